"""Flip payload bytes in stored objects under a directory (the disk tier's files).

Test-only; runs between engines in ``tests.e2e.driver`` or from a test. An
object file is recognised by the codec's magic at offset 0; one byte after
the header is inverted, so the header still parses and only the payload
checksum can catch the damage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridkv.tiers.codec import HEADER_BYTES, MAGIC


def stored_object_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.stat().st_size <= HEADER_BYTES:
            continue
        with path.open("rb") as f:
            if f.read(len(MAGIC)) == MAGIC:
                files.append(path)
    return files


def flip_payload_byte(path: Path) -> None:
    size = path.stat().st_size
    offset = HEADER_BYTES + (size - HEADER_BYTES) // 2
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def corrupt_files(spec: dict[str, Any]) -> dict[str, Any]:
    """Corrupt every ``every``-th object file under ``spec["dir"]``.

    Returns the number of object files seen and the corrupted ones (relative paths).
    """
    root = Path(spec["dir"])
    every = int(spec.get("every", 1))
    files = stored_object_files(root)
    corrupted = files[::every]
    for path in corrupted:
        flip_payload_byte(path)
    return {
        "num_object_files": len(files),
        "corrupted": [str(p.relative_to(root)) for p in corrupted],
    }
