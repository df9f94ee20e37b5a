"""The mark of tests that build network namespaces: skipped, saying why, on machines
that cannot (no root, no ``ip``, no veth support)."""

from __future__ import annotations

import pytest

from hybridkv.tools.netns import unavailable_reason

REASON = unavailable_reason()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")
