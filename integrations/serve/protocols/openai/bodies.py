"""Response bodies and server-sent-event chunks in OpenAI's shapes.

Every function returns plain JSON-ready dicts (or SSE text). ``usage`` always carries
``prompt_tokens_details.cached_tokens``. Streams follow OpenAI: with
``stream_options.include_usage`` every chunk has ``"usage": null`` and one last chunk with
``choices: []`` carries the usage; without it the chunk that finishes the last choice carries the
usage (so a stream's cached tokens are visible either way, and ``chunk.choices[0]`` never fails).
"""

from __future__ import annotations

import json
import time

SSE_DONE = "data: [DONE]\n\n"


def now() -> int:
    """``created``: seconds since the epoch."""
    return int(time.time())


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's ``usage`` with ``prompt_tokens_details.cached_tokens``."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_choice(index: int, message: dict, finish_reason: str, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries, decode) -> dict:
    """A chat choice's ``logprobs``: one ``content`` entry per ``(token id, TokenLogprobs)`` of
    ``entries``, each with its ``top_logprobs``; ``decode(id)`` is a token's text (its ``bytes`` are
    that text's UTF-8, so a token that is part of a character reads as U+FFFD)."""
    return {"content": [{**_token(decode(t), lp.logprob),
                         "top_logprobs": [_token(decode(i), v) for i, v in lp.top]} for t, lp in entries],
            "refusal": None}


def completion_logprobs(entries, decode, offset: int = 0) -> dict:
    """A completion choice's legacy ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset`` counted from ``offset``) for ``(token id, TokenLogprobs)`` ``entries``."""
    tokens = [decode(t) for t, _ in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for _, lp in entries],
            "top_logprobs": [{decode(i): v for i, v in lp.top} for _, lp in entries], "text_offset": offsets}


def chat_completion(response_id: str, created: int, model: str, choices: list[dict], usage_: dict) -> dict:
    """The body of a non-streaming ``/v1/chat/completions`` response."""
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_}


def chat_chunk(response_id: str, created: int, model: str, choices: list[dict],
               usage_: dict | None = None, usage_null: bool = False) -> dict:
    """One ``chat.completion.chunk``; ``usage_null`` writes ``"usage": null`` (include_usage streams)."""
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices}
    if usage_ is not None or usage_null:
        chunk["usage"] = usage_
    return chunk


def delta_choice(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
    """A streamed choice: ``delta`` holds ``role``, ``content`` and/or ``tool_calls`` pieces."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def tool_call_deltas(tool_calls: list[dict]) -> list[dict]:
    """Streamed ``tool_calls`` entries: each whole call in one piece, with its ``index``."""
    return [{"index": i, **call} for i, call in enumerate(tool_calls)]


def text_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """A ``/v1/completions`` choice (whole, or one streamed piece)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion(response_id: str, created: int, model: str, choices: list[dict], usage_: dict | None,
               usage_null: bool = False) -> dict:
    """A ``text_completion`` body or streamed chunk (``usage_`` None in chunks that carry none)."""
    body = {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None or usage_null:
        body["usage"] = usage_
    return body


def model_list(names, created: int, root: str, max_model_len: int, owner: str = "radixcache") -> dict:
    """The body of ``GET /v1/models``: one entry per served name, each with the model it serves
    (``root``: the model directory's name) and its context length (``max_model_len``), as vLLM
    lists them. ``owned_by`` stays neither "vllm" nor "sglang": a router (SMG) that reads it must
    not take this server for either engine."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": owner, "root": root,
                                        "max_model_len": max_model_len} for name in names]}
