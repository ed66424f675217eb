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

from looptrain.config import GRAD_DTYPES, WEIGHT_DTYPES
from looptrain.optim import OPTIMIZER_NAMES
from looptrain.planning.estimator import ESTIMATE_METER, PRESETS, estimate, ladder, load_config, preset_config
from looptrain.precision import PRECISIONS


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


def _at_least(minimum: int):
    """An argparse type: an integer >= `minimum`, or a usage error naming the bound."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} (got {value})")
        return value

    return parse


def _parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m looptrain.memory",
                                     description="Estimate the peak memory of a training step on fake tensors.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in BERT shape (no download)")
    source.add_argument("--config", help="a config.json file (with model_type)")
    source.add_argument("--model", help="a local model directory (its config only is read)")
    parser.add_argument("--batch-size", type=_at_least(1), default=32)
    parser.add_argument("--seq-len", type=_at_least(1), default=128)
    parser.add_argument("--num-labels", type=_at_least(1), default=2)
    parser.add_argument("--ladder", action="store_true", help="print the table of strategy mixes")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--optim", choices=OPTIMIZER_NAMES, default="adamw")
    parser.add_argument("--weights", choices=WEIGHT_DTYPES, default="fp32",
                        help="parameter storage: bf16 = 2 B/param, no fp32 master copy, bf16 compute")
    parser.add_argument("--grad-dtype", choices=GRAD_DTYPES, default="bf16",
                        help="with --weights bf16: the dtype gradients accumulate in")
    parser.add_argument("--grad-checkpoint", action="store_true")
    parser.add_argument("--grad-checkpoint-every", type=_at_least(1), default=1,
                        help="with --grad-checkpoint: every k-th block")
    parser.add_argument("--optim-in-backward", action="store_true")
    parser.add_argument("--freeze-embeddings", action="store_true")
    parser.add_argument("--freeze-layers", type=_at_least(0), default=0)
    parser.add_argument("--freeze-encoder", action="store_true")
    parser.add_argument("--no-foreach", action="store_true")
    parser.add_argument("--accum", type=_at_least(1), default=1)
    parser.add_argument("--max-grad-norm", type=float, default=1.0,
                        help="the Loop's clipping threshold (clipping temporaries)")
    return parser.parse_args(argv)


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
            options = {
                "batch_size": arguments.batch_size, "seq_len": arguments.seq_len, "num_labels": arguments.num_labels,
                "precision": arguments.precision, "optimizer": arguments.optim,
                "gradient_checkpointing": arguments.grad_checkpoint,
                "checkpoint_every": arguments.grad_checkpoint_every,
                "optimizer_in_backward": arguments.optim_in_backward, "freeze_embeddings": arguments.freeze_embeddings,
                "freeze_layers": arguments.freeze_layers, "freeze_encoder": arguments.freeze_encoder,
                "foreach": False if arguments.no_foreach else None, "accum_steps": arguments.accum,
                "max_grad_norm": arguments.max_grad_norm, "weights": arguments.weights,
                "grad_dtype": arguments.grad_dtype,
            }
            rows = [("as given", estimate(config, **options))]
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
