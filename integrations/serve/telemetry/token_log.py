"""``--log-token-ids FILE``: one JSON line per finished or ended request, for offline analysis.

Each line is ``{"id", "protocol", "model", "prompt_ids", "cached_tokens", "output_ids",
"finish_reasons", "time"}``: the prompt's token ids exactly as the engine saw them, how many of them
the cache served, and each sample's output token ids (the stop token included when the engine
produced one). ``ideal_cached`` computes each request's ideal hit from these lines (what
``benchmarks/agent_clients.py`` reports the cache against).
Lines are written whole, under a lock, and flushed at once, so a reader never sees half a line
and a crash loses at most the request in flight.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from radixcache.tokens import common_prefix


class TokenLog:
    """An append-only JSON-lines file of requests (see the module docstring). ``write`` is safe from
    any thread; ``close`` is idempotent and later writes are dropped."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, *, request_id: str, protocol: str, model: str, prompt_ids, cached_tokens: int,
              output_ids, finish_reasons) -> None:
        """Append one request's line."""
        line = json.dumps({"id": request_id, "protocol": protocol, "model": model,
                           "prompt_ids": list(prompt_ids), "cached_tokens": int(cached_tokens),
                           "output_ids": [list(ids) for ids in output_ids],
                           "finish_reasons": list(finish_reasons), "time": time.time()},
                          separators=(",", ":"))
        with self._lock:
            if self._file is None:
                return
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def ideal_cached(lines, block_size: int) -> list[int]:
    """Per line of a token log, the most tokens any cache could have served: the longest prefix of
    its prompt that an earlier request's prompt followed by one of its outputs already covered,
    rounded down to whole blocks and capped at the prompt minus one token (the last prompt token is
    always computed, to get the first output's logits)."""
    seen: list[tuple] = []
    ideal = []
    for line in lines:
        prompt = line["prompt_ids"]
        best = max((common_prefix(prompt, s) for s in seen), default=0)
        ideal.append(min(best // block_size * block_size, max(len(prompt) - 1, 0)))
        seen.extend(tuple(prompt) + tuple(out) for out in line["output_ids"] or [()])
    return ideal


def read_token_log(path) -> list[dict]:
    """The lines of a token log, in the order they were written."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
