"""torch.distributed plumbing: joining torchrun's process group, rank queries, small collectives.

looptrain has no launcher of its own: `torchrun --nproc_per_node N script.py` starts the processes
and sets `RANK`, `LOCAL_RANK` and `WORLD_SIZE`; `init_distributed` joins the group they describe
(gloo on CPU, NCCL on CUDA). Every helper here is a no-op in a single process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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
    global _JOINED
    _JOINED = True
    return current()


_JOINED = False  # whether `init_distributed` created the default group (`shutdown` leaves a caller's own alone)


def shutdown() -> None:
    """Leaves the process group `init_distributed` joined, every rank together (a no-op otherwise).

    Call it once training is over (`finetune.py` does): a process that exits with the group alive may abort in
    gloo's or NCCL's threads at interpreter exit ("terminate called without an active exception"), and NCCL
    warns that the group was never destroyed. A group the caller created itself is the caller's to destroy.
    """
    global _JOINED
    if not (_JOINED and dist.is_available() and dist.is_initialized()):
        return
    _JOINED = False
    dist.barrier()
    dist.destroy_process_group()


_ALONE = False  # inside `alone()`: this process acts as if it were the only one


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within it this rank acts as a single process: `current()` says rank 0 of 1, so a Loop built there neither
    wraps its model in DDP nor reduces across ranks (rank 0's planning: its estimates and probes train alone while
    the other ranks wait for the plan)."""
    global _ALONE
    before, _ALONE = _ALONE, True
    try:
        yield
    finally:
        _ALONE = before


def current() -> DistributedInfo:
    """This process's place in an initialised group (rank 0 of 1 when there is none, or inside `alone()`)."""
    if _ALONE or not (dist.is_available() and dist.is_initialized()):
        return DistributedInfo()
    return DistributedInfo(
        rank=dist.get_rank(),
        local_rank=int(os.environ.get("LOCAL_RANK", dist.get_rank())),
        world_size=dist.get_world_size(),
        backend=dist.get_backend(),
    )


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums a few numbers over every rank (returned unchanged in a single process)."""
    if not current().is_distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def all_reduce_tensors_sum(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Scalar tensors summed over every rank in one collective (returned unchanged in a single process)."""
    if not current().is_distributed:
        return tensors
    stacked = torch.stack([tensor.detach().to(torch.float64) for tensor in tensors])
    dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return tuple(value.to(tensor.dtype) for value, tensor in zip(stacked, tensors))


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


def device_for(device: torch.device, place: DistributedInfo) -> torch.device:
    """The device a process trains on: `device`, with each rank on its own GPU under torchrun."""
    if place.is_distributed and device.type == "cuda":
        return torch.device("cuda", place.local_rank)
    return device


# ---------------------------------------------------------------------- DDP
def wrap_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """What forward and backward run through: `DistributedDataParallel(model)` under torchrun, else `model`.

    A model sharded with FSDP2 (`shard_model`) is returned as it is: `fully_shard` already changed it
    in place. Under DDP, a training forward of the bare model that bypasses the wrapper would
    silently skip the gradient all-reduce; a pre-hook turns that into an error naming the fix.
    """
    if not current().is_distributed or is_fsdp(model):
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    # Buffers (position ids) never change in training: no need to broadcast them every forward.
    wrapped = DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
    inside = {"wrapper": False}
    wrapped.register_forward_pre_hook(lambda module, args: inside.update(wrapper=True))
    wrapped.register_forward_hook(lambda module, args, output: inside.update(wrapper=False))

    def refuse_bypass(module, args):
        if module.training and torch.is_grad_enabled() and not inside["wrapper"]:
            raise RuntimeError(
                "the model was called directly under DistributedDataParallel, so its gradients would not be "
                "all-reduced across ranks: in Loop hooks call self.wrapped_model(...), not self.model(...)"
            )

    model.register_forward_pre_hook(refuse_bypass)
    return wrapped


def gradient_sync(wrapped_model: torch.nn.Module, model: torch.nn.Module, enabled: bool):
    """A context in which backward all-reduces (DDP) or reduce-scatters (FSDP2) gradients only if `enabled`.

    The loop enables it on a window's last micro-batch alone: the others accumulate locally.
    """
    if is_fsdp(model):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and hasattr(wrapped_model, "no_sync"):
        return wrapped_model.no_sync()
    return contextlib.nullcontext()


# ---------------------------------------------------------------------- FSDP2
def shard_model(model: torch.nn.Module, *, reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shards a model with FSDP2 (`fully_shard`): each transformer block, then the root.

    Call it under torchrun, after moving the model to its device and freezing, and **before**
    building the optimizer: `fully_shard` replaces the parameters with sharded ones.

    Args:
        model: the model; its transformer blocks are found with `looptrain.freeze.find_transformer_blocks`
            (a model without recognisable blocks is sharded as one unit).
        reshard_after_forward: free the gathered parameters after each block's forward (less memory,
            one more all-gather in backward).

    Raises:
        ValueError: no process group (one process has nothing to shard across).
    """
    from torch.distributed.fsdp import fully_shard

    from looptrain.freeze import find_transformer_blocks

    if not current().is_distributed:
        raise ValueError("shard_model needs several processes: launch with torchrun --nproc_per_node N")
    try:
        blocks = list(find_transformer_blocks(model))
    except ValueError:
        blocks = []
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model


def is_fsdp(module: torch.nn.Module) -> bool:
    """True for a model sharded with FSDP2's `fully_shard`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def _full_options(cpu_offload: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)


class FullStateModel(torch.nn.Module):
    """A sharded model seen through its *full* state dict, for `looptrain.checkpoint`'s save and load.

    Saving: build it on every rank (gathering is collective), then rank 0 hands it to
    `save_checkpoint`. Loading: every rank passes it to `load_checkpoint`, which loads the full
    tensors into each rank's shards.
    """

    def __init__(self, module: torch.nn.Module, gather: bool = True):
        super().__init__()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self.__dict__["sharded"] = module  # not registered as a child: its own state_dict is sharded
        self.__dict__["full"] = get_model_state_dict(module, options=_full_options(cpu_offload=False)) if gather else {}

    def state_dict(self, *args, **kwargs):
        return dict(self.full)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=strict)
        return set_model_state_dict(self.sharded, state_dict, options=options)

    def save_pretrained(self, directory, **kwargs):
        """HF models: `save_pretrained` with the gathered weights (config and all)."""
        return self.sharded.save_pretrained(directory, state_dict=self.full, **kwargs)


class FullStateOptimizer:
    """The optimizer of a sharded model seen through its full state dict (see `FullStateModel`)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, gather: bool = True):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self.module, self.optimizer = module, optimizer
        self.full = (
            get_optimizer_state_dict(module, optimizer, options=_full_options(cpu_offload=False)) if gather else None
        )

    def state_dict(self):
        return self.full

    def load_state_dict(self, state_dict):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, self.optimizer, state_dict, options=_full_options(cpu_offload=False))


def save_pretrained(model: torch.nn.Module, directory) -> None:
    """`model.save_pretrained(directory)` from rank 0, gathering a sharded model's weights first (all ranks call it)."""
    if is_fsdp(model):
        model = FullStateModel(model)
    if current().is_main:
        model.save_pretrained(directory)
    barrier()
