"""Probes of a deep model on a truncated stack of its identical blocks, scaled to the whole stack.

A probe of a model of N identical blocks need not run all N: the blocks' share of each micro-batch grows by one
block's time per block, and the rest (the embedding, the head and its loss, the optimizer's Python) does not move.
So the probe runs the model cut to `depth` of its blocks in place (`truncated`: the same weights, the other blocks
set aside and put back), times the blocks' share of each micro-batch (`BlockClock`: forward from the first block's
input to the last block's output, backward from the gradient of the last block's output to the gradient of the first
block's input, recompute included), and scales (`scaled_seconds`): each micro-batch's seconds plus ``N / depth - 1``
times its blocks' seconds, the optimizer step by the trainable parameters' count. Its measured peak moves by what
the estimator priced between the truncated and the whole stack (`Truncation.shift_bytes`) less what the process
holds of the blocks set aside while it runs (`hold_set_aside`: their weights, read in first), and its ceiling by
the same, so the verdict is the whole model's (docs/plan.md, 'What planning costs').
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from looptrain.freeze import find_transformer_blocks

# A model of fewer blocks is probed whole: the head and the embedding dominate a shallow stack's time, and the
# estimator prices no truncated stack of it (`looptrain.estimation.blocks.FEWEST_BLOCKS`).
FEWEST_BLOCKS = 16
PAGE_BYTES = 4096  # the smallest page a CPU maps: reading a byte every this many reads in every page


@dataclass(frozen=True)
class Truncation:
    """A probe run on `depth` of the model's `blocks` identical blocks; `shift_bytes`: the estimate of the whole stack
    less that of `depth` blocks (same settings, same batch), added to the measured peak and taken off the ceiling."""

    depth: int
    blocks: int
    shift_bytes: int = 0

    @property
    def scale(self) -> float:
        """The blocks' seconds of the whole stack per second of the truncated one's."""
        return self.blocks / self.depth

    def words(self) -> str:
        return f"{self.depth} of its {self.blocks} blocks"


def truncation_for(model: nn.Module, estimate: dict | None, predicted_shift: int | None = None) -> Truncation | None:
    """How to probe `model` at settings whose estimate is `estimate` (None: not estimated, `predicted_shift` from
    estimates of other splits): on the middle of the truncated depths the estimator priced (its
    ``depth_peak_bytes``), where the model stacks at least `FEWEST_BLOCKS` identical blocks, every parameter trains
    (the first block's input then carries a gradient, which times the blocks' backward) and the estimate was
    extrapolated. None: probe the whole model."""
    if not isinstance(model, nn.Module) or not all(p.requires_grad for p in model.parameters()):
        return None
    try:
        blocks = len(find_transformer_blocks(model))
    except ValueError:
        return None
    if blocks < FEWEST_BLOCKS:
        return None
    if estimate is None or not estimate.get("depth_peak_bytes"):
        return None
    depths = sorted(estimate["depth_peak_bytes"], key=int)
    depth = depths[len(depths) // 2]
    shift = estimate["peak_memory_bytes"] - estimate["depth_peak_bytes"][depth] if predicted_shift is None \
        else predicted_shift
    return Truncation(int(depth), blocks, max(0, int(shift)))


@contextmanager
def truncated(model: nn.Module, depth: int) -> Iterator[nn.ModuleList]:
    """`model` with its block list cut to its first `depth` blocks, in place (the same module list, the same weights);
    the others are put back, in order, on exit."""
    blocks = find_transformer_blocks(model)
    removed = list(blocks)[depth:]
    del blocks[depth:]
    try:
        yield blocks
    finally:
        blocks.extend(removed)


def hold_set_aside(model: nn.Module, depth: int) -> int:
    """The bytes of the tensors (parameters and buffers, each once) of `model`'s blocks past the first `depth`, each
    of their pages read first, so that the process holds them while a truncated probe runs.

    A measured meter counts the weights a probe's process holds, and the estimate of the whole stack less the
    truncated one (`Truncation.shift_bytes`) prices the set-aside blocks' weights too: the probe's shift is that less
    these bytes. Read in, they are held whatever touched them before (a model loaded from a memory-mapped file holds
    a page only once it is read: the packing lever's check reads every weight, a plan without it none), so the
    verdict does not depend on it; the run reads them all anyway."""
    seen, total = set(), 0
    with torch.no_grad():
        for block in list(find_transformer_blocks(model))[depth:]:
            for tensor in [*block.parameters(), *block.buffers()]:
                if (tensor.data_ptr(), tensor.numel()) in seen or tensor.numel() == 0:
                    continue
                seen.add((tensor.data_ptr(), tensor.numel()))
                total += tensor.numel() * tensor.element_size()
                if tensor.device.type == "cpu":  # one byte of each page read: the page is mapped in
                    flat = tensor.detach()
                    (flat.reshape(-1).view(torch.uint8)[::PAGE_BYTES] if flat.is_contiguous() else flat).sum()
    return total


def _first_tensor(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


class BlockClock:
    """The blocks' seconds of each micro-batch (`intervals`: their forward and their backward, as (start, end)).

    Forward: from the first block's forward to the last block's output, while no backward runs (a checkpointed block's
    recompute calls its forward again). Backward: from the gradient of the last block's output (the head's backward
    done) to the gradient of the first block's input (every block's backward done)."""

    def __init__(self, blocks: nn.ModuleList):
        self.intervals: list[tuple[float, float]] = []
        self.started: float | None = None
        self.backward_from: float | None = None
        self.hooks = [blocks[0].register_forward_pre_hook(self._first, with_kwargs=True),
                      blocks[-1].register_forward_hook(self._last)]

    def _first(self, module, args, kwargs) -> None:
        if self.backward_from is not None:
            return  # a recompute
        self.started = time.perf_counter()
        hidden = _first_tensor(args) if args else _first_tensor(kwargs.get("hidden_states"))
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(self._backward_done)

    def _last(self, module, args, output) -> None:
        if self.backward_from is not None or self.started is None:
            return
        self.intervals.append((self.started, time.perf_counter()))
        self.started = None
        hidden = _first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(self._backward_starts)

    def _backward_starts(self, grad):
        self.backward_from = time.perf_counter()

    def _backward_done(self, grad):
        if self.backward_from is not None:
            self.intervals.append((self.backward_from, time.perf_counter()))
            self.backward_from = None

    def seconds_within(self, start: float, end: float) -> float:
        """The blocks' seconds of the intervals that started in [start, end)."""
        return sum(stop - begin for begin, stop in self.intervals if start <= begin < end)

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def scaled_seconds(micro_seconds: list[float], starts: list[float], clock: BlockClock,
                   truncation: Truncation) -> list[float]:
    """Each micro-batch's seconds (starting at `starts`) as the whole stack would take them: plus
    ``N / depth - 1`` times the blocks' seconds the clock measured in it."""
    return seconds_plus(micro_seconds, starts,
                        lambda start, end: (truncation.scale - 1) * clock.seconds_within(start, end))


def seconds_plus(micro_seconds: list[float], starts: list[float], within) -> list[float]:
    """Each micro-batch's seconds (starting at `starts`; the last runs to the update's end) plus ``within(start,
    end)``, the seconds a clock adds to what started in that span."""
    bounds = [*starts[1:], float("inf")]
    return [seconds + within(start, end) for seconds, start, end in zip(micro_seconds, starts, bounds)]


def trainable_numel(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
