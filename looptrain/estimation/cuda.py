"""CUDA's kernels priced on the CPU: an estimate for a GPU run, made on fake CPU tensors.

The estimate always runs on the CPU. For ``estimate(device="cuda")`` it runs attention and autocast's fp32
ops as CUDA runs them (`cuda_kernels`), and adds the cuBLAS workspaces a CUDA run allocates
(`with_cublas_workspaces`, `cublas_workspace_bytes`) to the result, after the cache.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import torch

from looptrain.estimation.fakes import replaced


def priced_device_type(device: Any) -> str:
    """"cpu" or "cuda" (of "cuda:1", a torch.device, ...): the kernels an estimate prices.

    Raises:
        ValueError: another device type, naming the two priced.
    """
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"estimate: device={device!r} is not priced; use 'cpu' or 'cuda'")
    return kind


@contextlib.contextmanager
def cuda_kernels():
    """Attention and autocast as a CUDA GPU runs them, on the estimate's fake CPU tensors.

    On the CPU a masked or dropped-out attention runs the math path, which keeps the attention probabilities (and
    their dropout) for backward: a [rows, heads, seq, seq] tensor or three per layer. On CUDA (sm80 and later)
    torch picks a fused kernel: flash attention for fp16 / bf16 without a mask (grouped-query heads as they are),
    else the memory-efficient kernel (any dtype, an additive mask). Both keep only their output and its log-sum-exp.
    The fused kernels' own aten ops run here on fake tensors (their meta kernels), so what autograd saves is what
    the GPU's autograd saves. CUDA's autocast runs the ops of `CUDA_AUTOCAST_FP32` in fp32 where the CPU's runs
    them in their input's dtype: under the estimate's (CPU) autocast they are run as CUDA's would run them.
    """
    functional = torch.nn.functional

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        flash = attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256
        if flash:
            return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal,
                                                                      scale=scale)[0]
        if key.shape[-3] != query.shape[-3]:  # the memory-efficient kernel takes every head's keys
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:  # as torch converts it: an additive mask of the query's dtype
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
            attn_mask = attn_mask.expand(*query.shape[:-1], key.shape[-2])
        needs_grad = query.requires_grad or key.requires_grad or value.requires_grad
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, needs_grad,
                                                                      dropout_p, is_causal, scale=scale)[0]

    fp32_ops = {name: _fp32_under_autocast(getattr(functional, name)) for name in CUDA_AUTOCAST_FP32}
    with replaced(functional, scaled_dot_product_attention=attention, **fp32_ops):
        yield


# The threads that run a training step's matmuls, each with its own cuBLAS handle and workspace: the one that runs the
# forward (and evaluation, and the optimizer), and autograd's device thread, which runs every backward. bf16 autocast
# (cuBLASLt) shares the handle's workspace, and later steps allocate none (docs/memory.md, "The estimator").
CUBLAS_HANDLES = 2


def cublas_workspace_bytes() -> int:
    """The workspace torch gives each cuBLAS handle, allocated through the caching allocator at the handle's first
    matmul and kept for the process: ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE:COUNT`` pairs in KiB, summed) where it
    is set, else torch's default: 32 MiB on compute capability 9.x-12.x (Hopper, Blackwell), 8 MiB + 128 KiB before.
    Without a visible GPU the 32 MiB of current GPUs is assumed (a budget errs on the high side)."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(size) * int(count) for size, count in pairs) * 1024
    major = torch.cuda.get_device_capability()[0] if torch.cuda.is_available() else 9
    return 4096 * 8 * 1024 if 9 <= major <= 12 else (4096 * 2 + 16 * 8) * 1024




def with_cublas_workspaces(result: dict[str, Any]) -> dict[str, Any]:
    """A CUDA estimate's result with cuBLAS's workspaces (`CUBLAS_HANDLES` of `cublas_workspace_bytes`) added to its
    peak, its phases' peaks and its activations and temporaries: the caching allocator counts them, and they exist
    from a run's first update on. Added after the cache, which holds the tensors alone (the size depends on this
    machine's GPU and environment)."""
    each = cublas_workspace_bytes()
    workspaces = CUBLAS_HANDLES * each
    breakdown = dict(result["memory_breakdown"])
    breakdown["activations_and_temps"] = breakdown.get("activations_and_temps", 0) + workspaces
    phases = {phase: peak + workspaces for phase, peak in (result["phase_peak_bytes"] or {}).items()}
    return {**result, "peak_memory_bytes": result["peak_memory_bytes"] + workspaces, "memory_breakdown": breakdown,
            "phase_peak_bytes": phases,
            "cublas_workspace_bytes": workspaces,
            "notes": [*result.get("notes", []), f"includes cuBLAS's workspaces: {CUBLAS_HANDLES} x "
                      f"{each / 2**20:g} MiB (the forward's thread and autograd's)"]}


# torch.nn.functional's ops that CUDA's autocast runs in fp32 and the CPU's runs in the input's dtype (the op lists of
# torch's autocast docs; the losses are fp32 on both). Under CUDA's bf16 autocast a bf16 model's LayerNorm reads and
# writes fp32: its input is saved for backward in fp32, and the residual stream after it is fp32.
CUDA_AUTOCAST_FP32 = ("layer_norm", "group_norm", "softmax", "log_softmax")


def _fp32_under_autocast(function: Any) -> Any:
    """`function` as CUDA's autocast runs an op of its fp32 list: floating-point inputs cast to fp32, run in fp32."""
    def run(*args, **kwargs):
        if not torch.is_autocast_enabled("cpu"):  # the estimate's Loop autocasts on its own device, the CPU
            return function(*args, **kwargs)

        def fp32(value):
            return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value

        with torch.autocast("cpu", enabled=False):
            return function(*map(fp32, args), **{name: fp32(value) for name, value in kwargs.items()})

    return run
