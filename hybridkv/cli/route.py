"""``hybridkv route serve``: answer, over HTTP, how much of a prompt each engine would load.

CLI process. The engines are given by their cards (``engine_card`` in each
engine's connector config); the service is ``hybridkv.route.server``.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from hybridkv.route.engines import Engines, engine_names
from hybridkv.route.server import RouteServer
from hybridkv.tools.servers import HOST

DEFAULT_PORT = 8740


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["serve"])
    parser.add_argument("--card", type=Path, action="append", required=True, help="an engine's "
                        "card (its connector config's engine_card); once per engine; the "
                        "engine's name is the file name without .json")  # fmt: skip
    parser.add_argument("--host", default=HOST, help=f"address to bind (default {HOST}: this "
                        "machine only; the API has no authentication)")  # fmt: skip
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to bind (default "
                        "%(default)s; 0: a free one, printed at start)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    engines = Engines(engine_names(args.card))
    try:
        server = RouteServer(engines, args.host, args.port)
    except OSError as exc:
        engines.close()
        print(f"hybridkv route: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _exit)
    for entry in engines.refresh():
        if entry.lookup is None:
            print(f"  engine {entry.name}: {entry.error} (read again once written)")
        else:
            print(f"  engine {entry.name}: {entry.lookup.card.model_groups.model_id}")
    print(f"hybridkv route: serving {len(engines.entries)} engines at {server.url} "
          "(GET /engines, POST /lookup)", flush=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engines.close()
    return 0


def _exit(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
