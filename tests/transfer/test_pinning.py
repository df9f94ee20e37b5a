"""A pageable CPU tier or staging arena on CUDA: a warning that names it, what it
costs and the fix; nothing where copies are synchronous anyway (CPU caches)."""

from __future__ import annotations

from hybridkv.transfer.engine import CPU_PIN, STAGING_PIN
from hybridkv.transfer.pinning import HostMemory, pageable_problem


def regions(*, staging: bool, cpu: bool) -> list[HostMemory]:
    return [
        HostMemory("the staging arena", staging, STAGING_PIN),
        HostMemory("the cpu tier's arena", cpu, CPU_PIN),
    ]


def test_pinned_memory_on_cuda_is_no_problem() -> None:
    assert pageable_problem("cuda", regions(staging=True, cpu=True)) is None
    assert pageable_problem("cuda", []) is None


def test_caches_off_cuda_never_warn() -> None:
    assert pageable_problem("cpu", regions(staging=False, cpu=False)) is None


def test_a_pageable_cpu_tier_on_cuda_is_named_with_its_cost_and_fix() -> None:
    problem = pageable_problem("cuda", regions(staging=True, cpu=False))
    assert problem is not None
    assert problem.startswith("the cpu tier's arena is pageable")
    assert "staging" not in problem
    assert "synchronous" in problem and "pin_memory to true" in problem


def test_every_pageable_region_is_named_once() -> None:
    problem = pageable_problem("cuda", regions(staging=False, cpu=False))
    assert problem is not None
    assert problem.startswith("the staging arena and the cpu tier's arena are pageable")
    assert problem.count("TransferConfig.pin_memory") == 1
    assert problem.count("the cpu tier's pin_memory") == 1
