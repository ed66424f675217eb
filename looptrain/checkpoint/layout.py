"""What a checkpoint is made of: its directory name, its files, its completeness marker, its error, and the
model it holds (the user's, inside DDP or torch.compile wrappers)."""

from __future__ import annotations

from pathlib import Path

from torch import nn

CHECKPOINT_PREFIX = "checkpoint-"
COMPLETE_MARKER = "COMPLETE"
MODEL_FILE = "model.safetensors"
MODEL_INDEX_FILE = "model.safetensors.index.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SCALER_FILE = "scaler.pt"
RNG_FILE = "rng_state.pt"
TRAINER_STATE_FILE = "trainer_state.json"
METRICS_FILE = "metrics.json"
ADAPTER_FILE = "adapter_model.safetensors"  # a peft (LoRA) model's checkpoint: its trainable weights only
ADAPTER_CONFIG_FILE = "adapter_config.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found, trusted or applied; the message names path and fix."""


def unreadable(path: Path, error: BaseException, *, no_detail: str = "") -> CheckpointError:
    """The error for a checkpoint file that `error` could not read: corrupt or truncated (raise it ``from error``).

    The detail is the first line of `error`'s message, `no_detail` when it has none.
    """
    detail = str(error).splitlines()[0] if str(error) else no_detail
    return CheckpointError(f"cannot read {path}: the file is corrupt or truncated ({type(error).__name__}: {detail}); "
                           "resume from another checkpoint.")


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint at optimizer step `step`."""
    return f"{CHECKPOINT_PREFIX}{int(step)}"


def is_complete_checkpoint(path: Path) -> bool:
    """Whether `path` is a checkpoint directory whose save finished (it holds the COMPLETE marker)."""
    return path.is_dir() and (path / COMPLETE_MARKER).is_file()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DistributedDataParallel (`.module`) or torch.compile (`._orig_mod`)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DataParallel":
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model
