"""The CPU tier's stored objects: by key digest, in least-recently-used order.

Worker process; not thread-safe (``CpuTier`` calls it under its lock). Each
object is a row of numpy arrays: its key digest (``DigestTable``), arena offset
and size, borrow count, its neighbours in the LRU list and its marks (44 B, plus
the table's buckets), not an OrderedDict entry, a slot object, their ints and the key
string, several times that (docs/DECISIONS.md). Changes run natively: one call
per batch.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

import hybridkv.native  # noqa: F401  # before numba compiles: see its docstring
from hybridkv.tiers import digest_table
from hybridkv.tiers.digest_table import (
    NONE,
    Buckets,
    Digests,
    DigestTable,
    Rows,
    claim_one,
    digest_words,
    find_one,
    grown,
    words,
)
from hybridkv.tiers.retention import MAX_PASSES

Wide = npt.NDArray[np.int64]
"""Per row: arena offset, size (NONE: a free row)."""
Narrow = npt.NDArray[np.int32]
"""Per row: borrows, the next older row, the next newer row (NONE: none), and marks:
bit 0 set when the object was read since it was added or last came round
(``second_chance``), bits 1-2 the passes it has left, bits 3-4 those ``grant`` gave it
(each use restores them)."""
_OFFSET, _SIZE = 0, 1
_BORROWS, _OLDER, _NEWER, _MARKS = 0, 1, 2, 3
_READ, _PASS, _LEFT, _GRANTED = 1, 2, 6, 8
_HEAD, _TAIL = 0, 1
PROTECTED = 0.75
"""``second_chance`` passes a read row over only while at most this share of the rows
is marked read. Where nearly all were read (each document of long-doc-qa is asked
several times), passing them all would leave the unread ones, the newest among them,
the only ones to go: a segmented LRU's cap on its protected part."""
_ADD, _TOUCH_ADDED = -2, -3
"""Deferred changes (``LruObjects.settle``) other than touching a row: add an object,
touch one added earlier in the same batch."""


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _unlink(narrow: Narrow, ends: Rows, row: int) -> None:  # pragma: no cover - native
    older, newer = narrow[row, _OLDER], narrow[row, _NEWER]
    if older >= 0:
        narrow[older, _NEWER] = newer
    else:
        ends[_HEAD] = newer
    if newer >= 0:
        narrow[newer, _OLDER] = older
    else:
        ends[_TAIL] = older


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _link_newest(narrow: Narrow, ends: Rows, row: int) -> None:  # pragma: no cover - native
    tail = ends[_TAIL]
    narrow[row, _OLDER], narrow[row, _NEWER] = tail, NONE
    if tail >= 0:
        narrow[tail, _NEWER] = row
    else:
        ends[_HEAD] = row
    ends[_TAIL] = row


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _touch_one(narrow: Narrow, ends: Rows, row: int) -> None:  # pragma: no cover - native
    """Make the row the most recent, its passes those granted it again."""
    marks = narrow[row, _MARKS]
    narrow[row, _MARKS] = (marks & ~_LEFT) | ((marks // _GRANTED) * _PASS & _LEFT)
    if ends[_TAIL] != row:
        _unlink(narrow, ends, row)
        _link_newest(narrow, ends, row)


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _touch(narrow: Narrow, ends: Rows, rows: Rows) -> None:  # pragma: no cover - native
    """Make each row the most recent, in order."""
    for row in rows:
        _touch_one(narrow, ends, row)


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _settle(
    buckets: Buckets,
    keys: Digests,
    meta: Rows,
    wide: Wide,
    narrow: Narrow,
    ends: Rows,
    changes: Rows,
    change_keys: Digests,
    change_wide: Wide,
    out: Rows,
    entry: int,
) -> int:  # pragma: no cover - native
    """Apply changes in order: touch row ``changes[i]``, or ``_ADD`` an object (the most
    recent, with marks ``entry``; ``out[i]``: its row, NONE for a digest present
    already), or ``_TOUCH_ADDED`` one; returns how many adds found their digest present.
    The caller made room for every add."""
    num_present = 0
    for i in range(len(changes)):
        row = changes[i]
        if row == _ADD:
            row = claim_one(buckets, keys, meta, change_keys[i, 0], change_keys[i, 1])
            out[i] = row
            if row < 0:
                num_present += 1
                continue
            wide[row, _OFFSET], wide[row, _SIZE] = change_wide[i, _OFFSET], change_wide[i, _SIZE]
            narrow[row, _BORROWS], narrow[row, _MARKS] = 0, entry
            _link_newest(narrow, ends, row)
        else:
            if row == _TOUCH_ADDED:
                row = find_one(buckets, keys, change_keys[i, 0], change_keys[i, 1])
            _touch_one(narrow, ends, row)
    return num_present


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _unlink_all(narrow: Narrow, ends: Rows, wide: Wide, rows: Rows) -> None:  # pragma: no cover
    for row in rows:
        _unlink(narrow, ends, row)
        wide[row, _SIZE] = NONE


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _oldest_unborrowed(
    narrow: Narrow, ends: Rows, marked: Rows, max_marked: int, passes: bool
) -> int:  # pragma: no cover - native
    """The least recent row nobody borrows. With ``passes``, a row with passes left is
    passed over, one pass spent; while at most ``max_marked`` rows are marked read
    (``marked[0]``, which the walk keeps), a marked row is passed over once, its mark
    cleared. A row passed over becomes the most recent (so the walk ends within
    ``MAX_PASSES + 2`` rounds)."""
    row = int(ends[_HEAD])
    while row >= 0:
        newer = int(narrow[row, _NEWER])
        if narrow[row, _BORROWS] == 0:
            marks = narrow[row, _MARKS]
            if passes and marks & _LEFT:
                narrow[row, _MARKS] = marks - _PASS
            elif marks & _READ and marked[0] <= max_marked:
                narrow[row, _MARKS] = marks - _READ
                marked[0] -= 1
            else:
                return row
            if newer < 0:  # the newest already: nothing else to pass it for
                return row
            _unlink(narrow, ends, row)
            _link_newest(narrow, ends, row)
        row = newer
    return NONE


@njit(nogil=True, cache=True)  # type: ignore[untyped-decorator]
def _order(narrow: Narrow, head: int, out: Rows) -> int:  # pragma: no cover - native
    """Rows from the least recent on into ``out``; how many there were (-1: more)."""
    row, count = head, 0
    while row >= 0:
        if count == len(out):
            return -1
        out[count] = row
        count += 1
        row = narrow[row, _NEWER]
    return count


class LruObjects:
    """Stored objects by key digest: arena offset, size and borrows of each, and their
    order of use (least recent first). With ``second_chance`` an object read since it
    was added (or last came round) is passed over once when it is the least recent:
    objects never read go first (while at most ``PROTECTED`` of them were read). An
    object ``grant`` gave passes is passed over that many times first, and again after
    each use (no cap: passes given to every object alike keep their order); once it gave
    any, new objects enter with ``MAX_PASSES`` until a grant sets theirs."""

    def __init__(self, *, second_chance: bool = False) -> None:
        self.second_chance = second_chance
        self.plain_lru = False
        """For now least recently used first: neither reads nor passes keep an object."""
        self._table = DigestTable()
        self._wide: Wide = np.zeros((0, 2), np.int64)
        self._narrow: Narrow = np.zeros((0, 4), np.int32)
        self._ends: Rows = np.array([NONE, NONE], np.int64)
        self._later: list[tuple[int, bytes, int, int]] = []
        """Changes deferred to ``settle``, in order: (row to touch, or ``_ADD`` /
        ``_TOUCH_ADDED``; digest, offset, size)."""
        self._added_later: set[bytes] = set()
        self._entry = 0
        """Marks of a new object: no pass, or ``MAX_PASSES`` once ``grant`` gave any."""
        self._marked: Rows = np.zeros(1, np.int64)
        """Rows marked read (``mark_read``), in element 0 (the native walk clears marks)."""

    def __len__(self) -> int:
        return len(self._table)

    @property
    def nbytes(self) -> int:
        return self._table.nbytes + self._wide.nbytes + self._narrow.nbytes

    @property
    def offsets(self) -> Rows:
        return self._wide[:, _OFFSET]

    @property
    def sizes(self) -> Rows:
        """Per row: the object's bytes; NONE for a free row."""
        return self._wide[:, _SIZE]

    @property
    def borrows(self) -> Narrow:
        return self._narrow[:, _BORROWS]

    def find(self, digests: Digests) -> Rows:
        return self._table.find(digests)

    def find_one(self, digest: bytes) -> int:
        first, second = words(digest)
        return int(find_one(self._table.buckets, self._table.keys, first, second))

    def add(self, digests: Digests, offsets: Rows, sizes: Rows) -> Rows:
        """New objects, most recent last; NONE for a digest present already."""
        table = self._make_room(len(digests))
        out = np.empty(len(digests), np.int64)
        changes = np.full(len(digests), _ADD, np.int64)
        new_wide = np.stack([offsets, sizes], axis=1).astype(np.int64)
        args = (self._wide, self._narrow, self._ends, changes, digests, new_wide, out, self._entry)
        _settle(table.buckets, table.keys, table.meta, *args)
        return out

    def _make_room(self, num_new: int) -> DigestTable:
        table = self._table
        table.make_room(num_new)
        if table.capacity > len(self._wide):
            self._wide = grown(self._wide, table.capacity, NONE)
            self._narrow = grown(self._narrow, table.capacity)
        return table

    def touch(self, rows: Rows) -> None:
        """Make these rows the most recent, in order."""
        _touch(self._narrow, self._ends, rows)

    def touch_one(self, row: int) -> None:
        _touch_one(self._narrow, self._ends, row)

    def mark_read(self, rows: Rows) -> None:
        """These objects were read (a hit): ``second_chance`` passes them over once."""
        rows = np.unique(rows)
        self._marked[0] += len(rows) - np.count_nonzero(self._narrow[rows, _MARKS] & _READ)
        self._narrow[rows, _MARKS] |= _READ

    def was_read(self, row: int) -> bool:
        return bool(self._narrow[row, _MARKS] & _READ)

    def grant(self, rows: Rows, passes: int) -> None:
        """These objects are passed over ``passes`` times (0 to ``MAX_PASSES``) when they
        come round as the least recent, from now on and after each use (a touch, a
        read)."""
        if not 0 <= passes <= MAX_PASSES:
            raise ValueError(f"passes {passes} outside 0..{MAX_PASSES}")
        if len(rows) and passes:
            # What an object is worth is known only once its request's stores end: until
            # then it must not be the walk's first object without passes, so new objects
            # enter with the most.
            self._entry = MAX_PASSES * (_PASS + _GRANTED)
        narrow = self._narrow
        narrow[rows, _MARKS] = (narrow[rows, _MARKS] & _READ) | (passes * (_PASS + _GRANTED))

    def passes_left(self, row: int) -> int:
        return (int(self._narrow[row, _MARKS]) & _LEFT) // _PASS

    # A batch of puts defers its changes: one native call applies them all.

    def add_later(self, digest: bytes, offset: int, size: int) -> None:
        """``add_one`` at the next ``settle`` (``added_later`` knows it until then)."""
        self._later.append((_ADD, digest, offset, size))
        self._added_later.add(digest)

    def added_later(self, digest: bytes) -> bool:
        return digest in self._added_later

    def touch_later(self, row: int | None, digest: bytes = b"") -> None:
        """``touch_one(row)`` at the next ``settle``; None: the row of ``digest``, which
        ``add_later`` added."""
        self._later.append((_TOUCH_ADDED, digest, 0, 0) if row is None else (row, bytes(16), 0, 0))

    def settle(self) -> None:
        """Apply the deferred changes, in order."""
        if not self._later:
            return
        later, self._later = self._later, []
        table = self._make_room(len(self._added_later))
        self._added_later = set()
        changes = np.array([change[0] for change in later], np.int64)
        change_keys = digest_words(b"".join(change[1] or bytes(16) for change in later))
        change_wide = np.array([change[2:] for change in later], np.int64)
        args = (
            self._wide,
            self._narrow,
            self._ends,
            changes,
            change_keys,
            change_wide,
            np.empty(len(later), np.int64),
            self._entry,
        )
        num_present = _settle(table.buckets, table.keys, table.meta, *args)
        assert num_present == 0, f"{num_present} deferred adds found their key present"

    def remove(self, rows: Rows) -> None:
        """Forget these rows (each in use, each once)."""
        assert np.all(self.sizes[rows] >= 0), "a row not in use"
        self._marked[0] -= np.count_nonzero(self._narrow[rows, _MARKS] & _READ)
        _unlink_all(self._narrow, self._ends, self._wide, rows)
        self._table.release(rows)

    def oldest_unborrowed(self) -> int:
        """The least recently used row nobody borrows (see ``second_chance`` and
        ``grant``, which may reorder rows passed over); NONE if none. ``plain_lru``:
        neither passes anything over."""
        rereads = self.second_chance and not self.plain_lru
        max_marked = int(PROTECTED * len(self)) if rereads else -1
        args = (self._narrow, self._ends, self._marked, max_marked, not self.plain_lru)
        return int(_oldest_unborrowed(*args))

    def order(self) -> Rows:
        """Rows in use, least recently used first."""
        out = np.empty(len(self), np.int64)
        count = _order(self._narrow, self._ends[_HEAD], out)
        assert count == len(self), f"the LRU list holds {count} of {len(self)} rows"
        return out

    def digest(self, row: int) -> bytes:
        return self._table.digest(row)

    def digests(self, rows: Rows) -> Digests:
        return self._table.digests(rows)

    def check(self) -> None:
        """Raise AssertionError unless table, arrays and the LRU list agree."""
        self._table.check()
        in_use = np.flatnonzero(self.sizes >= 0)
        assert np.array_equal(in_use, self._table.rows()), "rows in use differ from the table's"
        order = self.order()
        assert np.array_equal(np.sort(order), in_use), "the LRU list holds other rows"
        if len(order):
            older, newer = self._narrow[:, _OLDER], self._narrow[:, _NEWER]
            assert older[order[0]] == NONE and newer[order[-1]] == NONE
            assert np.array_equal(older[order[1:]], order[:-1]), "links disagree"
        assert np.all(self.borrows[in_use] >= 0)
        marked = np.count_nonzero(self._narrow[in_use, _MARKS] & _READ)
        assert marked == self._marked[0], f"{self._marked[0]} rows counted read, {marked} marked"


def warm_up() -> None:
    """Compile (or load) the native loops now rather than on a tier's first put."""
    digest_table.warm_up()
    objects = LruObjects()
    rows = objects.add(digest_words(bytes(range(32))), np.zeros(2, np.int64), np.ones(2, np.int64))
    objects.find(digest_words(bytes(range(16))))
    objects.find_one(bytes(range(16)))
    objects.touch(rows[::-1].copy())
    objects.touch_one(int(rows[0]))
    objects.add_later(bytes(16), 0, 1)
    objects.touch_later(int(rows[0]))
    objects.touch_later(None, bytes(16))
    objects.settle()
    objects.oldest_unborrowed()
    objects.mark_read(rows)
    objects.grant(rows, 1)
    objects.second_chance = True
    objects.oldest_unborrowed()
    objects.order()
    objects.remove(objects.find(digest_words(bytes(16) + bytes(range(32)))))
