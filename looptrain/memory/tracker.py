"""The storage tracker: a dispatch mode that counts live tensor bytes, their peak, phase and breakdown.

`StorageTracker` registers the storage of every tensor an op reads or produces and hears about its
release through a weak reference, so its `current_bytes` is the bytes of live tensors at every
moment, by category (params, grads, optimizer state, activations and temporaries). It works on
real and fake tensors alike: the CPU meter runs it on a real step, the estimator on a fake one.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from looptrain.optim import inner_optimizers

CATEGORY_PARAMS = "params"
CATEGORY_GRADS = "grads"
CATEGORY_OPTIMIZER = "optimizer_state"
CATEGORY_OTHER = "activations_and_temps"
CATEGORIES = (CATEGORY_PARAMS, CATEGORY_GRADS, CATEGORY_OPTIMIZER, CATEGORY_OTHER)


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


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """All tensors held in the optimizer's state (8-bit states, absmax, quantization maps, steps)."""
    tensors: list[torch.Tensor] = []
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            leaves, _ = tree_flatten(state)
            tensors.extend(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
    return tensors


# --------------------------------------------------------------------------------------------
# The storage tracker
# --------------------------------------------------------------------------------------------


@functools.cache
def _bnb_python_kernels() -> dict[str, Callable[..., Any]]:
    """bitsandbytes' CPU optimizer kernels, which are Python functions built from torch ops.

    Called directly (instead of through the dispatcher, which runs them with the mode popped), their
    fp32 temporaries (dequantized states, grad copies) reach the tracker. Empty if bnb is absent.
    Looked up only when a ``bitsandbytes::`` op is first dispatched (such an op exists only once
    bitsandbytes is imported), so tracking a run without it never pays bitsandbytes' import.
    """
    try:
        from bitsandbytes.backends.cpu import ops as bnb_cpu_ops
    except Exception:  # noqa: BLE001 (not installed, or its native library fails to load with any error type)
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

    bitsandbytes' CPU optimizer kernels are Python functions of torch ops; the tracker calls them
    directly (the dispatcher would run them with the mode popped), so their fp32 temporaries count,
    on real and on fake tensors alike.

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
        self.category_bytes = dict.fromkeys(CATEGORIES, 0)
        self.phase = "setup"
        self.peak_bytes = 0
        self.peak_phase = "setup"
        self.peak_sequence = -1
        self.peak_category_bytes = dict(self.category_bytes)
        self.phase_peak_bytes: dict[str, int] = {}
        self._current_phase_peak = -1  # phase_peak_bytes[phase], cached: update_peak runs after every op
        self._kernel_of_op: dict[Any, Any] = {}  # op -> bitsandbytes Python kernel or None
        self._self_reference = weakref.ref(self)
        self.timeline: list[tuple[Any, str, int]] | None = None  # `record_timeline`
        self._event: Any = "classify"
        self._scratch_rule: Callable[[Any, list[torch.Tensor]], int] | None = None  # `price_op_scratch`
        self.scratch_peak_bytes = 0

    def record_timeline(self) -> None:
        """From now on, append ``(event, phase, live bytes)`` to `timeline` at every point the peak is checked: after
        each op (the event: the op's name and its outputs' bytes) and each classification ("classify"). The estimator
        compares the timelines of stacks of 2, 3 and 4 blocks to extrapolate one of N (`looptrain.estimation.blocks`).
        """
        self.timeline = [("start", self.phase, self.current_bytes)]

    def price_op_scratch(self, rule: Callable[[Any, list[torch.Tensor]], int]) -> None:
        """From now on, count at each op the bytes `rule(op, outputs)` says its kernel holds inside while it runs,
        memory that is no tensor (oneDNN's fp32 buffer of an emulated bf16 matmul: `looptrain.memory.kernels.
        cpu_bf16_matmul_scratch`), in `scratch_peak_bytes`: the highest of the live tensors plus that. `peak_bytes`
        stays the peak of tensors alone, which a tracker on a real run measures."""
        self._scratch_rule = rule

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
        if self.timeline is not None:
            self.timeline.append((self._event, self.phase, current))
            self._event = "classify"
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
        self.scratch_peak_bytes = 0
        self.peak_sequence = -1
        self.phase_peak_bytes = {}
        self._current_phase_peak = -1
        self.update_peak()

    def run_python_kernel(self, op: Any, kernel: Callable[..., Any]) -> None:
        """Run `op` through `kernel`, a Python function of torch ops, so that its temporaries are seen.

        The dispatcher runs an op's kernel with the mode popped: what it allocates and frees inside is not
        seen. A kernel given here is called by the tracker itself, inside the mode, as bitsandbytes' CPU
        optimizer kernels are (`_bnb_python_kernels`). The estimator gives bitsandbytes' 4-bit matmul its
        Python kernel this way, so that the dequantized weight it makes is priced.

        Args:
            op: the op overload (``torch.ops.<namespace>.<name>.default``).
            kernel: a function of the op's arguments returning its outputs.
        """
        self._kernel_of_op[op] = kernel

    # -- dispatch ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._sequence += 1
        kernel = self._kernel_of_op.get(func, _NO_KERNEL)
        if kernel is _NO_KERNEL:
            name = func._schema.name
            kernel = _bnb_python_kernels().get(name) if name.startswith("bitsandbytes::") else None
            self._kernel_of_op[func] = kernel
        if kernel is not None:
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
        if self._scratch_rule is not None:
            held = self.current_bytes + self._scratch_rule(func, outputs)
            self.scratch_peak_bytes = max(self.scratch_peak_bytes, held)
        if self.timeline is not None:
            self._event = (func.__name__, sum(storage.nbytes() for storage in map(_storage_of, outputs)
                                              if storage is not None))
        self.update_peak()
        return output


def _on_free(tracker_reference: weakref.ref, key: int) -> None:
    tracker = tracker_reference()
    if tracker is not None:
        tracker._forget(key)
