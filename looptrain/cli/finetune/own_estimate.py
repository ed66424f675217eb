"""A run's own memory estimate (a run without --memory-budget), which the run never waits for before training.

`start_estimate` returns a `RunEstimate`: ready at once where it costs nothing (a planned run's, which its plan
carries; one read from the estimate cache), else computed in a forked child (`EstimateWorker`) at a lower priority
(`ESTIMATE_NICE`), beside the first updates. The Loop of the run (`announcing`) says it after the update during
which it arrived; the end of the run collects it for the summary and the table (`RunEstimate.collect`), waiting for
it at most `wait_allowance` (max(2 s, 2% of the run's time)): past that the child is killed, and the table says the
estimate is missing. Where the worker cannot fork (an accelerator visible, torchrun,
``LOOPTRAIN_ESTIMATE_IN_PROCESS=1``) it is computed here, before the first update, as it was before. A failure is
a notice, never a failed run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from looptrain.cli.console import say
from looptrain.loop import Loop

ESTIMATE_NICE = 19  # the child runs on the CPU time training leaves idle (os.nice: the lowest priority)
MIN_WAIT_SECONDS = 2.0  # what the end of a run may wait for its estimate: this, or WAIT_SHARE of the run's time
WAIT_SHARE = 0.02


def wait_allowance(run_seconds: float) -> float:
    """How long a run of `run_seconds` may wait for its own estimate: max(2 s, 2% of its time), or
    ``LOOPTRAIN_ESTIMATE_WAIT`` seconds where that is set (the test suite waits for every estimate)."""
    explicit = os.environ.get("LOOPTRAIN_ESTIMATE_WAIT", "").strip()
    return float(explicit) if explicit else max(MIN_WAIT_SECONDS, WAIT_SHARE * run_seconds)


class RunEstimate:
    """The run's estimate (a dict of ``peak_memory_bytes``, ``training_peak_bytes``, ``evaluation_peak_bytes``):
    known already (`result`), or being computed by `worker` (a child started by `start_estimate`).

    `describe` gives the line saying it, once it is known; `waited_seconds` is the time the run spent waiting for it
    (computing it here, or at the end of the run); `missing` says why there is none where one was due (an error, not
    ready in time).
    """

    def __init__(self, result: dict | None = None, worker: Any = None, describe: Callable[[dict], str] | None = None,
                 waited_seconds: float = 0.0, missing: str | None = None):
        self.result, self.worker, self.describe = result, worker, describe
        self.waited_seconds, self.missing = waited_seconds, missing
        self.started = time.perf_counter()

    def poll(self, echo: Callable[[str], None] = say, step: int | None = None) -> None:
        """Takes the child's answer if it has come, and says it (`echo`): never waits."""
        if self.worker is not None and self.worker.ready():
            self._take(echo, f"beside updates 1-{step}" if step else "beside the run")

    def collect(self, run_seconds: float, echo: Callable[[str], None] = say) -> dict | None:
        """The estimate, waiting for a child still computing at most `wait_allowance(run_seconds)`, less what the run
        waited for it already. Past it the child is killed, and the estimate is missing (None)."""
        if self.worker is None:
            return self.result
        allowance = max(0.0, wait_allowance(run_seconds) - self.waited_seconds)
        started = time.perf_counter()
        arrived = self.worker.ready(allowance)
        self.waited_seconds += time.perf_counter() - started
        if not arrived:
            self.close()
            self.missing = f"still computing after {self.computed():.1f} s beside the run"
            echo(f"notice: no memory estimate for this run ({self.missing}; a run waits for it at most "
                 f"max({MIN_WAIT_SECONDS:.0f} s, {WAIT_SHARE:.0%} of its time), LOOPTRAIN_ESTIMATE_WAIT seconds "
                 "where that is set)")
            return None
        self._take(echo, "beside the run")
        return self.result

    def computed(self) -> float:
        return time.perf_counter() - self.started

    def close(self) -> None:
        """Kills a child still computing and reaps it (interrupts, errors, the end of a run): none outlives the run."""
        if self.worker is not None:
            self.worker.kill()
            self.worker = None

    def _take(self, echo: Callable[[str], None], where: str) -> None:
        worker, self.worker = self.worker, None
        try:
            self.result = worker.collect()
        except Exception as error:  # noqa: BLE001  an estimate is a report, never a reason to stop a run
            self.missing = f"{type(error).__name__}: {error}"
            echo(f"notice: no memory estimate for this run ({self.missing})")
            return
        finally:
            worker.kill()  # it has answered: reaped (it was leaving already)
        if self.result is not None and self.describe is not None:
            echo(f"{self.describe(self.result)} (computed {where} in {self.computed():.1f} s)")


def announcing(loop_class: type[Loop]) -> type[Loop]:
    """`loop_class` (the Loop the command line builds, resolved when it runs: a subclass or a test's stand-in
    counts) that, after each update, takes the run's estimate if it has arrived and says it."""

    class AnnouncingLoop(loop_class):
        run_estimate: RunEstimate | None = None

        def on_step_end(self, *, step: int, **others: Any) -> None:
            super().on_step_end(step=step, **others)
            if self.run_estimate is not None:
                self.run_estimate.poll(self.run.log.echo, step)

    return AnnouncingLoop


def start_estimate(compute: Callable[[Any], dict], cached: Callable[[], dict],
                   describe: Callable[[dict], str]) -> RunEstimate:
    """The run's estimate: `cached()` (raising LookupError where the estimate cache does not hold it) said at once,
    else `compute` started in a child at priority `ESTIMATE_NICE`, or computed here where no child can be forked."""
    from looptrain.estimation.worker import EstimateWorker

    started = time.perf_counter()
    try:
        try:
            result = cached()
        except LookupError:
            worker = EstimateWorker(compute, nice=ESTIMATE_NICE)
            if worker.pid is not None:
                worker.submit(None, last=True)
                say("estimating the run's peak memory in a child process beside the first updates (it is said when "
                    "it is ready)")
                return RunEstimate(worker=worker, describe=describe, waited_seconds=time.perf_counter() - started)
            result = worker(None)
    except Exception as error:  # noqa: BLE001  an estimate is a report, never a reason to stop a run
        missing = f"{type(error).__name__}: {error}"
        say(f"notice: no memory estimate for this run ({missing})")
        return RunEstimate(missing=missing, waited_seconds=time.perf_counter() - started)
    say(describe(result))
    return RunEstimate(result=result, waited_seconds=time.perf_counter() - started)
