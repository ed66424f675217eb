"""Guards around the update: SIGTERM/SIGINT, out-of-memory retries, and runs of non-finite windows.

None of these change what an update computes. Signals ask the loop to stop after the current
window (it saves and exits); an out-of-memory either splits every micro-batch in two and retries
the same window (`auto_batch`) or explains what held the memory; a run of `max_bad_windows`
windows with a non-finite loss or gradient stops training with `TrainingDiverged`.
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch

from looptrain import distributed

# torch < 2.5 has only the CUDA-specific class.
OUT_OF_MEMORY_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError)


class TrainingDiverged(RuntimeError):
    """Too many consecutive windows had a non-finite loss or gradient (`LoopConfig.max_bad_windows`)."""


class SignalGuard:
    """While entered, SIGTERM and SIGINT ask for a stop after the current window; a second one stops at once.

    Args:
        echo: prints a line when a signal arrives.
        stopping: what the first signal waits for, as its line says.
    """

    def __init__(self, echo: Callable[[str], None] = print,
                 stopping: str = "stopping after this window and saving a checkpoint"):
        self.echo = echo
        self.stopping = stopping
        self.received: str | None = None  # the name of the first signal caught ("SIGTERM", "SIGINT")
        self._previous: dict = {}

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():  # handlers install on the main thread only
            self._previous = {
                number: signal.signal(number, self._request_stop) for number in (signal.SIGTERM, signal.SIGINT)
            }
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _request_stop(self, signal_number: int, frame: Any) -> None:
        if self.received is not None:  # asked twice: stop now
            signal.signal(signal_number, self._previous.get(signal_number, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.received = signal.Signals(signal_number).name
        self.echo(f"{self.received} received: {self.stopping} (send it again to stop at once, without saving)")

    def stop_requested(self, device: torch.device) -> bool:
        """Whether any rank caught a signal (one tiny all-reduce under torchrun, so all ranks stop together)."""
        flag = float(self.received is not None)
        return distributed.all_reduce_sum([flag], device)[0] > 0


class BadWindowGuard:
    """Counts consecutive windows whose loss is not finite, or whose fp32/bf16 update was skipped.

    An fp16 overflow with a finite loss is not bad: the GradScaler lowers its scale and the next
    window usually steps.

    Args:
        max_bad_windows: how many bad windows in a row stop the run.
    """

    def __init__(self, max_bad_windows: int):
        self.max_bad_windows = max_bad_windows
        self.in_a_row = 0

    def check(
        self, loss_is_finite: bool, stepped: bool, scaler_enabled: bool, where: str, last_checkpoint: Any
    ) -> str | None:
        """Records one window; returns why it was skipped (None when it stepped).

        Args:
            loss_is_finite: whether the window's loss sum is finite.
            stepped: whether its update was applied.
            scaler_enabled: fp16 with a GradScaler (a skip with a finite loss is then an overflow).
            where: "step S (micro-step M)", for the error message.
            last_checkpoint: the newest checkpoint on disk, or None, for the error message.

        Raises:
            TrainingDiverged: the `max_bad_windows`-th bad window in a row.
        """
        bad = not loss_is_finite or (not stepped and not scaler_enabled)
        self.in_a_row = self.in_a_row + 1 if bad else 0
        if self.in_a_row >= self.max_bad_windows:
            raise TrainingDiverged(
                f"the loss or gradients were not finite for {self.in_a_row} windows in a row, up to {where}; "
                f"none of them was applied. Last good checkpoint: "
                f"{last_checkpoint if last_checkpoint is not None else 'none saved'}. Lower the learning rate, use "
                "precision='bf16' or 'fp32', check the data for extreme values, or raise max_bad_windows"
            )
        if stepped:
            return None
        return "non-finite loss or gradients" if bad else "fp16 gradients overflowed: the GradScaler lowered its scale"


def split_after_out_of_memory(
    error: BaseException, rows: int, splits: int, auto_batch: bool, where: str, explain: Callable[[], str]
) -> int:
    """The next micro-batch split after an out-of-memory: twice `splits`, or the error re-raised.

    Splitting keeps the window (the effective batch) and its item count, so the update stays the
    exact mean over the same items; only the number of forward/backward passes doubles.

    Args:
        error: the out-of-memory error.
        rows: the fewest rows of any batch in the failed window.
        splits: how many pieces each batch was cut into when it failed.
        auto_batch: whether retrying smaller is allowed (`LoopConfig.auto_batch`).
        where: "step S", for the error message.
        explain: builds the lines that say what held the memory and what to try.

    Raises:
        The same error type, with `explain()`'s lines, when it cannot be retried.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if not auto_batch or splits * 2 > rows:
        raise type(error)(
            f"out of memory at {where} (micro-batch of {math.ceil(rows / splits)} rows): {error}\n{explain()}"
        ) from error
    return splits * 2


def auto_batch_event(step: int, rows: int, splits: int) -> dict:
    """The `auto_batch` event: each micro-batch of the failed window now runs in `splits` pieces, and it is retried."""
    return {
        "event": "auto_batch", "step": step, "micro_batch_splits": splits, "micro_batch_rows": math.ceil(rows / splits),
        "message": f"out of memory: each micro-batch now runs in {splits} pieces "
                   f"(accumulation x{splits}, same effective batch); retrying the window",
    }


def memory_held(model: Any, optimizer: Any, device: torch.device) -> str:
    """What held the memory at an out-of-memory (params, grads, optimizer state), and what to try."""
    from looptrain.memory import gradient_bytes, parameter_bytes
    from looptrain.optim import optimizer_state_bytes

    lines = [f"  held at the failure: params {parameter_bytes(model) / 2**20:.1f} MiB, grads "
             f"{gradient_bytes(model) / 2**20:.1f} MiB, optimizer state "
             f"{optimizer_state_bytes(optimizer) / 2**20:.1f} MiB"]
    if device.type == "cuda":
        lines.append(f"  CUDA allocated {torch.cuda.memory_allocated(device) / 2**20:.1f} MiB of "
                     f"{torch.cuda.get_device_properties(device).total_memory / 2**20:.0f} MiB")
    lines.append("  try: auto_batch=True (--auto-batch) to halve the micro-batch and double accumulation; "
                 "gradient_checkpointing=True (--grad-checkpoint); an 8-bit optimizer (--optim adamw8bit); "
                 "bf16 (--amp); a shorter --max-length")
    return "\n".join(lines)

