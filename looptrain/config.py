"""`LoopConfig`: the loop's part of a strategy plus every option of a run, and the one place it is validated.

The memory/speed levers the Loop carries out are declared once, in `looptrain.strategy.LoopLevers`, which
`LoopConfig` inherits (`LoopConfig.from_strategy` builds one from a whole `Strategy`). The run's own options
are declared here the same way, with `looptrain.strategy.option`: default, help, flag, and the check of a single
value. The command line (`looptrain-finetune`) generates its flags from both, so a field's declaration is the only
source of its default and help text. Checks are said once, in field names: a single value's with its field, the
combinations in `COMBINATION_CHECKS` (run by `__post_init__`), and those against the process group in
`check_process_group` (called by the `Loop`, and by the command line before any model loads).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from looptrain.checkpoint import default_mode
from looptrain.compilation import compile_problems
from looptrain.optim.in_backward import CLIP_MODES as FUSED_CLIP_MODES
from looptrain.precision import precision_problem, resolve_device
from looptrain.strategy import CONFIG_PRECISIONS, GRAD_DTYPES, WEIGHT_DTYPES, ConfigError, LoopLevers, option
from looptrain.trackers import TRACKERS, missing_package, tracker_names
from looptrain.unfreeze import valid_every

CLIP_MODES = ("auto", "global", *FUSED_CLIP_MODES)  # the fused step's own modes come from optim
__all__ = ["CLIP_MODES", "CONFIG_PRECISIONS", "GRAD_DTYPES", "WEIGHT_DTYPES", "ConfigError", "LoopConfig",
           "check_process_group", "field_help"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _word_or_count(words: tuple[str, ...], expected: str) -> Callable[[str], int | str]:
    """A flag's parser for a value that is one of `words` or a whole number (argparse's error says `expected`)."""
    def parse(text: str) -> int | str:
        if text in words:
            return text
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    return parse


def _trackers(report_to) -> list[str]:
    return [name.strip() for name in str(report_to).split(",") if name.strip()]


def _valid_report_to(report_to) -> bool:
    trackers = _trackers(report_to)
    return bool(trackers) and all(name in ("none", *TRACKERS) for name in trackers)


@dataclass(kw_only=True)
class LoopConfig(LoopLevers):
    """Configuration of a `Loop` run: the loop's levers (`LoopLevers`) and the run's options.

    Invalid values raise `ConfigError` naming the fields.
    """

    # --- schedule ---
    epochs: int = option(1, flag="--epochs", minimum=1, help="passes over the training data")
    max_steps: int = option(-1, flag="--max-steps", check=lambda steps: _is_int(steps) and (steps > 0 or steps == -1),
                            must="a positive number of updates or -1 for 'no limit'",
                            help="stop after this many optimizer updates (-1: run all epochs)")
    seed: int = option(42, flag="--seed", check=lambda seed: _is_int(seed) and 0 <= seed < 2**32,
                       must="an integer from 0 to 2**32 - 1",
                       help="seeds python, numpy and torch before the model sees data")
    unfreeze_every: int | str | None = option(
        None, flag="--unfreeze-schedule", metavar="N|epoch",
        parse=_word_or_count(("epoch",), "'epoch' or a number of optimizer updates per stage"),
        check=lambda every: every is None or valid_every(every),
        must="None, 'epoch' or a positive number of optimizer updates",
        help="gradual unfreezing: train the head alone, then one more block from the top every N updates (or every "
             "epoch), the embeddings last (docs/freezing.md)")
    # --- stability (precision, checkpointing, the fused step and bf16 weights: LoopLevers) ---
    max_grad_norm: float | None = option(
        1.0, flag="--max-grad-norm", group="memory/speed", check=lambda norm: norm is None or norm > 0,
        must="> 0, or None to disable clipping", help="clip gradients to this norm after unscaling (None: off)")
    clip_mode: str = option("auto", flag="--clip-mode", group="memory/speed", choices=CLIP_MODES,
                            help="global | per_parameter | previous_global; auto = global, or per_parameter with "
                                 "optimizer_in_backward")
    # --- device ---
    device: str = option("auto", flag="--device", check=lambda device: isinstance(device, str) and bool(device),
                         must="a string like 'auto', 'cpu' or 'cuda'",
                         help="auto (cuda when present, else cpu), cpu, cuda, cuda:1, ...")
    # --- logging, evaluation, checkpoints ---
    log_every: int = option(10, flag="--log-every", minimum=1, group="evaluation/state",
                            help="optimizer updates between log lines")
    progress_bar: bool = option(True, help="tqdm bar on a terminal; plain log lines otherwise")
    eval_every: int | str = option(
        "epoch", flag="--eval-every", group="evaluation/state",
        parse=_word_or_count(("epoch", "no"), "'epoch', 'no' or a number of updates"),
        check=lambda every: every in ("epoch", "no") or (_is_int(every) and every >= 1),
        must="'epoch', 'no' or a positive number of updates", help='"epoch", N optimizer updates, or "no"')
    output_dir: str | None = option(None, flag="--output-dir", group="inputs",
                                    help="metrics.jsonl, checkpoints and summary.json go here (None: write nothing)")
    save_total_limit: int | None = option(
        None, flag="--save-total-limit", group="evaluation/state", check=lambda limit: limit is None or limit >= 1,
        must=">= 1, or None to keep every checkpoint",
        help="keep this many newest checkpoints, plus the best (None: keep all)")
    metric_for_best: str | None = option(
        None, flag="--metric-for-best", group="evaluation/state",
        check=lambda metric: metric is None or (isinstance(metric, str) and bool(metric)),
        must="a metric name such as 'f1' or 'loss', or None",
        help="eval metric that picks the best checkpoint (None: f1 when evaluated, else loss)")
    greater_is_better: bool | None = option(
        None, help="direction of metric_for_best (None: lower for loss/perplexity/error names)")
    load_best_at_end: bool = option(False, flag="--load-best-at-end", group="evaluation/state",
                                    help="reload the best checkpoint's weights when training ends")
    resume: str | None = option(None, flag="--resume", group="evaluation/state",
                                help='"auto" (continue the run in output_dir, if it is this run) or a checkpoint '
                                     "directory (forced)")
    overwrite: bool = option(False, flag="--overwrite", group="evaluation/state",
                             help="a fresh run into an output_dir holding another run moves that run aside (never "
                                  "deletes it)")
    run_identity: dict = option(default_factory=dict,
                                help="besides the schedule and seed, what makes this the same run (the CLI: model, "
                                     "data files)")
    max_bad_windows: int = option(5, flag="--max-bad-windows", minimum=1,
                                  help="stop after this many consecutive windows with a non-finite loss or gradient")
    auto_batch: bool = option(False, flag="--auto-batch", group="memory/speed",
                              help="on out-of-memory, halve the micro-batch and double accumulation, then retry")
    track_memory: bool = option(True, help="CPU: count every tensor for an exact peak and breakdown (slower); False: "
                                           "RSS only")
    track_every_update: bool = option(
        False, help="with track_memory: also updates whose micro-batches a tracked one's cover (their peak cannot "
                    "rise; a model whose memory depends on the data: True)")
    measure_mfu: bool = option(
        True, check=lambda measure: isinstance(measure, bool), must="True or False",
        help="model FLOP utilisation in the summary and log lines: times this device's matmul peak once at the "
             "start (about a second, then cached on disk)")
    report_to: str = option("none", flag="--report-to", group="evaluation/state", check=_valid_report_to,
                            must=f"'none' or comma-separated names from {', '.join(TRACKERS)}",
                            help="experiment trackers besides metrics.jsonl: none, or tensorboard, wandb and mlflow "
                                 "(comma-separated, or the flag repeated; each an optional package, docs/finetune.md)")
    extra: dict = option(default_factory=dict,
                         help="free-form values recorded in summary.json (e.g. CLI options)")

    @classmethod
    def from_strategy(cls, strategy: LoopLevers, **options) -> LoopConfig:
        """The LoopConfig of a `Strategy`'s loop levers plus the run's `options` (an invalid mix raises ConfigError)."""
        return cls(**strategy.loop_fields(), **options)

    def __post_init__(self) -> None:
        problems = self.lever_problems()  # every single value, levers and options alike
        for check in COMBINATION_CHECKS:
            problems.extend(check(self))
        if not problems:
            problems.extend(_device_problems(self.device, self.compute_precision))
        if problems:
            raise ConfigError("Invalid LoopConfig:\n  - " + "\n  - ".join(problems))

    def best_mode_for(self, metric_name: str) -> str:
        """"max" or "min" for the best-checkpoint metric: `greater_is_better`, else by its name."""
        if self.greater_is_better is not None:
            return "max" if self.greater_is_better else "min"
        return default_mode(metric_name)

    @property
    def compute_precision(self) -> str:
        """The autocast precision asked for: `precision`, except that bf16 weights compute in bf16.

        With `weights="bf16"` the forward runs under bf16 autocast whether `precision` is fp32 or
        auto: the weights are bf16 already (autocast makes no copies of them), and autocast keeps the
        loss (cross-entropy) and any fp32 parameter's ops well-defined.
        """
        return "bf16" if self.weights == "bf16" else self.precision

    @property
    def effective_clip_mode(self) -> str:
        """The clip mode in force once `auto` is resolved."""
        if self.clip_mode != "auto":
            return self.clip_mode
        return "per_parameter" if self.optimizer_in_backward else "global"

    def identity(self) -> dict:
        """What makes a run the same run: its schedule and seed, plus `run_identity` (see `looptrain.ledger`)."""
        identity = {"accum_steps": self.accum_steps, "epochs": self.epochs, "max_steps": self.max_steps,
                    "seed": self.seed}
        if self.unfreeze_every is not None:  # which parameters train at each step
            identity["unfreeze_every"] = self.unfreeze_every
        # What changes the update's math or the checkpoint's state layout, named when not the default (so a run
        # saved before these were part of the identity still matches itself).
        if self.weights != "fp32":
            identity.update(weights=self.weights, grad_dtype=self.grad_dtype,
                            stochastic_rounding=self.stochastic_rounding)
        if self.optimizer_in_backward:
            identity["optimizer_in_backward"] = True
        return {**identity, **self.run_identity}

    def to_dict(self) -> dict:
        """A JSON-ready copy of every field."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- the combinations, each said once
def _checkpoint_every_problems(config: LoopConfig) -> list[str]:
    if _is_int(config.checkpoint_every) and config.checkpoint_every > 1 and not config.gradient_checkpointing:
        return ["checkpoint_every > 1 chooses which blocks gradient checkpointing recomputes: "
                "set gradient_checkpointing=True (--grad-checkpoint) too"]
    return []


def _report_to_problems(config: LoopConfig) -> list[str]:
    trackers = _trackers(config.report_to)
    if not _valid_report_to(config.report_to):
        return []  # named by the field's own check
    if config.output_dir is None and "none" not in trackers:
        return [f"report_to={config.report_to!r} writes its files under output_dir: set output_dir"]
    # Checked now, not as training begins after the model and data have loaded.
    return [problem for name in tracker_names(config.report_to) if (problem := missing_package(name))]


def _fused_step_problems(config: LoopConfig) -> list[str]:
    """What optimizer_in_backward (the step inside backward) cannot be combined with, and the clip modes it needs."""
    if not config.optimizer_in_backward:
        if config.clip_mode in ("per_parameter", "previous_global"):
            return [f"clip_mode={config.clip_mode!r} only applies with optimizer_in_backward=True; "
                    "use clip_mode='global' (or 'auto')"]
        return []
    problems = []
    if config.accum_steps > 1:
        problems.append("optimizer_in_backward=True cannot be combined with accum_steps > 1: the fused step "
                        "updates each parameter during backward, so gradients are never accumulated; "
                        "raise the micro-batch size instead, or turn optimizer_in_backward off")
    if config.precision == "fp16":
        problems.append("optimizer_in_backward=True cannot be combined with precision='fp16': the GradScaler must "
                        "see every gradient before any parameter steps; use precision='bf16' (no scaler needed)")
    if config.precision == "auto" and _auto_means_fp16(config.device):
        problems.append("optimizer_in_backward=True cannot be combined with precision='auto' on this device, where it "
                        "means fp16 with a GradScaler; use precision='bf16' or 'fp32'")
    if config.clip_mode == "global" and config.max_grad_norm is not None:
        problems.append("clip_mode='global' needs every gradient at once, which optimizer_in_backward=True never "
                        "holds; use clip_mode='per_parameter' or 'previous_global' (or 'auto'), or max_grad_norm=None")
    return problems


def _head_step_problems(config: LoopConfig) -> list[str]:
    """step_by_rows steps weights by rows inside backward: the fused step's, the head's from the chunked CE."""
    if not config.step_by_rows:
        return []
    problems = []
    if not config.optimizer_in_backward:
        problems.append("step_by_rows=True steps weights by rows inside backward: set "
                        "optimizer_in_backward=True too (--optim-in-backward; no accumulation)")
    if config.chunked_ce == "off":
        problems.append("step_by_rows=True steps the head from the chunked cross-entropy's backward: "
                        "set chunked_ce to 'auto' or 'on'")
    if config.compile:
        problems.append("step_by_rows=True needs the chunked cross-entropy, which --compile turns off: "
                        "turn one of them off")
    return problems


def _accumulating_problems(config: LoopConfig) -> list[str]:
    """The options that split a batch into an accumulation window, which the fused step cannot accumulate."""
    problems = []
    if config.micro_batch_tokens and config.optimizer_in_backward:
        problems.append("micro_batch_tokens cuts a batch into micro-batches that accumulate, which "
                        "optimizer_in_backward=True cannot do (it steps in every backward); turn one of them off")
    if config.auto_batch and config.optimizer_in_backward:
        problems.append("auto_batch=True splits a micro-batch into an accumulation window, which "
                        "optimizer_in_backward=True cannot accumulate; lower the batch size instead")
    return problems


def _output_dir_problems(config: LoopConfig) -> list[str]:
    """What needs an output directory, evaluations, or one of resume and overwrite."""
    problems = []
    if config.load_best_at_end and config.output_dir is None:
        problems.append("load_best_at_end=True needs output_dir: the best checkpoint is saved there")
    if config.load_best_at_end and config.eval_every == "no":
        problems.append("load_best_at_end=True needs evaluations to pick the best: set eval_every to 'epoch' or N")
    if config.resume == "auto" and config.output_dir is None:
        problems.append("resume='auto' looks for checkpoints in output_dir: set output_dir")
    if config.overwrite and config.resume is not None:
        problems.append("overwrite=True starts a fresh run, resume continues one: pass one of them (--overwrite, "
                        "--resume)")
    if not isinstance(config.run_identity, dict):
        problems.append(f"run_identity must be a dict of JSON values (got {type(config.run_identity).__name__})")
    return problems


def _weights_problems(config: LoopConfig) -> list:
    """What is wrong with the weights / stochastic_rounding / grad_dtype combination."""
    if config.weights not in WEIGHT_DTYPES or config.grad_dtype not in GRAD_DTYPES:
        return []  # named by lever_problems
    if config.weights == "fp32":
        problems = []
        if not config.stochastic_rounding:
            problems.append(
                "stochastic_rounding=False only applies with weights='bf16' (fp32 weights are never rounded)"
            )
        if config.grad_dtype != "bf16":
            problems.append("grad_dtype only applies with weights='bf16' (fp32 weights have fp32 gradients)")
        return problems
    problems = []
    if config.precision == "fp16" or (config.precision == "auto" and _auto_means_fp16(config.device)):
        problems.append("weights='bf16' computes in bf16 and cannot run fp16 autocast with a GradScaler; "
                        "use precision='bf16' (or leave it at 'fp32': bf16 weights compute in bf16)")
    if config.grad_dtype == "fp32" and config.optimizer_in_backward:
        problems.append("grad_dtype='fp32' chooses the dtype gradients accumulate in, and optimizer_in_backward=True "
                        "steps each gradient as soon as it exists; leave grad_dtype at 'bf16'")
    return problems


def _compile_problems(config: LoopConfig) -> list[str]:
    return compile_problems(config, cpu=_on_cpu(config.device))


# The combinations of fields a LoopConfig checks (single values are checked by their declarations), in order.
COMBINATION_CHECKS: tuple[Callable[[LoopConfig], list[str]], ...] = (
    _checkpoint_every_problems, _report_to_problems, _fused_step_problems, _head_step_problems, _weights_problems,
    _accumulating_problems, _output_dir_problems, _compile_problems)


def check_process_group(
    config: LoopConfig, world_size: int, *, sharded: bool, optimizer_name: str | None = None
) -> None:
    """The checks that depend on the process group (torchrun), as `ConfigError` naming the options.

    Args:
        config: the run's configuration.
        world_size: processes in the job (1 outside torchrun).
        sharded: the model is (or will be) sharded with FSDP2.
        optimizer_name: the optimizer's `looptrain.optim` name, or None when unknown.
    """
    problems = []
    if world_size > 1:
        if config.optimizer_in_backward:
            problems.append(
                "optimizer_in_backward=True cannot run with several processes: each parameter would "
                "step on its local gradient before the all-reduce; turn it off for multi-process runs"
            )
        if config.auto_batch:
            problems.append(
                "auto_batch=True cannot run with several processes: one rank would retry a window while the "
                "others wait in its all-reduce; set the micro-batch size by hand (--batch-size, --accum)"
            )
        if config.micro_batch_tokens:
            problems.append(
                "micro_batch_tokens cannot run with several processes: each rank would cut its batch into a "
                "different number of micro-batches, and DDP / FSDP2 need the same forwards on every rank; set the "
                "micro-batch size by hand (--batch-size, --accum)"
            )
        if config.unfreeze_every is not None:
            problems.append(
                "unfreeze_every (gradual unfreezing) cannot run with several processes: DDP fixes the set of "
                "parameters it reduces when it wraps the model; unfreeze by hand between runs instead"
            )
    if world_size > 1 and config.weights == "bf16" and config.grad_dtype == "fp32":
        problems.append("grad_dtype='fp32' moves each gradient into an fp32 buffer during backward, before DDP "
                        "reduces it; use grad_dtype='bf16' for multi-process runs")
    if sharded:
        if config.weights == "bf16":
            problems.append("weights='bf16' is not supported with FSDP2 sharding: use FSDP2's own mixed precision "
                            "(precision='bf16') with fp32 weights")
        if world_size < 2:
            problems.append("FSDP2 sharding (--fsdp) needs several processes: launch with torchrun --nproc_per_node N")
        if config.precision == "fp16":
            problems.append("precision='fp16' is not supported with FSDP2 sharding: use precision='bf16'")
        if optimizer_name is not None and optimizer_name in ("adamw8bit", "paged_adamw8bit"):
            problems.append(f"--fsdp does not support --optim {optimizer_name} (bitsandbytes cannot step sharded "
                            "parameters); use --optim adamw or adafactor")
    if problems:
        raise ConfigError("Invalid LoopConfig for this process group:\n  - " + "\n  - ".join(problems))


def _auto_means_fp16(device_name: str) -> bool:
    from looptrain.precision import amp_precision

    try:
        device = resolve_device(device_name)
        return device.type != "cpu" and amp_precision(device)[0] == "fp16"  # a CPU's --amp is bf16 or fp32
    except ValueError:
        return False


def _on_cpu(device_name: str) -> bool:
    try:
        return resolve_device(device_name).type == "cpu"
    except (TypeError, ValueError):
        return False  # named by _device_problems


def _device_problems(device_name: str, precision: str) -> list:
    try:
        device = resolve_device(device_name)
    except ValueError as error:
        return [str(error)]
    problem = precision_problem(device, precision)
    return [problem] if problem else []


def field_help() -> dict:
    """Each run option's help, as declared with `option` (and each loop lever's, as declared with `lever`)."""
    from looptrain.strategy import declaration, declared

    return {spec.name: declaration(spec)["help"] for spec in declared(LoopConfig)}
