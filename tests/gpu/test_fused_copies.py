"""The fused span kernel on real CUDA: the same bytes as the per-span torch path, for
the interpreter's cases and for pages and layer counts of real models, with both halves
of the chunk in flight on their two streams.

Skipped without CUDA or Triton; run with ``python -m pytest tests/gpu``.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer.chunked import ChunkedCopies
from tests.transfer.span_cases import CACHES, CASE_NAMES, FRAMES, compare_paths

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytest.importorskip("triton")

CUDA = torch.device("cuda")
MIB = 1 << 20


def test_the_kernel_is_the_default_on_cuda() -> None:
    caches, _ = CACHES["LBNHC"](CUDA)
    assert ChunkedCopies(caches).fused


@pytest.mark.parametrize("case", [c for c in CASE_NAMES if c.rpartition("-")[2] in FRAMES])
def test_fused_equals_per_span_on_cuda(case: str) -> None:
    name, _, frame = case.rpartition("-")
    assert compare_paths(CACHES[name], frame, 3, CUDA) == []


def model(num_layers: int, page_bytes: int) -> ModelGroups:
    def group(kind: GroupKind, prefix: str) -> KVGroup:
        return KVGroup(
            kind=kind,
            block_size=16,
            page_size_bytes=page_bytes,
            layer_names=tuple(f"{prefix}.{i}" for i in range(num_layers)),
            sliding_window=1024 if kind is GroupKind.SLIDING_WINDOW else None,
        )

    return ModelGroups(groups=(group(GroupKind.FULL, "f"), group(GroupKind.SLIDING_WINDOW, "s")))


@pytest.mark.parametrize("kind", [KVLayoutKind.LAYER_MAJOR, KVLayoutKind.BLOCK_MAJOR])
@pytest.mark.parametrize("layers_pages", [(32, 4 << 10), (32, 64 << 10), (8, 256 << 10)])
@pytest.mark.parametrize("room", [0, 64])
def test_many_pieces_of_real_pages_round_trip(
    kind: KVLayoutKind, layers_pages: tuple[int, int], room: int
) -> None:
    """64 MiB of random blocks out through the kernel and back in, several pieces on both
    streams: the host rows and the caches hold what the per-span path puts there."""
    spec = model(*layers_pages)
    block_bytes = spec.groups[0].block_bytes
    n = max(4, 64 * MIB // block_bytes)
    alloc = allocate_kv_caches(spec, 2 * n + 1, kind=kind, device=CUDA)
    alloc.buffer.copy_(torch.randint(-128, 128, alloc.buffer.shape, dtype=torch.int8))
    fused = ChunkedCopies(alloc.canonical, 8 * MIB, fused=True)
    plain = ChunkedCopies(alloc.canonical, 8 * MIB, fused=False)
    ids = np.array(random.Random(n).sample(range(2 * n + 1), n), np.int64)
    offsets = room + np.arange(n, dtype=np.int64) * (block_bytes + room)
    size = int(offsets[-1]) + block_bytes
    got, want = (torch.zeros(size, dtype=torch.uint8, pin_memory=True) for _ in range(2))
    assert fused.gather(0, ids, got, offsets, scratch_gaps=room > 0) > 2
    plain.gather(0, ids, want, offsets, scratch_gaps=room > 0)
    torch.cuda.synchronize()
    rows = [slice(o, o + block_bytes) for o in offsets.tolist()]
    assert all(torch.equal(got[r], want[r]) for r in rows)
    scattered = []
    for copies in (fused, plain):
        alloc.buffer.zero_()
        copies.scatter(0, ids, got, offsets, scratch_gaps=room > 0)
        torch.cuda.synchronize()
        scattered.append(alloc.buffer.clone())
    assert torch.equal(scattered[0], scattered[1])
    assert bool(scattered[0].any()), "the blocks came back"
