"""The zero-copy path: the transfer engine's staging registered with a real Mooncake pool
(master and storage daemon on 127.0.0.1), objects framed and verified in place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.layout import canonicalize
from hybridkv.tiers.base import GetStatus, PutStatus
from hybridkv.tiers.codec import HEADER_BYTES, checksum, pack_header
from hybridkv.tiers.mooncake import direct
from hybridkv.tiers.mooncake.config import MooncakeConfig
from hybridkv.tiers.mooncake.tier import MooncakeTier
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.tools.pool import LocalPool
from hybridkv.tools.servers import ServerRole
from hybridkv.transfer import JobOutcome, JobResult, TransferConfig, TransferEngine, TransferPart
from tests.support.kv_caches import qwen_next_like
from tests.support.servers import MIB, MooncakePool, wait_for
from tests.support.tier_data import new_keys

pytestmark = pytest.mark.timeout(120)

GROUPS = qwen_next_like(attn_page=16 << 10, mamba_page=12 << 10)
NUM_BLOCKS = 16


class Recorder:
    """The real Mooncake client, with the addresses of each data call written down."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.pointers: dict[str, list[tuple[int, int]]] = {"put": [], "get": []}
        self.num_calls = {"put": 0, "get": 0}

    def batch_put_from(self, keys: list[str], pointers: list[int], sizes: list[int]) -> Any:
        self.pointers["put"] += zip(pointers, sizes, strict=True)
        self.num_calls["put"] += 1
        return self._store.batch_put_from(keys, pointers, sizes)

    def batch_get_into(self, keys: list[str], pointers: list[int], sizes: list[int]) -> Any:
        self.pointers["get"] += zip(pointers, sizes, strict=True)
        self.num_calls["get"] += 1
        return self._store.batch_get_into(keys, pointers, sizes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    with MooncakePool(segment_bytes=128 * MIB) as running:
        yield running


def make_tier(pool: LocalPool, **options: Any) -> MooncakeTier:
    options = {"op_timeout_s": 1.0, "retry_interval_s": 0.2, **options}
    return MooncakeTier(
        MooncakeConfig(master_address=pool.master_address, local_buffer_bytes=1 * MIB, **options)
    )


def caches(seed: int) -> dict[str, torch.Tensor]:
    kv = allocate_kv_caches(GROUPS, NUM_BLOCKS).kv_caches
    gen = torch.Generator().manual_seed(seed)
    for t in kv.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return kv


def parts(block_ids: list[int]) -> list[TransferPart]:
    """Group 0 (full attention) over ``block_ids``, under fresh keys."""
    return [TransferPart(0, block_ids, new_keys(len(block_ids)))]


def block_bytes(kv: dict[str, torch.Tensor], block_id: int) -> bytes:
    return b"".join(kv[name][block_id].view(torch.uint8).numpy().tobytes()
                    for name in GROUPS.groups[0].layer_names)  # fmt: skip


def run(engine: TransferEngine, job_id: Any) -> JobResult:
    assert job_id is not None and engine.wait([job_id], timeout_s=30)
    (result,) = engine.poll_finished()
    return result


@pytest.mark.parametrize("num_chunks", [1, 2])
def test_blocks_round_trip_through_the_pool_with_no_copy_by_the_tier(
    pool: LocalPool, raw: Any, num_chunks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = caches(seed=1)
    ids = [3, 7, 11, 12]
    saved = {b: block_bytes(kv, b) for b in ids}
    object_bytes = HEADER_BYTES + len(saved[3])
    monkeypatch.setattr(direct, "CHUNK_BYTES", len(ids) * object_bytes // num_chunks)
    with make_tier(pool) as tier:
        recorder = Recorder(tier._client.store)
        tier._client.store = recorder
        config = TransferConfig(staging_bytes=4 * MIB)
        with TransferEngine(canonicalize(kv, GROUPS), tier, config) as engine:
            assert engine.placement.room_bytes >= HEADER_BYTES
            job = parts(ids)
            assert run(engine, engine.submit_store(job)).ok
            for t in kv.values():
                t.view(torch.uint8).fill_(0x5A)
            assert run(engine, engine.submit_load(job)).ok
            assert all(block_bytes(kv, b) == saved[b] for b in ids)
            # The pool holds header + block; Mooncake read and wrote the engine's staging
            # itself (the tier's own arena was never named): no copy by the tier.
            key = job[0].keys[1]
            assert raw.get(key) == pack_header(key, np.frombuffer(saved[7], np.uint8)) + saved[7]
            low = int(engine.arena.array.ctypes.data)
            high = low + engine.arena.total_bytes
            for op in ("put", "get"):
                spans = recorder.pointers[op]
                assert len(spans) == len(ids) and recorder.num_calls[op] == num_chunks, op
                assert all(low <= p and p + n <= high for p, n in spans), op
                assert {n for _, n in spans} == {object_bytes}, op
            engine.check_integrity()
        stats, payload_bytes = tier.stats(), len(ids) * len(saved[3])
        assert (stats.puts, stats.put_bytes) == (len(ids), payload_bytes)
        assert (stats.gets, stats.get_bytes) == (len(ids), payload_bytes)
        assert stats.errors == stats.corrupt == 0
        assert tier.usage().num_objects == len(ids)
        tier.check_integrity()


def test_a_corrupt_object_in_the_pool_never_reaches_the_caches(pool: LocalPool, raw: Any) -> None:
    kv = caches(seed=2)
    ids = [1, 2, 5]
    saved = {b: block_bytes(kv, b) for b in ids}
    with make_tier(pool) as tier, TransferEngine(canonicalize(kv, GROUPS), tier) as engine:
        job = parts(ids)
        assert run(engine, engine.submit_store(job)).ok
        key = job[0].keys[1]
        stored = bytearray(raw.get(key))
        stored[-1] ^= 0xFF  # one flipped payload byte behind a valid header
        assert raw.remove(key, True) == 0 and raw.put(key, bytes(stored)) == 0
        for t in kv.values():
            t.view(torch.uint8).fill_(0x5A)
        result = run(engine, engine.submit_load(job))
        assert result.outcome is JobOutcome.FAILED and result.failed_block_ids[0] == (2,)
        assert block_bytes(kv, 2) == b"\x5a" * len(saved[2]), "corrupt bytes were scattered"
        assert block_bytes(kv, 1) == saved[1] and block_bytes(kv, 5) == saved[5]
        assert tier.stats().corrupt == 1
        engine.check_integrity()


def test_an_abandoned_put_keeps_its_staging_until_mooncake_returns() -> None:
    kv = caches(seed=3)
    with MooncakePool(segment_bytes=64 * MIB) as fault_pool, make_tier(fault_pool) as tier:
        config = TransferConfig(staging_bytes=1 * MIB, store_timeout_s=0.5)
        with TransferEngine(canonicalize(kv, GROUPS), tier, config) as engine:
            fault_pool.pause(ServerRole.DAEMON)
            try:
                result = run(engine, engine.submit_store(parts([0, 1, 2])))
                assert result.outcome is JobOutcome.TIMED_OUT
                # The lookup (master) answers; the transfer to the stopped daemon hangs, and
                # the tier gives up after op_timeout_s with its call still in Mooncake.
                wait_for(lambda: tier.staging_busy(), timeout_s=10)
                held = engine.num_inflight_bytes
                assert held > 0, "staging freed while Mooncake may still read it"
                assert not engine.wait_idle(timeout_s=0.2)
            finally:
                fault_pool.resume(ServerRole.DAEMON)
            assert engine.wait_idle(timeout_s=60)
            assert not tier.staging_busy() and engine.num_inflight_bytes == 0
            engine.check_integrity()
        tier.check_integrity()


def test_buffers_outside_registered_staging_take_the_copy_path(pool: LocalPool) -> None:
    with make_tier(pool) as tier:
        staging = np.zeros(1 * MIB, dtype=np.uint8)
        assert tier.register_staging(staging) >= HEADER_BYTES
        inside = staging[4096 : 4096 + 1000]
        at_start = staging[:1000]  # no room in front: must not be framed in place
        assert tier._staged.framed([inside]) is not None
        assert tier._staged.framed([at_start]) is None
        assert tier._staged.framed([inside, np.zeros(1000, np.uint8)]) is None


def test_framing_finds_each_buffer_in_its_own_registered_staging(pool: LocalPool) -> None:
    """Buffers of one batch may lie in different registered stagings, in any order; each
    is framed as a slice of its own, with that slice's address, and one that runs past
    the end of its staging is not framed at all."""
    with make_tier(pool) as tier:
        first, second = np.zeros(MIB, np.uint8), np.zeros(MIB, np.uint8)
        assert tier.register_staging(first) >= HEADER_BYTES
        assert tier.register_staging(second) >= HEADER_BYTES
        buffers = [second[4096:8192], first[64:1000], second[-500:], first[-1000:]]
        framed = tier._staged.framed(buffers)
        assert framed is not None
        for buffer, view, address in zip(buffers, framed.views, framed.addresses, strict=True):
            assert address == int(buffer.ctypes.data) - HEADER_BYTES == int(view.ctypes.data)
            assert len(view) == HEADER_BYTES + len(buffer)
            assert view.base is first or view.base is second
            assert np.shares_memory(view[HEADER_BYTES:], buffer)
        past_end = np.lib.stride_tricks.as_strided(second[-500:], shape=(501,))
        assert tier._staged.framed([buffers[0], past_end]) is None


@given(st.lists(st.integers(1, 5000), max_size=40), st.integers(1, 20_000))
def test_split_keeps_every_index_once_in_order(sizes: list[int], chunk_bytes: int) -> None:
    framed = [np.empty(size, np.uint8) for size in sizes]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct, "CHUNK_BYTES", chunk_bytes)
        chunks = direct.split(list(range(len(sizes))), framed)
    assert [i for chunk in chunks for i in chunk] == list(range(len(sizes)))
    assert 1 <= len(chunks) <= max(1, min(direct.MAX_CHUNKS, sum(sizes) // chunk_bytes))
    assert all(chunks) or chunks == [[]]


def test_checksums_given_with_a_put_go_into_the_headers_unread(pool: LocalPool) -> None:
    """A put in registered staging writes the checksums it is given (taken by the engine
    while gathering) instead of reading the payloads: a right one reads back OK, a wrong
    one reads back CORRUPT (recomputed, never wrong data); a count that does not match
    the keys is refused before anything is stored."""
    with make_tier(pool) as tier:
        staging = np.zeros(1 * MIB, dtype=np.uint8)
        room = tier.register_staging(staging)
        payloads = [np.random.default_rng(seed).integers(0, 256, 3000, np.uint8) for seed in (1, 2)]
        buffers = [staging[room + i * 8192 : room + i * 8192 + 3000] for i in (0, 1)]
        for buffer, payload in zip(buffers, payloads, strict=True):
            buffer[:] = payload
        keys = new_keys(2)
        right = checksum(payloads[0])
        with pytest.raises(ValueError, match="checksums"):
            tier.put_many(keys, buffers, [right])
        assert tier.put_many(keys, buffers, [right, right]) == [PutStatus.OK] * 2
        out = [np.zeros(3000, np.uint8) for _ in keys]
        assert tier.get_many_into(keys, out) == [GetStatus.OK, GetStatus.CORRUPT]
        assert np.array_equal(out[0], payloads[0])
        assert tier.stats().corrupt == 1
