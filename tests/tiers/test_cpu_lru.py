"""LruObjects against an OrderedDict (hypothesis): adds, touches, borrows and removals;
the rows found, their fields, the order of use and the oldest unborrowed object."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.tiers.cpu_lru import LruObjects
from hybridkv.tiers.digest_table import NONE, digest_words

NUM_KEYS = 24


def digest(i: int) -> bytes:
    """Few homes: the first word takes four values, so probe runs share buckets."""
    return (i % 4).to_bytes(8, "little") + i.to_bytes(8, "little")


keys = st.lists(st.integers(0, NUM_KEYS - 1), min_size=1, max_size=8)
ops = st.lists(st.tuples(st.sampled_from(["add", "touch", "borrow", "remove"]), keys), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_objects_follow_an_ordered_dict(steps: list[tuple[str, list[int]]]) -> None:
    objects = LruObjects()
    model: OrderedDict[int, tuple[int, int, int]] = OrderedDict()  # key -> offset, size, borrows
    for step, (op, batch) in enumerate(steps):
        rows = objects.find(digest_words(b"".join(map(digest, batch))))
        if op == "add":
            offsets = np.array([1000 * step + j for j in range(len(batch))], np.int64)
            sizes = offsets % 97
            added = objects.add(digest_words(b"".join(map(digest, batch))), offsets, sizes)
            for i, row, offset, size in zip(batch, added, offsets, sizes, strict=True):
                assert (row == NONE) == (i in model)
                if i not in model:
                    model[i] = (int(offset), int(size), 0)
        elif op == "touch":
            present = [(i, row) for i, row in zip(batch, rows, strict=True) if row >= 0]
            objects.touch(np.array([row for _, row in present], np.int64))
            for i, _ in present:
                model.move_to_end(i)
        elif op == "borrow":
            for i, row in zip(batch, rows, strict=True):
                if row >= 0:
                    objects.borrows[row] += 1
                    offset, size, borrows = model[i]
                    model[i] = (offset, size, borrows + 1)
        else:
            gone = {i: row for i, row in zip(batch, rows, strict=True) if row >= 0}
            objects.remove(np.array(list(gone.values()), np.int64))
            for i in gone:
                del model[i]
        order = objects.order()
        assert [objects.digest(row) for row in order] == [digest(i) for i in model]
        fields = zip(
            objects.offsets[order], objects.sizes[order], objects.borrows[order], strict=True
        )
        assert [tuple(map(int, f)) for f in fields] == list(model.values())
        oldest = next((i for i, (_, _, borrows) in model.items() if not borrows), None)
        found = objects.oldest_unborrowed()
        assert (found == NONE) if oldest is None else objects.digest(found) == digest(oldest)
        assert len(objects) == len(model)
        objects.check()
