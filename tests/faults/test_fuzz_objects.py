"""Random damage to stored objects, read back through the real tiers (hypothesis).

Bit flips, truncation, random bytes and wrong lengths in disk segment files
(before the tier opens them, or under an open tier) and in Valkey values must
give misses or corrupt answers that the tier counts: never an exception,
never a hang (pytest-timeout), never bytes other than those stored.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.tiers.base import GetStatus, StoreKey, Tier
from hybridkv.tiers.codec import HEADER_BYTES, pack_header, verify_object
from hybridkv.tiers.disk import segments
from hybridkv.tiers.disk.tier import DiskConfig, DiskTier
from hybridkv.tiers.valkey.config import ValkeyConfig
from hybridkv.tiers.valkey.tier import ValkeyTier
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.servers import HOST
from tests.faults.report import record
from tests.support.servers import ValkeyServer

SIZES = [1, 100, 4096, 5000, 12_288, 70_000]
KEYS = [StoreKey(f"faults/fuzz/{i}") for i in range(len(SIZES))]
PAYLOADS = [
    np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(SIZES)
]
NUM_EXAMPLES = 60
pytestmark = pytest.mark.timeout(300)

totals: dict[str, dict[str, int]] = {}


def read_back(
    tier: Tier, size_deltas: list[int], *, check: bool = True, reader: bool = False
) -> dict[str, int]:
    """Look up then load every key (some into a buffer of the wrong size) and check the
    answers against what was stored; returns the tier's counters.

    A key found and then missing must have been counted (corrupt or error), except for
    a read-only disk instance: for it a file taken over by its writer since the lookup
    looks the same as a damaged segment header, and both are a plain miss.
    """
    found = tier.contains_many(KEYS)
    outs = [
        np.zeros(max(0, len(p) + d), np.uint8) for p, d in zip(PAYLOADS, size_deltas, strict=True)
    ]
    statuses = tier.get_many_into(KEYS, outs)
    for payload, out, status, delta in zip(PAYLOADS, outs, statuses, size_deltas, strict=True):
        assert status is not GetStatus.ERROR or delta == 0, status
        if status is GetStatus.OK:
            assert delta == 0 and np.array_equal(out, payload)  # never other bytes
    stats = tier.stats()
    num_ok = statuses.count(GetStatus.OK)
    assert stats.gets == num_ok
    assert stats.queries - stats.hits == found.count(False)  # a lookup that misses is counted
    assert stats.corrupt >= statuses.count(GetStatus.CORRUPT)
    assert stats.errors >= statuses.count(GetStatus.ERROR)
    for was_found, status in zip(found, statuses, strict=True):  # found, then gone: counted
        assert reader or status is not GetStatus.MISS or not was_found, (found, statuses)
    if check:
        tier.check_integrity()
    return {"ok": num_ok, "missed": found.count(False), "corrupt": stats.corrupt}


def add_totals(case: str, seen: dict[str, int]) -> None:
    total = totals.setdefault(case, {"examples": 0, "ok": 0, "missed": 0, "corrupt": 0})
    total["examples"] += 1
    for name, value in seen.items():
        total[name] += value


# -- disk --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="hybridkv-fuzz-"))
    tier = DiskTier(DiskConfig(path=root / "cache", capacity_bytes=4 << 20, segment_bytes=64 << 10))
    tier.put_many(KEYS, PAYLOADS)
    tier.close()
    yield root / "cache"
    shutil.rmtree(root, ignore_errors=True)


REGIONS = ("segment_header", "slot_table", "payload", "anywhere")
DAMAGE = st.tuples(
    st.sampled_from(["flip", "random", "truncate", "extend"]),
    st.sampled_from(REGIONS),
    st.integers(0, 2**32),  # which file and where, reduced modulo what exists
    st.integers(1, 300),
)


def damage_file(path: Path, kind: str, region: str, where: int, num_bytes: int) -> None:
    size = path.stat().st_size
    records = [r for r in segments.iter_records(path.parent) if r.path == path]
    spans = {
        "segment_header": (0, 64),
        "slot_table": (segments.PAGE, segments.PAGE + max(1, len(records)) * segments.SLOT_BYTES),
        "payload": (records[where % len(records)].offset, records[where % len(records)].offset
                    + records[where % len(records)].length) if records else (0, size),
        "anywhere": (0, size),
    }  # fmt: skip
    start, end = spans[region]
    offset = start + where % max(1, end - start)
    with path.open("r+b") as f:
        if kind == "flip":
            f.seek(offset)
            byte = f.read(1) or b"\0"
            f.seek(offset)
            f.write(bytes([byte[0] ^ (1 << (where % 8))]))
        elif kind == "random":
            f.seek(offset)
            f.write(os.urandom(num_bytes))
        elif kind == "truncate":
            f.truncate(offset)
        else:
            f.seek(0, os.SEEK_END)
            f.write(os.urandom(num_bytes))


@settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    damages=st.lists(DAMAGE, min_size=1, max_size=4),
    opened_first=st.booleans(),
    read_only=st.booleans(),
    size_deltas=st.lists(st.sampled_from([0, 0, 0, -1, 1]), min_size=len(KEYS), max_size=len(KEYS)),
)
def test_damaged_segment_files_give_counted_misses(
    stored_dir: Path,
    damages: list[tuple[str, str, int, int]],
    opened_first: bool,
    read_only: bool,
    size_deltas: list[int],
) -> None:
    with tempfile.TemporaryDirectory() as work:
        root = Path(work) / "cache"
        shutil.copytree(stored_dir, root)
        config = DiskConfig(path=root, capacity_bytes=4 << 20, read_only=read_only)
        tier = DiskTier(config) if opened_first else None
        files = sorted(root.glob("*.seg"))
        for kind, region, where, num_bytes in damages:
            damage_file(files[where % len(files)], kind, region, where, num_bytes)
        tier = tier or DiskTier(config)
        try:
            # A file grown under an open writer breaks its size bookkeeping (checked by
            # check_integrity) until the next start; only the answers are checked then.
            grown = opened_first and any(d[0] == "extend" for d in damages)
            add_totals("disk", read_back(tier, size_deltas, check=not grown, reader=read_only))
        finally:
            tier.close()


# -- valkey ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def valkey() -> Iterator[LocalPool]:
    with ValkeyServer() as running:
        yield running


def mutate(value: bytes, kind: str, where: int, num_bytes: int) -> bytes:
    if not value:  # truncated to nothing by an earlier damage
        return os.urandom(num_bytes) if kind in ("random", "extend") else value
    offset = where % len(value)
    if kind == "flip":
        return value[:offset] + bytes([value[offset] ^ (1 << (where % 8))]) + value[offset + 1 :]
    if kind == "random":
        return value[:offset] + os.urandom(num_bytes) + value[offset + num_bytes :]
    if kind == "truncate":
        return value[:offset]
    return value + os.urandom(num_bytes)


@pytest.mark.slow
@settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    damages=st.lists(
        st.tuples(st.sampled_from(["flip", "random", "truncate", "extend"]),
                  st.integers(0, len(KEYS) - 1), st.integers(0, 2**32), st.integers(1, 300)),
        min_size=1, max_size=4,
    ),
    size_deltas=st.lists(st.sampled_from([0, 0, 0, -1, 1]), min_size=len(KEYS), max_size=len(KEYS)),
)  # fmt: skip
def test_damaged_valkey_values_give_counted_misses(
    valkey: LocalPool, damages: list[tuple[str, int, int, int]], size_deltas: list[int]
) -> None:
    raw = redis.Redis(host=HOST, port=valkey.valkey_port)
    values = {k: pack_header(k, p) + p.tobytes() for k, p in zip(KEYS, PAYLOADS, strict=True)}
    for kind, index, where, num_bytes in damages:
        values[KEYS[index]] = mutate(values[KEYS[index]], kind, where, num_bytes)
    raw.flushdb()
    raw.mset({k: v for k, v in values.items() if v})  # an empty value: the key is gone
    raw.close()
    with ValkeyTier(ValkeyConfig(port=valkey.valkey_port, op_timeout_s=2.0)) as tier:
        add_totals("valkey", read_back(tier, size_deltas))


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["flip", "random", "truncate", "extend"]),
    index=st.integers(0, len(KEYS) - 1),
    where=st.integers(0, 2**32),
    num_bytes=st.integers(1, 64),
)
def test_damaged_object_headers_never_verify_as_other_bytes(
    kind: str, index: int, where: int, num_bytes: int
) -> None:
    key, payload = KEYS[index], PAYLOADS[index]
    value = mutate(pack_header(key, payload) + payload.tobytes(), kind, where, num_bytes)
    stored = np.frombuffer(value[HEADER_BYTES:], np.uint8)
    problem = verify_object(value[:HEADER_BYTES], key, stored)
    if problem is None:  # only damage to reserved header bytes leaves it readable
        assert np.array_equal(stored, payload)
    add_totals(
        "codec", {"ok": int(problem is None), "missed": 0, "corrupt": int(problem is not None)}
    )


@pytest.mark.slow
def test_fuzz_summary_rows() -> None:
    """Runs last in this module: one report row per fuzzed tier."""
    assert set(totals) == {"disk", "valkey", "codec"}, totals
    for case, total in totals.items():
        assert total["examples"] >= NUM_EXAMPLES and total["corrupt"] > 0, (case, total)
    record(
        "disk: fuzzed damage to segment files",
        done=f"{totals['disk']['examples']} hypothesis examples: bit flips, random bytes, "
        "truncation, junk appended in segment headers, slot tables and payloads, before "
        "or under an open writer or reader; some buffers of the wrong size",
        seen="only OK (byte-identical), MISS, CORRUPT or an I/O ERROR; every lookup miss, "
        "corrupt read and error counted; no exception or hang",
        counters=totals["disk"],
    )
    record(
        "valkey: fuzzed damage to stored values",
        done=f"{totals['valkey']['examples']} hypothesis examples: the same damage to values "
        "written raw to a real valkey-server, read through the tier",
        seen="only OK (byte-identical), MISS or CORRUPT, each counted; no exception or hang",
        counters=totals["valkey"],
    )
    record(
        "codec: fuzzed damage to object headers",
        done=f"{totals['codec']['examples']} hypothesis examples on header + payload",
        seen="verify_object accepts only values whose payload equals the stored one",
        counters=totals["codec"],
    )
