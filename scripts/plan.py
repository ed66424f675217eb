#!/usr/bin/env python
"""Plan only: the fastest exact settings that fit a memory budget, and the command line that trains them.

    python scripts/plan.py --model DIR --data train.csv --memory-budget 4GiB [--effective-batch 32] [--json]

It takes every flag of `scripts/finetune.py` (the data, the model, `--amp`, `--optim auto`,
`--group-by-length`, ...) and runs its planner (`looptrain.planning.plan`, docs/plan.md) without training:
it prints the ranked table and the `finetune.py` command line of the winner. Nothing is written.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    """Runs `finetune.py --plan-only` with these arguments; returns its exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--memory-budget" not in {token.split("=")[0] for token in argv}:
        print("plan.py: error: --memory-budget SIZE is required (e.g. --memory-budget 4GiB)", file=sys.stderr)
        return 2
    specification = importlib.util.spec_from_file_location("looptrain_finetune_cli", SCRIPTS / "finetune.py")
    finetune = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(finetune)
    return finetune.main([*argv, "--plan-only"])


if __name__ == "__main__":
    sys.path.insert(0, str(SCRIPTS.parent))  # run from a checkout without install
    sys.exit(main())
