"""RedisStore: the shared KV tier on Redis or Redis Cluster (a ``radixcache.store.BlockStore``).

Write path: ``offer`` reserves room in a byte-bounded queue, snapshots the blocks that fit (one
batched ``pool.export_blocks``) and returns; a background thread encodes them and sends, per batch, one
pipeline of ``EXISTS`` (to skip what the store holds) and one of ``SET key value NX [PX ttl]``.
Read path: ``fetch`` computes the chained keys, sends one pipeline of ``GET`` (``GETEX`` with a
TTL, which refreshes it) per chunk of blocks, verifies each value in chain order and stops at the
first miss. A pipeline is one round trip per server: on Redis Cluster the chained keys land in
different slots (a multi-key ``MGET`` would fail with CROSSSLOT) and redis-py's cluster pipeline
sends each node its share at once. A value that fails verification is a miss and its key is
deleted.

Trust: with a secret (``secret``, the URL's ``secret_file=PATH``, or the environment variable
``RADIXCACHE_STORE_SECRET`` through ``store_secret``), every value is sealed with a keyed BLAKE3
MAC and every value read is checked before use: one written without the secret (a forger with
write access to Redis, a replica without it) is a miss, counted in ``store_unauthenticated_blocks``,
never a token. Without one, values carry a checksum only and the store trusts whoever can write
to its Redis (it says so once, at start).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence

from radixcache.store import STORE_COUNTERS, BlockKV, BlockSource
from radixcache.store.keys import BlockFormat, block_digests, namespace_digest
from radixcache.store.values import BadValue, Unauthenticated, decode_value, encode_value, mac_key, value_size
from radixcache.integrations.redis_store.connection import DOWN, Link, redact, split_url
from radixcache.integrations.redis_store.writer import BlockWriter, WriteJob

logger = logging.getLogger("radixcache.store")

MIB = 1 << 20
DEFAULT_QUEUE_BYTES = 256 * MIB
DEFAULT_PREFIX = "radixcache:"
SECRET_ENV = "RADIXCACHE_STORE_SECRET"
READ_THREADS = 4  # chunks read ahead of the one being verified, across concurrent fetches
_TRUST_NOTED: set = set()  # store URLs whose missing secret was logged


def store_secret(secret_file=None) -> bytes | None:
    """The shared store's secret: the contents of ``secret_file`` (surrounding whitespace stripped),
    else the environment variable ``RADIXCACHE_STORE_SECRET``, else None. Never a command-line value:
    a process's arguments are visible to every user of the machine. ``ValueError`` for a file that
    cannot be read or holds nothing."""
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read().strip()
        except OSError as e:
            raise ValueError(f"store secret file {secret_file}: {e.strerror or e}") from None
        if not secret:
            raise ValueError(f"store secret file {secret_file} is empty")
        return secret
    value = os.environ.get(SECRET_ENV, "").strip()
    return value.encode() if value else None


class Counters:
    """The store's ``STORE_COUNTERS``, thread-safe; frozen by ``freeze`` (later adds are ignored)."""

    def __init__(self):
        self._values = dict.fromkeys(STORE_COUNTERS, 0)
        self._lock = threading.Lock()
        self._frozen = False

    def add(self, **deltas: int) -> None:
        with self._lock:
            if not self._frozen:
                for name, delta in deltas.items():
                    self._values[name] += delta

    def freeze(self) -> None:
        with self._lock:
            self._frozen = True

    def snapshot(self) -> dict:
        with self._lock:
            return dict(self._values)


class RedisStore:
    """Whole KV blocks of one block format in Redis, shared by every process that uses the same URL.

    ``url``: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS; redis-py's query
    options such as ``ssl_ca_certs=`` pass through) or ``unix://``; a Redis Cluster node's URL is
    detected as such. radixcache's own query options: ``ttl`` (seconds; absent: no expiry) and
    ``prefix`` (of every key, default "radixcache:"); the keyword arguments override them.
    ``max_queue_bytes`` bounds the write queue (default 256 MiB); ``timeout`` bounds every socket
    read/write and ``connect_timeout`` every connect (seconds); ``fetch_deadline`` bounds one
    ``fetch``; ``read_chunk_bytes`` / ``write_batch_bytes`` bound one pipeline. ``secret`` (bytes;
    default: the URL's ``secret_file``, else ``store_secret()``) seals every value with a MAC and
    refuses values without a valid one (see the module docstring).

    Never raises because Redis failed: an unreachable store at start is logged once and the store
    runs as a miss-everything, drop-everything store, retrying after a backoff. Bad arguments raise
    ``TypeError``/``ValueError`` at once. Thread-safe.
    """

    def __init__(self, url: str, fmt: BlockFormat, *, ttl: float | None = None,
                 prefix: str | None = None, max_queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 timeout: float = 0.5, connect_timeout: float = 0.5, fetch_deadline: float = 2.0,
                 read_chunk_bytes: int = 8 * MIB, write_batch_bytes: int = 32 * MIB,
                 backoff: tuple[float, float] = (0.5, 30.0), secret: bytes | None = None):
        redis_url, own = split_url(url)
        if secret is None:
            secret = store_secret(own.get("secret_file"))
        self._key = mac_key(secret) if secret is not None else None
        fmt.check()
        ttl = float(own["ttl"]) if ttl is None and "ttl" in own else ttl
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be a positive number of seconds, got {ttl!r}")
        for name, value in [("timeout", timeout), ("connect_timeout", connect_timeout),
                            ("fetch_deadline", fetch_deadline)]:
            if not value > 0:
                raise ValueError(f"{name} must be positive, got {value!r}")
        self.format = fmt
        self.block_size = fmt.block_size
        self.value_bytes = value_size(fmt, self.sealed)
        self.ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
        self.prefix = (prefix if prefix is not None else own.get("prefix", DEFAULT_PREFIX)).encode()
        self.fetch_deadline = fetch_deadline
        self.chunk_blocks = max(1, read_chunk_bytes // self.value_bytes)
        self.counters = Counters()
        self.link = Link(redis_url, timeout=timeout, connect_timeout=connect_timeout,
                         on_error=lambda: self.counters.add(store_errors=1), backoff=backoff)
        self._namespaces: dict = {}
        self._closed = False
        self._warned_refused = False
        self._lock = threading.Lock()
        self.link.run(lambda client: client.ping())  # an unreachable store is reported at start
        if not self.sealed and redact(url) not in _TRUST_NOTED:  # once per store URL and process
            _TRUST_NOTED.add(redact(url))
            logger.warning("radixcache store: no secret (%s or secret_file=): %s trusts whoever can write to "
                           "it; anyone with write access there can change every replica's tokens",
                           SECRET_ENV, redact(url))
        self.writer = BlockWriter(self._send, self._lost, max_bytes=max_queue_bytes,
                                  batch_bytes=max(write_batch_bytes, self.value_bytes))
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="radixcache-store-read")

    # ------------------------------------------------------------------ the BlockStore protocol
    def fetch(self, namespace: tuple, tokens: Sequence[int], start: int, limit: int) -> list[BlockKV]:
        """Verified K/V of blocks ``start, start+1, ...`` (at most ``limit``), stopping at the first miss.

        See ``radixcache.store.BlockStore.fetch``. One pipelined round trip per server per
        ``read_chunk_bytes`` of blocks, the next one in flight while a chunk is verified; a timeout,
        a dead server or a bad value ends the fetch there.
        """
        _validate_range(start, limit)
        bs = self.block_size
        end = min(start + limit, len(tokens) // bs)
        if end <= start or self._closed:
            return []
        ns = self._namespace(namespace)
        digests = block_digests(ns, tokens, bs, end)
        out: list[BlockKV] = []
        received = 0
        deadline = time.monotonic() + self.fetch_deadline
        chunks = [range(i, min(end, i + self.chunk_blocks)) for i in range(start, end, self.chunk_blocks)]

        def read(chunk):
            keys = [self.key(digests[k]) for k in chunk]
            return keys, self.link.run(lambda client: self._get_many(client, keys))

        # the next chunk is read while this one is verified (a MAC costs about what the read does)
        try:
            pending = self._readers.submit(read, chunks[0])
        except RuntimeError:  # closed meanwhile
            return []
        for n, chunk in enumerate(chunks):
            keys, values = pending.result()
            more = n + 1 < len(chunks) and not self._closed and time.monotonic() < deadline
            try:
                pending = self._readers.submit(read, chunks[n + 1]) if more else None
            except RuntimeError:  # closed meanwhile
                pending = None
            if values is DOWN:
                break
            received += sum(len(v) for v in values if isinstance(v, bytes))
            if not self._verified(ns, tokens, digests, chunk, keys, values, out) or pending is None:
                break
        self.counters.add(store_hit_tokens=len(out) * bs, store_miss_blocks=end - start - len(out),
                          store_bytes_read=received)
        return out

    def _verified(self, ns, tokens, digests, chunk, keys, values, out: list) -> bool:
        """Append the verified values of ``chunk`` to ``out`` in order; False at the first one missing or bad."""
        bs = self.block_size
        for k, key, value in zip(chunk, keys, values):
            try:
                if isinstance(value, Exception) and str(value).startswith("WRONGTYPE"):
                    raise BadValue("the key holds another type of value")
                if not isinstance(value, bytes):
                    if value is not None:  # a refused command: the server's trouble, not the key's
                        self.counters.add(store_errors=1)
                    return False
                out.append(decode_value(value, self.format, ns, digests[k], tokens[k * bs:(k + 1) * bs],
                                        self._key))
            except BadValue as e:
                self.counters.add(store_bad_values=1, store_unauthenticated_blocks=isinstance(e, Unauthenticated))
                logger.warning("radixcache store: deleting a bad value (%s)", e)
                self.link.run(lambda client: client.delete(key))
                return False
        return True

    def offer(self, namespace: tuple, tokens: Sequence[int], start: int, blocks: Sequence[int],
              pool: BlockSource) -> int:
        """Snapshot and queue blocks ``start .. start+len(blocks)-1`` of ``tokens``; returns how many.

        See ``radixcache.store.BlockStore.offer``. A block that does not fit drops it and every
        later one of this call (a chain read stops at its first gap, so they could never be read).
        """
        _validate_range(start, len(blocks))
        bs = self.block_size
        end = start + len(blocks)
        if end * bs > len(tokens):
            raise ValueError(f"blocks {start}..{end - 1} need {end * bs} tokens, got {len(tokens)}")
        if not blocks:
            return 0
        ns = self._namespace(namespace)
        n = self.writer.reserve(len(blocks), self.value_bytes) if self.link.breaker.ready() else 0
        if n:
            try:
                snapshots = _export(pool, list(blocks[:n]))
            except BaseException:
                self.writer.unreserve(n * self.value_bytes)
                raise
            self.writer.put(WriteJob(ns, _prefix(tokens, (start + n) * bs), start, snapshots,
                                     n * self.value_bytes))
        if n < len(blocks):
            self.counters.add(store_dropped_blocks=len(blocks) - n)
        return n

    def stats(self) -> dict:
        """The ``radixcache.store.STORE_COUNTERS`` (ints)."""
        return self.counters.snapshot()

    def close(self, timeout: float = 10.0) -> dict:
        """Wait up to ``timeout`` s for queued writes, then close; returns the final counters."""
        with self._lock:
            if self._closed:
                return self.stats()
            self._closed = True
        unsent = self.writer.close(timeout)
        self._readers.shutdown(wait=True)
        if unsent:
            self.counters.add(store_dropped_blocks=unsent)
            logger.warning("radixcache store: %d queued blocks were not written before close", unsent)
        self.counters.freeze()
        self.link.close()
        return self.stats()

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    @property
    def sealed(self) -> bool:
        """Values carry a MAC under the store's secret (and unsealed ones are refused)."""
        return self._key is not None

    def key(self, digest: bytes) -> bytes:
        """The Redis key of a block digest."""
        return self.prefix + digest.hex().encode()

    def _namespace(self, namespace: tuple) -> bytes:
        if not isinstance(namespace, tuple):
            raise TypeError(f"namespace must be a tuple, got {type(namespace).__name__}")
        with self._lock:
            ns = self._namespaces.get(namespace)
        if ns is None:
            ns = namespace_digest(self.format, namespace, self.sealed)
            with self._lock:
                if len(self._namespaces) >= 4096:
                    self._namespaces.clear()
                self._namespaces[namespace] = ns
        return ns

    def _get_many(self, client, keys: list[bytes]) -> list:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            if self.ttl_ms is None:
                pipe.get(key)
            else:
                pipe.getex(key, px=self.ttl_ms)
        return pipe.execute(raise_on_error=False)

    def _send(self, jobs: list[WriteJob]) -> None:
        """Encode and write a batch (runs on the writer thread); counts everything it does."""
        bs = self.block_size
        entries = []
        for job in jobs:
            digests = block_digests(job.ns, job.tokens, bs, job.start + len(job.blocks))
            for j, kv in enumerate(job.blocks):
                i = job.start + j
                value = encode_value(self.format, job.ns, digests[i], job.tokens[i * bs:(i + 1) * bs], kv,
                                     self._key)
                entries.append((self.key(digests[i]), value))

        def exists(client):
            pipe = client.pipeline(transaction=False)
            for key, _ in entries:
                pipe.exists(key)
            return pipe.execute(raise_on_error=False)

        present = self.link.run(exists)
        if present is DOWN:
            self.counters.add(store_dropped_blocks=len(entries))
            return
        todo = [entry for entry, held in zip(entries, present) if held is not True and held != 1]

        def put(client):
            pipe = client.pipeline(transaction=False)
            for key, value in todo:
                pipe.set(key, value, nx=True, px=self.ttl_ms)
            return pipe.execute(raise_on_error=False)

        results = self.link.run(put) if todo else []
        if results is DOWN:
            self.counters.add(store_dropped_blocks=len(todo), store_present_blocks=len(entries) - len(todo))
            return
        written = [len(v) for (_, v), r in zip(todo, results) if r is True]
        failed = sum(1 for r in results if isinstance(r, Exception))
        if failed:
            first = next(r for r in results if isinstance(r, Exception))
            log = logger.debug if self._warned_refused else logger.warning
            self._warned_refused = True
            log("radixcache store: %d writes refused (%s); dropped", failed, first)
        self.counters.add(store_written_blocks=len(written), store_bytes_written=sum(written),
                          store_dropped_blocks=failed, store_errors=failed,
                          store_present_blocks=len(entries) - len(written) - failed)

    def _lost(self, blocks: int) -> None:
        self.counters.add(store_dropped_blocks=blocks, store_errors=1)

    def __repr__(self) -> str:
        return f"RedisStore({redact(self.link.url)}, {self.format.model}, {self.format.kv_dtype})"


def _export(pool: BlockSource, blocks: list) -> list:
    """Snapshots of ``blocks``: one batched ``export_blocks`` where the pool has it."""
    batched = getattr(pool, "export_blocks", None)
    return batched(blocks) if batched is not None else [pool.export_block(b) for b in blocks]


def _prefix(tokens: Sequence[int], n: int):
    """The first ``n`` tokens as an object of their own: an ``array('I')`` copy (one memcpy) of an
    array, else a tuple."""
    return tokens[:n] if isinstance(tokens, array) else tuple(tokens[:n])


def _validate_range(start: int, count: int) -> None:
    for name, value in [("start", start), ("count", count)]:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
