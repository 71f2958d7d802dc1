"""KV events in vLLM's layout over a ZMQ PUB socket, from a thread of their own.

Each message is three frames: the topic (UTF-8), the sequence number as 8 bytes big-endian
(0, 1, 2, ...: one per batch) and a msgpack ``EventBatch = [timestamp, [event, ...], dp_rank]``
(``timestamp``: ``time.time()`` when the batch was encoded, a float; the events are those of
``radixcache.kv_events.translate``). The socket binds the endpoint (``tcp://HOST:PORT``, any
address ZMQ binds, ``tcp://127.0.0.1:*`` for a free port: ``endpoint`` then says which);
subscribers connect and subscribe to the topic. A subscriber that joins late sees the stream from
then on; ``CacheManager.resync_events`` (or ``RadixCache.resync_events``) republishes the whole
state for it.

Every ``BlockStored`` carries the block's token ids: a subscriber reads every tenant's prompts, block
by block. So the endpoint must be local (``tcp://`` on a loopback address, ``ipc://``,
``inproc://``) unless ``allow_remote``: binding anything else (``tcp://0.0.0.0:5557``, a LAN
address, ``tcp://*:5557``) is refused without it, and logged as a warning with it.

The tree never waits on this: it queues references to its own bytes in a ``BlockEventLog``
(bounded, drops counted, recovering by a full resync) and returns; this thread computes the
digests, encodes and sends (a PUB socket drops what a slow subscriber cannot take, past ``hwm``
messages, and never blocks either).
"""

from __future__ import annotations

import logging
import threading
import time

from radixcache.kv_events.log import BlockEventLog
from radixcache.kv_events.translate import EventTranslator

logger = logging.getLogger("radixcache")
_INSTALL = "KV events need pyzmq and msgpack: pip install pyzmq msgpack (radixcache's [events] extra)"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint can only be reached from this machine: ``ipc://`` and ``inproc://``,
    or ``tcp://`` on a loopback address (127.0.0.0/8, localhost, ::1)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0] if rest.count(":") else rest
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def _modules():
    try:
        import msgpack
        import zmq
    except ImportError as e:
        raise ImportError(f"{_INSTALL} ({e})") from None
    return zmq, msgpack


class KVEventPublisher:
    """Publishes one tree's block changes as vLLM KV events (module docstring) on ``endpoint``.

    ``topic`` (default "kv") is the first frame of every message; ``medium`` the tier named in
    ``BlockStored`` and ``BlockRemoved`` (default "GPU": vLLM's name for an engine's own KV cache,
    which routers score as such; the pool may live on the CPU all the same); ``dp_rank`` the
    ``EventBatch``'s last field; ``max_queue`` bounds the records waiting for this thread;
    ``max_batch`` the records per batch; ``hwm`` the messages the socket keeps per subscriber.
    Attach it with ``CacheManager.use_events`` (or ``RadixCache.set_event_log(publisher.log)``);
    ``flush`` waits until everything queued so far is sent, ``close`` flushes and unbinds.
    Raises ``ValueError`` naming the endpoint when it cannot bind, or when it is not local and
    ``allow_remote`` is False (module docstring); ``ImportError`` without pyzmq.
    """

    def __init__(self, endpoint: str, *, topic: str = "kv", medium: str | None = "GPU",
                 dp_rank: int = 0, max_queue: int = 100_000, max_batch: int = 1024,
                 hwm: int = 100_000, allow_remote: bool = False):
        if not isinstance(endpoint, str) or not endpoint:
            raise TypeError(f"kv_events endpoint must be a non-empty str such as "
                            f"'tcp://127.0.0.1:5557', got {endpoint!r}")
        if "://" in endpoint and not is_local_endpoint(endpoint):  # a malformed one fails to bind below
            if not allow_remote:
                raise ValueError(f"kv_events: {endpoint!r} is not a loopback address; KV events carry every "
                                 "block's token ids (every tenant's prompts), so binding it needs allow_remote "
                                 "(radixcache serve: --kv-events-allow-remote)")
            logger.warning("KV events bound on %s: anyone who can connect there reads every block's token ids",
                           endpoint)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {topic!r}")
        if medium is not None and not isinstance(medium, str):
            raise TypeError(f"medium must be a str or None, got {medium!r}")
        for name, value, low in (("dp_rank", dp_rank, 0), ("max_queue", max_queue, 1),
                                 ("max_batch", max_batch, 1), ("hwm", hwm, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        zmq, msgpack = _modules()
        self.log = BlockEventLog(max_queue)
        self.topic, self.medium, self.dp_rank, self.max_batch = topic, medium, dp_rank, max_batch
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._translator = EventTranslator(medium)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            self._context.term()
            raise ValueError(f"kv_events: cannot bind {endpoint!r}: {e}") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.batches = 0        # messages sent: the next sequence number
        self.errors = 0         # records this thread could not translate (each forces a resync)
        self.thread_cpu_s = 0.0  # CPU time this publisher's thread has used
        self._handled = 0       # records taken from the log and dealt with
        self._done = threading.Condition()
        self._stopping = self._abort = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="radixcache-kv-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public
    def stats(self) -> dict:
        """Counters: ``kv_events_batches`` (messages sent), ``kv_events_dropped`` (block records
        dropped on a full queue), ``kv_events_resyncs`` (full snapshots queued: start-up, clears,
        recoveries), ``kv_events_queued`` (records waiting now), ``kv_events_errors`` and
        ``kv_events_thread_cpu_s`` (the CPU seconds the publisher's thread used: digests, encoding,
        sending)."""
        log = self.log
        return {"kv_events_batches": self.batches, "kv_events_dropped": log.dropped,
                "kv_events_resyncs": log.resyncs, "kv_events_queued": len(log.records),
                "kv_events_errors": self.errors, "kv_events_thread_cpu_s": self.thread_cpu_s}

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait up to ``timeout`` s until every record queued before this call has been sent (handed
        to the socket); returns whether it was."""
        target = self.log.appended
        deadline = time.monotonic() + timeout
        self.log.wake.set()
        with self._done:
            while self._handled < target and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._done.wait(left)
            return self._handled >= target

    def close(self, timeout: float = 10.0) -> dict:
        """Send what is queued (up to ``timeout`` s; past it, what is left is dropped once the
        record in hand is done), stop the thread, unbind; returns ``stats()``. Idempotent. The tree
        must no longer log into it (``CacheManager.use_events(None)`` detaches it)."""
        if self._closed:
            return self.stats()
        self._closed = True
        deadline = time.monotonic() + timeout
        self._stopping = True
        self.log.close()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():  # past the deadline: drop the rest, after the current batch
            self._abort = True
            self._thread.join()
        linger = int(max(0.0, min(1.0, deadline - time.monotonic())) * 1000)
        self._socket.close(linger=linger)
        self._context.term()
        return self.stats()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._closed

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KVEventPublisher({self.endpoint!r}, topic={self.topic!r}, batches={self.batches})"

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        log = self.log
        while not self._abort:
            log.wake.wait(0.5)
            log.wake.clear()
            while log.records and not self._abort:
                try:
                    self._send_batch()
                except Exception:  # the socket failed: count it, keep the thread alive
                    self.errors += 1
                    logger.exception("radixcache: sending a KV event batch failed")
            if self._stopping and not log.records:
                break
        with self._done:
            self._done.notify_all()

    def _send_batch(self) -> None:
        log, events, taken = self.log, [], 0
        try:
            while taken < self.max_batch:
                record = log.take()
                if record is None:
                    break
                taken += 1
                try:
                    events.extend(self._translator.translate(record))
                except Exception:  # a record this view cannot apply: start over from a snapshot
                    self.errors += 1
                    logger.exception("radixcache: a KV event record could not be translated; "
                                     "resyncing")
                    log.force_resync()
                time.sleep(0)  # let the tree's thread have the GIL back between records
            if events:
                payload = self._pack([time.time(), events, self.dp_rank])
                self._socket.send_multipart((self.topic.encode(), self.batches.to_bytes(8, "big"),
                                             payload), copy=False)
                self.batches += 1
        finally:
            self.thread_cpu_s = time.thread_time()
            with self._done:
                self._handled += taken
                self._done.notify_all()
