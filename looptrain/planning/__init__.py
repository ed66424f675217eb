"""Planning: above the Loop, the estimator and the planner drive its public update (see docs/architecture.md).

Modules:
    estimator   `estimate`: a training step's peak on fake tensors, driving the Loop's own update;
                `estimate_windows` / `bounding_windows`: a run's peak over the batches it will see;
                `measure`: the same strategy run for real, for the accuracy check
    estimate_cache  the on-disk cache of estimates: the key of an estimate (everything that decides it)
    planner     `plan`: a memory budget in, the fastest exact training configuration that fits out, from
                `plans` (`Plan`, `Candidate`, `Levers`), `search` (what fits), `ranking` (probes and the
                time model: what is fastest) and `suggestions` (when nothing fits; LoRA's saving)
    lowest      `lowest`: the full fine-tune with the lowest estimated peak (``--lowest``)
    probes      `probe`: one real update on the worst batch, timed and measured by the budget's meter
    worker      `EstimateWorker`: the estimates in forked child processes
    errors      `PlanError`

Their command lines live in `looptrain.cli` (`python -m looptrain.memory` is the estimate's).
"""

from looptrain.planning.errors import PlanError
from looptrain.planning.estimator import (
    ACCURACY_MIXES,
    ESTIMATE_METER,
    PRESETS,
    bounding_windows,
    estimate,
    estimate_windows,
    ladder,
    load_config,
    measure,
    preset_config,
    random_batch,
)
from looptrain.planning.lowest import Lowest, lowest
from looptrain.planning.planner import plan
from looptrain.planning.plans import Candidate, Levers, Plan, Settings, parse_size
from looptrain.planning.probes import rss_baseline_bytes
from looptrain.planning.ranking import run_batches_estimate, run_windows
from looptrain.planning.search import by_tokens

__all__ = [
    "ACCURACY_MIXES",
    "ESTIMATE_METER",
    "PRESETS",
    "Candidate",
    "Levers",
    "Lowest",
    "Plan",
    "PlanError",
    "Settings",
    "bounding_windows",
    "by_tokens",
    "estimate",
    "estimate_windows",
    "ladder",
    "load_config",
    "lowest",
    "measure",
    "parse_size",
    "plan",
    "preset_config",
    "random_batch",
    "rss_baseline_bytes",
    "run_batches_estimate",
    "run_windows",
]
