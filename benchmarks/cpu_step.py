"""A miss and a decode through ``lm.generate`` against plain ``model.generate``, in process.

For each dtype and context length, repetitions alternate the two sides (which goes first
alternates too):

- cold prompt: a fresh random prompt of ``context`` tokens (nothing of it cached), one new token;
  the time of the whole call. A user expects a miss to cost what plain ``generate`` costs.
- decode: a prompt of ``context`` tokens, first generated once untimed (radixcache then holds it),
  then ``new`` greedy tokens (``min_new_tokens`` keeps both sides from stopping early) timed by a
  streamer: tokens per second from the first generated token to the last.

Every timed call's tokens are compared between the two sides (in float32 they must be equal).
``python benchmarks/cpu_step.py [--dtypes float32 bfloat16] [--contexts 1500 3000] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import random_ids, timed_generate  # noqa: E402
from benchmarks.report import cpu_name, fmt, median, met, table  # noqa: E402

COLD_TARGET = 1.03  # lm.generate / model.generate on a miss, at most
DECODE_TARGET = 1.0  # lm.generate's decode rate / model.generate's, at least


def cold_call(generate, ids) -> tuple[float, list]:
    import torch

    t0 = time.perf_counter()
    out = generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0, out[0, len(ids):].tolist()


def decode_call(generate, ids, new: int) -> tuple[float, list]:
    import torch

    out, _, first, last = timed_generate(generate, torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new,
                                         do_sample=False)
    return (new - 1) / (last - first), out[0, len(ids):].tolist()


def measure(model, lm, dtype: str, context: int, new: int, reps: int, seed: int) -> dict:
    """One row: medians of the cold prompt's seconds and the decode rate on both sides."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    specials = [t for t in (model.generation_config.eos_token_id, model.generation_config.pad_token_id)
                if isinstance(t, int)]
    sides = {"plain": model.generate, "radixcache": lm.generate}
    cold = {name: [] for name in sides}
    decode = {name: [] for name in sides}
    same = 0
    warm = random_ids(rng, context, vocab, specials)  # one untimed call each: allocations, first-touch
    for fn in sides.values():
        cold_call(fn, warm)
    for rep in range(reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        prompt = random_ids(rng, context, vocab, specials)
        outputs = {}
        for name in order:
            seconds, outputs[name] = cold_call(sides[name], prompt)
            cold[name].append(seconds)
        same += outputs["plain"] == outputs["radixcache"]
        for name in order:  # the prompt is cached on radixcache's side now
            rate, outputs[name] = decode_call(sides[name], prompt, new)
            decode[name].append(rate)
        same += outputs["plain"] == outputs["radixcache"]
    row = {"dtype": dtype, "context": context, "new": new, "reps": reps, "same": same, "calls": 2 * reps}
    for name in sides:
        row[f"cold_{name}_s"] = median(cold[name])
        row[f"cold_{name}_all"] = cold[name]
        row[f"decode_{name}_tps"] = median(decode[name])
        row[f"decode_{name}_all"] = decode[name]
    row["cold_ratio"] = row["cold_radixcache_s"] / row["cold_plain_s"]
    row["decode_ratio"] = row["decode_radixcache_tps"] / row["decode_plain_tps"]
    return row


def render(rows: list[dict]) -> str:
    header = ("dtype", "context", "cold plain ms", "cold radixcache ms", "ratio", f"<= {COLD_TARGET}",
              "decode plain tok/s", "decode radixcache tok/s", "ratio", f">= {DECODE_TARGET}", "same tokens")
    body = []
    for r in rows:
        body.append((r["dtype"], f"{r['context']:,}", fmt(r["cold_plain_s"] * 1e3, ",.0f"),
                     fmt(r["cold_radixcache_s"] * 1e3, ",.0f"), fmt(r["cold_ratio"], ".3f"),
                     met(r["cold_ratio"], COLD_TARGET), fmt(r["decode_plain_tps"], ".1f"),
                     fmt(r["decode_radixcache_tps"], ".1f"), fmt(r["decode_ratio"], ".3f"),
                     met(r["decode_ratio"], DECODE_TARGET, below=False), f"{r['same']}/{r['calls']}"))
    return table(header, body, left=(0,))


def main(argv=None, load=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: the embedded SmolLM2)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1500, 3000])
    parser.add_argument("--new", type=int, default=32, help="decoded tokens per timed call")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--attention", default="auto", help="radixcache's attention backend")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    import torch

    import radixcache
    from radixcache.models import load_model

    torch.set_num_threads(args.threads)
    rows = []
    for dtype in args.dtypes:
        if load is None:
            model, _ = load_model(args.model, dtype=dtype)
        else:
            model = load(dtype)
        lm = radixcache.wrap(model, attention=args.attention,
                             max_cache_tokens=4 * (max(args.contexts) + args.new + 64))
        for context in args.contexts:
            rows.append(measure(model, lm, dtype, context, args.new, args.reps, args.seed))
            print(f"  {dtype} {context}: done", file=sys.stderr)
        lm.close()
    print(f"cold prompt and decode, lm.generate against model.generate; {args.threads} torch thread(s), "
          f"{args.reps} repetitions, medians; {cpu_name()}, "
          f"torch {torch.__version__}")
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
