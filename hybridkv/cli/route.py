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
from hybridkv.route.events import EventIndex
from hybridkv.route.server import RouteServer
from hybridkv.tools.servers import HOST

DEFAULT_PORT = 8740


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["serve"])
    parser.add_argument(
        "--card",
        type=Path,
        action="append",
        required=True,
        help="an engine's "
        "card (its connector config's engine_card); once per engine; the "
        "engine's name is the file name without .json",
    )
    parser.add_argument(
        "--events",
        action="append",
        default=[],
        metavar="NAME=ENDPOINT",
        help="follow engine NAME's KV events: bind ENDPOINT (e.g. "
        "tcp://127.0.0.1:5557) and give the same endpoint to that engine's "
        "kv_events_config (publisher zmq); its CPU tier and prefix cache then "
        "count too",
    )
    parser.add_argument(
        "--host",
        default=HOST,
        help=f"address to bind (default {HOST}: this machine only; the API has no authentication)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="port to bind (default %(default)s; 0: a free one, printed at start)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        cards = engine_names(args.card)
        endpoints = dict(_split_events(text) for text in args.events)
        if endpoints:  # vLLM decodes its events; imported only when they are followed
            from hybridkv.integrations.vllm.event_feed import EventFeed
        indexes = {name: EventIndex() for name in endpoints}
        feeds = {
            name: EventFeed(indexes[name].apply, endpoint=ep) for name, ep in endpoints.items()
        }
    except (ValueError, OSError) as exc:  # zmq's errors are OSErrors
        print(f"hybridkv route: {exc}", file=sys.stderr)
        return 2
    try:
        engines = Engines(cards, events=indexes)
        server = RouteServer(engines, args.host, args.port)
    except (ValueError, OSError) as exc:
        for feed in feeds.values():
            feed.close()
        print(f"hybridkv route: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, _exit)
    for entry in engines.reread():
        if entry.lookup is None:
            print(f"  engine {entry.name}: {entry.error} (read again once written)")
        else:
            print(f"  engine {entry.name}: {entry.lookup.card.model_groups.model_id}")
    print(
        f"hybridkv route: serving {len(engines.entries)} engines at {server.url} "
        "(GET /engines, POST /lookup)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        engines.close()
        for feed in feeds.values():
            feed.close()
    return 0


def _split_events(text: str) -> tuple[str, str]:
    name, sep, endpoint = text.partition("=")
    if not sep or not name or not endpoint.startswith("tcp://"):
        raise ValueError(f"--events {text!r}: give NAME=tcp://HOST:PORT (an engine's name)")
    return name, endpoint


def _exit(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
