"""A run's own estimate never holds up its first update: it is computed in a child at a low priority beside the
updates (looptrain/cli/finetune/own_estimate.py), collected for the end-of-run table, and a child that fails or
never finishes leaves the run finished, the table saying the estimate is missing, and no process behind."""

from __future__ import annotations

import json
import os
import time

import pytest

from looptrain import estimation
from looptrain.cli import finetune
from looptrain.cli.finetune import own_estimate
from looptrain.estimation import worker as workers

from conftest import write_csv

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or workers.accelerator_visible(),
                                reason="forks a child: POSIX, and no accelerator visible")
PEAKS = {"peak_memory_bytes": 123 * 2**20, "training_peak_bytes": 123 * 2**20, "evaluation_peak_bytes": None}


@pytest.fixture(scope="module")
def train_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("data") / "train.csv", 24)


def fake_peaks(monkeypatch, tmp_path, behaviour: str):
    """`run_batches_peaks` replaced: nothing cached; in the child, it writes its pid and then blocks until the file
    "release" exists ("blocks"), blocks for ever ("never"), or raises ("fails")."""
    def peaks(*args, cache=True, **kwargs):
        if cache == "only":
            raise LookupError("not cached")
        (tmp_path / "child").write_text(str(os.getpid()))
        if behaviour == "fails":
            raise ValueError("no estimate here")
        for _ in range(2000):  # 20 s at most
            if behaviour == "blocks" and (tmp_path / "release").exists():
                return PEAKS
            time.sleep(0.01)
        raise TimeoutError("never released")

    monkeypatch.setattr(estimation, "run_batches_peaks", peaks)


def children() -> set[int]:
    """The pids of this process's live children (zombies too), read from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.add(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def train(model_dir, train_csv, output_dir) -> dict:
    assert finetune.main(["--model", str(model_dir), "--data", str(train_csv), "--output-dir", str(output_dir),
                          "--max-length", "16", "--batch-size", "4", "--max-steps", "3", "--no-track-memory",
                          "--no-progress-bar", "--eval-every", "no"]) == 0
    return json.loads((output_dir / "summary.json").read_text())


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_the_first_update_does_not_wait_for_the_estimate_and_the_table_shows_it(model_dir, train_csv, tmp_path,
                                                                               monkeypatch, capsys):
    fake_peaks(monkeypatch, tmp_path, "blocks")
    polls = []
    poll = own_estimate.RunEstimate.poll

    def released_after_the_first_update(self, echo, step=None):
        polls.append((step, self.worker is not None and not self.worker.ready()))  # still computing?
        (tmp_path / "release").touch()
        return poll(self, echo, step)

    monkeypatch.setattr(own_estimate.RunEstimate, "poll", released_after_the_first_update)
    summary = train(model_dir, train_csv, tmp_path / "run")
    assert polls[0] == (1, True)  # the first update ran while the child was blocked
    assert summary["estimated_peak_bytes"] == PEAKS["peak_memory_bytes"] and summary["estimate_missing"] is None
    output = capsys.readouterr().out
    assert "in a child process beside the first updates" in output
    assert "estimated peak of live tensors: 123.0 MiB" in output
    assert "| estimated peak (worst batch) | 123.0 MiB" in output
    assert int((tmp_path / "child").read_text()) not in children()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_an_estimate_that_never_comes_ends_with_the_run_and_the_table_says_so(model_dir, train_csv, tmp_path,
                                                                             monkeypatch, capsys):
    fake_peaks(monkeypatch, tmp_path, "never")
    monkeypatch.setenv("LOOPTRAIN_ESTIMATE_WAIT", "0.2")  # the suite's own waits for every estimate
    summary = train(model_dir, train_csv, tmp_path / "run")
    assert summary["estimated_peak_bytes"] is None
    assert summary["estimate_missing"].startswith("still computing after ")
    output = capsys.readouterr().out
    assert "notice: no memory estimate for this run (still computing after " in output
    assert "| estimated peak (worst batch) | missing (still computing after " in output
    pid = int((tmp_path / "child").read_text())
    assert pid not in children() and not os.path.exists(f"/proc/{pid}")  # killed and reaped


def test_a_failing_estimate_is_a_notice_and_leaves_no_child(tmp_path, capsys):
    def fail(_):
        (tmp_path / "child").write_text(str(os.getpid()))
        raise ValueError("no estimate here")

    def not_cached():
        raise LookupError

    estimate = own_estimate.start_estimate(fail, not_cached, describe=str)
    assert estimate.worker is not None
    assert estimate.collect(run_seconds=1.0) is None
    assert estimate.missing == "ValueError: no estimate here" and estimate.worker is None
    assert "notice: no memory estimate for this run (ValueError: no estimate here)" in capsys.readouterr().out
    assert not os.path.exists(f"/proc/{int((tmp_path / 'child').read_text())}")


def test_the_child_runs_at_a_lower_priority_and_a_cached_estimate_needs_none(capsys):
    def not_cached():
        raise LookupError

    estimate = own_estimate.start_estimate(lambda _: {"nice": os.nice(0)}, not_cached, describe=str)
    assert estimate.collect(run_seconds=1.0) == {"nice": min(19, os.nice(0) + own_estimate.ESTIMATE_NICE)}
    cached = own_estimate.start_estimate(lambda _: pytest.fail("computed"), lambda: PEAKS, describe=str)
    assert cached.worker is None and cached.result == PEAKS
    assert capsys.readouterr().out.splitlines()[-1] == str(PEAKS)  # said at once, before any update


def test_a_run_waits_for_its_estimate_at_most_max_2_s_and_2_percent(monkeypatch):
    monkeypatch.delenv("LOOPTRAIN_ESTIMATE_WAIT", raising=False)
    assert own_estimate.wait_allowance(10.0) == 2.0
    assert own_estimate.wait_allowance(500.0) == pytest.approx(10.0)
