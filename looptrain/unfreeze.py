"""Gradual unfreezing (ULMFiT): train the head first, then one more block from the top per stage.

Stage 0 trains the head alone (what follows the last transformer block: pooler, classifier);
stage ``k`` adds the top ``k`` blocks; the last stage adds the embeddings, and from then on the
whole model trains. A stage starts every ``every`` optimizer updates, or at every epoch with
``every="epoch"``. Only parameters that were trainable when the schedule was built take part: a
parameter the user froze (``--freeze-embeddings``) stays frozen in every stage.

The optimizer is built over all of them from the start. A frozen parameter gets no gradient, and
every optimizer skips a parameter without one, so it creates no state until its stage begins; the
parameters already training keep theirs untouched. Param groups therefore never change shape, and
LR schedulers and checkpoints see the same optimizer in every stage.

The Loop starts the schedule with `start_unfreezing` and, before each window, has it `follow` the run:
enter the stage due, re-checkpoint, restart the memory peak and log the stage; `summary` is the
schedule's part of the run's summary.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from looptrain.freeze import layer_depths
from looptrain.gradient_checkpointing import enable_gradient_checkpointing

Every = int | str


def valid_every(every: object) -> bool:
    """Whether `every` names a stage length: a positive int of optimizer updates, or "epoch"."""
    return every == "epoch" or (isinstance(every, int) and not isinstance(every, bool) and every >= 1)


def check_optimizer_holds(model: nn.Module, optimizer) -> None:
    """Raises ValueError when `optimizer` lacks a trainable parameter of `model`, which a later stage would train."""
    held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    missing = [name for name, parameter in model.named_parameters()
               if parameter.requires_grad and id(parameter) not in held]
    if missing:
        raise ValueError(
            f"unfreeze_every: the optimizer does not hold {missing[:3]} (and {max(0, len(missing) - 3)} more), "
            "which the schedule unfreezes later; build the optimizer over the whole model before the Loop "
            "(build_optimizer(model, ...)), and let the schedule freeze it")


def start_unfreezing(model: nn.Module, optimizer, every: Every | None) -> GradualUnfreezing | None:
    """Gradual unfreezing over the parameters trainable now, which the optimizer must already hold.

    Returns:
        The schedule, no stage applied yet; None when `every` is None (no gradual unfreezing).
    """
    if every is None:
        return None
    schedule = GradualUnfreezing(model, every)
    check_optimizer_holds(model, optimizer)
    return schedule  # the first window enters the stage due (stage 1, or a later one on resume)


class GradualUnfreezing:
    """The stages of one model and which of them is in force.

    Args:
        model: A transformer whose block list `looptrain.freeze.find_transformer_blocks` finds.
        every: Optimizer updates per stage (a positive int), or ``"epoch"`` (one stage per epoch).

    Raises:
        ValueError: `every` is neither, or the model has no trainable parameter outside its blocks
            and embeddings and no block list.
    """

    def __init__(self, model: nn.Module, every: Every):
        if not valid_every(every):
            raise ValueError(f"unfreeze_every must be a positive number of optimizer updates or 'epoch', got {every!r}")
        self.every = every
        self.stages: list[tuple[str, list[nn.Parameter]]] = []
        for label, named in layer_depths(model):
            trainable = [parameter for _, parameter in named if parameter.requires_grad]
            if trainable:  # a depth the user froze entirely is no stage
                self.stages.append((label, trainable))
        if not self.stages:
            raise ValueError("unfreeze_every: the model has no trainable parameter to unfreeze")
        self.stage = -1  # none applied yet
        self.stage_peaks: list[int] = []  # the peak memory of each stage that ended (`follow` records them)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Every parameter the schedule manages: the trainable set of the last stage."""
        return [parameter for _, parameters in self.stages for parameter in parameters]

    def stage_at(self, step: int, epoch: int) -> int:
        """The stage in force before optimizer update `step + 1`, in epoch `epoch` (both from 0)."""
        index = epoch if self.every == "epoch" else step // self.every
        return min(index, len(self.stages) - 1)

    def apply(self, stage: int) -> list[str]:
        """Makes `stage` the one in force: its depths and those above train, the rest are frozen.

        Returns:
            The labels of the depths that train in this stage, from the top.
        """
        for index, (_, parameters) in enumerate(self.stages):
            for parameter in parameters:
                parameter.requires_grad_(index <= stage)
        self.stage = stage
        return [label for label, _ in self.stages[:stage + 1]]

    def reach_notice(self, planned_updates: int | None, epochs: int) -> str | None:
        """What a run that is too short for its schedule never trains, said before it starts (None: it reaches
        the last stage)."""
        if planned_updates is None or planned_updates < 1:
            return None
        last = self.stage_at(planned_updates - 1, epochs - 1)  # the stage of the run's last update
        if last == len(self.stages) - 1:
            return None
        never = ", ".join(label for label, _ in self.stages[last + 1:])
        stages = len(self.stages)
        if self.every == "epoch":
            fix = f"train at least {stages} epochs (--epochs), or give a number of updates"
        elif planned_updates >= stages:
            fix = f"lower it to at most {planned_updates // stages} updates"
        else:
            fix = f"train at least {stages} updates (--max-steps, --epochs)"
        return (f"unfreeze_every={self.every!r} (--unfreeze-schedule) but the run makes {planned_updates} updates in "
                f"{epochs} epoch(s): it reaches stage {last + 1} of {stages}, and {never} never train; {fix} to "
                "reach every stage")

    def describe(self) -> str:
        """One line: the stages in order and when each starts."""
        unit = "epoch" if self.every == "epoch" else f"{self.every} updates"
        labels = ", ".join(label for label, _ in self.stages)
        return f"gradual unfreezing: {len(self.stages)} stages, one every {unit}: {labels}"

    def follow(self, progress: Any, parts: Any, config: Any, log: Any) -> None:
        """Enters the stage due before the Loop's next update (a window never changes stage midway).

        Checkpointing follows the new trainable set, and the memory meter starts the new stage's peak
        (the last stage's is the one the summary reports; the earlier ones are kept beside it).

        Args:
            progress: the Loop's `looptrain.progress.Progress` (its `step` and `epoch` are read).
            parts: its `looptrain.run.TrainingParts` (`model`, `optimizer`, `meter`).
            config: its `LoopConfig` (`gradient_checkpointing`, `checkpoint_every`).
            log: its run's `RunLog`, which records the stage.
        """
        stage = self.stage_at(progress.step, progress.epoch)
        if stage == self.stage:
            return
        model, meter = parts.model, parts.meter
        if self.stage >= 0:  # the stage that ends now had its own peak
            self.stage_peaks.append(int(meter.summary(model, parts.optimizer)["peak_memory_bytes"]))
        self.apply(stage)
        if config.gradient_checkpointing:
            enable_gradient_checkpointing(model, every=config.checkpoint_every)
        meter.restart_peak()
        label = self.stages[stage][0]
        trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
        log.event(
            {"event": "unfreeze", "step": progress.step, "stage": stage + 1, "stages": len(self.stages),
             "unfrozen": label, "trainable_parameters": trainable},
            line=f"unfreeze: stage {stage + 1}/{len(self.stages)} from step {progress.step}: {label} "
                 f"trains ({trainable:,} trainable parameters)")

    def summary(self) -> dict:
        """Gradual unfreezing's part of the run's summary: the stage reached and the earlier stages' peaks."""
        return {"every": self.every, "stage": self.stage + 1, "stages": len(self.stages),
                "earlier_stage_peak_bytes": self.stage_peaks}
