"""The engine's model runner for a transformers causal LM: one packed forward with a StepPlan."""

from __future__ import annotations

import functools

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from radixcache.attention.plan import Segment, StepPlan, device_tensor
from radixcache.engine.runner import ModelRunner
from radixcache.integrations.hf.cache import PagedCache, StepCache, compiled_step, forget_pending, hooked

# what transformers' generate hands a causal LM's forward that a packed step reproduces
PACKABLE = {"input_ids", "cache", "attention_mask", "position_ids", "use_cache", "return_dict",
            "logits_to_keep", "cache_position"}


class HFModelRunner(ModelRunner):
    """Runs ``model`` (switched to radixcache's attention by ``install``) on a ``[1, T]`` packed
    step: token ids, positions and the logits rows go to the device in one copy, and a
    ``StepCache`` routes every layer's K/V and attention through the plan. ``model_id`` roots the
    namespaces of the engine's requests (the wrapper updates it on ``invalidate``).

    A model whose attention does not reach the hook (``cache.hooked`` is False: Falcon) attends
    with its own masks over K/V a dense ``StepCache`` hands it, which cannot tell packed sequences
    apart: such a step runs one forward per segment, ``[1, q_len]`` each.

    ``compile()`` switches the packed steps to ``torch.compile(model.forward, dynamic=True)``: the
    step is planned before the graph runs and each layer's attention is one opaque op
    (``attention.paged_attention_op``, ``cache.compiled_step``); ``eager()`` switches back. The first steps of each shape
    class (one token, many; one logits row, many) compile; the wrapper runs them at start-up.
    While compiled, ``lm.generate``'s forwards run as the same packed steps (``forward_generate``):
    one compiled graph serves both paths.
    """

    def __init__(self, model, vocab_size: int, device: torch.device, model_id: str):
        self.model = model
        self.vocab_size = vocab_size
        self.device = device
        self.model_id = model_id
        self.compiled = None

    def compile(self) -> None:
        """Run the packed steps through ``torch.compile`` (compiled on their first calls). Its CPU
        kernels take the thread count of the thread that runs them (a server compiles on its
        main thread, serial, and steps on the scheduler's), not the one they were compiled on."""
        self.compiled = torch.compile(model_forward(self.model), dynamic=True,
                                      options={"cpp.dynamic_threads": True})
        route_generate_forwards(self.model)

    def eager(self) -> None:
        """Run the packed steps (and ``lm.generate``'s forwards) eagerly again."""
        self.compiled = None

    def forward_generate(self, cache: PagedCache, input_ids: torch.Tensor,
                         position_ids: torch.Tensor | None) -> CausalLMOutputWithPast:
        """One forward of ``lm.generate`` (``[B, n]`` new columns over ``cache``) as a packed step:
        the logits of each row's last column (``[B, 1, vocab]``, float32) and the cache."""
        tokens, positions, rows = cache.begin_packed(input_ids, position_ids)
        logits = self._run(tokens, positions, StepCache(cache.plan), rows)
        return CausalLMOutputWithPast(logits=logits[:, None], cache=cache)

    def forward(self, tokens: list, positions: list, plan: StepPlan, logits_rows: list) -> torch.Tensor:
        """See ``ModelRunner.forward``."""
        if not hooked(self.model):
            return self._per_segment(tokens, positions, plan, logits_rows)
        return self._run(tokens, positions, StepCache(plan), logits_rows)

    def _run(self, tokens: list, positions: list, cache: StepCache, logits_rows: list) -> torch.Tensor:
        t = len(tokens)
        packed = device_tensor(tokens + positions + logits_rows, self.device)
        inputs = dict(input_ids=packed[:t][None], position_ids=packed[t:2 * t][None], cache=cache,
                      use_cache=True, logits_to_keep=packed[2 * t:])
        try:
            with torch.no_grad():
                if self.compiled is not None and not cache.dense:
                    cache.begin_forward(1, t)
                    with compiled_step(cache):
                        out = self.compiled(**inputs)
                else:
                    out = self.model(**inputs)
        finally:
            forget_pending()
        return out.logits[0].float()

    def _per_segment(self, tokens: list, positions: list, plan: StepPlan, logits_rows: list):
        """One dense forward per segment; the logits rows gathered back in ``logits_rows`` order."""
        found: dict = {}
        for seg in plan.segments:
            lo, hi = seg.q_start, seg.q_start + seg.q_len
            mine = [r for r in logits_rows if lo <= r < hi]
            one = StepPlan(plan.pool, [Segment(0, seg.q_len, seg.kv_len, seg.blocks)], plan.backend)
            logits = self._run(tokens[lo:hi], positions[lo:hi], StepCache(one, dense=True),
                               [r - lo for r in mine] or [seg.q_len - 1])
            found.update(zip(mine, logits))
        return torch.stack([found[r] for r in logits_rows])


def model_forward(model):
    """``model.forward`` as the model has it (not ``route_generate_forwards``' router)."""
    return getattr(model.forward, "radixcache_own_forward", model.forward)


def route_generate_forwards(model) -> None:
    """Make ``model``'s forwards that carry a ``PagedCache`` of a wrapper whose runner is compiled
    (and only what transformers' generate hands a causal LM: ``PACKABLE``, one logits row) run
    through that runner's ``forward_generate``; every other forward (plain ``generate``, an eager
    wrapper, a dense cache) runs the model's own. Idempotent; the model's signature is kept
    (transformers reads it)."""
    if hasattr(model.forward, "radixcache_own_forward"):
        return
    own = model.forward

    @functools.wraps(own)
    def forward(*args, **kwargs):
        cache = kwargs.get("cache")
        if not args and isinstance(cache, PagedCache) and not cache.dense \
                and cache.owner.runner.compiled is not None and kwargs.keys() <= PACKABLE \
                and kwargs.get("logits_to_keep") in (None, 1) and kwargs.get("return_dict", True):
            return cache.owner.runner.forward_generate(cache, kwargs["input_ids"], kwargs.get("position_ids"))
        return own(*args, **kwargs)

    forward.radixcache_own_forward = own
    model.forward = forward
