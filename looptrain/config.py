"""`LoopConfig`: the loop's part of a strategy plus every option of a run, and the one place it is validated.

The memory/speed levers the Loop carries out are declared once, in `looptrain.strategy.LoopLevers`, which
`LoopConfig` inherits (`LoopConfig.from_strategy` builds one from a whole `Strategy`). The run's own options
are declared here; the command line (`looptrain-finetune`) generates its flags from both, so their defaults
and one-line comments are the only source of defaults and help text. Option combinations are checked here
once: in `__post_init__`, and against the process group by `check_process_group` (called by the `Loop`,
and by the command line before any model loads).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

from looptrain.checkpoint import default_mode
from looptrain.compilation import compile_problems
from looptrain.optim.in_backward import CLIP_MODES as FUSED_CLIP_MODES
from looptrain.precision import precision_problem, resolve_device
from looptrain.run_log import TRACKERS
from looptrain.strategy import CONFIG_PRECISIONS, GRAD_DTYPES, WEIGHT_DTYPES, ConfigError, LoopLevers
from looptrain.unfreeze import valid_every

CLIP_MODES = ("auto", "global", *FUSED_CLIP_MODES)  # the fused step's own modes come from optim
__all__ = ["CLIP_MODES", "CONFIG_PRECISIONS", "GRAD_DTYPES", "WEIGHT_DTYPES", "ConfigError", "LoopConfig",
           "check_process_group", "field_help"]


@dataclass(kw_only=True)
class LoopConfig(LoopLevers):
    """Configuration of a `Loop` run: the loop's levers (`LoopLevers`) and the run's options.

    Invalid values raise `ConfigError` naming the fields.
    """

    # --- schedule ---
    epochs: int = 1  # passes over the training data
    max_steps: int = -1  # stop after this many optimizer updates (-1: run all epochs)
    seed: int = 42  # seeds python, numpy and torch before the model sees data
    unfreeze_every: int | str | None = None  # gradual unfreezing: head first, one more block from the top
                                             # every N updates or "epoch"
    # --- stability (precision, checkpointing, the fused step and bf16 weights: LoopLevers) ---
    max_grad_norm: float | None = 1.0  # clip gradients to this norm after unscaling (None: off)
    clip_mode: str = "auto"  # global | per_parameter | previous_global; auto = global, or per_parameter with
                             # optimizer_in_backward
    # --- device ---
    device: str = "auto"  # auto (cuda when present, else cpu), cpu, cuda, cuda:1, ...
    # --- logging, evaluation, checkpoints ---
    log_every: int = 10  # optimizer updates between log lines
    progress_bar: bool = True  # tqdm bar on a terminal; plain log lines otherwise
    eval_every: int | str = "epoch"  # "epoch", N optimizer updates, or "no"
    output_dir: str | None = None  # metrics.jsonl, checkpoints and summary.json go here (None: write nothing)
    save_total_limit: int | None = None  # keep this many newest checkpoints, plus the best (None: keep all)
    metric_for_best: str | None = None  # eval metric that picks the best checkpoint (None: f1 when evaluated,
                                        # else loss)
    greater_is_better: bool | None = None  # direction of metric_for_best (None: lower for loss/perplexity/error names)
    load_best_at_end: bool = False  # reload the best checkpoint's weights when training ends
    resume: str | None = None  # "auto" (continue the run in output_dir, if it is this run) or a checkpoint
                               # directory (forced)
    overwrite: bool = False  # a fresh run into an output_dir holding another run moves that run aside
                             # (never deletes it)
    run_identity: dict = field(default_factory=dict)  # besides the schedule and seed, what makes this the same
                                                      # run (the CLI: model, data files)
    max_bad_windows: int = 5  # stop after this many consecutive windows with a non-finite loss or gradient
    auto_batch: bool = False  # on out-of-memory, halve the micro-batch and double accumulation, then retry
    track_memory: bool = True  # CPU: count every tensor for an exact peak and breakdown (slower); False: RSS only
    track_every_update: bool = False  # with track_memory: also updates whose micro-batches a tracked one's cover
                                      # (their peak cannot rise; a model whose memory depends on the data: True)
    measure_mfu: bool = True  # model FLOP utilisation in the summary and log lines: times this device's matmul
                              # peak once at the start (about a second, then cached on disk)
    report_to: str = "none"  # experiment trackers besides metrics.jsonl: none or tensorboard (comma-separated)
    extra: dict = field(default_factory=dict)  # free-form values recorded in summary.json (e.g. CLI options)

    @classmethod
    def from_strategy(cls, strategy: LoopLevers, **options) -> LoopConfig:
        """The LoopConfig of a `Strategy`'s loop levers plus the run's `options` (an invalid mix raises ConfigError)."""
        return cls(**strategy.loop_fields(), **options)

    def __post_init__(self) -> None:
        problems = self.lever_problems()
        if self.epochs < 1:
            problems.append(f"epochs must be >= 1 (got {self.epochs})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            problems.append(f"seed must be an integer from 0 to 2**32 - 1 (got {self.seed!r})")
        if self.max_steps == 0 or self.max_steps < -1:
            problems.append(
                f"max_steps must be a positive number of updates or -1 for 'no limit' (got {self.max_steps})"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            problems.append(f"max_grad_norm must be > 0, or None to disable clipping (got {self.max_grad_norm})")
        if isinstance(self.checkpoint_every, int) and self.checkpoint_every > 1 and not self.gradient_checkpointing:
            problems.append("checkpoint_every > 1 chooses which blocks gradient checkpointing recomputes: "
                            "set gradient_checkpointing=True (--grad-checkpoint) too")
        if self.clip_mode not in CLIP_MODES:
            problems.append(f"clip_mode must be one of {', '.join(CLIP_MODES)} (got {self.clip_mode!r})")
        if self.log_every < 1:
            problems.append(f"log_every must be >= 1 (got {self.log_every})")
        if not _valid_eval_every(self.eval_every):
            problems.append(
                f"eval_every must be 'epoch', 'no' or a positive number of updates (got {self.eval_every!r})"
            )
        if self.save_total_limit is not None and self.save_total_limit < 1:
            problems.append(
                f"save_total_limit must be >= 1, or None to keep every checkpoint (got {self.save_total_limit})"
            )
        if self.metric_for_best is not None and (not isinstance(self.metric_for_best, str) or not self.metric_for_best):
            problems.append(
                f"metric_for_best must be a metric name such as 'f1' or 'loss', or None "
                f"(got {self.metric_for_best!r})"
            )
        trackers = [name.strip() for name in str(self.report_to).split(",") if name.strip()]
        unknown = [name for name in trackers if name not in ("none", *TRACKERS)]
        if unknown or not trackers:
            problems.append(
                f"report_to must be 'none' or comma-separated names from {', '.join(TRACKERS)} "
                f"(got {self.report_to!r})"
            )
        elif self.output_dir is None and "none" not in trackers:
            problems.append(f"report_to={self.report_to!r} writes its files under output_dir: set output_dir")
        elif "tensorboard" in trackers and importlib.util.find_spec("tensorboard") is None:
            # Checked now, not at the first log line after minutes of training.
            problems.append("report_to='tensorboard' needs the tensorboard package: pip install tensorboard "
                            "(or pip install 'looptrain[tensorboard]')")
        if self.optimizer_in_backward:
            if self.accum_steps > 1:
                problems.append(
                    "optimizer_in_backward=True cannot be combined with accum_steps > 1: the fused step "
                    "updates each parameter during backward, so gradients are never accumulated; "
                    "raise the micro-batch size instead, or turn optimizer_in_backward off"
                )
            if self.precision == "fp16":
                problems.append(
                    "optimizer_in_backward=True cannot be combined with precision='fp16': the GradScaler must "
                    "see every gradient before any parameter steps; use precision='bf16' (no scaler needed)"
                )
            if self.precision == "auto" and _auto_means_fp16(self.device):
                problems.append(
                    "optimizer_in_backward=True cannot be combined with precision='auto' on this device, where it "
                    "means fp16 with a GradScaler; use precision='bf16' or 'fp32'"
                )
            if self.clip_mode == "global" and self.max_grad_norm is not None:
                problems.append(
                    "clip_mode='global' needs every gradient at once, which optimizer_in_backward=True never "
                    "holds; use clip_mode='per_parameter' or 'previous_global' (or 'auto'), or max_grad_norm=None"
                )
        elif self.clip_mode in ("per_parameter", "previous_global"):
            problems.append(
                f"clip_mode={self.clip_mode!r} only applies with optimizer_in_backward=True; "
                "use clip_mode='global' (or 'auto')"
            )
        problems.extend(_weights_problems(self))
        every = self.unfreeze_every
        if every is not None and not valid_every(every):
            problems.append(
                f"unfreeze_every must be None, 'epoch' or a positive number of optimizer updates (got {every!r})"
            )
        if not isinstance(self.measure_mfu, bool):
            problems.append(f"measure_mfu must be True or False (got {self.measure_mfu!r})")
        if self.max_bad_windows < 1:
            problems.append(f"max_bad_windows must be >= 1 (got {self.max_bad_windows})")
        if self.micro_batch_tokens and self.optimizer_in_backward:
            problems.append(
                "micro_batch_tokens cuts a batch into micro-batches that accumulate, which optimizer_in_backward=True "
                "cannot do (it steps in every backward); turn one of them off"
            )
        if self.auto_batch and self.optimizer_in_backward:
            problems.append(
                "auto_batch=True splits a micro-batch into an accumulation window, which "
                "optimizer_in_backward=True cannot accumulate; lower the batch size instead"
            )
        if self.load_best_at_end and self.output_dir is None:
            problems.append("load_best_at_end=True needs output_dir: the best checkpoint is saved there")
        if self.load_best_at_end and self.eval_every == "no":
            problems.append("load_best_at_end=True needs evaluations to pick the best: set eval_every to 'epoch' or N")
        if self.resume is not None and self.output_dir is None and self.resume == "auto":
            problems.append("resume='auto' looks for checkpoints in output_dir: set output_dir")
        if self.overwrite and self.resume is not None:
            problems.append(
                "overwrite=True starts a fresh run, resume continues one: pass one of them (--overwrite, --resume)"
            )
        if not isinstance(self.run_identity, dict):
            problems.append(f"run_identity must be a dict of JSON values (got {type(self.run_identity).__name__})")
        if not self.device or not isinstance(self.device, str):
            problems.append(f"device must be a string like 'auto', 'cpu' or 'cuda' (got {self.device!r})")
        problems.extend(compile_problems(self, cpu=_on_cpu(self.device)))
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


def _auto_means_fp16(device_name: str) -> bool:
    from looptrain.precision import amp_precision

    try:
        return amp_precision(resolve_device(device_name))[0] == "fp16"
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


def _valid_eval_every(value) -> bool:
    if value in ("epoch", "no"):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def field_help() -> dict:
    """Each field's comment in the class body, for help texts (empty when no source is available).

    A comment that does not fit on the field's line goes on in comment lines indented past the field.
    """
    import inspect
    import re

    try:
        source = inspect.getsource(LoopConfig)
    except (OSError, TypeError):
        return {}
    pattern = re.compile(r"^(\s+)(\w+): [^=]+=.*?#\s*(.+)$")
    continuation = re.compile(r"^(\s+)#\s*(.+)$")  # a comment line indented past the field: the comment goes on
    helps: dict = {}
    field_indent, name = None, None
    for line in source.splitlines():
        match = pattern.match(line)
        if match:
            field_indent, name = len(match.group(1)), match.group(2)
            helps[name] = match.group(3).strip()
            continue
        more = continuation.match(line)
        if more and name is not None and len(more.group(1)) > field_indent:
            helps[name] += " " + more.group(2).strip()
        else:
            name = None
    return helps
