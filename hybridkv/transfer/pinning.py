"""Whether the host memory a transfer engine copies through is page-locked, and what
it costs when it is not.

Worker process, at set-up. A device copy to or from pageable host memory is
synchronous whatever the caller asks (the driver stages it through a pinned
buffer of its own and returns when it is done), so on CUDA a pageable CPU tier
or staging arena turns the asynchronous copies into waits on the thread that
enqueues them, and the link never moves one job while the host prepares the
next. It still works, so it is a warning, not an error (a host may not be able
to lock that much memory), but never silent.
"""

from __future__ import annotations

from typing import NamedTuple


class HostMemory(NamedTuple):
    """One region of host memory device copies go through."""

    name: str
    """What it is, as the user would look it up (``the cpu tier's arena``)."""
    pinned: bool
    setting: str
    """The config field that pins it, and how (for the message)."""


def pageable_problem(device_type: str, regions: list[HostMemory]) -> str | None:
    """A warning naming every pageable region the copies of caches on ``device_type``
    go through, what that costs and the fix; None when there is none (or the caches
    are not on CUDA, where nothing is asynchronous)."""
    if device_type != "cuda":
        return None
    pageable = [r for r in regions if not r.pinned]
    if not pageable:
        return None
    names = " and ".join(r.name for r in pageable)
    fixes = "; ".join(r.setting for r in pageable)
    return (
        f"{names} {'is' if len(pageable) == 1 else 'are'} pageable host memory while the KV "
        "cache is on CUDA: every copy between them is synchronous (the thread that enqueues "
        "it waits until it is done, so stores and loads no longer overlap the link) and "
        f"slower than from page-locked memory. To pin: {fixes}"
    )
