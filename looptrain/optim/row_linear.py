"""Linear layers whose weight the fused step takes by rows: the ``[out, in]`` weight gradient never exists whole.

`step_linears_by_rows` gives each ``nn.Linear`` of a model whose weight the fused step steps by rows
(`OptimizerInBackward(row_stepped=...)`, found with `row_stepper`) a forward that, while gradients are enabled, runs
`_RowSteppedLinear`: its backward computes the input's gradient with the weight as it is, then hands the weight's
gradient to the fused step by rows of its output features (``grad_output[:, rows].T @ input``), each chunk made
when a pass of the step asks for it. The forward is a bound method (`types.MethodType`): a deep copy of the model
binds it to the copy; it checks the stepper at every call, so a model whose wrapper is gone runs ``F.linear``.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from looptrain.optim.in_backward import row_stepper


class _RowSteppedLinear(torch.autograd.Function):
    """``F.linear(input, weight, bias)`` (in autocast's dtype where it is on), its weight stepped by rows in
    backward."""

    @staticmethod
    def forward(ctx, input, weight, bias, dtype):
        with torch.autocast(input.device.type, enabled=False):
            cast = input.to(dtype)
            output = F.linear(cast, weight.to(dtype), None if bias is None else bias.to(dtype))
        ctx.save_for_backward(cast)
        # the parameter itself, not a saved tensor: under checkpointing a saved one is unpacked as a recomputed alias
        ctx.weight, ctx.dtype, ctx.input_dtype = weight, dtype, input.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (cast,) = ctx.saved_tensors
        weight = ctx.weight
        dtype = ctx.dtype
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_output = grad_output.to(dtype)
        rows_out = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = (grad_output @ weight.to(dtype)).to(ctx.input_dtype) if needs_input else None  # before the step
        grad_bias = rows_out.sum(0) if needs_bias else None
        grad_weight = None
        if needs_weight:
            rows_in = cast.reshape(-1, cast.shape[-1])
            stepper = row_stepper(weight)
            if stepper is None:
                grad_weight = (rows_out.t() @ rows_in).to(weight.dtype)
            else:
                stepper(weight, lambda rows: rows_out[:, rows].t() @ rows_in, weight.shape[0])
        return grad_input, grad_weight, grad_bias, None


def _forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and self.weight.requires_grad and row_stepper(self.weight) is not None:
        device_type = input.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else self.weight.dtype
        return _RowSteppedLinear.apply(input, self.weight, self.bias, dtype)
    return F.linear(input, self.weight, self.bias)


def step_linears_by_rows(modules: list[nn.Linear]) -> None:
    """Gives each of `modules` (plain ``nn.Linear``) the forward that hands its weight's gradient over by rows."""
    for module in modules:
        module.forward = types.MethodType(_forward, module)


def row_steppable_linears(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> list[nn.Linear]:
    """The plain ``nn.Linear`` modules of `model` with a trainable weight, except `skip` (an LM head)."""
    return [module for module in model.modules() if type(module) is nn.Linear and module.weight.requires_grad
            and all(module is not other for other in skip)]
