"""WriteBack alone: copies and borrowed views in one queue, one thread, one byte budget."""

from __future__ import annotations

import threading

import numpy as np

from hybridkv.tiers.base import Buffer, StoreKey
from hybridkv.tiers.tiered.write_back import WriteBack


def key(i: int) -> StoreKey:
    return StoreKey(f"test/write-back/{i}")


class Lower:
    """Where the queue writes: a dict, behind a gate the test opens."""

    def __init__(self) -> None:
        self.written: dict[StoreKey, bytes] = {}
        self.released: list[StoreKey] = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def write(self, keys: list[StoreKey], views: list[Buffer]) -> int:
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        self.written.update((k, view.tobytes()) for k, view in zip(keys, views, strict=True))
        return 0


def test_copies_and_borrowed_views_share_one_queue_and_budget() -> None:
    lower = Lower()
    write_back = WriteBack(lower.write, lower.released.extend, capacity_bytes=4096)
    views = [np.full(1200, i, dtype=np.uint8) for i in range(4)]  # three fit in 4096 bytes
    assert write_back.submit_borrowed_many([key(0)], views[:1]) == [True]
    assert lower.entered.wait(30)  # key 0 in flight, waiting at the gate
    assert write_back.submit_many([key(1)], views[1:2]) == [True]
    views[1][:] = 99  # the caller reuses its buffer: the queue copied it
    answers = write_back.submit_borrowed_many(
        [key(2), key(0), key(3)], [views[2], views[0], views[3]]
    )
    assert answers == [True, True, False]  # key 0 queued already; key 3 past the budget
    assert lower.released == [key(0), key(3)], "borrows not kept are released at once"
    write_back.check_integrity()
    lower.gate.set()
    assert write_back.flush(30)
    assert lower.written == {k: bytes([i]) * 1200 for i, k in enumerate(map(key, range(3)))}
    assert sorted(lower.released) == sorted([key(0), key(3), key(0), key(2)])
    stats = write_back.snapshot()
    counts = (stats.num_queued, stats.num_copied, stats.num_written, stats.num_skipped)
    assert counts == (3, 1, 3, 1)
    write_back.check_integrity()
    write_back.close(30)


def test_cancel_and_close_release_the_borrows_they_drop() -> None:
    lower = Lower()
    write_back = WriteBack(lower.write, lower.released.extend, capacity_bytes=1 << 20)
    views = [np.full(100, i, dtype=np.uint8) for i in range(4)]
    write_back.submit_borrowed_many([key(0)], views[:1])
    assert lower.entered.wait(30)
    write_back.submit_borrowed_many([key(1), key(2)], views[1:3])
    write_back.submit_many([key(3)], views[3:])
    write_back.cancel([key(1)])
    assert lower.released == [key(1)]
    write_back.close(timeout_s=0.1)  # key 0 stays in flight behind the gate
    assert lower.released == [key(1), key(2)]
    assert write_back.snapshot().num_skipped == 2  # keys 2 and 3 dropped at close
    lower.gate.set()
    assert write_back.flush(30)
    assert lower.released == [key(1), key(2), key(0)] and list(lower.written) == [key(0)]
    write_back.check_integrity()


def test_past_the_borrow_limit_views_are_copied_and_their_borrows_released() -> None:
    """Borrowed views pin the first tier: past the limit the queue copies instead, so the
    first tier can evict those blocks for new stores while the slower tiers lag."""
    lower = Lower()
    write_back = WriteBack(
        lower.write, lower.released.extend, capacity_bytes=1 << 20, borrow_limit_bytes=250
    )
    views = [np.full(100, i, dtype=np.uint8) for i in range(4)]
    assert write_back.submit_borrowed_many([key(i) for i in range(4)], views) == [True] * 4
    assert lower.released == [key(2), key(3)], "two views fit the limit; two were copied"
    for view in views:
        view[:] = 77  # the first tier reuses the copied ones' memory at once
    lower.gate.set()
    assert write_back.flush(30)
    assert lower.written[key(2)] == bytes([2]) * 100 and lower.written[key(3)] == bytes([3]) * 100
    assert write_back.snapshot().num_copied == 2
    assert sorted(lower.released) == sorted(map(key, range(4)))
    write_back.check_integrity()
    write_back.close(30)
