"""The global RNG states (python, numpy, torch CPU and CUDA), captured into and restored from what
`torch.load(weights_only=True)` accepts, for a resume that draws the same numbers."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """The python, numpy, torch CPU and (when initialised) CUDA RNG states, loadable with weights_only.

    numpy's state is a tuple holding an ndarray, which `torch.load(weights_only=True)` refuses, so
    it is stored as a plain dict of a str, an int64 tensor and numbers.
    """
    numpy_name, numpy_keys, numpy_position, numpy_has_gauss, numpy_cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": str(numpy_name),
            "keys": torch.from_numpy(np.asarray(numpy_keys, dtype=np.int64).copy()),
            "position": int(numpy_position),
            "has_gauss": int(numpy_has_gauss),
            "cached_gaussian": float(numpy_cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Sets the global RNGs to a state from `capture_rng_state` (CUDA only when saved and available)."""
    random.setstate(_as_nested_tuple(state["python"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["position"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        # A resume on fewer (or more) GPUs restores the devices both runs have.
        for device_index in range(min(len(saved), torch.cuda.device_count())):
            torch.cuda.set_rng_state(saved[device_index], device_index)


def _as_nested_tuple(value: Any) -> Any:
    """random.setstate needs tuples; keep them tuples even if a container came back as a list."""
    if isinstance(value, (list, tuple)):
        return tuple(_as_nested_tuple(item) for item in value)
    return value
