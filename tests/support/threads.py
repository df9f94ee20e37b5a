"""Running one piece of work on several threads at once, for tests of thread safety."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_on_threads(work: Callable[[int], None], num_threads: int) -> None:
    """``work(seed)`` for each seed below ``num_threads``, all at once, each on a thread of
    its own; returns when every one has finished."""
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
