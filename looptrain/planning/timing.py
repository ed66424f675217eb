"""The time model: what a candidate's epoch costs, from a prior (`prior_seconds`) or from its probe (`record_probe`):
a micro-batch's fixed cost and its seconds per FLOP (`micro_batch_costs`) over the micro-batches of an epoch, and
each optimizer step; unprobed candidates' prior scaled to the probes (`scale_priors`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch import nn

import looptrain.planning.probes as probes
from looptrain.flops import ModelFlops
from looptrain.planning.plans import Candidate
from looptrain.precision import cpu_bf16_is_fast
from looptrain.strategy import Strategy


def prior_seconds(candidate: Candidate, model: Any, device_type: str) -> float:
    """A unitless prior time per epoch, to order probes: padded tokens, recompute, small-batch and precision cost."""
    settings = candidate.settings
    recompute = 0.0 if not settings.gradient_checkpointing else 0.35 / settings.checkpoint_every
    precision_cost = 1.0
    if settings.precision != "fp32":
        native = device_type == "cuda" or (settings.precision == "bf16" and cpu_bf16_is_fast())
        precision_cost = 0.7 if native else 8.0
    parameters = (sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
                  if isinstance(model, nn.Module) else 1e8)  # the optimizer steps the trainable ones (LoRA: adapters)
    optimizer_cost = {"adamw": 1.0, "sgd": 0.3, "adafactor": 2.0}.get(settings.optimizer, 5.0) * parameters / 3e5
    if settings.weights == "bf16":
        optimizer_cost *= 2.0  # each tensor upcast, stepped alone, and rounded back with random bits
    per_token = (1 + recompute) * (1 + 0.5 / settings.batch_size) * precision_cost
    return candidate.padded_tokens * per_token + candidate.updates * optimizer_cost


def typical_batch(candidate: Candidate, dataset, collator, order) -> dict | None:
    """A micro-batch of `candidate.typical_shape` for its probe to time: its rows of the longest samples (`order`),
    cut to its width in real tokens (`probes.warm_up_batch`); where those rows are too short to cut, the longest
    sample as every row, cut alike (the same shape and work, all of it real tokens: a probe cut to what it decides
    then never falls back to its worst batch). None without a shape, or where even the longest sample is too short
    (the probe then prices the run by its worst batch)."""
    if candidate.typical_shape is None:
        return None
    rows, width = candidate.typical_shape
    for indices in (order[:rows], [order[0]] * rows):
        batch = probes.warm_up_batch(collator([dataset[index] for index in indices]), width)
        if probes.batch_shape(batch) == [rows, width]:
            return batch
    return None


def has_line(probe: dict) -> bool:
    """Whether a probe timed the two micro-batches a line of costs goes through: the small one and a typical one."""
    return "small_step_seconds" in probe and "typical_step_seconds" in probe


def same_kernels(one: Strategy, other: Strategy) -> bool:
    """Whether two settings differ only in their split (micro-batch, accumulation, token cut): their micro-batches
    then run the same kernels, and one line of costs prices both (`micro_batch_costs`)."""
    def kernels(settings: Strategy) -> Strategy:
        return dataclasses.replace(settings, batch_size=1, accum_steps=1, micro_batch_tokens=0)
    return kernels(one) == kernels(other)


def steps_alike(one: Strategy, other: Strategy) -> bool:
    """Whether a line of costs drawn by a probe of `other` prices `one`: the same kernels (`same_kernels`), or `one`
    steps each parameter inside backward where `other` steps after it: its micro-batches run the same forward and
    backward, and its update the same per-parameter optimizer work, which `other`'s probe times as its optimizer
    step (`line_priced`)."""
    return same_kernels(one, other) or (one.optimizer_in_backward and not other.optimizer_in_backward
                                        and same_kernels(dataclasses.replace(one, optimizer_in_backward=False), other))


def record_probe(candidate: Candidate, probe: dict, flops: ModelFlops | None = None,
                 line_from: dict | None = None) -> None:
    """A probe's measurements on its candidate, and the epoch's time they predict (`epoch_seconds`)."""
    candidate.record(probe, None if probe.get("stopped") else epoch_seconds(candidate, probe, flops, line_from))


def epoch_seconds(candidate: Candidate, probe: dict, flops: ModelFlops | None = None,
                  line_from: dict | None = None) -> float:
    """The epoch's time a probe predicts: each micro-batch's fixed cost and its work at the probe's seconds per FLOP
    (`micro_batch_costs`: of `line_from`, a probe of settings with the same kernels that timed a typical micro-batch,
    when given), else (no small step timed, or no FLOPs counted) its padded tokens at the seconds per token of the
    probe's typical micro-batch (else of its worst batch); and each optimizer step, as this probe timed it.

    One line serves settings that differ only in their split: a line fitted to one cut's micro-batches prices
    another cut's closely, where the lines through each probe's worst batch overprice them (docs/plan.md, 'How
    "fastest" is decided')."""
    costs = micro_batch_costs(line_from if line_from is not None else probe, flops) if candidate.flops else None
    if costs is not None:
        work = costs[0] * candidate.micro_batches + costs[1] * candidate.flops
    elif "typical_step_seconds" in probe:  # one micro-batch an update: the typical one's seconds per FLOP (or token)
        typical = probe["typical_batch_shape"]
        work = probe["typical_step_seconds"] * (candidate.flops / flops.per_batch(*typical) if candidate.flops and flops
                                                else candidate.padded_tokens / math.prod(typical))
    else:
        work = probe["micro_step_seconds"] / probe["tokens"] * candidate.padded_tokens
    return (work + probe["optimizer_step_seconds"] * candidate.updates
            + probe.get("compile_seconds", 0.0))  # torch.compile: paid once, counted once


def micro_batch_costs(probe: dict, flops: ModelFlops | None) -> tuple[float, float] | None:
    """A probe's seconds per micro-batch whatever its size, and per model FLOP of its work: the line through two of
    its timed micro-batches, the warm-up's second run and the typical one (else the worst batch), their work in model
    FLOPs (`ModelFlops.per_batch`: padded tokens, attention growing with the width). None without a small step timed
    or FLOPs counted.

    A micro-batch's fixed cost (reading every weight matrix three times, accumulating every gradient, Python and
    dispatch: the same for 1 row or 8) is why cutting a batch into more micro-batches costs more than its tokens
    say. The typical micro-batch rather than the worst: the worst batch's longest rows cost more per FLOP than the
    run's other micro-batches, and a line through them overprices every micro-batch's work, the more so the larger
    the cut (docs/plan.md, 'How "fastest" is decided').
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


def line_priced(alike: Candidate, flops: ModelFlops | None) -> dict | None:
    """What a probe of a candidate with `alike`'s kernels would tell, without one: `alike`'s line of micro-batch costs
    and its optimizer step (the same settings but the split step the same parameters alike), nothing measured; for
    `record_probe(candidate, ..., line_from=alike.probe)`. None where `alike`'s probe drew no line (`has_line`, or no
    FLOPs counted): then only a probe prices it."""
    if not has_line(alike.probe) or micro_batch_costs(alike.probe, flops) is None:
        return None
    return {"optimizer_step_seconds": alike.probe["optimizer_step_seconds"], "probe_seconds": 0.0,
            "memory": "decided by the estimate", "line_only": True}


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
        candidate.predict(candidate.prior * ratios[len(ratios) // 2])


def timed(candidate: Candidate) -> bool:
    """Whether a candidate's speed was measured: probed, and not stopped at its ceiling."""
    return candidate.probed and not candidate.probe.get("stopped")


def predicted_probe_seconds(candidate: Candidate, probed: list[Candidate]) -> float:
    """A probe's time, scaled from the nearest candidate probed whole by micro-batch rows and recompute (a probe cut
    to what it decides, `Prober.probe`, tells nothing of a whole probe's cost)."""
    probed = [c for c in probed if timed(c) and not c.probe.get("memory")]
    if not probed:
        return 0.0

    def recompute(settings: Strategy) -> float:
        return 1 + (0.35 / settings.checkpoint_every if settings.gradient_checkpointing else 0.0)
    reference = min(probed, key=lambda c: abs(c.settings.batch_size - candidate.settings.batch_size))
    scale = candidate.settings.batch_size / reference.settings.batch_size * recompute(candidate.settings) \
        / recompute(reference.settings)
    return reference.probe["probe_seconds"] * scale
