"""The estimate book: every estimate a plan asks for, at the worst batch, memoised, made in forked workers, timed.

`EstimateBook` owns the memo (`peak`, `predict`: most splits' peaks predicted from two estimates of the same settings),
the workers that estimate side by side (`start_workers`, `close`) and planning's time spent on estimates (`limit_time`,
`spent`): once that time is spent only cached estimates are read, and a split not estimated yet raises
`SearchTimeSpent`. It knows nothing of the budget: `search.Search` decides what fits.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from looptrain.estimation.estimator import estimate
from looptrain.estimation.worker import EstimateWorker
from looptrain.lora import is_4bit_layer, is_lora_model
from looptrain.planning.plans import format_bytes, lora_words
from looptrain.planning.truncation import Truncation, truncation_for
from looptrain.strategy import Strategy

FULL_FINE_TUNE = "full fine-tune"  # `EstimateBook.peak(model=...)`: the book's LoRA model without its adapters


class SearchTimeSpent(Exception):
    """The plan's time for estimates is spent: a split not estimated yet counts as not fitting."""


def estimate_workers() -> int:
    """How many estimates run side by side: one per core this process may use, up to two (an estimate is one
    thread of Python; the search rarely has more than two it is sure to need)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(2, cores))


def full_fine_tune_model(model: Any) -> Any:
    """What `estimate` prices as the full fine-tune of a LoRA model: the model without its adapters.

    A config, a preset or a model that is not a `PeftModel` is returned as it is. A `PeftModel`: a copy with
    its adapters unloaded and every parameter trainable, sharing the original's tensors (no memory; the
    original is unchanged). A QLoRA model (4-bit base): its transformers config (the unquantized model), or
    None when it has none.
    """
    if not is_lora_model(model):
        return model
    if any(is_4bit_layer(module) for module in model.modules()):
        config = getattr(model, "config", None)
        return config if hasattr(config, "to_dict") else None
    memo: dict[int, Any] = {id(buffer): buffer for buffer in model.buffers()}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(parameter.detach(), requires_grad=True)
    return copy.deepcopy(model, memo).unload()


class EstimateBook:
    """Estimates at the worst batch (`width` tokens wide), memoised by what the estimator prices, and the time they
    took.

    Args:
        model: what `estimate` takes (a module, a config, a preset name).
        width: the worst batch's width, where every estimate is made unless asked for another.
        max_grad_norm, num_labels: as in `estimate`.
        echo: prints one line per estimate.
        device_type: whose kernels the estimates price (`estimate(device=)`): the run's device.
        padded: the worst batch of more than one row holds shorter, padded rows (see `estimate`).
        workers: stand-ins for `EstimateWorker`s (``submit``, ``collect``, ``close``); `start_workers` starts real
            ones.
        extrapolate: as in `estimate` (False: every estimate runs the whole model).
    """

    def __init__(self, model: Any, width: int, *, max_grad_norm: float | None = 1.0, num_labels: int = 2,
                 echo: Callable[[str], None] = lambda line: None, device_type: str = "cpu", padded: bool = False,
                 workers: Sequence[Any] = (), extrapolate: bool = True, packed_width: int | None = None,
                 counts_scratch: bool = False):
        self.model, self.width, self.max_grad_norm, self.num_labels = model, width, max_grad_norm, num_labels
        self.packed_width = packed_width or width  # the widest packed row, where batches may be packed
        self.extrapolate = extrapolate
        # Under a budget of RSS a peak includes what matmul kernels hold inside (`kernel_scratch_bytes`: no tensor).
        self.counts_scratch = counts_scratch
        self.echo, self.device_type, self.padded = echo, device_type, padded
        self.workers: list = list(workers)
        self.cache: dict = {}  # key -> the estimate's peak bytes
        self.results: dict = {}  # the whole estimate (breakdown, phase), by the same key
        self.count = 0
        self.cached = 0  # of `count`, the estimates read from the on-disk cache (looptrain.estimation.cache)
        self.seconds = 0.0
        # The estimates as `limit` counts them: each at what computing it cost (a cached one at its recorded cost), so
        # that a rerun reading them from the cache stops where the first run stopped, in a fraction of the time.
        self.charged = 0.0
        self.limit: float | None = None  # seconds the estimates may take; then only cached ones are read
        self.round_seconds = 0.0  # the longest round of estimates so far, as charged: what `spent` expects of the next
        self.skipped = 0  # estimates not made because `limit` was spent
        self.predicted: set = set()  # keys of the splits a prediction decided (`note_predicted`), not estimated
        self.full_model: Any = None  # `FULL_FINE_TUNE`'s model, made once where the estimates run

    def start_workers(self) -> EstimateBook:
        """Starts `estimate_workers()` forked children that estimate (`EstimateWorker`), so that this process never
        holds what estimating costs (torch's fake-tensor machinery); `close` ends them. Returns the book."""
        for _ in range(estimate_workers()):
            self.workers.append(EstimateWorker(self.estimate_here))
        return self

    def close(self) -> None:
        """Ends the workers."""
        for worker in self.workers:
            worker.close()

    def __enter__(self) -> EstimateBook:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def limit_time(self, seconds: float | None) -> None:
        """Planning's time for estimates, as `charged` counts it (None: no limit)."""
        self.limit = seconds

    def spent(self) -> bool:
        """Whether planning's time (`limit`) has no room for another round as long as the longest so far: then only
        cached estimates are read (a round is not started that would end past the limit)."""
        return self.limit is not None and self.charged + self.round_seconds > self.limit

    def priced(self, settings: Strategy) -> Strategy:
        """The settings whose estimate is that of `settings`: with `micro_batch_tokens`, the split whose memory bounds
        theirs (its micro-batch at the worst width: what `by_tokens` made them from); `trim_heap` off (the C heap
        holds no tensor)."""
        settings = dataclasses.replace(settings, trim_heap=False)
        if not settings.micro_batch_tokens:
            return settings
        rows = max(1, min(settings.batch_size, settings.micro_batch_tokens // self.width_of(settings)))
        return dataclasses.replace(settings, batch_size=rows, micro_batch_tokens=0,
                                   accum_steps=math.ceil(settings.batch_size / rows) * settings.accum_steps)

    def key(self, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> tuple:
        """What the estimator prices of `settings` at `seq_len` (default: the worst batch's width)."""
        settings = self.priced(settings)
        priced = {**settings.estimate_options(), "accum_steps": min(settings.accum_steps, 2),  # memory repeats after 2
                  "packs": settings.packs}
        key = settings.batch_size, seq_len or self.width_of(settings), type(settings), tuple(sorted(priced.items()))
        return key if model is None else (*key, model)

    def width_of(self, settings: Strategy) -> int:
        """The worst batch's width for `settings`: the widest packed row where they pack each batch's samples."""
        return self.packed_width if settings.batch_packing == "on" else self.width

    def memoised(self, settings: Strategy) -> bool:
        """Whether `settings` were estimated (not only predicted)."""
        return self.key(settings) in self.cache

    def peak(self, settings: Strategy, seq_len: int | None = None, model: str | None = None) -> int:
        """The estimate of `settings` at the worst batch (or `seq_len` wide), memoised by what the estimator prices.

        `model`: None (the book's model) or `FULL_FINE_TUNE` (a LoRA model without its adapters). With workers, the
        estimate runs in a child process.
        """
        request = self._request(settings, seq_len, model)
        if request[-1] not in self.cache:
            self._estimate([request], demanded=True)
        return self.cache[request[-1]]

    def prefetch(self, settings_list: Sequence[Strategy]) -> None:
        """Estimates those of `settings_list` not memoised yet side by side, one per worker, so that `peak` finds them.
        Best effort: nothing with one worker, for fewer than two estimates, or once the time is spent. A round is
        charged as its longest estimate: the search's decisions do not depend on how many ran beside each other,
        and a rerun on the cache takes the same."""
        if len(self.workers) < 2 or self.spent():
            return
        wanted = {}
        for settings in settings_list:
            request = self._request(settings, None, None)
            if request[-1] not in self.cache:
                wanted.setdefault(request[-1], request)
        if len(wanted) > 1:
            self._estimate(list(wanted.values())[:len(self.workers)], demanded=False)

    def prefetch_all(self, settings_list: Sequence[Strategy]) -> None:
        """`prefetch` of all of `settings_list` not memoised yet, a round (one per worker) at a time."""
        wanted: dict[tuple, Strategy] = {}
        for settings in settings_list:
            key = self.key(settings)
            if key not in self.cache:
                wanted.setdefault(key, settings)
        pending = list(wanted.values())
        for start in range(0, len(pending), max(1, len(self.workers))):
            self.prefetch(pending[start:start + len(self.workers)])

    def _request(self, settings: Strategy, seq_len: int | None, model: str | None) -> tuple:
        seq_len = seq_len or self.width_of(settings)
        settings = self.priced(settings)
        return settings, seq_len, model, self.key(settings, seq_len, model)

    def _estimate(self, requests: list[tuple], demanded: bool) -> None:
        """One round: each request on its own worker (here without any), their results memoised."""
        started = time.perf_counter()
        spent = self.spent()  # then only cached estimates are read
        workers = self.workers or [None] * len(requests)
        for (settings, seq_len, model, _), worker in zip(requests, workers):
            if worker is not None:
                worker.submit((settings, seq_len, model, spent))
        answers = []
        for request, worker in zip(requests, workers):  # every answer is read, so that no worker is left behind
            settings, seq_len, model, _ = request
            try:
                answers.append(worker.collect() if worker is not None
                               else self.estimate_here((settings, seq_len, model, spent)))
            except Exception as error:  # noqa: BLE001  raised below for what was asked, once every answer is in
                answers.append(error)
        elapsed = time.perf_counter() - started
        self.seconds += elapsed
        failed = next((answer for answer in answers if isinstance(answer, Exception)
                       and not isinstance(answer, LookupError)), None)
        if demanded and failed is not None:
            raise failed  # a prefetch's failure is not memoised: `peak` meets it again if the search asks
        results = [answer for answer in answers if not isinstance(answer, Exception)]
        # A cached estimate counts at what computing it cost; a round of side-by-side estimates, at its longest.
        cost = max((result.get("compute_seconds", elapsed) for result in results), default=0.0)
        self.charged += cost
        self.round_seconds = max(self.round_seconds, cost)
        for (settings, seq_len, _, key), result in zip(requests, answers):
            if not isinstance(result, Exception):
                self._record(settings, seq_len, key, result)
        if demanded and len(results) < len(requests):
            self.skipped += 1
            raise SearchTimeSpent

    def _record(self, settings: Strategy, seq_len: int, key: tuple, result: dict) -> None:
        """One estimate memoised, and echoed."""
        self.count += 1
        self.cached += bool(result.get("from_cache"))
        self.cache[key] = result["peak_memory_bytes"] + (result.get("kernel_scratch_bytes") or 0
                                                         if self.counts_scratch else 0)
        self.results[key] = result
        self.echo(f"  estimate {settings.batch_size} x {settings.accum_steps}, {settings.precision}"
                  f"{', bf16 weights' if settings.weights == 'bf16' else ''}, "
                  f"{settings.optimizer}, checkpointing {settings.checkpointing}"
                  f"{', fused step' if settings.optimizer_in_backward else ''}"
                  f"{', ' + lora_words(settings) if settings.lora_rank else ''}"
                  f"{', batches packed' if settings.batch_packing == 'on' else ''}"
                  f"{f', seq {seq_len}' if seq_len != self.width else ''}: {format_bytes(self.cache[key])}"
                  f"{' (from the cache)' if result.get('from_cache') else ''}")

    def estimate_here(self, request: tuple) -> dict:
        """`estimate` of a `peak` request in this process (the worker's child calls it too)."""
        settings, seq_len, model, cached_only = request
        if model == FULL_FINE_TUNE:
            if self.full_model is None:
                self.full_model = full_fine_tune_model(self.model)
            model = self.full_model
        return estimate(self.model if model is None else model, settings.batch_size, seq_len, settings,
                        num_labels=self.num_labels, max_grad_norm=self.max_grad_norm, padded=self.padded,
                        cache="only" if cached_only else True, device=self.device_type, extrapolate=self.extrapolate)

    def predict(self, settings: Strategy) -> int | None:
        """The estimate of `settings` (memoised), else their peak predicted from two estimates of the same settings at
        other micro-batches, else None.

        For fixed settings at one width, the peak of each phase of the update (forward, backward, the optimizer
        step: `phase_peak_bytes`) is affine in the micro-batch's rows: activations and temporaries grow with them,
        weights, gradients and optimizer state do not (docs/plan.md, 'Most steps of the search are predicted').
        Each phase is read off the line through the two nearest estimates (those on either side when there are),
        and the prediction is the largest. Where the worst batch of several rows is padded, one row is not (nothing
        to pad): it is neither a point nor predicted.
        """
        key = self.key(settings)
        if key in self.cache:
            return self.cache[key]
        rows, points = key[0], self.family_estimates(settings)
        if rows < (2 if self.padded else 1) or len(points) < 2:
            return None
        below = [point for point in points if point[0] < rows]
        above = [point for point in points if point[0] > rows]
        (low, first), (high, second) = (below[-1], above[0]) if below and above else \
            (below[-2], below[-1]) if len(below) >= 2 else (above[0], above[1])

        def phases(result: dict) -> dict:
            return result.get("phase_peak_bytes") or {"peak": result["peak_memory_bytes"]}

        ends = phases(first), phases(second)
        return int(max(ends[0][phase] + (ends[1][phase] - ends[0][phase]) * (rows - low) / (high - low)
                       for phase in ends[0] if phase in ends[1]))

    def truncation(self, settings: Strategy) -> Truncation | None:
        """How a probe of `settings` runs the model: on a truncated stack of its blocks, scaled
        (`truncation.truncation_for`), from their estimate, or where a prediction decided them, from the two nearest
        estimates of the same settings (the difference between the whole and the truncated stack is affine in the
        rows, as each is). None: the whole model."""
        result = self.results.get(self.key(settings))
        if result is not None:
            return truncation_for(self.model, result)
        points = [(rows, point) for rows, point in self.family_estimates(settings) if point.get("depth_peak_bytes")]
        if len(points) < 2:
            return None
        rows = self.key(settings)[0]
        (low, first), (high, second) = sorted(points, key=lambda point: (abs(point[0] - rows), point[0]))[:2]
        plan = truncation_for(self.model, first)
        if plan is None or str(plan.depth) not in second["depth_peak_bytes"]:
            return None

        def shift(point: dict) -> int:
            return point["peak_memory_bytes"] - point["depth_peak_bytes"][str(plan.depth)]
        predicted = shift(first) + (shift(second) - shift(first)) * (rows - low) / (high - low)
        return truncation_for(self.model, first, predicted_shift=int(predicted))

    def note_predicted(self, settings: Strategy) -> None:
        """Records that a prediction, not an estimate, decided `settings` (`Plan.predictions` counts them)."""
        self.predicted.add(self.key(settings))

    def predictions(self) -> int:
        """How many splits a prediction decided and no estimate made later."""
        return len(self.predicted - self.cache.keys())

    def family_estimates(self, settings: Strategy) -> list[tuple[int, dict]]:
        """The estimates of `settings` at other micro-batches that lie on one line, ``(rows, result)`` by rows: at two
        rows or more where the worst batch is padded (one row is not)."""
        key, smallest = self.key(settings), 2 if self.padded else 1
        return sorted(((other[0], result) for other, result in self.results.items()
                       if other[1:] == key[1:] and other[0] >= smallest), key=lambda point: point[0])

    def known(self, settings: Strategy) -> bool:
        """Whether the book can answer for `settings` without an estimate (memoised or predicted)."""
        return self.predict(settings) is not None

    def step_bytes(self, settings: Strategy) -> int:
        """What the optimizer step of `settings` allocates beyond the weights and gradients alive before it: its
        estimate's optimizer phase less them (the optimizer state it creates and the step's temporaries; the same at
        every micro-batch, so any estimate of the same settings tells), or 0 without one or with the fused step.

        Inside a step nothing can stop a probe (`probes._Ceiling`), so a probe stops before a step this large would
        pass its ceiling (docs/plan.md, 'Nor does its optimizer step').
        """
        if settings.optimizer_in_backward:
            return 0
        key = self.key(settings)
        result = self.results.get(key) or next((result for _, result in self.family_estimates(settings)), None)
        if result is None or "optimizer" not in (result.get("phase_peak_bytes") or {}):
            return 0
        parts = result["memory_breakdown"]
        alive = parts["params"] + parts["grads"] + result.get("cublas_workspace_bytes", 0)
        return max(0, result["phase_peak_bytes"]["optimizer"] - alive)
