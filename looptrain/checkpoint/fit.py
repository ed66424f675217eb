"""Whether a checkpoint's weights fit a model, read from the safetensors headers and the adapter config only,
so a command line can refuse a checkpoint before it writes anything."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torch import nn

from looptrain.checkpoint.layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    MODEL_FILE,
    MODEL_INDEX_FILE,
    CheckpointError,
    unreadable,
    unwrap_model,
)
from looptrain.lora import is_lora_model


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
            raise unreadable(path, error) from error
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
