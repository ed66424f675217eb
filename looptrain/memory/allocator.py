"""The CPU allocator: glibc malloc's thresholds, fixed so that a process's RSS follows its live tensors.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc raises its mmap threshold each time a large
mmapped block is freed (up to 32 MiB), so after the first steps a training process serves its activations from the
heap, whose freed holes stay resident: RSS then measures the allocator's history (docs/memory.md, "The RSS trap").
A budget read as RSS (`--memory-budget` on a CPU) may not be held that way: under glibc's own thresholds a process
can hold several times what it holds besides its tensors with them fixed, enough to refuse every plan of a budget
that Hugging Face Trainer, run with them fixed, keeps (docs/plan.md, "Which meter the budget counts").
`keep_rss_lean` fixes them in the running process, as the ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
environment variables would have at its start.

The price is time: every freed block above the threshold goes back to the OS and the next one is faulted in anew,
so the planner asks for it only where the process's first probe, under glibc's own thresholds, does not fit the
budget (`plan(make_lean=...)`), and then one step at a time (`fix_thresholds`, `LEAN_STEPS`): 1 MiB first, where
only a step's large blocks are mmapped and the run trims the heap, which costs less, and 128 KiB, the leanest and
slowest, only where that does not fit either (what each costs: docs/memory.md, "A step between the two").

Between the two, `release_freed` (the Loop's ``trim_heap`` lever: ``malloc_trim`` before every micro-batch and every
optimizer step) keeps glibc's thresholds and gives the heap's freed pages back between micro-batches, and between the
last backward and the step's temporaries: RSS then holds what one micro-batch leaves resident, not what the run has,
for a few percent of the speed (docs/memory.md, "Between the two: the heap trimmed before each micro-batch"). The
planner trims wherever it keeps glibc's own thresholds under a budget of RSS (`keeps_freed`): its probes measure a
fresh heap, which a whole run without trimming outgrows.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

LEAN_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting mmap threshold, kept fixed instead of raised
# Between glibc's dynamic thresholds and the lean 128 KiB: blocks of 1 MiB or more mmapped (a training step's large
# activations), smaller ones served from the heap, which the run trims before each micro-batch: most of the lean
# setting's RSS saving for a fraction of its time (docs/memory.md, "A step between the two"; docs/results.md).
MODERATE_THRESHOLD_BYTES = 1024 * 1024
LEAN_STEPS = (MODERATE_THRESHOLD_BYTES, LEAN_THRESHOLD_BYTES)  # `fix_thresholds`'s steps, the fastest first
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
USER_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")
_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3

_applied: int | None = None  # the threshold this process fixed, once it has


@functools.cache  # `release_freed` asks before every micro-batch; libc_ver reads the interpreter's file
def _glibc() -> ctypes.CDLL | None:
    """The process's own C library when it is glibc (``mallopt`` and ``malloc_trim`` are glibc's), else None."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into this process: its libc among them
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def user_malloc_settings(environment: dict | None = None) -> list[str]:
    """The malloc thresholds the user set for this process (environment variables or GLIBC_TUNABLES), by name."""
    environment = os.environ if environment is None else environment
    given = [name for name in USER_VARIABLES if environment.get(name)]
    tunables = environment.get("GLIBC_TUNABLES", "")
    return given + [name for name in USER_TUNABLES if name + "=" in tunables]


def lean_environment(threshold: int | None = None) -> dict[str, str]:
    """The environment variables that give a new process the thresholds `keep_rss_lean(threshold)` fixes (None: the
    lean 128 KiB, as for a plan saved before `Plan.malloc_threshold_bytes` existed)."""
    mmap, trim = _thresholds(LEAN_THRESHOLD_BYTES if threshold is None else threshold)
    return {"MALLOC_MMAP_THRESHOLD_": str(mmap), "MALLOC_TRIM_THRESHOLD_": str(trim)}


def _thresholds(threshold: int) -> tuple[int, int]:
    """The (mmap, trim) thresholds of a fixed `threshold`: the heap's free top is returned above 128 KiB at most."""
    return threshold, min(threshold, LEAN_THRESHOLD_BYTES)


def fixed_threshold() -> int | None:
    """The mmap threshold looptrain fixed in this process (`keep_rss_lean`, `fix_thresholds`), or None."""
    return _applied


def describe() -> str:
    """The allocator's state in a line (it decides what a probe's RSS measures, so probe caches key on it)."""
    if _applied is not None:
        return f"glibc: thresholds fixed at {_applied} bytes by looptrain"
    given = user_malloc_settings()
    if given:
        variables = [f"{name}={os.environ[name]}" for name in USER_VARIABLES if os.environ.get(name)]
        tunables = [f"GLIBC_TUNABLES={os.environ['GLIBC_TUNABLES']}"] if os.environ.get("GLIBC_TUNABLES") else []
        return "as set: " + ", ".join(variables + tunables)
    return "glibc: dynamic thresholds" if _glibc() is not None else "not glibc"


def keep_rss_lean(threshold: int | None = None) -> str:
    """Fixes glibc's mmap and trim thresholds at `threshold` bytes (None: the lean `LEAN_THRESHOLD_BYTES`) and returns
    what was done, in a sentence.

    Blocks of `threshold` bytes or more are then mmapped and unmapped when freed, and the heap's free top is returned
    above it, so the process's RSS rises and falls with its tensors. What the heap holds free now is returned at
    once (``malloc_trim``). Process-wide and not undone: glibc cannot be given back its dynamic threshold. Leaves
    the allocator as it is where the user set a threshold (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``
    or ``GLIBC_TUNABLES``) and where the C library is not glibc; calling it again changes nothing.
    """
    threshold = LEAN_THRESHOLD_BYTES if threshold is None else threshold
    if threshold < 1:
        raise ValueError(f"the malloc threshold must be positive, got {threshold}")
    if _applied is not None:
        return f"glibc malloc's thresholds are fixed at {_applied // 1024} KiB (done earlier in this process)"
    given = user_malloc_settings()
    if given:
        return f"glibc malloc's thresholds are left as set by {', '.join(given)}"
    libc = _glibc()
    if libc is None:
        return "the C library is not glibc: its allocator is left as it is, and RSS may keep freed memory"
    return _fix(libc, threshold)


def _fix(libc: ctypes.CDLL, threshold: int) -> str:
    """Fixes the thresholds of `threshold` (`_thresholds`), gives the heap's free pages back to the OS, and says
    what it did."""
    global _applied
    mmap, trim = _thresholds(threshold)
    if not (libc.mallopt(_M_MMAP_THRESHOLD, mmap) and libc.mallopt(_M_TRIM_THRESHOLD, trim)):
        return "glibc refused the malloc thresholds (mallopt): the allocator is left as it is"
    libc.malloc_trim(0)
    _applied = threshold
    if mmap == trim:
        return (f"glibc malloc's mmap and trim thresholds fixed at {mmap // 1024} KiB, so that RSS follows the "
                "live tensors (slower: freed blocks go back to the OS; MALLOC_MMAP_THRESHOLD_ set by you is kept)")
    return (f"glibc malloc's mmap threshold fixed at {mmap // 1024} KiB and its trim threshold at {trim // 1024} KiB: "
            "large blocks go back to the OS when freed, smaller ones stay in the heap, which the run trims before "
            "each micro-batch (MALLOC_MMAP_THRESHOLD_ set by you is kept)")


def release_freed() -> bool:
    """Gives the heap's free pages back to the OS (glibc ``malloc_trim(0)``: every arena, holes included); whether
    the C library could. Costs milliseconds; the pages given back are faulted in again when next used."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def keeps_freed() -> bool:
    """Whether freed heap blocks stay resident across a run here: glibc with its own dynamic thresholds, or with an
    mmap threshold looptrain fixed above 128 KiB (`MODERATE_THRESHOLD_BYTES`), and none the user set. A short probe
    then measures a fresh heap, and a long run holds more than it, unless the heap is trimmed before each
    micro-batch (`release_freed`, the Loop's ``trim_heap``)."""
    return ((_applied is None or _applied > LEAN_THRESHOLD_BYTES) and not user_malloc_settings()
            and _glibc() is not None)


def fix_thresholds() -> str | None:
    """The planner's `make_lean` (`plan(make_lean=fix_thresholds)`): one step leaner each call along `LEAN_STEPS`
    (glibc's own thresholds, then 1 MiB with the heap trimmed, then 128 KiB), and what it did; None when it changed
    nothing (128 KiB already, thresholds the user set, not glibc)."""
    libc = _glibc()
    if libc is None or user_malloc_settings():
        return None
    leaner = next((step for step in LEAN_STEPS if _applied is None or step < _applied), None)
    if leaner is None:
        return None
    said = _fix(libc, leaner)
    return said if _applied == leaner else None


# oneDNN's primitive cache and PyTorch's cache of oneDNN computations (ideep's LRU cache) keep one entry per operation
# shape, 1024 each by default. Under bf16 autocast on a CPU every new batch width adds entries, so a budget of RSS is
# spent one width at a time; 64 entries each keep RSS flat after the first widths at no cost in speed (docs/memory.md,
# "bf16 autocast: RSS grows with the number of widths"; docs/results.md).
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
KERNEL_CACHE_CAPACITY = 64


def cap_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> str | None:
    """Caps oneDNN's and PyTorch's per-shape kernel caches at `capacity` entries each (`KERNEL_CACHE_VARIABLES`), so
    that a budget of RSS is not spent one batch width at a time; what it did, or None when the user set them (kept).

    Both libraries read their capacity when they first build a kernel: call it before the process's first matmul
    (the command line does, at its start, under a budget of RSS), and in a process that is the run's alone (the
    setting outlives it).
    """
    if any(os.environ.get(name) for name in KERNEL_CACHE_VARIABLES):
        return None
    for name in KERNEL_CACHE_VARIABLES:
        os.environ[name] = str(capacity)
    settings = ", ".join(f"{name}={capacity}" for name in KERNEL_CACHE_VARIABLES)
    return (f"oneDNN's kernel caches capped at {capacity} entries each ({settings}): under bf16 autocast each batch "
            "width would otherwise keep its kernels resident (about 5 MiB a width on a MiniLM)")
