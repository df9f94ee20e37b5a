"""The fused span kernel against the per-span torch path, case by case, on CPU tensors.

Run as ``TRITON_INTERPRET=1 python -m tests.transfer.span_cases`` (the variable must
be set before ``span_kernel`` is imported, so a fresh process); prints one JSON
object, case name -> list of differences found (empty: byte-exact). Each case
builds the same caches twice, moves the same blocks with ``fused=True`` and
``fused=False``, and compares every byte of host memory (gathers, the bytes between
rows included) and of the caches (scatters).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable

import numpy as np
import torch

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.layout import CanonicalKVCaches, KVLayoutKind, canonicalize
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer.chunked import ChunkedCopies
from hybridkv.transfer.span_kernel import SpanBytes, SpanTable

NUM_BLOCKS = 12
Built = tuple[CanonicalKVCaches, torch.Tensor]
"""Caches, and the one buffer holding all their bytes."""
Build = Callable[[torch.device], Built]
CPU = torch.device("cpu")


def group(names: tuple[str, ...], page: int, kind: GroupKind = GroupKind.FULL) -> KVGroup:
    window = 64 if kind is GroupKind.SLIDING_WINDOW else None
    return KVGroup(
        kind=kind, block_size=16, page_size_bytes=page, layer_names=names, sliding_window=window
    )


def random_bytes(nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(nbytes)
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=gen)


def allocated(kind: KVLayoutKind) -> Build:
    """vLLM's GPU layouts: LBNHC (layer-major) and BLHNC (block-major), two groups."""
    spec = ModelGroups(
        groups=(
            group(("f.0", "f.1", "f.2"), 192),
            group(("s.0", "s.1", "s.2"), 192, GroupKind.SLIDING_WINDOW),
        )
    )

    def build(device: torch.device) -> Built:
        alloc = allocate_kv_caches(spec, NUM_BLOCKS, kind=kind, device=device)
        alloc.buffer.copy_(random_bytes(alloc.buffer.numel()))
        return alloc.canonical, alloc.buffer

    return build


def placed(places: dict[str, tuple[int, int]], page: int, nbytes: int) -> Build:
    """One group's layers as views of one buffer: name -> (offset of block 0, stride)."""
    spec = ModelGroups(groups=(group(tuple(places), page),))

    def build(device: torch.device) -> Built:
        buffer = random_bytes(nbytes).to(device)
        kv = {
            name: buffer.as_strided((NUM_BLOCKS, page), (stride, 1), offset)
            for name, (offset, stride) in places.items()
        }
        return canonicalize(kv, spec), buffer

    return build


def kernel_blocks(device: torch.device) -> Built:
    """vLLM split each block into two kernel blocks: a layer's page is two spans (K, V)."""
    n, page = NUM_BLOCKS, 256
    storage = random_bytes(2 * n * page).to(device).view(2, 2 * n, page // 2)
    spec = ModelGroups(groups=(group(("a.0", "a.1"), page),))
    return canonicalize({"a.0": storage[0], "a.1": storage[1]}, spec), storage


N = NUM_BLOCKS
CACHES: dict[str, Build] = {
    "LBNHC": allocated(KVLayoutKind.LAYER_MAJOR),
    "BLHNC": allocated(KVLayoutKind.BLOCK_MAJOR),
    "kernel_blocks": kernel_blocks,
    "reversed_slots": placed({"a.0": (N * 128, 128), "a.1": (0, 128)}, 128, 2 * N * 128),
    "gapped_rows": placed({"a.0": (0, 3 * 128), "a.1": (2 * 128, 3 * 128)}, 128, 3 * N * 128),
    # block b of a.1 is block b + 2 of a.0: scatters must write span by span, in order
    "aliased_layers": placed({"a.0": (0, 128), "a.1": (2 * 128, 128)}, 128, (N + 2) * 128),
    # 37-byte pages at odd offsets: only 1-byte elements fit
    "odd_bytes": placed({"a.0": (1, 37), "a.1": (N * 37 + 3, 41)}, 37, N * 37 + 3 + N * 41),
    # 102-byte pages, 2 bytes off any 4-byte grid: 2-byte elements
    "two_byte": placed({"a.0": (2, 106), "a.1": (N * 106 + 2, 102)}, 102, N * 208 + 4),
}
FRAMES = {
    "tight": (0, False),  # rows block_bytes apart
    "framed": (64, True),  # 64 bytes of scratch room before each row, one pitch apart
    "scattered": (0, False),  # rows anywhere, in and out of order
}


def row_offsets(frame: str, num_rows: int, block_bytes: int) -> np.ndarray:
    room, _ = FRAMES[frame]
    if frame == "scattered":
        slots = random.Random(num_rows).sample(range(2 * num_rows), num_rows)
        return np.array([s * block_bytes + 8 * (s % 3) for s in slots], np.int64)
    return room + np.arange(num_rows, dtype=np.int64) * (block_bytes + room)


def compare_paths(
    build: Build, frame: str, chunk_blocks: int, device: torch.device = CPU
) -> list[str]:
    """Gather and scatter through both paths; every difference, described."""
    problems = []
    fused_caches, fused_buffer = build(device)
    plain_caches, plain_buffer = build(device)
    pinned = device.type == "cuda"
    groups = fused_caches.model_groups.groups
    chunk_bytes = 2 * chunk_blocks * max(g.block_bytes for g in groups)
    fused = ChunkedCopies(fused_caches, chunk_bytes, fused=True)
    plain = ChunkedCopies(plain_caches, chunk_bytes, fused=False)
    assert fused.fused and not plain.fused
    _, scratch = FRAMES[frame]
    for group_id, g in enumerate(groups):
        rng = random.Random(group_id)
        ids = np.array(rng.sample(range(NUM_BLOCKS), 7), np.int64)
        offsets = row_offsets(frame, len(ids), g.block_bytes)
        size = int(offsets.max()) + g.block_bytes + 64
        memories = [torch.full((size,), 0xA5, dtype=torch.uint8) for _ in range(2)]
        memories = [m.pin_memory() if pinned else m for m in memories]
        pieces = [
            copies.gather(group_id, ids, memory, offsets, scratch_gaps=scratch)
            for copies, memory in zip((fused, plain), memories, strict=True)
        ]
        if pinned:
            torch.cuda.synchronize(device)
        if pieces[0] != pieces[1] or pieces[0] < 2:
            problems.append(f"group {group_id}: pieces {pieces}, want equal and several")
        differ = memories[0] != memories[1]
        if scratch:  # the rooms between a piece's rows are scratch: any bytes may land there
            differ[int(offsets[0]) : int(offsets[-1])] = False
            for row in offsets.tolist():
                differ[row : row + g.block_bytes] = (
                    memories[0][row : row + g.block_bytes]
                    != (memories[1][row : row + g.block_bytes])
                )
        if bool(differ.any()):
            where = differ.nonzero()[:4].flatten().tolist()
            problems.append(f"group {group_id}: gathered bytes differ at {where}")
        source = random_bytes(size).view(torch.uint8)
        source = source.pin_memory() if pinned else source
        fused.scatter(group_id, ids, source, offsets, scratch_gaps=scratch)
        plain.scatter(group_id, ids, source, offsets, scratch_gaps=scratch)
        if pinned:
            torch.cuda.synchronize(device)
        if not torch.equal(fused_buffer, plain_buffer):
            problems.append(f"group {group_id}: scattered caches differ")
    return problems


def swapped_spans_are_caught() -> list[str]:
    """The comparison is not blind: with two spans' places in the block swapped, it
    must fail."""
    build = CACHES["LBNHC"]
    original = SpanTable.__init__

    def swapped(self: SpanTable, spans: list[SpanBytes], device: torch.device) -> None:
        first = spans[0]._replace(object_offset=spans[1].object_offset)
        second = spans[1]._replace(object_offset=spans[0].object_offset)
        original(self, [first, second, *spans[2:]], device)

    SpanTable.__init__ = swapped  # type: ignore[method-assign]
    try:
        found = compare_paths(build, "tight", 3)
    finally:
        SpanTable.__init__ = original  # type: ignore[method-assign]
    return [] if found else ["swapped spans went unnoticed"]


def wrong_pitch_is_caught() -> list[str]:
    """A kernel that misreads the pitch must fail the comparison too."""
    original = SpanTable.copy

    def off_by_eight(self: SpanTable, ids: torch.Tensor, chunk: torch.Tensor, pitch: int, **kw):  # type: ignore[no-untyped-def]
        original(self, ids, chunk, pitch + 8, **kw)

    SpanTable.copy = off_by_eight  # type: ignore[method-assign]
    try:
        found = compare_paths(CACHES["BLHNC"], "framed", 3)
    finally:
        SpanTable.copy = original  # type: ignore[method-assign]
    return [] if found else ["a wrong pitch went unnoticed"]


def table_against_brute_force() -> list[str]:
    """``SpanTable.copy`` alone, odd addresses, lengths and pitch, against slicing."""
    problems = []
    cache = random_bytes(4096).view(torch.uint8)
    spans = [
        SpanBytes(cache.data_ptr() + 3, 101, 0, 33),
        SpanBytes(cache.data_ptr() + 2000, 77, 40, 7),
    ]
    table = SpanTable(spans, cache.device)
    ids = torch.tensor([5, 0, 9, 2])
    pitch = 51
    chunk = torch.zeros(512, dtype=torch.uint8)
    table.copy(ids, chunk, pitch, to_cache=False)
    want = torch.zeros_like(chunk)
    for r, block in enumerate(ids.tolist()):
        for s in spans:
            start = s.address - cache.data_ptr() + block * s.row_stride
            at = r * pitch + s.object_offset
            want[at : at + s.num_bytes] = cache[start : start + s.num_bytes]
    if not torch.equal(chunk, want):
        problems.append("gather differs from slicing")
    before = cache.clone()
    chunk.copy_(random_bytes(512).view(torch.uint8))
    table.copy(ids, chunk, pitch, to_cache=True, spans=slice(1, 2))
    expected = before.clone()
    s = spans[1]
    for r, block in enumerate(ids.tolist()):
        start = s.address - cache.data_ptr() + block * s.row_stride
        at = r * pitch + s.object_offset
        expected[start : start + s.num_bytes] = chunk[at : at + s.num_bytes]
    if not torch.equal(cache, expected):
        problems.append("scatter of one span differs from slicing (or wrote other spans)")
    return problems


def warm_up_leaves_the_caches_as_they_were() -> list[str]:
    """The warm-up launches the kernel both ways for every group (each span apart where
    spans share bytes), and leaves every byte of the caches as it was."""
    problems = []
    original = SpanTable.copy
    launches: list[bool] = []

    def counted(self: SpanTable, ids: torch.Tensor, chunk: torch.Tensor, pitch: int, **kw):  # type: ignore[no-untyped-def]
        launches.append(kw["to_cache"])
        original(self, ids, chunk, pitch, **kw)

    SpanTable.copy = counted  # type: ignore[method-assign]
    try:
        for name, build in CACHES.items():
            caches, buffer = build(CPU)
            before = buffer.clone()
            launches.clear()
            copies = ChunkedCopies(caches, 1 << 16, fused=True)
            copies.warm_up()
            if not copies.fused:
                problems.append(f"{name}: the warm-up turned the kernel off")
            groups = range(caches.model_groups.num_groups)
            rounds = [
                len(caches.group_block_spans(g)) if caches.spans_may_share_bytes(g) else 1
                for g in groups
            ]
            if launches.count(False) != 2 * len(rounds) or launches.count(True) != 2 * sum(rounds):
                problems.append(f"{name}: launches {launches} for {rounds} scatter rounds")
            if not torch.equal(buffer, before):
                problems.append(f"{name}: the warm-up changed the caches")
    finally:
        SpanTable.copy = original  # type: ignore[method-assign]
    return problems


def all_cases() -> dict[str, Callable[[], list[str]]]:
    cases: dict[str, Callable[[], list[str]]] = {}
    for name, build in CACHES.items():
        for frame in FRAMES:
            cases[f"{name}-{frame}"] = lambda b=build, f=frame: compare_paths(b, f, 3)  # type: ignore[misc]
    cases["swapped_spans_are_caught"] = swapped_spans_are_caught
    cases["wrong_pitch_is_caught"] = wrong_pitch_is_caught
    cases["table_against_brute_force"] = table_against_brute_force
    cases["warm_up_leaves_the_caches_as_they_were"] = warm_up_leaves_the_caches_as_they_were
    return cases


CASE_NAMES = [f"{name}-{frame}" for name in CACHES for frame in FRAMES] + [
    "swapped_spans_are_caught",
    "wrong_pitch_is_caught",
    "table_against_brute_force",
    "warm_up_leaves_the_caches_as_they_were",
]


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1: the kernel runs on CPU tensors only there")
    results = {}
    for name, case in all_cases().items():
        try:
            results[name] = case()
        except Exception as error:  # one broken case must not hide the others
            results[name] = [f"{type(error).__name__}: {error}"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
