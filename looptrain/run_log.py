"""The run log: throughput and loss totals, `metrics.jsonl`, trackers, the progress bar, the summary.

Every event (a train log line, an evaluation, a skipped window, a resume) is one JSON object: it is
appended to `output_dir/metrics.jsonl`, handed to each tracker named in `LoopConfig.report_to`
(TensorBoard, Weights & Biases, MLflow: `looptrain.trackers`) and printed as one line; the trackers
also receive the run's configuration and, at the end, its summary. Only rank 0 writes, prints and
opens trackers.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm.auto import tqdm

from looptrain.run_files import METRICS_FILE
from looptrain.trackers import open_trackers, tracker_names

HEARTBEAT_SECONDS = 10.0  # without a progress bar, a line at least this often while training or evaluating


class Totals:
    """Samples, tokens, loss and training seconds: for the current log interval and for the whole run.

    Training seconds run from `restart_clock()` to each window's end, so evaluation and checkpoint
    writing (after which the clock restarts) are not training time; data loading is.
    """

    def __init__(self):
        self.samples = self.tokens = self.items = 0
        self.loss_sum = self.seconds = 0.0
        self.run_samples = self.run_tokens = self.run_items = 0
        self.run_loss_sum = self.run_seconds = 0.0
        self._clock = time.perf_counter()

    def restart_clock(self) -> None:
        self._clock = time.perf_counter()

    def add_window(self, samples: int, tokens: int, loss_sum: float, items: int) -> None:
        """Closes one window: its counts, and the seconds since the clock's last tick."""
        now = time.perf_counter()
        seconds, self._clock = now - self._clock, now
        self.samples += samples
        self.tokens += tokens
        self.loss_sum += loss_sum
        self.items += items
        self.seconds += seconds
        self.run_samples += samples
        self.run_tokens += tokens
        self.run_loss_sum += loss_sum
        self.run_items += items
        self.run_seconds += seconds

    def pop_interval(self) -> dict:
        """The interval's mean loss and throughput; starts the next interval."""
        seconds = max(self.seconds, 1e-9)
        result = {
            "loss": self.loss_sum / max(self.items, 1),
            "samples_per_s": self.samples / seconds,
            "tokens_per_s": self.tokens / seconds,
        }
        self.samples = self.tokens = self.items = 0
        self.loss_sum = self.seconds = 0.0
        return result

    def run_figures(self) -> dict:
        """Whole-run counts, throughput and mean train loss (None when no item was seen)."""
        seconds = max(self.run_seconds, 1e-9)
        return {
            "train_samples": self.run_samples,
            "train_tokens": self.run_tokens,
            "train_samples_per_s": round(self.run_samples / seconds, 3),
            "train_tokens_per_s": round(self.run_tokens / seconds, 3),
            "train_loss": self.run_loss_sum / self.run_items if self.run_items else None,
        }


def format_record(record: dict) -> str:
    """One event as `key=value` pairs (floats to 4 significant digits, `mfu` in percent; nested ones left out)."""
    parts = []
    for key, value in record.items():
        if key == "mfu" and isinstance(value, float):  # model FLOP utilisation, a fraction: read as a percentage
            parts.append(f"mfu={value:.1%}")
        elif isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif value is not None and not isinstance(value, (dict, list)):
            parts.append(f"{key}={value}")
    return " ".join(parts)


class RunLog:
    """Where a run's events go: `metrics.jsonl`, the trackers, stdout, and the progress bar.

    Args:
        output_dir: where `metrics.jsonl` (and tracker files) are written; None writes nothing.
        is_main: rank 0 (only it writes and prints).
        report_to: "none" or comma-separated tracker names (`looptrain.trackers.TRACKERS`).
        progress_bar: show a tqdm bar when stderr is a terminal.
        config: the run's configuration, which the trackers record.
    """

    def __init__(self, output_dir: Path | None, *, is_main: bool, report_to: str = "none", progress_bar: bool = True,
                 config: dict | None = None):
        self.output_dir = output_dir
        self.is_main = is_main
        self.totals = Totals()
        self._want_bar = progress_bar
        self._bar = None
        self._report_to = report_to
        self._config = config or {}
        self._trackers: list | None = None  # opened as the run begins (`open_trackers`), not before
        self._last_line = time.monotonic()

    def echo(self, line: str) -> None:
        """Prints one line (rank 0), above the progress bar when there is one."""
        if self.is_main:
            tqdm.write(line, file=sys.stdout)
            self._last_line = time.monotonic()

    def heartbeat(self, describe: Callable[[], str]) -> None:
        """Without a progress bar, prints `describe()` when nothing was printed for `HEARTBEAT_SECONDS`.

        A log file or CI console then shows a sign of life at least that often, however long a log
        interval or an evaluation takes.
        """
        if self.is_main and self._bar is None and time.monotonic() - self._last_line >= HEARTBEAT_SECONDS:
            self.echo(describe())

    def event(self, record: dict, line: str | None = None) -> None:
        """Appends one event to `metrics.jsonl`, gives it to the trackers, and prints it (rank 0).

        Args:
            record: the event (JSON-ready; "event" and "step" keys by convention).
            line: what to print instead of the record's `key=value` pairs.
        """
        if not self.is_main:
            return
        self.open_trackers()  # before metrics.jsonl grows: it says which steps a continued tracker run holds
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with open(self.output_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        for tracker in self._trackers:
            tracker.log(record)
        self.echo(format_record(record) if line is None else line)

    def open_trackers(self) -> None:
        """Opens the trackers `report_to` names (rank 0), once: as the run begins, so that one which cannot start
        (a missing login, an unreachable store) stops the run before it trains (`looptrain.trackers.open_trackers`)."""
        if self._trackers is None and self.is_main:
            named = self.output_dir is not None and tracker_names(self._report_to)
            self._trackers = open_trackers(self._report_to, self.output_dir, self._config) if named else []

    def log_summary(self, summary: dict) -> None:
        """Hands the run's summary (less its config, which the trackers hold already) to every tracker (rank 0)."""
        if self.is_main:
            self.open_trackers()
            for tracker in self._trackers:
                tracker.log_summary({key: value for key, value in summary.items() if key != "config"})

    def open_progress(self, total: int | None, initial: int) -> None:
        """A tqdm bar over optimizer updates, on a terminal only (elsewhere the log lines report progress)."""
        if self._want_bar and self.is_main and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def advance_progress(self, steps: int, **postfix: str) -> None:
        """Moves the bar on by `steps` updates; `postfix` replaces what it shows beside the count."""
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(**postfix, refresh=False)
            self._bar.update(steps)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self, ending: str = "finished") -> None:
        """Closes the bar and every tracker; `ending` is how the run ended (`looptrain.trackers.ENDINGS`)."""
        self.close_progress()
        for tracker in self._trackers or []:
            tracker.close(ending)
        self._trackers = None
