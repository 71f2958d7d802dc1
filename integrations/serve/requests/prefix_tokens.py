"""Tokenize a chat's text once: a later text that starts with an earlier one is tokenized from there.

A multi-turn chat sends the whole conversation every turn, and the chat template renders it to a
text that starts with the previous turn's text. A fast (Rust) tokenizer first cuts its input at the
added tokens it matches and tokenizes the pieces between them independently, so at the start ``c``
of a special token ``S`` that cuts the text (a *cut*)::

    tokenize(text) == tokenize(text[:c]) + tokenize(text[c:])

``PrefixTokenizer`` keeps, for recent texts, the token ids of their prefix up to their last cut,
and tokenizes a new text as the ids of the longest such prefix it starts with plus the tokens of
the rest: a cached chat turn costs the tokens of its new messages, not of the whole conversation.

When the identity holds (and when it does not, ``PrefixTokenizer`` tokenizes whole texts only):

- the tokenizer is a fast one (``tokenizer.is_fast``) and ``S`` is one of its special added tokens
  that is matched on the raw text with no stripping (``ChatRenderer.splitting_specials``) and
  encodes alone to one id;
- no other added token can be matched across a cut: none has a proper suffix that is a prefix of
  ``S``, or that starts with ``S`` (it would start before the cut and run into or past ``S``);
- every piece that is tokenized from a cut starts with the id of ``S`` (checked on every call, so a
  tokenizer that puts something before it, as a prefix space, is caught: the text is then
  tokenized whole, and that prefix is not kept);
- and ``check`` (run once when the tokenizer is built) finds a sample chat tokenized the same both
  ways.

Bounded: at most ``max_entries`` prefixes and ``max_chars`` characters of them, least recently used
dropped first. Thread-safe (one lock around the table; the tokenizer runs outside it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_ENTRIES = 1024
MAX_CHARS = 32 * 1024 * 1024


def cutting_specials(tokenizer, specials: tuple) -> dict:
    """Of ``specials`` (texts of special tokens that cut a text), those the identity in the module
    docstring holds for, as text -> token id; empty for a tokenizer that is not a fast one."""
    if not getattr(tokenizer, "is_fast", False):
        return {}
    added = [t.content for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values() if t.content]
    safe = {}
    for special in specials:
        ids = tokenizer(special, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            continue
        straddles = any(special.startswith(x[i:]) or x[i:].startswith(special)
                        for x in added for i in range(1, len(x)))
        if not straddles:
            safe[special] = ids[0]
    return safe


class PrefixTokenizer:
    """``tokenize(text)`` -> token ids, equal to ``encode(text)`` (see the module docstring).

    ``encode``: text -> list of ids (no special tokens added); ``specials``: the cutting specials
    (``cutting_specials``). With no specials it encodes every text whole.
    """

    def __init__(self, encode, specials: dict, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS):
        self.encode = encode
        self.specials = dict(specials)
        self.max_entries, self.max_chars = max_entries, max_chars
        self._prefixes: OrderedDict = OrderedDict()  # prefix text -> its token ids (a tuple)
        self._by_length: dict = {}  # len(prefix) -> set of prefixes of that length
        self._chars = 0
        self._lock = threading.Lock()

    def tokenize(self, text: str) -> list[int]:
        """The token ids of ``text``: the kept prefix it starts with, then its rest tokenized."""
        if not self.specials:
            return list(self.encode(text))
        cuts = self._cuts(text)
        start, head = self._longest_prefix(text, cuts)
        last = cuts[-1] if cuts else 0
        if last > start:  # tokenize up to the last cut apart, to keep that prefix's ids
            middle = self._piece(text, start, last)
            tail = self._piece(text, last, len(text))
            if middle is None or tail is None:
                return list(self.encode(text))
            self._keep(text[:last], head + middle)
            return list(head + middle + tail)
        tail = self._piece(text, start, len(text))
        return list(self.encode(text)) if tail is None else list(head + tail)

    def check(self, text: str) -> bool:
        """Whether ``text`` tokenizes the same whole and cut at each of its cuts; False also disables
        the prefixes (every text is then tokenized whole)."""
        whole = tuple(self.encode(text))
        ok = True
        for cut in self._cuts(text):
            head, tail = self._piece(text, 0, cut), self._piece(text, cut, len(text))
            ok = ok and head is not None and tail is not None and head + tail == whole
        if not ok:
            with self._lock:
                self.specials = {}
                self._prefixes.clear()
                self._by_length.clear()
                self._chars = 0
        return ok

    def kept(self) -> list[str]:
        """The prefixes kept now, least recently used first."""
        with self._lock:
            return list(self._prefixes)

    def _cuts(self, text: str) -> list[int]:
        """Start offsets (> 0) of every cutting special in ``text``, ascending."""
        cuts = set()
        for special in self.specials:
            at = text.find(special, 1)
            while at >= 0:
                cuts.add(at)
                at = text.find(special, at + len(special))
        return sorted(cuts)

    def _piece(self, text: str, start: int, end: int) -> tuple | None:
        """Tokens of ``text[start:end]``; None when it starts at a cut but not with its special's id."""
        ids = tuple(self.encode(text[start:end]))
        if start:
            special = next((s for s in self.specials if text.startswith(s, start)), None)
            if special is None or not ids or ids[0] != self.specials[special]:
                return None
        return ids

    def _longest_prefix(self, text: str, cuts: list[int]) -> tuple[int, tuple]:
        with self._lock:
            for cut in reversed(cuts):
                for prefix in self._by_length.get(cut, ()):
                    if text.startswith(prefix):
                        self._prefixes.move_to_end(prefix)
                        return cut, self._prefixes[prefix]
        return 0, ()

    def _keep(self, prefix: str, ids: tuple) -> None:
        if len(prefix) > self.max_chars:
            return
        with self._lock:
            if prefix in self._prefixes:
                self._prefixes.move_to_end(prefix)
                return
            self._prefixes[prefix] = ids
            self._by_length.setdefault(len(prefix), set()).add(prefix)
            self._chars += len(prefix)
            while len(self._prefixes) > self.max_entries or self._chars > self.max_chars:
                old, _ = self._prefixes.popitem(last=False)
                lengths = self._by_length[len(old)]
                lengths.discard(old)
                if not lengths:
                    del self._by_length[len(old)]
                self._chars -= len(old)
