"""Precision: the device, what is fast on it, autocast, and the GradScaler with the step it guards.

`Precision` plays the part of Lightning Fabric's precision plugin: the loop asks it for the autocast
context, for the backward, to unscale before clipping and to take (or skip) the optimizer step; it
owns the scaler and its state. One `GradScaler(enabled=(precision == "fp16"))` lets fp32, bf16 and
fp16 share one code path: a disabled scaler's `scale`, `unscale_`, `step` and `update` pass through.

`amp_precision` decides what `--amp` / `precision="auto"` means on a device by what the hardware
has, not by what torch merely accepts: a CPU without native bf16 emulates it several times slower
than fp32.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch

PRECISIONS = ("fp32", "bf16", "fp16")
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
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={name!r}: looptrain trains on 'cpu' and 'cuda' (and 'mps' where PyTorch has it); "
                         "use device='auto'")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={name!r} was asked for but this PyTorch build has no MPS device (Apple GPUs only); "
                         "use device='cpu' or 'auto'")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for but CUDA is not available here; use device='cpu' or 'auto'")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(
            f"device={name!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return device


# ---------------------------------------------------------------------- what this CPU does natively
@functools.cache
def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux; the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_capability() -> str:
    """torch's vector ISA for this CPU (`AVX2`, `AVX512`, ...), plus `+AVX512_BF16` / `+AMX` when torch uses them.

    The extensions are named only when oneDNN computes bf16 natively (so a CPU restricted to AVX2
    with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` reads as plain `AVX2`).
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if not cpu_has_native_bf16():
        return capability
    probes = (("AVX512_BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
    return "+".join([capability, *(name for name, probe in probes if getattr(torch.cpu, probe, lambda: False)())])


def cpu_description() -> str:
    """One line naming the CPU for benchmark headers and summaries: model, torch capability, threads."""
    return f"{cpu_name()} ({cpu_capability()}, {torch.get_num_threads()} threads)"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX), as oneDNN inside torch reports it."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_has_native_fp16() -> bool:
    """Whether this CPU computes fp16 natively (AVX-512 FP16 or AMX-FP16), as oneDNN inside torch reports it."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def amp_precision(device: torch.device) -> tuple[str, str]:
    """What `--amp` / `precision="auto"` means on `device`, and the reason, in one line.

    - CUDA: bf16 where the GPU supports it (compute capability 8.0+), else fp16 with a GradScaler.
    - CPU: bf16 only where the CPU has native bf16 (AMX or AVX-512 BF16); elsewhere bf16 is
      emulated, several times slower than fp32, so fp32.
    - Other devices: fp16 with a GradScaler.

    Returns:
        `(precision, reason)`: one of "fp32", "bf16", "fp16", and a line to print.
    """
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "--amp: bf16 autocast (this GPU supports bf16)"
        return "fp16", "--amp: fp16 autocast with a GradScaler (this GPU has no bf16)"
    if device.type == "cpu":
        capability = cpu_capability()
        if cpu_has_native_bf16():
            return "bf16", f"--amp: bf16 autocast (this CPU has native bf16: {capability})"
        return "fp32", (
            f"--amp: this CPU has no native bf16 ({capability}); training in fp32, which is faster here; "
            "force with --precision bf16"
        )
    return "fp16", f"--amp: fp16 autocast with a GradScaler on {device.type}"


def resolve_precision(precision: str, device: torch.device) -> str:
    """`precision` as given, or for "auto" what `amp_precision` picks on `device`."""
    return amp_precision(device)[0] if precision == "auto" else precision


def emulation_warning(device: torch.device, precision: str) -> str | None:
    """A one-line warning when `precision` runs emulated (slowly) on this CPU, else None."""
    if device.type != "cpu" or precision == "fp32":
        return None
    if precision == "bf16" and not cpu_has_native_bf16():
        return (f"precision bf16 on a CPU without native bf16 ({cpu_capability()}): it is emulated and several "
                "times slower than fp32 here (use --amp or --precision fp32 for speed)")
    if precision == "fp16" and not cpu_has_native_fp16():
        return (f"precision fp16 on a CPU without native fp16 ({cpu_capability()}): it is emulated and many "
                "times slower than fp32 here (CPU fp16 is for testing the GradScaler path)")
    return None


def precision_problem(device: torch.device, precision: str) -> str | None:
    """Why `precision` cannot run on `device`, or None when it can ("auto" always can)."""
    if precision in ("fp32", "auto"):
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


# ---------------------------------------------------------------------- the plugin
class Precision:
    """Autocast, the GradScaler and the optimizer step it guards, for one device and precision.

    Args:
        device: where the model trains.
        precision: "fp32", "bf16" or "fp16" (resolve "auto" with `resolve_precision` first).
        init_scale: the fp16 GradScaler's first scale.
    """

    def __init__(self, device: torch.device, precision: str, init_scale: float = 2.0**16):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} (got {precision!r})")
        self.device = device
        self.name = precision
        self.scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=(precision == "fp16"))

    def autocast(self):
        """The autocast context for this precision (a null context for fp32)."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=AUTOCAST_DTYPES[self.name])

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of `loss`, multiplied by the scale first under fp16."""
        self.scaler.scale(loss).backward()

    def unscale_(self, optimizer: Any) -> None:
        """fp16: divides the gradients by the scale, so clipping sees their true values."""
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: Any, grad_norm: torch.Tensor) -> bool:
        """Applies the update unless the gradients are not finite; returns whether it was applied.

        fp16: the scaler steps unless some gradient overflowed, then lowers or keeps its scale (a
        skip shows as a lower scale). fp32/bf16: a non-finite gradient norm skips the step.
        """
        if self.scaler.is_enabled():
            scale_before = self.scaler.get_scale()
            self.scaler.step(optimizer)
            self.scaler.update()
            return self.scaler.get_scale() >= scale_before  # the scale only shrinks after a skip
        if not math.isfinite(float(grad_norm)):
            return False
        optimizer.step()
        return True

    def state_dict(self) -> dict:
        """The scaler's state (empty for fp32 and bf16)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores `state_dict()`."""
        self.scaler.load_state_dict(state)
