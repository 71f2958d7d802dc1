"""Small helpers the benchmark scripts share for printing their tables."""

from __future__ import annotations

import statistics
from pathlib import Path

from radixcache.table import render_table


def fmt(value, spec: str) -> str:
    """``value`` formatted with ``spec``, or "-" when it is None (not measured)."""
    return "-" if value is None else format(value, spec)


def median(values):
    """Median of the values that are not None, or None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(header, rows, left=(0,)) -> str:
    """A plain-text table (``radixcache.table.render_table``): columns padded to their widest cell,
    those in ``left`` left-aligned."""
    return render_table(header, rows, left)


def model_label(model) -> str:
    """'smollm2-135m-instruct (LlamaForCausalLM, torch.float32)', or the class name for unnamed models."""
    name = Path(str(getattr(model.config, "_name_or_path", "") or "")).name
    desc = f"{type(model).__name__}, {next(model.parameters()).dtype}"
    return f"{name} ({desc})" if name else desc


def percentile(values, q: float):
    """Linear-interpolated percentile (q in 0..100) of the values that are not None, or None."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    pos = (len(values) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def mib(n) -> str:
    """Bytes as MiB with one decimal, or "-" for None."""
    return "-" if n is None else f"{n / 2**20:.1f}"


def ratio(value, reference):
    """value / reference, or None when either is missing or the reference is 0."""
    if value is None or not reference:
        return None
    return value / reference


def met(value, target, below: bool = True) -> str:
    """"yes"/"NO" for value <= target (or >= when ``below`` is False), "-" when not measured."""
    if value is None:
        return "-"
    return "yes" if (value <= target if below else value >= target) else "NO"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the machine type where there is none."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
