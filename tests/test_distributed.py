"""torchrun on CPU (gloo): 2 ranks give the same model as 1 rank with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from looptrain.cli import finetune

from conftest import run_torchrun, write_csv

ROOT = Path(__file__).resolve().parent.parent

# The module's runs (one torchrun launch of 2 ranks and its 1-rank references) take about 15-20 s on 2 cores: slow,
# so `make test` stays under 5 minutes; .ci/run and `make test-all` run them.
pytestmark = [pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                 reason="needs torch.distributed with gloo"),
              pytest.mark.slow]


def launch(nproc: int, root: Path, steps: list[dict]) -> subprocess.CompletedProcess:
    """One torchrun launch of `nproc` ranks that runs every step of `steps` (see tests/distributed_runs.py)."""
    plan = root / "plan.json"
    plan.write_text(json.dumps(steps))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc_per_node", str(nproc), str(ROOT / "tests" / "distributed_runs.py"), str(plan)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    result = run_torchrun(command, environment, ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory):
    """One 1-rank run (batch 8, in this process) and 2-rank runs (batch 4 each, one torchrun launch), all accum 2:
    global batch 16."""
    root = tmp_path_factory.mktemp("ddp")
    # 38 samples: 10 micro-batches of 4 (the last holds 2) over 2 ranks, or 5 of 8 (the last holds 6)
    # on 1 rank; windows of 2 groups: 16, 16 and a partial 6. Rank 1's last micro-batch holds 2 items
    # while rank 0's holds 4: only a global item count gives the 1-rank update.
    train = write_csv(root / "train.csv", 38, seed=5)
    evaluation = write_csv(root / "eval.csv", 21, seed=6)
    common = ["--model", str(model_dir), "--data", str(train), "--eval-data", str(evaluation), "--max-length", "32",
              "--lr", "1e-3", "--epochs", "2", "--accum", "2", "--eval-every", "epoch", "--eval-batch-size", "4",
              "--log-every", "1", "--device", "cpu", "--no-track-memory", "--no-progress-bar"]
    assert finetune.main(
        [*common, "--batch-size", "8", "--output-dir", str(root / "one")]) == 0
    steps = [
        {"name": "two", "argv": [*common, "--batch-size", "4", "--output-dir", str(root / "two")]},
        # FSDP2 (sharded parameters, gradients and optimizer state) with gradient checkpointing.
        {"name": "fsdp", "argv": [*common, "--batch-size", "4", "--fsdp", "--grad-checkpoint",
                                  "--output-dir", str(root / "fsdp")]},
    ]
    # A planned run: rank 0 plans, both ranks train its plan (each planning for itself could pick another split).
    steps.append({"name": "planned", "argv": [*common, "--batch-size", "4", "--memory-budget", "64MiB",
                                              "--budget-meter", "tensors", "--plan-time", "3",
                                              "--output-dir", str(root / "planned")]})
    # Resumes from the mid-run checkpoint (end of epoch 0: step 3), under DDP and under FSDP2.
    for name, extra in (("two", []), ("fsdp", ["--fsdp", "--grad-checkpoint"])):
        resumed = root / f"{name}-resumed"
        steps += [{"copy": [str(root / name / "checkpoint-3"), str(resumed / "checkpoint-3")]},
                  {"name": f"{name}-resumed", "argv": [*common, "--batch-size", "4", *extra, "--output-dir",
                                                       str(resumed), "--resume", str(resumed / "checkpoint-3")]}]
    launch(2, root, steps)
    return root


def test_a_planned_run_trains_rank_zeros_plan_on_every_rank(runs):
    summary = json.loads((runs / "planned" / "summary.json").read_text())
    assert summary["plan"]["effective_batch"] == 8  # per rank
    assert json.loads((runs / "planned" / "run_config.json").read_text())["world_size"] == 2
    settings = summary["plan"]["settings"]
    assert settings["batch_size"] * settings["accum_steps"] == 8
    assert summary["optimizer_steps"] == 6  # 38 samples, 2 epochs, a global batch of 16: 3 updates an epoch
    rank_zero = (runs / "planned.rank0.out").read_text()
    assert "plan for a budget of 64.0 MiB of live tensors" in rank_zero and (runs / "planned" / "final").is_dir()


def final_weights(directory: Path) -> dict:
    return load_file(str(directory / "final" / "model.safetensors"))


def test_two_ranks_equal_one_rank_with_the_same_global_batch(runs):
    root = runs
    one = load_file(str(root / "one" / "final" / "model.safetensors"))
    two = load_file(str(root / "two" / "final" / "model.safetensors"))
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    summary_one = json.loads((root / "one" / "summary.json").read_text())
    summary_two = json.loads((root / "two" / "summary.json").read_text())
    assert summary_one["optimizer_steps"] == summary_two["optimizer_steps"] == 6  # 3 windows x 2 epochs
    # Evaluation gathered across ranks: every one of the 21 samples counted once, same scores.
    for metric in ("accuracy", "f1", "loss"):
        assert summary_two["final_eval"][metric] == pytest.approx(summary_one["final_eval"][metric], rel=1e-5)
    # Throughput counts every rank's samples and tokens: 38 samples a epoch, the same tokens as one rank saw.
    assert summary_two["train_samples"] == summary_one["train_samples"] == 2 * 38
    assert summary_two["train_tokens"] == summary_one["train_tokens"]


def test_only_rank_zero_writes(runs):
    root = runs
    lines_one = (root / "one" / "metrics.jsonl").read_text().splitlines()
    lines_two = (root / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(lines_two) == len(lines_one) == 8  # 6 train lines + 2 evaluations, written once
    losses_one = [json.loads(line)["loss"] for line in lines_one]
    losses_two = [json.loads(line)["loss"] for line in lines_two]
    assert losses_two == pytest.approx(losses_one, rel=1e-5)  # the logged loss is the global window mean
    assert sorted(p.name for p in (root / "two").iterdir()) == sorted(p.name for p in (root / "one").iterdir())
    # The final table is printed by rank 0 alone.
    assert (root / "two.rank0.out").read_text().count("looptrain run in") == 1
    assert "looptrain run in" not in (root / "two.rank1.out").read_text()
    # The run's picture is drawn by rank 0 alone (`looptrain.report`), after the tables.
    assert (root / "two" / "report.png").is_file()
    assert (root / "two.rank0.out").read_text().count(f"the run's picture: {root / 'two' / 'report.png'}") == 1


def test_fsdp2_with_checkpointing_equals_one_rank(runs):
    root = runs
    one, sharded = final_weights(root / "one"), final_weights(root / "fsdp")
    assert sharded.keys() == one.keys()  # the full (gathered) weights, under their usual names
    for key in one:
        torch.testing.assert_close(sharded[key], one[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, key=key: f"{key}: {m}")
    assert json.loads((root / "fsdp" / "summary.json").read_text())["optimizer_steps"] == 6


@pytest.mark.parametrize("name", ["two", "fsdp"])
def test_resume_under_ddp_and_fsdp2_equals_uninterrupted(runs, name):
    root = runs
    uninterrupted, resumed = final_weights(root / name), final_weights(root / f"{name}-resumed")
    for key in uninterrupted:
        assert torch.equal(resumed[key], uninterrupted[key]), key
