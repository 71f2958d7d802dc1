"""The client side of ``benchmarks/serve.py``: the agent sessions and the phases that run them.

``Workload`` is the demo's agent (prompts rendered here only to count tokens and the ideal hit);
``run_session`` plays one session through the ``openai`` client (streamed, greedy), recording a
``Call`` per turn; ``run_phase`` runs ``sessions`` of them at once against one server within a time
budget (optionally interleaving an in-process reference with a single session, each turn once the
server is idle); ``warm_up`` sends one short request first.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from serve_inprocess import InProcessSession
from server_process import ServerProcess


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
        from radixcache.integrations.serve.requests.chat_template import ChatRenderer

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
        from radixcache.integrations.serve.history.forms import history_tokens

        return history_tokens(self.renderer, messages)


SETTLE_S = 0.1  # between the in-process reference and the server: the other side's OpenMP workers stop spinning

_RENDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-render")  # one: tokenizers


async def render(fn, messages):
    """``fn(messages)`` (the client side's template rendering) off the event loop, so one
    session's rendering never delays another's stream reading (and its measured TTFT)."""
    return await asyncio.get_running_loop().run_in_executor(_RENDER, fn, messages)


async def run_session(client, model: str, work: Workload, session: int, turns: int, max_tokens: int,
                      deadline: float, calls: list, after_turn=None) -> None:
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
        if after_turn is not None:
            await after_turn(turn)


async def wait_idle(server: ServerProcess, timeout_s: float = 30.0) -> None:
    """Until the server runs and queues nothing (its history precompute included)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            text = (await client.get(server.base + "/metrics")).text
            busy = [line for line in text.splitlines()
                    if line.startswith(("radixcache:num_requests_running ", "radixcache:num_requests_waiting "))
                    and float(line.split()[-1]) > 0]
            if not busy:
                return
            await asyncio.sleep(0.05)


async def run_phase(server: ServerProcess, work: Workload, sessions: int, turns: int, max_tokens: int,
                    budget_s: float, reference: InProcessSession | None = None) -> Phase:
    """Run the sessions; no turn starts after ``budget_s`` and calls still running at twice that
    are cut off (reported as incomplete), so a phase never takes longer than ``2 * budget_s``. With
    one session and a ``reference``, each turn is followed (once the server is idle) by the same
    turn in process (its time is left out of the phase's wall time), with ``SETTLE_S`` before and
    after it, so that neither side starts while the other's OpenMP workers still spin."""
    from openai import AsyncOpenAI

    phase = Phase(server.name, sessions)
    client = AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=2 * budget_s)
    start = time.perf_counter()
    deadline = time.monotonic() + budget_s
    aside = []  # seconds spent on the in-process turns: not the server's wall time

    async def in_process(turn):
        began = time.perf_counter()
        await wait_idle(server)
        await asyncio.sleep(SETTLE_S)
        reference.turn(turn)
        await asyncio.sleep(SETTLE_S)
        aside.append(time.perf_counter() - began)

    hook = in_process if reference is not None and sessions == 1 else None
    runs = asyncio.gather(*(run_session(client, server.model, work, s, turns, max_tokens, deadline, phase.calls,
                                        hook if s == 0 else None) for s in range(sessions)))
    try:
        await asyncio.wait_for(runs, timeout=2 * budget_s)
    except asyncio.TimeoutError:
        pass
    phase.wall_s = time.perf_counter() - start - sum(aside)
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
