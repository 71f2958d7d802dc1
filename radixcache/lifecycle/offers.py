"""Offering committed blocks to the shared store outside the manager's lock.

A commit runs under the manager's lock, and copying blocks out of the KV pool (a device to host
copy on GPU) is too slow to do there. So a commit that puts new blocks into the tree queues an
``Offer``: the blocks, the lease's token record that covers them, and one lock on the tree node
their path ends at. That lock keeps every offered block in the tree and unevictable, hence
unwritten (the tree's blocks are never written: copy on write), however the lease goes on.

The manager's lock is a ``ReleasingLock``: each time its outermost holder lets go, the manager
hands the queued offers to their store (``store.offer`` copies the blocks, in one batched export,
and queues the copies for the network) and then drops their node locks. Anything that needs to
count or take freeable blocks first finishes every offer (``OfferQueue.finish``: it sends the
queued ones under the lock and waits for those another thread is sending, which needs no lock),
so an offer never changes what an allocation can get.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

logger = logging.getLogger("radixcache.store")


class ReleasingLock:
    """A reentrant lock (``threading.RLock``) that calls ``after()`` when its outermost holder
    releases it while ``armed``, once it is free. Use it as ``with lock:`` or ``acquire`` /
    ``release``."""

    def __init__(self, after):
        self._lock = threading.RLock()
        self._depth = 0  # only ever changed by the thread holding the lock
        self._after = after
        self.armed = False  # set (lock held) when there is work for ``after``; it clears it

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock (see ``threading.RLock.acquire``)."""
        got = self._lock.acquire(blocking, timeout)
        if got:
            self._depth += 1
        return got

    def release(self) -> None:
        """Let go of one hold; after the outermost one, run ``after()``."""
        self._depth -= 1
        outermost = self._depth == 0
        self._lock.release()
        if outermost and self.armed:
            self._after()

    def __enter__(self) -> ReleasingLock:
        self._lock.acquire()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        outermost = self._depth == 0
        self._lock.release()
        if outermost and self.armed:
            self._after()


@dataclass(eq=False)
class Offer:
    """Blocks ``start .. start+len(blocks)-1`` of ``tokens`` (a lease's token record, which only
    ever grows) for ``store``, in ``namespace``; ``node`` is the tree node the offer has locked."""

    store: object
    namespace: tuple
    tokens: object
    start: int
    blocks: list
    node: object

    def send(self, pool) -> None:
        """Hand the blocks to the store (it copies them now); a failure is logged, never raised."""
        try:
            self.store.offer(self.namespace, self.tokens, self.start, self.blocks, pool)
        except Exception as e:  # noqa: BLE001 - a store failure is a drop, never the caller's error
            logger.warning("radixcache store: offering %d blocks failed (%s: %s); dropped",
                           len(self.blocks), type(e).__name__, e)


class OfferQueue:
    """The offers of one manager: ``queued`` (guarded by the manager's lock), those being sent
    and those sent whose node is still locked (both guarded by the queue's own condition)."""

    def __init__(self, lock: ReleasingLock | None = None):
        self.queued: list[Offer] = []
        self.mutex = lock  # armed while offers are queued
        self._sending = 0
        self._sent: list[Offer] = []
        self._cond = threading.Condition()
        self._local = threading.local()

    @property
    def idle(self) -> bool:
        """No offer is queued, being sent or waiting for its node lock to be dropped. Read without
        the queue's lock (called with the manager's lock held, so nothing is queued or taken
        meanwhile; ``send`` files an offer as sent before it stops counting it as being sent)."""
        return not (self.queued or self._sending or self._sent)

    def add(self, offer: Offer) -> None:
        """Queue ``offer`` (manager's lock held; its node is locked already)."""
        self.queued.append(offer)
        self.mutex.armed = True

    def offer(self, tree, store, lease, first: int, full: int) -> None:
        """Queue for ``store`` the blocks ``first .. full-1`` of ``lease`` (a ``Lease`` the tree
        has just adopted them from), locking the node its path ends at until the store has its
        copies (manager's lock held)."""
        tree.lock(lease.node)
        self.add(Offer(store, lease.namespace, lease.tokens, first, lease.blocks[first:full],
                       lease.node))

    def take(self) -> list[Offer]:
        """The queued offers, now counted as being sent (manager's lock held)."""
        batch, self.queued = self.queued, []
        self.mutex.armed = False
        with self._cond:
            self._sending += len(batch)
        return batch

    def send(self, batch: list[Offer], pool) -> None:
        """Send ``batch`` (from ``take``); each offer, sent or failed, waits for ``settle``."""
        try:
            for offer in batch:
                offer.send(pool)
        finally:
            with self._cond:
                self._sent.extend(batch)
                self._sending -= len(batch)
                self._cond.notify_all()

    def settle(self, tree) -> None:
        """Drop the node lock of every offer sent (manager's lock held)."""
        with self._cond:
            done, self._sent = self._sent, []
        for offer in done:
            tree.unlock(offer.node)

    def finish(self, tree, pool) -> None:
        """Send the queued offers now, wait for those other threads are sending, then settle them
        (manager's lock held): afterwards no offer holds a block."""
        if self.idle:
            return
        self.send(self.take(), pool)
        with self._cond:
            while self._sending:
                self._cond.wait()
        self.settle(tree)

    def after_release(self, manager) -> None:
        """What the manager's lock runs once free: send what is queued, outside the lock, until
        nothing is; then settle. A thread already sending (its own ``with manager.mutex`` inside
        this) does not start again."""
        local = self._local
        if getattr(local, "active", False):
            return
        local.active = True
        try:
            while True:
                with manager.mutex:
                    self.settle(manager.tree)
                    batch = self.take()
                if not batch:
                    return
                self.send(batch, manager.pool)
        finally:
            local.active = False
