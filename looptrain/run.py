"""`Run`: one training run's output directory, apart from the loop that trains.

The `Loop` trains; its `Run` keeps the record: the output directory's lock and ledger (`run.json`,
see `looptrain.ledger`), the checkpoints (saving, restoring, rotation, the best), the data position
a resume continues from, the summary (`summary.json`), and the run log's progress lines.

A `Run` reads the training state from the Loop that made it (its counters `step`, `micro_step`,
`epoch`, `batch_in_epoch`, `skipped_steps`, its `model`, `optimizer`, `scheduler`, `precision`,
`device`, `meter`, `train_loader`, `last_eval`, `interrupted`), and a resume writes the counters
back. It never imports `looptrain.loop`: the Loop hands itself over.
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from pathlib import Path
from typing import Any

import torch

from looptrain import distributed, flops, ledger, resume, state
from looptrain.config import LoopConfig
from looptrain.precision import cpu_description, emulation_warning
from looptrain.run_log import RunLog

__all__ = ["MFU_KEYS", "Run", "planned_updates"]

# The summary's model FLOP utilisation figures (None without `measure_mfu`); see `Run.flops_figures`.
MFU_KEYS = ("mfu", "model_flops_per_token", "model_flops_per_s", "peak_flops_per_s", "peak_flops_dtype",
            "peak_flops_device")


def planned_updates(num_batches: int, config: LoopConfig) -> int:
    """Optimizer updates a run makes over `num_batches` micro-batches an epoch (partial windows included)."""
    windows = math.ceil(num_batches / config.accum_steps) * config.epochs
    return min(windows, config.max_steps) if config.max_steps > 0 else windows


class Run:
    """The output directory of one training run: lock, ledger, checkpoints, resume, best, summary, progress.

    Args:
        config: the run's `LoopConfig` (`output_dir`, `resume`, `overwrite`, `save_total_limit`, ...).
        training: the `Loop` whose run this is (see the module docstring for what is read of it).
        is_main: rank 0; only it locks, writes the ledger and the summary, and prints.

    Attributes:
        output_dir: the run's directory, or None (nothing is written).
        log: the `RunLog` (metrics.jsonl, trackers, progress bar, heartbeat lines).
        best: the `BestTracker` of the checkpoints written so far.
        last_eval_step: the step of the latest evaluation (-1: none yet).
        last_checkpoint_step: the step of the latest checkpoint written or restored (-1: none yet).
        model_flops: the model's training FLOPs per token (`looptrain.flops.ModelFlops`), None until
            `open_progress` or without `measure_mfu`.
        peak: this device's matmul peak (`looptrain.flops.matmul_peak_flops`), likewise.
    """

    def __init__(self, config: LoopConfig, training: Any, *, is_main: bool):
        self.config = config
        # A weak reference: the Loop holds its Run, and a Run holding its Loop back made a cycle that kept a dropped
        # Loop, its optimizer and the optimizer's state alive until the collector's next full pass.
        self.training = weakref.proxy(training)
        self.is_main = is_main
        self.output_dir = Path(config.output_dir) if config.output_dir else None
        metric = config.metric_for_best or "loss"  # until the Loop's first evaluation check resolves it
        self.best = state.BestTracker(metric, config.best_mode_for(metric))
        self.log = RunLog(self.output_dir, is_main=is_main, report_to=config.report_to,
                          progress_bar=config.progress_bar)
        self.last_eval_step = self.last_checkpoint_step = -1
        self.model_flops: flops.ModelFlops | None = None
        self.peak: dict | None = None
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

    def begin(self) -> dict:
        """What this run may do in output_dir: `looptrain.ledger.RunLedger.begin`, decided by rank 0."""
        warning = emulation_warning(self.training.device, self.training.precision.name)
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
                self.record_status("running")
            if config.resume == "auto" and plan["action"] == "fresh" and plan["run"] is not None:
                self.log.event({"event": "resume", "step": 0, "checkpoint": None,
                                "message": "no checkpoint of this run yet: training starts again from scratch; the "
                                           "events after this one supersede any logged before it"},
                               line=f"resume=auto: no checkpoint of this run in {self.output_dir} yet, "
                                    "starting from scratch")
            elif config.resume == "auto" and plan["action"] == "fresh":
                self.log.echo(f"resume=auto: nothing in {self.output_dir} yet, starting from scratch")
        return distributed.all_gather_objects(plan)[0]  # every rank follows rank 0's decision

    def record_status(self, status: str) -> None:
        """Writes this run's identity and status into output_dir/run.json (rank 0)."""
        if self.output_dir is not None and self.is_main:
            self._ledger.write(self.config.identity(), status, step=self.training.step,
                               last_checkpoint=state.checkpoint_name(self.last_checkpoint_step)
                               if self.last_checkpoint_step >= 0 else None)

    def finished_run_summary(self) -> dict:
        """`resume="auto"` on a finished run: nothing to train; its summary.json is left as it is."""
        summary = self._ledger.finished_run_summary()
        self.log.close()
        return summary

    # ------------------------------------------------------------------ checkpoints and resume
    def save_checkpoint(self, eval_metrics: dict | None) -> None:
        """Writes `checkpoint-<step>/` atomically; the best moves to it once it is safely on disk."""
        training = self.training
        best = copy.deepcopy(self.best)
        name = state.checkpoint_name(training.step)
        if eval_metrics is not None:
            best.update(eval_metrics, name, step=training.step)
        self._checkpoints.add(name)
        resume.save_training_checkpoint(
            self.output_dir, training.step, model=training.model, optimizer=training.optimizer,
            scheduler=training.scheduler, precision=training.precision,
            trainer_state={**self._trainer_state(), "best": best.state_dict()}, metrics=eval_metrics,
            save_total_limit=self.config.save_total_limit, best_checkpoint=best.best_checkpoint,
            run_checkpoints=self._checkpoints)
        self.best = best
        self.last_checkpoint_step = training.step

    def _trainer_state(self) -> dict:
        """The counters and positions an exact resume needs (JSON-ready)."""
        training = self.training
        return {
            "step": training.step, "micro_step": training.micro_step, "epoch": training.epoch,
            "batch_in_epoch": training.batch_in_epoch, "skipped_steps": training.skipped_steps,
            "last_eval": training.last_eval, "last_eval_step": self.last_eval_step,
            "run_checkpoints": sorted(self._checkpoints),
            # The data order of an epoch is drawn from torch's RNG when its iterator starts: keep the
            # state of that moment so a resume in mid-epoch replays the same order.
            "epoch_rng_state": None if self._epoch_rng_state is None else self._epoch_rng_state.tolist(),
        }

    def restore(self, checkpoints: list) -> None:
        """Restores weights, optimizer, scheduler, scaler, RNG and position from the first checkpoint that reads.

        With `resume="auto"` a checkpoint that cannot be read (a truncated file) is reported and the
        next older one is tried; a checkpoint named explicitly must read.
        """
        training = self.training
        forced = self.config.resume not in (None, "auto")
        for index, candidate in enumerate(checkpoints):
            try:
                path = state.resolve_resume_checkpoint(str(candidate), self.output_dir) if forced else Path(candidate)
                saved, self._rng_after_skip = resume.load_training_checkpoint(
                    path, model=training.model, optimizer=training.optimizer, scheduler=training.scheduler,
                    precision=training.precision, device=training.device)
                break
            except state.CheckpointError as error:
                if forced or index == len(checkpoints) - 1:
                    raise
                self.log.echo(f"notice: {error}\n  falling back to {Path(checkpoints[index + 1]).name}")
        training.step, training.micro_step, training.epoch = saved["step"], saved["micro_step"], saved["epoch"]
        training.batch_in_epoch, training.skipped_steps = saved["batch_in_epoch"], saved["skipped_steps"]
        self.best.load_state_dict(saved["best"])
        training.last_eval, self.last_eval_step = saved["last_eval"], saved["last_eval_step"]
        self.last_checkpoint_step = training.step
        self._checkpoints = set(saved.get("run_checkpoints", [])) | {path.name}
        if saved["epoch_rng_state"] is not None:
            self._epoch_rng_state = torch.tensor(saved["epoch_rng_state"], dtype=torch.uint8)
        self.log.event({"event": "resume", "step": training.step, "micro_step": training.micro_step,
                        "epoch": training.epoch, "checkpoint": str(path),
                        "message": "the events after this one supersede any logged before it for later steps"},
                       line=f"resumed from {path} at step {training.step} (epoch {training.epoch}, "
                            f"micro-batch {training.batch_in_epoch})")

    def start_epoch(self):
        """The current epoch's batches, from the run's position (a resume in mid-epoch replays its order)."""
        training = self.training
        epoch_batches, self._epoch_rng_state = resume.start_epoch(
            training.train_loader, training.epoch, training.batch_in_epoch, self._epoch_rng_state,
            self._rng_after_skip)
        self._rng_after_skip = None
        return epoch_batches

    def load_best(self) -> None:
        """Loads the best checkpoint's weights into the model (`load_best_at_end`)."""
        training = self.training
        path = self.output_dir / self.best.best_checkpoint
        saved = resume.load_weights(path, training.model, training.device)
        training.last_eval = saved.get("last_eval")
        self.log.echo(f"loaded the best checkpoint {path.name} ({self.best.metric_name}={self.best.best_metric:.4f})")

    def save_on_interrupt(self) -> None:
        """A signal asked the run to stop: save where it stands so `resume='auto'` continues from here."""
        step = self.training.step
        if self.output_dir is not None and self.last_checkpoint_step != step:
            self.save_checkpoint(None)
        where = f"saved checkpoint-{step}" if self.output_dir is not None else "nothing saved (no output_dir)"
        self.log.echo(f"interrupted by {self.training.interrupted} at step {step}: {where}; "
                      "continue with resume='auto' (--resume auto)")

    def last_good_checkpoint(self) -> Path | None:
        """The newest complete checkpoint in output_dir, if any (named when training diverges)."""
        return state.latest_checkpoint(self.output_dir) if self.output_dir is not None else None

    # ------------------------------------------------------------------ progress
    def open_progress(self) -> None:
        """The progress bar from the current step; the heartbeat's time-to-go counts this run's updates.

        A `max_steps` that the epochs cannot reach is said once here, not discovered at the end. With
        `measure_mfu`, the model's FLOPs per token are counted (trainability as it is now) and this device's
        matmul peak is read from the cache or measured (about a second): before training's clock starts.
        """
        planned, config = self.planned_updates(), self.config
        if planned is not None and 0 < planned < config.max_steps:
            self.log.echo(f"notice: max_steps={config.max_steps} (--max-steps) but {config.epochs} epoch(s) of this "
                          f"data make {planned} updates: the run stops at {planned}; raise epochs (--epochs) to "
                          f"reach {config.max_steps}")
        if config.measure_mfu:
            self.model_flops = flops.count_model_flops(self.training.model)
            self.peak = flops.matmul_peak_flops(self.training.device, self.training.precision.name)
        self.log.open_progress(planned, initial=self.training.step)
        self._first_step = self.training.step

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
        peak = self.peak["flops_per_s"] * distributed.current().world_size  # the tokens are every rank's
        return {"mfu": achieved / peak, "model_flops_per_token": per_token, "model_flops_per_s": achieved,
                "peak_flops_per_s": peak, "peak_flops_dtype": self.peak["dtype"],
                "peak_flops_device": self.peak["device"]}

    def planned_updates(self) -> int | None:
        """The updates the whole run makes (None: a loader without a length and no `max_steps`)."""
        try:
            return planned_updates(len(self.training.train_loader), self.config)
        except TypeError:  # a loader without a length
            return self.config.max_steps if self.config.max_steps > 0 else None

    def progress_line(self) -> str:
        """"step 12/32 (epoch 0.38), 41.2 s of training, about 68 s to go": the heartbeat line."""
        totals, planned, step = self.log.totals, self.planned_updates(), self.training.step
        line = f"training: step {step}" + (f"/{planned}" if planned else "") + f" (epoch {self.epoch_progress()})"
        line += f", {totals.run_seconds:.0f} s of training"
        done = step - self._first_step
        if planned and done > 0:
            line += f", about {totals.run_seconds / done * (planned - step):.0f} s to go"
        return line

    def epoch_progress(self) -> float:
        """The data position in epochs (2.25: a quarter into the third epoch)."""
        training = self.training
        try:
            return round(training.epoch + training.batch_in_epoch / len(training.train_loader), 4)
        except (TypeError, ZeroDivisionError):
            return float(training.epoch)

    def log_train(self, grad_norm: torch.Tensor) -> None:
        """The `train` event of a log interval: loss, learning rate, norm, throughput, memory."""
        training = self.training
        interval = self.log.totals.pop_interval()
        groups = training.optimizer.param_groups
        record = {
            "event": "train", "step": training.step, "micro_step": training.micro_step,
            "epoch": self.epoch_progress(), "loss": interval["loss"],
            "lr": float(groups[0]["lr"]) if groups else 0.0, "grad_norm": float(grad_norm),
            "samples_per_s": interval["samples_per_s"], "tokens_per_s": interval["tokens_per_s"],
            "skipped_steps": training.skipped_steps,
            "peak_memory_bytes": training.meter.summary(training.model, training.optimizer)["peak_memory_bytes"],
            "mfu": self.flops_figures(interval["tokens_per_s"], interval["samples_per_s"])["mfu"],
        }
        mfu = {} if record["mfu"] is None else {"mfu": f"{record['mfu']:.1%}"}
        self.log.advance_progress(0, loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                  samples_s=f"{record['samples_per_s']:.1f}", **mfu)
        self.log.event(record)

    # ------------------------------------------------------------------ the summary
    def summary(self, runtime_seconds: float, *, micro_batch_splits: int, unfreeze: dict | None) -> dict:
        """The run's summary: throughput, MFU, counters, memory, final evaluation, best checkpoint."""
        training, totals = self.training, self.log.totals
        seconds = max(totals.run_seconds, 1e-9)
        result = {
            "train_runtime_s": round(runtime_seconds, 3),
            **totals.run_figures(),
            **self.flops_figures(totals.run_tokens / seconds, totals.run_samples / seconds),
            "optimizer_steps": training.step,
            "skipped_steps": training.skipped_steps,
            "micro_steps": training.micro_step,
            "epochs_completed": training.epoch,
            "device": str(training.device),
            "cpu": cpu_description(),
            "precision": training.precision.name,
            "final_eval": training.last_eval,
            "metric_for_best": self.best.metric_name,
            "best_metric": self.best.best_metric,
            "best_checkpoint": self.best.best_checkpoint,
            "interrupted": training.interrupted,
            "micro_batch_splits": micro_batch_splits,
            "config": self.config.to_dict(),
        }
        result.update(training.meter.summary(training.model, training.optimizer))
        if unfreeze is not None:  # peak_memory_bytes is then the last stage's, the one that must fit
            result["unfreeze"] = unfreeze
        return result

    def finish(self, summary: dict) -> dict:
        """Writes summary.json (rank 0), records the run as finished or interrupted, closes the log."""
        if self.output_dir is not None and self.is_main:
            state.write_json_atomic(self.output_dir / "summary.json", summary)
        self.record_status("interrupted" if self.training.interrupted else "finished")
        self.log.close()
        return summary
