"""Agent loop over HTTP: the same multi-turn workload through the ``openai`` client, server by server.

Each server is started as a subprocess on a free loopback port, on the same local model directory
(offline: ``HF_HUB_OFFLINE=1``), warmed up with one short request and then driven by ``sessions``
concurrent agent sessions (first 1, then 8). A session is the demo's agent: a system message with the
tool preamble (``radixcache.app.demo.build_system_prompt``, about 1,500 tokens on SmolLM2), then per
turn a user request, the streamed greedy reply (``max_tokens`` 24), a tool result as a ``tool``
message; every request sends the whole conversation as messages, as agent frameworks do.

Per server, sessions and turn it prints: prompt tokens, TTFT p50/p95 (request sent to the first
content chunk, over the sessions), output tokens/s (that turn's completion tokens over its wall
span), cached tokens as the server reports them in ``usage.prompt_tokens_details.cached_tokens``
("-" when it reports none) against the ideal: the prompt tokens that repeat the session's previous
turn token for token (its history form, rendered with the server's chat template; 0 on turn 1).
radixcache runs once more with each drifting chat template (``benchmarks/drift_templates.py``, at
the first session count). After the servers, one session is played in this process through
``lm.generate`` (``serve_inprocess.py``) for the in-process TTFT reference, and the issue's
targets are printed as met or missed (``serve_report.py``).

``--quick`` bounds the run (3 turns, 16 new tokens, a time budget per phase: no turn starts after
90 s and calls still running at 180 s are cut off and reported as incomplete); default
``transformers serve`` takes 7-8 s per turn on the embedded model on 2 CPU cores. Timings measured
on a shared machine are noisy: the README's numbers come from a quiet one.

    python benchmarks/serve.py [--quick] [--model DIR] [--servers radixcache,transformers,transformers-cb]
                               [--templates generation_think,strip_think]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drift_templates import TEMPLATES  # noqa: E402
from report import table  # noqa: E402
from serve_inprocess import inprocess_ttft_ms  # noqa: E402
from serve_report import phase_rows, summary_rows, target_rows  # noqa: E402
from server_process import ServerProcess, free_port  # noqa: E402


def _exe(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def transformers_command(model_dir, port: int) -> list[str]:
    return [_exe("transformers"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]


def transformers_cb_command(model_dir, port: int) -> list[str]:
    return transformers_command(model_dir, port) + ["--continuous-batching"]


def radixcache_command(model_dir, port: int) -> list[str]:
    return [_exe("radixcache"), "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]


SERVERS = {"radixcache": radixcache_command, "transformers": transformers_command,
           "transformers-cb": transformers_cb_command}
DEFAULT_SERVERS = tuple(SERVERS)


@dataclass
class Call:
    """One request of one session."""

    session: int
    turn: int
    prompt_tokens: int
    ideal_cached: int
    started: float
    ttft_s: float | None = None
    done: float | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    reply: str = ""
    error: str | None = None
    cut_off: bool = False  # still running when the phase's time was up

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cut_off and self.done is not None


@dataclass
class Phase:
    """One server at one number of concurrent sessions."""

    server: str
    sessions: int
    wall_s: float = 0.0
    calls: list = field(default_factory=list)
    note: str = ""


# ---------------------------------------------------------------------- the workload
class Workload:
    """The demo's agent: prompts rendered client-side only to count tokens and the ideal hit."""

    def __init__(self, tokenizer, system_tokens: int, template: str | None = None):
        from radixcache.app.demo import build_system_prompt
        from radixcache.integrations.serve.chat_template import ChatRenderer

        self.system, self.tools = build_system_prompt(tokenizer, system_tokens)
        self.renderer = ChatRenderer(tokenizer, template)

    def request(self, session: int, turn: int) -> tuple[str, str]:
        from radixcache.app.demo import script_step

        request, result = script_step(turn + session)
        return f"[session {session + 1}] {request}", result

    def count(self, messages) -> tuple[int, tuple]:
        ids = self.renderer.render(messages).token_ids
        return len(ids), ids

    def history(self, messages) -> tuple:
        from radixcache.integrations.serve.history import history_tokens

        return history_tokens(self.renderer, messages)


_RENDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-render")  # one: tokenizers


async def render(fn, messages):
    """``fn(messages)`` (the client side's template rendering) off the event loop, so one
    session's rendering never delays another's stream reading (and its measured TTFT)."""
    return await asyncio.get_running_loop().run_in_executor(_RENDER, fn, messages)


async def run_session(client, model: str, work: Workload, session: int, turns: int, max_tokens: int,
                      deadline: float, calls: list) -> None:
    from radixcache.tokens import common_prefix

    messages = [{"role": "system", "content": work.system}]
    previous = ()
    for turn in range(turns):
        if time.monotonic() > deadline:
            return
        request, result = work.request(session, turn)
        messages.append({"role": "user", "content": request})
        n, ids = await render(work.count, messages)
        call = Call(session, turn + 1, n, common_prefix(ids, previous) if previous else 0, time.perf_counter())
        calls.append(call)
        try:
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
                    if call.ttft_s is None:
                        call.ttft_s = time.perf_counter() - call.started
                    call.reply += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    call.completion_tokens = chunk.usage.completion_tokens
                    details = chunk.usage.prompt_tokens_details
                    call.cached_tokens = None if details is None else details.cached_tokens
        except asyncio.CancelledError:
            call.cut_off = True
            raise
        except Exception as exc:  # noqa: BLE001 - a failed call is reported, the run goes on
            call.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        finally:
            call.done = time.perf_counter()
        messages.append({"role": "assistant", "content": call.reply})
        previous = await render(work.history, messages)
        messages.append({"role": "tool", "tool_call_id": f"call_{turn + 1}", "content": result})


async def run_phase(server: ServerProcess, work: Workload, sessions: int, turns: int, max_tokens: int,
                    budget_s: float) -> Phase:
    """Run the sessions; no turn starts after ``budget_s`` and calls still running at twice that
    are cut off (reported as incomplete), so a phase never takes longer than ``2 * budget_s``."""
    from openai import AsyncOpenAI

    phase = Phase(server.name, sessions)
    client = AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=2 * budget_s)
    start = time.perf_counter()
    deadline = time.monotonic() + budget_s
    runs = asyncio.gather(*(run_session(client, server.model, work, s, turns, max_tokens, deadline, phase.calls)
                            for s in range(sessions)))
    try:
        await asyncio.wait_for(runs, timeout=2 * budget_s)
    except asyncio.TimeoutError:
        pass
    phase.wall_s = time.perf_counter() - start
    await client.close()
    done = sum(c.ok for c in phase.calls)
    if done < sessions * turns:
        phase.note = f"{done} of {sessions * turns} calls done within the budget ({budget_s:.0f} s to start a turn)"
    return phase


async def warm_up(server: ServerProcess) -> None:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
        await client.chat.completions.create(model=server.model, max_tokens=2, temperature=0,
                                             messages=[{"role": "user", "content": "Hello"}])


def planned_runs(names, templates, sessions, template_dir: Path):
    """``(label, command builder, template text or None, sessions)`` per server to start: each named
    server, then radixcache once more per drifting template (its first session count only)."""
    runs = [(name, SERVERS[name], None, sessions) for name in names]
    if "radixcache" in names:
        for name in templates:
            path = template_dir / f"{name}.jinja"
            path.write_text(TEMPLATES[name])
            build = lambda model, port, path=path: radixcache_command(model, port) + ["--chat-template", str(path)]  # noqa: E731
            runs.append((f"radixcache[{name}]", build, TEMPLATES[name], sessions[:1]))
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", metavar="DIR", default=None, help="local model directory (default: SmolLM2)")
    parser.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                        help=f"comma-separated, from {', '.join(SERVERS)} (default {','.join(DEFAULT_SERVERS)})")
    parser.add_argument("--templates", default=",".join(TEMPLATES),
                        help=f"drifting chat templates radixcache also runs with, from {', '.join(TEMPLATES)} "
                             "('' for none; default all)")
    parser.add_argument("--sessions", type=int, nargs="+", default=None, help="concurrent sessions (default 1 8)")
    parser.add_argument("--turns", type=int, default=None, help="turns per session (default 6, quick 3)")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per reply (default 24, quick 16)")
    parser.add_argument("--system-tokens", type=int, default=1500, help="size of the tool preamble")
    parser.add_argument("--quick", action="store_true", help="bounded run: 3 turns, 16 new tokens, 90 s budget")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds per phase after which no turn starts; calls still running at twice that "
                             "are cut off (default 1800, quick 90)")
    parser.add_argument("--no-inprocess", action="store_true", help="skip the in-process generate reference")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument("--json", metavar="PATH", help="also write every call to PATH as JSON")
    args = parser.parse_args(argv)
    turns = args.turns or (3 if args.quick else 6)
    max_tokens = args.max_tokens or (16 if args.quick else 24)
    sessions = args.sessions or [1, 8]
    budget = args.budget or (90.0 if args.quick else 1800.0)
    names = [s for s in args.servers.split(",") if s]
    templates = [t for t in args.templates.split(",") if t]
    unknown = [s for s in names if s not in SERVERS] + [t for t in templates if t not in TEMPLATES]
    if unknown or min(sessions) < 1 or turns < 1 or max_tokens < 1:
        parser.error(f"unknown server(s) or template(s) {unknown}" if unknown
                     else "sessions, turns and max tokens must be >= 1")

    from transformers import AutoTokenizer

    from radixcache.models import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    work = Workload(tokenizer, args.system_tokens)
    print(f"radixcache serve benchmark: {model_dir.name}, {turns} turns, sessions {sessions}, "
          f"{max_tokens} new tokens, system prompt with {work.tools} tools; servers: {', '.join(names)}; "
          f"drifting templates: {', '.join(templates) if 'radixcache' in names and templates else 'none'}")
    phases, failures = [], []
    with tempfile.TemporaryDirectory(prefix="serve-bench-") as logs:
        for label, build, template, counts in planned_runs(names, templates, sessions, Path(logs)):
            run_work = work if template is None else Workload(tokenizer, args.system_tokens, template)
            try:
                server = ServerProcess(label, build(model_dir, free_port()), Path(logs), args.startup_timeout)
            except RuntimeError as exc:
                failures.append(f"{label}: {exc}")
                continue
            try:
                asyncio.run(warm_up(server))
                for n in counts:
                    phases.append(asyncio.run(run_phase(server, run_work, n, turns, max_tokens, budget)))
            finally:
                server.stop()
            if any(c.error for p in phases if p.server == label for c in p.calls):
                print(f"{label} failed calls; the end of its log:\n{server.tail(2000)}", file=sys.stderr)
    inprocess = None
    if "radixcache" in names and not args.no_inprocess:
        inprocess = inprocess_ttft_ms(model_dir, work, turns, max_tokens)
    inprocess_ms = inprocess.ttft_ms if inprocess else None
    header = ("server", "sessions", "turn", "prompt tok", "TTFT p50 ms", "TTFT p95 ms", "out tok/s",
              "cached tok", "ideal tok", "cached/ideal")
    print(table(header, [row for phase in phases for row in phase_rows(phase)], left=(0,)))
    print()
    print(table(("server", "sessions", "calls", "TTFT turns 2+ ms", "out tok/s", "wall s", "note"),
                summary_rows(phases), left=(0, 6)))
    print("TTFT: request sent to the first content chunk (streamed, greedy). out tok/s: completion tokens "
          "over the wall time. cached: usage.prompt_tokens_details.cached_tokens ('-': not reported); "
          "ideal: prompt tokens repeating the session's previous turn token for token.")
    if inprocess_ms is not None:
        print(f"in-process lm.generate TTFT, turns 2+ (one session, history precomputed): {inprocess_ms:,.0f} ms; "
              f"cached tokens per turn: {', '.join(f'{c:,}' for c in inprocess.cached)}")
    print()
    print(table(("target", "measured", "goal", "met"), target_rows(phases, inprocess_ms), left=(0,)))
    errors = [c.error for p in phases for c in p.calls if c.error]
    for line in failures + errors[:5]:
        print(f"FAILED {line}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"phases": [asdict(p) for p in phases], "failures": failures,
                                               "inprocess_ttft_ms": inprocess_ms,
                                               "inprocess_cached": inprocess.cached if inprocess else None},
                                              indent=1) + "\n")
    return 1 if failures or errors else 0


if __name__ == "__main__":
    sys.exit(main())
