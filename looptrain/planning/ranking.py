"""How the candidates that fit are ranked: a prior (`prior_seconds`), then probes (`probe_candidates`): one real
update each, its time read as a micro-batch's fixed cost and seconds per FLOP (`micro_batch_costs`) over the
micro-batches of an epoch (`run_windows`), each probe stopped at the most that fits (`probe_ceiling`); the baseline
kept unless another is measured `KEEP_BASELINE_WITHIN` faster."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from looptrain.flops import ModelFlops
from looptrain.planning import probes
from looptrain.planning.errors import PlanError
from looptrain.planning.plans import Candidate, Plan, format_bytes
from looptrain.precision import cpu_has_native_bf16
from looptrain.strategy import Strategy

# The plan keeps the configuration the run would have trained without it unless another candidate's measured
# prediction is at least this much faster: a probe is one update, and its prediction is a sample, not a constant.
KEEP_BASELINE_WITHIN = 0.05

# Under a measured meter, what a whole run adds to one probe's peak, as a share of the memory that probe measured
# besides the tensors: later updates' other widths, the allocator's retained blocks, evaluation and checkpoint
# saving. Measured: +39 MiB over a 160 MiB share (24%, a 3.3M-parameter BERT, tests/test_plan.py), +15 MiB over
# 216 MiB (7%, the 36.6M-parameter BERT of scripts/bench_plan.py).
RUN_GROWTH = 0.25

# A candidate is probed only if, this much faster than the prior (scaled to the probes) predicts, it would win by
# more than its probe costs: the prior orders candidates within about this factor.
PRIOR_OPTIMISM = 0.75


def probe_ceiling(budget: int, margin: float, growth: int) -> int:
    """The most a probe may measure and fit (`fits_measured`), where `measure_probe` stops it: a probe that goes
    past has already taken the process past what fits, and left unchecked it went on past the budget itself (worst
    batch of 16 rows under glibc's own thresholds: 1.30 GiB measured against a budget of 1.17 GiB, docs/plan.md)."""
    return int(budget / (1 + margin)) - growth


def first_probe_ceiling(budget: int, margin: float, estimated_peak: int) -> int:
    """`probe_ceiling` of the first probe, whose growth is not known before it is measured: it is `RUN_GROWTH` of
    what the probe measures above its estimate (`run_growth`), so the most it may measure and fit (`fits_measured`)
    solves ``(peak + RUN_GROWTH * (peak - estimated_peak)) * (1 + margin) <= budget``; ``budget / (1 + margin)``
    where the estimate alone is past that."""
    within = budget / (1 + margin)
    if estimated_peak > within:
        return int(within)
    return int((within + RUN_GROWTH * estimated_peak) / (1 + RUN_GROWTH))


def run_growth(measured_peak: int, estimated_peak: int) -> int:
    """What a whole run may add to one probe's measured peak: `RUN_GROWTH` of what it measured besides the tensors."""
    return int(RUN_GROWTH * max(0, measured_peak - estimated_peak))


def fits_measured(peak: int, growth: int, margin: float, budget: int) -> bool:
    """A probe's measured peak fits: with the run's growth and the margin, within the budget."""
    return (peak + growth) * (1 + margin) <= budget


def probe_within(probe: dict, growth: int, margin: float, budget: int) -> bool:
    """A probe's verdict: its measured peak fits (`fits_measured`); one stopped at its ceiling never does (its
    recorded peak, one byte past the ceiling, could round within), one that measured nothing (the tensors meter)
    always does."""
    if probe.get("stopped"):
        return False
    peak = probe.get("measured_peak_bytes")
    return peak is None or fits_measured(peak, growth, margin, budget)


def prior_seconds(candidate: Candidate, model: Any, device_type: str) -> float:
    """A unitless prior time per epoch, to order probes: padded tokens, recompute, small-batch and precision cost."""
    settings = candidate.settings
    recompute = 0.0 if not settings.gradient_checkpointing else 0.35 / settings.checkpoint_every
    precision_cost = 1.0
    if settings.precision != "fp32":
        native = device_type == "cuda" or (settings.precision == "bf16" and cpu_has_native_bf16())
        precision_cost = 0.7 if native else 8.0
    parameters = (sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
                  if isinstance(model, nn.Module) else 1e8)  # the optimizer steps the trainable ones (LoRA: adapters)
    optimizer_cost = {"adamw": 1.0, "sgd": 0.3, "adafactor": 2.0}.get(settings.optimizer, 5.0) * parameters / 3e5
    if settings.weights == "bf16":
        optimizer_cost *= 2.0  # each tensor upcast, stepped alone, and rounded back with random bits
    per_token = (1 + recompute) * (1 + 0.5 / settings.batch_size) * precision_cost
    return candidate.padded_tokens * per_token + candidate.updates * optimizer_cost


def probe_candidates(result: Plan, model: nn.Module, dataset, collator, order: list[int], device: str, epochs: int,
                      max_grad_norm, probe_budget: float | None, probe_fraction: float, meter: probes.Meter | None,
                      echo, smaller: Callable[[Candidate], Candidate | None] = lambda candidate: None,
                      flops: ModelFlops | None = None) -> None:
    """Probes candidates within the probe budget and ranks them by the measured speed.

    The baseline (the configuration without the planner) and the prior's favourite are always probed. The
    others follow in the order of their prior scaled to the probes, each only if its predicted probe time fits
    what is left of the budget and, `PRIOR_OPTIMISM` faster than predicted, it would beat the best measured
    candidate by more than its probe costs (planning included: a probe that cannot pay for itself is not
    run). Under a measured meter (`meter`) a candidate fits only when its probe's measured peak (with the
    margin) does: the others are dropped, and probing goes on, budget or not, until one candidate fits.
    Unprobed candidates rank after the probed ones; the baseline stays first unless another is predicted at
    least `KEEP_BASELINE_WITHIN` faster. A candidate whose probe measures over the budget is replaced by a stand-in,
    probed at once, budget or not: the candidate the prior ranks first of those not probed yet, the next smaller
    split of its settings (`smaller`) among them.
    The budget counts each probe at its seconds as measured, a cached one at its recorded seconds
    (`Plan.charged_seconds`), so that a rerun on the cache takes the same decisions.
    """
    started, spent = time.perf_counter(), result.probe_seconds  # the first probe, made before the search
    budget, rejected, skipped, hopeless = probe_budget, [], 0, 0
    charged = 0.0  # the probes below as the budget counts them: each at its (measured or recorded) seconds

    def fits(candidate: Candidate) -> bool:
        return probe_within(candidate.probe, result.growth_bytes, result.margin, result.budget_bytes)

    batches: dict[int, dict] = {}  # by micro-batch size: the cache check and the probe collate it once

    def batch_of(candidate: Candidate) -> dict:
        size = candidate.settings.batch_size
        if size not in batches:
            batches[size] = collator([dataset[i] for i in order[:size]])
        return batches[size]

    def run(candidate: Candidate) -> None:
        nonlocal charged
        if not candidate.probed:
            ceiling = probe_ceiling(result.budget_bytes, result.margin, result.growth_bytes) \
                if meter is not None else None
            # Settings that run the same kernels share one line of costs: the first probe of them times a typical
            # micro-batch, the others reuse its line (`record_probe`) and are probed for their memory and steps.
            alike = next((other for other in result.candidates if has_line(other.probe)
                          and same_kernels(other.settings, candidate.settings)), None)
            typical = typical_batch(candidate, dataset, collator, order) if alike is None else None
            record_probe(candidate, probes.probe(model, candidate.settings, batch_of(candidate), device, max_grad_norm,
                                                  meter, ceiling, candidate.step_bytes, typical=typical), flops,
                         alike.probe if alike is not None else None)
            charged += candidate.probe["probe_seconds"]
        over = not fits(candidate)
        if over:
            rejected.append(candidate)
        settings, peak = candidate.settings, candidate.probe.get("measured_peak_bytes")
        if not candidate.probe.get("stopped"):
            speed = f"{result.num_samples / candidate.seconds_per_epoch:.1f} samples/s predicted"
        elif "before_step_bytes" in candidate.probe:
            speed = (f"stopped before its optimizer step (+{format_bytes(candidate.probe['before_step_bytes'])}) would "
                     f"pass {format_bytes(candidate.probe['ceiling'])}, the most that fits")
        else:
            speed = f"stopped past {format_bytes(candidate.probe['ceiling'])}, the most that fits"
        echo(f"  probe {settings.batch_size} x {settings.accum_steps}, {settings.precision}, {settings.optimizer}, "
             f"checkpointing {settings.checkpointing}{', fused step' if settings.optimizer_in_backward else ''}: "
             f"{speed} "
             + (f"(from the cache, measured in {candidate.probe['probe_seconds']:.1f} s"
                if candidate.probe.get("from_cache") else f"({candidate.probe['probe_seconds']:.1f} s")
             + (f"; measured peak {format_bytes(peak)}{', over the budget' if candidate in rejected else ''}"
                if peak is not None else "") + ")")
        if over:
            # A stand-in, probed at once, budget or not: the candidate the prior ranks first of those not probed yet,
            # the next smaller split of these settings among them (a larger micro-batch of a mode that recomputes
            # may rank ahead of one that does not, and measure over the budget: the runner-up is then more likely
            # the faster of what fits than the favourite's own smaller split).
            replacement = smaller(candidate)
            if replacement is not None:
                result.candidates.append(replacement)
            stand_in = min((other for other in result.candidates if not other.probed),
                           key=lambda other: other.prior, default=None)
            if stand_in is not None:
                run(stand_in)

    baseline = next((c for c in result.candidates if c.baseline), None)
    for candidate in [baseline] + [result.candidates[0]] * (result.candidates[0] is not baseline):
        if candidate is not None:
            run(candidate)
    if budget is None:  # a share of the planned run (as the baseline's probe predicts it)
        reference = next((c for c in (baseline, *result.candidates) if c is not None and timed(c)), None)
        budget = probe_fraction * reference.seconds_per_epoch * epochs if reference is not None else 0.0
    budget = max(0.0, budget - result.charged_seconds - charged)  # planning's time: estimates and probes together
    charged = 0.0
    result.probe_budget_seconds = round(budget, 3)
    while True:
        probed = [c for c in result.candidates if c.probed]
        scale_priors(result.candidates)
        waiting = sorted((c for c in result.candidates if not c.probed), key=lambda c: c.seconds_per_epoch)
        if not waiting:
            break
        candidate = waiting[0]
        fitting = [c for c in probed if c not in rejected]
        best = min((c.seconds_per_epoch for c in fitting), default=math.inf)
        cost = predicted_probe_seconds(candidate, probed)  # cached or not: a rerun decides as the first run did
        if fitting and charged + cost > budget:
            skipped += len(waiting)
            break
        if fitting and (best - PRIOR_OPTIMISM * candidate.seconds_per_epoch) * epochs <= cost:
            hopeless += len(waiting)  # the rest are predicted slower still
            break
        run(candidate)
    result.probe_seconds = spent + time.perf_counter() - started
    if skipped:
        result.notes.append(f"{skipped} candidate(s) not probed: their probes would not fit the probe budget "
                            f"({budget:.0f} s); their speed is the prior scaled to the probes")
    if hopeless:
        result.notes.append(f"{hopeless} candidate(s) not probed: even {1 / PRIOR_OPTIMISM:.2f}x faster than "
                            "predicted, none would win by more than its probe costs")
    if meter is not None:
        unmeasured = [c for c in result.candidates if not c.probed]
        result.candidates = [c for c in result.candidates if c.probed and c not in rejected]
        if rejected or unmeasured:
            result.notes.append(f"budget {result.meter}: {len(rejected)} probed candidate(s) measured over it and "
                                f"{len(unmeasured)} not measured were left out")
        if not result.candidates:
            raise PlanError(f"no candidate fits {format_bytes(result.budget_bytes)} {result.meter}: the probes "
                            "measured " + ", ".join(("over " if c.probe.get("stopped") else "")
                                                    + format_bytes(c.probe['measured_peak_bytes']) for c in rejected)
                            + "; raise the budget, or let the planner use --amp / --optim auto")
    scale_priors(result.candidates)
    result.candidates.sort(key=lambda c: (not c.probed or c in rejected, c.seconds_per_epoch))
    baseline = next((c for c in result.candidates if c.baseline and c.probed and c not in rejected), None)
    if baseline is not None and result.candidates[0] is not baseline \
            and result.candidates[0].seconds_per_epoch > (1 - KEEP_BASELINE_WITHIN) * baseline.seconds_per_epoch:
        result.candidates.remove(baseline)
        result.candidates.insert(0, baseline)
        result.notes.append(f"kept the {result.baseline_words}: no candidate is predicted at least "
                            f"{KEEP_BASELINE_WITHIN:.0%} faster")


def typical_batch(candidate: Candidate, dataset, collator, order: list[int]) -> dict | None:
    """A micro-batch of `candidate.typical_shape` for its probe to time: its rows of the longest samples (`order`),
    cut to its width in real tokens (`probes.warm_up_batch`); None without a shape, or where those rows are too short
    to cut (the probe then prices the run by its worst batch)."""
    if candidate.typical_shape is None:
        return None
    rows, width = candidate.typical_shape
    batch = probes.warm_up_batch(collator([dataset[index] for index in order[:rows]]), width)
    return batch if probes.batch_shape(batch) == [rows, width] else None


def has_line(probe: dict) -> bool:
    """Whether a probe timed the two micro-batches a line of costs goes through: the small one and a typical one."""
    return "small_step_seconds" in probe and "typical_step_seconds" in probe


def same_kernels(one: Strategy, other: Strategy) -> bool:
    """Whether two settings differ only in their split (micro-batch, accumulation, token cut): their micro-batches
    then run the same kernels, and one line of costs prices both (`micro_batch_costs`)."""
    def kernels(settings: Strategy) -> Strategy:
        return dataclasses.replace(settings, batch_size=1, accum_steps=1, micro_batch_tokens=0)
    return kernels(one) == kernels(other)


def record_probe(candidate: Candidate, probe: dict, flops: ModelFlops | None = None,
                 line_from: dict | None = None) -> None:
    """A probe's measurements on its candidate, and the epoch's time they predict: each micro-batch's fixed cost
    and its work at the probe's seconds per FLOP (`micro_batch_costs`: of `line_from`, a probe of settings with the
    same kernels that timed a typical micro-batch, when given), else (no small step timed, or no FLOPs counted) its
    padded tokens at the seconds per token of the probe's typical micro-batch (else of its worst batch); and each
    optimizer step, as this probe timed it.

    One line for settings that differ only in their split: on the benchmark of docs/plan.md the line fitted to one
    run's micro-batches priced the other cut's within 3% (both ways), where the lines through each probe's worst
    batch had overpriced them by 25% and 39%."""
    candidate.probe, candidate.probed = probe, True
    if probe.get("stopped"):  # over its ceiling, so over the budget: no time measured, the prior's stands
        return
    costs = micro_batch_costs(line_from if line_from is not None else probe, flops) if candidate.flops else None
    if costs is not None:
        work = costs[0] * candidate.micro_batches + costs[1] * candidate.flops
    elif "typical_step_seconds" in probe:  # one micro-batch an update: the typical one's seconds per FLOP (or token)
        typical = probe["typical_batch_shape"]
        work = probe["typical_step_seconds"] * (candidate.flops / flops.per_batch(*typical) if candidate.flops and flops
                                                else candidate.padded_tokens / math.prod(typical))
    else:
        work = probe["micro_step_seconds"] / probe["tokens"] * candidate.padded_tokens
    candidate.seconds_per_epoch = (work + probe["optimizer_step_seconds"] * candidate.updates
                                   + probe.get("compile_seconds", 0.0))  # torch.compile: paid once, counted once


def micro_batch_costs(probe: dict, flops: ModelFlops | None) -> tuple[float, float] | None:
    """A probe's seconds per micro-batch whatever its size, and per model FLOP of its work: the line through two of
    its timed micro-batches, the warm-up's second run and the typical one (else the worst batch), their work in model
    FLOPs (`ModelFlops.per_batch`: padded tokens, attention growing with the width). None without a small step timed
    or FLOPs counted.

    A micro-batch's fixed cost (reading every weight matrix three times, accumulating every gradient, Python and
    dispatch: the same for 1 row or 8) is why cutting a batch into more micro-batches costs more than its tokens
    say. The typical micro-batch rather than the worst: the worst batch's longest rows cost more per FLOP than the
    run's other micro-batches (11.5 against 6.5-7 s per TFLOP on the benchmark's BERT), and the line through it
    overpriced every micro-batch's work by half, the more so the larger the cut (docs/plan.md).
    """
    small, shape = probe.get("small_step_seconds"), probe.get("small_batch_shape")
    if small is None or shape is None or flops is None:
        return None
    large, large_shape = (probe["typical_step_seconds"], probe["typical_batch_shape"]) \
        if "typical_step_seconds" in probe else (probe["micro_step_seconds"], probe["batch_shape"])
    small_work, large_work = flops.per_batch(*shape), flops.per_batch(*large_shape)
    if large_work <= small_work or large <= small:
        return None
    per_flop = (large - small) / (large_work - small_work)
    fixed = small - per_flop * small_work
    if fixed < 0:  # noise: all of it work
        return 0.0, large / large_work
    return fixed, per_flop


def scale_priors(candidates: list[Candidate]) -> None:
    """Unprobed candidates' predicted time: their prior times the median ratio of the probed ones alike
    (same precision and optimizer), or of every probed one."""
    probed = [c for c in candidates if timed(c)]
    if not probed:
        return
    for candidate in (c for c in candidates if not timed(c)):
        alike = [c for c in probed if (c.settings.precision, c.settings.optimizer)
                 == (candidate.settings.precision, candidate.settings.optimizer)] or probed
        ratios = sorted(c.seconds_per_epoch / c.prior for c in alike)
        candidate.seconds_per_epoch = candidate.prior * ratios[len(ratios) // 2]


def timed(candidate: Candidate) -> bool:
    """Whether a candidate's speed was measured: probed, and not stopped at its ceiling."""
    return candidate.probed and not candidate.probe.get("stopped")


def predicted_probe_seconds(candidate: Candidate, probed: list[Candidate]) -> float:
    """A probe's time, scaled from the nearest probed candidate by micro-batch rows and recompute."""
    probed = [c for c in probed if timed(c)]
    if not probed:
        return 0.0

    def recompute(settings: Strategy) -> float:
        return 1 + (0.35 / settings.checkpoint_every if settings.gradient_checkpointing else 0.0)
    reference = min(probed, key=lambda c: abs(c.settings.batch_size - candidate.settings.batch_size))
    scale = candidate.settings.batch_size / reference.settings.batch_size * recompute(candidate.settings) \
        / recompute(reference.settings)
    return reference.probe["probe_seconds"] * scale
