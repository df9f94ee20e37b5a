"""Disk faults under a running vLLM engine whose only tier is a disk tier on a tmpfs.

One engine process (Gemma 3 tiny model, float32) stores its prompts, then takes
one fault after another; for each: the fault, a run on it, the recovery, a
run that stores again, a run that must hit. Faults: bit flips in every stored
payload, segment files truncated, deleted, foreign files in the directory, the
directory turned read-only (a read-only bind mount over it), the file system
full while writing (a filler file takes the tmpfs's free space). Last the
engine is SIGKILLed during a write, and a new process on the same directory
must serve correct outputs, check clean and hit. Outputs are compared with the
engine alone (no connector) on the same prompts, in the same process.

A symlink in place of a segment is ``test_cache_dirs.py``'s case.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybridkv.tiers.disk.directory import RESCAN_EVERY_S
from hybridkv.tools.models import TinyModelKind, default_prompt_token_ids
from tests.e2e.expect import describe, engine_facts, full_hit_tokens
from tests.e2e.harness import Harness, PlanRun
from tests.e2e.scenarios import RESET, SETTLE, base_prompts, engine, generate
from tests.faults.engine_faults import Action, CaseFigures, case_steps, judge, run_with_faults
from tests.faults.report import record
from tests.support.corrupt import corrupt_files
from tests.support.servers import MIB

pytestmark = pytest.mark.slow

KIND = TinyModelKind.GEMMA3
LOAD_TIMEOUT_S = 10.0
TMPFS_BYTES = 24 * MIB
CAPACITY_BYTES = 16 * MIB
SEGMENT_BYTES = 1 * MIB


def fresh_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """Prompts no earlier step stored: a run on them must write."""
    return [
        default_prompt_token_ids(n, vocab_size=vocab_size, seed=seed + i)
        for i, n in enumerate((300, 330, 360, 390))
    ]


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return Harness(tmp_path_factory.mktemp("e2e"))


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    mount_point = tmp_path_factory.mktemp("disk-faults")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        reason = f"cannot mount a tmpfs here ({mounted.stderr.strip()}); needs root"
        record("disk faults on a running engine", done="mount a tmpfs", seen=reason, skipped=True)
        pytest.skip(reason)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _seg_files(kv_dir: Path) -> list[Path]:
    return sorted(kv_dir.glob("*.seg"))


def flip_bits(kv_dir: Path) -> Action:
    return lambda pid: corrupt_files({"dir": str(kv_dir), "every": 1})


def truncate(kv_dir: Path) -> Action:
    def act(pid: int) -> dict[str, Any]:
        files = _seg_files(kv_dir)
        for path in files:
            os.truncate(path, 4096)  # the header page only
        return {"num_truncated": len(files)}

    return act


def delete(kv_dir: Path) -> Action:
    def act(pid: int) -> dict[str, Any]:
        files = _seg_files(kv_dir)
        for path in files:
            path.unlink()
        return {"num_deleted": len(files)}

    return act


FOREIGN_FILES = ("foreign.seg", "notes.txt", "7fffffffffffff99.seg")


def add_foreign_files(kv_dir: Path) -> Action:
    def act(pid: int) -> dict[str, Any]:
        (kv_dir / "foreign.seg").write_bytes(os.urandom(SEGMENT_BYTES))
        (kv_dir / "notes.txt").write_text("not a segment\n")
        # Named like a segment, under a number the tier never reaches: writing it under a
        # live segment's name would rewrite that segment's file (the same inode) instead.
        (kv_dir / "7fffffffffffff99.seg").write_bytes(b"\0" * 8192)
        (kv_dir / "subdir").mkdir()
        # The writer sweeps on a put, at most every RESCAN_EVERY_S: once that long has
        # passed, the fault step's first put sweeps. Without the wait, a sweep just
        # before the files came let them stay until a later case's (read-only) sweep.
        time.sleep(RESCAN_EVERY_S)
        return {"added": 4}

    return act


def foreign_files_left(kv_dir: Path) -> Action:
    """After the fault step: which planted files the writer left in its directory."""

    def act(pid: int) -> dict[str, Any]:
        return {"left": sorted(name for name in FOREIGN_FILES if (kv_dir / name).exists())}

    return act


def bind_read_only(kv_dir: Path) -> Action:
    def act(pid: int) -> dict[str, Any]:
        subprocess.run(["mount", "--bind", str(kv_dir), str(kv_dir)], check=True)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(kv_dir)], check=True)
        return {"read_only": True}

    return act


def unmount(kv_dir: Path) -> Action:
    def act(pid: int) -> dict[str, Any]:
        subprocess.run(["umount", str(kv_dir)], check=True)
        return {"read_only": False}

    return act


def fill(mount_point: Path) -> Action:
    def act(pid: int) -> dict[str, Any]:
        filler, chunk = mount_point / "filler", b"\0" * (64 << 10)
        with contextlib.suppress(OSError), filler.open("wb") as out:
            while True:
                out.write(chunk)
                out.flush()
        free = os.statvfs(mount_point)
        return {"filler_bytes": filler.stat().st_size, "free_bytes": free.f_bavail * free.f_bsize}

    return act


def remove_filler(mount_point: Path) -> Action:
    return lambda pid: {"removed": (mount_point / "filler").unlink() is None}


def kill_on_write(kv_dir: Path) -> Action:
    """SIGKILL the engine as soon as a segment file changes (a write-back under way)."""

    def act(pid: int) -> dict[str, Any]:
        before = {p: p.stat().st_mtime_ns for p in _seg_files(kv_dir)}

        def watch() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                now = {p: p.stat().st_mtime_ns for p in _seg_files(kv_dir) if p.exists()}
                if now != before:
                    break
                time.sleep(0.001)
            os.kill(pid, signal.SIGKILL)

        threading.Thread(target=watch, daemon=True).start()
        return {"kill_armed": True}

    return act


CASES = ("bit flips", "truncated", "deleted", "foreign files", "read-only", "disk full")


class DiskMatrix:
    def __init__(self, harness: Harness, mount_point: Path) -> None:
        self.model = harness.model(KIND)
        self.kv_dir = mount_point / "kv"
        self.sync_dir = harness.work_dir / "disk-faults-sync"
        self.connector = {
            "tiers": [
                {
                    "kind": "disk",
                    "path": str(self.kv_dir),
                    "capacity_bytes": CAPACITY_BYTES,
                    "segment_bytes": SEGMENT_BYTES,
                }
            ],
            "load_timeout_s": LOAD_TIMEOUT_S,
        }
        vocab = self.model.vocab_size
        self.prompts = {
            "base": base_prompts(vocab),
            "foreign files": fresh_prompts(vocab, 400),
            "read-only": fresh_prompts(vocab, 500),
            "disk full": fresh_prompts(vocab, 600),
            "killed": fresh_prompts(vocab, 700),
        }
        self.case_prompts = {c: self.prompts.get(c, self.prompts["base"]) for c in CASES}
        ref_steps = []
        for label, prompts in self.prompts.items():
            ref_steps += [RESET, generate(label, prompts)]
        steps = [
            generate("store", self.prompts["base"]),
            RESET,
            generate("warm", self.prompts["base"]),
        ]
        for case in CASES:
            steps += case_steps(case, self.case_prompts[case], self.sync_dir)
        steps += [
            {"op": "integrity", "label": "before-kill"},
            {"op": "await", "label": "await-kill", "dir": str(self.sync_dir), "name": "kill"},
            generate("killed", self.prompts["killed"]),
        ]
        self.first = run_with_faults(
            harness,
            "disk-faults",
            [engine("ref", self.model, ref_steps), engine("D", self.model, steps, self.connector)],
            self.actions(mount_point),
            self.sync_dir,
        )
        killed = self.prompts["killed"]
        again = [generate("killed:fault", killed), RESET, generate("killed:restore", killed)]
        again += [
            SETTLE,
            RESET,
            generate("killed:hit", killed),
            RESET,
            generate("base", self.prompts["base"]),
        ]
        self.restarted = harness.run(
            "disk-faults-restart", [engine("D2", self.model, again, self.connector)]
        )

    def actions(self, mount_point: Path) -> dict[str, Action]:
        kv = self.kv_dir
        return {
            "bit flips": flip_bits(kv),
            "truncated": truncate(kv),
            "deleted": delete(kv),
            "foreign files": add_foreign_files(kv),
            "foreign files:recover": foreign_files_left(kv),
            "read-only": bind_read_only(kv),
            "read-only:recover": unmount(kv),
            "disk full": fill(mount_point),
            "disk full:recover": remove_filler(mount_point),
            "kill": kill_on_write(kv),
        }

    def reference(self, case: str) -> dict[str, Any]:
        label = case if case in self.prompts else "base"
        return self.first.step("ref", label)


_matrix: dict[str, DiskMatrix] = {}


@pytest.fixture(scope="module")
def matrix(harness: Harness, tmpfs: Path) -> DiskMatrix:
    if "run" not in _matrix:
        _matrix["run"] = DiskMatrix(harness, tmpfs)
    return _matrix["run"]


def _action_done(run: PlanRun, name: str) -> dict[str, Any]:
    return dict(run.step("D", f"await-{name}")["test"])


@pytest.mark.parametrize("case", CASES)
def test_disk_fault_under_a_running_engine(case: str, matrix: DiskMatrix) -> None:
    run = matrix.first
    figures = judge(run, "D", case, matrix.reference(case), matrix.model)
    _assert_case(case, figures)
    done = _action_done(run, case)
    if case == "foreign files":  # moved out by the fault step's first put, each counted
        assert run.step("D", "await-foreign files:recover")["test"]["left"] == []
        assert figures.counted.get("tier_corrupt_objects", 0) >= len(FOREIGN_FILES), figures
    figures.record(
        f"disk (engine): {case}",
        done=f"{DONE[case]}; {done}",
        seen=f"{SEEN[case]}; fault run cached {figures.fault_cached_tokens}",
    )


def _assert_case(case: str, figures: CaseFigures) -> None:
    assert figures.outputs_identical, "\n".join(figures.output_problems)
    assert figures.within_load_timeout(LOAD_TIMEOUT_S), figures
    assert figures.counted, f"{case}: the fault was not counted: {figures}"
    assert figures.hits_resumed, (
        f"hit {figures.hit_tokens} of {figures.expected_hit_tokens}: {figures}"
    )


DONE = {
    "bit flips": "one payload byte inverted in every stored object",
    "truncated": "every segment file truncated to its header page",
    "deleted": "every segment file unlinked",
    "foreign files": "a random 1 MiB foo.seg, a zero-filled NNN.seg, notes.txt and a subdirectory",
    "read-only": "a read-only bind mount over the directory (root ignores modes), then unmounted",
    "disk full": "a filler file takes the tmpfs's free space, then is removed",
}
SEEN = {
    "bit flips": "damaged objects counted corrupt, recomputed, stored again",
    "truncated": "reads past the end counted, recomputed, stored again",
    "deleted": "the engine served on; stored again after",
    "foreign files": "new prompts stored; the writer moved the foreign files to quarantine, "
    "counted corrupt; none served",
    "read-only": "writes refused and counted; recomputed",
    "disk full": "writes refused (ENOSPC) and counted",
}


def test_engine_killed_mid_write_restarts_clean(matrix: DiskMatrix) -> None:
    first, run = matrix.first, matrix.restarted
    assert first.returncode == -signal.SIGKILL, first.describe_failure()
    assert first.step("D", "before-kill")["integrity"] == "ok"
    assert run.returncode == 0, run.describe_failure()
    figures = judge(run, "D2", "killed", matrix.reference("killed"), matrix.model)
    assert figures.outputs_identical, "\n".join(figures.output_problems)
    assert figures.within_load_timeout(LOAD_TIMEOUT_S), figures
    assert figures.hits_resumed, (
        f"hit {figures.hit_tokens} of {figures.expected_hit_tokens}: {figures}"
    )
    base = run.step("D2", "base")  # stored before the kill: still there
    assert base["num_cached_tokens"] == [
        full_hit_tokens(n, engine_facts(run, "D2")) for n in base["num_prompt_tokens"]
    ], describe(base)
    (integrity,) = (r for r in run.records if r.get("op") == "integrity")
    assert integrity["integrity"] == "ok", integrity
    figures.record(
        "disk (engine): SIGKILL mid-write, restart",
        done="engine SIGKILLed the moment a segment file changed during a run on new prompts; "
        "a new engine process on the same directory",
        seen=f"the new engine's first run cached {figures.fault_cached_tokens} of the killed "
        f"prompts, outputs correct, check_integrity ok; stored and hit again; earlier prompts "
        f"all hit",
    )
