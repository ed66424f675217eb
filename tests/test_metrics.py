"""Metrics against hand-computed confusion matrices."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from looptrain.metrics import (
    ClassificationMetrics,
    EvalMetrics,
    UndefinedF1Warning,
    accuracy,
    confusion_matrix,
    f1_scores,
    majority_baseline,
)

# Three classes, ten items.
LABELS = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
PREDICTIONS = [0, 0, 1, 2, 1, 1, 0, 2, 2, 1]
# Confusion matrix, rows = true, columns = predicted:
#            pred0 pred1 pred2
#   true0      2     1     1
#   true1      1     2     0
#   true2      0     1     2
# class 0: tp 2, fp 1, fn 2 -> P 2/3, R 2/4, F1 = 2*2/(2*2+1+2) = 4/7
# class 1: tp 2, fp 2, fn 1 -> P 2/4, R 2/3, F1 = 4/(4+2+1)     = 4/7
# class 2: tp 2, fp 1, fn 1 -> P 2/3, R 2/3, F1 = 4/(4+1+1)     = 4/6
# macro F1 = (4/7 + 4/7 + 2/3) / 3; accuracy = 6/10
EXPECTED_MATRIX = [[2, 1, 1], [1, 2, 0], [0, 1, 2]]
EXPECTED_F1 = [4 / 7, 4 / 7, 4 / 6]


def test_confusion_matrix_by_hand():
    assert confusion_matrix(PREDICTIONS, LABELS).tolist() == EXPECTED_MATRIX


def test_accuracy_and_f1_three_classes():
    assert accuracy(PREDICTIONS, LABELS) == pytest.approx(0.6)
    scores = f1_scores(PREDICTIONS, LABELS)
    assert scores["classes"] == [0, 1, 2]
    assert scores["f1_per_class"] == pytest.approx(EXPECTED_F1)
    assert scores["precision_per_class"] == pytest.approx([2 / 3, 2 / 4, 2 / 3])
    assert scores["recall_per_class"] == pytest.approx([2 / 4, 2 / 3, 2 / 3])
    assert scores["support_per_class"] == [4, 3, 3]
    assert scores["f1_macro"] == pytest.approx(sum(EXPECTED_F1) / 3)
    assert "f1_binary" not in scores


def test_binary_case():
    labels = [1, 1, 1, 0, 0, 0, 0, 1]
    predictions = [1, 0, 1, 0, 1, 0, 0, 1]
    # true0: pred0 3, pred1 1; true1: pred0 1, pred1 3
    # class 1: tp 3, fp 1, fn 1 -> F1 = 6/8 = 0.75; class 0 the same by symmetry -> macro 0.75
    assert confusion_matrix(predictions, labels).tolist() == [[3, 1], [1, 3]]
    scores = f1_scores(predictions, labels)
    assert scores["f1_binary"] == pytest.approx(0.75)
    assert scores["f1_macro"] == pytest.approx(0.75)
    # Asymmetric: true1 all predicted 1, true0 half predicted 1.
    labels = [0, 0, 0, 0, 1, 1]
    predictions = [0, 0, 1, 1, 1, 1]
    # class 1: tp 2, fp 2, fn 0 -> F1 = 4/6; class 0: tp 2, fp 0, fn 2 -> F1 = 4/6 ... macro 2/3
    scores = f1_scores(predictions, labels)
    assert scores["f1_binary"] == pytest.approx(4 / 6)
    assert scores["f1_per_class"] == pytest.approx([4 / 6, 4 / 6])
    labels = [0, 0, 0, 1]
    predictions = [0, 0, 0, 0]
    # class 1: tp 0, fp 0, fn 1 -> F1 0 (never predicted: precision 0, no warning);
    # class 0: tp 3, fp 1, fn 0 -> F1 6/7; macro 3/7
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores = f1_scores(predictions, labels)
    assert scores["f1_binary"] == 0.0
    assert scores["f1_macro"] == pytest.approx(3 / 7)
    assert scores["precision_per_class"] == pytest.approx([3 / 4, 0.0])


def test_absent_class_with_num_labels_counts_as_zero_and_warns():
    labels = [0, 0, 1, 1]
    predictions = [0, 1, 1, 1]
    # class 0: tp 1, fp 0, fn 1 -> 2/3; class 1: tp 2, fp 1, fn 0 -> 4/5; class 2 absent -> 0
    with pytest.warns(UndefinedF1Warning, match=r"F1 is undefined for class 2: no item is labelled or predicted"):
        scores = f1_scores(predictions, labels, num_labels=3)
    assert scores["classes"] == [0, 1, 2]
    assert scores["f1_per_class"] == pytest.approx([2 / 3, 4 / 5, 0.0])
    assert scores["f1_macro"] == pytest.approx((2 / 3 + 4 / 5) / 3)
    assert "f1_binary" not in scores
    # Without num_labels only the classes present are averaged (and it is then binary).
    scores = f1_scores(predictions, labels)
    assert scores["classes"] == [0, 1]
    assert scores["f1_macro"] == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert scores["f1_binary"] == pytest.approx(4 / 5)


def test_class_ids_with_a_gap_average_over_present_classes():
    labels = [0, 2, 2]
    predictions = [0, 2, 0]
    # class 0: tp 1, fp 1, fn 0 -> 2/3; class 2: tp 1, fp 0, fn 1 -> 2/3; class 1 not present
    scores = f1_scores(predictions, labels)
    assert scores["classes"] == [0, 2]
    assert scores["f1_macro"] == pytest.approx(2 / 3)
    assert "f1_binary" not in scores


def test_all_correct_and_all_wrong():
    labels = [0, 1, 2, 1]
    assert accuracy(labels, labels) == 1.0
    scores = f1_scores(labels, labels)
    assert scores["f1_macro"] == 1.0 and scores["f1_per_class"] == [1.0, 1.0, 1.0]
    wrong = [1, 2, 0, 0]
    # Every class has tp 0 -> every F1 is 0.
    assert accuracy(wrong, labels) == 0.0
    assert f1_scores(wrong, labels)["f1_macro"] == 0.0


def test_ignore_index_and_input_types():
    labels = torch.tensor([0, 1, -100, 1])
    predictions = np.array([0, 1, 0, 0])
    assert accuracy(predictions, labels) == pytest.approx(2 / 3)
    assert confusion_matrix(predictions, labels).tolist() == [[1, 0], [1, 1]]


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="differ in size"):
        accuracy([0, 1], [0])
    with pytest.raises(ValueError, match="zero items"):
        accuracy([], [])
    with pytest.raises(ValueError, match="outside"):
        f1_scores([0, 3], [0, 1], num_labels=3)
    with pytest.raises(ValueError, match="integer class ids"):
        accuracy([0.5, 1.0], [0, 1])


def _chunks(tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(tensor, sizes))


def test_streaming_in_chunks_equals_one_shot():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(23, 4, generator=generator)
    labels = torch.randint(0, 4, (23,), generator=generator)
    losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")

    one_shot = ClassificationMetrics()
    one_shot.update(logits, labels, loss_sum=losses.sum(), count=23)

    streamed = ClassificationMetrics()
    sizes = [5, 1, 8, 9]
    for logit_chunk, label_chunk, loss_chunk in zip(
        _chunks(logits, sizes), _chunks(labels, sizes), _chunks(losses, sizes)
    ):
        # A mean loss per chunk, turned back into a sum: the exact mean over items survives.
        streamed.update(logit_chunk, label_chunk, loss_sum=loss_chunk.mean() * len(label_chunk))

    expected_predictions = logits.argmax(-1)
    first, second = one_shot.compute(), streamed.compute()
    assert first["count"] == second["count"] == 23
    assert first["accuracy"] == pytest.approx(second["accuracy"])
    assert first["accuracy"] == pytest.approx(accuracy(expected_predictions, labels))
    assert first["f1"] == pytest.approx(second["f1"])
    assert first["f1"] == pytest.approx(f1_scores(expected_predictions, labels, num_labels=4)["f1_macro"])
    assert second["loss"] == pytest.approx(losses.mean().item(), rel=1e-6)
    np.testing.assert_array_equal(streamed.confusion_matrix, confusion_matrix(expected_predictions, labels, 4))


def test_streaming_hand_computed_with_predictions_and_binary_logit():
    metrics = ClassificationMetrics()
    # Integer predictions in two chunks of the 3-class example above.
    metrics.update(torch.tensor(PREDICTIONS[:4]), torch.tensor(LABELS[:4]))
    metrics.update(torch.tensor(PREDICTIONS[4:]), torch.tensor(LABELS[4:]))
    scores = metrics.compute()
    assert metrics.confusion_matrix.tolist() == EXPECTED_MATRIX
    assert scores == {"accuracy": pytest.approx(0.6), "f1": pytest.approx(sum(EXPECTED_F1) / 3), "count": 10}

    # One logit per item: positive -> class 1. Same as the first binary example: F1 0.75.
    single_logit = ClassificationMetrics()
    single_logit.update(torch.tensor([2.0, -1.0, 0.5, -3.0]), torch.tensor([1, 1, 1, 0]))
    single_logit.update(torch.tensor([[1.0], [-0.2], [-0.1], [0.3]]), torch.tensor([0, 0, 0, 1]))
    # true1: pred1 3 (2.0, 0.5, 0.3), pred0 1; true0: pred0 3, pred1 1 -> [[3, 1], [1, 3]]
    assert single_logit.confusion_matrix.tolist() == [[3, 1], [1, 3]]
    scores = single_logit.compute()
    assert scores["f1_binary"] == pytest.approx(0.75) and scores["f1"] == pytest.approx(0.75)
    assert "loss" not in scores


def test_streaming_token_logits_with_ignore_index_and_reset():
    logits = torch.tensor([[[3.0, 0.0], [0.0, 3.0], [3.0, 0.0]]])  # predictions 0, 1, 0
    labels = torch.tensor([[0, 0, -100]])
    metrics = ClassificationMetrics(num_labels=2)
    metrics.update(logits, labels, loss_sum=1.5, count=2)
    assert metrics.compute() == {
        "accuracy": 0.5,
        "f1": pytest.approx((2 / 3 + 0.0) / 2),  # class 0: tp 1, fn 1 -> 2/3; class 1: tp 0, fp 1 -> 0
        "f1_binary": 0.0,
        "loss": 0.75,
        "count": 2,
    }
    metrics.reset()
    with pytest.raises(ValueError, match="no labelled items"):
        metrics.compute()


def test_streaming_errors():
    metrics = ClassificationMetrics(num_labels=2)
    with pytest.raises(ValueError, match="outside"):
        metrics.update(torch.tensor([0, 2]), torch.tensor([0, 1]))
    metrics = ClassificationMetrics()
    metrics.update(torch.randn(2, 3), torch.tensor([0, 1]), loss_sum=1.0)
    with pytest.raises(ValueError, match="every update"):
        metrics.update(torch.randn(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="predictions for"):
        ClassificationMetrics().update(torch.randn(3, 2), torch.tensor([0, 1]))


def test_majority_baseline():
    labels = [2, 2, 2, 0, 1, 2]
    # Always 2: accuracy 4/6. class 2: tp 4, fp 2, fn 0 -> 8/10; classes 0, 1: F1 0 -> macro 0.8/3
    baseline = majority_baseline(labels)
    assert baseline["majority_class"] == 2
    assert baseline["accuracy"] == pytest.approx(4 / 6)
    assert baseline["f1"] == pytest.approx(0.8 / 3)
    # Binary, tie broken towards the smaller id: always 0 -> class 0 F1 2*2/(4+2) = 2/3, class 1 0.
    binary = majority_baseline(torch.tensor([1, 0, 1, 0]))
    assert binary["majority_class"] == 0
    assert binary["f1"] == pytest.approx(1 / 3) and binary["f1_binary"] == 0.0
    with pytest.raises(ValueError, match="zero labels"):
        majority_baseline([])


@pytest.mark.slow  # 7 s; .ci/run runs it, make test stays under 5 minutes
def test_matches_scikit_learn_when_installed():
    metrics_module = pytest.importorskip("sklearn.metrics")
    generator = np.random.default_rng(0)
    for num_labels in (2, 3, 5):
        labels = generator.integers(0, num_labels, 50)
        predictions = generator.integers(0, num_labels, 50)
        scores = f1_scores(predictions, labels, num_labels=num_labels)
        expected = metrics_module.f1_score(
            labels, predictions, labels=list(range(num_labels)), average="macro", zero_division=0
        )
        assert scores["f1_macro"] == pytest.approx(expected)
        assert accuracy(predictions, labels) == pytest.approx(metrics_module.accuracy_score(labels, predictions))
        if num_labels == 2:
            assert scores["f1_binary"] == pytest.approx(metrics_module.f1_score(labels, predictions))
    assert not math.isnan(scores["f1_macro"])


@pytest.mark.parametrize("labels, predictions, absent", [
    ([0, 0, 2], [0, 0, 2], [1, 3]),       # labels '1' and '3' only: '2' and '4' are absent
    ([0, 0, 2], [0, 1, 2], [3]),          # '2' is predicted, never a label: present (labels ∪ predictions)
    ([0, 1, 2, 3], [0, 0, 0, 0], []),     # every class is a label: none absent, whatever is predicted
    ([3, 3], [3, 3], [0, 1, 2]),
])
def test_the_f1_warning_names_exactly_the_classes_neither_labelled_nor_predicted(labels, predictions, absent):
    """The classes it names are range(num_labels) minus labels ∪ predictions, by their label names: with labels
    '1'..'4', the class of id 1 is '2', never the label '1' that is present."""
    names = ["1", "2", "3", "4"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f1_scores(predictions, labels, num_labels=4, label_names=names)
    messages = [str(warning.message) for warning in caught if warning.category is UndefinedF1Warning]
    assert sorted(set(range(4)) - set(labels) - set(predictions)) == absent  # the definition, spelled out
    if not absent:
        assert messages == []
        return
    named = [f"'{names[index]}' (id {index})" for index in absent]
    assert messages == [f"F1 is undefined for {'class' if len(absent) == 1 else 'classes'} {', '.join(named)}: no "
                        f"item is labelled or predicted as it, so it counts 0 in the macro-F1 over all 4 classes; "
                        "evaluate on data holding every class (or pass num_labels=None to average only over the "
                        "classes present)"]


def test_the_loops_metrics_name_the_absent_class_by_the_models_labels():
    from conftest import make_tiny_bert

    model = make_tiny_bert(num_labels=3)
    model.config.id2label = {0: "1", 1: "2", 2: "3"}
    evaluation = EvalMetrics.for_model(model)
    evaluation.update({"logits": torch.tensor([[9.0, 0, 0], [0, 0, 9.0]]), "labels": torch.tensor([0, 2])})
    with pytest.warns(UndefinedF1Warning, match=r"^F1 is undefined for class '2' \(id 1\): ") as caught:
        evaluation.compute()
    assert len(caught) == 1
    assert EvalMetrics.for_model(make_tiny_bert(num_labels=3)).label_names is None  # LABEL_0..: ids
