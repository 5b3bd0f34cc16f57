"""Where compiled kernels are cached: one per-user directory shared by both backends.

``$METRALE_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/metrale-attn``, else
``~/.cache/metrale-attn``. Entries are named by a hash of everything that went into
them, so a stale entry is never reused and concurrent writers only race to write
the same bytes (each writes a temporary file and renames it into place).
"""

from __future__ import annotations

import os
from pathlib import Path


CACHE_DIR = "METRALE_ATTN_CACHE_DIR"


def cache_root() -> Path:
    """The cache directory (not created here)."""
    root = os.environ.get(CACHE_DIR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "metrale-attn") if xdg else os.path.join(Path.home(), ".cache", "metrale-attn")
    return Path(root)
