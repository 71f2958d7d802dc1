"""A miss and a decode through ``lm.generate`` against plain ``model.generate``, in process.

For each dtype and context length, repetitions alternate the two sides (which goes first
alternates too):

- cold prompt: a fresh random prompt of ``context`` tokens (nothing of it cached), one new token;
  the time of the whole call. A user expects a miss to cost what plain ``generate`` costs.
- decode: a prompt of ``context`` tokens, first generated once untimed (radixcache then holds it),
  then ``new`` greedy tokens (``min_new_tokens`` keeps both sides from stopping early) timed by a
  streamer: tokens per second from the first generated token to the last.

Every timed call's tokens are compared between the two sides (in float32 they must be equal).
``--serve`` adds a third side to the decode: ``radixcache serve`` as a subprocess (same model, dtype
and threads, idle while the others run), the same prompt sent once untimed and then streamed
through ``/v1/completions`` as token ids; its rate from the first streamed token to the last
(a reply cut short by EOS is left out), beside ``lm.generate``'s; ``--quantize int8`` starts it
with its weights int8, the in-process sides' not: the ratio is then what the configuration buys.
``--compile`` compiles radixcache's sides (``wrap(model, compile=True)`` in process, ``serve
--compile``); plain ``generate`` stays eager, as a user runs it.
``python benchmarks/cpu_step.py [--dtypes float32 bfloat16] [--contexts 1500 3000] [--threads 1] [--serve] [--compile]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import random_ids, timed_generate  # noqa: E402
from benchmarks.report import cpu_name, fmt, median, met, table  # noqa: E402

COLD_TARGET = 1.03  # lm.generate / model.generate on a miss, at most
DECODE_TARGET = 1.0  # lm.generate's decode rate / model.generate's, at least
SERVE_TARGET = 0.95  # the server's decode rate / lm.generate's, at least


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


def served_decode(server, ids: list, new: int) -> float | None:
    """The decode rate of ``server`` over ``ids`` (sent once untimed first), or None when its reply
    ended before ``new`` tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=600)
    client.completions.create(model=server.model, prompt=ids, max_tokens=1, temperature=0)
    arrivals, usage = [], None
    for chunk in client.completions.create(model=server.model, prompt=ids, max_tokens=new, temperature=0,
                                           stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter())
        usage = chunk.usage or usage
    if usage is None or usage.completion_tokens < new or len(arrivals) < 2:
        return None
    return (usage.completion_tokens - 1) / (arrivals[-1] - arrivals[0])


def measure(model, lm, dtype: str, context: int, new: int, reps: int, seed: int, server=None) -> dict:
    """One row: medians of the cold prompt's seconds and the decode rate on both sides (and the
    server's decode rate when ``server`` runs)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    specials = [t for t in (model.generation_config.eos_token_id, model.generation_config.pad_token_id)
                if isinstance(t, int)]
    sides = {"plain": model.generate, "radixcache": lm.generate}
    cold = {name: [] for name in sides}
    decode = {name: [] for name in sides}
    same = 0
    served: list = []
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
        if server is not None:
            served.append(served_decode(server, prompt, new))
    row = {"dtype": dtype, "context": context, "new": new, "reps": reps, "same": same, "calls": 2 * reps}
    for name in sides:
        row[f"cold_{name}_s"] = median(cold[name])
        row[f"cold_{name}_all"] = cold[name]
        row[f"decode_{name}_tps"] = median(decode[name])
        row[f"decode_{name}_all"] = decode[name]
    row["cold_ratio"] = row["cold_radixcache_s"] / row["cold_plain_s"]
    row["decode_ratio"] = row["decode_radixcache_tps"] / row["decode_plain_tps"]
    rates = [rate for rate in served if rate is not None]
    row["decode_server_all"] = served
    row["decode_server_tps"] = median(rates) if rates else None
    row["serve_ratio"] = row["decode_server_tps"] / row["decode_radixcache_tps"] if rates else None
    return row


def render(rows: list[dict]) -> str:
    header = ("dtype", "context", "cold plain ms", "cold radixcache ms", "ratio", f"<= {COLD_TARGET}",
              "decode plain tok/s", "decode radixcache tok/s", "ratio", f">= {DECODE_TARGET}", "same tokens")
    served = any(r.get("decode_server_all") for r in rows)
    if served:
        header += ("decode server tok/s", "server / radixcache", f">= {SERVE_TARGET}")
    body = []
    for r in rows:
        line = (r["dtype"], f"{r['context']:,}", fmt(r["cold_plain_s"] * 1e3, ",.0f"),
                fmt(r["cold_radixcache_s"] * 1e3, ",.0f"), fmt(r["cold_ratio"], ".3f"),
                met(r["cold_ratio"], COLD_TARGET), fmt(r["decode_plain_tps"], ".1f"),
                fmt(r["decode_radixcache_tps"], ".1f"), fmt(r["decode_ratio"], ".3f"),
                met(r["decode_ratio"], DECODE_TARGET, below=False), f"{r['same']}/{r['calls']}")
        if served:
            ratio = r.get("serve_ratio")
            line += (fmt(r.get("decode_server_tps"), ".1f"), fmt(ratio, ".3f"),
                     "-" if ratio is None else met(ratio, SERVE_TARGET, below=False))
        body.append(line)
    return table(header, body, left=(0,))


def start_server(model_dir, dtype: str, threads: int, max_cache_tokens: int, log_dir: Path,
                 compile: bool = False, quantize: str | None = None):
    """``radixcache serve`` on a free loopback port with this run's model, dtype and threads."""
    from benchmarks.server_process import ServerProcess, free_port

    exe = Path(sys.executable).with_name("radixcache")
    command = [str(exe) if exe.exists() else "radixcache", "serve", "--host", "127.0.0.1",
               "--port", str(free_port()), "--dtype", dtype, "--threads", str(threads),
               "--max-cache-tokens", str(max_cache_tokens), "--log-level", "warning"]
    if model_dir is not None:
        command += ["--model", str(model_dir)]
    if compile:
        command.append("--compile")
    if quantize:
        command += ["--quantize", quantize]
    return ServerProcess("radixcache", command, log_dir, startup_s=900 if compile else 300)


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
    parser.add_argument("--serve", action="store_true",
                        help="also time the decode through radixcache serve (a subprocess)")
    parser.add_argument("--compile", action="store_true",
                        help="compile radixcache's sides: wrap(model, compile=True) and serve --compile")
    parser.add_argument("--quantize", choices=("int8",), default=None, help="start the server with --quantize")
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
        pool_tokens = 4 * (max(args.contexts) + args.new + 64)
        lm = radixcache.wrap(model, attention=args.attention, max_cache_tokens=pool_tokens, compile=args.compile)
        if args.compile:
            print(f"  {dtype}: lm.generate compiled in {lm.compile_s or 0:.0f} s"
                  + (f" (failed: {lm.compile_failed})" if lm.compile_failed else ""), file=sys.stderr)
        server = None
        if args.serve:
            server = start_server(args.model, dtype, args.threads, pool_tokens,
                                  Path(tempfile.mkdtemp(prefix="cpu_step_")), compile=args.compile,
                                  quantize=args.quantize)
        try:
            for context in args.contexts:
                rows.append(measure(model, lm, dtype, context, args.new, args.reps, args.seed, server))
                print(f"  {dtype} {context}: done", file=sys.stderr)
        finally:
            if server is not None:
                server.stop()
            lm.close()
    flags = " ".join(flag for flag, on in (("--compile", args.compile), (f"--quantize {args.quantize}", args.quantize))
                     if on)
    sides = "radixcache's sides" if args.serve else "lm.generate"
    configured = f" ({sides} with {flags})" if flags else ""
    print(f"cold prompt and decode, lm.generate against model.generate{configured}; {args.threads} torch thread(s), "
          f"{args.reps} repetitions, medians; {cpu_name()}, "
          f"torch {torch.__version__}")
    print(render(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
