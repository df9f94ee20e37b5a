"""What one engine holds on its GPU and in its private tiers, learned from its KV events.

The lookup's process (a router, ``hybridkv route serve``). An engine with vLLM's
``kv_events_config`` publishes, over ZMQ, every block its GPU prefix cache and
hybridkv's tiers store and remove (``integrations.vllm.events``). Those blocks
are named with vLLM's own chained hash, which a process outside the engine
cannot compute (its seed is the engine's), so ``EventIndex`` learns each hash
from the events themselves: a block is the hash of its parent and its tokens
(and its extra keys), and a prompt is followed block by block from its first
one. A block whose name no event gave is unknown, and so is every block after
it: the index may under-count a hit, never over-count one.

Engine-neutral: events are taken as objects with vLLM's event fields (vLLM's
``EventFeed``, in ``integrations.vllm.event_feed``, receives and decodes them).
Bounded: at most ``max_names`` block names are kept, least recently stored
first out, and at most as many blocks per source (a pool's server evicts
without telling anyone, so its blocks could only grow; past the bound some
block is forgotten: an under-count).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.connector.events import source_name
from hybridkv.hits import Contains

MAX_NAMES = 1 << 20
"""Block names (parent, tokens -> hash) kept per engine, and blocks followed per source;
each name costs a few hundred bytes."""
DEVICE = "GPU"
"""The engine's own prefix cache, as vLLM's events name its medium."""

TokenIds = Sequence[int] | npt.NDArray[np.integer[Any]]
Source = str
"""Where a block is held, as events name it: ``GPU``, ``CPU``, ``STORAGE/disk``..."""


def _extra(raw: Any) -> tuple[Any, ...] | None:
    """An event's extra keys of one block, hashable (msgspec decodes tuples as lists)."""
    if not raw:
        return None
    return tuple(tuple(x) if isinstance(x, list) else x for x in raw)


class EventIndex:
    """Which blocks of one engine each source holds, by group and vLLM block hash.

    Thread-safe: an ``EventFeed`` applies batches while lookups read.
    """

    def __init__(self, *, max_names: int = MAX_NAMES) -> None:
        if max_names < 1:
            raise ValueError(f"max_names={max_names} must be >= 1")
        self.max_names = max_names
        self._names: OrderedDict[tuple[int, Any, bytes, Any], Any] = OrderedDict()
        """(block size, parent hash, tokens, extra keys) -> the block's hash."""
        self._held: dict[Source, set[tuple[int | None, Any]]] = {}
        """source -> (group, hash) it holds."""
        self._lock = threading.Lock()

    def apply(self, events: Iterable[Any]) -> None:
        """One batch of vLLM ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``."""
        with self._lock:
            for event in events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    self._stored(event)
                elif kind == "BlockRemoved":
                    held = self._held.get(source_name(event.medium, event.ownership))
                    if held is not None:
                        for block_hash in event.block_hashes:
                            held.discard((event.group_idx, _hashable(block_hash)))
                elif kind == "AllBlocksCleared":
                    self._held.pop(DEVICE, None)  # vLLM clears its own prefix cache

    def _stored(self, event: Any) -> None:
        size = int(event.block_size)
        tokens = _token_bytes(event.token_ids)
        extras = event.extra_keys or [None] * len(event.block_hashes)
        parent = _hashable(event.parent_block_hash)
        held = self._held.setdefault(source_name(event.medium, event.ownership), set())
        for n, block_hash in enumerate(event.block_hashes):
            name = (size, parent, tokens[n * size * 8 : (n + 1) * size * 8], _extra(extras[n]))
            block = _hashable(block_hash)
            self._names[name] = block
            self._names.move_to_end(name)
            held.add((event.group_idx, block))
            parent = block
        while len(self._names) > self.max_names:
            self._names.popitem(last=False)
        while len(held) > self.max_names:  # a pool's evictions are never published
            held.pop()  # forgetting a block under-counts, as a lost name does

    def chain(
        self,
        token_ids: TokenIds,
        block_size: int,
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[Any]:
        """The vLLM hashes of the prompt's whole blocks of ``block_size`` tokens, as far as
        the events named them (the list stops at the first block never named)."""
        tokens = _token_bytes(token_ids)
        hashes: list[Any] = []
        parent = None
        with self._lock:
            for n in range(len(tokens) // (8 * block_size)):
                extra = [lora_name] if lora_name else []
                if cache_salt and n == 0:  # vLLM salts a prompt's first block only
                    extra.append(cache_salt)
                chunk = tokens[n * block_size * 8 : (n + 1) * block_size * 8]
                block = self._names.get((block_size, parent, chunk, tuple(extra) or None))
                if block is None:
                    break
                hashes.append(block)
                parent = block
        return hashes

    def holds(
        self, sources: Collection[Source], group_id: int, hashes: Sequence[Any]
    ) -> list[bool]:
        """Whether any of ``sources`` holds each block of ``group_id``."""
        with self._lock:
            held = [self._held.get(s, set()) for s in sources]
            return [any((group_id, h) in s for s in held) for h in hashes]

    def sources(self) -> dict[Source, int]:
        """Blocks held per source."""
        with self._lock:
            return {source: len(held) for source, held in self._held.items()}


def _token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as little-endian int64 bytes, 8 per token."""
    return np.asarray(token_ids, dtype="<i8").tobytes()


def _hashable(block_hash: Any) -> Any:
    return bytes(block_hash) if isinstance(block_hash, bytearray | memoryview) else block_hash


class PromptBlocks:
    """One prompt's blocks as an engine's events name them, per group's block size."""

    def __init__(
        self,
        index: EventIndex,
        token_ids: TokenIds,
        block_sizes: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        group_idx: Sequence[int] | None = None,
    ) -> None:
        """``group_idx``: each group's id in the engine's events (None: its place; an
        engine whose connector skips groups numbers them otherwise)."""
        self.index = index
        self.block_sizes = tuple(block_sizes)
        self.group_idx = tuple(group_idx or range(len(self.block_sizes)))
        chains = {
            size: index.chain(token_ids, size, lora_name=lora_name, cache_salt=cache_salt)
            for size in set(block_sizes)
        }
        self.chains = [chains[size] for size in self.block_sizes]

    def contains(self, sources: Collection[Source]) -> Contains:
        """``find_longest_hit``'s question, answered from what ``sources`` hold."""

        def contains(group_id: int, indices: Sequence[int]) -> list[bool]:
            chain = self.chains[group_id]
            named = [i for i in indices if i < len(chain)]
            held = dict(
                zip(
                    named,
                    self.index.holds(sources, self.group_idx[group_id], [chain[i] for i in named]),
                    strict=True,
                )
            )
            return [held.get(i, False) for i in indices]

        return contains
