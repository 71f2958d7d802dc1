"""The one plain-text table renderer: the kv-size table, the demo and every benchmark print with it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def render_table(header: Sequence[str], rows: Iterable[Sequence[str]], left: Iterable[int] = (0,),
                 footer: Iterable[Sequence[str]] = ()) -> str:
    """``header``, a rule, then ``rows`` (cells are strings, as many as the header has), each
    column padded to its widest cell and separated by two spaces: columns whose index is in
    ``left`` left-aligned, the others right-aligned. ``footer`` rows (e.g. a total) follow a
    second rule. No line ends in spaces."""
    header = tuple(header)
    body = [tuple(r) for r in rows]
    tail = [tuple(r) for r in footer]
    for row in body + tail:
        if len(row) != len(header):
            raise ValueError(f"render_table: a row has {len(row)} cells, the header {len(header)}")
    left = set(left)
    widths = [max(len(row[i]) for row in [header, *body, *tail]) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(header), rule, *map(line, body)]
    if tail:
        out += [rule, *map(line, tail)]
    return "\n".join(out)
