"""Estimates in a child process, so the training process never holds what estimating costs.

An estimate runs the Loop's update on fake tensors: that imports and warms torch's fake-tensor machinery
(sympy, torch.fx, dynamo's utilities) and leaves its caches behind: RSS that the process would keep for the
whole run although no tensor of the run needs it (docs/plan.md, 'How "fits" is decided', has the measurement).
A budget of process RSS (`plan(meter="rss")`, the command line's default on a CPU) would pay it. `EstimateWorker`
forks this process once (POSIX) and answers requests in the child, which inherits the model and everything else
copy-on-write, so nothing is pickled but the requests and the answers; the child exits when the worker
is closed (or when this process ends: it reads end-of-file). The child's own memory is short-lived and
exists while this process holds only the weights, before training allocates anything.

Requests run in this process instead where `os.fork` does not exist, under torch.distributed (a process with
a process group's threads is not safe to fork), where an accelerator (CUDA, MPS, ...) is visible, or with
``LOOPTRAIN_ESTIMATE_IN_PROCESS=1``. With a GPU visible, the first backward of the process (even one on the CPU)
starts autograd's device threads, and a child forked after it fails its first backward ("Unable to handle autograd's
threading in combination with fork-based multiprocessing"); the caches an estimate leaves are host memory, which a
GPU run's budget (the allocator's reserved bytes) does not count. A child that does
not answer within ``LOOPTRAIN_ESTIMATE_TIMEOUT`` seconds (default 600) is killed and the request runs here.

A child never outlives this process: on Linux the kernel kills it when this process ends, however it ends
(``PR_SET_PDEATHSIG``); elsewhere it reads end-of-file and leaves once its request is answered. ``nice``: the child
lowers its own priority by that much (`os.nice`), so that an estimate computed beside training takes the CPU time
training leaves idle first (`looptrain.cli.finetune.own_estimate`).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import sys
from collections.abc import Callable
from typing import Any


class EstimateWorker:
    """Calls ``serve(request)`` in a forked child (or here) and returns its answer; errors are raised here.

    Use as a context manager, or call `close`.
    """

    def __init__(self, serve: Callable[[Any], Any], *, nice: int = 0):
        self.serve, self.pid = serve, None
        self._pending: Any = None  # the request `submit` sent, until `collect`
        self._requests = self._answers = None
        if not _can_fork():
            return
        request_read, request_write = os.pipe()
        answer_read, answer_write = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: answer until end-of-file, then leave without running any exit handler
            code = 0
            try:
                _die_with(parent, nice)
                os.close(request_write)
                os.close(answer_read)
                for descriptor in _PARENT_ENDS:  # other workers' ends: held here, their children would never end
                    _close_quietly(descriptor)
                _serve_forever(serve, os.fdopen(request_read, "rb"), os.fdopen(answer_write, "wb"))
            except BaseException:  # noqa: BLE001  the parent sees end-of-file and says so
                code = 1
            finally:
                os._exit(code)
        os.close(request_read)
        os.close(answer_write)
        _PARENT_ENDS.update((request_write, answer_read))
        self.pid, self._ends = pid, (request_write, answer_read)
        self._requests, self._answers = os.fdopen(request_write, "wb"), os.fdopen(answer_read, "rb")

    def __call__(self, request: Any) -> Any:
        self.submit(request)
        return self.collect()

    def submit(self, request: Any, *, last: bool = False) -> None:
        """Sends `request` to the child, which starts on it at once; `collect` returns its answer. One at a time.
        `last`: no request follows, so the child leaves as soon as it has answered (its answer waits in the pipe)."""
        self._pending = request
        if self.pid is not None:
            pickle.dump(request, self._requests)
            self._requests.flush()
            if last:
                _PARENT_ENDS.discard(self._ends[0])  # the number may be reused: a later child must not close it
                self._requests.close()

    def ready(self, timeout: float = 0.0) -> bool:
        """Whether `collect` would return without waiting (an answer or the child's end is there), after waiting
        up to `timeout` seconds for it; True where there is no child (`collect` computes the answer here)."""
        return self.pid is None or bool(select.select([self._answers], [], [], timeout)[0])

    def kill(self) -> None:
        """Ends the child at once, whatever it is doing, and reaps it (its answer, if any, is dropped)."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.close()

    def collect(self) -> Any:
        """The answer to the request `submit` sent (computed here when there is no child); its error is raised here."""
        request, self._pending = self._pending, None
        if self.pid is None:
            return self.serve(request)
        timeout = float(os.environ.get("LOOPTRAIN_ESTIMATE_TIMEOUT", "600"))
        if not select.select([self._answers], [], [], timeout)[0]:  # a child that hangs: never the run
            os.kill(self.pid, signal.SIGKILL)
            self.close()
            return self.serve(request)
        try:
            status, answer = pickle.load(self._answers)
        except EOFError:
            self.close()
            raise RuntimeError("the estimate's child process ended without an answer (killed, or out of memory); "
                               "set LOOPTRAIN_ESTIMATE_IN_PROCESS=1 to estimate in this process") from None
        if status == "error":
            raise answer
        return answer

    def close(self) -> None:
        if self.pid is None:
            return
        _PARENT_ENDS.difference_update(self._ends)
        for stream in (self._requests, self._answers):
            try:
                stream.close()
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.pid = None

    def __enter__(self) -> EstimateWorker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# The pipe ends this process holds for its live workers' children. A child forked later closes them: a copy held
# open there would keep an earlier child from reading end-of-file, and closing that worker would wait forever.
_PARENT_ENDS: set[int] = set()


def _close_quietly(descriptor: int) -> None:
    try:
        os.close(descriptor)
    except OSError:
        pass


def _die_with(parent: int, nice: int) -> None:
    """In a child: asks the kernel to kill it when `parent` ends (Linux; strictly, when the thread that forked it
    ends: a worker is made on a thread that lives as long as it needs the worker), leaves if `parent` has ended
    already, and lowers its priority by `nice`."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the child leaves at end-of-file
        pass
    if os.getppid() != parent:
        os._exit(1)
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass


def _can_fork() -> bool:
    if not hasattr(os, "fork") or os.environ.get("LOOPTRAIN_ESTIMATE_IN_PROCESS", "") not in ("", "0"):
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun: its agent's and the group's threads
        return False
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return not accelerator_visible()


def accelerator_visible() -> bool:
    """Whether torch sees an accelerator (CUDA, MPS, XPU, ...): then autograd's device threads, started by the
    process's first backward, make a forked child's backward fail."""
    import torch

    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        return bool(accelerator.is_available())
    return bool(torch.cuda.is_available())


def _serve_forever(serve: Callable[[Any], Any], requests, answers) -> None:
    import torch

    torch.set_num_threads(1)  # fake tensors compute nothing; a forked OpenMP pool is not this child's to use
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            answer = ("ok", serve(request))
        except Exception as error:  # noqa: BLE001  raised again in the parent
            answer = ("error", error)
        try:
            payload = pickle.dumps(answer)
        except Exception:  # noqa: BLE001  an error that does not pickle: its words do
            payload = pickle.dumps(("error", RuntimeError(f"{type(answer[1]).__name__}: {answer[1]}")))
        answers.write(payload)
        answers.flush()
