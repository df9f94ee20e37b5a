"""Plain-text tables and byte counts for the command line's reports.

CLI process; pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence


def format_bytes(num_bytes: float) -> str:
    """``512 B``, ``1.5 KiB``, ... ``2.9 GiB`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} B" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell (the first left-aligned, the others
    right-aligned); the first row is the header, underlined."""
    if not rows:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(row) for row in rows[1:])])
