"""Hugging Face's Adafactor, stepped with one parameter-sized temporary instead of two.

`transformers.optimization.Adafactor.step` builds each parameter's update out of place: ``grad**2 + eps``
(two temporaries while the sum is formed), ``_approx_sq_grad`` (a second one beside the first), ``-update``
(again a second). For a large parameter, a vocabulary's embedding, that is two copies of it held at once on top
of the weights and the gradients, and an accumulating run's peak is often its optimizer step (docs/optimizers.md,
"adafactor", has the measurement). `Adafactor` here is the same class with the same options, state and learning
rate (`_get_lr`, `_rms`, `_get_options` are its parent's); its `step` makes the same operations in the same order
on the same values, but writes each result into the one temporary: ``pow(grad, 2)`` then ``add_(eps)``, the
approximation into it (``torch.mul(..., out=)``), ``sub_`` instead of ``add_(-update)``. So the weights and the
state are bitwise those of Hugging Face's step (`tests/test_optim.py`), and its peak is one parameter-sized
temporary lower.

It is not a subclass of it: `transformers.optimization` imports `transformers.trainer_utils`, which imports peft,
which imports bitsandbytes, resident modules and start-up time for a run that uses none of them (a memory budget
on a CPU counts the process's RSS; docs/optimizers.md has what they cost). Its constructor, options, learning rate
(`_get_lr`) and RMS are Hugging Face's, option for option (the same errors too), and the tests hold every result
bitwise to that class.
"""
from __future__ import annotations

import math

import torch

_HALF = (torch.float16, torch.bfloat16)


class Adafactor(torch.optim.Optimizer):
    """`transformers.optimization.Adafactor` with an in-place step: the same options and defaults, bitwise the same
    results, one parameter-sized temporary at its peak instead of two. A closure is evaluated with gradients enabled
    (as torch's optimizers do).

    Args (Hugging Face's, each a term of the update rule in docs/optimizers.md, "Adafactor's update rule"): `lr`,
    `eps`, `clip_threshold`, `decay_rate`, `beta1`, `weight_decay`, `scale_parameter`, `relative_step`,
    `warmup_init`.
    """

    def __init__(self, params, lr: float | None = None, eps: tuple[float, float] = (1e-30, 1e-3),
                 clip_threshold: float = 1.0, decay_rate: float = -0.8, beta1: float | None = None,
                 weight_decay: float = 0.0, scale_parameter: bool = True, relative_step: bool = True,
                 warmup_init: bool = False):
        if lr is not None and relative_step:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        if warmup_init and not relative_step:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        defaults = {"lr": lr, "eps": eps, "clip_threshold": clip_threshold, "decay_rate": decay_rate, "beta1": beta1,
                    "weight_decay": weight_decay, "scale_parameter": scale_parameter, "relative_step": relative_step,
                    "warmup_init": warmup_init}
        super().__init__(params, defaults)

    @staticmethod
    def _get_lr(group: dict, state: dict) -> float:
        """The step's learning rate: step 1 of Adafactor's update rule (docs/optimizers.md)."""
        step_size = group["lr"]
        if group["relative_step"]:
            cap = 1e-6 * state["step"] if group["warmup_init"] else 1e-2
            step_size = min(cap, 1.0 / math.sqrt(state["step"]))
        scale = max(group["eps"][1], state["RMS"]) if group["scale_parameter"] else 1.0
        return scale * step_size

    @staticmethod
    def _get_options(group: dict, shape: torch.Size) -> tuple[bool, bool]:
        """(factored second moment: two or more dimensions, first moment: `beta1` set)."""
        return len(shape) >= 2, group["beta1"] is not None

    @staticmethod
    def _rms(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.norm(2) / (tensor.numel() ** 0.5)

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
