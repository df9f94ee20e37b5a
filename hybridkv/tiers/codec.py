"""The checksummed object header every tier stores in front of a payload.

Pure functions, any process. Layout (little endian, 48 bytes):

    magic b"HKV1" | u16 version | u16 reserved | u64 payload_bytes |
    u64 xxh3-64(payload) | 16 bytes xxh3-128(key) | 8 bytes reserved

The key digest lets a reader reject an object written under another key (a
foreign or renamed file, a hash collision in a remote store's namespace).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from hybridkv.tiers.base import Buffer, StoreKey

MAGIC = b"HKV1"
VERSION = 1
HEADER_FORMAT = "<4sHHQQ16s8x"
"""magic, version, flags, payload length, payload checksum, key digest, padding."""
_HEADER = struct.Struct(HEADER_FORMAT)
HEADER_BYTES = _HEADER.size


class HeaderError(enum.Enum):
    BAD_MAGIC = "bad magic"
    BAD_VERSION = "unsupported format version"
    WRONG_KEY = "written under another key"
    WRONG_LENGTH = "payload length differs"
    BAD_CHECKSUM = "payload checksum mismatch"
    TRUNCATED = "shorter than its header"


Bytes = Buffer | bytes | memoryview


def _view(data: Bytes) -> memoryview:
    if isinstance(data, np.ndarray):
        return data.data.cast("B")
    return memoryview(data).cast("B")


def key_digest(key: StoreKey) -> bytes:
    return xxhash.xxh3_128_digest(key.encode())


def key_digests(keys: Sequence[StoreKey]) -> bytes:
    """The ``key_digest`` of each key, concatenated (one call per batch: this runs for
    every key a disk tier is asked about)."""
    digest = xxhash.xxh3_128_digest
    return b"".join([digest(key.encode()) for key in keys])


def checksum(payload: Bytes) -> int:
    return int(xxhash.xxh3_64_intdigest(_view(payload)))


def pack_header(key: StoreKey, payload: Bytes, payload_checksum: int | None = None) -> bytes:
    """The header for ``payload`` (``payload_checksum``: its ``checksum``, when the
    caller already took it)."""
    value = checksum(payload) if payload_checksum is None else payload_checksum
    return _HEADER.pack(MAGIC, VERSION, 0, len(_view(payload)), value, key_digest(key))


def write_header_into(
    out: Buffer, key: StoreKey, payload: Buffer, payload_checksum: int | None = None
) -> None:
    """Write the header for ``payload`` into the first HEADER_BYTES of ``out``
    (``payload_checksum``: its ``checksum``, when the caller already took it)."""
    value = checksum(payload) if payload_checksum is None else payload_checksum
    _HEADER.pack_into(out.data, 0, MAGIC, VERSION, 0, len(payload), value, key_digest(key))


def verify_header(header: Bytes, key: StoreKey, payload_bytes: int) -> HeaderError | None:
    """Check magic, version, key and length; the checksum is checked separately."""
    raw = bytes(_view(header)[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        return HeaderError.TRUNCATED
    return _check_fields(_HEADER.unpack(raw), key, payload_bytes)


def _check_fields(
    fields: tuple[bytes, int, int, int, int, bytes], key: StoreKey, payload_bytes: int
) -> HeaderError | None:
    magic, version, _, length, _, digest = fields
    if magic != MAGIC:
        return HeaderError.BAD_MAGIC
    if version != VERSION:
        return HeaderError.BAD_VERSION
    if digest != key_digest(key):
        return HeaderError.WRONG_KEY
    if length != payload_bytes:
        return HeaderError.WRONG_LENGTH
    return None


def verify_object(header: Bytes, key: StoreKey, payload: Buffer) -> HeaderError | None:
    """Full check of a header against the payload read back."""
    raw = bytes(_view(header)[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        return HeaderError.TRUNCATED
    fields = _HEADER.unpack(raw)
    problem = _check_fields(fields, key, len(payload))
    if problem is not None:
        return problem
    if fields[4] != checksum(payload):
        return HeaderError.BAD_CHECKSUM
    return None
