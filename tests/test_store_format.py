"""Keys and values that leave the process: exact framing, round trips, and every corruption caught."""

import hashlib
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache.store import BlockKV
from radixcache.store.keys import (FORMAT_VERSION, ITEMSIZE, BlockFormat, block_digests,
                                   encode_namespace, frame, namespace_digest)
from radixcache.store.values import BadValue, decode_value, encode_value, header_size, value_size

dtypes = st.sampled_from(sorted(ITEMSIZE))
namespaces = st.tuples(st.text(max_size=8), st.one_of(st.none(), st.text(max_size=8)))


@st.composite
def formats(draw):
    layers = draw(st.integers(1, 3))
    bs = draw(st.integers(1, 8))
    return BlockFormat.of(draw(st.text(min_size=1, max_size=12)), draw(dtypes), layers, bs,
                          draw(st.integers(1, 2)), draw(st.integers(1, 4)))


@st.composite
def blocks(draw):
    """(format, ns digest, block digest, tokens, BlockKV) of one random block."""
    fmt = draw(formats())
    ns = namespace_digest(fmt, draw(namespaces))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=fmt.block_size, max_size=fmt.block_size))
    digest = block_digests(ns, tokens, fmt.block_size, 1)[0]
    data = draw(st.binary(min_size=fmt.payload_bytes, max_size=fmt.payload_bytes))
    scales = tuple(draw(st.lists(st.floats(0.0625, 1024.0, width=32), min_size=fmt.num_scales,
                                 max_size=fmt.num_scales)))
    return fmt, ns, digest, tokens, BlockKV(data, fmt.kv_dtype, fmt.shape, scales)


@settings(max_examples=200, deadline=None)
@given(blocks())
def test_value_round_trip(block):
    fmt, ns, digest, tokens, kv = block
    value = encode_value(fmt, ns, digest, tokens, kv)
    assert len(value) == value_size(fmt)
    out = decode_value(value, fmt, ns, digest, tokens)
    assert bytes(out.data) == bytes(kv.data)
    assert (out.dtype, out.shape, out.scales) == (kv.dtype, kv.shape, kv.scales)


@settings(max_examples=300, deadline=None)
@given(blocks(), st.data())
def test_every_single_byte_change_is_caught(block, data):
    fmt, ns, digest, tokens, kv = block
    value = bytearray(encode_value(fmt, ns, digest, tokens, kv))
    at = data.draw(st.integers(0, len(value) - 1))
    value[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(BadValue):
        decode_value(bytes(value), fmt, ns, digest, tokens)


@settings(max_examples=200, deadline=None)
@given(blocks(), st.data())
def test_truncation_and_extension_are_caught(block, data):
    fmt, ns, digest, tokens, kv = block
    value = encode_value(fmt, ns, digest, tokens, kv)
    cut = data.draw(st.integers(0, len(value) - 1))
    with pytest.raises(BadValue, match="bytes"):
        decode_value(value[:cut], fmt, ns, digest, tokens)
    with pytest.raises(BadValue):
        decode_value(value + data.draw(st.binary(min_size=1, max_size=8)), fmt, ns, digest, tokens)


def _resealed(value: bytes, at: int, new: bytes) -> bytes:
    """``value`` with ``new`` written at ``at`` and a recomputed (valid) checksum: a forged value."""
    body = bytearray(value[:-16])
    body[at:at + len(new)] = new
    return bytes(body) + xxhash.xxh3_128_digest(bytes(body))


def test_a_valid_checksum_does_not_excuse_any_other_mismatch():
    fmt = BlockFormat.of("m", "float8_e4m3fn", 2, 4, 1, 2)
    ns = namespace_digest(fmt, ("fp", None))
    tokens = [1, 2, 3, 4]
    digest = block_digests(ns, tokens, 4, 1)[0]
    kv = BlockKV(bytes(range(fmt.payload_bytes)), fmt.kv_dtype, fmt.shape, (1.0, 2.0, 3.0, 4.0))
    value = encode_value(fmt, ns, digest, tokens, kv)
    name = len(fmt.kv_dtype)
    cases = {
        "bad magic": (0, b"XXXX"),
        "format version": (4, struct.pack("<H", FORMAT_VERSION + 1)),
        "namespace mismatch": (6, b"\0" * 32),
        "chain digest mismatch": (38, b"\0" * 32),
        "expected float8": (71, b"float8_e5m2"[:name]),
        "expected float8_e4m3fn": (72 + name, struct.pack("<I", 3)),
        "token mismatch": (96 + name, struct.pack("<I", 9)),
        "scales, expected": (96 + name + 16, struct.pack("<I", 2)),
        "payload of": (100 + name + 16 + 16, struct.pack("<Q", 7)),
    }
    for reason, (at, new) in cases.items():
        with pytest.raises(BadValue, match=reason):
            decode_value(_resealed(value, at, new), fmt, ns, digest, tokens)
    # the reader's expectations: another namespace, chain position, tokens or format
    other = BlockFormat.of("m", "float8_e4m3fn", 2, 4, 1, 2)._replace(model="other")
    with pytest.raises(BadValue, match="namespace"):
        decode_value(value, fmt, namespace_digest(fmt, ("fp", "tenant-b")), digest, tokens)
    with pytest.raises(BadValue, match="chain digest"):
        decode_value(value, fmt, ns, block_digests(ns, [9, 9, 9, 9], 4, 1)[0], tokens)
    with pytest.raises(BadValue, match="token"):
        decode_value(value, fmt, ns, digest, [1, 2, 3, 5])
    assert decode_value(value, other, ns, digest, tokens)  # format fields live in ns, checked above
    with pytest.raises(BadValue, match="bytes"):
        decode_value(value, BlockFormat.of("m", "float16", 2, 4, 1, 2), ns, digest, tokens)
    with pytest.raises(BadValue, match="pickle|magic|checksum|bytes"):
        decode_value(b"\x80\x04\x95" + b"\0" * (len(value) - 3), fmt, ns, digest, tokens)


def test_header_layout_is_as_documented():
    fmt = BlockFormat.of("m", "float32", 3, 2, 1, 1)
    ns, digest, tokens = b"N" * 32, b"D" * 32, [7, 8]
    data = bytes(range(fmt.payload_bytes))
    value = encode_value(fmt, ns, digest, tokens, BlockKV(data, "float32", fmt.shape))
    n = len("float32")
    assert value[:4] == b"RCKV" and struct.unpack("<H", value[4:6]) == (FORMAT_VERSION,)
    assert value[6:38] == ns and value[38:70] == digest
    assert value[70] == n and value[71:71 + n] == b"float32" and value[71 + n] == 5
    assert struct.unpack("<5I", value[72 + n:92 + n]) == (3, 2, 2, 1, 1)
    assert struct.unpack("<3I", value[92 + n:104 + n]) == (2, 7, 8)
    assert struct.unpack("<IQ", value[104 + n:116 + n]) == (0, fmt.payload_bytes)
    assert header_size(fmt) == 116 + n
    assert value[header_size(fmt):-16] == data
    assert value[-16:] == xxhash.xxh3_128_digest(value[:-16])


def test_smollm2_fp32_block_is_737280_bytes_of_payload():
    fmt = BlockFormat.of("smollm2", "float32", 30, 16, 3, 64)
    assert fmt.payload_bytes == 737_280 and value_size(fmt) - fmt.payload_bytes < 256


def test_key_bytes_are_as_documented():
    fmt = BlockFormat.of("model-x", "bfloat16", 2, 2, 1, 4)
    ns = namespace_digest(fmt, ("fp", "salt"))
    raw = b"".join(frame(p) for p in [struct.pack("<H", FORMAT_VERSION), b"model-x", b"bfloat16",
                                      struct.pack("<I", 2), fmt.layout.encode(),
                                      struct.pack("<5I", 2, 2, 2, 1, 4),
                                      encode_namespace(("fp", "salt"))])
    assert ns == hashlib.blake2b(raw, digest_size=32, person=b"radixcache-ns").digest()
    d0, d1 = block_digests(ns, [5, 6, 7, 8], 2, 2)
    version = frame(struct.pack("<H", FORMAT_VERSION))
    assert d0 == hashlib.blake2b(version + frame(ns) + frame(b"") + frame(struct.pack("<2I", 5, 6)),
                                 digest_size=32, person=b"radixcache-blk").digest()
    assert d1 == hashlib.blake2b(version + frame(ns) + frame(d0) + frame(struct.pack("<2I", 7, 8)),
                                 digest_size=32, person=b"radixcache-blk").digest()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=24), st.lists(st.integers(0, 50), min_size=1,
                                                                       max_size=24),
       st.integers(1, 4))
def test_chained_keys_are_equal_exactly_when_the_whole_prefix_is(a, b, bs):
    fmt = BlockFormat.of("m", "float32", 1, bs, 1, 1)
    ns = namespace_digest(fmt, ())
    da = block_digests(ns, a, bs, len(a) // bs)
    db = block_digests(ns, b, bs, len(b) // bs)
    for i, (x, y) in enumerate(zip(da, db)):
        assert (x == y) == (a[:(i + 1) * bs] == b[:(i + 1) * bs])
    assert block_digests(ns, a, bs, len(a) // bs) == da  # deterministic


@given(namespaces, namespaces)
def test_namespaces_collide_only_when_equal(a, b):
    fmt = BlockFormat.of("m", "float32", 1, 2, 1, 1)
    assert (namespace_digest(fmt, a) == namespace_digest(fmt, b)) == (a == b)


def test_every_format_field_and_framing_separates_keys():
    base = BlockFormat.of("m", "float32", 2, 4, 2, 8)
    variants = [base, base._replace(model="m2"), BlockFormat.of("m", "bfloat16", 2, 4, 2, 8),
                BlockFormat.of("m", "float32", 2, 8, 2, 8), BlockFormat.of("m", "float32", 3, 4, 2, 8),
                BlockFormat.of("m", "float32", 2, 4, 1, 8), base._replace(layout="other")]
    digests = {namespace_digest(f, ("fp", "t")) for f in variants}
    assert len(digests) == len(variants)
    framed = [("ab", "c"), ("a", "bc"), ("abc",), ("1",), (1,), (True,), (None,), ("",), ((),),
              (("a",),), (b"a",), ("a",)]
    assert len({namespace_digest(base, ns) for ns in framed}) == len(framed)


def test_bad_arguments_raise_clearly():
    with pytest.raises(ValueError, match="kv_dtype"):
        BlockFormat.of("m", "int8", 1, 1, 1, 1)
    with pytest.raises(TypeError, match="model identity"):
        BlockFormat.of("", "float32", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="shape"):
        BlockFormat.of("m", "float32", 0, 1, 1, 1)
    with pytest.raises(TypeError, match="namespace elements"):
        namespace_digest(BlockFormat.of("m", "float32", 1, 1, 1, 1), (1.5,))
    with pytest.raises(TypeError, match="tuple"):
        encode_namespace(["a"])
    with pytest.raises(ValueError, match="token ids"):
        block_digests(b"n" * 32, [-1, 2], 2, 1)
    with pytest.raises(ValueError, match="do not fit"):
        block_digests(b"n" * 32, [1, 2], 2, 2)
    fmt = BlockFormat.of("m", "float32", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="payload"):
        encode_value(fmt, b"n" * 32, b"d" * 32, [1], BlockKV(b"abc", "float32", fmt.shape))
    with pytest.raises(ValueError, match="holds"):
        encode_value(fmt, b"n" * 32, b"d" * 32, [1], BlockKV(b"abcd", "float16", fmt.shape))
