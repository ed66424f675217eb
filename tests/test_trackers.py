"""The experiment trackers, for real and without a network: Weights & Biases in offline mode (its run files read back
with wandb's own reader, `wandb leet inspect --json`) and MLflow with a local file store (read back with its
client). What each holds must equal metrics.jsonl and summary.json, a resumed run must continue the same tracker
run without logging a step twice, and only rank 0 ever opens one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looptrain import Loop, LoopConfig
from looptrain.errors import ConfigError
from looptrain.run_log import RunLog
from looptrain.trackers import tracker_names

from conftest import SmallMLP, mlp_batches, write_csv


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    """wandb without a network, its settings and caches under tmp_path (WANDB_DIR unset: output_dir/wandb)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name))
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture
def local_mlflow(monkeypatch, tmp_path):
    """MLflow's client on a file store under tmp_path (MLflow 3 keeps that store behind MLFLOW_ALLOW_FILE_STORE)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    from mlflow import MlflowClient

    return MlflowClient()


class FailAtStep(Loop):
    """Raises at the end of one step (before its train event): a crash that `resume="auto"` continues from."""

    fail_step = 4

    def on_step_end(self, *, step, **_):
        if step == self.fail_step:
            raise RuntimeError("crash")


def train(output_dir: Path, report_to: str, loop_class=Loop, **fields) -> dict:
    torch.manual_seed(0)
    model = SmallMLP()
    config = LoopConfig(output_dir=str(output_dir), report_to=report_to, progress_bar=False, log_every=1,
                        eval_every=2, device="cpu", track_memory=False, measure_mfu=False, **fields)
    return loop_class(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_batches(4),
                      eval_loader=mlp_batches(1, seed=1), config=config).fit()


def logged_numbers(output_dir: Path) -> dict[tuple[str, int], float]:
    """Every number of metrics.jsonl as `<event>/<key>` at its step, as first logged: a tracker run continued by a
    resume keeps what it holds of a step (the numbers are the same but for the throughput)."""
    numbers = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        for key, value in event.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers.setdefault((f"{event['event']}/{key}", event["step"]), value)
    return numbers


def wandb_records(run_dir: Path, *options: str) -> list[dict]:
    """A W&B run directory's records, read by wandb's own reader of its .wandb log."""
    result = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *options, str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")] if not options \
        else [json.loads(result.stdout)]


def without_empty_dicts(value):
    """A config as W&B keeps it: nested dicts that are empty leave no key."""
    if not isinstance(value, dict):
        return value
    return {key: without_empty_dicts(item) for key, item in value.items() if item != {}}


def wandb_history(run_dir: Path) -> dict[tuple[str, int], float]:
    return {(key, record["history"]["step"].get("num", 0)): value
            for record in wandb_records(run_dir) if record["type"] == "history"
            for key, value in record["history"]["item"].items() if not key.startswith("_")}


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_wandb_offline_run_holds_every_logged_number_the_config_and_the_summary(offline_wandb, tmp_path):
    summary = train(tmp_path / "run", "wandb")
    [run_dir] = (tmp_path / "run" / "wandb").glob("offline-run-*")
    saved = json.loads((tmp_path / "run" / "trackers.json").read_text())
    logged = logged_numbers(tmp_path / "run")
    assert {key for key, _ in logged} >= {"train/loss", "train/lr", "train/grad_norm", "eval/loss", "eval/accuracy"}
    assert wandb_history(run_dir) == logged
    [state] = wandb_records(run_dir, "--summary")
    assert state["state"] == "finished" and state["name"] == "run" and state["project"] == "looptrain"
    assert state["run_id"] == saved["wandb"]["id"]
    assert state["config"] == without_empty_dicts({"loop_config": json.loads(json.dumps(summary["config"]))})
    for key in ("train_runtime_s", "optimizer_steps", "peak_memory_bytes", "memory_breakdown", "final_eval"):
        assert state["summary"][key] == summary[key], key


def test_mlflow_file_store_holds_every_logged_number_the_config_and_the_summary(local_mlflow, tmp_path):
    summary = train(tmp_path / "run", "mlflow")
    run_id = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]["run_id"]
    run = local_mlflow.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert local_mlflow.get_experiment(run.info.experiment_id).name == "looptrain"
    logged = logged_numbers(tmp_path / "run")
    held = {(metric.key, metric.step): metric.value for key in {key for key, _ in logged}
            for metric in local_mlflow.get_metric_history(run_id, key)}
    assert held == logged
    assert run.data.params["loop_config.seed"] == "42" and run.data.params["loop_config.report_to"] == "mlflow"
    assert run.data.metrics["summary/optimizer_steps"] == summary["optimizer_steps"] == 4
    for category, size in summary["memory_breakdown"].items():
        if isinstance(size, int):
            assert run.data.metrics[f"summary/memory_breakdown/{category}"] == size, category
    from mlflow.artifacts import load_dict

    assert load_dict(f"{run.info.artifact_uri}/summary.json") == json.loads(json.dumps(
        {key: value for key, value in summary.items() if key != "config"}))
    assert load_dict(f"{run.info.artifact_uri}/run_config.json") == {"loop_config": json.loads(json.dumps(
        summary["config"]))}


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_a_resumed_run_continues_the_same_tracker_runs_without_a_step_twice(offline_wandb, local_mlflow, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))  # wandb's own setting wins over output_dir
    output_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="crash"):
        train(output_dir, "wandb,mlflow", FailAtStep)
    saved = json.loads((output_dir / "trackers.json").read_text())
    run_id = saved["mlflow"]["run_id"]
    assert local_mlflow.get_run(run_id).info.status == "FAILED"
    assert [metric.step for metric in local_mlflow.get_metric_history(run_id, "train/loss")] == [1, 2, 3]
    train(output_dir, "wandb,mlflow", resume="auto")  # continues from checkpoint-2: steps 3 and 4 again
    assert json.loads((output_dir / "trackers.json").read_text()) == saved  # the same tracker runs
    assert local_mlflow.get_run(run_id).info.status == "FINISHED"
    logged = logged_numbers(output_dir)
    steps = [metric.step for metric in local_mlflow.get_metric_history(run_id, "train/loss")]
    assert steps == [1, 2, 3, 4]  # step 3, logged before the crash, is not logged again; 4 was not
    held = {(metric.key, metric.step): metric.value for key in {key for key, _ in logged}
            for metric in local_mlflow.get_metric_history(run_id, key)}
    assert held == {key: value for key, value in logged.items() if not key[0].startswith("resume/")}
    first, second = sorted((tmp_path / "wandb-files" / "wandb").glob("offline-run-*"))  # by start time
    [state] = wandb_records(first, "--summary")
    assert state["state"] == "failed" and state["run_id"] == saved["wandb"]["id"]
    assert wandb_records(second, "--summary")[0]["run_id"] == saved["wandb"]["id"]
    history = {**wandb_history(first), **wandb_history(second)}
    assert sorted(step for key, step in wandb_history(second) if key == "train/loss") == [4]
    assert history == {key: value for key, value in logged.items() if not key[0].startswith("resume/")}


def test_only_rank_zero_opens_trackers(offline_wandb, local_mlflow, tmp_path):
    log = RunLog(tmp_path / "run", is_main=False, report_to="wandb,mlflow")
    log.open_trackers()
    log.event({"event": "train", "step": 1, "loss": 0.5})
    log.log_summary({"optimizer_steps": 1})
    log.close()
    assert not (tmp_path / "run").exists()
    assert not list((tmp_path / "mlruns").glob("*/*/meta.yaml"))  # no MLflow run in the store


def test_repeated_and_comma_separated_names_are_one_list():
    from looptrain.cli.finetune.arguments import build_parser

    parser = build_parser()
    assert parser.parse_args([]).report_to == "none"
    parsed = parser.parse_args(["--report-to", "wandb", "--report-to", "mlflow,tensorboard"]).report_to
    assert parsed == "wandb,mlflow,tensorboard"
    assert tracker_names(parsed) == ["wandb", "mlflow", "tensorboard"]
    assert tracker_names("none") == [] and tracker_names("wandb,none,wandb") == ["wandb"]


@pytest.mark.slow  # a whole command-line run through both trackers, their imports cold: .ci/run runs it
def test_the_command_line_reports_to_wandb_and_mlflow_at_once(offline_wandb, local_mlflow, model_dir, tmp_path):
    from looptrain.cli import finetune

    output_dir = tmp_path / "run"
    argv = ["--model", str(model_dir), "--data", str(write_csv(tmp_path / "train.csv", 24)), "--output-dir",
            str(output_dir), "--max-length", "32", "--batch-size", "8", "--eval-split", "0.25", "--no-progress-bar",
            "--no-track-memory", "--log-every", "1", "--report-to", "wandb", "--report-to", "mlflow"]
    assert finetune.main(argv) == 0
    run_config = json.loads((output_dir / "run_config.json").read_text())
    summary = json.loads((output_dir / "summary.json").read_text())
    logged = logged_numbers(output_dir)
    run_id = json.loads((output_dir / "trackers.json").read_text())["mlflow"]["run_id"]
    run = local_mlflow.get_run(run_id)
    assert run.data.params["arguments.max_length"] == "32"  # the command line's run_config.json, flags and all
    assert run.data.metrics["summary/estimated_peak_bytes"] == summary["estimated_peak_bytes"]
    assert {(metric.key, metric.step): metric.value for metric in local_mlflow.get_metric_history(run_id, "eval/f1")} \
        == {key: value for key, value in logged.items() if key[0] == "eval/f1"}
    [run_dir] = (output_dir / "wandb").glob("offline-run-*")
    [state] = wandb_records(run_dir, "--summary")
    assert state["config"] == without_empty_dicts(run_config)
    assert state["summary"]["majority_baseline"] == summary["majority_baseline"]
    assert wandb_history(run_dir) == logged


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_importing_looptrain_and_checking_trackers_imports_none_of_them(tmp_path):
    """wandb and mlflow take a second or more to import: only a run that reports to them imports them."""
    code = ("import sys; import looptrain, looptrain.loop, looptrain.cli.finetune; "
            f"looptrain.LoopConfig(report_to='tensorboard,wandb,mlflow', output_dir={str(tmp_path)!r}); "
            "print(sorted(m for m in ('wandb', 'mlflow', 'tensorboard', 'torch.utils.tensorboard') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("mlflow", "mlflow-skinny")])
def test_a_tracker_without_its_package_is_refused_before_training(monkeypatch, tmp_path, name, package):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *args: None if module == name else real_find_spec(module, *args))
    with pytest.raises(ConfigError, match=rf"report_to='{name}' needs the {name} package: pip install {package} "
                                          rf"\(or pip install 'looptrain\[{name}\]'\)"):
        LoopConfig(report_to=f"tensorboard,{name}", output_dir=str(tmp_path))


def test_a_tracker_that_cannot_start_stops_the_run_before_it_trains(local_mlflow, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with pytest.raises(ConfigError, match=r"report_to='mlflow' could not start its run \(.*\); set "
                                          r"MLFLOW_TRACKING_URI to a tracking server or store"):
        train(tmp_path / "run", "mlflow")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step trained


def test_overwrite_moves_the_tracker_runs_aside_with_the_run(local_mlflow, tmp_path):
    """A fresh run in the place of another (--overwrite) opens tracker runs of its own: trackers.json goes aside
    with the run it belonged to."""
    train(tmp_path / "run", "mlflow")
    first = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]["run_id"]
    train(tmp_path / "run", "mlflow", overwrite=True)
    second = json.loads((tmp_path / "run" / "trackers.json").read_text())["mlflow"]["run_id"]
    [aside] = (tmp_path / "run").glob("previous-*/trackers.json")
    assert json.loads(aside.read_text())["mlflow"]["run_id"] == first != second
    assert [metric.step for metric in local_mlflow.get_metric_history(second, "train/loss")] == [1, 2, 3, 4]
