"""Ending a worker without losing what it stored: at shutdown, at interpreter exit, on SIGTERM.

Worker process. A store reaches the first tier when its transfer job ends and
the slower tiers (disk, pool) through the write-back thread; both threads die
with the process. ``close_worker`` waits for them for up to the configured
bound (``exit_flush_timeout_s``), counts the blocks it leaves behind
(``unflushed_blocks``, and a warning in the log), then stops the worker.

``flush_at_exit`` makes that happen when a process ends without the engine's
shutdown: at interpreter exit (an offline script that returns), and on SIGTERM
where nothing else handles it (the default would end the process at once;
the signal is delivered again, with the default action, once the workers are
closed). Where the engine handles SIGTERM itself (vLLM's engine and worker
processes, a server), its shutdown closes the worker; a multi-process vLLM
engine kills its processes a few seconds after asking them to stop, whatever
this bound is.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.connector.worker import ConnectorWorker

logger = logging.getLogger(__name__)

_live: set[ConnectorWorker] = set()
"""Workers to close at exit; held until closed, so one its engine dropped without a
shutdown still flushes."""
_lock = threading.RLock()  # the SIGTERM handler may interrupt a holder on its own thread
_installed = False


def close_worker(worker: ConnectorWorker, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the worker's stores and then its write-back, count
    the blocks neither finished, and stop its transfer engine and tiers."""
    with _lock:
        _live.discard(worker)
    end = time.monotonic() + timeout_s
    unstored = 0
    engine = worker.engine
    if engine is not None:
        engine.wait(None, timeout_s)
        unstored = worker.collect_results()
        engine.close(_left(end))
    worker.store.flush(_left(end))
    unwritten = worker.store.write_back_stats().num_pending
    worker.store.close(0.0)
    worker.stats.unflushed_blocks += unstored + unwritten
    if unstored or unwritten:
        logger.warning(
            "hybridkv worker %s stopped after %.1f s (exit_flush_timeout_s) with %d blocks "
            "not stored and %d not written to the slower tiers",
            worker.rank.label,
            timeout_s,
            unstored,
            unwritten,
        )


def flush_at_exit(worker: ConnectorWorker) -> None:
    """Close ``worker`` (``ConnectorWorker.close``) at interpreter exit or on SIGTERM,
    unless it was closed before (it is kept until then)."""
    global _installed
    with _lock:
        _live.add(worker)
        if _installed:
            return
        _installed = True
    atexit.register(_close_all)
    _take_sigterm()


def _close_all() -> None:
    with _lock:
        workers = list(_live)
    for worker in workers:
        try:
            worker.close()
        except Exception:  # one worker's failure must not keep the others from flushing
            logger.exception("hybridkv worker %s: closing at exit failed", worker.rank.label)


def _take_sigterm() -> None:
    """Handle SIGTERM where its action is the default one (only the main thread may)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # The interrupted thread may hold a lock the flush needs: flush on a thread of its
    # own and wait for it no longer than the workers' bounds, then die as SIGTERM would.
    with _lock:
        bound = max((worker.close_timeout_s for worker in _live), default=0.0)
    closer = threading.Thread(target=_close_all, name="hybridkv-exit-flush", daemon=True)
    closer.start()
    closer.join(bound + 1.0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _left(end: float) -> float:
    return max(0.0, end - time.monotonic())
