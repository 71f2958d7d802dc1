"""Grammar-constrained sampling inside a step: per-sample matchers and one batched token mask.

A request's ``constraint`` is an ``xgrammar.CompiledGrammar`` (compiled elsewhere, off the
scheduler thread: the engine only uses it). Each sample of such a request gets its own
``GrammarMatcher`` (``new_matcher``). In a step, ``mask_rows`` fills the bitmask of every
constrained row in one batched call and sets the logits of the tokens each grammar forbids to
``-inf`` in place, for those rows only (``indices``), on the logits' own device; free rows of the
same batch are untouched. After the tokens are chosen, ``advance`` moves each matcher on.

xgrammar is imported only when a constrained request arrives, so the engine runs without it.
"""

from __future__ import annotations

import torch

# xgrammar's Linux x86_64 wheel requires triton (about 1 GB) for its CUDA kernels only: on a CPU
# the two packages it runs on are enough
XGRAMMAR_INSTALL = ("pip install xgrammar==0.2.9 (on a machine without CUDA, without its unused triton: "
                    "pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2)")


def _xgrammar():
    try:
        import xgrammar
    except ImportError:  # pragma: no cover - exercised only where xgrammar is missing
        raise ValueError(f"constrained requests need xgrammar: {XGRAMMAR_INSTALL}") from None
    return xgrammar


def validate_constraint(constraint, vocab_size: int, what: str) -> None:
    """``TypeError`` when ``constraint`` is not an ``xgrammar.CompiledGrammar``, ``ValueError``
    when it was compiled for another vocabulary size than the model's ``vocab_size``."""
    xgr = _xgrammar()
    if not isinstance(constraint, xgr.CompiledGrammar):
        raise TypeError(f"{what}: constraint must be an xgrammar.CompiledGrammar, got "
                        f"{type(constraint).__name__}")
    size = constraint.tokenizer_info.vocab_size
    if size != vocab_size:
        raise ValueError(f"{what}: the constraint was compiled for a vocabulary of {size} tokens, "
                         f"the model has {vocab_size}")


def new_matcher(constraint):
    """A fresh matcher of ``constraint`` for one sample (at the start of its generation)."""
    return _xgrammar().GrammarMatcher(constraint)


class GrammarMasks:
    """The bitmask buffer and batch filler one engine reuses from step to step."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._bitmask: torch.Tensor | None = None
        self._filler = None

    def mask_rows(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """Set ``logits[rows[i], t]`` to ``-inf`` for every token ``t`` that ``matchers[i]`` forbids
        next (in place; rows not in ``rows`` are left as they are)."""
        xgr = _xgrammar()
        batch = logits.shape[0]
        if self._bitmask is None or self._bitmask.shape[0] < batch:
            self._bitmask = xgr.allocate_token_bitmask(max(batch, 16), self.vocab_size)
            self._filler = xgr.BatchGrammarMatcher(max_threads=1)
        bitmask = self._bitmask[:batch]
        self._filler.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


def accept(matcher, token: int) -> bool:
    """Advance ``matcher`` by the chosen ``token``; False when its grammar forbids it."""
    return bool(matcher.accept_token(token))


def advance(matcher, token: int) -> bool | None:
    """Advance ``matcher`` by ``token``: True when its grammar has ended (its stop token), None when
    it refuses ``token`` (the mask makes that impossible; the engine then ends the sample with an
    error rather than go on off the grammar)."""
    if not accept(matcher, token):
        return None
    return bool(matcher.is_terminated())
