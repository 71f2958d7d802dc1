"""Weight-only quantization of a loaded model, and how far its greedy tokens still agree.

``quantize_weights(model, "int8")`` replaces every ``nn.Linear`` weight by int8 with one scale per
output channel (torchao's ``Int8WeightOnlyConfig``, in place; activations and the KV cache keep the
model's dtype) and measures what that costs in tokens: greedy ``generate`` on a fixed probe prompt
before and after, and how many leading tokens agree. Quantization changes tokens, so it is never a
default. On a CPU it pays only with a compiled step (``wrap(..., compile=True)``, ``serve
--compile``): torchao's eager int8 matmul is slower than the float one.

torch and torchao are imported inside the functions that need them.
"""

from __future__ import annotations

from typing import NamedTuple

SCHEMES = ("int8",)
PROBE_PROMPT = 48  # tokens of the probe prompt
PROBE_NEW = 32  # greedy tokens compared
INSTALL = "pip install torchao (radixcache's [quantize] extra)"


class QuantizeReport(NamedTuple):
    """``scheme`` applied; ``agreeing`` of the ``probe_tokens`` greedy tokens on the probe prompt
    equal the unquantized model's before the first that differs; ``weights`` Linear layers changed."""

    scheme: str
    agreeing: int
    probe_tokens: int
    weights: int

    def describe(self) -> str:
        """One line for a log: what was done and the greedy agreement it left."""
        return (f"{self.scheme} weight-only (torchao, {self.weights} linear layers); greedy agrees with the "
                f"unquantized model on the first {self.agreeing} of {self.probe_tokens} probe tokens")


def probe_prompt(model) -> list:
    """A fixed prompt of ``PROBE_PROMPT`` ordinary token ids (the same on every run)."""
    vocab = model.get_input_embeddings().num_embeddings
    low = 100 if vocab > 1000 else 1
    return [low + (i * 7919) % (vocab - low) for i in range(PROBE_PROMPT)]


def _greedy(model, prompt: list) -> list:
    import torch

    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=PROBE_NEW,
                             min_new_tokens=PROBE_NEW, do_sample=False,
                             pad_token_id=model.generation_config.pad_token_id or 0)
    return out[0, len(prompt):].tolist()


def quantize_weights(model, scheme: str) -> QuantizeReport:
    """Quantize ``model``'s Linear weights to ``scheme`` in place and report the greedy agreement.
    ``ValueError`` for an unknown scheme, ``ImportError`` naming the install line without torchao,
    both before the model is touched."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError as e:
        raise ImportError(f"--quantize {scheme} needs torchao: {INSTALL}") from e
    import torch

    prompt = probe_prompt(model)
    before = _greedy(model, prompt)
    weights = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    quantize_(model, Int8WeightOnlyConfig())
    after = _greedy(model, prompt)
    agreeing = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), len(before))
    return QuantizeReport(scheme, agreeing, len(before), weights)
