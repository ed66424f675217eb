"""EstimateWorker: estimates in a forked child, so the training process's RSS never holds what estimating costs."""

from __future__ import annotations

import os
import time

import pytest

from looptrain.estimation import estimate
from looptrain.estimation import worker as workers
from looptrain.estimation.worker import EstimateWorker
from looptrain.memory.meters import proc_status_bytes, reset_peak_rss

from conftest import make_tiny_bert

# Where an accelerator is visible the worker never forks (autograd's device threads): those tests have no child.
forks = pytest.mark.skipif(not hasattr(os, "fork") or workers.accelerator_visible(),
                           reason="forks a child: POSIX, and no accelerator visible")


@forks
def test_an_estimate_in_the_child_equals_one_in_this_process():
    model = make_tiny_bert(num_labels=2)
    here = estimate(model, 4, 16, accum_steps=2, cache=False)
    parent = os.getpid()
    with EstimateWorker(lambda request: (os.getpid(), estimate(model, *request, accum_steps=2, cache=False))) as worker:
        pid, there = worker((4, 16))
    assert pid != parent
    assert there["peak_memory_bytes"] == here["peak_memory_bytes"]
    assert there["memory_breakdown"] == here["memory_breakdown"]


@forks
def test_what_the_child_allocates_is_not_this_process_s_rss():
    reset_peak_rss()
    before = proc_status_bytes("VmHWM")

    def allocate(size):
        block = bytearray(size)  # written: resident in the child
        return len(block)

    with EstimateWorker(allocate) as worker:
        assert worker(200 * 2**20) == 200 * 2**20
    assert proc_status_bytes("VmHWM") - before < 50 * 2**20


@forks
def test_an_error_in_the_child_is_raised_here_with_its_type_and_words():
    def fail(request):
        raise ValueError(f"no estimate for {request}")

    with EstimateWorker(fail) as worker, pytest.raises(ValueError, match="no estimate for 7"):
        worker(7)


@forks
def test_a_child_that_hangs_is_killed_and_the_request_runs_here(monkeypatch):
    parent = os.getpid()

    def serve(request):
        if os.getpid() != parent:
            time.sleep(60)  # the child hangs
        return request * 2

    monkeypatch.setenv("LOOPTRAIN_ESTIMATE_TIMEOUT", "0.5")
    with EstimateWorker(serve) as worker:
        assert worker.pid is not None
        assert worker(21) == 42
        assert worker.pid is None  # killed and reaped


def test_in_process_when_asked(monkeypatch):
    monkeypatch.setenv("LOOPTRAIN_ESTIMATE_IN_PROCESS", "1")
    with EstimateWorker(lambda request: os.getpid()) as worker:
        assert worker.pid is None and worker(None) == os.getpid()


def test_in_process_where_an_accelerator_is_visible(monkeypatch):
    """With a GPU visible, a child forked after the process's first backward fails its own backward (autograd's
    device threads): the worker answers here, and the estimate is the same."""
    model = make_tiny_bert(num_labels=2)
    here = estimate(model, 4, 16, accum_steps=2, cache=False)
    monkeypatch.setattr(workers, "accelerator_visible", lambda: True)
    with EstimateWorker(lambda request: (os.getpid(), estimate(model, *request, accum_steps=2, cache=False))) as worker:
        assert worker.pid is None
        pid, there = worker((4, 16))
    assert pid == os.getpid()
    assert there["peak_memory_bytes"] == here["peak_memory_bytes"]


@forks
def test_two_workers_answer_side_by_side_and_close_in_any_order(monkeypatch, tmp_path):
    """The planner estimates two splits at once on two workers: each child answers its own request while the other
    works (each waits to see the other start), and the first worker closes while the second still runs (the second
    child holds none of its pipe ends, which would keep the first child from reading end-of-file and closing it from
    returning)."""
    monkeypatch.setenv("LOOPTRAIN_ESTIMATE_TIMEOUT", "60")

    def serve(request):
        (tmp_path / str(request)).touch()
        other = tmp_path / str(3 - request)
        for _ in range(400):  # up to 20 s: the other child starts while this one waits, or never (one at a time)
            if other.exists():
                break
            time.sleep(0.05)
        return os.getpid(), request * 2, other.exists()

    first, second = EstimateWorker(serve), EstimateWorker(serve)
    try:
        first.submit(1)
        second.submit(2)
        (pid_one, one, saw_two), (pid_two, two, saw_one) = first.collect(), second.collect()
        assert (one, two) == (2, 4) and len({pid_one, pid_two, os.getpid()}) == 3
        assert saw_two and saw_one  # side by side
        first.close()
        assert first.pid is None and second(2)[1] == 4
    finally:
        first.close()
        second.close()
