"""Which blocks a step stores, and what the scheduler remembers of stores in flight.

Scheduler process; no I/O. Of the blocks a step completes, those a later hit
can read (each kind's ``stored_blocks`` rule: sliding windows keep the tail of
each aligned segment, Mamba only aligned states) are sent for storing once (a
recent block is not sent again), except blocks a worker reported dropped or
lost, or a lookup found in no tier, which may be sent again. Until every rank
confirms a block, it counts as stored for lookups (read-your-writes; the worker
loads it only after its store is done). Blocks the engine's own cache served a
request are stored again where they are admitted (``refresh``): the first tier
may have evicted them since. Groups whose states the engine hands over
(``StateHandoff``: states that do not stay at their block's position) store
exactly those states, from the blocks the engine named (``handoffs``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from hybridkv.connector.lookup import BoundedKeySet
from hybridkv.connector.metadata import BlockRef, BlockTransfer, RankReport, StorePlan
from hybridkv.connector.ranks import EngineRanks
from hybridkv.connector.requests import RequestState
from hybridkv.connector.steps import ScheduledRequest, StateHandoff
from hybridkv.groups import ModelGroups
from hybridkv.groups.kinds import rules_for
from hybridkv.keys import BlockHash, KeyBuilder

RECENT_STORES = 1 << 16
"""Blocks sent for storing recently: not sent again while remembered."""


class StorePlanner:
    def __init__(
        self,
        model_groups: ModelGroups,
        builder: KeyBuilder,
        ranks: EngineRanks,
        drafting: Sequence[bool] | None = None,
        handoff_group_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model_groups = model_groups
        self.handoff_group_ids = handoff_group_ids
        """Groups whose states are stored only as the engine hands them over: their
        blocks do not keep a state at their position (``StateHandoff``)."""
        self.drafting = tuple(drafting or (False,) * model_groups.num_groups)
        """Per group: hits drop its last block (EAGLE), so stores keep one block more."""
        self.builder = builder
        """Any rank's builder: block hashes are the same for every rank."""
        self.num_holders = ranks.num_holders()
        """Per group, the ranks that confirm each of its blocks (those with its layers)."""
        self._recent: BoundedKeySet[BlockRef] = BoundedKeySet(RECENT_STORES)
        self._storing: OrderedDict[BlockRef, int] = OrderedDict()
        """Blocks sent for storing -> ranks that have not confirmed them yet."""
        self._refreshable = all(
            rules_for(group.kind).blocks_stay_computed for group in model_groups.groups
        )

    def plan(
        self, st: RequestState, req: ScheduledRequest, alignment_tokens: int
    ) -> StorePlan | None:
        """The blocks of every group that this step of ``req`` completes (not sent yet);
        groups whose states the engine hands over are left to ``handoffs``."""
        start = req.num_computed_tokens
        if not req.replaces_block_ids:
            # Drafted tokens a step accepted were computed in it, past its end here (the
            # step's token ids had no drafts): their blocks are planned in the next step.
            start = min(start, st.planned_tokens)
        end = min(req.num_computed_tokens + req.num_scheduled_tokens, len(req.token_ids))
        st.planned_tokens = end
        if end <= start or not st.cacheable:
            return None
        st.hash_up_to(req.token_ids, end)
        transfers: list[BlockTransfer] = []
        for group_id, group in enumerate(self.model_groups.groups):
            if group_id in self.handoff_group_ids:
                continue
            ids = st.table.block_ids[group_id]
            rule = rules_for(group.kind)
            stored = rule.stored_blocks(
                group, start, end, alignment_tokens, self.drafting[group_id]
            )
            indices = [i for i in stored if i < len(ids) and ids[i] != 0]
            transfer = self._fresh(st, group_id, indices, [ids[i] for i in indices])
            if transfer is not None:
                transfers.append(transfer)
        if not transfers:
            return None
        return StorePlan(req_id=req.req_id, transfers=tuple(transfers))

    def handoffs(
        self, st: RequestState, handoffs: Sequence[StateHandoff], alignment_tokens: int
    ) -> tuple[list[BlockTransfer], int]:
        """The states the engine handed over that a later hit can read, each from the
        very block it named (not sent yet), and how many it handed over in vain: in a
        group it does not hand over for, before the tokens hashed so far, or off the
        hit alignment (no hit reads them)."""
        by_group: dict[int, dict[int, int]] = {}  # group -> block index -> block id
        num_unused = 0
        for handoff in handoffs:
            group_id, block_id, num_tokens = handoff
            if not self._usable(st, handoff, alignment_tokens):
                num_unused += 1
                continue
            index = num_tokens // self.model_groups.groups[group_id].block_size - 1
            by_group.setdefault(group_id, {})[index] = block_id
        transfers = []
        for group_id, blocks in sorted(by_group.items()):
            indices = sorted(blocks)
            transfer = self._fresh(st, group_id, indices, [blocks[i] for i in indices])
            if transfer is not None:
                transfers.append(transfer)
        return transfers, num_unused

    def _usable(self, st: RequestState, handoff: StateHandoff, alignment_tokens: int) -> bool:
        group_id, block_id, num_tokens = handoff
        return (
            st.cacheable
            and group_id in self.handoff_group_ids
            and block_id != 0
            and 0 < num_tokens <= st.hasher.num_tokens
            and num_tokens % alignment_tokens == 0
            and num_tokens % self.model_groups.groups[group_id].block_size == 0
        )

    def _fresh(
        self, st: RequestState, group_id: int, indices: Sequence[int], block_ids: Sequence[int]
    ) -> BlockTransfer | None:
        """The blocks at ``indices`` of the request's group, held in ``block_ids``, that
        were not sent recently; noted as storing."""
        if not indices:
            return None
        hashes = self.builder.block_hashes(group_id, st.hasher.block_hashes, indices)
        fresh = [n for n, h in enumerate(hashes) if BlockRef(group_id, h) not in self._recent]
        if not fresh:
            return None
        refs = [BlockRef(group_id, hashes[n]) for n in fresh]
        self._recent.add_many(refs)
        self._note_storing(refs)
        return make_transfer(
            group_id,
            [hashes[n] for n in fresh],
            [block_ids[n] for n in fresh],
            [indices[n] for n in fresh],
        )

    def refresh(
        self,
        st: RequestState,
        req: ScheduledRequest,
        admitted: Collection[BlockRef],
        alignment_tokens: int,
    ) -> tuple[BlockTransfer, ...]:
        """Of the blocks admitted at the step that hands over a request's whole table,
        those the engine's own cache served it (``StorePlan.refresh``). Another request
        stored them, and the first tier may have evicted them since. Only where every
        group's blocks keep their KV (a hit needs every group)."""
        cached = min(st.engine_cached_tokens, req.num_computed_tokens)
        if not (admitted and req.replaces_block_ids and cached and self._refreshable):
            return ()
        transfers: list[BlockTransfer] = []
        for group_id, group in enumerate(self.model_groups.groups):
            ids = st.table.block_ids[group_id]
            rule = rules_for(group.kind)
            stored = rule.stored_blocks(group, 0, cached, alignment_tokens, self.drafting[group_id])
            indices = [i for i in stored if i < len(ids) and ids[i] != 0]
            hashes = self.builder.block_hashes(group_id, st.hasher.block_hashes, indices)
            keep = [n for n, h in enumerate(hashes) if BlockRef(group_id, h) in admitted]
            if keep:
                served = make_transfer(group_id, hashes, [ids[i] for i in indices], indices)
                transfers.append(served.picked(keep))
        return tuple(transfers)

    def is_storing(self, ref: BlockRef) -> bool:
        return ref in self._storing

    @property
    def num_blocks_storing(self) -> int:
        """Blocks sent for storing that some rank has not confirmed yet."""
        return len(self._storing)

    def take_report(self, report: RankReport) -> None:
        for ref in report.stored:
            left = self._storing.get(ref)
            if left is not None and left <= 1:
                del self._storing[ref]
            elif left is not None:
                self._storing[ref] = left - 1
        # Dropped or lost blocks may be stored again when a request computes them.
        for ref in (*report.dropped, *report.missing):
            self._storing.pop(ref, None)
        self._recent.discard_many(report.dropped)
        self._recent.discard_many(report.missing)

    def forget_sent(self, refs: Sequence[BlockRef]) -> None:
        """Blocks a lookup found in no tier (a pool restarted empty, files removed,
        evicted): send them again when a request computes them."""
        self._recent.discard_many(refs)

    def _note_storing(self, refs: Sequence[BlockRef]) -> None:
        for ref in refs:
            self._storing[ref] = self.num_holders[ref.group_id]
            self._storing.move_to_end(ref)
        while len(self._storing) > RECENT_STORES:
            self._storing.popitem(last=False)


def make_transfer(
    group_id: int, hashes: Sequence[BlockHash], block_ids: Sequence[int], indices: Sequence[int]
) -> BlockTransfer:
    return BlockTransfer(
        group_id=group_id,
        block_hashes=tuple(hashes),
        block_ids=tuple(block_ids),
        block_indices=tuple(indices),
    )
