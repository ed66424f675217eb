"""How long an estimate takes, whole and extrapolated from a few blocks, and the table of the lowest full fine-tunes.

Two parts (docs/memory.md, "One block priced once" and "The lowest full fine-tune of seven shapes", have the figures):

- ``--time``: the seconds of one estimate of the Qwen2.5-1.5B shape at 1 x 2048 (the lowest settings: bf16 weights,
  Adafactor fused into backward, every block checkpointed, chunked cross-entropy; and the default fp32 AdamW), each
  in a fresh process (imports included, the cache off), ``--repeats`` times, whole (``--full-estimate``) and
  extrapolated; then ``python -m looptrain.memory --lowest`` on the Llama-3.1-8B shape, extrapolated (``--lowest-8b``
  adds the whole-model run: about 8 minutes of CPU, so off by default). Medians of wall and CPU seconds.
- ``--table``: ``python -m looptrain.memory --preset NAME --seq-len 2048 --batch-size 1 --lowest --json`` for each
  preset of `TABLE_SHAPES`, as a Markdown table (estimated bytes, bytes per parameter, the settings picked).

Run (2 shared CPU cores: minutes each)::

    PYTHONPATH=. python scripts/bench_estimate.py --time --repeats 3
    PYTHONPATH=. python scripts/bench_estimate.py --table

Benchmarks never run in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1024**3
LOWEST_1_5B = ["--weights", "bf16", "--optim", "adafactor", "--optim-in-backward", "--grad-checkpoint",
               "--precision", "bf16"]
TABLE_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "llama-3.2-1b", "llama-3.2-3b",
                "llama-3.1-8b")


def memory_command(*arguments: str) -> list[str]:
    return [sys.executable, "-m", "looptrain.memory", *arguments, "--json"]


def timed(command: list[str]) -> tuple[float, float, dict]:
    """Wall and CPU seconds of `command` in a fresh process (the estimate cache off), and its JSON output."""
    environment = {**os.environ, "LOOPTRAIN_CACHE_DIR": "off", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    output = subprocess.run(command, check=True, capture_output=True, text=True, env=environment).stdout
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(output)


def time_rows(repeats: int, lowest_whole: bool) -> None:
    import torch

    from looptrain.precision import cpu_has_native_bf16

    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, native bf16 {cpu_has_native_bf16()}, "
          f"{os.cpu_count()} cores; medians of {repeats} fresh processes\n")
    print("| estimate | whole: wall s | whole: CPU s | extrapolated: wall s | extrapolated: CPU s | peak bytes |")
    print("|---|---|---|---|---|---|")
    single = ["--preset", "qwen2.5-1.5b", "--seq-len", "2048", "--batch-size", "1"]
    for label, levers in (("Qwen2.5-1.5B 1 x 2048, lowest settings", LOWEST_1_5B),
                          ("Qwen2.5-1.5B 1 x 2048, fp32 AdamW", [])):
        cells, peaks = [], set()
        for extra in (["--full-estimate"], []):
            runs = [timed(memory_command(*single, *levers, *extra)) for _ in range(repeats)]
            peaks |= {result["peak_memory_bytes"] for *_, result in runs}
            cells += [statistics.median(run[0] for run in runs), statistics.median(run[1] for run in runs)]
        print(f"| {label} | " + " | ".join(f"{cell:.1f}" for cell in cells) + f" | {', '.join(map(str, peaks))} |",
              flush=True)
    lowest = ["--preset", "llama-3.1-8b", "--seq-len", "2048", "--batch-size", "1", "--lowest"]
    whole = timed(memory_command(*lowest, "--full-estimate")) if lowest_whole else None
    extrapolated = timed(memory_command(*lowest))
    cells = (f"{whole[0]:.1f} | {whole[1]:.1f}" if whole else "- | -") + f" | {extrapolated[0]:.1f} | " \
        f"{extrapolated[1]:.1f}"
    print(f"| Llama-3.1-8B --lowest (one run) | {cells} | {extrapolated[2]['estimated_peak_bytes']} |")


def table_rows() -> None:
    print("| shape | parameters | lowest estimate | bytes/param | settings --lowest picked | extrapolated |")
    print("|---|---|---|---|---|---|")
    for name in TABLE_SHAPES:
        _, cpu, result = timed(memory_command("--preset", name, "--seq-len", "2048", "--batch-size", "1",
                                              "--lowest"))
        peak, parameters = result["estimated_peak_bytes"], result["parameters"]
        given, split = result["settings"]["flags"], ("--batch-size", "--accum")  # the split is given: 1 x 1
        flags = " ".join(flag for index, flag in enumerate(given)
                         if flag not in split and (index == 0 or given[index - 1] not in split))
        print(f"| {name} | {parameters / 1e9:.2f}B | {peak / GIB:.2f} GiB ({peak:,} B) | {peak / parameters:.2f} | "
              f"`{flags}` | {result.get('extrapolation', '')} ({cpu:.0f} s CPU) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lowest-8b", action="store_true", help="with --time: also the 8B --lowest run whole")
    parser.add_argument("--table", action="store_true")
    arguments = parser.parse_args()
    if arguments.time:
        time_rows(arguments.repeats, arguments.lowest_8b)
    if arguments.table:
        table_rows()


if __name__ == "__main__":
    main()
