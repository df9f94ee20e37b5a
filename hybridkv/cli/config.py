"""``hybridkv config``: every configuration key, from the declarations; check a config.

CLI process. The tables come from the config dataclasses themselves
(``hybridkv.schema.field_docs``), so they cannot drift from the code; the
tables of docs/CONFIGURATION.md are this command's ``--markdown`` output
(``scripts/generate_docs.py`` writes them there; a test checks them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hybridkv.connector.config import ConnectorConfig
from hybridkv.schema import FieldDoc, field_docs
from hybridkv.tiers.registry import TIER_CONFIGS


def _tables() -> list[tuple[str, list[FieldDoc]]]:
    tables = [("kv_connector_extra_config", field_docs(ConnectorConfig))]
    for config in TIER_CONFIGS:
        tables.append((f"tiers entry, kind {config.kind!r}", field_docs(config)))
    return tables


def render_markdown() -> str:
    """The configuration tables of docs/CONFIGURATION.md."""
    blocks = []
    for title, docs in _tables():
        rows = [f"**{title}**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for d in docs:
            cells = (d.type_text, d.default_text, d.description)
            text = " | ".join(_markdown_cell(cell) for cell in cells)
            rows.append(f"| `{d.name}` | {text} |")
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks)


def _markdown_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render_text() -> str:
    lines = []
    for title, docs in _tables():
        lines.append(title)
        width = max(len(d.name) for d in docs)
        for d in docs:
            lines.append(f"  {d.name.ljust(width)}  {d.description}")
            lines.append(f"  {' ' * width}  type {d.type_text}; default {d.default_text}")
        lines.append("")
    return "\n".join(lines).rstrip()


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check",
        metavar="JSON_OR_FILE",
        help="check a kv_connector_extra_config (JSON text or a file) and print it resolved",
    )
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown")


def run(args: argparse.Namespace) -> int:
    if args.check is None:
        print(render_markdown() if args.markdown else render_text())
        return 0
    raw = _read_json(args.check)
    config = ConnectorConfig.from_dict(raw)  # a ConfigError is printed by the CLI
    tiers = [_plain(tier) for tier in config.tier_configs]
    print(json.dumps({"ok": True, "tiers": tiers}, indent=2))
    return 0


def _read_json(text_or_path: str) -> Any:
    path = Path(text_or_path)
    text = path.read_text() if path.is_file() else text_or_path
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--check: not JSON text nor a JSON file: {exc}") from None


def _plain(config: Any) -> dict[str, Any]:
    import dataclasses

    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.repr:
            continue  # secrets
        value = getattr(config, f.name)
        out[f.name] = value.value if hasattr(value, "value") else value
        if isinstance(value, Path):
            out[f.name] = str(value)
    return out
