"""Plan only: the fastest exact settings that fit a memory budget, and the command line that trains them.

    python scripts/plan.py --model DIR --data train.csv --memory-budget 4GiB [--effective-batch 32] [--json]
    looptrain-plan --model DIR --data train.csv --memory-budget 4GiB     # the same, once installed

It takes every flag of `scripts/finetune.py` (the data, the model, `--amp`, `--optim auto`,
`--group-by-length`, ...) and runs its planner (`looptrain.plan`, docs/plan.md) without training:
it prints the ranked table and the `finetune.py` command line of the winner. Nothing is written.
With `--lora R` the rest is planned around the adapters (kept as given), and the table notes what LoRA saves
over the full fine-tune with the winner's settings (docs/lora.md, "The planner").
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None, *, owns_process: bool = False) -> int:
    """Runs `finetune.py --plan-only` with these arguments; returns its exit code (`owns_process`: as
    `finetune.main`'s: the console script's process may have its allocator's thresholds fixed)."""
    from looptrain.cli import finetune
    from looptrain.cli.finetune.arguments import SWITCHED_FIELDS
    from looptrain.cli.recipe import expand_config

    argv = expand_config(finetune.build_parser(), sys.argv[1:] if argv is None else argv,
                         SWITCHED_FIELDS)  # a --config file's flags, then the typed ones
    # Parsed as finetune.py parses it, so that --help prints the help (and exits 0) and --memory-budget is found
    # however it is spelt (--memory-budget=4GiB) or given (the --config file).
    if finetune.build_parser().parse_args(argv).memory_budget is None:
        print("plan.py: error: --memory-budget SIZE is required (e.g. --memory-budget 4GiB, or memory_budget: 4GiB "
              "in the --config file)", file=sys.stderr)
        return 2
    return finetune.main([*argv, "--plan-only"], owns_process=owns_process)


def main_entry() -> None:
    """The `looptrain-plan` console script: exits with main's code."""
    sys.exit(main(owns_process=True))
