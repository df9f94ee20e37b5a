"""Flip payload bytes of objects stored by the disk tier under a directory.

Test-only; runs between engines in ``tests.e2e.driver`` or from a test.
Objects are found through the segment files' slot tables; one byte in the
middle of a payload is inverted, so the slot still parses and only the
payload checksum can catch the damage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.tiers.disk.segments import RecordInfo, SlotState, iter_records


def stored_objects(root: Path) -> list[RecordInfo]:
    return [
        record
        for record in iter_records(root)
        if record.state is SlotState.LIVE and record.length > 0
    ]


def flip_payload_byte(record: RecordInfo) -> None:
    offset = record.offset + record.length // 2
    with record.path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def corrupt_files(spec: dict[str, Any]) -> dict[str, Any]:
    """Corrupt every ``every``-th stored object under ``spec["dir"]`` (searched recursively).

    Returns the number of objects seen and the corrupted ones (segment file and slot).
    """
    root = Path(spec["dir"])
    every = int(spec.get("every", 1))
    objects = [
        record
        for directory in sorted({p.parent for p in root.rglob("*.seg")})
        for record in stored_objects(directory)
    ]
    corrupted = objects[::every]
    for record in corrupted:
        flip_payload_byte(record)
    return {
        "num_objects": len(objects),
        "corrupted": [f"{record.path.relative_to(root)}#{record.slot}" for record in corrupted],
    }
