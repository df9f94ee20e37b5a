"""Fixtures for end-to-end tests on real vLLM (CPU) with tiny local models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.harness import BASELINE_KINDS, Harness, PlanRun


@pytest.fixture(scope="session")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    yield Harness(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="session")
def baselines(harness: Harness) -> PlanRun:
    """All tiny models on vLLM without the connector, in one process."""
    from tests.e2e.scenarios import baseline_engine

    engines = [baseline_engine(harness.model(kind)) for kind in BASELINE_KINDS]
    return harness.run("baselines", engines)
