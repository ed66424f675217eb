"""Where looptrain keeps what it measured once and can reuse: estimates, the planner's probes, this device's
matmul peak.

`cache_dir()` is ``$LOOPTRAIN_CACHE_DIR``, else ``$XDG_CACHE_HOME/looptrain``, else ``~/.cache/looptrain``.
``LOOPTRAIN_CACHE_DIR=off`` (or ``0``, ``none``) turns every on-disk cache off: each figure is then
computed again in each process. Entries are small JSON files written atomically (a temporary file
renamed), so two processes may share a directory; an entry that cannot be read is recomputed.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

_OFF = {"off", "0", "none", "false", "no"}


def cache_dir() -> Path | None:
    """The cache's root directory, or None when ``LOOPTRAIN_CACHE_DIR`` turns caching off."""
    explicit = os.environ.get("LOOPTRAIN_CACHE_DIR")
    if explicit is not None:
        return None if explicit.strip().lower() in _OFF else Path(explicit).expanduser()
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "looptrain"


def read_entry(kind: str, name: str) -> dict | None:
    """The JSON object stored under ``kind/name.json``, or None (absent, unreadable, caching off)."""
    root = cache_dir()
    if root is None:
        return None
    try:
        value = json.loads((root / kind / f"{name}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_entry(kind: str, name: str, value: dict) -> None:
    """Stores `value` under ``kind/name.json``; a cache that cannot be written is skipped silently."""
    root = cache_dir()
    if root is None:
        return
    directory = root / kind
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=directory, suffix=".tmp", delete=False, encoding="utf-8") as handle:
            json.dump(value, handle)
        os.replace(handle.name, directory / f"{name}.json")
    except OSError:
        return
