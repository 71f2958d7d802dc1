"""Packing one engine step: the new tokens of every scheduled sequence in one ragged forward.

``pack_batch`` lays the sequences of a step end to end: for each ``(seq, k)`` its next ``k``
tokens (a prompt chunk or a single decode token) at their positions, one attention ``Segment``
over the sequence's blocks, and, when those ``k`` tokens end the sequence's tokens and the
request wants a next token, the row whose logits the step keeps.
"""

from __future__ import annotations

from radixcache.attention.plan import Segment


def pack_batch(batch) -> tuple[list, list, list, list]:
    """``(tokens, positions, segments, keep)`` of ``batch`` (a list of ``(Sequence, k)``):
    the packed token ids and their positions, one ``Segment`` per sequence (its offset in the
    packed tokens, ``k``, its K/V length after the step, its blocks), and the packed indices whose
    logits are needed, in batch order (empty when no sequence needs one)."""
    tokens, positions, segments, keep = [], [], [], []
    for seq, k in batch:
        start = seq.computed
        segments.append(Segment(len(tokens), k, start + k, tuple(seq.lease.blocks)))
        tokens.extend(seq.tokens[start:start + k])
        positions.extend(range(start, start + k))
        if start + k == len(seq.tokens) and not seq.request.prefill_only:
            keep.append(len(tokens) - 1)
    return tokens, positions, segments, keep
