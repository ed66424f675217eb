"""Finding checkpoints: the complete ones of an output directory, the latest, and what `--resume` names."""

from __future__ import annotations

import os
import re
from pathlib import Path

from looptrain.checkpoint.layout import COMPLETE_MARKER, CheckpointError, is_complete_checkpoint

_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def not_a_checkpoint_error(path: Path) -> CheckpointError:
    """The error for a `--resume` path that is not a complete checkpoint, naming what to pass instead."""
    if not path.exists():
        return CheckpointError(
            f"checkpoint {path} does not exist; pass --resume auto or an existing checkpoint-<step> dir."
        )
    candidates = list_checkpoints(path) if path.is_dir() else []
    if candidates:
        return CheckpointError(
            f"{path} is an output directory, not a checkpoint; pass --resume {candidates[-1]} "
            f"(the latest) or --resume auto."
        )
    return CheckpointError(
        f"{path} is not a complete checkpoint (no {COMPLETE_MARKER} marker: not written by looptrain, or "
        "its save was interrupted); pass --resume with a checkpoint-<step> directory or --resume auto."
    )


def _step_of(path: Path) -> int:
    match = _CHECKPOINT_NAME.match(path.name)
    return int(match.group(1)) if match else -1


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete `checkpoint-<step>` directories of `output_dir`, oldest step first.

    Temp dirs of an interrupted save and directories without the COMPLETE marker are skipped.
    A missing `output_dir` has none.
    """
    output_path = Path(output_dir)
    if not output_path.is_dir():
        return []
    found = [
        child
        for child in output_path.iterdir()
        if _CHECKPOINT_NAME.match(child.name) and is_complete_checkpoint(child)
    ]
    return sorted(found, key=_step_of)


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    checkpoints = list_checkpoints(output_dir)
    return checkpoints[-1] if checkpoints else None


def resolve_resume_checkpoint(resume: str | os.PathLike | None, output_dir: str | os.PathLike) -> Path | None:
    """Turns the `--resume` flag into a checkpoint directory.

    Args:
        resume: None (fresh run), "auto" (the latest complete checkpoint of `output_dir`, or a fresh
            run when there is none), or a checkpoint directory.
        output_dir: The run's output directory.

    Returns:
        The checkpoint to resume from, or None for a fresh start.

    Raises:
        CheckpointError: `resume` names a directory that is not a complete checkpoint.
    """
    if resume is None:
        return None
    if str(resume) == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume)
    if not is_complete_checkpoint(path):
        raise not_a_checkpoint_error(path)
    return path
