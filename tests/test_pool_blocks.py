"""KVPool.export_block / import_block: one block's K/V of every layer out as bytes and back, exactly."""

import pytest
import torch

from radixcache.kv.pool import FP8_MAX, KVPool
from radixcache.store import BlockKV, BlockSink, BlockSource

LAYERS, BLOCKS, BS, HEADS, DIM = 3, 6, 4, 2, 8


def make_pool(kv_dtype=None, dtype=torch.float32):
    return KVPool(LAYERS, BLOCKS, BS, HEADS, DIM, dtype=dtype, device="cpu", kv_dtype=kv_dtype)


def fill(pool, block, seed, scale=1.0):
    """Write random K/V (one draw per layer) into ``block``; returns what was written."""
    g = torch.Generator().manual_seed(seed)
    rows = pool.rows_for([block], 0, BS)
    written = []
    for layer in range(pool.num_layers):
        k = torch.randn(BS, HEADS, DIM, generator=g) * scale
        v = torch.randn(BS, HEADS, DIM, generator=g) * scale
        pool.write(layer, rows, k, v)
        written.append((k, v))
    return written


def read(pool, block):
    rows = pool.rows_for([block], 0, BS)
    return [pool.read(layer, rows) for layer in range(pool.num_layers)]


def same(a, b):
    return all(torch.equal(x, y) for (xk, xv), (yk, yv) in zip(a, b) for x, y in ((xk, yk), (xv, yv)))


@pytest.mark.parametrize("kv_dtype", [None, "bf16", "fp16", "fp8"])
def test_export_import_round_trip_is_exact(kv_dtype):
    a, b = make_pool(kv_dtype), make_pool(kv_dtype)
    assert isinstance(a, BlockSource) and isinstance(b, BlockSink)
    fill(a, 2, seed=1)
    kv = a.export_block(2)
    assert kv.shape == (LAYERS, 2, BS, HEADS, DIM)
    assert len(memoryview(kv.data).cast("B")) == a.bytes_per_token * BS
    assert kv.dtype == str(a.storage_dtype).removeprefix("torch.")
    assert len(kv.scales) == (2 * LAYERS if kv_dtype == "fp8" else 0)
    b.import_block(5, BlockKV(bytes(memoryview(kv.data).cast("B")), kv.dtype, kv.shape, kv.scales))
    assert same(read(a, 2), read(b, 5))


def test_the_payload_is_token_major_whatever_the_pool_layout():
    """The bytes that leave the process are every layer's K ``[block_size, kv_heads, dim]`` then its
    V, token by token (the layout other processes and earlier versions read), though the pool keeps
    heads first; and a payload written that way lands at the same tokens and heads."""
    pool = make_pool()
    written = fill(pool, 2, seed=7)
    kv = pool.export_block(2)
    assert tuple(kv.shape) == (LAYERS, 2, BS, HEADS, DIM)
    payload = torch.frombuffer(bytearray(kv.data), dtype=torch.float32).view(LAYERS, 2, BS, HEADS, DIM)
    for layer, (k, v) in enumerate(written):
        assert torch.equal(payload[layer, 0], k) and torch.equal(payload[layer, 1], v)
    other = make_pool()
    other.import_block(4, BlockKV(payload.flip(2).numpy().reshape(-1), kv.dtype, kv.shape, kv.scales))
    assert same(read(other, 4), [(k.flip(0), v.flip(0)) for k, v in written])


def test_snapshot_never_changes_when_the_block_is_reused():
    pool = make_pool()
    first = fill(pool, 1, seed=1)
    kv = pool.export_block(1)
    fill(pool, 1, seed=2)  # the block is evicted and reused for other tokens
    other = make_pool()
    other.import_block(0, kv)
    assert same(read(other, 0), first)
    assert not same(read(pool, 1), first)


def test_fp8_adopts_an_unset_scale_and_rescales_another():
    a = make_pool("fp8")
    fill(a, 0, seed=1, scale=1.0)
    want = read(a, 0)
    b = make_pool("fp8")
    b.import_block(0, a.export_block(0))
    assert torch.equal(b.scales, a.scales) and same(read(b, 0), want)
    c = make_pool("fp8")
    fill(c, 3, seed=3, scale=4.0)  # c calibrated on larger K/V: a larger scale
    before = c.scales.clone()
    c.import_block(1, a.export_block(0))
    assert torch.equal(c.scales, before)  # a set scale is never changed by an import
    for (wk, wv), (gk, gv) in zip(want, read(c, 1)):
        for w, g in ((wk, gk), (wv, gv)):
            assert torch.allclose(g, w, rtol=0.13, atol=float(before.max()) * 0.02)


def test_fp8_refuses_a_rescale_that_would_clip_and_writes_nothing():
    small = make_pool("fp8")
    fill(small, 0, seed=1, scale=0.01)
    big = make_pool("fp8")
    fill(big, 0, seed=2, scale=10.0)
    kv = big.export_block(0)
    assert max(kv.scales) * FP8_MAX > float(small.scales.max()) * FP8_MAX
    before = read(small, 0)
    with pytest.raises(ValueError, match="refusing to clip"):
        small.import_block(0, kv)
    assert same(read(small, 0), before)


def test_import_rejects_what_does_not_fit_and_writes_nothing():
    pool, other = make_pool(), make_pool()
    fill(pool, 0, seed=1)
    before = read(pool, 0)
    kv = other.export_block(0)
    bad = [
        (kv._replace(dtype="bfloat16"), "this pool holds"),
        (kv._replace(shape=(LAYERS, 2, BS, HEADS, DIM * 2)), "this pool holds"),
        (kv._replace(data=bytes(memoryview(kv.data).cast("B"))[:-1]), "bytes, expected"),
        (kv._replace(scales=(1.0,)), "carries no scales"),
    ]
    for value, message in bad:
        with pytest.raises(ValueError, match=message):
            pool.import_block(0, value)
    fp8 = make_pool("fp8")
    good = make_pool("fp8")
    fill(good, 0, seed=1)
    for scales, message in [((1.0,), "needs 6 scales"), ((0.0,) * 6, "not a positive number")]:
        with pytest.raises(ValueError, match=message):
            fp8.import_block(0, good.export_block(0)._replace(scales=scales))
    for block in (-1, BLOCKS, True, 1.0):  # BLOCKS is the null block: never written
        with pytest.raises(ValueError, match="block must be"):
            pool.import_block(block, kv)
        with pytest.raises(ValueError, match="block must be"):
            pool.export_block(block)
    assert same(read(pool, 0), before)
    assert not fp8.scales.any()  # a refused import sets no scale


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_k_and_v_of_different_head_dims_round_trip(kv_dtype):
    """An MLA pool (K 12 wide, V 8 per head): rows, reads, copies and block export/import keep K
    and V apart and exact; the payload is every layer's K bytes then V bytes."""
    def mla_pool():
        return KVPool(2, 5, BS, HEADS, 12, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype,
                      head_dim_v=8)

    a, b = mla_pool(), mla_pool()
    assert a.bytes_per_token == 2 * HEADS * (12 + 8) * (1 if kv_dtype else 4)
    g = torch.Generator().manual_seed(3)
    rows = a.rows_for([1], 0, BS)
    written = [(torch.randn(BS, HEADS, 12, generator=g), torch.randn(BS, HEADS, 8, generator=g))
               for _ in range(2)]
    for layer, (k, v) in enumerate(written):
        a.write(layer, rows, k, v)
    a.copy_block(1, 3)
    kv = a.export_block(3)
    assert kv.shape == (2, 2, BS, HEADS, 12, 8)
    assert len(memoryview(kv.data).cast("B")) == a.bytes_per_token * BS
    b.import_block(0, kv)
    for layer, (k, v) in enumerate(written):
        got_k, got_v = b.read(layer, b.rows_for([0], 0, BS))
        want_k, want_v = a.read(layer, rows)
        assert got_k.shape == (BS, HEADS, 12) and got_v.shape == (BS, HEADS, 8)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        if kv_dtype is None:
            assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_export_blocks_is_export_block_of_each():
    pool = make_pool("fp8")
    fill(pool, 1, seed=1)
    fill(pool, 4, seed=2)
    batched = pool.export_blocks([4, 1, 4])
    for kv, block in zip(batched, [4, 1, 4]):
        one = pool.export_block(block)
        assert bytes(memoryview(kv.data).cast("B")) == bytes(memoryview(one.data).cast("B"))
        assert (kv.dtype, kv.shape, kv.scales) == (one.dtype, one.shape, one.scales)
    assert pool.export_blocks([]) == []
    with pytest.raises(ValueError, match="block must be"):
        pool.export_blocks([1, BLOCKS])


def test_the_shared_tier_refuses_a_pool_of_two_head_dims():
    from radixcache.integrations.redis_store import pool_format

    pool = KVPool(1, 2, BS, 1, 12, dtype=torch.float32, device="cpu", head_dim_v=8)
    with pytest.raises(ValueError, match="MLA"):
        pool_format(pool, "model")
    assert pool_format(make_pool(), "model").shape == (LAYERS, 2, BS, HEADS, DIM)
