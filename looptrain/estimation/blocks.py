"""One block priced once: a stack of N identical blocks estimated from stacks of 2, 3 and 4, extrapolated exactly.

A transformer's layers are N blocks of one class with the same parameter shapes, and every lever treats them
alike (checkpointing every k-th block repeats with period k). So the estimate of N blocks is the estimate of a
truncated model, the same model with d, d + p and d + 2p blocks (p: the checkpointing period, d = N mod p, at
least 2 and past the frozen blocks), extrapolated to N: `extrapolated_result`.

The peak is a maximum over time, and a maximum of quantities each affine in N may move as N grows (the logits'
temporaries at the start of backward beat the gradients at the step on 4 blocks, not on 28). So the estimate
records the tracker's live bytes at every op (`StorageTracker.record_timeline`) and extrapolates the whole
timeline, not the peak:

1. the ops of d + p blocks are the ops of d blocks with one block's ops inserted where each block repeats
   (forward, backward, the optimizer's step over the parameters): `align` finds the insertions and maps every op of
   the shorter run to the same op of the longer one, a stack's first block to the first, its last to the last
   (the middle blocks, between the two, are the ones inserted);
2. at every op, the live bytes of the three runs must grow by the same bytes per block (else no extrapolation);
   then each op's bytes at N are its bytes at d plus (N - d) / p increments;
3. the peak at N is the highest of these, and so is each phase's; the deepest run's own peak must lie at an op the
   shallowest run has (not in a middle block);
4. the peak must be at the same op in the three runs and at N, so that its breakdown extrapolates with it: the
   reported figures (the peak, its breakdown, the parameters) must grow by the same increment from d to d + p and
   from d + p to d + 2p, and the peak's phase must stay. Where the peak at N is at another op (it overtakes the
   truncated runs' peak further on), the timeline says from which depth it stays there, and those three depths
   are priced instead when that costs less than the whole model. The phases' peaks are the timeline's at N (a
   phase's highest op may change between 2 blocks and N; each op's bytes are exact).

Where any of these fails, or the blocks are not identical, the estimate runs the whole model and says why
(``"extrapolated": false`` and ``"extrapolation"``, the reason).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import numpy
import torch
from torch import nn

# The timeline's events between the shorter run's last matched op and the resynchronised one that must match.
_RESYNC_EVENTS = 8
# Stacks of fewer blocks are estimated whole: three truncated runs each pay for the embedding, the head and the
# model's building again, and on fewer blocks cost about what the whole model does.
FEWEST_BLOCKS = 16
# What a truncated run costs besides its blocks (the embedding, the head, building the model), in blocks: three
# more truncated runs are priced only where they cost less than the whole model.
_RUN_COST_IN_BLOCKS = 8
_FREEZING = ("lora_rank", "qlora", "freeze_embeddings", "freeze_layers", "freeze_encoder")


def stack_blocks(model_or_config: Any, config: Any = None) -> tuple[int, str | None]:
    """The number of identical blocks the model stacks, and None; or 0 and why it cannot be extrapolated.

    `config`: the config of a preset name or path (`model_or_config` a string). A module's blocks are the list
    `looptrain.freeze.find_transformer_blocks` finds, as long as its config's ``num_hidden_layers``, and must
    all have the same class, parameters and buffers (names, shapes, dtypes, trainability)."""
    if isinstance(model_or_config, nn.Module):
        return _module_blocks(model_or_config)
    config = config if config is not None else model_or_config
    if getattr(config, "is_encoder_decoder", False):
        return 0, "an encoder-decoder stacks two kinds of block"
    blocks = getattr(config, "num_hidden_layers", None)
    if not isinstance(blocks, int) or not hasattr(config, "to_dict"):
        return 0, "the config gives no num_hidden_layers"
    for name, value in vars(config).items():
        if isinstance(value, list) and len(value) == blocks and len({repr(item) for item in value}) > 1:
            return 0, f"the blocks differ (the config's {name})"
    return blocks, None


def _module_blocks(model: nn.Module) -> tuple[int, str | None]:
    from looptrain.freeze import find_transformer_blocks

    config = getattr(model, "config", None)
    blocks = getattr(config, "num_hidden_layers", None)
    if not isinstance(blocks, int):
        return 0, "the model's config gives no num_hidden_layers"
    try:
        stack = find_transformer_blocks(model)
    except ValueError:
        return 0, "no list of transformer blocks found"
    if len(stack) != blocks:
        return 0, f"the block list has {len(stack)} blocks, the config {blocks}"
    if len({_block_description(block) for block in stack}) > 1:
        return 0, "the blocks differ (their parameters, buffers or trainability)"
    return blocks, None


def _block_description(block: nn.Module) -> tuple:
    tensors = [*block.named_parameters(remove_duplicate=False), *block.named_buffers(remove_duplicate=False)]
    return (type(block), tuple((name, type(tensor), tuple(tensor.shape), tensor.dtype, tensor.requires_grad,
                                getattr(tensor, "quant_state", None) is not None) for name, tensor in tensors),
            tuple((name, type(module)) for name, module in block.named_modules()))


def depths(blocks: int, strategy: Any, frozen: bool = False) -> tuple[tuple[int, int, int] | None, str | None]:
    """The three truncated depths ``(d, d + p, d + 2p)`` priced for a stack of `blocks`, or None and why not.

    p is the checkpointing period (`checkpoint_every` under checkpointing, else 1) and d the least depth at least
    2 past the frozen blocks (`freeze_layers`; 3 where something is frozen) with ``d = blocks (mod p)``: the
    truncated stacks end as the whole one does. A stack of fewer than `FEWEST_BLOCKS` is not extrapolated."""
    period = strategy.checkpoint_every if strategy.gradient_checkpointing else 1
    # Under a frozen embedding (LoRA, freezing, `frozen`: a module with frozen parameters) the first trained block's
    # input needs no gradient, so its backward differs from the next ones': one block more.
    frozen = frozen or any(getattr(strategy, name, False) for name in _FREEZING)
    first = strategy.freeze_layers + (3 if frozen else 2)
    first += (blocks - first) % period
    if first + 2 * period >= blocks:
        return None, f"{blocks} blocks: too few to price {first}, {first + period} and {first + 2 * period} of them"
    if blocks < FEWEST_BLOCKS:
        return None, f"{blocks} blocks: fewer than {FEWEST_BLOCKS}, where the whole model costs no more"
    return (first, first + period, first + 2 * period), None


def truncated_config(config: Any, depth: int) -> Any:
    """A copy of `config` with `depth` blocks (``num_hidden_layers``, and every per-block list cut to it)."""
    blocks = config.num_hidden_layers
    config = copy.deepcopy(config)
    for name, value in list(vars(config).items()):
        if isinstance(value, list) and len(value) == blocks:
            setattr(config, name, value[:depth])
    config.num_hidden_layers = depth
    return config


def truncate_in_copy(model: nn.Module, depth: int, memo: dict) -> None:
    """Prepares `memo` so that ``copy.deepcopy(model, memo)`` copies `model` with its first `depth` blocks (and a
    config that says so): the other blocks are never copied."""
    from looptrain.freeze import find_transformer_blocks

    stack = find_transformer_blocks(model)
    memo[id(model.config)] = truncated_config(model.config, depth)
    memo[id(stack)] = type(stack)([copy.deepcopy(block, memo) for block in list(stack)[:depth]])


def mark_blocks(model: nn.Module, tracker: Any) -> None:
    """Each block's forward (and its recomputation under checkpointing) and its backward start with a ``"block"``
    event in the tracker's timeline, so that `align` cannot take the ops after the last block (a final norm, like the
    next block's first norm) for one more block. Hooks on the estimate's own fake model, dropped with it."""
    from looptrain.freeze import find_transformer_blocks

    def marker(*_: Any) -> None:
        tracker.timeline.append((("block", 0), tracker.phase, tracker.current_bytes))

    def mark_its_gradient(module: nn.Module, args: Any, output: Any) -> None:
        first = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(marker)  # its backward starts when its output's gradient arrives

    for block in find_transformer_blocks(model):
        block.register_forward_pre_hook(marker)
        block.register_forward_hook(mark_its_gradient)


def align(short: Sequence, long: Sequence) -> list[int] | None:
    """Where each event of `short` is in `long`, `long` being `short` with repeated runs of events inserted; None
    when it is not.

    Events are ``((op, output bytes), phase)``. At each place the two part, the events inserted are found (the
    fewest after which `long` goes on as `short` does) and must repeat the run just before them: the events of
    `short`'s last repetition then map to the inserted ones, so that a stack's first block maps to the first and its
    last to the last. Where no insertion fits, the same op with outputs of another size (one whose size follows the
    depth: the stack of every parameter's norm) maps to its counterpart."""
    mapping: list[int] = []
    i = j = 0
    while i < len(short):
        if j < len(long) and short[i] == long[j]:
            mapping.append(j)
            i, j = i + 1, j + 1
            continue
        inserted = _inserted(short, long, i, j)
        if inserted is None:
            if j < len(long) and _name(short[i]) == _name(long[j]):  # an op whose size follows the depth (a stack)
                mapping.append(j)
                i, j = i + 1, j + 1
                continue
            return None
        _remap_last_repetition(mapping, i, j, inserted)
        j += inserted
    if j < len(long):
        inserted = len(long) - j
        if inserted > i or list(long[j:]) != list(short[i - inserted:i]) \
                or any(mapping[t] != j - i + t for t in range(i - inserted, i)):
            return None
        _remap_last_repetition(mapping, i, j, inserted)
    return mapping


def _inserted(short: Sequence, long: Sequence, i: int, j: int) -> int | None:
    """The number of events inserted in `long` at `j` (where `short` is at `i`), repeating `short`'s run before
    `i`; None if no such insertion makes the two go on alike (the same ops, their sizes aside, for a few events)."""
    window = min(_RESYNC_EVENTS, len(short) - i)
    after = [_name(event) for event in short[i:i + window]]
    for inserted in range(1, min(i, len(long) - j - window) + 1):
        if [_name(event) for event in long[j + inserted:j + inserted + window]] == after \
                and list(long[j:j + inserted]) == list(short[i - inserted:i]):
            return inserted
    return None


def _name(event: tuple) -> tuple:
    """An event's op name and phase, without its outputs' bytes."""
    op, phase = event
    return (op[0] if isinstance(op, tuple) else op), phase


def _remap_last_repetition(mapping: list[int], i: int, j: int, inserted: int) -> None:
    for t in range(i - inserted, i):
        mapping[t] += inserted


class NotAffine(Exception):
    """Why a stack's estimate cannot be extrapolated from its truncated runs."""


class PeakMoves(NotAffine):
    """The peak at N is at another op than in the truncated runs; `settles_at`: the least depth from which it is at
    that op (None: nowhere short of N)."""

    def __init__(self, settles_at: int | None) -> None:
        super().__init__("the peak moves to another op as blocks are added")
        self.settles_at = settles_at


def extrapolated_result(run: Callable[[int], tuple[dict, list]], depths_priced: tuple[int, int, int],
                        blocks: int) -> dict:
    """The estimate of `blocks` blocks from `run(depth)` (an estimate of the truncated model and its tracker's
    timeline) at the three `depths_priced`, extrapolated (the module's docstring says how and when). Where the peak
    moves to another op past the deepest of them, the three depths from which it stays there are priced instead, if
    they cost less than the whole model.

    Raises:
        NotAffine: the runs do not prove the extrapolation exact; the message says why.
    """
    try:
        return _extrapolated([run(depth) for depth in depths_priced], depths_priced, blocks)
    except PeakMoves as moved:
        period = depths_priced[1] - depths_priced[0]
        deeper = moved.settles_at
        if deeper is None or 3 * (deeper + period) + _RUN_COST_IN_BLOCKS >= blocks:
            raise
        depths_priced = (deeper, deeper + period, deeper + 2 * period)
        return _extrapolated([run(depth) for depth in depths_priced], depths_priced, blocks)


def _extrapolated(runs: list[tuple[dict, list]], depths_priced: tuple[int, int, int], blocks: int) -> dict:
    results = [result for result, _ in runs]
    period = depths_priced[1] - depths_priced[0]
    steps = (blocks - depths_priced[0]) // period
    lives, slopes = _timeline_slopes([timeline for _, timeline in runs])
    at_blocks = lives[0] + steps * slopes
    peak_event = int(numpy.argmax(at_blocks))
    first_peak = int(numpy.argmax(lives[0]))
    if peak_event != first_peak or any(int(numpy.argmax(deeper)) != first_peak for deeper in lives[1:]):
        raise PeakMoves(_settles_at(lives[0], slopes, peak_event, depths_priced[0], period, blocks)
                        if peak_event != first_peak else None)
    result = _affine_result(results, steps)
    phases = numpy.array([phase for _, phase, _ in runs[0][1]])
    result["phase_peak_bytes"] = {phase: int(at_blocks[phases == phase].max()) for phase in dict.fromkeys(phases)}
    first, *_, last = depths_priced
    result["notes"] = [*results[-1]["notes"],
                       f"estimated from {', '.join(map(str, depths_priced))} of the {blocks} identical blocks, "
                       "extrapolated (exact: every op's live bytes grow by one block's at each step)"]
    result["extrapolated"] = True
    result["extrapolation"] = f"blocks {first}..{last} of {blocks}"
    # The truncated stacks' own peaks: a planner's probe of one of them is scaled to the whole by their difference.
    result["depth_peak_bytes"] = {str(depth): int(run["peak_memory_bytes"])
                                  for depth, run in zip(depths_priced, results)}
    return result


def _timeline_slopes(timelines: list[list]) -> tuple[list, Any]:
    """Each op of the shallowest run: its live bytes in each run (arrays in its order) and its increment per step."""
    events = [[(event, phase) for event, phase, _ in timeline] for timeline in timelines]
    first, second = align(events[0], events[1]), align(events[1], events[2])
    if first is None or second is None:
        raise NotAffine("a block more is not the same ops inserted in the same places")
    hops = [numpy.array(first), numpy.array(second)[first]]
    raw = [numpy.array([live for *_, live in timeline], dtype=numpy.int64) for timeline in timelines]
    lives = [raw[0], raw[1][hops[0]], raw[2][hops[1]]]
    slopes = lives[1] - lives[0]
    uneven = numpy.flatnonzero(lives[2] - lives[1] != slopes)
    if uneven.size:
        (event, phase), = [events[0][int(uneven[0])]]
        raise NotAffine(f"the live bytes at {event} in {phase} do not grow by the same bytes per block")
    if raw[2].max() != lives[2].max():
        raise NotAffine("the deepest stack's peak is in a middle block")
    return lives, slopes


def _settles_at(lives: Any, slopes: Any, event: int, depth: int, period: int, blocks: int) -> int | None:
    """The least depth from which `event` is the timeline's first highest op up to `blocks`, or None."""
    settled = None
    for steps, at in reversed(list(enumerate(range(depth, blocks + 1, period)))):
        if int(numpy.argmax(lives + steps * slopes)) != event:
            break
        settled = at
    return settled


def _affine_result(results: list[dict], steps: int) -> dict:
    """The first result with every figure extrapolated `steps` increments, each increment checked constant."""
    def affine(values: list[int], name: str) -> int:
        if values[2] - values[1] != values[1] - values[0]:
            raise NotAffine(f"{name} does not grow by the same bytes per block")
        return values[0] + steps * (values[1] - values[0])

    breakdowns = [result["memory_breakdown"] for result in results]
    if len({breakdown["peak_phase"] for breakdown in breakdowns}) > 1:
        raise NotAffine("the peak's phase changes with the number of blocks")
    phases = [result["phase_peak_bytes"] for result in results]
    if len({tuple(sorted(phase)) for phase in phases}) > 1:
        raise NotAffine("the phases change with the number of blocks")
    result = dict(results[0])
    for name in ("peak_memory_bytes", "parameters", "trainable_parameters", "kernel_scratch_bytes"):
        if name in result:
            result[name] = affine([item[name] for item in results], name)
    result["memory_breakdown"] = {name: value if name == "peak_phase" else
                                  affine([breakdown[name] for breakdown in breakdowns], name)
                                  for name, value in breakdowns[0].items()}
    return result
