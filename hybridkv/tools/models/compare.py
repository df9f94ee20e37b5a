"""Comparing a run's greedy outputs with a reference run's, exactly or within bfloat16 noise.

Any process; pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

LOGPROB_TOLERANCE = 0.2
"""Nats. vLLM on CPU is not batch invariant: batched differently (which a
connector's asynchronous loads always cause), a request's bfloat16
log-probabilities moved by up to 0.034 and near-ties flipped at gaps up to
0.064 (measured, Qwen3-Next kinds, no connector). A wrong KV block moves the
chosen token out of the top five in most requests."""


def greedy_mismatch(
    want_ids: Sequence[int],
    want_lps: Sequence[dict[str, float]],
    got_ids: Sequence[int],
    got_lps: Sequence[dict[str, float]],
    *,
    exact: bool,
    tolerance: float = LOGPROB_TOLERANCE,
) -> str | None:
    """Why greedy output ``got`` does not match ``want``; None when it does.

    ``exact`` (float32 models): the tokens must be equal. Otherwise the chosen
    tokens' log-probabilities must stay within ``tolerance`` and the first
    token that differs, if any, must be a near-tie in both runs; after it the
    contexts differ and nothing more is compared.
    """
    if exact or len(got_ids) != len(want_ids):
        return None if list(got_ids) == list(want_ids) else f"tokens {got_ids} != {want_ids}"
    for pos, (want, got) in enumerate(zip(want_ids, got_ids, strict=True)):
        want_top, got_top = want_lps[pos], got_lps[pos]
        if want == got:
            drift = abs(want_top[str(want)] - got_top[str(got)])
            if drift > tolerance:
                return f"position {pos}: token {got} log-probability moved by {drift:.3f}"
            continue
        for side, top, chosen, other in (
            ("reference", want_top, want, got),
            ("run", got_top, got, want),
        ):
            if str(other) not in top:
                return f"position {pos}: {got} != {want}; {other} not in the {side}'s top tokens"
            gap = top[str(chosen)] - top[str(other)]
            if gap > tolerance:
                return (
                    f"position {pos}: {got} != {want}; the {side} preferred {chosen} by {gap:.3f}"
                )
        return None
    return None
