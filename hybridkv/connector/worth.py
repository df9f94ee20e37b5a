"""What a request's stored blocks save per byte held: the passes a tier gives them.

Worker process. A hit on a prefix of ``n`` tokens saves the prefill of ``n``
tokens; holding it costs the bytes of every group's blocks that the hit reads.
Per token those bytes differ by model and by prompt. A full-attention group
stores a block per block of tokens, but a Mamba group one state where a step
ended, and with hits aligned to several blocks a sliding-window group only the
last window before each boundary. So a long prompt's chain costs fewer bytes
per token saved than a short one's: with vLLM's hybrid allocator every group's
page is the same size, and a Qwen3-Next-like model (three Mamba groups, one
full-attention group) holds 4 blocks for a one-block prompt and 13 for a
ten-block prompt prefilled in one step, 3.1 times the prefill saved per byte.

``eviction_order: worth`` weighs that against recency as GreedyDual does. A
chain's worth is that of a hit at its end: its tokens over the bytes of the
blocks that hit reads, as a multiple of the least a chain can be worth (a
block of every group per block of tokens: ``ratio``). A chain worth ``r``
times the least of the chains touched lately (``connector.recency``) is
passed over ``round(r) - 1`` times when it comes round to be evicted (at most
``MAX_PASSES``), and again after each use, so it stays about ``r`` times as
long. Chains all worth the same (a model of full-attention groups alone,
every block of every group stored, or prompts all alike) get no pass and
keep plain chain order: measured against the least a chain could be worth,
chains all alike would each get passes, and a clock of passes is not quite
recency. Every block of the chain gets its passes: a state or window a step
left earlier in the chain is where a request that shares only that prefix
(a system prompt with a new question, a document asked again) hits, and
where chain order falls back as the tail goes. (docs/DECISIONS.md has what
the other choices cost.)

Prefill saved is counted in tokens: attention's work grows with the context,
but the hybrid models this is for have few attention layers, and how that work
compares with the rest of a layer's depends on widths the KV layout does not
give.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.groups import KVGroup, ModelGroups
from hybridkv.groups.kinds import rules_for
from hybridkv.tiers.retention import MAX_PASSES


@dataclass(frozen=True)
class ChainWorth:
    """The engine's groups: what a hit reads of each, tokens and bytes per block (any
    common scale: ranks of a tensor-parallel engine each hold their share of every
    group)."""

    groups: tuple[KVGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("no groups: a chain's worth needs at least one")

    @classmethod
    def for_groups(cls, model_groups: ModelGroups) -> ChainWorth:
        return cls(tuple(model_groups.groups))

    @property
    def densest_bytes_per_token(self) -> float:
        """Bytes per token where every group stores a block per block of tokens: the
        most a chain can hold per token, so the least it can be worth."""
        return sum(g.block_bytes / g.block_size for g in self.groups)

    def hit_blocks(self, group_id: int, num_tokens: int) -> range:
        """The group's blocks a hit of ``num_tokens`` tokens reads (every block of a
        full-attention group; a sliding window's last; a Mamba group's last state)."""
        group = self.groups[group_id]
        rules = rules_for(group.kind)
        lo, hi = rules.window(group, num_tokens)
        found = rules.find(group, lo, b"\x01" * (hi - lo), False, group.block_size)
        return range(found.first_block, found.end_block)

    def ratio(self, num_tokens: int, num_bytes: int) -> float:
        """Prefill tokens saved per byte held, over the least a chain can be worth."""
        if num_tokens <= 0 or num_bytes <= 0:
            return 1.0
        return num_tokens * self.densest_bytes_per_token / num_bytes

    @staticmethod
    def passes(ratio: float, least: float = 1.0) -> int:
        """Times blocks worth ``ratio`` are passed over where the least worth is
        ``least``: ``round(ratio / least) - 1``, within 0..``MAX_PASSES``."""
        return max(0, min(MAX_PASSES, int(ratio / least + 0.5) - 1))
