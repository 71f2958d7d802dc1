"""Cached-turn TTFT of ``lm.generate`` against its floor, at a block-aligned and an unaligned prefix.

For each repetition a fresh random prefix of ``prefix`` tokens is cached, then a prompt of prefix +
``new`` fresh tokens is timed from the call to its first token:

- radixcache: ``lm.generate(prefix, max_new_tokens=1)`` (untimed; it caches the prefix's whole
  blocks and, when the prefix is not block-aligned, its partial last block), then
  ``lm.generate(prefix + new, max_new_tokens=1, do_sample=False)`` timed by a streamer;
- the floor: a ``DynamicCache`` already holding the prefix and the previous turn's last tokens
  (untimed), then, timed, ``cache.crop(len(prefix))`` in place plus one forward over the new tokens
  and the argmax of the last logits: what a caller keeping its own cache per conversation pays.

Both sides compute the same ``new`` tokens when the partial block is reused. Medians over
repetitions, the two sides alternating; the ratio is radixcache / floor.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from benchmarks.measure import random_ids, timed_generate
from benchmarks.report import fmt, median, met, table

TARGETS = {"aligned": 1.05, "unaligned": 1.08}
PREVIOUS_TURN_TOKENS = 8  # tokens the floor's cache holds past the prefix before it is cropped


@dataclass(frozen=True)
class FloorConfig:
    """Sizes: prefixes of ``aligned`` and ``unaligned`` tokens, ``new`` tokens, repetitions."""

    aligned: int = 1504
    unaligned: int = 1500
    new: int = 60
    repeats: int = 5
    block_size: int = 16
    seed: int = 0


QUICK = FloorConfig(aligned=304, unaligned=300, new=20, repeats=2)


def floor_ttft(model, prefix: list, previous: list, new: list) -> float:
    """Seconds for crop + one forward over ``new`` + argmax, on a DynamicCache holding
    ``prefix + previous``."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix + previous]), cache=cache, use_cache=True,
              logits_to_keep=1)
        t0 = time.perf_counter()
        cache.crop(len(prefix) - cache.get_seq_length())  # in place; negative: drop from the end
        out = model(input_ids=torch.tensor([new]), cache=cache, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
        return time.perf_counter() - t0


def radix_ttft(lm, prefix: list, new: list) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens computed, prompt tokens served from the cache) of the cached
    turn ``prefix + new`` after caching ``prefix``."""
    import torch

    lm.generate(torch.tensor([prefix]), max_new_tokens=1, do_sample=False)
    before = lm.stats()
    ids = torch.tensor([prefix + new])
    out, _, ttft, _ = timed_generate(lm.generate, ids, max_new_tokens=1, do_sample=False,
                                     return_dict_in_generate=True)
    after = lm.stats()
    return ttft, after["computed_prompt_tokens"] - before["computed_prompt_tokens"], out.cached_tokens[0]


def run(model, cfg: FloorConfig, log=lambda msg: None) -> list[dict]:
    """One row per prefix kind ("aligned", "unaligned"), with per-repetition times."""
    import radixcache

    vocab = model.get_input_embeddings().num_embeddings
    rng = random.Random(cfg.seed)
    need = (max(cfg.aligned, cfg.unaligned) + cfg.new + cfg.block_size) * 3
    lm = radixcache.wrap(model, block_size=cfg.block_size, max_cache_tokens=need)
    rows = []
    for kind, length in (("aligned", cfg.aligned), ("unaligned", cfg.unaligned)):
        rc, fl, computed, cached = [], [], [], []
        for rep in range(cfg.repeats):
            log(f"  ttft floor {kind} ({length} + {cfg.new}), repetition {rep + 1}/{cfg.repeats}")
            prefix = random_ids(rng, length, vocab)
            new = random_ids(rng, cfg.new, vocab)
            previous = random_ids(rng, PREVIOUS_TURN_TOKENS, vocab)
            t, c, h = radix_ttft(lm, prefix, new)
            rc.append(t)
            computed.append(c)
            cached.append(h)
            fl.append(floor_ttft(model, prefix, previous, new))
            lm.clear()
        r, f = median(rc), median(fl)
        rows.append(dict(kind=kind, prefix=length, new=cfg.new, radix_ms=r * 1e3, floor_ms=f * 1e3,
                         ratio=r / f, target=TARGETS[kind], computed=max(computed),
                         cached=min(cached), radix_s=rc, floor_s=fl))
    return rows


def render(rows: list[dict]) -> str:
    """The side-by-side table."""
    body = [(r["kind"], str(r["prefix"]), str(r["new"]), str(r["cached"]), str(r["computed"]),
             fmt(r["radix_ms"], ".0f"), fmt(r["floor_ms"], ".0f"), fmt(r["ratio"], ".3f"),
             f"<= {r['target']:.2f}", met(r["ratio"], r["target"])) for r in rows]
    return table(("prefix", "tokens", "new", "cached", "computed", "TTFT radixcache ms",
                  "TTFT floor ms", "ratio", "target", "met?"), body)
