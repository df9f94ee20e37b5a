"""Moving KV blocks between canonical KV caches and a tier, in batches, asynchronously.

Worker process. One object is one block of one group (its layers' pages in
layer order, see ``hybridkv.layout``). ``TransferEngine`` gathers stores into
a bounded staging arena before returning and writes them in the background;
it reads loads in the background and scatters only blocks read OK. Every
submitted job yields exactly one ``JobResult``. ``BlockCopier`` does the
batched copies.
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
