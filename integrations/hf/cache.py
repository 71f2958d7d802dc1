"""transformers ``Cache`` objects that write K/V into the paged pool and let radixcache attend.

A model's attention layer calls ``cache.update(key, value, layer)`` and then its attention function.
A ``PlannedCache`` returns its inputs unchanged and marks the layer pending in this thread;
radixcache's registered attention function (``attention.py``) recognises the attention call that
follows (``take_planned``), writes the K/V it is handed (the new tokens' K/V as the layer attends
over them: for MLA models the per-head K and V expanded from the latent the model cached) into the
pool through the forward's ``StepPlan``, and attends over the block tables through the backend.
Anything else (a forward with another cache, or none) is served by the model's own attention and
masks.

Models whose attention layers do not call transformers' attention functions (Falcon computes SDPA
itself) never reach the hook: their caches run *dense* (``hooked(model)`` is False). ``update``
then writes the new K/V and returns each row's whole K/V gathered from the pool, as a
``DynamicCache`` would, the sizes reported to the mask builders carry no marker, and the model's own
attention and masks compute the layer.

- ``StepCache``: one engine step, its plan fixed in advance (a ``[1, T]`` packed forward; dense: a
  single segment, ``[1, q_len]``).
- ``PagedCache``: the cache ``lm.generate`` hands to transformers' own ``generate``: a batch of
  rows, each with a ``Lease``. At layer 0 of every forward it commits what the previous forward
  computed, grows each row's blocks to the new length (lazily: blocks grow as tokens arrive) and
  plans the step. Left padding and already-cached columns are in no segment: the real query rows
  are gathered for attention and scattered back. Under a compiled runner the forward runs as the
  engine's packed step instead (``begin_packed``, ``runner.route_generate_forwards``).

A compiled engine step (``compiled_step``) plans its ``StepCache`` before the graph runs; while
it is traced, ``update`` returns its inputs and the attention hook calls one opaque op that writes
and attends (``attention.paged_attention_op``), so the graph holds no Python of the cache.

What transformers sees of these besides the cache itself: the per-layer views its ``Cache`` API
expects (``CacheLayer``) and the marked KV offset reported to its mask builders (``PagedOffset``);
all K/V state lives in the owning cache.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from radixcache.attention.plan import Segment, StepPlan, device_tensor
from radixcache.errors import CacheError, OutOfBlocks


class PagedOffset(int):
    """The KV offset (always 0) a ``PlannedCache`` reports to transformers' mask builders; the
    registered mask function sees it and builds no mask, since radixcache's backends read none."""


PAGED_OFFSET = PagedOffset(0)


class CacheLayer(CacheLayerMixin):
    """Per-layer view transformers expects of ``owner`` (a ``PlannedCache``); all state lives in
    the owning cache, and every operation a radixcache cache does not support (beam reordering,
    cropping, batch expansion, row selection, reset) raises ``CacheError`` (their modes fall back
    to plain generate)."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: Cache):
        super().__init__()
        self.owner = owner
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool exists already
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        raise CacheError("a radixcache cache is updated through the cache, not its layers")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.get_seq_length() + query_length, PAGED_OFFSET

    def get_seq_length(self) -> int:
        return self.owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1  # grows lazily, bounded only by the pool

    def reset(self) -> None:
        raise CacheError("a radixcache cache cannot be reset")

    def reorder_cache(self, beam_idx) -> None:
        raise CacheError("a radixcache cache does not support beam reordering")

    def crop(self, tokens_to_remove: int) -> None:
        raise CacheError("a radixcache cache does not support cropping")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise CacheError("a radixcache cache does not support expanding the batch")

    def batch_select_indices(self, indices) -> None:
        raise CacheError("a radixcache cache does not support selecting batch rows")


PREFIX = "radixcache_paged_"  # the attention implementation ``attention.install`` switches to
_PENDING = threading.local()  # (cache, plan, layer, batch, new columns) of this thread's last update


_COMPILED = threading.local()  # cache: the StepCache of this thread's compiled step in flight


class _CompiledSteps:
    active = False  # some thread runs a compiled step (read while tracing: dynamo guards on it)
    running = 0  # how many threads do
    lock = threading.Lock()


@contextmanager
def compiled_step(cache: "StepCache"):
    """Within it, this thread runs a compiled engine step over ``cache`` (planned already:
    ``begin_forward`` ran, the graph runs no Python of the cache): while it is traced,
    ``in_compiled_step()`` is True, and the attention op finds ``cache`` (``compiled_cache()``).
    Threads may run compiled steps at once (two ``lm.generate`` calls)."""
    _COMPILED.cache = cache
    with _CompiledSteps.lock:
        _CompiledSteps.running += 1
        _CompiledSteps.active = True
    try:
        yield
    finally:
        with _CompiledSteps.lock:
            _CompiledSteps.running -= 1
            _CompiledSteps.active = _CompiledSteps.running > 0
        _COMPILED.cache = None


def compiled_cache() -> "StepCache | None":
    """The ``StepCache`` of this thread's ``compiled_step``, or None outside one."""
    return getattr(_COMPILED, "cache", None)


def in_compiled_step() -> bool:
    """Whether the code calling this is being traced by the compiler for a ``compiled_step`` (a
    model the user compiled on their own is not)."""
    return torch.compiler.is_compiling() and _CompiledSteps.active


def hooked(model) -> bool:
    """Whether ``model``'s attention layers reach radixcache's attention hook (``attention.install``
    switched it; models that compute attention themselves refuse the switch)."""
    return model.config._attn_implementation.startswith(PREFIX)


def forget_pending() -> None:
    """Drop this thread's pending ``update`` (after a forward, even one that failed half way)."""
    _PENDING.entry = None


def take_planned(query: torch.Tensor, key: torch.Tensor):
    """``(cache, layer)`` when a ``PlannedCache.update`` of this thread is pending, its forward
    still runs on the same plan, and ``query`` and ``key`` (``[batch, heads, n, dim]``) are of its
    forward's shape (then forgotten), else None."""
    entry = getattr(_PENDING, "entry", None)
    if entry is None:
        return None
    cache, plan, layer, batch, n = entry
    if cache.plan is not plan or query.dim() != 4 or key.dim() != 4 or query.shape[0] != batch or key.shape[0] != batch \
            or query.shape[2] != n or key.shape[2] != n:
        return None
    _PENDING.entry = None
    return cache, layer


class PlannedCache(Cache):
    """Base: ``update`` writes through ``self.plan`` (set by ``begin_forward`` at layer 0) and
    hands the plan to the attention function; ``attend`` runs the backend for one layer."""

    def __init__(self, num_layers: int, dense: bool = False):
        super().__init__(layers=[CacheLayer(self) for _ in range(num_layers)])
        self.plan: StepPlan | None = None
        self.gather: torch.Tensor | None = None  # packed positions of the real query rows
        self.shape: tuple = (0, 0)  # (batch, new columns) of the forward in flight
        self.dense = dense
        self.history: torch.Tensor | None = None  # dense: [B, columns] pool rows of every column
        self.history_slots: torch.Tensor | None = None  # dense: their KVPool.slots, flat

    def begin_forward(self, batch: int, n: int) -> None:
        """Set ``plan`` (and ``gather``) for a forward of ``n`` new columns per row."""
        raise NotImplementedError

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        """Plan the forward (at layer 0) and mark ``layer_idx`` pending; return the inputs. The
        attention call that follows writes the K/V it attends over (``write``). Dense: write them
        now and return every row's whole K/V ``[B, kv_heads, columns, head_dim]``."""
        if in_compiled_step():  # planned before the graph; the attention op writes
            return key_states, value_states
        batch, n = key_states.shape[0], key_states.shape[2]
        if layer_idx == 0:
            self.begin_forward(batch, n)
            self.shape = (batch, n)
        elif self.plan is None or self.shape != (batch, n):
            raise CacheError(f"layer {layer_idx} ran before layer 0 planned the forward")
        if self.dense:
            self.write(layer_idx, key_states, value_states)
            if layer_idx == 0:  # every layer reads the same rows
                self.history_slots = self.plan.pool.slots(self.history.reshape(-1)).reshape(-1)
            k, v = self.plan.pool.read(layer_idx, self.history.reshape(-1), slots=self.history_slots)
            rows, cols = self.history.shape
            return (k.view(rows, cols, *k.shape[1:]).transpose(1, 2),
                    v.view(rows, cols, *v.shape[1:]).transpose(1, 2))
        _PENDING.entry = (self, self.plan, layer_idx, batch, n)
        return key_states, value_states

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the forward's new ``key [B, kv_heads, n, head_dim]`` and ``value [..., head_dim_v]``
        of ``layer`` into the pool (only the planned query rows)."""
        self.plan.write(layer, self._pack(key), self._pack(value))

    def attend(self, layer: int, query: torch.Tensor, scale: float, sliding_window, softcap):
        """``query [B, heads, n, head_dim]`` -> attention output ``[B, n, heads, head_dim_v]``."""
        batch, heads, n, _ = query.shape
        out = self.plan.attend(layer, self._pack(query), scale, sliding_window=sliding_window,
                               softcap=softcap)
        if self.gather is not None:
            full = out.new_zeros(batch * n, heads, out.shape[-1])
            full.index_copy_(0, self.gather, out)
            out = full
        return out.view(batch, n, heads, out.shape[-1])

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        batch, heads, n, dim = x.shape
        x = x.transpose(1, 2).reshape(batch * n, heads, dim)
        return x if self.gather is None else x.index_select(0, self.gather)


class StepCache(PlannedCache):
    """One engine step: a packed ``[1, T]`` forward whose plan is known before it starts."""

    def __init__(self, plan: StepPlan, dense: bool = False):
        super().__init__(plan.pool.num_layers, dense)
        self.step_plan = plan
        self.past = 0
        if dense:
            if len(plan.segments) != 1:
                raise CacheError(f"a dense step runs one segment, got {len(plan.segments)}")
            seg = plan.segments[0]
            self.past = seg.kv_len - seg.q_len
            pos = torch.arange(seg.kv_len, device=plan.pool.device)
            self.history = plan.pool.rows(plan.block_table, 0, pos)[None]

    def begin_forward(self, batch: int, n: int) -> None:
        """Use the step's plan; the forward must be the packed ``[1, num_tokens]`` it describes."""
        if batch != 1 or n != self.step_plan.num_tokens:
            raise CacheError(f"the step plans {self.step_plan.num_tokens} packed tokens, the forward "
                             f"has [{batch}, {n}]")
        self.plan = self.step_plan

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """0: a packed step has no single past length (positions come as ``position_ids``);
        dense: the segment's cached tokens."""
        return self.past

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """Sizes transformers' mask builders ask for; the marked offset makes them build none
        (dense: the segment's whole K/V, a plain offset)."""
        if self.dense:
            return self.past + query_length, 0
        return query_length, PAGED_OFFSET


class GenerateRow:
    """One batch row of a ``lm.generate`` call: its real tokens so far, left padding, lease, and
    how many of its tokens may go into the tree (up to its first EOS, included)."""

    def __init__(self, tokens: list, pad: int, lease):
        self.tokens = tokens
        self.pad = pad
        self.lease = lease
        self.prompt_len = len(tokens)
        self.eos_end = None  # index after the first EOS among the generated tokens, once seen


class PagedCache(PlannedCache):
    """The cache of one ``lm.generate`` call (see the module docstring).

    ``rows``: ``GenerateRow`` per batch row; ``start``: the columns transformers treats as filled
    (the smallest ``pad + lease.computed``); ``tokens_seen``: the ``StoppingCriteria`` that records
    transformers' ``input_ids`` after each step (``latest``); ``eos``: EOS ids. After ``close()``
    (when the call returns) every method raises ``CacheError``: pass the object back to
    ``lm.generate`` (it is recognised, and the tree serves the prefix) or drop it.
    """

    def __init__(self, owner, manager, pool, backend, rows: list, start: int, tokens_seen,
                 eos: set, keep_s: float | None = None):
        super().__init__(pool.num_layers, dense=not hooked(owner.model))
        self.owner = owner
        self.manager = manager
        self.pool = pool
        self.backend = backend
        self.rows = rows
        self.length = start  # columns of every row that are filled (pads and cached included)
        self.completed = start  # columns whose K/V every layer has written
        self.tokens_seen = tokens_seen
        self.eos = eos
        self.keep_s = keep_s
        self.released = False

    def _require_live(self) -> None:
        if self.released:
            raise CacheError("this PagedCache was released when lm.generate returned: its blocks "
                             "belong to the radix tree now. Pass it back to the same lm.generate "
                             "(the cached prefix is found in the tree) or drop it")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Columns transformers treats as filled (every row's pads and cached tokens included)."""
        self._require_live()
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """Sizes transformers' mask builders ask for; the marked offset makes them build none
        (dense: a plain offset, the model's own masks cover every column)."""
        self._require_live()
        return self.length + query_length, 0 if self.dense else PAGED_OFFSET

    def begin_forward(self, batch: int, n: int) -> None:
        """Commit what the previous forward computed, grow every row to ``length + n`` tokens
        (``OutOfBlocks`` when even eviction cannot), and plan the forward's segments."""
        self._require_live()
        if batch != len(self.rows):
            raise CacheError(f"generate runs {batch} rows, the cache holds {len(self.rows)}")
        previous = self.length
        self.completed = previous  # the forward before this one ran every layer
        self._record(self.tokens_seen.latest, previous, n)
        end = previous + n
        with self.manager.mutex:
            self._commit()
            try:
                for row in self.rows:
                    self.manager.grow(row.lease, end - row.pad)
            except OutOfBlocks as e:
                generated = len(self.rows[0].tokens) - self.rows[0].prompt_len
                raise OutOfBlocks(f"the KV pool ran out after {generated} generated tokens ({e}); "
                                  "what was computed is cached, so a retry or a continuation "
                                  "reuses it: raise max_cache_tokens for longer outputs") from e
        segments, gather, identity = [], [], True
        for r, row in enumerate(self.rows):
            first = max(previous, row.pad + row.lease.computed)
            q_len = end - first
            segments.append(Segment(len(gather), q_len, end - row.pad, tuple(row.lease.blocks)))
            gather.extend(range(r * n + first - previous, r * n + n))
            identity = identity and q_len == n
        self.length = end
        self.gather = None if identity else device_tensor(gather, self.pool.device)
        self.plan = StepPlan(self.pool, segments, self.backend)
        if self.dense:  # column c of row r is its position c - pad (pads read the zero null block)
            pad = device_tensor([row.pad for row in self.rows], self.pool.device)[:, None]
            pos = torch.arange(end, device=self.pool.device)[None] - pad
            rows = self.pool.rows(self.plan.block_table, torch.arange(batch, device=pos.device)[:, None],
                                  pos.clamp(min=0))
            self.history = torch.where(pos >= 0, rows, self.pool.null_row)

    def begin_packed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None):
        """Plan a forward of ``input_ids`` (``[B, n]``) as one packed ``[1, T]`` step over the real
        query rows (``begin_forward``) -> ``(tokens, positions, logits_rows)``: what
        ``ModelRunner.forward`` takes, the logits row of each batch row its last query token.
        ``position_ids`` (``[B, n]``, transformers' own for left-padded rows) give the positions;
        without them a column's position is its index in its row's tokens."""
        batch, n = input_ids.shape
        self.begin_forward(batch, n)
        self.shape = (batch, n)
        flat = input_ids.reshape(-1)
        given = None if position_ids is None else position_ids.reshape(-1)
        if self.gather is not None:
            flat = flat.index_select(0, self.gather)
            given = None if given is None else given.index_select(0, self.gather)
        positions, rows = ([] if given is None else given.tolist()), []
        for seg in self.plan.segments:
            if seg.q_len < 1:
                raise CacheError(f"a packed generate step needs every row to have a query token, "
                                 f"one has {seg.q_len}")
            if given is None:
                positions.extend(range(seg.kv_len - seg.q_len, seg.kv_len))
            rows.append(seg.q_start + seg.q_len - 1)
        return flat.tolist(), positions, rows

    def _record(self, sequences, previous: int, n: int) -> None:
        """Append columns ``previous .. previous+n-1`` of transformers' ``sequences`` (the tokens
        generated so far) to each row, unless they are prompt columns, known already."""
        row0 = self.rows[0]
        if previous + n - row0.pad <= len(row0.tokens):
            return
        fed = sequences[:, previous:previous + n].tolist()
        for row, new in zip(self.rows, fed):
            for token in new:
                if row.eos_end is None and token in self.eos:
                    row.eos_end = len(row.tokens) + 1
                row.tokens.append(token)

    def _commit(self) -> None:
        for row in self.rows:
            done = self.committable(row)
            if done > row.lease.computed:
                self.manager.commit(row.lease, row.tokens, done)

    def committable(self, row: GenerateRow) -> int:
        """Leading tokens of ``row`` whose K/V are computed and belong in the tree (nothing after
        its first EOS: transformers keeps feeding finished rows padding)."""
        done = self.completed - row.pad
        return done if row.eos_end is None else min(done, row.eos_end)

    def finish(self, sequences: torch.Tensor | None) -> None:
        """The call ended (``sequences``: transformers' output, None after an error): commit what
        was computed and finish every lease (``CacheManager.finish``: retained ``keep_s`` after
        a call that returned), and refuse any further use."""
        if self.released:
            return
        if sequences is not None:
            self.completed = self.length
            if sequences.shape[1] > self.length:  # the last token, never fed: no K/V
                self._record(sequences, self.length, sequences.shape[1] - self.length)
        with self.manager.mutex:
            try:
                self._commit()
                keep_s = self.keep_s if sequences is not None else None
                for row in self.rows:  # what it computed up to its first EOS, then the tail
                    self.manager.finish(row.lease, row.tokens, keep_s)
            finally:
                for row in self.rows:
                    if row.lease is not None and not row.lease.released:
                        self.manager.release(row.lease)
                    row.lease = None
                self.released = True
                self.plan = None
                self.gather = None
                self.history = None
