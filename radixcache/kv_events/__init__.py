"""KV events: the tree's whole blocks as vLLM publishes them, for KV-aware routers.

``KVEventPublisher(endpoint)`` binds a ZMQ PUB socket and publishes vLLM's layout
(``radixcache.kv_events.publisher``, ``radixcache.kv_events.translate``); ``CacheManager.use_events``
(or ``radixcache.wrap(model, kv_events=...)``) routes a tree's changes to it through a
``BlockEventLog`` (``radixcache.kv_events.log``). pyzmq and msgpack are needed only to publish
(``pip install pyzmq msgpack``, radixcache's ``[events]`` extra).
"""

from radixcache.kv_events.log import BlockEventLog
from radixcache.kv_events.publisher import KVEventPublisher
from radixcache.kv_events.translate import EventTranslator, block_hash

__all__ = ["BlockEventLog", "EventTranslator", "KVEventPublisher", "block_hash", "open_publisher"]


def open_publisher(kv_events) -> KVEventPublisher | None:
    """``kv_events`` as a publisher: None stays None, an endpoint string (``tcp://HOST:PORT``)
    binds a new ``KVEventPublisher``, a ``KVEventPublisher`` that is not closed is used as is.
    ``TypeError`` for anything else, ``ValueError`` for a closed publisher or an endpoint that
    cannot be bound."""
    if kv_events is None or isinstance(kv_events, KVEventPublisher):
        if kv_events is not None and kv_events.closed:
            raise ValueError("kv_events: this KVEventPublisher is closed")
        return kv_events
    if isinstance(kv_events, str):
        return KVEventPublisher(kv_events)
    raise TypeError(f"kv_events must be an endpoint such as 'tcp://127.0.0.1:5557' or a "
                    f"KVEventPublisher, got {type(kv_events).__name__}")
