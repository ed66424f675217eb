"""Estimation: "what does this strategy cost?", priced on fake tensors by the Loop's own update.

It sits above the Loop and drives its public update; it never imports `looptrain.planning`, which sits
above it and asks it questions (docs/architecture.md).

Modules:
    estimator   `estimate`: a training step's peak on fake tensors, driving the Loop's own update;
                `estimate_windows` / `bounding_windows`: a run's peak over the batches it will see;
                `estimate_evaluation`: evaluation's peak (a forward without gradients, the optimizer state resident);
                `measure`: the same strategy run for real, for the accuracy check
    fakes       the fake model, and the Loop's behaviour on fake tensors through its doors
                (`FakePrecision`, `FakeOptimizerInBackward`, the priming loss)
    cuda        a CUDA run priced on the CPU: its attention and autocast kernels, cuBLAS's workspaces
    blocks      a stack of N identical blocks priced on 2, 3 and 4 of them and extrapolated to N, byte-exact where
                the tracker's timeline proves it (else the whole model, and why)
    shapes      presets and configs (`preset_config`, `load_config`), `random_batch`, token windows,
                the `ladder` and `ACCURACY_MIXES`
    windows     `run_windows`: the micro-batch shapes of every window a run trains on; `evaluation_shapes`: those
                of its evaluation batches; `run_batches_estimate` / `run_batches_peaks`: a run's own estimate over
                them (training's peak and evaluation's)
    cache       the on-disk cache of estimates: the key of an estimate (everything that decides it)
    worker      `EstimateWorker`: the estimates in forked child processes
"""

from looptrain.estimation.estimator import (
    ESTIMATE_METER,
    bounding_windows,
    estimate,
    estimate_evaluation,
    estimate_windows,
    measure,
)
from looptrain.estimation.shapes import ACCURACY_MIXES, PRESETS, ladder, load_config, preset_config, random_batch
from looptrain.estimation.windows import evaluation_shapes, run_batches_estimate, run_batches_peaks, run_windows
from looptrain.estimation.worker import EstimateWorker

__all__ = [
    "ACCURACY_MIXES",
    "ESTIMATE_METER",
    "PRESETS",
    "EstimateWorker",
    "bounding_windows",
    "estimate",
    "estimate_evaluation",
    "estimate_windows",
    "evaluation_shapes",
    "ladder",
    "load_config",
    "measure",
    "preset_config",
    "random_batch",
    "run_batches_estimate",
    "run_batches_peaks",
    "run_windows",
]
