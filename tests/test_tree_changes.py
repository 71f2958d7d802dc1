"""RadixCache.changes: the content epoch, the last eviction and the log of inserts' first new
blocks, which the scheduler uses to know which cached peeks may have grown."""

from array import array

from radixcache import BlockAllocator, RadixCache
from radixcache.tree.body import ChangeLog

BS = 4


def packed(tokens):
    return array("I", tokens).tobytes()


def test_inserts_log_their_first_new_block_and_its_index():
    alloc = BlockAllocator(32)
    tree = RadixCache(alloc, BS)
    log = tree.changes
    start = log.epoch
    a = list(range(1, 13))
    held = alloc.allocate(3)
    tree.insert(a, held)
    assert log.inserted_since(start) == [(0, packed(a[:4]))]
    mark = log.epoch
    b = a[:8] + [50, 51, 52, 53]
    mine = alloc.allocate(3)
    tree.insert(b, mine)  # blocks 0 and 1 are cached: the first new one is block 2
    assert log.inserted_since(mark) == [(2, packed(b[8:]))]
    assert tree.peek(b) == 12
    mark = log.epoch
    got = tree.adopt(a[:8], held[:2])
    tree.lock(got.node)
    more = alloc.allocate(1)
    tree.adopt_below(got.node, [60, 61, 62, 63], more)  # below a node ending at block 2
    assert log.inserted_since(mark) == [(2, packed([60, 61, 62, 63]))]
    mark = log.epoch
    tail = alloc.allocate(1)
    tree.adopt_below(got.node, [70, 71], [], tail_block=tail[0])  # a tail: no entry
    assert log.epoch > mark and log.inserted_since(mark) == []
    tree.unlock(got.node)
    assert log.evicted_epoch < log.epoch
    tree.evict(1)
    assert log.evicted_epoch == log.epoch
    alloc.release(held + mine + more + tail)
    tree.reset()
    assert alloc.num_free == 32


def test_the_log_says_when_it_no_longer_reaches_back():
    log = ChangeLog(size=3)
    for i in range(3):
        log.inserted(i, b"x")
    assert [j for j, _ in log.inserted_since(0)] == [2, 1, 0]
    log.inserted(3, b"y")
    assert log.inserted_since(0) is None and [j for j, _ in log.inserted_since(1)] == [3, 2, 1]
