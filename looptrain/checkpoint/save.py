"""Writing a checkpoint directory atomically: temp dir, fsync, COMPLETE marker, rename into place; any other
directory of a run (its final/) through the same temp dir and rename (`published_directory`)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from looptrain.checkpoint import files
from looptrain.checkpoint.layout import (
    ADAPTER_FILE,
    COMPLETE_MARKER,
    FORMAT_VERSION,
    METRICS_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    CheckpointError,
    checkpoint_name,
    unwrap_model,
)
from looptrain.checkpoint.rng import capture_rng_state
from looptrain.lora import is_lora_model


def _save_model_weights(model: nn.Module, directory: Path) -> None:
    """model.safetensors via save_pretrained (HF: config too, tied weights handled) or safetensors; a peft model's
    adapters and trained head in peft's format (adapter_model.safetensors + adapter_config.json): the frozen base,
    4-bit or not, is the --model's and is not copied into every checkpoint."""
    model = unwrap_model(model)
    if is_lora_model(model):
        model.save_pretrained(str(directory))
        if not (directory / ADAPTER_FILE).exists():
            raise CheckpointError(f"{type(model).__name__}.save_pretrained wrote no {ADAPTER_FILE} into {directory}; "
                                  "upgrade peft.")
        return
    if hasattr(model, "save_pretrained"):
        import inspect

        keyword_arguments: dict[str, Any] = {}
        # transformers 4.x needs the flag to write safetensors; 5.x always does and dropped it.
        if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
            keyword_arguments["safe_serialization"] = True
        with _no_shard_bar():
            model.save_pretrained(str(directory), **keyword_arguments)
        if not (directory / MODEL_FILE).exists() and not (directory / MODEL_INDEX_FILE).exists():
            raise CheckpointError(
                f"{type(model).__name__}.save_pretrained wrote no {MODEL_FILE} into {directory}; "
                "upgrade transformers or save a plain nn.Module."
            )
        return
    from safetensors.torch import save_model

    # save_model drops the duplicate names of shared (tied) tensors, which save_file refuses.
    save_model(model, str(directory / MODEL_FILE), metadata={"format": "pt"})


@contextlib.contextmanager
def _no_shard_bar() -> Iterator[None]:
    """transformers' "Writing model shards" bar off while a checkpoint is written: a run's progress is its own
    (one bar, `looptrain.progress`), and every checkpoint and final save would print one on stderr."""
    from transformers.utils import logging as transformers_logging

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def save_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    trainer_state: dict[str, Any],
    metrics: dict[str, Any] | None = None,
) -> Path:
    """Writes `output_dir/checkpoint-<step>/` atomically (temp dir, fsync, rename).

    Call it from one process only (rank 0 under torchrun). Re-saving an existing step (after a
    resume) replaces the old directory: old renamed aside, new renamed in, old deleted.

    Args:
        output_dir: The run's output directory (created if missing).
        step: Optimizer step; names the directory.
        model: The model (DDP / torch.compile wrappers are unwrapped). Hugging Face models are
            written with `save_pretrained` (model.safetensors + config.json), others with
            `safetensors.torch.save_model` (tied weights stored once).
        optimizer: Saved to optimizer.pt when given.
        scheduler: LR scheduler, saved to scheduler.pt when given.
        scaler: GradScaler, saved to scaler.pt when given.
        trainer_state: JSON-ready dict of the Loop's state (step, micro_step, epoch, batch index in
            the epoch, best tracker, history...); "step" is filled in when absent.
        metrics: Evaluation scores at this step, written to metrics.json when given.

    Returns:
        The final checkpoint directory.

    Raises:
        CheckpointError: The state cannot be serialized or the directory cannot be published.
    """
    output_path = Path(output_dir)
    output_path.mkdir(parents=True, exist_ok=True)
    final_path = output_path / checkpoint_name(step)
    temporary_path = output_path / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if temporary_path.exists():
        shutil.rmtree(temporary_path)
    temporary_path.mkdir()
    try:
        _save_model_weights(model, temporary_path)
        if optimizer is not None:
            _torch_save(optimizer.state_dict(), temporary_path / OPTIMIZER_FILE)
        if scheduler is not None:
            _torch_save(scheduler.state_dict(), temporary_path / SCHEDULER_FILE)
        if scaler is not None:
            _torch_save(scaler.state_dict(), temporary_path / SCALER_FILE)
        _torch_save(capture_rng_state(), temporary_path / RNG_FILE)
        state = dict(trainer_state)
        state.setdefault("step", int(step))
        files.write_json(state, temporary_path / TRAINER_STATE_FILE)
        if metrics is not None:
            files.write_json(dict(metrics), temporary_path / METRICS_FILE)
        file_names = sorted(path.name for path in temporary_path.iterdir())
        files.fsync_tree(temporary_path)
        # Written last, after the data is durable: a directory with this marker was written whole.
        files.write_json({"format_version": FORMAT_VERSION, "step": int(step), "files": file_names},
                    temporary_path / COMPLETE_MARKER)
        files.fsync_tree(temporary_path)
    except BaseException as error:
        # A failed save leaves no temp dir behind when it can; rotate_checkpoints sweeps the rest.
        shutil.rmtree(temporary_path, ignore_errors=True)
        if _is_write_failure(error):
            needed = _tensor_bytes(model.state_dict()) + (_tensor_bytes(optimizer.state_dict()) if optimizer else 0)
            raise CheckpointError(write_failure_message(error, output_path, final_path.name, needed)) from error
        raise
    files.publish(temporary_path, final_path)
    return final_path


@contextlib.contextmanager
def published_directory(final_path: str | os.PathLike, *, model: nn.Module, advice: str) -> Iterator[Path]:
    """Yields a temporary directory beside `final_path` to write into; once the block ends, it is fsynced and renamed
    to `final_path` (an existing one replaced): a reader or a crash sees the old directory or the whole new one.

    An exception (a signal included) removes the temporary directory; a full disk, a quota or a file-size limit is a
    `CheckpointError` saying how much `model`'s weights need, how much is free, and `advice`. Leftovers of a killed
    writer (`.tmp-<name>-*`) are removed first: call it from the one process that writes `final_path`.
    """
    final_path = Path(final_path)
    for leftover in final_path.parent.glob(f".tmp-{final_path.name}-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    temporary_path = final_path.parent / f".tmp-{final_path.name}-{os.getpid()}"
    temporary_path.mkdir(parents=True)
    try:
        yield temporary_path
        files.fsync_tree(temporary_path)
    except BaseException as error:
        shutil.rmtree(temporary_path, ignore_errors=True)
        if _is_write_failure(error):
            message = write_failure_message(error, final_path.parent, final_path.name,
                                            _tensor_bytes(unwrap_model(model).state_dict()), advice)
            raise CheckpointError(message) from error
        raise
    files.publish(temporary_path, final_path)


# What a full disk (ENOSPC), a quota (EDQUOT) or a file-size limit (EFBIG) looks like from each writer: an
# OSError; torch.save's "[enforce fail at inline_container.cc] unexpected pos" or "file write failed"; and
# safetensors' "Error while serializing: I/O error: ... (os error N)".
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
_WRITE_FAILURE_TEXT = ("inline_container", "file write failed", "I/O error", "No space left")


def _is_write_failure(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno in _WRITE_ERRNOS
    return isinstance(error, Exception) and any(text in str(error) for text in _WRITE_FAILURE_TEXT)


CHECKPOINT_ADVICE = ("Free some space or pass an output directory on a larger disk (--output-dir) and --resume the "
                     "last checkpoint; earlier checkpoints are left as they were.")


def write_failure_message(error: BaseException, output_path: Path, name: str, needed: int,
                          advice: str = CHECKPOINT_ADVICE) -> str:
    """Why `name` could not be written in `output_path`, how much it needs (`needed` bytes) and how much is free,
    and what to do (`advice`). The error's own text is quoted, as it was raised."""
    try:
        free = f"{shutil.disk_usage(output_path).free / 1e6:,.1f} MB free"
    except OSError:
        free = "free space unknown"
    return (f"cannot write {name} in {output_path}: no space left (the disk is full, or a quota or file-size limit "
            f"was reached; {type(error).__name__}: {str(error).strip()[:200]}). It needs about {needed / 1e6:,.1f} MB; "
            f"{output_path} has {free}. {advice}")


def _tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) state dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0
