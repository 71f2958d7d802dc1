"""Token ids to text as they arrive, with OpenAI ``stop`` strings.

``TextAssembler(tokenizer, stop_strings, stop_token_ids)`` turns one sample's tokens into text
deltas. It decodes a sliding window of ids (the last complete piece plus what is new), so the text
is what ``tokenizer.decode(ids, skip_special_tokens=True)`` gives, delivered incrementally, and a
character split over several byte tokens is sent only once it is whole. Stop token ids (EOS) are
never decoded. When a stop string appears, the text ends right before it (OpenAI leaves the stop
string out; of several, the one that is complete first, reading the text left to right) and
``stopped`` becomes True (``stop_string`` is the one that matched); until then, a tail that could still grow into a stop
string is held back, so nothing sent ever has to be taken back.
"""

from __future__ import annotations

_INCOMPLETE = "\ufffd"


class TextAssembler:
    """Incremental detokenizer for one sample; see the module docstring for the contract."""

    def __init__(self, tokenizer, stop_strings=(), stop_token_ids=()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.stop_token_ids = set(stop_token_ids)
        self.ids: list[int] = []
        self.text = ""  # decoded so far (the stop string and anything after it cut off)
        self.sent = 0  # characters of ``text`` already returned
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text, once stopped
        self._prefix = 0  # ids[_prefix:_read] decode to the text just before the unread ids
        self._read = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the new text safe to send (possibly "")."""
        if self.stopped:
            return ""
        if token_id in self.stop_token_ids:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(_INCOMPLETE):
            return ""  # nothing new yet, or a character still missing bytes
        self._prefix, self._read = self._read, len(self.ids)
        return self._add(now[len(before):])

    def finish(self) -> str:
        """The text still held back (an incomplete character, a possible stop-string start)."""
        if not self.stopped and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            now = self._decode(self.ids[self._prefix:])
            self._prefix = self._read = len(self.ids)
            self._add(now[len(before):], final=True)
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _add(self, delta: str, final: bool = False) -> str:
        start = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0) + 1)
        self.text += delta
        hits = [(p + len(s), p, s) for s in self.stop_strings if (p := self.text.find(s, start)) >= 0]
        if hits:  # the stop string completed first wins (so the cut does not depend on token size)
            _, cut, self.stop_string = min(hits)
            self.text = self.text[:cut]
            self.stopped = True
            end = len(self.text)
        else:
            end = len(self.text) if final else len(self.text) - self._held_tail()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def _held_tail(self) -> int:
        """Length of the longest end of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stop_strings), default=1) - 1), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return n
        return 0
