"""A model-free ``ModelRunner`` whose next token depends on every cached token: engine tests and
benchmarks without weights.

``StubRunner`` writes each new token's id as its key (and its position as its value) into layer 0
of a one-head, one-dimension ``KVPool`` through the step's plan, exactly as a model's layer would.
With ``read_kv=True`` (the default) every logits row then reads back the keys of its whole
sequence through the sequence's block table and puts all the mass on ``next_token`` of what it
read: a block shared, copied, evicted, preempted or matched wrongly gives a different token than
``next_token`` over the true sequence, so ``reference`` (the tokens a correct engine produces)
checks the whole cache lifecycle. ``read_kv=False`` uses only the last token and its position
(for scheduling benchmarks, where the readback would dominate the step).

``stub_engine`` builds a ``CacheManager``, that pool, a ``StubBackend`` (it plans nothing: the stub
never attends) and the ``Engine`` over them.
"""

from __future__ import annotations

import torch

from radixcache.engine.engine import Engine
from radixcache.engine.runner import ModelRunner
from radixcache.kv.pool import KVPool
from radixcache.lifecycle.manager import CacheManager

MIX = 2654435761  # Knuth's multiplicative hash constant: spreads the weighted sums over the vocabulary
ONE_HOT = 100.0  # the chosen logit: sampling at any temperature near 1 picks it too (e**-100 elsewhere)


def next_token(tokens, vocab_size: int) -> int:
    """The stub's next token after ``tokens`` (every token of the sequence so far)."""
    weighted = sum((i + 1) * t for i, t in enumerate(tokens))
    return (weighted * MIX + len(tokens)) % vocab_size


def reference(prompt, max_new_tokens: int, vocab_size: int, stop_token_ids=()) -> list:
    """What a correct engine generates greedily for ``prompt`` over a ``StubRunner``."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = next_token(seq, vocab_size)
        seq.append(token)
        out.append(token)
        if token in stop_token_ids:
            break
    return out


class StubBackend:
    """An attention backend for runners that never attend: plans nothing."""

    name = "stub"

    def plan(self, step) -> None:
        """No per-step state."""
        return None


class StubRunner(ModelRunner):
    """See the module docstring. ``calls`` records each forward's ``(tokens, positions)`` (lists);
    ``fail_at`` (a call number, counted from 1) makes that forward raise ``RuntimeError``."""

    def __init__(self, vocab_size: int = 997, *, read_kv: bool = True, model_id: str = "stub"):
        self.vocab_size = vocab_size
        self.device = torch.device("cpu")
        self.model_id = model_id
        self.read_kv = read_kv
        self.calls: list = []
        self.fail_at: int | None = None

    def forward(self, tokens: list, positions: list, plan, logits_rows: list) -> torch.Tensor:
        """See ``ModelRunner.forward``."""
        self.calls.append((list(tokens), list(positions)))
        if self.fail_at == len(self.calls):
            raise RuntimeError(f"stub forward {len(self.calls)} failed on purpose")
        n = len(tokens)
        keys = torch.tensor(tokens, dtype=torch.float32).view(n, 1, 1)
        values = torch.tensor(positions, dtype=torch.float32).view(n, 1, 1)
        for layer in range(plan.pool.num_layers):
            plan.write(layer, keys, values)
        logits = torch.zeros(len(logits_rows), self.vocab_size)
        for out, row in enumerate(logits_rows):
            logits[out, self._next(plan, row, tokens, positions)] = ONE_HOT
        return logits

    def _next(self, plan, row: int, tokens: list, positions: list) -> int:
        if not self.read_kv:
            return (tokens[row] * MIX + positions[row] + 1) % self.vocab_size
        seg = next(s for s in plan.segments if s.q_start <= row < s.q_start + s.q_len)
        end = seg.kv_len - seg.q_len + (row - seg.q_start) + 1
        pool = plan.pool
        keys, values = pool.read(0, pool.rows_for(seg.blocks, 0, end))
        if not torch.equal(values.view(-1), torch.arange(end, dtype=values.dtype)):
            return 0  # a position holds another position's K/V: a token no reference expects
        return next_token(keys.view(-1).to(torch.int64).tolist(), self.vocab_size)


def stub_engine(num_blocks: int = 256, block_size: int = 4, *, vocab_size: int = 997,
                read_kv: bool = True, store=None, **options) -> Engine:
    """An ``Engine`` over a fresh ``CacheManager`` of ``num_blocks`` blocks, a one-layer stub pool
    and a ``StubRunner``; ``options`` go to ``Engine`` (``max_running``, ``max_step_tokens``,
    ``schedule``, ``starvation_rounds``)."""
    pool = KVPool(1, num_blocks, block_size, 1, 1, dtype=torch.float32, device="cpu")
    manager = CacheManager(num_blocks, block_size, pool=pool, store=store)
    return Engine(manager, pool, StubRunner(vocab_size, read_kv=read_kv), StubBackend(), **options)
