"""Concurrent multi-turn chat sessions against one OpenAI-compatible base URL (a router or a replica).

``run_sessions(base_url, model, ...)`` runs ``sessions`` sessions at once (threads, session ``k``
starting ``k * stagger_s`` seconds in), each ``turns`` turns: a system prompt of its own (about
1,100 characters: ``"Session k: "`` and a shared filler), then per turn a user message, a
streamed greedy reply of at most ``max_tokens`` tokens (``stream_options.include_usage``) appended
to the history, and a pause (the client running its tool) before the next turn: ``pause_s``,
``1.5 * pause_s`` or ``2 * pause_s`` for sessions 0, 1, 2 (mod 3), so that sessions drift out of
lockstep (a ``round_robin`` router would otherwise keep each on one replica by parity). It
returns one ``Turn`` per request, in session and turn order: the response id (the replica's token
log names it), prompt and cached tokens (``usage``), the time to the first content chunk and the
whole request's time. Every request is bounded by ``timeout_s``; a failed one raises.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

FILLER = ("You are a coding agent working in a large repository. Follow the house rules: small "
          "modules, docstrings that state contracts, tests that can fail, no copied code. "
          "Explain each change briefly, then show the diff. ") * 5


class Turn(NamedTuple):
    """One request of one session."""

    session: int
    turn: int
    id: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    total_s: float


def system_prompt(session: int) -> str:
    """The system prompt of session ``session`` (distinct from the first characters on)."""
    return f"Session {session}: " + FILLER


def run_sessions(base_url: str, model: str, *, sessions: int = 8, turns: int = 3, max_tokens: int = 8,
                 pause_s: float = 0.0, stagger_s: float = 0.0, api_key: str = "none",
                 timeout_s: float = 120.0, first_session: int = 0) -> list[Turn]:
    """Run the sessions (module docstring); ``first_session`` numbers them from there."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=timeout_s)
    results: dict = {}
    errors: list = []

    def session(k: int) -> None:
        try:
            time.sleep(k * stagger_s)
            number = first_session + k
            messages = [{"role": "system", "content": system_prompt(number)}]
            for t in range(turns):
                messages.append({"role": "user", "content": f"Turn {t}: continue with step {t} of the plan."})
                start = time.perf_counter()
                first = None
                text, usage, rid = [], None, None
                stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True})
                for chunk in stream:
                    rid = rid or chunk.id
                    if chunk.usage is not None:
                        usage = chunk.usage
                    for choice in chunk.choices:
                        if choice.delta.content:
                            if first is None:
                                first = time.perf_counter()
                            text.append(choice.delta.content)
                end = time.perf_counter()
                cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
                results[(number, t)] = Turn(number, t, rid, usage.prompt_tokens, cached,
                                            (first or end) - start, end - start)
                messages.append({"role": "assistant", "content": "".join(text)})
                if t + 1 < turns:
                    time.sleep(pause_s * (1 + (k % 3) / 2))
        except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append((k, exc))

    threads = [threading.Thread(target=session, args=(k,), daemon=True) for k in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=turns * (timeout_s + 2 * pause_s) + sessions * stagger_s + 10)
    if errors:
        k, exc = errors[0]
        raise RuntimeError(f"session {first_session + k} failed: {type(exc).__name__}: {exc}") from exc
    if len(results) != sessions * turns:
        raise RuntimeError(f"{sessions * turns - len(results)} requests did not finish in time")
    return [results[key] for key in sorted(results)]
