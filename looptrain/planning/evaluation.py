"""Evaluation inside the budget: the largest evaluation batch, up to the one asked for, whose estimated peak fits the
plan's budget by the plan's own fit rule (`Budget.within`: the process's memory besides tensors and the margin)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from looptrain.planning.budget import Budget
from looptrain.planning.plans import Plan, format_bytes


@dataclass(frozen=True)
class EvaluationBatch:
    """The evaluation batch a planned run uses.

    Attributes:
        size: rows per evaluation batch.
        requested: the rows asked for (--eval-batch-size).
        peak_bytes: evaluation's estimated peak at `size`.
        fits: whether that peak fits the budget (False only when one row does not).
        note: what was cut and why, for the plan's notes and the run's line; None when nothing was.
    """

    size: int
    requested: int
    peak_bytes: int
    fits: bool
    note: str | None


def plan_budget(plan: Plan) -> Budget:
    """The `Budget` the plan fitted its winner to: its bytes, margin, and what it charged besides tensors."""
    return Budget(plan.budget_bytes, plan.margin, overhead=plan.overhead_bytes, growth=plan.growth_bytes)


def evaluation_batch(plan: Plan, requested: int, peak_at: Callable[[int], int]) -> EvaluationBatch:
    """The largest evaluation batch of at most `requested` rows whose estimated peak, `peak_at(rows)` (evaluation's,
    the weights and optimizer state resident: `looptrain.estimation.estimate_evaluation`), fits `plan`'s budget.

    An evaluation forward's memory grows with its rows, so the largest that fits is found by bisection (a few
    estimates). Evaluation's loss and scores are exact sums over the samples whatever the batch (docs/memory.md).
    """
    budget, peaks = plan_budget(plan), {}

    def fits(rows: int) -> bool:
        if rows not in peaks:
            peaks[rows] = peak_at(rows)
        return budget.within(peaks[rows])

    if fits(requested):
        return EvaluationBatch(requested, requested, peaks[requested], True, None)
    within = format_bytes(plan.budget_bytes)
    if requested == 1 or not fits(1):
        return EvaluationBatch(1, requested, peaks[1], False, (
            f"evaluation batch {requested} -> 1: even one row is estimated at {format_bytes(peaks[1])}, over "
            f"{within} {plan.meter}: pass --max-eval-samples, a shorter --max-length or a larger --memory-budget"))
    low, high = 1, requested  # low fits, high does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return EvaluationBatch(low, requested, peaks[low], True, (
        f"evaluation batch {requested} -> {low} to stay within {within} {plan.meter} (evaluation estimated at "
        f"{format_bytes(peaks[low])}; {format_bytes(peaks[requested])} at {requested})"))
