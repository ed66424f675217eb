"""torch.distributed plumbing: joining torchrun's process group, rank queries, small collectives.

looptrain has no launcher of its own: `torchrun --nproc_per_node N script.py` starts the processes
and sets `RANK`, `LOCAL_RANK` and `WORLD_SIZE`; `init_distributed` joins the group they describe
(gloo on CPU, NCCL on CUDA). Every helper here is a no-op in a single process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits in the job (rank 0 of 1 when not distributed)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True when torchrun's environment describes more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: str = "auto") -> DistributedInfo:
    """Joins the process group torchrun describes, once; returns this process's place in it.

    Args:
        device: the run's device name; "cpu" forces gloo even on a machine with CUDA.

    Returns:
        The rank, local rank, world size and backend (rank 0 of 1 outside torchrun).
    """
    if dist.is_available() and dist.is_initialized():
        return current()
    if not launched_by_torchrun():
        return DistributedInfo()
    use_cuda = torch.cuda.is_available() and device != "cpu" and not device.startswith("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)  # before NCCL initialises, so each rank owns its GPU
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return current()


def current() -> DistributedInfo:
    """This process's place in an initialised group (rank 0 of 1 when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistributedInfo()
    return DistributedInfo(
        rank=dist.get_rank(),
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
    )


def is_main_process() -> bool:
    """True on rank 0, and in a single process: the one that writes files and prints."""
    return current().is_main


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums a few numbers over every rank (returned unchanged in a single process)."""
    if not current().is_distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (a one-element list in a single process)."""
    info = current()
    if not info.is_distributed:
        return [value]
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    """Waits for every rank (nothing to wait for in a single process)."""
    if current().is_distributed:
        dist.barrier()
