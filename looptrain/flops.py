"""Model FLOP utilisation: the training FLOPs a model needs per token, and this device's matmul peak.

MFU = achieved model FLOP/s / peak FLOP/s. Both sides are counted here, apart from the loop:

- `count_model_flops(model)`: the FLOPs of one training token (forward + backward), by convention
  of the *model*, not of the hardware's work. Every weight matrix of a matmul (``nn.Linear``,
  transformers' ``Conv1D``) costs 2 FLOPs per token forward (a multiply and an add), 2 more for the
  gradient of its input and 2 more for the gradient of the weight: 6 per weight when it trains, 4
  when it is frozen but a trainable module comes before it in forward order (its input's gradient is
  still needed), 2 when no trainable module comes before it (no backward reaches it). Embedding
  lookups cost nothing (an embedding tied to an LM head is counted once, as the head's matmul);
  biases, norms and activations are left out. Attention adds, per layer and per token, ``2 * 2 *
  seq_len * width`` forward (``QK^T`` and ``AV``; width = heads x head size), x3 for training, x1 for
  a block before the first trainable module; causal masking is not discounted (the usual convention).
  Recompute under gradient checkpointing is *not* counted: MFU counts the model's FLOPs, so
  checkpointing lowers it (the hardware does more work for the same model FLOPs).
- `matmul_peak_flops(device, dtype)`: the best FLOP/s of square matmuls in the run's compute dtype,
  measured in about a second and cached on disk (`looptrain.cache`) under a key naming the device
  (CPU: model name, torch's capability, oneDNN's bf16 report and its ``ONEDNN_MAX_CPU_ISA`` cap, threads;
  CUDA: the GPU's name), the dtype and
  torch's version: a CPU restricted to AVX2 (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``)
  gets its own peak. A cached peak that a run then beats (MFU above 100%: it was measured while other work held
  the cores) is measured again once, and the better of the two kept (`matmul_peak_flops(..., at_least=)`).

Tokens are the run's real tokens (the attention mask's ones, or a packed row's tokens before its padding, and its
samples the sequences packed: `looptrain.batches.samples_and_tokens`):
padding is computed but is not the model's work, so a padded run shows it as a lower MFU. Batches
without token ids count samples instead. The attention term uses the mean real length of a sample.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch
from torch import nn

from looptrain import cache
from looptrain.freeze import find_transformer_blocks
from looptrain.precision import cpu_bf16_speedup, cpu_capability, cpu_has_native_bf16, cpu_name

__all__ = ["ModelFlops", "count_model_flops", "matmul_peak_flops", "model_flops_per_token", "peak_key"]

CACHE_KIND = "matmul_peak"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MATMUL_SIZE = {"cpu": 1024, "cuda": 4096}  # square matmuls big enough to reach the peak, small enough to be quick


@dataclass(frozen=True)
class ModelFlops:
    """A model's training FLOPs per token: `dense + attention * seq_len`.

    Attributes:
        dense: the weight matrices' FLOPs per token (2, 4 or 6 per weight, see the module docstring).
        attention: the attention FLOPs per token per position of the sequence (summed over layers).
    """

    dense: float
    attention: float

    def per_token(self, seq_len: float) -> float:
        """Training FLOPs of one token in a sequence of `seq_len` tokens."""
        return self.dense + self.attention * seq_len

    def per_batch(self, rows: int, seq_len: int) -> float:
        """Training FLOPs of a batch of `rows` sequences padded to `seq_len` tokens (the padding computed too)."""
        return rows * seq_len * self.per_token(seq_len)


def _matmul_weights(module: nn.Module) -> int:
    """The multiply-adds per token of a module's own weight matrix (0 for anything but a matmul layer)."""
    if isinstance(module, nn.Linear):  # bitsandbytes' and peft's linear layers too (packed weights: use the shape)
        return module.in_features * module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:  # GPT-2's transposed linear
        return module.weight.numel()
    return 0


def _attention_width(config) -> int | None:
    heads, head_dim = getattr(config, "num_attention_heads", None), getattr(config, "head_dim", None)
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads * head_dim
    hidden = getattr(config, "hidden_size", None)
    return hidden if isinstance(hidden, int) else None


def count_model_flops(model: nn.Module) -> ModelFlops:
    """The model's training FLOPs per token, from its modules and (for attention) its config.

    Trainability is read now: count again after freezing or unfreezing. Forward order is
    ``named_modules()`` order (registration order, which is forward order for transformers). A model
    without ``nn.Linear`` / ``Conv1D`` modules counts each of its parameters of 2+ dimensions as a
    weight matrix. Attention is counted when the model's config names ``num_hidden_layers`` and
    ``hidden_size`` (or heads x ``head_dim``).
    """
    modules = [module for _, module in model.named_modules()]
    position = {id(module): index for index, module in enumerate(modules)}
    trainable = [index for index, module in enumerate(modules)
                 if any(parameter.requires_grad for parameter in module.parameters(recurse=False))]
    first_trainable = trainable[0] if trainable else len(modules)

    def factor(index: int, trains: bool) -> int:
        return 6 if trains else (4 if index > first_trainable else 2)

    dense = 0
    matmuls = [(index, module) for index, module in enumerate(modules) if _matmul_weights(module)]
    for index, module in matmuls:
        dense += factor(index, module.weight.requires_grad) * _matmul_weights(module)
    if not matmuls:
        for index, module in enumerate(modules):
            for parameter in module.parameters(recurse=False):
                if parameter.dim() >= 2:
                    dense += factor(index, parameter.requires_grad) * parameter.numel()
    config = getattr(model, "config", None)
    layers, width = getattr(config, "num_hidden_layers", None), _attention_width(config)
    if not isinstance(layers, int) or width is None:
        return ModelFlops(float(dense), 0.0)
    try:
        blocks = list(find_transformer_blocks(model))
    except ValueError:
        blocks = []
    if len(blocks) == layers:  # a block after the first trainable module (or holding it) runs its backward
        backward = [max(position[id(inner)] for inner in block.modules()) >= first_trainable for block in blocks]
    else:
        backward = [True] * layers
    attention = sum((3 if runs_backward else 1) * 2 * 2 * width for runs_backward in backward)
    return ModelFlops(float(dense), float(attention))


def model_flops_per_token(model: nn.Module, seq_len: float) -> float:
    """Training FLOPs (forward + backward, no recompute) of one token of a `seq_len`-token sequence."""
    return count_model_flops(model).per_token(seq_len)


def device_name(device: torch.device) -> str:
    """The device as reports name it: the GPU's name, or the CPU's model, ISA, bf16's measured speed and threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        speedup = cpu_bf16_speedup()
        bf16 = "no bf16 matmul" if speedup is None else f"bf16 {speedup:.3g}x fp32 measured"
        return f"{cpu_name()} ({cpu_capability()}, {bf16}, {torch.get_num_threads()} threads)"
    return device.type


def peak_key(device: torch.device, precision: str) -> str:
    """The cache key of a peak: the device (on CPU: model, ISA, oneDNN's bf16 report and cap, threads), the dtype
    and torch's version."""
    if device.type == "cpu":
        bf16 = "onednn bf16" if cpu_has_native_bf16() else "no onednn bf16"
        name = f"{cpu_name()} ({cpu_capability()}, {bf16}, {torch.get_num_threads()} threads)"
        return f"{name}|{torch.backends.cpu.get_cpu_capability()}|{precision}|torch {torch.__version__}"
    return f"{device_name(device)}||{precision}|torch {torch.__version__}"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(device: torch.device, dtype: torch.dtype, seconds: float, size: int) -> float:
    """The best FLOP/s of `size` x `size` matmuls over about `seconds` (after two warm-up products)."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    right = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    for _ in range(2):  # kernel selection, thread pools, first-call costs
        torch.mm(left, right)
    _synchronize(device)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while best == float("inf") or time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(left, right)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-12)


def matmul_peak_flops(device: torch.device, precision: str = "fp32", *, seconds: float = 1.0,
                      size: int | None = None, at_least: float | None = None) -> dict:
    """This device's matmul peak in `precision`: read from the cache, else measured (about `seconds`) and cached.

    Args:
        device: where the run computes.
        precision: the run's compute precision, "fp32", "bf16" or "fp16" (autocast's matmul dtype).
        seconds: how long to time matmuls when the cache has no entry.
        size: the matrices' side (default: 1024 on CPU, 4096 on a GPU).
        at_least: FLOP/s a run achieved: a cached peak below it is measured again, and the better of the two is
            cached (a peak measured beside other work is too low for every later run).

    Returns:
        ``{"flops_per_s", "dtype", "device", "size", "key"}``.
    """
    device = torch.device(device)
    key = peak_key(device, precision)
    name = hashlib.sha256(key.encode("utf-8")).hexdigest()[:24]
    entry = cache.read_entry(CACHE_KIND, name)
    cached = entry is not None and entry.get("key") == key and isinstance(entry.get("flops_per_s"), (int, float))
    if cached and (at_least is None or entry["flops_per_s"] >= at_least):
        return entry
    side = size or MATMUL_SIZE.get(device.type, 1024)
    with torch.no_grad():
        flops_per_s = _measure(device, DTYPES[precision], seconds, side)
    if cached:
        flops_per_s = max(flops_per_s, entry["flops_per_s"])
    entry = {"flops_per_s": flops_per_s, "dtype": precision, "device": device_name(device), "size": side, "key": key}
    cache.write_entry(CACHE_KIND, name, entry)
    return entry
