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

A test or benchmark builds one with ``make_engine(make_groups(kinds),
make_config(tmp_dir))``, then ``add``s requests, ``step``s, and closes it with
``close_engine``.
"""

from hybridkv.tools.sim.build import STAGING_BYTES, close_engine, make_config, make_engine
from hybridkv.tools.sim.check import KVMismatchError, assert_kv_matches_cold
from hybridkv.tools.sim.drive import AfterStep, run_to_end, settle_and_flush, wait_loaded
from hybridkv.tools.sim.engine import SimEngine, SimRequest
from hybridkv.tools.sim.model import expected_state, next_state, prompt, token_kv
from hybridkv.tools.sim.shapes import (
    HEAD_DIM,
    MAMBA_STATE_BYTES,
    NUM_KV_HEADS,
    attention_page_bytes,
    make_groups,
    make_kv_caches,
)

__all__ = [
    "HEAD_DIM",
    "MAMBA_STATE_BYTES",
    "NUM_KV_HEADS",
    "STAGING_BYTES",
    "AfterStep",
    "KVMismatchError",
    "SimEngine",
    "SimRequest",
    "assert_kv_matches_cold",
    "attention_page_bytes",
    "close_engine",
    "expected_state",
    "make_config",
    "make_engine",
    "make_groups",
    "make_kv_caches",
    "next_state",
    "prompt",
    "run_to_end",
    "settle_and_flush",
    "token_kv",
    "wait_loaded",
]
