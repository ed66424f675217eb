"""What a kernel holds inside while it runs, which is no tensor: measured once per CPU kind.

oneDNN computes a bf16 matmul in an fp32 buffer of its whole output where the CPU lacks bf16 instructions (AVX-512
without AVX512_BF16 or AMX, or any CPU under ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``); where bf16 is native, or where the
matmul is not oneDNN's (AVX2), it holds none. The process's RSS holds that buffer though no tensor does: the
estimate counts it apart (`looptrain.estimation.fakes.matmul_scratch_rule`, docs/memory.md, "What the process holds
besides tensors").
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from looptrain.memory.allocator import release_freed
from looptrain.memory.meters import current_rss_bytes, proc_status_bytes, reset_peak_rss
from looptrain.precision import measured_once

SCRATCH_CACHE_KIND = "matmul_scratch"
SCRATCH_SHAPE = (2048, 16, 8192)  # rows, inner, columns: a 64 MiB fp32 output, 0.5 GFLOP
_SCRATCH: dict[str, dict] = {}  # by `cpu_speed_key`: the measured entry


def measure_bf16_matmul_scratch(shape: tuple[int, int, int] = SCRATCH_SHAPE) -> float:
    """Bytes a bf16 matmul holds inside while it runs, per element of its output, beyond the output: the rise of
    the process's peak RSS over one `torch.mm` (one thread, the heap trimmed first). oneDNN computes bf16 in an
    fp32 buffer of the whole output where the CPU lacks bf16 instructions (AVX-512 without AVX512_BF16, or under
    ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``): 4 bytes an element there, none where bf16 is native or not oneDNN's
    (docs/memory.md, "What the process holds besides tensors"). 0.0 without a bf16 matmul or off Linux.

    Raises:
        RuntimeError: called under a dispatch mode (a fake mode, a tracker): nothing real would be measured.
    """
    if _get_current_dispatch_mode() is not None:
        raise RuntimeError("the bf16 matmul's buffer is measured on real tensors: call this outside any fake or "
                           "tracking mode (looptrain.estimation.fakes.matmul_scratch_rule does, before its fake mode)")
    rows, inner, columns = shape
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            generator = torch.Generator().manual_seed(0)
            left = torch.randn(rows, inner, generator=generator).to(torch.bfloat16)
            right = torch.randn(inner, columns, generator=generator).to(torch.bfloat16)
            torch.mm(left[:8], right[:, :8])  # kernel selection, first-call costs
            release_freed()
            before = current_rss_bytes()
            reset_peak_rss()
            output = torch.mm(left, right)
            # the kernel's mark since the reset (not `peak_rss_bytes`, which keeps the process's whole peak)
            rise = proc_status_bytes("VmHWM") - before - output.numel() * output.element_size()
    except (RuntimeError, OSError):  # no bf16 matmul in this build; no /proc to read
        return 0.0
    finally:
        torch.set_num_threads(threads)
    return max(0.0, rise / (rows * columns))


def cpu_bf16_matmul_scratch() -> int:
    """Bytes per output element a bf16 matmul holds inside on this CPU: `measure_bf16_matmul_scratch` rounded to
    the fp32 buffer it is (4) or to nothing (0); measured once per process and CPU kind, cached on disk."""
    entry = measured_once(SCRATCH_CACHE_KIND, _SCRATCH,
                          lambda: {"bytes_per_element": measure_bf16_matmul_scratch()}, "bytes_per_element",
                          salt=f"|{SCRATCH_SHAPE}")
    return 4 if entry["bytes_per_element"] >= 2.0 else 0
