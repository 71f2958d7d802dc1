"""Agent loop over HTTP: the same multi-turn workload through the ``openai`` client, server by server.

Each server (``serve_servers.py``: radixcache, optionally also with ``--compile``, ``--quantize
int8`` or ``--attention torch`` as rows of their own, ``transformers serve`` without and with
continuous batching, and llama.cpp's ``llama-server`` when it is on PATH, on the GGUF the embedded
model comes from, started anew for each number of sessions) is started as a subprocess on a free
loopback port, on the same local model (offline: ``HF_HUB_OFFLINE=1``), warmed up with one short
request and then driven by ``sessions`` concurrent agent sessions (1, 8, then 16). Every server but llama-server (whose GGUF is Q4_1)
runs at one ``--dtype`` (default auto: ``radixcache.models.default_dtype``, bfloat16 on CPUs with
native bf16 matrix units), and so does the in-process reference; the dtype is printed. A session is the demo's agent: a system message with the
tool preamble (``radixcache.app.demo.build_system_prompt``, about 1,500 tokens on SmolLM2), then per
turn a user request, the streamed greedy reply (``max_tokens`` 24), a tool result as a ``tool``
message; every request sends the whole conversation as messages, as agent frameworks do.

Per phase it prints turn-1 TTFT, cached-turn TTFT p50 and p99, a call's decode rate (its tokens
after the first over the time from the first to the last), a cached turn's whole latency and the
output tokens/s; against llama-server, the one-session targets of each radixcache configuration.
Per server, sessions and turn it prints: prompt tokens, TTFT p50/p95 (request sent to the first
content chunk, over the sessions), output tokens/s (that turn's completion tokens over its wall
span), cached tokens as the server reports them in ``usage.prompt_tokens_details.cached_tokens``
("-" when it reports none) against the ideal: the prompt tokens that repeat the session's previous
turn token for token (its history form, rendered with the server's chat template; 0 on turn 1).
radixcache runs once more with each drifting chat template (``benchmarks/drift_templates.py``, at
the first session count). After the servers, one session is played in this process through
``lm.generate`` (``serve_inprocess.py``) for the in-process TTFT reference, interleaved turn by turn
with radixcache's 1-session phase (each side runs while the other is idle, under the same machine
load), each of its greedy replies checked against plain ``model.generate`` and against the server's
own reply, and the targets are printed as met or missed (``serve_report.py``).

Every phase is bounded in count (sessions x turns calls) and time: no turn starts after
``--budget`` seconds (default 600) and calls still running at twice that are cut off and reported
as incomplete. ``--quick`` runs 3 turns of 16 new tokens with a 90 s budget; default
``transformers serve`` takes 7-8 s per turn on the embedded model on 2 CPU cores. Timings measured
on a shared machine are noisy: the numbers in benchmarks/README.md come from a quiet one.

    python benchmarks/serve.py [--quick] [--model DIR] [--dtype auto|float32|bfloat16]
                               [--servers radixcache,transformers,transformers-cb,llama-server]
                               [--templates generation_think,strip_think] [--sessions 1 8 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drift_templates import TEMPLATES  # noqa: E402
from report import table  # noqa: E402
from serve_client import Workload, run_phase, warm_up  # noqa: E402
from serve_inprocess import InProcessSession, inprocess_ttft_ms  # noqa: E402
from serve_report import SUMMARY_HEADER, greedy_line, phase_rows, summary_rows, target_rows  # noqa: E402
from serve_servers import (COMPILING, DEFAULT_SERVERS, PER_PHASE, SERVERS, Run, precision,  # noqa: E402
                           radixcache_command, unavailable)
from server_process import ServerProcess, free_port  # noqa: E402


def planned_runs(names, templates, sessions, template_dir: Path):
    """``(label, command builder, template text or None, sessions)`` per server start: each named
    server once for every session count (a server of ``PER_PHASE`` once per count), then radixcache
    once more per drifting template (its first session count only)."""
    runs = []
    for name in names:
        phases = [[n] for n in sessions] if name in PER_PHASE else [sessions]
        runs += [(name, SERVERS[name], None, counts) for counts in phases]
    if "radixcache" in names:
        for name in templates:
            path = template_dir / f"{name}.jinja"
            path.write_text(TEMPLATES[name])
            build = lambda model, port, run, path=path: radixcache_command(model, port, run) + ["--chat-template", str(path)]  # noqa: E731
            runs.append((f"radixcache[{name}]", build, TEMPLATES[name], sessions[:1]))
    return runs


def main(argv=None) -> int:
    from radixcache.models import DTYPE_CHOICES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="DIR", default=None, help="local model directory (default: SmolLM2)")
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help=f"comma-separated, from {', '.join(SERVERS)} (default {','.join(DEFAULT_SERVERS)}; "
                             "llama-server only when it is on PATH and the model is the embedded one)")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype of every server but llama-server and of the in-process reference "
                             "(default auto: radixcache.models.default_dtype)")
    parser.add_argument("--templates", default=",".join(TEMPLATES),
                        help=f"drifting chat templates radixcache also runs with, from {', '.join(TEMPLATES)} "
                             "('' for none; default all)")
    parser.add_argument("--sessions", type=int, nargs="+", default=None, help="concurrent sessions (default 1 8 16)")
    parser.add_argument("--turns", type=int, default=None, help="turns per session (default 6, quick 3)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per reply (default 24, quick 16)")
    parser.add_argument("--system-tokens", type=int, default=1500, help="size of the tool preamble")
    parser.add_argument("--quick", action="store_true", help="bounded run: 3 turns, 16 new tokens, 90 s budget")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds per phase after which no turn starts; calls still running at twice that "
                             "are cut off (default 600, quick 90)")
    parser.add_argument("--no-inprocess", action="store_true", help="skip the in-process generate reference")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--json", metavar="PATH", help="also write every call to PATH as JSON")
    args = parser.parse_args(argv)
    turns = args.turns or (3 if args.quick else 6)
    max_tokens = args.max_tokens or (16 if args.quick else 24)
    sessions = args.sessions or [1, 8, 16]
    budget = args.budget or (90.0 if args.quick else 600.0)
    names = [s for s in args.servers.split(",") if s]
    templates = [t for t in args.templates.split(",") if t]
    unknown = [s for s in names if s not in SERVERS] + [t for t in templates if t not in TEMPLATES]
    if unknown or min(sessions) < 1 or turns < 1 or max_tokens < 1:
        parser.error(f"unknown server(s) or template(s) {unknown}" if unknown
                     else "sessions, turns and max tokens must be >= 1")

    from transformers import AutoTokenizer

    from radixcache.models import default_dtype, default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    dtype = default_dtype("cpu") if args.dtype == "auto" else args.dtype
    skipped = [(n, why) for n in names if (why := unavailable(n, model_dir))]
    names = [n for n in names if n not in dict(skipped)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    work = Workload(tokenizer, args.system_tokens)
    print(f"radixcache serve benchmark: {model_dir.name}, {turns} turns, sessions {sessions}, "
          f"{max_tokens} new tokens, system prompt with {work.tools} tools; servers: {', '.join(names)}; "
          f"drifting templates: {', '.join(templates) if 'radixcache' in names and templates else 'none'}; "
          f"precision: " + ", ".join(f"{n} {precision(n, model_dir, dtype)}" for n in names))
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    phases, failures = [], []
    inprocess = None

    with tempfile.TemporaryDirectory(prefix="serve-bench-") as logs:
        for label, build, template, counts in planned_runs(names, templates, sessions, Path(logs)):
            run_work = work if template is None else Workload(tokenizer, args.system_tokens, template)
            run = Run(dtype, max(counts))
            startup_s = max(args.startup_timeout, 900.0) if label in COMPILING else args.startup_timeout
            try:
                server = ServerProcess(label, build(model_dir, free_port(), run), Path(logs), startup_s)
            except RuntimeError as exc:
                failures.append(f"{label}: {exc}")
                continue
            try:
                asyncio.run(warm_up(server))
                for n in counts:
                    reference = None
                    if label == "radixcache" and n == 1 and not args.no_inprocess:
                        reference = InProcessSession(model_dir, work, max_tokens, dtype)
                    try:
                        phases.append(asyncio.run(run_phase(server, run_work, n, turns, max_tokens, budget,
                                                            reference)))
                    finally:
                        if reference is not None:
                            reference.close()
                            inprocess = reference.result()
                    print("  ".join(summary_rows(phases[-1:])[0]), file=sys.stderr, flush=True)
            finally:
                server.stop()
            if any(c.error for p in phases if p.server == label for c in p.calls):
                print(f"{label} failed calls; the end of its log:\n{server.tail(2000)}", file=sys.stderr)
    if inprocess is None and "radixcache" in names and not args.no_inprocess:  # no 1-session phase
        inprocess = inprocess_ttft_ms(model_dir, work, turns, max_tokens, dtype)
    inprocess_ms = inprocess.ttft_ms if inprocess else None
    header = ("server", "sessions", "turn", "prompt tok", "TTFT p50 ms", "TTFT p95 ms", "out tok/s",
              "cached tok", "ideal tok", "cached/ideal")
    print(table(header, [row for phase in phases for row in phase_rows(phase)], left=(0,)))
    print()
    print(table(SUMMARY_HEADER, summary_rows(phases), left=(0, len(SUMMARY_HEADER) - 1)))
    print("TTFT: request sent to the first content chunk (streamed, greedy). out tok/s: completion tokens "
          "over the wall time. cached: usage.prompt_tokens_details.cached_tokens ('-': not reported); "
          "ideal: prompt tokens repeating the session's previous turn token for token.")
    if inprocess_ms is not None:
        print(f"in-process lm.generate TTFT, turns 2+ (one session, history precomputed, {dtype}, interleaved "
              f"turn by turn with the server's 1-session phase): {inprocess_ms:,.0f} ms; cached tokens per turn: "
              f"{', '.join(f'{c:,}' for c in inprocess.cached)}")
    if inprocess is not None:
        print(greedy_line(phases, inprocess, dtype))
    print()
    print(table(("target", "measured", "goal", "met"), target_rows(phases, inprocess_ms), left=(0,)))
    errors = [c.error for p in phases for c in p.calls if c.error]
    for line in failures + errors[:5]:
        print(f"FAILED {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"phases": [asdict(p) for p in phases], "failures": failures,
                                               "dtype": dtype, "skipped": dict(skipped),
                                               "inprocess_ttft_ms": inprocess_ms,
                                               "inprocess_cached": inprocess.cached if inprocess else None,
                                               "inprocess_plain_equal": inprocess.plain_equal if inprocess else None},
                                              indent=1) + "\n")
    return 1 if failures or errors else 0


if __name__ == "__main__":
    sys.exit(main())
