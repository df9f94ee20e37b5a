"""Byte counts and plain-text tables of the command line."""

from __future__ import annotations

from hybridkv.cli.tables import format_bytes, format_table


def test_format_bytes_units() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(832 * 1024) == "832.0 KiB"
    assert format_bytes(3 << 30) == "3.0 GiB"
    assert format_bytes(5000 << 30) == "5000.0 GiB"


def test_table_columns_line_up() -> None:
    text = format_table([["run", "n"], ["cold", "1"], ["restart", "12345"]])
    lines = text.splitlines()
    assert lines[0] == "run          n"
    assert lines[1] == "-------  -----"
    assert lines[2] == "cold         1"
    assert lines[3] == "restart  12345"
    assert format_table([]) == ""
