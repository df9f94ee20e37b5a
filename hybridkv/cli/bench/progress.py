"""Progress bars for ``hybridkv bench`` (tqdm, on stderr): engines starting, requests done.

CLI process; tqdm is imported here only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class Bars:
    def __init__(self) -> None:
        self._bars: dict[str, Any] = {}

    def starting(self, label: str) -> Callable[[], None]:
        from tqdm import tqdm

        bar = tqdm(desc=f"starting {label}", bar_format="{desc}: {elapsed}", file=sys.stderr)
        self._bars[label] = bar
        return lambda: bar.refresh()

    def started(self, label: str, seconds: float) -> None:
        bar = self._bars.pop(label, None)
        if bar is not None:
            bar.set_description_str(f"{label} ready")
            bar.close()

    def replaying(self, label: str, num_requests: int) -> Callable[[], None]:
        from tqdm import tqdm

        bar = tqdm(total=num_requests, desc=label, unit="req", file=sys.stderr)
        self._bars[label] = bar
        return lambda: bar.update(1)

    def replayed(self, label: str) -> None:
        bar = self._bars.pop(label, None)
        if bar is not None:
            bar.close()
