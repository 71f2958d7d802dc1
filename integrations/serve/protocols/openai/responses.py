"""The OpenAI Responses protocol (``/v1/responses``), as an adapter over ``job`` and ``generation``.

A request (``responses_request.py``) becomes the one internal ``Conversation``: the
``instructions`` as a first system message, then the items as chat messages (``to_messages``), with
the function tools; then ``job.new_job`` builds the engine's ``Request``. Its reply becomes output
items: a ``message`` (``output_text``; left out when the reply is only tool calls) and one
``function_call`` per call (``call_id`` is the chat tool call's id, so an echoed call is the same
assistant message the reply's history form was made from: stateless clients such as Codex, which
resend every item with ``store: false``, hit the cache through the history form exactly as chat
clients do).

Stored responses (``response_store.py``): with ``store`` (the default) a finished response keeps its
prompt and output token ids. A request naming it in ``previous_response_id`` continues it:

- with the same ``instructions`` and tools, its prompt is the stored ids followed by the tokens of
  only what the template writes after them (``continued_prompt``): the past turns are the tokens
  the model saw and produced, never rendered again, so the whole stored prefix is a cache hit;
- otherwise (instructions do not carry over, as in OpenAI's API; or the template writes the past
  differently from the stored tokens), the conversation is rendered anew from the stored messages
  and the new items, and the short hit is reported (a log line, ``short_hits{reason=
  "previous_response_rendered_anew"}``).

An unknown, deleted, expired or ``store: false`` id is a 404 naming it (``param:
previous_response_id``). Streams are named SSE events with ``sequence_number`` (see ``events``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from itertools import count

from radixcache.integrations.serve.requests.structured import json_constraint, tool_call_constraint
from radixcache.integrations.serve.errors import APIError, bad_request
from radixcache.integrations.serve.requests.job import Conversation, new_job, render_conversation
from radixcache.integrations.serve.access import caller_of
from radixcache.integrations.serve.admission import resolve_model
from radixcache.integrations.serve.protocols.openai.responses_request import NamedFunction, to_messages
from radixcache.integrations.serve.protocols.openai.response_store import StoredResponse
from radixcache.tokens import common_prefix

logger = logging.getLogger("radixcache.serve")
RENDERED_ANEW = "previous_response_rendered_anew"


def not_found(response_id: str, param: str | None = None) -> APIError:
    """404 for a response id this server does not hold (for this key)."""
    what = "Previous response" if param else "Response"
    return APIError(404, f"{what} with id {response_id!r} not found.", param=param, code="not_found")


def continued_prompt(renderer, stored_ids, messages: list, tools) -> tuple | None:
    """``stored_ids`` followed by the tokens of what the template writes after them for
    ``messages`` (the stored conversation, then the new messages, then the generation prompt), or
    None when that would not be the same text as rendering ``messages`` whole: the stored ids must
    decode to a prefix of the whole render, and end where the tokenizer cuts the text (at a special
    token on either side), so the rest tokenizes as it does in the whole render."""
    whole = renderer.render_text(messages, tools)
    past = renderer.tokenizer.decode(list(stored_ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
    rest = whole[len(past):]
    if not whole.startswith(past) or not rest:
        return None
    specials = renderer.splitting_specials
    if not any(past.endswith(s) for s in specials) and not any(rest.startswith(s) for s in specials):
        return None
    return tuple(stored_ids) + tuple(renderer.tokenize(rest))


@dataclass
class Turn:
    """What the adapter keeps around one response: the request (its ``namespaces`` say where each
    function came from), the conversation (messages without the instructions: the stored
    conversation it continues, then the new items) and the creation time."""

    req: object
    messages: list
    created_at: int

    def response(self, rid: str, model: str, status: str, output: list, usage: dict | None,
                 error: dict | None = None, incomplete: dict | None = None) -> dict:
        """The ``response`` object in OpenAI's shape."""
        req = self.req
        return {"id": rid, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error, "incomplete_details": incomplete,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "model": model, "output": output, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id, "reasoning": req.reasoning or {},
                "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
                "text": {"format": req.text_format.model_dump(by_alias=True, exclude_none=True)},
                "tool_choice": _tool_choice(req.tool_choice), "tools": req.tools or [],
                "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
                "usage": usage, "metadata": req.metadata or {},
                "prompt_cache_key": req.prompt_cache_key}


def _tool_choice(choice):
    if isinstance(choice, NamedFunction):
        return {"type": "function", "name": choice.name}
    return choice or "auto"


def _constraint(req, tools):
    if tools and req.tool_choice == "required":
        return tool_call_constraint(tools, None, req.parallel_tool_calls)
    if tools and isinstance(req.tool_choice, NamedFunction):
        return tool_call_constraint(tools, req.tool_choice.name, req.parallel_tool_calls)
    fmt = req.text_format
    if fmt.type == "json_object":
        return json_constraint(param="text.format")
    if fmt.type == "json_schema":
        return json_constraint(fmt.schema_, bool(fmt.strict), param="text.format")
    return None


async def responses_job(state, req, key: str | None):
    """``(Job, Turn)`` of a validated ``ResponsesRequest`` (see the module docstring)."""
    model = resolve_model(req.model, state.model_names)
    caller = caller_of(state, key, req.cache_salt)
    tools = req.functions
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    new = to_messages(req.items)
    past, prompt_ids, history = [], None, True
    if req.previous_response_id is not None:
        stored = state.responses.get(req.previous_response_id, caller.tenant)
        if stored is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        past = stored.messages
        conversation = Conversation(instructions + past + new, tools)
        same = stored.instructions == req.instructions and stored.tools == tools
        if same:
            try:
                prompt_ids = await state.render(continued_prompt, state.renderer, stored.token_ids,
                                                conversation.messages, tools)
            except ValueError as exc:
                raise bad_request(str(exc), param="input") from None
            history = prompt_ids is None  # the stored ids are the prefix: no history form to compute
        if prompt_ids is None:
            prompt_ids = (await render_conversation(state, conversation, caller)).token_ids
            _report_anew(state, req, stored, prompt_ids, "instructions or tools differ" if not same else
                         "the template writes the past turns differently from their stored tokens")
    else:
        conversation = Conversation(instructions + new, tools)
        prompt_ids = (await render_conversation(state, conversation, caller)).token_ids
    try:
        job = new_job(state, "responses", model, prompt_ids, id_prefix="resp", caller=caller,
                      max_tokens=req.max_output_tokens,
                      temperature=1.0 if req.temperature is None else req.temperature,
                      top_p=1.0 if req.top_p is None else req.top_p, stream=req.stream, keep_s=req.keep_s,
                      conversation=conversation, parse_tools=bool(tools) and req.tool_choice != "none",
                      clamp_max_tokens=True, constraint=_constraint(req, tools),
                      single_tool_call=not req.parallel_tool_calls)
    except APIError as exc:
        if exc.param in ("messages", "prompt"):  # chat's names for what this protocol calls input
            exc.param = "input"
        raise
    job.history_form = history
    return job, Turn(req, past + new, int(time.time()))


def _report_anew(state, req, stored, prompt_ids, why: str) -> None:
    block = state.limits.block_size
    kept = common_prefix(stored.token_ids, prompt_ids)
    expected = (len(stored.token_ids) - 1) // block * block
    missed = max(0, expected - kept // block * block)
    state.metrics.observe_short_hit(RENDERED_ANEW, missed)
    logger.debug("responses: previous_response_id %s rendered anew (%s): %d of its %d stored tokens kept",
                req.previous_response_id, why, kept, len(stored.token_ids))


# ---------------------------------------------------------------------- output
def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_items(sample, namespaces: dict) -> list:
    items = []
    for call in sample.tool_calls or []:
        name = call["function"]["name"]
        item = {"type": "function_call", "id": _item_id("fc"), "status": "completed", "call_id": call["id"],
                "name": name, "arguments": call["function"]["arguments"]}
        if namespaces.get(name):
            item["namespace"] = namespaces[name]
        items.append(item)
    return items


def _usage(generation) -> dict:
    prompt, output = len(generation.job.prompt_ids), generation.completion_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": generation.cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def _finish(state, generation, turn: Turn, message_id: str | None) -> dict:
    """The finished response (stored when the request asks for it), its output made of the reply."""
    job, sample = generation.job, generation.choices[0]
    output = []
    if sample.content or not sample.tool_calls:
        output.append(_message_item(message_id or _item_id("msg"), sample.content))
    output += _call_items(sample, turn.req.namespaces)
    incomplete = {"reason": "max_output_tokens"} if sample.finish == "length" else None
    response = turn.response(generation.request_id, job.model, "incomplete" if incomplete else "completed",
                             output, _usage(generation), incomplete=incomplete)
    if turn.req.store:
        state.responses.put(generation.request_id, StoredResponse(
            response, job.tenant, turn.req.instructions, turn.req.functions,
            turn.messages + [sample.message()], tuple(job.prompt_ids), tuple(sample.tokens)))
    return response


def body(state, turn: Turn, generation) -> dict:
    """The JSON body of a finished response."""
    return _finish(state, generation, turn, None)


def _event(seq, kind: str, **fields) -> str:
    data = json.dumps({"type": kind, "sequence_number": next(seq), **fields}, ensure_ascii=False,
                      separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


async def events(state, turn: Turn, generation):
    """The SSE events of a streamed response: ``response.created``, ``response.in_progress``; for the
    text, ``output_item.added``, ``content_part.added``, ``output_text.delta``s, then ``.done``s;
    per tool call, ``output_item.added``, ``function_call_arguments.delta`` / ``.done``,
    ``output_item.done``; then ``response.completed`` (or ``response.incomplete`` at the output
    cap). An error after the stream started is a ``response.failed`` carrying it."""
    seq, rid, model = count(), generation.request_id, generation.job.model
    start = turn.response(rid, model, "in_progress", [], None)
    yield _event(seq, "response.created", response=start)
    yield _event(seq, "response.in_progress", response=start)
    message_id = None
    try:
        async for delta in generation.deltas():
            if delta.content and message_id is None:
                message_id = _item_id("msg")
                added = {**_message_item(message_id, "", "in_progress"), "content": []}
                yield _event(seq, "response.output_item.added", output_index=0, item=added)
                yield _event(seq, "response.content_part.added", item_id=message_id, output_index=0,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            if delta.content:
                yield _event(seq, "response.output_text.delta", item_id=message_id, output_index=0,
                             content_index=0, delta=delta.content, logprobs=[])
        response = _finish(state, generation, turn, message_id)
    except APIError as exc:
        state.metrics.observe_rejected(exc.status)
        failed = turn.response(rid, model, "failed", [], None, error={"code": exc.code or "server_error",
                                                                        "message": exc.message})
        yield _event(seq, "response.failed", response=failed)
        return
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            if message_id is None:  # an empty reply: its item is announced now
                yield _event(seq, "response.output_item.added", output_index=index,
                             item={**item, "status": "in_progress", "content": []})
                yield _event(seq, "response.content_part.added", item_id=item["id"], output_index=index,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            part = item["content"][0]
            yield _event(seq, "response.output_text.done", item_id=item["id"], output_index=index,
                         content_index=0, text=part["text"], logprobs=[])
            yield _event(seq, "response.content_part.done", item_id=item["id"], output_index=index,
                         content_index=0, part=part)
        else:
            yield _event(seq, "response.output_item.added", output_index=index,
                         item={**item, "status": "in_progress", "arguments": ""})
            yield _event(seq, "response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                         delta=item["arguments"])
            yield _event(seq, "response.function_call_arguments.done", item_id=item["id"], output_index=index,
                         name=item["name"], arguments=item["arguments"])
        yield _event(seq, "response.output_item.done", output_index=index, item=item)
    yield _event(seq, f"response.{response['status']}", response=response)
