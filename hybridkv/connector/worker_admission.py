"""A rank's admissions: blocks the scheduler admits, sent on to the slower tiers.

Worker process (``Admission.REUSED``; ``connector.admission`` decides, on the
scheduler side). A block is sent on from the first tier at once, or, while this
worker still stores it, once that store is done (``TieredStore.admit_many``).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

from hybridkv.connector.metadata import BlockRef
from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.tiered.store import TieredStore


class WorkerAdmission:
    """Sends admitted blocks on; ``storing``: the keys of store jobs in flight."""

    def __init__(self, model_groups: ModelGroups, keys: KeyBuilder, store: TieredStore) -> None:
        self.model_groups = model_groups
        self.keys = keys
        self.store = store
        self._when_stored: dict[StoreKey, int] = {}
        """Keys admitted while their store was in flight -> their bytes."""

    def admit(self, refs: Sequence[BlockRef], storing: Container[StoreKey]) -> None:
        """Send these stored blocks on now, or those still being stored once their
        store is done (``stored``)."""
        keys: list[StoreKey] = []
        sizes: list[int] = []
        for group_id, block_hash in refs:
            key = self.keys.key(group_id, block_hash)
            size = self.model_groups.groups[group_id].block_bytes
            if key in storing:
                self._when_stored[key] = size
            else:
                keys.append(key)
                sizes.append(size)
        if keys:
            self.store.admit_many(keys, sizes)

    def stored(self, keys: Sequence[StoreKey], storing: Container[StoreKey]) -> None:
        """Stores of these keys ended: send on the admissions that waited for them
        (unless another store of the key still runs)."""
        waited = [k for k in keys if k in self._when_stored and k not in storing]
        ready = list(dict.fromkeys(waited))
        if ready:
            sizes = [self._when_stored.pop(key) for key in ready]
            self.store.admit_many(ready, sizes)

    def check_integrity(self, storing: Mapping[StoreKey, int]) -> None:
        assert self._when_stored.keys() <= storing.keys(), "admission left waiting"
