"""Stored responses of ``/v1/responses``: what ``previous_response_id`` and ``GET`` read back.

A ``StoredResponse`` keeps a finished response exactly: the response object as it was returned, the
token ids of its prompt and of its output (the stop token included when the model produced one),
and the conversation they stand for (its messages without the instructions, the reply last; the
instructions and the function tools apart, since those do not carry over to the next request).

``ResponseStore`` holds them in an ``OrderedDict`` (least recently used first), bounded in bytes
(``max_bytes``: ids at 4 bytes a token plus the JSON size of the messages and the response object)
and in time (``ttl_s`` since a response was stored): storing one drops expired and then least
recently used responses until the rest fits; a response larger than the whole bound is not kept.
Every lookup names the tenant (``job.Caller.tenant``): a response stored by one API key is not found
with another (unless ``--share-cache-across-keys``). Used from the event loop only.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_MAX_BYTES = 256 << 20
DEFAULT_TTL_S = 24 * 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """One stored response (see the module docstring). ``messages[-1]`` is the reply."""

    response: dict
    salt: str | None
    instructions: str | None
    tools: list | None
    messages: list
    prompt_ids: tuple
    output_ids: tuple

    @property
    def token_ids(self) -> tuple:
        """Every token the model saw or produced: prompt then output."""
        return self.prompt_ids + self.output_ids

    @property
    def nbytes(self) -> int:
        text = json.dumps([self.response, self.instructions, self.tools, self.messages], ensure_ascii=False)
        return 4 * (len(self.prompt_ids) + len(self.output_ids)) + len(text.encode())


class ResponseStore:
    """See the module docstring. ``clock`` (monotonic seconds) is for tests."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float = DEFAULT_TTL_S, clock=time.monotonic):
        if max_bytes < 1 or ttl_s <= 0:
            raise ValueError(f"a response store needs max_bytes >= 1 and ttl_s > 0, got {max_bytes}, {ttl_s}")
        self.max_bytes, self.ttl_s, self.clock = max_bytes, ttl_s, clock
        self.bytes = 0
        self._entries: OrderedDict = OrderedDict()  # id -> (StoredResponse, nbytes), least recently used first
        self._stored_at: OrderedDict = OrderedDict()  # id -> when it was stored, oldest first

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, stored: StoredResponse) -> bool:
        """Keep ``stored`` under ``response_id`` (replacing what the id held) as the most recent;
        False when it alone is too large."""
        if response_id in self._entries:
            self._drop(response_id)
        size = stored.nbytes
        if size > self.max_bytes:
            return False
        self._expire()
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = (stored, size)
        self._stored_at[response_id] = self.clock()
        self.bytes += size
        return True

    def get(self, response_id: str, salt: str | None) -> StoredResponse | None:
        """The stored response (now the most recently used), or None: unknown, expired, deleted or
        stored under another salt."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry[0].salt != salt:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str, salt: str | None) -> bool:
        """Forget a response; False when there was none to forget (for this salt)."""
        entry = self._entries.get(response_id)
        if entry is None or entry[0].salt != salt:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        deadline = self.clock() - self.ttl_s
        while self._stored_at and next(iter(self._stored_at.values())) <= deadline:
            self._drop(next(iter(self._stored_at)))

    def _drop(self, response_id: str) -> None:
        _, size = self._entries.pop(response_id)
        del self._stored_at[response_id]
        self.bytes -= size
