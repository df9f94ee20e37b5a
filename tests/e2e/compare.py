"""Compare the greedy outputs of two generate records, exactly or within bfloat16 noise.

vLLM on CPU is not batch invariant: the same request batched differently
(which a connector's asynchronous loads always cause) gets slightly
different bfloat16 logits, and a tiny random model's top tokens are close
enough for that to flip a greedy choice. The rule is
``hybridkv.tools.models.greedy_mismatch`` (the demo uses it too): the chosen
tokens' log-probabilities stay within a tolerance, and the first differing
token, if any, is a near-tie in both runs. A wrong KV block moves
log-probabilities far more: ``test_vllm_models.py`` checks that a zeroed
group fails this comparison.
"""

from __future__ import annotations

from typing import Any

from hybridkv.tools.models import LOGPROB_TOLERANCE, greedy_mismatch

__all__ = ["LOGPROB_TOLERANCE", "output_problems", "request_problem"]

request_problem = greedy_mismatch


def output_problems(got: dict[str, Any], want: dict[str, Any], *, exact: bool) -> list[str]:
    """One line per request of generate record ``got`` that does not match ``want``."""
    if len(got["output_token_ids"]) != len(want["output_token_ids"]):
        return [f"{len(got['output_token_ids'])} requests != {len(want['output_token_ids'])}"]
    problems = []
    for i, want_ids in enumerate(want["output_token_ids"]):
        problem = greedy_mismatch(
            want_ids,
            want["top_logprobs"][i],
            got["output_token_ids"][i],
            got["top_logprobs"][i],
            exact=exact,
        )
        if problem is not None:
            problems.append(
                f"request {i} (prompt {got['num_prompt_tokens'][i]} tokens, cached "
                f"{got['num_cached_tokens'][i]}): {problem}"
            )
    return problems
