"""Fake tensors: the one place production code asks whether a tensor has values.

The estimator (`looptrain.estimation`) runs the Loop's own update on fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and strides, no storage, no values).
Production code computes the same way on both, except where it would read a value that a fake tensor
does not have (which labels are scored, which token ids a batch holds, whether two results agree);
there, and only there, it asks `is_fake` and takes the branch of the same shapes and memory that
needs no value. Every such question goes through this module, so a reader finds them all by one name:
`looptrain.lm_loss`, `looptrain.lora` and `looptrain.embedding_grad` ask it today.

The estimator's own behaviour on fakes (a finiteness check that always passes) is not asked here: it
brings its own objects through the Loop's doors (`Loop(precision=, wrap_optimizer=)`).
"""

from __future__ import annotations

from typing import Any

from torch._subclasses import fake_tensor


def is_fake(value: Any) -> bool:
    """Whether `value` is a fake tensor (no values to read); False for a real tensor and for anything else."""
    return fake_tensor.is_fake(value)


def fake_mode_of(tensor: Any) -> fake_tensor.FakeTensorMode:
    """The `FakeTensorMode` a fake tensor belongs to: new fakes made under it live beside `tensor`.

    Raises:
        ValueError: `tensor` is not a fake tensor.
    """
    mode = fake_tensor.maybe_get_fake_mode(tensor)
    if mode is None:
        raise ValueError(f"fake_mode_of needs a fake tensor, got a {type(tensor).__name__}")
    return mode
