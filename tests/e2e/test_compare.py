"""The output comparison the end-to-end tests rely on (pure, fast)."""

from __future__ import annotations

from typing import Any

from tests.e2e.compare import output_problems, request_problem

# Three positions, top tokens with log-probabilities.
WANT_IDS = [5, 7, 9]
WANT_LPS = [
    {"5": -1.00, "6": -1.50, "8": -3.0},
    {"7": -2.00, "3": -2.02, "4": -2.5},
    {"9": -0.50, "1": -2.00},
]


def test_identical_runs_match_both_ways() -> None:
    assert request_problem(WANT_IDS, WANT_LPS, WANT_IDS, WANT_LPS, exact=True) is None
    assert request_problem(WANT_IDS, WANT_LPS, WANT_IDS, WANT_LPS, exact=False) is None


def test_small_drift_passes_large_drift_fails() -> None:
    got = [dict(p) for p in WANT_LPS]
    got[2]["9"] = -0.60
    assert request_problem(WANT_IDS, WANT_LPS, WANT_IDS, got, exact=False) is None
    got[2]["9"] = -0.90
    problem = request_problem(WANT_IDS, WANT_LPS, WANT_IDS, got, exact=False)
    assert problem is not None and "position 2" in problem and "0.400" in problem


def test_divergence_at_a_near_tie_passes_and_stops_comparing() -> None:
    got_ids = [5, 3, 1]  # position 1: 3 instead of 7 (gap 0.02), then anything
    got_lps = [
        dict(WANT_LPS[0]),
        {"3": -2.005, "7": -2.01, "4": -2.5},
        {"1": -0.1, "9": -5.0},
    ]
    assert request_problem(WANT_IDS, WANT_LPS, got_ids, got_lps, exact=False) is None
    assert request_problem(WANT_IDS, WANT_LPS, got_ids, got_lps, exact=True) is not None


def test_divergence_with_a_clear_preference_fails() -> None:
    got_ids = [6, 7, 9]  # reference preferred 5 over 6 by 0.5
    got_lps = [{"6": -1.0, "5": -1.01}, *WANT_LPS[1:]]
    problem = request_problem(WANT_IDS, WANT_LPS, got_ids, got_lps, exact=False)
    assert problem is not None and "reference preferred 5 by 0.500" in problem
    # The run itself clearly preferring its token fails as well.
    got_lps = [{"6": -0.5, "5": -1.49, "8": -3.0}, *WANT_LPS[1:]]
    want_lps = [{"5": -1.00, "6": -1.01}, *WANT_LPS[1:]]
    problem = request_problem(WANT_IDS, want_lps, got_ids, got_lps, exact=False)
    assert problem is not None and "run preferred 6" in problem


def test_token_missing_from_top_list_fails() -> None:
    got_ids = [2, 7, 9]
    got_lps = [{"2": -0.1, "5": -4.0}, *WANT_LPS[1:]]
    problem = request_problem(WANT_IDS, WANT_LPS, got_ids, got_lps, exact=False)
    assert problem is not None and "2 not in the reference's top tokens" in problem


def test_output_problems_name_the_request_and_its_cache_hit() -> None:
    def record(ids: list[list[int]], lps: list[list[dict[str, float]]]) -> dict[str, Any]:
        return {
            "output_token_ids": ids,
            "top_logprobs": lps,
            "num_prompt_tokens": [200, 330],
            "num_cached_tokens": [192, 320],
        }

    want = record([WANT_IDS, WANT_IDS], [WANT_LPS, WANT_LPS])
    bad = [dict(p) for p in WANT_LPS]
    bad[0]["5"] = -3.0
    got = record([WANT_IDS, WANT_IDS], [WANT_LPS, bad])
    assert output_problems(want, want, exact=False) == []
    problems = output_problems(got, want, exact=False)
    assert len(problems) == 1 and problems[0].startswith(
        "request 1 (prompt 330 tokens, cached 320)"
    )
    assert output_problems(record([WANT_IDS], [WANT_LPS]), want, exact=True) == ["1 requests != 2"]
