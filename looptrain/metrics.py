"""Evaluation metrics: streaming objects the Loop fills batch by batch, accuracy, F1, a majority baseline.

The Loop's evaluation protocol: `Loop.make_metrics()` returns an object with `update(output)` (one
`eval_step` output dict per batch), `merge(other)` (another rank's object) and `compute()` (a dict
of scores). `EvalMetrics`, the default, always scores the loss; it adds accuracy and macro F1 when
the outputs carry class logits (through `ClassificationMetrics`), and perplexity when the loss is
per token and there are no class scores (a language model).

Everything is computed from a confusion matrix (rows: true class, columns: predicted class), so the
streaming accumulator only ever keeps a `num_labels x num_labels` table of counts on the CPU, never
the logits of the whole evaluation set.

Conventions (the same as scikit-learn's with `zero_division=0`):

* Which classes count. With `num_labels` given, the classes are `range(num_labels)` and the macro
  average is over all of them. Without it, the classes are those that appear in labels or
  predictions (labels ∪ predictions), sorted.
* A class with no true and no predicted items (possible only when `num_labels` is given) has
  precision, recall and F1 of 0, is included in the macro average, and raises an
  `UndefinedF1Warning`: a small evaluation set that misses a class scores lower on macro F1 for it,
  exactly as `sklearn.metrics.f1_score(..., labels=range(num_labels), average="macro")` does.
* Precision of a class never predicted, or recall of a class never true, is 0 (no warning: its F1
  is then well defined, `2·tp / (2·tp + fp + fn)`).
* `f1_binary` (F1 of the positive class 1) is reported when the classes are exactly {0, 1}.
* Labels equal to `ignore_index` (default -100, the token-classification padding label) are skipped.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "EvalMetrics",
    "UndefinedF1Warning",
    "accuracy",
    "confusion_matrix",
    "f1_scores",
    "ClassificationMetrics",
    "captured_output",
    "logits_of",
    "label_names_of",
    "majority_baseline",
    "named_labels",
    "scoreable_logits",
    "vocab_size_of",
]

IGNORE_INDEX = -100

ArrayLike = torch.Tensor | np.ndarray | Sequence[int]
# A head with more outputs than this is taken for a vocabulary, not a label set: its confusion
# matrix would not fit in memory (50k classes: 20 GB). Override Loop.make_metrics for such tasks.
MAX_CLASSES = 1024


class UndefinedF1Warning(UserWarning):
    """A class has no true and no predicted items: its F1 is set to 0."""


def _to_int64_numpy(values: ArrayLike, name: str) -> np.ndarray:
    """Flattens a tensor, array or sequence of class ids to a 1-D int64 numpy array."""
    if isinstance(values, torch.Tensor):
        values = values.detach().to("cpu", torch.int64).numpy()
    array = np.asarray(values)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        if np.issubdtype(array.dtype, np.floating) and np.all(np.mod(array, 1) == 0):
            array = array.astype(np.int64)
        else:
            raise ValueError(
                f"{name} must hold integer class ids, got dtype {array.dtype}; "
                "pass argmax predictions (or logits to ClassificationMetrics.update)."
            )
    return array.astype(np.int64, copy=False).reshape(-1)


def _paired(predictions: ArrayLike, labels: ArrayLike, ignore_index: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Converts both inputs, checks their lengths match and drops ignored labels."""
    prediction_array = _to_int64_numpy(predictions, "predictions")
    label_array = _to_int64_numpy(labels, "labels")
    if prediction_array.shape != label_array.shape:
        raise ValueError(
            f"predictions and labels differ in size ({prediction_array.size} vs {label_array.size}); "
            "pass one prediction per label."
        )
    if ignore_index is not None:
        keep = label_array != ignore_index
        prediction_array, label_array = prediction_array[keep], label_array[keep]
    return prediction_array, label_array


def _check_range(values: np.ndarray, num_labels: int, name: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= num_labels):
        raise ValueError(
            f"{name} hold class ids outside [0, {num_labels}): min {values.min()}, max {values.max()}; "
            "check num_labels and the label column."
        )


def confusion_matrix(predictions: ArrayLike, labels: ArrayLike, num_labels: int | None = None) -> np.ndarray:
    """Counts items per (true class, predicted class).

    Args:
        predictions: Predicted class ids (any shape; flattened).
        labels: True class ids, same size; items labelled -100 are skipped.
        num_labels: Number of classes; inferred as `max(id) + 1` when omitted.

    Returns:
        An int64 array `matrix[true, predicted]` of shape `(num_labels, num_labels)`.

    Raises:
        ValueError: Sizes differ, ids are negative, or ids reach `num_labels`.
    """
    prediction_array, label_array = _paired(predictions, labels, IGNORE_INDEX)
    if num_labels is None:
        largest = max(int(prediction_array.max(initial=-1)), int(label_array.max(initial=-1)))
        num_labels = largest + 1
    _check_range(prediction_array, num_labels, "predictions")
    _check_range(label_array, num_labels, "labels")
    flat = np.bincount(label_array * num_labels + prediction_array, minlength=num_labels * num_labels)
    return flat.reshape(num_labels, num_labels).astype(np.int64)


def _classes_in_use(matrix: np.ndarray, num_labels: int | None) -> list[int]:
    """`range(num_labels)` when given, else the classes seen as a label or a prediction."""
    if num_labels is not None:
        return list(range(num_labels))
    seen = (matrix.sum(axis=0) + matrix.sum(axis=1)) > 0
    return [int(index) for index in np.flatnonzero(seen)]


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """Elementwise division that yields 0 where the denominator is 0 (zero_division=0)."""
    result = np.zeros(numerator.shape, dtype=np.float64)
    nonzero = denominator > 0
    result[nonzero] = numerator[nonzero] / denominator[nonzero]
    return result


def _absent_classes_message(absent: list[int], num_classes: int, label_names: Sequence[str] | None) -> str:
    """The warning for classes with no true and no predicted item, named by their labels where known."""
    named = [f"{label_names[index]!r} (id {index})" if label_names else str(index) for index in absent]
    which = "class " + named[0] if len(named) == 1 else "classes " + ", ".join(named)
    return (f"F1 is undefined for {which}: no item is labelled or predicted as it, so it counts 0 in the macro-F1 over "
            f"all {num_classes} classes; evaluate on data holding every class (or pass num_labels=None to average "
            "only over the classes present)")


def _scores_from_confusion(matrix: np.ndarray, num_labels: int | None,
                           label_names: Sequence[str] | None = None) -> dict[str, Any]:
    """Per-class precision, recall, F1 and their macro average from a confusion matrix (`label_names`: the
    classes' names in id order, for the warning about an absent class)."""
    classes = _classes_in_use(matrix, num_labels)
    if num_labels is not None and matrix.shape[0] < num_labels:
        padded = np.zeros((num_labels, num_labels), dtype=np.int64)
        padded[: matrix.shape[0], : matrix.shape[1]] = matrix
        matrix = padded
    # Column / row totals over the whole matrix: mass outside `classes` still counts as fp / fn.
    true_positive = np.array([matrix[index, index] for index in classes], dtype=np.float64)
    predicted_total = np.array([matrix[:, index].sum() for index in classes], dtype=np.float64)
    true_total = np.array([matrix[index, :].sum() for index in classes], dtype=np.float64)
    false_positive = predicted_total - true_positive
    false_negative = true_total - true_positive
    precision = _safe_divide(true_positive, predicted_total)
    recall = _safe_divide(true_positive, true_total)
    f1 = _safe_divide(2 * true_positive, 2 * true_positive + false_positive + false_negative)
    absent = [classes[index] for index in np.flatnonzero(predicted_total + true_total == 0)]
    if absent:
        warnings.warn(_absent_classes_message(absent, len(classes), label_names), UndefinedF1Warning, stacklevel=3)
    scores: dict[str, Any] = {
        "f1_macro": float(f1.mean()) if len(classes) else 0.0,
        "classes": classes,
        "f1_per_class": [float(value) for value in f1],
        "precision_per_class": [float(value) for value in precision],
        "recall_per_class": [float(value) for value in recall],
        "support_per_class": [int(value) for value in true_total],
    }
    if classes == [0, 1]:
        scores["f1_binary"] = float(f1[1])
    return scores


def accuracy(predictions: ArrayLike, labels: ArrayLike) -> float:
    """Fraction of items whose prediction equals the label.

    Args:
        predictions: Predicted class ids.
        labels: True class ids, same size; items labelled -100 are skipped.

    Returns:
        Accuracy in [0, 1].

    Raises:
        ValueError: No items, or sizes differ.
    """
    prediction_array, label_array = _paired(predictions, labels, IGNORE_INDEX)
    if label_array.size == 0:
        raise ValueError("accuracy of zero items is undefined; pass at least one labelled item.")
    return float(np.mean(prediction_array == label_array))


def f1_scores(predictions: ArrayLike, labels: ArrayLike, num_labels: int | None = None,
              label_names: Sequence[str] | None = None) -> dict[str, Any]:
    """F1 per class, macro F1 and (for two classes) binary F1, with precision and recall.

    See the module docstring for which classes are averaged and how undefined values are set.

    Args:
        predictions: Predicted class ids.
        labels: True class ids, same size; items labelled -100 are skipped.
        num_labels: Number of classes; when given, the macro average is over `range(num_labels)`,
            else over the classes present in labels ∪ predictions.
        label_names: the classes' names in id order, which the `UndefinedF1Warning` names them by.

    Returns:
        A dict with `f1_macro`, `classes` (the class ids averaged over, ascending),
        `f1_per_class`, `precision_per_class`, `recall_per_class`, `support_per_class` (lists
        aligned with `classes`), and `f1_binary` (F1 of class 1) when the classes are {0, 1}.
    """
    matrix = confusion_matrix(predictions, labels, num_labels)
    return _scores_from_confusion(matrix, num_labels, label_names)


def _predictions_from_outputs(logits_or_predictions: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim for logits, a threshold at 0 for one logit, ids unchanged."""
    if not logits_or_predictions.is_floating_point():
        return logits_or_predictions
    if logits_or_predictions.ndim >= 2 and logits_or_predictions.shape[-1] > 1:
        return logits_or_predictions.argmax(dim=-1)
    # One logit per item (sigmoid head): positive logit means class 1.
    return (logits_or_predictions.reshape(logits_or_predictions.shape[0], -1) > 0).reshape(-1)


class ClassificationMetrics:
    """Streaming accuracy / F1 / loss over an evaluation set, holding only a confusion matrix.

    Each `update` takes the argmax on the logits' own device and moves only the int64 predictions
    (and labels) to the CPU, so the evaluation set's logits are never kept.

    Example:
        metrics = ClassificationMetrics(num_labels=3)
        for batch in eval_loader:
            output = model(**batch)
            metrics.update(output.logits, batch["labels"],
                           loss_sum=output.loss * len(batch["labels"]), count=len(batch["labels"]))
        scores = metrics.compute()  # {"accuracy", "f1", "loss", "count"}
    """

    def __init__(self, num_labels: int | None = None, ignore_index: int | None = IGNORE_INDEX,
                 label_names: Sequence[str] | None = None):
        """Creates an empty accumulator.

        Args:
            num_labels: Number of classes. When omitted, it is taken from the logits' last dim on the
                first update (2 for a single logit); with class-id predictions only, the macro
                average is over the classes seen.
            ignore_index: Label value to skip (token-classification padding), or None.
            label_names: the classes' names in id order (the warning about an absent class names them).
        """
        self.num_labels = num_labels
        self.ignore_index = ignore_index
        self.label_names = list(label_names) if label_names else None
        self._num_labels_from_user = num_labels is not None
        self.reset()

    def reset(self) -> None:
        """Forgets all updates (keeps num_labels)."""
        size = self.num_labels or 0
        self._matrix = torch.zeros(size, size, dtype=torch.int64)
        self._loss_sum = 0.0
        self._loss_count = 0
        self._updates_with_loss = 0
        self._updates = 0

    @property
    def confusion_matrix(self) -> np.ndarray:
        """The accumulated counts, `matrix[true, predicted]`, as an int64 numpy array."""
        return self._matrix.numpy().copy()

    def _grow(self, size: int) -> None:
        if self.num_labels is not None and size > self.num_labels:
            raise ValueError(
                f"class id {size - 1} is outside [0, {self.num_labels}); "
                "check num_labels and the label column."
            )
        if size <= self._matrix.shape[0]:
            return
        grown = torch.zeros(size, size, dtype=torch.int64)
        old = self._matrix.shape[0]
        grown[:old, :old] = self._matrix
        self._matrix = grown

    def update(
        self,
        logits_or_predictions: torch.Tensor | Mapping[str, Any],
        labels: torch.Tensor | None = None,
        loss_sum: float | torch.Tensor | None = None,
        count: int | None = None,
    ) -> None:
        """Adds one evaluation batch.

        Args:
            logits_or_predictions: Float logits `[..., num_labels]` (argmax taken), a single logit per
                item `[N]` or `[N, 1]` (positive means class 1), or integer class ids. Or an
                `eval_step` output dict (`logits` or `predictions`, `labels`, optional `loss_sum` and
                `num_items`), as `Loop.evaluate` passes it.
            labels: True class ids, one per prediction; `ignore_index` items are skipped.
            loss_sum: Sum (not mean) of the per-item losses of this batch; for a mean loss pass
                `mean_loss * count`. Give it on every update or on none.
            count: Number of items `loss_sum` covers; defaults to the number of non-ignored labels.

        Raises:
            ValueError: Sizes differ, ids out of range, or loss given on only some updates.
        """
        if isinstance(logits_or_predictions, Mapping):  # an eval_step output, as the Loop passes it
            output = logits_or_predictions
            logits_or_predictions = output["logits"] if output.get("logits") is not None else output["predictions"]
            labels, loss_sum, count = output["labels"], output.get("loss_sum"), output.get("num_items")
        with torch.no_grad():
            if self.num_labels is None and logits_or_predictions.is_floating_point():
                last_dim = logits_or_predictions.shape[-1] if logits_or_predictions.ndim >= 2 else 1
                self.num_labels = max(last_dim, 2)
                self._grow(self.num_labels)
            predictions = _predictions_from_outputs(logits_or_predictions)
            # Only the int64 ids cross to the CPU; the logits stay (and are freed) on their device.
            predictions = predictions.detach().reshape(-1).to("cpu", torch.int64)
            label_ids = torch.as_tensor(labels).detach().reshape(-1).to("cpu", torch.int64)
        if predictions.numel() != label_ids.numel():
            raise ValueError(
                f"got {predictions.numel()} predictions for {label_ids.numel()} labels; "
                "pass logits whose leading dims match the labels."
            )
        if self.ignore_index is not None:
            keep = label_ids != self.ignore_index
            predictions, label_ids = predictions[keep], label_ids[keep]
        if label_ids.numel():
            smallest = min(int(label_ids.min()), int(predictions.min()))
            if smallest < 0:
                raise ValueError(f"class ids must be >= 0, got {smallest}; check the label column.")
            self._grow(max(int(label_ids.max()), int(predictions.max())) + 1)
            size = self._matrix.shape[0]
            counts = torch.bincount(label_ids * size + predictions, minlength=size * size)
            self._matrix += counts.reshape(size, size)
        self._updates += 1
        if loss_sum is not None:
            self._updates_with_loss += 1
            self._loss_sum += float(loss_sum)
            self._loss_count += int(count) if count is not None else int(label_ids.numel())
        if self._updates_with_loss not in (0, self._updates):
            raise ValueError(
                "loss_sum was given on some updates and not on others; pass it on every update "
                "(or on none) so that the mean loss covers the same items as the scores."
            )

    def merge(self, other: ClassificationMetrics) -> None:
        """Adds another accumulator's counts (another rank's shard of the evaluation set)."""
        size = max(self._matrix.shape[0], other._matrix.shape[0])
        self._grow(size)
        other_matrix = torch.zeros(size, size, dtype=torch.int64)
        other_matrix[: other._matrix.shape[0], : other._matrix.shape[1]] = other._matrix
        self._matrix += other_matrix
        self._loss_sum += other._loss_sum
        self._loss_count += other._loss_count
        self._updates += other._updates
        self._updates_with_loss += other._updates_with_loss

    def compute(self) -> dict[str, float]:
        """Scores over everything seen since the last reset.

        Returns:
            `accuracy`, `f1` (macro), `f1_binary` when the classes are {0, 1}, `loss` (the exact mean
            Σ loss_sum / Σ count, only when losses were given) and `count` (items scored).

        Raises:
            ValueError: Nothing was scored yet.
        """
        matrix = self._matrix.numpy()
        total = int(matrix.sum())
        if total == 0:
            raise ValueError("no labelled items were scored; call update() with evaluation batches first.")
        scores = _scores_from_confusion(matrix, self.num_labels, self.label_names)
        result: dict[str, float] = {
            "accuracy": float(np.trace(matrix) / total),
            "f1": scores["f1_macro"],
        }
        if "f1_binary" in scores:
            result["f1_binary"] = scores["f1_binary"]
        if self._updates_with_loss:
            result["loss"] = self._loss_sum / self._loss_count if self._loss_count else math.nan
        result["count"] = total
        return result


@contextlib.contextmanager
def captured_output(model: torch.nn.Module) -> Iterator[dict]:
    """Keeps the last output of `model`'s forward under "output" while entered (the logits a loss saw)."""
    captured: dict = {}
    handle = model.register_forward_hook(lambda module, args, output: captured.update(output=output))
    try:
        yield captured
    finally:
        handle.remove()


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits of a model's output: the tensor itself, a mapping's "logits", or an object's `.logits`."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        return output.get("logits")
    return getattr(output, "logits", None)


def vocab_size_of(model: torch.nn.Module) -> int | None:
    """The model's vocabulary size from its config (HF models), or None."""
    return getattr(getattr(model, "config", None), "vocab_size", None)


def scoreable_logits(logits: Any, labels: Any, vocab_size: int | None = None) -> bool:
    """Whether `logits` are class scores for integer `labels` (one row of scores per label).

    True for `[N, C]` logits with `[N]` labels (sequence classification), `[N, T, C]` with `[N, T]`
    (token classification) and single-logit heads; False for float labels (regression), for heads
    of more than `MAX_CLASSES` outputs, and for a head as wide as the model's vocabulary (a
    language model, whose labels may also be shifted inside the model).
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return False
    if not logits.is_floating_point() or labels.is_floating_point() or logits.dim() < 1:
        return False
    classes = logits.shape[-1] if logits.dim() > labels.dim() else 1
    shape_matches = logits.shape[:-1] == labels.shape if logits.dim() > labels.dim() else logits.shape == labels.shape
    return bool(shape_matches) and classes <= MAX_CLASSES and classes != vocab_size


class EvalMetrics:
    """The Loop's default streaming metrics: loss always, classification scores or perplexity when they apply.

    - `loss`: Σ loss_sum / Σ num_items over the evaluation set (exact, however the batches fall).
    - `accuracy`, `f1` (macro), `f1_binary` (two classes): when the outputs carry `logits` (or
      `predictions`) and integer `labels`, through `ClassificationMetrics`; labels of -100 are skipped.
    - `perplexity` = exp(loss): when there are no class scores and the loss is per token (its items
      outnumber the rows, or the labels have a time dimension).
    - `count`: the items the loss (or the scores) cover.

    Args:
        num_labels: the number of classes, when known (the macro F1 then averages over all of them).
        label_names: the classes' names in id order, when known (the warning about an absent class names them).
    """

    def __init__(self, num_labels: int | None = None, label_names: Sequence[str] | None = None):
        self.num_labels = num_labels
        self.label_names = label_names
        self.loss_sum = 0.0
        self.items = 0.0
        self.rows = 0
        self.token_level = False
        self.classification: ClassificationMetrics | None = None

    @classmethod
    def for_model(cls, model: Any) -> EvalMetrics:
        """The metrics of `model`'s evaluation: its config's ``num_labels`` and label names (``id2label``, unless
        they are the default ``LABEL_i``), when it has a config."""
        config = getattr(model, "config", None)
        return cls(num_labels=getattr(config, "num_labels", None), label_names=named_labels(config))

    def update(self, output: Mapping[str, Any]) -> None:
        """Adds one `eval_step` output: `loss_sum` and `num_items`, and `logits`/`predictions` with `labels`."""
        if not isinstance(output, Mapping):
            raise TypeError(
                f"eval_step returned a {type(output).__name__}; return a dict with loss_sum and num_items "
                "(and logits and labels to be scored)"
            )
        if output.get("loss_sum") is not None:
            items = float(output.get("num_items", 0))
            self.loss_sum += float(output["loss_sum"])
            self.items += items
            rows = int(output.get("rows", items))
            self.rows += rows
            self.token_level = self.token_level or items > rows
        if output.get("labels") is not None and (
            output.get("logits") is not None or output.get("predictions") is not None
        ):
            if self.classification is None:
                self.classification = ClassificationMetrics(num_labels=self.num_labels, label_names=self.label_names)
            scores = output["logits"] if output.get("logits") is not None else output["predictions"]
            self.classification.update(scores, output["labels"])
            self.token_level = self.token_level or output["labels"].dim() > 1

    def merge(self, other: EvalMetrics) -> None:
        """Adds another rank's sums (its shard of the evaluation set)."""
        self.loss_sum += other.loss_sum
        self.items += other.items
        self.rows += other.rows
        self.token_level = self.token_level or other.token_level
        if other.classification is not None:
            if self.classification is None:
                self.classification = ClassificationMetrics(num_labels=self.num_labels, label_names=self.label_names)
            self.classification.merge(other.classification)

    def compute(self) -> dict[str, float]:
        """The scores (see the class docstring).

        Raises:
            ValueError: nothing was evaluated (no batch had a loss or class scores).
        """
        result: dict[str, float] = {}
        if self.items:
            result["loss"] = self.loss_sum / self.items
        if self.classification is not None:
            scores = self.classification.compute()
            result.update({key: value for key, value in scores.items() if key != "loss"})
        elif "loss" in result and self.token_level:
            result["perplexity"] = math.exp(min(result["loss"], 700.0))  # exp(700) is near float's limit
        if not result:
            raise ValueError("nothing was evaluated: eval_step returned no loss_sum and no logits with labels")
        result.setdefault("count", int(self.items))
        return result


def label_names_of(config: Any) -> list[str]:
    """A classifier config's class names in id order: its ``id2label``, ``LABEL_i`` for an id it does not name (no
    config or no ``num_labels``: none)."""
    id2label = getattr(config, "id2label", None) or {}
    return [str(id2label.get(index, f"LABEL_{index}")) for index in range(getattr(config, "num_labels", None) or 0)]


def named_labels(config: Any) -> list[str] | None:
    """`label_names_of`, or None where they are only transformers' default ``LABEL_i`` (ids, not names)."""
    names = label_names_of(config)
    return None if names == [f"LABEL_{index}" for index in range(len(names))] else names


def majority_baseline(labels: ArrayLike, num_labels: int | None = None) -> dict[str, float]:
    """Scores of always predicting the most frequent class of `labels` (ties: the smallest id).

    The command line prints this beside the model's scores: a model that does not beat it has
    learned nothing beyond the class balance.

    Args:
        labels: True class ids; -100 items are skipped.
        num_labels: Number of classes, as for `f1_scores` (changes which classes macro F1 averages).

    Returns:
        `accuracy`, `f1` (macro), `f1_binary` when the classes are {0, 1}, and `majority_class`.

    Raises:
        ValueError: No labelled items.
    """
    label_array = _to_int64_numpy(labels, "labels")
    label_array = label_array[label_array != IGNORE_INDEX]
    if label_array.size == 0:
        raise ValueError("majority baseline of zero labels is undefined; pass at least one label.")
    majority_class = int(np.argmax(np.bincount(label_array)))
    predictions = np.full_like(label_array, majority_class)
    with warnings.catch_warnings():
        # A constant predictor leaves classes unpredicted by design; the warning would be noise.
        warnings.simplefilter("ignore", UndefinedF1Warning)
        scores = f1_scores(predictions, label_array, num_labels)
    result: dict[str, float] = {
        "accuracy": float(np.mean(predictions == label_array)),
        "f1": scores["f1_macro"],
        "majority_class": majority_class,
    }
    if "f1_binary" in scores:
        result["f1_binary"] = scores["f1_binary"]
    return result
