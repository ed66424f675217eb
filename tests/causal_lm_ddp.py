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

from looptrain import Loop, distributed

from conftest import quiet_config


def main(family: str, count: int, output: str) -> int:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    samples = lm_samples(count, seed=1)
    share = 16 // world_size
    mine = [row for start in range(0, count, 16) for row in samples[start + rank * share:start + (rank + 1) * share]]
    model = make_causal_lm(family)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=1.0), batched(mine, 4),
                config=quiet_config(accum_steps=share // 4, epochs=2, max_grad_norm=None))
    loop.fit()
    if rank == 0:
        torch.save({"state_dict": model.state_dict(), "step": loop.step}, output)
    # Leave the group together: a rank that exits while gloo's threads still serve the other aborts ("terminate
    # called without an active exception").
    distributed.shutdown()
    assert not torch.distributed.is_initialized(), "shutdown left the group the Loop joined"
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    # Skip the interpreter's finalization: a rank aborted there once in a CI run (SIGABRT, "terminate called without
    # an active exception") although the group had been destroyed; the result is saved, the streams flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
