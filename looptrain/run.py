"""`Run`: one training run's output directory, apart from the loop that trains.

The `Loop` trains; its `Run` keeps the record: the output directory's lock and ledger (`run.json`,
see `looptrain.ledger`), the checkpoints (saving, restoring, rotation, the best), the data position
a resume continues from, the summary (`summary.json`), and the run log's progress lines.

A `Run` holds neither the Loop nor its objects: each call is handed what it reads, the Loop's
`Progress` (counters, data position, latest evaluation: a frozen value) and its `TrainingParts`
(model, optimizer, scheduler, precision, device, meter, train loader), and what changes the
Loop's state comes back as a return value (`restore` returns the saved `Progress`, `load_best` the
best checkpoint's scores). So a dropped Loop, its optimizer and the optimizer's state are freed at
once, by reference counting. It never imports `looptrain.loop`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

from looptrain import distributed, flops, ledger, resume
from looptrain.checkpoint import (
    BestTracker,
    CheckpointError,
    checkpoint_name,
    latest_checkpoint,
    resolve_resume_checkpoint,
    write_json_atomic,
)
from looptrain.config import LoopConfig
from looptrain.guards import SignalGuard
from looptrain.precision import cpu_description, emulation_warning
from looptrain.progress import Progress, length_of
from looptrain.run_files import read_json_object
from looptrain.run_log import RunLog
from looptrain.trackers import tracker_names

__all__ = ["MFU_KEYS", "EvaluationError", "Run", "TrainingParts", "planned_updates", "tracked_configuration"]

# The summary's model FLOP utilisation figures (None without `measure_mfu`); see `Run.flops_figures`.
MFU_KEYS = ("mfu", "model_flops_per_token", "model_flops_per_s", "peak_flops_per_s", "peak_flops_dtype",
            "peak_flops_device")


class EvaluationError(ValueError):
    """The evaluation hooks fail on the first eval batch, or `metric_for_best` is not a metric they produce."""


def planned_updates(num_batches: int, config: LoopConfig) -> int:
    """Optimizer updates a run makes over `num_batches` micro-batches an epoch (partial windows included)."""
    windows = math.ceil(num_batches / config.accum_steps) * config.epochs
    return min(windows, config.max_steps) if config.max_steps > 0 else windows


@dataclasses.dataclass(frozen=True)
class TrainingParts:
    """What the Loop trains with, handed to its `Run` on each call that reads it (the Run keeps none of it)."""

    model: Any
    optimizer: Any
    scheduler: Any
    precision: Any  # a `looptrain.precision.Precision`: its name, its scaler's state
    device: torch.device
    meter: Any  # the memory meter (`looptrain.memory.make_meter`)
    train_loader: Any


class Run:
    """The output directory of one training run: lock, ledger, checkpoints, resume, best, summary, progress.

    Args:
        config: the run's `LoopConfig` (`output_dir`, `resume`, `overwrite`, `save_total_limit`, ...).
        is_main: rank 0; only it locks, writes the ledger and the summary, and prints.
        save_final: called (on every rank) as `save_final(summary)` once training has ended, before the summary is
            written and run.json says "finished"; returns the summary to record (`Loop`'s door of the same name).

    Attributes:
        output_dir: the run's directory, or None (nothing is written).
        log: the `RunLog` (metrics.jsonl, trackers, progress bar, heartbeat lines).
        best: the `BestTracker` of the checkpoints written so far (`track_best` names its metric).
        last_checkpoint_step: the step of the latest checkpoint written or restored (-1: none yet).
        model_flops: the model's training FLOPs per token (`looptrain.flops.ModelFlops`), None until
            `open_progress` or without `measure_mfu`.
        peak: this device's matmul peak (`looptrain.flops.matmul_peak_flops`), likewise.
    """

    def __init__(self, config: LoopConfig, *, is_main: bool, save_final: Any = None):
        self.config = config
        self._save_final = save_final  # the final outputs (`Loop(save_final=...)`), written before "finished"
        self.is_main = is_main
        self.output_dir = Path(config.output_dir) if config.output_dir else None
        metric = config.metric_for_best or "loss"  # until the Loop's first evaluation check resolves it
        self.best = BestTracker(metric, config.best_mode_for(metric))
        self.log = RunLog(self.output_dir, is_main=is_main, report_to=config.report_to,
                          progress_bar=config.progress_bar,
                          config=tracked_configuration(config, self.output_dir)
                          if is_main and tracker_names(config.report_to) else None)
        self.last_checkpoint_step = -1
        self.model_flops: flops.ModelFlops | None = None
        self.peak: dict | None = None
        self._peak_device: torch.device | None = None
        self._peak_rechecked = False
        self._first_step = 0
        self._checkpoints: set[str] = set()  # this run's checkpoints: the only ones rotation may delete
        self._epoch_rng_state: torch.Tensor | None = None
        self._rng_after_skip: dict | None = None
        self._ledger = ledger.RunLedger(self.output_dir, echo=self.log.echo) if self.output_dir is not None else None

    # ------------------------------------------------------------------ the ledger
    def lock(self):
        """The output directory's lock (rank 0, with an output_dir): one run at a time in it."""
        if self.output_dir is None or not self.is_main:
            return contextlib.nullcontext()
        return ledger.OutputDirLock(self.output_dir, echo=self.log.echo)

    def begin(self, parts: TrainingParts, step: int) -> dict:
        """What this run may do in output_dir: `looptrain.ledger.RunLedger.begin`, decided by rank 0."""
        warning = emulation_warning(parts.device, parts.precision.name)
        if warning:
            self.log.echo(f"warning: {warning}")
        config = self.config
        forced = config.resume not in (None, "auto")
        if self.output_dir is None:
            return {"action": "resume" if forced else "fresh", "checkpoints": [Path(config.resume)] if forced else []}
        plan = None
        if self.is_main:
            plan = self._ledger.begin(config.identity(), config.resume, config.overwrite)
            if plan["action"] != "finished":
                self.record_status("running", step=step)
            if config.resume == "auto" and plan["action"] == "fresh" and plan["run"] is not None:
                self.log.event({"event": "resume", "step": 0, "checkpoint": None,
                                "message": "no checkpoint of this run yet: training starts again from scratch; the "
                                           "events after this one supersede any logged before it"},
                               line=f"resume=auto: no checkpoint of this run in {self.output_dir} yet, "
                                    "starting from scratch")
            elif config.resume == "auto" and plan["action"] == "fresh":
                self.log.echo(f"resume=auto: nothing in {self.output_dir} yet, starting from scratch")
        return distributed.all_gather_objects(plan)[0]  # every rank follows rank 0's decision

    def record_status(self, status: str, *, step: int) -> None:
        """Writes this run's identity, status and `step` into output_dir/run.json (rank 0)."""
        if self.output_dir is not None and self.is_main:
            self._ledger.write(self.config.identity(), status, step=step,
                               last_checkpoint=checkpoint_name(self.last_checkpoint_step)
                               if self.last_checkpoint_step >= 0 else None)

    def fail(self, *, step: int) -> None:
        """Training raised: run.json says "failed", and the trackers close their runs as failed."""
        self.record_status("failed", step=step)
        self.log.close("failed")

    def finished_run_summary(self) -> dict:
        """`resume="auto"` on a finished run: nothing to train; its summary.json is left as it is."""
        summary = self._ledger.finished_run_summary()
        self.log.close()
        return summary

    # ------------------------------------------------------------------ checkpoints and resume
    def track_best(self, scores: dict) -> None:
        """Chooses the best checkpoint by `metric_for_best` from now on (default: f1 when scored, else the loss).

        Raises:
            EvaluationError: `metric_for_best` is not among `scores` (the first eval batch's, before training).
        """
        name = self.config.metric_for_best or ("f1" if "f1" in scores else "loss")
        if name not in scores and f"eval_{name}" not in scores:
            raise EvaluationError(
                f"metric_for_best={name!r} is not among the evaluation metrics {sorted(scores)}; choose one of "
                "those (--metric-for-best), or override Loop.compute_metrics to produce it")
        self.best = BestTracker(name, self.config.best_mode_for(name))

    def save_checkpoint(self, parts: TrainingParts, progress: Progress, eval_metrics: dict | None) -> None:
        """Writes `checkpoint-<step>/` atomically; the best moves to it once it is safely on disk."""
        best = copy.deepcopy(self.best)
        name = checkpoint_name(progress.step)
        if eval_metrics is not None:
            best.update(eval_metrics, name, step=progress.step)
        self._checkpoints.add(name)
        resume.save_training_checkpoint(
            self.output_dir, progress.step, model=parts.model, optimizer=parts.optimizer,
            scheduler=parts.scheduler, precision=parts.precision,
            trainer_state={**self._trainer_state(progress), "best": best.state_dict()}, metrics=eval_metrics,
            save_total_limit=self.config.save_total_limit, best_checkpoint=best.best_checkpoint,
            run_checkpoints=self._checkpoints)
        self.best = best
        self.last_checkpoint_step = progress.step

    def _trainer_state(self, progress: Progress) -> dict:
        """The counters and positions an exact resume needs (JSON-ready)."""
        return {
            **progress.state_dict(),
            "identity": self.config.identity(),  # whose checkpoint this is, wherever it is copied (`looptrain.ledger`)
            "run_checkpoints": sorted(self._checkpoints),
            # The data order of an epoch is drawn from torch's RNG when its iterator starts: keep the
            # state of that moment so a resume in mid-epoch replays the same order.
            "epoch_rng_state": None if self._epoch_rng_state is None else self._epoch_rng_state.tolist(),
        }

    def restore(self, checkpoints: list, parts: TrainingParts) -> Progress:
        """Restores weights, optimizer, scheduler, scaler and RNG from the first checkpoint that reads.

        With `resume="auto"` a checkpoint that cannot be read (a truncated file) is reported and the
        next older one is tried; a checkpoint named explicitly must read.

        Returns:
            The saved `Progress` (counters, data position, latest evaluation): training continues from it.
        """
        forced = self.config.resume not in (None, "auto")
        for index, candidate in enumerate(checkpoints):
            try:
                path = resolve_resume_checkpoint(str(candidate), self.output_dir) if forced else Path(candidate)
                saved, self._rng_after_skip = resume.load_training_checkpoint(
                    path, model=parts.model, optimizer=parts.optimizer, scheduler=parts.scheduler,
                    precision=parts.precision, device=parts.device)
                break
            except CheckpointError as error:
                if forced or index == len(checkpoints) - 1:
                    raise
                self.log.echo(f"notice: {error}\n  falling back to {Path(checkpoints[index + 1]).name}")
        progress = Progress.from_state_dict(saved)
        self.best.load_state_dict(saved["best"])
        self.last_checkpoint_step = progress.step
        self._checkpoints = set(saved.get("run_checkpoints", [])) | {path.name}
        if saved["epoch_rng_state"] is not None:
            self._epoch_rng_state = torch.tensor(saved["epoch_rng_state"], dtype=torch.uint8)
        self.log.event({"event": "resume", "step": progress.step, "micro_step": progress.micro_step,
                        "epoch": progress.epoch, "checkpoint": str(path),
                        "message": "the events after this one supersede any logged before it for later steps"},
                       line=f"resumed from {path} at step {progress.step} (epoch {progress.epoch}, "
                            f"micro-batch {progress.batch_in_epoch})")
        return progress

    def start_epoch(self, train_loader: Any, progress: Progress):
        """The current epoch's batches, from the run's position (a resume in mid-epoch replays its order)."""
        epoch_batches, self._epoch_rng_state = resume.start_epoch(
            train_loader, progress.epoch, progress.batch_in_epoch, self._epoch_rng_state, self._rng_after_skip)
        self._rng_after_skip = None
        return epoch_batches

    def load_best(self, parts: TrainingParts) -> dict | None:
        """Loads the best checkpoint's weights into the model (`load_best_at_end`); returns its evaluation."""
        path = self.output_dir / self.best.best_checkpoint
        saved = resume.load_weights(path, parts.model, parts.device)
        self.log.echo(f"loaded the best checkpoint {path.name} ({self.best.metric_name}={self.best.best_metric:.4f})")
        return saved.get("last_eval")

    def save_on_interrupt(self, parts: TrainingParts, progress: Progress, signal_name: str) -> None:
        """A signal asked the run to stop: save where it stands so `resume='auto'` continues from here."""
        step = progress.step
        if self.output_dir is not None and self.last_checkpoint_step != step:
            self.save_checkpoint(parts, progress, None)
        where = f"saved checkpoint-{step}" if self.output_dir is not None else "nothing saved (no output_dir)"
        self.log.echo(f"interrupted by {signal_name} at step {step}: {where}; "
                      "continue with resume='auto' (--resume auto)")

    def last_good_checkpoint(self) -> Path | None:
        """The newest complete checkpoint in output_dir, if any (named when training diverges)."""
        return latest_checkpoint(self.output_dir) if self.output_dir is not None else None

    # ------------------------------------------------------------------ progress
    def open_progress(self, parts: TrainingParts, step: int, unfreezing: Any = None) -> None:
        """The progress bar from `step`; the heartbeat's time-to-go counts this run's updates.

        A `max_steps` that the epochs cannot reach is said once here, not discovered at the end, and so are
        the stages of gradual unfreezing (`unfreezing`, a `looptrain.unfreeze.GradualUnfreezing`) it cannot. With
        `measure_mfu`, the model's FLOPs per token are counted (trainability as it is now) and this device's
        matmul peak is read from the cache or measured once: before training's clock starts.
        """
        self.log.open_trackers()  # a tracker that cannot start stops the run now, before it trains
        planned, config = self.planned_updates(parts.train_loader), self.config
        if planned is not None and 0 < planned < config.max_steps:
            self.log.echo(f"notice: max_steps={config.max_steps} (--max-steps) but {config.epochs} epoch(s) of this "
                          f"data make {planned} updates: the run stops at {planned}; raise epochs (--epochs) to "
                          f"reach {config.max_steps}")
        if config.measure_mfu:
            self.model_flops = flops.count_model_flops(parts.model)
            self.peak = flops.matmul_peak_flops(parts.device, parts.precision.name)
            self._peak_device = parts.device
        self.log.open_progress(planned, initial=step)
        self._first_step = step
        if unfreezing is not None and (notice := unfreezing.reach_notice(planned, config.epochs)):
            self.log.echo(f"notice: {notice}")

    def flops_figures(self, tokens_per_s: float, samples_per_s: float) -> dict:
        """Model FLOP/s and MFU at these rates (over every rank); every `MFU_KEYS` value None without `measure_mfu`.

        FLOPs are counted per real token (per sample when the batches carry no token ids), with the
        attention term at the mean real length of a sample, tokens / samples (docs/speed.md).
        """
        if self.model_flops is None or self.peak is None:
            return dict.fromkeys(MFU_KEYS)
        seq_len = tokens_per_s / samples_per_s if tokens_per_s and samples_per_s else 1.0
        per_token = self.model_flops.per_token(seq_len)
        achieved = per_token * (tokens_per_s or samples_per_s)
        world = distributed.current().world_size  # the tokens are every rank's
        if achieved > self.peak["flops_per_s"] * world and not self._peak_rechecked:
            # a peak this run beats was measured beside other work: measured again once, the better one kept
            self._peak_rechecked = True
            self.peak = flops.matmul_peak_flops(self._peak_device, self.peak["dtype"], at_least=achieved / world)
        peak = self.peak["flops_per_s"] * world
        return {"mfu": achieved / peak, "model_flops_per_token": per_token, "model_flops_per_s": achieved,
                "peak_flops_per_s": peak, "peak_flops_dtype": self.peak["dtype"],
                "peak_flops_device": self.peak["device"]}

    def planned_updates(self, train_loader: Any) -> int | None:
        """The updates the whole run makes (None: a loader without a length and no `max_steps`)."""
        batches = length_of(train_loader)
        if batches is None:
            return self.config.max_steps if self.config.max_steps > 0 else None
        return planned_updates(batches, self.config)

    def progress_line(self, progress: Progress, train_loader: Any) -> str:
        """"step 12/32 (epoch 0.38), 41.2 s of training, about 68 s to go": the heartbeat line."""
        totals, planned, step = self.log.totals, self.planned_updates(train_loader), progress.step
        line = f"training: step {step}" + (f"/{planned}" if planned else "")
        line += f" (epoch {progress.in_epochs(length_of(train_loader))}), {totals.run_seconds:.0f} s of training"
        done = step - self._first_step
        if planned and done > 0:
            line += f", about {totals.run_seconds / done * (planned - step):.0f} s to go"
        return line

    def log_train(self, grad_norm: torch.Tensor, parts: TrainingParts, progress: Progress) -> None:
        """The `train` event of a log interval: loss, learning rate, norm, throughput, memory."""
        interval = self.log.totals.pop_interval()
        groups = parts.optimizer.param_groups
        record = {
            "event": "train", "step": progress.step, "micro_step": progress.micro_step,
            "epoch": progress.in_epochs(length_of(parts.train_loader)), "loss": interval["loss"],
            "lr": float(groups[0]["lr"]) if groups else 0.0, "grad_norm": float(grad_norm),
            "samples_per_s": interval["samples_per_s"], "tokens_per_s": interval["tokens_per_s"],
            "skipped_steps": progress.skipped_steps,
            "peak_memory_bytes": parts.meter.summary(parts.model, parts.optimizer)["peak_memory_bytes"],
            "mfu": self.flops_figures(interval["tokens_per_s"], interval["samples_per_s"])["mfu"],
        }
        mfu = {} if record["mfu"] is None else {"mfu": f"{record['mfu']:.1%}"}
        self.log.advance_progress(0, loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                  samples_s=f"{record['samples_per_s']:.1f}", **mfu)
        self.log.event(record)

    # ------------------------------------------------------------------ the summary
    def summary(self, runtime_seconds: float, parts: TrainingParts, progress: Progress, *,
                interrupted: str | None, micro_batch_splits: int, unfreezing: Any = None) -> dict:
        """The run's summary: throughput, MFU, counters, memory, final evaluation, best checkpoint.

        With gradual unfreezing (`unfreezing`), its part too: the stage reached and the earlier stages' peaks.
        """
        totals = self.log.totals
        seconds = max(totals.run_seconds, 1e-9)
        result = {
            "train_runtime_s": round(runtime_seconds, 3),
            **totals.run_figures(),
            **self.flops_figures(totals.run_tokens / seconds, totals.run_samples / seconds),
            "optimizer_steps": progress.step,
            "skipped_steps": progress.skipped_steps,
            "micro_steps": progress.micro_step,
            "epochs_completed": progress.epoch,
            "device": str(parts.device),
            "cpu": cpu_description(),
            "precision": parts.precision.name,
            "final_eval": progress.last_eval,
            "metric_for_best": self.best.metric_name,
            "best_metric": self.best.best_metric,
            "best_checkpoint": self.best.best_checkpoint,
            "interrupted": interrupted,
            "micro_batch_splits": micro_batch_splits,
            "config": self.config.to_dict(),
        }
        result.update(parts.meter.summary(parts.model, parts.optimizer))
        if unfreezing is not None:  # peak_memory_bytes is then the last stage's, the one that must fit
            result["unfreeze"] = unfreezing.summary()
        return result

    def finish(self, summary: dict) -> dict:
        """Writes the final outputs (`save_final`), then summary.json (rank 0); records the run as finished or
        interrupted; closes the log.

        A run that stops while its final outputs are written (a kill, a full disk) is not finished: run.json still
        says "running", and `resume="auto"` continues it from its last checkpoint. SIGTERM or SIGINT meanwhile waits
        for them to be written (a second one stops at once, without them).
        """
        if self._save_final is not None and not summary["interrupted"]:
            with SignalGuard(echo=self.log.echo, stopping="writing the final outputs first"):
                summary = self._save_final(summary)
        if self.output_dir is not None and self.is_main:
            write_json_atomic(self.output_dir / "summary.json", summary)
        ending = "interrupted" if summary["interrupted"] else "finished"
        self.record_status(ending, step=summary["optimizer_steps"])
        self.log.log_summary(summary)
        self.log.close(ending)
        return summary


def tracked_configuration(config: LoopConfig, output_dir: Path | None) -> dict:
    """What the trackers record as the run's configuration: the command line's run_config.json when it is this
    run's (its loop_config is this config), else this config alone, under "loop_config" as there."""
    loop_config = json.loads(json.dumps(config.to_dict(), default=str))
    saved = read_json_object(output_dir / "run_config.json") if output_dir is not None else {}
    return saved if saved.get("loop_config") == loop_config else {"loop_config": loop_config}
