"""Fine-tune a sequence classifier (or, with --task causal-lm, a decoder LM) with looptrain, every memory
strategy one flag away.

    python scripts/finetune.py --amp --accum 32                       # the embedded model and data
    python scripts/finetune.py --model DIR --data train.csv --eval-data dev.csv --grad-checkpoint
    python scripts/finetune.py --task causal-lm --model QWEN_DIR --data sft.jsonl --eval-data dev.jsonl
    looptrain-finetune --amp --accum 32                               # the same, once installed

Every flag is documented in docs/finetune.md. The memory/speed levers' flags are generated from
`looptrain.Strategy`'s field metadata, the loop's run options (schedule, checkpoints) from `LoopConfig`,
so their defaults and help come from one place.

The package, by concern: `arguments` (the parser and the flags' checks), `request` (argv parsed once into a frozen
`RunRequest`), `inputs` (data, model, LoRA, the run's identity), `budget` (`--memory-budget`: the plan and what it
needs), `run` (one run, start to final/) and `reports` (the end-of-run table). Messages go through one console per
rank (`looptrain.cli.console`). `main` and the names below are its public surface.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from looptrain.cli.errors import UsageError
from looptrain.cli.finetune.arguments import (
    SWITCHED_FIELDS,
    DefaultOnceFormatter,
    add_loading_arguments,
    build_parser,
    flag_names_for,
    strategy_of,
)
from looptrain.cli.finetune.budget import plan_on_rank_zero, rss_at_start
from looptrain.cli.finetune.inputs import (
    EMBEDDED_DATA_PACKAGE,
    EMBEDDED_MODEL_PACKAGE,
    load_data,
    load_model_config,
    load_weights,
    run_identity,
)
from looptrain.cli.finetune.reports import OutOfMemory, final_table
from looptrain.cli.finetune.request import Flags, Process, RunRequest, request_of
from looptrain.cli.finetune.run import run
from looptrain.cli.recipe import expand_config

__all__ = ["EMBEDDED_DATA_PACKAGE", "EMBEDDED_MODEL_PACKAGE", "DefaultOnceFormatter", "Flags", "Process",
           "RunRequest", "UsageError", "add_loading_arguments", "build_parser", "final_table", "load_data",
           "load_model_config", "load_weights", "main", "main_entry", "plan_on_rank_zero", "request_of", "run",
           "run_identity", "strategy_of"]

INTERRUPTED_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}  # the shell's 128 + signal number


def main(argv: list[str] | None = None, *, owns_process: bool = False) -> int:
    """Runs the command line; returns the exit code (0 ok, 2 for a user error).

    `owns_process`: the process is this run's alone (the console script's), so settings that outlive the run may
    be changed: under a budget read as RSS, glibc's malloc thresholds where the planner needs them (`lean_allocator`).
    """
    parser = build_parser()
    argv = expand_config(parser, sys.argv[1:] if argv is None else argv, SWITCHED_FIELDS)  # a --config file's, typed
    args = parser.parse_args(argv)
    rss = rss_at_start()
    capped = None  # said by `run` once it knows where its messages go (stderr with --json)
    if args.memory_budget and owns_process:  # before the process's first kernel: the caches read it then
        from looptrain.memory import allocator

        capped = allocator.cap_kernel_caches()
    process = Process(argv=tuple(argv), owns_process=owns_process, rss_at_start=rss, capped_kernel_caches=capped)
    from looptrain.checkpoint.layout import CheckpointError
    from looptrain.data.errors import DataError
    from looptrain.errors import ConfigError
    from looptrain.guards import TrainingDiverged
    from looptrain.ledger import LedgerError
    from looptrain.planning import PlanError
    from looptrain.run import EvaluationError

    user_errors = (UsageError, ConfigError, DataError, CheckpointError, TrainingDiverged, OutOfMemory, LedgerError,
                   EvaluationError, PlanError)
    try:
        summary = run(request_of(args, process))  # the flags checked, then parsed once into a frozen request
    except KeyboardInterrupt:  # a second Ctrl-C (or SIGTERM) during training or final/, or one before it began
        if args.debug:
            raise
        print(f"finetune.py: {stopped_at_once(args.output_dir)}", file=sys.stderr)
        return INTERRUPTED_EXIT_CODES["SIGINT"]
    except user_errors as error:
        if args.debug:
            raise
        # The command line's own messages, the ledger's and those about files name their flags already, and their
        # words are not field names ("no space left on device" is no --device).
        own_words = (UsageError, DataError, CheckpointError, LedgerError)
        hint = "" if isinstance(error, own_words) else flag_names_for(str(error))
        print(f"finetune.py: error: {error}{hint}", file=sys.stderr)
        return 2
    if summary.get("interrupted"):
        return INTERRUPTED_EXIT_CODES.get(summary["interrupted"], 1)
    return 0


def stopped_at_once(output_dir: str | None) -> str:
    """What a run stopped at once (a second signal) left: the newest checkpoint --resume auto continues from, or
    none, so that --resume auto trains the run again from its start."""
    from looptrain.checkpoint import latest_checkpoint

    latest = latest_checkpoint(output_dir) if output_dir else None
    if latest is None:
        return (f"stopped at once: what was in progress was not saved, and {output_dir} holds no checkpoint of this "
                "run yet (none is saved before the first evaluation point; --eval-every sets them): --resume auto "
                "trains it again from the start")
    return (f"stopped at once: what was in progress (a window of training, or final/) was not saved. Checkpoints "
            f"already in {output_dir} are intact; --resume auto continues from the last one ({latest.name})")


def main_entry() -> None:
    """The `looptrain-finetune` console script (and `scripts/finetune.py`): exits with main's code.

    Under torchrun every rank leaves the process group together first (`distributed.shutdown`); `main` itself
    leaves it joined, so one process may call it for several runs.
    """
    code = main(owns_process=True)
    from looptrain import distributed

    distributed.shutdown()
    sys.exit(code)
