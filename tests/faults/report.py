"""One JSON line per fault case, for ``docs/RELIABILITY.md`` (test helper).

``record`` appends to the file named by ``$HYBRIDKV_FAULTS_REPORT`` when it is
set (``make faults`` sets it); otherwise it does nothing. Call it after the
case's assertions, so a recorded row is a passed case; a case that fails
before recording shows up as missing (``scripts/faults_report.py`` lists the
pytest outcome next to it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

REPORT_ENV = "HYBRIDKV_FAULTS_REPORT"


def record(
    case: str,
    *,
    done: str,
    seen: str,
    passed: bool = True,
    skipped: bool = False,
    counters: Mapping[str, int | float] | None = None,
    outputs_identical: bool | None = None,
    max_stall_s: float | None = None,
    hits_resumed_s: float | None = None,
) -> None:
    """Append one row: the case, what was done, what was seen, and the counters read.

    ``skipped``: the case could not run here (say why in ``seen``). The engine
    cases also give ``outputs_identical`` (every output equal to the engine
    alone), ``max_stall_s`` (the longest request or step while the fault was
    on) and ``hits_resumed_s`` (from the recovery until the first hit); leave
    them ``None`` where they do not apply.
    """
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    row: dict[str, object] = {
        "case": case,
        "done": done,
        "seen": seen,
        "passed": passed,
        "skipped": skipped,
    }
    row["counters"] = dict(counters or {})
    row["outputs_identical"] = outputs_identical
    row["max_stall_s"] = max_stall_s
    row["hits_resumed_s"] = hits_resumed_s
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(row, sort_keys=True) + "\n")
