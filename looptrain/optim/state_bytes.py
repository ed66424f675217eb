"""Optimizer state in bytes, for any optimizer (bitsandbytes' 8-bit ones and fused wrappers included)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes held by the tensors in an optimizer's state (8-bit state counts 1 byte an element).

    A tensor shared between parameters (bitsandbytes' quantisation maps) is counted once.

    Args:
        optimizer: A torch optimizer (bitsandbytes ones included) or an `OptimizerInBackward`.

    Returns:
        The number of bytes.
    """
    return _state_bytes(inner_optimizers(optimizer))


def inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers that hold the state: an `OptimizerInBackward`'s per-parameter ones, else itself.

    Args:
        optimizer: A torch optimizer, a wrapper with an ``inner_optimizers()`` method (such as
            `OptimizerInBackward`), or None.

    Returns:
        A list of optimizers (empty for None).
    """
    if optimizer is None:
        return []
    if hasattr(optimizer, "inner_optimizers"):  # a wrapper (OptimizerInBackward) whose inner optimizers hold the state
        return list(optimizer.inner_optimizers())
    return [optimizer]


def _state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    seen: set[int] = set()
    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and id(value) not in seen:
                    seen.add(id(value))
                    total += value.numel() * value.element_size()
    return total
