"""TieredStore over a real CpuTier and DiskTier: selection, promotion, write-back, failures."""

from __future__ import annotations

import random
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierStats,
    TierUsage,
)
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from hybridkv.tiers.selection import Selection, pick_whole_request_tier
from hybridkv.tiers.tiered.store import TieredStore
from tests.support.threads import run_on_threads

SIZE = 4096


def key(i: int | str) -> StoreKey:
    return StoreKey(f"test/tiered/{i}")


def payload(k: str, num_bytes: int = SIZE, version: int = 0) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(k.encode()) + 7919 * version)
    return rng.integers(0, 256, num_bytes, dtype=np.uint8)


def cpu(capacity_bytes: int = 1 << 20, load_weight: float = 1.0) -> CpuTier:
    config = CpuConfig(capacity_bytes=capacity_bytes, load_weight=load_weight, pin_memory=False)
    return CpuTier(config)


def disk(
    path: Path, capacity_bytes: int = 16 << 20, load_weight: float = 4.0, read_only: bool = False
) -> DiskTier:
    config = DiskConfig(
        path=path, capacity_bytes=capacity_bytes, load_weight=load_weight, read_only=read_only
    )
    return DiskTier(config)


def read(
    store: Tier, keys: Sequence[StoreKey], **kwargs: int
) -> tuple[list[GetStatus], list[Buffer]]:
    outs = [np.zeros(SIZE, dtype=np.uint8) for _ in keys]
    if kwargs:
        assert isinstance(store, TieredStore)
        return store.get_many_into(keys, outs, **kwargs), outs
    return store.get_many_into(keys, outs), outs


class RaisingTier(Tier):
    """A tier whose every call raises, as a crashed client library would."""

    name = "broken"
    load_weight = 0.5

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        raise ConnectionError("pool unreachable")

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        raise ConnectionError("pool unreachable")

    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        raise ConnectionError("pool unreachable")

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        raise ConnectionError("pool unreachable")

    def usage(self) -> TierUsage:
        raise ConnectionError("pool unreachable")

    def stats(self) -> TierStats:
        raise ConnectionError("pool unreachable")


@pytest.mark.parametrize(
    "cpu_weight, disk_weight, expect_source", [(1.0, 4.0, "cpu"), (5.0, 1.0, "disk")]
)
def test_per_block_reads_each_block_from_the_cheapest_tier_holding_it(
    tmp_path: Path, cpu_weight: float, disk_weight: float, expect_source: str
) -> None:
    cpu_tier, disk_tier = cpu(load_weight=cpu_weight), disk(tmp_path, load_weight=disk_weight)
    store = TieredStore([cpu_tier, disk_tier], promote=False, write_back=False)
    only_disk, both, nowhere = key("only-disk"), key("both"), key("nowhere")
    # Same key, different bytes per tier: the bytes read back name the tier that served them.
    cpu_tier.put_many([both], [payload(both, version=1)])
    disk_tier.put_many([only_disk, both], [payload(only_disk), payload(both, version=2)])

    statuses, outs = read(store, [only_disk, both, nowhere])
    assert statuses == [GetStatus.OK, GetStatus.OK, GetStatus.MISS]
    assert np.array_equal(outs[0], payload(only_disk))
    expected_version = 1 if expect_source == "cpu" else 2
    assert np.array_equal(outs[1], payload(both, version=expected_version))
    assert store.contains_many([only_disk, both, nowhere]) == [True, True, False]
    by_tier = [store.contains_many([only_disk, both, nowhere], tier_index=i) for i in (0, 1)]
    assert by_tier == [[False, True, False], [True, True, False]]
    store.check_integrity()


def test_a_corrupt_copy_falls_back_to_the_next_tier(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), disk(tmp_path)
    store = TieredStore([cpu_tier, disk_tier], promote=False, write_back=False)
    k = key("other-size")
    cpu_tier.put_many([k], [payload(k, SIZE + 1)])  # of another size: CORRUPT when read
    disk_tier.put_many([k], [payload(k)])
    statuses, outs = read(store, [k])
    assert statuses == [GetStatus.OK] and np.array_equal(outs[0], payload(k))
    by_tier = store.stats_by_tier()
    assert by_tier["cpu"].corrupt == 1 and by_tier["disk"].gets == 1
    store.check_integrity()


@given(
    st.lists(
        st.tuples(st.integers(0, 10_000), st.floats(0.01, 100, allow_nan=False)),
        min_size=1,
        max_size=6,
    )
)
def test_pick_whole_request_tier_matches_brute_force(tiers: list[tuple[int, float]]) -> None:
    hits = [tokens for tokens, _ in tiers]
    weights = [weight for _, weight in tiers]
    scores = [(tokens / weight, -i) for i, (tokens, weight) in enumerate(tiers) if tokens > 0]
    expected = -max(scores)[1] if scores else None
    assert pick_whole_request_tier(hits, weights) == expected


def test_whole_request_picks_one_tier_by_hit_tokens_per_cost(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(load_weight=1.0), disk(tmp_path, load_weight=4.0)
    store = TieredStore(
        [cpu_tier, disk_tier], selection=Selection.WHOLE_REQUEST, promote=False, write_back=False
    )
    weights = [tier.load_weight for tier in store.tiers]
    assert pick_whole_request_tier([100, 300], weights) == 0  # 100 / 1 beats 300 / 4
    assert pick_whole_request_tier([100, 500], weights) == 1  # 500 / 4 beats 100 / 1
    assert pick_whole_request_tier([0, 0], weights) is None
    assert pick_whole_request_tier([16, 64], weights) == 0  # a tie goes to the earlier tier
    k = key("both")
    cpu_tier.put_many([k], [payload(k, version=1)])
    disk_tier.put_many([k], [payload(k, version=2)])
    statuses, outs = read(store, [k], tier_index=1)
    assert statuses == [GetStatus.OK] and np.array_equal(outs[0], payload(k, version=2))
    assert store.contains_many([key("missing"), k], tier_index=1) == [False, True]
    with pytest.raises(ValueError, match="weights"):
        pick_whole_request_tier([1, 2], [1.0])


@pytest.mark.parametrize("promote", [True, False])
def test_lower_tier_hits_are_promoted_into_cpu(tmp_path: Path, promote: bool) -> None:
    cpu_tier, disk_tier = cpu(), disk(tmp_path)
    store = TieredStore([cpu_tier, disk_tier], promote=promote, write_back=False)
    k = key("promote")
    disk_tier.put_many([k], [payload(k)])
    assert read(store, [k])[0] == [GetStatus.OK]
    assert cpu_tier.contains_many([k]) == [promote]
    if promote:
        statuses, outs = read(cpu_tier, [k])
        assert statuses == [GetStatus.OK] and np.array_equal(outs[0], payload(k))
    store.check_integrity()


class PromotedDisk(DiskTier):
    """A disk tier that declares it takes promotions."""

    accepts_promotions = True


class UnpromotedCpu(CpuTier):
    """A CPU tier that declares it takes none."""

    accepts_promotions = False


def test_promotion_goes_to_the_first_tier_declaring_it_accepts_them(tmp_path: Path) -> None:
    first = UnpromotedCpu(CpuConfig(capacity_bytes=1 << 20, pin_memory=False))
    taker = PromotedDisk(DiskConfig(path=tmp_path / "taker", capacity_bytes=16 << 20))
    source = disk(tmp_path / "source", load_weight=8.0)
    store = TieredStore([first, taker, source], write_back=False)
    k = key("promoted")
    source.put_many([k], [payload(k)])
    assert read(store, [k])[0] == [GetStatus.OK]
    assert [store.contains_many([k], tier_index=i) for i in range(3)] == [[False], [True], [True]]
    statuses, outs = read(taker, [k])
    assert statuses == [GetStatus.OK] and np.array_equal(outs[0], payload(k))
    store.check_integrity()
    store.close()


def test_write_back_reaches_disk_with_the_bytes_of_the_put(tmp_path: Path) -> None:
    store = TieredStore([cpu(), disk(tmp_path / "d")])
    keys = [key(i) for i in range(50)]
    buffers = [payload(k) for k in keys]
    assert store.put_many(keys, buffers) == [PutStatus.OK] * len(keys)
    for buf in buffers:
        buf[:] = 0  # the caller reuses its staging buffers at once
    assert store.flush(timeout_s=30)
    assert store.write_back_stats().num_written == len(keys)
    store.check_integrity()

    fresh = disk(tmp_path / "d", read_only=True)  # the store still writes there
    assert fresh.scan_report.num_objects == len(keys)
    statuses, outs = read(fresh, keys)
    assert statuses == [GetStatus.OK] * len(keys)
    assert all(np.array_equal(out, payload(k)) for k, out in zip(keys, outs, strict=True))


def test_close_flushes_write_back(tmp_path: Path) -> None:
    store = TieredStore([cpu(), disk(tmp_path / "d")])
    keys = [key(i) for i in range(20)]
    store.put_many(keys, [payload(k) for k in keys])
    store.close()
    assert disk(tmp_path / "d").contains_many(keys) == [True] * len(keys)


def test_write_back_skips_and_counts_when_staging_is_full(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), disk(tmp_path)
    store = TieredStore([cpu_tier, disk_tier], write_back_bytes=SIZE // 2)
    k = key("skipped")
    assert store.put_many([k], [payload(k)]) == [PutStatus.OK]  # the CPU tier has it
    assert store.flush(timeout_s=30)
    assert store.write_back_stats().num_skipped == 1
    assert disk_tier.contains_many([k]) == [False]
    store.check_integrity()


def test_objects_too_big_for_cpu_still_reach_disk(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(capacity_bytes=SIZE // 2), disk(tmp_path)
    store = TieredStore([cpu_tier, disk_tier])
    k = key("big")
    assert store.put_many([k], [payload(k)]) == [PutStatus.OK]
    assert store.flush(timeout_s=30)
    assert cpu_tier.contains_many([k]) == [False]
    assert disk_tier.contains_many([k]) == [True]
    store.check_integrity()


def test_without_write_back_stores_reach_every_tier_at_once(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), disk(tmp_path)
    store = TieredStore([cpu_tier, disk_tier], write_back=False)
    k = key("sync")
    assert store.put_many([k], [payload(k)]) == [PutStatus.OK]
    assert disk_tier.contains_many([k]) == [True] and cpu_tier.contains_many([k]) == [True]


def test_a_raising_tier_never_breaks_the_store(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), disk(tmp_path)
    store = TieredStore([cpu_tier, RaisingTier(), disk_tier])
    keys = [key(i) for i in range(4)]
    assert store.put_many(keys, [payload(k) for k in keys]) == [PutStatus.OK] * 4
    assert store.flush(timeout_s=30)
    assert disk_tier.contains_many(keys) == [True] * 4
    cpu_tier.delete_many(keys[:2])
    assert store.contains_many(keys) == [True] * 4
    statuses, outs = read(store, keys)  # the broken tier is the cheapest: tried first
    assert statuses == [GetStatus.OK] * 4
    assert all(np.array_equal(out, payload(k)) for k, out in zip(keys, outs, strict=True))
    assert store.delete_many(keys) == 4
    by_tier = store.stats_by_tier()
    assert by_tier["broken"].errors >= 5
    assert by_tier["cpu"].errors == 0 and by_tier["disk"].errors == 0
    assert store.stats().errors == by_tier["broken"].errors
    assert store.usage().capacity_bytes is None
    store.check_integrity()
    store.close()


def test_a_disk_tier_whose_directory_vanished_costs_hits_only(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), disk(tmp_path / "d")
    store = TieredStore([cpu_tier, disk_tier], promote=False)
    keys = [key(i) for i in range(4)]
    store.put_many(keys, [payload(k) for k in keys])
    assert store.flush(timeout_s=30)
    shutil.rmtree(tmp_path / "d")  # the open segment files lose their last link
    cpu_tier.delete_many(keys[:2])
    statuses, _ = read(store, keys)
    assert statuses == [GetStatus.MISS, GetStatus.MISS, GetStatus.OK, GetStatus.OK]
    more = [key(i) for i in range(4, 8)]
    assert store.put_many(more, [payload(k) for k in more]) == [PutStatus.OK] * 4
    assert store.flush(timeout_s=30)
    assert store.write_back_stats().num_failed == 4
    assert disk_tier.contains_many(keys) == [False] * 4
    assert disk_tier.usage().num_objects == 0


def test_delete_removes_from_every_tier_and_the_write_back_queue(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(), disk(tmp_path)
    store = TieredStore([cpu_tier, disk_tier])
    keys = [key(i) for i in range(30)]
    store.put_many(keys, [payload(k) for k in keys])
    assert store.delete_many(keys) == 30
    assert store.flush(timeout_s=30)
    assert store.contains_many(keys) == [False] * 30
    assert disk_tier.contains_many(keys) == [False] * 30
    store.check_integrity()


def test_stats_by_tier_and_hit_tokens(tmp_path: Path) -> None:
    store = TieredStore(
        [cpu(), disk(tmp_path / "a"), disk(tmp_path / "b")], promote=False, write_back=False
    )
    assert list(store.stats_by_tier()) == ["cpu", "disk", "disk#2"]
    k = key("s")
    store.put_many([k], [payload(k)])
    store.record_hit_tokens(1, 64)
    store.record_hit_tokens(1, 32)
    store.record_hit_tokens(0, 16)
    read(store, [k, key("miss")])
    by_tier = store.stats_by_tier()
    assert by_tier["disk"].hit_tokens == 96 and by_tier["cpu"].hit_tokens == 16
    assert all(stats.pending_loads == 0 for stats in by_tier.values())
    assert by_tier["cpu"].gets == 1 and by_tier["disk"].gets == 0  # the miss costs no get
    stats = store.stats()
    assert (stats.hit_tokens, stats.gets, stats.get_bytes) == (112, 1, SIZE)
    assert store.usage().num_objects == 3


def test_threads_with_write_back_and_eviction_stay_consistent(tmp_path: Path) -> None:
    cpu_tier, disk_tier = cpu(capacity_bytes=16 * SIZE), disk(tmp_path, capacity_bytes=40 * SIZE)
    store = TieredStore([cpu_tier, disk_tier], write_back_bytes=8 * SIZE)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            keys = [key(rng.randrange(60)) for _ in range(rng.randrange(1, 4))]
            keys = list(dict.fromkeys(keys))
            if rng.random() < 0.5:
                store.put_many(keys, [payload(k) for k in keys])
            else:
                statuses, outs = read(store, keys)
                for k, status, out in zip(keys, statuses, outs, strict=True):
                    if status is GetStatus.OK and not np.array_equal(out, payload(k)):
                        errors.append(f"wrong bytes for {k}")
                    elif status not in (GetStatus.OK, GetStatus.MISS):
                        errors.append(f"{status} for {k}")

    run_on_threads(work, num_threads=6)
    assert store.flush(timeout_s=60)
    assert errors == []
    assert cpu_tier.stats().evictions > 0 and disk_tier.stats().evictions > 0
    store.check_integrity()
    store.close()


def test_store_needs_a_tier() -> None:
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])
