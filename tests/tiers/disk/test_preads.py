"""The native read of a get's payloads: the bytes of a real file, each object's hash
as the codec takes it, short reads at the end of the file, errors as errors."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers import codec
from hybridkv.tiers.disk import preads

FILE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    data = np.random.default_rng(5).integers(0, 256, FILE_BYTES, dtype=np.uint8).tobytes()
    path = tmp_path_factory.mktemp("preads") / "data.bin"
    path.write_bytes(data)
    return path, data


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, FILE_BYTES + 10), st.integers(0, 300_000)), max_size=12))
def test_each_object_is_the_file_s_bytes_with_the_codec_s_checksum(
    data_file: tuple[Path, bytes], objects: list[tuple[int, int]]
) -> None:
    path, data = data_file
    outs = [np.full(length, 0xEE, np.uint8) for _, length in objects]
    fd = os.open(path, os.O_RDONLY)
    try:
        got, hashes = preads.read_hashed(
            fd,
            np.array([offset for offset, _ in objects], np.int64),
            np.array([length for _, length in objects], np.int64),
            np.array([out.ctypes.data for out in outs], np.int64),
        )
    finally:
        os.close(fd)
    for (offset, length), out, n, value in zip(objects, outs, got, hashes, strict=True):
        present = data[offset : offset + length]
        assert n == len(present)  # short only where the file ends
        assert out[: len(present)].tobytes() == present
        if n == length:
            assert int(value) == codec.checksum(out)


def test_a_failed_read_is_minus_one(tmp_path: Path) -> None:
    path = tmp_path / "w"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_WRONLY)  # pread on it fails (EBADF)
    out = np.zeros(100, np.uint8)
    try:
        got, _ = preads.read_hashed(
            fd, np.array([0], np.int64), np.array([100], np.int64), np.array([out.ctypes.data])
        )
    finally:
        os.close(fd)
    assert got.tolist() == [-1]
