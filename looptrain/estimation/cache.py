"""The estimator's on-disk cache: an estimate made once is read back, keyed by everything that decides it.

`estimate` and `estimate_windows` store their result dict under ``<cache_dir>/estimates/<key>.json``
(`looptrain.cache`: ``$LOOPTRAIN_CACHE_DIR``, off with ``LOOPTRAIN_CACHE_DIR=off``). The key is a
SHA-256 of a JSON description of:

- the model: a preset's name and numbers, a config file's or a transformers config's class and values
  (``to_dict()``, the attention implementation too), or, for an ``nn.Module``, its class, its config,
  its module tree (``repr``: layer sizes, 4-bit and LoRA layers, dropout; each module's class and plain
  public attributes, such as a checkpointing flag), peft's adapter configs, and
  each parameter and buffer (name, shape, dtype, requires_grad, class, tied weights, a 4-bit weight's
  quantization state);
- the batches (the windows' micro-batch shapes; the evaluation batches' shapes when evaluation is priced), the
  strategy (every field but those applied to the batches), the number of labels, the clipping threshold, padding
  (and packing, whose one-row micro-batches are priced with their mask);
- the CPU (capability, oneDNN's bf16 and fp16 reports, its ``ONEDNN_MAX_CPU_ISA`` cap, and whether bf16 matmuls
  measure fast: ``precision="auto"`` resolves by that), ``WORLD_SIZE``, the versions of
  torch, transformers, bitsandbytes and peft, `CODE_VERSION`, and a hash of looptrain's own source
  files, so that any change to the code estimated (the Loop, the optimizers, the tracker) misses the
  cache instead of reading a stale figure.

A model the description cannot cover (neither a name, a config nor a module) is never cached.

The planner's probes on a CPU (one real update of a candidate, timed, its peak measured) are kept the same way,
under ``<cache_dir>/probes/<key>.json`` (`probe_key`, `read_probe`, `write_probe`): the key adds the probe's batch
(its shape and each row's length), the meter, the CPU's name and the number of threads.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from looptrain import cache, precision
from looptrain.memory import kernels
from looptrain.strategy import Strategy, levers

# Bump when the estimator's result changes for the same inputs in a way the source hash below cannot see.
CODE_VERSION = 1
KIND = "estimates"
PROBES = "probes"
_PROBE_KEYS = ("micro_step_seconds", "optimizer_step_seconds", "probe_seconds", "tokens", "batch_shape")
_STOPPED_PROBE_KEYS = ("ceiling", "measured_peak_bytes", "probe_seconds", "tokens", "batch_shape")  # no timings
_RESULT_KEYS = ("peak_memory_bytes", "memory_meter", "memory_breakdown", "phase_peak_bytes", "parameters",
                "trainable_parameters", "notes", "extrapolated")


@functools.cache
def _versions() -> dict[str, str | None]:
    """The versions of the libraries an estimate runs through (None: not installed), and of this code."""
    from importlib import metadata

    versions: dict[str, str | None] = {"torch": torch.__version__, "code": str(CODE_VERSION),
                                       "source": _source_hash()}
    for package in ("transformers", "bitsandbytes", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def _source_hash() -> str:
    """A hash of looptrain's Python sources (the code that an estimate drives)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _config_description(config: Any) -> dict:
    """A transformers config's class and values (every value, defaults included)."""
    values = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return {"class": f"{type(config).__module__}.{type(config).__qualname__}", "values": values,
            "attention": getattr(config, "_attn_implementation", None)}


def _tensor_description(tensor: torch.Tensor) -> list:
    return [type(tensor).__name__, list(tensor.shape), str(tensor.dtype), str(tensor.device)]


def _quant_state_description(state: Any, depth: int = 0) -> Any:
    """A bitsandbytes quantization state: its tensors' shapes and dtypes, its scalar settings, nested states."""
    if state is None or depth > 3:
        return None
    description = {}
    for name, value in sorted(vars(state).items()):
        if isinstance(value, torch.Tensor):
            description[name] = _tensor_description(value)
        elif isinstance(value, (int, float, str, bool, type(None))):
            description[name] = value
        elif isinstance(value, (torch.Size, tuple, list)):
            description[name] = [str(item) for item in value]
        elif isinstance(value, torch.dtype):
            description[name] = str(value)
        else:
            description[name] = _quant_state_description(value, depth + 1) if hasattr(value, "__dict__") else str(value)
    return description


def _settings(module: nn.Module) -> dict:
    """A module's plain public attributes (flags, sizes, rates: what its forward may branch on)."""
    return {name: value for name, value in sorted(vars(module).items())
            if not name.startswith("_") and isinstance(value, (bool, int, float, str, type(None)))}


def _module_description(model: nn.Module) -> dict:
    """What of a module an estimate depends on: classes, tree, configs, and every parameter and buffer."""
    first_name: dict[int, str] = {}  # a tied weight names the one it shares
    tensors = []
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            tied = first_name.setdefault(id(tensor), name)
            tensors.append([kind, name, *_tensor_description(tensor), bool(tensor.requires_grad),
                            tied if tied != name else None,
                            _quant_state_description(getattr(tensor, "quant_state", None))])
    config = getattr(model, "config", None)
    peft_configs = getattr(model, "peft_config", None)
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": _config_description(config) if config is not None and hasattr(config, "to_dict") else None,
        "peft": {name: value.to_dict() for name, value in peft_configs.items()} if isinstance(peft_configs, dict)
        else None,
        "modules": [[name, f"{type(module).__module__}.{type(module).__qualname__}", _settings(module)]
                    for name, module in model.named_modules(remove_duplicate=False)],
        "tree": repr(model),
        "tensors": tensors,
    }


def _model_description(model_or_config: Any, named_config: Any) -> dict | None:
    """The model an estimate builds, described; None when it cannot be described (never cached then)."""
    if isinstance(model_or_config, nn.Module):
        return {"module": _module_description(model_or_config)}
    if isinstance(model_or_config, str):
        if named_config is None:
            return None
        return {"name": model_or_config, "config": _config_description(named_config)}
    if hasattr(model_or_config, "to_dict") and hasattr(model_or_config, "model_type"):
        return {"config": _config_description(model_or_config)}
    return None


def _strategy_description(strategy: Strategy, *, batch_fields: bool = False) -> dict:
    """Every field of the strategy but, unless `batch_fields`, those the batches apply (the estimate is told its
    batches' shapes)."""
    batches_only = set() if batch_fields else {spec.name for spec in levers(type(strategy))
                                               if spec.metadata["lever"]["applied_by"] == "batches"}
    return {"class": f"{type(strategy).__module__}.{type(strategy).__qualname__}",
            "fields": {field.name: getattr(strategy, field.name) for field in dataclasses.fields(strategy)
                       if field.name not in batches_only}}


def key(model_or_config: Any, windows: Sequence[Sequence[tuple[int, int]]], strategy: Strategy, *,
        num_labels: int, max_grad_norm: float | None, padded: bool, named_config: Any = None,
        primes: bool = False, device: str = "cpu", evaluation: Sequence[tuple[int, int]] = (),
        extrapolated: bool = False) -> str | None:
    """The cache key of one `estimate_windows` call (a hex digest), or None when it is not to be cached.

    `named_config`: for a preset name or a path, the config it names (read by the estimator); without it a name
    is not cached. `primes`: the first window only creates the optimizer state (`estimate`'s). `device`: the device
    type whose kernels the estimate prices ("cpu", "cuda"). `evaluation`: the evaluation batches' shapes, evaluated
    after the windows (none: a key without them, the same as before evaluation was priced). `extrapolated`: the
    estimate extrapolated from a few of the model's blocks (`looptrain.estimation.blocks`), kept apart from the
    whole model's (False: the key as before).
    """
    model = _model_description(model_or_config, named_config)
    if model is None:
        return None
    description = {
        "model": model,
        "windows": [[[int(rows), int(width)] for rows, width in window] for window in windows],
        "strategy": _strategy_description(strategy),
        "num_labels": num_labels,
        "max_grad_norm": max_grad_norm,
        "padded": padded,
        "primes": primes,
        "device": device,
        "versions": _versions(),
        # Asked at each call (tests pin them): precision "auto" resolves by them.
        "cpu": [torch.backends.cpu.get_cpu_capability(), precision.cpu_has_native_bf16(),
                precision.cpu_has_native_fp16(), precision.onednn_isa_cap(),
                precision.cpu_bf16_is_fast(), kernels.cpu_bf16_matmul_scratch()],
        "world_size": os.environ.get("WORLD_SIZE", "1"),  # under torchrun the Loop joins the process group
    }
    if getattr(strategy, "packs", False):  # a packed row's mask is priced: a key of its own
        description["packed"] = True
    if evaluation:
        description["evaluation"] = [[int(rows), int(width)] for rows, width in evaluation]
    if extrapolated:
        description["extrapolated"] = True
    text = json.dumps(description, sort_keys=True, default=_json_value)
    return hashlib.sha256(text.encode()).hexdigest()


def _json_value(value: Any) -> Any:
    """A JSON form of what `json` cannot write: sets sorted (their order changes between processes), others by repr."""
    if isinstance(value, (set, frozenset)):
        return sorted(repr(item) for item in value)
    return repr(value)


def read(name: str) -> dict | None:
    """The result stored under `name`, or None (absent, unreadable, incomplete, caching off)."""
    entry = cache.read_entry(KIND, name)
    if entry is None or not all(field in entry for field in _RESULT_KEYS) \
            or not isinstance(entry["peak_memory_bytes"], int):
        return None
    return entry


def write(name: str, result: dict) -> None:
    """Stores an estimate's result under `name` (nothing when caching is off or the directory is not writable)."""
    cache.write_entry(KIND, name, result)


def model_digest(model: nn.Module) -> str:
    """A digest of what of `model` an estimate or a probe depends on (its classes, tree, configs and tensors)."""
    text = json.dumps(_module_description(model), sort_keys=True, default=_json_value)
    return hashlib.sha256(text.encode()).hexdigest()


def probe_key(model: str, strategy: Strategy, batch: dict, *, max_grad_norm: float | None, meter: str,
              warm_up_width: int, allocator: str, typical: dict | None = None,
              head_tile_every: int | None = None) -> str:
    """The cache key of one planner probe on this CPU: `strategy`'s update of the model on `batch`, under `meter`.

    `model` is the model's `model_digest`, taken when planning starts: a probe changes what a description reads
    (transformers turns the config's ``use_cache`` off under checkpointing), and a rerun starts from a fresh model.
    The batch is described by each tensor's shape and, with an attention mask, each row's length (the probe's
    batch is the run's worst: its longest samples), the probe's warm-up by its width, its head's tiles by how many it
    samples (`head_tile_every`), and its `typical` micro-batch
    by its tensors' shapes (cut from the same longest samples, so their shapes say it all). The CPU's name and the
    number of threads join the CPU's capability, since a probe measures speed; the C allocator's state
    (`looptrain.memory.allocator.describe`) joins them, since it moves both the RSS a probe measures and its time.
    """
    mask = batch.get("attention_mask")
    description = {
        "model": model,
        "strategy": _strategy_description(strategy, batch_fields=True),
        "batch": _shapes(batch),
        "rows": mask.sum(dim=-1).tolist() if isinstance(mask, torch.Tensor) else None,
        "max_grad_norm": max_grad_norm,
        "meter": meter,
        "warm_up_width": warm_up_width,
        "head_tile_every": head_tile_every,
        "typical": _shapes(typical) if typical is not None else None,
        "allocator": allocator,
        "versions": _versions(),
        "cpu": [precision.cpu_description(), torch.backends.cpu.get_cpu_capability(),
                precision.cpu_has_native_bf16(), precision.cpu_has_native_fp16(), precision.onednn_isa_cap(),
                torch.get_num_threads()],
        "world_size": os.environ.get("WORLD_SIZE", "1"),
    }
    text = json.dumps(description, sort_keys=True, default=_json_value)
    return hashlib.sha256(text.encode()).hexdigest()


def read_probe(name: str) -> dict | None:
    """The probe stored under `name`, or None (absent, unreadable, incomplete, caching off)."""
    entry = cache.read_entry(PROBES, name)
    required = _STOPPED_PROBE_KEYS if entry is not None and entry.get("stopped") else _PROBE_KEYS
    if entry is None or not all(isinstance(entry.get(field), (int, float, list)) for field in required):
        return None
    return entry


def write_probe(name: str, result: dict) -> None:
    """Stores a probe's measurements under `name` (nothing when caching is off or the directory is not writable)."""
    cache.write_entry(PROBES, name, result)


def _shapes(batch: dict) -> dict:
    return {name: list(value.shape) for name, value in sorted(batch.items()) if isinstance(value, torch.Tensor)}
