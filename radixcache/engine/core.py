"""Engine: continuous batching in one ragged forward per step, over the wrapper's tree and pool.

Every step packs the new tokens of all running sequences (chunks of prompt suffixes and
single-token decodes) into one ``[1, total_tokens]`` forward with per-token positions. The paged
attention writes each sequence's new K/V into its blocks and attends over its block table.

Life of a sequence: *waiting* -> admitted (match the prompt in the tree, lock the match, retain its
blocks, allocate the rest; evicting LRU leaves when short) -> *running* (whole blocks are inserted
into the tree as soon as they are computed, so requests behind it share them at once) -> finished
(insert, unlock, release). When blocks run out mid-run, the youngest running sequence is preempted:
what it computed goes into the tree, it releases its blocks and waits again with the tokens it has.

Waiting requests are admitted longest-cached-prefix first (``schedule="lpm"``) or in arrival order
(``"fcfs"``); a request passed over ``starvation_rounds`` times goes first. A request whose prompt
shares uncached blocks with one being prefilled waits for that prefill instead of duplicating it.
Parallel samples (``n > 1``) fork after the prompt: they share its full blocks and copy the
partially filled last block (copy on write).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from radixcache.attention import Segment, StepPlan, install, resolve_backend
from radixcache.engine.sampling import check_sampling, draw, nucleus_probs
from radixcache.errors import OutOfBlocks


@dataclass(eq=False)
class Sequence:
    """One sample being generated: ``tokens`` = prompt + generated so far."""

    prompt_idx: int
    sample_idx: int
    tokens: list
    prompt_len: int
    max_new: int
    fork: int = 1  # samples to fork from this one's first-token logits (parallel sampling)
    generator: torch.Generator | None = None
    blocks: list = field(default_factory=list)
    node: object = None
    computed: int = 0  # tokens whose K/V are in ``blocks``
    in_tree: int = 0  # leading whole blocks already inserted into the tree
    arrival: int = 0
    admitted: int = -1
    passed_over: int = 0
    finished: bool = False
    counted: bool = False  # its prompt is in the hit statistics (a resumed sequence is not counted again)

    @property
    def generated(self) -> list:
        """Tokens generated so far (the prompt not repeated)."""
        return self.tokens[self.prompt_len:]


@dataclass
class RunStats:
    """What one ``Engine.generate`` call did (the benchmark reads these)."""

    steps: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_blocks: int = 0
    ttft_s: dict = field(default_factory=dict)  # prompt index -> seconds to its first token
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens admitted."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine:
    """Continuous-batching generation for a ``CachedLM`` (its model, tree, allocator and pool).

    ``max_running`` caps concurrent sequences, ``max_step_tokens`` the tokens of one forward
    (longer prompts are prefilled in chunks).
    """

    def __init__(self, lm, *, max_running: int = 64, max_step_tokens: int = 2048,
                 schedule: str = "lpm", starvation_rounds: int = 8):
        if schedule not in ("lpm", "fcfs"):
            raise ValueError(f"schedule must be 'lpm' or 'fcfs', got {schedule!r}")
        if max_running < 1 or max_step_tokens < 1:
            raise ValueError("max_running and max_step_tokens must be >= 1")
        self.lm = lm
        self.pool = lm.pool
        self.tree = lm.cache
        self.allocator = lm.allocator
        self.bs = lm.block_size
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.schedule = schedule
        self.starvation_rounds = starvation_rounds
        self.backend = resolve_backend(lm.attention, lm.device, lm.dtype, lm.pool.storage_dtype)
        install(lm.model)
        self.last_run = RunStats()

    # ------------------------------------------------------------------ public
    def generate(self, prompts, max_new_tokens: int = 16, do_sample: bool = False,
                 temperature: float = 1.0, top_p: float = 1.0, n: int = 1, cache_salt=None,
                 stream: bool = False, eos_token_id=None, seed: int | None = None):
        """Generate for every prompt (a list of token-id lists); see ``CachedLM.generate_batch``.

        Returns, per prompt in order, ``n`` lists of generated token ids (the prompt not repeated,
        the EOS token included when one ends the sample). With ``stream=True``: an iterator of
        ``(prompt index, sample index, token)`` as tokens appear. ``seed`` fixes the per-sample RNGs
        (default: drawn from torch's global RNG). Bad arguments raise before any state changes.
        """
        prompts = self._check(prompts, max_new_tokens, n, cache_salt)
        check_sampling(do_sample, temperature, top_p)
        eos = self._eos_ids(eos_token_id)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)))
        events = self._run(prompts, max_new_tokens, do_sample, float(temperature), float(top_p),
                           n, (self.lm.fingerprint, cache_salt), eos, seed)
        if stream:
            return events
        results = [[[] for _ in range(n)] for _ in prompts]
        for p, s, token in events:
            results[p][s].append(token)
        return results

    # ------------------------------------------------------------------ checks
    def _check(self, prompts, max_new_tokens, n, cache_salt) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, torch.Tensor):
                p = p.tolist()
            if not isinstance(p, (list, tuple)) or not p:
                raise ValueError(f"prompt {i} must be a non-empty list of token ids")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                raise TypeError(f"prompt {i} must hold ints")
            bad = [t for t in p if not 0 <= t < self.lm.vocab_size]
            if bad:
                raise ValueError(f"prompt {i}: token id {bad[0]} is outside the vocabulary "
                                 f"0..{self.lm.vocab_size - 1}")
            need = math.ceil((len(p) + max_new_tokens) / self.bs) + (n - 1) * (
                math.ceil(max_new_tokens / self.bs) + 1)
            if need > self.allocator.num_blocks:
                raise OutOfBlocks(f"prompt {i} with {n} samples needs up to {need} blocks; the pool "
                                  f"has {self.allocator.num_blocks}: raise max_cache_tokens")
            out.append(list(p))
        return out

    def _eos_ids(self, eos_token_id) -> set:
        if eos_token_id is None:
            eos_token_id = getattr(self.lm.model.generation_config, "eos_token_id", None)
        if eos_token_id is None:
            return set()
        return set(eos_token_id) if isinstance(eos_token_id, (list, tuple, set)) else {int(eos_token_id)}

    # ------------------------------------------------------------------ the loop
    def _run(self, prompts, max_new, do_sample, temperature, top_p, n, ns, eos, seed) -> Iterator:
        stats = self.last_run = RunStats()
        start = time.perf_counter()
        waiting = [Sequence(i, 0, list(p), len(p), max_new, fork=n,
                            generator=torch.Generator().manual_seed(seed + 7919 * i), arrival=i)
                   for i, p in enumerate(prompts)]
        running: list[Sequence] = []
        admissions = 0
        try:
            while waiting or running:
                with self.lm._lock:
                    admissions = self._admit(waiting, running, ns, admissions, stats)
                    batch = self._schedule(running, waiting, ns, stats)
                    used = self.allocator.num_blocks - self.allocator.num_free
                    stats.peak_blocks = max(stats.peak_blocks, used)
                if not batch:
                    if not running and waiting:
                        raise OutOfBlocks("no waiting request fits in the pool even after eviction; "
                                          "other requests hold the rest: raise max_cache_tokens")
                    continue
                logits = self._forward(batch)
                stats.steps += 1
                stats.computed_tokens += sum(k for _, k in batch)
                events = []
                greedy = None if do_sample else logits.argmax(dim=-1).tolist()  # one device sync
                with self.lm._lock:
                    row = 0
                    for seq, k in batch:
                        seq.computed += k
                        if seq.computed < len(seq.tokens):
                            self._cache_progress(seq, ns)
                            continue
                        scores = logits[row] if do_sample else greedy[row]
                        row += 1
                        for child in self._emit(seq, scores, do_sample, temperature, top_p, eos,
                                                running, waiting, ns, stats, start, events):
                            running.append(child)
                    for seq in [s for s in running if s.finished]:
                        running.remove(seq)
                        self._retire(seq, ns, insert=True)
                yield from events
        finally:
            with self.lm._lock:
                for seq in running:
                    self._retire(seq, ns, insert=False)
            stats.wall_s = time.perf_counter() - start
            c = self.lm._counters
            c["requests"] += len(prompts)
            c["prompt_tokens"] += stats.prompt_tokens
            c["hit_tokens"] += stats.hit_tokens
            c["computed_prompt_tokens"] += stats.prompt_tokens - stats.hit_tokens
            c["generated_tokens"] += stats.generated_tokens

    def _emit(self, seq, scores, do_sample, temperature, top_p, eos, running, waiting, ns, stats,
              start, events) -> list[Sequence]:
        """Choose the next token of ``seq`` (and of its forks) from ``scores`` (its logits, or the
        greedy token already chosen); return the forked sequences."""
        if seq.prompt_idx not in stats.ttft_s:
            stats.ttft_s[seq.prompt_idx] = time.perf_counter() - start
        children = []
        if seq.fork > 1:
            children = self._fork(seq, running, waiting, ns)
        if do_sample:
            scores = nucleus_probs(scores, temperature, top_p)
        for s in [seq, *children]:
            token = draw(scores, s.generator) if do_sample else scores
            s.tokens.append(token)
            stats.generated_tokens += 1
            events.append((s.prompt_idx, s.sample_idx, token))
            if token in eos or len(s.generated) >= s.max_new:
                s.finished = True
        self._cache_progress(seq, ns)
        return [c for c in children if c.blocks]

    # ------------------------------------------------------------------ admission
    def _admit(self, waiting, running, ns, admissions, stats) -> int:
        if not waiting:
            return admissions
        starved = lambda s: s.passed_over >= self.starvation_rounds  # noqa: E731
        if self.schedule == "lpm":
            cached = {id(s): self.tree.peek(s.tokens[:-1], ns) for s in waiting}
            order = sorted(waiting, key=lambda s: (not starved(s), -cached[id(s)], s.arrival))
        else:
            order = sorted(waiting, key=lambda s: (not starved(s), s.arrival))
        prefilling = [s for s in running if s.computed < s.prompt_len]
        for seq in order:
            if len(running) >= self.max_running:
                break
            if self._shares_pending_prefill(seq, prefilling, ns):
                continue
            if not self._try_admit(seq, ns, stats):
                break  # no room: keep the order (no small request overtakes a big one forever)
            waiting.remove(seq)
            seq.admitted = admissions
            admissions += 1
            running.append(seq)
            prefilling.append(seq)
        for seq in waiting:
            seq.passed_over += 1
        return admissions

    def _shares_pending_prefill(self, seq, prefilling, ns) -> bool:
        """True when ``seq`` would share at least one more whole block with a prompt being prefilled
        than it can match now: it waits one round and then matches that prompt from the tree."""
        if not prefilling:
            return False
        have = self.tree.peek(seq.tokens[:-1], ns)
        for other in prefilling:
            common = _common_prefix(seq.tokens[:-1], other.tokens[:other.prompt_len])
            if common // self.bs * self.bs > have:
                return True
        return False

    def _try_admit(self, seq, ns, stats) -> bool:
        m = self.tree.match(seq.tokens[:-1], ns)
        need = math.ceil(len(seq.tokens) / self.bs) - len(m.blocks)
        if seq.fork > 1:
            need += seq.fork - 1  # copies of a partially filled last block
        self.tree.lock(m.node)  # before counting: the match itself must not count as evictable
        if need > self.allocator.num_free + self.tree.evictable_blocks:
            self.tree.unlock(m.node)
            return False
        self.allocator.retain(m.blocks)
        short = need - self.allocator.num_free
        if short > 0:
            self.tree.evict(short)
        new = math.ceil(len(seq.tokens) / self.bs) - len(m.blocks)
        seq.blocks = list(m.blocks) + self.allocator.allocate(new)
        seq.node, seq.computed, seq.in_tree = m.node, m.length, len(m.blocks)
        if seq.sample_idx == 0 and not seq.counted:
            stats.prompt_tokens += len(seq.tokens)
            stats.hit_tokens += m.length
            seq.counted = True
        return True

    # ------------------------------------------------------------------ one step
    def _schedule(self, running, waiting, ns, stats) -> list[tuple[Sequence, int]]:
        """Pick each running sequence's new tokens for this step (decodes first), making sure its
        blocks cover them; preempt the youngest sequences when blocks run out."""
        budget = self.max_step_tokens
        batch = []
        for seq in sorted(running, key=lambda s: (s.computed < len(s.tokens) - 1, s.admitted)):
            if seq not in running:
                continue  # preempted while making room for an older one
            want = len(seq.tokens) - seq.computed
            take = min(want, budget)
            if take < 1:
                continue
            if not self._grow(seq, seq.computed + take, running, waiting, ns, stats):
                continue  # seq itself was preempted
            batch.append((seq, take))
            budget -= take
        return [(s, k) for s, k in batch if s in running]

    def _grow(self, seq, length, running, waiting, ns, stats) -> bool:
        need = math.ceil(length / self.bs) - len(seq.blocks)
        while need > 0:
            short = need - self.allocator.num_free
            if short > 0:
                self.tree.evict(short)
            if need <= self.allocator.num_free:
                seq.blocks += self.allocator.allocate(need)
                return True
            victim = max(running, key=lambda s: s.admitted)
            self._preempt(victim, running, waiting, ns, stats)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq, running, waiting, ns, stats) -> None:
        running.remove(seq)
        self._retire(seq, ns, insert=True)
        seq.computed = seq.in_tree = 0
        seq.passed_over = self.starvation_rounds  # first in line when room comes back
        waiting.insert(0, seq)
        stats.preemptions += 1

    def _forward(self, batch) -> torch.Tensor:
        ids, positions, segments, keep = [], [], [], []
        for seq, k in batch:
            start = seq.computed
            segments.append(Segment(len(ids), k, start + k, tuple(seq.blocks)))
            ids.extend(seq.tokens[start:start + k])
            positions.extend(range(start, start + k))
            if start + k == len(seq.tokens):
                keep.append(len(ids) - 1)
        device = self.lm.device
        plan = StepPlan(self.pool, segments, self.backend)
        with torch.no_grad():
            out = self.lm.model(input_ids=torch.tensor([ids], device=device),
                                position_ids=torch.tensor([positions], device=device),
                                use_cache=False, radixcache_plan=plan,
                                logits_to_keep=torch.tensor(keep or [0], device=device))
        return out.logits[0].float()

    # ------------------------------------------------------------------ tree bookkeeping
    def _cache_progress(self, seq, ns) -> None:
        """Insert newly completed whole blocks, move the lock down, adopt the tree's copies."""
        full = seq.computed // self.bs
        if full <= seq.in_tree:
            return
        tokens = seq.tokens[:full * self.bs]
        self.tree.insert(tokens, seq.blocks[:full], ns)
        m = self.tree.match(tokens, ns)
        self.tree.lock(m.node)
        self.tree.unlock(seq.node)
        seq.node = m.node
        for i, tree_block in enumerate(m.blocks):
            if seq.blocks[i] != tree_block:  # another sequence cached this block first
                self.allocator.retain([tree_block])
                self.allocator.release([seq.blocks[i]])
                seq.blocks[i] = tree_block
        seq.in_tree = full

    def _fork(self, leader, running, waiting, ns) -> list[Sequence]:
        """Parallel samples of ``leader`` right after its prompt: share full blocks, copy the partial one."""
        full, partial = divmod(leader.computed, self.bs)
        children = []
        for i in range(1, leader.fork):
            child = Sequence(leader.prompt_idx, i, list(leader.tokens), leader.prompt_len,
                             leader.max_new, generator=torch.Generator().manual_seed(
                                 int(leader.generator.initial_seed()) + 104729 * i),
                             arrival=leader.arrival, admitted=leader.admitted)
            blocks = list(leader.blocks[:full])
            if partial:
                if self.allocator.num_free < 1:
                    self.tree.evict(1)
                if self.allocator.num_free < 1:
                    waiting.append(child)  # no block to copy into: re-admit later via the tree
                    continue
                copy = self.allocator.allocate(1)[0]
                self.pool.copy_block(leader.blocks[full], copy)
            self.allocator.retain(blocks)
            self.tree.lock(leader.node)
            child.blocks = blocks + ([copy] if partial else [])
            child.node, child.computed, child.in_tree = leader.node, leader.computed, leader.in_tree
            children.append(child)
        leader.fork = 1
        return children

    def _retire(self, seq, ns, insert: bool) -> None:
        """Insert what ``seq`` computed (when ``insert``), unlock and release everything it holds."""
        if insert and seq.computed >= self.bs and seq.blocks:
            full = seq.computed // self.bs
            self.tree.insert(seq.tokens[:full * self.bs], seq.blocks[:full], ns)
        if seq.node is not None:
            self.tree.unlock(seq.node)
            seq.node = None
        if seq.blocks:
            self.allocator.release(seq.blocks)
            seq.blocks = []


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
