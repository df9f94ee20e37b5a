"""Where hybridkv keeps files by default: one rule for every process and tool.

Any process; imports nothing heavy.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "HYBRIDKV_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$HYBRIDKV_CACHE_DIR`` when set, else the user's cache directory + ``hybridkv``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "hybridkv"
