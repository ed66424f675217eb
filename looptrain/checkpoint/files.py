"""Files written so that a reader or a crash never sees half of one: JSON through a temporary file and a rename,
fsync of a finished directory, and the rename that publishes a checkpoint directory."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looptrain.checkpoint.layout import CheckpointError
from looptrain.run_files import write_text_atomic


def _json_default(value: Any) -> Any:
    """Numbers from numpy or torch in the trainer state become plain python numbers."""
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"trainer_state value of type {type(value).__name__} is not JSON serializable")


def write_json(value: dict[str, Any], path: Path) -> None:
    """Writes a checkpoint's JSON file (sorted keys, numpy and torch numbers as plain numbers).

    Raises:
        CheckpointError: A value JSON cannot hold; the message names the file.
    """
    try:
        text = json.dumps(value, indent=2, sort_keys=True, default=_json_default)
    except TypeError as error:
        raise CheckpointError(
            f"cannot write {path.name}: {error}; keep trainer_state and metrics to numbers, strings, "
            "lists and dicts."
        ) from error
    path.write_text(text + "\n", encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Writes JSON through a temporary file and a rename: a reader never sees half a file."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def fsync_tree(directory: Path) -> None:
    """Flushes every file, then the directory entries, so the rename publishes durable data."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_directory(directory)


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # Windows cannot open directories; rename there is still atomic enough.
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def publish(temporary_path: Path, final_path: Path) -> None:
    """Renames the finished temp dir to its final name, replacing an existing one safely."""
    aside_path = None
    if final_path.exists():
        aside_path = final_path.parent / f".old-{final_path.name}-{os.getpid()}"
        if aside_path.exists():
            shutil.rmtree(aside_path)
        os.rename(final_path, aside_path)
    os.rename(temporary_path, final_path)
    _fsync_directory(final_path.parent)
    if aside_path is not None:
        shutil.rmtree(aside_path, ignore_errors=True)
