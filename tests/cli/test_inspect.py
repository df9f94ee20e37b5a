"""``hybridkv inspect``: the numbers (pure function) and the command line around them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cli import main
from hybridkv.cli.inspect import compute_report
from hybridkv.groups import GroupKind, KVGroup, ModelGroups
from hybridkv.tools.presets import deepseek_v4_flash, gemma3_27b, qwen3_next_80b_a3b

GEMMA_PAGE = 2 * 16 * 16 * 128 * 2  # K+V x block x KV heads x head_dim x bf16


def brute_hybrid_blocks(group: KVGroup, num_tokens: int) -> int:
    """Blocks holding the tokens a group needs to resume at num_tokens, by enumeration."""
    if group.kind is GroupKind.MAMBA:
        return 1 if num_tokens else 0
    if group.kind is GroupKind.FULL:
        needed = range(num_tokens)
    elif group.kind is GroupKind.SLIDING_WINDOW:
        assert group.sliding_window is not None
        needed = range(max(0, num_tokens - group.sliding_window + 1), num_tokens)
        # vLLM keeps at least one block of a window (a window of 1 token needs none).
        return max(1, len({t // group.block_size for t in needed})) if num_tokens else 0
    else:
        assert group.attention_chunk_size is not None
        needed = range(
            num_tokens // group.attention_chunk_size * group.attention_chunk_size, num_tokens
        )
    return len({t // group.block_size for t in needed})


def test_gemma3_32k_hit_moves_about_19_percent() -> None:
    report = compute_report(gemma3_27b(), hit_tokens=32768)
    # 10 full layers need all 2048 blocks; 52 sliding layers need the last 1024 tokens = 64 blocks.
    assert report.hybrid_bytes == (10 * 2048 + 52 * 64) * GEMMA_PAGE == 3_120_562_176
    assert report.blind_bytes == 62 * 2048 * GEMMA_PAGE == 16_642_998_272
    assert report.ratio == pytest.approx(0.1875)
    notes_estimate = 1 / 6 + 5 / 6 * 1024 / 32768  # the design notes' "about 19%"
    assert abs(report.ratio - notes_estimate) < 0.01
    assert [g.hybrid_blocks for g in report.groups] == [64] * 6 + [2048]
    assert [g.bytes_per_token for g in report.groups][-1] == 10 * GEMMA_PAGE / 16
    assert report.hit_tokens == report.requested_hit_tokens == 32768
    assert report.alignment_tokens == 16


def test_qwen3_next_hit_is_aligned_and_mamba_moves_one_state() -> None:
    report = compute_report(qwen3_next_80b_a3b(), hit_tokens=32768)
    page = 544 * 2048
    assert report.hit_tokens == 60 * 544 == 32640
    assert [g.hybrid_blocks for g in report.groups] == [1, 1, 1, 60]
    assert [g.blind_blocks for g in report.groups] == [60] * 4
    assert report.hybrid_bytes == (3 * 12 + 60 * 12) * page
    assert report.blind_bytes == 60 * 48 * page
    assert report.ratio == pytest.approx(756 / 2880)


def test_deepseek_v4_flash_numbers_match_enumeration() -> None:
    model_groups = deepseek_v4_flash()
    report = compute_report(model_groups, hit_tokens=4096)
    expected_blocks = [brute_hybrid_blocks(g, 4096) for g in model_groups.groups]
    assert [g.hybrid_blocks for g in report.groups] == expected_blocks == [2, 2, 16, 2, 16]
    assert [g.blind_blocks for g in report.groups] == [64, 64, 16, 1024, 512]


def test_deepseek_v4_flash_stores_vllms_tail_per_segment() -> None:
    """Per 256-token segment vLLM caches group 0's block, sliding KV blocks 2-3 of 4, CSA
    state blocks 62-63 of 64 and HCA state blocks 16-31 of 32."""
    model_groups = deepseek_v4_flash()
    report = compute_report(model_groups, hit_tokens=4096)
    tails = {64: 2, 4: 2, 8: 16}  # block size -> tail blocks per segment
    want = 0
    for g in model_groups.groups:
        want += g.block_bytes * (1 if g.kind is GroupKind.FULL else tails[g.block_size])
    assert report.alignment_tokens == 256
    assert report.stored_bytes_per_segment == want
    assert report.stored_bytes == want * 4096 // 256
    blind = sum(g.block_bytes * 4096 // g.block_size for g in model_groups.groups)
    assert report.blind_stored_bytes == blind and report.stored_ratio == want * 16 / blind


@pytest.mark.parametrize(("alignment", "sliding_share"), [(1024, 1.0), (2048, 0.5), (8192, 0.125)])
def test_gemma3_stores_only_each_segments_window(alignment: int, sliding_share: float) -> None:
    """52 sliding layers keep the 1024-token window before each boundary, 10 full ones all."""
    report = compute_report(gemma3_27b(), hit_tokens=32768, alignment_tokens=alignment)
    assert report.stored_ratio == pytest.approx((10 + 52 * sliding_share) / 62)
    assert report.stored_bytes_per_segment == pytest.approx(
        (10 + 52 * sliding_share) * GEMMA_PAGE / 16 * alignment
    )
    # Loads are unchanged by what is stored: the same window of each sliding group.
    assert report.hybrid_bytes == compute_report(gemma3_27b(), hit_tokens=32768).hybrid_bytes


@st.composite
def layouts(draw: st.DrawFn) -> ModelGroups:
    groups = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(list(GroupKind)))
        block_size = draw(st.sampled_from([2, 4, 8, 16]))
        groups.append(
            KVGroup(
                kind=kind,
                block_size=block_size,
                page_size_bytes=draw(st.integers(1, 4096)),
                layer_names=tuple(f"l{i}.{j}" for j in range(draw(st.integers(1, 3)))),
                sliding_window=draw(st.integers(1, 100))
                if kind is GroupKind.SLIDING_WINDOW
                else None,
                attention_chunk_size=block_size * draw(st.integers(1, 6))
                if kind is GroupKind.CHUNKED_LOCAL
                else None,
            )
        )
    return ModelGroups(groups=tuple(groups))


@given(layouts(), st.integers(1, 400))
@settings(max_examples=200, deadline=None)
def test_report_matches_brute_force(model_groups: ModelGroups, hit_tokens: int) -> None:
    if hit_tokens < model_groups.scheduler_block_size:
        with pytest.raises(ValueError, match="must be an int >= the alignment"):
            compute_report(model_groups, hit_tokens=hit_tokens)
        return
    if any(
        g.kind is GroupKind.CHUNKED_LOCAL and g.block_size != model_groups.scheduler_block_size
        for g in model_groups.groups
    ):  # as in vLLM, chunked local attention needs hits aligned to its own block size
        with pytest.raises(ValueError, match="chunked local attention needs"):
            compute_report(model_groups, hit_tokens=hit_tokens)
        return
    report = compute_report(model_groups, hit_tokens=hit_tokens)
    n = max(t for t in range(hit_tokens + 1) if t % model_groups.scheduler_block_size == 0)
    assert report.hit_tokens == n
    hybrid = blind = 0
    for group, load in zip(model_groups.groups, report.groups, strict=True):
        blocks = brute_hybrid_blocks(group, n)
        assert load.hybrid_blocks == blocks
        assert load.hybrid_bytes == blocks * group.page_size_bytes * group.num_layers
        assert load.blind_blocks == len(range(0, n, group.block_size))
        hybrid += load.hybrid_bytes
        blind += load.blind_bytes
    assert (report.hybrid_bytes, report.blind_bytes) == (hybrid, blind)
    assert report.ratio == hybrid / blind


# ---------------------------------------------------------------- the command line


def test_cli_prints_groups_totals_and_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "gemma3-27b"]) == 0
    out = capsys.readouterr().out
    assert "google/gemma-3-27b-it" in out
    assert "hit of 32768 tokens" in out
    assert "(3120562176 B)" in out and "(16642998272 B)" in out
    assert "ratio 18.75%" in out
    group_rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["6"])]
    assert group_rows[0][:6] == ["0", "sliding_window", "16", "1024", "9", str(GEMMA_PAGE)]
    assert group_rows[1][:6] == ["6", "full", "16", "-", "10", str(GEMMA_PAGE)]


def test_cli_json_equals_the_pure_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "qwen3-next-80b-a3b", "--hit-tokens", "10000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = compute_report(qwen3_next_80b_a3b(), hit_tokens=10000)
    assert data == json.loads(json.dumps(expected.to_dict()))
    assert data["hit_tokens"] == 18 * 544
    assert [g["kind"] for g in data["groups"]] == ["mamba"] * 3 + ["full"]


def test_cli_hits_at_a_coarser_alignment(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "deepseek-v4-flash", "--hit-tokens", "4000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["alignment_tokens"], data["hit_tokens"]) == (256, 3840)
    argv = ["inspect", "deepseek-v4-flash", "--hit-tokens", "4000", "--alignment-tokens", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "hit of 3584 tokens (requested 4000)" in out and "hits aligned to 512 tokens" in out


def test_cli_reads_a_layout_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "groups.json"
    path.write_text(json.dumps(gemma3_27b().to_dict()))
    assert main(["inspect", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fingerprint"] == gemma3_27b().fingerprint
    assert data["hybrid_bytes"] == 3_120_562_176


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["inspect", "no-such-model"], "neither a preset nor a groups JSON file"),
        (
            ["inspect", "deepseek-v4-flash", "--alignment-tokens", "6"],
            "alignment_tokens=6 is not a multiple of the block_size",
        ),
        (["inspect", "qwen3-next-80b-a3b", "--hit-tokens", "100"], "the alignment 544"),
    ],
)
def test_cli_errors_are_clean(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert fragment in captured.err
    assert "Traceback" not in captured.err
