"""The planner: a memory budget in, the fastest exact training configuration that fits out.

`plan(model, dataset, collator, memory_budget=..., effective_batch=...)` sits above the Loop, beside
the estimator, and drives both:

1. **Candidates** are `looptrain.Strategy` instances: the user's strategy with the searched fields
   replaced (any other lever, a `Strategy` subclass's own included, is kept). The effective batch never
   changes: micro-batch × accumulation (× ranks) is always what was asked for. Levers that keep the
   math are always free: the split, gradient checkpointing (none, every other block, all), the
   optimizer step fused into backward (when accumulation is 1), dynamic padding. Levers that change
   the numerics are used only when allowed (`Levers`): precision
   (bf16/fp16 where the hardware has it, fp32 always tried beside it; where it is bf16, bf16 weights with
   stochastic rounding too), the optimizer within its family
   (adamw → adamw8bit → paged_adamw8bit). Levers that change the task (freezing, a shorter max length)
   are never applied; when nothing fits they are suggested, with their estimates. LoRA (`lora_rank`,
   `qlora`, ...) is the task's choice too: with it, the planner plans the rest and never changes it (the
   model must be the wrapped `PeftModel` the run trains, `Strategy.wrap_model`), and says how much it
   saves over the full fine-tune with the same settings (one more estimate); without it, LoRA and QLoRA
   r 16 are among the suggestions when nothing fits.
2. **Fits**: `looptrain.planning.estimate` at the dataset's longest padded batch (its worst batch), plus a
   safety margin (`DEFAULT_MARGIN`), must be within the budget, by the meter the budget counts (`METERS`):
   live tensors (the estimate alone), or the process's RSS above its start / CUDA's reserved memory (what the
   process holds besides tensors is measured once by a probe and charged to every candidate, and each probed
   candidate must fit by its own measured peak). For each precision, optimizer and checkpointing mode, the
   largest micro-batch that fits is found by a search over the divisors of the effective batch (memory only
   grows with the micro-batch). The estimates run in a forked child (`EstimateWorker`), so the training
   process never holds what estimating costs; they are cached on disk.
3. **Fastest, never losing**: the configuration the run would train without the planner (the user's split, else
   the safe default: micro-batch 1, every block checkpointed) is always a candidate and probed first; the prior's
   favourite next, then others while their probes fit the probe budget (5% of the run by default, less the
   estimates' time) and could pay for themselves. A probe is one update of the real Loop (`Loop.run_update`)
   on a real batch of the worst shape, learning rate 0, its second micro-batch timed. The measured time per
   padded token and per optimizer step, times the padded tokens and the updates of an epoch under that
   candidate's batching, predict the epoch's time; candidates left unprobed keep a prior, FLOP-style prediction
   and rank after the probed ones. The baseline is replaced only by a candidate predicted at least
   `KEEP_BASELINE_WITHIN` faster.

Everything measured and decided is in the returned `Plan` (`table()`, `to_dict()`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from looptrain.batches import token_pieces
from looptrain.config import ConfigError, LoopConfig
from looptrain.flops import ModelFlops, count_model_flops
from looptrain.lora import is_4bit_layer, is_lora_model
from looptrain.optim.factory import import_optimizer
from looptrain.planning import estimate_cache, probes
from looptrain.planning.errors import PlanError
from looptrain.planning.estimator import bounding_windows, estimate, estimate_windows
from looptrain.planning.worker import EstimateWorker
from looptrain.precision import amp_precision, cpu_has_native_bf16, resolve_device
from looptrain.strategy import Strategy

GIB = 1024**3
# The share of the budget kept free above the estimate. CPU: the estimate is within 2.3% of the tensor
# tracker on every mix of planning.ACCURACY_MIXES; 5% leaves room for that and for batches the estimate
# shapes differently. CUDA: the caching allocator rounds and fragments, and kernels take workspaces the
# estimate does not see (about 10-20% of the peak on typical runs); 15% covers that, unchecked here.
DEFAULT_MARGIN = {"cpu": 0.05, "cuda": 0.15}
OPTIMIZER_FAMILIES = {"adamw": ("adamw", "adamw8bit", "paged_adamw8bit")}
CHECKPOINT_MODES = ((False, 1), (True, 2), (True, 1))  # none, every other block, every block
# LoRA: the rank suggested when nothing fits, and the share of the full fine-tune's peak below which a LoRA
# plan's saving is called small (activations dominate: a small model, or long sequences).
LORA_SUGGESTED_RANK = 16
LORA_SMALL_SAVING = 0.2
LORA_LEVERS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "qlora")
# What a budget counts, by `plan(meter=...)`, and how the plan names it.
METERS = {"tensors": "of live tensors", "rss": "of process RSS above the start",
          "cuda_reserved": "of CUDA reserved memory"}
# The plan keeps the configuration the run would have trained without it unless another candidate's measured
# prediction is at least this much faster: a probe is one update, and its prediction is a sample, not a constant.
KEEP_BASELINE_WITHIN = 0.05
# Planning's time is 5% of the run (`probe_fraction`), but at least this many seconds, probes included: the search
# of a small run would otherwise stop at its first estimates ("at most ~10 s for a small run").
MIN_PLANNING_SECONDS = 10.0
# Under a measured meter, what a whole run adds to one probe's peak, as a share of the memory that probe measured
# besides the tensors: later updates' other widths, the allocator's retained blocks, evaluation and checkpoint
# saving. Measured: +39 MiB over a 160 MiB share (24%, a 3.3M-parameter BERT, tests/test_plan.py), +15 MiB over
# 216 MiB (7%, the 36.6M-parameter BERT of scripts/bench_plan.py).
RUN_GROWTH = 0.25
FULL_FINE_TUNE = "full fine-tune"  # `_Search.peak(model=...)`: the search's LoRA model without its adapters
# A candidate is probed only if, this much faster than the prior (scaled to the probes) predicts, it would win by
# more than its probe costs: the prior orders candidates within about this factor.
PRIOR_OPTIMISM = 0.75
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


class SearchTimeSpent(Exception):
    """The plan's time for estimates is spent: a split not estimated yet counts as not fitting."""


def parse_size(text: str) -> int:
    """"4GiB", "3.5 GB", "512MiB", "1073741824B" -> bytes (B, KB, MB, GB, TB decimal; KiB ... TiB binary).

    A number without a unit is refused: "4" meant as 4 GiB would plan for 4 bytes.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if match and not match.group(2):
        raise PlanError(f"the memory size {text!r} has no unit: write {match.group(1)}GiB, {match.group(1)}MiB or, "
                        f"for bytes, {match.group(1)}B")
    unit = (match.group(2) if match else "").lower()
    if not match or unit not in _UNITS:
        raise PlanError(f"cannot read the memory size {text!r}: write a number and a unit, e.g. 4GiB, 3.5GB or 512MiB "
                        "(units B, KiB, MiB, GiB, KB, MB, GB)")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise PlanError(f"memory size {text!r} is not positive")
    return int(value)


def format_bytes(value: float) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB / 4 else f"{value / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Levers:
    """The numerics levers the user allows (the math-preserving ones are always free).

    Attributes:
        precision: try the precision `--amp` would pick beside fp32 (`--amp` / `--precision auto`),
            and where that is bf16, bf16 weights with stochastic rounding too (`--weights bf16`).
        optimizer_family: try the 8-bit members of the optimizer's family (`--optim auto`).
    """

    precision: bool = False
    optimizer_family: bool = False


Settings = Strategy  # the planner's name for a candidate's strategy (candidates are `looptrain.Strategy` instances)


@dataclass
class Candidate:
    """One strategy, its estimate at the worst batch and its speed (measured, or a prior)."""

    settings: Strategy
    estimated_peak_bytes: int
    padded_tokens: int = 0  # an epoch's padded tokens under these settings' batching
    micro_batches: int = 0  # an epoch's micro-batches under these settings' batching
    flops: float = 0.0  # an epoch's model FLOPs over its padded micro-batches (`looptrain.flops`; 0: not counted)
    updates: int = 0  # optimizer updates per epoch
    seconds_per_epoch: float | None = None  # predicted: from the probe, or the prior scaled to the probes' seconds
    prior: float = 0.0  # the unitless prior that orders the probes
    probed: bool = False
    probe: dict = field(default_factory=dict)  # seconds per padded token, per optimizer step, probe seconds
    baseline: bool = False  # the configuration the run would train without the planner
    # What the run trains, when not `settings` themselves: the split cut by tokens (`by_tokens`); `plan` gives it
    # to `settings` once the probes, which measure the split, are done. Its padded tokens are `padded_tokens`.
    trained: Strategy | None = None
    predicted: bool = False  # `estimated_peak_bytes` predicted from two estimates of its settings (`_Search.predict`)


@dataclass
class Plan:
    """The planner's result: candidates that fit, fastest first, and how they were chosen."""

    budget_bytes: int
    margin: float
    effective_batch: int
    worst_width: int
    device: str
    candidates: list[Candidate]
    estimates: int  # estimator runs made
    estimate_seconds: float
    probe_seconds: float
    probe_budget_seconds: float | None
    num_samples: int
    meter: str = "of live tensors"  # METERS' words: under a measured meter the probes' measured peaks must fit too
    notes: list[str] = field(default_factory=list)
    cached_estimates: int = 0  # of `estimates`, those read from the on-disk cache
    extrapolated: list = field(default_factory=list)  # fused candidates ruled out without an estimate
    growth_bytes: int = 0  # under a measured meter: kept free above each probe's peak for the run's growth
    malloc: str | None = None  # what `plan(make_lean=...)` did to the C allocator before the search; None: nothing
    # Planning's time as its budget counts it: each estimate and probe at what it cost when computed, a cached one at
    # its recorded cost, so that a rerun reading them from the cache takes the same decisions in less time.
    charged_seconds: float = 0.0
    baseline_words: str = "your flags"  # the baseline candidate: the user's flags, or "safe default" (the lightest)
    # A LoRA plan: the winner against the full fine-tune with its settings (`lora_comparison`); None otherwise.
    lora: dict | None = None
    predictions: int = 0  # splits the search decided by a prediction from two estimates (`_Search.predict`)

    @property
    def winner(self) -> Candidate:
        return self.candidates[0]

    @property
    def planning_seconds(self) -> float:
        """Planning's whole cost: the estimates and the probes."""
        return self.estimate_seconds + self.probe_seconds

    def table(self, top: int = 5) -> str:
        """The ranked candidates (the top `top`), the winner first, with estimates and speeds."""
        lines = [f"plan for a budget of {format_bytes(self.budget_bytes)} {self.meter} "
                 f"(fits: estimate x {1 + self.margin:.2f} within it; "
                 f"worst batch {self.worst_width} tokens wide), effective batch {self.effective_batch}, {self.device}"
                 + (f", {_lora_words(self.winner.settings)} (kept)" if self.winner.settings.lora_rank else "") + ":",
                 "| rank | micro-batch x accum | precision | optimizer | checkpointing | fused step | grouping | "
                 "est. peak | samples/s | speed from |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for rank, candidate in enumerate(self.candidates[:top], 1):
            settings = candidate.settings
            measured = any(c.probed for c in self.candidates)  # without probes the prior has no unit
            speed = f"{self.num_samples / candidate.seconds_per_epoch:.1f}" if measured else "-"
            source = ("probe (cached)" if candidate.probe.get("from_cache") else "probe") if candidate.probed \
                else "prior, scaled to the probes" if measured else "prior only"
            marks = ", ".join(mark for mark, on in (("winner", rank == 1), (self.baseline_words, candidate.baseline))
                              if on)
            lines.append(
                f"| {rank}{f' ({marks})' if marks else ''} | {split_words(settings)} | "
                f"{settings.precision}{' + bf16 weights' if settings.weights == 'bf16' else ''} | "
                f"{settings.optimizer} | {settings.checkpointing} | "
                f"{'yes' if settings.optimizer_in_backward else 'no'} | "
                f"{'yes' if settings.group_by_length else 'no'} | "
                f"{format_bytes(candidate.estimated_peak_bytes)}{' (predicted)' if candidate.predicted else ''} | "
                f"{speed} | "
                f"{source} |")
        lines.append(f"{len(self.candidates)} candidates fit; planning {self.planning_seconds:.1f} s: "
                     f"{self.estimates} estimates in {self.estimate_seconds:.1f} s"
                     + (f" ({self.cached_estimates} of them read from the cache)" if self.cached_estimates else "")
                     + (f", {self.predictions} splits predicted from them" if self.predictions else "")
                     + f", probes {self.probe_seconds:.1f} s"
                     + (f" (budget {self.probe_budget_seconds:.0f} s)"
                        if self.probe_budget_seconds is not None else ""))
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: the winner's settings and estimate, the budget, and every candidate."""
        return {
            "budget_bytes": self.budget_bytes, "margin": self.margin, "effective_batch": self.effective_batch,
            "worst_width": self.worst_width, "device": self.device, "meter": self.meter,
            "settings": dataclasses.asdict(self.winner.settings),
            "estimated_peak_bytes": self.winner.estimated_peak_bytes,
            "estimates": self.estimates, "cached_estimates": self.cached_estimates, "predictions": self.predictions,
            "growth_bytes": self.growth_bytes, "malloc": self.malloc,
            "planning_seconds": round(self.planning_seconds, 3),
            "estimate_seconds": round(self.estimate_seconds, 3),
            "probe_seconds": round(self.probe_seconds, 3), "probe_budget_seconds": self.probe_budget_seconds,
            "candidates": [{"settings": dataclasses.asdict(candidate.settings),
                            "estimated_peak_bytes": candidate.estimated_peak_bytes,
                            "estimate_predicted": candidate.predicted,
                            "seconds_per_epoch": candidate.seconds_per_epoch, "probed": candidate.probed,
                            "baseline": candidate.baseline, "probe": candidate.probe}
                           for candidate in self.candidates],
            "notes": self.notes,
            "lora": self.lora,
        }


def split_words(settings: Strategy) -> str:
    """The micro-batch split in words: ``4 x 8``, or ``32 x 1 in <= 1024-token micro-batches``."""
    words = f"{settings.batch_size} x {settings.accum_steps}"
    return words + (f" in <= {settings.micro_batch_tokens}-token micro-batches" if settings.micro_batch_tokens else "")


def divisors(number: int) -> list[int]:
    return [value for value in range(1, number + 1) if number % value == 0]


def plan(
    model: nn.Module,
    dataset: Any,
    collator: Any,
    *,
    memory_budget: int,
    effective_batch: int,
    base: Strategy | None = None,
    baseline: Strategy | None = None,
    levers: Levers = Levers(),
    fixed: Sequence[str] = (),
    device: str = "cpu",
    epochs: int = 1,
    max_grad_norm: float | None = 1.0,
    margin: float | None = None,
    probe: bool = True,
    probe_budget: float | None = None,
    probe_fraction: float = 0.05,
    seed: int = 42,
    rss_baseline: int | None = None,
    meter: str | None = None,
    make_lean: Callable[[], str | None] | None = None,
    token_micro_batches: bool = True,
    echo: Callable[[str], None] = lambda line: None,
) -> Plan:
    """Plans the fastest training that fits `memory_budget`, keeping `effective_batch` exact.

    Args:
        model: the model to train; `base`'s model levers (freezing) are applied to it in place, as the
            run applies them. Probes run it in place with the learning rate at 0, and leave its weights as
            they were. With `base.lora_rank`, the wrapped `PeftModel` (`base.wrap_model(model)`), as the
            run trains it.
        dataset: the tokenized training set (`looptrain.data.TokenizedDataset`: `lengths` and items). For a
            causal LM, items with token labels: the estimate prices its `[rows, width]` labels (see `estimate`),
            the worst batch padded when the dataset has shorter samples.
        collator: the collator the run will use: `batch_width` and `max_length` (which caps widths); probes
            call it (for a causal LM it pads the labels too, with -100).
        memory_budget: bytes the run's peak may take, by `meter`.
        effective_batch: samples per optimizer update; every candidate keeps it exact.
        base: the user's `Strategy` (their precision, optimizer, freezing, padding, grouping, ...); every
            candidate is a `dataclasses.replace` of it, so levers the planner does not search (freezing, or
            a field of a `Strategy` subclass) are kept as given.
        baseline: the configuration the run would train without the planner (the user's flags). It is
            always among the candidates when it fits, probed first, and the plan replaces it only when
            another candidate's measured prediction is at least `KEEP_BASELINE_WITHIN` faster. Default:
            `base` when its split is the effective batch. When it does not fit, the safe default stands in
            for it: micro-batch 1, every block checkpointed (the lowest-memory split).
        levers: the numerics levers allowed.
        fixed: names of `Strategy` fields the user set explicitly: never changed.
        device: where the run trains.
        epochs: of the planned run (to budget the probes).
        max_grad_norm: the run's clipping (the estimate includes its temporaries).
        margin: the budget share kept free (default `DEFAULT_MARGIN` of the device type).
        probe: measure speeds on this device (False: rank by the prior alone).
        probe_budget: seconds the probes may take in all (default: `probe_fraction` of the planned run's
            predicted time less the seconds the estimates took; the baseline and the prior's favourite are
            always probed). No probe starts that its predicted time would take past the budget.
        probe_fraction: see `probe_budget`.
        seed: the run's seed (batching order).
        rss_baseline: with `meter="rss"`: the process's RSS the budget counts from (`rss_baseline_bytes()`
            when the run starts is typical; the weights then count).
        meter: what the budget counts. "tensors": live tensor bytes (the tracker's meter; the estimate alone
            decides). "rss" (Linux): the process's peak RSS above `rss_baseline`. "cuda_reserved": the CUDA
            caching allocator's reserved bytes. Under a measured meter ("rss", "cuda_reserved") a candidate
            is eligible only when its probe's measured peak, with the margin, fits. Default: "rss" when
            `rss_baseline` is given, else "tensors".
        make_lean: under `meter="rss"`: called once if the first probe, made with the C allocator as the process
            has it, measures over the budget (with the run's growth and the margin). It may fix the allocator's
            thresholds so that RSS follows the tensors (the command line passes `allocator.fix_thresholds`) and
            returns what it did, or None when it changed nothing; the first probe is then measured again, and the
            plan says so (`Plan.malloc`). glibc's own thresholds keep freed blocks resident but train about a third
            faster (docs/memory.md), so they are left alone wherever the first probe fits with them.
        token_micro_batches: train every candidate but your own flags (a `baseline` given and fitting: it trains as
            given; the safe default is the planner's own and is cut too) as `by_tokens` realises it: its window as one
            batch, cut into micro-batches of at most (its micro-batch x the worst width) padded tokens
            (`micro_batch_tokens`), so that short rows run many to a micro-batch within the same memory. Its
            estimate and probe are those of its split at the worst width, which bounds every such micro-batch; its
            predicted time counts the micro-batches it cuts. False (several processes, which must run the same
            micro-batches): the splits as they are.
        echo: prints progress lines.

    Returns:
        The `Plan`: candidates that fit, fastest first.

    Raises:
        PlanError: nothing fits; the message lists what would (freezing, LoRA, a shorter max length, levers).
    """
    base = base or Strategy(batch_size=effective_batch, accum_steps=1)
    if base.micro_batch_tokens or (baseline is not None and baseline.micro_batch_tokens):
        raise PlanError("the planner chooses the micro-batches' tokens itself: drop micro_batch_tokens "
                        "(--micro-batch-tokens) from the strategy it plans")
    meter = meter or ("rss" if rss_baseline is not None else "tensors")
    if meter not in METERS:
        raise PlanError(f"unknown budget meter {meter!r}: pass one of {', '.join(METERS)}")
    if meter == "rss" and rss_baseline is None:
        raise PlanError("a budget of process RSS counts from the RSS at the run's start: pass rss_baseline="
                        "rss_baseline_bytes() (taken before the model is loaded, so the weights count)")
    if base.lora_rank and isinstance(model, nn.Module) and not is_lora_model(model):
        raise PlanError(f"{_lora_words(base)}: pass the wrapped model the run trains (model = "
                        "base.wrap_model(model)): the probes train it as it is")
    if isinstance(model, nn.Module):
        base.prepare_model(model)  # the task's own levers (freezing): never changed by the plan, probed as they run
        probes.MODEL_DIGESTS[model] = estimate_cache.model_digest(model)  # before a probe changes what it reads
    device_type = resolve_device(device).type
    margin = DEFAULT_MARGIN.get(device_type, 0.15) if margin is None else margin
    lengths = list(dataset.lengths)
    worst_width = _worst_width(lengths, collator, base.padding)
    num_labels = getattr(model, "num_labels", None) or getattr(getattr(model, "config", None), "num_labels", None) or 2
    search = _Search(model, worst_width, memory_budget, margin, max_grad_norm, num_labels, echo)
    malloc: str | None = None
    search.padded = min(lengths) < worst_width  # a batch of more than one row holding the longest sample is padded
    search.by_tokens = token_micro_batches
    search.measured = meter != "tensors"
    search.flops = count_model_flops(model) if isinstance(model, nn.Module) else None
    # The estimates run in a child process: what estimating costs (torch's fake-tensor machinery) stays out of
    # this process, whose RSS the budget may count. The optimizers' libraries are imported here first, once: the
    # probes need them here anyway, and each child forked after finds them imported instead of paying for it.
    if isinstance(model, nn.Module):
        _import_optimizers(base, levers, fixed)
    frozen = _freeze_objects(collect=probe and meter != "tensors")
    try:
        for _ in range(_estimate_workers() if isinstance(model, nn.Module) else 0):
            search.workers.append(EstimateWorker(search.estimate_here))  # closed below, whatever happens next
        measured = probes.Meter(meter, rss_baseline) if meter != "tensors" else None
        if measured is not None and not (probe and isinstance(model, nn.Module)):
            raise PlanError(f"a budget {METERS[meter]} is checked by probing a real model: pass probe=True, "
                            "or plan for a budget of live tensors (meter='tensors')")
        if baseline is None and base.batch_size * base.accum_steps == effective_batch:
            baseline = base
        order = sorted(range(len(lengths)), key=lambda index: -lengths[index])  # the worst batch: the longest samples
        reference: Candidate | None = None  # the first probe's candidate, costed and probed before the search
        first_seconds = first_charged = 0.0  # the first probe(s): wall seconds, and as `_Search.charged` counts them
        if probe and isinstance(model, nn.Module):
            # Before the search, the configuration every plan probes first (the user's, else the safe default):
            # its probe predicts the run's time, which bounds planning's (`probe_fraction`, or `probe_budget`), and
            # under a measured meter it measures what the process holds besides tensors, which the search charges.
            firsts = [s for s in (baseline, _lightest(base, effective_batch)) if s is not None and _valid(s)]
            search.prefetch(firsts)  # side by side: the lightest is needed when the baseline does not fit
            first = next((s for s in firsts if search.fits(s)), None)
            if first is not None:
                batch = collator([dataset[i] for i in order[:first.batch_size]])
                started = time.perf_counter()
                # A probe that reads more than a fitting one may stops there: the process stays within its budget.
                ceiling = _ceiling(memory_budget, margin, 0) if measured is not None else None
                probed = probes.probe(model, first, batch, device, max_grad_norm, measured, ceiling)
                leans = meter == "rss" and make_lean is not None
                if leans and probed.get("from_cache") and not _probe_fits(probed, search, first):
                    # Measured again, though cached: besides its verdict, this probe under glibc's own thresholds
                    # leaves freed chunks in the heap, which the run reuses once the thresholds are fixed. A rerun
                    # that read it from the cache trained 10% slower (docs/plan.md).
                    probed = probes.measure_probe(model, probes.as_run(first, measured), batch, device, max_grad_norm,
                                                  measured, ceiling)
                first_charged = probed["probe_seconds"]  # as measured, or as recorded when read from the cache
                if leans and not _probe_fits(probed, search, first):
                    malloc = make_lean()
                    if malloc is not None:
                        echo(f"  {first.batch_size} x {first.accum_steps} measured "
                             f"{format_bytes(probed['measured_peak_bytes'])}, over the budget with the run's growth, "
                             f"under the C allocator's own thresholds: {malloc}; measuring it again")
                        probed = probes.probe(model, first, batch, device, max_grad_norm, measured, ceiling)
                        first_charged += probed["probe_seconds"]
                first_seconds = time.perf_counter() - started
                reference = _costed(search, first, dataset, collator, lengths, device_type, seed,
                                    as_given=first == baseline)
                _record_probe(reference, probed, search.flops)
                total = probe_budget if probe_budget is not None else 0.0 if probed.get("stopped") else \
                    probe_fraction * reference.seconds_per_epoch * epochs  # stopped: no time measured, the floor
                # Both probes count when the first was measured again with the allocator fixed: planning's time is
                # all of it, and the probes after the search are reserved at the second's (the allocator as it will
                # be): the favourite's, and under a measured meter its stand-in's (`_smaller_split`).
                search.limit = max(search.charged, estimate_seconds(
                    total, probed["probe_seconds"], MIN_PLANNING_SECONDS if probe_budget is None else 0.0,
                    spent=first_charged, reserved=1 if measured is None else 2))
            if reference is not None and measured is not None:
                besides = max(0, reference.probe["measured_peak_bytes"] - reference.estimated_peak_bytes)
                search.growth = _run_growth(reference.probe["measured_peak_bytes"], reference.estimated_peak_bytes)
                search.overhead = besides + search.growth
                echo(f"  the process holds {format_bytes(besides)} besides the estimated tensors (measured: "
                     f"{format_bytes(reference.probe['measured_peak_bytes'])} at {first.batch_size} x "
                     f"{first.accum_steps}); {format_bytes(search.growth)} more is kept for the run's growth")
        candidates = _costed_candidates(search, dataset, collator, lengths, effective_batch, base, levers, set(fixed),
                                        device_type, seed, baseline, reference)
        search.limit = None  # what follows (suggestions when nothing fits, LoRA's comparison) is one estimate each
        if not candidates:
            if measured is not None and not search.overhead:
                # What would fit is judged by the same meter: measure the process's memory besides the tensors on
                # the lightest settings (one row of the longest sample), or every suggestion would be priced as
                # tensors alone.
                lightest = _lightest(base, effective_batch)
                longest = max(range(len(lengths)), key=lambda index: lengths[index])
                probed = probes.probe(model, lightest, collator([dataset[longest]]), device, max_grad_norm, measured,
                                      memory_budget)  # stopped at the budget: what it holds besides is at least that
                search.overhead = max(0, probed["measured_peak_bytes"] - search.peak(lightest))
            raise PlanError(_nothing_fits_message(search, effective_batch, base, levers, collator, lengths,
                                                  device_type))
        result = Plan(memory_budget, margin, effective_batch, worst_width, device, candidates, search.count,
                      search.seconds, 0.0, probe_budget, len(lengths), meter=METERS[meter])
        result.cached_estimates = search.cached
        result.growth_bytes = search.growth
        result.malloc = malloc
        if malloc is not None:
            result.notes.append(f"the first probe did not fit under the C allocator's own thresholds, which keep "
                                f"freed blocks resident: {malloc}")
        result.extrapolated = search.extrapolated
        result.predictions = len(search.predicted - search.cache.keys())  # not estimated after all
        if search.skipped:
            result.notes.append(f"the search stopped short of {search.skipped} estimate(s): planning's time (5% of "
                                "the run its first probe predicts, or --plan-time) was spent, so those splits count "
                                "as not fitting; a longer --plan-time searches further (a rerun on the cache stops "
                                "where this run did)")
        if search.extrapolated:
            result.notes.append(f"{len(search.extrapolated)} fused-step candidate(s) not estimated: the line through "
                                "two estimates of the same settings at smaller micro-batches (activations are affine "
                                "in the rows) puts them over the budget")
        chosen = next((c for c in candidates if c.baseline), None)
        if chosen is None:
            result.notes.append("neither your flags nor the safe default (micro-batch 1, every block checkpointed) "
                                "fit: every candidate is the planner's")
        elif chosen.settings != baseline:
            result.baseline_words = "safe default"
            result.notes.append(("your flags do not fit" if baseline is not None else "no split of yours to start "
                                 "from") + "; the baseline is the safe default: micro-batch 1, every block "
                                "checkpointed")
        if search.overhead:
            result.notes.append(f"fits: (estimate + {format_bytes(search.overhead - search.growth)} the process "
                                f"measured besides tensors + {format_bytes(search.growth)} for the run's growth) x "
                                f"{1 + margin:.2f} within the budget, and each probe's measured peak + the growth x "
                                f"{1 + margin:.2f}")
        if probe and isinstance(model, nn.Module):
            result.probe_seconds = first_seconds
            result.charged_seconds = search.charged + first_charged
            _probe_candidates(result, model, dataset, collator, order, device, epochs, max_grad_norm, probe_budget,
                              probe_fraction, measured, echo, flops=search.flops,
                              smaller=lambda candidate: None if "batch_size" in fixed else _smaller_split(
                                  search, candidate, result.candidates, dataset, collator, lengths, device_type, seed))
        else:
            for candidate in candidates:
                candidate.seconds_per_epoch = candidate.prior
            result.notes.append("nothing probed: speeds are a prior in arbitrary units (padded tokens, recompute, "
                                "micro-batch size, precision), not measured")
        realised = [candidate for candidate in result.candidates if candidate.trained is not None]
        for candidate in realised:
            candidate.settings, candidate.trained = candidate.trained, None
        if probes.trims(measured):
            for candidate in result.candidates:
                candidate.settings = probes.as_run(candidate.settings, measured)
            result.notes.append("glibc's own malloc thresholds keep freed blocks resident over a run, where a probe "
                                "measured a fresh heap: the run trims the heap before each micro-batch (--trim-heap, "
                                "2-10% of the speed), as its probes did, so that its RSS stays near theirs")
        if realised:
            result.notes.append(f"{len(realised)} candidate(s) train each window as one batch cut into micro-batches "
                                "of at most (micro-batch x the worst width) padded tokens: short rows run many to a "
                                "micro-batch, within the memory of the split they were estimated and probed as")
        if base.lora_rank:
            lora_comparison(search, result)
        return result
    finally:
        for worker in search.workers:
            worker.close()
        if frozen:
            gc.unfreeze()


def _freeze_objects(collect: bool) -> bool:
    """Hides every object the process holds from the collector until `plan` returns (`gc.freeze`): the probes'
    collections, which free what each probe made before the next is measured, then scan only what planning made.
    After transformers, peft and bitsandbytes are imported, a full collection scans hundreds of thousands of objects
    (about 0.2 s each, 12 of them in a plan of 4 probes). The children forked after it share those objects' pages
    untouched. `collect`: a full collection first (once), where probes measure the process's memory, so that garbage
    made before planning is not frozen into their measurements. Returns whether it froze them (not when the caller
    had already: theirs stay frozen)."""
    if gc.get_freeze_count():
        return False
    if collect:
        gc.collect()
    gc.freeze()
    return True


def _probe_fits(probed: dict, search: _Search, settings: Strategy) -> bool:
    """A probe's measured peak fits the search's budget, with the run's growth (from its estimate) and the margin."""
    peak = probed.get("measured_peak_bytes", 0)
    return _fits_measured(peak, _run_growth(peak, search.peak(settings)), search.margin, search.budget)


def _ceiling(budget: int, margin: float, growth: int) -> int:
    """The most a probe may measure and fit (`_fits_measured`), where `measure_probe` stops it: a probe that goes
    past has already taken the process past what fits, and left unchecked it went on past the budget itself (worst
    batch of 16 rows under glibc's own thresholds: 1.30 GiB measured against a budget of 1.17 GiB, docs/plan.md)."""
    return int(budget / (1 + margin)) - growth


def _run_growth(measured_peak: int, estimated_peak: int) -> int:
    """What a whole run may add to one probe's measured peak: `RUN_GROWTH` of what it measured besides the tensors."""
    return int(RUN_GROWTH * max(0, measured_peak - estimated_peak))


def _fits_measured(peak: int, growth: int, margin: float, budget: int) -> bool:
    """A probe's measured peak fits: with the run's growth and the margin, within the budget."""
    return (peak + growth) * (1 + margin) <= budget


def _costed_candidates(search: _Search, dataset, collator, lengths, effective_batch: int, base: Strategy,
                       levers: Levers, fixed: set, device_type: str, seed: int,
                       baseline: Strategy | None, known: Candidate | None = None) -> list[Candidate]:
    """The candidates that fit, with their epoch's padded tokens and updates and their prior, best prior first.

    The baseline (the configuration without the planner; when it does not fit, the lightest split) is among
    them, marked, whether or not the search reached it. `known` (the candidate probed before the search) is used
    as it is when its settings are among them, its probe kept.
    """
    settings_list = _candidate_settings(search, effective_batch, base, levers, fixed, device_type)
    fallback = _lightest(base, effective_batch)
    chosen = next((s for s in (baseline, fallback) if s is not None and _valid(s) and _fits_or_spent(search, s)),
                  None)
    if chosen is not None and chosen not in settings_list:
        settings_list.append(chosen)
    candidates = [known if known is not None and settings == known.settings
                  else _costed(search, settings, dataset, collator, lengths, device_type, seed,
                               as_given=settings == baseline)
                  for settings in settings_list]
    for candidate in candidates:
        candidate.baseline = candidate.settings == chosen
    return sorted(candidates, key=lambda candidate: candidate.prior)


def _fits_or_spent(search: _Search, settings: Strategy) -> bool:
    """`search.fits`, False once the search's time is spent on settings not estimated yet."""
    try:
        return search.fits(settings)
    except SearchTimeSpent:
        return False


def _costed(search: _Search, settings: Strategy, dataset, collator, lengths, device_type: str, seed: int,
            as_given: bool = False) -> Candidate:
    """A candidate with its estimate, its epoch's padded tokens and updates (from the lengths alone) and its prior:
    of its batches as `by_tokens` cuts them (`as_given`: the user's own flags, trained as they are)."""
    from looptrain import data as data_module

    candidate = Candidate(settings, search.candidate_peak(settings))
    candidate.predicted = search.key(settings) not in search.cache
    # The user's own flags train as given; the safe default is the planner's, and is cut like the rest.
    trained = by_tokens(settings, search.width) if search.by_tokens and not as_given else settings
    candidate.trained = trained if trained != settings else None
    loader = data_module.make_train_loader(dataset, trained.batch_size, collator,
                                           grouping="length" if trained.group_by_length else "random", seed=seed)
    windows = run_windows(loader.batch_sampler, lengths, collator, trained.accum_steps,
                          micro_batch_tokens=trained.micro_batch_tokens)
    shapes = [shape for window in windows for shape in window]
    candidate.padded_tokens = sum(rows * width for rows, width in shapes)
    candidate.micro_batches = len(shapes)
    if search.flops is not None:
        candidate.flops = sum(search.flops.per_batch(rows, width) for rows, width in shapes)
    candidate.updates = len(windows)
    candidate.prior = _prior_seconds(candidate, search.model, device_type)
    return candidate


def by_tokens(settings: Strategy, width: int) -> Strategy:
    """A split as a token-cut run trains it: the window (micro-batch x accumulation) as one batch, cut into
    micro-batches of at most micro-batch x `width` padded tokens (`micro_batch_tokens`); `settings` as they are
    when that cannot apply (fixed-width padding, no accumulation, the fused step, torch.compile, a cut already).

    Each such micro-batch of r rows w wide has r x w <= micro-batch x `width` tokens and r x w x w attention
    scores at most micro-batch x `width` x `width`: within what the split's estimate and probe at `width` (the
    worst batch) priced.
    """
    if settings.padding != "dynamic" or settings.accum_steps == 1 or settings.optimizer_in_backward \
            or settings.compile or settings.micro_batch_tokens:
        return settings
    return dataclasses.replace(settings, batch_size=settings.batch_size * settings.accum_steps, accum_steps=1,
                               micro_batch_tokens=settings.batch_size * width)


# ------------------------------------------------------------------------------------------ fits
def _worst_width(lengths: Sequence[int], collator: Any, padding: str) -> int:
    """The width of the dataset's longest padded batch (any batch holding the longest sample)."""
    if padding == "max_length":
        return int(collator.max_length)
    return int(collator.batch_width([max(lengths)]))


class _Search:
    """Estimates at the worst batch, memoised; `fits` compares them with the budget less the margin."""

    def __init__(self, model, width: int, budget: int, margin: float, max_grad_norm, num_labels: int, echo):
        self.model, self.width, self.budget, self.margin = model, width, budget, margin
        self.max_grad_norm, self.num_labels, self.echo = max_grad_norm, num_labels, echo
        self.cache: dict = {}
        self.results: dict = {}  # the whole estimate (breakdown, phase), by the same key
        self.count = 0
        self.cached = 0  # of `count`, the estimates read from the on-disk cache (looptrain.planning.estimate_cache)
        self.seconds = 0.0
        # The estimates as `limit` counts them: each at what computing it cost (a cached one at its recorded cost), so
        # that a rerun reading them from the cache stops where the first run stopped, in a fraction of the time.
        self.charged = 0.0
        self.overhead = 0  # a budget of process RSS: what the process holds besides the estimated tensors
        self.smallest_failure: Strategy | None = None  # `_largest_fitting`'s smallest split that did not fit
        self.extrapolated: list[Strategy] = []  # fused candidates ruled out by extrapolation, not estimated
        self.limit: float | None = None  # seconds the estimates may take; then only cached ones are read
        self.round_seconds = 0.0  # the longest round of estimates so far, as charged: what `spent` expects of the next
        self.skipped = 0  # estimates not made because `limit` was spent
        self.growth = 0  # a measured meter: kept free for what the run adds to a probe's peak (`RUN_GROWTH`)
        self.padded = False  # the worst batch of more than one row holds shorter, padded rows (see `estimate`)
        self.full_model: Any = None  # `FULL_FINE_TUNE`'s model, made once where the estimates run
        self.workers: list[EstimateWorker] = []  # run the estimates in child processes (`plan` starts them)
        self.by_tokens = False  # candidates other than your flags train as `by_tokens` cuts them (`_costed`)
        # A measured meter: every candidate's memory is confirmed by its probe, so a split's predicted peak
        # (`predict`) stands for its estimate; under the tensors meter the estimate decides alone, and the search
        # estimates the split its predictions chose (`_largest_fitting`).
        self.measured = False
        self.predicted: set = set()  # keys of the splits a prediction decided (`predict`), not estimated
        self.flops: ModelFlops | None = None  # the model's FLOPs per token, which weigh a probe's time (`plan` sets it)

    def priced(self, settings: Strategy) -> Strategy:
        """The settings whose estimate is that of `settings`: with `micro_batch_tokens`, the split whose memory bounds
        theirs (its micro-batch at the worst width: what `by_tokens` made them from); `trim_heap` off (the C heap
        holds no tensor)."""
        settings = dataclasses.replace(settings, trim_heap=False)
        if not settings.micro_batch_tokens:
            return settings
        rows = max(1, min(settings.batch_size, settings.micro_batch_tokens // self.width))
        return dataclasses.replace(settings, batch_size=rows, micro_batch_tokens=0,
                                   accum_steps=math.ceil(settings.batch_size / rows) * settings.accum_steps)

    def key(self, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> tuple:
        """What the estimator prices of `settings` at `seq_len` (default: the worst batch's width)."""
        settings = self.priced(settings)
        priced = {**settings.estimate_options(), "accum_steps": min(settings.accum_steps, 2)}  # memory repeats after 2
        key = settings.batch_size, seq_len or self.width, type(settings), tuple(sorted(priced.items()))
        return key if model is None else (*key, model)

    def peak(self, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> int:
        """The estimate of `settings` at the worst batch (or `seq_len` wide), memoised by what the estimator prices.

        `model`: None (the search's model) or `FULL_FINE_TUNE` (a LoRA model without its adapters). With
        `workers` (`plan` starts them), the estimate runs in a child process.
        """
        request = self._request(settings, seq_len, model)
        if request[-1] not in self.cache:
            self._estimate([request], demanded=True)
        return self.cache[request[-1]]

    def prefetch(self, settings_list: Sequence[Strategy]) -> None:
        """Estimates those of `settings_list` not memoised yet side by side, one per worker, so that `peak` finds them
        (`search.workers`: one per core, up to two). Best effort: nothing with one worker, for fewer than two
        estimates, or once the search's time is spent. A round is charged as its longest estimate: the search's
        decisions do not depend on how many ran beside each other, and a rerun on the cache takes the same."""
        if len(self.workers) < 2 or self.spent():
            return
        wanted = {}
        for settings in settings_list:
            request = self._request(settings, None, None)
            if request[-1] not in self.cache:
                wanted.setdefault(request[-1], request)
        if len(wanted) > 1:
            self._estimate(list(wanted.values())[:len(self.workers)], demanded=False)

    def _request(self, settings: Strategy, seq_len: int | None, model: str | None) -> tuple:
        seq_len = seq_len or self.width
        settings = self.priced(settings)
        return settings, seq_len, model, self.key(settings, seq_len, model)

    def _estimate(self, requests: list[tuple], demanded: bool) -> None:
        """One round: each request on its own worker (here without any), their results memoised."""
        started = time.perf_counter()
        spent = self.spent()  # then only cached estimates are read
        workers = self.workers or [None] * len(requests)
        for (settings, seq_len, model, _), worker in zip(requests, workers):
            if worker is not None:
                worker.submit((settings, seq_len, model, spent))
        answers = []
        for request, worker in zip(requests, workers):  # every answer is read, so that no worker is left behind
            settings, seq_len, model, _ = request
            try:
                answers.append(worker.collect() if worker is not None
                               else self.estimate_here((settings, seq_len, model, spent)))
            except Exception as error:  # noqa: BLE001  raised below for what was asked, once every answer is in
                answers.append(error)
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        failed = next((answer for answer in answers if isinstance(answer, Exception)
                       and not isinstance(answer, LookupError)), None)
        if demanded and failed is not None:
            raise failed  # a prefetch's failure is not memoised: `peak` meets it again if the search asks
        results = [answer for answer in answers if not isinstance(answer, Exception)]
        # A cached estimate counts at what computing it cost; a round of side-by-side estimates, at its longest.
        cost = max((result.get("compute_seconds", elapsed) for result in results), default=0.0)
        self.charged += cost
        self.round_seconds = max(self.round_seconds, cost)
        for (settings, seq_len, _, key), result in zip(requests, answers):
            if isinstance(result, Exception):
                continue
            self.count += 1
            self.cached += bool(result.get("from_cache"))
            self.cache[key] = result["peak_memory_bytes"]
            self.results[key] = result
            self.echo(f"  estimate {settings.batch_size} x {settings.accum_steps}, {settings.precision}"
                      f"{', bf16 weights' if settings.weights == 'bf16' else ''}, "
                      f"{settings.optimizer}, checkpointing {settings.checkpointing}"
                      f"{', fused step' if settings.optimizer_in_backward else ''}"
                      f"{', ' + _lora_words(settings) if settings.lora_rank else ''}"
                      f"{f', seq {seq_len}' if seq_len != self.width else ''}: {format_bytes(self.cache[key])}"
                      f"{' (from the cache)' if result.get('from_cache') else ''}")
        if demanded and len(results) < len(requests):
            self.skipped += 1
            raise SearchTimeSpent

    def spent(self) -> bool:
        """Whether planning's time (`limit`) has no room for another round as long as the longest so far: then only
        cached estimates are read (a round is not started that would end past the limit)."""
        return self.limit is not None and self.charged + self.round_seconds > self.limit

    def estimate_here(self, request: tuple) -> dict:
        """`estimate` of a `peak` request in this process (the worker's child calls it too)."""
        settings, seq_len, model, cached_only = request
        if model == FULL_FINE_TUNE:
            if self.full_model is None:
                self.full_model = full_fine_tune_model(self.model)
            model = self.full_model
        return estimate(self.model if model is None else model, settings.batch_size, seq_len, settings,
                        num_labels=self.num_labels, max_grad_norm=self.max_grad_norm, padded=self.padded,
                        cache="only" if cached_only else True)

    def predict(self, settings: Strategy) -> int | None:
        """The estimate of `settings` (memoised), else their peak predicted from two estimates of the same settings at
        other micro-batches, else None.

        For fixed settings at one width, the peak of each phase of the update (forward, backward, the optimizer
        step: `phase_peak_bytes`) is affine in the micro-batch's rows: activations and temporaries grow with them,
        weights, gradients and optimizer state do not (docs/plan.md: exact to 2.3e-4 on 12 mixes of models,
        optimizers, precisions, checkpointing, LoRA and chunked cross-entropy). Each phase is read off the line
        through the two nearest estimates (those on either side when there are), and the prediction is the largest.
        Where the worst batch of several rows is padded, one row is not (nothing to pad): it is neither a point nor
        predicted.
        """
        key = self.key(settings)
        if key in self.cache:
            return self.cache[key]
        rows, points = key[0], self.family_estimates(settings)
        if rows < (2 if self.padded else 1) or len(points) < 2:
            return None
        below = [point for point in points if point[0] < rows]
        above = [point for point in points if point[0] > rows]
        (low, first), (high, second) = (below[-1], above[0]) if below and above else \
            (below[-2], below[-1]) if len(below) >= 2 else (above[0], above[1])

        def phases(result: dict) -> dict:
            return result.get("phase_peak_bytes") or {"peak": result["peak_memory_bytes"]}

        ends = phases(first), phases(second)
        return int(max(ends[0][phase] + (ends[1][phase] - ends[0][phase]) * (rows - low) / (high - low)
                       for phase in ends[0] if phase in ends[1]))

    def family_estimates(self, settings: Strategy) -> list[tuple[int, dict]]:
        """The estimates of `settings` at other micro-batches that lie on one line, ``(rows, result)`` by rows: at two
        rows or more where the worst batch is padded (one row is not)."""
        key, smallest = self.key(settings), 2 if self.padded else 1
        return sorted(((other[0], result) for other, result in self.results.items()
                       if other[1:] == key[1:] and other[0] >= smallest), key=lambda point: point[0])

    def known(self, settings: Strategy) -> bool:
        """Whether `fits` can answer for `settings` without an estimate."""
        return self.predict(settings) is not None

    def candidate_peak(self, settings: Strategy) -> int:
        """A candidate's peak: its estimate; its prediction when it has none and either a measured meter's probe
        will measure it or planning's time is spent."""
        predicted = self.predict(settings)
        if predicted is not None and self.measured:
            return predicted
        try:
            return self.peak(settings)
        except SearchTimeSpent:
            if predicted is None:
                raise
            return predicted

    def fits(self, settings: Strategy) -> bool:
        """Whether `settings` fit the budget less the margin (with what the process holds besides tensors): by their
        estimate, or their prediction (`predict`) when they have none, or by an estimate made now."""
        key, peak = self.key(settings), self.predict(settings)
        if peak is None:
            peak = self.peak(settings)
        elif key not in self.cache:
            self.predicted.add(key)
        return (peak + self.overhead) * (1 + self.margin) <= self.budget


def _optimizer_names(base: Strategy, levers: Levers, fixed: Sequence[str]) -> tuple[str, ...]:
    """The optimizers the plan may try: the user's, or with `Levers.optimizer_family` (and the optimizer not fixed)
    every member of its family (`OPTIMIZER_FAMILIES`)."""
    if levers.optimizer_family and "optimizer" not in fixed:
        return OPTIMIZER_FAMILIES.get(base.optimizer, (base.optimizer,))
    return (base.optimizer,)


def _import_optimizers(base: Strategy, levers: Levers, fixed: Sequence[str]) -> None:
    """Imports the libraries of the optimizers the plan may estimate and probe (`import_optimizer`); one that is not
    installed is left to the estimate, which says so."""
    for name in _optimizer_names(base, levers, fixed):
        with contextlib.suppress(ImportError):
            import_optimizer(name)


def _estimate_workers() -> int:
    """How many estimates run side by side: one per core this process may use, up to two (an estimate is one
    thread of Python; the search rarely has more than two it is sure to need)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2, cores))


def _valid(settings: Strategy) -> bool:
    try:
        LoopConfig.from_strategy(settings, device="cpu", track_memory=False)  # probes and planned compiled runs: off
    except ConfigError:
        return False
    return True


def estimate_seconds(total: float, first_probe_seconds: float, floor: float, spent: float | None = None,
                     reserved: int = 1) -> float:
    """Planning's time left for the estimates: `total` (5% of the run, or the probe budget), at least `floor`, less
    the probes made before the search (`spent`; default: one, the first probe) and as much as the first probe again
    for each of the `reserved` probes that follow the search: the favourite's, and under a measured meter the one of
    the smaller split that stands in for it when it measures over the budget."""
    return max(total, floor) - (first_probe_seconds if spent is None else spent) - reserved * first_probe_seconds


def _candidate_settings(search: _Search, effective_batch: int, base: Strategy, levers: Levers, fixed: set,
                        device_type: str) -> list[Strategy]:
    """For each allowed precision, optimizer, checkpointing mode and fused step: the largest split that fits.

    The checkpointing modes are searched from the one that saves the most memory (every block) to none, so that
    a search cut short by planning's time has found the splits most likely to fit first. Memory only grows as
    fewer blocks are checkpointed, so a mode is searched only up to the largest micro-batch the mode before it
    reached (and not at all when that one fitted none); a later optimizer of the family (slower, lighter) must buy
    a larger micro-batch than the ones before it reached with the same mode, and the fused step (the whole batch in
    one micro-batch) is tried only where the unfused step did not reach it.
    """
    sizes = divisors(effective_batch)
    if "batch_size" in fixed:
        sizes = [size for size in sizes if size == base.batch_size]
    numerics = [(base.precision, base.weights)]  # (autocast precision, weight storage)
    if levers.precision and "precision" not in fixed:
        fast = amp_precision(resolve_device(device_type))[0]
        numerics = list(dict.fromkeys([("fp32", base.weights), (fast, base.weights)]))
        if fast == "bf16" and "weights" not in fixed:
            numerics.append(("bf16", "bf16"))
    # bf16 weights compute in bf16 (LoopConfig.compute_precision), and never with fp16's GradScaler.
    numerics = [("bf16" if weights == "bf16" else precision, weights) for precision, weights in numerics
                if weights == "fp32" or precision != "fp16"]
    optimizers = [name for name in _optimizer_names(base, levers, fixed)
                  if device_type == "cuda" or not name.startswith("paged")]
    checkpointing_fixed = fixed & {"gradient_checkpointing", "checkpoint_every"}
    modes = [(base.gradient_checkpointing, base.checkpoint_every)] if checkpointing_fixed \
        else list(reversed(CHECKPOINT_MODES))  # the most memory saved first
    fused_options = [base.optimizer_in_backward] if "optimizer_in_backward" in fixed else [False, True]
    chosen: list[Strategy] = []
    for precision, weights in dict.fromkeys(numerics):
        reached: dict = {}  # checkpointing mode -> the largest micro-batch an earlier optimizer of the family reached
        for optimizer in optimizers:
            cap = effective_batch  # the largest micro-batch the previous (more checkpointed) mode fitted
            fused_may_fit = True in fused_options  # the fused step fitted (or was not needed) with the previous mode
            for checkpointing, every in modes:
                if cap == 0 and not fused_may_fit:
                    break  # less checkpointing fits nothing that more did not
                unfused_best = 0
                for fused in fused_options:
                    template = dataclasses.replace(base, precision=precision, weights=weights, optimizer=optimizer,
                                                   gradient_checkpointing=checkpointing, checkpoint_every=every,
                                                   optimizer_in_backward=fused)
                    floor = reached.get((checkpointing, every), 0)  # a later optimizer must buy a larger micro-batch
                    if fused:
                        if unfused_best == effective_batch or not fused_may_fit or floor == effective_batch:
                            continue  # the whole batch fits unfused; or with more checkpointing it did not fit fused
                        failed = search.smallest_failure if unfused_best < effective_batch else None
                        if failed is not None and _cannot_fit_fused(search, failed, effective_batch):
                            fused_may_fit = False  # extrapolated from the unfused estimates
                            continue
                        options = [effective_batch]
                    else:
                        options = [size for size in sizes if floor < size <= cap]
                        search.smallest_failure = None
                    size = _largest_fitting(search, template, options, effective_batch) if options else None
                    if fused:
                        fused_may_fit = size is not None
                    else:
                        unfused_best = size or 0
                    if size is not None:
                        chosen.append(dataclasses.replace(template, batch_size=size,
                                                          accum_steps=effective_batch // size))
                floor = reached.get((checkpointing, every), 0)
                # A later optimizer of the family is lighter: it fits at least what the ones before it reached.
                cap = max(unfused_best, floor if False in fused_options else 0)
                reached[(checkpointing, every)] = max(floor, unfused_best)
    return chosen


def _largest_fitting(search: _Search, template: Strategy, sizes: list[int], effective_batch: int) -> int | None:
    """The largest micro-batch in `sizes` that fits (memory grows with it: a binary search).

    A step is decided by its split's estimate, or by its prediction from two estimates of the same settings at other
    micro-batches (`_Search.predict`): the first step is estimated beside the step it takes when it fits, and from
    then on the line through them decides most steps without an estimate. Under the tensors meter (the estimate
    decides alone) the largest split a prediction chose is estimated before it is returned; should it not fit, the
    search goes on below it.
    """
    def split(size: int) -> Strategy:
        return dataclasses.replace(template, batch_size=size, accum_steps=effective_batch // size)

    sizes = [size for size in sizes if _valid(split(size))]
    low, high, best = 0, len(sizes) - 1, None
    search.smallest_failure = None
    while low <= high:
        middle = (low + high) // 2
        settings = split(sizes[middle])
        if not search.known(settings):
            # Beside it, where the search goes next when it fits (larger splits are the faster ones); at the last
            # step, the split below the best so far, which stands in for it when its probe measures over the budget
            # (`_smaller_split`).
            below = sizes.index(best) - 1 if best is not None else -1
            beside = [split(sizes[(middle + 1 + high) // 2])] if middle < high \
                else [split(sizes[below])] if below >= 0 else []
            search.prefetch([settings] + [other for other in beside if not search.known(other)])
        try:
            fitting = search.fits(settings)
        except SearchTimeSpent:
            return best  # what the estimates made so far found
        if fitting:
            best, low = sizes[middle], middle + 1
        else:
            high = middle - 1
            search.smallest_failure = settings
    if best is None or search.measured or search.key(split(best)) in search.cache:
        return best
    try:
        search.peak(split(best))  # a prediction chose it: estimated, as the tensors meter decides by estimates
    except SearchTimeSpent:
        return best  # planning's time is spent: the prediction stands
    if search.fits(split(best)):
        return best
    found = _largest_fitting(search, template, sizes[:sizes.index(best)], effective_batch)
    search.smallest_failure = search.smallest_failure or split(best)
    return found


def _cannot_fit_fused(search: _Search, failed: Strategy, effective_batch: int) -> bool:
    """Whether the step fused into backward at the whole batch is sure not to fit, extrapolated from two estimates of
    `failed`'s settings (unfused, at smaller micro-batches, one of which did not fit).

    The fused step holds no gradients, but the weights, the optimizer state and the activations of the whole batch.
    Where those estimates peaked in forward or backward, their activations and temporaries are affine in the rows,
    as each phase's peak is (`_Search.predict`): the line through the two largest, read at `effective_batch` rows,
    plus the weights and the state, bound the fused step's peak. Below that bound, or without two such estimates,
    the fused candidate is estimated. (Scaling one estimate's activations by `effective_batch / rows` overstates
    them by the line's intercept: on worked example 1 it ruled out 8-bit AdamW fused, 3.09 GiB, under 4 GiB.)
    """
    points = [(rows, result["memory_breakdown"]) for rows, result in search.family_estimates(failed)]
    if len(points) < 2 or any(parts["peak_phase"] not in ("forward", "backward") for _, parts in points[-2:]):
        return False
    (low, first), (high, second) = points[-2:]
    slope = (second["activations_and_temps"] - first["activations_and_temps"]) / (high - low)
    bound = second["params"] + second["optimizer_state"] + second["activations_and_temps"] \
        + slope * (effective_batch - high)
    if (bound + search.overhead) * (1 + search.margin) <= search.budget:
        return False
    search.extrapolated.append(dataclasses.replace(failed, batch_size=effective_batch, accum_steps=1,
                                                   optimizer_in_backward=True))
    return True


def _lightest(base: Strategy, effective_batch: int) -> Strategy:
    """The lightest exact split of `base`: micro-batch 1, every block checkpointed."""
    return dataclasses.replace(base, batch_size=1, accum_steps=effective_batch, gradient_checkpointing=True,
                               checkpoint_every=1, optimizer_in_backward=False)


def _nothing_fits_message(search: _Search, effective_batch: int, base: Strategy, levers: Levers, collator, lengths,
                          device_type: str) -> str:
    """What would fit, with its estimate: the lightest exact settings plus one task or numerics change."""
    lightest = _lightest(base, effective_batch)
    lines = [f"nothing fits {format_bytes(search.budget)} (with a {search.margin:.0%} margin) at the worst batch "
             f"({search.width} tokens wide), even micro-batch 1 x {effective_batch} with gradient checkpointing: "
             f"estimated {format_bytes(search.peak(lightest))}"
             + (f" + {format_bytes(search.overhead)} of the process's RSS measured besides tensors"
                if search.overhead else "")
             + "."]
    suggestions = []
    if not levers.optimizer_family and base.optimizer == "adamw":
        suggestions.append(("--optim auto (8-bit AdamW)", dataclasses.replace(lightest, optimizer="adamw8bit"), None))
    fast = amp_precision(resolve_device(device_type))[0]
    if not levers.precision and base.precision == "fp32":
        suggestions.append(("--amp", dataclasses.replace(lightest, precision=fast), None))
    if base.weights == "fp32" and fast == "bf16":
        suggestions.append(("--weights bf16", dataclasses.replace(lightest, precision="bf16", weights="bf16"), None))
    if not base.lora_rank:  # freezing and LoRA do not mix (LoRA freezes the whole base)
        blocks = _block_count(search.model)
        for count in sorted({blocks // 2, blocks - 1} - {0}) if blocks else []:
            suggestions.append((f"--freeze-layers {count}",
                                dataclasses.replace(lightest, freeze_layers=count, freeze_encoder=False), None))
        suggestions.append(("--freeze-encoder",
                            dataclasses.replace(lightest, freeze_encoder=True, freeze_layers=0,
                                                freeze_embeddings=False), None))
    adapters = _lora_suggestions(search, base, lightest)
    if search.width > 16:
        suggestions.append((f"--max-length {search.width // 2}", lightest, search.width // 2))
    fitting, lora_over = [], []
    for label, settings, seq_len, model in [(*suggestion, None) for suggestion in suggestions] + adapters:
        try:
            peak = search.peak(settings, seq_len, model)
        except Exception as error:  # LoRA: any estimate that cannot run here (QLoRA without 4 bits)
            if isinstance(error, (ValueError, TypeError)) or model is not None or settings.lora_rank:
                continue  # an invalid mix
            raise
        if (peak + search.overhead) * (1 + search.margin) <= search.budget:
            fitting.append(f"fits with {label} (est. {format_bytes(peak)})")
        elif (label, settings, seq_len, model) in adapters:
            lora_over.append(f"{label} (est. {format_bytes(peak)})")
    lines.append("; ".join(fitting) + "." if fitting else "None of --amp, --optim auto, freezing, LoRA or a halved "
                 "--max-length fits either: raise the budget.")
    if lora_over:
        lines.append(f"Not enough: {', '.join(lora_over)}.")
    return " ".join(lines)


def _lora_suggestions(search: _Search, base: Strategy, lightest: Strategy) -> list[tuple]:
    """LoRA's suggestions when nothing fits: (label, settings, None, model to estimate or None).

    Without LoRA: LoRA and QLoRA of rank `LORA_SUGGESTED_RANK` (freezing dropped: LoRA freezes the base).
    With LoRA but not QLoRA: ``--qlora``, estimated on the unwrapped base (a wrapped model is not quantized again).
    """
    if base.qlora:
        return []
    if base.lora_rank:
        if full_fine_tune_model(search.model) is None:
            return []
        return [("--qlora", dataclasses.replace(lightest, qlora=True), None, FULL_FINE_TUNE)]
    frozen = [name for name in ("freeze_embeddings", "freeze_layers", "freeze_encoder")
              if getattr(lightest, name) != Strategy.__dataclass_fields__[name].default]
    lora = dataclasses.replace(lightest, lora_rank=LORA_SUGGESTED_RANK,
                               **{name: Strategy.__dataclass_fields__[name].default for name in frozen})
    dropped = f" (without --{', --'.join(name.replace('_', '-') for name in frozen)})" if frozen else ""
    return [(f"--lora {LORA_SUGGESTED_RANK}{dropped}", lora, None, None),
            (f"--lora {LORA_SUGGESTED_RANK} --qlora{dropped}", dataclasses.replace(lora, qlora=True), None, None)]


# ------------------------------------------------------------------------------------------ LoRA
def _lora_words(settings: Strategy) -> str:
    """``LoRA r 16`` or ``QLoRA r 16``."""
    return f"{'QLoRA' if settings.qlora else 'LoRA'} r {settings.lora_rank}"


def full_fine_tune_model(model: Any) -> Any:
    """What `estimate` prices as the full fine-tune of a LoRA model: the model without its adapters.

    A config, a preset or a model that is not a `PeftModel` is returned as it is. A `PeftModel`: a copy with
    its adapters unloaded and every parameter trainable, sharing the original's tensors (no memory; the
    original is unchanged). A QLoRA model (4-bit base): its transformers config (the unquantized model), or
    None when it has none.
    """
    if not is_lora_model(model):
        return model
    if any(is_4bit_layer(module) for module in model.modules()):
        config = getattr(model, "config", None)
        return config if hasattr(config, "to_dict") else None
    import copy

    memo: dict[int, Any] = {id(buffer): buffer for buffer in model.buffers()}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(parameter.detach(), requires_grad=True)
    return copy.deepcopy(model, memo).unload()


def lora_comparison(search: _Search, result: Plan) -> dict | None:
    """The LoRA winner against the full fine-tune with the same settings, at the worst batch: one more estimate.

    Sets `result.lora` (both estimates, the saving, whether the full fine-tune fits the budget too) and adds a
    note; when LoRA saves less than `LORA_SMALL_SAVING` of the full fine-tune's peak (activations dominate: a
    small model, long sequences), the note says so. An estimate that cannot run adds a note and nothing else.
    """
    winner = result.winner
    settings = dataclasses.replace(winner.settings, **{name: Strategy.__dataclass_fields__[name].default
                                                       for name in LORA_LEVERS})
    flags = " ".join(settings.flags())
    started, count = search.seconds, search.count
    try:
        if full_fine_tune_model(search.model) is None:
            raise ValueError("a 4-bit model without a transformers config")
        full = search.peak(settings, model=FULL_FINE_TUNE)
    except Exception as error:  # noqa: BLE001  a report: never a reason to fail the plan
        result.notes.append(f"no comparison of {_lora_words(winner.settings)} with a full fine-tune "
                            f"({type(error).__name__}: {error})")
        return None
    finally:
        result.estimates += search.count - count
        result.estimate_seconds += search.seconds - started
    saving = full - winner.estimated_peak_bytes
    share = saving / full if full else 0.0
    fits = (full + search.overhead) * (1 + search.margin) <= search.budget
    result.lora = {"settings": dataclasses.asdict(winner.settings), "estimated_peak_bytes": winner.estimated_peak_bytes,
                   "full_fine_tune_flags": settings.flags(), "full_fine_tune_peak_bytes": full,
                   "saving_bytes": saving, "saving_share": round(share, 4), "full_fine_tune_fits": fits,
                   "small_saving": share < LORA_SMALL_SAVING}
    words = _lora_words(winner.settings)
    if saving <= 0:
        amount = f"{words} saves nothing"
    else:
        amount = f"{words} saves {'only ' if share < LORA_SMALL_SAVING else ''}{format_bytes(saving)} ({share:.0%})"
    text = (f"{amount} over the full fine-tune with the same settings ({flags}: est. {format_bytes(full)}, "
            f"{words} est. {format_bytes(winner.estimated_peak_bytes)}) at this length ({search.width} tokens)")
    if share < LORA_SMALL_SAVING:
        text += (": the activations dominate the peak, and LoRA trims only the weights' gradients and optimizer "
                 "state; " + ("the full fine-tune fits the budget too (drop --lora to train every weight)" if fits
                              else "still, with these settings only LoRA fits the budget"))
    result.notes.append(text)
    return result.lora


def _block_count(model: Any) -> int:
    from looptrain.freeze import find_transformer_blocks

    try:
        return len(find_transformer_blocks(model))
    except (ValueError, TypeError):
        return 0


# ------------------------------------------------------------------------------------------ fastest
def _prior_seconds(candidate: Candidate, model: Any, device_type: str) -> float:
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


def _probe_candidates(result: Plan, model: nn.Module, dataset, collator, order: list[int], device: str, epochs: int,
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
    least `KEEP_BASELINE_WITHIN` faster. A candidate whose probe measures over the budget is replaced by the next
    smaller split of its settings (`smaller`), probed at once, budget or not (it stands in for the one probed).
    The budget counts each probe at its seconds as measured, a cached one at its recorded seconds
    (`Plan.charged_seconds`), so that a rerun on the cache takes the same decisions.
    """
    started, spent = time.perf_counter(), result.probe_seconds  # the first probe, made before the search
    budget, rejected, skipped, hopeless = probe_budget, [], 0, 0
    charged = 0.0  # the probes below as the budget counts them: each at its (measured or recorded) seconds

    def fits(candidate: Candidate) -> bool:
        peak = candidate.probe.get("measured_peak_bytes")
        return peak is None or _fits_measured(peak, result.growth_bytes, result.margin, result.budget_bytes)

    batches: dict[int, dict] = {}  # by micro-batch size: the cache check and the probe collate it once

    def batch_of(candidate: Candidate) -> dict:
        size = candidate.settings.batch_size
        if size not in batches:
            batches[size] = collator([dataset[i] for i in order[:size]])
        return batches[size]

    def run(candidate: Candidate) -> None:
        nonlocal charged
        if not candidate.probed:
            ceiling = _ceiling(result.budget_bytes, result.margin, result.growth_bytes) if meter is not None else None
            _record_probe(candidate, probes.probe(model, candidate.settings, batch_of(candidate), device, max_grad_norm,
                                                  meter, ceiling), flops)
            charged += candidate.probe["probe_seconds"]
        over = not fits(candidate)
        if over:
            rejected.append(candidate)
        settings, peak = candidate.settings, candidate.probe.get("measured_peak_bytes")
        speed = f"stopped past {format_bytes(candidate.probe['ceiling'])}, the most that fits" \
            if candidate.probe.get("stopped") else \
            f"{result.num_samples / candidate.seconds_per_epoch:.1f} samples/s predicted"
        echo(f"  probe {settings.batch_size} x {settings.accum_steps}, {settings.precision}, {settings.optimizer}, "
             f"checkpointing {settings.checkpointing}{', fused step' if settings.optimizer_in_backward else ''}: "
             f"{speed} "
             + (f"(from the cache, measured in {candidate.probe['probe_seconds']:.1f} s"
                if candidate.probe.get("from_cache") else f"({candidate.probe['probe_seconds']:.1f} s")
             + (f"; measured peak {format_bytes(peak)}{', over the budget' if candidate in rejected else ''}"
                if peak is not None else "") + ")")
        replacement = smaller(candidate) if over else None
        if replacement is not None:
            result.candidates.append(replacement)
            run(replacement)

    baseline = next((c for c in result.candidates if c.baseline), None)
    for candidate in [baseline] + [result.candidates[0]] * (result.candidates[0] is not baseline):
        if candidate is not None:
            run(candidate)
    if budget is None:  # a share of the planned run (as the baseline's probe predicts it)
        reference = next((c for c in (baseline, *result.candidates) if c is not None and _timed(c)), None)
        budget = probe_fraction * reference.seconds_per_epoch * epochs if reference is not None else 0.0
    budget = max(0.0, budget - result.charged_seconds - charged)  # planning's time: estimates and probes together
    charged = 0.0
    result.probe_budget_seconds = round(budget, 3)
    while True:
        probed = [c for c in result.candidates if c.probed]
        _scale_priors(result.candidates)
        waiting = sorted((c for c in result.candidates if not c.probed), key=lambda c: c.seconds_per_epoch)
        if not waiting:
            break
        candidate = waiting[0]
        fitting = [c for c in probed if c not in rejected]
        best = min((c.seconds_per_epoch for c in fitting), default=math.inf)
        cost = _predicted_probe_seconds(candidate, probed)  # cached or not: a rerun decides as the first run did
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
                            "measured " + ", ".join(format_bytes(c.probe['measured_peak_bytes']) for c in rejected)
                            + "; raise the budget, or let the planner use --amp / --optim auto")
    _scale_priors(result.candidates)
    result.candidates.sort(key=lambda c: (not c.probed or c in rejected, c.seconds_per_epoch))
    baseline = next((c for c in result.candidates if c.baseline and c.probed and c not in rejected), None)
    if baseline is not None and result.candidates[0] is not baseline \
            and result.candidates[0].seconds_per_epoch > (1 - KEEP_BASELINE_WITHIN) * baseline.seconds_per_epoch:
        result.candidates.remove(baseline)
        result.candidates.insert(0, baseline)
        result.notes.append(f"kept the {result.baseline_words}: no candidate is predicted at least "
                            f"{KEEP_BASELINE_WITHIN:.0%} faster")


def _smaller_split(search: _Search, candidate: Candidate, candidates: list[Candidate], dataset, collator, lengths,
                   device_type: str, seed: int) -> Candidate | None:
    """The next smaller micro-batch of a candidate's settings (same effective batch), costed, when it is no candidate
    yet and its estimate fits; None otherwise (micro-batch 1, or the next one is a candidate already)."""
    settings = candidate.settings
    effective_batch = settings.batch_size * settings.accum_steps
    sizes = [size for size in divisors(effective_batch) if size < settings.batch_size]
    if settings.optimizer_in_backward or not sizes:
        return None
    smaller = dataclasses.replace(settings, batch_size=sizes[-1], accum_steps=effective_batch // sizes[-1])
    if any(other.settings == smaller for other in candidates) or not _valid(smaller) or not search.fits(smaller):
        return None
    return _costed(search, smaller, dataset, collator, lengths, device_type, seed)


def _record_probe(candidate: Candidate, probe: dict, flops: ModelFlops | None = None) -> None:
    """A probe's measurements on its candidate, and the epoch's time they predict: each micro-batch's fixed cost
    and its work at the probe's seconds per FLOP (`micro_batch_costs`), else (no small step timed, or no FLOPs
    counted) its padded tokens at the probe's seconds per token; and each optimizer step."""
    candidate.probe, candidate.probed = probe, True
    if probe.get("stopped"):  # over its ceiling, so over the budget: no time measured, the prior's stands
        return
    costs = micro_batch_costs(probe, flops) if candidate.flops else None
    work = costs[0] * candidate.micro_batches + costs[1] * candidate.flops if costs is not None \
        else probe["micro_step_seconds"] / probe["tokens"] * candidate.padded_tokens
    candidate.seconds_per_epoch = (work + probe["optimizer_step_seconds"] * candidate.updates
                                   + probe.get("compile_seconds", 0.0))  # torch.compile: paid once, counted once


def micro_batch_costs(probe: dict, flops: ModelFlops | None) -> tuple[float, float] | None:
    """A probe's seconds per micro-batch whatever its size, and per model FLOP of its work: the line through its two
    timed micro-batches (the warm-up's second run and the worst batch), their work in model FLOPs
    (`ModelFlops.per_batch`: padded tokens, attention growing with the width). None without a small step timed or
    FLOPs counted.

    A micro-batch's fixed cost (Python, dispatch, hooks: the same for 1 row or 8) is why cutting a batch into more
    micro-batches costs more than its tokens say; and attention makes a token of the worst width dearer than one of
    a typical batch.
    """
    small, shape = probe.get("small_step_seconds"), probe.get("small_batch_shape")
    if small is None or shape is None or flops is None:
        return None
    small_work, large_work = flops.per_batch(*shape), flops.per_batch(*probe["batch_shape"])
    if large_work <= small_work or probe["micro_step_seconds"] <= small:
        return None
    per_flop = (probe["micro_step_seconds"] - small) / (large_work - small_work)
    fixed = small - per_flop * small_work
    if fixed < 0:  # noise: all of it work
        return 0.0, probe["micro_step_seconds"] / large_work
    return fixed, per_flop


def _scale_priors(candidates: list[Candidate]) -> None:
    """Unprobed candidates' predicted time: their prior times the median ratio of the probed ones alike
    (same precision and optimizer), or of every probed one."""
    probed = [c for c in candidates if _timed(c)]
    if not probed:
        return
    for candidate in (c for c in candidates if not _timed(c)):
        alike = [c for c in probed if (c.settings.precision, c.settings.optimizer)
                 == (candidate.settings.precision, candidate.settings.optimizer)] or probed
        ratios = sorted(c.seconds_per_epoch / c.prior for c in alike)
        candidate.seconds_per_epoch = candidate.prior * ratios[len(ratios) // 2]


def _timed(candidate: Candidate) -> bool:
    """Whether a candidate's speed was measured: probed, and not stopped at its ceiling."""
    return candidate.probed and not candidate.probe.get("stopped")


def _predicted_probe_seconds(candidate: Candidate, probed: list[Candidate]) -> float:
    """A probe's time, scaled from the nearest probed candidate by micro-batch rows and recompute."""
    probed = [c for c in probed if _timed(c)]
    if not probed:
        return 0.0

    def recompute(settings: Strategy) -> float:
        return 1 + (0.35 / settings.checkpoint_every if settings.gradient_checkpointing else 0.0)
    reference = min(probed, key=lambda c: abs(c.settings.batch_size - candidate.settings.batch_size))
    scale = candidate.settings.batch_size / reference.settings.batch_size * recompute(candidate.settings) \
        / recompute(reference.settings)
    return reference.probe["probe_seconds"] * scale


def run_windows(sampler: Any, lengths: Sequence[int], collator: Any, accum_steps: int, epochs: int = 1,
                max_steps: int = 0, micro_batch_tokens: int = 0) -> list[list[tuple[int, int]]]:
    """The micro-batch shapes ``(rows, padded width)`` of every window a run trains on, in order.

    Read from the sampler's own epochs (`epoch_batches(epoch)`: no batch is built, no resume offset is
    consumed), cut into windows as the Loop cuts them (the last one of an epoch may be shorter; with
    `micro_batch_tokens`, each batch into its pieces, `looptrain.batches.token_pieces`), and stopped after
    `max_steps` windows when that is set.
    """
    def width(batch_lengths: Sequence[int]) -> int:
        return int(collator.batch_width(batch_lengths))

    def micro_batches(batch: Sequence[int]) -> list[tuple[int, int]]:
        batch_lengths = [lengths[index] for index in batch]
        pieces = (token_pieces(batch_lengths, micro_batch_tokens, lambda length: width([length]))
                  if micro_batch_tokens else [range(len(batch))])
        return [(len(piece), width([batch_lengths[row] for row in piece])) for piece in pieces]

    windows: list[list[tuple[int, int]]] = []
    for epoch in range(epochs):
        batches = sampler.epoch_batches(epoch)
        windows.extend([shape for batch in batches[start:start + accum_steps] for shape in micro_batches(batch)]
                       for start in range(0, len(batches), accum_steps))
        if 0 < max_steps <= len(windows):
            return windows[:max_steps]
    return windows


def run_batches_estimate(model: Any, settings: Strategy, windows: Sequence[Sequence[tuple[int, int]]], *,
                         fresh: bool = True, max_grad_norm=1.0, num_labels: int = 2, padded: bool = True) -> int:
    """`estimate_windows` of `settings` over the batches a run will see (`run_windows`), where it sees them.

    The run's peak, not the dataset's worst case: a length-grouped sampler gives its longest batch first,
    before any optimizer state exists, so pricing that batch beside the state (as the planner does, to be
    safe under a budget) describes a moment the run never has. `bounding_windows` keeps the few windows
    that decide it. A causal LM's micro-batches of more than one row are priced padded (`padded`, as
    `estimate` says): dynamic padding pads nearly every one of them.
    """
    return estimate_windows(model, bounding_windows(windows, fresh=fresh), settings, num_labels=num_labels,
                            max_grad_norm=max_grad_norm, padded=padded)["peak_memory_bytes"]


__all__ = ["Candidate", "Levers", "Plan", "PlanError", "Settings", "by_tokens", "parse_size",
           "plan", "run_batches_estimate", "run_windows"]
