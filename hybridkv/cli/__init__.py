"""`hybridkv` command line: one subcommand per module, imported lazily.

Each subcommand module exposes ``configure_parser(parser)`` and
``run(args) -> int``; importing vLLM or Mooncake happens only when the
subcommand that needs them runs.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "inspect": (
        "hybridkv.cli.inspect",
        "show a model's KV groups and what a hybrid-aware load moves",
    ),
    "demo": (
        "hybridkv.cli.demo",
        "time to first token of a Gemma 3 270M-shaped model: cold, from the tiers, after a restart",
    ),
    "bench": (
        "hybridkv.cli.bench",
        "replay a serving workload on vLLM, alone and with hybridkv's tiers",
    ),
    "pool": ("hybridkv.cli.pool", "start or stop a local Mooncake pool on loopback"),
    "config": ("hybridkv.cli.config", "list every configuration key, or check a config"),
    "route": (
        "hybridkv.cli.route",
        "serve each engine's cache hits for a prompt over HTTP, for routers",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser; only ``command``'s module is imported to fill its options."""
    parser = argparse.ArgumentParser(
        prog="hybridkv", description="KV cache offload for hybrid-attention LLMs."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        if name == command:
            importlib.import_module(module_name).configure_parser(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((arg for arg in argv if arg in SUBCOMMANDS), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args))
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"hybridkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
