"""Reading a checkpoint back, loading nothing that can run code: `torch.load(weights_only=True)` and safetensors."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from looptrain.checkpoint.find import not_a_checkpoint_error
from looptrain.checkpoint.fit import check_weights_fit
from looptrain.checkpoint.layout import (
    ADAPTER_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    CheckpointError,
    is_complete_checkpoint,
    unreadable,
    unwrap_model,
)
from looptrain.checkpoint.rng import restore_rng_state
from looptrain.lora import is_lora_model


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
        raise unreadable(path, error) from error


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
        raise unreadable(path, error, no_detail=type(error).__name__) from error


def _storage_key(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


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
    if not is_complete_checkpoint(checkpoint):
        raise not_a_checkpoint_error(checkpoint)
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
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read {state_path}: {error}; resume from another checkpoint.") from error
    return check_trainer_state(state, state_path, {"step": int})  # save_checkpoint always writes the step


def check_trainer_state(state: Any, path: Path, kinds: dict[str, Any]) -> dict[str, Any]:
    """`state` (read from `path`, a trainer_state.json), checked to be a JSON object holding each key of `kinds`
    with a value of its type (an ``int`` is never a bool); returns it.

    Raises:
        CheckpointError: naming the file and the key that is missing or of another type.
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} holds a JSON {type(state).__name__}, not the object of counters a checkpoint "
                              "saves; it is damaged or not looptrain's: resume from another checkpoint.")
    for key, kind in kinds.items():
        if key not in state:
            raise CheckpointError(f"{path} has no {key!r}: it is damaged or not looptrain's; resume from another "
                                  "checkpoint.")
        value = state[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            expected = getattr(kind, "__name__", kind)
            raise CheckpointError(f"{path}: {key!r} is {json.dumps(value)[:40]}, not {expected}; it is damaged or "
                                  "not looptrain's: resume from another checkpoint.")
    return state
