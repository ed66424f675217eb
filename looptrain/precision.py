"""Precision: the device, what is fast on it, autocast, and the GradScaler with the step it guards.

`Precision` plays the part of Lightning Fabric's precision plugin: the loop asks it for the autocast
context, for the backward, to unscale before clipping and to take (or skip) the optimizer step; it
owns the scaler and its state. One `GradScaler(enabled=(precision == "fp16"))` lets fp32, bf16 and
fp16 share one code path: a disabled scaler's `scale`, `unscale_`, `step` and `update` pass through.

`amp_precision` decides what `--amp` / `precision="auto"` means on a device by what the hardware
does, not by what torch or oneDNN merely accept. On a CPU that is measured (`cpu_matmul_speed`): a
bf16 matmul and an fp32 one are timed once per process (and cached on disk, `looptrain.cache`), and
bf16 autocast is chosen only where bf16 runs at least `BF16_FAST_RATIO` times fp32's speed. oneDNN
reports bf16 "supported" on every AVX-512 CPU, also where it lacks AVX512_BF16 and AMX and computes
bf16 several times slower than fp32 (Skylake / Cascade Lake Xeons, or any CPU under
``ONEDNN_MAX_CPU_ISA=AVX512_CORE``); the flag alone would pick the slow precision there.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from looptrain import cache

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

    The extensions are named only when oneDNN reports bf16 (so a CPU restricted to AVX2 with
    `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` reads as plain `AVX2`); a cap on oneDNN's
    instructions (`ONEDNN_MAX_CPU_ISA`) is named after them, as the extensions may then go unused.
    """
    capability = torch.backends.cpu.get_cpu_capability()
    if not cpu_has_native_bf16():
        return capability
    probes = (("AVX512_BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
    named = "+".join([capability, *(name for name, probe in probes if getattr(torch.cpu, probe, lambda: False)())])
    cap = onednn_isa_cap()
    return f"{named}, oneDNN capped at {cap}" if cap else named


def onednn_isa_cap() -> str | None:
    """The instruction set oneDNN is capped at (``ONEDNN_MAX_CPU_ISA``, or its old name ``DNNL_MAX_CPU_ISA``)."""
    value = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return value.strip().upper() or None


def cpu_description() -> str:
    """One line naming the CPU for benchmark headers and summaries: model, torch capability, threads."""
    return f"{cpu_name()} ({cpu_capability()}, {torch.get_num_threads()} threads)"


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN inside torch reports bf16 on this CPU: False means emulated; True is no promise of speed
    (oneDNN reports it on any AVX-512 CPU): `cpu_bf16_is_fast` measures that."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def cpu_has_native_fp16() -> bool:
    """Whether this CPU computes fp16 natively (AVX-512 FP16 or AMX-FP16), as oneDNN inside torch reports it."""
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# ---------------------------------------------------------------------- what is fast on this CPU, measured
BF16_FAST_RATIO = 1.1  # the rule: bf16 autocast on a CPU only where a bf16 matmul runs >= 1.1x fp32's speed
SPEED_CACHE_KIND = "matmul_speed"
MATMUL_SIDE = 256  # square matmuls on one thread: big enough for oneDNN's bf16 kernels, small enough where emulated
_SPEEDS: dict[str, dict] = {}  # per process, by `cpu_speed_key`


def _median_matmul_flops(dtype: torch.dtype, side: int, repeats: int, seconds: float) -> float:
    """FLOP/s of a `side` x `side` matmul in `dtype`: the median of up to `repeats` timed products after a warm-up,
    fewer once `seconds` have passed (at least one)."""
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(side, side, generator=generator).to(dtype)
    right = torch.randn(side, side, generator=generator).to(dtype)
    torch.mm(left, right)  # kernel selection, first-call costs
    times, deadline = [], time.perf_counter() + seconds
    while len(times) < repeats and (not times or time.perf_counter() < deadline):
        start = time.perf_counter()
        torch.mm(left, right)
        times.append(time.perf_counter() - start)
    return 2 * side**3 / max(statistics.median(times), 1e-12)


def measure_cpu_matmul_speed(side: int = MATMUL_SIDE, repeats: int = 5, seconds: float = 0.2) -> dict:
    """This CPU's matmul speed in fp32 and in bf16 (FLOP/s), on one thread so that other processes' load and
    thread barriers do not blur the ratio; bf16 is None where torch has no bf16 matmul on the CPU. Bounded where
    bf16 is emulated: its repeats stop after `seconds` (docs/finetune.md#precision-from-measurement has the cost).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            fp32 = _median_matmul_flops(torch.float32, side, repeats, seconds)
            try:
                bf16 = _median_matmul_flops(torch.bfloat16, side, repeats, seconds)
            except RuntimeError:  # a build without bf16 matmuls on the CPU
                bf16 = None
    finally:
        torch.set_num_threads(threads)
    return {"fp32": fp32, "bf16": bf16}


def cpu_speed_key() -> str:
    """What the measured speed belongs to: the CPU, torch's capability, oneDNN's bf16 report and cap, torch."""
    return (f"{cpu_name()}|{torch.backends.cpu.get_cpu_capability()}|onednn bf16 {cpu_has_native_bf16()}"
            f"|onednn cap {onednn_isa_cap()}|torch {torch.__version__}|side {MATMUL_SIDE}")


def cpu_matmul_speed() -> dict:
    """`measure_cpu_matmul_speed` once per process and CPU kind, and cached on disk (`looptrain.cache`).

    Returns:
        ``{"fp32", "bf16", "key"}``: FLOP/s (bf16 None where there is no bf16 matmul) and `cpu_speed_key`.
    """
    return measured_once(SPEED_CACHE_KIND, _SPEEDS, measure_cpu_matmul_speed, "fp32")


def measured_once(kind: str, memo: dict, measure: Callable[[], dict], number: str, salt: str = "") -> dict:
    """What `measure()` returns, measured once per process and CPU kind (`cpu_speed_key`: kept in `memo`) and cached
    on disk under `kind` (`looptrain.cache`; `salt` names what else the measurement depends on). A disk entry of
    another key, or without a number at `number`, is measured again. The entry carries its ``"key"``."""
    key = cpu_speed_key()
    if key not in memo:
        name = hashlib.sha256(f"{key}{salt}".encode()).hexdigest()[:24]
        entry = cache.read_entry(kind, name)
        if entry is None or entry.get("key") != key or not isinstance(entry.get(number), (int, float)):
            entry = {**measure(), "key": key}
            cache.write_entry(kind, name, entry)
        memo[key] = entry
    return memo[key]


def cpu_bf16_speedup() -> float | None:
    """bf16 matmul speed / fp32 matmul speed on this CPU, measured; None where there is no bf16 matmul."""
    speed = cpu_matmul_speed()
    return None if speed.get("bf16") is None else speed["bf16"] / max(speed["fp32"], 1e-12)


def cpu_bf16_is_fast() -> bool:
    """Whether bf16 is worth autocasting to on this CPU: its matmuls measured >= `BF16_FAST_RATIO` x fp32's speed."""
    speedup = cpu_bf16_speedup()
    return speedup is not None and speedup >= BF16_FAST_RATIO


def cpu_bf16_speed_line() -> str:
    """What was measured, in words: "bf16 matmuls run 0.29x the speed of fp32 on this CPU (measured; AVX512)"."""
    speedup = cpu_bf16_speedup()
    if speedup is None:
        return f"this CPU has no bf16 matmul in this torch ({cpu_capability()})"
    return f"bf16 matmuls run {speedup:.3g}x the speed of fp32 on this CPU (measured; {cpu_capability()})"




def amp_precision(device: torch.device) -> tuple[str, str]:
    """What `--amp` / `precision="auto"` means on `device`, and the reason, in one line.

    - CUDA: bf16 where the GPU supports it (compute capability 8.0+), else fp16 with a GradScaler.
    - CPU: bf16 only where its matmuls measured at least `BF16_FAST_RATIO` times fp32's speed here
      (`cpu_bf16_is_fast`); elsewhere fp32, and the line says the measured ratio.
    - Other devices: fp16 with a GradScaler.

    Returns:
        `(precision, reason)`: one of "fp32", "bf16", "fp16", and a line to print.
    """
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "--amp: bf16 autocast (this GPU supports bf16)"
        return "fp16", "--amp: fp16 autocast with a GradScaler (this GPU has no bf16)"
    if device.type == "cpu":
        if cpu_bf16_is_fast():
            return "bf16", f"--amp: bf16 autocast: {cpu_bf16_speed_line()}"
        return "fp32", (f"--amp: fp32: {cpu_bf16_speed_line()}; bf16 autocast needs {BF16_FAST_RATIO}x; "
                        "force with --precision bf16")
    return "fp16", f"--amp: fp16 autocast with a GradScaler on {device.type}"


def resolve_precision(precision: str, device: torch.device) -> str:
    """`precision` as given, or for "auto" what `amp_precision` picks on `device`."""
    return amp_precision(device)[0] if precision == "auto" else precision


def emulation_warning(device: torch.device, precision: str) -> str | None:
    """A one-line warning when `precision` runs emulated (slowly) on this CPU, else None."""
    if device.type != "cpu" or precision == "fp32":
        return None
    speedup = cpu_bf16_speedup() if precision == "bf16" else None
    if precision == "bf16" and speedup is not None and speedup < 1:
        return (f"precision bf16 is slower than fp32 here: {cpu_bf16_speed_line()} "
                "(use --amp or --precision fp32 for speed)")
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
