"""Keys that leave the process: chained BLAKE2b-256 digests over length-framed bytes.

Exact bytes (every integer little-endian; ``frame(b) = u32(len(b)) || b``):

- namespace digest ``N = BLAKE2b-256(person=b"radixcache-ns", frame(u16 FORMAT_VERSION) ||
  frame(model) || frame(kv_dtype) || frame(u32 block_size) || frame(layout) ||
  frame(u32 * shape) || frame(encode_namespace(namespace)) [|| frame(b"mac:blake3") for a store
  with a secret])``, strings UTF-8;
- block digest ``D_i = BLAKE2b-256(person=b"radixcache-blk", frame(u16 FORMAT_VERSION) || frame(N) ||
  frame(D_{i-1}) || frame(u32 * tokens[i*bs:(i+1)*bs]))`` with ``D_{-1} = b""``;
- the store key of block ``i`` is ``key_prefix || hex(D_i)``;
- KV events (``radixcache.kv_events``) chain the same ``D_i`` from a tree namespace digest
  ``N_tree = BLAKE2b-256(person=b"radixcache-evns", frame(u16 FORMAT_VERSION) ||
  frame(u32 block_size) || frame(encode_namespace(namespace)))`` (the tree knows no pool format;
  the namespace tuple carries the model identity and the tenant salt) and name block ``i`` by the
  first 8 bytes of ``D_i`` read as a signed big-endian int64.

So a key names the format version, the model, the KV dtype, block size and layout, every element
of the manager's namespace (tenant salt, ...) and every token up to the end of the block. The
digest is deterministic across processes and machines (no Python ``hash``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NamedTuple

FORMAT_VERSION = 1
LAYOUT = "layer,kv,token,head,dim"  # the C order of a block's payload
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
QUANTIZED = {"float8_e4m3fn"}  # dtypes whose bytes need their scales
DIGEST_SIZE = 32
_VERSION = struct.pack("<H", FORMAT_VERSION)
_NS_PERSON = b"radixcache-ns"
_BLOCK_PERSON = b"radixcache-blk"
_TREE_NS_PERSON = b"radixcache-evns"


def frame(data: bytes) -> bytes:
    """``u32 little-endian length || data``: concatenated frames can never be read two ways."""
    return struct.pack("<I", len(data)) + data


class BlockFormat(NamedTuple):
    """What every stored block of one pool shares: it enters every key and is checked in every value.

    ``model``: the model identity (same weights, same string, on every machine); ``kv_dtype``: the
    pool's storage dtype name (a key of ``ITEMSIZE``); ``shape``: ``(layers, 2, block_size, kv_heads,
    head_dim)``; ``layout``: the payload's axis order.
    """

    model: str
    kv_dtype: str
    block_size: int
    shape: tuple
    layout: str = LAYOUT

    @classmethod
    def of(cls, model: str, kv_dtype: str, layers: int, block_size: int, kv_heads: int,
           head_dim: int) -> BlockFormat:
        """The format of a pool with these dimensions; ``ValueError``/``TypeError`` on bad ones."""
        fmt = cls(model, kv_dtype, block_size, (layers, 2, block_size, kv_heads, head_dim))
        fmt.check()
        return fmt

    def check(self) -> None:
        """Raise ``TypeError``/``ValueError`` naming the first field that is not valid."""
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"model identity must be a non-empty str, got {self.model!r}")
        if self.kv_dtype not in ITEMSIZE:
            raise ValueError(f"kv_dtype must be one of {sorted(ITEMSIZE)}, got {self.kv_dtype!r}")
        shape = tuple(self.shape)
        if len(shape) != 5 or not all(type(d) is int and d > 0 for d in shape):
            raise ValueError(f"shape must be 5 positive ints (layers, 2, block_size, kv_heads, "
                             f"head_dim), got {self.shape!r}")
        if shape[1] != 2 or shape[2] != self.block_size:
            raise ValueError(f"shape {shape} must be (layers, 2, block_size={self.block_size}, ...)")

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block's K/V across all layers."""
        n = ITEMSIZE[self.kv_dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def num_scales(self) -> int:
        """Scales a value carries: one per layer for K and for V when quantized, else none."""
        return 2 * self.shape[0] if self.kv_dtype in QUANTIZED else 0


def encode_namespace(namespace: tuple) -> bytes:
    """Typed, framed bytes of a namespace tuple of str, bytes, int, bool, None and nested tuples."""
    if not isinstance(namespace, tuple):
        raise TypeError(f"namespace must be a tuple, got {type(namespace).__name__}")
    parts = [struct.pack("<I", len(namespace))]
    for item in namespace:
        if item is None:
            parts.append(b"n" + frame(b""))
        elif isinstance(item, bool):
            parts.append(b"?" + frame(b"1" if item else b"0"))
        elif isinstance(item, int):
            parts.append(b"i" + frame(str(item).encode()))
        elif isinstance(item, str):
            parts.append(b"s" + frame(item.encode("utf-8")))
        elif isinstance(item, bytes):
            parts.append(b"b" + frame(item))
        elif isinstance(item, tuple):
            parts.append(b"t" + frame(encode_namespace(item)))
        else:
            raise TypeError(f"namespace elements must be str, bytes, int, bool, None or tuples, "
                            f"got {type(item).__name__}")
    return b"".join(parts)


def namespace_digest(fmt: BlockFormat, namespace: tuple, sealed: bool = False) -> bytes:
    """``N``: the 32-byte digest of the block format and the manager's namespace tuple; a store
    whose values carry a MAC (``sealed``) adds ``frame(b"mac:blake3")``, so it never shares a key
    with a store without a secret (they would delete each other's values as bad)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_NS_PERSON)
    for part in (_VERSION, fmt.model.encode("utf-8"), fmt.kv_dtype.encode(),
                 struct.pack("<I", fmt.block_size), fmt.layout.encode(),
                 struct.pack(f"<{len(fmt.shape)}I", *fmt.shape), encode_namespace(namespace)):
        h.update(frame(part))
    if sealed:
        h.update(frame(b"mac:blake3"))
    return h.digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    """``u32`` little-endian bytes of token ids; ``ValueError`` unless each is an int in 0..2**32-1."""
    try:
        return struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error as e:
        raise ValueError(f"token ids must be ints in 0..{2**32 - 1} ({e})") from None


def tree_namespace_digest(namespace: tuple, block_size: int) -> bytes:
    """``N_tree``: the 32-byte digest of a tree namespace tuple and the block size (no pool format)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=_TREE_NS_PERSON)
    for part in (_VERSION, struct.pack("<I", block_size), encode_namespace(namespace)):
        h.update(frame(part))
    return h.digest()


def chain_digests(ns: bytes, parent: bytes, raw: bytes, block_size: int) -> list[bytes]:
    """The chained digests of the whole blocks of ``raw`` (``u32`` little-endian token bytes) that
    follow the block whose digest is ``parent`` (``b""`` for the first block of a sequence) under
    namespace digest ``ns``: ``[D_j, D_{j+1}, ...]``; a partial last block is ignored."""
    start = hashlib.blake2b(frame(_VERSION) + frame(ns), digest_size=DIGEST_SIZE,
                            person=_BLOCK_PERSON)
    step = 4 * block_size
    block_frame = struct.pack("<I", step)
    parent_frame, digest_frame = frame(parent), struct.pack("<I", DIGEST_SIZE)
    out = []
    for i in range(0, len(raw) - step + 1, step):
        h = start.copy()
        h.update(parent_frame + block_frame + raw[i:i + step])
        digest = h.digest()
        out.append(digest)
        parent_frame = digest_frame + digest
    return out


def block_digests(ns: bytes, tokens: Sequence[int], block_size: int, count: int) -> list[bytes]:
    """``[D_0, ..., D_{count-1}]``: the chained digests of the first ``count`` whole blocks of ``tokens``."""
    if count < 0 or count * block_size > len(tokens):
        raise ValueError(f"{count} blocks of {block_size} do not fit {len(tokens)} tokens")
    return chain_digests(ns, b"", token_bytes(tokens[:count * block_size]), block_size)
