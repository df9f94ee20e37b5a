"""A batch's objects cut into runs of consecutive slots, and a get's runs into tasks.

Runs wherever a disk tier runs, on the calling thread; no I/O, no state. A run
(objects in consecutive slots of one segment) is written with one ``pwritev``
and read with one native call; a get's tasks are one per I/O thread.
"""

from __future__ import annotations

from hybridkv.tiers.disk.records import Entry, Reservation

MIN_PART_BYTES = 1 << 20
"""A get is cut into tasks for its I/O threads of at least this size."""


def follows(last: Entry | Reservation | None, this: Entry | Reservation) -> bool:
    """Whether ``this`` is in the slot after ``last``'s, in the same segment."""
    return last is not None and last.segment is this.segment and last.slot + 1 == this.slot


def runs(reservations: list[Reservation]) -> list[list[Reservation]]:
    """Reservations grouped into runs of consecutive slots of one segment."""
    grouped: list[list[Reservation]] = []
    for r in sorted(reservations, key=lambda r: (r.segment.seq, r.slot)):
        if follows(grouped[-1][-1] if grouped else None, r):
            grouped[-1].append(r)
        else:
            grouped.append([r])
    return grouped


def read_tasks(
    found: list[tuple[int, Entry]], num_tasks: int
) -> list[list[list[tuple[int, Entry]]]]:
    """(item, entry) pairs of a get cut into up to ``num_tasks`` tasks of similar bytes,
    one per I/O thread; a task is a list of runs of consecutive slots of one segment
    (a run cut where one task ends goes on in the next). One task per thread, not one
    per run: with a task per run, a run of two objects at a segment's end was a task
    of its own, and one thread often read both big ones after it."""
    ordered = sorted(found, key=lambda pair: (pair[1].segment.seq, pair[1].slot))
    total = sum(entry.length for _, entry in ordered)
    num_tasks = max(1, min(num_tasks, len(ordered), total // MIN_PART_BYTES))
    tasks: list[list[list[tuple[int, Entry]]]] = [[] for _ in range(num_tasks)]
    before = 0
    for item, entry in ordered:
        # Empty objects after the last byte go with the last task.
        task = tasks[min(before * num_tasks // total, num_tasks - 1)] if total else tasks[0]
        if follows(task[-1][-1][1] if task else None, entry):
            task[-1].append((item, entry))
        else:
            task.append([(item, entry)])
        before += entry.length
    return [task for task in tasks if task]
