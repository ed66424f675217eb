"""Planning: "which strategy do we train?", above the estimator (`looptrain.estimation`), which it asks.

Modules:
    planner     `plan`: a memory budget in, the fastest exact training configuration that fits out, in five
                phases, each a function of values: check (`request`), first probe (`first_probe`), search
                (`candidates`, over `search`), rank (`ranking`, over `timing`) and explain
    budget      `Budget`: the fit rule, in one place (estimates, probes, probe ceilings, the run's growth)
    book        `EstimateBook`: the estimates' memo, their predictions, the forked workers and planning's time
    plans       `Plan`, `Candidate`, `Levers`: what a plan is made of, its table and JSON
    suggestions what would fit when nothing does; LoRA's saving
    evaluation  `evaluation_batch`: the largest evaluation batch whose estimated peak fits the plan's budget
    lowest      `lowest`: the full fine-tune with the lowest estimated peak (``--lowest``)
    probes      `probe`: one real update on the worst batch, timed and measured by the budget's meter
    errors      `PlanError`

Their command lines live in `looptrain.cli`.
"""

from looptrain.planning.candidates import by_tokens
from looptrain.planning.errors import PlanError
from looptrain.planning.evaluation import EvaluationBatch, evaluation_batch
from looptrain.planning.lowest import Lowest, lowest
from looptrain.planning.planner import plan
from looptrain.planning.plans import Candidate, Levers, Plan, parse_size
from looptrain.planning.probes import rss_baseline_bytes

__all__ = [
    "Candidate",
    "EvaluationBatch",
    "Levers",
    "Lowest",
    "Plan",
    "PlanError",
    "by_tokens",
    "evaluation_batch",
    "lowest",
    "parse_size",
    "plan",
    "rss_baseline_bytes",
]
