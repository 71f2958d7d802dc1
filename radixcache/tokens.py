"""Token ids as the tree stores and compares them: unsigned 32-bit ints, packed in ``bytes``.

The fastest input is an ``array('I')`` (packed with one copy); numpy and torch integer arrays are
range-checked and cast in C; lists and tuples of ints are packed by ``array('I', ...)``, which also
checks every item (about 10 ns per token). Signed typecodes and generic iterables take slower paths.
"""

from __future__ import annotations

from array import array

import numpy as np

MAX_TOKEN = 2**32 - 1


def _bad_token(tokens) -> Exception:
    """The precise error for the first item of ``tokens`` that is not a token id (slow path)."""
    for t in tokens:
        if isinstance(t, bool):
            continue
        if not hasattr(type(t), "__index__"):
            return TypeError(f"tokens must be ints, got {t!r}")
        value = t.__index__()
        if value < 0:
            return ValueError(f"tokens must be non-negative, got {value}")
        if value > MAX_TOKEN:
            return ValueError(f"token ids must be below 2**32, got {value}")
    return TypeError("tokens must be a sequence of ints")


def _from_numpy(arr: np.ndarray) -> bytes:
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {tuple(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint32:
        return arr.tobytes()
    if arr.size:
        low, high = arr.min(), arr.max()
        if low < 0:
            raise ValueError(f"tokens must be non-negative, got {low}")
        if high > MAX_TOKEN:
            raise ValueError(f"token ids must be below 2**32, got {high}")
    return arr.astype(np.uint32).tobytes()


def token_bytes(tokens) -> bytes:
    """Validate ``tokens`` and pack them as native-order uint32 bytes (4 bytes per token).

    Accepts a list, tuple, ``array``, numpy array, 1-D tensor or any iterable of non-negative ints
    below 2**32. Raises ``TypeError`` for non-integers (floats, strings, float or bool tensors) and
    ``ValueError`` for negative or too large ids and for arrays that are not one-dimensional.
    """
    kind = type(tokens)
    if kind is array:
        if tokens.typecode == "I":
            return tokens.tobytes()
        if tokens.typecode in "fd":
            raise TypeError(f"tokens must be integers, got array('{tokens.typecode}')")
        return _from_numpy(np.frombuffer(tokens, dtype=tokens.typecode))
    if kind is list or kind is tuple:
        try:
            return array("I", tokens).tobytes()
        except (TypeError, OverflowError):
            raise _bad_token(tokens) from None
    if isinstance(tokens, np.ndarray):
        return _from_numpy(tokens)
    if isinstance(tokens, (str, bytes, bytearray)):
        raise TypeError("tokens must be a sequence of ints, got a string")
    if hasattr(tokens, "tolist"):  # torch tensors and anything array-like
        if getattr(tokens, "ndim", 1) != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {tuple(tokens.shape)}")
        dtype = str(getattr(tokens, "dtype", ""))
        if "float" in dtype or "complex" in dtype or "bool" in dtype:
            raise TypeError(f"tokens must be integers, got dtype {dtype}")
        try:
            return _from_numpy(np.asarray(tokens))
        except (TypeError, RuntimeError):  # not on the host: go through Python ints
            tokens = tokens.tolist()
    return token_bytes(list(tokens))


def as_token_tuple(tokens) -> tuple:
    """Validate ``tokens`` as ``token_bytes`` does and return them as a tuple of Python ints."""
    if type(tokens) is tuple or type(tokens) is list:
        try:
            array("I", tokens)  # C-speed check: every item an int in 0 .. 2**32-1
        except (TypeError, OverflowError):
            raise _bad_token(tokens) from None
        return tuple(tokens)
    return tuple(unpack(token_bytes(tokens)))


def token_array(tokens) -> array:
    """Validate ``tokens`` as ``token_bytes`` does and return them as an ``array('I')``: the form
    the cache lifecycle carries a request's tokens in (the tree packs it with one copy). An
    ``array('I')`` is returned as it is, not copied."""
    if type(tokens) is array and tokens.typecode == "I":
        return tokens
    return unpack(token_bytes(tokens))


def unpack(data: bytes) -> array:
    """Packed token bytes back as an ``array('I')`` of ids."""
    out = array("I")
    out.frombytes(data)
    return out


def common_tokens(a: bytes, b: bytes) -> int:
    """How many leading tokens two packed token strings share."""
    n = min(len(a), len(b)) >> 2
    if a[:4] != b[:4]:
        return 0
    if a[:4 * n] == b[:4 * n]:
        return n
    lo, hi = 1, n  # tokens [0, lo) are equal; some token in [lo, hi) differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[4 * lo:4 * mid] == b[4 * lo:4 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_blocks(key: bytes, q: bytes, pos: int, end: int, bs4: int) -> int:
    """How many whole blocks of ``key`` equal ``q[pos:end]`` (the first block is known equal)."""
    m = min(len(key), end - pos) // bs4
    if q[pos:pos + m * bs4] == key[:m * bs4]:
        return m
    lo, hi = 1, m  # blocks [0, lo) are equal; some block in [lo, hi) differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if q[pos + lo * bs4:pos + mid * bs4] == key[lo * bs4:mid * bs4]:
            lo = mid
        else:
            hi = mid
    return lo


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token sequences (lists, tuples, arrays, numpy
    arrays, in any mix): bisection over C-speed slice compares."""
    if type(a) is not type(b) or isinstance(a, np.ndarray):
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
