"""``CacheManager.keep``: session hints over the manager, and the property that a retention hint
never changes a generated token.

A stand-in model "generates" each next token from the K/V content a request actually reads (the
content pool of test_manager_properties records what every position was computed for), so a block
served for the wrong tokens would change the output. The same multi-turn sessions run through
managers with and without hints, under memory pressure, on a hypothesis-driven clock: every output
must equal the reference computed from the true tokens, with or without hints, whatever was
evicted.

To extend this to ``generate``/``generate_batch`` once they take ``keep_s=``: run the same
sessions through a tiny model twice (``keep_s=None`` and a few values, with a pool small enough to
evict) and assert equal generated token ids (and, with greedy decoding, equal to plain
transformers, as the differential tests do).
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixcache import CacheError
from radixcache.lifecycle.manager import CacheManager
from test_manager_properties import ContentPool

BS = 4
VOCAB = 50


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def next_token(content) -> int:
    """The stand-in model: the next token is a function of everything the request attends to."""
    return hash(tuple(content)) % VOCAB


def reference(namespace, tokens) -> int:
    """What the model computes from the true tokens (a sound cache reads exactly this content)."""
    return next_token((namespace, tuple(tokens[:p + 1])) for p in range(len(tokens)))


def turn(mgr, pool, tokens, namespace, generate, hint_s):
    """One request: admit, compute the uncached rest into the lease's blocks, generate ``generate``
    tokens one by one from the content read through the block table, then (with a hint) retain and
    release. Returns the generated tokens."""
    tokens = list(tokens)
    lease = mgr.admit(tokens, namespace)
    out = []
    for _ in range(generate):
        mgr.grow(lease, len(tokens))
        for p in range(lease.computed, len(tokens)):
            block = lease.blocks[p // BS]
            assert mgr.allocator.refcount(block) == 1 and not mgr.tree.holds(block), \
                "write into a shared block"
            pool.cells[block][p % BS] = (namespace, tuple(tokens[:p + 1]))
        mgr.commit(lease, tokens, len(tokens))
        content = [pool.cells[lease.blocks[p // BS]][p % BS] for p in range(len(tokens))]
        out.append(next_token(content))
        tokens.append(out[-1])
    if hint_s is not None:
        mgr.keep(lease, hint_s)
    mgr.release(lease, tokens[:lease.computed])
    mgr.check()
    return out


SESSIONS = st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
                              st.sampled_from([(), ("tenant",)])), min_size=1, max_size=4)
STEPS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3),
                           st.lists(st.integers(0, VOCAB - 1), max_size=5),
                           st.sampled_from([0.0, 1.0, 5.0, 30.0])), min_size=1, max_size=14)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(SESSIONS, STEPS, st.sampled_from([None, 0.0, 2.0, 10.0, 1e9]), st.integers(12, 24))
def test_a_retention_hint_never_changes_a_generated_token(sessions, steps, hint_s, num_blocks):
    """Interleaved sessions (a turn appends a user/tool message to the history and generates 1-3
    tokens; the clock advances between turns) through a small pool: with hints of any length or
    none, every generated token equals the one computed from the true tokens."""
    runs = []
    for hint in (None, hint_s):
        clock = Clock()
        pool = ContentPool(num_blocks, BS)
        mgr = CacheManager(num_blocks, BS, pool=pool, clock=clock)
        history = [list(s) for s, _ in sessions]
        outputs = []
        for which, generate, message, pause in steps:
            s = which % len(sessions)
            namespace = sessions[s][1]
            tokens = history[s] + message
            if len(tokens) + generate > (num_blocks - 2) * BS:
                continue
            out = turn(mgr, pool, tokens, namespace, generate, hint)
            expected, seq = [], list(tokens)
            for _ in range(generate):
                expected.append(reference(namespace, seq))
                seq.append(expected[-1])
            assert out == expected, "a cached block served other tokens than the request's"
            outputs.append(out)
            history[s] = tokens + out
            clock.now += pause
        mgr.clear()
        assert mgr.allocator.num_free == num_blocks
        runs.append((outputs, mgr.stats()["hit_tokens"]))
    assert runs[0][0] == runs[1][0]


def test_a_retained_session_outlives_newer_one_shot_requests():
    """Under pressure, the hinted session's history stays cached while newer unhinted prompts go;
    once the hint expires it is plain LRU again."""
    clock = Clock()
    pool = ContentPool(12, BS)
    mgr = CacheManager(12, BS, pool=pool, clock=clock)
    session = list(range(1, 17))                       # 4 blocks
    turn(mgr, pool, session, (), 1, hint_s=60.0)
    for k in range(5):                                 # newer one-shot prompts fill the pool
        clock.now += 1
        turn(mgr, pool, [40 + k] * 12, (), 1, hint_s=None)
    lease = mgr.admit(session + [7])
    assert lease.cached_tokens >= 16
    mgr.release(lease)
    clock.now += 120                                   # the hint has expired: plain LRU again,
    for k in range(5):                                 # and the session is among the oldest entries
        clock.now += 1
        turn(mgr, pool, [30 + k] * 12, (), 1, hint_s=None)
    lease = mgr.admit(session + [7])
    cached = lease.cached_tokens
    mgr.release(lease)
    assert cached == 0
    mgr.check()


@pytest.mark.parametrize("bad, error", [(-1.0, ValueError), (float("nan"), ValueError), ("5", TypeError),
                                        (None, TypeError), (True, TypeError)])
def test_retain_refuses_bad_durations_and_changes_nothing(bad, error):
    mgr = CacheManager(8, BS, pool=ContentPool(8, BS))
    lease = mgr.admit(list(range(9)))
    mgr.grow(lease, 9)
    mgr.commit(lease, list(range(9)), 9)
    before = (mgr.tree.cached_blocks, lease.computed, list(lease.blocks), mgr.stats())
    with pytest.raises(error):
        mgr.keep(lease, bad)
    assert (mgr.tree.cached_blocks, lease.computed, list(lease.blocks), mgr.stats()) == before
    mgr.release(lease)
    with pytest.raises(CacheError, match="released"):
        mgr.keep(lease, 5.0)
    mgr.check()


def test_retain_covers_the_committed_path_on_the_managers_clock():
    clock = Clock()
    mgr = CacheManager(8, BS, pool=ContentPool(8, BS), clock=clock)
    tokens = list(range(10))
    lease = mgr.admit(tokens)
    mgr.grow(lease, 10)
    mgr.commit(lease, tokens, 9)                       # 2 whole blocks in the tree
    clock.now = 100.0
    mgr.keep(lease, 5.0)
    assert lease.node.depth_tokens == 8 and mgr.tree.node_table.until[lease.node.id] == 105.0
    mgr.release(lease, tokens[:lease.computed])
    mgr.check()
