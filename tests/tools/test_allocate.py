"""Allocated KV caches: engine shapes, storage shared across groups, padding, huge pages,
and agreement with a brute-force reader of the engine-facing per-layer tensors."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import pytest
import torch

from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.layout import KVLayoutKind
from hybridkv.tools.allocate import allocate_kv_caches
from hybridkv.transfer import StagingArena
from tests.support.kv_caches import (
    attention_shapes,
    fill_random,
    gemma_like,
    group,
    object_via_spans,
    reference_object,
)


@pytest.mark.parametrize("kind", list(KVLayoutKind))
def test_allocate_gives_engine_shapes_and_canonical_objects(kind: KVLayoutKind) -> None:
    model_groups = gemma_like()
    shapes = attention_shapes(model_groups, torch.float32)
    alloc = allocate_kv_caches(model_groups, 8, kind=kind, shapes=shapes)
    assert alloc.kind is kind
    for name, (shape, dtype) in shapes.items():
        assert alloc.kv_caches[name].shape == (8, *shape)
        assert alloc.kv_caches[name].dtype == dtype
    c = alloc.canonical
    assert c.block_major == ((True, True) if kind is KVLayoutKind.BLOCK_MAJOR else (False, False))
    # One physical slot per layer index, shared by that layer of each group.
    assert len(c.tensors) == (1 if kind is KVLayoutKind.BLOCK_MAJOR else 2)
    assert c.page_formats == ("float32[2,32,16]", "float32[2,32,16]")
    fill_random(alloc.buffer, 1)
    for group_id, g in enumerate(model_groups.groups):
        spans = c.group_block_spans(group_id)
        assert len(spans) == (1 if kind is KVLayoutKind.BLOCK_MAJOR else g.num_layers)
        for block_id in range(8):
            want = reference_object(alloc.kv_caches, g, block_id)
            assert object_via_spans(c, group_id, block_id) == want


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding ``address`` may get transparent huge pages."""
    start = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                low, high = (int(part, 16) for part in first.split("-"))
                start = low if low <= address < high else None
            elif start is not None and first == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no THPeligible line for {address:#x}")


def _thp_mode() -> str:
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(path) or not os.path.exists("/proc/self/smaps"):
        return "[never]"
    with open(path) as file:
        return file.read()


@pytest.mark.skipif("[never]" in _thp_mode(), reason="no transparent huge pages here")
def test_cpu_caches_and_staging_may_use_huge_pages() -> None:
    """Scattered block copies miss the TLB far less on huge pages (bench_transfer)."""
    alloc = allocate_kv_caches(gemma_like(page=1 << 20), 16, kind=KVLayoutKind.LAYER_MAJOR)
    middle = alloc.buffer.numel() // 2  # the first bytes may share a page with malloc's
    assert _thp_eligible(alloc.buffer.data_ptr() + middle)
    arena = StagingArena(32 << 20)
    assert _thp_eligible(arena.array.ctypes.data + (16 << 20))
    if "[always]" not in _thp_mode():
        # A fresh anonymous mapping nobody advised: the check tells the two apart. (Not
        # torch.zeros: once glibc's dynamic mmap threshold has risen, malloc serves it
        # from a heap range numpy advised earlier in the process.)
        plain = mmap.mmap(-1, 32 << 20)
        view = ctypes.c_char.from_buffer(plain)
        eligible = _thp_eligible(ctypes.addressof(view) + (16 << 20))
        del view
        plain.close()
        assert not eligible


def test_block_major_groups_share_one_slot_per_layer_index() -> None:
    """Uniform pages: layer i of every group uses the same bytes of block b."""
    alloc = allocate_kv_caches(gemma_like(), 4, kind=KVLayoutKind.BLOCK_MAJOR)
    kv = alloc.kv_caches
    assert kv["l.0"][2].data_ptr() == kv["l.1"][2].data_ptr()
    assert kv["l.2"][2].data_ptr() == kv["l.3"][2].data_ptr()
    assert kv["l.2"][2].data_ptr() - kv["l.0"][2].data_ptr() == 4096
    assert alloc.buffer.numel() == 4 * 2 * 4096


def test_block_major_with_uneven_groups_pads_rows_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    even = ModelGroups(
        groups=(
            group(GroupKind.FULL, ("a.0",), 3000),
            group(GroupKind.MAMBA, ("m.1", "m.2", "m.3"), 1000),
        )
    )
    with caplog.at_level(logging.WARNING, logger="hybridkv.tools.allocate"):
        allocate_kv_caches(even, 5, kind=KVLayoutKind.BLOCK_MAJOR)
        allocate_kv_caches(gemma_like(), 5, kind=KVLayoutKind.BLOCK_MAJOR)
    assert not caplog.records  # equal group blocks waste nothing: nothing to say
    uneven = ModelGroups(
        groups=(
            group(GroupKind.FULL, ("a.0",), 3000),
            group(GroupKind.MAMBA, ("m.1", "m.2", "m.3"), 900),
        )
    )
    with caplog.at_level(logging.WARNING, logger="hybridkv.tools.allocate"):
        alloc = allocate_kv_caches(uneven, 5, kind=KVLayoutKind.BLOCK_MAJOR)
    assert alloc.kind is KVLayoutKind.BLOCK_MAJOR
    assert alloc.canonical.block_major == (True, True)
    assert alloc.buffer.numel() == 5 * 3008  # rows padded to 16 bytes
    assert "group block bytes differ ([3000, 2700])" in caplog.text
    assert "group(s) [1] leaves [300] bytes unused" in caplog.text


def test_layer_major_slots_use_the_largest_page_of_their_layer_index() -> None:
    model_groups = ModelGroups(
        groups=(
            group(GroupKind.FULL, ("a.0", "a.1"), 2048),
            group(GroupKind.MAMBA, ("m.0",), 4096),
        )
    )
    alloc = allocate_kv_caches(model_groups, 3, kind=KVLayoutKind.LAYER_MAJOR)
    assert alloc.buffer.numel() == 3 * 4096 + 3 * 2048
    assert alloc.kv_caches["a.0"].data_ptr() == alloc.kv_caches["m.0"].data_ptr()
    assert alloc.kv_caches["a.0"].stride(0) == 4096  # padded row of the shared slot
    fill_random(alloc.buffer, 2)
    for group_id, g in enumerate(model_groups.groups):
        for block_id in range(3):
            want = reference_object(alloc.kv_caches, g, block_id)
            assert object_via_spans(alloc.canonical, group_id, block_id) == want


def test_allocate_rejects_bad_arguments_with_every_problem() -> None:
    model_groups = gemma_like()
    with pytest.raises(ValueError) as err:
        allocate_kv_caches(
            model_groups,
            0,
            shapes={"l.0": ((2, 32, 8), torch.float32), "nope": ((1,), torch.int8)},
        )
    text = str(err.value)
    assert "num_blocks=0 must be an int > 0" in text
    assert "['nope']" in text
    assert "shapes['l.0']" in text and "2048 bytes per block" in text
    assert "a page of 4096 bytes" in text
