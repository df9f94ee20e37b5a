"""`hybridkv pool up|status|down` and LocalPool, with real servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

from hybridkv.cli import main
from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, Tier
from hybridkv.tiers.registry import build_tier, parse_tier_config
from hybridkv.tools.pool import STATE_FILE, LocalPool
from hybridkv.tools.servers import ServerRole, default_run_dir, read_metrics, valkey_info
from tests.support.servers import MIB, MooncakePool


def round_trip(tier: Tier) -> None:
    key = StoreKey(f"pool-test/{uuid.uuid4().hex}")
    payload = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)
    assert tier.put_many([key], [payload]) == [PutStatus.OK]
    out = np.empty_like(payload)
    assert tier.get_many_into([key], [out]) == [GetStatus.OK]
    assert np.array_equal(out, payload)
    tier.check_integrity()


def pid_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_cli_up_status_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "pool"
    argv = ["pool", "up", "--run-dir", str(run_dir), "--segment-size", "64MiB", "--valkey"]
    eviction = ["--eviction-high-watermark", "0.7", "--eviction-ratio", "0.3"]
    assert main([*argv, *eviction, "--valkey-policy", "noeviction", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    try:
        kinds = [entry["kind"] for entry in document["tiers"]]
        assert kinds == ["mooncake", "valkey"]
        extra = document["kv_transfer_config"]["kv_connector_extra_config"]
        assert extra["tiers"][1:] == document["tiers"]
        for entry in document["tiers"]:  # the printed entries are what an engine uses
            with build_tier(parse_tier_config(entry)) as tier:
                round_trip(tier)
        state = json.loads((run_dir / STATE_FILE).read_text())
        pids = [server["pid"] for server in state["servers"].values()]
        assert len(pids) == 3 and all(pid_running(pid) for pid in pids)

        assert main(["pool", "status", "--run-dir", str(run_dir), "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert all(status[role]["alive"] for role in ("master", "daemon", "valkey"))
        assert status["pool"]["total_capacity_bytes"] == 64 * MIB
        assert status["pool"]["evicted_keys"] == status["pool"]["refused_puts"] == 0
        assert status["valkey_pool"]["maxmemory_bytes"] == 1 << 30
        assert status["valkey_pool"]["evicted_keys"] == status["valkey_pool"]["refused_puts"] == 0
        master_argv = state["servers"]["master"]["argv"]
        assert "--eviction_high_watermark_ratio=0.7" in master_argv
        assert "--eviction_ratio=0.3" in master_argv
        valkey_port = document["tiers"][1]["port"]
        assert valkey_info(valkey_port)["maxmemory_policy"] == "noeviction"

        assert main(argv) == 2  # one pool per run directory
        assert "already runs" in capsys.readouterr().err
    finally:
        assert main(["pool", "down", "--run-dir", str(run_dir)]) == 0
    assert "stopped" in capsys.readouterr().out
    assert not any(pid_running(pid) for pid in pids)
    assert not (run_dir / STATE_FILE).exists()
    assert main(["pool", "down", "--run-dir", str(run_dir)]) == 0
    assert main(["pool", "status", "--run-dir", str(run_dir)]) == 2


def test_cli_up_prints_a_usable_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "pool"
    assert main(["pool", "up", "--run-dir", str(run_dir), "--segment-size", "32MiB"]) == 0
    try:
        out = capsys.readouterr().out
        (entry_line,) = [line for line in out.splitlines() if line.startswith('  {"kind"')]
        with build_tier(parse_tier_config(json.loads(entry_line))) as tier:
            round_trip(tier)
        flag_line = next(line for line in out.splitlines() if "--kv-transfer-config" in line)
        flag = json.loads(flag_line.split("--kv-transfer-config", 1)[1].strip().strip("'"))
        assert flag["kv_connector"] == "HybridKVConnector"
        assert json.loads(entry_line) in flag["kv_connector_extra_config"]["tiers"]
        assert f"hybridkv pool down --run-dir {run_dir}" in out
    finally:
        assert main(["pool", "down", "--run-dir", str(run_dir)]) == 0


def test_cli_rejects_bad_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["pool", "up", "--run-dir", str(tmp_path), "--segment-size", "lots"]
    assert main(argv) == 2
    assert "--segment-size='lots'" in capsys.readouterr().err
    assert not (tmp_path / STATE_FILE).exists()


def test_start_rejects_bad_eviction_settings_naming_each(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as caught:
        LocalPool.start(
            tmp_path, eviction_high_watermark=1.5, eviction_ratio=0, valkey_policy="lru"
        )
    message = str(caught.value)
    assert "eviction_high_watermark=1.5: must be in (0, 1]" in message
    assert "eviction_ratio=0: must be in (0, 1]" in message
    assert "valkey_policy='lru': must be one of allkeys-lru" in message
    assert not (tmp_path / STATE_FILE).exists()


def test_default_run_dir_follows_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(tmp_path))
    assert main(["pool", "status"]) == 2
    assert str(tmp_path / "pool") in capsys.readouterr().err
    from hybridkv.paths import default_cache_dir

    for cache_dir in (str(tmp_path), None):
        if cache_dir is None:
            monkeypatch.delenv("HYBRIDKV_CACHE_DIR")
        assert default_run_dir() == default_cache_dir() / "pool"


def test_another_process_sees_and_stops_the_pool() -> None:
    with MooncakePool(segment_bytes=32 * MIB) as pool:
        loaded = LocalPool.load(pool.run_dir)  # as `hybridkv pool down` would, without children
        assert loaded.master_address == pool.master_address
        assert all(server.popen is None and server.alive() for server in loaded.servers.values())
        loaded.kill(ServerRole.DAEMON)
        assert not pool.servers[ServerRole.DAEMON].alive()
        assert loaded.status()["daemon"]["alive"] is False
        loaded.restart(ServerRole.DAEMON)
        assert LocalPool.load(pool.run_dir).servers[ServerRole.DAEMON].alive()
        metrics = read_metrics(pool.ports["metrics"])
        assert metrics is not None and metrics["master_total_capacity_bytes"] >= 32 * MIB
        loaded.stop()
        assert not any(server.alive() for server in pool.servers.values())
    assert not os.path.exists(pool.run_dir)


def test_cli_up_starts_a_valkey_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "pool"
    argv = ["pool", "up", "--run-dir", str(run_dir), "--segment-size", "16MiB", "--valkey"]
    assert main([*argv, "--valkey-shards", "2", "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    try:
        entry = document["tiers"][1]
        assert entry["kind"] == "valkey" and entry["cluster"] is True
        with build_tier(parse_tier_config(entry)) as tier:
            round_trip(tier)
        assert main(["pool", "status", "--run-dir", str(run_dir), "--json"]) == 0
        status = json.loads(capsys.readouterr().out)
        assert status["valkey-shard-0"]["alive"] and status["valkey-shard-1"]["alive"]
        pids = [status[f"valkey-shard-{i}"]["pid"] for i in range(2)]
    finally:
        assert main(["pool", "down", "--run-dir", str(run_dir)]) == 0
    assert not any(pid_running(pid) for pid in pids)
