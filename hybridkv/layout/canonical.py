"""Canonical KV caches: the engine's per-layer KV tensors as int8 block tensors.

Worker process (the one that owns the KV tensors). A group's block object is
its layers' pages concatenated in layer order (``KVGroup.block_bytes``
bytes), the same bytes whatever the storage layout, so what one layout stores
another can load when their ``page_formats`` agree. ``canonicalize``
understands layers of several groups sharing storage (vLLM's hybrid
allocator), vLLM's kernel-block splitting and padded Mamba pages.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from hybridkv.groups import ModelGroups

logger = logging.getLogger(__name__)


class KVLayoutKind(enum.Enum):
    BLOCK_MAJOR = "block_major"
    """A block's pages for every layer of its group are adjacent: one copy per block."""
    LAYER_MAJOR = "layer_major"
    """Each layer slot owns a region of ``num_blocks`` pages: one copy per layer."""


class PageRef(NamedTuple):
    """Where one layer's page of every block lives inside a block tensor row."""

    tensor_idx: int
    offset_bytes: int
    page_bytes: int


class BlockSpan(NamedTuple):
    """Bytes ``[offset, offset + num_bytes)`` of a block tensor row that hold
    bytes ``[object_offset, object_offset + num_bytes)`` of a group's block object."""

    tensor_idx: int
    offset_bytes: int
    num_bytes: int
    object_offset_bytes: int


@dataclass(frozen=True, kw_only=True, eq=False)
class CanonicalKVCaches:
    """Block tensors (int8, ``(num_blocks, row_bytes)``) and per-group page refs."""

    model_groups: ModelGroups
    num_blocks: int
    tensors: tuple[torch.Tensor, ...]
    group_refs: tuple[tuple[PageRef, ...], ...]
    page_formats: tuple[str, ...] = ()
    """Per group: what a page's bytes hold (dtype and dims in memory order, e.g.
    ``bfloat16[2,64,128]``). Objects are interchangeable between caches whose
    formats agree; mix it into store keys when engines may differ."""
    _spans: tuple[tuple[BlockSpan, ...], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        problems = _canonical_problems(self)
        if problems:
            raise ValueError("invalid CanonicalKVCaches: " + "; ".join(problems))
        object.__setattr__(self, "_spans", tuple(_group_spans(refs) for refs in self.group_refs))

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def block_major(self) -> tuple[bool, ...]:
        """Per group: whether one block of the group is one contiguous span."""
        return tuple(len(spans) == 1 for spans in self._spans)

    @property
    def kind(self) -> KVLayoutKind:
        """BLOCK_MAJOR when every group moves a block in one copy."""
        return KVLayoutKind.BLOCK_MAJOR if all(self.block_major) else KVLayoutKind.LAYER_MAJOR

    def group_block_spans(self, group_id: int) -> tuple[BlockSpan, ...]:
        """Spans that make up one block object of the group, in object order."""
        return self._spans[group_id]

    def spans_may_share_bytes(self, group_id: int) -> bool:
        """Whether two spans (of any blocks) of the group may share bytes. False when
        every span has its own storage, or when all have one size and row stride in
        one storage and start on one grid of that size without meeting."""
        spans = self.group_block_spans(group_id)
        tensors = [self.tensors[s.tensor_idx] for s in spans]
        storages = [t.untyped_storage().data_ptr() for t in tensors]
        if len(set(storages)) == len(storages):
            return False
        first, span_bytes = tensors[0], spans[0].num_bytes
        row_stride = first.stride(0) if self.num_blocks > 1 else span_bytes
        if any(
            storage != storages[0]
            or (self.num_blocks > 1 and t.stride(0) != row_stride)
            or s.num_bytes != span_bytes
            for storage, t, s in zip(storages, tensors, spans, strict=True)
        ):
            return True
        starts = [
            int(t.storage_offset()) + s.offset_bytes for t, s in zip(tensors, spans, strict=True)
        ]
        base = min(starts)
        if row_stride % span_bytes or any((start - base) % span_bytes for start in starts):
            return True
        block_step = row_stride // span_bytes
        elements = [(start - base) // span_bytes for start in starts]
        # Blocks b, b' of spans i, j share bytes iff e_i - e_j == (b' - b) * block_step.
        for i, j in itertools.combinations(elements, 2):
            distance = abs(i - j)
            if distance == 0 or (
                distance % block_step == 0 and distance // block_step < self.num_blocks
            ):
                return True
        return False

    def describe(self) -> str:
        rows = ", ".join(f"{t.shape[1]}B/{t.stride(0)}B" for t in self.tensors)
        return (
            f"{len(self.tensors)} block tensors of {self.num_blocks} blocks (row/stride: {rows}); "
            f"block-major per group: {list(self.block_major)}"
        )


class _LayerPlace(NamedTuple):
    name: str
    group_id: int
    storage: torch.UntypedStorage
    offset_bytes: int
    stride_bytes: int
    num_blocks: int
    page_bytes: int
    page_format: str
    kernel_ratio: int
    """Engine kernel blocks per block (vLLM may split a block into several)."""


def canonicalize(
    kv_caches: Mapping[str, torch.Tensor], model_groups: ModelGroups
) -> CanonicalKVCaches:
    """Describe registered per-layer KV tensors canonically (see module doc).

    A layer's tensor must have the block dim physically outermost: one block's
    page is one run of the layer's page size (or fewer, padded up to it inside the
    block stride; or that size ``// k`` with ``k`` dense kernel blocks per
    block, as vLLM's kernel block splitting makes). Raises ValueError listing
    every problem.
    """
    problems: list[str] = []
    places: list[_LayerPlace] = []
    known = {name for group in model_groups.groups for name in group.layer_names}
    unknown = sorted(set(kv_caches) - known)
    if unknown:
        problems.append(f"layers {unknown} are registered but in no group of the layout")
    for group_id, group in enumerate(model_groups.groups):
        for name, page in zip(group.layer_names, group.page_sizes_bytes, strict=True):
            if name not in kv_caches:
                problems.append(f"layer {name!r} of group {group_id} is missing from kv_caches")
                continue
            place = _place_layer(name, group_id, page, kv_caches[name])
            if isinstance(place, str):
                problems.append(place)
            else:
                places.append(place)
    problems += _consistency_problems(places, kv_caches)
    if problems:
        raise ValueError("cannot canonicalize KV caches: " + "; ".join(problems))
    tensors, refs = _block_tensors(places, problems)
    if problems:
        raise ValueError("cannot canonicalize KV caches: " + "; ".join(problems))
    group_refs = tuple(tuple(refs[name] for name in g.layer_names) for g in model_groups.groups)
    formats = {p.name: p.page_format for p in places}
    page_formats = tuple(
        "/".join(dict.fromkeys(formats[name] for name in g.layer_names))
        for g in model_groups.groups
    )
    canonical = CanonicalKVCaches(
        model_groups=model_groups,
        num_blocks=places[0].num_blocks,
        tensors=tensors,
        group_refs=group_refs,
        page_formats=page_formats,
    )
    logger.debug("canonical KV caches: %s", canonical.describe())
    return canonical


def _place_layer(name: str, group_id: int, page: int, tensor: object) -> _LayerPlace | str:
    """Where one layer's pages (``page`` bytes each, from the layout) live in its tensor."""
    if not isinstance(tensor, torch.Tensor):
        return f"layer {name!r}: expected a torch.Tensor, got {type(tensor).__name__}"
    where = (
        f"layer {name!r} (group {group_id}, shape {tuple(tensor.shape)}, "
        f"stride {tensor.stride()}, dtype {tensor.dtype})"
    )
    if tensor.dim() < 1 or tensor.shape[0] == 0:
        return f"{where}: needs a leading block dim with at least one block"
    item = tensor.element_size()
    kernel_page = math.prod(tensor.shape[1:]) * item
    stride = tensor.stride(0) * item
    if tensor.shape[0] == 1:  # any stride is valid for one block; never below a page
        stride = max(stride, kernel_page, page)
    page_dims = _dense_dims(tensor[0])
    if page_dims is None or stride < kernel_page:
        return (
            f"{where}: one block's page is not one contiguous run of bytes; the block dim "
            "must be the physically outermost dim (ask the engine for a block-leading "
            "layout, e.g. vLLM's LBHNC or BLHNC)"
        )
    ratio = 1
    if kernel_page < page and page % kernel_page == 0 and stride == kernel_page:
        ratio = page // kernel_page  # dense kernel blocks; one block is `ratio` of them
        stride = page
        if tensor.shape[0] % ratio:
            return f"{where}: {tensor.shape[0]} kernel blocks do not group into blocks of {ratio}"
    elif kernel_page != page and not kernel_page < page <= stride:
        return (
            f"{where}: one block's page is prod(shape[1:]) * element size = {kernel_page} "
            f"bytes but group {group_id} gives it a page of {page} bytes; expected equal (or a "
            f"page padded up to {page} within the block stride of {stride} bytes); fix the "
            "group's page sizes or register the layer's own tensor"
        )
    dims = ([ratio] if ratio > 1 else []) + [tensor.shape[1 + d] for d in page_dims]
    page_format = f"{str(tensor.dtype).removeprefix('torch.')}[{','.join(map(str, dims))}]"
    if page > kernel_page * ratio:
        page_format += f"+{page - kernel_page * ratio}pad"
    return _LayerPlace(
        name=name,
        group_id=group_id,
        storage=tensor.untyped_storage(),
        offset_bytes=int(tensor.storage_offset()) * item,
        stride_bytes=stride,
        num_blocks=tensor.shape[0] // ratio,
        page_bytes=page,
        page_format=page_format,
        kernel_ratio=ratio,
    )


def _dense_dims(page: torch.Tensor) -> list[int] | None:
    """Non-trivial dims of one block's page, outermost first, if its elements fill
    one run of memory (any dim order); None when they leave gaps or overlap."""
    dims = sorted((d for d in range(page.dim()) if page.shape[d] != 1), key=page.stride)
    expected = 1
    for d in dims:
        if page.stride(d) != expected:
            return None
        expected *= page.shape[d]
    return dims[::-1]


def _consistency_problems(
    places: Sequence[_LayerPlace], kv_caches: Mapping[str, torch.Tensor]
) -> list[str]:
    problems: list[str] = []
    devices = {str(kv_caches[p.name].device) for p in places}
    if len(devices) > 1:
        problems.append(f"layers are on several devices {sorted(devices)}; expected one")
    if len({p.num_blocks for p in places}) > 1:
        counts = {p.name: _block_count(p) for p in places}
        problems.append(f"layers disagree on num_blocks {counts}; each needs the same count")
    for p in places:
        end = p.offset_bytes + (p.num_blocks - 1) * p.stride_bytes + p.page_bytes
        if end > p.storage.nbytes():
            problems.append(
                f"layer {p.name!r}: its last padded page ends at byte {end}, past its "
                f"storage of {p.storage.nbytes()} bytes"
            )
    return problems


def _block_count(p: _LayerPlace) -> int | str:
    if p.kernel_ratio == 1:
        return p.num_blocks
    kernel_page = p.page_bytes // p.kernel_ratio
    return f"{p.num_blocks} ({p.kernel_ratio} kernel blocks of {kernel_page} bytes each)"


def _block_tensors(
    places: Sequence[_LayerPlace], problems: list[str]
) -> tuple[tuple[torch.Tensor, ...], dict[str, PageRef]]:
    """Group layers into block tensors: same storage and stride, pages within one row."""
    buckets: dict[tuple[int, int], list[_LayerPlace]] = defaultdict(list)
    for p in places:
        buckets[(p.storage.data_ptr(), p.stride_bytes)].append(p)
    clusters: list[list[_LayerPlace]] = []
    for members in buckets.values():
        members.sort(key=lambda p: p.offset_bytes)
        start = len(clusters)
        for p in members:
            row_start = clusters[-1][0].offset_bytes if len(clusters) > start else -1
            if row_start >= 0 and p.offset_bytes + p.page_bytes - row_start <= p.stride_bytes:
                clusters[-1].append(p)
            else:
                clusters.append([p])
    order = {p.name: i for i, p in enumerate(places)}  # layout order: stable tensor indices
    clusters.sort(key=lambda c: min(order[p.name] for p in c))
    tensors: list[torch.Tensor] = []
    refs: dict[str, PageRef] = {}
    for idx, cluster in enumerate(clusters):
        first = cluster[0]
        row_start = first.offset_bytes
        row_bytes = max(p.offset_bytes + p.page_bytes for p in cluster) - row_start
        flat = torch.empty(0, dtype=torch.int8, device=first.storage.device).set_(first.storage)
        tensors.append(
            flat.as_strided((first.num_blocks, row_bytes), (first.stride_bytes, 1), row_start)
        )
        for p in cluster:
            refs[p.name] = PageRef(idx, p.offset_bytes - row_start, p.page_bytes)
        problems += _alias_problems(cluster)
    return tuple(tensors), refs


def _alias_problems(cluster: Sequence[_LayerPlace]) -> list[str]:
    """Layers of one group must not share page bytes (groups may: a block has one owner)."""
    problems: list[str] = []
    by_group: dict[int, list[_LayerPlace]] = defaultdict(list)
    for p in cluster:
        by_group[p.group_id].append(p)
    for group_id, members in by_group.items():
        for a, b in itertools.pairwise(members):
            if b.offset_bytes < a.offset_bytes + a.page_bytes:
                problems.append(
                    f"layers {a.name!r} and {b.name!r} of group {group_id} share page bytes "
                    f"(offsets {a.offset_bytes} and {b.offset_bytes}, page {a.page_bytes}); "
                    "every layer of a group needs its own page"
                )
    return problems


def _group_spans(refs: Sequence[PageRef]) -> tuple[BlockSpan, ...]:
    """A block object's spans: pages in layer order, adjacent ones merged into one copy."""
    spans: list[BlockSpan] = []
    object_offset = 0
    for r in refs:
        last = spans[-1] if spans else None
        if (
            last
            and last.tensor_idx == r.tensor_idx
            and last.offset_bytes + last.num_bytes == r.offset_bytes
        ):
            spans[-1] = last._replace(num_bytes=last.num_bytes + r.page_bytes)
        else:
            spans.append(BlockSpan(r.tensor_idx, r.offset_bytes, r.page_bytes, object_offset))
        object_offset += r.page_bytes
    return tuple(spans)


def _canonical_problems(c: CanonicalKVCaches) -> list[str]:
    problems = [
        f"tensors[{i}] is {t.dtype} {tuple(t.shape)} stride {t.stride()}; expected int8 "
        f"({c.num_blocks}, row_bytes) with contiguous rows"
        for i, t in enumerate(c.tensors)
        if t.dtype != torch.int8 or t.dim() != 2 or t.shape[0] != c.num_blocks or t.stride(1) != 1
    ]
    if problems or not c.tensors:
        return problems or ["tensors is empty"]
    if [len(refs) for refs in c.group_refs] != [g.num_layers for g in c.model_groups.groups]:
        return ["group_refs needs one PageRef per layer of every group, in layer order"]
    for group_id, (group, refs) in enumerate(zip(c.model_groups.groups, c.group_refs, strict=True)):
        for ref, page in zip(refs, group.page_sizes_bytes, strict=True):
            ok = 0 <= ref.tensor_idx < len(c.tensors) and ref.page_bytes == page
            if not ok or ref.offset_bytes + ref.page_bytes > c.tensors[ref.tensor_idx].shape[1]:
                problems.append(f"group {group_id}: {ref} does not fit its block tensor")
    return problems
