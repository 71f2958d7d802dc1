"""Problem 7 of issue 8: fp8 scales are calibrated per layer on the first real K/V (not on the
wrap-time self-test's random prompt), mirrored on the host, and clamping is counted and reported."""

import logging

import pytest
import torch

import radixcache
from radixcache.kv.pool import FP8_HEADROOM, FP8_MAX, KVPool
from tiny_models import random_ids, tiny_model

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_self_test_leaves_the_scales_uncalibrated(model):
    """wrap() runs its self-test through the fp8 pool, then forgets those scales."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, kv_dtype="fp8")
    assert lm.unsupported is None
    assert lm.pool.calibrated_layers() == 0


def test_first_real_kv_sets_every_layer_scale_and_its_host_mirror(model):
    """After the first generate each layer's K and V scales are amax * headroom / 448 of that
    layer's first K/V, and the host mirror equals the device scales."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, kv_dtype="fp8")
    ids = random_ids(20, 1)
    captured = {}
    handles = [layer.self_attn.k_proj.register_forward_hook(
        lambda m, a, o, i=i: captured.setdefault(i, o)) for i, layer in enumerate(model.model.layers)]
    try:
        lm.generate(ids, max_new_tokens=1)
    finally:
        for h in handles:
            h.remove()
    pool = lm.pool
    assert pool.calibrated_layers() == pool.num_layers
    for layer in range(pool.num_layers):
        k_scale, v_scale = pool.host_scales(layer)
        assert torch.tensor([k_scale, v_scale]).allclose(pool.scales[layer].cpu())
        assert k_scale > 0 and v_scale > 0 and k_scale != v_scale
    # K of layer 0 is its k_proj output after RoPE: amax is within the rotation's range of k_proj's
    raw = captured[0].abs().amax().item()
    k0 = pool.host_scales(0)[0] * FP8_MAX / FP8_HEADROOM
    assert 0.5 * raw < k0 < 2.0 * raw


def test_kv_beyond_the_calibrated_range_is_counted_and_warned(model, caplog):
    """K/V larger than the calibrated range is clamped: counted in stats and warned about once."""
    pool = KVPool(1, 4, BS, 2, 8, dtype=torch.float32, device="cpu", kv_dtype="fp8")
    rows = pool.rows_for([0], 0, 2)
    pool.write(0, rows, torch.ones(2, 2, 8), torch.ones(2, 2, 8))
    assert pool.clamped_writes() == 0
    pool.write(0, rows, torch.full((2, 2, 8), 100.0), torch.ones(2, 2, 8))
    assert pool.clamped_writes() == 1
    keys, _ = pool.read(0, rows)
    assert keys.max().item() == pytest.approx(FP8_HEADROOM, rel=0.1)  # clamped at the range's edge

    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512, kv_dtype="fp8")
    lm.generate(random_ids(20, 2), max_new_tokens=1)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(50.0)
    try:
        with caplog.at_level(logging.WARNING, logger="radixcache"):
            lm.generate(random_ids(20, 3), max_new_tokens=1)
    finally:
        with torch.no_grad():
            model.model.layers[0].self_attn.v_proj.weight.div_(50.0)
    assert lm.stats()["fp8_clamped_writes"] > 0
    assert any("clamped" in r.message for r in caplog.records)


def test_reset_calibration_forgets_scales():
    """reset_calibration() makes the next write calibrate again."""
    pool = KVPool(2, 4, BS, 1, 4, dtype=torch.float32, device="cpu", kv_dtype="fp8")
    rows = pool.rows_for([1], 0, 1)
    pool.write(1, rows, torch.full((1, 1, 4), 3.0), torch.full((1, 1, 4), 2.0))
    assert pool.calibrated_layers() == 1
    assert pool.host_scales(1) == pytest.approx((3.0 * FP8_HEADROOM / FP8_MAX, 2.0 * FP8_HEADROOM / FP8_MAX))
    pool.reset_calibration()
    assert pool.calibrated_layers() == 0 and pool.host_scales(1) == (0.0, 0.0)


def test_a_first_write_racing_an_import_keeps_one_scale_per_layer(monkeypatch):
    """Issue 18, defect 2: a layer's first write calibrates its scales while a store prefetch on
    another thread imports a block written with other scales. The calibration is held open (it
    waits up to 0.5 s for the import to finish) so the threads overlap deterministically. The
    import must not adopt its scales between the writer's decision and its calibration: both blocks
    read back what was written, and the export ships the scales the bytes were written with."""
    import threading

    source = KVPool(1, 4, BS, 2, 8, dtype=torch.float32, device="cpu", kv_dtype="fp8")
    stored = torch.linspace(-1, 1, BS * 2 * 8).view(BS, 2, 8)  # small values: a small scale
    source.write(0, source.rows_for([0], 0, BS), stored, stored)
    value = source.export_block(0)

    pool = KVPool(1, 4, BS, 2, 8, dtype=torch.float32, device="cpu", kv_dtype="fp8")
    original = pool.fp8.calibrate
    imported = threading.Event()

    def held_open(*args):
        imported.wait(0.5)  # the import finishes meanwhile unless the lock keeps it out
        original(*args)

    monkeypatch.setattr(pool.fp8, "calibrate", held_open)
    written = torch.linspace(-8, 8, BS * 2 * 8).view(BS, 2, 8)
    writer = threading.Thread(target=pool.write, args=(0, pool.rows_for([1], 0, BS), written, written))
    writer.start()

    def run_import():
        pool.import_block(2, value)
        imported.set()

    importer = threading.Thread(target=run_import)
    importer.start()
    writer.join()
    importer.join()
    keys, values = pool.read(0, pool.rows_for([2], 0, BS))
    # rescaled into the writer's (8x larger) scale: fp8 steps of about 0.07 at this range
    assert torch.allclose(keys, stored, atol=0.1) and torch.allclose(values, stored, atol=0.1)
    keys, _ = pool.read(0, pool.rows_for([1], 0, BS))
    assert torch.allclose(keys, written, rtol=0.07, atol=0.05)
    again = KVPool(1, 4, BS, 2, 8, dtype=torch.float32, device="cpu", kv_dtype="fp8")
    again.import_block(0, pool.export_block(2))
    assert torch.allclose(again.read(0, again.rows_for([0], 0, BS))[0], stored, atol=0.1)
