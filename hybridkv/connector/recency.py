"""Chain-aware recency: the order a request's blocks take in a tier's LRU list.

Worker process. Blocks are stored and loaded in chain order (block 0 first), so
plain recency makes a prompt's first blocks its oldest, and a full cache evicts
them first; yet a hit is a prefix of the chain in every group, and without its
first blocks the rest of a prompt is useless. ``ChainRecency`` remembers, per
request, the keys this rank stored or loaded for it; each time some of them
were, the tiers are told to touch all of them last block first, every group's
block of one position together: the head becomes the most recent, the tail
(worth the least) goes first. With ``eviction_order: worth`` each chain's touch
also gives its blocks the passes its prefill saved per byte earns
(``connector/worth.py``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from hybridkv.connector.worth import ChainWorth
from hybridkv.tiers.base import StoreKey

RECENT_CHAINS = 256
"""Chains whose worth sets the least: passes go to what is worth more than what the
tier is storing now, so chains all worth the same keep plain chain order."""
Placed = tuple[StoreKey, int, int]
"""A block of a chain: its key, its group, its first token."""


@dataclass
class _Chain:
    keys_at: dict[int, dict[StoreKey, int]] = field(default_factory=dict)
    """First token of a block -> the keys of every group's block there, each with its
    group (in order of arrival)."""
    ends: dict[int, int] = field(default_factory=dict)
    """Group -> the end of its last block, in tokens."""
    finished: bool = False


class ChainRecency:
    """Per request, its blocks' keys by position; ``take_orders`` lists those to touch.

    Not thread-safe (the worker calls it from its one thread). A request is forgotten
    once the engine finished it and none of its store jobs is still running.
    """

    def __init__(self, block_sizes: Sequence[int], worth: ChainWorth | None = None) -> None:
        self.block_sizes = tuple(block_sizes)
        """Per group: tokens per block (positions are in tokens, as groups' sizes differ)."""
        self.worth = worth
        """Passes by prefill saved per byte (None: none, recency in chain order alone)."""
        self._ratios: deque[float] = deque(maxlen=RECENT_CHAINS)
        """What the chains touched last were worth (``ChainWorth.ratio``): the least of
        them is worth no pass."""
        self._chains: dict[str, _Chain] = {}
        self._num_jobs: Counter[str] = Counter()
        """Requests -> store jobs still running."""
        self._changed: set[str] = set()
        """Requests whose blocks were stored or loaded since their chain's last touch."""

    def __len__(self) -> int:
        return len(self._chains)

    def add(
        self, req_id: str, group_id: int, block_indices: Sequence[int], keys: Sequence[StoreKey]
    ) -> None:
        """The request's chain holds these blocks of one group (they are being stored or
        loaded; ``touched`` says when)."""
        chain = self._chains.setdefault(req_id, _Chain())
        block_size = self.block_sizes[group_id]
        keys_at = chain.keys_at
        for index, key in zip(block_indices, keys, strict=True):
            keys_at.setdefault(index * block_size, {})[key] = group_id
        if len(block_indices):
            end = (max(block_indices) + 1) * block_size
            chain.ends[group_id] = max(chain.ends.get(group_id, 0), end)

    def start_store(self, req_id: str) -> None:
        self._num_jobs[req_id] += 1

    def end_store(self, req_id: str) -> None:
        """A store job of the request ended: its chain is touched next."""
        self._num_jobs[req_id] -= 1
        if not self._num_jobs[req_id]:
            del self._num_jobs[req_id]
        self.touched(req_id)

    def touched(self, req_id: str) -> None:
        """Blocks of the request were stored or loaded: its chain is touched next."""
        if req_id in self._chains:
            self._changed.add(req_id)

    def finish(self, req_ids: Iterable[str]) -> None:
        """The engine is done with these requests: forget them once their stores end."""
        for req_id in req_ids:
            chain = self._chains.get(req_id)
            if chain is not None:
                chain.finished = True
                if req_id not in self._num_jobs and req_id not in self._changed:
                    del self._chains[req_id]

    def take_orders(self) -> list[tuple[list[StoreKey], int | None]]:
        """Per request changed since the last call, its keys in the order to touch them
        (last block first, all groups of a position adjacent: the head ends most recent)
        and the passes they get (``passes``; None without ``worth``)."""
        orders = []
        for req_id in self._changed:
            chain = self._chains[req_id]
            keys_at = chain.keys_at
            placed = [
                (k, g, at) for at in sorted(keys_at, reverse=True) for k, g in keys_at[at].items()
            ]
            orders.append(([k for k, _, _ in placed], self.passes(chain.ends, placed)))
            if chain.finished and req_id not in self._num_jobs:
                del self._chains[req_id]
        self._changed = set()
        return orders

    def passes(self, ends: dict[int, int], placed: Sequence[Placed]) -> int | None:
        """The passes ``worth`` gives every block of a chain (key, group, first token):
        those a hit at the chain's end (where every group's blocks reach) earns by its
        tokens per byte of the blocks it reads. None without ``worth``."""
        worth = self.worth
        if worth is None:
            return None
        if len(ends) < len(self.block_sizes):
            return 0  # a group holds nothing: no hit reads this chain
        end = min(ends.values())
        hit_blocks = [worth.hit_blocks(g, end) for g in range(len(self.block_sizes))]
        read_groups = [g for _, g, at in placed if at // self.block_sizes[g] in hit_blocks[g]]
        num_bytes = sum(worth.groups[g].block_bytes for g in read_groups)
        ratio = worth.ratio(end, num_bytes)
        self._ratios.append(ratio)
        return worth.passes(ratio, min(self._ratios))

    def check_integrity(self) -> None:
        assert all(n > 0 for n in self._num_jobs.values()), self._num_jobs
        assert set(self._num_jobs) <= set(self._chains), "a store job of a forgotten request"
        assert self._changed <= set(self._chains), "a forgotten request to touch"
