"""`Strategy`: how a run spends memory and time, described once.

Every lever is one dataclass field declared with `lever(...)`, whose metadata says its command-line
flag, its help, the values it takes and who carries it out (`applied_by`):

- ``loop``: the `Loop` (precision, checkpointing, the fused step, bf16 weights, accumulation, chunked
  cross-entropy, torch.compile). These fields live in `LoopLevers`, which both `Strategy` and `LoopConfig`
  inherit: a `LoopConfig` *is* the loop's part of a strategy plus the run's own options.
- ``model``: applied to the model before the Loop sees it (`Strategy.prepare_model`: freezing;
  `Strategy.wrap_model`: LoRA adapters through peft).
- ``optimizer``: the optimizer the strategy builds (`Strategy.build_optimizer`).
- ``batches``: the loaders (the micro-batch size, padding, length grouping).

From that one declaration, and nothing else:

- the flags of both command lines (`looptrain-finetune` and `python -m looptrain.memory`) are generated
  by `add_arguments`, and a parsed command line becomes a strategy with `from_arguments`;
- the estimator (`looptrain.estimation.estimate`) takes a `Strategy` (or its fields as keywords) and
  prices every lever that is not ``batches``;
- the planner's candidates are `Strategy` instances (`dataclasses.replace` of the user's), and
  `Strategy.flags` is the command line that trains one.

Adding a lever is one field here (or in `LoopLevers` when the Loop applies it) plus its
implementation; docs/architecture.md walks through it, and tests/test_strategy.py proves it with a lever
declared only in the test.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from looptrain.errors import ConfigError
from looptrain.optim import OPTIMIZER_NAMES, optimizer_options_problem
from looptrain.optim.bf16 import GRAD_DTYPES
from looptrain.precision import PRECISIONS

APPLIED_BY = ("loop", "model", "optimizer", "batches")
CONFIG_PRECISIONS = (*PRECISIONS, "auto")
WEIGHT_DTYPES = ("fp32", "bf16")
PADDINGS = ("dynamic", "max_length")
CHUNKED_CE_MODES = ("auto", "on", "off")
BATCH_PACKINGS = ("auto", "on", "off")


def lever(default: Any, *, flag: str, help: str, applied_by: str = "loop", choices: tuple | None = None,
          minimum: int | None = None, const: Any = None, metavar: str | None = None,
          group: str = "memory/speed") -> Any:
    """A strategy field: its default and the metadata that makes it a flag, a check and an estimate option.

    Args:
        default: the field's default (also the flag's).
        flag: the command-line flag. A bool field whose default is True gets a ``--no-...`` flag that turns it
            off; a field with `const` gets a flag that sets `const` (``--no-foreach`` sets ``foreach=False``).
        help: the flag's help, one sentence.
        applied_by: who carries the lever out, one of `APPLIED_BY`.
        choices: the values it takes (checked by `Strategy` / `LoopConfig`, offered by the flag).
        minimum: the smallest integer it takes.
        const: the value a valueless flag sets.
        metavar: the flag's value name in --help.
        group: the --help section of `looptrain-finetune`.
    """
    if applied_by not in APPLIED_BY:
        raise ValueError(f"applied_by must be one of {', '.join(APPLIED_BY)} (got {applied_by!r})")
    metadata = {"flag": flag, "help": help, "applied_by": applied_by, "choices": choices, "minimum": minimum,
                "const": const, "metavar": metavar, "group": group}
    return field(default=default, metadata={"lever": metadata})


def option(default: Any = dataclasses.MISSING, *, help: str, flag: str | None = None, choices: tuple | None = None,
           minimum: int | None = None, check: Callable[[Any], bool] | None = None, must: str | None = None,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None, group: str = "training",
           default_factory: Callable[[], Any] | Any = dataclasses.MISSING) -> Any:
    """A run option of `LoopConfig` (not a lever: it does not change what a step costs), declared like `lever`.

    Its check is said once, here, in field names (`declared_problems`); the command line translates the names to
    flags in one place (`flag_names`).

    Args:
        default: the field's default (also the flag's); `default_factory` for a mutable one.
        help: what the option does, one sentence: the flag's help and the option's documentation.
        flag: the command-line flag of `looptrain-finetune`; None: Python only.
        choices: the values it takes.
        minimum: the smallest integer it takes.
        check: a test of a single value (True: valid) beyond `choices` and `minimum`; `must` says what it asks for
            (the problem reads "<field> must be <must> (got <value>)").
        must: see `check`.
        parse: the flag's argparse type, where the field's annotation does not say how to read it.
        metavar: the flag's value name in --help.
        group: the --help section of `looptrain-finetune`.
    """
    metadata = {"flag": flag, "help": help, "choices": choices, "minimum": minimum, "check": check, "must": must,
                "parse": parse, "const": None, "metavar": metavar, "group": group}
    return field(default=default, default_factory=default_factory, metadata={"option": metadata})


def declaration(spec: dataclasses.Field) -> dict:
    """The metadata a field was declared with (`lever` or `option`)."""
    return spec.metadata.get("lever") or spec.metadata["option"]


def declared(cls: type) -> list[dataclasses.Field]:
    """Every field of `cls` declared with `lever` or `option`, in declaration order."""
    return [spec for spec in dataclasses.fields(cls) if "lever" in spec.metadata or "option" in spec.metadata]


def declared_problems(instance: Any) -> list[str]:
    """What is wrong with single values of the declared fields (choices, minimums, checks), one line per field."""
    problems = []
    for spec in declared(type(instance)):
        value, meta = getattr(instance, spec.name), declaration(spec)
        if meta["choices"] is not None and value not in meta["choices"]:
            problems.append(f"{spec.name} must be one of {', '.join(map(str, meta['choices']))} (got {value!r})")
        elif meta["minimum"] is not None and isinstance(spec.default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < meta["minimum"]:
                problems.append(f"{spec.name} must be a number >= {meta['minimum']} (got {value!r})")
        elif meta["minimum"] is not None and (isinstance(value, bool) or not isinstance(value, int)
                                              or value < meta["minimum"]):
            problems.append(f"{spec.name} must be >= {meta['minimum']} (got {value!r})")
        elif meta.get("check") is not None and not meta["check"](value):
            problems.append(f"{spec.name} must be {meta['must']} (got {value!r})")
    return problems


def flag_names(*classes: type) -> dict[str, str]:
    """Field name -> command-line flag, for every declared field of `classes` that has a flag: the one translation
    of the names checks speak in (fields) into the names a command line speaks in (flags)."""
    return {spec.name: declaration(spec)["flag"] for cls in classes for spec in declared(cls)
            if declaration(spec)["flag"]}


@dataclass(kw_only=True)
class LoopLevers:
    """The levers the `Loop` carries out: the part of a `Strategy` a `LoopConfig` holds."""

    accum_steps: int = lever(1, flag="--accum", minimum=1, group="training",
                             help="micro-batches per optimizer update (gradient accumulation): the effective batch is "
                                  "--batch-size x --accum")
    micro_batch_tokens: int = lever(0, flag="--micro-batch-tokens", minimum=0, group="training",
                                    help="cut each batch, longest rows first, into micro-batches of at most this many "
                                         "padded tokens (rows x the piece's longest row) that accumulate exactly: "
                                         "short rows run many to a micro-batch, long ones few; 0: off")
    precision: str = lever("fp32", flag="--precision", choices=CONFIG_PRECISIONS,
                           help="autocast dtype: fp32 (off), bf16, fp16 (with a GradScaler), or auto (what is fast on "
                                "this device)")
    gradient_checkpointing: bool = lever(False, flag="--grad-checkpoint",
                                         help="recompute activations in backward: less memory, ~30%% more time")
    checkpoint_every: int = lever(1, flag="--grad-checkpoint-every", minimum=1,
                                  help="with --grad-checkpoint: checkpoint every k-th block (1: all; 2: every other "
                                       "one)")
    optimizer_in_backward: bool = lever(False, flag="--optim-in-backward",
                                        help="step each parameter inside backward and free its grad at once (no "
                                             "accumulation)")
    weights: str = lever("fp32", flag="--weights", choices=WEIGHT_DTYPES,
                         help="parameter storage: fp32, or bf16 (2 B/param, no fp32 master copy: updates in fp32, "
                              "rounded back stochastically; computes in bf16)")
    stochastic_rounding: bool = lever(True, flag="--no-stochastic-rounding",
                                      help="with --weights bf16: round updates to nearest instead of stochastically "
                                           "(the control: updates below bf16's resolution vanish)")
    grad_dtype: str = lever("bf16", flag="--grad-dtype", choices=GRAD_DTYPES,
                            help="with --weights bf16: gradients accumulate in bf16 (2 B/param) or fp32 (4 B/param, "
                                 "for long accumulation windows)")
    chunked_ce: str = lever("auto", flag="--chunked-ce", choices=CHUNKED_CE_MODES,
                            help="causal LMs: the LM head and cross-entropy in tiles of the vocabulary, so the "
                                 "[tokens x vocab] logits never exist (same loss and gradients); auto: on for causal "
                                 "LMs whose loss shifts labels, the model's own loss with a notice where it cannot be "
                                 "exact; on: that notice is an error")
    ce_chunk_tokens: int = lever(0, flag="--ce-chunk-tokens", minimum=0,
                                 help="with --chunked-ce: the logits held at once are at most N x vocab (a tile of "
                                      "vocabulary rows for all of a micro-batch's tokens); 0: 8M logits (32 MiB in "
                                      "fp32)")
    step_by_rows: bool = lever(False, flag="--step-by-rows",
                               help="with --optim-in-backward and the chunked cross-entropy: the untied LM head, the "
                                    "input embedding and every linear layer step by chunks of rows inside backward, "
                                    "so none of their weight gradients exists whole (AdamW, SGD, Adafactor)")
    trim_heap: bool = lever(False, flag="--trim-heap",
                            help="CPU, glibc: give the heap's freed pages back to the OS before each micro-batch and "
                                 "each optimizer step (malloc_trim), so that RSS holds one micro-batch's leftovers, "
                                 "not the run's: 2-10%% slower")
    embedding_row_grads: bool = lever(True, flag="--no-embedding-row-grads",
                                      help="CPU: each micro-batch adds only the rows its tokens use into the input "
                                           "embedding's .grad, bitwise the dense gradient, without a vocabulary-sized "
                                           "temporary (fp32, untied; docs/memory.md); this flag turns it off")
    compile: bool = lever(False, flag="--compile",
                          help="torch.compile the model's forward (and its backward): minutes of compiling first, "
                               "then faster updates where it pays (docs/compile.md); dynamic shapes, so varying "
                               "widths do not recompile")

    def lever_problems(self) -> list[str]:
        """What is wrong with single values (choices, minimums, checks), one line per field (`declared_problems`)."""
        return declared_problems(self)

    def loop_fields(self) -> dict:
        """The fields the Loop carries out, as `LoopConfig` keywords."""
        return {spec.name: getattr(self, spec.name) for spec in levers(type(self), applied_by="loop")}

    @property
    def checkpointing(self) -> str:
        """Gradient checkpointing in words: none, all blocks, every k."""
        if not self.gradient_checkpointing:
            return "none"
        return "all blocks" if self.checkpoint_every == 1 else f"every {self.checkpoint_every}"


@dataclass(kw_only=True)
class Strategy(LoopLevers):
    """A run's memory/speed strategy: every lever of looptrain, with its default.

    Invalid single values raise `ConfigError` naming the field; combinations the Loop cannot run are
    checked by `LoopConfig` (`LoopConfig.from_strategy`).
    """

    batch_size: int = lever(8, flag="--batch-size", applied_by="batches", minimum=1, group="training",
                            help="micro-batch size: activation memory grows with it; --accum keeps the effective "
                                 "batch")
    optimizer: str = lever("adamw", flag="--optim", applied_by="optimizer", choices=OPTIMIZER_NAMES,
                           help="adamw: 8 B/param of state; adamw8bit: 2 B/param (embeddings kept 32-bit); "
                                "adafactor: factored, ~0 B/param; sgd: no state (plain SGD)")
    foreach: bool | None = lever(None, flag="--no-foreach", applied_by="optimizer", const=False,
                                 help="AdamW/SGD step one tensor at a time: lower optimizer-step peak, a little "
                                      "slower")
    freeze_embeddings: bool = lever(False, flag="--freeze-embeddings", applied_by="model",
                                    help="freeze the embeddings: no grads or optimizer state for them")
    freeze_layers: int = lever(0, flag="--freeze-layers", applied_by="model", minimum=0, metavar="N",
                               help="freeze the first N transformer blocks (and run them without storing "
                                    "activations)")
    freeze_encoder: bool = lever(False, flag="--freeze-encoder", applied_by="model",
                                 help="train the classification head only (largest saving, lowest accuracy)")
    padding: str = lever("dynamic", flag="--padding", applied_by="batches", choices=PADDINGS,
                         help="dynamic: pad each batch to its longest sequence; max_length: always to --max-length")
    group_by_length: bool = lever(False, flag="--group-by-length", applied_by="batches",
                                  help="batch samples of similar length together (still shuffled): less padding")
    packing: bool = lever(False, flag="--packing", applied_by="batches", group="training",
                          help="causal LMs: pack the samples best-fit decreasing into rows of at most --max-length "
                               "tokens, position_ids restarting at every sample so that no token attends across a "
                               "sample (the same tokens scored, no padding between samples); --batch-size counts "
                               "rows")
    batch_packing: str = lever("auto", flag="--batch-packing", applied_by="batches", group="training",
                               choices=BATCH_PACKINGS,
                               help="causal LMs: on: pack each batch's samples among themselves into rows of at most "
                                    "--max-length tokens (every micro-batch and update holds the samples it holds "
                                    "unpacked: the same math, fewer forwards, less padding); auto: off, or the "
                                    "planner's choice under --memory-budget; off: never")
    lora_rank: int = lever(0, flag="--lora", applied_by="model", minimum=0, metavar="R", group="LoRA",
                           help="train rank-R LoRA adapters (peft) on a frozen base instead of every weight; 0: full "
                                "fine-tune")
    lora_alpha: int = lever(0, flag="--lora-alpha", applied_by="model", minimum=0, group="LoRA",
                            help="with --lora: the adapters' scaling numerator (updates scaled by alpha / R); 0: 2 x R")
    lora_dropout: float = lever(0.0, flag="--lora-dropout", applied_by="model", minimum=0, metavar="P", group="LoRA",
                                help="with --lora: dropout on each adapter's input (0 <= P < 1)")
    lora_targets: str = lever("", flag="--lora-targets", applied_by="model", metavar="NAMES", group="LoRA",
                              help="with --lora: comma-separated module names the adapters wrap (q_proj,v_proj); "
                                   "default: every Linear of the transformer blocks")
    qlora: bool = lever(False, flag="--qlora", applied_by="model", group="LoRA",
                        help="with --lora: the frozen block Linears stored in 4-bit NF4 (bitsandbytes), computed in "
                             "bf16 or fp32")

    def __post_init__(self) -> None:
        problems = self.lever_problems()
        if self.optimizer in OPTIMIZER_NAMES and optimizer_options_problem(self.optimizer, self.foreach):
            problems.append(optimizer_options_problem(self.optimizer, self.foreach))
        problems += self.lora_problems()
        if self.packing and self.batch_packing == "on":
            problems.append("packing packs the whole data set into rows and batch_packing each batch's samples: "
                            "choose one (--packing or --batch-packing on)")
        if problems:
            raise ConfigError(f"Invalid {type(self).__name__}:\n  - " + "\n  - ".join(problems))

    def lora_problems(self) -> list[str]:
        """The LoRA levers' combinations that cannot run, one line each naming the fix."""
        problems = []
        lora_options = [name for name in ("lora_alpha", "lora_dropout", "lora_targets", "qlora")
                        if getattr(self, name) != _default(type(self), name)]
        if not self.lora_rank and lora_options:
            problems.append(f"{', '.join(lora_options)} need LoRA: set lora_rank (--lora R, e.g. --lora 16)")
        if freezing := lora_freezing_problem(self):
            problems.append(freezing)
        if isinstance(self.lora_dropout, (int, float)) and not 0 <= self.lora_dropout < 1:
            problems.append(f"lora_dropout must be in [0, 1) (got {self.lora_dropout!r})")
        return problems

    # ------------------------------------------------------------------ the levers' implementations
    def prepare_model(self, model: Any) -> str | None:
        """Applies the ``model`` levers (freezing) in place; returns the freeze report, or None when nothing froze."""
        from looptrain import freeze

        if self.freeze_encoder:
            freeze.freeze_encoder(model)
        if self.freeze_embeddings:
            freeze.freeze_embeddings(model)
        if self.freeze_layers:
            freeze.freeze_layers(model, self.freeze_layers)
        if self.freeze_encoder or self.freeze_embeddings or self.freeze_layers:
            return freeze.freeze_report(model)
        return None

    def wrap_model(self, model: Any, device: Any = "cpu") -> Any:
        """Applies the adapter levers: with `lora_rank`, `looptrain.lora.apply_lora`'s `PeftModel`; else `model`.

        Call it after `prepare_model`, before the optimizer is built (the optimizer takes the adapters).
        """
        from looptrain import lora

        if not self.lora_rank or lora.is_lora_model(model):  # a model wrapped already (the planner's copy) stays
            return model
        compute_dtype = self.qlora_compute_dtype(device) if self.qlora else None
        wrapped = lora.apply_lora(model, self.lora_rank, alpha=self.lora_alpha or None, dropout=self.lora_dropout,
                                  targets=self.lora_targets or None, qlora=self.qlora, compute_dtype=compute_dtype)
        if self.weights == "bf16":  # peft keeps adapters in fp32 over a bf16 base: bf16 weights are all bf16
            from looptrain.optim.bf16 import cast_to_bf16

            cast_to_bf16(wrapped)
        return wrapped

    def qlora_compute_dtype(self, device: Any = "cpu") -> Any:
        """The dtype QLoRA's 4-bit layers compute in: bf16 under bf16 autocast or bf16 weights, with precision
        ``auto`` what the device computes natively (`looptrain.lora.default_compute_dtype`), else fp32."""
        import torch

        from looptrain import lora

        if self.precision == "auto":
            return lora.default_compute_dtype(device)
        return torch.bfloat16 if "bf16" in (self.precision, self.weights) else torch.float32

    def build_optimizer(self, model: Any, lr: float, **options: Any) -> Any:
        """The ``optimizer`` levers: `looptrain.optim.build_optimizer` of this strategy's optimizer."""
        from looptrain.optim import build_optimizer

        return build_optimizer(model, self.optimizer, lr, foreach=self.foreach, **options)

    # ------------------------------------------------------------------ views
    @property
    def packs(self) -> bool:
        """Whether its rows are packed samples (`packing`, or `batch_packing` on): each builds a block mask."""
        return self.packing or self.batch_packing == "on"

    def estimate_options(self) -> dict:
        """Every lever the estimator prices (all but the ``batches`` ones), as keywords."""
        return {spec.name: getattr(self, spec.name) for spec in levers(type(self))
                if spec.metadata["lever"]["applied_by"] != "batches"}

    def flags(self) -> list[str]:
        """The command-line flags that select this strategy: the split always, every other lever off its default."""
        flags = []
        split_first = {"batch_size": 0, "accum_steps": 1}
        for spec in sorted(levers(type(self)), key=lambda spec: split_first.get(spec.name, 2)):
            value, meta = getattr(self, spec.name), spec.metadata["lever"]
            if spec.name not in ("batch_size", "accum_steps") and value == spec.default:
                continue
            if meta["const"] is not None or isinstance(spec.default, bool):
                flags.append(meta["flag"])  # a switch: set means "not the default"
            else:
                flags += [meta["flag"], str(value)]
        return flags

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FREEZING_LEVERS = ("freeze_embeddings", "freeze_layers", "freeze_encoder")


def lora_freezing_problem(values: Any, name: Callable[[str], str] = str) -> str | None:
    """LoRA with a freezing lever: LoRA freezes the whole base already.

    Args:
        values: a `Strategy`, or a command line's parsed flags (the same names).
        name: how a field is named in the message: itself, or its flag (`flag_names`) on a command line.
    """
    frozen = [name(lever) for lever in FREEZING_LEVERS if getattr(values, lever)]
    if not values.lora_rank or not frozen:
        return None
    return (f"{name('lora_rank')} freezes the whole base already; drop {' and '.join(frozen)} (only the adapters "
            "and a classifier's head train)")


def _default(cls: type, name: str) -> Any:
    return next(spec.default for spec in dataclasses.fields(cls) if spec.name == name)


def levers(cls: type = Strategy, *, applied_by: str | None = None) -> list[dataclasses.Field]:
    """The lever fields of a strategy class (declared with `lever`), in declaration order."""
    return [spec for spec in dataclasses.fields(cls) if "lever" in spec.metadata
            and (applied_by is None or spec.metadata["lever"]["applied_by"] == applied_by)]


def add_arguments(parser: argparse.ArgumentParser, *, cls: type = Strategy, groups: dict | None = None,
                  exclude: tuple[str, ...] = (), defaults: dict | None = None, extra_choices: dict | None = None,
                  kind: str = "lever", overrides: dict | None = None) -> None:
    """Adds one flag per declared field of `cls` (in `groups[meta.group]` when given), dest = the field name.

    Args:
        parser: the command line.
        cls: the strategy class (a subclass adds its own levers), or `LoopConfig` for its run options.
        groups: argument groups by name (`lever(group=...)`, `option(group=...)`); the parser itself when missing.
        exclude: fields that get no flag.
        defaults: flag defaults that differ from the field's (the estimate's --batch-size).
        extra_choices: values a flag accepts besides the field's (``{"optimizer": ("auto",)}``: the planner's).
        kind: "lever" (fields declared with `lever`) or "option" (with `option`; those without a flag are skipped).
        overrides: argparse options by field that a command line says its own way (its help, its choices).
    """
    defaults, extra_choices, groups, overrides = defaults or {}, extra_choices or {}, groups or {}, overrides or {}
    hints = typing.get_type_hints(cls)
    for spec in declared(cls):
        meta = spec.metadata.get(kind)
        if meta is None or meta["flag"] is None or spec.name in exclude:
            continue
        default = defaults.get(spec.name, spec.default)
        options: dict[str, Any] = {"dest": spec.name, "default": default, "help": meta["help"]}
        if meta["const"] is not None:
            options.update(action="store_const", const=meta["const"])
        elif hints[spec.name] is bool:
            options["action"] = "store_false" if default else "store_true"
        else:
            options.update(_value_options(meta, hints[spec.name], parse_minimum=kind == "lever"))
            if meta["choices"] is not None:
                options["choices"] = (*meta["choices"], *extra_choices.get(spec.name, ()))
        options.update(overrides.get(spec.name, {}))
        groups.get(meta["group"], parser).add_argument(meta["flag"], **options)


def _value_options(meta: dict, annotation: Any, *, parse_minimum: bool) -> dict:
    """The argparse type (and metavar) of a valued flag: the declared `parse`, else the annotation's type (an
    optional one reads "none" or "off" as None); a lever's minimum is checked as the flag is parsed."""
    arguments = [argument for argument in typing.get_args(annotation) if argument is not type(None)]
    base = arguments[0] if arguments and annotation is not float else annotation
    kind = int if base is int else float if base is float else str
    options: dict[str, Any] = {}
    if meta.get("parse") is not None:
        options["type"] = meta["parse"]
    elif parse_minimum and meta["minimum"] is not None:
        options["type"] = at_least(meta["minimum"], kind)
    elif type(None) in typing.get_args(annotation):
        options["type"] = lambda text: None if text.lower() in ("none", "off") else kind(text)
    else:
        options["type"] = kind
    if meta["metavar"] or (parse_minimum and kind is int and meta["choices"] is None):
        options["metavar"] = meta["metavar"] or "N"
    return options


def from_arguments(arguments: argparse.Namespace, cls: type = Strategy, **overrides: Any) -> Strategy:
    """The strategy of parsed flags (`add_arguments`), with `overrides` (e.g. a resolved optimizer)."""
    values = {spec.name: getattr(arguments, spec.name) for spec in levers(cls) if hasattr(arguments, spec.name)}
    return cls(**{**values, **overrides})


def at_least(minimum: int, kind: type = int):
    """An argparse type: an integer (or a `kind` number) >= `minimum`, or a usage error naming the bound."""

    def parse(text: str) -> int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") \
                from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
        return value

    return parse


__all__ = ["ConfigError", "LoopLevers", "Strategy", "add_arguments", "declared", "declared_problems", "flag_names",
           "from_arguments", "lever", "levers", "option"]
