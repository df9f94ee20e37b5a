"""Block hashes and store keys: stable, chained, incremental, namespaced."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.keys import (
    BlockHash,
    HashAlgo,
    KeyBuilder,
    KeyNamespace,
    RequestBlockHasher,
    hash_block_tokens,
    sanitize_model_id,
)
from hybridkv.tiers.base import StoreKey


def digest(algo: HashAlgo, data: bytes) -> bytes:
    if algo is HashAlgo.XXH3_128:
        return xxhash.xxh3_128(data).digest()
    return hashlib.new("sha256", data).digest()


def extra(tag: bytes, value: str) -> bytes:
    raw = value.encode()
    return tag + len(raw).to_bytes(4, "little") + raw


def reference_hashes(
    token_ids: list[int],
    block_size: int,
    algo: HashAlgo,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[bytes]:
    """The documented encoding, written out independently of hybridkv.keys."""
    parent = digest(algo, b"hybridkv:block-hash:v1")
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        data = parent + struct.pack(f"<{block_size}q", *block)
        if lora_name:
            data += extra(b"L", lora_name)
        if cache_salt and start == 0:
            data += extra(b"S", cache_salt)
        parent = digest(algo, data)
        hashes.append(parent)
    return hashes


# ---------------------------------------------------------------- golden values


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_golden_values_match_the_documented_encoding(algo: HashAlgo) -> None:
    tokens = list(range(1000, 1040))  # 2 full blocks of 16 + 8 pending tokens
    hasher = RequestBlockHasher(16, algo=algo)
    hasher.extend(tokens)
    root = digest(algo, b"hybridkv:block-hash:v1")
    first = digest(algo, root + b"".join(t.to_bytes(8, "little") for t in tokens[:16]))
    second = digest(algo, first + b"".join(t.to_bytes(8, "little") for t in tokens[16:32]))
    assert list(hasher.block_hashes) == [first, second]
    assert len(first) == algo.digest_bytes
    assert hasher.num_tokens == 40


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_golden_values_with_salt_and_lora(algo: HashAlgo) -> None:
    tokens = [7] * 8
    hasher = RequestBlockHasher(4, algo=algo, cache_salt="tenant-a", lora_name="sql")
    hasher.extend(tokens)
    root = digest(algo, b"hybridkv:block-hash:v1")
    block = struct.pack("<4q", 7, 7, 7, 7)
    salt = b"S" + struct.pack("<I", 8) + b"tenant-a"
    lora = b"L" + struct.pack("<I", 3) + b"sql"
    first = digest(algo, root + block + lora + salt)
    second = digest(algo, first + block + lora)  # the salt only enters the first block
    assert list(hasher.block_hashes) == [first, second]


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_hash_block_tokens_chains_from_the_root(algo: HashAlgo) -> None:
    block = struct.pack("<2q", 5, 6)
    root = digest(algo, b"hybridkv:block-hash:v1")
    first = hash_block_tokens(algo, None, block)
    assert first == digest(algo, root + block)
    assert hash_block_tokens(algo, first, block, b"x") == digest(algo, first + block + b"x")


# ---------------------------------------------------------------- stability across processes

STABILITY_SCRIPT = """
import json
from hybridkv.keys import HashAlgo, KeyBuilder, KeyNamespace, RequestBlockHasher
from hybridkv.groups import GroupKind, KVGroup, ModelGroups
tokens = [(i * 7919) % 50000 for i in range(1000)]
out = {}
for algo in HashAlgo:
    h = RequestBlockHasher(16, algo=algo, cache_salt="s", lora_name="l")
    h.extend(tokens)
    out[algo.value] = [x.hex() for x in h.block_hashes]
layout = ModelGroups(
    groups=(KVGroup(kind=GroupKind.FULL, block_size=32, page_size_bytes=64, layer_names=("a",)),
            KVGroup(kind=GroupKind.MAMBA, block_size=16, page_size_bytes=64, layer_names=("b",))),
    model_id="org/model",
)
h = RequestBlockHasher(layout.hash_block_size)
h.extend(tokens)
kb = KeyBuilder(layout, KeyNamespace.for_groups(layout, tp_rank=1, tp_size=2))
out["keys"] = kb.keys(0, h.block_hashes, range(10)) + kb.keys(1, h.block_hashes, range(10))
print(json.dumps(out))
"""


def test_hashes_and_keys_are_identical_across_processes_and_hash_seeds() -> None:
    outputs = []
    for seed in ("0", "1", "4242"):
        result = subprocess.run(
            [sys.executable, "-c", STABILITY_SCRIPT],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        )
        outputs.append(json.loads(result.stdout))
    assert outputs[0] == outputs[1] == outputs[2]
    tokens = [(i * 7919) % 50000 for i in range(1000)]
    for algo in HashAlgo:
        expected = reference_hashes(tokens, 16, algo, cache_salt="s", lora_name="l")
        assert outputs[0][algo.value] == [x.hex() for x in expected]
    assert len(set(outputs[0]["keys"])) == 20


# ---------------------------------------------------------------- chaining and extra keys


@given(
    tokens=st.lists(st.integers(0, 2**40), max_size=200),
    block_size=st.integers(1, 24),
    algo=st.sampled_from(list(HashAlgo)),
    salt=st.one_of(st.none(), st.text(max_size=8)),
    lora=st.one_of(st.none(), st.text(max_size=8)),
)
@settings(max_examples=150, deadline=None)
def test_hashes_match_reference(
    tokens: list[int], block_size: int, algo: HashAlgo, salt: str | None, lora: str | None
) -> None:
    hasher = RequestBlockHasher(block_size, algo=algo, cache_salt=salt, lora_name=lora)
    hasher.extend(tokens)
    assert list(hasher.block_hashes) == reference_hashes(tokens, block_size, algo, salt, lora)


def hashes_of(tokens: list[int], **kwargs: str | None) -> list[BlockHash]:
    hasher = RequestBlockHasher(4, cache_salt=kwargs.get("salt"), lora_name=kwargs.get("lora"))
    hasher.extend(tokens)
    return list(hasher.block_hashes)


def test_cache_salt_changes_every_hash_of_the_chain() -> None:
    tokens = list(range(32))
    plain, a, b = hashes_of(tokens), hashes_of(tokens, salt="a"), hashes_of(tokens, salt="b")
    for i in range(8):
        assert len({plain[i], a[i], b[i]}) == 3


def test_lora_name_changes_every_hash() -> None:
    tokens = list(range(32))
    plain, x, y = hashes_of(tokens), hashes_of(tokens, lora="x"), hashes_of(tokens, lora="y")
    for i in range(8):
        assert len({plain[i], x[i], y[i]}) == 3


def test_chain_depends_on_every_earlier_token() -> None:
    tokens = list(range(64))
    base = hashes_of(tokens)
    changed = hashes_of([999, *tokens[1:]])
    assert all(b != c for b, c in zip(base, changed, strict=True))
    later = hashes_of([*tokens[:40], 999, *tokens[41:]])
    assert later[:10] == base[:10]  # blocks before token 40 keep their hashes
    assert all(b != c for b, c in zip(base[10:], later[10:], strict=True))


def test_algorithms_give_different_digests() -> None:
    a = RequestBlockHasher(4, algo=HashAlgo.XXH3_128)
    b = RequestBlockHasher(4, algo=HashAlgo.SHA256)
    a.extend(range(8))
    b.extend(range(8))
    assert [len(h) for h in a.block_hashes] == [16, 16]
    assert [len(h) for h in b.block_hashes] == [32, 32]


# ---------------------------------------------------------------- incremental extension


def test_extension_hashes_only_new_full_blocks() -> None:
    hasher = RequestBlockHasher(16)
    hasher.extend(list(range(100)))
    assert hasher.num_hash_calls == 6
    first_six = list(hasher.block_hashes)
    hasher.extend(list(range(100, 120)))  # completes block 6 only
    assert hasher.num_hash_calls == 7
    assert list(hasher.block_hashes[:6]) == first_six
    hasher.extend([1, 2, 3])  # 123 tokens: no block completes
    assert hasher.num_hash_calls == 7
    assert hasher.num_tokens == 123
    hasher.extend([])
    assert hasher.num_hash_calls == 7
    hasher.extend(list(range(8)))  # 131 tokens: block 7 completes
    assert hasher.num_hash_calls == 8
    assert len(hasher.block_hashes) == 8


@given(
    tokens=st.lists(st.integers(0, 100_000), max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=8),
    block_size=st.integers(1, 32),
)
@settings(max_examples=150, deadline=None)
def test_any_split_into_extensions_gives_the_one_shot_hashes(
    tokens: list[int], cuts: list[int], block_size: int
) -> None:
    hasher = RequestBlockHasher(block_size, cache_salt="s")
    bounds = [0, *sorted(c % (len(tokens) + 1) for c in cuts), len(tokens)]
    for start, end in itertools.pairwise(bounds):
        hasher.extend(tokens[start:end])
    assert list(hasher.block_hashes) == reference_hashes(tokens, block_size, HashAlgo.XXH3_128, "s")
    assert hasher.num_hash_calls == len(tokens) // block_size  # each block hashed exactly once
    assert hasher.num_tokens == len(tokens)


def test_numpy_input_of_any_int_dtype_hashes_alike() -> None:
    tokens = list(range(64))
    expected = hashes_of(tokens)
    for dtype in (np.int32, np.int64, np.uint16, np.uint64):
        hasher = RequestBlockHasher(4)
        hasher.extend(np.asarray(tokens, dtype=dtype))
        assert list(hasher.block_hashes) == expected


@pytest.mark.parametrize(
    ("tokens", "error", "fragment"),
    [
        ([1, -2, 3], ValueError, "token id -2 is negative"),
        ([1.5, 2.0], TypeError, "must be integers"),
        ([[1, 2], [3, 4]], ValueError, "must be 1-D"),
        (np.array([2**64 - 1], dtype=np.uint64), ValueError, "out of range"),
        ([2**70], ValueError, "token_ids must be ints"),
    ],
)
def test_bad_token_ids_are_rejected(tokens: object, error: type[Exception], fragment: str) -> None:
    hasher = RequestBlockHasher(4)
    with pytest.raises(error, match=re.escape(fragment)):
        hasher.extend(tokens)  # type: ignore[arg-type]
    assert hasher.num_tokens == 0


def test_bad_hasher_arguments_are_reported_together() -> None:
    with pytest.raises(ValueError) as info:
        RequestBlockHasher(0, algo="sha256", cache_salt=3)  # type: ignore[arg-type]
    message = str(info.value)
    for fragment in ("hash_block_size=0: must be greater than 0", "algo='sha256'", "cache_salt=3"):
        assert fragment in message


def test_hash_algo_parse() -> None:
    assert HashAlgo.parse("XXH3_128") is HashAlgo.XXH3_128
    assert HashAlgo.parse("sha256") is HashAlgo.SHA256
    with pytest.raises(ValueError, match=r"hash_algo='md5'.*\['xxh3_128', 'sha256'\]"):
        HashAlgo.parse("md5")


# ---------------------------------------------------------------- namespace and keys

KEY_CHARS = re.compile(r"^[A-Za-z0-9._~|-]+$")


def test_namespace_prefix_format() -> None:
    ns = KeyNamespace(
        model_id="tiny-model_1.0", groups_fingerprint="0123abcd", tp_rank=2, tp_size=4
    )
    assert ns.prefix == "tiny-model_1.0|0123abcd|tp2of4"


def test_model_ids_are_sanitized_without_collisions() -> None:
    slash, underscore = sanitize_model_id("org/model"), sanitize_model_id("org_model")
    assert underscore == "org_model"
    assert slash.startswith("org_model~") and slash != underscore
    assert sanitize_model_id("a b") != sanitize_model_id("a_b")
    long_a, long_b = sanitize_model_id("x" * 100 + "a"), sanitize_model_id("x" * 100 + "b")
    assert long_a != long_b and len(long_a) <= 64


@given(st.text(min_size=1, max_size=120))
@settings(max_examples=200, deadline=None)
def test_any_model_id_gives_an_ascii_key_without_spaces(model_id: str) -> None:
    prefix = KeyNamespace(model_id=model_id, groups_fingerprint="ab12").prefix
    assert KEY_CHARS.match(prefix), prefix
    assert prefix.count("|") == 2


def test_invalid_namespace_lists_every_problem() -> None:
    with pytest.raises(ValueError) as info:
        KeyNamespace(model_id="", groups_fingerprint="XYZ", tp_rank=0, tp_size=1)
    message = str(info.value)
    assert "model_id=''" in message and "groups_fingerprint='XYZ'" in message
    assert "use ModelGroups.fingerprint" in message
    with pytest.raises(ValueError, match=r"tp_rank=2 must be in \[0, tp_size=2\)"):
        KeyNamespace(model_id="m", groups_fingerprint="ab", tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="tp_size=0: must be greater than 0"):
        KeyNamespace(model_id="m", groups_fingerprint="ab", tp_rank=0, tp_size=0)


def dsv4_like_groups(model_id: str = "org/dsv4") -> ModelGroups:
    def g(kind: GroupKind, block_size: int, name: str, window: int | None = None) -> KVGroup:
        return KVGroup(
            kind=kind,
            block_size=block_size,
            page_size_bytes=128,
            layer_names=(name,),
            sliding_window=window,
        )

    return ModelGroups(
        groups=(
            g(GroupKind.FULL, 256, "a"),
            g(GroupKind.SLIDING_WINDOW, 64, "b", 128),
            g(GroupKind.SLIDING_WINDOW, 4, "c", 8),
            g(GroupKind.SLIDING_WINDOW, 8, "d", 128),
        ),
        model_id=model_id,
    )


def test_group_block_key_uses_the_hash_of_its_last_hash_block() -> None:
    model_groups = dsv4_like_groups()
    ns = KeyNamespace.for_groups(model_groups)
    builder = KeyBuilder(model_groups, ns)
    hasher = RequestBlockHasher(model_groups.hash_block_size)
    hasher.extend(list(range(600)))  # 150 hash blocks of 4 tokens
    hashes = hasher.block_hashes
    assert builder.num_full_blocks(0, len(hashes)) == 2
    assert builder.num_full_blocks(1, len(hashes)) == 9
    assert builder.num_full_blocks(3, len(hashes)) == 75
    keys = builder.keys(0, hashes, [0, 1])
    assert keys == [f"{ns.prefix}|g0|{hashes[63].hex()}", f"{ns.prefix}|g0|{hashes[127].hex()}"]
    assert builder.keys(1, hashes, [8]) == [f"{ns.prefix}|g1|{hashes[143].hex()}"]
    assert builder.keys(2, hashes, [149]) == [f"{ns.prefix}|g2|{hashes[149].hex()}"]
    assert builder.keys(3, hashes, [0, 74]) == [
        f"{ns.prefix}|g3|{hashes[1].hex()}",
        f"{ns.prefix}|g3|{hashes[149].hex()}",
    ]
    assert builder.keys(0, hashes, []) == []


def test_keys_of_incomplete_blocks_and_bad_groups_are_errors() -> None:
    model_groups = dsv4_like_groups()
    builder = KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups))
    hasher = RequestBlockHasher(4)
    hasher.extend(list(range(300)))  # 75 hash blocks: group 0 has 1 full block
    with pytest.raises(ValueError, match=r"group 0 block 1 is not complete: 75 hashes"):
        builder.keys(0, hasher.block_hashes, [0, 1])
    with pytest.raises(ValueError, match=r"group_id=4 is out of range \[0, 4\)"):
        builder.keys(4, hasher.block_hashes, [0])


def test_key_builder_rejects_a_namespace_of_other_groups() -> None:
    model_groups = dsv4_like_groups()
    other = KeyNamespace(model_id="org/dsv4", groups_fingerprint="00")
    with pytest.raises(ValueError, match=r"does not match model_groups\.fingerprint"):
        KeyBuilder(model_groups, other)


@given(
    multiples=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    hash_block_size=st.integers(1, 4),
    num_tokens=st.integers(0, 200),
    position=st.integers(0, 199),
)
@settings(max_examples=150, deadline=None)
def test_a_key_depends_on_exactly_the_tokens_up_to_its_block_end(
    multiples: list[int], hash_block_size: int, num_tokens: int, position: int
) -> None:
    groups = tuple(
        KVGroup(
            kind=GroupKind.FULL,
            block_size=m * hash_block_size,
            page_size_bytes=8,
            layer_names=(f"l{i}",),
        )
        for i, m in enumerate(multiples)
    )
    model_groups = ModelGroups(groups=groups, hash_block_size=hash_block_size)
    builder = KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups))
    tokens = list(range(num_tokens))
    changed = list(tokens)
    if num_tokens:
        changed[position % num_tokens] = 10**6
    base, other = RequestBlockHasher(hash_block_size), RequestBlockHasher(hash_block_size)
    base.extend(tokens)
    other.extend(changed)
    for group_id, group in enumerate(groups):
        num_full = num_tokens // group.block_size
        assert builder.num_full_blocks(group_id, len(base.block_hashes)) == num_full
        blocks = range(num_full)
        for i, a, b in zip(
            blocks,
            builder.keys(group_id, base.block_hashes, blocks),
            builder.keys(group_id, other.block_hashes, blocks),
            strict=True,
        ):
            block_end = (i + 1) * group.block_size
            assert (a == b) == (position % max(num_tokens, 1) >= block_end)


def test_keys_differ_by_model_layout_rank_and_group() -> None:
    model_groups = dsv4_like_groups()
    hasher = RequestBlockHasher(4)
    hasher.extend(list(range(256)))
    hashes = hasher.block_hashes

    def key(model_groups: ModelGroups, group_id: int, **ns: int) -> str:
        builder = KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups, **ns))
        return builder.keys(group_id, hashes, [0])[0]

    other_groups = ModelGroups(
        groups=tuple(
            KVGroup(**{**g.to_dict(), "kind": g.kind, "block_size": 2 * g.block_size})
            for g in model_groups.groups
        ),
        model_id=model_groups.model_id,
    )
    keys = {
        key(model_groups, 2),
        key(model_groups, 3),
        key(dsv4_like_groups("org/other"), 2),
        key(other_groups, 2),
        key(model_groups, 2, tp_rank=1, tp_size=2),
        key(model_groups, 2, tp_rank=0, tp_size=2),
    }
    assert len(keys) == 6
    assert all(KEY_CHARS.match(k) for k in keys)


def test_a_key_parses_back_to_its_group_and_hash_in_its_namespace_only() -> None:
    model_groups = dsv4_like_groups("org/dsv4 with|bars")
    hasher = RequestBlockHasher(4)
    hasher.extend(list(range(64)))
    builder = KeyBuilder(model_groups, KeyNamespace.for_groups(model_groups, tp_size=2))
    for group_id in range(model_groups.num_groups):
        for block_hash in hasher.block_hashes[:3]:
            assert builder.parse(builder.key(group_id, block_hash)) == (group_id, block_hash)
    block_hash = hasher.block_hashes[0]
    other_rank = KeyBuilder(
        model_groups, KeyNamespace.for_groups(model_groups, tp_rank=1, tp_size=2)
    )
    good = builder.key(1, block_hash)
    foreign = [
        other_rank.key(1, block_hash),
        KeyBuilder(*_builder_args(dsv4_like_groups("org/other"))).key(1, block_hash),
        StoreKey(good.replace("|g1|", "|g9|")),  # no such group
        StoreKey(good[:-1]),  # odd hex
        StoreKey(good + "z"),
        StoreKey(good.replace("|g1|", "|gx|")),
        StoreKey("test/other/key"),
    ]
    assert [builder.parse(k) for k in foreign] == [None] * len(foreign)


def _builder_args(model_groups: ModelGroups) -> tuple[ModelGroups, KeyNamespace]:
    return model_groups, KeyNamespace.for_groups(model_groups, tp_size=2)
