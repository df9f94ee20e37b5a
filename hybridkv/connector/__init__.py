"""Engine-neutral connector: the scheduler side decides, the worker side moves bytes.

``scheduler.ConnectorScheduler`` (scheduler process) looks up hits, plans
loads and stores and hands the workers a ``metadata.ConnectorMetadata`` each
step; ``worker.ConnectorWorker`` (one per tensor-parallel rank, in the
process that owns the KV tensors and the tiers) executes it and answers with
a ``metadata.WorkerReport``. ``config.ConnectorConfig`` parses the user's
configuration once; ``setup`` builds both sides from it and the engine's
facts. Importing this package imports no engine and no tensor library.
"""
