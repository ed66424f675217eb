"""Device resolution, autocast contexts and the GradScaler for a (device, precision) pair.

One `GradScaler(enabled=(precision == "fp16"))` lets fp32, bf16 and fp16 share one code path: a
disabled scaler's `scale`, `unscale_`, `step` and `update` are plain pass-throughs.
"""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    """Turns a device name into a `torch.device`; "auto" picks CUDA when it is present.

    Raises:
        ValueError: the name is not a device, or names CUDA on a machine without it.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"device={name!r} is not a device name; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available here; use device='cpu' or 'auto'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device={name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


def precision_problem(device: torch.device, precision: str) -> str | None:
    """Why `precision` cannot run on `device`, or None when it can."""
    if precision == "fp32":
        return None
    if not torch.amp.is_autocast_available(device.type):
        return f"precision={precision!r} needs autocast, which torch does not offer on device type {device.type!r}"
    if device.type == "cuda" and precision == "bf16" and not torch.cuda.is_bf16_supported():
        return (
            "precision='bf16' is not supported by this GPU (it needs compute capability 8.0+); "
            "use precision='fp16' (with its GradScaler) or 'fp32'"
        )
    if precision == "fp16" and device.type not in ("cuda", "cpu", "xpu", "mps"):
        return f"precision='fp16' needs a GradScaler, which torch does not offer on device type {device.type!r}"
    return None


def amp_precision(device: torch.device) -> str:
    """The precision `--amp` means on this device: bf16 where supported, else fp16 with a GradScaler."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if device.type == "cpu":
        return "bf16"  # CPU autocast always offers bf16; it is fast where the CPU has AVX-512 BF16 / AMX
    return "fp16"


def autocast(device: torch.device, precision: str):
    """The autocast context for this precision (a null context for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def make_grad_scaler(device: torch.device, precision: str, init_scale: float = 2.0**16) -> torch.amp.GradScaler:
    """A GradScaler that is active for fp16 only; for fp32 and bf16 it passes everything through."""
    return torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=(precision == "fp16"))
