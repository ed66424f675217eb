r"""The estimator's command line (`looptrain.planning.estimate`): `python -m looptrain.memory`, `scripts/estimate.py`.

    python -m looptrain.memory --preset bert-large --batch-size 32 --seq-len 128 --ladder
    python -m looptrain.memory --model DIR --batch-size 8 --seq-len 256 --precision bf16 --grad-checkpoint
    python -m looptrain.memory --preset bert-large --weights bf16 --optim adafactor --optim-in-backward \
        --grad-checkpoint
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from typing import Any

from looptrain import strategy as strategies
from looptrain.planning.estimator import ESTIMATE_METER, PRESETS, estimate, ladder, load_config, preset_config


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


def batching_only() -> tuple[str, ...]:
    """Levers of how batches are formed: the estimate prices one batch_size x seq_len shape, so they get no flag."""
    return tuple(spec.name for spec in strategies.levers(strategies.Strategy, applied_by="batches")
                 if spec.name != "batch_size")


def build_parser() -> argparse.ArgumentParser:
    """The estimate's command line: the model source and the shape, then every lever the estimator prices."""
    parser = argparse.ArgumentParser(prog="python -m looptrain.memory",
                                     description="Estimate the peak memory of a training step on fake tensors.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in BERT shape (no download)")
    source.add_argument("--config", help="a config.json file (with model_type)")
    source.add_argument("--model", help="a local model directory (its config only is read)")
    parser.add_argument("--seq-len", type=strategies.at_least(1), default=128)
    parser.add_argument("--num-labels", type=strategies.at_least(1), default=2)
    parser.add_argument("--ladder", action="store_true", help="print the table of strategy mixes")
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="the Loop's clipping threshold (clipping temporaries)")
    # Every lever of looptrain.Strategy the estimator prices, from its field metadata (as in looptrain-finetune).
    strategies.add_arguments(parser, cls=strategies.Strategy, exclude=batching_only(), defaults={"batch_size": 32})
    return parser


def _parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print one estimate, or with ``--ladder`` the table of strategy mixes."""
    arguments = _parse_arguments(argv)
    try:
        if arguments.preset:
            config = preset_config(arguments.preset, arguments.num_labels)
            source = arguments.preset
        else:
            source = arguments.config or arguments.model
            config = load_config(source, arguments.num_labels)
        if arguments.ladder:
            rows = []
            for label, options in ladder(arguments.batch_size, arguments.seq_len):
                options = {"batch_size": arguments.batch_size, "seq_len": arguments.seq_len,
                           "num_labels": arguments.num_labels, **options}
                rows.append((label, estimate(copy.deepcopy(config), **options)))
        else:
            strategy = strategies.from_arguments(arguments, cls=strategies.Strategy)
            rows = [("as given", estimate(config, arguments.batch_size, arguments.seq_len, strategy,
                                          num_labels=arguments.num_labels, max_grad_norm=arguments.max_grad_norm))]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    parameters = rows[0][1]["parameters"]
    print(f"{source}: {parameters / 1e6:.1f}M parameters, batch {arguments.batch_size}, seq {arguments.seq_len}; "
          f"meter: {ESTIMATE_METER} (GiB)\n")
    print(_table(rows))
    notes = sorted({note for _, result in rows for note in result["notes"]})
    for note in notes:
        print(f"\nnote: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
