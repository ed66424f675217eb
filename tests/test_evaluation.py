"""Evaluation for any task: the metrics hooks, metric_for_best on any key, checks before training, trackers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from looptrain import EvaluationError, Loop
from looptrain.metrics import ClassificationMetrics, EvalMetrics

from conftest import SmallMLP, mlp_batches
from conftest import quiet_config as quiet


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x, labels=None):
        prediction = self.linear(x).squeeze(-1)
        loss = None if labels is None else nn.functional.mse_loss(prediction, labels)
        return {"loss": loss, "logits": prediction}


class MeanAbsoluteError:
    """A streaming metric for regression: it must see float predictions and labels as they are."""

    def __init__(self, loop):
        self.loop, self.total, self.count = loop, 0.0, 0

    def update(self, output):
        batch = output["batch"]
        predictions = self.loop.model(batch["x"])["logits"]
        self.total += float((predictions - batch["labels"]).abs().sum())
        self.count += batch["labels"].numel()

    def merge(self, other):
        self.total, self.count = self.total + other.total, self.count + other.count

    def compute(self):
        return {"mae": self.total / self.count}


class RegressionLoop(Loop):
    def eval_step(self, batch):
        return {**super().eval_step(batch), "batch": batch}

    def make_metrics(self):
        return MeanAbsoluteError(self)


def test_evaluation_keeps_float_predictions_and_labels_for_a_regression_metric():
    torch.manual_seed(0)
    model = Regressor()
    x = torch.randn(12, 4)
    labels = x @ torch.tensor([1.5, -2.0, 0.5, 0.25]) + 0.3  # not integers: casting them would be wrong
    batches = [{"x": x[i:i + 4], "labels": labels[i:i + 4]} for i in range(0, 12, 4)]
    loop = RegressionLoop(model, torch.optim.SGD(model.parameters(), lr=0.0), batches, eval_loader=batches,
                          config=quiet(metric_for_best="mae"))
    scores = loop.evaluate()
    with torch.no_grad():
        expected = (model(x)["logits"] - labels).abs().mean().item()
    assert scores["mae"] == pytest.approx(expected, rel=1e-6) and expected > 0.1


def test_the_default_metrics_score_classification_and_loss():
    torch.manual_seed(0)
    model = SmallMLP()
    batches = mlp_batches(3)
    scores = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, eval_loader=batches,
                  config=quiet()).evaluate()
    with torch.no_grad():
        outputs = [model(**batch) for batch in batches]
    predictions = torch.cat([output["logits"].argmax(-1) for output in outputs])
    labels = torch.cat([batch["labels"] for batch in batches])
    mean_loss = sum(float(output["loss"]) * 8 for output in outputs) / 24
    assert scores["accuracy"] == pytest.approx((predictions == labels).float().mean().item())
    assert scores["loss"] == pytest.approx(mean_loss, rel=1e-6)
    assert scores["count"] == 24 and "perplexity" not in scores


def test_metric_for_best_the_metrics_do_not_produce_fails_before_training(tmp_path):
    model = SmallMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loop = Loop(model, optimizer, mlp_batches(4), eval_loader=mlp_batches(1),
                config=quiet(metric_for_best="bleu", output_dir=str(tmp_path), eval_every=2))
    with pytest.raises(EvaluationError, match=r"metric_for_best='bleu' is not among the evaluation metrics "
                                              r"\['accuracy', 'count', 'f1', 'loss'\].*Loop.compute_metrics"):
        loop.fit()
    assert loop.step == 0 and not list(tmp_path.glob("checkpoint-*"))  # nothing trained, nothing written


def test_a_broken_eval_step_fails_before_training_naming_the_hook():
    model = SmallMLP()
    tuple_batches = [(batch["x"], batch["labels"]) for batch in mlp_batches(2)]
    dict_batches = mlp_batches(2)  # training on dicts works; evaluation gets tuples the default cannot run
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), dict_batches, eval_loader=tuple_batches,
                config=quiet())
    with pytest.raises(EvaluationError, match=r"evaluation fails on the first eval batch \(TypeError: the default "
                                              r"compute_loss calls model\(\*\*batch\).*Override Loop.eval_step"):
        loop.fit()
    assert loop.step == 0


def test_metric_for_best_can_be_any_key_with_its_direction(tmp_path):
    class ScoredLoop(Loop):
        """Scores each evaluation with a made-up metric that peaks at step 4 (lower is better)."""

        def compute_metrics(self, evaluation):
            return {**evaluation.compute(), "distance": abs(self.step - 4)}

    model = SmallMLP()
    summary = ScoredLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_batches(8), eval_loader=mlp_batches(1),
                         config=quiet(metric_for_best="distance", greater_is_better=False, output_dir=str(tmp_path),
                                      eval_every=2)).fit()
    assert summary["best_checkpoint"] == "checkpoint-4" and summary["best_metric"] == 0
    assert summary["metric_for_best"] == "distance"


def test_perplexity_picks_the_lowest_by_default(tmp_path):
    class TokenLoop(Loop):
        def compute_loss(self, batch):
            inputs, targets = batch
            logits = self.wrapped_model(inputs)
            return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    data = [(torch.randint(0, 10, (4, 6)), torch.randint(0, 10, (4, 6))) for _ in range(6)]
    summary = TokenLoop(model, torch.optim.SGD(model.parameters(), lr=0.5), data, eval_loader=data[:2],
                        config=quiet(metric_for_best="perplexity", output_dir=str(tmp_path), eval_every=2)).fit()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    perplexities = {event["step"]: event["perplexity"] for event in events if event["event"] == "eval"}
    assert set(perplexities) == {2, 4, 6}
    assert all(value == pytest.approx(math.exp(event["loss"])) for event in events if event["event"] == "eval"
               for value in [event["perplexity"]])
    best_step = min(perplexities, key=perplexities.get)
    assert summary["best_checkpoint"] == f"checkpoint-{best_step}"


def test_the_final_evaluation_is_logged_and_a_best_candidate(tmp_path):
    # 7 updates, evaluation every 3: the last evaluation point is step 6; the final one (step 7) still counts.
    class LatestIsBest(Loop):
        def compute_metrics(self, evaluation):
            return {**evaluation.compute(), "step_score": self.step}

    model = SmallMLP()
    summary = LatestIsBest(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_batches(7),
                           eval_loader=mlp_batches(1),
                           config=quiet(metric_for_best="step_score", output_dir=str(tmp_path), eval_every=3)).fit()
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [event["step"] for event in events if event["event"] == "eval"] == [3, 6, 7]
    assert summary["best_checkpoint"] == "checkpoint-7" and (tmp_path / "checkpoint-7" / "COMPLETE").exists()


def test_eval_metrics_merge_equals_one_pass():
    torch.manual_seed(0)
    outputs = [{"loss_sum": torch.tensor(float(i)), "num_items": 4, "rows": 4, "logits": torch.randn(4, 3),
                "labels": torch.randint(0, 3, (4,))} for i in range(6)]
    whole, first, second = EvalMetrics(num_labels=3), EvalMetrics(num_labels=3), EvalMetrics(num_labels=3)
    for index, output in enumerate(outputs):
        whole.update(output)
        (first if index % 2 else second).update(output)
    first.merge(second)
    assert first.compute() == whole.compute()
    classification = ClassificationMetrics(num_labels=3)
    for output in outputs:
        classification.update(output)  # an eval_step dict is accepted as it is
    assert classification.compute()["accuracy"] == whole.compute()["accuracy"]


def test_tensorboard_tracker_receives_every_event(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = SmallMLP()
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_batches(6), eval_loader=mlp_batches(1),
         config=quiet(report_to="tensorboard", output_dir=str(tmp_path), log_every=2, eval_every=3)).fit()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [scalar.step for scalar in events.Scalars("train/loss")] == [2, 4, 6]
    assert [scalar.step for scalar in events.Scalars("eval/accuracy")] == [3, 6]
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_losses = [event["loss"] for event in logged if event["event"] == "train"]
    assert [scalar.value for scalar in events.Scalars("train/loss")] == pytest.approx(train_losses, rel=1e-6)


def test_progress_bar_advances_once_per_update_on_a_terminal(monkeypatch, capsys):
    import sys

    from looptrain import run_log

    bars = []

    class RecordingBar:
        def __init__(self, total, initial, **_):
            self.total, self.n = total, initial
            bars.append(self)

        def update(self, steps):
            self.n += steps

        def set_postfix(self, **_):
            pass

        def close(self):
            pass

    monkeypatch.setattr(run_log, "tqdm", type("FakeTqdm", (), {"__new__": lambda cls, **kw: RecordingBar(**kw),
                                                               "write": staticmethod(lambda line, file=None: None)}))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    model = SmallMLP()
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_batches(10),
         config=quiet(progress_bar=True, accum_steps=2)).fit()
    assert len(bars) == 1 and bars[0].total == 5 and bars[0].n == 5


def test_heartbeat_lines_show_progress_without_a_terminal(monkeypatch, capsys):
    from looptrain import run_log

    monkeypatch.setattr(run_log, "HEARTBEAT_SECONDS", 0.0)  # every chance to print is taken
    model = SmallMLP()
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), mlp_batches(6), eval_loader=mlp_batches(2),
         config=quiet(accum_steps=2, eval_every="epoch")).fit()
    lines = capsys.readouterr().out.splitlines()
    training = [line for line in lines if line.startswith("training: step")]
    assert [line.split(" (")[0] for line in training] == ["training: step 1/3", "training: step 2/3",
                                                           "training: step 3/3"]
    assert "s to go" in training[0]
    assert any(line.startswith("evaluating at step 3: batch 2/2") for line in lines)
