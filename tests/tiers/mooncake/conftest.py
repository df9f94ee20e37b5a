"""Fixtures shared by the Mooncake tier tests; each module starts its own ``pool``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hybridkv.tools.pool import LocalPool
from tests.support.servers import MIB


@pytest.fixture(scope="module")
def raw(pool: LocalPool) -> Iterator[Any]:
    """A plain Mooncake client of the module's pool, for reading and writing values behind
    the tier's back."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MIB, "tcp", "", pool.master_address)
    assert rc == 0
    yield store
    store.close()
