"""Runs several `scripts/finetune.py` runs in one torchrun launch (imported by tests/test_distributed.py's launch).

Usage: torchrun --nproc_per_node 2 tests/distributed_runs.py PLAN.json

PLAN.json is a list of steps, run in order by every rank:
  {"name": "two", "argv": [...]}          finetune.main(argv); each rank's stdout goes to <name>.rank<r>.out
                                          beside PLAN.json; a non-zero exit code ends the launch with it
  {"copy": ["SOURCE_DIR", "TARGET_DIR"]}  rank 0 copies a directory (a checkpoint to resume from), all wait
One launch pays torchrun's start-up and the imports once for every run of the distributed tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist

from looptrain import distributed
from looptrain.cli import finetune


def main(plan_path: str) -> int:
    plan_file = Path(plan_path)
    for step in json.loads(plan_file.read_text()):
        if "copy" in step:
            source, target = step["copy"]
            if int(os.environ.get("RANK", "0")) == 0:
                shutil.copytree(source, target)
            if dist.is_initialized():
                dist.barrier()
            continue
        rank = int(os.environ.get("RANK", "0"))  # torchrun's; the group is joined inside the first run
        with open(plan_file.parent / f"{step['name']}.rank{rank}.out", "w", encoding="utf-8") as out, \
                contextlib.redirect_stdout(out):
            code = finetune.main(step["argv"])
        if code != 0:
            print(f"run {step['name']!r} exited {code} on rank {rank}", file=sys.stderr)
            return code
    distributed.shutdown()  # every rank leaves the group together (a rank that exits first may abort the other)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
