"""The one table formatter of the benchmarks and reports: markdown for docs and results, aligned text for terminals."""

from typing import Optional, Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: Optional[str] = None) -> str:
    """A markdown table. ``align``: one character per column, ``l`` or ``r`` (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align={align!r}: expected one of 'l'/'r' per column ({len(header)} columns)")
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, the header {len(header)}")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(map(str, header)) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[object]], align: Optional[str] = None) -> str:
    """The same table, padded for a terminal, with a rule under the header."""
    align = align or "l" + "r" * (len(header) - 1)
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]

    def line(row):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]])
