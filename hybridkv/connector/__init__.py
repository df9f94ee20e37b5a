"""Engine-neutral connector: the scheduler side decides, the worker side moves bytes.

``ConnectorScheduler`` (scheduler process) looks up hits, plans loads and
stores and hands the worker a ``ConnectorMetadata`` each step;
``ConnectorWorker`` (worker process, owns the KV tensors and the tiers)
executes it and answers with a ``WorkerReport``. ``ConnectorConfig`` parses
the user's configuration once. ``hybridkv.vllm`` adapts these to vLLM.
"""

from hybridkv.connector.config import ConnectorConfig
from hybridkv.connector.metadata import (
    BlockTransfer,
    ConnectorMetadata,
    LoadResult,
    LoadSpec,
    StoreSpec,
    WorkerReport,
)
from hybridkv.connector.scheduler import ConnectorScheduler
from hybridkv.connector.steps import (
    LoadOutcome,
    LookupResult,
    ScheduledRequest,
    SchedulerStats,
    StepInput,
)
from hybridkv.connector.views import KeyLookup
from hybridkv.connector.wiring import build_lookup, build_store, lookup_for_store
from hybridkv.connector.worker import ConnectorWorker

__all__ = [
    "BlockTransfer",
    "ConnectorConfig",
    "ConnectorMetadata",
    "ConnectorScheduler",
    "ConnectorWorker",
    "KeyLookup",
    "LoadOutcome",
    "LoadResult",
    "LoadSpec",
    "LookupResult",
    "ScheduledRequest",
    "SchedulerStats",
    "StepInput",
    "StoreSpec",
    "WorkerReport",
    "build_lookup",
    "build_store",
    "lookup_for_store",
]
