"""What a plan is made of: the budget's units and meters, the levers allowed (`Levers`), a candidate's settings and
measures (`Candidate`), and the plan itself with its table and JSON (`Plan`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from looptrain.planning.errors import PlanError
from looptrain.strategy import Strategy

GIB = 1024**3

# The share of the budget kept free above the estimate. CPU: more than the estimate's error against the tensor
# tracker on every mix of estimation.ACCURACY_MIXES (docs/memory.md), with room for batches the estimate shapes
# differently. CUDA: the caching allocator rounds and fragments, and kernels take workspaces the estimate does not
# see; the larger share covers them, unchecked here (docs/plan.md, 'How "fits" is decided').
DEFAULT_MARGIN = {"cpu": 0.05, "cuda": 0.15}

# What a budget counts, by `plan(meter=...)`, and how the plan names it.
METERS = {"tensors": "of live tensors", "rss": "of process RSS above the start",
          "cuda_reserved": "of CUDA reserved memory"}

# Planning's time is 5% of the run (`probe_fraction`), but at least this many seconds, probes included: the search
# of a small run would otherwise stop at its first estimates.
MIN_PLANNING_SECONDS = 10.0
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


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


@dataclass
class Candidate:
    """One strategy, its estimate at the worst batch and its speed (measured, or a prior)."""

    settings: Strategy
    estimated_peak_bytes: int
    padded_tokens: int = 0  # an epoch's padded tokens under these settings' batching
    micro_batches: int = 0  # an epoch's micro-batches under these settings' batching
    # The epoch's micro-batch of mean work, (rows, padded width): its probe times one, which the run's micro-batches
    # are priced from (`ranking.micro_batch_costs`); None when not known (the probe then prices by its worst batch).
    typical_shape: tuple[int, int] | None = None
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
    predicted: bool = False  # `estimated_peak_bytes` predicted from two estimates of its settings (`Search.predict`)
    # What its optimizer step allocates beyond what is alive before it (`Search.step_bytes`): a probe with a ceiling
    # stops before a step that would take it past, as nothing inside the step can stop it.
    step_bytes: int = 0
    # How its probe runs the model (`truncation.Truncation`: on a truncated stack of blocks, scaled), None: whole.
    truncation: Any = None

    def record(self, probe: dict, seconds_per_epoch: float | None = None) -> None:
        """Its probe's measurements, and the epoch's time they predict (None: no time measured, the prior's stands)."""
        self.probe, self.probed = probe, True
        if seconds_per_epoch is not None:
            self.seconds_per_epoch = seconds_per_epoch

    def predict(self, seconds_per_epoch: float) -> None:
        """Its epoch's time predicted without its own probe: the prior, scaled to the probes or alone."""
        self.seconds_per_epoch = seconds_per_epoch

    def mark_baseline(self, baseline: bool) -> None:
        """Whether it is the configuration the run would train without the planner."""
        self.baseline = baseline

    def realise(self, as_run: Callable[[Strategy], Strategy] = lambda settings: settings) -> None:
        """Its settings become what the run trains: `trained` where it is cut by tokens, as `as_run` trains them."""
        self.settings = as_run(self.trained if self.trained is not None else self.settings)
        self.trained = None


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
    malloc_threshold_bytes: int | None = None  # the mmap threshold it left fixed (`allocator.fixed_threshold`)
    # Planning's time as its budget counts it: each estimate and probe at what it cost when computed, a cached one at
    # its recorded cost, so that a rerun reading them from the cache takes the same decisions in less time.
    charged_seconds: float = 0.0
    baseline_words: str = "your flags"  # the baseline candidate: the user's flags, or "safe default" (the lightest)
    # A LoRA plan: the winner against the full fine-tune with its settings (`lora_comparison`); None otherwise.
    lora: dict | None = None
    predictions: int = 0  # splits the search decided by a prediction from two estimates (`Search.predict`)
    overhead_bytes: int = 0  # under a measured meter: what the fit rule charged each estimate besides tensors
    # Evaluation inside the budget (`evaluation.evaluation_batch`): its batch and estimated peak; None: no evaluation.
    evaluation_batch_size: int | None = None
    evaluation_peak_bytes: int | None = None

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
                 + (f", {lora_words(self.winner.settings)} (kept)" if self.winner.settings.lora_rank else "") + ":",
                 "| rank | micro-batch x accum | precision | optimizer | checkpointing | fused step | grouping | "
                 "est. peak | samples/s | speed from |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for rank, candidate in enumerate(self.candidates[:top], 1):
            settings = candidate.settings
            measured = any(c.probed for c in self.candidates)  # without probes the prior has no unit
            speed = f"{self.num_samples / candidate.seconds_per_epoch:.1f}" if measured else "-"
            source = ("line of a probe alike" if candidate.probe.get("line_only") else "probe (cached)"
                      if candidate.probe.get("from_cache") else "probe") if candidate.probed \
                else "prior, scaled to the probes" if measured else "prior only"
            marks = ", ".join(mark for mark, on in (("winner", rank == 1), (self.baseline_words, candidate.baseline))
                              if on)
            lines.append(
                f"| {rank}{f' ({marks})' if marks else ''} | {split_words(settings)} | "
                f"{settings.precision}{' + bf16 weights' if settings.weights == 'bf16' else ''} | "
                f"{settings.optimizer} | {settings.checkpointing} | "
                f"{'yes' if settings.optimizer_in_backward else 'no'} | "
                f"{'yes' if settings.group_by_length else 'no'}"
                f"{', batches packed' if settings.batch_packing == 'on' else ''} | "
                f"{format_bytes(candidate.estimated_peak_bytes)}{' (predicted)' if candidate.predicted else ''} | "
                f"{speed} | "
                f"{source} |")
        lines.append(f"{len(self.candidates)} candidates fit; planning {self.planning_seconds:.1f} s: "
                     f"{self.estimates} estimates in {self.estimate_seconds:.1f} s"
                     + (f" ({self.cached_estimates} of them read from the cache)" if self.cached_estimates else "")
                     + (f", {self.predictions} splits predicted from them" if self.predictions else "")
                     + f", probes {self.probe_seconds:.1f} s"
                     + (f" ({self.probe_budget_seconds:.0f} s left for probes beyond the baseline's and the "
                        "favourite's)" if self.probe_budget_seconds is not None else ""))
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
            "growth_bytes": self.growth_bytes, "overhead_bytes": self.overhead_bytes, "malloc": self.malloc,
            "evaluation_batch_size": self.evaluation_batch_size,
            "estimated_evaluation_peak_bytes": self.evaluation_peak_bytes,
            "malloc_threshold_bytes": self.malloc_threshold_bytes,
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


def estimate_seconds(total: float, first_probe_seconds: float, floor: float, spent: float | None = None) -> float:
    """Planning's time left for the estimates: `total` (5% of the run, or the probe budget), at least `floor`, less
    the probes made before the search (`spent`; default: one, the first probe) and as much as the first probe again
    for the probe of the search's favourite, which follows the search. (Under a measured meter, the probe of a
    candidate that stands in for a favourite measured over the budget is not reserved: when one is needed, planning
    ends past its time by that probe.)"""
    return max(total, floor) - (first_probe_seconds if spent is None else spent) - first_probe_seconds


def lora_words(settings: Strategy) -> str:
    """``LoRA r 16`` or ``QLoRA r 16``."""
    return f"{'QLoRA' if settings.qlora else 'LoRA'} r {settings.lora_rank}"
