"""The fused span kernel (CUDA's one launch per piece) byte for byte against the per-span
torch path, under Triton's interpreter on CPU tensors: vLLM's page layouts, K/V split
pages, gapped and reversed slots, aliased layers (scatters in span order), spans that
only allow 2- or 1-byte elements, tight, framed and scattered rows over several
pieces; and the comparison itself catches swapped spans and a wrong pitch.

The interpreter must be on before the kernel is defined, so the cases run in one
fresh process (``tests/transfer/span_cases.py``) whose report each test reads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from hybridkv.transfer.chunked import FUSED_ENV, ChunkedCopies
from tests.transfer.span_cases import CACHES, CASE_NAMES, CPU

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict[str, list[str]]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.transfer.span_cases"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found: dict[str, list[str]] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


@pytest.mark.parametrize("case", CASE_NAMES)
def test_fused_copies_equal_the_per_span_path(case: str, report: dict[str, list[str]]) -> None:
    assert report[case] == []


def test_every_case_ran(report: dict[str, list[str]]) -> None:
    assert sorted(report) == sorted(CASE_NAMES)


def test_the_kernel_needs_an_opt_in_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors the default stays the per-span path (the kernel needs CUDA or the
    interpreter); a bad ``HYBRIDKV_FUSED_COPIES`` is refused by name."""
    caches, _ = CACHES["LBNHC"](CPU)
    monkeypatch.delenv(FUSED_ENV, raising=False)
    assert not ChunkedCopies(caches).fused
    monkeypatch.setenv(FUSED_ENV, "yes")
    with pytest.raises(ValueError, match="HYBRIDKV_FUSED_COPIES='yes'"):
        ChunkedCopies(caches)
    monkeypatch.setenv(FUSED_ENV, "0")
    assert not ChunkedCopies(caches).fused
