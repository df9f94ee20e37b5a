"""The simulated engine: hybridkv's real connector (a ``ConnectorScheduler`` and a
``ConnectorWorker`` over real tiers) driven the way vLLM 0.32 drives it, with KV
that a tiny deterministic "model" writes, so every loaded byte can be checked
against a cold run. The connector tests and the replay benchmarks run on it;
everything runs in their one process.

* ``shapes``: the model's groups and its KV tensors, as vLLM's CPU worker lays them out;
* ``model``: the KV and Mamba states the model computes from the tokens, and prompts;
* ``engine``: ``SimEngine``, vLLM's block rules and its step (lookup, allocate,
  metadata, forward, loads, save, report);
* ``build``: an engine over a fresh scheduler/worker pair on a connector config's tiers;
* ``drive``: running a request to its end, waiting for its load, settling transfers;
* ``check``: a request's KV against a cold run's;
* ``workloads``, ``replay``, ``options``: the replay benchmarks' seeded workloads,
  their replay under several policies, and their command line.

A test or benchmark builds one with ``build.make_engine(shapes.make_groups(kinds),
build.make_config(tmp_dir))``, then ``add``s requests, ``step``s, and closes it
with ``build.close_engine``; it imports each name from its module.
"""
