"""A bounded soak of ``radixcache serve``: many sessions on mixed protocols for minutes, a third of
the streams dropped, and what is left at the end.

Starts ``radixcache serve`` (a subprocess on a free loopback port; a tiny random Llama with the
embedded tokenizer unless ``--model``), then runs ``--sessions`` sessions at once for ``--minutes``.
Session i speaks one protocol, in turn: chat streamed, chat, completions streamed, Anthropic
Messages streamed (the ``anthropic`` client), Responses streamed; each turn appends the reply and
a new user message (a conversation restarts after ``--turns`` turns, so the context stays bounded).
Every third stream is dropped after one to three chunks (the client closes the connection).

Reported: requests per protocol, streams dropped, errors (any failure that was not a drop; target
0), what the server still holds once the clients stop (requests running or waiting and pool blocks
that cannot be had, from ``/v1/loads``; target 0 each), and the server's resident memory (VmRSS of
its process, sampled every 5 s): the median of the first minute after the warm-up (the first fifth
of the run, at least one minute) against the median of the last minute (target: within 10 %).

    python benchmarks/soak.py [--model DIR] [--minutes 10] [--sessions 16] [--turns 6]
                              [--max-tokens 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402

from report import table  # noqa: E402

PROTOCOLS = ("chat stream", "chat", "completions stream", "messages stream", "responses stream")
SAMPLE_S = 5.0


class Tally:
    """Counts shared by the session threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(PROTOCOLS, 0)
        self.dropped = 0
        self.errors: list = []

    def done(self, protocol: str, dropped: bool = False) -> None:
        with self.lock:
            self.requests[protocol] += 1
            self.dropped += dropped

    def error(self, protocol: str, exc: BaseException) -> None:
        with self.lock:
            self.requests[protocol] += 1
            self.errors.append(f"{protocol}: {type(exc).__name__}: {exc}"[:300])


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one_turn(base: str, protocol: str, messages: list, max_tokens: int, drop: bool) -> tuple[str, bool]:
    """Send one turn; ``(reply text, dropped)``. A dropped stream is closed after 1-3 chunks."""
    o = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    keep = 1 + len(messages) % 3
    if protocol == "chat":
        out = o.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0)
        return out.choices[0].message.content or "", False
    if protocol == "chat stream":
        stream = o.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0.7,
                                           stream=True)
        text = ""
        for n, chunk in enumerate(stream):
            if drop and n >= keep:
                stream.close()
                return text, True
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return text, False
    if protocol == "completions stream":
        prompt = "\n".join(m["content"] for m in messages)
        stream = o.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
        text = ""
        for n, chunk in enumerate(stream):
            if drop and n >= keep:
                stream.close()
                return text, True
            text += "".join(c.text for c in chunk.choices)
        return text, False
    if protocol == "messages stream":
        a = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)
        text = ""
        with a.messages.stream(model="m", max_tokens=max_tokens, messages=messages) as stream:
            for n, piece in enumerate(stream.text_stream):
                if drop and n >= keep:
                    return text, True
                text += piece
        return text, False
    stream = o.responses.create(model="m", input=messages, max_output_tokens=max_tokens, stream=True)
    text = ""
    for n, event in enumerate(stream):
        if drop and n >= keep:
            stream.close()
            return text, True
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.failed":
            raise RuntimeError(f"response.failed: {event.response.error}")
    return text, False


def session(base: str, index: int, args, deadline: float, tally: Tally) -> None:
    protocol = PROTOCOLS[index % len(PROTOCOLS)]
    streams = itertools.count()
    while time.monotonic() < deadline:
        messages = [{"role": "user", "content": f"Session {index}: tell me about the river number {index}."}]
        for turn in range(args.turns):
            if time.monotonic() >= deadline:
                return
            drop = "stream" in protocol and next(streams) % 3 == 2
            try:
                reply, dropped = one_turn(base, protocol, messages, args.max_tokens, drop)
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                tally.error(protocol, exc)
                break
            tally.done(protocol, dropped)
            messages = messages + [{"role": "assistant", "content": reply or "."},
                                   {"role": "user", "content": f"And then, part {turn + 2}?"}]


def main(argv=None) -> int:
    from server_process import ServerProcess, free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a local model directory (default: a tiny random Llama)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="radixcache-soak-") as tmp:
        work = Path(tmp)
        if args.model:
            model_dir = Path(args.model)
        else:
            from faults import tiny_model_dir

            model_dir = tiny_model_dir(work / "tiny-model")
        port = free_port()
        server = ServerProcess("soak", [sys.executable, "-m", "radixcache.app.cli", "serve", "--model", str(model_dir),
                                        "--port", str(port), "--served-model-name", "m",
                                        "--max-cache-tokens", "65536"], work, 300)
        tally, samples = Tally(), []
        began = time.monotonic()
        deadline = began + args.minutes * 60
        try:
            threads = [threading.Thread(target=session, args=(server.base, i, args, deadline, tally), daemon=True)
                       for i in range(args.sessions)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                samples.append((time.monotonic() - began, rss_bytes(server.proc.pid)))
                time.sleep(SAMPLE_S)
            for t in threads:
                t.join(180)
            left = {"num_running_reqs": -1, "num_waiting_reqs": -1, "num_used_tokens": -1}
            settle = time.monotonic() + 60
            while time.monotonic() < settle:
                left = httpx.get(server.base + "/v1/loads", timeout=10).json()["loads"][0]
                if not (left["num_running_reqs"] or left["num_waiting_reqs"] or left["num_used_tokens"]):
                    break
                time.sleep(0.5)
            alive = server.proc.poll() is None
        finally:
            server.stop()
    elapsed = samples[-1][0] if samples else 0.0
    warm = max(60.0, elapsed / 5)
    first = [rss for t, rss in samples if warm <= t < warm + 60] or [samples[-1][1]]
    last = [rss for t, rss in samples if t >= elapsed - 60]
    rss_first, rss_last = statistics.median(first), statistics.median(last)
    growth = rss_last / rss_first - 1
    total = sum(tally.requests.values())
    rows = [[p, str(n)] for p, n in tally.requests.items()]
    print(f"soak: {args.sessions} sessions for {args.minutes:g} min, {total} requests, {tally.dropped} streams "
          f"dropped, {len(tally.errors)} errors")
    print(table(["protocol", "requests"], rows))
    print()
    print(table(["left running", "left waiting", "blocks held", "RSS after warm-up", "RSS at the end", "growth",
                 "server alive"],
                [[str(left["num_running_reqs"]), str(left["num_waiting_reqs"]), str(left["num_used_tokens"] // 16),
                  f"{rss_first / 2**20:.0f} MiB", f"{rss_last / 2**20:.0f} MiB", f"{growth:+.1%}", str(alive)]]))
    for line in tally.errors[:5]:
        print("error:", line)
    if args.json:
        Path(args.json).write_text(json.dumps({"requests": tally.requests, "dropped": tally.dropped,
                                               "errors": tally.errors, "left": left, "rss": samples,
                                               "growth": growth}, indent=1))
    ok = (not tally.errors and alive and not (left["num_running_reqs"] or left["num_waiting_reqs"]
                                              or left["num_used_tokens"]) and growth <= 0.10)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
