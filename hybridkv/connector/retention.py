"""A rank's retention policy: what decides which stored blocks outlive the others.

Worker process (one per rank). ``eviction_order`` names the policy, one class
each in ``POLICIES``; every policy drives the tier stack through the one
interface it has for this (``TieredStore.retention``: ``tiers.retention``,
``tiers.tiered.retention``):

* the order blocks age in: with ``lru`` as each was stored or read; with
  ``chain`` (and ``worth``) a request's blocks touched as a chain, last block
  first, whenever some were stored or loaded (``connector.recency``);
* how long a chain outlives others: with ``worth`` the passes its prefill
  saved per byte earns (``connector.worth``);
* the stack's mode for each step (``StackMode``), which the scheduler sets
  (``connector.returns``), and the blocks it admits, sent on to the slower
  tiers once their stores are done (``connector.worker_admission``).

The scheduler's half of the same decisions (what is admitted, which mode) is
``connector.admission``; docs/ARCHITECTURE.md draws both.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import ClassVar

from hybridkv.connector.metadata import BlockRef
from hybridkv.connector.recency import ChainRecency
from hybridkv.connector.worker_admission import WorkerAdmission
from hybridkv.connector.worth import ChainWorth
from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder
from hybridkv.tiers.base import StoreKey
from hybridkv.tiers.retention import StackMode
from hybridkv.tiers.tiered.store import TieredStore


class EvictionOrder(enum.Enum):
    """The names of the retention policies (``eviction_order``)."""

    CHAIN = "chain"
    """A request's blocks age as a chain: its last blocks are evicted first."""
    LRU = "lru"
    """Plain recency: each block as it was stored or read (its first blocks go first)."""
    WORTH = "worth"
    """Chain order, and a chain that saves more prefill per byte held stays longer."""


class RetentionPolicy:
    """What every policy does: pass on the step's mode and the admitted blocks. What a
    request's blocks tell the tiers beyond that is each policy's own (``POLICIES``).

    Call from the worker's one thread. The worker tells it of a request's blocks
    (``holds``), of its stores (``store_started``, ``store_ended``) and loads
    (``touched``), and after each poll ``touch_changed`` passes on what changed.
    """

    order: ClassVar[EvictionOrder]

    def __init__(self, model_groups: ModelGroups, keys: KeyBuilder, store: TieredStore) -> None:
        self.model_groups = model_groups
        self.store = store
        self._admission = WorkerAdmission(model_groups, keys, store)

    def holds(
        self, req_id: str, group_id: int, block_indices: Sequence[int], keys: Sequence[StoreKey]
    ) -> None:
        """The request's blocks of one group at these indices are being stored or loaded."""

    def store_started(self, req_id: str) -> None:
        """A store job of the request was submitted."""

    def store_ended(self, req_id: str) -> None:
        """A store job of the request ended (written or not)."""

    def touched(self, req_id: str) -> None:
        """Blocks of the request were loaded."""

    def finish(self, req_ids: Iterable[str]) -> None:
        """The engine is done with these requests (their stores may still run)."""

    def touch_changed(self) -> None:
        """After a poll: tell the tiers what the stores and loads since changed."""

    def use_mode(self, mode: StackMode) -> None:
        """The scheduler's mode for this step (``ConnectorWorker.save`` says when)."""
        self.store.retention.use_mode(mode)

    def admit(self, refs: Sequence[BlockRef], storing: Container[StoreKey]) -> None:
        """Send these stored blocks on to the slower tiers (``Admission.REUSED``): now, or
        those of ``storing`` (stores in flight) once their store is done."""
        self._admission.admit(refs, storing)

    def stored(self, keys: Sequence[StoreKey], storing: Container[StoreKey]) -> None:
        """Stores of these keys ended; ``storing``: the keys still in flight."""
        self._admission.stored(keys, storing)

    def check_integrity(self, storing: Mapping[StoreKey, int]) -> None:
        self._admission.check_integrity(storing)


POLICIES: dict[EvictionOrder, type[RetentionPolicy]] = {}
"""The retention policy of each ``eviction_order``."""


def register(
    order: EvictionOrder,
) -> Callable[[type[RetentionPolicy]], type[RetentionPolicy]]:
    """Class decorator: the policy for ``order``."""

    def add(cls: type[RetentionPolicy]) -> type[RetentionPolicy]:
        if order in POLICIES:
            raise ValueError(f"eviction_order {order.value!r} has a policy already")
        cls.order = order
        POLICIES[order] = cls
        return cls

    return add


@register(EvictionOrder.LRU)
class LruPolicy(RetentionPolicy):
    """Plain recency: the tiers order each block as it was stored or read, and hear
    nothing of chains."""


@register(EvictionOrder.CHAIN)
class ChainPolicy(RetentionPolicy):
    """A request's blocks age as a chain: after each poll in which some were stored or
    loaded, all of them are touched last block first (``ChainRecency``)."""

    def __init__(self, model_groups: ModelGroups, keys: KeyBuilder, store: TieredStore) -> None:
        super().__init__(model_groups, keys, store)
        block_sizes = [group.block_size for group in model_groups.groups]
        self.chains = ChainRecency(block_sizes, self._worth())
        """Per request, its blocks to touch in chain order."""

    def _worth(self) -> ChainWorth | None:
        """What gives a chain passes (None: chain order alone)."""
        return None

    def holds(
        self, req_id: str, group_id: int, block_indices: Sequence[int], keys: Sequence[StoreKey]
    ) -> None:
        self.chains.add(req_id, group_id, block_indices, keys)

    def store_started(self, req_id: str) -> None:
        self.chains.start_store(req_id)

    def store_ended(self, req_id: str) -> None:
        self.chains.end_store(req_id)

    def touched(self, req_id: str) -> None:
        self.chains.touched(req_id)

    def finish(self, req_ids: Iterable[str]) -> None:
        self.chains.finish(req_ids)

    def touch_changed(self) -> None:
        """Each request whose blocks were stored or loaded since the last poll: all of its
        blocks, one batch, head last (most recent), with the chain's passes."""
        for keys, passes in self.chains.take_orders():
            self.store.retention.touch(keys, passes)

    def check_integrity(self, storing: Mapping[StoreKey, int]) -> None:
        super().check_integrity(storing)
        self.chains.check_integrity()


@register(EvictionOrder.WORTH)
class WorthPolicy(ChainPolicy):
    """Chain order, and each chain's touch gives its blocks the passes its prefill saved
    per byte held earns (``ChainWorth``)."""

    def _worth(self) -> ChainWorth:
        return ChainWorth.for_groups(self.model_groups)


def policy_for(
    order: EvictionOrder, model_groups: ModelGroups, keys: KeyBuilder, store: TieredStore
) -> RetentionPolicy:
    """The retention policy ``eviction_order`` names, for one rank's store."""
    return POLICIES[order](model_groups, keys, store)
