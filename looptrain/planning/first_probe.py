"""The plan's first-probe phase: before the search, the configuration every plan probes first (your flags, else the
safe default) is costed and probed (`first_probe`).

Its probe predicts the run's time, which bounds planning's (`probe_fraction`, or `probe_budget`), and under a measured
meter it measures what the process holds besides tensors, which the search then charges to every candidate
(`Budget.with_process`). Under a budget of RSS with `make_lean`, a first probe over the budget makes the C allocator
one step leaner and is measured again (`_measure_first`; docs/plan.md, 'Which meter the budget counts').
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import looptrain.planning.probes as probes
from looptrain.memory import allocator
from looptrain.planning.budget import Budget
from looptrain.planning.candidates import costed
from looptrain.planning.plans import MIN_PLANNING_SECONDS, Candidate, estimate_seconds, format_bytes
from looptrain.planning.request import Request
from looptrain.planning.search import Search, lightest_split, mode_frontier, valid_settings
from looptrain.planning.timing import record_probe, typical_batch
from looptrain.planning.truncation import Truncation
from looptrain.strategy import Strategy


@dataclass(frozen=True)
class FirstProbe:
    """The first-probe phase's answer.

    Attributes:
        reference: the first probe's candidate, costed and probed (None: nothing probed, or nothing fits to probe).
        budget: the request's budget, with what the first probe measured besides tensors and the run's growth under
            a measured meter.
        malloc: what `make_lean` did to the C allocator (None: nothing).
        seconds: the first probe(s)' wall seconds.
        charged: the first probe(s)' seconds as planning's time counts them (a cached probe at its recorded seconds).
    """

    reference: Candidate | None
    budget: Budget
    malloc: str | None = None
    seconds: float = 0.0
    charged: float = 0.0


def first_probe(request: Request, search: Search) -> FirstProbe:
    """The first-probe phase: the baseline (else the lightest split) that fits, costed and probed, and planning's
    time for the estimates set from what it predicts (`EstimateBook.limit_time`). Nothing is probed where the plan
    does not probe."""
    if not request.probes:
        return FirstProbe(None, request.budget)
    baseline = request.baseline
    firsts = [s for s in (baseline, lightest_split(request.base, request.effective_batch))
              if s is not None and valid_settings(s)]
    search.prefetch(firsts)  # side by side: the lightest is needed when the baseline does not fit
    first = next((s for s in firsts if search.fits(s)), None)
    if first is None:
        return FirstProbe(None, request.budget)
    reference = costed(search, first, request, as_given=first == baseline)
    started = time.perf_counter()
    probed, malloc, charged = _measure_first(request, search, first, typical_batch(
        reference, request.dataset, request.collator, request.order), reference.truncation)
    seconds = time.perf_counter() - started
    record_probe(reference, probed, request.flops)
    total = request.probe_budget if request.probe_budget is not None else 0.0 if probed.get("stopped") else \
        request.probe_fraction * reference.seconds_per_epoch * request.epochs  # stopped: no time measured, the floor
    # Both probes count when the first was measured again with the allocator fixed: planning's time is all of it,
    # and the favourite's probe after the search is reserved at the second's (the allocator as it will be).
    search.book.limit_time(max(search.book.charged, estimate_seconds(
        total, probed["probe_seconds"], MIN_PLANNING_SECONDS if request.probe_budget is None else 0.0,
        spent=charged)))
    if first != baseline:
        # Your flags do not fit: which checkpointing modes do, at their lightest split? Asked first, side by side,
        # within planning's time (docs/plan.md, 'Which checkpointing modes fit is asked first').
        search.estimate_round(mode_frontier(request.base, request.effective_batch, set(request.fixed)), rounds=None)
    budget = request.budget
    if request.meter is not None:
        measured_peak = reference.probe["measured_peak_bytes"]
        budget = budget.with_process(measured_peak, reference.estimated_peak_bytes)
        request.echo(f"  the process holds {format_bytes(budget.besides)} besides the estimated tensors (measured: "
                     f"{format_bytes(measured_peak)} at {first.batch_size} x {first.accum_steps}); "
                     f"{format_bytes(budget.growth)} more is kept for the run's growth")
    return FirstProbe(reference, budget, malloc, seconds, charged)


def _measure_first(request: Request, search: Search, first: Strategy, typical: dict | None,
                   truncation: Truncation | None = None) -> tuple:
    """The first probe, stopped at the most it may measure and still fit, its growth included
    (`Budget.first_probe_ceiling`), and before an optimizer step that would take it past; under a budget of RSS
    with `make_lean`, measured again one allocator step leaner while it does not fit. Returns the probe, what
    `make_lean` did (None: nothing) and the probes' seconds as charged."""
    batch = request.collator([request.dataset[i] for i in request.order[:first.batch_size]])
    estimated = search.peak(first)
    ceiling = request.budget.first_probe_ceiling(estimated) if request.meter is not None else None
    step_bytes = search.book.step_bytes(first)  # the step itself cannot be stopped: it is checked before

    def measure(settings: Strategy, again: bool = False) -> dict:
        run = probes.measure_probe if again else probes.probe
        return run(request.model, settings, batch, request.device, request.max_grad_norm, request.meter, ceiling,
                   step_bytes, typical=typical, **({"truncation": truncation} if truncation is not None else {}))

    probed = measure(first)
    leans = request.budget.meter == "rss" and request.make_lean is not None
    if leans and probed.get("from_cache") and not request.budget.first_probe_fits(probed, estimated):
        # Measured again, though cached: besides its verdict, this probe under glibc's own thresholds leaves freed
        # chunks in the heap, which the run reuses once the thresholds are fixed (docs/plan.md, 'Which meter the
        # budget counts').
        probed = measure(probes.as_run(first, request.meter), again=True)
    charged, malloc = probed["probe_seconds"], None  # as measured, or as recorded when read from the cache
    # One step leaner at a time (`allocator.LEAN_STEPS`: a middle threshold first, which trains nearly as fast as
    # glibc's own), until the first probe fits or the allocator has nothing leaner.
    for _ in allocator.LEAN_STEPS if leans else ():
        if request.budget.first_probe_fits(probed, estimated):
            break
        said = request.make_lean()
        if said is None:
            break
        request.echo(f"  {first.batch_size} x {first.accum_steps} measured "
                     f"{format_bytes(probed['measured_peak_bytes'])}, over the budget with the run's growth, "
                     f"under the C allocator's {'own thresholds' if malloc is None else 'thresholds so far'}: "
                     f"{said}; measuring it again")
        malloc = said
        probed = measure(first)
        charged += probed["probe_seconds"]
    return probed, malloc, charged
