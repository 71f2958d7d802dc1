"""The tree's side of KV events: which block event log a tree body tells of its whole blocks.

A ``TreeBody``'s ``events`` is None or a ``radixcache.kv_events.BlockEventLog`` (any object with
``attach(body)``, ``detach(body)`` and ``resync(body)``); the body tells it of every whole block
that enters or leaves (``radixcache.tree.body``). Both functions run under the lock of whoever
changes the tree.
"""

from __future__ import annotations

from contextlib import contextmanager


def attach_event_log(body, log) -> None:
    """Make ``log`` (or None, to stop) the log ``body`` tells of its whole blocks: attaching starts
    it with ``AllBlocksCleared`` and ``BlockStored`` for every whole block held already (the log
    already attached is just resynced), and the log replaced is detached. ``ValueError`` from
    ``log.attach`` (a log that follows another tree, or is closed) leaves everything as it was."""
    if log is not None and log is body.events:
        log.resync(body)
        return
    if log is not None:
        log.attach(body)
    if body.events is not None:
        body.events.detach(body)
    body.events = log


@contextmanager
def muted_then_resynced(body):
    """Tell ``body``'s log nothing while the block runs (the log is restored however it ends);
    once it ends without an exception, resync the log (``AllBlocksCleared``, then ``BlockStored``
    for what the tree holds). Nothing to do without a log."""
    events, body.events = body.events, None
    try:
        yield
    finally:
        body.events = events
    if events is not None:
        events.resync(body)
