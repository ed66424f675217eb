"""`lowest`: the full fine-tune with the lowest estimated peak (``--lowest``), by the planner's memoised estimates.

A coordinate search over the levers that keep the task and the math, at one micro-batch and sequence length; it
trains nothing and probes nothing (`looptrain.planning.planner.plan` does, under a budget).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from looptrain import strategy as strategies
from looptrain.estimation.shapes import is_causal_lm_config, named_config
from looptrain.planning.book import EstimateBook
from looptrain.planning.errors import PlanError
from looptrain.planning.search import CHECKPOINT_MODES, valid_settings
from looptrain.precision import cpu_bf16_is_fast, cpu_bf16_speed_line, cpu_has_native_bf16
from looptrain.strategy import Strategy

__all__ = ["EXACT_LEVERS", "TASK_LEVERS", "ROWS_LEVER", "Lowest", "lowest", "untied_head"]

# Task-changing levers: never searched by `lowest` (a full fine-tune of the whole sequence).
TASK_LEVERS = ("freeze_embeddings", "freeze_layers", "freeze_encoder")
# Math-preserving levers `lowest` tries beside the ones it names, when the strategy class has them (a lever
# added later, e.g. chunked cross-entropy): field -> values to try (None: every value its choices or its bool
# type allow). A lever whose metadata says ``math_preserving=True`` (or ``exact=True``) is tried too.
EXACT_LEVERS: dict[str, tuple | None] = {"chunked_ce": None, "chunked_cross_entropy": None, "ce_chunks": (8,),
                                         "loss_chunks": (8,), "cross_entropy_chunks": (8,)}


# The lever that steps an untied head, the input embedding and the linear layers by rows inside the fused step,
# and the optimizers (`looptrain.optim` names) whose step it can take by rows.
ROWS_LEVER = "step_by_rows"
ROWS_LEVER_OPTIMIZERS = ("adamw", "adafactor", "sgd")


def untied_head(model_or_config: Any) -> bool:
    """Whether a model (a module, a config, a preset name or a model directory) has an LM head of its own, not tied
    to its input embedding: what `ROWS_LEVER` needs (a causal LM's config: ``tie_word_embeddings`` False)."""
    if isinstance(model_or_config, nn.Module):
        get_head, get_embedding = (getattr(model_or_config, name, None)
                                   for name in ("get_output_embeddings", "get_input_embeddings"))
        head = get_head() if callable(get_head) else None
        embedding = get_embedding() if callable(get_embedding) else None
        return isinstance(head, nn.Linear) and getattr(embedding, "weight", None) is not head.weight
    config = named_config(model_or_config, 2) if isinstance(model_or_config, str) else model_or_config
    return is_causal_lm_config(config) and getattr(config, "tie_word_embeddings", True) is False


@dataclass
class Lowest:
    """`lowest`'s result: the strategy with the lowest estimated peak, its estimate, and every strategy tried."""

    settings: Strategy
    estimate: dict
    tried: list[tuple[Strategy, int]]  # (strategy, estimated peak bytes), in the order estimated
    estimates: int
    estimate_seconds: float
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """JSON-ready: ``estimated_peak_bytes``, ``settings`` (the strategy as a dict and its flags), the breakdown."""
        return {
            "estimated_peak_bytes": self.estimate["peak_memory_bytes"],
            "settings": {"strategy": dataclasses.asdict(self.settings), "flags": self.settings.flags()},
            "memory_meter": self.estimate["memory_meter"],
            "memory_breakdown": self.estimate["memory_breakdown"],
            "phase_peak_bytes": self.estimate["phase_peak_bytes"],
            "parameters": self.estimate["parameters"],
            "trainable_parameters": self.estimate["trainable_parameters"],
            "extrapolated": self.estimate.get("extrapolated"),
            "extrapolation": self.estimate.get("extrapolation"),
            "tried": [{"flags": settings.flags(), "estimated_peak_bytes": peak} for settings, peak in self.tried],
            "estimates": self.estimates,
            "estimate_seconds": round(self.estimate_seconds, 3),
            "notes": self.notes,
        }


def lowest(model_or_config: Any, batch_size: int, seq_len: int, base: Strategy | None = None, *,
           fixed: Sequence[str] = (), native_bf16: bool | None = None, max_grad_norm: float | None = 1.0,
           num_labels: int = 2, echo: Callable[[str], None] = lambda line: None, device: str = "cpu",
           extrapolate: bool = True) -> Lowest:
    """The full fine-tune with the lowest estimated peak at ``batch_size x seq_len``: levers that keep the task.

    A coordinate search over the levers that keep the task and the math, one lever at a time, each kept at
    the value with the lowest estimate before the next is searched (the planner's memoised `estimate` at
    the worst batch): the numerics (fp32; bf16 autocast and bf16 weights where the CPU computes bf16
    natively), the optimizer (adamw, adamw8bit when bitsandbytes is installed, adafactor), every lever of
    `EXACT_LEVERS` (or marked ``math_preserving``) the strategy has (a tie keeps it on), and last gradient
    checkpointing jointly with the step fused into backward (without accumulation): what either saves
    depends on where the other puts the peak; the fused step comes with `ROWS_LEVER` (the untied head, the
    input embedding and the linear layers stepped by rows, never whole) where the head is untied (`untied_head`)
    and the optimizer can step rows. Otherwise, among equal estimates the value listed first (fp32,
    no checkpointing, no fused step) is kept. The split (``batch_size``, ``accum_steps``) is kept; freezing
    and the sequence length are never changed.

    Args:
        model_or_config: what `estimate` takes (a config, a preset name, a directory, a module).
        batch_size: the micro-batch (`base.accum_steps` micro-batches per update).
        seq_len: tokens per row.
        base: the starting strategy (default `Strategy(batch_size=batch_size)`); its freezing levers must be off.
        fixed: names of fields the user set: kept as `base` has them.
        native_bf16: plan for a CPU with (True) or without (False) native bf16; None: this CPU (bf16 tried where
            oneDNN reports it; a note says when its matmuls measured slower than fp32's here).
        max_grad_norm, num_labels, device: as in `estimate` (``device="cuda"``: bf16 is native there).
        echo: prints one line per estimate.
        extrapolate: as in `estimate` (False: every estimate runs the whole model).

    Raises:
        PlanError: `base` freezes something (not a full fine-tune).
    """
    base = dataclasses.replace(base or Strategy(), batch_size=batch_size)
    frozen = [name for name in TASK_LEVERS if getattr(base, name) != Strategy.__dataclass_fields__[name].default]
    if frozen:
        raise PlanError(f"the lowest full fine-tune freezes nothing: drop {', '.join(frozen)}")
    fixed = set(fixed)
    on_cuda = torch.device(device).type == "cuda"
    this_cpu = native_bf16 is None and not on_cuda
    if native_bf16 is None:  # bf16 is tried for its memory where it is not emulated; a note says when it is slow
        native_bf16 = on_cuda or cpu_has_native_bf16()
    search = EstimateBook(model_or_config, seq_len, max_grad_norm=max_grad_norm, num_labels=num_labels, echo=echo,
                          device_type="cuda" if on_cuda else "cpu", extrapolate=extrapolate)
    numerics = [{"precision": "fp32", "weights": "fp32"}]
    if native_bf16:
        numerics += [{"precision": "bf16", "weights": "fp32"}, {"precision": "bf16", "weights": "bf16"}]
    optimizers = ["adamw", "adafactor"]
    if importlib.util.find_spec("bitsandbytes") is not None:
        optimizers.insert(1, "adamw8bit")
    # Each dimension: its choices, and whether a tie goes to the later (lighter) choice. A lever that saves
    # nothing where the peak is now may save much once another lever moves the peak: the fused step saves
    # nothing while the peak is in backward before any gradient exists, and checkpointing nothing while it is
    # in the optimizer step. So the math-preserving extras win ties, and checkpointing is searched last,
    # jointly with the fused step (none, every other block, all; each without and with it).
    dimensions = [(numerics, False), ([{"optimizer": name} for name in optimizers], False)]
    dimensions += [([{name: value} for value in values], True) for name, values in _exact_levers(type(base)).items()]
    # The fused step steps weights by rows where it can (`ROWS_LEVER`): never more memory.
    by_rows = ROWS_LEVER in {spec.name for spec in strategies.levers(type(base))} and ROWS_LEVER not in fixed \
        and untied_head(model_or_config)
    dimensions.append(([{"gradient_checkpointing": on, "checkpoint_every": every, "optimizer_in_backward": fused,
                         **({ROWS_LEVER: True} if fused and by_rows else {})}
                        for on, every in CHECKPOINT_MODES for fused in (False, True)], False))
    started, current, tried = time.perf_counter(), base, []
    seen: set = set()
    for choices, lighter_wins_ties in dimensions:
        options = []
        for choice in choices:
            if any(name in fixed and getattr(base, name) != value for name, value in choice.items()):
                continue  # the user set it
            settings = dataclasses.replace(current, **choice)
            if choice.get(ROWS_LEVER) and (current.optimizer not in ROWS_LEVER_OPTIMIZERS
                                            or not valid_settings(settings)):  # e.g. the chunked CE off
                settings = dataclasses.replace(settings, **{ROWS_LEVER: getattr(current, ROWS_LEVER)})
            if valid_settings(settings):
                options.append(settings)
        if current not in options:
            options.insert(0, current)
        for settings in options:
            if search.key(settings) not in seen:
                seen.add(search.key(settings))
                tried.append((settings, search.peak(settings)))
        ranks = {id(settings): -index if lighter_wins_ties else index for index, settings in enumerate(options)}
        current = min(options, key=lambda settings: (search.peak(settings), ranks[id(settings)]))
    notes = [] if native_bf16 else ["planned for a CPU without native bf16: bf16 autocast and bf16 weights "
                                    "(emulated there, several times slower) were not tried"]
    if this_cpu and "bf16" in (current.precision, current.weights) and not cpu_bf16_is_fast():
        notes.append(f"bf16 chosen for memory, not speed: {cpu_bf16_speed_line()}")
    if base.accum_steps > 1:
        notes.append("accumulation: the step fused into backward (no accumulation) was not tried")
    return Lowest(current, search.results[search.key(current)], tried, search.count, time.perf_counter() - started,
                  notes)


def _exact_levers(cls: type) -> dict[str, tuple]:
    """The math-preserving levers of `cls` beyond the searched ones, with the values to try (default first)."""
    found = {}
    for spec in strategies.levers(cls):
        meta = spec.metadata["lever"]
        if spec.name not in EXACT_LEVERS and not (meta.get("math_preserving") or meta.get("exact")):
            continue
        values = EXACT_LEVERS.get(spec.name) or meta["choices"] or ((False, True) if isinstance(spec.default, bool)
                                                                      else None)
        if values:
            found[spec.name] = (spec.default, *(value for value in values if value != spec.default))
    return found
