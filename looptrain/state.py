"""Save and resume training state: atomic checkpoints, safe loading, rotation, best checkpoint.

A checkpoint is a directory `output_dir/checkpoint-<step>/` holding

    model.safetensors (or HF shards + index)   weights (plus config.json for Hugging Face models)
    adapter_model.safetensors + adapter_config.json   instead, for a peft (LoRA) model: the adapters and
                                                the trained head only, in peft's format
    optimizer.pt, scheduler.pt, scaler.pt       state dicts, each only when that object was given
    rng_state.pt                                python, numpy, torch CPU (and CUDA) RNG states
    trainer_state.json                          the Loop's counters, sampler position, best metric
    metrics.json                                the evaluation scores at this step, when given
    COMPLETE                                    written last: the directory is whole

It is written into `output_dir/.tmp-checkpoint-<step>-<pid>/`, fsynced, and renamed into place, so
a crash leaves either the previous checkpoints or the new one, never a half-written
`checkpoint-<step>`. Everything is read back with `torch.load(weights_only=True)`, which refuses
to execute code hidden in a pickle. See docs/checkpoints.md.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from looptrain.lora import is_lora_model

__all__ = [
    "CheckpointError",
    "BestTracker",
    "is_better",
    "save_checkpoint",
    "load_checkpoint",
    "load_model_weights",
    "check_weights_fit",
    "checkpoint_weight_shapes",
    "list_checkpoints",
    "latest_checkpoint",
    "resolve_resume_checkpoint",
    "rotate_checkpoints",
    "remove_stale_temporary_dirs",
    "capture_rng_state",
    "restore_rng_state",
    "checkpoint_name",
    "default_mode",
    "unwrap_model",
    "write_json_atomic",
]

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

_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
# Leftovers of an interrupted save, replace or delete; all start with "." so nothing lists them.
_STALE_PREFIXES = (".tmp-checkpoint-", ".old-checkpoint-", ".deleting-checkpoint-")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, found, trusted or applied; the message names path and fix."""


# ---------------------------------------------------------------------------------------------
# Best metric
# ---------------------------------------------------------------------------------------------


LOWER_IS_BETTER_WORDS = ("loss", "perplexity", "ppl", "error", "mae", "mse", "rmse", "wer", "cer")


def default_mode(metric_name: str) -> str:
    """"min" for names of losses and errors (loss, perplexity, mae, ...), "max" for scores such as f1."""
    name = metric_name.lower()
    return "min" if any(word in name for word in LOWER_IS_BETTER_WORDS) else "max"


def is_better(metric: float, best: float | None, mode: str) -> bool:
    """Whether `metric` improves on `best`.

    Args:
        metric: The new value. NaN is never better.
        best: The best value so far, or None when there is none yet (any finite metric wins).
        mode: "max" (higher is better) or "min" (lower is better).

    Returns:
        True when strictly better (ties keep the earlier, already saved, best).

    Raises:
        ValueError: Unknown mode.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}.")
    if metric is None or math.isnan(metric):
        return False
    if best is None or math.isnan(best):
        return True
    return metric > best if mode == "max" else metric < best


class BestTracker:
    """Remembers the best value of one evaluation metric and the checkpoint that holds it.

    Its `state_dict()` goes into trainer_state.json so a resumed run keeps the same best, and its
    `best_checkpoint` goes to `rotate_checkpoints` so the best is never deleted.
    """

    def __init__(self, metric_name: str = "f1", mode: str | None = None):
        """Creates a tracker with no best yet.

        Args:
            metric_name: Key of the metric in the evaluation dict ("f1", "accuracy", "loss", ...);
                an "eval_"-prefixed key is accepted too.
            mode: "max" or "min"; default "min" for names containing "loss", else "max".
        """
        self.metric_name = metric_name
        self.mode = mode if mode is not None else default_mode(metric_name)
        if self.mode not in ("max", "min"):
            raise ValueError(f"BestTracker mode must be 'max' or 'min', got {mode!r}.")
        self.best_metric: float | None = None
        self.best_checkpoint: str | None = None
        self.best_step: int | None = None

    def value_from(self, metrics: dict[str, Any]) -> float:
        """Picks this tracker's metric out of an evaluation dict.

        Raises:
            KeyError: The metric is not in the dict; the message lists the keys that are.
        """
        for key in (self.metric_name, f"eval_{self.metric_name}"):
            if key in metrics:
                return float(metrics[key])
        raise KeyError(
            f"metric for best {self.metric_name!r} is not among the evaluation metrics "
            f"{sorted(metrics)}; choose one of those (--metric-for-best)."
        )

    def update(self, metrics: dict[str, Any], checkpoint_name: str | None, step: int | None = None) -> bool:
        """Records `metrics` as the new best when better.

        Args:
            metrics: The evaluation dict of this evaluation point.
            checkpoint_name: Name of the checkpoint saved for this point ("checkpoint-120"), or None.
            step: Optimizer step of this evaluation point.

        Returns:
            True when it is the new best.
        """
        value = self.value_from(metrics)
        if not is_better(value, self.best_metric, self.mode):
            return False
        self.best_metric = value
        self.best_checkpoint = checkpoint_name
        self.best_step = step
        return True

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state for trainer_state.json."""
        return {
            "metric_name": self.metric_name,
            "mode": self.mode,
            "best_metric": self.best_metric,
            "best_checkpoint": self.best_checkpoint,
            "best_step": self.best_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the state written by `state_dict`.

        Raises:
            CheckpointError: The saved tracker followed another metric or mode.
        """
        if state.get("metric_name", self.metric_name) != self.metric_name or state.get("mode", self.mode) != self.mode:
            raise CheckpointError(
                f"the checkpoint tracked the best {state.get('metric_name')!r} ({state.get('mode')}), this run "
                f"tracks {self.metric_name!r} ({self.mode}); resume with the same --metric-for-best or start "
                "a new --output-dir."
            )
        self.best_metric = state.get("best_metric")
        self.best_checkpoint = state.get("best_checkpoint")
        self.best_step = state.get("best_step")


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    """The python, numpy, torch CPU and (when initialised) CUDA RNG states, loadable with weights_only.

    numpy's state is a tuple holding an ndarray, which `torch.load(weights_only=True)` refuses, so
    it is stored as a plain dict of a str, an int64 tensor and numbers.
    """
    numpy_name, numpy_keys, numpy_position, numpy_has_gauss, numpy_cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(numpy_name),
            "keys": torch.from_numpy(np.asarray(numpy_keys, dtype=np.int64).copy()),
            "position": int(numpy_position),
            "has_gauss": int(numpy_has_gauss),
            "cached_gaussian": float(numpy_cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Sets the global RNGs to a state from `capture_rng_state` (CUDA only when saved and available)."""
    random.setstate(_as_nested_tuple(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        # A resume on fewer (or more) GPUs restores the devices both runs have.
        for device_index in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[device_index], device_index)


def _as_nested_tuple(value: Any) -> Any:
    """random.setstate needs tuples; keep them tuples even if a container came back as a list."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_nested_tuple(item) for item in value)
    return value


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DistributedDataParallel (`.module`) or torch.compile (`._orig_mod`)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DataParallel":
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


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


def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)


def _json_default(value: Any) -> Any:
    """Numbers from numpy or torch in the trainer state become plain python numbers."""
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"trainer_state value of type {type(value).__name__} is not JSON serializable")


def _write_json(value: dict[str, Any], path: Path) -> None:
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
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def _fsync_tree(directory: Path) -> None:
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


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint at optimizer step `step`."""
    return f"{CHECKPOINT_PREFIX}{int(step)}"


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
        _write_json(state, temporary_path / TRAINER_STATE_FILE)
        if metrics is not None:
            _write_json(dict(metrics), temporary_path / METRICS_FILE)
        files = sorted(path.name for path in temporary_path.iterdir())
        _fsync_tree(temporary_path)
        # Written last, after the data is durable: a directory with this marker was written whole.
        _write_json({"format_version": FORMAT_VERSION, "step": int(step), "files": files},
                    temporary_path / COMPLETE_MARKER)
        _fsync_tree(temporary_path)
    except BaseException as error:
        # A failed save leaves no temp dir behind when it can; rotate_checkpoints sweeps the rest.
        shutil.rmtree(temporary_path, ignore_errors=True)
        if _is_write_failure(error):
            raise CheckpointError(_write_failure_message(error, output_path, final_path.name, model, optimizer)) \
                from error
        raise
    _publish(temporary_path, final_path)
    return final_path


# What a full disk (ENOSPC), a quota (EDQUOT) or a file-size limit (EFBIG) looks like from each writer: an
# OSError; torch.save's "[enforce fail at inline_container.cc] unexpected pos" or "file write failed"; and
# safetensors' "Error while serializing: I/O error: ... (os error N)".
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}
_WRITE_FAILURE_TEXT = ("inline_container", "file write failed", "I/O error", "No space left")


def _is_write_failure(error: BaseException) -> bool:
    if isinstance(error, OSError):
        return error.errno in _WRITE_ERRNOS
    return isinstance(error, Exception) and any(text in str(error) for text in _WRITE_FAILURE_TEXT)


def _write_failure_message(error: BaseException, output_path: Path, name: str, model: nn.Module,
                           optimizer: Any) -> str:
    """Why a checkpoint could not be written, how much it needs and how much is free, and what to do."""
    needed = _tensor_bytes(model.state_dict()) + (_tensor_bytes(optimizer.state_dict()) if optimizer else 0)
    try:
        free = f"{shutil.disk_usage(output_path).free / 1e6:,.1f} MB free"
    except OSError:
        free = "free space unknown"
    return (f"cannot write {name} in {output_path}: no space left (the disk is full, or a quota or file-size limit "
            f"was reached; {type(error).__name__}: {str(error).strip()[:200]}). It needs about {needed / 1e6:,.1f} MB; "
            f"{output_path} has {free}. Free some space or pass an output directory on a larger disk "
            "(--output-dir) and --resume the last checkpoint; earlier checkpoints are left as they were.")


def _tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) state dict."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _publish(temporary_path: Path, final_path: Path) -> None:
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


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _safe_torch_load(path: Path, map_location: Any) -> Any:
    """torch.load with weights_only=True; an unsafe or corrupt file raises CheckpointError."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"refusing to load {path}: it holds Python objects other than tensors and plain containers, "
            "and unpickling them could execute code (torch.load weights_only=True rejected it: "
            f"{str(error).splitlines()[-1] if str(error) else type(error).__name__}). Re-create the checkpoint "
            "with looptrain, or delete this checkpoint directory and resume from another one."
        ) from error
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(
            f"cannot read {path}: the file is corrupt or truncated ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); resume from another checkpoint."
        ) from error


def _is_complete_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / COMPLETE_MARKER).is_file()


def _read_model_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors or of the shards listed in its index (HF sharded saves)."""
    single = checkpoint / MODEL_FILE
    if single.is_file():
        return _load_safetensors(single)
    index = checkpoint / MODEL_INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as error:
            raise CheckpointError(f"cannot read {index}: {error}; resume from another checkpoint.") from error
        tensors: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(_load_safetensors(checkpoint / shard))
        return tensors
    raise CheckpointError(
        f"{checkpoint} has no {MODEL_FILE}; it was not written by looptrain's save_checkpoint, "
        "point --resume at a checkpoint-<step> directory."
    )


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors; a truncated or corrupt file raises CheckpointError naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except Exception as error:  # safetensors raises its own SafetensorError (and OSError) for bad files
        detail = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(
            f"cannot read {path}: the file is corrupt or truncated ({type(error).__name__}: {detail}); "
            "resume from another checkpoint."
        ) from error


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def checkpoint_weight_shapes(checkpoint: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Each weight's shape, read from the safetensors headers only (no tensor is loaded).

    Raises:
        CheckpointError: No weights file, or a header that cannot be read.
    """
    from safetensors import safe_open

    checkpoint = Path(checkpoint)
    if (checkpoint / MODEL_FILE).is_file():
        files = [checkpoint / MODEL_FILE]
    elif (checkpoint / ADAPTER_FILE).is_file():
        files = [checkpoint / ADAPTER_FILE]
    elif (checkpoint / MODEL_INDEX_FILE).is_file():
        try:
            weight_map = json.loads((checkpoint / MODEL_INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as error:
            raise CheckpointError(
                f"cannot read {checkpoint / MODEL_INDEX_FILE}: {error}; resume from another checkpoint."
            ) from error
        files = [checkpoint / shard for shard in sorted(set(weight_map.values()))]
    else:
        raise CheckpointError(
            f"{checkpoint} has no {MODEL_FILE}; it was not written by looptrain's save_checkpoint, "
            "point --resume at a checkpoint-<step> directory."
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:  # safetensors' own error type for a bad header
            raise CheckpointError(
                f"cannot read {path}: the file is corrupt or truncated ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); resume from another checkpoint."
            ) from error
    return shapes


def check_weights_fit(checkpoint: str | os.PathLike, model: nn.Module) -> None:
    """Raises one `CheckpointError` summarising the shape mismatches between a checkpoint and `model`.

    Reads the safetensors headers only, so a command line can check a checkpoint before it writes
    anything (the loop calls it too, before loading).
    """
    model = unwrap_model(model)
    if _check_adapters_fit(Path(checkpoint), model):
        return
    model_shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    mismatched = [(name, shape, model_shapes[name]) for name, shape in checkpoint_weight_shapes(checkpoint).items()
                  if name in model_shapes and shape != model_shapes[name]]
    if mismatched:
        name, saved, wanted = mismatched[0]
        raise CheckpointError(
            f"weights in {checkpoint} do not fit {type(model).__name__}: {len(mismatched)} tensors differ in shape, "
            f"e.g. {name} [{', '.join(map(str, saved))}] in the checkpoint vs [{', '.join(map(str, wanted))}] in the "
            "model; resume with the model (and the settings) that wrote the checkpoint, or start a new --output-dir."
        )


LORA_SETTINGS = (("r", "--lora"), ("lora_alpha", "--lora-alpha"), ("lora_dropout", "--lora-dropout"))


def _read_adapter_config(checkpoint: Path) -> dict | None:
    path = checkpoint / ADAPTER_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}; resume from another checkpoint.") from error


def _check_adapters_fit(checkpoint: Path, model: nn.Module) -> bool:
    """For a LoRA checkpoint or model: a `CheckpointError` naming the flags when the two do not match (adapters
    into a model without them, full weights into a LoRA model, another rank, alpha, dropout or targets).

    Returns:
        True when both are LoRA and match (the shapes follow), False when neither is LoRA.
    """
    saved = _read_adapter_config(checkpoint)
    lora_model = is_lora_model(model)
    if saved is None and not lora_model:
        return False
    if saved is not None and not lora_model:
        raise CheckpointError(
            f"{checkpoint} holds LoRA adapters (rank {saved.get('r')}) and this run trains no adapters; resume with "
            f"the LoRA settings that wrote it (--lora {saved.get('r')}, lora_rank={saved.get('r')}), or start a new "
            "--output-dir.")
    if saved is None:
        raise CheckpointError(
            f"{checkpoint} holds the full weights of a run without LoRA and this run trains LoRA adapters; drop "
            "--lora (lora_rank=0) to resume it, or start a new --output-dir.")
    config = model.peft_config[model.active_adapter]
    differences = [f"{flag} {saved.get(key)} in the checkpoint, {getattr(config, key)} now"
                   for key, flag in LORA_SETTINGS if saved.get(key) != getattr(config, key)]
    targets = saved.get("target_modules")
    if targets is not None and set(targets) != set(config.target_modules or ()):
        differences.append(f"--lora-targets {','.join(sorted(targets))} in the checkpoint, "
                           f"{','.join(sorted(config.target_modules or ()))} now")
    if differences:
        raise CheckpointError(
            f"the LoRA adapters in {checkpoint} do not fit this run's: {'; '.join(differences)}; resume with the "
            "LoRA settings that wrote the checkpoint, or start a new --output-dir.")
    return True


def _load_adapter_weights(checkpoint: Path, model: nn.Module) -> None:
    """A LoRA checkpoint's adapters and trained head into a peft model, strictly (peft's key mapping)."""
    from peft import set_peft_model_state_dict

    tensors = _load_safetensors(checkpoint / ADAPTER_FILE)
    result = set_peft_model_state_dict(model, tensors, adapter_name=model.active_adapter)
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    missing = sorted(name for name in result.missing_keys if name in trainable)
    unexpected = sorted(result.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(
            f"the adapters in {checkpoint} do not match {type(model).__name__}: missing keys {missing}, unexpected "
            f"keys {unexpected}; resume with the same model and LoRA settings that wrote the checkpoint.")


def load_model_weights(checkpoint: str | os.PathLike, model: nn.Module) -> None:
    """Loads a checkpoint's safetensors weights into `model`, strictly.

    Tied weights saved once (HF `save_pretrained`, `safetensors.torch.save_model`) count as loaded
    when the tensor they share storage with was loaded. A LoRA checkpoint (adapter_model.safetensors)
    loads into a peft model's adapters and trained head; its frozen base is left as it is.

    Raises:
        CheckpointError: Missing or unexpected keys (listed), shape mismatches, or LoRA settings that
            differ from the checkpoint's (adapters without --lora, another rank).
    """
    checkpoint_path = Path(checkpoint)
    model = unwrap_model(model)
    check_weights_fit(checkpoint_path, model)
    if is_lora_model(model):
        _load_adapter_weights(checkpoint_path, model)
        return
    tensors = _read_model_tensors(checkpoint_path)
    model_state = model.state_dict()
    result = model.load_state_dict(tensors, strict=False)
    loaded_storages = {_storage_key(model_state[name]) for name in tensors if name in model_state}
    missing = [name for name in result.missing_keys if _storage_key(model_state[name]) not in loaded_storages]
    unexpected = list(result.unexpected_keys)
    if missing or unexpected:
        raise CheckpointError(
            f"weights in {checkpoint_path} do not match {type(model).__name__}: "
            f"missing keys {sorted(missing)}, unexpected keys {sorted(unexpected)}; "
            "resume with the same model (and the same freezing / wrapping) that wrote the checkpoint."
        )


def _not_a_checkpoint_error(path: Path) -> CheckpointError:
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


def _load_optional_state(
    checkpoint: Path, file_name: str, target: Any | None, what: str, map_location: Any
) -> None:
    if target is None:
        return
    path = checkpoint / file_name
    if not path.is_file():
        raise CheckpointError(
            f"{checkpoint} has no {file_name} but a {what} was passed to load_checkpoint; resume with the "
            f"same settings that wrote it, or pass {what}=None to start that {what} fresh."
        )
    state = _safe_torch_load(path, map_location)
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{path} does not fit this {what} ({type(target).__name__}): {error}; resume with the same "
            f"{what} settings that wrote the checkpoint."
        ) from error


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    scaler: Any | None = None,
    map_location: Any = "cpu",
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restores a checkpoint written by `save_checkpoint`, loading nothing that can run code.

    Args:
        path: A `checkpoint-<step>` directory.
        model: Receives the weights (strict: missing / unexpected keys raise).
        optimizer: Receives optimizer.pt when given (its state moves to the parameters' device).
        scheduler: Receives scheduler.pt when given.
        scaler: Receives scaler.pt when given.
        map_location: Where `torch.load` puts the optimizer / scheduler / scaler tensors.
        restore_rng: Restore python, numpy, torch (and CUDA) RNG states, for an exact resume.

    Returns:
        The trainer state dict saved with the checkpoint.

    Raises:
        CheckpointError: The path is not a complete checkpoint, a file is unsafe or corrupt, or a
            state does not fit the object it is loaded into.
    """
    checkpoint = Path(path)
    if not _is_complete_checkpoint(checkpoint):
        raise _not_a_checkpoint_error(checkpoint)
    load_model_weights(checkpoint, model)
    _load_optional_state(checkpoint, OPTIMIZER_FILE, optimizer, "optimizer", map_location)
    _load_optional_state(checkpoint, SCHEDULER_FILE, scheduler, "scheduler", map_location)
    _load_optional_state(checkpoint, SCALER_FILE, scaler, "scaler", map_location)
    if restore_rng:
        rng_path = checkpoint / RNG_FILE
        if rng_path.is_file():
            # The RNG setters take CPU byte tensors whatever map_location says.
            restore_rng_state(_safe_torch_load(rng_path, "cpu"))
    state_path = checkpoint / TRAINER_STATE_FILE
    try:
        return json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {state_path}: {error}; resume from another checkpoint.") from error


# ---------------------------------------------------------------------------------------------
# Finding and rotating
# ---------------------------------------------------------------------------------------------


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
        if _CHECKPOINT_NAME.match(child.name) and _is_complete_checkpoint(child)
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
    if not _is_complete_checkpoint(path):
        raise _not_a_checkpoint_error(path)
    return path


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
        if match and _is_complete_checkpoint(child) and not (output_path / match.group(1)).exists():
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
