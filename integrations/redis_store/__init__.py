"""The shared KV tier on Redis (redis-py): ``RedisStore``, a ``radixcache.store.BlockStore``.

    from radixcache.integrations.redis_store import RedisStore, pool_format
    store = RedisStore("redis://localhost:6379/0", pool_format(pool, model="<model identity>"))

Keys and values are ``radixcache.store.keys`` / ``radixcache.store.values``.
"""

from radixcache.integrations.redis_store.store import DEFAULT_QUEUE_BYTES, SECRET_ENV, RedisStore, store_secret
from radixcache.store.keys import BlockFormat


def pool_format(pool, model: str) -> BlockFormat:
    """The ``BlockFormat`` of a ``radixcache.kv.pool.KVPool`` (read from its public fields) for
    ``model``. ``ValueError`` for a pool whose K and V head dims differ (MLA): the block format
    has one head dim."""
    if pool.head_dim != pool.head_dim_v:
        raise ValueError(f"the shared KV tier stores K and V of one head dim; this pool's differ "
                         f"(K {pool.head_dim}, V {pool.head_dim_v}: an MLA model)")
    return BlockFormat.of(model, str(pool.storage_dtype).removeprefix("torch."), pool.num_layers,
                          pool.block_size, pool.num_kv_heads, pool.head_dim)


__all__ = ["DEFAULT_QUEUE_BYTES", "SECRET_ENV", "BlockFormat", "RedisStore", "pool_format", "store_secret"]
