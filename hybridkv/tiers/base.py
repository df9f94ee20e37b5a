"""The tier protocol: where stored KV blocks live (CPU, disk, shared pool).

Runs in the worker process (bytes) and, for ``contains_many`` only, in the
scheduler process. One object is one block of one group for all of that
group's layers, addressed by a ``StoreKey``. A tier never raises for I/O
failures on the data path: a failure is a per-key result, counted in
``stats()``, and the engine recomputes.
"""

from __future__ import annotations

import abc
import ctypes
import enum
import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, NewType, Protocol

import numpy as np
import numpy.typing as npt

from hybridkv.metric_fields import counter, gauge
from hybridkv.tiers.retention import TierRetention

if TYPE_CHECKING:
    import torch  # only where a tier exposes its memory; lookups never load it

StoreKey = NewType("StoreKey", str)
"""Names one stored block: namespace, group and block hash (see ``hashing``)."""

Buffer = npt.NDArray[np.uint8]
"""A 1-D, C-contiguous uint8 array on CPU memory (a view of a staging buffer)."""


def buffer_address(buffer: Buffer) -> int:
    """The address of ``buffer``'s first byte, cheaper than ``ctypes.data`` for a writable
    buffer (as staging is), for paths that read it once a block."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer.data))
    except (TypeError, ValueError):  # read-only, or empty
        return int(buffer.ctypes.data)


class GetStatus(enum.Enum):
    OK = "ok"
    MISS = "miss"
    CORRUPT = "corrupt"
    """Present but failed its integrity check (checksum, length, key)."""
    ERROR = "error"
    """The tier could not answer (dead server, I/O error, timeout)."""


class PutStatus(enum.Enum):
    OK = "ok"
    EXISTS = "exists"
    """Already stored under this key; the first value is kept."""
    FULL = "full"
    """No room now; skipped and counted, never an error for the engine."""
    ERROR = "error"


_TIER = ("tier",)


@dataclass(kw_only=True)
class TierStats:
    """Monotonic counters of one tier (reset only by a new process), each declared with
    the metric the connector exports it as."""

    queries: int = counter("Keys asked about", name="tier_lookup_keys", labels=_TIER)
    """Keys asked about in ``contains_many``."""
    hits: int = counter("Keys a lookup found", name="tier_hits", labels=_TIER)
    """Keys found by ``contains_many``."""
    gets: int = counter("Objects read", name="tier_reads", labels=_TIER)
    get_bytes: int = counter("Bytes read", name="tier_read_bytes", labels=_TIER)
    puts: int = counter("Objects written", name="tier_writes", labels=_TIER)
    put_bytes: int = counter("Bytes written", name="tier_written_bytes", labels=_TIER)
    put_skipped_full: int = counter("Writes skipped: no room", name="tier_full_skips", labels=_TIER)
    corrupt: int = counter(
        "Objects that failed their checksum (never loaded)",
        name="tier_corrupt_objects",
        labels=_TIER,
    )
    errors: int = counter(
        "Calls that failed (answered as misses)", name="tier_errors", labels=_TIER
    )
    evictions: int = counter("Objects or segments evicted", name="tier_evictions", labels=_TIER)
    hit_tokens: int = counter(
        "Tokens of whole-request hits served", name="tier_hit_tokens", labels=_TIER
    )
    """Tokens of hits served by this tier, as reported by the connector."""
    admitted: int = counter(
        "Blocks sent on to this slower tier from the first (admission)",
        name="tier_admitted_blocks",
        labels=_TIER,
    )
    """Set by the tiered store: blocks it queued or wrote to this tier, which is not its
    first (with ``Admission.ALL`` every stored block)."""
    rejected: int = counter(
        "Blocks the first tier stored and this slower tier did not receive (admission)",
        name="tier_rejected_blocks",
        labels=_TIER,
    )
    """Set by the tiered store: blocks stored in its first tier and held back from this
    one (``Admission.REUSED``); one admitted later counts here and in ``admitted``."""
    admission_lost: int = counter(
        "Blocks admitted that the first tier did not hold (evicted, or never stored)",
        name="tier_admission_lost_blocks",
        labels=_TIER,
    )
    """Set by the tiered store: blocks admitted (``StackRetention.admit``) that the first
    tier did not hold (``Admission.REUSED``): evicted before their admission ran, or
    never stored (a prefix's blocks another rank or an earlier request was to store);
    not sent on."""
    pending_loads: int = gauge(
        "Keys being read from the tier when the metrics were taken",
        name="tier_pending_loads",
        labels=_TIER,
    )
    """Set by the tiered store, which makes the reads."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class TierUsage:
    num_objects: int
    used_bytes: int
    capacity_bytes: int | None
    """None when the tier cannot tell (a shared pool)."""


class TierReach(enum.Enum):
    """Which processes can see a tier's objects."""

    PROCESS = "process"
    """Only the process that holds it (CPU memory): other processes learn its keys
    from reports."""
    HOST = "host"
    """Other processes on the same host (a local directory)."""
    CLUSTER = "cluster"
    """Every engine that reaches the same server (a shared pool)."""


class TierMedium(enum.Enum):
    """Where a tier keeps its objects (reported as the source of hits)."""

    MEMORY = "memory"
    DISK = "disk"
    REMOTE = "remote"


class TierChanges(Protocol):
    """Where a tier records, in the order they happen, the objects it stores and removes.

    Called from any thread, possibly under the tier's own lock (so it must not call
    the tier back).
    """

    def stored(self, keys: Sequence[StoreKey]) -> None:
        """These objects are now stored (visible to lookups)."""

    def removed(self, keys: Sequence[StoreKey]) -> None:
        """These objects are gone: evicted, deleted, or dropped as corrupt."""

    def keep_digests(self) -> None:
        """A tier that names removals by digest calls this first, before it stores
        anything: stored keys are then remembered by digest (bounded)."""

    def removed_digests(self, digests: bytes) -> None:
        """Objects gone, named by their concatenated ``codec.key_digest`` (a tier that
        indexes digests, not keys; see ``keep_digests``)."""


class Tier(abc.ABC):
    """A key -> bytes store with batched calls.

    Invariants every implementation keeps:

    * ``get_many_into`` writes a buffer only when its status is OK (buffers in
      registered staging excepted, see ``register_staging``), and the bytes
      written equal what ``put_many`` stored under that key.
    * A buffer's length is the object's exact size; a stored object of
      another size is CORRUPT, never a partial read.
    * Every call takes a batch and costs at most one round trip to a remote
      server per call.
    """

    name: str = "tier"
    load_weight: float = 1.0
    """Relative cost of loading from this tier (lower is cheaper)."""
    accepts_promotions: ClassVar[bool] = False
    """Blocks read from slower tiers are copied here (best effort)."""
    local_usage: ClassVar[bool] = False
    """``usage`` and ``retention.evicts_reused`` answer from this process's memory, with no
    round trip to a server (``tiers.tiered.room`` asks for every batch)."""
    marks_sightings: ClassVar[bool] = False
    """A shared tier whose ``sight_many`` marks keys for other engines to see
    (``connector.sightings``)."""
    num_tiers: int = 1
    """Tiers a read may name (``get_many_from``); a stack of tiers has several."""

    @abc.abstractmethod
    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether each key is stored. Errors answer False (a miss)."""

    @abc.abstractmethod
    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """Store each buffer under its key. The tier copies the bytes.

        ``checksums``, when given, holds each buffer's ``codec.checksum``, taken by
        the caller while the bytes were in cache; a tier may write it into its
        header instead of reading the payload again. (A wrong one costs no data:
        the object reads back CORRUPT and is recomputed.)
        """

    @abc.abstractmethod
    def get_many_into(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> list[GetStatus]:
        """Read each key into its buffer (exactly ``len(buffer)`` bytes)."""

    def get_many_from(
        self, tier_index: int, keys: Sequence[StoreKey], buffers: Sequence[Buffer]
    ) -> list[GetStatus]:
        """``get_many_into`` from ``tier_index`` only (``0 <= tier_index < num_tiers``)."""
        if tier_index != 0:
            raise ValueError(f"tier_index={tier_index}: {self.name} is one tier, index 0")
        return self.get_many_into(keys, buffers)

    @abc.abstractmethod
    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        """Remove keys; returns how many were present."""

    def sight_many(self, keys: Sequence[StoreKey], ttl_s: int) -> list[bool]:
        """Mark each key for ``ttl_s`` seconds; True for those already marked (by any
        client). An unanswered key is False. Only a tier that ``marks_sightings`` can."""
        raise NotImplementedError(
            f"tier {self.name} cannot mark sightings (marks_sightings is False); "
            "mark them in a tier that can (valkey)"
        )

    @functools.cached_property
    def retention(self) -> TierRetention:
        """The hints a retention policy gives this tier (touch, passes, reused marks,
        plain recency). The default ignores them: the tier evicts by its own rule."""
        return TierRetention(self)

    @abc.abstractmethod
    def usage(self) -> TierUsage: ...

    @abc.abstractmethod
    def stats(self) -> TierStats: ...

    def register_staging(self, staging: Buffer) -> int:
        """Offer the transfer engine's staging memory; returns the header room wanted.

        A tier answering ``n > 0`` is promised that every buffer inside
        ``staging`` it is later given has ``n`` bytes in front of it that it
        may overwrite, and may read or write such a buffer (and its room)
        directly, whatever the status it answers: the engine scatters only
        blocks answered OK. 0 (the default): buffers come without room.
        """
        return 0

    def staging_busy(self) -> bool:
        """Whether a call this tier gave up on may still touch registered staging.

        While True the engine reuses no staging region a finished call used.
        """
        return False

    def memory(self) -> TierMemory | None:
        """Where transfers may copy in place; None: only through buffers."""
        return None

    def log_changes(self, changes: TierChanges) -> bool:
        """From now on, record every object stored and removed (evictions included) in
        ``changes``, in order. False (the default): this tier cannot see its removals
        (a shared pool evicts on its server); its caller records what it learns."""
        return False

    def check_integrity(self) -> None:
        """Raise AssertionError if internal bookkeeping is inconsistent."""

    def close(self) -> None:
        """Release files, sockets and memory. Idempotent."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TierMemory(abc.ABC):
    """Objects kept in this process's memory, which a transfer copies into and out of
    in place (no staging copy). Thread-safe. Offsets index ``memory``.

    An object is reserved (being written, invisible), then stored; a stored object
    may be borrowed (pinned) any number of times. A borrow or reservation is ended
    by key, so while a deleted object is still borrowed its key cannot be reserved
    again (FULL): one key never names two extents at once.
    """

    @property
    @abc.abstractmethod
    def memory(self) -> torch.Tensor:
        """1-D uint8 CPU tensor over the whole arena (page-locked when the tier pinned it)."""

    @abc.abstractmethod
    def reserve_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | PutStatus]:
        """Room for each new object: its offset in ``memory``; PutStatus.EXISTS when the key
        is stored or reserved already; PutStatus.FULL when there is no room even after
        evicting every object that may be evicted. A reserved object is invisible
        (contains_many, get_many_into, borrow_many answer as if absent) until
        ``commit_many``, and is never evicted."""

    @abc.abstractmethod
    def commit_many(
        self, keys: Sequence[StoreKey], written: Sequence[bool], *, num_borrows: int = 0
    ) -> None:
        """End reservations: a written object becomes stored (counted as a put, most
        recently used); the room of the others is freed.

        ``num_borrows``: each stored object starts borrowed that many times, before
        anything could evict it (not counted as gets; each ended by ``release_many``).
        """

    @abc.abstractmethod
    def borrow_many(self, keys: Sequence[StoreKey], sizes: Sequence[int]) -> list[int | GetStatus]:
        """Offsets of stored objects to read in place; each borrowed object is pinned (never
        evicted, its bytes never reused) until ``release_many``. GetStatus.MISS when absent,
        GetStatus.CORRUPT when stored with another size (then dropped, counted corrupt).
        A borrow counts as a get (gets, get_bytes) and marks the object most recently used."""

    @abc.abstractmethod
    def release_many(self, keys: Sequence[StoreKey]) -> None:
        """End one borrow of each key (keys borrowed OK only)."""


def check_batch(
    keys: Sequence[StoreKey], buffers: Sequence[Buffer], checksums: Sequence[int] | None = None
) -> None:
    """Validate a batch at the API boundary (programming errors raise)."""
    if len(keys) != len(buffers):
        raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers; need one buffer per key")
    if checksums is not None and len(checksums) != len(keys):
        raise ValueError(
            f"{len(keys)} keys but {len(checksums)} checksums; give one per key, or None"
        )
    for i, buf in enumerate(buffers):
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 1:
            raise TypeError(
                f"buffers[{i}] must be a 1-D numpy uint8 array, got "
                f"{type(buf).__name__} {getattr(buf, 'dtype', '')} ndim={getattr(buf, 'ndim', '')}"
            )
        if not buf.flags.c_contiguous:
            raise ValueError(f"buffers[{i}] must be C-contiguous")


def check_sizes(keys: Sequence[StoreKey], sizes: Sequence[int]) -> None:
    """Validate a reserve or borrow batch at the API boundary (programming errors raise)."""
    if len(keys) != len(sizes):
        raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes; need one size per key")
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise TypeError(f"sizes[{i}] must be an int (bytes), got {type(size).__name__}")
        if size < 0:
            raise ValueError(f"sizes[{i}] = {size}: an object's size must be >= 0 bytes")
