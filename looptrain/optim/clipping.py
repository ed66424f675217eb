"""Gradient clipping: every optimizer the Loop steps answers `clip_grad_norm_(max_norm)`.

looptrain's wrappers clip their own gradients, because each knows where they are: `PerParameterOptimizer`
clips its parameters' `.grad`, `BF16Optimizer` reads the fp32 buffers when gradients accumulate there, and
`OptimizerInBackward` clipped each gradient in its backward hook already and answers with that backward's
norm. `clip_gradients` gives a plain torch (or bitsandbytes) optimizer the same call, over the parameters
the Loop trains, so the Loop's update has one clipping line whatever it steps. Clip after unscaling (fp16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["clip_gradients", "clip_parameters_"]


def clip_parameters_(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` without raising on a non-finite norm; returns the norm before clipping.

    A non-finite norm is returned, not raised: the update is then skipped and counted. Under FSDP2 the norm is a
    DTensor; its full value is returned.
    """
    norm = nn.utils.clip_grad_norm_(parameters, max_norm, error_if_nonfinite=False)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_gradients(optimizer: Any, parameters: Iterable[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Clips the gradients `optimizer` steps to global norm `max_norm`; returns their norm before clipping.

    Args:
        optimizer: a looptrain wrapper (it clips its own: `clip_grad_norm_(max_norm)`), or a plain optimizer.
        parameters: the parameters the Loop trains: what a plain optimizer's gradients are clipped over.
        max_norm: the largest global norm; None measures the norm and clips nothing.

    Returns:
        The gradients' global norm before clipping, a scalar tensor (not finite when a gradient is not).
    """
    max_norm = math.inf if max_norm is None else max_norm
    own = getattr(optimizer, "clip_grad_norm_", None)
    return own(max_norm) if own is not None else clip_parameters_(parameters, max_norm)
