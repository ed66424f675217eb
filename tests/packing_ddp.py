"""One DDP run of a tiny causal LM on packed rows (launched by tests/test_packing.py).

Usage: torchrun --nproc_per_node 2 tests/packing_ddp.py FAMILY COUNT OUTPUT.pt

The samples of tests/test_causal_lm.py's `lm_samples(COUNT, seed=1)` packed into rows of 32 tokens; each rank takes
its own packs from looptrain's random batch sampler (one pack a micro-batch, accumulation 2), so a window holds 4
packs, 2 per rank. Rank 0 saves the trained weights to OUTPUT.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from test_causal_lm import lm_samples, make_causal_lm
from test_packing import samples_dataset

from looptrain import Loop
from looptrain.data import make_train_loader
from looptrain.data.packing import PackedCollator, PackedDataset, packing_problem

from conftest import exit_rank, leave_group, quiet_config

PAD = 0


def main(family: str, count: int, output: str) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    packed = PackedDataset(samples_dataset(lm_samples(count, seed=1)), 32)
    loader = make_train_loader(packed, 1, PackedCollator(PAD, 32), seed=0, num_replicas=world_size, rank=rank)
    model = make_causal_lm(family)
    assert packing_problem(model) is None
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=1.0), loader,
                config=quiet_config(accum_steps=2, epochs=1, max_grad_norm=None))
    loop.fit()
    leave_group(loop, output)
    return 0


if __name__ == "__main__":
    exit_rank(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
