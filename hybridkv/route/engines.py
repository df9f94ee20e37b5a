"""The engines a lookup service answers for, each read from its card file.

The service's process. A card is read when first asked for and again whenever its
file changes (the engine restarted, perhaps with other tiers); a card missing or
unreadable is reported with the engine, which answers nothing until it is fixed.
Tiers several engines share (one pool) are opened once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.connector.card import read_card
from hybridkv.route.events import EventIndex
from hybridkv.route.lookup import EngineHits, EngineLookup, HitQuery
from hybridkv.tiers.base import Tier
from hybridkv.tiers.registry import TierConfig

logger = logging.getLogger(__name__)

Stamp = tuple[int, int, int]
"""A card file's inode, modification time (ns) and size: any change means a new card."""


@dataclass
class EngineEntry:
    name: str
    path: Path
    lookup: EngineLookup | None = None
    error: str | None = None
    stamp: Stamp | None = None

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"name": self.name, "card": str(self.path)}
        if self.lookup is None:
            info["error"] = self.error
            return info
        card = self.lookup.card
        info.update(
            engine_id=card.engine_id,
            model_id=card.model_groups.model_id,
            num_groups=card.model_groups.num_groups,
            hash_algo=card.hash_algo.value,
            hash_block_size=card.model_groups.hash_block_size,
            alignment_tokens=card.alignment_tokens,
            tp_size=card.tp_size,
            use_eagle=card.use_eagle,
            events=self.lookup.events is not None,
            selection=card.selection.value,
            tiers=[
                {
                    "tier_index": i,
                    "kind": tier.kind,
                    "visible": visible or self.lookup.events is not None,
                    "via_events": not visible and self.lookup.events is not None,
                }
                for i, (tier, visible) in enumerate(
                    zip(card.tiers, self.lookup.visible, strict=True)
                )
            ],
            hostname=card.hostname,
            pid=card.pid,
        )
        return info


@dataclass(frozen=True)
class EngineError:
    """An engine that could not answer a query: no usable card, or a query it cannot take."""

    engine: str
    error: str

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "error": self.error}


def engine_names(paths: Sequence[Path]) -> dict[str, Path]:
    """Each card by its engine's name, the file's stem; ValueError if two share one."""
    names: dict[str, Path] = {}
    repeated = []
    for path in paths:
        if path.stem in names:
            repeated.append(f"{names[path.stem]} and {path}")
        names[path.stem] = path
    if repeated:
        raise ValueError(
            f"cards {'; '.join(repeated)} name the same engine (a card's name is its file "
            "name without .json): give each engine's card its own file name"
        )
    return names


class Engines:
    """Every engine of a service, by name. Thread-safe.

    ``opened``: lookup-only tiers this process opened already, by config (a pool
    client it has); ``close`` closes them with the tiers the engines opened.
    ``events``: the KV events followed of some engines, by name: their private tiers
    and prefix caches (``route.events``).
    """

    def __init__(
        self,
        cards: dict[str, Path],
        *,
        opened: dict[TierConfig, Tier] | None = None,
        events: dict[str, EventIndex] | None = None,
    ) -> None:
        unknown = sorted(set(events or {}) - set(cards))
        if unknown:
            raise ValueError(f"events of engines {unknown} without a card; cards: {list(cards)}")
        self.entries = {name: EngineEntry(name, path) for name, path in cards.items()}
        self.events = dict(events or {})
        self._opened: dict[TierConfig, Tier] = dict(opened or {})
        self._lock = threading.Lock()

    def reread(self) -> list[EngineEntry]:
        """Every entry, its card read again if its file changed since the last call."""
        with self._lock:
            for entry in self.entries.values():
                self._reread(entry)
            return list(self.entries.values())

    def _reread(self, entry: EngineEntry) -> None:
        try:
            st = os.stat(entry.path)
        except OSError as exc:
            _forget(entry, None, f"no card: {exc.strerror} ({entry.path})")
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == entry.stamp:
            return
        _forget(entry, stamp, None)
        try:
            card = read_card(entry.path)
            entry.lookup = EngineLookup(
                entry.name, card, opened=self._opened, events=self.events.get(entry.name)
            )
        except (OSError, ValueError) as exc:  # ConfigError is a ValueError
            entry.error = str(exc)
            logger.warning("engine %s: %s", entry.name, exc)
            return
        logger.info("engine %s: card of %s read", entry.name, card.model_groups.model_id)

    def find(
        self, query: HitQuery, names: Sequence[str] | None = None
    ) -> list[EngineHits | EngineError]:
        """Each engine's hits (``names``: only those), in order; ValueError for a name
        not served."""
        entries = self.reread()
        if names is not None:
            unknown = sorted(set(names) - set(self.entries))
            if unknown:
                raise ValueError(f"engines {unknown} are not served; served: {list(self.entries)}")
            entries = [self.entries[name] for name in names]
        return [_answer(entry, query) for entry in entries]

    def close(self) -> None:
        with self._lock:
            for entry in self.entries.values():
                if entry.lookup is not None:
                    entry.lookup.close()
                    entry.lookup = None
            for tier in self._opened.values():
                tier.close()
            self._opened.clear()


def _forget(entry: EngineEntry, stamp: Stamp | None, error: str | None) -> None:
    """Drop the entry's card (its file changed or went)."""
    if entry.lookup is not None:
        entry.lookup.close()
    entry.lookup, entry.stamp, entry.error = None, stamp, error


def _answer(entry: EngineEntry, query: HitQuery) -> EngineHits | EngineError:
    if entry.lookup is None:
        return EngineError(entry.name, entry.error or "no card")
    try:
        return entry.lookup.find(query)
    except ValueError as exc:  # the query does not fit this engine's hash settings
        return EngineError(entry.name, str(exc))
