"""Faults a real run meets, through the command line (`python -m looptrain.cli.finetune`): bad inputs, kills,
tampered checkpoints, remote code.

Interrupted runs are real subprocesses killed with real signals; the run they are compared with is one
uninterrupted run per module, and "equal" means bitwise-equal final/model.safetensors. docs/reliability.md
lists every fault with the test that proves what happens.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looptrain.checkpoint import latest_checkpoint, list_checkpoints, resolve_resume_checkpoint
from looptrain.cli import finetune

ROOT = Path(__file__).resolve().parent.parent
# One thread everywhere: bitwise equality between processes needs the same kernels and reduction splits,
# and two OpenMP threads per process on a shared 2-core machine run several times slower than one.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# 32 samples, batch 2, 3 epochs: 48 updates and a checkpoint every 2, so a kill lands mid-training with
# checkpoints behind it, and a complete run takes a few seconds on a tiny BERT.
TOTAL_STEPS = 48
TRAINING = ["--batch-size", "2", "--epochs", "3", "--eval-every", "2", "--save-total-limit", "2", "--seed", "3",
            "--max-length", "32", "--lr", "1e-3", "--precision", "fp32", "--device", "cpu",
            "--no-track-memory", "--no-progress-bar"]


@contextmanager
def single_thread():
    """In-process runs use one thread like the subprocesses (CHILD_ENV), so their weights compare bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_in_process(arguments: list[str]) -> int:
    with single_thread():
        return finetune.main(arguments)


def argv(model_dir, data_files, output_dir, *extra) -> list[str]:
    train, evaluation = data_files
    return ["--model", str(model_dir), "--data", str(train), "--eval-data", str(evaluation),
            "--output-dir", str(output_dir), *TRAINING, *extra]


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(str(Path(output_dir) / "final" / "model.safetensors"))


def assert_bitwise_equal(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    different = [key for key in first if not torch.equal(first[key], second[key])]
    assert not different, f"tensors differ after resume: {different}"


def start(arguments: list[str], log_path: Path, *, child: list[str] | None = None) -> subprocess.Popen:
    """Starts the CLI (or a `python -c` child script) in a subprocess, its output in a file (no pipe to fill)."""
    command = [sys.executable, *(child or ["-m", "looptrain.cli.finetune"]), *arguments]
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(command, cwd=ROOT, env=CHILD_ENV, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()  # the child holds its own descriptor


def wait_for_checkpoint(output_dir: Path, process: subprocess.Popen, log_path: Path, timeout: float = 120) -> Path:
    """Polls until a complete checkpoint-* exists; fails with the child's output if it ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        checkpoints = list_checkpoints(output_dir)
        if checkpoints:
            return checkpoints[0]
        if process.poll() is not None:
            pytest.fail(f"the run ended (status {process.returncode}) before its first checkpoint:\n"
                        f"{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.02)
    process.kill()
    pytest.fail(f"no checkpoint after {timeout} s:\n{log_path.read_text(errors='replace')[-3000:]}")


# ---------------------------------------------------------------------------------------------------------
# Interrupted runs
# ---------------------------------------------------------------------------------------------------------


# Runs finetune.py with every update followed by a 30 ms pause: the weights are the same, but the 48 updates take
# at least 1.4 s however fast the CPU, so a signal sent up to 0.8 s after the first checkpoint lands mid-training
# (unpaced, a fast machine finished the whole run in 0.4 s and the signal found it exiting).
PACED = """
import runpy, sys, time
from looptrain.loop import Loop

run_update = Loop.run_update

def paced_update(self, window):
    result = run_update(self, window)
    time.sleep(0.03)
    return result

Loop.run_update = paced_update
sys.argv = ["looptrain-finetune", *sys.argv[1:]]
runpy.run_module("looptrain.cli.finetune", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # 8 s: a real SIGKILL and a resume; .ci/run runs it, make test stays under 5 minutes
def test_sigkill_at_a_random_point_then_resume_auto_equals_uninterrupted(
        model_dir, data_files, uninterrupted, tmp_path, capsys):
    output_dir = tmp_path / "killed"
    delay = random.Random(8).uniform(0.1, 0.8)  # seeded: the same kill point (in time) on every run
    log = tmp_path / "killed.log"
    process = start(argv(model_dir, data_files, output_dir), log, child=["-c", PACED])
    wait_for_checkpoint(output_dir, process, log)
    time.sleep(delay)
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL, "the run ended before the kill; lengthen it"
    assert not (output_dir / "final").exists()
    survivor = latest_checkpoint(output_dir)
    killed_at = int(survivor.name.split("-")[1])
    assert 2 <= killed_at < TOTAL_STEPS

    # The same command again with --resume auto (in-process: a fresh interpreter would only add start-up time;
    # the killed run and the reference already ran in different processes).
    capsys.readouterr()
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto")) == 0
    assert f"resumed from {survivor} at step {killed_at}" in capsys.readouterr().out
    assert_bitwise_equal(final_weights(uninterrupted), final_weights(output_dir))
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["optimizer_steps"] == TOTAL_STEPS
    assert not list(output_dir.glob(".tmp-*")), "a save cut by the kill must be swept by the next rotation"


# Runs finetune.py with looptrain.checkpoint.files.fsync_tree replaced: while the second checkpoint (step 4) is being
# written, after its data files but before its COMPLETE marker, the process SIGKILLs itself, like a power cut.
DIE_DURING_SECOND_SAVE = """
import os, runpy, signal, sys
from pathlib import Path
import looptrain.checkpoint.files as checkpoint_files

original_fsync_tree = checkpoint_files.fsync_tree

def fsync_tree_then_die(directory):
    directory = Path(directory)
    if directory.name.startswith(".tmp-checkpoint-4-") and not (directory / "COMPLETE").exists():
        os.kill(os.getpid(), signal.SIGKILL)
    original_fsync_tree(directory)

checkpoint_files.fsync_tree = fsync_tree_then_die
sys.argv = ["looptrain-finetune", *sys.argv[1:]]
runpy.run_module("looptrain.cli.finetune", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow  # over 5 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_kill_during_a_checkpoint_write_keeps_the_previous_one(model_dir, data_files, uninterrupted, tmp_path, capsys):
    output_dir = tmp_path / "cut"
    log = tmp_path / "cut.log"
    process = start(argv(model_dir, data_files, output_dir), log, child=["-c", DIE_DURING_SECOND_SAVE])
    assert process.wait(timeout=300) == -signal.SIGKILL, log.read_text(errors="replace")[-3000:]

    # The first checkpoint is whole and listed; the cut one is a temp dir with data but no marker, not listed.
    assert list_checkpoints(output_dir) == [output_dir / "checkpoint-2"]
    leftovers = list(output_dir.glob(".tmp-checkpoint-4-*"))
    assert len(leftovers) == 1
    assert (leftovers[0] / "model.safetensors").is_file() and not (leftovers[0] / "COMPLETE").exists()
    assert not (output_dir / "checkpoint-4").exists() and not (output_dir / "final").exists()
    assert resolve_resume_checkpoint("auto", output_dir) == output_dir / "checkpoint-2"

    capsys.readouterr()
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto")) == 0
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in capsys.readouterr().out
    assert_bitwise_equal(final_weights(uninterrupted), final_weights(output_dir))
    assert not leftovers[0].exists(), "rotation must sweep the temp dir of the interrupted save"


@pytest.mark.slow  # 6-7 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_sigterm_saves_a_checkpoint_exits_143_and_resume_equals_uninterrupted(
        model_dir, data_files, uninterrupted, tmp_path, capsys):
    output_dir = tmp_path / "terminated"
    log = tmp_path / "terminated.log"
    process = start(argv(model_dir, data_files, output_dir), log, child=["-c", PACED])
    wait_for_checkpoint(output_dir, process, log)
    time.sleep(random.Random(9).uniform(0.1, 0.8))
    process.send_signal(signal.SIGTERM)
    status = process.wait(timeout=120)
    output = log.read_text(errors="replace")
    assert status == 143, f"status {status}:\n{output[-3000:]}"
    found = re.search(r"interrupted by SIGTERM at step (\d+): saved checkpoint-(\d+); continue with .*--resume auto",
                      output)
    assert found and found[1] == found[2], output[-3000:]
    stopped_at = int(found[1])
    assert 2 <= stopped_at < TOTAL_STEPS
    assert latest_checkpoint(output_dir) == output_dir / f"checkpoint-{stopped_at}"
    assert not (output_dir / "final").exists()

    capsys.readouterr()
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto")) == 0
    assert f"resumed from {output_dir / f'checkpoint-{stopped_at}'} at step {stopped_at}" in capsys.readouterr().out
    assert_bitwise_equal(final_weights(uninterrupted), final_weights(output_dir))


# ---------------------------------------------------------------------------------------------------------
# Safe loading
# ---------------------------------------------------------------------------------------------------------


class WritesMarker:
    """Unpickling this calls open(marker, "w"): the file appears if, and only if, the pickle's code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("file_name", ["optimizer.pt", "scheduler.pt", "rng_state.pt"])
def test_resume_refuses_a_checkpoint_file_that_would_run_code(
        model_dir, data_files, uninterrupted, tmp_path, capsys, file_name):
    marker = tmp_path / "PAYLOAD_RAN"
    tampered = {"state": {}, "param_groups": [], "payload": WritesMarker(marker)}
    # The payload is live: a plain torch.load (weights_only=False) runs it.
    probe = tmp_path / "probe.pt"
    torch.save(tampered, probe)
    torch.load(probe, weights_only=False)
    assert marker.exists()
    marker.unlink()

    output_dir = tmp_path / "run"
    latest = latest_checkpoint(uninterrupted)
    shutil.copytree(latest, output_dir / latest.name)
    torch.save(tampered, output_dir / latest.name / file_name)
    assert finetune.main(argv(model_dir, data_files, output_dir, "--resume", str(output_dir / latest.name))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.search(rf"finetune\.py: error: refusing to load \S*{re.escape(file_name)}: .*could execute code",
                     err), err
    assert not marker.exists()
    assert not (output_dir / "final").exists()


REMOTE_CODE = "import pathlib\npathlib.Path({marker!r}).write_text('remote code ran')\n"


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_model_with_custom_code_is_refused_without_trust_remote_code(model_dir, data_files, tmp_path):
    """A config whose auto_map points at Python files in the model dir: nothing of it may run.

    stdin holds "y": transformers asks "Do you wish to run the custom code? [y/N]" when
    trust_remote_code is left None, and that answer would run it.
    """
    marker = tmp_path / "REMOTE_CODE_RAN"
    evil = tmp_path / "evil-model"
    shutil.copytree(model_dir, evil)
    config = json.loads((evil / "config.json").read_text())
    config["model_type"] = "evil-bert"  # unknown to transformers, so only the shipped code could load it
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForSequenceClassification": "modeling_evil.EvilModel"}
    (evil / "config.json").write_text(json.dumps(config))
    payload = REMOTE_CODE.format(marker=str(marker))
    (evil / "configuration_evil.py").write_text(
        payload + "from transformers import BertConfig\nclass EvilConfig(BertConfig):\n    model_type = 'evil-bert'\n")
    (evil / "modeling_evil.py").write_text(
        payload + "from transformers import BertForSequenceClassification\n"
        "class EvilModel(BertForSequenceClassification):\n    pass\n")

    result = subprocess.run(
        [sys.executable, "-m", "looptrain.cli.finetune", *argv(evil, data_files, tmp_path / "out"),
         "--max-steps", "1", "--eval-every", "no"],
        cwd=ROOT, env=CHILD_ENV, input="y\n", capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "[y/N]" not in result.stdout + result.stderr, "the CLI must never ask; only --trust-remote-code opts in"
    assert re.search(r"finetune\.py: error: .*custom code.*trust_remote_code", result.stderr, re.S), result.stderr
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------------
# Bad inputs through the command line (the cases tests/test_finetune.py does not cover)
# ---------------------------------------------------------------------------------------------------------

GOOD_ROWS = "text,label\ngood movie,pos\nbad plot,neg\ngreat fun,pos\n"


def cli_error(model_dir, capsys, arguments: list[str]) -> str:
    """Runs the CLI in-process, asserts exit 2 and no traceback, returns stderr."""
    try:
        code = finetune.main(["--model", str(model_dir), "--no-track-memory", "--no-progress-bar", "--max-length",
                              "32", "--max-steps", "1", "--eval-every", "no", *arguments])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err
    assert captured.err.startswith("finetune.py: error: ") or "usage:" in captured.err, captured.err
    return captured.err


@pytest.mark.parametrize("column_flag, wrong, suggested", [
    ("--label-column", "lable", "label"),
    ("--text-column", "Text", "text"),
])
def test_misspelled_column_suggests_the_closest_name(model_dir, tmp_path, capsys, column_flag, wrong, suggested):
    data = tmp_path / "train.csv"
    data.write_text(GOOD_ROWS)
    err = cli_error(model_dir, capsys, ["--data", str(data), "--output-dir", str(tmp_path / "out"), column_flag, wrong])
    assert f"column '{wrong}' not found in {data}; available columns: text, label. Did you mean '{suggested}'?" in err
    assert "--text-column / --label-column" in err


@pytest.mark.parametrize("content, message", [
    ("text,label\n", r"train\.csv has a header but no data rows"),
    ("\n  \n", r"train\.csv is empty"),
    ("text,label\ngood movie,pos\n   ,neg\n", r"train\.csv line 3: text column 'text' is empty"),
    ("text,label\ngood movie,pos\nbad plot,\n", r"train\.csv line 3: label column 'label' is empty"),
    ("text,label\ngood movie,pos\n" + "x" * 200_000 + ",neg\n",
     r"train\.csv:3: cannot parse this line \(field larger than field limit"),
])
def test_bad_csv_names_the_file_and_line(model_dir, tmp_path, capsys, content, message):
    data = tmp_path / "train.csv"
    data.write_text(content)
    err = cli_error(model_dir, capsys, ["--data", str(data), "--output-dir", str(tmp_path / "out")])
    assert re.search(message, err), err


@pytest.mark.parametrize("lines, message", [
    (['{"text": "good movie", "label": "pos"}', '{"text": null, "label": "neg"}'],
     r"train\.jsonl line 2: text column 'text' is null; fill or drop the row"),
    (['{"text": "good movie", "label": "pos"}', '{"text": "", "label": "neg"}'],
     r"train\.jsonl line 2: text column 'text' is empty"),
    (['{"text": "good movie", "label": "pos"}', '{"label": "neg"}'],
     r"train\.jsonl line 2: column 'text' is missing from this row"),
    (['{"text": "good movie", "label": 1.5}'], r"label 1\.5 .* labels must be strings or integers"),
    (['{"text": "good movie", "label": true}'], r"label True .* labels must be strings or integers"),
    (['{"text": "good movie", "label": "pos"}', '["bad plot", "neg"]'],
     r"train\.jsonl:2: expected a JSON object per line, got list"),
    (['{"text": "good movie", "label": "pos"}', '{"text": "bad plot", "label": "neg"'],
     r"train\.jsonl:2: not valid JSON"),
])
def test_bad_jsonl_names_the_line(model_dir, tmp_path, capsys, lines, message):
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    err = cli_error(model_dir, capsys, ["--data", str(data), "--output-dir", str(tmp_path / "out")])
    assert re.search(message, err), err


def test_undecodable_bytes_name_the_file_and_line_and_the_flag_that_reads_them(model_dir, tmp_path, capsys):
    data = tmp_path / "latin1.csv"
    data.write_bytes(b"text,label\ngood movie,pos\ncaf\xe9 plot,neg\nfun,pos\n")
    err = cli_error(model_dir, capsys, ["--data", str(data), "--output-dir", str(tmp_path / "out")])
    assert f"{data}:3: bytes b'\\xe9' are not valid utf-8" in err
    assert "--encoding-errors replace" in err
    # The fix the message names works.
    assert run_in_process(["--model", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                          "--encoding-errors", "replace", "--max-steps", "1", "--eval-every", "no", "--max-length",
                          "32", "--no-track-memory", "--no-progress-bar"]) == 0


def test_bad_eval_file_is_named(model_dir, data_files, tmp_path, capsys):
    train, _ = data_files
    evaluation = tmp_path / "dev.csv"
    evaluation.write_bytes(b"text,label\ngood movie,pos\n\xff\xfe,neg\n")
    err = cli_error(model_dir, capsys, ["--data", str(train), "--eval-data", str(evaluation),
                                        "--output-dir", str(tmp_path / "out")])
    assert f"{evaluation}:3: bytes" in err
    err = cli_error(model_dir, capsys, ["--data", str(train), "--eval-data", str(tmp_path / "missing.csv"),
                                        "--output-dir", str(tmp_path / "out")])
    assert f"data file not found: {tmp_path / 'missing.csv'}" in err
    err = cli_error(model_dir, capsys, ["--data", str(tmp_path / "train.txt"), "--output-dir", str(tmp_path / "out")])
    assert "unsupported file type '.txt'; use one of .csv, .tsv, .jsonl" in err


@pytest.mark.parametrize("flags, message", [
    (["--optim-in-backward", "--precision", "fp16"],
     "optimizer_in_backward=True cannot be combined with precision='fp16'"),
    (["--eval-split", "1.5"], "--eval-split must be in [0, 1) (got 1.5)"),
    (["--batch-size", "0"], "argument --batch-size: must be >= 1 (got 0)"),
    (["--amp", "--precision", "fp32"], "--amp and --precision fp32 contradict each other"),
    (["--weights", "bf16", "--precision", "fp32"], "--weights bf16 computes in bf16, so --precision fp32 cannot hold"),
    (["--json"], "--json prints the plan of --plan-only as JSON"),
])
def test_incompatible_flags_are_refused_before_any_work(model_dir, data_files, tmp_path, capsys, flags, message):
    train, _ = data_files
    err = cli_error(model_dir, capsys, ["--data", str(train), "--output-dir", str(tmp_path / "out"), *flags])
    assert message in err
    assert not (tmp_path / "out").exists(), "a refused run must not create its output directory"


def test_an_eval_split_that_leaves_no_training_sample_is_a_usage_error(model_dir, data_files, tmp_path, capsys):
    train, _ = data_files  # 32 samples: 0.99 of them rounds to all 32
    err = cli_error(model_dir, capsys, ["--data", str(train), "--output-dir", str(tmp_path / "out"),
                                        "--eval-split", "0.99"])
    assert "--eval-split 0.99 of 32 samples leaves no training sample; lower --eval-split" in err
