"""Which stored blocks the slower tiers receive (``Admission.REUSED``).

Scheduler process. Each request's chain of block hashes is noted once, as it
is looked up and as its steps extend it; a hash another request noted first
(``SeenHashes``: bounded, oldest forgotten first) means the prefix it ends was
reached twice: a prefix several requests share, or one that came back. So is
a prefix a request loads, and one another engine sharing the pool reached
(``connector.sightings``, where the pool can mark hashes). Blocks within a
request's shared prefix are admitted: those its own steps store, and those
other requests stored before, once this request's steps reach them (the
engine's own cache may have served them). Decisions go by the prefix, never
by block: every group's blocks up to a boundary are admitted together, as a
hit needs all of them. The same counts give the tier stack's mode for each
step (``mode``, ``connector.returns``); keeping the slower tiers is only
considered with ``admission_keep_slower``.
"""

from __future__ import annotations

import numpy as np

from hybridkv.connector.metadata import BlockRef, StorePlan
from hybridkv.connector.requests import RequestState
from hybridkv.connector.returns import KeptReturns, ReturnShare
from hybridkv.connector.seen import NOT_SEEN, SeenHashes
from hybridkv.connector.sightings import PoolSightings
from hybridkv.connector.steps import ScheduledRequest
from hybridkv.groups import ModelGroups
from hybridkv.keys import KeyBuilder
from hybridkv.tiers.admission import Admission
from hybridkv.tiers.retention import StackMode

DEFAULT_SEEN_HASHES = 1 << 20
"""Hashes remembered by default: 29 MiB (``connector.seen``)."""
SEEN = 1
"""A request's chain reached the hash."""
RETURNED = 2
"""A second request's chain reached it (``connector.returns``)."""
ADMITTED = 3
"""The blocks ending at the hash were sent to be admitted."""


class AdmissionTracker:
    """Notes requests' chains and names the blocks each step admits."""

    def __init__(
        self,
        model_groups: ModelGroups,
        builder: KeyBuilder,
        *,
        capacity: int,
        sightings: PoolSightings | None = None,
        keeps: bool = False,
    ) -> None:
        self.model_groups = model_groups
        self.builder = builder
        """Any rank's builder: block hashes are the same for every rank."""
        self.seen = SeenHashes(capacity)
        self.sightings = sightings
        """Where hashes this engine sees for the first time are marked for other engines."""
        self.returns = ReturnShare(model_groups.hash_block_size)
        """Whether first sightings come back: if most do, the tiers go plain LRU."""
        self.kept = KeptReturns() if keeps else None
        """Whether the tiers keep what comes back: if most is lost, the slower tiers
        keep what they hold (None: they never do, ``admission_keep_slower`` off)."""
        self.held = SeenHashes(max(1, capacity // 8))
        """Hashes first seen while the slower tiers kept what they held: what they did
        not take."""

    @classmethod
    def if_needed(
        cls,
        admission: Admission,
        model_groups: ModelGroups,
        builder: KeyBuilder,
        num_tiers: int,
        capacity: int,
        sightings: PoolSightings | None = None,
        *,
        keeps: bool = False,
    ) -> AdmissionTracker | None:
        """A tracker for ``Admission.REUSED`` over several tiers; None where every stored
        block reaches every tier (``Admission.ALL``, or one tier)."""
        if admission is not Admission.REUSED or num_tiers <= 1:
            return None
        return cls(model_groups, builder, capacity=capacity, sightings=sightings, keeps=keeps)

    def note(self, st: RequestState) -> None:
        """The request's hashes not noted yet; those another request noted first (here,
        or in another engine sharing the pool) make the prefix up to the last of them
        shared."""
        chain = st.hasher.block_hashes
        new = chain[st.num_noted :]
        before = self.seen.sight(new, SEEN, RETURNED)  # a second sighting: RETURNED
        returned = before == SEEN
        first = np.flatnonzero(before == NOT_SEEN)
        if len(first) and self.mode is StackMode.KEEP_SLOWER:
            self.held.raise_to([new[k] for k in first], SEEN)
        if len(first) and self.sightings is not None:
            elsewhere = first[self.sightings.sight([new[k] for k in first])]
            returned[elsewhere] = True
            before[elsewhere] = SEEN
        again = np.flatnonzero(before >= SEEN)
        if len(again):
            st.shared_hashes = max(st.shared_hashes, st.num_noted + int(again[-1]) + 1)
        self.returns.noted(len(new) - len(again), int(np.count_nonzero(returned)))
        st.num_noted = len(chain)

    @property
    def mode(self) -> StackMode:
        """``PLAIN_LRU`` while most first sightings come back (the tiers take every store
        and evict by recency alone); else ``KEEP_SLOWER`` while most returns lately were
        lost (the slower tiers take only free room); else ``OWN_RULES``
        (``connector.returns``)."""
        if self.returns.plain_lru:
            return StackMode.PLAIN_LRU
        if self.kept is not None and self.kept.keep_slower:
            return StackMode.KEEP_SLOWER
        return StackMode.OWN_RULES

    def looked_up(self, st: RequestState, engine_tokens: int, hit_tokens: int) -> None:
        """The tiers were asked for the request: once per request with a shared prefix
        beyond the engine's own cache, whether they hit any of it."""
        shared_tokens = st.shared_hashes * self.model_groups.hash_block_size
        if self.kept is None or st.return_judged or shared_tokens <= engine_tokens:
            return
        st.return_judged = True
        if hit_tokens > engine_tokens:
            self.kept.judged(lost=False, held_back=False)
            return
        last = st.hasher.block_hashes[st.shared_hashes - 1]
        self.kept.judged(lost=True, held_back=bool(self.held.levels([last])[0]))

    def loaded(self, st: RequestState, num_tokens: int) -> None:
        """The request loads its first ``num_tokens`` tokens from the tiers."""
        num_hashes = num_tokens // self.model_groups.hash_block_size
        st.shared_hashes = max(st.shared_hashes, num_hashes)

    def admits(
        self, st: RequestState, req: ScheduledRequest, plan: StorePlan | None
    ) -> list[BlockRef]:
        """The blocks to admit after the step ``req`` of the request, which stores
        ``plan``: its stores within the shared prefix, and every group's blocks there,
        up to where the step reached, not admitted yet (whoever stored them). The
        chain's last blocks come first, every group's at each position: the slower
        tiers evict what they took first, so the prefix loses its tail first."""
        self.note(st)  # the tokens this step hashed
        reached_tokens = min(req.num_computed_tokens + req.num_scheduled_tokens, len(req.token_ids))
        refs: dict[BlockRef, int] = {}  # -> the hashes the block ends at
        for t in () if plan is None else plan.transfers:
            m = self.builder.hashes_per_block(t.group_id)
            for index, block_hash in zip(t.block_indices, t.block_hashes, strict=True):
                if (index + 1) * m <= st.shared_hashes:
                    refs[BlockRef(t.group_id, block_hash)] = (index + 1) * m
        reached = reached_tokens // self.model_groups.hash_block_size
        end = min(st.shared_hashes, reached, len(st.hasher.block_hashes))
        if end > st.admitted_hashes:
            refs.update(self._not_admitted(st, end))
            st.admitted_hashes = end
        return sorted(refs, key=lambda ref: (-refs[ref], ref.group_id))

    def _not_admitted(self, st: RequestState, end: int) -> dict[BlockRef, int]:
        """Every group's blocks ending in hashes [admitted_hashes, end) of the request's
        chain that no request admitted yet (those are admitted now) -> the hashes each
        ends at."""
        start, chain = st.admitted_hashes, st.hasher.block_hashes
        before = self.seen.raise_to(chain[start:end], ADMITTED)
        fresh = [start + int(k) for k in np.flatnonzero(before < ADMITTED)]
        refs = {}
        for group_id in range(self.model_groups.num_groups):
            m = self.builder.hashes_per_block(group_id)
            refs.update({BlockRef(group_id, chain[k]): k + 1 for k in fresh if (k + 1) % m == 0})
        return refs
