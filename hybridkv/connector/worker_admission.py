"""A rank's admissions: blocks the scheduler admits, sent on to the slower tiers.

Worker process (``Admission.REUSED``; ``connector.admission`` decides, on the
scheduler side). A step's admitted blocks go on together and in the order the
scheduler gives (a chain's last blocks first, every group's at each position:
the slower tiers evict what was written first, so a prefix loses its tail, not
its head or one group's blocks): at once, or, while this worker still stores
some of them, once those stores are done (``StackRetention.admit``).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from hybridkv.connector.metadata import BlockRef
from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.tiered.store import TieredStore


@dataclass
class _Batch:
    keys: list[StoreKey]
    sizes: list[int]
    waiting: set[StoreKey]
    """Keys whose store is still in flight."""


class WorkerAdmission:
    """Sends admitted blocks on; ``storing``: the keys of store jobs in flight."""

    def __init__(self, model_groups: ModelGroups, keys: KeyBuilder, store: TieredStore) -> None:
        self.model_groups = model_groups
        self.keys = keys
        self.store = store
        self._batches: list[_Batch] = []
        """Admissions waiting for stores, oldest first."""

    def admit(self, refs: Sequence[BlockRef], storing: Container[StoreKey]) -> None:
        """Send these stored blocks on, in this order: now, or once the stores of those
        still being stored are done (``stored``)."""
        if not refs:
            return
        keys = [self.keys.key(group_id, block_hash) for group_id, block_hash in refs]
        sizes = [self.model_groups.groups[group_id].block_bytes for group_id, _ in refs]
        batch = _Batch(keys, sizes, {key for key in keys if key in storing})
        if batch.waiting:
            self._batches.append(batch)
        else:
            self.store.retention.admit(keys, sizes)

    def stored(self, keys: Sequence[StoreKey], storing: Container[StoreKey]) -> None:
        """Stores of these keys ended: send on the admissions that waited only for them
        (a key another store still writes keeps waiting)."""
        if not self._batches:
            return
        done = {key for key in keys if key not in storing}
        ready = []
        for batch in self._batches:
            batch.waiting -= done
            if not batch.waiting:
                ready.append(batch)
        if ready:
            self._batches = [batch for batch in self._batches if batch.waiting]
            for batch in ready:
                self.store.retention.admit(batch.keys, batch.sizes)

    def check_integrity(self, storing: Mapping[StoreKey, int]) -> None:
        waiting = {key for batch in self._batches for key in batch.waiting}
        assert waiting <= storing.keys(), "admission left waiting"
