"""The disk tier's directory against other users and planted links, on a real file system.

Tests run as root here, so "another user's directory" is a real directory
chowned to an unused uid.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from hybridkv.connector.config import ConnectorConfig
from hybridkv.schema import ConfigError
from hybridkv.tiers.base import GetStatus, StoreKey
from hybridkv.tiers.disk.files import UnsafeCacheDir
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from hybridkv.tiers.ranks import WorkerRank
from tests.faults.report import record
from tests.support.corrupt import flip_payload_byte, stored_objects

OTHER_UID = 65534
pytestmark = pytest.mark.timeout(60)


def disk_tier(path: Path, **kwargs: object) -> DiskTier:
    return DiskTier(DiskConfig(path=path, capacity_bytes=16 << 20, **kwargs))  # type: ignore[arg-type]


def store(tier: DiskTier, names: list[str]) -> dict[StoreKey, np.ndarray]:
    objects = {StoreKey(f"faults/{n}"): np.full(5000, i + 1, np.uint8) for i, n in enumerate(names)}
    tier.put_many(list(objects), list(objects.values()))
    return objects


def get(tier: DiskTier, key: StoreKey) -> tuple[GetStatus, np.ndarray]:
    out = np.zeros(5000, np.uint8)
    return tier.get_many_into([key], [out])[0], out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("umask", [0o000, 0o002, 0o022])
def test_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        root = tmp_path / "cache"
        tier = disk_tier(root)
        key = next(iter(store(tier, ["a"])))
        (stored,) = stored_objects(root)
        flip_payload_byte(stored)  # the read then keeps a quarantine copy
        assert get(tier, key)[0] is GetStatus.CORRUPT
        tier.close()
    finally:
        os.umask(old)
    dirs = [root, root / "quarantine"]
    files = [*root.glob("*.seg"), root / "writer.lock", *(root / "quarantine").iterdir()]
    assert len(files) == 3, files
    assert {str(p): mode(p) for p in dirs} == {str(p): 0o700 for p in dirs}
    assert {str(p): mode(p) for p in files} == {str(p): 0o600 for p in files}
    record(
        f"disk: modes under umask {umask:03o}",
        done="store, damage and read one object (a quarantine copy), with this umask",
        seen="directories 0700, segment, lock and quarantined files 0600",
        counters={"num_dirs": len(dirs), "num_files": len(files)},
    )


@pytest.mark.parametrize("read_only", [False, True])
def test_a_directory_of_another_user_is_refused(tmp_path: Path, read_only: bool) -> None:
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeCacheDir) as caught:
        disk_tier(root, read_only=read_only)
    message = str(caught.value)
    assert str(root) in message and f"owned by uid {OTHER_UID}" in message, message
    assert "fix:" in message and "chown" in message, message
    assert root.stat().st_uid == OTHER_UID and os.listdir(root) == []  # left as it was
    record(
        f"disk: directory owned by another user ({'reader' if read_only else 'writer'})",
        done=f"open a disk tier on a directory chowned to uid {OTHER_UID}",
        seen="refused at start naming the path, the owner and the fix; nothing written",
    )


@pytest.mark.parametrize("found_mode", [0o777, 0o770, 0o702])
def test_a_directory_others_can_write_is_refused(tmp_path: Path, found_mode: int) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, found_mode)
    with pytest.raises(UnsafeCacheDir) as caught:
        disk_tier(root)
    assert f"mode {found_mode:04o}" in str(caught.value) and str(root) in str(caught.value)
    assert mode(root) == found_mode and os.listdir(root) == []
    record(
        f"disk: directory mode {found_mode:04o}",
        done="open a disk tier on a directory group or others can write",
        seen="refused at start naming the path and the mode; nothing written",
    )


def test_a_readable_directory_of_ours_is_narrowed_to_0700(tmp_path: Path) -> None:
    root = tmp_path / "ours"
    root.mkdir()
    os.chmod(root, 0o755)
    disk_tier(root).close()
    assert mode(root) == 0o700


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"cache_dir": "/tmp/hkv/../../etc"}, "cache_dir"),
        ({"tiers": [{"kind": "disk", "path": "cache/../../x", "capacity_bytes": "1GiB"}]},
         "tiers[0].path"),
        ({"cache_dir": "/tmp/a\0b"}, "cache_dir"),
    ],
)  # fmt: skip
def test_paths_that_climb_out_are_config_errors(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ConnectorConfig.from_dict(raw)
    assert f"{field}=" in str(caught.value) and "1 problem" in str(caught.value), caught.value
    record(
        f"config: path {next(iter(raw.values()))!r}"[:60],
        done="parse a kv_connector_extra_config whose path has '..' or a NUL",
        seen=f"one ConfigError naming {field}",
    )


def test_a_link_in_place_of_a_segment_is_a_counted_miss_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    tier = disk_tier(root)
    objects = store(tier, ["a", "b"])
    tier.close()
    (segment,) = root.glob("*.seg")
    target = outside / "planted.seg"
    shutil.copyfile(segment, target)  # the same bytes: following the link would serve them
    segment.unlink()
    segment.symlink_to(target)
    before = digest(target)

    reader = disk_tier(root, read_only=True)
    writer = disk_tier(root)
    for tier in (reader, writer):
        assert [get(tier, k)[0] for k in objects] == [GetStatus.MISS] * 2
    assert writer.stats().corrupt == 1 and reader.stats().corrupt == 1
    store(writer, ["c", "d", "e"])  # new objects go to a new file
    writer.close()
    reader.close()
    assert digest(target) == before and not segment.is_symlink()
    quarantined = list((root / "quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].is_symlink()  # moved, not followed
    record(
        "disk: symlink in place of a segment",
        done="replace a segment file by a link to a copy outside the directory; open, read, store",
        seen="reads miss, the link is counted corrupt and moved to quarantine; the target "
        "is never read or written",
        counters={"corrupt_writer": 1, "corrupt_reader": 1},
    )


@pytest.mark.parametrize("name", ["writer.lock", "quarantine"])
def test_a_link_in_place_of_the_lock_or_quarantine_is_refused(tmp_path: Path, name: str) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    disk_tier(root).close()
    outside.mkdir(mode=0o755)
    (outside / "file").write_text("precious")
    planted = root / name
    if planted.is_dir():
        shutil.rmtree(planted)
    else:
        planted.unlink()
    planted.symlink_to(outside if name == "quarantine" else outside / "file")
    with pytest.raises(UnsafeCacheDir) as caught:
        disk_tier(root)
    assert str(planted) in str(caught.value) and "symbolic link" in str(caught.value)
    assert (outside / "file").read_text() == "precious" and mode(outside) == 0o755
    record(
        f"disk: symlink in place of {name}",
        done=f"replace {name} by a link out of the directory, then open the tier",
        seen="refused at start naming the link; its target untouched",
    )


def test_a_link_in_place_of_a_rank_directory_is_refused(tmp_path: Path) -> None:
    """With tensor parallel > 1 each rank uses ``tp<rank>of<size>`` inside the configured
    directory; a link planted there would lead the rank's tier out of it."""
    root, outside = tmp_path / "cache", tmp_path / "outside"
    config = DiskConfig(path=root, capacity_bytes=16 << 20)  # type: ignore[arg-type]
    DiskTier(config.for_rank(WorkerRank(tp_rank=0, tp_size=2))).close()
    outside.mkdir(mode=0o700)
    planted = root / "tp1of2"
    planted.symlink_to(outside)
    with pytest.raises(UnsafeCacheDir) as caught:
        DiskTier(config.for_rank(WorkerRank(tp_rank=1, tp_size=2)))
    assert str(planted) in str(caught.value) and "symbolic link" in str(caught.value)
    assert list(outside.iterdir()) == []
    DiskTier(
        config.for_rank(WorkerRank(tp_rank=0, tp_size=2))
    ).close()  # the rank whose directory is real still opens
    record(
        "disk: symlink in place of a rank directory",
        done="replace tp1of2 (tensor-parallel rank 1's directory) by a link out, open rank 1",
        seen="refused at start naming the link; nothing written through it; rank 0 opens",
    )
