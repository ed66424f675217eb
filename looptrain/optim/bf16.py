"""bf16 weights without fp32 master weights: every update computed in fp32, one tensor at a time, and
written back with stochastic rounding.

A bf16 parameter holds 8 bits of mantissa: near 0.05 its neighbours are 2.4e-4 apart, so an update of
lr 2e-5 rounds back to the same value every step and fine-tuning stalls. Stochastic rounding rounds
up or down at random, with the probabilities that make the expected stored value the exact fp32
result (E[round(x)] = x): small updates then move the weights on average, as in fp32.

`BF16Optimizer` wraps an ordinary optimizer (AdamW, bitsandbytes' 8-bit AdamW, Adafactor, SGD): for
each parameter in turn it upcasts the parameter and its gradient to fp32, lets a per-parameter copy
of the optimizer step it, and rounds the result back into the bf16 storage. Only one tensor's fp32
copies exist at a time. The optimizer state is created in fp32 (AdamW 8 B/param, 8-bit AdamW 2,
Adafactor's factored state ~0). `OptimizerInBackward(..., bf16_weights=True)` does the same inside
backward.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from looptrain.optim.per_parameter import PerParameterOptimizer

GRAD_DTYPES = ("bf16", "fp32")
_CHUNK = 1 << 22  # elements rounded at a time: bounds the rounding's own temporaries to ~48 MiB
_HIGH_BITS = -65536  # 0xFFFF0000 as an int32: the bits a bf16 keeps of an fp32


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Writes fp32 `value` into bf16 `target`, rounding each element up or down at random, unbiased.

    Adds a uniform random integer in [0, 2^16) to the 16 low bits of each fp32 bit pattern and drops
    them: the chance of rounding up is the dropped fraction, so E[target] = value. The carry
    propagates into the exponent correctly, and the sign-magnitude layout makes it right for negative
    numbers too. Works chunk by chunk on contiguous memory.
    """
    if target.dtype != torch.bfloat16 or value.dtype != torch.float32:
        raise TypeError(
            f"stochastic_round_: expected a bf16 target and an fp32 value, got {target.dtype} and {value.dtype}"
        )
    flat_target = target.view(-1)
    flat_value = value.contiguous().view(-1)
    for start in range(0, flat_value.numel(), _CHUNK):
        bits = flat_value[start:start + _CHUNK].view(torch.int32)
        noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
        rounded = (bits + noise).bitwise_and_(_HIGH_BITS).view(torch.float32)
        flat_target[start:start + _CHUNK].copy_(rounded)  # exact: the low 16 bits are zero


def step_in_fp32_(parameter: nn.Parameter, optimizer: torch.optim.Optimizer, gradient: torch.Tensor,
                  stochastic_rounding: bool = True) -> None:
    """Steps one bf16 parameter in fp32 with `optimizer` (a per-parameter optimizer of it), writes it back.

    The parameter's storage is swapped for an fp32 copy while the optimizer steps (so its state is
    created and updated in fp32), then the result is rounded into the original bf16 storage:
    stochastically, or to nearest with `stochastic_rounding=False` (the control that stalls).
    """
    if parameter.dtype != torch.bfloat16:  # a parameter kept in fp32 (a norm layer, say) steps as usual
        parameter.grad = gradient.to(parameter.dtype)
        optimizer.step()
        parameter.grad = None
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
        norms = torch.stack([torch.linalg.vector_norm(gradient, 2, dtype=torch.float32) for gradient in gradients])
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
