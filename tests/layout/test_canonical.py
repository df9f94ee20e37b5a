"""Canonical KV caches: detection of block-major storage, validation, and agreement with a
brute-force reader of the engine-facing per-layer tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.groups import GroupKind, ModelGroups
from hybridkv.layout import KVLayoutKind, canonicalize
from hybridkv.tools.allocate import allocate_kv_caches
from tests.support.kv_caches import (
    Shapes,
    VllmAllocate,
    attention_shapes,
    fill_random,
    gemma_like,
    group,
    object_via_spans,
    page_bytes,
    qwen_next_like,
    real_vllm_allocator,
    reference_object,
)

# ---------------------------------------------------------------- canonicalize


def test_separate_tensors_per_layer_are_layer_major() -> None:
    model_groups = gemma_like()
    kv = {name: torch.randn(6, 2, 32, 16) for g in model_groups.groups for name in g.layer_names}
    c = canonicalize(kv, model_groups)
    assert len(c.tensors) == 4 and c.block_major == (False, False)
    for group_id, g in enumerate(model_groups.groups):
        for block_id in range(6):
            assert object_via_spans(c, group_id, block_id) == reference_object(kv, g, block_id)


def test_layers_of_different_groups_sharing_storage_are_deduplicated() -> None:
    model_groups = gemma_like()
    slot0 = torch.randn(6, 2, 32, 16)
    slot1 = torch.randn(6, 2, 32, 16)
    kv = {"l.0": slot0, "l.1": slot0, "l.2": slot1, "l.3": slot1}
    c = canonicalize(kv, model_groups)
    assert len(c.tensors) == 2
    assert c.group_refs[0][0] == c.group_refs[1][0]
    assert c.group_refs[0][1] == c.group_refs[1][1]


def test_kernel_blocks_group_into_engine_blocks() -> None:
    """vLLM may split a block of 64 tokens into two kernel blocks of 32."""
    model_groups = ModelGroups(groups=(group(GroupKind.FULL, ("a.0", "a.1"), 8192, block_size=64),))
    storage = torch.randn(2, 10, 2, 32, 16)  # layer, kernel block, heads, tokens, C
    kv = {"a.0": storage[0], "a.1": storage[1]}
    c = canonicalize(kv, model_groups)
    assert c.num_blocks == 5
    assert c.page_formats == ("float32[2,2,32,16]",)
    want = storage[1, 6:8].contiguous().view(torch.uint8).numpy().tobytes()
    got = object_via_spans(c, 0, 3)[8192:]
    assert got == want


def test_padded_mamba_page_inside_a_larger_block_stride() -> None:
    """vLLM CPU: Mamba layers are raw int8 [blocks, 1, 1, state] views with a padded stride."""
    buffer = torch.randint(-128, 128, (4 * 512,), dtype=torch.int8)
    view = buffer.as_strided((4, 1, 1, 300), (512, 300, 300, 1))
    for page in (300, 512):
        model_groups = ModelGroups(groups=(group(GroupKind.MAMBA, ("m.0",), page),))
        c = canonicalize({"m.0": view}, model_groups)
        assert object_via_spans(c, 0, 2) == buffer[1024 : 1024 + page].numpy().tobytes()
        assert c.page_formats == (("int8[300]" if page == 300 else "int8[300]+212pad"),)


def test_permuted_page_is_accepted_when_its_bytes_are_one_run() -> None:
    """Layout [B, N, H, C] viewed as [B, H, N, C]: the page is dense, dims just permuted."""
    model_groups = ModelGroups(groups=(group(GroupKind.FULL, ("a.0",), 4096),))
    physical = torch.randn(3, 32, 2, 16)  # block, tokens, heads, C
    c = canonicalize({"a.0": physical.permute(0, 2, 1, 3)}, model_groups)
    assert c.page_formats == ("float32[32,2,16]",)
    assert object_via_spans(c, 0, 1) == physical[1].numpy().tobytes()


def test_canonicalize_names_every_problem() -> None:
    model_groups = gemma_like()
    heads_outside = torch.randn(2, 6, 32, 16).transpose(0, 1)  # [H, B, N, C] storage
    kv = {
        "l.0": heads_outside,
        "l.1": torch.randn(6, 2, 32, 24),  # 6144-byte page for a 4096-byte group
        "ghost.9": torch.randn(6, 2, 32, 16),
    }
    with pytest.raises(ValueError) as err:
        canonicalize(kv, model_groups)
    text = str(err.value)
    assert "layer 'l.3' of group 1 is missing" in text
    assert "['ghost.9'] are registered but in no group" in text
    assert "layer 'l.0' (group 0, shape (6, 2, 32, 16)" in text
    assert "physically outermost" in text
    assert "layer 'l.1'" in text and "= 6144 bytes" in text and "a page of 4096 bytes" in text


def test_canonicalize_rejects_disagreeing_block_counts_and_aliased_pages() -> None:
    model_groups = gemma_like()
    shared = torch.randn(6, 2, 32, 16)
    kv = {"l.0": shared, "l.2": shared, "l.1": torch.randn(6, 2, 32, 16)}
    kv["l.3"] = torch.randn(5, 2, 32, 16)
    with pytest.raises(ValueError) as err:
        canonicalize(kv, model_groups)
    assert "disagree on num_blocks {'l.0': 6, 'l.2': 6, 'l.1': 6, 'l.3': 5}" in str(err.value)
    kv["l.3"] = torch.randn(6, 2, 32, 8)  # half pages: read as 2 kernel blocks per block
    with pytest.raises(ValueError) as err:
        canonicalize(kv, model_groups)
    assert "'l.3': '3 (2 kernel blocks of 2048 bytes each)'" in str(err.value)
    kv["l.3"] = torch.randn(6, 2, 32, 16)
    with pytest.raises(ValueError, match=r"layers 'l.0' and 'l.2' of group 0 share page bytes"):
        canonicalize(kv, model_groups)


# ---------------------------------------------------------------- property test


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ModelGroups, Shapes, int]:
    kinds = [GroupKind.FULL, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL, GroupKind.MAMBA]
    dtypes = [torch.int8, torch.bfloat16, torch.float32]
    groups = []
    shapes: Shapes = {}
    for gid in range(draw(st.integers(1, 3))):
        num_layers = draw(st.integers(1, 3))
        dtype = draw(st.sampled_from(dtypes))
        names = tuple(f"g{gid}.l{i}" for i in range(num_layers))
        mixed = draw(st.booleans())  # each layer its own page, as DeepSeek-V4's groups
        dims = [(draw(st.integers(1, 3)), draw(st.integers(1, 40))) for _ in names]
        if not mixed:
            dims = [dims[0]] * num_layers
        pages = tuple(d[0] * d[1] * dtype.itemsize for d in dims)
        kind = draw(st.sampled_from(kinds))
        groups.append(group(kind, names, pages[0], layer_pages=pages if mixed else ()))
        shapes.update({name: (d, dtype) for name, d in zip(names, dims, strict=True)})
    return ModelGroups(groups=tuple(groups)), shapes, draw(st.integers(1, 5))


@settings(max_examples=60, deadline=None)
@given(layouts(), st.sampled_from(list(KVLayoutKind)), st.integers(0, 2**31))
def test_canonical_objects_match_the_per_layer_tensors(
    spec: tuple[ModelGroups, Shapes, int], kind: KVLayoutKind, seed: int
) -> None:
    model_groups, shapes, num_blocks = spec
    alloc = allocate_kv_caches(model_groups, num_blocks, kind=kind, shapes=shapes)
    fill_random(alloc.buffer, seed)
    c = alloc.canonical
    assert len(c.tensors) == len({t.data_ptr() for t in c.tensors})
    if kind is KVLayoutKind.BLOCK_MAJOR:
        assert all(c.block_major)
    for group_id, g in enumerate(model_groups.groups):
        assert sum(s.num_bytes for s in c.group_block_spans(group_id)) == g.block_bytes
        for block_id in range(num_blocks):
            want = reference_object(alloc.kv_caches, g, block_id)
            assert object_via_spans(c, group_id, block_id) == want
    # Rebuilding from the views alone finds the same description.
    again = canonicalize(alloc.kv_caches, model_groups)
    assert again.group_refs == c.group_refs and again.block_major == c.block_major


# ---------------------------------------------------------------- real vLLM allocation


@pytest.fixture(scope="module")
def vllm_allocate() -> VllmAllocate:
    return real_vllm_allocator()


VLLM_IMPORT_WARNINGS = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@VLLM_IMPORT_WARNINGS
@pytest.mark.parametrize(("layout_name", "block_major"), [("LBHNC", False), ("BLHNC", True)])
def test_real_vllm_allocation_is_canonicalized(
    vllm_allocate: VllmAllocate, layout_name: str, block_major: bool
) -> None:
    kv, attn_page, mamba_real = vllm_allocate(layout_name)
    model_groups = qwen_next_like(attn_page, attn_page)  # vLLM's padded Mamba page size
    c = canonicalize(kv, model_groups)
    assert c.block_major == (block_major,) * 3
    assert len(c.tensors) == (1 if block_major else 2)  # every group overlays the same slots
    torch.manual_seed(3)
    for t in kv.values():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    for group_id, g in enumerate(model_groups.groups):
        for block_id in (0, 7, c.num_blocks - 1):
            got = object_via_spans(c, group_id, block_id)
            for i, name in enumerate(g.layer_names):
                page = got[i * attn_page : (i + 1) * attn_page]
                real = page_bytes(kv[name], block_id)
                assert page[: len(real)] == real
    # The unpadded Mamba page works too; then Mamba blocks are one span per layer.
    c = canonicalize(kv, qwen_next_like(attn_page, mamba_real))
    assert c.block_major == (block_major, False, False)


@VLLM_IMPORT_WARNINGS
def test_real_vllm_layout_without_leading_blocks_is_rejected(vllm_allocate: VllmAllocate) -> None:
    kv, attn_page, _ = vllm_allocate("LHBNC")
    with pytest.raises(ValueError, match=r"layer 'a.0' .* physically outermost"):
        canonicalize(kv, qwen_next_like(attn_page, attn_page))


def test_objects_are_independent_of_storage_layout() -> None:
    """The same per-layer contents give the same objects in both layouts."""
    model_groups = gemma_like(page=2048)
    shapes = attention_shapes(model_groups, torch.bfloat16)
    a = allocate_kv_caches(model_groups, 4, kind=KVLayoutKind.BLOCK_MAJOR, shapes=shapes)
    b = allocate_kv_caches(model_groups, 4, kind=KVLayoutKind.LAYER_MAJOR, shapes=shapes)
    fill_random(a.buffer, 9)
    for block_id in range(4):
        owner = block_id % 2  # block ids come from one pool: each has one owning group
        for name in model_groups.groups[owner].layer_names:
            b.kv_caches[name][block_id].copy_(a.kv_caches[name][block_id])
    for block_id in range(4):
        owner = block_id % 2
        got_a = object_via_spans(a.canonical, owner, block_id)
        assert got_a == object_via_spans(b.canonical, owner, block_id)
        assert np.frombuffer(got_a, np.uint8).any()
