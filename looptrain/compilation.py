"""torch.compile as a lever (`compile`, ``--compile``): the model's forward compiled in place.

`compile_model` calls ``model.compile(...)``, which compiles the module's ``__call__`` and keeps the
module itself: the same object, the same parameters (the optimizer's), the same ``state_dict`` keys
(no ``_orig_mod.`` prefix), so checkpoints, ``final/`` and resume read and write what an eager run
does. Backward runs the compiled backward (AOTAutograd), so per-parameter gradient hooks (the fused
step, bf16 weights' fp32 gradient buffers) still fire when each gradient is accumulated.

Shapes are compiled dynamic from the first batch (``dynamic=True``: the batch and width dimensions
symbolic), so dynamic padding's widths, and a partial last batch, cost one compilation instead of one
per shape (torch's default, ``dynamic=None``, would compile the first shape static and recompile at the
second). Sizes 0 and 1 are still specialised: a one-row batch compiles once more. Evaluation (eval
mode, no grad) compiles once more too.

The backend is inductor; ``LOOPTRAIN_COMPILE_BACKEND`` (e.g. ``aot_eager``, which traces forward and
backward like inductor but runs torch's own kernels) chooses another, for tests and debugging.

Inductor's on-disk cache is kept per CPU capability (`isolate_inductor_cache`): one directory shared by runs
of two capabilities (an AVX-512 machine natively, then as an AVX2 one with ``ATEN_CPU_CAPABILITY=avx2``)
served the first run's compiled graphs to the second, which failed in a generated kernel ("index out of
bounds") or crashed the interpreter (torch 2.13).

What the combinations do is decided in `compile_problems` (refusals, asked by `LoopConfig`) and in
docs/compile.md.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

BACKEND_VARIABLE = "LOOPTRAIN_COMPILE_BACKEND"
DEFAULT_BACKEND = "inductor"


def compile_backend() -> str:
    """The torch.compile backend: ``$LOOPTRAIN_COMPILE_BACKEND``, else inductor."""
    return os.environ.get(BACKEND_VARIABLE, "").strip() or DEFAULT_BACKEND


def compile_model(model: nn.Module, enabled: bool) -> nn.Module:
    """With `enabled`, compiles `model`'s forward in place (``nn.Module.compile``); returns `model`.

    Call it after everything that changes the module's forward (gradient checkpointing, adapters)
    and before a distributed wrapper. A model compiled already is left as it is.
    """
    if enabled and getattr(model, "_compiled_call_impl", None) is None:
        isolate_inductor_cache()  # AOTAutograd's cache (any backend) lives there too
        model.compile(backend=compile_backend(), dynamic=True)
    return model


def isolate_inductor_cache() -> str:
    """Points inductor's default cache directory at one for this CPU capability; returns the directory.

    The default (``$TMPDIR/torchinductor_<user>``) gets the capability as a suffix (``-avx512``, ``-avx2``);
    a ``TORCHINDUCTOR_CACHE_DIR`` the user set is kept as it is.
    """
    import torch
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{torch.backends.cpu.get_cpu_capability().lower()}"
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_problems(config: Any, cpu: bool) -> list[str]:
    """The combinations `compile=True` cannot run, one line each naming the flags and the fix.

    Args:
        config: the `LoopConfig`.
        cpu: the run's device is a CPU (where `track_memory` installs the tensor tracker).
    """
    if not config.compile:
        return []
    problems = []
    if config.track_memory and cpu:
        problems.append(
            "compile=True (--compile) cannot run under the CPU tensor tracker (track_memory=True): torch.compile "
            "runs a model eagerly while a dispatch mode is active, so nothing would be compiled; set "
            "track_memory=False (--no-track-memory: the meter reads RSS) or turn compile off"
        )
    if config.chunked_ce == "on":
        problems.append(
            "compile=True (--compile) compiles the model's own forward and loss, and chunked_ce='on' (--chunked-ce on) "
            "computes the head and loss outside it; use --chunked-ce auto or off with --compile (the compiled "
            "model's own loss), or drop --compile"
        )
    return problems


__all__ = ["BACKEND_VARIABLE", "DEFAULT_BACKEND", "compile_backend", "compile_model", "compile_problems"]
