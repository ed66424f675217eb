"""Evaluation's peak in the estimate (issue 53): against the tracker on a hand-run no_grad forward, evaluation's batch
cut to fit a plan's budget, and evaluation's loss exact whatever its batch."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from looptrain import estimation
from looptrain.cli.estimate import main as estimate_main
from looptrain.loop import Loop
from looptrain.memory.tracker import StorageTracker
from looptrain.planning import Plan, evaluation_batch
from looptrain.strategy import Strategy

from conftest import quiet_config

# The estimate runs the Loop's `eval_step` (its item count and loss sum beside the forward) on fake tensors; the
# reference below is the model's bare forward: a few KiB apart on these 80-100 KiB models.
TOLERANCE = 0.02


def tiny(kind: str) -> nn.Module:
    from transformers import AutoModelForCausalLM, BertConfig, BertForSequenceClassification, Qwen2Config

    torch.manual_seed(0)
    if kind == "classifier":
        return BertForSequenceClassification(BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
            max_position_embeddings=64, num_labels=2))
    return AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=40, max_position_embeddings=64))


def measured_evaluation_peak(model: nn.Module, rows: int, width: int) -> int:
    """The tracker's peak over a no_grad forward in eval mode, after one AdamW step created the optimizer state
    (gradients freed), as evaluation meets it in a run."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    (torch.stack([parameter.sum() for parameter in trainable]).sum() * 0).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    batch = estimation.random_batch(rows, width, model.config.vocab_size, 2, torch.Generator().manual_seed(0),
                                    token_labels="CausalLM" in type(model).__name__)
    model.eval()
    tracker = StorageTracker()
    tracker.classify(model, optimizer)
    tracker.reset_peak()
    with tracker, torch.no_grad():
        model(**batch)
    return tracker.peak_bytes


@pytest.mark.parametrize("kind, lora_rank", [("classifier", 0), ("causal-lm", 4),
                                             # the other two with the slow tests: make test's time is counted
                                             pytest.param("classifier", 4, marks=pytest.mark.slow),
                                             pytest.param("causal-lm", 0, marks=pytest.mark.slow)])
def test_the_evaluation_estimate_is_the_measured_peak_of_a_no_grad_forward(kind, lora_rank):
    strategy = Strategy(lora_rank=lora_rank)
    estimated = estimation.estimate_evaluation(tiny(kind), [(8, 24)], strategy, cache=False)
    model = strategy.wrap_model(tiny(kind)) if lora_rank else tiny(kind)
    measured = measured_evaluation_peak(model, 8, 24)
    assert estimated["peak_memory_bytes"] == estimated["evaluation_peak_bytes"]
    assert estimated["memory_breakdown"]["grads"] == 0 and estimated["memory_breakdown"]["optimizer_state"] > 0
    assert abs(estimated["evaluation_peak_bytes"] - measured) / measured <= TOLERANCE, (estimated, measured)


def test_an_estimate_with_evaluation_carries_both_peaks_and_the_higher_is_its_peak():
    both = estimation.estimate(tiny("classifier").config, 2, 24, eval_batch_size=32)  # the command line's, below
    alone = estimation.estimate_evaluation(tiny("classifier").config, [(32, 24)])
    assert both["evaluation_peak_bytes"] == alone["evaluation_peak_bytes"] > both["training_peak_bytes"]
    assert both["peak_memory_bytes"] == both["evaluation_peak_bytes"]
    assert both["training_peak_bytes"] == max(peak for phase, peak in both["phase_peak_bytes"].items()
                                              if phase != "eval")


def test_the_command_line_prints_and_answers_evaluations_peak(tmp_path, capsys):
    config = tmp_path / "config.json"
    tiny("classifier").config.to_json_file(config)
    assert estimate_main(["--config", str(config), "--batch-size", "2", "--seq-len", "24", "--eval-batch-size", "32",
                          "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    expected = estimation.estimate(tiny("classifier").config, 2, 24, eval_batch_size=32)
    assert printed["eval_batch_size"] == 32
    assert (printed["training_peak_bytes"], printed["evaluation_peak_bytes"]) == (
        expected["training_peak_bytes"], expected["evaluation_peak_bytes"])
    assert estimate_main(["--config", str(config), "--batch-size", "2", "--seq-len", "24", "--eval-batch-size",
                          "32"]) == 0
    assert (f"evaluation: {expected['evaluation_peak_bytes'] / 1024**3:.3f} GiB (a forward without gradients at "
            "batch 32 x seq 24") in capsys.readouterr().out


def plan_of(budget: int, margin: float = 0.1, overhead: int = 0) -> Plan:
    return Plan(budget, margin, 8, 32, "cpu", [], 0, 0.0, 0.0, None, 64, overhead_bytes=overhead)


def test_the_evaluation_batch_is_the_largest_that_fits_the_plans_budget():
    def peak_at(rows: int) -> int:  # affine in the rows, as an evaluation forward's memory is
        asked.append(rows)
        return 1000 + 100 * rows

    asked: list[int] = []
    kept = evaluation_batch(plan_of(100_000), 64, peak_at)
    assert (kept.size, kept.fits, kept.note, asked) == (64, True, None, [64])
    # (1000 + 100 rows + 500 besides) x 1.1 <= 4000: rows <= 21
    cut = evaluation_batch(plan_of(4000, overhead=500), 64, peak_at)
    assert (cut.size, cut.requested, cut.peak_bytes, cut.fits) == (21, 64, 3100, True)
    assert cut.note.startswith("evaluation batch 64 -> 21 to stay within 0.0 MiB of live tensors")
    none = evaluation_batch(plan_of(1000), 64, peak_at)
    assert (none.size, none.fits) == (1, False) and "even one row is estimated at" in none.note


@pytest.mark.parametrize("kind", ["causal-lm", pytest.param("classifier", marks=pytest.mark.slow)])
def test_the_evaluation_loss_is_the_exact_mean_whatever_the_evaluation_batch(kind):
    """Cutting the evaluation batch to fit a budget leaves its scores as they were: the loss is the mean over every
    sample (classifier) or every scored token (causal LM), checked against the library's cross-entropy over all."""
    model = tiny(kind)
    generator = torch.Generator().manual_seed(1)
    lengths = [5, 9, 3, 12, 7, 4, 11]
    samples = [estimation.random_batch(1, length, 100, 2, generator, token_labels=kind == "causal-lm")
               for length in lengths]
    samples = [{**sample, "attention_mask": torch.ones_like(sample["input_ids"])} for sample in samples]

    def batched(rows: int) -> list[dict]:  # right-padded as the run's collator pads: ids and mask 0, labels -100
        batches = []
        for start in range(0, len(samples), rows):
            group = samples[start:start + rows]
            width = max(sample["input_ids"].shape[1] for sample in group)
            batch = {}
            for name in group[0]:
                pad = -100 if name == "labels" else 0
                batch[name] = torch.cat([nn.functional.pad(sample[name], (0, width - sample[name].shape[1]), value=pad)
                                         if sample[name].dim() == 2 else sample[name] for sample in group])
            batches.append(batch)
        return batches

    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config())
    losses = [loop.evaluate(batched(rows))["loss"] for rows in (1, 3, 7)]
    model.eval()
    with torch.no_grad():
        outputs = [(model(input_ids=sample["input_ids"]).logits, sample["labels"]) for sample in samples]
    if kind == "causal-lm":
        logits = torch.cat([logit[0, :-1] for logit, _ in outputs])
        targets = torch.cat([labels[0, 1:] for _, labels in outputs])
    else:
        logits, targets = torch.cat([logit for logit, _ in outputs]), torch.cat([labels for _, labels in outputs])
    reference = nn.functional.cross_entropy(logits, targets, ignore_index=-100).item()
    assert losses == pytest.approx([reference] * 3, rel=1e-5)
