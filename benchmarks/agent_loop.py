#!/usr/bin/env python
"""Agent-loop benchmark: TTFT, decode speed, time and KV memory of multi-turn generation.

Model: the embedded SmolLM2-135M-Instruct (``radixcache.models.load_model``), fp32, on CPU, greedy,
exactly ``new_tokens`` generated per call (the model's EOS is disabled for the run so every system
generates the same number of tokens).

Workload (token-id level; random but fixed-seed token ids, drawn from the vocabulary minus the
tokenizer's special ids, so no text is tokenized): a 1,500-token system prompt; every turn appends a
fresh 60-token "user text" to the history and generates 16 tokens; the next prompt is the previous
prompt + the generated tokens + the next user text. Three variants:

linear       one conversation of 8 turns.
branching    8 turns; each turn is tried twice from the same history with two different user texts
             (both generated, one after the other); the conversation continues from the first try on
             odd turns and from the second on even turns.
interleaved  8 conversations sharing the system prompt, served round robin turn by turn, 3 turns
             each (fewer than 8 so that (a), which re-prefills ~1,600 tokens on each of its 24 calls,
             fits the run's time budget). radixcache gets a pool (``max_cache_tokens``) of 1.5x the
             tokens the 8 conversations need when they share the system prompt: it can hold all of
             them once, never twice (held unshared they would need several times more).

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
              sized explicitly (by default it takes 90% of free RAM): it gets the same 1.5x rule.
(d) radixcache ``radixcache.wrap(model, block_size=16).generate(...)``, same arguments as (a); a fresh
              wrapper per variant (default pool in linear/branching, the budget above in interleaved).

Measurements, per call:
- TTFT: wall time from the call to the first generated token, the same way for every system: (a),
  (b), (d) pass a streamer that timestamps each token as ``generate`` emits it; (c) records per-token
  timestamps itself (``record_timestamps=True``) on the same clock (``time.perf_counter``).
- decode tokens/s: (generated tokens - 1) / (time of the last token - time of the first token).
- total: wall time of the calls. For (c) each ``generate_batch`` call also starts and stops the
  manager's thread (the stop polls every 0.1 s); "to last tok" sums call start -> last token instead.
- peak KV memory, sampled after each call: (a) the largest per-call cache, (prompt + generated)
  tokens x KV bytes per token; (b) the bytes of every key/value tensor of every live DynamicCache;
  (c) the paged cache's used bytes (its size minus ``compute_free_capacity(relative=False)``);
  (d) used blocks x block_size x ``kv_bytes_per_token`` from ``stats()``. "reserved" is the size of
  the preallocated pool of (c) and (d) (radixcache's is allocated lazily and costs nothing untouched).
- hit rate: prompt tokens served from cache / prompt tokens. (d): ``stats()`` counters; (c): CB keeps
  no counter, it only logs "Found a prefix match of N tokens" at debug level, which is counted here.
- greedy equality: the tokens of (b), (c), (d) are compared with (a)'s, call by call.

Summaries are medians over calls ("hit" calls are those where radixcache reused a cached prefix).
Nothing asserts on timings; the ``met?`` column only compares against the issue's targets.

Cost: (a) takes ~4.5 s of one core per 1,560-token prefill and ~0.1 s per decode step at ~2k tokens;
the full run used 661 s of CPU with one thread (about 6-9 minutes of wall time on 2 quiet cores with
``--threads 2``); ``--quick`` about a sixth of that.

    python benchmarks/agent_loop.py [--quick] [--json PATH] [--threads N]
                                    [--variants linear,branching,interleaved] [--skip-cb]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import platform
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import fmt, median  # noqa: E402

# torch and transformers are imported after --threads has been applied (see main).

HEADER = "radixcache agent_loop benchmark"
VARIANTS = ("linear", "branching", "interleaved")
SYSTEMS = ("a", "b", "c", "d")
SYSTEM_NAMES = {"a": "plain", "b": "dyncache", "c": "cb", "d": "radixcache"}
SYSTEM_HELP = {
    "a": "plain model.generate (attention_mask of ones, no cache kept)",
    "b": "one DynamicCache per conversation reused in place (transformers iterative generation)",
    "c": "transformers continuous batching, generate_batch(persistent_manager=True), page_size 16, "
         "prefix sharing",
    "d": "radixcache.wrap(model, block_size=16).generate",
}
TARGETS = {"ttft_vs_b": 1.15, "ttft_below_a": 8.0, "decode_vs_a": 0.9}
# Why a baseline can hold less KV than any cache that keeps what it computed (printed with the target).
MEMORY_NOTES = {
    ("branching", "a"): "(a) holds one call's KV, only during the call",
    ("interleaved", "a"): "(a) holds one call's KV, only during the call",
    ("branching", "b"): "(b) crops back to one branch, so it keeps one sequence",
    ("branching", "c"): "(c) keeps the same shared blocks",
    ("interleaved", "c"): "(c) keeps the same shared blocks",
}
CB_LOGGER = "ContinuousBatchingLogger"
PREFIX_MATCH = re.compile(r"Found a prefix match of (\d+) tokens for request (\S+)")


@dataclass(frozen=True)
class Config:
    """Sizes of one run. ``budget_factor`` sizes the interleaved radixcache pool and every CB pool."""

    system_tokens: int = 1500
    user_tokens: int = 60
    new_tokens: int = 16
    linear_turns: int = 8
    branching_turns: int = 8
    branches: int = 2
    conversations: int = 8
    interleaved_turns: int = 3
    block_size: int = 16
    budget_factor: float = 1.5
    seed: int = 0


FULL = Config()
QUICK = Config(system_tokens=300, linear_turns=3, branching_turns=3, conversations=2,
               interleaved_turns=3)


# --------------------------------------------------------------------------- workload
@dataclass
class Call:
    """One generate call of a script: its label, conversation and full prompt (token ids)."""

    label: str
    conv: int
    prompt: list


class Workload:
    """Seeded random token ids: the shared system prompt and a fresh user text on each request."""

    def __init__(self, cfg: Config, vocab_size: int, special_ids, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed)
        special = set(special_ids)
        self.low = max(special) + 1 if special and max(special) < vocab_size // 2 else 0
        self.vocab_size = vocab_size
        self.special = special
        self.system = self.ids(cfg.system_tokens)

    def ids(self, n: int) -> list:
        out = []
        while len(out) < n:
            t = self.rng.randrange(self.low, self.vocab_size)
            if t not in self.special:
                out.append(t)
        return out

    def user(self) -> list:
        return self.ids(self.cfg.user_tokens)


def linear_script(cfg: Config, w: Workload):
    prompt = w.system + w.user()
    for t in range(1, cfg.linear_turns + 1):
        generated = yield Call(str(t), 0, prompt)
        prompt = prompt + generated + w.user()


def branching_script(cfg: Config, w: Workload):
    history = list(w.system)
    for t in range(1, cfg.branching_turns + 1):
        keep = (t - 1) % cfg.branches
        kept = None
        for k in range(cfg.branches):
            prompt = history + w.user()
            generated = yield Call(f"{t}{'abcdefghij'[k]}", 0, prompt)
            if k == keep:
                kept = prompt + generated
        history = kept


def interleaved_script(cfg: Config, w: Workload):
    histories = [list(w.system) for _ in range(cfg.conversations)]
    for t in range(1, cfg.interleaved_turns + 1):
        for c in range(cfg.conversations):
            prompt = histories[c] + w.user()
            generated = yield Call(f"c{c + 1}t{t}", c, prompt)
            histories[c] = prompt + generated


SCRIPTS = {"linear": linear_script, "branching": branching_script, "interleaved": interleaved_script}


def unique_tokens(sequences) -> int:
    """Tokens of the trie holding every sequence (shared prefixes counted once)."""
    seqs = sorted(tuple(s) for s in sequences)
    total, prev = 0, ()
    for s in seqs:
        total += len(s) - common_prefix(s, prev)
        prev = s
    return total


def common_prefix(x, y) -> int:
    n = min(len(x), len(y))
    i = 0
    while i < n and x[i] == y[i]:
        i += 1
    return i


def describe_variant(name: str, cfg: Config) -> str:
    if name == "linear":
        return (f"1 conversation x {cfg.linear_turns} turns")
    if name == "branching":
        return (f"{cfg.branching_turns} turns x {cfg.branches} tries from the same history "
                "(continues from try a on odd turns, b on even turns)")
    fewer = (f" (fewer turns than linear's {cfg.linear_turns}: (a) re-prefills every prompt in full)"
             if cfg.interleaved_turns < cfg.linear_turns else "")
    return (f"{cfg.conversations} conversations x {cfg.interleaved_turns} turns{fewer}, round robin, "
            "one shared system prompt")


# --------------------------------------------------------------------------- measurement
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


class TokenTimes:
    """A generate() streamer that timestamps every generated token (the first put is the prompt)."""

    def __init__(self):
        self.puts = 0
        self.times: list[float] = []

    def put(self, value) -> None:
        if self.puts:
            self.times.append(time.perf_counter())
        self.puts += 1

    def end(self) -> None:
        pass


def timed_generate(fn, ids, **kwargs) -> tuple:
    """Run ``fn(ids, streamer=..., **kwargs)``; return (output, total, ttft, last token) in seconds."""
    streamer = TokenTimes()
    t0 = time.perf_counter()
    out = fn(ids, streamer=streamer, **kwargs)
    t1 = time.perf_counter()
    if not streamer.times:
        raise RuntimeError("the streamer saw no generated token")
    return out, t1 - t0, streamer.times[0] - t0, streamer.times[-1] - t0


# --------------------------------------------------------------------------- systems
class System:
    key = "?"
    reuses_cache = False

    def __init__(self, model, cfg: Config):
        self.model = model
        self.cfg = cfg
        import torch

        self.torch = torch
        from radixcache.integrations.hf import kv_geometry

        layers, kv_heads, head_dim = kv_geometry(model.config)
        element = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * element

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
        self.start = self.lm.stats()

    def generate(self, call: Call) -> Result:
        before = self.lm.stats()["hit_tokens"]
        ids = self._ids(call.prompt)
        out, total, ttft, last = timed_generate(
            self.lm.generate, ids, attention_mask=self.torch.ones_like(ids),
            max_new_tokens=self.cfg.new_tokens, do_sample=False)
        s = self.lm.stats()
        used = (s["capacity_tokens"] - s["free_tokens"]) * s["kv_bytes_per_token"]
        return Result(out[0, ids.shape[1]:].tolist(), total, ttft, last,
                      hit_tokens=s["hit_tokens"] - before, kv_bytes=used)

    def reserved_bytes(self) -> int | None:
        return self.lm.stats()["kv_pool_bytes"]

    def hit_rate(self) -> float | None:
        s = self.lm.stats()
        queried = s["prompt_tokens"] - self.start["prompt_tokens"]
        return (s["hit_tokens"] - self.start["hit_tokens"]) / queried if queried else None

    def fallbacks(self) -> dict:
        s = self.lm.stats()
        return {"count": s["fallbacks"] - self.start["fallbacks"], "reasons": s["fallback_reasons"]}

    def end(self) -> None:
        lm = getattr(self, "lm", None)
        if lm is not None:
            lm.clear()
        self.lm = None


SYSTEM_CLASSES = {"a": Plain, "b": IterativeDynamicCache, "c": ContinuousBatching, "d": Radix}


# --------------------------------------------------------------------------- one variant
@dataclass
class SystemRun:
    key: str
    status: str = "ok"  # "ok", "skipped: why" or "failed: why"
    results: list = field(default_factory=list)
    reserved_bytes: int | None = None
    hit_rate: float | None = None
    extra: dict = field(default_factory=dict)


def ceil_to(n: float, m: int) -> int:
    return int(math.ceil(n / m)) * m


def plan_variant(name: str, cfg: Config, calls: list, outputs: list) -> dict:
    """Pool sizes once (a) has fixed the prompts: what the variant needs when prefixes are shared."""
    bs = cfg.block_size
    sequences = [c.prompt + out for c, out in zip(calls, outputs)]
    need = unique_tokens(sequences)
    longest = max(len(s) for s in sequences)
    budget = ceil_to(cfg.budget_factor * need, bs)
    unshared = sum(max(len(s) for s, c in zip(sequences, calls) if c.conv == conv)
                   for conv in {c.conv for c in calls})
    return {
        "need_tokens": need,
        "unshared_tokens": unshared,
        "longest_sequence": longest,
        "rc_cache_tokens": budget if name == "interleaved" else None,
        "cb_blocks": budget // bs,
        "max_batch_tokens": ceil_to(max(len(c.prompt) for c in calls), 256),
    }


def run_variant(name: str, cfg: Config, model, workload_args: tuple, keys, log,
                skip_reasons: dict) -> dict:
    vocab_size, special_ids = workload_args
    w = Workload(cfg, vocab_size, special_ids, seed=cfg.seed * 1000 + VARIANTS.index(name))
    warmup = w.ids(3)
    script = SCRIPTS[name](cfg, w)
    runs = {k: SystemRun(k) for k in SYSTEMS}

    # (a) drives the script: its outputs fix every later prompt
    plain = Plain(model, cfg)
    calls, outputs = [], []
    call = next(script)
    while True:
        res = plain.generate(call)
        calls.append(call)
        outputs.append(res.tokens)
        runs["a"].results.append(res)
        log(f"  {name} (a) plain {call.label}: prompt {len(call.prompt)}, TTFT {res.ttft_s * 1e3:.0f} ms")
        try:
            call = script.send(res.tokens)
        except StopIteration:
            break
    plan = plan_variant(name, cfg, calls, outputs)
    plan["warmup_prompt"] = warmup

    for key in ("b", "c", "d"):
        run = runs[key]
        if key not in keys:
            run.status = "skipped: " + skip_reasons.get(key, "not selected")
            continue
        system = None
        try:
            system = SYSTEM_CLASSES[key](model, cfg)
            system.begin(plan)
            for call, want in zip(calls, outputs):
                res = system.generate(call)
                res.match = res.tokens == want
                run.results.append(res)
                log(f"  {name} ({key}) {SYSTEM_NAMES[key]} {call.label}: TTFT {res.ttft_s * 1e3:.0f} ms"
                    + ("" if res.match else "  [tokens differ from (a)]"))
            run.reserved_bytes = system.reserved_bytes()
            run.hit_rate = system.hit_rate()
            if isinstance(system, Radix):
                run.extra["fallbacks"] = system.fallbacks()
        except Exception as e:  # noqa: BLE001 - a broken baseline is reported in the table
            run.status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log(f"  {name} ({key}) {run.status}")
        finally:
            if system is not None:
                try:
                    system.end()
                except Exception as e:  # noqa: BLE001
                    log(f"  {name} ({key}) cleanup failed: {type(e).__name__}: {e}")
            gc.collect()
    return {"name": name, "description": describe_variant(name, cfg), "plan": plan,
            "calls": [{"label": c.label, "conv": c.conv, "prompt_len": len(c.prompt)} for c in calls],
            "runs": runs}


# --------------------------------------------------------------------------- summaries
def hit_call_indices(variant: dict) -> list[int]:
    """Calls on which radixcache reused a prefix (or, if it did not run, every call after the first
    of its conversation)."""
    d = variant["runs"]["d"]
    if d.status == "ok" and d.results:
        return [i for i, r in enumerate(d.results) if r.hit_tokens]
    seen, out = set(), []
    for i, c in enumerate(variant["calls"]):
        if c["conv"] in seen:
            out.append(i)
        seen.add(c["conv"])
    return out


def summarize(variant: dict) -> dict:
    hits = set(hit_call_indices(variant))
    out = {}
    for key, run in variant["runs"].items():
        if run.status != "ok" or not run.results:
            out[key] = {"status": run.status}
            continue
        rs = run.results
        matches = [r.match for r in rs if r.match is not None]
        out[key] = {
            "status": "ok",
            "ttft_hit_s": median([r.ttft_s for i, r in enumerate(rs) if i in hits]),
            "ttft_miss_s": median([r.ttft_s for i, r in enumerate(rs) if i not in hits]),
            "decode_tps": median([r.decode_tps for r in rs]),
            "total_s": sum(r.total_s for r in rs),
            "to_last_token_s": sum(r.last_s for r in rs),
            "peak_kv_bytes": max(r.kv_bytes for r in rs),
            "reserved_bytes": run.reserved_bytes,
            "hit_rate": run.hit_rate,
            "matches": sum(matches) if key != "a" else None,
            "calls": len(rs),
        }
    return out


def targets(name: str, summary: dict) -> list[dict]:
    rows = []
    d = summary.get("d", {})
    if d.get("status") != "ok":
        return [{"variant": name, "target": "radixcache targets", "value": None, "reference": None,
                 "ratio": None, "met": None, "note": d.get("status", "not run")}]

    def ok(key):
        return summary.get(key, {}).get("status") == "ok"

    def add(target, value, reference, ratio, met, note=""):
        rows.append({"variant": name, "target": target, "value": value, "reference": reference,
                     "ratio": ratio, "met": met, "note": note})

    if d["ttft_hit_s"] is not None:
        if ok("b") and summary["b"]["ttft_hit_s"]:
            r = d["ttft_hit_s"] / summary["b"]["ttft_hit_s"]
            add(f"TTFT on hit <= {TARGETS['ttft_vs_b']}x (b)", d["ttft_hit_s"], summary["b"]["ttft_hit_s"],
                r, r <= TARGETS["ttft_vs_b"])
        if ok("a") and summary["a"]["ttft_hit_s"]:
            r = summary["a"]["ttft_hit_s"] / d["ttft_hit_s"]
            add(f"TTFT on hit >= {TARGETS['ttft_below_a']:.0f}x below (a)", d["ttft_hit_s"],
                summary["a"]["ttft_hit_s"], r, r >= TARGETS["ttft_below_a"])
    if ok("a") and d["decode_tps"] and summary["a"]["decode_tps"]:
        r = d["decode_tps"] / summary["a"]["decode_tps"]
        add(f"decode tok/s >= {TARGETS['decode_vs_a']}x (a)", d["decode_tps"], summary["a"]["decode_tps"],
            r, r >= TARGETS["decode_vs_a"])
    if name in ("branching", "interleaved"):
        baselines = [k for k in ("a", "b", "c") if ok(k)]
        missing = [f"({k}) {summary[k]['status'].split(':')[0]}" for k in ("a", "b", "c") if not ok(k)]
        note = ("not compared: " + ", ".join(missing)) if missing else ""
        for metric, label in (("total_s", "total time"), ("peak_kv_bytes", "peak KV memory")):
            if not baselines:
                continue
            best = min(baselines, key=lambda k: summary[k][metric])
            ref = summary[best][metric]
            why = MEMORY_NOTES.get((name, best), "") if metric == "peak_kv_bytes" else ""
            if metric == "total_s":
                # the same comparison on call start -> last token (leaves out (c)'s manager stop)
                alt = min(baselines, key=lambda k: summary[k]["to_last_token_s"])
                alt_ref = summary[alt]["to_last_token_s"]
                if (d["to_last_token_s"] < alt_ref) != (d[metric] < ref):
                    why = (f"to last token instead: {d['to_last_token_s']:.2f} s vs "
                           f"{alt_ref:.2f} s ({alt}), {'met' if d['to_last_token_s'] < alt_ref else 'missed'}")
            add(f"{label} < every baseline (best: {best})", d[metric], ref,
                d[metric] / ref if ref else None, d[metric] < ref, "; ".join(x for x in (why, note) if x))
    return rows


# --------------------------------------------------------------------------- report
def render(columns, rows, left=(0,)) -> str:
    cells = [tuple(columns)] + [tuple(r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def call_table(variant: dict) -> str:
    runs = variant["runs"]
    columns = (["call", "prompt"] + [f"TTFT ms {k}" for k in SYSTEMS] + [f"tok/s {k}" for k in SYSTEMS]
               + ["hit c", "hit d", "= a? b c d"])
    rows = []
    for i, c in enumerate(variant["calls"]):
        def get(key, attr, spec):
            run = runs[key]
            if run.status != "ok" or i >= len(run.results):
                return "-"
            value = getattr(run.results[i], attr)
            return fmt(value * 1e3 if attr == "ttft_s" else value, spec)

        same = []
        for key in ("b", "c", "d"):
            run = runs[key]
            if run.status != "ok" or i >= len(run.results):
                same.append("-")
            else:
                same.append("y" if run.results[i].match else "N")
        rows.append([c["label"], str(c["prompt_len"])]
                    + [get(k, "ttft_s", ".0f") for k in SYSTEMS]
                    + [get(k, "decode_tps", ".1f") for k in SYSTEMS]
                    + [get("c", "hit_tokens", "d"), get("d", "hit_tokens", "d"), " ".join(same)])
    return render(columns, rows)


def summary_table(variants: list) -> str:
    columns = ("variant", "system", "TTFT hit ms", "TTFT miss ms", "decode tok/s", "total s",
               "to last tok s", "peak KV MiB", "reserved MiB", "hit rate", "greedy = (a)", "status")
    rows = []
    for v in variants:
        for key in SYSTEMS:
            s = v["summary"][key]
            label = f"({key}) {SYSTEM_NAMES[key]}"
            if s["status"] != "ok":
                rows.append([v["name"], label] + ["-"] * (len(columns) - 3) + [s["status"]])
                continue
            rows.append([v["name"], label, fmt(s["ttft_hit_s"] and s["ttft_hit_s"] * 1e3, ".0f"),
                         fmt(s["ttft_miss_s"] and s["ttft_miss_s"] * 1e3, ".0f"),
                         fmt(s["decode_tps"], ".1f"), fmt(s["total_s"], ".2f"),
                         fmt(s["to_last_token_s"], ".2f"), mib(s["peak_kv_bytes"]),
                         mib(s["reserved_bytes"]), fmt(s["hit_rate"], ".1%"),
                         "-" if s["matches"] is None else f"{s['matches']}/{s['calls']}", "ok"])
    return render(columns, rows, left=(0, 1, len(columns) - 1))


def show_target_value(target: str, x) -> str:
    """A target's value in its own unit: ms for TTFT, tok/s, MiB for memory, s for time."""
    if x is None:
        return "-"
    if "TTFT" in target:
        return f"{x * 1e3:.0f} ms"
    if "tok/s" in target:
        return f"{x:.1f} tok/s"
    if "memory" in target:
        return f"{mib(x)} MiB"
    return f"{x:.2f} s"


def target_table(rows: list) -> str:
    columns = ("variant", "target", "radixcache", "reference", "ratio", "met?", "note")
    out = []
    for r in rows:
        out.append([r["variant"], r["target"], show_target_value(r["target"], r["value"]),
                    show_target_value(r["target"], r["reference"]), fmt(r["ratio"], ".2f"),
                    "-" if r["met"] is None else ("yes" if r["met"] else "NO"), r["note"]])
    return render(columns, out, left=(0, 1, 6))


def to_json(variant: dict) -> dict:
    runs = {}
    for key, run in variant["runs"].items():
        runs[key] = {"system": SYSTEM_NAMES[key], "status": run.status, "reserved_bytes": run.reserved_bytes,
                     "hit_rate": run.hit_rate, "extra": run.extra,
                     "calls": [dict(asdict(r), decode_tps=r.decode_tps) for r in run.results]}
    plan = {k: v for k, v in variant["plan"].items() if k != "warmup_prompt"}
    return {"name": variant["name"], "description": variant["description"], "plan": plan,
            "elapsed_s": variant["elapsed_s"], "cpu_s": variant["cpu_s"],
            "calls": variant["calls"], "runs": runs, "summary": variant["summary"],
            "targets": variant["targets"]}


# --------------------------------------------------------------------------- driver
def prepare_model(model, tokenizer=None):
    """Greedy, fixed-length generation: disable EOS, make sure a pad id exists."""
    gc_ = model.generation_config
    if gc_.pad_token_id is None:
        eos = gc_.eos_token_id
        gc_.pad_token_id = (eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0
    gc_.eos_token_id = None
    special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(model.config, name, None)
        if isinstance(value, int):
            special.add(value)
    special.add(gc_.pad_token_id)
    return model.get_input_embeddings().num_embeddings, sorted(special)


def run_benchmark(cfg: Config, model, tokenizer=None, variants=VARIANTS, skip_cb: bool = False,
                  log=None) -> list[dict]:
    """Run the selected variants on ``model``; return one dict per variant (see ``to_json``)."""
    log = log or (lambda msg: None)
    import torch

    workload_args = prepare_model(model, tokenizer)
    keys = set(SYSTEMS)
    skip = {}
    if skip_cb:
        keys.discard("c")
        skip["c"] = "--skip-cb"
    elif not hasattr(model, "generate_batch"):
        keys.discard("c")
        skip["c"] = "this transformers has no generate_batch"
    # untimed warm-up of the model's kernels
    with torch.no_grad():
        ids = torch.tensor([list(range(workload_args[1][-1] + 1, workload_args[1][-1] + 33))])
        ids = ids.clamp(max=workload_args[0] - 1)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    out = []
    for name in variants:
        log(f"variant {name} ...")
        started, cpu = time.perf_counter(), time.process_time()
        v = run_variant(name, cfg, model, workload_args, keys, log, skip)
        v["elapsed_s"] = time.perf_counter() - started
        v["cpu_s"] = time.process_time() - cpu
        v["summary"] = summarize(v)
        v["targets"] = targets(name, v["summary"])
        out.append(v)
    return out


def report(cfg: Config, results: list, header_lines: list, print_=print) -> None:
    print_(f"{HEADER}: multi-turn generation, (a) plain vs (b) DynamicCache vs (c) CB vs (d) radixcache")
    for line in header_lines:
        print_(line)
    for key in SYSTEMS:
        print_(f"  ({key}) {SYSTEM_NAMES[key]}: {SYSTEM_HELP[key]}")
    for v in results:
        p = v["plan"]
        print_()
        print_(f"[{v['name']}] {v['description']}; {len(v['calls'])} calls, {v['elapsed_s']:.0f} s wall, "
               f"{v['cpu_s']:.0f} s CPU")
        pool = (f"radixcache max_cache_tokens={p['rc_cache_tokens']} ({cfg.budget_factor}x needed)"
                if p["rc_cache_tokens"] else "radixcache default pool")
        print_(f"  tokens needed with shared prefixes: {p['need_tokens']} (unshared: {p['unshared_tokens']}); "
               f"{pool}; CB num_blocks={p['cb_blocks']} x {cfg.block_size}, "
               f"max_batch_tokens={p['max_batch_tokens']}")
        a0 = v["runs"]["a"].results[0]
        print_(f"  (a) first call: prefill of {v['calls'][0]['prompt_len']} tokens + first token "
               f"in {a0.ttft_s:.2f} s")
        print_(call_table(v))
    print_()
    print_("summary (medians over calls; 'hit' = calls where radixcache reused a cached prefix)")
    print_(summary_table(results))
    print_()
    rows = [r for v in results for r in v["targets"]]
    print_("targets")
    print_(target_table(rows))
    notes = []
    for v in results:
        fb = v["runs"]["d"].extra.get("fallbacks")
        if fb and fb["count"]:
            notes.append(f"{v['name']}: radixcache fell back to plain generate {fb['count']} times "
                         f"({fb['reasons']})")
    for n in notes:
        print_("note: " + n)
    print_()
    print_("TTFT: call start -> first generated token (streamer timestamps for a/b/d, CB's own "
           "record_timestamps for c). decode tok/s: (tokens - 1) / (last token - first token).")
    print_("total s: wall time of the calls; to last tok s: sum of call start -> last token (excludes "
           "CB's per-call manager stop). peak KV: sampled after each call (see the module docstring).")


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def main(argv=None, load_model=None, config: Config | None = None) -> int:
    """CLI entry. ``load_model`` (returning ``(model, tokenizer)``) and ``config`` replace the default
    SmolLM2 loader and the FULL/QUICK sizes (the tests pass a tiny random model)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="300-token system prompt, 3 turns, 2 conversations (a smoke test)")
    parser.add_argument("--json", metavar="PATH", help="also write every number to PATH as JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core this process may use)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--skip-cb", action="store_true",
                        help="do not run (c), transformers' continuous batching")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants takes a comma-separated subset of {','.join(VARIANTS)}; got {args.variants!r}")
    threads = args.threads or default_threads()
    if threads < 1:
        parser.error("--threads must be >= 1")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch is imported, when it is not yet
    import torch
    import transformers

    torch.set_num_threads(threads)
    base = config or (QUICK if args.quick else FULL)
    cfg = Config(**{**asdict(base), "seed": args.seed})

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    started = time.perf_counter()
    cpu_started = time.process_time()
    if load_model is None:
        from radixcache.models import load_model
    model, tokenizer = load_model()
    model_name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    results = run_benchmark(cfg, model, tokenizer, variants=variants, skip_cb=args.skip_cb, log=log)
    elapsed = time.perf_counter() - started
    cpu = time.process_time() - cpu_started

    dtype = next(model.parameters()).dtype
    machine = (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, torch threads {threads}, "
               f"Python {platform.python_version()}, torch {torch.__version__}, "
               f"transformers {transformers.__version__}")
    workload = (f"system prompt {cfg.system_tokens} tokens, +{cfg.user_tokens} user tokens and "
                f"{cfg.new_tokens} generated tokens per call (greedy, EOS disabled), random token ids "
                f"(seed {cfg.seed}), block/page size {cfg.block_size}" + (" [--quick]" if args.quick else ""))
    header = [f"model: {model_name} ({type(model).__name__}, {dtype}, CPU)",
              f"workload: {workload}",
              f"machine: {machine}",
              f"run: {elapsed:.0f} s wall, {cpu:.0f} s CPU (process), model load included"]
    report(cfg, results, header)

    if args.json:
        payload = {"benchmark": "agent_loop", "config": asdict(cfg), "quick": args.quick,
                   "model": model_name, "machine": machine, "threads": threads, "elapsed_s": elapsed,
                   "cpu_s": cpu, "variants": [to_json(v) for v in results]}
        Path(args.json).write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
