"""The ``kv-size`` table: byte formatting, how many sequences fit, the rows and their rendering, and
the sliding-window note (the shapes and their arithmetic are in ``radixcache.app.kv_size``)."""

from __future__ import annotations

from collections.abc import Iterable

from radixcache.app.kv_size import KVShape, validated_int
from radixcache.table import render_table

_KIB = 1024
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")

def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: "512 B", "128 KiB", "1.5 GiB" (at most two decimals)."""
    validated_int(n, "byte count", 0)
    value, unit = float(n), _UNITS[0]
    for unit in _UNITS:
        if value < _KIB or unit == _UNITS[-1]:
            break
        value /= _KIB
    if unit == "B":
        return f"{n} B"
    return f"{value:.2f}".rstrip("0").rstrip(".") + f" {unit}"


def sequences_that_fit(shape: KVShape, memory: int, context: int, dtype: str = "bf16") -> int:
    """How many whole sequences of ``context`` tokens fit in ``memory`` bytes of KV cache."""
    validated_int(memory, "memory", 0)
    per_sequence = shape.bytes_per_sequence(validated_int(context, "context", 1), dtype)
    return memory // per_sequence


def kv_size_table(shapes: Iterable[KVShape] | KVShape, context: int, sequences: int = 1,
                  dtypes: Iterable[str] | str = ("bf16", "fp16", "fp8"),
                  memory: int | None = None) -> list[dict]:
    """One row per (shape, dtype): name, attention, layers, kv_heads, head_dim, head_dim_v, dtype, context,
    sequences, bytes_per_token, bytes_per_sequence and bytes_total (all ints); with ``memory`` (bytes)
    also ``memory`` and ``fits``: how many sequences of ``context`` tokens fit in it."""
    shapes = [shapes] if isinstance(shapes, KVShape) else list(shapes)
    dtypes = [dtypes] if isinstance(dtypes, str) else list(dtypes)
    validated_int(context, "context", 0)
    validated_int(sequences, "sequences", 0)
    if memory is not None:
        validated_int(memory, "memory", 0)
        validated_int(context, "context", 1)
    rows = []
    for shape in shapes:
        if not isinstance(shape, KVShape):
            raise TypeError(f"shapes must be KVShape objects, got {type(shape).__name__}")
        for dtype in dtypes:
            rows.append({
                "name": shape.name,
                "attention": shape.attention,
                "layers": shape.layers,
                "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "head_dim_v": shape.head_dim_v,
                "dtype": dtype.lower() if isinstance(dtype, str) else dtype,
                "context": context,
                "sequences": sequences,
                "bytes_per_token": shape.bytes_per_token(dtype),
                "bytes_per_sequence": shape.bytes_per_sequence(context, dtype),
                "bytes_total": shape.bytes_for(sequences, context, dtype),
            })
            if memory is not None:
                rows[-1]["memory"] = memory
                rows[-1]["fits"] = sequences_that_fit(shape, memory, context, dtype)
    return rows


def window_note(shape: KVShape, context: int, dtypes: Iterable[str]) -> str | None:
    """One line on ``shape``'s sliding window (None without one): the table counts every token's
    K/V, as radixcache's pool holds them; what a cache that drops K/V outside the window would
    hold per sequence of ``context`` tokens at each of ``dtypes``."""
    if shape.sliding_window is None:
        return None
    where = (f"{shape.name}: a sliding window of {shape.sliding_window:,} tokens on "
             f"{shape.sliding_layers} of {shape.layers} layers")
    if context <= shape.sliding_window:
        return f"{where} does not cap sequences of {context:,} tokens."
    caps = ", ".join(f"{format_bytes(shape.windowed_bytes_per_sequence(context, d))} {d.lower()}"
                     for d in dtypes)
    return (f"{where}: the table counts every token's K/V, as radixcache's pool keeps them; a "
            f"cache that dropped K/V outside the window would hold at most {caps} per sequence.")


_COLUMNS = (
    ("model", lambda r: r["name"], "<"),
    ("attn", lambda r: r["attention"], "<"),
    ("layers", lambda r: str(r["layers"]), ">"),
    ("kv heads", lambda r: str(r["kv_heads"]), ">"),
    ("head dim", lambda r: str(r["head_dim"]) if r["head_dim"] == r["head_dim_v"]
     else f"{r['head_dim']}/{r['head_dim_v']}", ">"),
    ("dtype", lambda r: r["dtype"], "<"),
    ("B/token", lambda r: f"{r['bytes_per_token']:,}", ">"),
    ("per token", lambda r: format_bytes(r["bytes_per_token"]), ">"),
    ("per sequence", lambda r: format_bytes(r["bytes_per_sequence"]), ">"),
    ("all sequences", lambda r: format_bytes(r["bytes_total"]), ">"),
)


def render_kv_table(rows: list[dict]) -> str:
    """Rows from ``kv_size_table`` as an aligned plain-text table (header, rule, one line per row);
    rows that carry ``fits`` get a last column "fit in <memory>"."""
    columns = list(_COLUMNS)
    if rows and "fits" in rows[0]:
        columns.append((f"fit in {format_bytes(rows[0]['memory'])}", lambda r: f"{r['fits']:,}", ">"))
    header = [name for name, _, _ in columns]
    cells = [[cell(row) for _, cell, _ in columns] for row in rows]
    left = [i for i, (_, _, align) in enumerate(columns) if align == "<"]
    return render_table(header, cells, left)
