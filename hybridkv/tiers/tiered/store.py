"""A store over several tiers: union lookup, cheapest reads, promotion, write-back.

Runs in the worker process; its lookups also serve the scheduler's hit search
when both share a process. Reads go to the cheapest tier holding each block
(``Selection.PER_BLOCK``) or to one chosen tier (``tier_index``, for
``Selection.WHOLE_REQUEST``; see ``tiers.selection``). Stores go to the first
tier synchronously and reach the others through the write-back queue; a
transfer may also store into the first tier's memory in place (``memory()``,
``tiers.tiered.in_place``), and what it commits is sent on the same way,
borrowed rather than copied. With ``Admission.REUSED`` stores stop at the first
tier once the others are full, and ``retention.admit`` sends on the blocks
someone judged worth keeping (``tiers.admission``, ``tiers.tiered.admission``,
``tiers.tiered.room``, ``tiers.tiered.retention``). A tier that raises never
breaks the store: the error is logged once, counted, and answered as a miss
(``tiers.tiered.guard``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Sequence

from hybridkv.tiers.admission import Admission
from hybridkv.tiers.base import (
    Buffer,
    GetStatus,
    PutStatus,
    StoreKey,
    Tier,
    TierMemory,
    TierStats,
    TierUsage,
    check_batch,
)
from hybridkv.tiers.selection import Selection
from hybridkv.tiers.tiered.admission import SlowerAdmission
from hybridkv.tiers.tiered.changes import ChangeLog, KeyChange
from hybridkv.tiers.tiered.guard import TierGuard
from hybridkv.tiers.tiered.in_place import StoreMemory
from hybridkv.tiers.tiered.retention import StackRetention
from hybridkv.tiers.tiered.write_back import WriteBack, WriteBackStats

logger = logging.getLogger(__name__)

_GET_SEVERITY = {GetStatus.MISS: 0, GetStatus.ERROR: 1, GetStatus.CORRUPT: 2}
_PUT_RANK = {PutStatus.OK: 0, PutStatus.EXISTS: 1, PutStatus.FULL: 2, PutStatus.ERROR: 3}


def _unique_names(tiers: Sequence[Tier]) -> tuple[str, ...]:
    names: list[str] = []
    for index, tier in enumerate(tiers):
        names.append(tier.name if tier.name not in names else f"{tier.name}#{index}")
    return tuple(names)


class TieredStore(Tier):
    """Several tiers behind the ``Tier`` protocol (see the module docstring for weights).

    ``tiers[0]`` takes stores synchronously (normally the CPU tier); with
    ``write_back`` the others receive them asynchronously, without it
    synchronously. With ``promote``, a block read from another tier is copied
    into the first tier that ``accepts_promotions`` (best effort). With
    ``Admission.REUSED`` the others receive what ``retention.admit`` names, and other
    stores only while they have room (``tiers.tiered.room``).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        selection: Selection = Selection.PER_BLOCK,
        promote: bool = True,
        write_back: bool = True,
        write_back_bytes: int = 64 << 20,
        admission: Admission = Admission.ALL,
        name: str = "tiered",
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier; pass e.g. [CpuTier(...)]")
        if write_back_bytes <= 0:
            raise ValueError(f"write_back_bytes={write_back_bytes}: must be > 0")
        self.name = name
        self.tiers = tuple(tiers)
        self.num_tiers = len(self.tiers)
        self.tier_names = _unique_names(self.tiers)
        self.selection = selection
        self.promote = promote
        self.admission = admission
        self.load_weight = min(tier.load_weight for tier in self.tiers)
        self._read_order = sorted(range(len(tiers)), key=lambda i: (tiers[i].load_weight, i))
        takers = [i for i, tier in enumerate(self.tiers) if tier.accepts_promotions]
        self._promote_to = takers[0] if promote and takers else None
        self._stats = TierStats()
        self._hit_tokens = [0] * len(tiers)
        self._pending_loads = [0] * len(tiers)
        self._guard = TierGuard(name, self.tier_names, logger)
        self._lock = threading.Lock()
        self._changes: ChangeLog | None = None
        self._first_memory = self.tiers[0].memory()
        self._write_back = (
            WriteBack(
                self._write_lower,
                self._release_first,
                write_back_bytes,
                borrow_limit_bytes=self._borrow_limit(),
            )
            if write_back and len(tiers) > 1
            else None
        )
        sends_all = admission is Admission.ALL and len(self.tiers) > 1
        self._memory = (
            None
            if self._first_memory is None
            else StoreMemory(self._first_memory, self._committed, send_on=sends_all)
        )
        self._admission = SlowerAdmission(
            self.tiers,
            self._guard,
            sends_all=sends_all,
            memory=self._memory,
            write_back=self._write_back,
            read_first=functools.partial(self._get_from, 0),
            write_lower=self._write_lower,
        )
        """What goes on past the first tier under ``admission``, and the counts of it."""

    def _borrow_limit(self) -> int | None:
        """Bytes of the first tier the write-back may keep borrowed: half of it, so the
        tier can still evict for new stores while the slower tiers lag (None: no limit
        known)."""
        usage = self._guard.call(0, "usage", None, self.tiers[0].usage)
        capacity = None if usage is None else usage.capacity_bytes
        return None if capacity is None else capacity // 2

    def _release_first(self, keys: list[StoreKey]) -> None:
        if self._first_memory is not None:
            self._guard.call(0, "release", None, self._first_memory.release_many, keys)

    # Lookups -----------------------------------------------------------------

    def contains_many(
        self, keys: Sequence[StoreKey], *, tier_index: int | None = None
    ) -> list[bool]:
        """Union over the tiers, or only ``tiers[tier_index]``."""
        found = [False] * len(keys)
        for index in self._read_order if tier_index is None else [tier_index]:
            todo = [j for j, hit in enumerate(found) if not hit]
            if not todo:
                break
            answers = self._contains_in(index, [keys[j] for j in todo])
            for j, hit in zip(todo, answers, strict=True):
                found[j] = hit
        with self._lock:
            self._stats.queries += len(keys)
            self._stats.hits += sum(found)
        return found

    def first_holds(self, keys: Sequence[StoreKey]) -> list[bool]:
        """Whether ``tiers[0]`` holds each key (the store counts no lookup; the tier
        counts its own queries)."""
        return self._contains_in(0, keys)

    def _contains_in(self, index: int, keys: Sequence[StoreKey]) -> list[bool]:
        return self._guard.batch(index, "contains", False, self.tiers[index].contains_many, keys)

    # Data path ---------------------------------------------------------------

    def get_many_from(
        self, tier_index: int, keys: Sequence[StoreKey], buffers: Sequence[Buffer]
    ) -> list[GetStatus]:
        return self.get_many_into(keys, buffers, tier_index=tier_index)

    def get_many_into(
        self, keys: Sequence[StoreKey], buffers: Sequence[Buffer], *, tier_index: int | None = None
    ) -> list[GetStatus]:
        """Read each key from the cheapest tier holding it, or only ``tiers[tier_index]``.

        A key that fails in one tier (miss, corrupt, error) is tried in the next.
        """
        check_batch(keys, buffers)
        statuses = [GetStatus.MISS] * len(keys)
        sources = [-1] * len(keys)
        todo = list(range(len(keys)))
        for index in self._read_order if tier_index is None else [tier_index]:
            if not todo:
                break
            answers = self._get_from(index, [keys[j] for j in todo], [buffers[j] for j in todo])
            for j, status in zip(todo, answers, strict=True):
                if status is GetStatus.OK:
                    statuses[j], sources[j] = status, index
                elif _GET_SEVERITY[status] > _GET_SEVERITY[statuses[j]]:
                    statuses[j] = status  # the most telling failure is reported
            todo = [j for j in todo if statuses[j] is not GetStatus.OK]
        self._promote(keys, buffers, sources)
        num_ok = len(keys) - len(todo)
        with self._lock:
            self._stats.gets += num_ok
            self._stats.get_bytes += sum(len(buffers[j]) for j, s in enumerate(sources) if s >= 0)
            self._stats.corrupt += sum(statuses[j] is GetStatus.CORRUPT for j in todo)
        return statuses

    def _get_from(
        self, index: int, keys: Sequence[StoreKey], buffers: Sequence[Buffer]
    ) -> list[GetStatus]:
        tier = self.tiers[index]
        with self._lock:
            self._pending_loads[index] += len(keys)
        try:
            answers = self._guard.batch(
                index, "get", GetStatus.ERROR, tier.get_many_into, keys, buffers
            )
            if self._changes is not None:
                self._changes.note_gets(index, keys, answers)
            return answers
        finally:
            with self._lock:
                self._pending_loads[index] -= len(keys)

    def _promote(
        self, keys: Sequence[StoreKey], buffers: Sequence[Buffer], sources: Sequence[int]
    ) -> None:
        """Best effort: copy blocks read from other tiers into the first tier that
        ``accepts_promotions``."""
        target = self._promote_to
        moved = [j for j, source in enumerate(sources) if source not in (-1, target)]
        if target is not None and moved:
            self._put_into(
                target, [keys[j] for j in moved], [buffers[j] for j in moved], what="promote"
            )

    def put_many(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
    ) -> list[PutStatus]:
        """Store into ``tiers[0]`` now and into the others by write-back (or now, without it).

        A key counts as OK when the first tier stored it or it was queued for write-back.
        """
        check_batch(keys, buffers, checksums)
        first = self._put_into(0, keys, buffers, checksums)
        if not self._admission.goes_on(sum(len(buffer) for buffer in buffers)):
            results = list(first)
            self._admission.count_sent_on(0, results.count(PutStatus.OK))
        elif self._write_back is not None:
            todo = [j for j, status in enumerate(first) if status is not PutStatus.EXISTS]
            queued = self._write_back.submit_many(
                [keys[j] for j in todo], [buffers[j] for j in todo]
            )
            results = list(first)
            for j, was_queued in zip(todo, queued, strict=True):
                if was_queued and results[j] is not PutStatus.OK:
                    results[j] = PutStatus.OK
            self._admission.count_sent_on(len(todo), 0)
        else:
            results = list(first)
            for index in range(1, len(self.tiers)):
                answers = self._put_into(index, keys, buffers, checksums)
                results = [
                    min(a, b, key=_PUT_RANK.__getitem__)
                    for a, b in zip(results, answers, strict=True)
                ]
            self._admission.count_sent_on(len(keys), 0)
        with self._lock:
            stored = [j for j, status in enumerate(results) if status is PutStatus.OK]
            self._stats.puts += len(stored)
            self._stats.put_bytes += sum(len(buffers[j]) for j in stored)
            self._stats.put_skipped_full += results.count(PutStatus.FULL)
        return results

    def _put_into(
        self,
        index: int,
        keys: Sequence[StoreKey],
        buffers: Sequence[Buffer],
        checksums: Sequence[int] | None = None,
        *,
        what: str = "put",
        reused: bool = False,
    ) -> list[PutStatus]:
        tier = self.tiers[index]
        put_many = tier.retention.put_reused if reused else tier.put_many
        what = "put reused" if reused else what
        answers = self._guard.batch(
            index, what, PutStatus.ERROR, put_many, keys, buffers, checksums
        )
        if self._changes is not None:
            self._changes.note_puts(index, keys, answers)
        return answers

    def _write_lower(self, keys: Sequence[StoreKey], buffers: Sequence[Buffer]) -> int:
        """Write-back thread: put into every tier but the first, those admitted as reused
        with ``TierRetention.put_reused``; returns failures."""
        reused = set(self._admission.take_reused(keys))
        parts = [(keys, buffers, False)]
        if reused:
            kept = [j for j, key in enumerate(keys) if key not in reused]
            taken = [j for j, key in enumerate(keys) if key in reused]
            parts = [
                ([keys[j] for j in part], [buffers[j] for j in part], is_reused)
                for part, is_reused in ((kept, False), (taken, True))
                if part
            ]
        answers = [
            status
            for index in range(1, len(self.tiers))
            for part_keys, part_buffers, is_reused in parts
            for status in self._put_into(index, part_keys, part_buffers, reused=is_reused)
        ]
        return answers.count(PutStatus.ERROR)

    def memory(self) -> TierMemory | None:
        """The first tier's memory (None where it has none); commits reach the other
        tiers as ``put_many`` does, without a copy (``tiers.tiered.admission``)."""
        return self._memory

    def _committed(self, keys: list[StoreKey], views: list[Buffer]) -> None:
        """Objects committed in place in the first tier: count them, then send them on."""
        with self._lock:
            self._stats.puts += len(keys)
            self._stats.put_bytes += sum(len(view) for view in views)
        self._admission.send_on(keys, views)

    @functools.cached_property
    def retention(self) -> StackRetention:
        """Hints for every tier, the store's ``StackMode``, and admission (``admit``)."""
        return StackRetention(self, self.tiers, self._guard, self._admission)

    def delete_many(self, keys: Sequence[StoreKey]) -> int:
        """Remove from every tier (and from the write-back queue); returns keys found anywhere."""
        if self._write_back is not None:
            self._write_back.cancel(keys)
        self._admission.take_reused(keys)
        present = self.contains_many(keys)
        for index, tier in enumerate(self.tiers):
            self._guard.call(index, "delete", 0, tier.delete_many, keys)
            if self._changes is not None:
                self._changes.note_deletes(index, keys)
        return sum(present)

    def register_staging(self, staging: Buffer) -> int:
        """Offered to every tier: reads and the first tier's stores see staging buffers."""
        tiers = enumerate(self.tiers)
        return max(
            self._guard.call(i, "register", 0, t.register_staging, staging) for i, t in tiers
        )

    def staging_busy(self) -> bool:
        return any(
            self._guard.call(i, "busy", False, t.staging_busy) for i, t in enumerate(self.tiers)
        )

    # Bookkeeping ---------------------------------------------------------------

    def record_changes(self, log: ChangeLog) -> None:
        """From now on, record in ``log`` what each tier stores and removes."""
        log.attach(self.tiers)
        self._changes = log

    def take_changes(self) -> list[KeyChange]:
        """What the tiers stored and removed since the last call ([] unless recording)."""
        return [] if self._changes is None else self._changes.take()

    def record_hit_tokens(self, tier_index: int, num_tokens: int) -> None:
        """Credit ``num_tokens`` of a request's hit to ``tiers[tier_index]``."""
        with self._lock:
            self._hit_tokens[tier_index] += num_tokens
            self._stats.hit_tokens += num_tokens

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write-back is done; False on timeout."""
        return True if self._write_back is None else self._write_back.flush(timeout_s)

    def write_back_stats(self) -> WriteBackStats:
        if self._write_back is None:
            return WriteBackStats()
        return self._write_back.snapshot()

    def usage(self) -> TierUsage:
        """Sums over the tiers (an object held by two tiers counts twice)."""
        usages = [
            self._guard.call(i, "usage", None, tier.usage) for i, tier in enumerate(self.tiers)
        ]
        known = [u for u in usages if u is not None]
        capacities = [u.capacity_bytes if u is not None else None for u in usages]
        return TierUsage(
            num_objects=sum(u.num_objects for u in known),
            used_bytes=sum(u.used_bytes for u in known),
            capacity_bytes=None if None in capacities else sum(c or 0 for c in capacities),
        )

    def stats(self) -> TierStats:
        counts = self._admission.counts()
        with self._lock:
            stats = TierStats(**self._stats.as_dict())
            stats.pending_loads = sum(self._pending_loads)
            stats.errors = self._guard.num_errors()
        stats.admitted = counts.num_admitted * (self.num_tiers - 1)
        stats.rejected = counts.num_rejected * (self.num_tiers - 1)
        stats.admission_lost = counts.num_lost * (self.num_tiers - 1)
        return stats

    def stats_by_tier(self) -> dict[str, TierStats]:
        """Each tier's own counters plus what the store counts for it (hit tokens,
        pending loads, exceptions it caught)."""
        counts = self._admission.counts()
        result = {}
        for index, (name, tier) in enumerate(zip(self.tier_names, self.tiers, strict=True)):
            own = self._guard.call(index, "stats", None, tier.stats)
            stats = TierStats(**own.as_dict()) if own is not None else TierStats()
            with self._lock:
                stats.hit_tokens = self._hit_tokens[index]
                stats.pending_loads = self._pending_loads[index]
                stats.errors += self._guard.num_errors(index)
            if index > 0:
                stats.admitted, stats.rejected = counts.num_admitted, counts.num_rejected
                stats.admission_lost = counts.num_lost
            result[name] = stats
        return result

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
        if self._write_back is not None:
            self._write_back.check_integrity()
        with self._lock:
            assert all(n >= 0 for n in self._pending_loads), self._pending_loads

    def close(self, timeout_s: float = 60.0) -> None:
        """Flush write-back (up to ``timeout_s``), stop its thread, close every tier."""
        if self._write_back is not None:
            self._write_back.close(timeout_s)
        for index, tier in enumerate(self.tiers):
            self._guard.call(index, "close", None, tier.close)
