"""Small helpers the benchmark scripts share for printing their tables."""

from __future__ import annotations

import statistics
from pathlib import Path


def fmt(value, spec: str) -> str:
    """``value`` formatted with ``spec``, or "-" when it is None (not measured)."""
    return "-" if value is None else format(value, spec)


def median(values):
    """Median of the values that are not None, or None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(header, rows, left=(0,)) -> str:
    """A plain-text table: columns padded to their widest cell, those in ``left`` left-aligned."""
    cells = [tuple(header)] + [tuple(r) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])


def model_label(model) -> str:
    """'smollm2-135m-instruct (LlamaForCausalLM, torch.float32)', or the class name for unnamed models."""
    name = Path(str(getattr(model.config, "_name_or_path", "") or "")).name
    desc = f"{type(model).__name__}, {next(model.parameters()).dtype}"
    return f"{name} ({desc})" if name else desc
