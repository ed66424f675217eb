"""Memory meters: the peak of a real run, with its breakdown and phase, named by what measured it.

- `CpuTensorMeter` ("cpu_tensor_tracker"): the `StorageTracker`'s peak of live tensor bytes, plus
  the process peak RSS as a cross-check; with `track_tensors=False` ("cpu_rss_delta") the RSS rise
  above the baseline plus the tensors alive at the start.
- `CudaMeter` ("cuda_max_memory_allocated"): the caching allocator's `max_memory_allocated` after
  `reset_peak_memory_stats`, with `max_memory_reserved` beside it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from looptrain.memory.tracker import (
    CATEGORY_GRADS,
    CATEGORY_OPTIMIZER,
    CATEGORY_PARAMS,
    StorageTracker,
    gradient_bytes,
    optimizer_state_tensors,
    parameter_bytes,
)
from looptrain.optim import inner_optimizers, optimizer_state_bytes

MIB = 1024 * 1024


def current_rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return peak_rss_bytes()


def proc_status_bytes(field: str) -> int:
    """A memory figure of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes.

    Raises:
        OSError: no such file or field (not Linux).
    """
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


_PEAK_BEFORE_RESET = 0  # the highest VmHWM this process had when `reset_peak_rss` last cleared it


def reset_peak_rss(forget: bool = False) -> None:
    """Sets the kernel's peak RSS mark (``VmHWM``) to the current RSS (Linux 4.0+; OSError elsewhere).

    The mark it clears is kept: `peak_rss_bytes` still reports the process's whole peak. With `forget` (a
    benchmark's baseline, taken after the imports) it is not: the process's peak counts from now.
    """
    global _PEAK_BEFORE_RESET
    _PEAK_BEFORE_RESET = 0 if forget else max(_PEAK_BEFORE_RESET, proc_status_bytes("VmHWM"))
    with open("/proc/self/clear_refs", "w", encoding="utf-8") as clear_refs:
        clear_refs.write("5")


def peak_rss_bytes() -> int:
    """The process's peak RSS since it started: ``VmHWM`` on Linux (with the marks `reset_peak_rss` cleared),
    else ``getrusage`` (KiB on Linux, bytes on macOS).

    Not ``ru_maxrss`` on Linux: a process started by ``fork`` + ``exec`` (``subprocess``) inherits its parent's
    high-water mark there, so a small run launched from a large process reported the parent's peak. Never below
    the current RSS: the kernel folds its RSS counters into the high-water mark lazily, so ``/proc/self/statm``
    can run some pages ahead for a moment.
    """
    try:
        peak = max(proc_status_bytes("VmHWM"), _PEAK_BEFORE_RESET)
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
    try:
        with open("/proc/self/statm") as statm:
            return max(peak, int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError):
        return peak


def _breakdown(params: int, grads: int, optimizer_state: int, peak: int, peak_phase: str) -> dict[str, Any]:
    return {
        "params": int(params),
        "grads": int(grads),
        "optimizer_state": int(optimizer_state),
        "activations_and_temps": int(max(0, peak - params - grads - optimizer_state)),
        "peak_phase": peak_phase,
    }


def micro_batch_shape(batch: Any, items: Any) -> tuple | None:
    """What sizes a micro-batch's tensors where a model's memory follows its inputs' shapes: each input tensor's
    shape by name, and the micro-batch's item count (a loss over the labels that are not ignored may allocate by it).
    None for a batch that is not a mapping of tensors (such an update is always tracked)."""
    if not isinstance(batch, dict) or not batch or not all(isinstance(value, torch.Tensor) for value in batch.values()):
        return None
    return tuple(sorted((str(name), tuple(value.shape)) for name, value in batch.items())), int(items)


def _covers(one: tuple, other: tuple) -> bool:
    """Whether micro-batch shape `one` (`micro_batch_shape`) is at least `other` in every input's every dimension
    and in items: then `other`'s tensors are no larger than `one`'s."""
    (shapes, items), (other_shapes, other_items) = one, other
    return other_items <= items and [name for name, _ in shapes] == [name for name, _ in other_shapes] and all(
        len(shape) == len(other_shape) and all(small <= large for small, large in zip(other_shape, shape))
        for (_, shape), (_, other_shape) in zip(shapes, other_shapes))


def _covers_tracked(known: tuple[tuple, bool, int], other: tuple[tuple, bool, int]) -> bool:
    """Whether a micro-batch tracked in a steady update, `known` = (shape, after its window's first micro-batch, the
    live bytes when its update started), covers `other`, the same for a later micro-batch: `_covers` their shapes,
    `known` at the window's first place or `other` after it too, and `other`'s update started with no more bytes."""
    return (known[1] or not other[1]) and other[2] <= known[2] and _covers(known[0], other[0])


class CpuTensorMeter:
    """CPU meter: the tracker's peak of live tensor bytes, plus the process RSS as a cross-check.

    With ``track_tensors=False`` no dispatch mode is installed (no per-op overhead): the peak is then
    the RSS rise above the baseline plus the tensors that existed at ``start`` (an approximation
    that includes allocator slack; meter name ``cpu_rss_delta``).

    Updates whose micro-batches are each covered by one already tracked (`update`) run with the tracker
    set aside: their peak cannot pass the tracked one's, and the tracker's Python per op (up to a fifth of
    a step under bf16 autocast on short rows, docs/memory.md) is paid only where the peak can still rise.
    ``track_every_update=True`` tracks them all (a model whose memory depends on the data beyond its shapes).
    """

    def __init__(self, track_tensors: bool = True, track_every_update: bool = False) -> None:
        self.track_tensors = track_tensors
        self.track_every_update = track_every_update
        # Micro-batches tracked once the optimizer had stepped: (shape, after the window's first micro-batch, the live
        # bytes when their update started).
        self._covering: list[tuple[tuple, bool, int]] = []
        self.tracked_updates = 0
        self.untracked_updates = 0
        self.tracker: StorageTracker | None = None
        self.rss_baseline_bytes = 0
        self._start_tensor_bytes = 0
        self._hooks: list[Any] = []
        self._model: nn.Module | None = None
        self._optimizer: Any = None
        self._active = False
        self._classify_on_mark = False
        self._grads_seen = 0  # without the tracker: the most gradient bytes held at a mark

    @property
    def name(self) -> str:
        """The meter's name as written in summaries."""
        return "cpu_tensor_tracker" if self.track_tensors else "cpu_rss_delta"

    def start(self, model: nn.Module, optimizer: Any = None) -> None:
        """Record the RSS baseline, register existing tensors and start tracking ops."""
        self._model, self._optimizer = model, optimizer
        self.rss_baseline_bytes = current_rss_bytes()
        self._start_tensor_bytes = parameter_bytes(model) + gradient_bytes(model) + optimizer_state_bytes(optimizer)
        self._grads_seen = gradient_bytes(model)
        if not self.track_tensors:
            return
        tracker = StorageTracker()
        tracker.classify(model, optimizer)
        self._install_hooks(tracker, model, optimizer)
        tracker.reset_peak()
        self.tracker = tracker
        tracker.__enter__()
        self._active = True

    def _install_hooks(self, tracker: StorageTracker, model: nn.Module, optimizer: Any) -> None:
        # A gradient is born as a backward op's output; classify it the moment it lands in .grad.
        def on_grad(parameter: torch.Tensor) -> None:
            if parameter.grad is not None:
                tracker.track(parameter.grad, CATEGORY_GRADS)

        for parameter in model.parameters():
            if parameter.requires_grad:
                self._hooks.append(parameter.register_post_accumulate_grad_hook(on_grad))
        # Optimizer state is created inside the first step(); classify it as soon as step returns.
        # An optimizer without step hooks (not a torch.optim.Optimizer) is classified at every mark.
        self._classify_on_mark = False
        for inner in inner_optimizers(optimizer):
            if not hasattr(inner, "register_step_post_hook"):
                self._classify_on_mark = True
                continue
            self._hooks.append(
                inner.register_step_post_hook(
                    lambda opt, args, kwargs: tracker.track_all(optimizer_state_tensors(opt), CATEGORY_OPTIMIZER)
                )
            )

    def mark(self, phase: str) -> None:
        """Name the phase that starts now ("forward", "backward", "optimizer", "eval").

        Cheap (the Loop marks twice per micro-batch): grads and optimizer state are classified by
        the hooks installed at ``start`` the moment they appear, so nothing is rescanned here unless
        some optimizer had no step hook to install (then the full classification runs, as at ``stop``).
        Without the tracker it sums the gradients held now: the breakdown's grads are the most an update held
        (a run ends with none, after ``zero_grad``).
        """
        if self.tracker is not None:
            if self._classify_on_mark:
                self.tracker.classify(self._model, self._optimizer)
            self.tracker.set_phase(phase)
        elif self._model is not None:  # the RSS meter's breakdown: the gradients an update held, not the end's none
            self._grads_seen = max(self._grads_seen, gradient_bytes(self._model))

    @contextlib.contextmanager
    def update(self, micro_batches: list, counts: list, steady: bool) -> Iterator[None]:
        """One optimizer update's micro-batches (and their item counts), tracked or not.

        An update is left untracked when the optimizer has stepped before (`steady`: its state exists, as in
        every update the tracker covers) and each of its micro-batches is covered by one tracked in such an
        update (`micro_batch_shape`: every input dimension and the items no larger), at the same place or a
        later one in its window (from the second micro-batch on, the window's gradients are held beside it),
        with no more live bytes than that update started with (what outlives updates, a growing list of
        tensors say, is under every later peak). Such an update's peak cannot pass the covering one's; frees are
        counted all the same (by weak reference), and the tracker is back before the next update. Everything
        else is tracked, and covers what follows once the optimizer has stepped.
        """
        if self.tracker is None or not self._active:
            yield
            return
        if self.track_every_update:
            self.tracked_updates += 1
            yield
            return
        # The inputs are counted now, tracked or not: a batch made before tracking (a list of them, say) is otherwise
        # counted when an op first reads it, which a set-aside update would not.
        self.tracker.track_all(value for batch in micro_batches if isinstance(batch, dict)
                               for value in batch.values() if isinstance(value, torch.Tensor))
        shapes = [micro_batch_shape(batch, items) for batch, items in zip(micro_batches, counts)]
        start = self.tracker.current_bytes
        covered = steady and all(
            shape is not None and any(_covers_tracked(known, (shape, position > 0, start)) for known in self._covering)
            for position, shape in enumerate(shapes))
        if not covered:
            self.tracked_updates += 1
            yield
            if steady:
                for position, shape in enumerate(shapes):
                    if shape is not None:
                        self._cover((shape, position > 0, start))
            return
        self.untracked_updates += 1
        self.tracker.__exit__(None, None, None)
        try:
            yield
        finally:
            self.tracker.__enter__()

    def outlive(self, *tensors: Any) -> None:
        """Tensors an update returns, which outlive it: counted now if it ran untracked (a tensor its ops made is
        otherwise counted when an op next reads it)."""
        if self.tracker is not None and self._active:
            self.tracker.track_all(tensor for tensor in tensors if isinstance(tensor, torch.Tensor))

    def _cover(self, entry: tuple[tuple, bool, int]) -> None:
        """Adds a tracked micro-batch to those that cover later updates; drops the ones it covers."""
        if not any(_covers_tracked(known, entry) for known in self._covering):
            self._covering = [known for known in self._covering if not _covers_tracked(entry, known)] + [entry]

    def restart_peak(self) -> None:
        """Start a new peak from the live bytes (a new gradual-unfreezing stage): the trainable set may
        have changed, so the gradient hooks follow it, and no update tracked before covers one after. Without
        the tensor tracker the RSS peak of the process cannot be reset and stays the run's."""
        self._covering.clear()
        if self.tracker is None or not self._active:
            return
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.tracker.classify(self._model, self._optimizer)
        self._install_hooks(self.tracker, self._model, self._optimizer)
        self.tracker.reset_peak()

    def stop(self) -> None:
        """Stop tracking ops (idempotent). Must run on the thread that called ``start``."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.tracker is not None and self._active:
            self.tracker.classify(self._model, self._optimizer)
            self.tracker.__exit__(None, None, None)
            self._active = False

    @contextlib.contextmanager
    def tracking(self, model: nn.Module, optimizer: Any = None) -> Iterator[CpuTensorMeter]:
        """``start`` on entry and ``stop`` on exit, exceptions included."""
        self.start(model, optimizer)
        try:
            yield self
        finally:
            self.stop()

    def summary(self, model: nn.Module | None = None, optimizer: Any = None) -> dict[str, Any]:
        """The run's memory figures (see the module docstring and docs/memory.md)."""
        model = model if model is not None else self._model
        optimizer = optimizer if optimizer is not None else self._optimizer
        peak_rss = peak_rss_bytes()
        result: dict[str, Any] = {"memory_meter": self.name, "peak_rss_bytes": peak_rss,
                                  "rss_baseline_bytes": self.rss_baseline_bytes}
        tracker = self.tracker
        if tracker is not None:
            at_peak = tracker.peak_category_bytes
            result["peak_memory_bytes"] = int(tracker.peak_bytes)
            result["memory_breakdown"] = _breakdown(
                at_peak[CATEGORY_PARAMS], at_peak[CATEGORY_GRADS], at_peak[CATEGORY_OPTIMIZER], tracker.peak_bytes,
                tracker.peak_phase,
            )
            result["phase_peak_bytes"] = {phase: int(value) for phase, value in tracker.phase_peak_bytes.items()}
            result["tracked_updates"] = self.tracked_updates
            result["untracked_updates"] = self.untracked_updates
        else:
            peak = max(0, peak_rss - self.rss_baseline_bytes) + self._start_tensor_bytes
            result["peak_memory_bytes"] = int(peak)
            result["memory_breakdown"] = _breakdown(
                parameter_bytes(model) if model is not None else 0,
                max(self._grads_seen, gradient_bytes(model) if model is not None else 0),
                optimizer_state_bytes(optimizer),
                peak,
                "unknown",
            )
        return result


class CudaMeter:
    """CUDA meter: the caching allocator's ``max_memory_allocated`` (and ``max_memory_reserved``).

    The peak phase is the phase during which ``max_memory_allocated`` last rose (read at each
    ``mark``); params and optimizer state are measured from the tensors, grads are those live at the
    end of the peak phase, and activations_and_temps is the rest of the peak.
    """

    def __init__(self, device: torch.device | str = "cuda", track_tensors: bool = False) -> None:
        self.device = torch.device(device)
        self.track_tensors = track_tensors  # accepted for one interface; the allocator sees all
        self.rss_baseline_bytes = 0
        self._phase = "setup"
        self._last_max = 0
        self._peak_phase = "setup"
        self._grads_at_peak = 0
        self._model: nn.Module | None = None
        self._optimizer: Any = None

    name = "cuda_max_memory_allocated"

    def start(self, model: nn.Module, optimizer: Any = None) -> None:
        """Reset the allocator's peak statistics and record the RSS baseline."""
        self._model, self._optimizer = model, optimizer
        self.rss_baseline_bytes = current_rss_bytes()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._last_max = torch.cuda.max_memory_allocated(self.device)
        self._grads_at_peak = gradient_bytes(model)

    def _close_phase(self) -> None:
        maximum = torch.cuda.max_memory_allocated(self.device)
        if maximum > self._last_max:
            self._last_max = maximum
            self._peak_phase = self._phase
            self._grads_at_peak = gradient_bytes(self._model) if self._model is not None else 0

    def mark(self, phase: str) -> None:
        """Close the current phase (did the peak rise in it?) and start ``phase``."""
        self._close_phase()
        self._phase = phase

    @contextlib.contextmanager
    def update(self, micro_batches: list, counts: list, steady: bool) -> Iterator[None]:
        """One optimizer update (`CpuTensorMeter.update`): the allocator sees every one, nothing to set aside."""
        yield

    def outlive(self, *tensors: Any) -> None:
        """`CpuTensorMeter.outlive`: the allocator counts them already."""

    def restart_peak(self) -> None:
        """Start a new peak from the memory allocated now (a new gradual-unfreezing stage)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._last_max = torch.cuda.max_memory_allocated(self.device)
        self._peak_phase = self._phase
        self._grads_at_peak = gradient_bytes(self._model) if self._model is not None else 0

    def stop(self) -> None:
        """Close the last phase."""
        self._close_phase()

    def summary(self, model: nn.Module | None = None, optimizer: Any = None) -> dict[str, Any]:
        """The run's memory figures, with ``reserved_bytes`` beside the allocated peak."""
        model = model if model is not None else self._model
        optimizer = optimizer if optimizer is not None else self._optimizer
        peak = torch.cuda.max_memory_allocated(self.device)
        return {
            "memory_meter": self.name,
            "peak_memory_bytes": int(peak),
            "reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_baseline_bytes": self.rss_baseline_bytes,
            "memory_breakdown": _breakdown(
                parameter_bytes(model) if model is not None else 0,
                self._grads_at_peak,
                optimizer_state_bytes(optimizer),
                peak,
                self._peak_phase,
            ),
        }


def make_meter(device: torch.device | str, track_tensors: bool = True,
               track_every_update: bool = False) -> CpuTensorMeter | CudaMeter:
    """The meter for ``device``: ``CudaMeter`` on CUDA, ``CpuTensorMeter`` otherwise.

    Args:
        device: where the model trains.
        track_tensors: on CPU, install the dispatch-mode tracker (exact tensor peak, some per-op
            overhead); False measures RSS only.
        track_every_update: on CPU with the tracker, track updates whose micro-batches are covered by
            tracked ones too (`CpuTensorMeter.update`).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return CudaMeter(device, track_tensors=track_tensors)
    return CpuTensorMeter(track_tensors=track_tensors, track_every_update=track_every_update)


def format_memory_table(summary: dict[str, Any]) -> str:
    """A small table of the run's memory figures in MiB, naming the meter."""
    breakdown = summary.get("memory_breakdown", {})
    rows = [
        ("params", breakdown.get("params")),
        ("grads", breakdown.get("grads")),
        ("optimizer state", breakdown.get("optimizer_state")),
        ("activations + temps", breakdown.get("activations_and_temps")),
        (f"peak ({summary.get('memory_meter', '?')})", summary.get("peak_memory_bytes")),
    ]
    if "reserved_bytes" in summary:
        rows.append(("reserved (allocator)", summary["reserved_bytes"]))
    if "peak_rss_bytes" in summary:
        rows.append(("process peak RSS", summary["peak_rss_bytes"]))
        if summary.get("rss_baseline_bytes"):
            # Above the meter's `start` (the model loaded, training about to begin): the process's own start, which
            # the command line's table counts from, is earlier.
            rows.append(("peak RSS above training's start", summary["peak_rss_bytes"] - summary["rss_baseline_bytes"]))
    width = max(len(label) for label, _ in rows)
    lines = [f"memory at the peak (phase: {breakdown.get('peak_phase', '?')})"]
    for label, value in rows:
        shown = "-" if value is None else f"{value / MIB:10.1f} MiB"
        lines.append(f"  {label:<{width}}  {shown}")
    return "\n".join(lines)


