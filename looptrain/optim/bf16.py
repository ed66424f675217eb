"""bf16 weights without fp32 master weights: every update computed in fp32, one tensor at a time, and
written back with stochastic rounding.

A bf16 parameter holds 8 bits of mantissa: near 0.05 its neighbours are 2.4e-4 apart, so an update of
lr 2e-5 rounds back to the same value every step and fine-tuning stalls. Stochastic rounding rounds
up or down at random, with the probabilities that make the expected stored value the exact fp32
result (E[round(x)] = x): small updates then move the weights on average, as in fp32.

`BF16Optimizer` wraps an ordinary optimizer (AdamW, bitsandbytes' 8-bit AdamW, Adafactor, SGD): for
each parameter in turn it upcasts the parameter and its gradient to fp32, lets a per-parameter copy
of the optimizer step it, and rounds the result back into the bf16 storage. Only one tensor's fp32
copies exist at a time, and a tensor of more than `STEP_CHUNK_ELEMENTS` (an embedding) stepped by AdamW
or SGD goes in chunks of rows, bitwise the same, so the step's transient is a chunk's; a 2-D one stepped
by Hugging Face's Adafactor goes in passes over chunks of rows, the same up to fp32 rounding noise (its
column means and RMS norms sum in another order). The optimizer state is created in fp32 (AdamW 8 B/param,
8-bit AdamW 2, Adafactor's factored state ~0).
`OptimizerInBackward(..., bf16_weights=True)` does the same inside backward.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from looptrain.fake import is_fake
from looptrain.optim.chunk_pricing import rounding_chunks_run, stack_norms, window_layouts, zero_norms
from looptrain.optim.per_parameter import PerParameterOptimizer

GRAD_DTYPES = ("bf16", "fp32")
# A bf16 tensor larger than this steps in chunks of whole rows of about this many elements (16 MiB in fp32),
# so the step's fp32 copies and the optimizer's temporaries are a chunk's, not the embedding's.
STEP_CHUNK_ELEMENTS = 1 << 22
# Optimizers whose update is elementwise over a parameter's elements, with state that is either
# parameter-shaped or scalar (a step count): stepping row chunks is bitwise the same as one whole step.
# Not their fused=True kernels (on CPU they round the elements past the last full vector differently,
# so the result depends on where a chunk ends), nor bitsandbytes' optimizers (blockwise 8-bit state, and
# 8 or 32 bits chosen from the tensor's size): those step whole. Hugging Face's Adafactor (row and column
# means, RMS norms over the whole tensor) has its own chunked step for 2-D tensors,
# `_step_adafactor_in_row_chunks_`, equal to its whole step up to fp32 rounding noise.
_ROW_WISE_OPTIMIZERS = (torch.optim.AdamW, torch.optim.SGD)
_ROUNDING_WINDOW = 1 << 22  # random bits drawn per call: bounds the rounding's temporaries to ~48 MiB
_HIGH_BITS = -65536  # 0xFFFF0000 as an int32: the bits a bf16 keeps of an fp32
RowSource = Callable[[slice], torch.Tensor]  # rows of a gradient that never exists whole (`step_rows_`)
FAKE_CHUNKS_SKIPPED = True  # `priced_chunks`, `_round_flat_`: on fakes, only the chunks and ops that differ in bytes


class _RoundingNoise:
    """The random low bits that round a tensor of `numel` elements, handed out in order, piece by piece.

    They are drawn in windows of `_ROUNDING_WINDOW` elements: the same `torch.randint` calls, in the same
    order, whether the tensor is rounded whole or row chunk by row chunk, so the random stream does not
    depend on the chunking on any device (CPU's generator gives the same bits for two draws as for one;
    a counter-based generator such as CUDA's Philox, which advances per call, does not: checked on an H100 by
    tests/test_bf16_chunked.py).
    """

    def __init__(self, numel: int, device: torch.device, generator: torch.Generator | None):
        self._undrawn = numel
        self._device = device
        self._generator = generator
        self._window = torch.empty(0, dtype=torch.int32, device=device)
        self._used = 0

    def pieces(self, count: int, sizes_only: bool = False):
        """Yields the next `count` random integers in [0, 2^16), as int32 pieces of at most one window each
        (`sizes_only`: the window each is from and its size, which hold it as long, for the estimator's fakes)."""
        while count > 0:
            if self._used == self._window.numel():
                if self._undrawn == 0:
                    raise ValueError("_RoundingNoise: asked for more bits than the tensor has elements.")
                size = min(_ROUNDING_WINDOW, self._undrawn)
                self._window = torch.randint(0, 1 << 16, (size,), dtype=torch.int32, device=self._device,
                                             generator=self._generator)
                self._undrawn -= size
                self._used = 0
            taken = min(count, self._window.numel() - self._used)
            piece = (self._window, taken) if sizes_only else self._window[self._used:self._used + taken]
            self._used += taken
            if self._used == self._window.numel():  # used up: not held while the next chunk steps
                self._window = torch.empty(0, dtype=torch.int32, device=self._device)
                self._used = 0
            count -= taken
            yield piece

    def skip(self, count: int) -> None:
        """Passes over the next `count` bits (`priced_chunks` on fakes): the window held is let go if they use it up,
        those they use whole are never drawn, the one they end in is drawn and held, as `pieces` leaves it."""
        held = self._window.numel() - self._used
        if count < held:
            self._used += count
            return
        count -= held
        if held:  # used up: let go, as `pieces` does
            self._window, self._used = torch.empty(0, dtype=torch.int32, device=self._device), 0
        whole = count // _ROUNDING_WINDOW * _ROUNDING_WINDOW  # drawn and let go inside the skipped bits: never drawn
        self._undrawn -= whole
        for _ in self.pieces(count - whole, sizes_only=True):  # the window the skipped bits end in, drawn and held
            pass


def _round_flat_(target: torch.Tensor, value: torch.Tensor, noise: _RoundingNoise) -> None:
    """Rounds flat fp32 `value` into flat bf16 `target` stochastically, with the next bits of `noise`. On the
    estimator's fake tensors (no bits to round) each piece makes only what it holds: its sum, an int32 per element."""
    start, fake = 0, FAKE_CHUNKS_SKIPPED and is_fake(value)
    for piece in noise.pieces(value.numel(), sizes_only=fake):
        stop = start + (piece[1] if fake else piece.numel())
        if fake:
            rounded = torch.empty(stop - start, dtype=torch.int32, device=noise._device)
        else:
            rounded = (value[start:stop].view(torch.int32) + piece).bitwise_and_(_HIGH_BITS).view(torch.float32)
            target[start:stop].copy_(rounded)  # exact: the low 16 bits are zero
        start = stop


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Writes fp32 `value` into bf16 `target`, rounding each element up or down at random, unbiased.

    Adds a uniform random integer in [0, 2^16) to the 16 low bits of each fp32 bit pattern and drops
    them: the chance of rounding up is the dropped fraction, so E[target] = value. The carry
    propagates into the exponent correctly, and the sign-magnitude layout makes it right for negative
    numbers too. Works window by window on contiguous memory.
    """
    if target.dtype != torch.bfloat16 or value.dtype != torch.float32:
        raise TypeError(
            f"stochastic_round_: expected a bf16 target and an fp32 value, got {target.dtype} and {value.dtype}"
        )
    _round_flat_(target.view(-1), value.contiguous().view(-1), _RoundingNoise(value.numel(), value.device, generator))


def fp32_norm(tensor: torch.Tensor, chunk_elements: int = STEP_CHUNK_ELEMENTS) -> torch.Tensor:
    """``torch.linalg.vector_norm(tensor, 2, dtype=torch.float32)``, in chunks of rows for a large bf16 tensor.

    On CPU, ``vector_norm`` with ``dtype=float32`` converts a bf16 tensor to fp32 whole before reducing: for
    a tied embedding's ``[151,936 x 1,536]`` gradient, an 890 MiB temporary that no tensor tracker sees (it is
    freed inside the op). Per chunk of about `chunk_elements` elements the copy is a chunk's; the chunks' norms
    are combined in fp32 (the same value up to fp32 rounding, and a better-conditioned sum). On fake tensors the
    middle chunks' norms are stood in for (`priced_chunks`: each is a 0-d fp32 tensor, as theirs).
    """
    if tensor.dtype == torch.float32 or tensor.dim() == 0 or tensor.numel() <= chunk_elements:
        return torch.linalg.vector_norm(tensor, 2, dtype=torch.float32)
    rows = max(1, chunk_elements // max(1, tensor[0].numel()))
    norms: list[torch.Tensor] = []
    chunks = [slice(start, start + rows) for start in range(0, tensor.shape[0], rows)]
    for chunk in priced_chunks(chunks, tensor, stand_ins=zero_norms(norms, tensor.device)):
        norms.append(torch.linalg.vector_norm(tensor[chunk], 2, dtype=torch.float32))
    return torch.linalg.vector_norm(stack_norms(norms), 2)


def step_in_fp32_(parameter: nn.Parameter, optimizer: torch.optim.Optimizer, gradient: torch.Tensor,
                  stochastic_rounding: bool = True, chunk_elements: int | None = None) -> None:
    """Steps one bf16 parameter in fp32 with `optimizer` (a per-parameter optimizer of it), writes it back.

    The parameter's storage is swapped for an fp32 copy while the optimizer steps (so its state is
    created and updated in fp32), then the result is rounded into the original bf16 storage:
    stochastically, or to nearest with `stochastic_rounding=False` (the control that stalls).

    A tensor of more than `chunk_elements` elements (default `STEP_CHUNK_ELEMENTS`) stepped by AdamW or
    SGD goes in chunks of whole rows (dim 0): each chunk's fp32 copy is stepped with views of the
    gradient's and the state's rows and rounded back before the next is made, with the same random bits
    as the whole tensor's rounding; weights and state come out bitwise the same as one whole step.
    A 2-D one stepped by `transformers.optimization.Adafactor` goes in passes over chunks of rows
    (`_step_adafactor_in_row_chunks_`): the same formulas, the same random bits, equal to the whole step
    up to fp32 rounding noise (not bitwise).
    """
    if parameter.dtype != torch.bfloat16:  # a parameter kept in fp32 (a norm layer, say) steps as usual
        parameter.grad = gradient.to(parameter.dtype)
        optimizer.step()
        parameter.grad = None
        return
    rows_per_chunk = _rows_per_chunk(parameter, optimizer, STEP_CHUNK_ELEMENTS if chunk_elements is None
                                     else chunk_elements)
    if rows_per_chunk is not None and not gradient.is_sparse:  # sparse: the optimizer's own error, whole
        if _is_factored_adafactor(parameter, optimizer):
            try:
                _step_adafactor_in_row_chunks_(parameter, optimizer, gradient, stochastic_rounding, rows_per_chunk)
            finally:
                parameter.grad = None  # as the other paths: the gradient is dropped once stepped
        else:
            _step_in_row_chunks_(parameter, optimizer, gradient, stochastic_rounding, rows_per_chunk)
        return
    storage = parameter.data
    parameter.data = storage.float()
    parameter.grad = gradient.float()
    try:
        optimizer.step()
        updated = parameter.data
    finally:
        parameter.data = storage
        parameter.grad = None
    if stochastic_rounding:
        stochastic_round_(storage, updated)
    else:
        storage.copy_(updated)


def _rows_per_chunk(parameter: nn.Parameter, optimizer: torch.optim.Optimizer, chunk_elements: int) -> int | None:
    """Rows of `parameter` stepped at a time (at least one), or None to step it whole."""
    if parameter.numel() <= chunk_elements:
        return None
    if type(optimizer) in _ROW_WISE_OPTIMIZERS:
        if optimizer.param_groups[0].get("fused"):
            return None
    elif not _is_factored_adafactor(parameter, optimizer):
        return None
    if parameter.dim() == 0 or not parameter.is_contiguous():  # the rounding walks rows as flat memory
        return None
    return max(1, chunk_elements // (parameter.numel() // parameter.shape[0]))


def priced_chunks(chunks: list[slice], storage: torch.Tensor, noise: _RoundingNoise | None = None,
                  stand_ins: Callable[[int], None] | None = None):
    """The chunks of rows a pass of a row-chunked step runs: every one, except on the estimator's fake tensors.

    There, the full chunks after the second and before the last full one are the same ops on tensors of the same
    sizes as their neighbours, so the same bytes: they are skipped, `stand_ins(count)` once for each run of `count`
    of them (what skipped chunks leave behind, such as their 0-d norms: `chunk_pricing.zero_norms`), and
    `noise` passes over their bits. Each skipped chunk holds no
    more than the one run after them (what chunks leave behind only grows), so the peak and every byte after
    are the whole pass's. With `noise` (the rounding pass: its chunks leave nothing behind), a chunk's ops also
    depend on where its bits fall in the windows (`chunk_pricing.window_layouts`): of the middle chunks of a layout, the
    first with the largest first piece runs too (`chunk_pricing.rounding_chunks_run`); none is skipped where a chunk
    holds more bits than a window.
    """
    elements = storage.numel() // max(1, storage.shape[0]) * (chunks[0].stop - chunks[0].start) if chunks else 0
    if (not FAKE_CHUNKS_SKIPPED or len(chunks) < 6 or not is_fake(storage)
            or (noise is not None and elements > _ROUNDING_WINDOW)):
        yield from chunks
        return
    run = {0, 1, *range(len(chunks) - 3, len(chunks))}
    if noise is not None:
        run |= rounding_chunks_run(window_layouts(noise._used, noise._window.numel(), noise._undrawn, _ROUNDING_WINDOW,
                                                  [elements] * (len(chunks) - 3)))
    index = 0
    while index < len(chunks):
        if index in run:
            yield chunks[index]
            index += 1
            continue
        skipped = next(later for later in range(index, len(chunks)) if later in run) - index
        if stand_ins is not None:
            stand_ins(skipped)
        if noise is not None:
            noise.skip(skipped * elements)
        index += skipped


def _step_in_row_chunks_(parameter: nn.Parameter, optimizer: torch.optim.Optimizer, gradient: torch.Tensor,
                         stochastic_rounding: bool, rows_per_chunk: int) -> None:
    """`step_in_fp32_` for a large tensor, `rows_per_chunk` rows at a time (see there).

    The optimizer sees each chunk as the whole parameter: its state entry is swapped for the rows of
    the parameter-shaped state tensors (updated in place, or copied back) and a copy of the scalars as
    they were before this step (so the step count advances once). On the first step it creates each
    chunk's state itself, which is copied into full-size tensors: what its zero (or gradient) start
    gives, row by row.
    """
    storage = parameter.data
    had_state = parameter in optimizer.state
    state = optimizer.state[parameter]
    scalars_before = {key: value for key, value in state.items() if not _is_parameter_shaped(value, storage)}
    first_step = not state
    noise = _RoundingNoise(storage.numel(), storage.device, None) if stochastic_rounding else None
    scalars_after: dict[str, Any] = {}
    chunks = [slice(start, start + rows_per_chunk) for start in range(0, storage.shape[0], rows_per_chunk)]
    try:
        for chunk in priced_chunks(chunks, storage, noise):
            scalars_after = _step_chunk_(parameter, optimizer, storage, gradient, chunk, state, scalars_before,
                                         first_step, noise)
    finally:
        parameter.data = storage
        parameter.grad = None
        optimizer.state[parameter] = state
        if not state and not had_state:  # SGD without momentum keeps no state entry at all
            del optimizer.state[parameter]
    state.update(scalars_after)


def _step_chunk_(parameter: nn.Parameter, optimizer: torch.optim.Optimizer, storage: torch.Tensor,
                 gradient: torch.Tensor, rows: slice, state: dict, scalars_before: dict, first_step: bool,
                 noise: _RoundingNoise | None) -> dict[str, Any]:
    """Steps and rounds back one chunk of rows (a function, so its fp32 copies are freed when it returns).

    Returns the optimizer's scalar state after this chunk (the step count), the same for every chunk.
    """
    given = {} if first_step else {
        key: _copy_of(value) if key in scalars_before else value[rows] for key, value in state.items()
    }
    optimizer.state[parameter] = dict(given)
    parameter.data = storage[rows].float()
    parameter.grad = _rows_of(gradient, rows).float()
    optimizer.step()
    updated = parameter.data
    parameter.data = storage
    parameter.grad = None
    scalars = {}
    for key, value in optimizer.state[parameter].items():
        if not _is_parameter_shaped(value, updated):
            scalars[key] = value
            state.setdefault(key, value)  # keeps the optimizer's order of keys on the first step
            continue
        if first_step and rows.start == 0:
            state[key] = torch.empty(storage.shape, dtype=value.dtype, device=value.device)
        if value is not given.get(key):  # created on the first step, or replaced instead of updated in place
            state[key][rows].copy_(value)
    optimizer.state[parameter] = {}  # this chunk's own state (first step) goes with the chunk
    row_numel = storage.numel() // storage.shape[0]
    target = storage.view(-1)[rows.start * row_numel:rows.start * row_numel + updated.numel()]
    if noise is not None:
        _round_flat_(target, updated.view(-1), noise)
    else:
        target.copy_(updated.view(-1))
    return scalars


def _is_factored_adafactor(parameter: nn.Parameter, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is exactly Hugging Face's Adafactor or looptrain's (the same step, in place) and
    `parameter` a 2-D tensor, which it factors.

    Reads `sys.modules` only: an Adafactor object means its module is imported already.
    """
    classes = {getattr(sys.modules.get(name), "Adafactor", None)
               for name in ("transformers.optimization", "looptrain.optim.adafactor")}
    return type(optimizer) in classes - {None} and parameter.dim() == 2


def _root_mean_square(norms: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The RMS of a tensor from the fp32 2-norms of its chunks: Adafactor's `_rms` (`norm(2) / numel**0.5`)."""
    return torch.linalg.vector_norm(stack_norms(norms).double()).float() / (numel**0.5)


@torch.no_grad()
def _step_adafactor_in_row_chunks_(parameter: nn.Parameter, optimizer: torch.optim.Optimizer,
                                   gradient: torch.Tensor, stochastic_rounding: bool, rows_per_chunk: int) -> None:
    """`step_in_fp32_` for a large 2-D tensor stepped by `transformers.optimization.Adafactor`, in row chunks.

    Adafactor's update rule (docs/optimizers.md, "Adafactor's update rule") for a factored (2-D) parameter, with
    the optimizer's own `_get_lr`, in three passes over chunks of `rows_per_chunk` rows, each chunk's fp32 copies
    made and freed inside the pass: (1) RMS(W) from the chunks' 2-norms, `exp_avg_sq_row` per row and the column
    sums for `exp_avg_sq_col`; (2) each chunk's update, for its RMS; (3) the update again, clipped, scaled, through
    `exp_avg`, with weight decay, subtracted from the chunk's fp32 copy and rounded into its bf16 rows with the
    next bits of the whole tensor's random stream.

    The state (its keys in Adafactor's order, `step` an int, `RMS` a 0-d tensor) is what the whole step
    leaves, but not bitwise: the column sums add across chunks, and the two RMS norms combine the chunks'
    norms, in another order than one reduction over the whole tensor, so `exp_avg_sq_col`, `RMS`, the
    update's clip factor, and through them everything after, differ from the whole step by fp32 rounding
    noise (a few 1e-7 relative); a bf16 weight can then land one bf16 step away where its value sits at a
    rounding boundary. The per-row means and the elementwise ops are the whole step's.
    """
    group = next(group for group in optimizer.param_groups if any(member is parameter for member in group["params"]))
    storage = parameter.data
    rows, columns = storage.shape
    chunks = [slice(start, start + rows_per_chunk) for start in range(0, rows, rows_per_chunk)]
    fp32 = {"dtype": torch.float32, "device": storage.device}
    use_first_moment = group["beta1"] is not None
    state = optimizer.state[parameter]
    if len(state) == 0:
        state["step"] = 0
        if use_first_moment:
            state["exp_avg"] = torch.zeros(storage.shape, **fp32)
        state["exp_avg_sq_row"] = torch.zeros(rows, **fp32)
        state["exp_avg_sq_col"] = torch.zeros(columns, **fp32)
        state["RMS"] = 0
    else:
        if use_first_moment:
            state["exp_avg"] = state["exp_avg"].to(**fp32)
        state["exp_avg_sq_row"] = state["exp_avg_sq_row"].to(**fp32)
        state["exp_avg_sq_col"] = state["exp_avg_sq_col"].to(**fp32)
    exp_avg_sq_row, exp_avg_sq_col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]

    state["step"] += 1
    beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])
    parameter_norms = []
    column_sums = torch.zeros(columns, **fp32)
    for chunk in priced_chunks(chunks, storage, stand_ins=zero_norms(parameter_norms, storage.device)):
        parameter_norms.append(storage[chunk].float().norm(2))
        squares = (_rows_of(gradient, chunk).float() ** 2) + group["eps"][0]
        exp_avg_sq_row[chunk].mul_(beta2t).add_(squares.mean(dim=-1), alpha=(1.0 - beta2t))
        column_sums.add_(squares.sum(dim=-2))
        del squares
    state["RMS"] = _root_mean_square(parameter_norms, storage.numel())
    lr = type(optimizer)._get_lr(group, state)
    exp_avg_sq_col.mul_(beta2t).add_(column_sums.div_(rows), alpha=(1.0 - beta2t))  # mean = sum / rows, as torch

    # Adafactor's _approx_sq_grad, its factors kept apart: the update is their product times the gradient.
    row_factor = (exp_avg_sq_row / exp_avg_sq_row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    column_factor = exp_avg_sq_col.unsqueeze(-2).rsqrt()

    def update_of(chunk: slice) -> torch.Tensor:
        return torch.mul(row_factor[chunk], column_factor).mul_(_rows_of(gradient, chunk).float())

    update_norms: list[torch.Tensor] = []
    for chunk in priced_chunks(chunks, storage, stand_ins=zero_norms(update_norms, storage.device)):
        update_norms.append(update_of(chunk).norm(2))
    clip = (_root_mean_square(update_norms, storage.numel()) / group["clip_threshold"]).clamp_(min=1.0)
    del update_norms

    noise = _RoundingNoise(storage.numel(), storage.device, None) if stochastic_rounding else None
    row_numel = columns
    for chunk in priced_chunks(chunks, storage, noise):
        update = update_of(chunk)
        update.div_(clip)
        update.mul_(lr)
        if use_first_moment:
            exp_avg = state["exp_avg"][chunk]
            exp_avg.mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
            update = exp_avg
        weights = storage[chunk].float()
        if group["weight_decay"] != 0:
            weights.add_(weights, alpha=(-group["weight_decay"] * lr))
        weights.sub_(update)  # bitwise add_(-update), without its temporary (as looptrain's Adafactor)
        del update
        target = storage.view(-1)[chunk.start * row_numel:chunk.start * row_numel + weights.numel()]
        if noise is not None:
            _round_flat_(target, weights.view(-1), noise)
        else:
            target.copy_(weights.view(-1))
        del weights  # not held while the next chunk's update is made


def steps_in_rows(parameter: nn.Parameter, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_rows_` can step `parameter` with `optimizer` (an optimizer whose groups hold it, or one of its
    per-parameter optimizers): a contiguous 2-D tensor stepped by AdamW or SGD (not their fused kernels) or by a
    factored Adafactor."""
    if parameter.dim() != 2 or not parameter.is_contiguous():
        return False
    if type(optimizer) in _ROW_WISE_OPTIMIZERS:
        groups = optimizer.param_groups
        group = next((group for group in groups if any(member is parameter for member in group["params"])), groups[0])
        return not group.get("fused")
    return _is_factored_adafactor(parameter, optimizer)


def step_rows_(parameter: nn.Parameter, optimizer: torch.optim.Optimizer, rows_of: RowSource, rows_per_chunk: int,
               stochastic_rounding: bool = True) -> None:
    """Steps `parameter` (`steps_in_rows`) from a gradient that never exists whole: `rows_of(rows)` returns the
    gradient's rows `rows` (a slice of dim 0; the parameter's dtype or fp32), and is called for each chunk of
    `rows_per_chunk` rows in each pass of the row-chunked step (AdamW, SGD: one; Adafactor: three), always before
    that chunk's rows are written. The step is `step_in_fp32_`'s row-chunked one (bitwise the whole step for AdamW
    and SGD given the same rows, to fp32 noise for Adafactor); a bf16 parameter is rounded back stochastically
    unless `stochastic_rounding` is False, an fp32 one is stepped in place."""
    rounding = stochastic_rounding and parameter.dtype == torch.bfloat16
    if _is_factored_adafactor(parameter, optimizer):
        try:
            _step_adafactor_in_row_chunks_(parameter, optimizer, rows_of, rounding, rows_per_chunk)
        finally:
            parameter.grad = None
    else:
        _step_in_row_chunks_(parameter, optimizer, rows_of, rounding, rows_per_chunk)


def _rows_of(gradient: torch.Tensor | RowSource, rows: slice) -> torch.Tensor:
    """Rows of a whole gradient, or of one given by rows (`step_rows_`)."""
    return gradient(rows) if callable(gradient) else gradient[rows]


def _is_parameter_shaped(value: Any, parameter: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == parameter.shape


def _copy_of(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


class BF16Optimizer(PerParameterOptimizer):
    """Steps bf16 parameters in fp32, one tensor at a time, with stochastic rounding.

    Args:
        model_or_params: the model or its parameters (the trainable ones are stepped).
        optimizer: the optimizer whose groups hold them (its hyperparameters, `lr` included, are read
            at every step, so schedulers built on it keep working); it must have no state yet.
        stochastic_rounding: False rounds to nearest (the control: small updates vanish).
        grad_dtype: "bf16" (default): gradients accumulate in the parameters' dtype, 2 B/param, as
            autograd leaves them; "fp32": each micro-batch's gradient is added into an fp32 buffer
            (`parameter.main_grad`, 4 B/param) and freed, for long accumulation windows whose sum
            bf16 would round at every addition.
    """

    def __init__(self, model_or_params: Any, optimizer: torch.optim.Optimizer, *, stochastic_rounding: bool = True,
                 grad_dtype: str = "bf16"):
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"BF16Optimizer: grad_dtype must be one of {GRAD_DTYPES}, got {grad_dtype!r}.")
        self.stochastic_rounding = stochastic_rounding
        self.grad_dtype = grad_dtype
        self._handles = []
        super().__init__(model_or_params, optimizer)

    def _adopt(self, parameter: nn.Parameter) -> None:
        super()._adopt(parameter)
        if self.grad_dtype == "fp32":
            self._handles.append(parameter.register_post_accumulate_grad_hook(_accumulate_in_fp32))

    def _steps_in_fp32(self, parameter: nn.Parameter) -> bool:
        return parameter.dtype == torch.bfloat16

    def gradients(self) -> list[torch.Tensor]:
        """The accumulated gradients: `main_grad` (fp32) or `.grad` (bf16), for the parameters that have one."""
        found = (gradient_of(parameter) for parameter in self.parameters)
        return [gradient for gradient in found if gradient is not None]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scales the gradients to global norm `max_norm` at most; returns their norm before, in fp32.

        What `torch.nn.utils.clip_grad_norm_` does, but reading the fp32 buffers when gradients
        accumulate there, and always summing in fp32 (bf16 norms would be rounded to 3 digits).
        """
        gradients = self.gradients()
        if not gradients:
            return torch.zeros((), dtype=torch.float32)
        norms = torch.stack([fp32_norm(gradient) for gradient in gradients])
        total = torch.linalg.vector_norm(norms, 2)
        if math.isfinite(max_norm):
            scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for gradient in gradients:
                gradient.mul_(scale.to(gradient.dtype))
        return total

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Steps every parameter that has a gradient: fp32 update, then rounding into bf16."""
        for parameter in self.parameters:
            gradient = gradient_of(parameter)
            if gradient is None:
                continue
            step_in_fp32_(parameter, self.optimizer_of(parameter), gradient, self.stochastic_rounding)
        self.optimizer._opt_called = True  # LR schedulers built on the original check that it stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients (and the fp32 buffers)."""
        for parameter in self.parameters:
            parameter.grad = None
            if hasattr(parameter, "main_grad"):
                del parameter.main_grad

    def remove(self) -> None:
        """Removes the fp32-accumulation hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def gradient_of(parameter: nn.Parameter) -> torch.Tensor | None:
    """The parameter's accumulated gradient: its fp32 `main_grad` when it has one, else `.grad`."""
    main_grad = getattr(parameter, "main_grad", None)
    return main_grad if main_grad is not None else parameter.grad


def _accumulate_in_fp32(parameter: nn.Parameter) -> None:
    """Adds the bf16 gradient autograd just accumulated into `parameter.main_grad` (fp32) and frees it."""
    with torch.no_grad():
        if getattr(parameter, "main_grad", None) is None:
            parameter.main_grad = parameter.grad.float()
        else:
            parameter.main_grad.add_(parameter.grad)
    parameter.grad = None


def stored_in_bf16(model: nn.Module) -> bool:
    """Whether the model's own floating-point parameters are stored in bf16 already (some, at least: the ones kept
    fp32 on purpose stay so). The bias of a 4-bit quantized layer (QLoRA) is in its compute dtype, not a choice of
    storage, and does not count."""
    from looptrain.lora import is_4bit_layer

    return any(parameter.dtype == torch.bfloat16 for module in model.modules() if not is_4bit_layer(module)
               for parameter in module.parameters(recurse=False))


def cast_to_bf16(model: nn.Module, keep_fp32: tuple[type, ...] = ()) -> list[str]:
    """Stores the model's floating-point parameters and buffers in bf16 in place (identity kept).

    Args:
        model: the model.
        keep_fp32: module types whose own parameters stay fp32 (e.g. normalisation layers).

    Returns:
        The names of the parameters kept in fp32.
    """
    kept = []
    for module_name, module in model.named_modules():
        keep = isinstance(module, keep_fp32) if keep_fp32 else False
        for name, parameter in module.named_parameters(recurse=False):
            if keep:
                kept.append(f"{module_name}.{name}".lstrip("."))
            elif parameter.is_floating_point():
                parameter.data = parameter.data.to(torch.bfloat16)
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_floating_point() and not keep:
                setattr(module, name, buffer.to(torch.bfloat16))
    return kept
