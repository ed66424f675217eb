"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, each an optional package imported only when named.

A tracker opens with the run's configuration, then receives every event of the run log (`log`), the run's summary
(`log_summary`: its final figures and memory breakdown) and how the run ended (`close`). Weights & Biases and
MLflow keep their run's id in `output_dir/trackers.json`, so a resumed run continues the same tracker run: the
events of steps that run already holds are left out (`ContinuedRun`), so no step is logged twice. Only rank 0 opens
trackers (`looptrain.run_log.RunLog`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from looptrain.checkpoint import write_json_atomic
from looptrain.errors import ConfigError
from looptrain.run_files import METRICS_FILE, read_events, read_json_object

TRACKERS = ("tensorboard", "wandb", "mlflow")  # names LoopConfig.report_to accepts, besides "none"
# A tracker's module and the pip package that brings it (the looptrain extra of the same name installs it).
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
STATE_FILE = "trackers.json"  # each tracker's run id, moved aside with its run (`looptrain.ledger.MOVED_WITH_A_RUN`)
ENDINGS = ("finished", "interrupted", "failed")  # how a run ends (`Tracker.close`)

__all__ = ["ENDINGS", "PACKAGES", "STATE_FILE", "TRACKERS", "ContinuedRun", "MlflowTracker", "TensorBoardTracker",
           "Tracker", "WandbTracker", "missing_package", "numbers_of", "open_trackers", "tracker_names"]


class Tracker(Protocol):
    """What the run log needs of an experiment tracker (opened with the run's configuration)."""

    state: dict | None  # what a resume needs to continue this tracker's run (kept in trackers.json), or None

    def log(self, record: dict) -> None:
        """Receives one event (it has "event" and "step" keys, and numbers)."""

    def log_summary(self, summary: dict) -> None:
        """Receives the run's summary: its figures, the final evaluation, the memory breakdown."""

    def close(self, ending: str) -> None:
        """Flushes and releases the tracker; `ending` is one of `ENDINGS`."""


def tracker_names(report_to: str) -> list[str]:
    """The trackers `report_to` names (comma-separated), in order, each once; "none" names none."""
    names = [name.strip() for name in str(report_to).split(",")]
    return list(dict.fromkeys(name for name in names if name and name != "none"))


def missing_package(name: str) -> str | None:
    """The problem of a tracker whose package is not installed (looked up without importing it), or None."""
    module, package = PACKAGES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:  # no origin: a bare directory of that name, not the package
        return (f"report_to={name!r} needs the {module} package: pip install {package} "
                f"(or pip install 'looptrain[{name}]')")
    return None


def _import(name: str) -> Any:
    """The tracker's module, or a ConfigError saying how to install it."""
    try:
        return importlib.import_module(PACKAGES[name][0])
    except ImportError as error:
        raise ConfigError(missing_package(name) or f"report_to={name!r}: {error}") from error


def numbers_of(mapping: dict, prefix: str = "") -> dict[str, float]:
    """The numbers in `mapping` and the dicts nested in it, by their keys joined with "/" (booleans and None left
    out)."""
    return {key: value for key, value in flat_values(mapping, prefix, "/").items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def flat_values(mapping: dict, prefix: str = "", separator: str = ".") -> dict[str, Any]:
    """Every value of a nested dict by its keys joined with `separator` (an empty dict is a value)."""
    flat = {}
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            flat.update(flat_values(value, f"{prefix}{key}{separator}", separator))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def event_numbers(record: dict) -> tuple[int, dict[str, float]]:
    """An event's step, and its numbers named `<event>/<key>` (the step itself left out)."""
    event = record.get("event", "event")
    numbers = numbers_of({key: value for key, value in record.items() if key != "step"}, f"{event}/")
    return int(record.get("step", 0)), numbers


def summary_step(summary: dict) -> int:
    return int(summary.get("optimizer_steps") or 0)


class TensorBoardTracker:
    """Every number of every event as a TensorBoard scalar `<event>/<key>` at its step; the configuration and the
    summary as text, the summary's numbers as scalars `summary/<key>` at the last step.

    Args:
        output_dir: the event files go to `output_dir/tensorboard`.
        config: the run's configuration.
    """

    state = None  # nothing to continue: a resumed run appends to the same directory

    def __init__(self, output_dir: Path, config: dict, saved: dict | None = None):
        _import("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"))
        self.writer.add_text("config", _as_markdown(config))

    def log(self, record: dict) -> None:
        step, numbers = event_numbers(record)
        for key, value in numbers.items():
            self.writer.add_scalar(key, value, step)

    def log_summary(self, summary: dict) -> None:
        step = summary_step(summary)
        for key, value in numbers_of(summary, "summary/").items():
            self.writer.add_scalar(key, value, step)
        self.writer.add_text("summary", _as_markdown(summary), step)

    def close(self, ending: str) -> None:
        self.writer.flush()
        self.writer.close()


def _as_markdown(value: dict) -> str:
    """A dict as a JSON block TensorBoard's text tab shows as it is."""
    return "```\n" + json.dumps(value, indent=1, default=str) + "\n```"


class WandbTracker:
    """A Weights & Biases run: the configuration as its config, every event's numbers as `<event>/<key>` at the
    event's step, the summary in its summary.

    Its files go under `output_dir/wandb` unless WANDB_DIR says where; the project is WANDB_PROJECT's, else
    "looptrain"; the run is named after the output directory. Every other setting is wandb's own (WANDB_MODE=offline
    logs without a network; `wandb sync` uploads later).

    Args:
        output_dir: the run's output directory.
        config: the run's configuration.
        saved: what an earlier part of this run stored (`state`): its run id, continued with resume="allow".
    """

    def __init__(self, output_dir: Path, config: dict, saved: dict | None = None):
        wandb = _import("wandb")
        self.run = wandb.init(
            id=(saved or {}).get("id"), resume="allow", reinit="create_new", config=config, name=output_dir.name,
            project=os.environ.get("WANDB_PROJECT") or "looptrain",
            dir=os.environ.get("WANDB_DIR") or str(output_dir))
        self.state = {"id": self.run.id}

    def log(self, record: dict) -> None:
        step, numbers = event_numbers(record)
        if numbers:
            self.run.log(numbers, step=step)

    def log_summary(self, summary: dict) -> None:
        self.run.summary.update({key: value for key, value in summary.items() if value is not None})

    def close(self, ending: str) -> None:
        self.run.finish(exit_code=1 if ending == "failed" else 0)


class MlflowTracker:
    """An MLflow run: the configuration as parameters (nested keys joined with ".") and as the artifact
    run_config.json, every event's numbers as metrics `<event>/<key>` at the event's step, the summary's numbers as
    metrics `summary/<key>` at the last step and the whole summary as the artifact summary.json.

    The store is MLflow's own choice (MLFLOW_TRACKING_URI, else MLflow's default); the experiment is
    MLFLOW_EXPERIMENT_ID's, else the one named MLFLOW_EXPERIMENT_NAME, else "looptrain" (created when missing).

    Args:
        output_dir: the run's output directory (the MLflow run is named after it).
        config: the run's configuration.
        saved: what an earlier part of this run stored (`state`): its run id, continued when the store has it.
    """

    STATUS = {"finished": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}

    def __init__(self, output_dir: Path, config: dict, saved: dict | None = None):
        mlflow = _import("mlflow")
        self.client = mlflow.MlflowClient()
        self.run_id = self._continued((saved or {}).get("run_id"))
        if self.run_id is None:
            run = self.client.create_run(self._experiment_id(), run_name=output_dir.name)
            self.run_id = run.info.run_id
            self._log_params(config)
            self.client.log_dict(self.run_id, config, "run_config.json")
        self.state = {"run_id": self.run_id, "tracking_uri": mlflow.get_tracking_uri()}

    def _continued(self, run_id: str | None) -> str | None:
        """`run_id` running again, when this store holds it; None otherwise."""
        if run_id is None:
            return None
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException:  # another store than the one that started it: a new run
            return None
        return run_id

    def _experiment_id(self) -> str:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):
            return os.environ["MLFLOW_EXPERIMENT_ID"]
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "looptrain"
        experiment = self.client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else self.client.create_experiment(name)

    def _log_params(self, config: dict) -> None:
        """The configuration's values as parameters, nested keys joined with "." (MLflow's length limits applied)."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = [Param(key, str(value)[:MAX_PARAM_VAL_LENGTH]) for key, value in flat_values(config).items()]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH])

    def _log_numbers(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step)
                                                    for key, value in numbers.items()])

    def log(self, record: dict) -> None:
        step, numbers = event_numbers(record)
        if numbers:
            self._log_numbers(numbers, step)

    def log_summary(self, summary: dict) -> None:
        self._log_numbers(numbers_of(summary, "summary/"), summary_step(summary))
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self, ending: str) -> None:
        self.client.set_terminated(self.run_id, status=self.STATUS[ending])


class ContinuedRun:
    """A tracker run that a resumed run continues: events of the steps it already holds (those logged before the
    resume, through `through`) are left out, so none is logged twice (looptrain's resume repeats them exactly)."""

    def __init__(self, tracker: Tracker, through: int):
        self.tracker, self.through = tracker, through

    def log(self, record: dict) -> None:
        if int(record.get("step", 0)) > self.through:
            self.tracker.log(record)

    def log_summary(self, summary: dict) -> None:
        self.tracker.log_summary(summary)

    def close(self, ending: str) -> None:
        self.tracker.close(ending)


CLASSES = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
ADVICE = {"tensorboard": "check that output_dir is writable",
          "wandb": "log in (wandb login), or log offline with WANDB_MODE=offline and upload later with wandb sync",
          "mlflow": "set MLFLOW_TRACKING_URI to a tracking server or store this machine can reach (pip install "
                    "mlflow brings the local sqlite store that is MLflow's default)"}


def open_trackers(report_to: str, output_dir: Path, config: dict) -> list[Tracker]:
    """The trackers `report_to` names, opened: each continues the tracker run `output_dir/trackers.json` names.

    Raises:
        ConfigError: a tracker's package is missing, or its run cannot be started (one line, with the fix).
    """
    state_file = output_dir / STATE_FILE
    saved = read_json_object(state_file)
    opened, state = [], dict(saved)
    for name in tracker_names(report_to):
        try:
            tracker = _open(name, output_dir, config, saved.get(name))
        except ConfigError:
            for earlier in opened:  # none is left running
                earlier.close("failed")
            raise
        if saved.get(name) is not None and tracker.state == saved[name]:
            tracker = ContinuedRun(tracker, last_logged_step(output_dir / METRICS_FILE))
        elif tracker.state is not None:
            state[name] = tracker.state
        opened.append(tracker)
    if state != saved:
        write_json_atomic(state_file, state)
    return opened


def _open(name: str, output_dir: Path, config: dict, saved: dict | None) -> Tracker:
    """One tracker, opened; its failure to start as a ConfigError of one line that says what to do."""
    try:
        return CLASSES[name](output_dir, config, saved)
    except ConfigError:
        raise
    except Exception as error:  # the tracker's own failure (network, login, store), said in one line
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise ConfigError(f"report_to={name!r} could not start its run ({type(error).__name__}: {first_line}); "
                          f"{ADVICE[name]}") from error


def last_logged_step(metrics_file: Path) -> int:
    """The highest step of the events in a metrics.jsonl (-1 without one); a line cut short by a kill is skipped."""
    if not metrics_file.is_file():
        return -1
    steps = [event.get("step") for event in read_events(metrics_file)]
    return max((int(step) for step in steps if isinstance(step, (int, float)) and not isinstance(step, bool)),
               default=-1)
