"""KV cache events for the blocks hybridkv's tiers hold, in vLLM 0.32's format.

vLLM's scheduler process. With events enabled (``--kv-events-config``), vLLM
publishes what ``HybridKVConnector.take_events`` returns in the same batches as
its own GPU events. Each block is named as vLLM names it on the GPU, so an
indexer can join the two: the engine's chained hash at the group's block size
(``request.block_hashes`` through ``maybe_convert_block_hash``), the hash of the
block before, its tokens, LoRA, extra keys, and the group's spec kind and window.
hybridkv's own block hashes (its store keys) never appear.

A name is taken from the vLLM request when the scheduler plans a store or a load
of the block, and kept until every tier announced the block (at most
``max_pending_tokens`` tokens of them, oldest out); the hash alone is kept while
some tier holds the block (bounded by ``connector.events``). Which tier holds
what comes from the workers' reports (``connector.events.TierEvents``).

Tiers are named as vLLM's own offloading connector names its tiers:

    tier              medium     locality   ownership
    cpu               "CPU"      None       None
    disk              "STORAGE"  "LOCAL"    "disk"
    valkey, mooncake  "STORAGE"  "REMOTE"   "valkey", "mooncake"
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from hybridkv.connector.events import EventSource, TierEvent, TierEvents
from hybridkv.connector.metadata import (
    BlockRef,
    BlockTransfer,
    ConnectorMetadata,
    LoadPlan,
    StorePlan,
    WorkerReport,
)
from hybridkv.integrations.vllm.served import ServedGroups

logger = logging.getLogger(__name__)

MAX_PENDING_TOKENS = 1 << 22
"""Tokens of the names kept for blocks some tier has still to announce."""


class GroupEvents(NamedTuple):
    """What the events of one KV cache group say about it, as vLLM's GPU events do."""

    block_size: int
    spec_kind: str | None
    sliding_window: int | None
    group_idx: int = 0
    """vLLM's id of the group (``ServedGroups``: hybridkv's ids skip unserved groups)."""


def group_events(kv_cache_config: Any, served: ServedGroups) -> tuple[GroupEvents, ...]:
    """Per group hybridkv serves, in its order, what its events say."""
    groups = []
    for group_idx in served.engine_group_ids:
        spec = kv_cache_config.kv_cache_groups[group_idx].kv_cache_spec
        kind = get_kv_cache_spec_kind(spec).value
        window = get_kv_cache_spec_sliding_window(spec)
        groups.append(GroupEvents(int(spec.block_size), kind, window, group_idx))
    return tuple(groups)


@dataclass(slots=True)
class _Name:
    """One block as vLLM's events name it."""

    block_hash: Any
    parent: Any
    token_ids: array[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None
    """As the engine hashed them (tagged); published untagged."""
    session_id: str | None


@dataclass(slots=True)
class _Announced:
    block_hash: Any
    tiers: int
    """The tiers its store was published for, one bit each."""


class BlockEvents:
    """The tiers' stored and removed blocks as vLLM's ``BlockStored``/``BlockRemoved``."""

    def __init__(
        self,
        groups: Sequence[GroupEvents],
        hash_block_size: int,
        sources: Sequence[EventSource],
        *,
        tiers: TierEvents | None = None,
        max_pending_tokens: int = MAX_PENDING_TOKENS,
    ) -> None:
        self.groups = tuple(groups)
        self.hash_block_size = hash_block_size
        self.sources = tuple(sources)
        self.max_pending_tokens = max_pending_tokens
        self.tiers = tiers or TierEvents()
        """Which rank holds what (every rank of the engine: ``EngineRanks.holders``)."""
        self.num_unnamed = 0
        """Blocks announced by a tier after their name was dropped: not published."""
        self._pending: OrderedDict[BlockRef, _Name] = OrderedDict()
        self._pending_tokens = 0
        self._announced: dict[BlockRef, _Announced] = {}

    # --- names, from the requests --------------------------------------------------

    def note_plans(self, meta: ConnectorMetadata, requests: Mapping[str, Any]) -> None:
        """Name the blocks of this step's stores and loads while their requests live."""
        plans: list[StorePlan | LoadPlan] = [*meta.stores, *meta.loads]
        for plan in plans:
            request = requests.get(plan.req_id)
            if request is not None:
                refresh = plan.refresh if isinstance(plan, StorePlan) else ()
                for transfer in (*plan.transfers, *refresh):
                    self._note(request, transfer)
        while self._pending_tokens > self.max_pending_tokens:
            self._pending_tokens -= len(self._pending.popitem(last=False)[1].token_ids)

    def _note(self, request: Any, transfer: BlockTransfer) -> None:
        block_size = self.groups[transfer.group_id].block_size
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        for block_hash, index in zip(transfer.block_hashes, transfer.block_indices, strict=True):
            ref = BlockRef(transfer.group_id, block_hash)
            if ref in self._pending:
                self._pending.move_to_end(ref)
            elif index < len(hashes):
                name = _name(request, hashes, index, block_size)
                self._pending[ref] = name
                self._pending_tokens += len(name.token_ids)

    # --- events, from the workers' reports -----------------------------------------

    def take_report(self, report: WorkerReport) -> None:
        self.tiers.take_report(report)

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The events since the last call, consecutive blocks of one source merged."""
        events: list[BlockStored | BlockRemoved] = []
        for event in self.tiers.take():
            if event.stored:
                self._stored(event, events)
            else:
                self._removed(event, events)
        return events

    def _stored(self, event: TierEvent, events: list[BlockStored | BlockRemoved]) -> None:
        ref = event.ref
        name = self._pending.get(ref)
        if name is None:
            if not self.num_unnamed:
                logger.warning(
                    "hybridkv KV events: a tier announced a block whose name was dropped "
                    "(more than %d tokens waiting for the slower tiers); not published",
                    self.max_pending_tokens,
                )
            self.num_unnamed += 1
            return
        announced = self._announced.setdefault(ref, _Announced(name.block_hash, 0))
        announced.tiers |= 1 << event.tier_index
        if announced.tiers == (1 << len(self.sources)) - 1:
            del self._pending[ref]
            self._pending_tokens -= len(name.token_ids)
        source, group = self.sources[event.tier_index], self.groups[ref.group_id]
        extra_keys = to_event_extra_keys([name.extra_keys])
        last = events[-1] if events else None
        if (
            isinstance(last, BlockStored)
            and _same_source(last, source, group.group_idx)
            and (last.lora_name, last.lora_id, last.session_id)
            == (name.lora_name, name.lora_id, name.session_id)
            and last.block_hashes[-1] == name.parent
            and last.extra_keys is not None
        ):
            last.block_hashes.append(name.block_hash)
            last.token_ids.extend(name.token_ids)
            last.extra_keys.extend(extra_keys or [None])
            return
        events.append(
            BlockStored(
                block_hashes=[name.block_hash],
                parent_block_hash=name.parent,
                token_ids=name.token_ids.tolist(),
                block_size=group.block_size,
                lora_id=name.lora_id,
                medium=source.medium,
                lora_name=name.lora_name,
                extra_keys=extra_keys,
                group_idx=group.group_idx,
                kv_cache_spec_kind=group.spec_kind,
                kv_cache_spec_sliding_window=group.sliding_window,
                locality=source.locality,
                ownership=source.ownership,
                session_id=name.session_id,
            )
        )

    def _removed(self, event: TierEvent, events: list[BlockStored | BlockRemoved]) -> None:
        ref = event.ref
        announced = self._announced.get(ref)
        tier = 1 << event.tier_index
        if announced is None or not announced.tiers & tier:
            return  # its store on this tier was never published
        announced.tiers &= ~tier
        if not announced.tiers:
            del self._announced[ref]
        source, group_idx = self.sources[event.tier_index], self.groups[ref.group_id].group_idx
        last = events[-1] if events else None
        if isinstance(last, BlockRemoved) and _same_source(last, source, group_idx):
            last.block_hashes.append(announced.block_hash)
            return
        events.append(
            BlockRemoved(
                block_hashes=[announced.block_hash],
                medium=source.medium,
                group_idx=group_idx,
                locality=source.locality,
                ownership=source.ownership,
            )
        )

    @property
    def num_names(self) -> int:
        """Blocks named and waiting for a tier to announce them."""
        return len(self._pending)

    def check_integrity(self) -> None:
        self.tiers.check_integrity()
        assert self._pending_tokens == sum(len(n.token_ids) for n in self._pending.values())
        all_tiers = (1 << len(self.sources)) - 1
        assert all(0 < a.tiers <= all_tiers for a in self._announced.values())
        assert len(self._announced) <= self.tiers.num_blocks


def _same_source(event: BlockStored | BlockRemoved, source: EventSource, group_id: int) -> bool:
    return (event.medium, event.locality, event.ownership, event.group_idx) == (
        source.medium,
        source.locality,
        source.ownership,
        group_id,
    )


def _name(request: Any, hashes: Any, index: int, block_size: int) -> _Name:
    """Block ``index`` of a group of ``block_size`` tokens, as ``BlockPool`` names it."""
    start, end = index * block_size, (index + 1) * block_size
    extra_keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    lora = request.lora_request
    return _Name(
        block_hash=maybe_convert_block_hash(hashes[index]),
        parent=maybe_convert_block_hash(hashes[index - 1]) if index else None,
        token_ids=array("q", request.all_token_ids[start:end]),
        lora_id=None if lora is None else lora.adapter_id,
        lora_name=None if lora is None else lora.name,
        extra_keys=extra_keys,
        session_id=getattr(request, "session_id", None),
    )
