"""Stable block keys: chained block hashes over token ids, and store keys built from them.

Runs in the scheduler process (block hashes; every rank's keys for lookups) and in
each worker (its own rank's keys for loads and stores). Hashes never
depend on ``PYTHONHASHSEED`` or Python's ``hash()``, so the same tokens give the
same keys in every process, after a restart and on every machine.

Encoding of one hash block (``hash_block_size`` tokens), version 1::

    digest(parent || tokens || extra)

* ``parent``: the previous block's digest; for the first block, the root
  ``digest(b"hybridkv:block-hash:v1")``.
* ``tokens``: the block's token ids as little-endian int64 (8 bytes each).
* ``extra``: the extra keys, each ``tag (1 byte) || length (uint32 LE) || UTF-8``:
  the LoRA name (tag ``L``) on every block, then the cache salt (tag ``S``) on
  the first block only (the chain carries it to every later block). An empty
  salt or LoRA name counts as none.
* ``digest``: xxh3-128 (16 bytes, xxhash's canonical big-endian digest, seed 0)
  or SHA-256 (32 bytes).

A store key names the namespace (model, groups fingerprint, the rank's label),
the group and the hash of the group block's last hash block:
``{model}|{fingerprint}|tp{rank}of{size}|g{group_id}|{hash_hex}``, with
``pp{stage}of{stages}-`` before ``tp`` under pipeline parallel (where the
fingerprint is that of the stage's own layers). Keys are ASCII without spaces,
usable as Redis/Mooncake keys.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, NewType

import numpy as np
import numpy.typing as npt
import xxhash
from pydantic import AfterValidator, StrictStr

from hybridkv.groups import ModelGroups
from hybridkv.schema import NonEmptyStr, NonNegativeInt, PositiveInt, check_fields
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.ranks import WorkerRank

BlockHash = NewType("BlockHash", bytes)
"""Digest of one hash block chained over every block before it."""

ROOT_SEED = b"hybridkv:block-hash:v1"
TAG_LORA = b"L"
TAG_CACHE_SALT = b"S"
_MAX_TOKEN_ID = 2**63 - 1


class HashAlgo(enum.Enum):
    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"

    @classmethod
    def parse(cls, value: str, *, where: str = "hash_algo") -> HashAlgo:
        """The algorithm named ``value`` (case-insensitive); ValueError listing the choices."""
        for algo in cls:
            if isinstance(value, str) and value.lower() == algo.value:
                return algo
        choices = [a.value for a in cls]
        raise ValueError(f"{where}={value!r} is not a hash algorithm; use one of {choices}")

    def digest(self, data: bytes) -> BlockHash:
        if self is HashAlgo.XXH3_128:
            return BlockHash(xxhash.xxh3_128_digest(data))
        return BlockHash(hashlib.sha256(data).digest())

    @property
    def digest_bytes(self) -> int:
        return 16 if self is HashAlgo.XXH3_128 else 32


@functools.cache
def root_hash(algo: HashAlgo) -> BlockHash:
    """The parent of a request's first block (one per algorithm, computed once)."""
    return algo.digest(ROOT_SEED)


def encode_extra(tag: bytes, value: str) -> bytes:
    raw = value.encode("utf-8")
    return tag + struct.pack("<I", len(raw)) + raw


def encode_token_ids(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """Token ids as a little-endian int64 array; TypeError/ValueError for anything else."""
    try:
        arr = np.asarray(token_ids)
    except (OverflowError, ValueError) as exc:
        raise ValueError(f"token_ids must be ints in [0, 2**63): {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i8")
    if arr.dtype.kind == "O" and all(isinstance(t, int) for t in arr):
        raise ValueError("token_ids must be ints in [0, 2**63); got an id out of int64 range")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > _MAX_TOKEN_ID:
        raise ValueError(f"token id {int(arr.max())} is out of range [0, 2**63)")
    if arr.dtype.kind == "i" and int(arr.min()) < 0:
        raise ValueError(f"token id {int(arr.min())} is negative; token ids must be >= 0")
    return arr.astype("<i8", copy=False)


def hash_block_tokens(
    algo: HashAlgo, parent: BlockHash | None, token_bytes: bytes, extra: bytes = b""
) -> BlockHash:
    """One chained block hash; ``token_bytes`` is the block's encoded token ids."""
    return algo.digest(b"".join((parent or root_hash(algo), token_bytes, extra)))


class RequestBlockHasher:
    """Chained hashes of one request's full hash blocks, extended incrementally.

    ``extend`` hashes only the blocks that the new tokens complete; earlier
    hashes are kept, never recomputed.
    """

    hash_block_size: PositiveInt
    algo: HashAlgo
    cache_salt: StrictStr | None
    lora_name: StrictStr | None

    def __init__(
        self,
        hash_block_size: int,
        *,
        algo: HashAlgo = HashAlgo.XXH3_128,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.hash_block_size = hash_block_size
        self.algo = algo
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        # Built once per request, yet checked here against the declared types: the
        # check costs little next to hashing the prompt, and a bad argument fails
        # here, named, not deep inside a later extend().
        check_fields(self).raise_if_any()
        self._root = root_hash(algo)
        lora = encode_extra(TAG_LORA, lora_name) if lora_name else b""
        salt = encode_extra(TAG_CACHE_SALT, cache_salt) if cache_salt else b""
        self._extra_first = lora + salt
        self._extra_rest = lora
        self._hashes: list[BlockHash] = []
        self._tail = np.zeros(0, dtype="<i8")
        self._num_hash_calls = 0

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """One hash per full hash block, in order (read-only: do not mutate)."""
        return self._hashes

    @property
    def num_tokens(self) -> int:
        return len(self._hashes) * self.hash_block_size + len(self._tail)

    @property
    def num_hash_calls(self) -> int:
        """Block digests computed so far (a cost counter)."""
        return self._num_hash_calls

    def extend(self, token_ids: Sequence[int] | npt.NDArray[np.integer]) -> None:
        """Append tokens; hash every hash block they complete."""
        new = encode_token_ids(token_ids)
        if new.size == 0:
            return
        tokens = np.concatenate((self._tail, new)) if self._tail.size else new
        num_full = len(tokens) // self.hash_block_size
        block_nbytes = self.hash_block_size * 8
        data = memoryview(tokens[: num_full * self.hash_block_size].tobytes())
        parent = self._hashes[-1] if self._hashes else self._root
        digest = self.algo.digest
        for i in range(num_full):
            extra = self._extra_first if not self._hashes else self._extra_rest
            block = data[i * block_nbytes : (i + 1) * block_nbytes]
            parent = digest(b"".join((parent, block, extra)))
            self._hashes.append(parent)
        self._num_hash_calls += num_full
        self._tail = tokens[num_full * self.hash_block_size :].copy()


_SAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
_HEX = re.compile(r"[0-9a-f]+")
_MAX_MODEL_CHARS = 64


def sanitize_model_id(model_id: str) -> str:
    """``model_id`` as ``[A-Za-z0-9._-]`` only; a changed or long id gets a digest suffix.

    The suffix keeps two ids that sanitize alike (``a/b`` and ``a_b``) apart.
    """
    safe = _SAFE_CHARS.sub("_", model_id)
    if safe == model_id and len(safe) <= _MAX_MODEL_CHARS:
        return safe
    suffix = hashlib.sha256(model_id.encode("utf-8")).hexdigest()[:8]
    return f"{safe[: _MAX_MODEL_CHARS - 9]}~{suffix}"


def _lowercase_hex(text: str) -> str:
    if not _HEX.fullmatch(text):
        raise ValueError("must be lowercase hex (use ModelGroups.fingerprint)")
    return text


@dataclass(frozen=True, kw_only=True)
class KeyNamespace:
    """What keeps keys of another model, other groups or another rank apart."""

    model_id: NonEmptyStr
    groups_fingerprint: Annotated[StrictStr, AfterValidator(_lowercase_hex)]
    tp_rank: NonNegativeInt = 0
    tp_size: PositiveInt = 1
    pp_rank: NonNegativeInt = 0
    pp_size: PositiveInt = 1
    """The pipeline stage: each stage holds other layers, so other blocks."""

    def __post_init__(self) -> None:
        problems = check_fields(self)
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            if problems.valid(rank, size) and getattr(self, rank) >= getattr(self, size):
                problems.add(
                    [f"{rank}={getattr(self, rank)} must be in [0, {size}={getattr(self, size)})"]
                )
        problems.raise_if_any()

    @classmethod
    def for_groups(
        cls,
        model_groups: ModelGroups,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
    ) -> KeyNamespace:
        """The namespace of one rank holding ``model_groups`` (under pipeline parallel,
        its stage's layers)."""
        return cls(
            model_id=model_groups.model_id,
            groups_fingerprint=model_groups.fingerprint,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
        )

    @classmethod
    def for_rank(cls, model_groups: ModelGroups, rank: WorkerRank) -> KeyNamespace:
        return cls.for_groups(
            model_groups,
            tp_rank=rank.tp_rank,
            tp_size=rank.tp_size,
            pp_rank=rank.pp_rank,
            pp_size=rank.pp_size,
        )

    @property
    def rank(self) -> WorkerRank:
        return WorkerRank(
            tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank, pp_size=self.pp_size
        )

    @property
    def prefix(self) -> str:
        model = sanitize_model_id(self.model_id)
        return f"{model}|{self.groups_fingerprint}|{self.rank.label}"


class KeyBuilder:
    """Store keys of one namespace (model, groups, tensor-parallel rank).

    Group ``g`` block ``i`` covers tokens ``[i * bs, (i + 1) * bs)`` with
    ``bs = m * hash_block_size``; it is named by ``block_hash`` = the request's
    hash ``(i + 1) * m - 1``, which chains every token before the block's end.
    A block hash is the same for every rank; ``key`` adds the namespace.
    """

    def __init__(self, model_groups: ModelGroups, namespace: KeyNamespace) -> None:
        if namespace.groups_fingerprint != model_groups.fingerprint:
            raise ValueError(
                f"namespace.groups_fingerprint={namespace.groups_fingerprint!r} does not match "
                f"model_groups.fingerprint={model_groups.fingerprint!r}; build the namespace with "
                "KeyNamespace.for_groups(model_groups)"
            )
        self.model_groups = model_groups
        self.namespace = namespace
        prefix = namespace.prefix
        self._group_prefixes = [f"{prefix}|g{g}|" for g in range(model_groups.num_groups)]
        model = sanitize_model_id(namespace.model_id)
        self._sighting_prefix = f"{model}|{namespace.groups_fingerprint}|seen|"
        """Marks of hashes seen (``connector.sightings``): the same for every rank."""
        self._hashes_per_block = [
            g.block_size // model_groups.hash_block_size for g in model_groups.groups
        ]

    def hashes_per_block(self, group_id: int) -> int:
        self._check_group(group_id)
        return self._hashes_per_block[group_id]

    def num_full_blocks(self, group_id: int, num_hashes: int) -> int:
        """Group blocks fully covered by ``num_hashes`` hash blocks."""
        return num_hashes // self.hashes_per_block(group_id)

    def block_hashes(
        self, group_id: int, hashes: Sequence[BlockHash], block_indices: Iterable[int]
    ) -> list[BlockHash]:
        """The names of the given group blocks; ValueError if a block is not full yet."""
        m = self.hashes_per_block(group_id)
        num_full = len(hashes) // m
        out: list[BlockHash] = []
        for i in block_indices:
            if not 0 <= i < num_full:
                raise ValueError(
                    f"group {group_id} block {i} is not complete: {len(hashes)} hashes cover "
                    f"blocks [0, {num_full}) of {m} hash blocks each"
                )
            out.append(hashes[(i + 1) * m - 1])
        return out

    def key(self, group_id: int, block_hash: BlockHash) -> StoreKey:
        """The store key of one group block in this namespace."""
        return StoreKey(self._group_prefixes[group_id] + block_hash.hex())

    def keys_of(self, group_id: int, block_hashes: Iterable[BlockHash]) -> list[StoreKey]:
        prefix = self._group_prefixes[group_id]
        return [StoreKey(prefix + h.hex()) for h in block_hashes]

    def sighting_keys(self, block_hashes: Iterable[BlockHash]) -> list[StoreKey]:
        """The keys that mark these hashes seen in a shared pool (any rank's builder
        gives the same; ``parse`` answers None for them)."""
        return [StoreKey(self._sighting_prefix + h.hex()) for h in block_hashes]

    def parse(self, key: StoreKey) -> tuple[int, BlockHash] | None:
        """The group and block hash ``key`` names; None for a key of another namespace
        or one this builder would not make."""
        _, sep, tail = key.rpartition("|g")
        group, sep2, hash_hex = tail.partition("|")
        well_formed = sep and sep2 and group.isdigit() and len(hash_hex) % 2 == 0
        if not (well_formed and _HEX.fullmatch(hash_hex)):
            return None
        group_id = int(group)
        if group_id >= len(self._group_prefixes):
            return None
        if not key.startswith(self._group_prefixes[group_id]):
            return None
        return group_id, BlockHash(bytes.fromhex(hash_hex))

    def keys(
        self, group_id: int, hashes: Sequence[BlockHash], block_indices: Iterable[int]
    ) -> list[StoreKey]:
        """Keys of the given group-block indices of a request's hash chain."""
        return self.keys_of(group_id, self.block_hashes(group_id, hashes, block_indices))

    def _check_group(self, group_id: int) -> None:
        if not 0 <= group_id < len(self._hashes_per_block):
            raise ValueError(
                f"group_id={group_id} is out of range [0, {len(self._hashes_per_block)})"
            )
