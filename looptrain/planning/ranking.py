"""The plan's rank phase: candidates probed within planning's time and ranked by what their probes predict (`rank`);
the baseline kept unless another is measured `KEEP_BASELINE_WITHIN` faster. The time model is `timing`'s."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import looptrain.planning.probes as probes
from looptrain.flops import ModelFlops
from looptrain.planning.budget import Budget
from looptrain.planning.errors import PlanError
from looptrain.planning.plans import Candidate, format_bytes
from looptrain.planning.timing import (
    has_line,
    line_priced,
    predicted_probe_seconds,
    record_probe,
    same_kernels,
    scale_priors,
    steps_alike,
    timed,
    typical_batch,
)

# The plan keeps the configuration the run would have trained without it unless another candidate's measured
# prediction is at least this much faster: a probe is one update, and its prediction is a sample, not a constant.
KEEP_BASELINE_WITHIN = 0.05

# A candidate is probed only if, this much faster than the prior (scaled to the probes) predicts, it would win by
# more than its probe costs: the prior orders candidates within about this factor.
PRIOR_OPTIMISM = 0.75


@dataclass(frozen=True, eq=False)
class Prober:
    """What a probe needs: the model, where the worst batches come from (`order`: the dataset's indices, longest
    first), the device, the budget and its meter (None: the tensors meter), the model's FLOPs and the echo."""

    model: Any
    dataset: Any
    collator: Any
    order: Any
    device: str
    max_grad_norm: float | None
    meter: probes.Meter | None
    budget: Budget
    flops: ModelFlops | None = None
    echo: Callable[[str], None] = lambda line: None
    batches: dict = field(default_factory=dict, compare=False)  # by micro-batch size: collated once
    # Planning's seconds left when ranking starts (None: no bound): a probe that cannot be paid from what is left is
    # cut to what it decides (`probe`); `spent` holds the probes' seconds since.
    seconds_left: float | None = None
    spent: list = field(default_factory=list, compare=False)

    def batch(self, size: int) -> dict:
        """The worst batch of `size` rows (the longest samples)."""
        if size not in self.batches:
            self.batches[size] = self.collator([self.dataset[i] for i in self.order[:size]])
        return self.batches[size]

    def probe(self, candidate: Candidate, candidates: list[Candidate]) -> None:
        """Probes `candidate` (`probes.probe`, stopped at the budget's `probe_ceiling` under a measured meter) and
        records what it predicts. Settings that run the same kernels share one line of costs: the first probe of them
        times a typical micro-batch, the others reuse its line and are probed for their memory and steps."""
        ceiling = self.budget.probe_ceiling() if self.meter is not None else None
        alike = next((other for other in candidates if has_line(other.probe)
                      and same_kernels(other.settings, candidate.settings)), None)
        # Where planning's time left cannot pay for the whole probe and the estimate decides the memory: priced by the
        # line of a probe of the same kernels (a fused step's: of its settings stepped after backward), else timed
        # without the worst batch (docs/plan.md, 'What planning costs').
        cut = self.seconds_left is not None and self.budget.decides(candidate.estimated_peak_bytes) \
            and predicted_probe_seconds(candidate, candidates) > self.seconds_left - sum(self.spent)
        lined = None if not cut else alike if alike is not None else next(
            (other for other in candidates
             if has_line(other.probe) and steps_alike(candidate.settings, other.settings)), None)
        priced = line_priced(lined, self.flops) if lined is not None else None
        if priced is not None:
            record_probe(candidate, priced, self.flops, lined.probe)
            return
        typical = typical_batch(candidate, self.dataset, self.collator, self.order) \
            if alike is None or cut else None
        probed = probes.probe(self.model, candidate.settings, self.batch(candidate.settings.batch_size), self.device,
                              self.max_grad_norm, self.meter, ceiling, candidate.step_bytes, typical=typical,
                              **({"truncation": candidate.truncation} if candidate.truncation is not None else {}),
                              **({"memory": False} if cut else {}))
        self.spent.append(probed["probe_seconds"])
        record_probe(candidate, probed, self.flops, alike.probe if alike is not None and not cut else None)

    def say(self, candidate: Candidate, over: bool) -> None:
        """The echo's line for a probe: its speed, or where it stopped, and its measured peak."""
        settings, probe, peak = candidate.settings, candidate.probe, candidate.probe.get("measured_peak_bytes")
        if not probe.get("stopped"):
            speed = f"{len(self.dataset.lengths) / candidate.seconds_per_epoch:.1f} samples/s predicted"
        elif "before_step_bytes" in probe:
            speed = (f"stopped before its optimizer step (+{format_bytes(probe['before_step_bytes'])}) would "
                     f"pass {format_bytes(probe['ceiling'])}, the most that fits")
        else:
            speed = f"stopped past {format_bytes(probe['ceiling'])}, the most that fits"
        self.echo(f"  probe {settings.batch_size} x {settings.accum_steps}, {settings.precision}, "
                  f"{settings.optimizer}, checkpointing {settings.checkpointing}"
                  f"{', fused step' if settings.optimizer_in_backward else ''}: "
                  f"{speed} "
                  + (f"(from the cache, measured in {probe['probe_seconds']:.1f} s"
                     if probe.get("from_cache") else f"({probe['probe_seconds']:.1f} s")
                  + (f"; measured peak {format_bytes(peak)}{', over the budget' if over else ''}"
                     if peak is not None else "") + ")")


@dataclass(frozen=True)
class Ranking:
    """The rank phase's answer: the candidates, fastest first (under a measured meter, only those whose probe fits),
    the notes on how they were ranked, the probes' seconds (the first probe's included) and the probe budget left
    after the baseline's and the favourite's probes."""

    candidates: list[Candidate]
    notes: list[str]
    probe_seconds: float
    probe_budget_seconds: float | None


class _Probing:
    """The candidates as the rank phase probes them: which were measured over the budget (`rejected`) and the
    probes' seconds as planning's time counts them (`charged`: each at its measured or recorded seconds)."""

    def __init__(self, candidates: list[Candidate], prober: Prober,
                 smaller: Callable[[Candidate, list[Candidate]], Candidate | None]):
        self.candidates, self.prober, self.smaller = list(candidates), prober, smaller
        self.rejected: list[Candidate] = []
        self.charged = 0.0

    def run(self, candidate: Candidate) -> None:
        """Probes `candidate` unless it was probed before the search. One whose probe measures over the budget gets
        a stand-in, probed at once, budget or not: the candidate the prior ranks first of those not probed yet, the
        next smaller split of its settings (`smaller`, given the candidates so far) among them (a larger micro-batch
        of a mode that recomputes may rank ahead of one that does not, and measure over the budget: the runner-up is
        then more likely the faster of what fits than the favourite's own smaller split)."""
        if not candidate.probed:
            self.prober.probe(candidate, self.candidates)
            self.charged += candidate.probe["probe_seconds"]
        over = not self.prober.budget.probe_fits(candidate.probe)
        if over:
            self.rejected.append(candidate)
        self.prober.say(candidate, over)
        if over:
            replacement = self.smaller(candidate, self.candidates)
            if replacement is not None:
                self.candidates.append(replacement)
            stand_in = min((other for other in self.candidates if not other.probed),
                           key=lambda other: other.prior, default=None)
            if stand_in is not None:
                self.run(stand_in)

    def run_within(self, budget: float, epochs: int) -> tuple[int, int]:
        """Probes the others in the order of their prior scaled to the probes, each only if its predicted probe time
        fits what is left of `budget` and, `PRIOR_OPTIMISM` faster than predicted, it would beat the best measured
        candidate by more than its probe costs. Returns how many were left unprobed for want of time, and how many
        because none could pay for its probe."""
        start = self.charged
        while True:
            probed = [c for c in self.candidates if c.probed]
            scale_priors(self.candidates)
            waiting = sorted((c for c in self.candidates if not c.probed), key=lambda c: c.seconds_per_epoch)
            if not waiting:
                return 0, 0
            candidate = waiting[0]
            fitting = [c for c in probed if c not in self.rejected]
            best = min((c.seconds_per_epoch for c in fitting), default=math.inf)
            cost = predicted_probe_seconds(candidate, probed)  # cached or not: a rerun decides as the first run did
            if fitting and self.charged - start + cost > budget:
                return len(waiting), 0
            if fitting and (best - PRIOR_OPTIMISM * candidate.seconds_per_epoch) * epochs <= cost:
                return 0, len(waiting)  # the rest are predicted slower still
            self.run(candidate)


def rank(candidates: list[Candidate], prober: Prober, *, epochs: int, probe_budget: float | None,
         probe_fraction: float, first_seconds: float = 0.0, charged_seconds: float = 0.0,
         baseline_words: str = "your flags",
         smaller: Callable[[Candidate, list[Candidate]], Candidate | None] = lambda candidate, others: None) -> Ranking:
    """The rank phase: probes candidates within the probe budget and ranks them by the measured speed.

    The baseline (the configuration without the planner) and the prior's favourite among the others are always
    probed; the others
    as `_Probing.run_within` decides. Under a measured meter (`prober.meter`) a candidate fits only when its probe's
    measured peak (with the margin) does: the others are dropped, and a candidate measured over the budget gets a
    stand-in (`_Probing.run`). Unprobed candidates rank after the probed ones; the baseline stays first unless
    another is predicted at least `KEEP_BASELINE_WITHIN` faster.

    `probe_budget`: seconds for the probes (None: `probe_fraction` of the run the baseline's probe predicts), less
    planning's time so far (`charged_seconds`: the estimates and the first probe, as charged, so that a rerun on the
    cache takes the same decisions); `first_seconds`: the first probe's wall seconds, counted in `probe_seconds`.
    """
    started = time.perf_counter()
    probing = _Probing(candidates, prober, smaller)
    baseline = next((c for c in probing.candidates if c.baseline), None)
    # The prior's favourite besides the baseline: where the prior ranks the baseline first, its runner-up, so that
    # a plan without time for more probes still measures one alternative to the configuration it would keep.
    favourite = next((c for c in probing.candidates if c is not baseline), None)
    for candidate in (baseline, favourite):
        if candidate is not None:
            probing.run(candidate)
    budget = probe_budget
    if budget is None:  # a share of the planned run (as the baseline's probe predicts it)
        reference = next((c for c in (baseline, *probing.candidates) if c is not None and timed(c)), None)
        budget = probe_fraction * reference.seconds_per_epoch * epochs if reference is not None else 0.0
    budget = max(0.0, budget - charged_seconds - probing.charged)  # planning's time: estimates and probes together
    skipped, hopeless = probing.run_within(budget, epochs)
    probe_seconds = first_seconds + time.perf_counter() - started
    notes = []
    if skipped:
        notes.append(f"{skipped} candidate(s) not probed: their probes would not fit the probe budget "
                     f"({budget:.0f} s); their speed is the prior scaled to the probes")
    if hopeless:
        notes.append(f"{hopeless} candidate(s) not probed: even {1 / PRIOR_OPTIMISM:.2f}x faster than "
                     "predicted, none would win by more than its probe costs")
    ranked = _measured_only(probing, notes) if prober.meter is not None else probing.candidates
    scale_priors(ranked)
    ranked.sort(key=lambda c: (not c.probed or c in probing.rejected, c.seconds_per_epoch))
    baseline = next((c for c in ranked if c.baseline and c.probed and c not in probing.rejected), None)
    if baseline is not None and ranked[0] is not baseline \
            and ranked[0].seconds_per_epoch > (1 - KEEP_BASELINE_WITHIN) * baseline.seconds_per_epoch:
        ranked.remove(baseline)
        ranked.insert(0, baseline)
        notes.append(f"kept the {baseline_words}: no candidate is predicted at least {KEEP_BASELINE_WITHIN:.0%} "
                     "faster")
    return Ranking(ranked, notes, probe_seconds, round(budget, 3))


def _measured_only(probing: _Probing, notes: list[str]) -> list[Candidate]:
    """Under a measured meter: the probed candidates whose probe fits (a note says how many were left out).

    Raises:
        PlanError: none fits.
    """
    budget, rejected = probing.prober.budget, probing.rejected
    unmeasured = [c for c in probing.candidates if not c.probed]
    kept = [c for c in probing.candidates if c.probed and c not in rejected]
    if rejected or unmeasured:
        notes.append(f"budget {budget.words}: {len(rejected)} probed candidate(s) measured over it and "
                     f"{len(unmeasured)} not measured were left out")
    if not kept:
        raise PlanError(f"no candidate fits {format_bytes(budget.bytes)} {budget.words}: the probes measured "
                        + ", ".join(("over " if c.probe.get("stopped") else "")
                                    + format_bytes(c.probe['measured_peak_bytes']) for c in rejected)
                        + "; raise the budget, or let the planner use --amp / --optim auto")
    return kept
