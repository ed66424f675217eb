"""The best checkpoint: which direction a metric improves in, and the tracker of its best value."""

from __future__ import annotations

import math
from typing import Any

from looptrain.checkpoint.layout import CheckpointError

LOWER_IS_BETTER_WORDS = ("loss", "perplexity", "ppl", "error", "mae", "mse", "rmse", "wer", "cer")


def default_mode(metric_name: str) -> str:
    """"min" for names of losses and errors (loss, perplexity, mae, ...), "max" for scores such as f1."""
    name = metric_name.lower()
    return "min" if any(word in name for word in LOWER_IS_BETTER_WORDS) else "max"


def is_better(metric: float, best: float | None, mode: str) -> bool:
    """Whether `metric` improves on `best`.

    Args:
        metric: The new value. NaN is never better.
        best: The best value so far, or None when there is none yet (any finite metric wins).
        mode: "max" (higher is better) or "min" (lower is better).

    Returns:
        True when strictly better (ties keep the earlier, already saved, best).

    Raises:
        ValueError: Unknown mode.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"mode must be 'max' or 'min', got {mode!r}.")
    if metric is None or math.isnan(metric):
        return False
    if best is None or math.isnan(best):
        return True
    return metric > best if mode == "max" else metric < best


class BestTracker:
    """Remembers the best value of one evaluation metric and the checkpoint that holds it.

    Its `state_dict()` goes into trainer_state.json so a resumed run keeps the same best, and its
    `best_checkpoint` goes to `rotate_checkpoints` so the best is never deleted.
    """

    def __init__(self, metric_name: str = "f1", mode: str | None = None):
        """Creates a tracker with no best yet.

        Args:
            metric_name: Key of the metric in the evaluation dict ("f1", "accuracy", "loss", ...);
                an "eval_"-prefixed key is accepted too.
            mode: "max" or "min"; default "min" for names containing "loss", else "max".
        """
        self.metric_name = metric_name
        self.mode = mode if mode is not None else default_mode(metric_name)
        if self.mode not in ("max", "min"):
            raise ValueError(f"BestTracker mode must be 'max' or 'min', got {mode!r}.")
        self.best_metric: float | None = None
        self.best_checkpoint: str | None = None
        self.best_step: int | None = None

    def value_from(self, metrics: dict[str, Any]) -> float:
        """Picks this tracker's metric out of an evaluation dict.

        Raises:
            KeyError: The metric is not in the dict; the message lists the keys that are.
        """
        for key in (self.metric_name, f"eval_{self.metric_name}"):
            if key in metrics:
                return float(metrics[key])
        raise KeyError(
            f"metric for best {self.metric_name!r} is not among the evaluation metrics "
            f"{sorted(metrics)}; choose one of those (--metric-for-best)."
        )

    def update(self, metrics: dict[str, Any], checkpoint_name: str | None, step: int | None = None) -> bool:
        """Records `metrics` as the new best when better.

        Args:
            metrics: The evaluation dict of this evaluation point.
            checkpoint_name: Name of the checkpoint saved for this point ("checkpoint-120"), or None.
            step: Optimizer step of this evaluation point.

        Returns:
            True when it is the new best.
        """
        value = self.value_from(metrics)
        if not is_better(value, self.best_metric, self.mode):
            return False
        self.best_metric = value
        self.best_checkpoint = checkpoint_name
        self.best_step = step
        return True

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state for trainer_state.json."""
        return {
            "metric_name": self.metric_name,
            "mode": self.mode,
            "best_metric": self.best_metric,
            "best_checkpoint": self.best_checkpoint,
            "best_step": self.best_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the state written by `state_dict`.

        Raises:
            CheckpointError: The saved tracker followed another metric or mode.
        """
        if state.get("metric_name", self.metric_name) != self.metric_name or state.get("mode", self.mode) != self.mode:
            raise CheckpointError(
                f"the checkpoint tracked the best {state.get('metric_name')!r} ({state.get('mode')}), this run "
                f"tracks {self.metric_name!r} ({self.mode}); resume with the same --metric-for-best or start "
                "a new --output-dir."
            )
        self.best_metric = state.get("best_metric")
        self.best_checkpoint = state.get("best_checkpoint")
        self.best_step = state.get("best_step")
