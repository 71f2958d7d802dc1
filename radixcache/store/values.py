"""Values that leave the process: one block's K/V with a self-describing, checksummed header.

Exact bytes (every integer little-endian), for a block of ``t`` tokens:

    offset     size  field
    0          4     magic b"RCKV"
    4          2     u16 format version (``keys.FORMAT_VERSION``)
    6          32    namespace digest N (``keys.namespace_digest``)
    38         32    block digest D_i (the key's own digest: the chain position)
    70         1     u8 dtype name length n
    71         n     dtype name, ASCII ("float32", "bfloat16", "float16", "float8_e4m3fn")
    71+n       1     u8 ndim (5)
    72+n       20    shape, u32 x 5: (layers, 2, block_size, kv_heads, head_dim)
    92+n       4     u32 token count t (== block_size)
    96+n       4t    the block's tokens, u32 each
    96+n+4t    4     u32 scale count s (2 x layers for fp8, else 0)
    100+n+4t   4s    scales, f32 each (layer 0 K, layer 0 V, layer 1 K, ...)
    100+n+4t+4s 8    u64 payload length P (== prod(shape) x itemsize)
    H          P     payload: K/V bytes in C order over shape, storage dtype
    H+P        T     the seal of bytes [0, H+P): without a store secret, xxh3-128 (16 bytes, the
                     canonical big-endian digest: catches corruption, not a forger); with one,
                     keyed BLAKE3 (32 bytes: a MAC, ``mac_key``)

``decode_value`` checks the size, the seal, every header field against what the reader expects
(namespace, chain digest, tokens, dtype, shape, scale count) and raises ``BadValue`` on the first
mismatch (``Unauthenticated`` when the MAC does not match): the caller treats it as a miss. The
header holds the block's chain digest and tokens, so a MAC also binds the value to its key: a value
copied under another key fails. No pickle: nothing in a value is ever executed.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence

import xxhash

from radixcache.store import BlockKV
from radixcache.store.keys import DIGEST_SIZE, FORMAT_VERSION, BlockFormat, token_bytes

MAGIC = b"RCKV"
CHECKSUM_SIZE = 16
MAC_SIZE = 32
_MAC_CONTEXT = "radixcache 2026-12-06 shared KV tier block MAC"


class BadValue(ValueError):
    """A stored value that must not be used: truncated, corrupted, or made for another block/format."""


class Unauthenticated(BadValue):
    """A value whose MAC does not check out under the store's secret: written without the secret
    (or with another one), or changed since."""


def mac_key(secret: bytes | str) -> bytes:
    """The 32-byte BLAKE3 key of a store secret (any bytes, e.g. a file's contents), derived with
    BLAKE3's key derivation mode (so a secret is never used as a key of two purposes)."""
    import blake3

    if isinstance(secret, str):
        secret = secret.encode()
    if not secret:
        raise ValueError("a store secret must not be empty")
    return blake3.blake3(secret, derive_key_context=_MAC_CONTEXT).digest()


def _seal(key: bytes | None, header, payload) -> bytes:
    if key is None:
        check = xxhash.xxh3_128(header)
        check.update(payload)
        return check.digest()
    import blake3

    mac = blake3.blake3(header, key=key)
    mac.update(payload)
    return mac.digest()


def header_size(fmt: BlockFormat) -> int:
    """Bytes before the payload of a value of ``fmt``."""
    return (4 + 2 + 2 * DIGEST_SIZE + 1 + len(fmt.kv_dtype) + 1 + 4 * len(fmt.shape)
            + 4 + 4 * fmt.block_size + 4 + 4 * fmt.num_scales + 8)


def value_size(fmt: BlockFormat, sealed: bool = False) -> int:
    """Exact length of every value of ``fmt`` (``sealed``: with a MAC, not a checksum)."""
    return header_size(fmt) + fmt.payload_bytes + (MAC_SIZE if sealed else CHECKSUM_SIZE)


def encode_value(fmt: BlockFormat, ns: bytes, digest: bytes, tokens: Sequence[int],
                 kv: BlockKV, key: bytes | None = None) -> bytes:
    """The value of one block: ``kv`` must match ``fmt`` (dtype, shape, size, scale count);
    ``key`` (``mac_key``): sealed with a MAC instead of a checksum."""
    payload = memoryview(kv.data).cast("B")
    if kv.dtype != fmt.kv_dtype or tuple(kv.shape) != tuple(fmt.shape):
        raise ValueError(f"block is {kv.dtype}{tuple(kv.shape)}, the store holds "
                         f"{fmt.kv_dtype}{tuple(fmt.shape)}")
    if len(payload) != fmt.payload_bytes:
        raise ValueError(f"block payload is {len(payload)} bytes, expected {fmt.payload_bytes}")
    if len(kv.scales) != fmt.num_scales:
        raise ValueError(f"block carries {len(kv.scales)} scales, expected {fmt.num_scales}")
    if len(tokens) != fmt.block_size or len(ns) != DIGEST_SIZE or len(digest) != DIGEST_SIZE:
        raise ValueError("a value needs block_size tokens and two 32-byte digests")
    name = fmt.kv_dtype.encode("ascii")
    header = b"".join([
        MAGIC, struct.pack("<H", FORMAT_VERSION), ns, digest,
        struct.pack("<B", len(name)), name,
        struct.pack(f"<B{len(fmt.shape)}I", len(fmt.shape), *fmt.shape),
        struct.pack("<I", len(tokens)), token_bytes(tokens),
        struct.pack(f"<I{len(kv.scales)}f", len(kv.scales), *kv.scales),
        struct.pack("<Q", len(payload)),
    ])
    return b"".join([header, payload, _seal(key, header, payload)])


class _Reader:
    """Bounds-checked sequential reads over a memoryview (truncation raises ``BadValue``)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.view):
            raise BadValue(f"truncated: field of {n} bytes at offset {self.pos} of {len(self.view)}")
        out = self.view[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))


def decode_value(data, fmt: BlockFormat, ns: bytes, digest: bytes, tokens: Sequence[int],
                 key: bytes | None = None) -> BlockKV:
    """The verified K/V in ``data`` (zero-copy views into it), or ``BadValue`` saying what is wrong
    (``Unauthenticated`` for a value without a valid MAC under ``key``, when ``key`` is given)."""
    view = memoryview(data).cast("B")
    want = value_size(fmt, key is not None)
    if len(view) != want:
        if key is not None and len(view) == value_size(fmt, False):
            raise Unauthenticated("the value carries a checksum, not a MAC (written without the store secret)")
        raise BadValue(f"value is {len(view)} bytes, a block of this format is {want}")
    seal = MAC_SIZE if key is not None else CHECKSUM_SIZE
    body, stored = view[:-seal], bytes(view[-seal:])
    if key is None:
        if xxhash.xxh3_128_digest(body) != stored:
            raise BadValue("checksum mismatch")
    elif not hmac.compare_digest(_seal(key, body, b""), stored):
        raise Unauthenticated("MAC mismatch (written without this store secret, or changed since)")
    r = _Reader(body)
    if bytes(r.take(4)) != MAGIC:
        raise BadValue("not a radixcache value (bad magic)")
    (version,) = r.unpack("<H")
    if version != FORMAT_VERSION:
        raise BadValue(f"format version {version}, expected {FORMAT_VERSION}")
    if bytes(r.take(DIGEST_SIZE)) != ns:
        raise BadValue("namespace mismatch (another model, tenant, dtype or block size)")
    if bytes(r.take(DIGEST_SIZE)) != digest:
        raise BadValue("chain digest mismatch (stored under another block's key)")
    (n,) = r.unpack("<B")
    dtype = bytes(r.take(n)).decode("ascii", "replace")
    (ndim,) = r.unpack("<B")
    shape = r.unpack(f"<{ndim}I")
    if dtype != fmt.kv_dtype or shape != tuple(fmt.shape):
        raise BadValue(f"value is {dtype}{shape}, expected {fmt.kv_dtype}{tuple(fmt.shape)}")
    (t,) = r.unpack("<I")
    if bytes(r.take(4 * t)) != token_bytes(tokens):
        raise BadValue("token mismatch")
    (s,) = r.unpack("<I")
    if s != fmt.num_scales:
        raise BadValue(f"{s} scales, expected {fmt.num_scales}")
    scales = r.unpack(f"<{s}f")
    (p,) = r.unpack("<Q")
    if p != fmt.payload_bytes:
        raise BadValue(f"payload of {p} bytes, expected {fmt.payload_bytes}")
    payload = r.take(p)
    if r.pos != len(body):
        raise BadValue(f"{len(body) - r.pos} unexpected bytes after the payload")
    return BlockKV(payload, dtype, shape, scales)
