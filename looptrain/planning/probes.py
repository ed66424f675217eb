"""Probes: one real update of the Loop on the worst batch, timed, and measured by the budget's meter.

A probe (`probe`) trains the model in place with the learning rate at 0 and leaves its weights as they were: its
second micro-batch is timed from its `compute_loss` to the optimizer step, the step by the optimizer's hooks, and
under a measured meter (`Meter`: the process's RSS above the start, or CUDA's reserved memory) its peak is what the
process held at its worst. Probes on a CPU are cached on disk beside the estimates (`estimate_cache.probe_key`).

`looptrain.planning.planner` decides which candidates to probe and what their measurements predict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from looptrain.config import LoopConfig
from looptrain.estimation import cache as estimate_cache
from looptrain.gradient_checkpointing import disable_gradient_checkpointing
from looptrain.loop import Loop
from looptrain.memory import allocator
from looptrain.memory.meters import current_rss_bytes, proc_status_bytes, reset_peak_rss
from looptrain.optim import inner_optimizers
from looptrain.planning.errors import PlanError
from looptrain.planning.truncation import (
    BlockClock,
    Truncation,
    hold_set_aside,
    scaled_seconds,
    seconds_plus,
    trainable_numel,
    truncated,
)
from looptrain.precision import resolve_device
from looptrain.strategy import Strategy
from looptrain.tile_sample import sampled_tiles

# A probe read from the cache under the RSS meter: the process may hold at most this more above the start than when
# the probe was measured (the same command holds the same or less; another program may hold more).
PROBE_HELD_TOLERANCE = 32 * 1024**2
# A probe's warm-up micro-batch is the worst batch cut to this many columns that are real tokens in every row: it
# leaves the gradients (their size does not depend on the width) and pays the first-call costs, for a fraction of
# a worst-width micro-batch. Compiled probes warm up at the worst width: that first micro-batch compiles the graph.
PROBE_WARM_UP_WIDTH = 16
# A probe on a CPU computes its head's first two vocabulary tiles and every this-many-th after, and prices the others
# from them (`looptrain.tile_sample`): a tile's work is its rows' share of the head's, its memory the same whichever.
HEAD_TILE_EVERY = 8
# A probe with a ceiling reads its meter at most this often (before and after each module's forward, as each
# gradient is accumulated, before the optimizer's step): the process outgrows the ceiling only by what it allocates
# in between, and the checks stay a small share of the timed worst micro-batch (docs/plan.md, 'How "fits" is
# decided').
CEILING_CHECK_SECONDS = 0.001
# The models being planned, described when `plan` starts (`estimate_cache.model_digest`): the probes' cache keys.
MODEL_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def describe_model(model: nn.Module) -> None:
    """Describes `model` for the probes' cache keys (`MODEL_DIGESTS`), before a probe changes what it reads."""
    MODEL_DIGESTS[model] = estimate_cache.model_digest(model)


class Meter:
    """A measured budget's meter around a probe: the process's RSS above `baseline` (Linux: the kernel's peak
    mark, reset before the probe), or the CUDA caching allocator's peak reserved bytes."""

    def __init__(self, kind: str, baseline: int | None):
        self.kind, self.baseline = kind, baseline or 0

    def reset(self) -> None:
        if self.kind == "cuda_reserved":
            torch.cuda.empty_cache()  # the run starts without the probes' cached blocks
            torch.cuda.reset_peak_memory_stats()
        else:
            _reset_peak_rss()

    def settle(self) -> None:
        """Frees what the work before left: a collection, and under the RSS meter the C heap's free pages given back
        (`allocator.release_freed`). Left resident, a probe's holes are measured by the next probe and held through
        the run (docs/plan.md, 'How "fits" is decided': each probe leaves the heap trimmed)."""
        gc.collect()
        if self.kind == "rss":
            allocator.release_freed()

    def peak(self) -> int:
        if self.kind == "cuda_reserved":
            return int(torch.cuda.max_memory_reserved())
        return max(0, _status_bytes("VmHWM") - self.baseline)  # the process may have returned memory since the start

    def current(self) -> int:
        """What the meter reads now (the RSS above the baseline, or CUDA's reserved bytes)."""
        if self.kind == "cuda_reserved":
            return int(torch.cuda.memory_reserved())
        return current_rss_bytes() - self.baseline


class ProbeStopped(Exception):
    """A probe's meter crossed its ceiling: the candidate does not fit, whatever the rest of its update holds."""


class _Ceiling:
    """Stops a probe once its meter reads above `limit`: checked (at most every `CEILING_CHECK_SECONDS`) before and
    after every module's forward (a checkpointed block's recompute included), as each parameter's gradient is
    accumulated, and before each optimizer step, where the meter must leave room for `step_bytes` (what the step
    allocates, from the estimate: nothing inside the step can stop it). Left to finish, a probe that does not fit can
    take the process past the budget itself, where a container's limit or the OOM killer would end the run while it
    plans."""

    def __init__(self, meter: Meter, limit: int, step_bytes: int = 0):
        self.meter, self.limit, self.step_bytes, self.tripped, self.last = meter, limit, step_bytes, False, 0.0
        self.before_step = False  # tripped by `check_step`: the step would have taken the meter past

    def check(self, *args) -> None:
        now = time.perf_counter()
        if self.tripped or now - self.last < CEILING_CHECK_SECONDS:
            return
        self.last = now
        self._stop_past(0)

    def check_step(self, *args) -> None:
        """Before an optimizer step: the meter with the room the step takes (`step_bytes`), read every time when it
        takes any (else as `check`: the fused step's per-parameter steps run inside backward)."""
        if not self.step_bytes:
            self.check()
        elif not self.tripped:
            self._stop_past(self.step_bytes)

    def _stop_past(self, room: int) -> None:
        if self.meter.current() + room > self.limit:
            self.tripped, self.before_step = True, room > 0
            raise ProbeStopped(f"the probe's meter crossed its ceiling of {self.limit} bytes"
                               + (f" with the {room} bytes the optimizer step takes" if room else ""))

    def watch(self, model: nn.Module) -> list:
        """The hooks that check while a micro-batch runs; remove them after it."""
        hooks = [nn.modules.module.register_module_forward_pre_hook(self.check),
                 nn.modules.module.register_module_forward_hook(self.check)]
        return hooks + [parameter.register_post_accumulate_grad_hook(self.check)
                        for parameter in model.parameters() if parameter.requires_grad]

    def before_steps(self, optimizers) -> list:
        """The hooks that check before each optimizer step; remove them after the probe."""
        return [inner.register_step_pre_hook(self.check_step) for inner in optimizers]


def probe(model: nn.Module, settings: Strategy, batch: dict, device: str, max_grad_norm,
          meter: Meter | None = None, ceiling: int | None = None, step_bytes: int = 0,
          typical: dict | None = None, truncation: Truncation | None = None, memory: bool = True) -> dict:
    """`measure_probe`, or its result read from the on-disk cache when this CPU measured the same probe before.

    `memory` False (the estimate decides the candidate's memory already, `Budget.decides`): the probe times what
    prices the run and measures nothing, where it times a `typical` micro-batch (`timing_only`).

    A probe on a CPU is cached (`estimate_cache.probe_key`: the model, the settings, the batch, the meter, the CPU
    and its threads, the versions); not a compiled one (the compile cache decides its first step), nor on CUDA. A
    cached probe says ``"from_cache": True``. Under the RSS meter it is read only while the process holds at most
    `PROBE_HELD_TOLERANCE` more above the start than when the probe was measured, and its peak moves up by what the
    process holds more now (never down: a rerun that read its first probes from the cache holds less, as their
    first-use memory was never touched). A probe stopped at its `ceiling` is read only for a ceiling no higher: it
    says the peak passes that ceiling, not where it ends.
    """
    if not memory and typical is not None and not settings.compile:
        return timing_only(probe(model, settings, typical, device, max_grad_norm, meter, truncation=truncation))
    settings = as_run(settings, meter)
    truncated_only = {"truncation": truncation} if truncation is not None else {}
    key = probe_key(model, settings, batch, device, max_grad_norm, meter, typical=typical, truncation=truncation)
    if key is None:
        return measure_probe(model, settings, batch, device, max_grad_norm, meter, ceiling, step_bytes, typical=typical,
                             **truncated_only)
    if truncation is not None and meter is not None:
        hold_set_aside(model, truncation.depth)  # held when measured, as when read back: what `held` counts
    held = held_bytes(meter)
    cached = cached_probe(key, held)
    if cached is not None and not (cached.get("stopped") and (ceiling is None or ceiling > cached["ceiling"])):
        return cached
    result = measure_probe(model, settings, batch, device, max_grad_norm, meter, ceiling, step_bytes, typical=typical,
                           **truncated_only)
    estimate_cache.write_probe(key, {**result, "held_bytes": held})
    return result


def timing_only(probed: dict) -> dict:
    """A probe of the typical micro-batch alone (warm-up, the small step, the typical one, the step), read as a
    probe of the candidate whose memory the estimate decides: its typical micro-batch timed, nothing measured. The
    worst batch, which only its memory needed (the run is priced from the small and the typical micro-batches), is
    not run (docs/plan.md, 'What planning costs')."""
    timed = {key: value for key, value in probed.items() if key != "measured_peak_bytes"}
    if timed.get("stopped"):  # a typical micro-batch is no larger than the worst the estimate fits: never expected
        return timed
    return {**timed, "typical_step_seconds": probed["micro_step_seconds"],
            "typical_batch_shape": probed["batch_shape"], "memory": "decided by the estimate"}


def trims(meter: Meter | None) -> bool:
    """Whether runs planned under `meter` trim the C heap before each micro-batch (``trim_heap``), and so their probes:
    a budget of process RSS with glibc's own thresholds, which keep freed blocks resident. A probe measures a fresh
    heap, and a whole run that keeps every earlier micro-batch's freed blocks outgrows the budget its probes kept
    (docs/plan.md, 'Which meter the budget counts')."""
    return meter is not None and meter.kind == "rss" and allocator.keeps_freed()


def as_run(settings: Strategy, meter: Meter | None) -> Strategy:
    """`settings` as a run planned under `meter` trains them, and so as they are probed: trimmed where `trims`."""
    return dataclasses.replace(settings, trim_heap=True) if trims(meter) else settings


def probe_key(model: nn.Module, settings: Strategy, batch: dict, device: str, max_grad_norm,
              meter: Meter | None, typical: dict | None = None, truncation: Truncation | None = None) -> str | None:
    """The probe's cache key, or None when it is not cached (CUDA, a compiled model, a meter other than RSS, a
    model `plan` did not describe when it started). A truncated probe keys on its depth and its shift too."""
    digest = MODEL_DIGESTS.get(model)
    if digest is not None and truncation is not None:
        digest = f"{digest} truncated {truncation}"
    if digest is None or resolve_device(device).type != "cpu" or settings.compile \
            or (meter is not None and meter.kind != "rss"):
        return None
    return estimate_cache.probe_key(digest, settings, batch, max_grad_norm=max_grad_norm,
                                    meter=meter.kind if meter is not None else "tensors",
                                    warm_up_width=PROBE_WARM_UP_WIDTH, allocator=allocator.describe(),
                                    typical=typical, head_tile_every=HEAD_TILE_EVERY)


def held_bytes(meter: Meter | None) -> int:
    """What the process holds above the start now (the RSS meter), after a collection; 0 for other meters."""
    if meter is None or meter.kind != "rss":
        return 0
    meter.settle()
    return max(0, meter.current())


def cached_probe(key: str | None, held: int) -> dict | None:
    """The cached probe under `key`, its measured peak moved by what the process holds more now; None: measure."""
    entry = estimate_cache.read_probe(key) if key is not None else None
    if entry is None:
        return None
    then = entry.pop("held_bytes", 0)
    if "measured_peak_bytes" in entry:
        if held - then > PROBE_HELD_TOLERANCE:
            return None  # the process holds more than when the probe was measured (another program): measure again
        entry["measured_peak_bytes"] = int(entry["measured_peak_bytes"]) + max(0, held - then)
    return {**entry, "from_cache": True}


def measure_probe(model: nn.Module, settings: Strategy, batch: dict, device: str, max_grad_norm,
                  meter: Meter | None = None, ceiling: int | None = None, step_bytes: int = 0,
                  typical: dict | None = None, truncation: Truncation | None = None) -> dict:
    """`_measure_probe`, then what it made freed (`Meter.settle`, or a collection): only once its frame is gone.

    Inside it the probe's Loop and optimizer are still referenced, and a collection there frees nothing; left to the
    collector's oldest generation, a probe's optimizer state outlived the plan and the run carried it to its end
    (docs/plan.md, 'Kernel caches, and a probe's Loop that outlived the plan')."""
    started = time.perf_counter()
    try:
        if truncation is None:
            result = _measure_probe(model, settings, batch, device, max_grad_norm, meter, ceiling, step_bytes, typical)
        else:
            result = _measure_truncated(model, settings, batch, device, max_grad_norm, meter, ceiling, step_bytes,
                                        typical, truncation)
    finally:
        if meter is not None:
            meter.settle()  # the next probe, and the run, start without this one's memory or its freed blocks
        else:
            gc.collect()
    return {**result, "probe_seconds": time.perf_counter() - started}  # the settling is the probe's time too


@dataclass(frozen=True)
class _Windows:
    """The updates a probe runs (`windows`, each a list of micro-batches): its warm-up micro-batch, the typical one
    it times (None: none), and the worst batch's place in the last window, from 1 (`worst`)."""

    windows: list[list[dict]]
    warm_up: dict
    typical: dict | None
    worst: int

    @property
    def armed_at(self) -> int:
        """The worst batch's place among all the probe's micro-batches, from 1: where the ceiling is armed."""
        return sum(map(len, self.windows[:-1])) + self.worst


def _probe_windows(settings: Strategy, batch: dict, typical: dict | None) -> _Windows:
    """The probe's updates (see `_measure_probe`). A window of micro-batches runs the warm-up twice: the second time,
    warm, it is timed too (`small_step_seconds`), so that the planner tells a micro-batch's fixed cost from its work.
    The typical micro-batch runs after the worst batch: the worst meets the heap as a probe without one did, and a
    probe stopped at its ceiling by the worst batch does not pay for the typical one. A window of one micro-batch
    (no accumulation, the fused step) times the typical one as an update of its own, between the warm-up and `batch`:
    every micro-batch is then an update."""
    warm_up = batch if settings.compile else warm_up_batch(batch, PROBE_WARM_UP_WIDTH)
    typical = typical if typical is not None and warm_up is not batch \
        and batch_shape(typical) not in (batch_shape(warm_up), batch_shape(batch)) else None
    if min(settings.accum_steps, 2) == 1:
        windows = [[warm_up], *([[typical]] if typical is not None else []), [batch]]
        return _Windows(windows, warm_up, typical, len(windows[-1]))
    windows = [[warm_up, warm_up, batch, *([typical] if typical is not None else [])] if warm_up is not batch
               else [warm_up, batch]]
    return _Windows(windows, warm_up, typical, len(windows[-1]) - (typical is not None))


class _Watch:
    """A probe's clock and its ceiling's hooks: marks each micro-batch's `compute_loss` and each optimizer step's
    start and end, and arms the ceiling (`_Ceiling`) for the worst batch and the step after it, where the update
    peaks (the warm-up holds less; the checks would slow the small micro-batch's timing more than the worst's)."""

    def __init__(self, model: nn.Module, guard: _Ceiling | None, armed_at: int):
        self.model, self.guard, self.armed_at = model, guard, armed_at
        self.marks: list[tuple[str, float]] = []  # ("loss" | "step" | "stepped", when)
        self.optimizers: list = []
        self.hooks: list = []
        self.watching: list = []
        self.micro_batches = 0

    def mark_steps(self, optimizers: list) -> None:
        """Marks each step of `optimizers` (the Loop's inner optimizers)."""
        self.optimizers = optimizers
        for inner in optimizers:
            self.hooks.append(inner.register_step_pre_hook(lambda *args: self._mark("step")))
            self.hooks.append(inner.register_step_post_hook(lambda *args: self._mark("stepped")))

    def _mark(self, kind: str) -> None:
        self.marks.append((kind, time.perf_counter()))

    def on_loss(self) -> None:
        """Before each micro-batch's `compute_loss`."""
        self._mark("loss")
        self.micro_batches += 1
        if self.guard is not None and self.micro_batches == self.armed_at:
            self.watching.extend(self.guard.watch(self.model))
            self.hooks.extend(self.guard.before_steps(self.optimizers))
            self.guard.check()  # the warm-up may have passed it already
        elif self.watching:  # the typical micro-batch, after the worst: smaller, untimed by the checks
            for hook in self.watching:
                hook.remove()
            self.watching.clear()
            # The worst batch's gradients are what the step meets: a probe whose step would pass its ceiling stops
            # now, without paying for the typical micro-batch (its step is checked again before it runs).
            self.guard.check_step()

    def window(self, loop: Loop, window: list[dict], fused: bool) -> tuple[list[float], float]:
        """Runs one update and returns its micro-batches' and optimizer steps' seconds (`_window_seconds`)."""
        self.marks.clear()
        loop.run_update(window)
        return _window_seconds(self.marks, time.perf_counter(), fused)

    def starts(self) -> list[float]:
        """When each micro-batch of the last update started (its `compute_loss`)."""
        return _loss_starts(self.marks)

    def remove(self) -> None:
        for hook in self.hooks + self.watching:
            hook.remove()


class _TimedLoop(Loop):
    """The probe's Loop: its `compute_loss` tells the probe's `_Watch` first (`on_loss`)."""

    def __init__(self, *args, on_loss: Callable[[], None], **kwargs):
        self._on_loss = on_loss
        super().__init__(*args, **kwargs)

    def compute_loss(self, batch):
        self._on_loss()
        return super().compute_loss(batch)


def _measure_truncated(model: nn.Module, settings: Strategy, batch: dict, device: str, max_grad_norm,
                       meter: Meter | None, ceiling: int | None, step_bytes: int, typical: dict | None,
                       truncation: Truncation) -> dict:
    """`_measure_probe` on `truncation.depth` of the model's blocks, scaled to the whole stack
    (`looptrain.planning.truncation`): the micro-batches by their blocks' seconds, the optimizer step by the trainable
    parameters, the peak by the estimate's `shift_bytes` less the set-aside blocks' tensors the process holds
    (`hold_set_aside`; the ceiling too, and the step's bytes by the parameters)."""
    whole = trainable_numel(model)
    shift = truncation.shift_bytes
    if meter is not None:  # the meter counts the set-aside blocks' weights: the shift prices them too
        shift = max(0, shift - hold_set_aside(model, truncation.depth))
    with truncated(model, truncation.depth) as blocks:
        clock = BlockClock(blocks)
        ratio = whole / max(1, trainable_numel(model))
        try:
            result = _measure_probe(model, settings, batch, device, max_grad_norm, meter,
                                    None if ceiling is None else ceiling - shift,
                                    int(step_bytes / ratio), typical, (clock, truncation, ratio))
        finally:
            clock.remove()
    if "measured_peak_bytes" in result:
        result["measured_peak_bytes"] += shift
    if result.get("stopped"):
        result["ceiling"] = ceiling
    if "before_step_bytes" in result:
        result["before_step_bytes"] = step_bytes
    return {**result, "truncated": {"depth": truncation.depth, "blocks": truncation.blocks,
                                    "shift_bytes": truncation.shift_bytes}}


def _measure_probe(model: nn.Module, settings: Strategy, batch: dict, device: str, max_grad_norm,
                   meter: Meter | None, ceiling: int | None, step_bytes: int, typical: dict | None,
                   scaling: tuple | None = None) -> dict:
    """One update of the Loop on `batch` (two when it has one micro-batch), learning rate 0, timed.

    An accumulating split's update is one window of micro-batches, as in the estimator: from the second micro-batch
    on, the gradients of the first are held beside the activations, which is where an accumulating run peaks. The
    first micro-batch is the warm-up (first-call costs, the gradients to hold): `batch` cut to `PROBE_WARM_UP_WIDTH`
    columns (`warm_up_batch`), since the gradients' size does not depend on the width. It runs again, warm, and is
    timed (`small_step_seconds`, `small_batch_shape`): beside a larger timed micro-batch, it tells what a
    micro-batch costs whatever its size from what its work costs. `typical`, a micro-batch of the run's mean work, is
    timed too (`typical_step_seconds`, `typical_batch_shape`): the run is priced from it, as the worst batch's time
    per FLOP is no run's (docs/plan.md, 'How "fastest" is decided'); it runs after `batch` (`_probe_windows`), and
    not at all when the probe stops at `batch`. `batch` is timed from its `compute_loss` to the optimizer step (the
    new width's kernel selection included, as a run of dynamic widths pays it), and the step by the optimizer's
    hooks (its first step: state creation included). Returns the seconds per micro-step and per optimizer step, and
    with `meter` the peak it measured over the whole probe (warm-up included: the run pays its first-call costs too).

    With `meter` and a `ceiling` (bytes by that meter), the probe stops as soon as the meter reads above it, from
    the worst batch on (`_Ceiling`): the result then says ``"stopped": True`` and holds the ceiling and the peak
    measured when it stopped (past it, or with ``"before_step_bytes"`` before an optimizer step of `step_bytes`
    that would have taken it past), but no timings. `scaling` (`_measure_truncated`): the micro-batches' seconds and
    the step's are scaled to the whole stack of blocks. On a CPU a causal LM's chunked head computes a sample of its
    vocabulary tiles (`HEAD_TILE_EVERY`, `looptrain.tile_sample`), and each micro-batch's seconds get the skipped
    tiles' seconds back (``"head_tiles_sampled"`` says so).
    """
    plan = _probe_windows(settings, batch, typical)
    config = LoopConfig(**settings.loop_fields() | {"accum_steps": len(plan.windows[0])}, max_grad_norm=max_grad_norm,
                        device=device, track_memory=False, progress_bar=False, eval_every="no", log_every=10**9)
    # bf16 weights: the Loop casts the model in place; its fp32 tensors are set aside and put back after.
    stash = _fp32_stash(model) if settings.weights == "bf16" else {}
    stashed = sum(tensor.numel() * tensor.element_size() for tensor in stash.values())
    if meter is not None:
        meter.settle()
        meter.reset()
    optimizer = settings.build_optimizer(model, 0.0)
    guard = _Ceiling(meter, ceiling + stashed, step_bytes) if meter is not None and ceiling is not None else None
    watch = _Watch(model, guard, plan.armed_at)
    loop = _TimedLoop(model, optimizer, [], config=config, on_loss=watch.on_loss)
    watch.mark_steps(inner_optimizers(loop.optimizer))
    timed: list[tuple[list[float], float]] = []  # per update: `_window_seconds`
    sampling = sampled_tiles(HEAD_TILE_EVERY) if resolve_device(device).type == "cpu" else contextlib.nullcontext()
    try:
        with sampling as sample:
            for window in plan.windows:
                seconds, optimizer_seconds = watch.window(loop, window, settings.optimizer_in_backward)
                starts = watch.starts()
                if sample is not None:  # the head's skipped tiles, in the micro-batch they fell in
                    seconds = seconds_plus(seconds, starts, sample.seconds_within)
                if scaling is not None:
                    clock, truncation, ratio = scaling
                    seconds = scaled_seconds(seconds, starts, clock, truncation)
                    optimizer_seconds *= ratio
                timed.append((seconds, optimizer_seconds))
    except Exception:
        if guard is None or not guard.tripped:  # autograd may re-raise a hook's exception as its own
            raise
    finally:
        watch.remove()
        if hasattr(loop.optimizer, "remove"):  # the wrappers' hooks (fused step, fp32 accumulation)
            loop.optimizer.remove()
        disable_gradient_checkpointing(model)
        loop.optimizer.zero_grad(set_to_none=True)  # the wrappers' zero_grad drops fp32 buffers too
        del loop, optimizer
        _restore_stash(model, stash)
    peak = meter.peak() - stashed if meter is not None else None  # the fp32 tensors set aside: not the run's
    measured = {"tokens": int(batch["input_ids"].numel()), "batch_shape": batch_shape(batch)}  # + `probe_seconds`
    if guard is not None and guard.tripped:
        return {"stopped": True, "ceiling": ceiling, "measured_peak_bytes": max(peak, ceiling + 1),
                **({"before_step_bytes": step_bytes} if guard.before_step else {}), **measured}
    sampled = {"head_tiles_sampled": HEAD_TILE_EVERY} if sample is not None and sample.added else {}
    return {**_timings(settings, plan, timed), **({"measured_peak_bytes": peak} if peak is not None else {}),
            **sampled, **measured}


def _timings(settings: Strategy, plan: _Windows, timed: list[tuple[list[float], float]]) -> dict:
    """A whole probe's timings from its updates' seconds (`timed`): the worst batch's micro-step and the optimizer
    step of the last update, the compile time, the warm-up's second run, the typical micro-batch."""
    worst = plan.worst
    seconds, optimizer_seconds = timed[-1]  # the last window's: the worst batch's, and the typical one after it
    micro_step = seconds[worst - 1]
    result = {"micro_step_seconds": micro_step, "optimizer_step_seconds": max(optimizer_seconds, 0.0)}
    if settings.compile and worst >= 2:  # the first micro-batch compiled the graph: what the run pays too
        result["compile_seconds"] = max(sum(seconds[:worst - 1]) - micro_step, 0.0)
    if worst >= 3:  # the warm-up's second run
        result["small_step_seconds"] = seconds[1]
        result["small_batch_shape"] = batch_shape(plan.warm_up)
    if plan.typical is not None:  # after the worst batch, or (one micro-batch an update) the second update
        result["typical_step_seconds"] = seconds[worst] if min(settings.accum_steps, 2) == 2 else timed[1][0][0]
        result["typical_batch_shape"] = batch_shape(plan.typical)
    return result


def _window_seconds(marks: list[tuple[str, float]], ended: float, fused: bool) -> tuple[list[float], float]:
    """One update's micro-batches, each timed from its `compute_loss` to the next one's (the last one: to the
    optimizer step, or to the update's end, `ended`, where the steps run inside backward: `fused`), and its
    optimizer steps' seconds (from their hooks' marks)."""
    starts = _loss_starts(marks)
    steps = [(kind, when) for kind, when in marks if kind in ("step", "stepped") and when > starts[-1]]
    if fused or not steps:
        stepping, optimizer_seconds = ended, 0.0
    else:
        stepping = min(when for _, when in steps)
        optimizer_seconds = sum(when if kind == "stepped" else -when for kind, when in steps)
    return [end - start for start, end in zip(starts, [*starts[1:], stepping])], optimizer_seconds


def _loss_starts(marks: list[tuple[str, float]]) -> list[float]:
    """When each micro-batch among `marks` started (its `compute_loss`), in order."""
    return sorted(when for kind, when in marks if kind == "loss")


def batch_shape(batch: dict) -> list[int]:
    """A batch's `[rows, width]`: the shape of its `input_ids`."""
    return list(batch["input_ids"].shape)


def warm_up_batch(batch: dict, width: int) -> dict:
    """`batch` cut to its first `width` columns that are real tokens in every row (right or left padding alike),
    in every tensor as wide as its ``input_ids``; `batch` itself when it is no wider or has fewer such columns."""
    input_ids = batch.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] <= width:
        return batch
    full = input_ids.shape[1]
    mask = batch.get("attention_mask")
    real = mask.bool().all(dim=0) if isinstance(mask, torch.Tensor) and mask.shape == input_ids.shape \
        else torch.ones(full, dtype=torch.bool)
    columns = real.nonzero().flatten()[:width]
    if len(columns) < width:
        return batch
    return {name: value.index_select(1, columns) if isinstance(value, torch.Tensor) and value.dim() >= 2
            and value.shape[1] == full else value for name, value in batch.items()}


def _fp32_stash(model: nn.Module) -> dict:
    """The model's floating-point parameters' and buffers' tensors, kept to undo a probe's bf16 cast."""
    stash = {}
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor.is_floating_point():
                stash[(module, name)] = tensor.data
    return stash


def _restore_stash(model: nn.Module, stash: dict) -> None:
    """Puts the stashed tensors back (parameters keep their identity)."""
    for (module, name), data in stash.items():
        if name in module._parameters:
            module._parameters[name].data = data
        else:
            module._buffers[name] = data


def _status_bytes(field: str) -> int:
    """A `/proc/self/status` memory figure (VmRSS, VmHWM) in bytes."""
    try:
        return proc_status_bytes(field)
    except OSError as error:
        raise PlanError(f"{error}: a budget of process RSS needs Linux") from error


def _reset_peak_rss() -> None:
    """Sets the kernel's peak RSS mark (VmHWM) to the current RSS (Linux 4.0+)."""
    try:
        reset_peak_rss()
    except OSError as error:
        raise PlanError(f"cannot reset the peak RSS mark ({error}): "
                        "a budget of process RSS needs Linux 4.0+") from error


def rss_baseline_bytes() -> int:
    """The process's resident set size now, from ``VmRSS``, as `plan(rss_baseline=...)` counts it.

    Unlike `looptrain.memory.current_rss_bytes` (which falls back to the peak), it has no fallback.

    Raises:
        PlanError: not Linux (a budget of process RSS needs it).
    """
    return _status_bytes("VmRSS")
