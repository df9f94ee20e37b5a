"""Fixtures for end-to-end tests on real vLLM (CPU) with tiny local models, and the
servers they share."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# Before any test module imports Mooncake's client: it binds where this says.
os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"

from hybridkv.tools.pool import LocalPool
from tests.e2e.harness import BASELINE_KINDS, Harness, PlanRun
from tests.support.servers import ValkeyServer


@pytest.fixture(scope="session")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    yield Harness(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def baselines(harness: Harness) -> PlanRun:
    """All tiny models on vLLM without the connector, in one process."""
    from tests.e2e.scenarios import baseline_engine

    engines = [baseline_engine(harness.model(kind)) for kind in BASELINE_KINDS]
    return harness.run("baselines", engines)


@pytest.fixture(scope="module")
def valkey() -> Iterator[LocalPool]:
    """A valkey-server of a module's own: a test may pause its writes."""
    with ValkeyServer() as running:
        yield running
