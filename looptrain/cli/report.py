"""Draw a run's picture, report.png, from its own files (docs/report.md).

    looptrain-report runs/exp1                     # runs/exp1/report.png, drawn again
    looptrain-report runs/exp1 --output exp1.png   # anywhere outside a run's own files
    python -m looptrain.report runs/exp1           # the same, without the console script

Every finished run draws its report.png when matplotlib is installed; this draws it afterwards (a run without
matplotlib, a run in progress, a run whose picture failed). It reads metrics.jsonl, summary.json and run_config.json
and writes nothing but the picture.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from looptrain.cli.errors import UsageError, program_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program_name("report.py"),
        description="Draw a run's report.png: the training loss, the evaluation metrics and the learning rate over "
                    "updates, and the memory at the peak by category beside the estimate.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a looptrain-finetune run's --output-dir")
    parser.add_argument("--output", default=None, metavar="PATH",
                        help="write the picture here, a .png outside any run's own files (default: RUN_DIR/report.png)")
    return parser


def check_output(run_dir: Path, output: Path | None) -> None:
    """--output is a .png in an existing directory, and no run's own file but this run's report.png
    (`looptrain.ledger.run_file_owner`)."""
    from looptrain.ledger import run_file_owner
    from looptrain.report import REPORT_FILE

    if output is None:
        return
    if output.suffix.lower() != ".png":
        raise UsageError(f"--output {output} does not end in .png: the picture is a PNG; pass a PATH.png")
    if not output.parent.is_dir():
        raise UsageError(f"--output {output}: the directory {output.parent} does not exist; create it or pass "
                         "another --output")
    owner = run_file_owner(output)
    if owner is not None and output.resolve() != (run_dir / REPORT_FILE).resolve():
        raise UsageError(f"--output {output} is a file of the run in {owner}; pass a path outside any run's own files "
                         f"(default: {run_dir / REPORT_FILE})")


def draw(run_dir: Path, output: Path | None) -> Path:
    """The picture written; a UsageError naming the fix for a directory that is no run, a missing matplotlib, or a
    write that fails (nothing is left behind then)."""
    from looptrain.report import REPORT_FILE, NotARunError, ReportUnavailable, write_report

    try:
        return write_report(run_dir, output)
    except (NotARunError, ReportUnavailable) as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        path = output if output is not None else run_dir / REPORT_FILE
        raise UsageError(f"cannot write {path} ({error.strerror or error}): free some space, or pass an --output "
                         "on another disk") from None


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code (0 ok, 2 for a user error)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = Path(args.run_dir)
    output = Path(args.output) if args.output is not None else None
    try:
        check_output(run_dir, output)
        path = draw(run_dir, output)
    except UsageError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def main_entry() -> None:
    """The `looptrain-report` console script: exits with main's code."""
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
