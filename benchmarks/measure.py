"""What the benchmark scripts share besides tables: workloads, streamers, timing, threads.

Workloads are seeded random token ids (no tokenizer), drawn clear of the model's special ids.
Timing is wall-clock (``time.perf_counter``), the same on every side of a comparison: a streamer
stamps each token ``generate`` emits; a stream of ``generate_batch`` is stamped as it yields.
"""

from __future__ import annotations

import os
import random
import time

TOKEN_LOW = 100  # random ids are drawn from [TOKEN_LOW, vocab): clear of special tokens


def token_range(vocab_size: int, special_ids=()) -> tuple[int, set]:
    """(lowest id to draw, ids never to draw) for a vocabulary and its special ids."""
    special = set(special_ids)
    low = TOKEN_LOW if vocab_size > 2 * TOKEN_LOW else 1
    if special and max(special) < vocab_size // 2:
        low = max(low, max(special) + 1)
    return low, special


def random_ids(rng: random.Random, n: int, vocab_size: int, special_ids=()) -> list[int]:
    """``n`` seeded random token ids of the vocabulary, none of them special."""
    low, special = token_range(vocab_size, special_ids)
    out = []
    while len(out) < n:
        t = rng.randrange(low, vocab_size)
        if t not in special:
            out.append(t)
    return out


def shared_prefix_prompts(n_systems: int, per_system: int, system_tokens: int, unique_tokens: int,
                          vocab_size: int, seed: int, shuffle: bool = False):
    """``n_systems * per_system`` prompts (a system prompt + a unique suffix each) and each one's
    system index."""
    rng = random.Random(seed)
    systems = [random_ids(rng, system_tokens, vocab_size) for _ in range(n_systems)]
    pairs = [(systems[k] + random_ids(rng, unique_tokens, vocab_size), k)
             for k in range(n_systems) for _ in range(per_system)]
    if shuffle:
        rng.shuffle(pairs)
    return [p for p, _ in pairs], [k for _, k in pairs]


class TokenTimes:
    """A ``generate`` streamer that timestamps every generated token (the first put is the prompt)."""

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
    """``fn(ids, streamer=..., **kwargs)``; returns (output, total, ttft, last token) in seconds."""
    streamer = TokenTimes()
    t0 = time.perf_counter()
    out = fn(ids, streamer=streamer, **kwargs)
    t1 = time.perf_counter()
    if not streamer.times:
        raise RuntimeError("the streamer saw no generated token")
    return out, t1 - t0, streamer.times[0] - t0, streamer.times[-1] - t0


def timed_stream(stream) -> tuple[list, dict, float]:
    """Drain a ``generate_batch(..., stream=True)`` run: (tokens per prompt per sample, seconds
    from the start to each prompt's first token, total seconds)."""
    t0 = time.perf_counter()
    first: dict = {}
    tokens: dict = {}
    with stream:
        for prompt, sample, token in stream:
            first.setdefault(prompt, time.perf_counter() - t0)
            tokens.setdefault(prompt, {}).setdefault(sample, []).append(token)
    total = time.perf_counter() - t0
    out = [[tokens[p][s] for s in sorted(tokens[p])] for p in sorted(tokens)]
    return out, first, total


def default_threads() -> int:
    """Every core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
