"""A run's own small files, read back leniently and written whole: JSON objects, the events of metrics.jsonl, and any
file through a temporary file and a rename (a reader never sees half of one).

A leaf with no looptrain import (and no torch): the picture (`looptrain.report`), the trackers, the ledger, the run
and the recipes all read and write a run's files through it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

METRICS_FILE = "metrics.jsonl"  # the run log's events, one JSON object a line (`looptrain.run_log.RunLog`)


def read_json_object(path: str | os.PathLike) -> dict:
    """A JSON object file's content; {} when it is missing, unreadable, or not a JSON object."""
    try:
        content = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return content if isinstance(content, dict) else {}


def read_events(path: str | os.PathLike) -> list[dict]:
    """The events of a metrics.jsonl, in order. A line that is not a JSON object (the half line a killed run may
    leave at the end) is passed over."""
    events = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                events.append(event)
    return events


def write_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """Calls `write` on a temporary file beside `path`, then renames it to `path`: `path` is the old file or the whole
    new one, never half of one. A failed write leaves no temporary file behind."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)  # gone after the rename; after a failure, what was written of it


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """`text` (UTF-8) written to `path` whole (`write_atomically`), its directory created when missing."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda handle: handle.write(text.encode("utf-8")))
