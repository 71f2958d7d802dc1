"""The shared KV tier on Redis (redis-py): ``RedisStore``, a ``radixcache.store.BlockStore``.

    from radixcache.integrations.redis_store import RedisStore, pool_format
    store = RedisStore("redis://localhost:6379/0", pool_format(pool, model="<model identity>"))

Keys and values are ``radixcache.store.keys`` / ``radixcache.store.values``.
"""

from radixcache.integrations.redis_store.store import DEFAULT_QUEUE_BYTES, RedisStore
from radixcache.store.keys import BlockFormat


def pool_format(pool, model: str) -> BlockFormat:
    """The ``BlockFormat`` of a ``radixcache.kv.pool.KVPool`` (read from its public fields) for ``model``."""
    return BlockFormat.of(model, str(pool.storage_dtype).removeprefix("torch."), pool.num_layers,
                          pool.block_size, pool.num_kv_heads, pool.head_dim)


__all__ = ["DEFAULT_QUEUE_BYTES", "BlockFormat", "RedisStore", "pool_format"]
