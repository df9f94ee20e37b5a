"""Running one piece of work on several threads at once, for tests of thread safety."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

import numpy as np

from hybridkv.tiers.base import GetStatus, PutStatus, StoreKey, Tier


def run_on_threads(work: Callable[[int], None], num_threads: int) -> None:
    """``work(seed)`` for each seed below ``num_threads``, all at once, each on a thread of
    its own; returns when every one has finished."""
    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def random_calls_on_threads(
    tier: Tier,
    key: Callable[[int], StoreKey],
    payload: Callable[[StoreKey, int], np.ndarray],
    sizes: list[int],
    num_calls: int,
) -> list[str]:
    """Eight threads each make ``num_calls`` random calls on 40 keys (key i holds
    ``sizes[i % len(sizes)]`` bytes): puts, gets, contains, integrity checks (which must
    hold while the others run) and deletes. Returns what went wrong: a failed put, an
    unexpected status, wrong bytes."""
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(num_calls):
            i = rng.randrange(40)
            k, n = key(i), sizes[i % len(sizes)]
            op = rng.random()
            if op < 0.4:
                put = tier.put_many([k], [payload(k, n)])[0]
                if put not in (PutStatus.OK, PutStatus.EXISTS, PutStatus.FULL):
                    errors.append(f"put {k}: {put}")
            elif op < 0.8:
                out = np.zeros(n, dtype=np.uint8)
                status = tier.get_many_into([k], [out])[0]
                if status is GetStatus.OK and not np.array_equal(out, payload(k, n)):
                    errors.append(f"wrong bytes for {k}")
                elif status not in (GetStatus.OK, GetStatus.MISS):
                    errors.append(f"get {k}: {status}")
            elif op < 0.85:
                tier.contains_many([k, key(i + 1)])
            elif op < 0.9:
                tier.check_integrity()
            else:
                tier.delete_many([k])

    run_on_threads(work, num_threads=8)
    return errors
