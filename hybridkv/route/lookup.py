"""How many tokens of a prompt an engine would load from its tiers, asked from outside it.

Any process that can read an engine's card (``connector.card``) and reach its
tiers: a router, or ``hybridkv route serve``. ``EngineLookup`` opens lookup-only
instances of the tiers this process can see (the connector's ``build_lookup``,
as a scheduler in another process than its workers does) and runs the
scheduler's own search (``HitSearch``) with the engine's groups, alignment,
drafting and hash settings: the hit it reports is the one the engine's
scheduler finds for the same tokens, as long as both see the same tiers.
Tiers private to the engine's processes (CPU memory) are read from the events
the engine publishes, when it publishes them and this process follows them
(``route.events``); then so is the engine's own prefix cache. Otherwise they
answer as misses (``TierHit.visible`` False).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.connector.card import EngineCard
from hybridkv.connector.events import event_source
from hybridkv.connector.lookup import LookupView
from hybridkv.connector.search import HitSearch
from hybridkv.connector.setup import EngineFacts, build_lookup, engine_ranks
from hybridkv.hits import Contains, Hit
from hybridkv.keys import BlockHash, RequestBlockHasher, encode_token_ids
from hybridkv.route.events import DEVICE, EventIndex, PromptBlocks
from hybridkv.tiers.base import StoreKey, Tier
from hybridkv.tiers.registry import TierConfig
from hybridkv.tiers.selection import Selection, pick_whole_request_tier


@dataclass(frozen=True, kw_only=True, eq=False)
class HitQuery:
    """A prompt: its token ids (hashed with each engine's settings, its ``cache_salt``
    and ``lora_name``), or the chained block hashes already computed with the
    engine's (``num_tokens``: the prompt's length; default the tokens the hashes
    cover, which may under-count one hit block when the prompt is longer)."""

    token_ids: Sequence[int] | npt.NDArray[np.integer] | None = None
    """Kept as little-endian int64 (TypeError or ValueError for anything else)."""
    block_hashes: Sequence[BlockHash] | None = None
    num_tokens: int | None = None
    cache_salt: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if (self.token_ids is None) == (self.block_hashes is None):
            problems.append("give either token_ids or block_hashes, not both nor neither")
        if self.block_hashes is not None and (self.cache_salt or self.lora_name):
            problems.append(
                "cache_salt and lora_name enter the block hashes: give them with token_ids "
                "only (block_hashes already include them)"
            )
        if self.token_ids is not None and self.num_tokens is not None:
            problems.append("num_tokens goes with block_hashes; token_ids give their length")
        if self.num_tokens is not None and self.num_tokens < 0:
            problems.append(f"num_tokens={self.num_tokens} must be >= 0")
        if problems:
            raise ValueError("; ".join(problems))
        if self.token_ids is not None:  # checked and encoded once, hashed per engine
            object.__setattr__(self, "token_ids", encode_token_ids(self.token_ids))


@dataclass(frozen=True, kw_only=True)
class TierHit:
    """The hit one tier alone would give (every rank's copy of that tier)."""

    tier_index: int
    kind: str
    visible: bool
    """False: private to the engine's processes (CPU memory) and no events of the engine
    followed (or a query without token ids): answered as a miss here."""
    via_events: bool = False
    """Read from the engine's KV events, not from the tier itself."""
    hit_tokens: int
    load_bytes_per_rank: int


@dataclass(frozen=True, kw_only=True)
class EngineHits:
    """One engine's answer: the hit its scheduler would find, per tier and over all."""

    engine: str
    num_tokens: int
    hit_tokens: int
    """What the scheduler finds over every visible tier (per-block selection), or from
    the one tier whole-request selection picks."""
    load_bytes_per_rank: int
    """Bytes each rank reads to load that hit (each block of every group it needs)."""
    tp_size: int
    tier_index: int | None
    """The tier whole-request selection picks; None: per block, the cheapest holding it."""
    tiers: tuple[TierHit, ...]
    device_hit_tokens: int | None = None
    """The engine's own prefix cache's hit, from its events; None: not followed."""

    @property
    def load_bytes(self) -> int:
        return self.load_bytes_per_rank * self.tp_size

    @property
    def usable_tokens(self) -> int:
        """What the engine would not compute: its own cache's hit or the tiers', the longer."""
        return max(self.hit_tokens, self.device_hit_tokens or 0)

    @property
    def complete(self) -> bool:
        """Every tier was visible: a private tier may only add to ``hit_tokens``."""
        return all(tier.visible for tier in self.tiers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "num_tokens": self.num_tokens,
            "hit_tokens": self.hit_tokens,
            "load_bytes": self.load_bytes,
            "load_bytes_per_rank": self.load_bytes_per_rank,
            "tp_size": self.tp_size,
            "tier_index": self.tier_index,
            "complete": self.complete,
            "device_hit_tokens": self.device_hit_tokens,
            "usable_tokens": self.usable_tokens,
            "tiers": [
                {
                    "tier_index": t.tier_index,
                    "kind": t.kind,
                    "visible": t.visible,
                    "via_events": t.via_events,
                    "hit_tokens": t.hit_tokens,
                    "load_bytes_per_rank": t.load_bytes_per_rank,
                    "load_bytes": t.load_bytes_per_rank * self.tp_size,
                }
                for t in self.tiers
            ],
        }


class _VisibleTiers:
    """Every rank's tiers this process can see, answering as the scheduler's
    ``KeyLookup`` does when nothing was reported: a tier it cannot see holds nothing.
    Remembers each tier's answers for one query (``forget``): the per-tier searches
    ask again what another search asked."""

    def __init__(self, tier_views: Sequence[Sequence[LookupView | None]]) -> None:
        self.views = [list(views) for views in tier_views]
        self.answers: list[list[dict[StoreKey, bool]]] = [
            [{} for _ in views] for views in tier_views
        ]

    def contains_many(
        self, keys: Sequence[StoreKey], *, rank: int = 0, tier_index: int | None = None
    ) -> list[bool]:
        views = self.views[rank]
        indices = range(len(views)) if tier_index is None else (tier_index,)
        found = [False] * len(keys)
        todo = list(range(len(keys)))
        for i in indices:
            if not todo:
                break
            if views[i] is None:
                continue
            answers = self._ask(rank, i, [keys[k] for k in todo])
            for k, hit in zip(todo, answers, strict=True):
                found[k] = hit
            todo = [k for k in todo if not found[k]]
        return found

    def _ask(self, rank: int, tier_index: int, keys: list[StoreKey]) -> list[bool]:
        view, memo = self.views[rank][tier_index], self.answers[rank][tier_index]
        assert view is not None
        new = [key for key in keys if key not in memo]
        if new:
            memo.update(zip(new, view.contains_many(new), strict=True))
        return [memo[key] for key in keys]

    def forget(self) -> None:
        for answers in self.answers:
            for memo in answers:
                memo.clear()


def engine_facts(card: EngineCard) -> EngineFacts:
    return EngineFacts(
        model_groups=card.model_groups,
        alignment_tokens=card.alignment_tokens,
        tp_size=card.tp_size,
        pp_size=len(card.stage_groups) or 1,
        stage_groups=card.stage_groups,
        use_eagle=card.use_eagle,
        eagle_group_ids=frozenset(card.eagle_group_ids),
        engine_key=card.engine_id,
    )


class EngineLookup:
    """Lookups for one engine, from its card. Thread-safe (one query at a time).

    ``opened``: lookup-only tiers already open in this process, shared with other
    engines and closed by whoever owns the dict; without it this object owns the
    tiers it opens (``close``).
    """

    def __init__(
        self,
        name: str,
        card: EngineCard,
        *,
        opened: dict[TierConfig, Tier] | None = None,
        events: EventIndex | None = None,
    ) -> None:
        self.name = name
        self.card = card
        self.events = events
        """The engine's KV events, if followed: its private tiers and prefix cache."""
        self._sources = tuple(event_source(config).name for config in card.tiers)
        """Each tier as the engine's events name it."""
        lookup, self._owned = build_lookup(
            card.connector_config(), engine_facts(card), opened=opened
        )
        if opened is not None:
            self._owned = []
        self.tiers = _VisibleTiers(lookup.tier_views)
        self.load_weights = lookup.load_weights
        self.visible = tuple(view is not None for view in lookup.tier_views[0])
        self.search = HitSearch(
            model_groups=card.model_groups,
            ranks=engine_ranks(engine_facts(card)),
            alignment_tokens=card.alignment_tokens,
            use_eagle=card.use_eagle,
            eagle_group_ids=card.eagle_group_ids or None,
        )
        self._lock = threading.Lock()

    def chain(self, query: HitQuery) -> tuple[Sequence[BlockHash], int]:
        """The query's chained block hashes with this engine's settings, and its length."""
        size = self.card.model_groups.hash_block_size
        if query.token_ids is not None:
            hasher = RequestBlockHasher(
                size,
                algo=self.card.hash_algo,
                cache_salt=query.cache_salt,
                lora_name=query.lora_name,
            )
            hasher.extend(query.token_ids)
            return hasher.block_hashes, len(query.token_ids)
        assert query.block_hashes is not None
        hashes = query.block_hashes
        num_tokens = len(hashes) * size if query.num_tokens is None else query.num_tokens
        problems = []
        if num_tokens // size != len(hashes):
            problems.append(
                f"{len(hashes)} block hashes for num_tokens={num_tokens}: engine {self.name} "
                f"hashes every {size} tokens, so give {num_tokens // size} hashes, or "
                f"num_tokens in [{len(hashes) * size}, {(len(hashes) + 1) * size})"
            )
        digest_bytes = self.card.hash_algo.digest_bytes
        wrong = sorted({len(h) for h in hashes if len(h) != digest_bytes})
        if wrong:
            problems.append(
                f"block hashes of {wrong} bytes: engine {self.name} uses "
                f"{self.card.hash_algo.value} ({digest_bytes} bytes)"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return hashes, num_tokens

    def find(self, query: HitQuery) -> EngineHits:
        """The engine's hit for ``query``, over every tier and per tier."""
        chain, num_tokens = self.chain(query)
        blocks = None
        if self.events is not None and query.token_ids is not None:
            sizes = [g.block_size for g in self.card.model_groups.groups]
            blocks = PromptBlocks(
                self.events,
                query.token_ids,
                sizes,
                lora_name=query.lora_name,
                cache_salt=query.cache_salt,
                group_idx=self.card.engine_group_ids or None,
            )
        with self._lock:
            try:
                return self._find(chain, num_tokens, blocks)
            finally:
                self.tiers.forget()

    def _find(
        self, chain: Sequence[BlockHash], num_tokens: int, blocks: PromptBlocks | None
    ) -> EngineHits:
        max_hit_tokens = num_tokens - 1  # the engine computes at least the last token
        via_events = [not seen and blocks is not None for seen in self.visible]
        visible = [i for i, seen in enumerate(self.visible) if seen or via_events[i]]

        def elsewhere(tiers: Sequence[int]) -> Contains | None:
            private = [self._sources[i] for i in tiers if via_events[i]]
            return None if blocks is None or not private else blocks.contains(private)

        per_tier: dict[int, Hit] = {}  # a tier not seen here holds nothing
        best: Hit | None = None
        if max_hit_tokens > 0 and len(visible) == 1:  # that tier's hit is the engine's
            best = per_tier[visible[0]] = self._search(
                chain, max_hit_tokens, None, elsewhere(visible)
            )
        elif max_hit_tokens > 0 and visible:
            per_tier = {i: self._search(chain, max_hit_tokens, i, elsewhere([i])) for i in visible}
            best = self._search(chain, max_hit_tokens, None, elsewhere(visible))
        device = None
        if blocks is not None:
            device = 0
            if max_hit_tokens > 0:
                device = self.search.search_in(blocks.contains([DEVICE]), max_hit_tokens).num_tokens
        tiers = tuple(
            TierHit(
                tier_index=i,
                kind=config.kind,
                visible=self.visible[i] or via_events[i],
                via_events=via_events[i],
                hit_tokens=0 if i not in per_tier else per_tier[i].num_tokens,
                load_bytes_per_rank=0 if i not in per_tier else self.search.load_bytes(per_tier[i]),
            )
            for i, config in enumerate(self.card.tiers)
        )
        tier_index = None
        if self.card.selection is Selection.WHOLE_REQUEST and len(tiers) > 1:
            tier_index = pick_whole_request_tier([t.hit_tokens for t in tiers], self.load_weights)
            best = per_tier.get(0 if tier_index is None else tier_index)
        return EngineHits(
            engine=self.name,
            num_tokens=num_tokens,
            hit_tokens=0 if best is None else best.num_tokens,
            load_bytes_per_rank=0 if best is None else self.search.load_bytes(best),
            tp_size=self.card.tp_size,
            tier_index=tier_index,
            tiers=tiers,
            device_hit_tokens=device,
        )

    def _search(
        self,
        chain: Sequence[BlockHash],
        max_hit_tokens: int,
        tier: int | None,
        elsewhere: Contains | None,
    ) -> Hit:
        return self.search.search(
            self.tiers, chain, max_hit_tokens, tier_index=tier, held_elsewhere=elsewhere
        )

    def close(self) -> None:
        for tier in self._owned:
            tier.close()
        self._owned = []
