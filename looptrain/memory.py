"""Memory meters, the per-run memory breakdown and the fake-tensor estimator.

Every figure names its meter (see docs/memory.md):

- ``CudaMeter``: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``.
- ``CpuTensorMeter``: the peak of live tensor bytes seen by ``StorageTracker``, a
  ``TorchDispatchMode`` that registers the storage of every tensor an op produces or reads and
  hears about its release through a weak reference; plus the process peak RSS as a cross-check.
- ``estimate``: the same tracker run on fake tensors (``FakeTensorMode``), so a training step of
  any model shape and strategy mix is measured without real memory and without the compute.

Run ``python -m looptrain.memory --preset bert-large --batch-size 32 --seq-len 128 --ladder``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import math
import os
import resource
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from looptrain.optim import inner_optimizers, optimizer_state_bytes

PHASES = ("forward", "backward", "optimizer", "eval")
CATEGORY_PARAMS = "params"
CATEGORY_GRADS = "grads"
CATEGORY_OPTIMIZER = "optimizer_state"
CATEGORY_OTHER = "activations_and_temps"
CATEGORIES = (CATEGORY_PARAMS, CATEGORY_GRADS, CATEGORY_OPTIMIZER, CATEGORY_OTHER)
MIB = 1024 * 1024

# bitsandbytes' 8-bit optimizers (bitsandbytes/optim/optimizer.py, init_state): tensors with fewer
# elements than min_8bit_size keep float32 state; 8-bit state is quantized in blocks of 256 values,
# each block with one float32 absmax; the two 256-entry quantization maps are shared by all params.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
BNB_QMAP_ENTRIES = 256


# --------------------------------------------------------------------------------------------
# Tensors and their storages
# --------------------------------------------------------------------------------------------


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's untyped storage, or None for tensors without one (sparse, nested...)."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = _storage_of(tensor)
        if storage is not None:
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (distinct storages)."""
    return tensor_bytes(list(model.parameters()) + list(model.buffers()))


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the ``.grad`` tensors currently held by the model's parameters."""
    return tensor_bytes(parameter.grad for parameter in model.parameters() if parameter.grad is not None)


def iter_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """Yield every ``torch.optim.Optimizer`` that holds state inside ``optimizer`` (see ``inner_optimizers``).

    The estimator's fused 8-bit stand-in (``_SimulatedInBackward``) keeps its per-parameter
    optimizers in ``optimizers``; it is handled here because ``looptrain.optim`` does not know it.
    """
    if isinstance(optimizer, _SimulatedInBackward):
        yield from optimizer.optimizers.values()
        return
    yield from inner_optimizers(optimizer)


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """All tensors held in the optimizer's state (8-bit states, absmax, quantization maps, steps)."""
    tensors: list[torch.Tensor] = []
    for inner in iter_optimizers(optimizer):
        for state in inner.state.values():
            leaves, _ = tree_flatten(state)
            tensors.extend(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
    return tensors


# --------------------------------------------------------------------------------------------
# The storage tracker
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _bnb_python_kernels() -> dict[str, Callable[..., Any]]:
    """bitsandbytes' CPU optimizer kernels, which are Python functions built from torch ops.

    Called directly (instead of through the dispatcher, which runs them with the mode popped), their
    fp32 temporaries (dequantized states, grad copies) reach the tracker. Empty if bnb is absent.
    Looked up only when a ``bitsandbytes::`` op is first dispatched (such an op exists only once
    bitsandbytes is imported), so tracking a run without it never pays bitsandbytes' import.
    """
    try:
        from bitsandbytes.backends.cpu import ops as bnb_cpu_ops
    except Exception:  # not installed or its native library failed to load
        return {}
    kernels = {}
    for op_name, attribute in (
        ("bitsandbytes::optimizer_update_8bit_blockwise", "_optimizer_update_8bit_blockwise_cpu"),
        ("bitsandbytes::optimizer_update_32bit", "_optimizer_update_32bit_cpu"),
    ):
        kernel = getattr(bnb_cpu_ops, attribute, None)
        if kernel is not None:
            kernels[op_name] = kernel
    return kernels


class _StorageRecord:
    """What the tracker knows about one live storage (a plain slotted class: one is made per new storage)."""

    __slots__ = ("nbytes", "category", "birth", "reference")

    def __init__(self, nbytes: int, category: str, birth: int, reference: weakref.ref) -> None:
        self.nbytes = nbytes
        self.category = category
        self.birth = birth
        self.reference = reference


_NO_KERNEL = object()


def _append_tensors(value: Any, tensors: list) -> None:
    """Append the tensors in an op argument or result: a tensor, or (nested) lists / tuples of them.

    ATen schemas only nest tensors in lists (``Tensor[]``, ``Tensor?[]``) and results in tuples, so
    this scan sees every tensor ``tree_flatten`` would, at a fraction of its per-op cost.
    """
    if isinstance(value, torch.Tensor):
        tensors.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                tensors.append(item)
            elif isinstance(item, (list, tuple)):
                _append_tensors(item, tensors)


class StorageTracker(TorchDispatchMode):
    """Counts live tensor bytes by storage; records the peak, its phase and its breakdown.

    Every op's outputs (and inputs, to catch tensors made before tracking or outside ops) are
    registered by storage: views share a storage and count once. A weak reference per storage
    subtracts its bytes when torch frees it, whoever frees it (Python, autograd, an optimizer).
    Not seen: memory an op allocates and frees internally (kernel workspaces), allocator caching
    and fragmentation, and non-tensor memory (the interpreter, libraries).

    The per-op path (``__torch_dispatch__``) is kept lean because it runs for every ATen op of a
    training step: a direct scan of the arguments instead of ``tree_flatten``, one dict lookup per
    tensor already known, a size check only for outputs (an op that resizes a storage in place,
    ``resize_`` or ``out=``, returns it), and a cached per-op lookup of the bitsandbytes kernels.
    """

    def __init__(self) -> None:
        super().__init__()
        self._records: dict[int, _StorageRecord] = {}
        self._sequence = 0
        self.current_bytes = 0
        self.category_bytes = {category: 0 for category in CATEGORIES}
        self.phase = "setup"
        self.peak_bytes = 0
        self.peak_phase = "setup"
        self.peak_sequence = -1
        self.peak_category_bytes = dict(self.category_bytes)
        self.phase_peak_bytes: dict[str, int] = {}
        self._current_phase_peak = -1  # phase_peak_bytes[phase], cached: update_peak runs after every op
        self._kernel_of_op: dict[Any, Any] = {}  # op -> bitsandbytes Python kernel or None
        self._self_reference = weakref.ref(self)

    # -- registration ------------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self.current_bytes -= record.nbytes
            self.category_bytes[record.category] -= record.nbytes

    def _register(self, storage: torch.UntypedStorage, key: int, category: str) -> _StorageRecord:
        nbytes = storage.nbytes()
        tracker_reference = self._self_reference
        reference = weakref.ref(storage, lambda _, key=key: _on_free(tracker_reference, key))
        record = _StorageRecord(nbytes, category, self._sequence, reference)
        self._records[key] = record
        self.current_bytes += nbytes
        self.category_bytes[category] += nbytes
        return record

    def _resized(self, record: _StorageRecord, nbytes: int) -> None:
        self.current_bytes += nbytes - record.nbytes
        self.category_bytes[record.category] += nbytes - record.nbytes
        record.nbytes = nbytes

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Register ``tensor``'s storage; with ``category``, (re)classify it.

        Reclassifying a storage that was alive at the peak moves its bytes in the peak's breakdown
        too, so the breakdown reflects what each storage turned out to be (gradients are created by
        backward ops and become ``.grad`` afterwards; optimizer state is created inside ``step``).
        """
        storage = _storage_of(tensor)
        if storage is None:
            return
        key = id(storage)
        record = self._records.get(key)
        if record is None:
            self._register(storage, key, category or CATEGORY_OTHER)
            return
        nbytes = storage.nbytes()
        if nbytes != record.nbytes:  # resized in place (resize_, out= ops)
            self._resized(record, nbytes)
        if category is not None and category != record.category:
            self.category_bytes[record.category] -= record.nbytes
            self.category_bytes[category] += record.nbytes
            if record.birth <= self.peak_sequence:  # alive now and born before the peak: alive at it
                self.peak_category_bytes[record.category] -= record.nbytes
                self.peak_category_bytes[category] += record.nbytes
            record.category = category

    def track_all(self, tensors: Iterable[torch.Tensor], category: str | None = None) -> None:
        """Register several tensors (see ``track``)."""
        for tensor in tensors:
            self.track(tensor, category)

    def classify(self, model: nn.Module | None, optimizer: Any = None) -> None:
        """(Re)classify the model's parameters, buffers and grads and the optimizer's state."""
        if model is not None:
            self.track_all(model.parameters(), CATEGORY_PARAMS)
            self.track_all(model.buffers(), CATEGORY_PARAMS)
            self.track_all((p.grad for p in model.parameters() if p.grad is not None), CATEGORY_GRADS)
        if optimizer is not None:
            self.track_all(optimizer_state_tensors(optimizer), CATEGORY_OPTIMIZER)
        self.update_peak()

    def set_phase(self, phase: str) -> None:
        """Name the phase that the following ops belong to."""
        self.phase = phase
        self._current_phase_peak = self.phase_peak_bytes.get(phase, -1)

    def update_peak(self) -> None:
        """Record the current live bytes as the peak if they exceed it."""
        current = self.current_bytes
        if current <= self._current_phase_peak:  # the common case: nothing new, checked in one compare
            return
        self._current_phase_peak = current
        self.phase_peak_bytes[self.phase] = current
        if current > self.peak_bytes:
            self.peak_bytes = current
            self.peak_phase = self.phase
            self.peak_sequence = self._sequence
            self.peak_category_bytes = dict(self.category_bytes)

    def reset_peak(self) -> None:
        """Forget the peak so far (the live bytes become the new peak)."""
        self.peak_bytes = 0
        self.peak_sequence = -1
        self.phase_peak_bytes = {}
        self._current_phase_peak = -1
        self.update_peak()

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._sequence += 1
        kernel = self._kernel_of_op.get(func, _NO_KERNEL)
        if kernel is _NO_KERNEL:
            name = func._schema.name
            kernel = _bnb_python_kernels().get(name) if name.startswith("bitsandbytes::") else None
            self._kernel_of_op[func] = kernel
        if kernel is not None and not _has_fake(args):
            with self:  # re-enter so the kernel's own torch ops (its temporaries) are seen
                output = kernel(*args, **kwargs)
        else:
            output = func(*args, **kwargs)
        records = self._records
        # Inputs: only storages never seen before need work (tensors made before tracking began).
        inputs: list[torch.Tensor] = []
        _append_tensors(args, inputs)
        if kwargs:
            _append_tensors(tuple(kwargs.values()), inputs)
        for tensor in inputs:
            storage = _storage_of(tensor)
            if storage is not None and id(storage) not in records:
                self._register(storage, id(storage), CATEGORY_OTHER)
        # Outputs: new storages, and storages an op resized in place (it returns them).
        outputs: list[torch.Tensor] = []
        _append_tensors(output, outputs)
        for tensor in outputs:
            storage = _storage_of(tensor)
            if storage is None:
                continue
            key = id(storage)
            record = records.get(key)
            if record is None:
                self._register(storage, key, CATEGORY_OTHER)
            else:
                nbytes = storage.nbytes()
                if nbytes != record.nbytes:
                    self._resized(record, nbytes)
        self.update_peak()
        return output


def _on_free(tracker_reference: weakref.ref, key: int) -> None:
    tracker = tracker_reference()
    if tracker is not None:
        tracker._forget(key)


def _has_fake(values: Sequence[Any]) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    leaves, _ = tree_flatten(values)
    return any(isinstance(leaf, FakeTensor) for leaf in leaves)


# --------------------------------------------------------------------------------------------
# RSS
# --------------------------------------------------------------------------------------------


def current_rss_bytes() -> int:
    """The process's resident set size now (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak RSS since it started, from ``getrusage`` (KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# --------------------------------------------------------------------------------------------
# Meters
# --------------------------------------------------------------------------------------------


def _breakdown(params: int, grads: int, optimizer_state: int, peak: int, peak_phase: str) -> dict[str, Any]:
    return {
        "params": int(params),
        "grads": int(grads),
        "optimizer_state": int(optimizer_state),
        "activations_and_temps": int(max(0, peak - params - grads - optimizer_state)),
        "peak_phase": peak_phase,
    }


class CpuTensorMeter:
    """CPU meter: the tracker's peak of live tensor bytes, plus the process RSS as a cross-check.

    With ``track_tensors=False`` no dispatch mode is installed (no per-op overhead): the peak is then
    the RSS rise above the baseline plus the tensors that existed at ``start`` (an approximation
    that includes allocator slack; meter name ``cpu_rss_delta``).
    """

    def __init__(self, track_tensors: bool = True) -> None:
        self.track_tensors = track_tensors
        self.tracker: StorageTracker | None = None
        self.rss_baseline_bytes = 0
        self._start_tensor_bytes = 0
        self._hooks: list[Any] = []
        self._model: nn.Module | None = None
        self._optimizer: Any = None
        self._active = False
        self._classify_on_mark = False

    @property
    def name(self) -> str:
        """The meter's name as written in summaries."""
        return "cpu_tensor_tracker" if self.track_tensors else "cpu_rss_delta"

    def start(self, model: nn.Module, optimizer: Any = None) -> None:
        """Record the RSS baseline, register existing tensors and start tracking ops."""
        self._model, self._optimizer = model, optimizer
        self.rss_baseline_bytes = current_rss_bytes()
        self._start_tensor_bytes = parameter_bytes(model) + gradient_bytes(model) + optimizer_state_bytes(optimizer)
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
        for inner in iter_optimizers(optimizer):
            if not hasattr(inner, "register_step_post_hook"):
                self._classify_on_mark = True
                continue
            self._hooks.append(
                inner.register_step_post_hook(lambda opt, args, kwargs: tracker.track_all(optimizer_state_tensors(opt), CATEGORY_OPTIMIZER))
            )

    def mark(self, phase: str) -> None:
        """Name the phase that starts now ("forward", "backward", "optimizer", "eval").

        Cheap (the Loop marks twice per micro-batch): grads and optimizer state are classified by
        the hooks installed at ``start`` the moment they appear, so nothing is rescanned here unless
        some optimizer had no step hook to install (then the full classification runs, as at ``stop``).
        """
        if self.tracker is not None:
            if self._classify_on_mark:
                self.tracker.classify(self._model, self._optimizer)
            self.tracker.set_phase(phase)

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
    def tracking(self, model: nn.Module, optimizer: Any = None) -> Iterator["CpuTensorMeter"]:
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
        result: dict[str, Any] = {"memory_meter": self.name, "peak_rss_bytes": peak_rss, "rss_baseline_bytes": self.rss_baseline_bytes}
        tracker = self.tracker
        if tracker is not None:
            at_peak = tracker.peak_category_bytes
            result["peak_memory_bytes"] = int(tracker.peak_bytes)
            result["memory_breakdown"] = _breakdown(
                at_peak[CATEGORY_PARAMS], at_peak[CATEGORY_GRADS], at_peak[CATEGORY_OPTIMIZER], tracker.peak_bytes, tracker.peak_phase
            )
            result["phase_peak_bytes"] = {phase: int(value) for phase, value in tracker.phase_peak_bytes.items()}
        else:
            peak = max(0, peak_rss - self.rss_baseline_bytes) + self._start_tensor_bytes
            result["peak_memory_bytes"] = int(peak)
            result["memory_breakdown"] = _breakdown(
                parameter_bytes(model) if model is not None else 0,
                gradient_bytes(model) if model is not None else 0,
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


def make_meter(device: torch.device | str, track_tensors: bool = True) -> CpuTensorMeter | CudaMeter:
    """The meter for ``device``: ``CudaMeter`` on CUDA, ``CpuTensorMeter`` otherwise.

    Args:
        device: where the model trains.
        track_tensors: on CPU, install the dispatch-mode tracker (exact tensor peak, some per-op
            overhead); False measures RSS only.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return CudaMeter(device, track_tensors=track_tensors)
    return CpuTensorMeter(track_tensors=track_tensors)


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
            rows.append(("peak RSS - baseline", summary["peak_rss_bytes"] - summary["rss_baseline_bytes"]))
    width = max(len(label) for label, _ in rows)
    lines = [f"memory at the peak (phase: {breakdown.get('peak_phase', '?')})"]
    for label, value in rows:
        shown = "-" if value is None else f"{value / MIB:10.1f} MiB"
        lines.append(f"  {label:<{width}}  {shown}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Strategy application (looptrain's own modules) and the training step both paths share
# --------------------------------------------------------------------------------------------

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "adamw8bit", "adafactor", "sgd")
PRESETS = {
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072, "vocab_size": 30522},
    "bert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522},
    "macbert-large": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 21128},
}


@dataclass(frozen=True)
class Strategy:
    """One strategy mix: everything ``estimate`` and ``measure`` need besides the model."""

    batch_size: int
    seq_len: int
    precision: str = "fp32"
    optimizer: str = "adamw"
    gradient_checkpointing: bool = False
    optimizer_in_backward: bool = False
    freeze_embeddings: bool = False
    freeze_layers: int = 0
    freeze_encoder: bool = False
    foreach: bool | None = None
    accum_steps: int = 1
    num_labels: int = 2

    def validate(self) -> None:
        """Raise ValueError naming the option when the mix is invalid."""
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}.")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}.")
        if self.batch_size < 1 or self.seq_len < 1 or self.accum_steps < 1:
            raise ValueError("batch_size, seq_len and accum_steps must be >= 1.")
        if self.optimizer_in_backward and self.accum_steps > 1:
            raise ValueError("optimizer_in_backward steps inside every backward and cannot accumulate: set accum_steps=1 (raise batch_size instead).")
        if self.foreach is not None and self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"foreach applies to adamw and sgd only, not {self.optimizer!r}; leave it None.")


def apply_model_strategy(model: nn.Module, strategy: Strategy) -> None:
    """Freeze and checkpoint ``model`` as ``strategy`` asks, with looptrain.freeze / .gradient_checkpointing."""
    from looptrain import freeze, gradient_checkpointing

    if strategy.freeze_encoder:
        freeze.freeze_encoder(model)
    if strategy.freeze_embeddings:
        freeze.freeze_embeddings(model)
    if strategy.freeze_layers:
        freeze.freeze_layers(model, strategy.freeze_layers)
    if strategy.gradient_checkpointing:
        gradient_checkpointing.enable_gradient_checkpointing(model)


def build_strategy_optimizer(model: nn.Module, strategy: Strategy, lr: float = 1e-5) -> Any:
    """The optimizer of ``strategy`` from looptrain.optim (wrapped in OptimizerInBackward if asked)."""
    from looptrain import optim

    foreach = strategy.foreach
    optimizer = optim.build_optimizer(model, strategy.optimizer, lr, foreach=foreach)
    if strategy.optimizer_in_backward:
        return optim.OptimizerInBackward(model, optimizer)
    return optimizer


def _autocast(precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast("cpu", dtype=dtype)


def run_training_steps(model: nn.Module, batch: dict[str, torch.Tensor], optimizer: Any, strategy: Strategy, meter: CpuTensorMeter, steps: int = 2) -> None:
    """``steps`` optimizer steps on ``batch``, marking phases on ``meter`` as the Loop does.

    Accumulation windows run min(accum_steps, 2) micro-steps: from the second one on, memory
    repeats (grads already exist), so more would only cost time. The second optimizer step, with
    optimizer state present, is the one that peaks. fp16 runs without GradScaler (its state is a
    few scalars).
    """
    micro_steps = min(strategy.accum_steps, 2)
    for _ in range(steps):
        for _ in range(micro_steps):
            meter.mark("forward")
            with _autocast(strategy.precision):
                loss = model(**batch).loss / strategy.accum_steps
            meter.mark("backward")
            loss.backward()
            del loss
        meter.mark("optimizer")
        if not strategy.optimizer_in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def _random_batch(batch_size: int, seq_len: int, vocab_size: int, num_labels: int, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "labels": torch.randint(0, num_labels, (batch_size,), generator=generator),
    }


def _vocab_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    if not embeddings:
        raise ValueError("the model has no nn.Embedding and no config.vocab_size: estimate/measure feed token ids.")
    return embeddings[0].num_embeddings


def measure(model: nn.Module, batch_size: int, seq_len: int, **options: Any) -> dict[str, Any]:
    """Run two real training steps of a strategy mix on random tokens and return the CPU meter's summary.

    ``model`` is modified (frozen / checkpointed / trained); pass a fresh one. Options are those of
    ``estimate``. This is the measured side of the estimator's accuracy check.
    """
    strategy = Strategy(batch_size, seq_len, **options)
    strategy.validate()
    apply_model_strategy(model, strategy)
    model.train()
    generator = torch.Generator().manual_seed(0)
    batch = _random_batch(batch_size, seq_len, _vocab_size(model), strategy.num_labels, generator)
    optimizer = build_strategy_optimizer(model, strategy)
    meter = CpuTensorMeter()
    with meter.tracking(model, optimizer):
        run_training_steps(model, batch, optimizer, strategy, meter)
    return meter.summary(model, optimizer)


# --------------------------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------------------------


class SimulatedAdamW8bit(torch.optim.Optimizer):
    """bitsandbytes' AdamW8bit state and CPU-step temporaries, on tensors that may be fake.

    bitsandbytes' kernels need real memory, so the estimator replays its layout instead
    (bitsandbytes/optim/optimizer.py ``init_state``, backends/cpu/ops.py): parameters with at least
    4096 elements and not overridden get uint8 ``state1``/``state2`` plus one float32 absmax per
    256-value block each, and share two 256-entry float32 quantization maps; the rest (and
    ``nn.Embedding`` weights, which looptrain gives 32-bit state) get float32 states. The step
    allocates what the CPU kernels allocate: 8-bit params dequantize both states to float32, copy
    the gradient and build the denominator (peak 20 B/element of the largest such tensor); 32-bit
    params copy the gradient and build sqrt(v)+eps and the update (12 B/element).
    """

    def __init__(self, params: Iterable[nn.Parameter], thirty_two_bit: set[int], lr: float = 1e-5, shared_qmaps: dict | None = None) -> None:
        super().__init__(params, {"lr": lr})
        self._thirty_two_bit = thirty_two_bit
        self._shared_qmaps = shared_qmaps if shared_qmaps is not None else {}

    def _init_state(self, parameter: torch.Tensor) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
        if parameter.numel() < BNB_MIN_8BIT_SIZE or id(parameter) in self._thirty_two_bit:
            state["state1"] = torch.zeros_like(parameter, dtype=torch.float32)
            state["state2"] = torch.zeros_like(parameter, dtype=torch.float32)
            return state
        if "maps" not in self._shared_qmaps:  # one pair for all parameters, as in bitsandbytes
            self._shared_qmaps["maps"] = (torch.zeros(BNB_QMAP_ENTRIES), torch.zeros(BNB_QMAP_ENTRIES))
        blocks = math.ceil(parameter.numel() / BNB_BLOCKSIZE)
        state["state1"] = torch.zeros_like(parameter, dtype=torch.uint8)
        state["state2"] = torch.zeros_like(parameter, dtype=torch.uint8)
        state["qmap1"], state["qmap2"] = self._shared_qmaps["maps"]
        state["absmax1"] = torch.zeros(blocks)
        state["absmax2"] = torch.zeros(blocks)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Allocate what one bitsandbytes CPU AdamW8bit step allocates (values are not meaningful)."""
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if not self.state[parameter]:
                    self.state[parameter] = self._init_state(parameter)
                state = self.state[parameter]
                grad = parameter.grad * 1.0  # g.float() * gnorm_scale
                if state["state1"].dtype == torch.uint8:
                    first = torch.empty_like(parameter, dtype=torch.float32)  # dequantized m
                    second = torch.empty_like(parameter, dtype=torch.float32)  # dequantized v
                    denominator = second.sqrt() / 1.0
                    parameter.addcdiv_(first, denominator, value=-group["lr"])
                    quantized = torch.empty_like(parameter, dtype=torch.uint8)  # re-quantize m
                    del quantized
                    quantized = torch.empty_like(parameter, dtype=torch.uint8)  # re-quantize v
                    del quantized, first, second, denominator
                else:
                    denominator = state["state2"].sqrt() + 1e-8
                    update = state["state1"] / denominator
                    parameter.add_(update, alpha=-group["lr"])
                    del denominator, update
                del grad


def preset_config(name: str, num_labels: int = 2):
    """A ``BertConfig`` for a named shape (bert-base, bert-large, macbert-large); no download."""
    from transformers import BertConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} or pass --config / --model.")
    return BertConfig(num_labels=num_labels, **PRESETS[name])


def load_config(path: str, num_labels: int = 2):
    """A transformers config from a model directory or a config.json file (local only)."""
    import json

    from transformers import AutoConfig

    if os.path.isdir(path):
        config = AutoConfig.from_pretrained(path)
    elif os.path.isfile(path):
        with open(path) as handle:
            values = json.load(handle)
        if "model_type" not in values:
            raise ValueError(f"{path} has no 'model_type'; add e.g. \"model_type\": \"bert\".")
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        raise ValueError(f"{path} is neither a model directory nor a config.json file.")
    config.num_labels = num_labels
    return config


def _fake_model(model_or_config: Any, num_labels: int, fake_mode) -> nn.Module:
    """A copy of the model whose parameters and buffers are fake tensors (no real memory)."""
    if isinstance(model_or_config, nn.Module):
        memo: dict[int, Any] = {}
        for parameter in model_or_config.parameters():
            fake = nn.Parameter(fake_mode.from_tensor(parameter.detach()), requires_grad=parameter.requires_grad)
            memo[id(parameter)] = fake
        for buffer in model_or_config.buffers():
            memo[id(buffer)] = fake_mode.from_tensor(buffer)
        return copy.deepcopy(model_or_config, memo)
    config = model_or_config
    if isinstance(config, str):
        config = preset_config(config, num_labels) if config in PRESETS else load_config(config, num_labels)
    from transformers import AutoModelForSequenceClassification

    config.num_labels = num_labels
    with fake_mode:
        return AutoModelForSequenceClassification.from_config(config)


def estimate(
    model_or_config: Any,
    batch_size: int,
    seq_len: int,
    *,
    precision: str = "fp32",
    optimizer: str = "adamw",
    gradient_checkpointing: bool = False,
    optimizer_in_backward: bool = False,
    freeze_embeddings: bool = False,
    freeze_layers: int = 0,
    freeze_encoder: bool = False,
    foreach: bool | None = None,
    accum_steps: int = 1,
    num_labels: int = 2,
) -> dict[str, Any]:
    """Estimate the peak memory of a training step on fake tensors, with the CPU tensor tracker.

    Builds the model under ``FakeTensorMode`` (from a config, a preset name, a local path, or a
    fake copy of a real model), applies the strategy with looptrain's freeze / checkpointing /
    optimizer modules and runs two optimizer steps (forward, backward, step) under the same
    ``StorageTracker`` the CPU meter uses. No real memory is allocated and nothing is computed.

    Args:
        model_or_config: an ``nn.Module`` (copied, never modified), a transformers config, a preset
            name (``bert-base``, ``bert-large``, ``macbert-large``) or a local model dir / config.json.
        batch_size: micro-batch size.
        seq_len: tokens per sequence (every sequence padded to it).
        precision: ``fp32``, ``bf16`` or ``fp16`` (CPU autocast op lists; fp32 master weights).
        optimizer: ``adamw``, ``adamw8bit`` (modelled, see ``SimulatedAdamW8bit``), ``adafactor``, ``sgd``.
        gradient_checkpointing: checkpoint every transformer block (non-reentrant).
        optimizer_in_backward: step each parameter inside backward (no stored grads).
        freeze_embeddings: freeze the embedding layer.
        freeze_layers: freeze the first N transformer blocks.
        freeze_encoder: freeze everything but the head.
        foreach: AdamW/SGD ``foreach`` (False steps one tensor at a time).
        accum_steps: gradient accumulation steps.
        num_labels: classifier outputs.

    Returns:
        ``peak_memory_bytes``, ``memory_meter`` ("estimate_fake_tensor_tracker"), ``memory_breakdown``
        (params, grads, optimizer_state, activations_and_temps, peak_phase), ``phase_peak_bytes``,
        ``parameters``, ``trainable_parameters``, ``notes`` and ``estimate_seconds``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    strategy = Strategy(
        batch_size, seq_len, precision, optimizer, gradient_checkpointing, optimizer_in_backward,
        freeze_embeddings, freeze_layers, freeze_encoder, foreach, accum_steps, num_labels,
    )
    strategy.validate()
    started = time.perf_counter()
    notes: list[str] = []
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _fake_model(model_or_config, num_labels, fake_mode)
    with fake_mode:
        apply_model_strategy(model, strategy)
        model.train()
        batch = _random_batch(batch_size, seq_len, _vocab_size(model), num_labels)
        if optimizer == "adamw8bit":
            built = _simulated_adamw8bit(model, strategy)
            notes.append(
                "adamw8bit modelled (bitsandbytes kernels cannot run on fake tensors): uint8 states + "
                "float32 absmax per 256 values for tensors >= 4096 elements, float32 states for smaller "
                "tensors and nn.Embedding weights; step temporaries as in bitsandbytes' CPU kernels."
            )
        else:
            built = build_strategy_optimizer(model, strategy)
        meter = CpuTensorMeter()
        with meter.tracking(model, built):
            run_training_steps(model, batch, built, strategy, meter)
        summary = meter.summary(model, built)
    parameters = list(model.parameters())
    return {
        "peak_memory_bytes": summary["peak_memory_bytes"],
        "memory_meter": "estimate_fake_tensor_tracker",
        "memory_breakdown": summary["memory_breakdown"],
        "phase_peak_bytes": summary["phase_peak_bytes"],
        "parameters": sum(p.numel() for p in parameters),
        "trainable_parameters": sum(p.numel() for p in parameters if p.requires_grad),
        "notes": notes,
        "estimate_seconds": round(time.perf_counter() - started, 3),
    }


def _simulated_adamw8bit(model: nn.Module, strategy: Strategy) -> Any:
    trainable = [p for p in model.parameters() if p.requires_grad]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if strategy.optimizer_in_backward:
        return _SimulatedInBackward(trainable, embeddings)
    return SimulatedAdamW8bit(trainable, embeddings)


class _SimulatedInBackward:
    """OptimizerInBackward over SimulatedAdamW8bit: step each parameter as its grad lands, then drop it."""

    def __init__(self, parameters: list[nn.Parameter], thirty_two_bit: set[int]) -> None:
        shared_qmaps: dict = {}
        self.optimizers = {id(p): SimulatedAdamW8bit([p], thirty_two_bit, shared_qmaps=shared_qmaps) for p in parameters}
        self._handles = [p.register_post_accumulate_grad_hook(self._step) for p in parameters]

    def _step(self, parameter: torch.Tensor) -> None:
        optimizer = self.optimizers[id(parameter)]
        optimizer.step()
        parameter.grad = None

    @property
    def state(self) -> dict:
        """Every per-parameter optimizer's state, merged (what ``optimizer_state_bytes`` reads)."""
        return {key: value for optimizer in self.optimizers.values() for key, value in optimizer.state.items()}

    def step(self) -> None:
        """Nothing: the steps happened in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: grads are dropped in backward."""


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def ladder(batch_size: int, seq_len: int) -> list[tuple[str, dict[str, Any]]]:
    """The strategy mixes of the ladder table: (label, ``estimate`` options) at one effective batch."""
    accumulated = {"batch_size": 1, "accum_steps": batch_size}
    checkpointed = {**accumulated, "gradient_checkpointing": True}
    return [
        (f"baseline: bs {batch_size}, fp32, AdamW", {}),
        (f"+ accumulation (bs 1 x {batch_size})", accumulated),
        ("+ gradient checkpointing", checkpointed),
        ("+ Adafactor", {**checkpointed, "optimizer": "adafactor"}),
        ("+ freeze encoder (head only)", {**checkpointed, "optimizer": "adafactor", "freeze_encoder": True}),
        (f"+ seq {seq_len // 2}", {**checkpointed, "optimizer": "adafactor", "freeze_encoder": True, "seq_len": seq_len // 2}),
        (f"bs {batch_size}, bf16 autocast", {"precision": "bf16"}),
        ("bs 1 x acc + ckpt, AdamW foreach=False", {**checkpointed, "foreach": False}),
        ("bs 1 x acc + ckpt, AdamW8bit", {**checkpointed, "optimizer": "adamw8bit"}),
        (f"bs {batch_size} + ckpt + bf16, AdamW8bit fused into backward", {"gradient_checkpointing": True, "precision": "bf16", "optimizer": "adamw8bit", "optimizer_in_backward": True}),
        (f"bs {batch_size} + ckpt + bf16, Adafactor fused into backward", {"gradient_checkpointing": True, "precision": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True}),
    ]


def _table(rows: list[tuple[str, dict[str, Any]]], title_columns: str = "| strategy mix | peak GiB | params | grads | optimizer state | activations + temps | peak phase | s |") -> str:
    lines = [title_columns, "|" + "---|" * (title_columns.count("|") - 1)]
    for label, result in rows:
        b = result["memory_breakdown"]
        gib = 1024**3
        lines.append(
            f"| {label} | {result['peak_memory_bytes'] / gib:.2f} | {b['params'] / gib:.2f} | {b['grads'] / gib:.2f} | "
            f"{b['optimizer_state'] / gib:.2f} | {b['activations_and_temps'] / gib:.2f} | {b['peak_phase']} | {result['estimate_seconds']:.1f} |"
        )
    return "\n".join(lines)


def _parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m looptrain.memory", description="Estimate the peak memory of a training step on fake tensors.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in BERT shape (no download)")
    source.add_argument("--config", help="a config.json file (with model_type)")
    source.add_argument("--model", help="a local model directory (its config only is read)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--num-labels", type=int, default=2)
    parser.add_argument("--ladder", action="store_true", help="print the table of strategy mixes")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--optim", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--grad-checkpoint", action="store_true")
    parser.add_argument("--optim-in-backward", action="store_true")
    parser.add_argument("--freeze-embeddings", action="store_true")
    parser.add_argument("--freeze-layers", type=int, default=0)
    parser.add_argument("--freeze-encoder", action="store_true")
    parser.add_argument("--no-foreach", action="store_true")
    parser.add_argument("--accum", type=int, default=1)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print one estimate, or with ``--ladder`` the table of strategy mixes."""
    arguments = _parse_arguments(argv)
    try:
        if arguments.preset:
            config = preset_config(arguments.preset, arguments.num_labels)
            source = arguments.preset
        else:
            source = arguments.config or arguments.model
            config = load_config(source, arguments.num_labels)
        if arguments.ladder:
            rows = []
            for label, options in ladder(arguments.batch_size, arguments.seq_len):
                options = {"batch_size": arguments.batch_size, "seq_len": arguments.seq_len, "num_labels": arguments.num_labels, **options}
                rows.append((label, estimate(copy.deepcopy(config), **options)))
        else:
            options = {
                "batch_size": arguments.batch_size, "seq_len": arguments.seq_len, "num_labels": arguments.num_labels,
                "precision": arguments.precision, "optimizer": arguments.optim, "gradient_checkpointing": arguments.grad_checkpoint,
                "optimizer_in_backward": arguments.optim_in_backward, "freeze_embeddings": arguments.freeze_embeddings,
                "freeze_layers": arguments.freeze_layers, "freeze_encoder": arguments.freeze_encoder,
                "foreach": False if arguments.no_foreach else None, "accum_steps": arguments.accum,
            }
            rows = [("as given", estimate(config, **options))]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    parameters = rows[0][1]["parameters"]
    print(f"{source}: {parameters / 1e6:.1f}M parameters, batch {arguments.batch_size}, seq {arguments.seq_len}; meter: estimate_fake_tensor_tracker (GiB)\n")
    print(_table(rows))
    notes = sorted({note for _, result in rows for note in result["notes"]})
    for note in notes:
        print(f"\nnote: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
