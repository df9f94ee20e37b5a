"""Moving KV blocks between canonical KV caches and a tier, in batches, asynchronously.

Worker process. One object is one block of one group (its layers' pages in
layer order, see ``hybridkv.layout``). ``TransferEngine`` copies stores
straight into the CPU tier's memory (or a bounded staging arena for tiers
without memory of their own), synchronously on CPU and on the copier's own
stream on CUDA (``fence`` keeps the engine from writing those blocks first);
it reads loads in the background, in place from the CPU tier or through
staging, and scatters only blocks read OK. Every submitted job yields exactly
one ``JobResult``. ``BlockCopier`` does the batched copies (``chunked``: the
CUDA path through one bounded device chunk).
"""

from hybridkv.transfer.copier import BlockCopier
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.jobs import (
    JobId,
    JobKind,
    JobOutcome,
    JobResult,
    TransferConfig,
    TransferPart,
)
from hybridkv.transfer.staging import StagingArena
from hybridkv.transfer.stats import TransferStats

__all__ = [
    "BlockCopier",
    "JobId",
    "JobKind",
    "JobOutcome",
    "JobResult",
    "StagingArena",
    "TransferConfig",
    "TransferEngine",
    "TransferPart",
    "TransferStats",
]
