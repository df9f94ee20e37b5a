"""Moving KV blocks between canonical KV caches and a tier, in batches, asynchronously.

Runs in the worker process (the one that owns the KV tensors).

One object is one block of one group: that group's layer pages concatenated
in layer order (``KVGroup.block_bytes`` bytes), the same bytes whatever the
storage layout (see ``hybridkv.layout``).

API
---
``TransferEngine(caches: CanonicalKVCaches, tier: Tier, config: TransferConfig | None = None)``

* ``submit_store(parts: Sequence[TransferPart], *, timeout_s: float | None = None)
  -> JobId | None``: gathers the blocks into staging before returning (the
  engine may reuse them at once); ``tier.put_many`` then runs on a worker
  thread. None = backpressure: the staging arena (the bound on bytes in
  flight) is full; retry later. A job larger than ``max_job_bytes`` raises
  ValueError, as do invalid parts (every problem named).
* ``submit_load(parts: Sequence[TransferPart], *, timeout_s: float | None = None)
  -> JobId | None``: ``tier.get_many_into`` on a worker thread, then scatters
  only the blocks read OK; MISS, CORRUPT and ERROR blocks fail and their KV
  is left untouched. Loads run before queued stores.
* ``poll_finished() -> list[JobResult]``: every submitted job is reported
  exactly once (also failed, timed-out, cancelled ones).
* ``cancel(job_id: JobId) -> bool``: True when the job will no longer touch the
  KV caches (reported failed, error "cancelled"); False when it is
  scattering, finished or unknown.
* ``wait(job_ids: Collection[JobId] | None = None, timeout_s: float | None = None)
  -> bool`` (results ready to poll); ``wait_idle(timeout_s: float | None = None)
  -> bool`` (no job holds staging).
* ``num_inflight_bytes``, ``max_job_bytes``, ``stats() -> TransferStats``,
  ``check_integrity()``, ``close(timeout_s: float = 5.0)``; a context manager.

``TransferPart(group_id: int, block_ids: Sequence[int], keys: Sequence[StoreKey])``
(NamedTuple): one key per block; at most one part per group in a job; block
ids distinct and in ``[0, num_blocks)``.

``JobResult(job_id, kind: JobKind, ok_block_ids: dict[int, tuple[int, ...]],
failed_block_ids: dict[int, tuple[int, ...]], error: str | None)`` (frozen;
block ids keyed by group id, in submit order); ``.ok``, ``.num_failed``.
A store's EXISTS counts as OK; FULL and ERROR fail. A job past its timeout
is reported failed with all its blocks; a load's late bytes are never
scattered (its staging stays reserved until the tier call returns).

``TransferConfig(staging_bytes=256 MiB, num_workers=1, load_timeout_s=30.0,
store_timeout_s=60.0, pin_memory=None)`` (frozen, kw_only; None timeouts
wait forever; ``num_workers > 1`` needs a thread-safe tier).

``BlockCopier(caches)``: the synchronous batched copies the engine uses,
``gather(group_id, block_ids, out)`` and ``scatter(group_id, block_ids, src,
*, only_rows=None)`` over 1-D uint8 buffers of ``len(block_ids) * block_bytes``
(IndexError for ids outside the cache); ``copies_per_block(group_id)`` is 1 for
block-major groups; ``uses_grid(group_id)``: whether CPU copies of the group are
one numpy op per call.
"""

from hybridkv.transfer.copier import BlockCopier
from hybridkv.transfer.engine import TransferEngine
from hybridkv.transfer.jobs import JobId, JobKind, JobResult, TransferConfig, TransferPart
from hybridkv.transfer.staging import StagingArena
from hybridkv.transfer.stats import TransferStats

__all__ = [
    "BlockCopier",
    "JobId",
    "JobKind",
    "JobResult",
    "StagingArena",
    "TransferConfig",
    "TransferEngine",
    "TransferPart",
    "TransferStats",
]
