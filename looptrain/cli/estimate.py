r"""The estimator's command line (`looptrain.estimation.estimate`): `python -m looptrain.memory`, `scripts/estimate.py`.

    python -m looptrain.memory --preset bert-large --batch-size 32 --seq-len 128 --ladder
    python -m looptrain.memory --model DIR --batch-size 8 --seq-len 256 --precision bf16 --grad-checkpoint
    python -m looptrain.memory --preset bert-large --weights bf16 --optim adafactor --optim-in-backward \
        --grad-checkpoint
    python -m looptrain.memory --model DIR --seq-len 2048 --batch-size 1 --lowest --json
    python -m looptrain.memory --preset qwen2.5-1.5b --seq-len 512 --batch-size 1 --lora 16 --qlora --grad-checkpoint \
        --json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

from looptrain import strategy as strategies
from looptrain.cli.errors import program_name
from looptrain.cli.recipe import expand_config
from looptrain.estimation.estimator import ESTIMATE_METER, estimate
from looptrain.estimation.shapes import PRESETS, ladder, load_config, preset_config
from looptrain.planning.errors import PlanError
from looptrain.planning.lowest import lowest
from looptrain.precision import cpu_bf16_speedup, cpu_has_native_bf16
from looptrain.run_files import read_json_object


def _table(rows: list[tuple[str, dict[str, Any]]],
           title_columns: str = ("| strategy mix | peak GiB | params | grads | optimizer state | activations + temps "
                                 "| peak phase | s |")) -> str:
    lines = [title_columns, "|" + "---|" * (title_columns.count("|") - 1)]
    for label, result in rows:
        b = result["memory_breakdown"]
        gib = 1024**3
        lines.append(
            f"| {label} | {result['peak_memory_bytes'] / gib:.2f} | {b['params'] / gib:.2f} | {b['grads'] / gib:.2f} | "
            f"{b['optimizer_state'] / gib:.2f} | {b['activations_and_temps'] / gib:.2f} | {b['peak_phase']} | "
            f"{result['estimate_seconds']:.1f} |"
        )
    return "\n".join(lines)


def bytes_per_parameter(result: dict[str, Any]) -> float:
    """An estimate's peak over the model's parameters (all of them, trained or frozen): 16 for fp32 AdamW's
    weights, grads and two moments before any activation; LoRA and QLoRA go below it."""
    return round(result["peak_memory_bytes"] / max(result["parameters"], 1), 2)


def batching_only() -> tuple[str, ...]:
    """Levers of how batches are formed: the estimate prices one batch_size x seq_len shape, so they get no flag
    (but `packing`, whose rows build a block mask the estimate prices)."""
    return tuple(spec.name for spec in strategies.levers(strategies.Strategy, applied_by="batches")
                 if spec.name not in ("batch_size", "packing"))


def build_parser() -> argparse.ArgumentParser:
    """The estimate's command line: the model source and the shape, then every lever the estimator prices."""
    parser = argparse.ArgumentParser(prog=program_name("estimate.py"),
                                     description="Estimate the peak memory of a training step on fake tensors.")
    parser.add_argument("--config", metavar="FILE",
                        help="a recipe: a YAML or JSON file of these flags by name without dashes (preset: "
                             "bert-large, grad_checkpoint: true); flags on the command line override it (a "
                             "config.json with model_type is read as --model FILE)")
    source = parser.add_mutually_exclusive_group()  # one is required: `_parse_arguments` says so after --config
    source.add_argument("--preset", choices=sorted(PRESETS),
                        help="a built-in shape (no download): BERT classifiers, Qwen2.5 causal LMs")
    source.add_argument("--model", help="a local model directory, or its config.json (with model_type); only the "
                                        "config is read")
    parser.add_argument("--seq-len", type=strategies.at_least(1), default=128)
    parser.add_argument("--num-labels", type=strategies.at_least(1), default=2)
    parser.add_argument("--eval-batch-size", type=strategies.at_least(1), default=None,
                        help="evaluation's rows per batch (default: --batch-size): its peak, a forward without "
                             "gradients at --seq-len with the weights and optimizer state resident, is printed too "
                             "(evaluation_peak_bytes in --json), and the peak is the higher of the two")
    parser.add_argument("--ladder", action="store_true", help="print the table of strategy mixes")
    parser.add_argument("--lowest", action="store_true",
                        help="search the levers that keep the task and the math (numerics, optimizer, checkpointing, "
                             "the fused step, ...) for the full fine-tune with the lowest estimate; the levers you "
                             "pass are kept")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="the device the run trains on, whose kernels are priced: cuda prices torch's foreach "
                             "optimizer step, the fused attention kernels and autocast's fp32 ops as CUDA runs them "
                             "(the estimate itself runs on the CPU; with --lowest, bf16 is tried)")
    parser.add_argument("--cpu-kind", choices=("this", "native-bf16", "no-bf16"), default="this",
                        help="with --lowest: plan bf16 for this CPU (bf16 tried where it is native), or for a CPU "
                             "with / without native bf16")
    parser.add_argument("--json", action="store_true",
                        help="print the result as JSON: the estimate (parameters, trainable parameters, bytes per "
                             "parameter, breakdown) or --lowest's search")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="the Loop's clipping threshold (clipping temporaries)")
    parser.add_argument("--full-estimate", action="store_true",
                        help="estimate the whole model every time (default: a stack of 16 or more identical blocks is "
                             "priced on 2, 3 and 4 of them and extrapolated where that is exact)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="with --model: allow model code shipped with the checkpoint (an auto_map in its "
                             "config) to run (off: such a model is refused, and nothing asks)")
    # Every lever of looptrain.Strategy the estimator prices, from its field metadata (as in looptrain-finetune).
    strategies.add_arguments(parser, cls=strategies.Strategy, exclude=batching_only(), defaults={"batch_size": 32})
    return parser


def _parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    return _parsed(parser, command_line(parser, argv))


def _parsed(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`argv` (its --config written out already, `command_line`) parsed, with a model source required."""
    arguments = parser.parse_args(argv)
    if arguments.preset is None and arguments.model is None:
        parser.error("one of the arguments --preset --model is required (or preset or model in the --config file)")
    return arguments


def command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """The command line with a --config recipe's flags written out in front of it (`expand_config`)."""
    return expand_config(parser, _model_config_as_model(argv))


def _model_config_as_model(argv: Sequence[str]) -> list[str]:
    """``--config config.json`` of a model (a JSON mapping with model_type), the flag's meaning before recipes, is
    ``--model config.json``."""
    argv = list(argv)
    for index, token in enumerate(argv[:-1]):
        if token == "--config" and argv[index + 1].endswith(".json") and "model_type" in read_json_object(
                argv[index + 1]):
            argv[index] = "--model"
    return argv


def given_levers(argv: Sequence[str]) -> set[str]:
    """The strategy fields whose flag is on the command line (kept as given by ``--lowest``)."""
    given = set()
    for spec in strategies.levers(strategies.Strategy):
        flag = spec.metadata["lever"]["flag"]
        if any(argument == flag or argument.startswith(flag + "=") for argument in argv):
            given.add(spec.name)
    if given & {"gradient_checkpointing", "checkpoint_every"}:
        given |= {"gradient_checkpointing", "checkpoint_every"}
    return given


def cpu_description() -> dict[str, Any]:
    """The CPU an estimate plans bf16 for: torch's capability, whether oneDNN reports bf16, and bf16 matmuls' speed
    over fp32's as measured here."""
    import torch

    return {"processor": platform.processor() or platform.machine(),
            "capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": cpu_has_native_bf16(),
            "bf16_speedup": cpu_bf16_speedup()}


def _lowest(arguments: argparse.Namespace, config: Any, argv: Sequence[str]) -> int:
    native = {"this": None, "native-bf16": True, "no-bf16": False}[arguments.cpu_kind]
    echo = (lambda line: print(line, file=sys.stderr)) if arguments.json else print
    result = lowest(config, arguments.batch_size, arguments.seq_len, strategies.from_arguments(arguments),
                    fixed=given_levers(argv), native_bf16=native, max_grad_norm=arguments.max_grad_norm,
                    num_labels=arguments.num_labels, echo=echo, device=arguments.device,
                    extrapolate=not arguments.full_estimate)
    output = {**result.to_dict(), "seq_len": arguments.seq_len, "cpu": cpu_description(),
              "cpu_kind": arguments.cpu_kind}
    if arguments.json:
        print(json.dumps(output, indent=2))
    else:
        print(f"\nlowest full fine-tune: {output['estimated_peak_bytes'] / 1024**3:.2f} GiB "
              f"({ESTIMATE_METER}); flags: {' '.join(output['settings']['flags'])}")
        print(_table([("lowest", result.estimate)]))
        for note in result.notes:
            print(f"note: {note}")
    return 0


def eval_batch_size(arguments: argparse.Namespace) -> int:
    """--eval-batch-size, or --batch-size without it."""
    return arguments.eval_batch_size or arguments.batch_size


def evaluation_line(result: dict[str, Any], rows: int, seq_len: int) -> str:
    """Evaluation's estimated peak beside training's, in a line."""
    gib = 1024**3
    return (f"\nevaluation: {result['evaluation_peak_bytes'] / gib:.3f} GiB (a forward without gradients at batch "
            f"{rows} x seq {seq_len}, the weights and optimizer state resident); training's step: "
            f"{result['training_peak_bytes'] / gib:.3f} GiB")


def source_config(arguments: argparse.Namespace) -> tuple[Any, str]:
    """The config the estimate prices and its name: a preset's, a config.json's, or a model directory's, read as
    looptrain-finetune reads it (a model that ships its own code needs --trust-remote-code; nothing asks). --seq-len
    is checked against its positions as finetune's --max-length is.

    Raises:
        UsageError: a model that ships code without --trust-remote-code, a config that cannot be read, or a
            --seq-len beyond the model's positions.
    """
    from looptrain.cli.finetune.inputs import check_length, read_model_config

    if arguments.preset:
        config, source = preset_config(arguments.preset, arguments.num_labels), arguments.preset
    elif os.path.isfile(arguments.model):  # a config.json (--config is the recipe file)
        config = load_config(arguments.model, arguments.num_labels, arguments.trust_remote_code)
        source = arguments.model
    else:
        config, source = read_model_config(arguments.model, arguments.trust_remote_code), arguments.model
        config.num_labels = arguments.num_labels
    check_length(config, arguments.seq_len, "--seq-len")
    return config, source


def adapter_as_model(arguments: argparse.Namespace, argv: Sequence[str]) -> None:
    """A LoRA adapter --model (a --lora run's final/) is priced as its base with its own LoRA levers (rank, alpha,
    dropout, targets), as looptrain-finetune continues it; --lora flags beside it are a UsageError."""
    from looptrain.cli.adapters import adapter_levers, check_no_lora_flags, read_adapter

    if arguments.model is None or os.path.isfile(arguments.model):
        return
    adapter = read_adapter(arguments.model)
    if adapter is None:
        return
    check_no_lora_flags(arguments.model, {token.split("=")[0] for token in argv})
    vars(arguments).update(adapter_levers(adapter, arguments.model))
    arguments.model = adapter["base"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print one estimate, with ``--ladder`` the table of strategy mixes, with ``--lowest`` the
    full fine-tune with the lowest estimate (``--json``: as JSON)."""
    parser = build_parser()
    argv = command_line(parser, sys.argv[1:] if argv is None else argv)  # --lowest reads the levers given in it
    arguments = _parsed(parser, argv)
    if arguments.json and arguments.ladder:
        print("error: --json prints one estimate or --lowest's result, not --ladder's table", file=sys.stderr)
        return 2
    from looptrain.cli.errors import UsageError

    try:
        adapter_as_model(arguments, argv)
        config, source = source_config(arguments)
        if arguments.lowest:
            return _lowest(arguments, config, argv)
        if arguments.ladder:
            rows = []
            for label, options in ladder(arguments.batch_size, arguments.seq_len):
                options = {"batch_size": arguments.batch_size, "seq_len": arguments.seq_len,
                           "num_labels": arguments.num_labels, "device": arguments.device,
                           "extrapolate": not arguments.full_estimate, **options}
                rows.append((label, estimate(copy.deepcopy(config), **options)))
        else:
            strategy = strategies.from_arguments(arguments, cls=strategies.Strategy)
            rows = [("as given", estimate(config, arguments.batch_size, arguments.seq_len, strategy,
                                          num_labels=arguments.num_labels, max_grad_norm=arguments.max_grad_norm,
                                          device=arguments.device, eval_batch_size=eval_batch_size(arguments),
                                          extrapolate=not arguments.full_estimate))]
    except (ValueError, PlanError, UsageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = rows[0][1]
    parameters, trainable = result["parameters"], result["trainable_parameters"]
    if arguments.json:
        print(json.dumps({**result, "bytes_per_parameter": bytes_per_parameter(result), "source": source,
                          "batch_size": arguments.batch_size, "seq_len": arguments.seq_len,
                          "eval_batch_size": eval_batch_size(arguments),
                          "flags": strategy.flags(), "cpu": cpu_description()}, indent=2))
        return 0
    trained = f" ({trainable / 1e6:.2f}M trainable)" if trainable != parameters else ""
    print(f"{source}: {parameters / 1e6:.1f}M parameters{trained}, batch {arguments.batch_size}, seq "
          f"{arguments.seq_len}; meter: {ESTIMATE_METER} (GiB)\n")
    print(_table(rows))
    if result.get("evaluation_peak_bytes") is not None:
        print(evaluation_line(result, eval_batch_size(arguments), arguments.seq_len))
    notes = sorted({note for _, result in rows for note in result["notes"]})
    for note in notes:
        print(f"\nnote: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
