"""Memory: measured and broken down. Every figure names its meter (see docs/memory.md).

Modules:
    tracker     `StorageTracker`: live tensor bytes by storage, their peak, phase and breakdown
    meters      `CpuTensorMeter` / `CudaMeter` (`make_meter`): a real run's peak; `format_memory_table`
    kernels     what a kernel holds inside that is no tensor (an emulated bf16 matmul's fp32 buffer), measured
    allocator   `keep_rss_lean`: glibc malloc's thresholds fixed, so that RSS follows the live tensors
    __main__    the estimate's command line, `python -m looptrain.memory` (`looptrain.cli.estimate`)

A leaf: the Loop uses the tracker and the meters. The estimator that runs the same tracker on fake
tensors sits above the Loop, in `looptrain.planning`.
"""

from looptrain.memory.allocator import keep_rss_lean
from looptrain.memory.meters import (
    CpuTensorMeter,
    CudaMeter,
    current_rss_bytes,
    format_memory_table,
    make_meter,
    peak_rss_bytes,
)
from looptrain.memory.tracker import StorageTracker, gradient_bytes, parameter_bytes, tensor_bytes

__all__ = [
    "CpuTensorMeter",
    "CudaMeter",
    "StorageTracker",
    "current_rss_bytes",
    "format_memory_table",
    "gradient_bytes",
    "keep_rss_lean",
    "make_meter",
    "parameter_bytes",
    "peak_rss_bytes",
    "tensor_bytes",
]
