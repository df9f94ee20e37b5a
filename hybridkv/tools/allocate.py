"""KV caches allocated the way an engine would, for tests and benchmarks.

Runs in the process that stands in for an engine's worker. One zeroed buffer
holds every layer; block ids come from one pool (groups share storage and a
block belongs to whichever group allocated it). Block-major rows put a
block's pages for every layer of its group side by side, so one copy moves a
block.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.groups import ModelGroups
from hybridkv.layout.canonical import CanonicalKVCaches, KVLayoutKind, canonicalize

logger = logging.getLogger(__name__)

ROW_ALIGN_BYTES = 16
"""Allocated rows are padded to this (the largest element size) so any dtype views them."""

LayerShapes = Mapping[str, tuple[Sequence[int], torch.dtype]]
"""Layer name -> (per-block shape without the leading num_blocks dim, dtype)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class AllocatedKVCaches:
    kind: KVLayoutKind
    """The storage layout actually used."""
    kv_caches: dict[str, torch.Tensor]
    """Engine-facing per-layer views, ``(num_blocks, *shape)``."""
    canonical: CanonicalKVCaches
    buffer: torch.Tensor
    """The one int8 backing allocation."""


def allocate_kv_caches(
    model_groups: ModelGroups,
    num_blocks: int,
    *,
    kind: KVLayoutKind = KVLayoutKind.BLOCK_MAJOR,
    shapes: LayerShapes | None = None,
    device: torch.device | str = "cpu",
) -> AllocatedKVCaches:
    """Allocate KV caches in one zeroed buffer; block ids come from one pool.

    BLOCK_MAJOR: block ``b`` is one row; each group lays its layers' pages out
    from the row's first byte (groups overlay: a block has one owner), so a
    group's block is one span. With uniform pages and layer counts this is
    "layer slot i is shared by layer i of every group"; otherwise rows are as
    long as the largest group block and the unused tail is logged.
    LAYER_MAJOR: layer slot ``i`` (shared by layer ``i`` of every group) owns
    ``num_blocks`` rows of its largest page.
    ``shapes`` gives each layer's per-block shape and dtype (default int8, one
    page of the layer's size); a view is ``(num_blocks, *shape)``.
    """
    page_shapes = _check_allocate_args(model_groups, num_blocks, kind, shapes)
    groups = model_groups.groups
    placement: dict[str, tuple[int, int]] = {}  # layer -> (offset of block 0, block stride)
    if kind is KVLayoutKind.BLOCK_MAJOR:
        row = _round_up(max(g.block_bytes for g in groups), ROW_ALIGN_BYTES)
        for g in groups:
            offsets = itertools.accumulate(g.page_sizes_bytes, initial=0)
            for name, offset in zip(g.layer_names, offsets, strict=False):
                placement[name] = (offset, row)
        total = row * num_blocks
        largest = max(g.block_bytes for g in groups)
        unused = {
            gid: largest - g.block_bytes for gid, g in enumerate(groups) if g.block_bytes < largest
        }
        if unused:
            logger.warning(
                "block-major KV rows hold the largest group block (%d bytes); group block bytes "
                "differ (%s), so a block owned by group(s) %s leaves %s bytes unused",
                largest,
                [g.block_bytes for g in groups],
                list(unused),
                list(unused.values()),
            )
    else:
        total = 0
        for slot in range(max(g.num_layers for g in groups)):
            slot_groups = [g for g in groups if g.num_layers > slot]
            row = _round_up(max(g.page_sizes_bytes[slot] for g in slot_groups), ROW_ALIGN_BYTES)
            for g in slot_groups:
                placement[g.layer_names[slot]] = (total, row)
            total += row * num_blocks
    buffer = _zeros(total, torch.device(device))
    kv_caches = {
        name: _layer_view(buffer, offset, stride, num_blocks, *page_shapes[name])
        for name, (offset, stride) in placement.items()
    }
    canonical = canonicalize(kv_caches, model_groups)
    assert kind is KVLayoutKind.LAYER_MAJOR or all(canonical.block_major), canonical.describe()
    return AllocatedKVCaches(kind=kind, kv_caches=kv_caches, canonical=canonical, buffer=buffer)


def _check_allocate_args(
    model_groups: ModelGroups, num_blocks: int, kind: KVLayoutKind, shapes: LayerShapes | None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    problems: list[str] = []
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        problems.append(f"num_blocks={num_blocks!r} must be an int > 0")
    if not isinstance(kind, KVLayoutKind):
        problems.append(f"kind={kind!r} must be one of {[k.name for k in KVLayoutKind]}")
    given = dict(shapes or {})
    known = {name for g in model_groups.groups for name in g.layer_names}
    unknown = sorted(set(given) - known)
    if unknown:
        problems.append(f"shapes names layers {unknown} that are in no group")
    result: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for group_id, g in enumerate(model_groups.groups):
        for name, page in zip(g.layer_names, g.page_sizes_bytes, strict=True):
            shape, dtype = given.get(name, ((page,), torch.int8))
            shape = tuple(shape)
            if not isinstance(dtype, torch.dtype) or not all(
                isinstance(d, int) and d > 0 for d in shape
            ):
                problems.append(
                    f"shapes[{name!r}]=({shape}, {dtype!r}) must be (positive int dims, "
                    "torch.dtype)"
                )
                continue
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes != page:
                problems.append(
                    f"shapes[{name!r}]: {shape} x {dtype} is {nbytes} bytes per block but group "
                    f"{group_id} gives the layer a page of {page} bytes; give the per-block "
                    "shape without the leading num_blocks dim"
                )
            result[name] = (shape, dtype)
    if problems:
        raise ValueError("allocate_kv_caches: " + "; ".join(problems))
    return result


def _layer_view(
    buffer: torch.Tensor,
    offset_bytes: int,
    stride_bytes: int,
    num_blocks: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    item = dtype.itemsize
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * shape[i + 1]
    typed = buffer.view(dtype)
    return typed.as_strided(
        (num_blocks, *shape), (stride_bytes // item, *inner), offset_bytes // item
    )


def _zeros(num_bytes: int, device: torch.device) -> torch.Tensor:
    """Zeroed int8 memory for the caches. On CPU it comes from numpy, whose allocator
    asks the kernel for transparent huge pages on big buffers (torch's does not):
    copies of blocks scattered over the cache then miss the TLB far less."""
    if device.type != "cpu":
        return torch.zeros(num_bytes, dtype=torch.int8, device=device)
    return torch.from_numpy(np.zeros(num_bytes, dtype=np.int8))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
