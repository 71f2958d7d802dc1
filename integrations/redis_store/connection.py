"""One store's connection to Redis: from a URL, plain or Cluster, bounded timeouts, never retried blindly.

redis-py retries a failed command up to 10 times by default; a cache tier must not: a miss costs a
recompute, a stall costs every request behind it. So every command runs once with bounded socket
timeouts, and after a failure a breaker skips the store for a backoff (doubling up to a cap) before
the next try. The first failure after a healthy stretch (or at start) is logged once as a warning.
"""

from __future__ import annotations

import logging
import threading
import time
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

logger = logging.getLogger("radixcache.store")

SCHEMES = ("redis", "rediss", "unix")
# radixcache's own URL query options, taken out before redis-py sees it
OWN_OPTIONS = ("ttl", "prefix", "secret_file")
DOWN = object()  # what ``Link.run`` returns when the store could not be used
FAILURES = (redis.RedisError, RedisClusterException, OSError)  # a store failure, never a caller's error


def split_url(url: str) -> tuple[str, dict]:
    """``(url for redis-py, {"ttl": ..., "prefix": ..., "secret_file": ...})``; ``ValueError`` on a URL
    that is not Redis's."""
    if not isinstance(url, str):
        raise TypeError(f"store URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"store URL must start with redis://, rediss:// or unix://, got {redact(url)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    own = {k: v for k, v in query if k in OWN_OPTIONS}
    rest = urlencode([(k, v) for k, v in query if k not in OWN_OPTIONS], safe="/")
    return urlunsplit(parts._replace(query=rest)), own


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (for logs and errors)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


class Breaker:
    """Closed while the store works; after a failure, open (skip the store) for a growing backoff."""

    def __init__(self, first: float = 0.5, cap: float = 30.0, clock=time.monotonic):
        self.first, self.cap, self.clock = first, cap, clock
        self.backoff = 0.0  # 0: closed
        self.until = 0.0

    def ready(self) -> bool:
        """Whether the store may be tried now."""
        return self.backoff == 0.0 or self.clock() >= self.until

    def failed(self) -> bool:
        """Open (or keep open, doubling the backoff); True when this opened a closed breaker."""
        opened = self.backoff == 0.0
        self.backoff = self.first if opened else min(self.cap, 2 * self.backoff)
        self.until = self.clock() + self.backoff
        return opened

    def succeeded(self) -> bool:
        """Close; True when it was open."""
        was_open = self.backoff != 0.0
        self.backoff = 0.0
        return was_open


class Link:
    """The client of one store, made lazily (plain Redis or Redis Cluster, detected), used through ``run``.

    ``timeout`` bounds every socket read and write, ``connect_timeout`` every connect. Thread-safe:
    redis-py clients pool their connections; the breaker and the client slot are under a lock.
    """

    def __init__(self, url: str, *, timeout: float, connect_timeout: float, on_error,
                 backoff: tuple[float, float] = (0.5, 30.0), clock=time.monotonic):
        self.url = url
        self.options = dict(socket_timeout=timeout, socket_connect_timeout=connect_timeout,
                            retry=Retry(NoBackoff(), 0), socket_read_size=256 * 1024)
        self.on_error = on_error
        self.breaker = Breaker(*backoff, clock=clock)
        self.cluster = False
        self._client = None
        self._lock = threading.Lock()
        self._warned = False
        self._closed = False

    def run(self, operation):
        """``operation(client)``'s result, or ``DOWN`` when the store is skipped or the operation failed.

        A failure is counted (``on_error``), opens the breaker and is logged once per outage.
        """
        with self._lock:
            if self._closed or not self.breaker.ready():
                return DOWN
        try:
            client = self._connected()
            result = operation(client)
        except FAILURES as e:
            self._failed(e)
            return DOWN
        with self._lock:
            if self.breaker.succeeded():
                self._warned = False
                logger.info("radixcache store: %s is reachable again", redact(self.url))
        return result

    def close(self) -> None:
        """Close every connection; every later ``run`` returns ``DOWN``."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except FAILURES:
                pass

    def _connected(self):
        with self._lock:
            if self._client is not None:
                return self._client
        client = redis.Redis.from_url(self.url, **self.options)
        try:
            cluster = bool(client.info("cluster").get("cluster_enabled"))
        except BaseException:
            client.close()
            raise
        if cluster:  # the plain client only probed; a cluster needs the slot-aware one
            client.close()
            client = RedisCluster.from_url(self.url, **self.options)
        with self._lock:
            if self._client is None and not self._closed:
                self._client, self.cluster = client, cluster
                return client
        client.close()  # another thread connected first, or the link closed meanwhile
        with self._lock:
            if self._client is None:
                raise redis.ConnectionError("store closed")
            return self._client

    def _failed(self, error: Exception) -> None:
        self.on_error()
        with self._lock:
            self.breaker.failed()
            warn = not self._warned
            self._warned = True
            wait = self.breaker.backoff
        if warn:
            logger.warning("radixcache store: %s failed (%s: %s); running without it, retrying in "
                           "%.1f s", redact(self.url), type(error).__name__, error, wait)
