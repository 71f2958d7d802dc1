"""A recording stand-in for the Anthropic Messages and OpenAI Responses APIs (stdlib only).

It answers ``POST /v1/messages`` (query string ignored), ``POST /v1/messages/count_tokens`` and
``POST /v1/responses`` with a fixed short reply, streamed (SSE) when the body asks for ``stream``,
and appends every request it gets (method, path, query, headers in order, JSON body) as one JSON
line to ``--log``. Any other path is recorded and answered 404.

The reply is a tool call when the newest input is a user turn whose text contains ``TOOL_TRIGGER``
(``echo hi``): a ``tool_use`` of ``Bash`` for Messages, a ``function_call`` of the request's shell
tool for Responses. Otherwise it is the text ``REPLY_TEXT``. Usage counts are made up (body bytes
/ 4) but consistent within a reply.

Run it as ``python tests/recording_server.py --port P --log FILE``; it prints ``listening PORT``
once it accepts connections. ``omit`` (``--omit EVENT``, repeatable) drops stream events of that
type, so a test can see what a client does without them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

REPLY_TEXT = "Hello from the recording server."
TOOL_TRIGGER = "echo hi"
SHELL_TOOLS = {  # Responses shell tools, in order of preference, and the arguments for `echo hi`
    "exec_command": {"cmd": "echo hi"},
    "shell_command": {"command": "echo hi"},
    "shell": {"command": ["bash", "-lc", "echo hi"]},
}
_ids = itertools.count(1)


def _text(content) -> str:
    """The text of a Messages / Responses content: a string, or the text of its text parts."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else []
    return "\n".join(p.get("text", "") for p in parts if isinstance(p, dict))


def wants_tool(items: list) -> bool:
    """Whether the newest message / input item, system and developer messages aside, is a user turn
    that asks for the tool call."""
    turns = [i for i in items if isinstance(i, dict) and i.get("role") not in ("system", "developer")]
    last = turns[-1] if turns else {}
    if last.get("role") != "user" or last.get("type", "message") != "message":
        return False
    content = last.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "tool_result" for p in content):
        return False
    return TOOL_TRIGGER in _text(content)


def messages_reply(body: dict) -> tuple[list, str, dict]:
    """The content blocks, stop reason and usage of the Messages reply to ``body``."""
    if wants_tool(body.get("messages") or []):
        block = {"type": "tool_use", "id": f"toolu_{next(_ids):06d}", "name": "Bash",
                 "input": {"command": "echo hi", "description": "Print hi"}}
        content, stop = [block], "tool_use"
    else:
        content, stop = [{"type": "text", "text": REPLY_TEXT}], "end_turn"
    usage = {"input_tokens": len(json.dumps(body)) // 4, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 0, "output_tokens": 12}
    return content, stop, usage


def messages_events(body: dict) -> list[tuple[str, dict]]:
    """The SSE events (type, data) of a streamed Messages reply."""
    content, stop, usage = messages_reply(body)
    message = {"id": f"msg_{next(_ids):06d}", "type": "message", "role": "assistant",
               "model": body.get("model"), "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {**usage, "output_tokens": 1}}
    events = [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]
    for index, block in enumerate(content):
        if block["type"] == "text":
            start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}),
                   ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}),
                   ("content_block_stop", {"type": "content_block_stop", "index": index})]
    events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                  "usage": {"output_tokens": usage["output_tokens"]}}),
               ("message_stop", {"type": "message_stop"})]
    return events


def responses_output(body: dict) -> list[dict]:
    """The output items of the Responses reply to ``body``."""
    items = body.get("input")
    items = items if isinstance(items, list) else [{"role": "user", "content": items or ""}]
    names = [t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)]
    shell = next((n for n in SHELL_TOOLS if n in names), None)
    if shell and wants_tool(items):
        return [{"type": "function_call", "id": f"fc_{next(_ids):06d}", "call_id": f"call_{next(_ids):06d}",
                 "name": shell, "arguments": json.dumps(SHELL_TOOLS[shell]), "status": "completed"}]
    return [{"type": "message", "id": f"msg_{next(_ids):06d}", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": REPLY_TEXT, "annotations": []}]}]


def responses_events(body: dict) -> list[tuple[str, dict]]:
    """The SSE events of a streamed Responses reply, ending with ``response.completed``."""
    output = responses_output(body)
    input_tokens = len(json.dumps(body)) // 4
    usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 12,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": input_tokens + 12}
    response = {"id": f"resp_{next(_ids):06d}", "object": "response", "created_at": int(time.time()),
                "status": "in_progress", "model": body.get("model"), "output": [], "usage": None}
    events = [("response.created", {"response": response}), ("response.in_progress", {"response": response})]
    for index, item in enumerate(output):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            events += [("response.output_item.added", {"output_index": index, "item": {**item, "status": "in_progress", "content": []}}),
                       ("response.content_part.added", {**at, "content_index": 0, "part": {**part, "text": ""}}),
                       ("response.output_text.delta", {**at, "content_index": 0, "delta": part["text"]}),
                       ("response.output_text.done", {**at, "content_index": 0, "text": part["text"]}),
                       ("response.content_part.done", {**at, "content_index": 0, "part": part})]
        else:
            events += [("response.output_item.added", {"output_index": index, "item": {**item, "status": "in_progress", "arguments": ""}}),
                       ("response.function_call_arguments.delta", {**at, "delta": item["arguments"]}),
                       ("response.function_call_arguments.done", {**at, "arguments": item["arguments"]})]
        events.append(("response.output_item.done", {"output_index": index, "item": item}))
    events.append(("response.completed", {"response": {**response, "status": "completed", "output": output, "usage": usage}}))
    return [(kind, {"type": kind, "sequence_number": n, **data}) for n, (kind, data) in enumerate(events)]


class RecordingHandler(BaseHTTPRequestHandler):
    """Records the request, then answers it (see the module docstring)."""

    server: "RecordingServer"
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # the recorded log replaces the access log
        pass

    def do_GET(self) -> None:
        self._record(None)
        self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode("utf-8", "replace")
        self._record(body)
        path = urlsplit(self.path).path
        if not isinstance(body, dict):
            self._json(400, {"error": {"message": "the body is not a JSON object"}})
        elif path == "/v1/messages/count_tokens":
            self._json(200, {"input_tokens": len(json.dumps(body)) // 4})
        elif path == "/v1/messages" and body.get("stream"):
            self._stream(messages_events(body))
        elif path == "/v1/messages":
            content, stop, usage = messages_reply(body)
            self._json(200, {"id": f"msg_{next(_ids):06d}", "type": "message", "role": "assistant",
                             "model": body.get("model"), "content": content, "stop_reason": stop,
                             "stop_sequence": None, "usage": usage})
        elif path == "/v1/responses" and body.get("stream", False):
            self._stream(responses_events(body))
        elif path == "/v1/responses":
            completed = responses_events(body)[-1][1]["response"]
            self._json(200, completed)
        else:
            self._json(404, {"error": {"message": f"no route {path}"}})

    def _record(self, body) -> None:
        parts = urlsplit(self.path)
        self.server.record({"method": self.command, "path": parts.path, "query": parts.query,
                            "headers": list(self.headers.items()), "body": body})

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: list) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        for kind, data in events:
            if kind not in self.server.omit:
                self.wfile.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()
        self.close_connection = True


class RecordingServer(ThreadingHTTPServer):
    """The HTTP server: ``log`` is the JSON-lines file each request is appended to."""

    daemon_threads = True

    def __init__(self, port: int, log: str, omit=()):
        super().__init__(("127.0.0.1", port), RecordingHandler)
        self.log, self.omit, self._lock = log, set(omit), threading.Lock()

    def record(self, entry: dict) -> None:
        with self._lock, open(self.log, "a") as out:
            out.write(json.dumps(entry) + "\n")


def read_log(path) -> list[dict]:
    """The requests a server recorded in ``path``, in order."""
    with open(path) as lines:
        return [json.loads(line) for line in lines if line.strip()]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", required=True, help="the JSON-lines file every request is appended to")
    parser.add_argument("--omit", action="append", default=[], help="a stream event type to leave out")
    args = parser.parse_args(argv)
    server = RecordingServer(args.port, args.log, args.omit)
    print(f"listening {server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
