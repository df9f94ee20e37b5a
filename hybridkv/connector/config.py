"""The connector's typed configuration, parsed once from the engine's extra config.

Any process (the scheduler and every worker parse the same dict). Declared
with ``hybridkv.schema``: every problem of the dict (unknown keys, wrong
types, impossible values, bad tier entries) goes into one ``ConfigError``.
An empty dict is a complete configuration: a CPU tier plus a disk tier under
the default cache directory.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictBool, StrictInt, StrictStr
from pydantic.dataclasses import dataclass

from hybridkv.connector.admission import DEFAULT_SEEN_HASHES
from hybridkv.connector.retention import EvictionOrder
from hybridkv.connector.sightings import DEFAULT_SIGHTING_TTL_S
from hybridkv.keys import HashAlgo
from hybridkv.paths import CACHE_DIR_ENV, default_cache_dir
from hybridkv.schema import CONFIG, ByteSize, Number, UserPath, parse
from hybridkv.tiers.admission import Admission
from hybridkv.tiers.cpu import CpuConfig
from hybridkv.tiers.disk.config import DiskConfig
from hybridkv.tiers.ranks import WorkerRank
from hybridkv.tiers.registry import TierConfig
from hybridkv.tiers.selection import Selection

DEFAULT_CPU_CAPACITY_BYTES = 2 << 30
DEFAULT_DISK_CAPACITY_BYTES = 32 << 30
DEFAULT_SWITCH_INTERVAL_S = 0.0005
DISK_SUBDIR = "kv"
"""The default disk tier lives in ``<cache_dir>/kv``."""
WHERE = "kv_connector_extra_config"


@dataclass(frozen=True, kw_only=True, config=CONFIG)
class ConnectorConfig:
    """Everything the connector reads from the user (``kv_connector_extra_config``)."""

    tiers: Annotated[
        tuple[TierConfig, ...] | None,
        Field(
            description=(
                "tier objects in lookup order, each with a 'kind' and that kind's keys; "
                "null: a cpu tier plus a disk tier in <cache_dir>/kv"
            )
        ),
    ] = None
    cache_dir: Annotated[
        UserPath | None,
        Field(
            description=(
                f"directory of the default disk tier; null: ${CACHE_DIR_ENV}, else "
                f"~/.cache/hybridkv"
            )
        ),
    ] = None
    cpu_capacity_bytes: Annotated[
        ByteSize | None, Field(ge=64, description="size of the default cpu tier; null: 2 GiB")
    ] = None
    disk_capacity_bytes: Annotated[
        ByteSize | None,
        Field(ge=1 << 20, description="size of the default disk tier; null: 32 GiB"),
    ] = None
    selection: Annotated[
        Selection,
        Field(
            description=(
                "per_block: each block from the cheapest tier holding it; whole_request: "
                "one tier serves a load, the one with most hit tokens / load_weight"
            )
        ),
    ] = Selection.PER_BLOCK
    eviction_order: Annotated[
        EvictionOrder,
        Field(
            description=(
                "chain: whenever a request's blocks are stored or loaded, the cpu tier "
                "reorders all of them so its last blocks are evicted first and its first "
                "blocks (which every hit needs) last, and the disk tier its segments holding "
                "them the same way; lru: plain recency, a prompt's first "
                "blocks go first; worth: chain, and the cpu tier passes a request's blocks "
                "over round(r) - 1 times (at most 3) when they come round to be evicted, "
                "again after each use, where r is the prefill tokens a hit on them all saves "
                "per byte it reads, over the least of the last 256 requests touched: a "
                "prompt held in fewer bytes per token (one Mamba state per step, a sliding "
                "window's last blocks) stays longer"
            )
        ),
    ] = EvictionOrder.CHAIN
    admission: Annotated[
        Admission,
        Field(
            description=(
                "which stored blocks the tiers after the first (disk, pool) receive; all: "
                "every one; reused: every one while those tiers have free room or would "
                "evict only blocks not admitted as reused, else only those likely to be read "
                "again, every group's blocks of a prefix that two requests reached (looked "
                "up, computed or loaded); the rest stays in the first tier until evicted "
                "there; while most blocks seen once are seen again, every tier goes plain "
                "LRU instead"
            )
        ),
    ] = Admission.ALL
    admission_keep_slower: Annotated[
        StrictBool,
        Field(
            description=(
                "with admission reused: while most requests that come back to a prefix "
                "reached before find none of it in the tiers (a cycle of prompts longer "
                "than the tiers hold, each evicted just before it returns), the slower "
                "tiers keep what they hold, taking stores only into free room (admitted "
                "blocks may replace admitted ones), so some of the cycle hits; where "
                "prefixes come back in no such order it can cost about a tenth of the hits "
                "(docs/DECISIONS.md, tiers under pressure)"
            )
        ),
    ] = False
    admission_seen_hashes: Annotated[
        StrictInt,
        Field(
            ge=1,
            description=(
                "with admission reused: block hashes the scheduler remembers to tell a "
                "prefix reached before (29-37 bytes each; the oldest seen is forgotten first)"
            ),
        ),
    ] = DEFAULT_SEEN_HASHES
    admission_sighting_ttl_s: Annotated[
        StrictInt,
        Field(
            ge=0,
            description=(
                "with admission reused and a tier that can mark keys (valkey): each block "
                "hash the scheduler sees for the first time is marked in that pool for this "
                "many seconds, and a mark another engine left counts as a second sighting, "
                "so engines sharing the pool judge reuse together; 0: each engine alone"
            ),
        ),
    ] = DEFAULT_SIGHTING_TTL_S
    load_timeout_s: Annotated[
        Number,
        Field(gt=0, allow_inf_nan=False, description="a load still running after this recomputes"),
    ] = 30.0
    device_chunk_bytes: Annotated[
        ByteSize,
        Field(
            ge=1 << 20,
            description=(
                "device memory each worker copies KV blocks through on a GPU (allocated "
                "once, in two halves that take turns; a block larger than a half gets "
                "halves of its size)"
            ),
        ),
    ] = 32 << 20
    hit_alignment_tokens: Annotated[
        StrictInt | None,
        Field(
            gt=0,
            description=(
                "hits land on multiples of this (sliding windows then store only each "
                "segment's last window); a multiple of the engine's alignment, not coarser "
                "with Mamba groups; null: the engine's"
            ),
        ),
    ] = None
    model_id: Annotated[
        StrictStr | None,
        Field(min_length=1, description="keeps this model's keys apart; null: the engine's model"),
    ] = None
    hash_algo: Annotated[HashAlgo, Field(description="block hash")] = HashAlgo.XXH3_128
    engine_card: Annotated[
        UserPath | None,
        Field(
            description=(
                "the scheduler writes this engine's card (groups, hash settings, tiers) to "
                "this JSON file when it starts, for `hybridkv route`; null: no card"
            )
        ),
    ] = None
    thread_switch_interval_s: Annotated[
        Number | None,
        Field(
            gt=0,
            allow_inf_nan=False,
            description=(
                "lowers Python's thread switch interval in worker processes to this: "
                "transfer and I/O threads then wait at most this for the interpreter while "
                "the engine's loop runs; null: leave Python's (5 ms)"
            ),
        ),
    ] = DEFAULT_SWITCH_INTERVAL_S

    exit_flush_timeout_s: Annotated[
        Number,
        Field(
            ge=0,
            allow_inf_nan=False,
            description=(
                "when a worker ends (the engine's shutdown, the interpreter's exit of a script "
                "that returns without it, or a SIGTERM nothing else handles), how long it "
                "waits for stores still copying and for the write-back to the slower tiers "
                "(disk, pool) before it stops; what is left is counted in unflushed_blocks "
                "and logged; 0: stop at once (vLLM's multi-process engine kills its "
                "processes about 5 s after asking them to stop, whatever this is)"
            ),
        ),
    ] = 30.0

    def __post_init__(self) -> None:
        if self.tiers is not None and not self.tiers:
            raise ValueError(
                "tiers is empty: give at least one tier, e.g. "
                '[{"kind": "cpu", "capacity_bytes": "4GiB"}], or leave it out for the default'
            )
        given = [k for k in ("cpu_capacity_bytes", "disk_capacity_bytes") if getattr(self, k)]
        if self.tiers is not None and given:
            raise ValueError(
                f"{' and '.join(given)} size the default tiers only, and 'tiers' is given: set "
                "capacity_bytes inside the 'tiers' entries instead"
            )

    @classmethod
    def from_dict(cls, raw: object) -> ConnectorConfig:
        """Parse the user's dict (None: the embedded default)."""
        config: ConnectorConfig = parse(cls, {} if raw is None else raw, where=WHERE)
        return config

    @property
    def tier_configs(self) -> tuple[TierConfig, ...]:
        """The tiers to build: the given ones, or the embedded default."""
        if self.tiers is not None:
            return self.tiers
        cache_dir = self.cache_dir or default_cache_dir()
        return (
            CpuConfig(capacity_bytes=self.cpu_capacity_bytes or DEFAULT_CPU_CAPACITY_BYTES),
            DiskConfig(
                path=cache_dir / DISK_SUBDIR,
                capacity_bytes=self.disk_capacity_bytes or DEFAULT_DISK_CAPACITY_BYTES,
            ),
        )

    def for_rank(self, rank: WorkerRank) -> tuple[TierConfig, ...]:
        """``rank``'s own tiers (its own disk directory)."""
        return tuple(t.for_rank(rank) for t in self.tier_configs)
