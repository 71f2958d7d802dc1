"""The systems of the agent-loop benchmark, each serving the same calls. Every one is timed by the
same streamer (CB by its own per-token timestamps on the same clock).

Systems, side by side on the same prompts (the prompts follow (a)'s outputs):

(a) plain     ``model.generate(ids, attention_mask=ones, max_new_tokens=16, do_sample=False)``.
(b) dyncache  transformers' "iterative generation": one ``DynamicCache(config=model.config)`` per
              conversation, passed in place to every call with the full ids
              (``model.generate(ids, attention_mask=ones, cache=dc, ...)``). Before a call the cache is
              cropped (``dc.crop(-n)``) to its longest common prefix with the new prompt, as a careful
              caller must when it switches branches.
(c) cb        transformers' continuous batching with prefix sharing: ``model.generate_batch([ids],
              generation_config=..., continuous_batching_config=ContinuousBatchingConfig(page_size=16,
              num_blocks=..., max_batch_tokens=..., allow_block_sharing=True), persistent_manager=True,
              record_timestamps=True)``, one manager per variant. On CPU the paged cache must be
              sized explicitly (by default it takes 90% of free RAM): it gets the same 1.5x rule
              (``Config.budget_factor``) as radixcache's interleaved pool.
(d) radixcache ``radixcache.wrap(model, block_size=16).generate(...)``, same arguments as (a); a fresh
              wrapper per variant (default pool in linear/branching, the interleaved budget of
              ``agent_loop_workload``).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from benchmarks.agent_loop_workload import Call, Config
from radixcache.tokens import common_prefix
from benchmarks.measure import timed_generate

CB_LOGGER = "ContinuousBatchingLogger"
PREFIX_MATCH = re.compile(r"Found a prefix match of (\d+) tokens for request (\S+)")


@dataclass
class Result:
    tokens: list
    total_s: float
    ttft_s: float
    last_s: float
    hit_tokens: int | None = None
    kv_bytes: int | None = None
    match: bool | None = None

    @property
    def decode_tps(self) -> float | None:
        n = len(self.tokens)
        span = self.last_s - self.ttft_s
        return (n - 1) / span if n > 1 and span > 0 else None


class System:
    key = "?"
    reuses_cache = False

    def __init__(self, model, cfg: Config):
        self.model = model
        self.cfg = cfg
        import torch

        self.torch = torch
        from radixcache.integrations.hf import kv_geometry
        from radixcache.kv.geometry import kv_bytes_per_token

        element = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
        self.bytes_per_token = kv_bytes_per_token(*kv_geometry(model.config), element)

    def begin(self, plan: dict) -> None:
        pass

    def generate(self, call: Call) -> Result:
        raise NotImplementedError

    def reserved_bytes(self) -> int | None:
        return None

    def hit_rate(self) -> float | None:
        return None

    def end(self) -> None:
        pass

    def _ids(self, prompt):
        return self.torch.tensor([prompt], dtype=self.torch.long)


class Plain(System):
    """(a) model.generate on the full prompt every call."""

    key = "a"

    def generate(self, call: Call) -> Result:
        ids = self._ids(call.prompt)
        with self.torch.no_grad():
            out, total, ttft, last = timed_generate(
                self.model.generate, ids, attention_mask=self.torch.ones_like(ids),
                max_new_tokens=self.cfg.new_tokens, do_sample=False)
        tokens = out[0, ids.shape[1]:].tolist()
        kv = (len(call.prompt) + len(tokens)) * self.bytes_per_token
        return Result(tokens, total, ttft, last, kv_bytes=kv)


class IterativeDynamicCache(System):
    """(b) one DynamicCache per conversation, passed in place with the full ids every turn."""

    key = "b"
    reuses_cache = True

    def begin(self, plan: dict) -> None:
        self.caches: dict[int, tuple] = {}  # conv -> (DynamicCache, tokens whose K/V it holds)

    def generate(self, call: Call) -> Result:
        from transformers import DynamicCache

        cache, held = self.caches.get(call.conv, (None, []))
        if cache is None:
            cache = DynamicCache(config=self.model.config)
        keep = min(common_prefix(held, call.prompt), len(call.prompt) - 1)
        length = cache.get_seq_length()
        if length > keep:
            cache.crop(keep - length)  # negative: drop that many tokens from the end
        reused = min(keep, length)
        ids = self._ids(call.prompt)
        with self.torch.no_grad():
            out, total, ttft, last = timed_generate(
                self.model.generate, ids, attention_mask=self.torch.ones_like(ids), cache=cache,
                max_new_tokens=self.cfg.new_tokens, do_sample=False)
        tokens = out[0, ids.shape[1]:].tolist()
        held = (call.prompt + tokens)[:cache.get_seq_length()]
        self.caches[call.conv] = (cache, held)
        return Result(tokens, total, ttft, last, hit_tokens=reused, kv_bytes=self._bytes())

    def _bytes(self) -> int:
        total = 0
        for cache, _ in self.caches.values():
            for layer in cache.layers:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, self.torch.Tensor):
                        total += t.numel() * t.element_size()
        return total

    def end(self) -> None:
        self.caches = {}


class _PrefixMatchLog(logging.Filter):
    """Counts CB's debug lines "Found a prefix match of N tokens" and keeps the console quiet."""

    def __init__(self):
        super().__init__()
        self.matches: dict[str, int] = {}
        self.errors: list[str] = []

    def filter(self, record) -> bool:
        message = record.getMessage()
        m = PREFIX_MATCH.search(message)
        if m:
            self.matches[m.group(2)] = int(m.group(1))
        if record.levelno >= logging.ERROR:
            self.errors.append(message.splitlines()[0][:300])
        return False  # the table reports what matters; CB's info/warning lines are noise here


class ContinuousBatching(System):
    """(c) transformers continuous batching, one persistent manager per variant."""

    key = "c"
    reuses_cache = True

    def begin(self, plan: dict) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        self.model.destroy_cached_continuous_batching_manager()
        bs = self.cfg.block_size
        self.num_blocks = plan["cb_blocks"]
        self.cb_config = ContinuousBatchingConfig(
            page_size=bs, num_blocks=self.num_blocks, max_batch_tokens=plan["max_batch_tokens"],
            allow_block_sharing=True, max_requests_per_batch=1)
        pad = self.model.generation_config.pad_token_id
        self.gen_config = GenerationConfig(max_new_tokens=self.cfg.new_tokens, do_sample=False,
                                           eos_token_id=-1, pad_token_id=pad if pad is not None else 0)
        self.log = _PrefixMatchLog()
        self.logger = logging.getLogger(CB_LOGGER)
        self._saved_level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addFilter(self.log)
        self.prompt_tokens = 0
        self.hits = 0
        # untimed: creates the manager and its paged cache; 3 + 1 tokens fill no block, cache nothing
        self._run(list(plan["warmup_prompt"]), max_new_tokens=1)
        manager = self.model.init_continuous_batching()  # returns the persistent manager
        self.cache = manager.batch_processor.cache
        if not self.cache.use_prefix_sharing:
            raise RuntimeError("continuous batching did not enable prefix sharing for this model")

    def _run(self, prompt, max_new_tokens=None):
        kwargs = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        before = len(self.log.errors)
        t0 = time.perf_counter()
        results = self.model.generate_batch([prompt], generation_config=self.gen_config,
                                            continuous_batching_config=self.cb_config,
                                            persistent_manager=True, record_timestamps=True, **kwargs)
        t1 = time.perf_counter()
        if len(results) != 1:
            reason = "; ".join(self.log.errors[before:]) or "no result returned"
            raise RuntimeError(f"generate_batch returned {len(results)} results: {reason}")
        request_id, out = next(iter(results.items()))
        if out.error is not None:
            raise RuntimeError(f"generate_batch failed: {out.error}")
        return request_id, out, t0, t1

    def generate(self, call: Call) -> Result:
        request_id, out, t0, t1 = self._run(call.prompt)
        stamps = out.timestamps or []
        if len(stamps) != len(out.generated_tokens) or not stamps:
            raise RuntimeError("generate_batch returned no per-token timestamps")
        hit = self.log.matches.pop(request_id, 0)
        self.prompt_tokens += len(call.prompt)
        self.hits += hit
        used = self.cache.num_sectors * self.cache.bytes_per_sector - int(
            self.cache.compute_free_capacity(relative=False))
        return Result(list(out.generated_tokens), t1 - t0, stamps[0] - t0, stamps[-1] - t0,
                      hit_tokens=hit, kv_bytes=used)

    def reserved_bytes(self) -> int | None:
        t = self.cache.cache_tensor
        return t.numel() * t.element_size()

    def hit_rate(self) -> float | None:
        return self.hits / self.prompt_tokens if self.prompt_tokens else None

    def end(self) -> None:
        try:
            self.model.destroy_cached_continuous_batching_manager()
        finally:
            logger = getattr(self, "logger", None)
            if logger is not None:
                logger.removeFilter(self.log)
                logger.setLevel(self._saved_level)
            self.cache = None


class Radix(System):
    """(d) radixcache.wrap(model).generate, a fresh wrapper (pool and tree) per variant."""

    key = "d"
    reuses_cache = True

    def begin(self, plan: dict) -> None:
        import radixcache

        self.lm = radixcache.wrap(self.model, block_size=self.cfg.block_size,
                                  max_cache_tokens=plan["rc_cache_tokens"])
        if self.lm.unsupported:
            raise RuntimeError(f"radixcache falls back to plain generate: {self.lm.unsupported}")
        # untimed first call (4 tokens fill no block, so nothing is cached); counters are diffed
        ids = self._ids(list(plan["warmup_prompt"]))
        self.lm.generate(ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=1,
                         do_sample=False)
        self.lm.reset_stats()

    def generate(self, call: Call) -> Result:
        ids = self._ids(call.prompt)
        out, total, ttft, last = timed_generate(
            self.lm.generate, ids, attention_mask=self.torch.ones_like(ids),
            max_new_tokens=self.cfg.new_tokens, do_sample=False, return_dict_in_generate=True)
        s = self.lm.stats()
        used = (s["capacity_tokens"] - s["free_tokens"]) * s["kv_bytes_per_token"]
        return Result(out.sequences[0, ids.shape[1]:].tolist(), total, ttft, last,
                      hit_tokens=out.cached_tokens[0], kv_bytes=used)

    def reserved_bytes(self) -> int | None:
        return self.lm.stats()["kv_pool_bytes"]

    def hit_rate(self) -> float | None:
        s = self.lm.stats()
        return s["hit_rate"] if s["queried_tokens"] else None

    def fallbacks(self) -> dict:
        s = self.lm.stats()
        return {"count": s["fallbacks"], "reasons": s["fallback_reasons"]}

    def end(self) -> None:
        lm = getattr(self, "lm", None)
        if lm is not None:
            lm.clear()
        self.lm = None


SYSTEM_CLASSES = {"a": Plain, "b": IterativeDynamicCache, "c": ContinuousBatching, "d": Radix}
