"""One DDP run of a tiny causal LM with the Loop's default hooks (launched by tests/test_causal_lm.py).

Usage: torchrun --nproc_per_node 2 tests/causal_lm_ddp.py FAMILY COUNT OUTPUT.pt

Each rank takes half of every 16-row window (two micro-batches of 4, accumulation 2; the last window of 60 rows
gives rank 0 two micro-batches and rank 1 one), so the 2 ranks together see the rows of the full-batch reference
of tests/test_causal_lm.py. Rank 0 saves the trained weights to OUTPUT.pt.
"""

from __future__ import annotations

import os
import sys

import torch
from test_causal_lm import batched, lm_samples, make_causal_lm

from looptrain import Loop

from conftest import exit_rank, leave_group, quiet_config


def main(family: str, count: int, output: str) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    samples = lm_samples(count, seed=1)
    share = 16 // world_size
    mine = [row for start in range(0, count, 16) for row in samples[start + rank * share:start + (rank + 1) * share]]
    model = make_causal_lm(family)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=1.0), batched(mine, 4),
                config=quiet_config(accum_steps=share // 4, epochs=2, max_grad_norm=None))
    loop.fit()
    leave_group(loop, output)
    return 0


if __name__ == "__main__":
    exit_rank(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
