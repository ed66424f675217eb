"""Resume: where training stands in the data, replaying an epoch's order, saving and loading the training state.

A checkpoint (see `looptrain.checkpoint` for its files) holds, besides weights and optimizer state, the
loop's counters and the torch RNG state from the moment the current epoch drew its data order. A
resume in mid-epoch sets that RNG state back, rebuilds the same order, skips the micro-batches
already consumed (without loading them when the batch sampler has `skip_batches`), then restores
the RNG state of the moment the checkpoint was written, so dropout continues exactly as it would
have. Sharded (FSDP2) models are saved and loaded through full-state views.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, get_type_hints

import torch
from torch import nn

from looptrain import distributed
from looptrain.checkpoint import (
    capture_rng_state,
    check_trainer_state,
    checkpoint_name,
    load_checkpoint,
    restore_rng_state,
    rotate_checkpoints,
    save_checkpoint,
)
from looptrain.checkpoint.layout import TRAINER_STATE_FILE
from looptrain.progress import Progress

# What a resume reads from trainer_state.json (`Progress.from_state_dict`, `Run.restore`), each of its type.
RESUME_STATE = {**get_type_hints(Progress), "best": dict, "epoch_rng_state": list | None}


def set_epoch(loader: Any, epoch: int) -> None:
    """Tells the loader's batch sampler (or sampler, or the loader itself) which epoch starts."""
    for source in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None), loader):
        if hasattr(source, "set_epoch"):
            source.set_epoch(epoch)
            return


def start_epoch(
    loader: Iterable,
    epoch: int,
    skip: int = 0,
    epoch_rng_state: torch.Tensor | None = None,
    rng_after_skip: dict | None = None,
) -> tuple[Iterator, torch.Tensor]:
    """Starts an epoch's batches; in mid-epoch (`skip > 0`) replays its order and skips the consumed ones.

    Args:
        loader: the training batches (a DataLoader or any iterable).
        epoch: the epoch that starts.
        skip: micro-batches of this epoch already consumed (0 for a fresh epoch).
        epoch_rng_state: the torch RNG state the epoch drew its order from (saved in the checkpoint).
        rng_after_skip: the RNG states to restore once skipped (those of the checkpoint's moment).

    Returns:
        The iterator over the remaining batches, and the RNG state this epoch's order is drawn from.
    """
    set_epoch(loader, epoch)
    if skip and epoch_rng_state is not None:
        torch.set_rng_state(epoch_rng_state)
    order_rng_state = torch.get_rng_state()
    sampler = getattr(loader, "batch_sampler", None)
    if skip and hasattr(sampler, "skip_batches"):
        sampler.skip_batches(skip)  # the sampler knows its epoch's order: no batch is loaded to skip it
        skip = 0
    batches = iter(loader)
    for _ in range(skip):
        next(batches, None)
    if rng_after_skip is not None:
        restore_rng_state(rng_after_skip)
    return batches, order_rng_state


def windows(batches: Iterator, accum_steps: int) -> Iterator[list]:
    """Groups batches into windows of `accum_steps`; the last one may be shorter (and is still stepped)."""
    window: list = []
    for batch in batches:
        window.append(batch)
        if len(window) == accum_steps:
            yield window
            window = []
    if window:
        yield window


def _full_state_views(model: nn.Module, optimizer: Any, gather: bool) -> tuple[nn.Module, Any]:
    """The model and optimizer as checkpoints see them: full-state views of a sharded (FSDP2) model."""
    if not distributed.is_fsdp(model):
        return model, optimizer
    return (distributed.FullStateModel(model, gather=gather),
            distributed.FullStateOptimizer(model, optimizer, gather=gather))


def save_training_checkpoint(
    output_dir: Path, step: int, *, model: nn.Module, optimizer: Any, scheduler: Any, precision: Any,
    trainer_state: dict, metrics: dict | None, save_total_limit: int | None, best_checkpoint: str | None,
    run_checkpoints: set | None = None,
) -> Path:
    """Writes `checkpoint-<step>` (rank 0; every rank calls it, gathering is collective) and rotates.

    Every rank's torch RNG state is stored (dropout differs per rank). Rotation only ever deletes
    checkpoints named in `run_checkpoints` (this run's own; None: every complete one).
    """
    trainer_state = {**trainer_state, "rank_rng_states": distributed.all_gather_objects(torch.get_rng_state().tolist())}
    model_view, optimizer_view = _full_state_views(model, optimizer, gather=True)
    path = Path(output_dir) / checkpoint_name(step)
    if distributed.current().is_main:
        save_checkpoint(output_dir, step, model=model_view, optimizer=optimizer_view, scheduler=scheduler,
                        scaler=precision, trainer_state=trainer_state, metrics=metrics)
        rotate_checkpoints(output_dir, save_total_limit, best_checkpoint=best_checkpoint,
                           run_checkpoints=run_checkpoints)
    distributed.barrier()  # no rank runs ahead of a checkpoint rank 0 is still writing
    return path


def load_training_checkpoint(
    path: Path, *, model: nn.Module, optimizer: Any, scheduler: Any, precision: Any, device: torch.device
) -> tuple[dict, dict | None]:
    """Loads weights, optimizer, scheduler and scaler state and this rank's RNG state from `path`.

    Returns:
        The saved trainer state, and the RNG states now in force (to re-apply after the data skip).
    """
    model_view, optimizer_view = _full_state_views(model, optimizer, gather=False)
    saved = load_checkpoint(path, model=model_view, optimizer=optimizer_view, scheduler=scheduler,
                            scaler=precision, map_location=device)
    check_trainer_state(saved, Path(path) / TRAINER_STATE_FILE, RESUME_STATE)
    place = distributed.current()
    rank_rng_states = saved.get("rank_rng_states")
    if rank_rng_states and len(rank_rng_states) == place.world_size:
        torch.set_rng_state(torch.tensor(rank_rng_states[place.rank], dtype=torch.uint8))
    return saved, capture_rng_state()


def load_weights(path: Path, model: nn.Module, device: torch.device) -> dict:
    """Loads only a checkpoint's weights (the best one, at the end of training); returns its trainer state."""
    model_view, _ = _full_state_views(model, None, gather=False)
    return load_checkpoint(path, model=model_view, map_location=device, restore_rng=False)
