"""The demo's pure parts: arguments, prompts, per-group split, table, verdict.

The whole demo (engines in child processes) runs in ``tests/e2e/test_demo_e2e.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from hybridkv.cli import demo, demo_report
from hybridkv.cli.demo_report import RunReport
from hybridkv.spec import GroupKind, make_layer_names
from hybridkv.tools.models import GroupShape, TinyModelKind

SLIDING = GroupShape(
    kind=GroupKind.SLIDING_WINDOW, layer_names=make_layer_names("s", [0, 2]), sliding_window=32
)
FULL = GroupShape(kind=GroupKind.FULL, layer_names=make_layer_names("f", [1]))


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.configure_parser(parser)
    return parser.parse_args(list(argv))


def report(name: str, outputs: list[list[int]], **kwargs: object) -> RunReport:
    fields: dict[str, object] = {
        "name": name,
        "num_prompt_tokens": 800,
        "num_cached_tokens": 0,
        "num_external_tokens": 0,
        "loaded_blocks": 0,
        "load_bytes": 0,
        "store_bytes": 0,
        "ttft_s": 0.25,
        "output_token_ids": outputs,
        "cached_tokens_per_request": [0] * len(outputs),
    }
    fields.update(kwargs)
    return RunReport(**fields)  # type: ignore[arg-type]


def test_defaults_and_cache_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = demo.config_from_args(parse())
    assert config.model is TinyModelKind.GEMMA3
    assert config.cache_dir == tmp_path / ".hybridkv-cache"
    assert not config.keep_cache
    config = demo.config_from_args(parse("--model", "qwen3-next", "--keep-cache"))
    assert config.model is TinyModelKind.QWEN3_NEXT and config.keep_cache


def test_unknown_model_is_refused_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        parse("--model", "llama")


def test_prompts_share_the_prefix_and_differ_after_it() -> None:
    config = demo.config_from_args(parse())
    prompts = demo.demo_prompts(config, vocab_size=512)
    n = config.prefix_tokens
    assert len(prompts) == config.num_prompts == 4
    assert all(len(p) == n + config.suffix_tokens for p in prompts)
    # Every prompt leaves its last partial block to compute: hits end at 384.
    assert all((len(p) - 1) // 32 * 32 == 384 for p in prompts)
    assert prompts[0][:n] == prompts[1][:n] == prompts[2][:n] == prompts[3][:n]
    assert len({tuple(p[n:]) for p in prompts}) == 4


def test_format_bytes_units() -> None:
    assert demo_report.format_bytes(0) == "0 B"
    assert demo_report.format_bytes(1023) == "1023 B"
    assert demo_report.format_bytes(1536) == "1.5 KiB"
    assert demo_report.format_bytes(832 * 1024) == "832.0 KiB"
    assert demo_report.format_bytes(3 << 30) == "3.0 GiB"
    assert demo_report.format_bytes(5000 << 30) == "5000.0 GiB"


def test_table_columns_line_up() -> None:
    text = demo_report.format_table([["run", "n"], ["cold", "1"], ["restart", "12345"]])
    lines = text.splitlines()
    assert lines[0] == "run          n"
    assert lines[1] == "-------  -----"
    assert lines[2] == "cold         1"
    assert lines[3] == "restart  12345"
    assert demo_report.format_table([]) == ""


def test_rows_show_per_group_blocks_and_matches() -> None:
    cold = report("cold", [[1, 2], [3, 4]], store_bytes=480 * 1024)
    warm = report(
        "warm",
        [[1, 2], [3, 4]],
        num_external_tokens=384,
        cached_tokens_per_request=[192, 192],
        loaded_blocks=14,
        load_bytes=14 * 16384,
        group_blocks=[2, 12],
    )
    restart = report(
        "restart",
        [[1, 2], [3, 5]],
        num_external_tokens=384,
        cached_tokens_per_request=[192, 192],
        loaded_blocks=14,
        group_blocks=[2, 12],
    )
    rows = demo_report.report_rows([cold, warm, restart], [SLIDING, FULL])
    assert rows[0][3] == "blocks loaded (g0 sliding_window/g1 full)"
    assert rows[1] == ["cold", "800", "0", "0", "0 B", "480.0 KiB", "250", "reference"]
    assert rows[2][2:5] == ["384", "2/12 = 14", "224.0 KiB"]
    assert rows[2][7] == "match"
    assert rows[3][3] == "2/12 = 14"
    assert rows[3][7] == "DIFFER"


def test_bfloat16_runs_match_within_noise_but_not_beyond() -> None:
    lps = [[{"1": -1.0, "7": -1.01}, {"2": -0.5, "3": -2.0}]]
    cold = report("cold", [[1, 2]], top_logprobs=lps)
    # Position 0 was a near-tie: a flip there is batch noise, not a wrong block.
    flipped = report(
        "warm",
        [[7, 9]],
        top_logprobs=[[{"7": -1.0, "1": -1.02}, {"9": -0.1}]],
        num_external_tokens=10,
    )
    assert demo_report.verdict([cold, flipped], exact=False) == []
    assert demo_report.report_rows([cold, flipped], [FULL], exact=False)[2][7] == "match"
    assert demo_report.verdict([cold, flipped], exact=True) != []
    drifted = report(
        "warm",
        [[1, 2]],
        top_logprobs=[[{"1": -1.0, "7": -1.01}, {"2": -0.9, "3": -2.0}]],
        num_external_tokens=10,
    )
    assert demo_report.verdict([cold, drifted], exact=False) == [
        "warm run: outputs of prompts [0] differ from the cold run"
    ]


def test_verdict_names_runs_that_differ_or_loaded_nothing() -> None:
    cold = report("cold", [[1, 2], [3, 4]])
    good = report("warm", [[1, 2], [3, 4]], num_external_tokens=10)
    assert demo_report.verdict([cold, good]) == []
    bad = report("restart", [[1, 2], [3, 9]], num_external_tokens=0)
    assert demo_report.verdict([cold, good, bad]) == [
        "restart run: outputs of prompts [1] differ from the cold run",
        "restart run: loaded no tokens from the tiers",
    ]
    assert demo_report.verdict([]) == ["no runs finished"]


def test_clear_stored_kv_keeps_the_model_and_unrelated_files(tmp_path: Path) -> None:
    (tmp_path / "kv" / "ab").mkdir(parents=True)
    (tmp_path / "kv" / "ab" / "x.kv").write_bytes(b"x")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "keep").write_text("m")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / demo.ENGINE_LOG).write_text("log")
    demo.clear_stored_kv(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "notes.txt"]
