"""Hugging Face's Adafactor, stepped with one parameter-sized temporary instead of two.

`transformers.optimization.Adafactor.step` builds each parameter's update out of place: ``grad**2 + eps``
(two temporaries while the sum is formed), ``_approx_sq_grad`` (a second one beside the first), ``-update``
(again a second). For a large parameter, a BERT vocabulary's embedding, that is two copies of it held at once
on top of the weights and the gradients, and an accumulating run's peak is often its optimizer step: on a
36.6M-parameter BERT (a 21,128 x 512 embedding, 41 MiB) the step took the process 110 MiB above what it held
before it (docs/plan.md). `Adafactor` here is the same class with the same options, state and learning rate
(`_get_lr`, `_rms`, `_get_options` are its parent's); its `step` makes the same operations in the same order on
the same values, but writes each result into the one temporary: ``pow(grad, 2)`` then ``add_(eps)``, the
approximation into it (``torch.mul(..., out=)``), ``sub_`` instead of ``add_(-update)``. So the weights and the
state are bitwise those of Hugging Face's step (`tests/test_optim.py`), and its peak is one parameter-sized
temporary lower.
"""

from __future__ import annotations

import math

import torch
from transformers.optimization import Adafactor as HuggingFaceAdafactor

_HALF = (torch.float16, torch.bfloat16)


class Adafactor(HuggingFaceAdafactor):
    """`transformers.optimization.Adafactor` with an in-place step: bitwise the same results, one parameter-sized
    temporary at its peak instead of two. A closure is evaluated with gradients enabled (as torch's optimizers
    do)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    self._step_parameter(parameter, group)
        return loss

    def _step_parameter(self, parameter: torch.nn.Parameter, group: dict) -> None:
        grad = parameter.grad
        if grad.dtype in _HALF:
            grad = grad.float()
        if grad.is_sparse:
            raise RuntimeError("Adafactor does not support sparse gradients.")
        state = self.state[parameter]
        factored, use_first_moment = self._get_options(group, grad.shape)
        if len(state) == 0:
            state["step"] = 0
            if use_first_moment:
                state["exp_avg"] = torch.zeros_like(grad)
            if factored:
                state["exp_avg_sq_row"] = torch.zeros(grad.shape[:-1]).to(grad)
                state["exp_avg_sq_col"] = torch.zeros(grad.shape[:-2] + grad.shape[-1:]).to(grad)
            else:
                state["exp_avg_sq"] = torch.zeros_like(grad)
            state["RMS"] = 0
        else:
            for name in ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"):
                if name in state:
                    state[name] = state[name].to(grad)

        weights = parameter.float() if parameter.dtype in _HALF else parameter
        state["step"] += 1
        state["RMS"] = self._rms(weights)
        lr = self._get_lr(group, state)
        beta2t = 1.0 - math.pow(state["step"], group["decay_rate"])

        update = grad.pow(2).add_(group["eps"][0])  # the one temporary, from here to the end
        if factored:
            row, column = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=(1.0 - beta2t))
            column.mul_(beta2t).add_(update.mean(dim=-2), alpha=(1.0 - beta2t))
            # `_approx_sq_grad`, written into the temporary instead of a second one
            row_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            torch.mul(row_factor, column.unsqueeze(-2).rsqrt(), out=update)
        else:
            average = state["exp_avg_sq"]
            average.mul_(beta2t).add_(update, alpha=(1.0 - beta2t))
            torch.rsqrt(average, out=update)
        update.mul_(grad)
        update.div_((self._rms(update) / group["clip_threshold"]).clamp_(min=1.0))
        update.mul_(lr)
        if use_first_moment:
            state["exp_avg"].mul_(group["beta1"]).add_(update, alpha=(1 - group["beta1"]))
            update = state["exp_avg"]
        if group["weight_decay"] != 0:
            weights.add_(weights, alpha=(-group["weight_decay"] * lr))
        weights.sub_(update)
        if parameter.dtype in _HALF:
            parameter.copy_(weights)
