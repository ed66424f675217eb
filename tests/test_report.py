"""report.png: every finished run draws its picture from its own files, and `looptrain-report RUN_DIR` draws it
again; the series drawn are metrics.jsonl's; without matplotlib a run finishes with one notice."""

from __future__ import annotations

import errno
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from looptrain import report
from looptrain.cli import finetune
from looptrain.cli import report as report_cli

from conftest import write_csv

pytestmark = pytest.mark.report  # its runs draw report.png (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PICTURE_SHAPE = (750, 1100, 4)  # 11 x 7.5 inches at 100 dpi, RGBA
NO_MATPLOTLIB = "drawing report.png needs matplotlib, which is not installed: pip install 'looptrain[report]'"


def argv(model_dir, data: Path, output_dir: Path, *extra) -> list[str]:
    return ["--model", str(model_dir), "--data", str(data), "--output-dir", str(output_dir), "--max-length", "32",
            "--lr", "1e-3", "--no-progress-bar", *extra]


@pytest.fixture(scope="module")
def finished_run(model_dir, tmp_path_factory):
    """A classifier's run: 6 updates, a log line at each, evaluations at 3 and 6, the tensor tracker's breakdown."""
    root = tmp_path_factory.mktemp("report")
    train, evaluation = write_csv(root / "train.csv", 24), write_csv(root / "eval.csv", 12, seed=1)
    output_dir = root / "run"
    assert finetune.main(argv(model_dir, train, output_dir, "--eval-data", str(evaluation), "--epochs", "2",
                              "--batch-size", "8", "--log-every", "1")) == 0
    return output_dir


def assert_picture(path: Path) -> None:
    """A valid PNG of the report's size: its signature, and matplotlib reads it back."""
    from matplotlib.image import imread

    assert path.stat().st_size > 0
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    assert imread(path).shape == PICTURE_SHAPE


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file()}


def events_of(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["event"] == kind]


# ------------------------------------------------------------------ the picture
def test_a_finished_run_draws_report_png(finished_run, capsys):
    assert_picture(finished_run / "report.png")
    assert not list(finished_run.glob(".report.png.tmp-*"))


def test_looptrain_report_draws_it_again_and_writes_nothing_else(finished_run, tmp_path, capsys):
    run_dir = shutil.copytree(finished_run, tmp_path / "run")
    (run_dir / "report.png").unlink()
    before = files_of(run_dir)
    assert report_cli.main([str(run_dir)]) == 0
    assert capsys.readouterr().out == f"wrote {run_dir / 'report.png'}\n"
    assert_picture(run_dir / "report.png")
    assert files_of(run_dir) == {**before, "report.png": (run_dir / "report.png").read_bytes()}
    # --output elsewhere: only that file is written
    assert report_cli.main([str(run_dir), "--output", str(tmp_path / "exp1.png")]) == 0
    assert_picture(tmp_path / "exp1.png")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["exp1.png", "run"]


def test_the_drawn_series_are_metrics_jsonl_values(finished_run, model_dir):
    series = report.run_series(finished_run)
    train, evaluations = events_of(finished_run, "train"), events_of(finished_run, "eval")
    assert series.train_loss.steps == tuple(event["step"] for event in train) == (1, 2, 3, 4, 5, 6)
    assert series.train_loss.values == tuple(event["loss"] for event in train)
    assert series.learning_rate.values == tuple(event["lr"] for event in train)
    assert [line.name for line in series.evaluation] == ["accuracy", "macro-F1"]
    for line, key in zip(series.evaluation, ("accuracy", "f1")):
        assert line.steps == tuple(event["step"] for event in evaluations) == (3, 6)
        assert line.values == tuple(event[key] for event in evaluations)
    summary = json.loads((finished_run / "summary.json").read_text())
    assert series.baseline == {"accuracy": summary["majority_baseline"]["accuracy"],
                               "macro-F1": summary["majority_baseline"]["f1"]}
    breakdown = summary["memory_breakdown"]
    assert series.memory == {"params": breakdown["params"], "grads": breakdown["grads"],
                             "optimizer state": breakdown["optimizer_state"],
                             "activations + temps": breakdown["activations_and_temps"]}
    assert (series.memory_meter, series.peak_phase) == ("cpu_tensor_tracker", breakdown["peak_phase"])
    assert series.estimated_peak_bytes == summary["estimated_peak_bytes"] > 0
    assert series.title == f"run: {model_dir.parent.name}/{model_dir.name}, sequence classification, 6 updates (fp32 " \
        "on cpu)"


def write_events(run_dir: Path, events: list[dict], tail: str = "") -> Path:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(event) + "\n" for event in events) + tail)
    return run_dir


def test_a_resume_supersedes_the_events_it_trains_again_and_an_unfinished_run_draws(tmp_path, capsys):
    events = [{"event": "train", "step": step, "loss": 1.0 / step, "lr": 0.1} for step in (1, 2, 3, 4)]
    events += [{"event": "eval", "step": 2, "loss": 0.9}, {"event": "eval", "step": 4, "loss": 0.8},
               {"event": "resume", "step": 2, "checkpoint": "checkpoint-2"},
               {"event": "train", "step": 3, "loss": 0.3, "lr": 0.05}, {"event": "eval", "step": 4, "loss": 0.7}]
    run_dir = write_events(tmp_path / "run", events, tail='{"event": "train", "st')  # a killed run's half line
    series = report.run_series(run_dir)
    assert (series.train_loss.steps, series.train_loss.values) == ((1, 2, 3), (1.0, 0.5, 0.3))
    assert series.learning_rate.values == (0.1, 0.1, 0.05)
    (evaluation,) = series.evaluation  # no class scores: the evaluation loss
    assert (evaluation.name, evaluation.steps, evaluation.values) == ("eval loss", (2, 4), (0.9, 0.7))
    assert (series.memory, series.estimated_peak_bytes) == ({}, None)
    assert series.title == "run: 3 updates (no summary.json: the run has not finished)"
    assert report_cli.main([str(run_dir)]) == 0  # a run in progress is drawn as far as it went
    assert_picture(run_dir / "report.png")


def test_a_causal_lm_run_is_drawn_with_its_evaluation_loss(tmp_path):
    events = [{"event": "train", "step": 1, "loss": 3.0, "lr": 1e-4},
              {"event": "eval", "step": 1, "loss": 2.5, "perplexity": 12.18, "count": 40}]
    series = report.run_series(write_events(tmp_path / "run", events))
    assert [(line.name, line.values) for line in series.evaluation] == [("eval loss", (2.5,))]


# ------------------------------------------------------------------ without matplotlib, and failures
def test_without_matplotlib_a_run_finishes_with_one_notice_and_looptrain_report_exits_2(model_dir, tmp_path,
                                                                                        capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    output_dir = tmp_path / "run"
    data = write_csv(tmp_path / "train.csv", 16)
    assert finetune.main(argv(model_dir, data, output_dir, "--max-steps", "2", "--eval-every", "no",
                              "--no-track-memory")) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "report.png" in line] == \
        [f"notice: {NO_MATPLOTLIB} (then: looptrain-report {output_dir})"]
    assert json.loads((output_dir / "run.json").read_text())["status"] == "finished"
    assert not (output_dir / "report.png").exists()
    assert report_cli.main([str(output_dir)]) == 2
    assert capsys.readouterr().err == f"report.py: error: {NO_MATPLOTLIB}\n"
    assert not (output_dir / "report.png").exists()


def test_a_picture_that_cannot_be_written_never_fails_the_finished_run(model_dir, tmp_path, capsys, monkeypatch):
    """The disk fills while the picture is written: the run has finished, so it exits 0 with a notice, and no
    partial picture nor temporary file is left."""
    from matplotlib.figure import Figure

    def full_disk(figure, handle, **options):
        handle.write(PNG_SIGNATURE)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    output_dir = tmp_path / "run"
    data = write_csv(tmp_path / "train.csv", 16)
    assert finetune.main(argv(model_dir, data, output_dir, "--max-steps", "2", "--eval-every", "no",
                              "--no-track-memory")) == 0
    assert (f"notice: no report.png (OSError: [Errno 28] No space left on device); the run itself is complete, and "
            f"looptrain-report {output_dir} draws it again") in capsys.readouterr().out
    assert json.loads((output_dir / "run.json").read_text())["status"] == "finished"
    assert not (output_dir / "report.png").exists() and not list(output_dir.glob(".report.png.tmp-*"))


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_a_real_write_failure_leaves_the_old_picture_whole_and_no_temporary_file(finished_run, tmp_path):
    """A file-size limit (RLIMIT_FSIZE) fails the picture's write as a full disk does, in a child process: exit 2,
    one line naming the fix; the rename never happened, so the previous report.png is intact."""
    import resource
    import signal

    def limit_file_size():  # in the child: files past 20 kB cannot be written (the picture is larger)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    run_dir = shutil.copytree(finished_run, tmp_path / "run")
    before = files_of(run_dir)
    done = subprocess.run([sys.executable, "-m", "looptrain.report", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, preexec_fn=limit_file_size, timeout=120)
    assert done.returncode == 2, done.stderr
    assert re.fullmatch(rf"python -m looptrain\.report: error: cannot write {re.escape(str(run_dir / 'report.png'))} "
                        r"\(File too large\): free some space, or pass an --output on another disk\n", done.stderr)
    assert files_of(run_dir) == before  # the old picture, byte for byte; no temporary file
