"""The data path on CUDA: bytes-exact round trips for vLLM's GPU page layouts, framed
rows, stores ordered after the compute that wrote their blocks and never overwritten
before their copies are done, a CPU + disk tier stack, and bounded device memory.

Skipped without CUDA (CI has none); run on a GPU machine with
``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.cpu import CpuConfig, CpuTier
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.disk.tier import DiskTier
from hybridkv.tiers.tiered.store import TieredStore
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer import BlockCopier, TransferConfig, TransferEngine, TransferPart
from hybridkv.transfer.copier import HostRows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MIB = 1 << 20
CUDA = torch.device("cuda")


def model(page_bytes: int, block_size: int, second: GroupKind, num_layers: int = 4) -> ModelGroups:
    def group(kind: GroupKind, prefix: str) -> KVGroup:
        return KVGroup(
            kind=kind,
            block_size=block_size,
            page_size_bytes=page_bytes,
            layer_names=tuple(f"{prefix}.{i}" for i in range(num_layers)),
            sliding_window=4 * block_size if kind is GroupKind.SLIDING_WINDOW else None,
        )

    return ModelGroups(groups=(group(GroupKind.FULL, "f"), group(second, "s")))


MODELS = {
    "4KiB-pages": model(4 << 10, 4, GroupKind.SLIDING_WINDOW),
    "16KiB-pages": model(16 << 10, 16, GroupKind.SLIDING_WINDOW),
    "mamba-states": model(256 << 10, 16, GroupKind.MAMBA, num_layers=2),
}
LAYOUTS = {"LBNHC": KVLayoutKind.LAYER_MAJOR, "BLHNC": KVLayoutKind.BLOCK_MAJOR}


def cuda_caches(spec: ModelGroups, kind: KVLayoutKind, num_blocks: int):  # type: ignore[no-untyped-def]
    alloc = allocate_kv_caches(spec, num_blocks, kind=kind, device=CUDA)
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    return alloc


def finished(engine: TransferEngine, job: object) -> bool:
    assert job is not None and engine.wait([job], 60)  # type: ignore[list-item]
    return all(r.ok for r in engine.poll_finished())


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_copier_matches_the_cpu_copier_for_tight_and_framed_rows(name: str, layout: str) -> None:
    spec, kind = MODELS[name], LAYOUTS[layout]
    alloc = cuda_caches(spec, kind, 96)
    reference = allocate_kv_caches(spec, 96, kind=kind)
    reference.buffer.copy_(alloc.buffer.cpu())
    copier = BlockCopier(alloc.canonical, chunk_bytes=4 * spec.groups[0].block_bytes)
    native = BlockCopier(reference.canonical, chunked=False)
    for group_id, group in enumerate(spec.groups):
        ids = random.Random(group_id).sample(range(96), 40)
        want = np.empty(len(ids) * group.block_bytes, np.uint8)
        native.gather(group_id, ids, want)
        for room in (0, 64):
            stride = group.block_bytes + room
            host = torch.zeros(len(ids) * stride + room, dtype=torch.uint8, pin_memory=True)
            rows = HostRows(host, room + np.arange(len(ids), dtype=np.int64) * stride, bool(room))
            copier.gather_at(group_id, ids, rows)
            copier.wait_done(copier.copies_mark())
            got = np.concatenate([host[o : o + group.block_bytes].numpy() for o in rows.offsets])
            assert np.array_equal(got, want), (group_id, room)
            saved = alloc.buffer.clone()
            alloc.buffer.zero_()
            copier.scatter_at(group_id, ids, rows)
            copier.wait_done(copier.copies_mark())
            reference.buffer.zero_()
            native.scatter(group_id, ids, want)
            assert torch.equal(alloc.buffer.cpu(), reference.buffer), (group_id, room)
            alloc.buffer.copy_(saved)
            reference.buffer.copy_(saved.cpu())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_store_and_load_through_a_cpu_and_disk_tier_stack(tmp_path: Path, layout: str) -> None:
    spec = MODELS["16KiB-pages"]
    alloc = cuda_caches(spec, LAYOUTS[layout], 128)
    cpu = CpuTier(CpuConfig(capacity_bytes=64 * MIB))
    assert cpu.is_pinned
    disk = DiskTier(DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=256 * MIB))
    store = TieredStore([cpu, disk])
    ids = random.Random(5).sample(range(1, 128), 60)
    parts = [
        TransferPart(g, ids, [StoreKey(f"gpu/{layout}/{g}/{b}") for b in ids]) for g in range(2)
    ]
    with TransferEngine(alloc.canonical, store, TransferConfig()) as engine:
        assert engine.asynchronous and engine.in_place is not None
        assert finished(engine, engine.submit_store(parts))
        assert store.flush(60)
        saved = alloc.buffer.clone()
        for t in alloc.canonical.tensors:
            t[ids] = 0
        assert finished(engine, engine.submit_load(parts))
        assert torch.equal(alloc.buffer, saved), "loaded from the CPU tier's memory"
        cpu.delete_many([k for p in parts for k in p.keys])
        for t in alloc.canonical.tensors:
            t[ids] = 0
        assert finished(engine, engine.submit_load(parts))
        assert torch.equal(alloc.buffer, saved), "loaded from the disk tier through staging"
        engine.check_integrity()
    store.close()


def test_a_store_copies_what_queued_compute_wrote_and_the_fence_guards_its_blocks() -> None:
    """The store returns before its copies; they run after the compute queued before it
    (which writes the blocks), and a write after ``fence`` cannot reach them first."""
    spec = MODELS["16KiB-pages"]
    alloc = cuda_caches(spec, KVLayoutKind.LAYER_MAJOR, 512)
    store = TieredStore([CpuTier(CpuConfig(capacity_bytes=256 * MIB))])
    ids = list(range(1, 257))
    keys = [StoreKey(f"fence/{b}") for b in ids]
    weight = torch.randn(4096, 4096, device=CUDA)
    with TransferEngine(alloc.canonical, store, TransferConfig()) as engine:
        for _ in range(20):  # tens of ms of compute, then the KV write it produces
            weight = torch.mm(weight, weight).clamp_(-1, 1)
        for t in alloc.canonical.tensors:
            t[ids] = 11
        job = engine.submit_store([TransferPart(0, ids, keys)])
        assert engine.fence(ids) == 1
        for t in alloc.canonical.tensors:  # the next step writes the same blocks
            t[ids] = 22
        assert finished(engine, job)
        for t in alloc.canonical.tensors:
            t[ids] = 0
        assert finished(engine, engine.submit_load([TransferPart(0, ids, keys)]))
        layers = [t[ids] for t in alloc.canonical.tensors]
        assert all(bool((x[:, : spec.groups[0].page_size_bytes] == 11).all()) for x in layers)
    store.close()


def test_device_memory_stays_within_the_chunk_whatever_the_job() -> None:
    spec = MODELS["16KiB-pages"]
    alloc = cuda_caches(spec, KVLayoutKind.LAYER_MAJOR, 4096)
    store = TieredStore([CpuTier(CpuConfig(capacity_bytes=1024 * MIB))])
    config = TransferConfig(device_chunk_bytes=8 * MIB)
    with TransferEngine(alloc.canonical, store, config) as engine:
        assert engine.copier.device_bytes == 8 * MIB
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ids = list(range(1, 4096))  # 4095 blocks of 64 KiB: 256 MiB in one job
        keys = [StoreKey(f"bound/{b}") for b in ids]
        assert finished(engine, engine.submit_store([TransferPart(0, ids, keys)]))
        assert finished(engine, engine.submit_load([TransferPart(0, ids, keys)]))
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        assert extra < 1 * MIB, f"{extra} device bytes beyond the chunk for a 256 MiB job"
    store.close()
