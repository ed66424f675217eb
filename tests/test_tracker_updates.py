"""The CPU tensor tracker sets aside updates whose micro-batches tracked ones cover (`CpuTensorMeter.update`): the
peak, its breakdown and every phase's peak must be those of a run that tracks every update, to the byte."""

from __future__ import annotations

import json
import re

import pytest
import torch

from looptrain import Loop, memory
from looptrain.optim import build_optimizer

from conftest import WORDS, make_tiny_bert, quiet_config, random_token_batches

# Widths that rise, fall and rise again past every earlier one, with a row count that changes too: the updates
# after the first step that nothing tracked covers are the widest so far (24, then 40) and the one with more rows.
LENGTHS = [[12, 9, 7, 5], [16, 8, 8, 3], [10, 10, 6, 2], [24, 20, 4, 4], [8, 7, 6, 5], [24, 3, 3, 3],
           [16, 12, 12, 9], [40, 2, 2, 2], [12, 11, 10, 9], [40, 30, 2, 2], [5, 5, 5, 5, 5, 5], [9, 9, 9]]


class FreshBatches:
    """Each batch made as it is drawn and dropped after its update, as a DataLoader's are."""

    def __init__(self, lengths: list[list[int]]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        for index, lengths in enumerate(self.lengths):
            yield random_token_batches([lengths], vocab_size=len(WORDS) + 5, seed=index)[0]


def train(every: bool, accum_steps: int, optimizer: str = "adamw", batches=None) -> tuple[dict, dict]:
    model = make_tiny_bert(seed=0)
    loop = Loop(model, build_optimizer(model, optimizer, lr=1e-3), batches or FreshBatches(LENGTHS),
                config=quiet_config(accum_steps=accum_steps, track_memory=True, track_every_update=every))
    summary = loop.fit()
    return summary, {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("accum_steps, optimizer", [(1, "adamw"), pytest.param(2, "adamw", marks=pytest.mark.slow),
                                                     pytest.param(1, "adafactor", marks=pytest.mark.slow)])
def test_set_aside_updates_leave_the_peak_breakdown_and_phases_to_the_byte(accum_steps, optimizer):
    every, every_weights = train(True, accum_steps, optimizer)
    lean, lean_weights = train(False, accum_steps, optimizer)
    updates = len(LENGTHS) // accum_steps
    assert every["tracked_updates"] == updates and every["untracked_updates"] == 0
    assert lean["tracked_updates"] + lean["untracked_updates"] == updates
    assert lean["untracked_updates"] >= updates // 3, lean  # the point of it: most updates are covered
    assert lean["peak_memory_bytes"] == every["peak_memory_bytes"]
    assert lean["memory_breakdown"] == every["memory_breakdown"]
    assert lean["phase_peak_bytes"] == every["phase_peak_bytes"]
    for name, tensor in every_weights.items():  # the tracker never changes what is trained
        assert torch.equal(tensor, lean_weights[name]), name


def test_what_outlives_updates_keeps_every_update_tracked():
    """Batches held in a list from the start are counted as each update first reads them: the live bytes grow
    from one update to the next, so no update is covered (its peak would pass an earlier one's by that growth)."""
    held = random_token_batches(LENGTHS, vocab_size=len(WORDS) + 5, seed=1)
    every, _ = train(True, 1, batches=held)
    lean, _ = train(False, 1, batches=held)
    assert lean["untracked_updates"] == 0 and lean["tracked_updates"] == len(LENGTHS)
    assert lean["peak_memory_bytes"] == every["peak_memory_bytes"]


def batch(rows: int, width: int, labels: int | None = None) -> dict:
    ids = torch.ones(rows, width, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": ids, "labels": torch.zeros(labels or rows, dtype=torch.long)}


def counted(meter, micro_batches: list[dict], steady: bool = True) -> str:
    """Runs an empty update through `meter.update`; says whether it was tracked."""
    before = meter.tracked_updates
    counts = [len(b["labels"]) if isinstance(b, dict) else 2 for b in micro_batches]
    with meter.update(micro_batches, counts, steady=steady):
        pass
    return "tracked" if meter.tracked_updates > before else "set aside"


def test_an_update_is_set_aside_only_when_every_micro_batch_is_covered():
    model = make_tiny_bert(seed=0)
    meter = memory.make_meter("cpu")
    with meter.tracking(model):
        assert counted(meter, [batch(4, 16)], steady=False) == "tracked"  # before the first step: no state yet
        assert counted(meter, [batch(4, 16)], steady=False) == "tracked"  # ... and it covers nothing
        assert counted(meter, [batch(4, 16)]) == "tracked"
        assert counted(meter, [batch(4, 16)]) == "set aside"
        assert counted(meter, [batch(3, 10)]) == "set aside"  # smaller in every dimension
        assert counted(meter, [batch(4, 17)]) == "tracked"  # wider
        assert counted(meter, [batch(5, 8)]) == "tracked"  # more rows
        assert counted(meter, [batch(4, 8, labels=6)]) == "tracked"  # more items (labels) than any tracked
        assert counted(meter, [batch(4, 8, labels=6)]) == "set aside"
        # A window's later micro-batches run beside its gradients: one tracked first in its window covers none.
        assert counted(meter, [batch(1, 4), batch(4, 16)]) == "tracked"
        assert counted(meter, [batch(1, 4), batch(4, 16)]) == "set aside"
        # More live bytes at the start (here the window's larger first batch) than any covering update had: tracked.
        assert counted(meter, [batch(4, 16), batch(4, 16)]) == "tracked"
        assert counted(meter, [batch(4, 16), batch(4, 16)]) == "set aside"
        assert counted(meter, [batch(1, 4), batch(4, 16)]) == "set aside"
        kept = torch.zeros(1000)  # held across updates: everything after starts above what was tracked
        assert counted(meter, [batch(1, 4), batch(4, 16)]) == "tracked"
        del kept
        assert counted(meter, [{"input_ids": torch.ones(2, 2, dtype=torch.long),
                                "labels": torch.zeros(2, dtype=torch.long)}]) == "tracked"  # other inputs
        assert counted(meter, [[torch.ones(2, 2)]]) == "tracked"  # not a mapping of tensors: always
        meter.restart_peak()  # a new unfreezing stage: the trainable set may have grown
        assert counted(meter, [batch(3, 10)]) == "tracked"
    assert memory.make_meter("cpu", track_every_update=True).track_every_update


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_the_command_line_says_how_many_updates_it_tracked(model_dir, tmp_path, capsys):
    from looptrain.cli import finetune

    from conftest import write_csv

    data = write_csv(tmp_path / "train.csv", 96)
    summaries = {}
    for name, extra in (("lean", []), ("every", ["--track-every-update"])):
        argv = ["--model", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / name), "--max-length",
                "32", "--batch-size", "4", "--group-by-length", "--eval-split", "0", "--no-progress-bar",
                "--device", "cpu", *extra]  # the tracker is the CPU's meter (a GPU run reads the allocator)
        assert finetune.main(argv) == 0
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
        out = capsys.readouterr().out
        lean = summaries[name]
        said = re.search(r"\| peak memory \| [\d.]+ MiB \(cpu_tensor_tracker; (\d+) of (\d+) updates tracked", out)
        if name == "lean":
            assert said and (int(said[1]), int(said[2])) == (lean["tracked_updates"], 24), out
            assert lean["untracked_updates"] > 0
        else:
            assert said is None and lean["tracked_updates"] == 24 and lean["untracked_updates"] == 0
    assert summaries["lean"]["peak_memory_bytes"] == summaries["every"]["peak_memory_bytes"]
    assert summaries["lean"]["config"]["track_every_update"] is False
    assert summaries["every"]["config"]["track_every_update"] is True
