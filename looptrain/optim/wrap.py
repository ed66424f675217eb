"""The optimizer a run steps, from the one the caller built and the run's `LoopConfig`.

The fused step (`optimizer_in_backward`) and bf16 weights (`weights="bf16"`) each turn an ordinary
optimizer into one optimizer per parameter (`OptimizerInBackward`, `BF16Optimizer`); the Loop wraps
the optimizer it is given here, once, when it is built.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from looptrain.optim.bf16 import BF16Optimizer
from looptrain.optim.in_backward import OptimizerInBackward
from looptrain.optim.per_parameter import PerParameterOptimizer


def wrap_for_config(model: nn.Module, optimizer: Any, config: Any, *,
                    in_backward: type[OptimizerInBackward] = OptimizerInBackward) -> Any:
    """The fused step and bf16 weights turn the optimizer into one optimizer per parameter.

    Args:
        model: the model, on its device and in its final dtype (bf16 weights are cast before).
        optimizer: the caller's optimizer; a `PerParameterOptimizer` was wrapped already and is kept.
        config: the run's `LoopConfig` (`optimizer_in_backward`, `weights`, `max_grad_norm`,
            `effective_clip_mode`, `stochastic_rounding`, `grad_dtype`).
        in_backward: the class of the fused step's wrapper (the estimator's subclass for fake tensors).

    Returns:
        The optimizer the Loop steps: `OptimizerInBackward`, `BF16Optimizer`, or `optimizer` itself.
    """
    if isinstance(optimizer, PerParameterOptimizer):
        return optimizer  # wrapped by the caller already
    bf16_weights = config.weights == "bf16"
    if config.optimizer_in_backward:
        return in_backward(model, optimizer, max_grad_norm=config.max_grad_norm, clip=config.effective_clip_mode,
                           bf16_weights=bf16_weights, stochastic_rounding=config.stochastic_rounding)
    if bf16_weights:
        return BF16Optimizer(model, optimizer, stochastic_rounding=config.stochastic_rounding,
                             grad_dtype=config.grad_dtype)
    return optimizer
