"""The plan's first phase, check: `plan`'s arguments checked and resolved into one `Request`, the model prepared.

Every later phase reads the request; none changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

import looptrain.planning.probes as probes
from looptrain.flops import ModelFlops, count_model_flops
from looptrain.lora import is_lora_model
from looptrain.planning.budget import Budget
from looptrain.planning.errors import PlanError
from looptrain.planning.plans import DEFAULT_MARGIN, METERS, Levers, lora_words
from looptrain.precision import resolve_device
from looptrain.strategy import Strategy


@dataclass(frozen=True, eq=False)
class Request:
    """What `plan` was asked, checked and resolved (see `plan` for each argument).

    Attributes beyond `plan`'s own: `budget` (the bytes, the margin and the meter: `Budget`), `meter` (the probes'
    meter, None for the tensors meter), `device_type`, the dataset's `lengths`, `order` (its indices, longest sample
    first: the worst batch), `worst_width`, `num_labels`, `flops` (the model's FLOPs, None for a config) and
    `baseline` resolved (`base` when its split is the effective batch).
    """

    model: Any
    dataset: Any
    collator: Any
    budget: Budget
    effective_batch: int
    base: Strategy
    baseline: Strategy | None
    levers: Levers
    fixed: frozenset
    device: str
    device_type: str
    epochs: int
    max_grad_norm: float | None
    probe: bool
    probe_budget: float | None
    probe_fraction: float
    seed: int
    meter: probes.Meter | None
    make_lean: Callable[[], str | None] | None
    token_micro_batches: bool
    echo: Callable[[str], None]
    lengths: tuple[int, ...]
    order: tuple[int, ...]
    worst_width: int
    num_labels: int
    flops: ModelFlops | None

    @property
    def is_module(self) -> bool:
        """Whether the model is a module (a config or a preset is only estimated)."""
        return isinstance(self.model, nn.Module)

    @property
    def probes(self) -> bool:
        """Whether this plan probes: asked to, with a real model."""
        return self.probe and self.is_module

    @property
    def padded(self) -> bool:
        """Whether a batch of more than one row holding the longest sample is padded (the dataset has shorter ones)."""
        return min(self.lengths) < self.worst_width


def worst_batch_width(lengths: Sequence[int], collator: Any, padding: str) -> int:
    """The width of the dataset's longest padded batch (any batch holding the longest sample)."""
    if padding == "max_length":
        return int(collator.max_length)
    return int(collator.batch_width([max(lengths)]))


def check(model: nn.Module, dataset: Any, collator: Any, *, memory_budget: int, effective_batch: int,
          base: Strategy | None, baseline: Strategy | None, margin: float | None, meter: str | None,
          rss_baseline: int | None, **options: Any) -> Request:
    """The check phase: `plan`'s arguments checked (a `PlanError` names what is wrong), defaults resolved, and the
    model prepared as the run prepares it (the task's own levers, freezing: never changed by the plan, probed as
    they run) and described for the probes' cache before a probe changes what it reads.

    `options`: `plan`'s other keyword arguments, as they are.
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
    is_module = isinstance(model, nn.Module)
    if base.lora_rank and is_module and not is_lora_model(model):
        raise PlanError(f"{lora_words(base)}: pass the wrapped model the run trains (model = "
                        "base.wrap_model(model)): the probes train it as it is")
    if is_module:
        base.prepare_model(model)
        probes.describe_model(model)
    if meter != "tensors" and not (options["probe"] and is_module):
        raise PlanError(f"a budget {METERS[meter]} is checked by probing a real model: pass probe=True, "
                        "or plan for a budget of live tensors (meter='tensors')")
    device_type = resolve_device(options["device"]).type
    margin = DEFAULT_MARGIN.get(device_type, 0.15) if margin is None else margin
    lengths = tuple(int(length) for length in dataset.lengths)
    if baseline is None and base.batch_size * base.accum_steps == effective_batch:
        baseline = base
    config = getattr(model, "config", None)
    fixed = frozenset(options.pop("fixed"))
    return Request(
        model=model, dataset=dataset, collator=collator, budget=Budget(memory_budget, margin, meter),
        effective_batch=effective_batch, base=base, baseline=baseline, fixed=fixed,
        device_type=device_type, meter=probes.Meter(meter, rss_baseline) if meter != "tensors" else None,
        lengths=lengths, order=tuple(sorted(range(len(lengths)), key=lambda index: -lengths[index])),
        worst_width=worst_batch_width(lengths, collator, base.padding),
        num_labels=getattr(model, "num_labels", None) or getattr(config, "num_labels", None) or 2,
        flops=count_model_flops(model) if is_module else None, **options)
