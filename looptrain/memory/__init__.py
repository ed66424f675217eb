"""Memory: measured, broken down and estimated. Every figure names its meter (see docs/memory.md).

Modules:
    tracker     `StorageTracker`: live tensor bytes by storage, their peak, phase and breakdown
    meters      `CpuTensorMeter` / `CudaMeter` (`make_meter`): a real run's peak; `format_memory_table`
    estimator   `estimate`: a training step's peak on fake tensors, driving the Loop's own update;
                `estimate_windows` / `bounding_windows`: a run's peak over the batches it will see
    __main__    the estimator's command line (`python -m looptrain.memory`)

The tracker and the meters are leaves (the Loop uses them); the estimator sits above the Loop, so
its names are imported on first use.
"""

from looptrain.memory.meters import (
    CpuTensorMeter,
    CudaMeter,
    current_rss_bytes,
    format_memory_table,
    make_meter,
    peak_rss_bytes,
)
from looptrain.memory.tracker import StorageTracker, gradient_bytes, parameter_bytes, tensor_bytes
from looptrain.optim import optimizer_state_bytes

# The estimator's names, imported on first use by `__getattr__`; they are listed in `__all__` below as well
# (literal strings, so that static tools can read it).
_ESTIMATOR_NAMES = ("ACCURACY_MIXES", "ESTIMATE_METER", "PRESETS", "bounding_windows", "estimate", "estimate_windows",
                    "ladder", "load_config", "measure", "preset_config", "random_batch")

__all__ = [
    "CpuTensorMeter",
    "CudaMeter",
    "StorageTracker",
    "current_rss_bytes",
    "format_memory_table",
    "gradient_bytes",
    "make_meter",
    "optimizer_state_bytes",
    "parameter_bytes",
    "peak_rss_bytes",
    "tensor_bytes",
    # the estimator's (`_ESTIMATOR_NAMES`)
    "ACCURACY_MIXES",
    "ESTIMATE_METER",
    "PRESETS",
    "bounding_windows",
    "estimate",
    "estimate_windows",
    "ladder",
    "load_config",
    "measure",
    "preset_config",
    "random_batch",
]


def __getattr__(name: str):
    """The estimator's names, imported on first use (it imports the Loop, which imports the meters)."""
    if name in _ESTIMATOR_NAMES:
        from looptrain.memory import estimator

        return getattr(estimator, name)
    if name == "main":
        from looptrain.memory.__main__ import main

        return main
    raise AttributeError(f"module 'looptrain.memory' has no attribute {name!r}")
