"""What the loop needs to know about a batch: its rows, items and tokens; moving and splitting it.

A batch is a tensor, or a mapping / list / tuple of tensors (nested as deep as you like). The
*items* of a batch are what a mean loss is taken over: its labels that are not -100 (one per row
for sequence classification, one per real token for token-level losses), or its rows when it has
no labels. The labels are a dict batch's `labels`, or the last element of a list / tuple batch
when it is an integer tensor (nanoGPT's `x, y`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from looptrain import distributed

IGNORE_INDEX = -100
Items = torch.Tensor | int


def first_dimension(batch: Any) -> int:
    """The batch's row count: the first dimension of its first tensor that has one.

    Raises:
        ValueError: the batch holds no tensor with a batch dimension.
    """
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (Mapping, list, tuple)) or hasattr(values, "__iter__"):
        for value in values:
            if isinstance(value, torch.Tensor) and value.dim():
                return value.shape[0]
    raise ValueError(
        f"cannot tell the batch size of a {type(batch).__name__}: it holds no tensor with a batch dimension; "
        "batches must be tensors, or dicts / lists / tuples of tensors"
    )


def labels_of(batch: Any) -> torch.Tensor | None:
    """A dict batch's `labels`; a list / tuple batch's last element when it holds integer ids; else None."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
        return labels if isinstance(labels, torch.Tensor) else None
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and isinstance(batch[-1], torch.Tensor):
        last = batch[-1]
        if last.dim() and not last.is_floating_point() and not last.is_complex() and last.dtype != torch.bool:
            return last
    return None


def count_items(batch: Any) -> Items:
    """Items a mean loss was taken over: labels that are not -100 (a tensor: no host sync), else rows."""
    labels = labels_of(batch)
    if labels is not None:
        return (labels != IGNORE_INDEX).sum()
    return first_dimension(batch)


def as_loss_sum(loss: Any, items: Items, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`compute_loss`'s result as `(loss_sum, num_items)`, float32 tensors on `device`.

    A mean loss is weighted by `items` (the batch's count); a `(loss_sum, num_items)` pair is taken
    as it is.
    """
    if isinstance(loss, tuple):
        if len(loss) != 2:
            raise TypeError(
                f"compute_loss returned a tuple of {len(loss)}; return a scalar mean loss or (loss_sum, num_items)"
            )
        loss, items = loss
        mean = False
    else:
        mean = True
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"compute_loss returned {type(loss).__name__}; return a scalar tensor (the mean loss) or "
            "(loss_sum, num_items)"
        )
    items = torch.as_tensor(items, dtype=torch.float32).to(device)
    return (loss.float() * items if mean else loss.float()), items


def samples_and_tokens(batch: Any) -> tuple[int, int]:
    """(samples, real tokens) of a batch, for throughput; tokens are 0 when the batch has no token ids.

    Tokens are the attention mask's ones; without a mask, the elements of `input_ids`; for a
    tensor, list or tuple batch (`(x, y)` of token ids), the elements of its first 2-D integer tensor.
    """
    samples = first_dimension(batch)
    if isinstance(batch, Mapping):
        if isinstance(batch.get("attention_mask"), torch.Tensor):
            return samples, int(batch["attention_mask"].sum())
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return samples, batch["input_ids"].numel()
        return samples, 0
    tensors = [batch] if isinstance(batch, torch.Tensor) else [v for v in batch if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        if tensor.dim() >= 2 and not tensor.is_floating_point() and not tensor.is_complex():
            return samples, tensor.numel()
    return samples, 0


def move_to(batch: Any, device: torch.device) -> Any:
    """The batch (tensor, mapping, list or tuple of them) on `device`; anything else unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: move_to(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(value, device) for value in batch)
    return batch


def split_batch(batch: Any, parts: int) -> list:
    """Cuts a batch into `parts` row-wise pieces (fewer when it has fewer rows).

    Every tensor whose first dimension is the batch's row count is split; anything else is shared.
    """
    if parts == 1:
        return [batch]
    rows = first_dimension(batch)
    bounds = [round(rows * index / parts) for index in range(parts + 1)]

    def piece(value: Any, start: int, stop: int) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return value[start:stop]
        if isinstance(value, Mapping):
            return {key: piece(item, start, stop) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(piece(item, start, stop) for item in value)
        return value

    return [piece(batch, start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


def on_device(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter and buffer already lives on `device` (then `.to` is skipped)."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(tensor.device.type == device.type and tensor.device.index in (None, device.index) for tensor in tensors)


def total_items(counts: list, device: torch.device) -> torch.Tensor:
    """The sum of item counts (tensors or ints) as a float32 tensor on `device`."""
    return torch.stack([torch.as_tensor(count, dtype=torch.float32) for count in counts]).sum().to(device)


def check_item_counts(counted: int, reported: int, where: str) -> None:
    """compute_loss must sum its loss over the items count_items counted, or the mean is off."""
    if counted != reported:
        raise ValueError(
            f"at {where}, compute_loss reported its loss over {reported} items but count_items counted "
            f"{counted}, and the gradients were divided by the count: override Loop.count_items(batch) to count "
            "the items your loss sums over (e.g. the tokens of your target key that are not -100)"
        )


def window_samples_and_tokens(window: list, device: torch.device) -> tuple[int, int]:
    """(samples, tokens) of a window, summed over every rank, for throughput."""
    samples = tokens = 0
    for batch in window:
        batch_samples, batch_tokens = samples_and_tokens(batch)
        samples, tokens = samples + batch_samples, tokens + batch_tokens
    samples, tokens = distributed.all_reduce_sum([samples, tokens], device)
    return int(samples), int(tokens)
