"""``hybridkv pool up|down|status``: a local shared pool for trying hybridkv on one machine.

CLI process. The pool itself is ``hybridkv.tools.pool.LocalPool``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridkv.tools.pool import (
    DEFAULT_EVICTION_HIGH_WATERMARK,
    DEFAULT_EVICTION_RATIO,
    VALKEY_POLICIES,
    LocalPool,
)
from hybridkv.tools.servers import HOST, ServerRole


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="state and logs (default: $HYBRIDKV_CACHE_DIR/pool, else ~/.cache/hybridkv/pool)",
    )
    parser.add_argument(
        "--segment-size",
        default="1GiB",
        help="memory the storage daemon lends to the pool (default 1GiB)",
    )
    parser.add_argument("--valkey", action="store_true", help="also start a valkey-server")
    parser.add_argument("--valkey-maxmemory", default="1GiB", help="valkey-server maxmemory")
    parser.add_argument(
        "--valkey-shards",
        type=int,
        default=1,
        help="more than 1: a Valkey Cluster of that many primaries on loopback (default 1)",
    )
    parser.add_argument(
        "--valkey-policy",
        default="allkeys-lru",
        choices=VALKEY_POLICIES,
        help="valkey-server maxmemory-policy (default allkeys-lru)",
    )
    parser.add_argument(
        "--eviction-high-watermark",
        type=float,
        default=DEFAULT_EVICTION_HIGH_WATERMARK,
        help="share of the Mooncake pool used before the master evicts (default %(default)s)",
    )
    parser.add_argument(
        "--eviction-ratio",
        type=float,
        default=DEFAULT_EVICTION_RATIO,
        help="share of the Mooncake objects one eviction pass removes, least "
        "recently used first (default %(default)s)",
    )
    parser.add_argument(
        "--host",
        default=HOST,
        help="address every server binds (default "
        f"{HOST}: this machine only; 0.0.0.0 opens the pool to the network, "
        "with no authentication on Mooncake)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    if args.action == "up":
        return _up(args)
    if args.action == "down":
        return _down(args)
    pool = LocalPool.load(args.run_dir)
    report = pool.status()
    print(json.dumps(report, indent=2) if args.json else _describe_status(pool, report))
    alive = [info["alive"] for info in report.values() if "alive" in info]
    return 0 if all(alive) else 1


def _up(args: argparse.Namespace) -> int:
    from hybridkv.schema import parse_byte_size

    sizes = {
        name: parse_byte_size(getattr(args, name)) for name in ("segment_size", "valkey_maxmemory")
    }
    bad = [f"--{n.replace('_', '-')}={getattr(args, n)!r}" for n, size in sizes.items() if not size]
    if bad:
        raise ValueError(f"{', '.join(bad)}: must be a byte count such as 1GiB or 512MB")
    try:
        pool = LocalPool.start(
            args.run_dir,
            segment_bytes=sizes["segment_size"] or 0,
            valkey=args.valkey,
            valkey_maxmemory_bytes=sizes["valkey_maxmemory"] or 0,
            valkey_policy=args.valkey_policy,
            valkey_shards=args.valkey_shards,
            eviction_high_watermark=args.eviction_high_watermark,
            eviction_ratio=args.eviction_ratio,
            host=args.host,
        )
    except RuntimeError as exc:
        print(f"hybridkv pool up: failed: {exc}")
        return 1
    document = {
        "run_dir": str(pool.run_dir),
        "bind_host": pool.host,
        "tiers": pool.tier_configs(),
        "kv_transfer_config": pool.kv_transfer_config(),
    }
    print(json.dumps(document) if args.json else "\n".join(_describe_up(pool)))
    return 0


def _describe_up(pool: LocalPool) -> Iterator[str]:
    yield f"pool up (state and logs in {pool.run_dir}):"
    reach = "this machine only" if pool.host == HOST else "reachable from the network"
    yield f"  servers bind {pool.host} ({reach}; --host to change)"
    if ServerRole.DAEMON in pool.servers:
        yield (
            "  note: the Mooncake daemon's transfer engine listens on every address whatever "
            "--host says (Mooncake binds those ports itself); firewall them on shared hosts"
        )
    for role, server in pool.servers.items():
        yield f"  {role.value:7} pid {server.pid}  log {server.log_path}"
    for i, shard in enumerate(pool.shards):
        port = pool.shard_ports[i]
        yield f"  valkey shard {i} pid {shard.pid}  port {port}  log {shard.log_path}"
    yield f"  master at {pool.master_address}; daemon lends {pool.segment_bytes} bytes"
    yield "tiers entries (kv_connector_extra_config['tiers']):"
    for entry in pool.tier_configs():
        yield f"  {json.dumps(entry)}"
    yield "vLLM, e.g. (CPU tier in front of the pool; the CPU build has no `vllm` command):"
    yield (
        "  python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config "
        f"'{json.dumps(pool.kv_transfer_config())}'"
    )
    yield f"stop it: hybridkv pool down --run-dir {pool.run_dir}"


def _down(args: argparse.Namespace) -> int:
    try:
        pool = LocalPool.load(args.run_dir)
    except FileNotFoundError as exc:
        print(f"nothing to stop: {exc}")
        return 0
    pool.stop()
    print(f"pool in {pool.run_dir} stopped")
    return 0


def _describe_status(pool: LocalPool, report: dict[str, Any]) -> str:
    lines = [f"pool in {pool.run_dir}:"]
    for name, info in report.items():
        if "alive" in info:
            lines.append(f"  {name:7} pid {info['pid']}  {'running' if info['alive'] else 'DOWN'}")
    for name in ("pool", "valkey_pool"):
        if name in report:
            lines.append(f"  {name}: " + ", ".join(f"{k} {v}" for k, v in report[name].items()))
    return "\n".join(lines)
