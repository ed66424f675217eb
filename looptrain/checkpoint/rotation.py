"""Rotation: the newest checkpoints plus the best one kept, the rest and the leftovers of interrupted saves deleted."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from looptrain.checkpoint.find import list_checkpoints
from looptrain.checkpoint.layout import is_complete_checkpoint

# Leftovers of an interrupted save, replace or delete; all start with "." so nothing lists them.
_STALE_PREFIXES = (".tmp-checkpoint-", ".old-checkpoint-", ".deleting-checkpoint-")
_TEMPORARY_NAME = re.compile(r"^\.tmp-(checkpoint-\d+)-\d+$")


def remove_stale_temporary_dirs(output_dir: str | os.PathLike) -> list[Path]:
    """Cleans up after interrupted saves (`.tmp-`, `.old-`, `.deleting-checkpoint-*` dirs).

    A temp dir that was written whole (it has COMPLETE) but whose final name is missing, because
    the process died between renaming the old directory aside and the new one in, is renamed into
    place instead of deleted. Call this only from the process that saves, when no save is running.

    Returns:
        The directories removed.
    """
    output_path = Path(output_dir)
    if not output_path.is_dir():
        return []
    removed = []
    for child in sorted(output_path.iterdir()):
        match = _TEMPORARY_NAME.match(child.name)
        if match and is_complete_checkpoint(child) and not (output_path / match.group(1)).exists():
            os.rename(child, output_path / match.group(1))
            continue
        if child.is_dir() and child.name.startswith(_STALE_PREFIXES):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def rotate_checkpoints(
    output_dir: str | os.PathLike,
    save_total_limit: int | None,
    best_checkpoint: str | os.PathLike | None = None,
    run_checkpoints: set[str] | None = None,
) -> list[Path]:
    """Keeps the `save_total_limit` newest complete checkpoints plus the best one.

    The best checkpoint is never deleted, so up to `save_total_limit + 1` remain when the best is
    older than the newest `save_total_limit`. `save_total_limit` None or 0 keeps every checkpoint.
    Stale temp dirs of crashed saves are removed in any case. Directories without the COMPLETE
    marker that are not looptrain temp dirs are left alone.

    Args:
        output_dir: The run's output directory.
        save_total_limit: How many of the newest checkpoints to keep; None or 0: all.
        best_checkpoint: The best checkpoint's name or path (BestTracker.best_checkpoint), or None.
        run_checkpoints: Names of the checkpoints the current run owns; only these may be deleted
            (None: any complete checkpoint). A checkpoint of another run is never touched.

    Returns:
        The checkpoint directories deleted (their former paths).

    Raises:
        ValueError: A negative limit.
    """
    if save_total_limit is not None and save_total_limit < 0:
        raise ValueError(f"save_total_limit must be >= 0 (0 or None keeps all), got {save_total_limit}.")
    output_path = Path(output_dir)
    remove_stale_temporary_dirs(output_path)
    if not save_total_limit:
        return []
    checkpoints = list_checkpoints(output_path)
    if run_checkpoints is not None:
        checkpoints = [path for path in checkpoints if path.name in run_checkpoints]
    best_name = Path(best_checkpoint).name if best_checkpoint is not None else None
    keep = {path.name for path in checkpoints[-save_total_limit:]}
    if best_name is not None:
        keep.add(best_name)
    deleted = []
    for path in checkpoints:
        if path.name in keep:
            continue
        # Rename first so a crash mid-delete never leaves a half-deleted dir that lists as complete.
        doomed = output_path / f".deleting-{path.name}-{os.getpid()}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
    return deleted
