"""`Progress`: where training stands (the counters, the data position, the latest evaluation).

The Loop owns one `Progress` and replaces it with the next one as training moves: after each
forward/backward pass, each update, each window and each epoch. It is a frozen value, so whoever
reads it (the `Run` writing a checkpoint, a log line or the summary) cannot change it; a resume
returns the saved one (`Progress.from_state_dict`) and the Loop takes it as its own.

Two counters with fixed meanings (docs/loop.md, "Counters"): `step` counts optimizer updates that
were applied, `micro_step` counts forward/backward passes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Progress", "length_of"]


@dataclasses.dataclass(frozen=True)
class Progress:
    """Where training stands; a checkpoint saves it and an exact resume continues from it.

    Attributes:
        step: optimizer updates applied (a skipped update does not count).
        micro_step: forward/backward passes (micro-batches), counted as they run.
        epoch: epochs completed.
        batch_in_epoch: micro-batches of the current epoch consumed: where a resume continues.
        skipped_steps: windows whose update was skipped (fp16 overflow, non-finite gradients).
        last_eval: the latest evaluation's scores, None before the first.
        last_eval_step: the `step` of that evaluation (-1: none yet).
    """

    step: int = 0
    micro_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0
    skipped_steps: int = 0
    last_eval: dict | None = None
    last_eval_step: int = -1

    def after_pass(self) -> Progress:
        """One more forward/backward pass."""
        return dataclasses.replace(self, micro_step=self.micro_step + 1)

    def after_update(self, stepped: bool) -> Progress:
        """One window's update: applied (`step` + 1) or skipped (`skipped_steps` + 1)."""
        if stepped:
            return dataclasses.replace(self, step=self.step + 1)
        return dataclasses.replace(self, skipped_steps=self.skipped_steps + 1)

    def after_batches(self, count: int) -> Progress:
        """`count` more micro-batches of the current epoch consumed."""
        return dataclasses.replace(self, batch_in_epoch=self.batch_in_epoch + count)

    def next_epoch(self) -> Progress:
        """The epoch completed: the next one starts at its first batch."""
        return dataclasses.replace(self, epoch=self.epoch + 1, batch_in_epoch=0)

    def evaluated(self, scores: dict | None) -> Progress:
        """An evaluation at the current step gave `scores`."""
        return dataclasses.replace(self, last_eval=scores, last_eval_step=self.step)

    def in_epochs(self, batches_per_epoch: int | None) -> float:
        """The data position in epochs (2.25: a quarter into the third epoch); whole epochs without a length."""
        if not batches_per_epoch:
            return float(self.epoch)
        return round(self.epoch + self.batch_in_epoch / batches_per_epoch, 4)

    def state_dict(self) -> dict[str, Any]:
        """The fields, JSON-ready (a checkpoint's trainer state holds them under these names)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, saved: dict[str, Any]) -> Progress:
        """The progress a checkpoint's trainer state holds (its other keys are ignored)."""
        return cls(**{field.name: saved[field.name] for field in dataclasses.fields(cls)})


def length_of(loader: Any) -> int | None:
    """The loader's number of batches, None when it has no length."""
    try:
        return len(loader)
    except TypeError:
        return None
