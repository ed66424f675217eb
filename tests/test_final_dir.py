"""A run is finished only once its final/ is whole: final/ is written into a temporary directory and renamed into
place, and run.json says "finished" only after it. A kill, a signal or a full disk while final/ is written leaves
every earlier file as it was and a run that `--resume auto` continues to the uninterrupted run's exact weights.

The kills are real signals sent to a subprocess paused inside the final/ write (PAUSE_IN_FINAL); the full disk is a
real write failure (a file-size limit) in a subprocess, and, in-process, the error a full disk raises.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_reliability import (
    CHILD_ENV,
    ROOT,
    TRAINING,
    argv,
    assert_bitwise_equal,
    final_weights,
    run_in_process,
)

from looptrain import distributed

# Runs finetune.py with the final/ write paused: once the weights are written into the temporary directory (or, with
# LOOPTRAIN_TEST_PAUSE_IN=merged, once final/merged/ is), the child writes the file LOOPTRAIN_TEST_PAUSED and waits
# until a file named "go" appears beside it. Signals reach it while it waits.
PAUSE_IN_FINAL = """
import os, runpy, sys, time
from pathlib import Path
import looptrain.distributed as distributed
import looptrain.lora as lora

marker, where = Path(os.environ["LOOPTRAIN_TEST_PAUSED"]), os.environ.get("LOOPTRAIN_TEST_PAUSE_IN", "weights")

def pause():
    marker.write_text("paused")
    while not (marker.parent / "go").exists():
        time.sleep(0.01)

def paused_after(function, name):
    def wrapped(*args, **kwargs):
        result = function(*args, **kwargs)
        if where == name:
            pause()
        return result
    return wrapped

distributed.save_pretrained = paused_after(distributed.save_pretrained, "weights")
lora.merge_lora = paused_after(lora.merge_lora, "merged")
sys.argv = ["looptrain-finetune", *sys.argv[1:]]
runpy.run_module("looptrain.cli.finetune", run_name="__main__", alter_sys=True)
"""


def earlier_files(output_dir: Path) -> dict[str, bytes]:
    """Every file of the run but its lock and a killed write's temporary final/ (`.tmp-final-<pid>`)."""
    return {str(path.relative_to(output_dir)): path.read_bytes() for path in sorted(output_dir.rglob("*"))
            if path.is_file() and path.name != ".looptrain.lock" and not path.relative_to(output_dir).parts[0]
            .startswith(".tmp-final-")}


def status(output_dir: Path) -> str:
    return json.loads((output_dir / "run.json").read_text())["status"]


def start_paused(arguments: list[str], tmp_path: Path, where: str = "weights") -> tuple[subprocess.Popen, Path]:
    """The command line in a subprocess, paused inside its final/ write; returns it and its log."""
    marker, log = tmp_path / "paused", tmp_path / "child.log"
    environment = {**CHILD_ENV, "LOOPTRAIN_TEST_PAUSED": str(marker), "LOOPTRAIN_TEST_PAUSE_IN": where}
    with open(log, "wb") as handle:
        process = subprocess.Popen([sys.executable, "-c", PAUSE_IN_FINAL, *arguments], cwd=ROOT, env=environment,
                                   stdout=handle, stderr=subprocess.STDOUT)
    wait_for(lambda: marker.exists(), process, log, "the final/ write")
    return process, log


def wait_for(condition, process: subprocess.Popen, log: Path, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the child never reached {what} (status {process.poll()}):\n"
                        f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.02)


def assert_paused_in_final(output_dir: Path) -> None:
    """The moment a kill finds: training done, run.json "running", no final/ and no summary yet, half a final/ in its
    temporary directory."""
    assert status(output_dir) == "running"
    assert not (output_dir / "final").exists() and not (output_dir / "summary.json").exists()
    (temporary,) = output_dir.glob(".tmp-final-*")
    assert (temporary / "model.safetensors").is_file() or (temporary / "adapter_model.safetensors").is_file()


@pytest.fixture(scope="module")
def no_checkpoints(model_dir, data_files, tmp_path_factory):
    """A run that saves no checkpoint at all (no evaluation data, --eval-every no): its flags and its final weights,
    uninterrupted."""
    def flags(output_dir: Path) -> list[str]:
        return ["--model", str(model_dir), "--data", str(data_files[0]), "--output-dir", str(output_dir), *TRAINING,
                "--eval-every", "no", "--max-steps", "12"]

    reference = tmp_path_factory.mktemp("no-checkpoints") / "run"
    assert run_in_process(flags(reference)) == 0
    return flags, final_weights(reference)


@pytest.fixture
def files_for_disk(model_dir, data_files):
    """The flags of a 2-update run that saves no checkpoint (no evaluation data, --eval-every no)."""
    def flags(output_dir: Path) -> list[str]:
        return ["--model", str(model_dir), "--data", str(data_files[0]), "--output-dir", str(output_dir), *TRAINING,
                "--eval-every", "no", "--max-steps", "2"]
    return flags


# ---------------------------------------------------------------------------------------------------------
# Real signals, in a subprocess paused inside the final/ write
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a subprocess and a resume, about 10 s: .ci/run runs it
@pytest.mark.parametrize("signals", [("SIGKILL",), ("SIGINT", "SIGINT"), ("SIGTERM", "SIGTERM")],
                         ids=["sigkill", "ctrl-c-twice", "sigterm-twice"])
def test_a_kill_while_final_is_written_leaves_every_file_and_resume_reaches_the_same_weights(
        model_dir, data_files, uninterrupted, tmp_path, capsys, signals):
    output_dir = tmp_path / "run"
    process, log = start_paused(argv(model_dir, data_files, output_dir), tmp_path)
    assert_paused_in_final(output_dir)
    before = earlier_files(output_dir)
    for count, name in enumerate(signals, 1):
        process.send_signal(getattr(signal, name))
        if count < len(signals):  # the second only once the first was seen (two at once would be one)
            line = f"{name} received: writing the final outputs first"
            wait_for(lambda line=line: line in log.read_text(), process, log, f"the {name} line")
    returncode = process.wait(timeout=120)
    output = log.read_text(errors="replace")
    if signals == ("SIGKILL",):
        assert returncode == -signal.SIGKILL
    else:  # the second signal stops at once: the temporary final/ is removed, the last checkpoint named
        assert returncode == 130, output[-3000:]
        assert "(send it again to stop at once, without saving)" in output and "Traceback" not in output
        assert (f"finetune.py: stopped at once: what was in progress (a window of training, or final/) was not saved. "
                f"Checkpoints already in {output_dir} are intact; --resume auto continues from the last one "
                "(checkpoint-48)") in output, output[-3000:]
        assert not list(output_dir.glob(".tmp-final-*"))
    assert earlier_files(output_dir) == before  # checkpoints, metrics.jsonl, run.json, run_config.json: unchanged
    assert status(output_dir) == "running" and not (output_dir / "final").exists()  # not finished: resumable

    capsys.readouterr()
    assert run_in_process(argv(model_dir, data_files, output_dir, "--resume", "auto")) == 0
    assert f"resumed from {output_dir / 'checkpoint-48'} at step 48" in capsys.readouterr().out
    assert_bitwise_equal(final_weights(uninterrupted), final_weights(output_dir))
    assert status(output_dir) == "finished" and not list(output_dir.glob(".tmp-final-*"))


@pytest.mark.slow  # a subprocess, about 8 s: .ci/run runs it
def test_one_sigterm_while_final_is_written_finishes_final_first(model_dir, data_files, uninterrupted, tmp_path):
    output_dir = tmp_path / "run"
    process, log = start_paused(argv(model_dir, data_files, output_dir), tmp_path)
    before = earlier_files(output_dir)
    process.send_signal(signal.SIGTERM)
    wait_for(lambda: "SIGTERM received: writing the final outputs first" in log.read_text(), process, log,
             "the SIGTERM line")
    (tmp_path / "go").touch()
    assert process.wait(timeout=120) == 0, log.read_text(errors="replace")[-3000:]
    assert status(output_dir) == "finished"
    assert_bitwise_equal(final_weights(uninterrupted), final_weights(output_dir))
    after = earlier_files(output_dir)
    assert {name: after[name] for name in before if name != "run.json"} == \
        {name: content for name, content in before.items() if name != "run.json"}


@pytest.mark.slow  # a subprocess and a resume that trains again, about 10 s: .ci/run runs it
def test_a_kill_while_final_is_written_without_any_checkpoint_trains_again_to_the_same_weights(
        no_checkpoints, tmp_path, capsys):
    """--eval-every no and no evaluation data: no checkpoint exists, so a run killed in its final/ write once had
    lost all of its training ("finished", final/ empty, "nothing to train")."""
    flags, reference = no_checkpoints
    output_dir = tmp_path / "run"
    process, log = start_paused(flags(output_dir), tmp_path)
    assert_paused_in_final(output_dir)
    before = earlier_files(output_dir)
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert earlier_files(output_dir) == before and status(output_dir) == "running"
    capsys.readouterr()
    assert run_in_process(flags(output_dir) + ["--resume", "auto"]) == 0
    assert f"resume=auto: no checkpoint of this run in {output_dir} yet, starting from scratch" in \
        capsys.readouterr().out
    assert_bitwise_equal(reference, final_weights(output_dir))
    assert status(output_dir) == "finished"


@pytest.mark.slow  # a LoRA subprocess and a resume, about 10 s: .ci/run runs it
def test_a_kill_while_final_merged_is_written_leaves_no_final_and_resume_writes_both(model_dir, data_files, tmp_path,
                                                                                       capsys):
    output_dir = tmp_path / "run"
    flags = argv(model_dir, data_files, output_dir, "--lora", "4", "--merge-lora", "--max-steps", "4")
    process, log = start_paused(flags, tmp_path, where="merged")
    (temporary,) = output_dir.glob(".tmp-final-*")
    assert (temporary / "merged" / "model.safetensors").is_file() and not (output_dir / "final").exists()
    before = earlier_files(output_dir)
    process.kill()
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert earlier_files(output_dir) == before and status(output_dir) == "running"
    assert run_in_process(flags + ["--resume", "auto"]) == 0
    assert f"--merge-lora: merged full weights in {output_dir / 'final' / 'merged'}" in capsys.readouterr().out
    assert (output_dir / "final" / "adapter_model.safetensors").is_file()
    assert (output_dir / "final" / "merged" / "model.safetensors").is_file()
    assert status(output_dir) == "finished" and not list(output_dir.glob(".tmp-final-*"))


# ---------------------------------------------------------------------------------------------------------
# A full disk while final/ is written
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow  # a subprocess and a resume that trains again, about 10 s: .ci/run runs it
def test_a_real_write_failure_while_final_is_written_is_one_line_and_the_run_resumes(no_checkpoints, tmp_path,
                                                                                      capsys):
    """A file-size limit (RLIMIT_FSIZE) fails the weights' write exactly as a full disk does (safetensors' I/O
    error; once a raw SafetensorError traceback, with run.json "finished" and final/ partial)."""
    def limit_file_size():  # in the child: files past 40 kB cannot be written (the weights are ~90 kB)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    flags, reference = no_checkpoints
    output_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "looptrain.cli.finetune", *flags(output_dir)], cwd=ROOT,
                          env=CHILD_ENV, capture_output=True, text=True, preexec_fn=limit_file_size, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert re.search(rf"^finetune\.py: error: cannot write final in {re.escape(str(output_dir))}: no space left \(the "
                     r"disk is full, or a quota or file-size limit was reached; \w+: .+\)\. It needs about 0\.\d+ MB; "
                     r".* MB free\. Free some space and run the same command with --resume auto: no checkpoint was "
                     r"saved \(--eval-every\), so it trains this run again from the start$", done.stderr.strip()), \
        done.stderr
    assert not (output_dir / "final").exists() and not list(output_dir.glob(".tmp-final-*"))
    assert status(output_dir) == "running"
    assert run_in_process(flags(output_dir) + ["--resume", "auto"]) == 0  # the space freed
    assert_bitwise_equal(reference, final_weights(output_dir))


def test_a_full_disk_while_final_is_written_names_no_device_flag_and_the_run_resumes(files_for_disk, tmp_path, capsys,
                                                                                     monkeypatch):
    """The error of a full disk names the device ("No space left on device"): the flag hint once read it as
    `--device`. In-process, the weights' write raises what a full disk raises, after half a file."""
    flags = files_for_disk(tmp_path / "run")
    output_dir = tmp_path / "run"
    real_save = distributed.save_pretrained

    def full_disk(model, directory):
        (Path(directory) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(distributed, "save_pretrained", full_disk)
    assert run_in_process(flags) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(r"error: cannot write final in .*: no space left .*OSError: \[Errno 28\] No space left on device\)"
                     r"\. It needs about .* MB; .* MB free\. Free some space and run the same command with --resume "
                     r"auto: no checkpoint was saved", err), err
    assert "(on the command line" not in err and "--device" not in err
    assert not (output_dir / "final").exists() and not list(output_dir.glob(".tmp-final-*"))
    assert status(output_dir) == "running"
    monkeypatch.setattr(distributed, "save_pretrained", real_save)
    assert run_in_process(flags + ["--resume", "auto"]) == 0
    assert (output_dir / "final" / "model.safetensors").is_file() and status(output_dir) == "finished"


# Ctrl-C while final/ is written, in-process (real SIGINTs sent to this process)
@pytest.mark.parametrize("times", [1, 2])
def test_ctrl_c_while_final_is_written(files_for_disk, tmp_path, capsys, monkeypatch, times):
    output_dir = tmp_path / "run"
    flags = files_for_disk(output_dir)
    real_save = distributed.save_pretrained

    def save_then_interrupt(model, directory):
        real_save(model, directory)
        for _ in range(times):
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(distributed, "save_pretrained", save_then_interrupt)
    code = run_in_process(flags)
    captured = capsys.readouterr()
    assert "SIGINT received: writing the final outputs first (send it again to stop at once" in captured.out
    assert "Traceback" not in captured.err
    if times == 1:  # final/ is finished first: the run is complete
        assert code == 0 and status(output_dir) == "finished"
        assert (output_dir / "final" / "model.safetensors").is_file()
        return
    assert code == 130
    # No checkpoint exists: the message says so (it once said "Checkpoints already in DIR are intact").
    assert captured.err == (f"finetune.py: stopped at once: what was in progress was not saved, and {output_dir} holds "
                            "no checkpoint of this run yet (none is saved before the first evaluation point; "
                            "--eval-every sets them): --resume auto trains it again from the start\n")
    assert not (output_dir / "final").exists() and not list(output_dir.glob(".tmp-final-*"))
    assert status(output_dir) == "running"
    monkeypatch.setattr(distributed, "save_pretrained", real_save)
    assert run_in_process(flags + ["--resume", "auto"]) == 0  # as the message says
    assert status(output_dir) == "finished" and (output_dir / "final" / "model.safetensors").is_file()


def test_the_loops_save_final_door_runs_before_the_run_is_finished(tmp_path):
    """In Python: `Loop(save_final=...)` is called once training ends, while run.json still says "running"; an error
    there leaves the run unfinished, and `resume="auto"` continues it and calls the door again."""
    import torch

    from looptrain import Loop, LoopConfig

    seen = []

    def make(save_final):
        model = torch.nn.Linear(4, 2)

        class Classifier(Loop):
            def compute_loss(self, batch):
                return torch.nn.functional.cross_entropy(self.wrapped_model(batch[0]), batch[1])

        batches = [(torch.randn(4, 4), torch.randint(0, 2, (4,))) for _ in range(4)]
        config = LoopConfig(output_dir=str(tmp_path), eval_every=2, progress_bar=False, track_memory=False,
                            device="cpu", resume="auto")
        return Classifier(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, config=config,
                          save_final=save_final)

    def failing(summary):
        seen.append(status(tmp_path))
        raise OSError(errno.ENOSPC, "No space left on device")

    def writing(summary):
        seen.append(status(tmp_path))
        return {**summary, "final": "written"}

    with pytest.raises(OSError):
        make(failing).fit()
    assert status(tmp_path) == "running" and not (tmp_path / "summary.json").exists()
    summary = make(writing).fit()
    assert seen == ["running", "running"] and summary["final"] == "written"
    assert json.loads((tmp_path / "summary.json").read_text())["final"] == "written"
    assert status(tmp_path) == "finished"


@pytest.mark.parametrize("checkpoints", [True, False], ids=["with-checkpoints", "without"])
def test_a_run_recorded_finished_without_final_says_so_and_its_advice_writes_final(model_dir, data_files, tmp_path,
                                                                                  capsys, checkpoints):
    """A directory an earlier looptrain left when a kill cut off its final/ write: run.json "finished", no final/.
    `--resume auto` says what is missing and what to do, and the advice leads to the uninterrupted run's weights."""
    output_dir = tmp_path / "run"
    flags = (argv(model_dir, data_files, output_dir, "--max-steps", "4") if checkpoints else  # no evaluation data
             ["--model", str(model_dir), "--data", str(data_files[0]), "--output-dir", str(output_dir), *TRAINING,
              "--eval-every", "no", "--max-steps", "4"])
    assert run_in_process(flags) == 0
    reference = final_weights(output_dir)
    for path in sorted((output_dir / "final").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    (output_dir / "final").rmdir()
    before = earlier_files(output_dir)
    capsys.readouterr()
    assert run_in_process(flags + ["--resume", "auto"]) == 0
    out = capsys.readouterr().out
    assert (f"warning: the run in {output_dir} is recorded as finished but has no final/ (its write was cut off); "
            in out)
    assert earlier_files(output_dir) == before  # nothing is trained or written by being told
    advice = re.search(r"--resume (\S+) \(it trains|(--overwrite) \(which moves", out)
    assert advice is not None and bool(advice.group(1)) == checkpoints, out
    follow = ["--resume", advice.group(1)] if checkpoints else ["--overwrite"]
    assert run_in_process(flags + follow) == 0
    assert_bitwise_equal(reference, final_weights(output_dir))
    assert status(output_dir) == "finished"
