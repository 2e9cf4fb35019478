"""fedpeft's on-disk cache folder: ``$FEDPEFT_CACHE_DIR``, else ``~/.cache/fedpeft``."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "FEDPEFT_CACHE_DIR"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or Path.home() / ".cache" / "fedpeft")
