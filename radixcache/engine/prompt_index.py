"""Which sequences share a prompt's first blocks: one dictionary lookup per question.

The scheduler asks, for a waiting sequence, whether a prompt still being computed (a running
prefill, or a prefill-only request still waiting) shares with it at least one whole block more
than the tree holds. Comparing the waiting sequence with every such prompt costs O(W x P x L) per
step; ``PromptIndex`` files each member's prompt under the chained hash of every prefix of whole
blocks (``Sequence.block_hashes``), so the question is one lookup plus one exact comparison of the
candidate's tokens (hash collisions cannot make it answer wrongly).
"""

from __future__ import annotations

from radixcache.engine.sequence import Sequence


class PromptIndex:
    """Member sequences, filed under the chained hash of their namespace and every prefix of whole
    blocks of their prompts (``tokens[:prompt_len]``). A key names one member, or a list of them
    (oldest first) where prompts share blocks: no container per block, so filing a prompt does not
    wake the garbage collector."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._members: dict[Sequence, list] = {}  # member -> its keys
        self._by_key: dict[int, Sequence | list] = {}  # key -> the member, or members

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, seq: Sequence) -> bool:
        return seq in self._members

    def add(self, seq: Sequence) -> None:
        """File ``seq``'s prompt (a no-op when it is a member)."""
        if seq in self._members:
            return
        n = seq.prompt_len // self.block_size
        keys = seq.block_hashes(n, self.block_size)[:n]
        by_key = self._by_key
        for key in keys:
            held = by_key.setdefault(key, seq)
            if held is not seq:
                if type(held) is list:
                    held.append(seq)
                else:
                    by_key[key] = [held, seq]
        self._members[seq] = keys

    def discard(self, seq: Sequence) -> None:
        """Forget ``seq`` (a no-op when it is not a member)."""
        keys = self._members.pop(seq, None)
        by_key = self._by_key
        for key in keys or ():
            held = by_key[key]
            if held is seq:
                del by_key[key]
            else:
                held.remove(seq)
                if len(held) == 1:
                    by_key[key] = held[0]

    def sync(self, members) -> None:
        """Make the members exactly ``members`` (each added or dropped once in its life)."""
        wanted = dict.fromkeys(members)
        for seq in [s for s in self._members if s not in wanted]:
            self.discard(seq)
        for seq in wanted:
            self.add(seq)

    def sharing(self, seq: Sequence, blocks: int) -> Sequence | None:
        """The first member other than ``seq`` in its namespace whose prompt starts with the first
        ``blocks`` whole blocks of ``seq.tokens[:-1]``, or None."""
        bs = self.block_size
        if not self._members or blocks < 1 or blocks > (len(seq.tokens) - 1) // bs:
            return None
        held = self._by_key.get(seq.block_hashes(blocks, bs)[blocks - 1])
        if held is None:
            return None
        bucket = held if type(held) is list else (held,)
        end = blocks * bs
        mine = seq.tokens[:end]
        return next((other for other in bucket if other is not seq and other.live.namespace ==
                     seq.live.namespace and other.tokens[:end] == mine), None)
