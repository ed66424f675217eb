"""`Loop`: the training loop, written out so that a reader can follow every step.

`fit()` owns all control flow. One optimizer update ("step") is made of one accumulation window of
`accum_steps` micro-batches ("micro_steps"); the last window of an epoch may hold fewer and is stepped
all the same. Per window, in this order:

    count the window's items (labels that are not -100, else rows)
    for each micro-batch:  forward under autocast -> loss sum / window items -> scaled backward
    unscale (fp16) -> clip -> step -> update -> zero

Dividing each micro-batch's loss *sum* by the whole window's item count (samples, or tokens for
token-level losses) makes accumulation exact: `B x 1` and any split of the same `B` items over
micro-batches of unequal sizes give the same update, the partial last window included. Dividing each
micro-batch's *mean* by `accum_steps` (the common recipe) is not: it over-weights small micro-batches
and the short last window.

Researchers subclass `Loop` and override a hook: `compute_loss`, `eval_step`, `compute_metrics`,
`on_step_end`. Each is called on one visible line of `fit()` or `evaluate()`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn
from tqdm.auto import tqdm

from looptrain import distributed, memory, metrics, state
from looptrain.config import ConfigError, LoopConfig
from looptrain.gradient_checkpointing import enable_gradient_checkpointing
from looptrain.optim import OptimizerInBackward, optimizer_state_bytes
from looptrain.precision import autocast, make_grad_scaler, resolve_device
from looptrain.seeding import seed_everything


class Loop:
    """An explicit training loop: exact accumulation, autocast + GradScaler, clipping after unscale.

    Args:
        model: the module to train. HF models work as they are (the default `compute_loss` reads
            `outputs.loss`); anything else needs `compute_loss` overridden.
        optimizer: an optimizer over the model's trainable parameters (see `looptrain.optim`).
        train_loader: an iterable of batches (dicts of tensors for the default hooks).
        eval_loader: optional batches for `evaluate()`.
        scheduler: optional LR scheduler, stepped once per optimizer update (never for skipped ones).
        config: a `LoopConfig`.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader,
        *,
        eval_loader=None,
        scheduler=None,
        config: Optional[LoopConfig] = None,
    ):
        self.config = config if config is not None else LoopConfig()
        self.dist = distributed.init_distributed(self.config.device)  # torchrun's group, if launched by it
        self.device = self.device_for(self.config, self.dist)
        seed_everything(self.config.seed)
        self.module = model.to(self.device)  # the model itself: configs, saving, evaluation
        self.fsdp = distributed.is_fsdp(self.module)
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(self.module)
        self.model = self.wrap_for_distributed(self.module)  # what forward and backward run through
        if self.config.optimizer_in_backward:
            optimizer = OptimizerInBackward(
                self.module, optimizer, max_grad_norm=self.config.max_grad_norm, clip=self.config.effective_clip_mode
            )
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_loader = train_loader
        self.eval_loader = eval_loader
        self.scaler = make_grad_scaler(self.device, self.config.precision)
        self.trainable_parameters = [p for p in self.module.parameters() if p.requires_grad]
        if not self.trainable_parameters:
            raise ValueError("the model has no trainable parameters: unfreeze some (see looptrain.freeze)")
        # The tensor tracker is not built for DTensors: sharded runs measure RSS (CPU) or the allocator (CUDA).
        self.meter = memory.make_meter(self.device, track_tensors=self.config.track_memory and not self.fsdp)
        self.output_dir = Path(self.config.output_dir) if self.config.output_dir else None
        # Counters with fixed meanings: `step` counts optimizer updates, `micro_step` counts
        # forward/backward passes; `batch_in_epoch` is the position an exact resume continues from.
        self.step = 0
        self.micro_step = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.skipped_steps = 0
        self.samples_seen = 0
        self.tokens_seen = 0
        self.best = state.BestTracker(self.config.metric_for_best)
        self.last_eval: Optional[dict] = None
        self.last_eval_step = -1
        self.epoch_rng_state: Optional[torch.Tensor] = None
        self.resume_rng_state: Optional[dict] = None
        self.progress = None
        self._interval = _Interval()
        self.micro_batch_splits = 1  # auto_batch doubles it after an out-of-memory
        self.bad_windows = 0  # consecutive windows with a non-finite loss or gradient
        self.stop_signal: Optional[str] = None  # set by SIGTERM / SIGINT
        self.interrupted: Optional[str] = None
        self.last_checkpoint_step = -1

    @staticmethod
    def device_for(config: LoopConfig, place: distributed.DistributedInfo) -> torch.device:
        """The device a process trains on: the config's, with each rank on its own GPU under torchrun."""
        device = resolve_device(config.device)
        if place.is_distributed and device.type == "cuda":
            return torch.device("cuda", place.local_rank)
        return device

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Trains for `epochs` (or until `max_steps` updates), evaluating and saving on schedule.

        Returns:
            The run's summary, the same dict that is written to `output_dir/summary.json`.
        """
        config = self.config
        fit_started = time.perf_counter()
        if config.resume is not None:
            self.restore(config.resume)
        self.meter.start(self.module, self.optimizer)
        self.progress = self.make_progress_bar()
        self._interval.restart_clock()
        try:
            with self.signals_caught():
                self.train_epochs()
        finally:  # an exception must not leave the memory tracker installed or the bar open
            self.close_progress_bar()
            self.meter.stop()
        if self.interrupted is None:
            if self.eval_loader is not None and self.last_eval_step != self.step:
                self.last_eval = self.evaluate()
                self.last_eval_step = self.step
            if config.load_best_at_end and self.best.best_checkpoint is not None:
                self.load_best()
        summary = self.summary(time.perf_counter() - fit_started)
        if self.output_dir is not None and self.dist.is_main:
            state.write_json_atomic(self.output_dir / "summary.json", summary)
        return summary

    def train_epochs(self) -> None:
        """The training loop proper: epochs of accumulation windows, each ending in one optimizer step."""
        config = self.config
        while self.epoch < config.epochs and not self.reached_max_steps():
            for window in self.accumulation_windows():
                window_loss, window_items, counted_items, stop = self.accumulate_with_retry(window)
                self.batch_in_epoch += len(window)
                self.mark("optimizer")
                grad_norm, stepped = self.optimizer_step(counted_items, window_items)
                if stepped:
                    self.step += 1
                    if self.scheduler is not None:
                        self.scheduler.step()  # never advanced for a step the scaler skipped
                else:
                    self.skipped_steps += 1
                self._interval.add_window(window_loss, window_items)
                self.check_window(window_loss, stepped)  # counts bad windows, may stop the run
                self.on_step_end(step=self.step, loss_sum=window_loss, num_items=window_items, grad_norm=grad_norm)
                if stepped and self.step % config.log_every == 0:
                    self.log_train(grad_norm)
                if stepped and isinstance(config.eval_every, int) and self.step % config.eval_every == 0:
                    self.evaluate_and_save()
                if stop:
                    self.save_on_interrupt()
                    return
                if self.reached_max_steps():
                    break
            else:  # the epoch ran to its end (not stopped by max_steps)
                self.epoch += 1
                self.batch_in_epoch = 0
                if config.eval_every == "epoch":
                    self.evaluate_and_save()

    def accumulate(self, window: list) -> tuple[float, int, int, bool]:
        """Forward and backward over one window's micro-batches, gradients left summed in `.grad`.

        Returns:
            The window's loss sum, its item count as `compute_loss` reported, the item count counted
            before the forwards (all summed over ranks), and whether any rank was asked to stop.
        """
        config = self.config
        self.model.train()
        # Counted before the first forward (HF's num_items_in_batch) and summed over ranks, so every
        # micro-batch backwards its share of the *global* window mean.
        counted_items = self.global_sum(sum(count_items(batch) for batch in window))
        micro_batches = [piece for batch in window for piece in split_batch(batch, self.micro_batch_splits)]
        window_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        window_items = window_samples = window_tokens = 0
        for index, batch in enumerate(micro_batches):
            samples, tokens = batch_sizes(batch)
            batch = self.to_device(batch)
            with self.backward_context(is_last=index == len(micro_batches) - 1):
                self.mark("forward")
                with autocast(self.device, config.precision):
                    loss_sum, num_items = self.loss_sum_and_items(self.compute_loss(batch), batch)
                self.mark("backward")
                # DDP averages gradients over ranks: scale the divisor down by the world size.
                divisor = num_items if config.optimizer_in_backward else counted_items / self.dist.world_size
                self.scaler.scale(loss_sum / max(divisor, 1e-12)).backward()
            window_loss += loss_sum.detach().double()
            window_items += num_items
            window_samples += samples
            window_tokens += tokens
        self.micro_step += len(micro_batches)
        # One collective per window: the global loss and counts, and whether a rank caught a signal.
        window_loss, window_items, window_samples, window_tokens, stops = distributed.all_reduce_sum(
            [float(window_loss), window_items, window_samples, window_tokens, float(self.stop_signal is not None)],
            self.device)
        self.samples_seen += int(window_samples)
        self.tokens_seen += int(window_tokens)
        self._interval.add(int(window_samples), int(window_tokens))
        return window_loss, int(window_items), counted_items, stops > 0

    def accumulate_with_retry(self, window: list) -> tuple[float, int, int, bool]:
        """`accumulate`, retried with micro-batches split in halves after an out-of-memory (`auto_batch`)."""
        while True:
            try:
                return self.accumulate(window)
            except OUT_OF_MEMORY_ERRORS as error:
                self.recover_from_out_of_memory(window, error)

    def recover_from_out_of_memory(self, window: list, error: BaseException) -> None:
        """Drops the failed window's gradients and doubles the micro-batch split, or re-raises.

        Splitting keeps the window (the effective batch) and its item count, so the update stays the
        exact mean over the same items; only the number of forward/backward passes doubles.
        """
        for parameter in self.trainable_parameters:
            parameter.grad = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        rows = min(first_dimension(batch) for batch in window)
        if not self.config.auto_batch or self.micro_batch_splits * 2 > rows:
            raise type(error)(self.out_of_memory_message(error, rows)) from error
        self.micro_batch_splits *= 2
        self.log_event({
            "event": "auto_batch", "step": self.step, "micro_batch_splits": self.micro_batch_splits,
            "micro_batch_rows": math.ceil(rows / self.micro_batch_splits),
            "message": f"out of memory: each micro-batch now runs in {self.micro_batch_splits} pieces "
                       f"(accumulation x{self.micro_batch_splits}, same effective batch); retrying the window",
        })

    def out_of_memory_message(self, error: BaseException, rows: int) -> str:
        """The error text for an out-of-memory the loop cannot recover from: what held the memory, what to try."""
        params = memory.parameter_bytes(self.module)
        grads = memory.gradient_bytes(self.module)
        optimizer_state = optimizer_state_bytes(self.optimizer)
        lines = [
            f"out of memory at step {self.step} (micro-batch of {math.ceil(rows / self.micro_batch_splits)} rows): {error}",
            f"  held at the failure: params {params / 2**20:.1f} MiB, grads {grads / 2**20:.1f} MiB, "
            f"optimizer state {optimizer_state / 2**20:.1f} MiB",
        ]
        if self.device.type == "cuda":
            lines.append(f"  CUDA allocated {torch.cuda.memory_allocated(self.device) / 2**20:.1f} MiB of "
                         f"{torch.cuda.get_device_properties(self.device).total_memory / 2**20:.0f} MiB")
        lines.append(
            "  try: auto_batch=True (--auto-batch) to halve the micro-batch and double accumulation; "
            "gradient_checkpointing=True (--grad-checkpoint); an 8-bit optimizer (--optim adamw8bit); "
            "bf16 (--amp); a shorter --max-length"
        )
        return "\n".join(lines)

    def check_window(self, window_loss: float, stepped: bool) -> None:
        """Logs a skipped window and stops the run after `max_bad_windows` non-finite ones in a row.

        A window is bad when its loss is not finite, or (fp32/bf16) its gradient norm is not. An fp16
        overflow with a finite loss is not bad: the GradScaler lowers its scale and the next window
        usually steps.
        """
        bad = not math.isfinite(window_loss) or (not stepped and not self.scaler.is_enabled())
        self.bad_windows = self.bad_windows + 1 if bad else 0
        if not stepped:
            reason = "non-finite loss or gradients" if bad else "fp16 gradients overflowed: the GradScaler lowered its scale"
            self.log_event({"event": "skipped", "step": self.step, "micro_step": self.micro_step,
                            "skipped_steps": self.skipped_steps, "reason": reason})
        if self.bad_windows >= self.config.max_bad_windows:
            last_good = state.latest_checkpoint(self.output_dir) if self.output_dir is not None else None
            raise TrainingDiverged(
                f"the loss or gradients were not finite for {self.bad_windows} windows in a row, up to step "
                f"{self.step} (micro-step {self.micro_step}); none of them was applied. Last good checkpoint: "
                f"{last_good if last_good is not None else 'none saved'}. Lower the learning rate, use "
                "precision='bf16' or 'fp32', check the data for extreme values, or raise max_bad_windows"
            )

    def save_on_interrupt(self) -> None:
        """A signal asked the run to stop: save where it stands so `resume='auto'` continues from here."""
        self.interrupted = self.stop_signal or "signal"
        if self.output_dir is not None and self.last_checkpoint_step != self.step:
            self.save_checkpoint(None)
            distributed.barrier()
        where = f"saved checkpoint-{self.step}" if self.output_dir is not None else "nothing saved (no output_dir)"
        self.echo(f"interrupted by {self.interrupted} at step {self.step}: {where}; continue with resume='auto' (--resume auto)")

    @contextlib.contextmanager
    def signals_caught(self):
        """SIGTERM and SIGINT (Ctrl-C) ask the loop to stop after the current window; a second one stops at once."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def request_stop(signal_number, frame):
            if self.stop_signal is not None:  # asked twice: stop now
                signal.signal(signal_number, previous[signal_number])
                raise KeyboardInterrupt
            self.stop_signal = signal.Signals(signal_number).name
            self.echo(f"{self.stop_signal} received: stopping after this window and saving a checkpoint")

        previous = {number: signal.signal(number, request_stop) for number in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def optimizer_step(self, counted_items: int, num_items: int) -> tuple[torch.Tensor, bool]:
        """Turns the window's accumulated gradients into one update.

        Args:
            counted_items: the items counted before the forward passes, which the losses were divided by.
            num_items: the items `compute_loss` reported; when it differs (a custom token-level loss),
                the gradients are rescaled once so the update is the exact mean over `num_items`.

        Returns:
            The gradient norm (after unscaling, before clipping) and whether the update was applied.
        """
        if self.config.optimizer_in_backward:
            # Every parameter already stepped inside backward (and was clipped per parameter there).
            return self.optimizer.grad_norm, True
        self.scaler.unscale_(self.optimizer)  # fp16: back to true gradients *before* clipping
        scale_gradients_(self.trainable_parameters, max(counted_items, 1) / max(num_items, 1))  # exact mean
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = nn.utils.clip_grad_norm_(self.trainable_parameters, max_norm, error_if_nonfinite=False)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm of sharded gradients is a DTensor
            grad_norm = grad_norm.full_tensor()
        if self.scaler.is_enabled():
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # the scaler skips the step when fp16 gradients overflowed
            self.scaler.update()
            stepped = self.scaler.get_scale() >= scale_before  # the scale only shrinks after a skip
        else:
            stepped = bool(torch.isfinite(grad_norm))  # a non-finite fp32/bf16 window is skipped, not applied
            if stepped:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, stepped

    # ------------------------------------------------------------------ hooks
    def compute_loss(self, batch) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Returns the micro-batch's mean loss, or `(loss_sum, num_items)` for exact token-level losses.

        The default calls `model(**batch)` and reads `.loss` (HF models compute it when the batch has
        `labels`). A mean is weighted by the batch's item count: its labels that are not -100, or its
        number of rows when it has no labels.
        """
        outputs = self.model(**batch)
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs.loss
        if loss is None:
            raise ValueError("the model returned no loss: pass `labels` in the batch or override Loop.compute_loss")
        return loss

    def eval_step(self, batch) -> dict:
        """Runs one evaluation batch; returns `loss_sum`, `num_items`, `predictions` and `labels`.

        The default is for sequence classification: argmax of `outputs.logits`, mean loss times rows.
        """
        outputs = self.model(**batch)
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits
        loss = outputs["loss"] if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        labels = batch["labels"]
        return {
            "loss_sum": None if loss is None else loss.float() * labels.shape[0],
            "num_items": labels.shape[0],
            "predictions": logits.argmax(dim=-1),
            "labels": labels,
        }

    def compute_metrics(self, predictions: torch.Tensor, labels: torch.Tensor) -> dict:
        """Metrics over the whole evaluation set (CPU tensors). The default: accuracy and F1."""
        num_labels = getattr(getattr(self.module, "config", None), "num_labels", None)
        scores = metrics.f1_scores(predictions, labels, num_labels=num_labels)
        result = {"accuracy": metrics.accuracy(predictions, labels), "f1": scores["f1_macro"]}
        if "f1_binary" in scores:
            result["f1_binary"] = scores["f1_binary"]
        return result

    def on_step_end(self, *, step: int, loss_sum: torch.Tensor, num_items: int, grad_norm: torch.Tensor) -> None:
        """Called after every accumulation window (also when its update was skipped). Does nothing."""

    # ------------------------------------------------------------------ evaluation and checkpoints
    @torch.inference_mode()
    def evaluate(self, loader=None) -> dict:
        """Evaluates on `loader` (default: the eval loader) and returns loss and `compute_metrics`.

        Only predictions and labels (one int each per sample) are kept, on the CPU.
        """
        loader = loader if loader is not None else self.eval_loader
        if loader is None:
            raise ValueError("evaluate() needs an eval_loader: pass one to Loop(...) or to evaluate(loader)")
        was_training = self.model.training
        self.model.eval()
        self.mark("eval")
        predictions, labels, loss_sum, num_items = [], [], 0.0, 0
        for batch in loader:
            batch = self.to_device(batch)
            with autocast(self.device, self.config.precision):
                output = self.eval_step(batch)
            predictions.append(output["predictions"].to("cpu", torch.int64))
            labels.append(output["labels"].to("cpu", torch.int64))
            if output.get("loss_sum") is not None:
                loss_sum += float(output["loss_sum"])
            num_items += int(output["num_items"])
        self.model.train(was_training)
        # Under DDP each rank evaluated its own shard: gather them (every sample exactly once).
        shards = distributed.all_gather_objects(
            (torch.cat(predictions) if predictions else None, torch.cat(labels) if labels else None, loss_sum, num_items))
        predictions = [shard[0] for shard in shards if shard[0] is not None]
        if not predictions:
            raise ValueError("the eval loader yielded no batches: check the evaluation data")
        labels = [shard[1] for shard in shards if shard[1] is not None]
        loss_sum, num_items = sum(shard[2] for shard in shards), sum(shard[3] for shard in shards)
        result = {"loss": loss_sum / max(num_items, 1)}
        result.update(self.compute_metrics(torch.cat(predictions), torch.cat(labels)))
        return result

    def evaluate_and_save(self) -> None:
        """The evaluation point: evaluate (when there is eval data), log, and write a checkpoint."""
        if self.eval_loader is not None:
            self.last_eval = self.evaluate()
            self.last_eval_step = self.step
            self.log_event({"event": "eval", "step": self.step, "epoch": self.epoch_progress(), **self.last_eval})
        if self.output_dir is not None:
            self.save_checkpoint(self.last_eval if self.eval_loader is not None else None)
            distributed.barrier()  # no rank runs ahead of a checkpoint that rank 0 is still writing
        self._interval.restart_clock()  # evaluation and saving are not training time

    def save_checkpoint(self, eval_metrics: Optional[dict]) -> Path:
        """Writes `checkpoint-<step>/` atomically, updates the best, rotates old checkpoints."""
        # The best moves to this checkpoint only once it is safely on disk.
        best = copy.deepcopy(self.best)
        if eval_metrics is not None:
            best.update(eval_metrics, state.checkpoint_name(self.step), step=self.step)
        # Every rank's torch RNG (dropout differs per rank); rank 0 alone writes.
        rank_rng_states = distributed.all_gather_objects(torch.get_rng_state().tolist())
        path = self.output_dir / state.checkpoint_name(self.step)
        model, optimizer = self.module, self.optimizer
        if self.fsdp:  # gather the full weights and optimizer state (a collective: every rank takes part)
            model = distributed.FullStateModel(self.module)
            optimizer = distributed.FullStateOptimizer(self.module, self.optimizer)
        if self.dist.is_main:
            state.save_checkpoint(
                self.output_dir,
                self.step,
                model=model,
                optimizer=optimizer,
                scheduler=self.scheduler,
                scaler=self.scaler,
                trainer_state={**self.trainer_state(), "best": best.state_dict(), "rank_rng_states": rank_rng_states},
                metrics=eval_metrics,
            )
            state.rotate_checkpoints(self.output_dir, self.config.save_total_limit, best_checkpoint=best.best_checkpoint)
        self.best = best
        self.last_checkpoint_step = self.step
        return path

    def trainer_state(self) -> dict:
        """The counters and positions an exact resume needs (JSON-ready)."""
        return {
            "step": self.step,
            "micro_step": self.micro_step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "skipped_steps": self.skipped_steps,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "best": self.best.state_dict(),
            "last_eval": self.last_eval,
            "last_eval_step": self.last_eval_step,
            # The data order of an epoch is drawn from torch's RNG when its iterator starts: keep the
            # state of that moment so a resume in mid-epoch replays the same order.
            "epoch_rng_state": None if self.epoch_rng_state is None else self.epoch_rng_state.tolist(),
        }

    def restore(self, resume: str) -> None:
        """Restores weights, optimizer, scheduler, scaler, RNG and position from a checkpoint.

        Args:
            resume: "auto" (the newest complete checkpoint in `output_dir`; none there: start fresh)
                or the path of a checkpoint directory.
        """
        path = state.resolve_resume_checkpoint(resume, self.output_dir)
        if path is None:
            self.echo(f"resume=auto: no checkpoint in {self.output_dir}, starting from scratch")
            return
        saved = state.load_checkpoint(
            path, model=self.loadable_model(), optimizer=self.loadable_optimizer(), scheduler=self.scheduler,
            scaler=self.scaler, map_location=self.device,
        )
        self.step, self.micro_step, self.epoch = saved["step"], saved["micro_step"], saved["epoch"]
        self.batch_in_epoch, self.skipped_steps = saved["batch_in_epoch"], saved["skipped_steps"]
        self.samples_seen, self.tokens_seen = saved["samples_seen"], saved["tokens_seen"]
        self.best.load_state_dict(saved["best"])
        self.last_eval, self.last_eval_step = saved["last_eval"], saved["last_eval_step"]
        if saved["epoch_rng_state"] is not None:
            self.epoch_rng_state = torch.tensor(saved["epoch_rng_state"], dtype=torch.uint8)
        rank_rng_states = saved.get("rank_rng_states")
        if rank_rng_states and len(rank_rng_states) == self.dist.world_size:
            torch.set_rng_state(torch.tensor(rank_rng_states[self.dist.rank], dtype=torch.uint8))
        self.resume_rng_state = state.capture_rng_state()  # what the checkpoint restored; re-applied after the skip
        self.echo(f"resumed from {path} at step {self.step} (epoch {self.epoch}, micro-batch {self.batch_in_epoch})")

    def loadable_model(self) -> nn.Module:
        """What checkpoint weights load into: the model, or a full-state view of an FSDP2-sharded one."""
        return distributed.FullStateModel(self.module) if self.fsdp else self.module

    def loadable_optimizer(self):
        return distributed.FullStateOptimizer(self.module, self.optimizer, gather=False) if self.fsdp else self.optimizer

    def load_best(self) -> None:
        """Loads the best checkpoint's weights into the model (`load_best_at_end`)."""
        path = self.output_dir / self.best.best_checkpoint
        saved = state.load_checkpoint(path, model=self.loadable_model(), map_location=self.device, restore_rng=False)
        self.last_eval = saved.get("last_eval")
        self.echo(f"loaded the best checkpoint {path.name} ({self.config.metric_for_best}={self.best.best_metric:.4f})")

    # ------------------------------------------------------------------ data and devices
    def accumulation_windows(self) -> Iterator[list]:
        """Yields the current epoch's micro-batches in windows of `accum_steps`; the last may be shorter.

        Windows never cross an epoch boundary. On resume in mid-epoch, the epoch's data order is
        replayed from the RNG state saved at its start and the consumed micro-batches are skipped.
        """
        sampler = getattr(self.train_loader, "batch_sampler", None)
        for source in (sampler, getattr(self.train_loader, "sampler", None), self.train_loader):
            if hasattr(source, "set_epoch"):
                source.set_epoch(self.epoch)
                break
        skip = self.batch_in_epoch
        if skip and self.epoch_rng_state is not None:
            torch.set_rng_state(self.epoch_rng_state)
        self.epoch_rng_state = torch.get_rng_state()
        if skip and hasattr(sampler, "skip_batches"):
            sampler.skip_batches(skip)  # the sampler knows its epoch's order: no batch is loaded to skip it
            skip = 0
        batches = iter(self.train_loader)
        for _ in range(skip):
            next(batches)
        if self.resume_rng_state is not None:
            state.restore_rng_state(self.resume_rng_state)
            self.resume_rng_state = None
        window = []
        for batch in batches:
            window.append(batch)
            if len(window) == self.config.accum_steps:
                yield window
                window = []
        if window:
            yield window  # the partial last window: stepped, normalised by the items it holds

    def to_device(self, batch):
        """Moves a batch (tensor, mapping, list or tuple of them) to the loop's device."""
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, Mapping):
            return {key: self.to_device(value) for key, value in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(value) for value in batch)
        return batch

    def backward_context(self, is_last: bool):
        """Skips the gradient all-reduce (DDP) or reduce-scatter (FSDP2) on every micro-step but the last."""
        if self.fsdp:
            self.module.set_requires_gradient_sync(is_last)
            return contextlib.nullcontext()
        if not is_last and hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def loss_sum_and_items(self, loss, batch) -> tuple[torch.Tensor, int]:
        """Turns `compute_loss`'s result into `(loss_sum, num_items)`."""
        if isinstance(loss, tuple):
            loss_sum, num_items = loss
            return loss_sum.float(), int(num_items)
        num_items = count_items(batch)
        return loss.float() * num_items, num_items

    def wrap_for_distributed(self, module: nn.Module) -> nn.Module:
        """Wraps the model in DistributedDataParallel when running under torchrun; else returns it."""
        if not self.dist.is_distributed:
            return module
        if self.config.optimizer_in_backward:
            raise ConfigError(
                "optimizer_in_backward=True cannot run with several processes: each parameter would "
                "step on its local gradient before the all-reduce; turn it off for multi-process runs"
            )
        if self.config.auto_batch:
            raise ConfigError(
                "auto_batch=True cannot run with several processes: one rank would retry a window while the "
                "others wait in its all-reduce; set the micro-batch size by hand (--batch-size, --accum)"
            )
        if self.fsdp:
            if self.config.precision == "fp16":
                raise ConfigError("precision='fp16' is not supported with FSDP2 sharding: use precision='bf16'")
            return module  # already sharded by looptrain.distributed.shard_model
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Buffers (position ids) never change in training: no need to broadcast them every forward.
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)

    def global_sum(self, value: int) -> int:
        """`value` summed over every rank (itself in a single process)."""
        return int(distributed.all_reduce_sum([value], self.device)[0])

    def reached_max_steps(self) -> bool:
        return 0 < self.config.max_steps <= self.step

    def mark(self, phase: str) -> None:
        """Tells the memory meter which phase starts now, so the peak can be attributed to one."""
        self.meter.mark(phase)

    # ------------------------------------------------------------------ logging and summary
    def log_train(self, grad_norm: torch.Tensor) -> None:
        interval = self._interval.pop()
        record = {
            "event": "train",
            "step": self.step,
            "micro_step": self.micro_step,
            "epoch": self.epoch_progress(),
            "loss": interval["loss"],
            "lr": self.current_lr(),
            "grad_norm": float(grad_norm),
            "samples_per_s": interval["samples_per_s"],
            "tokens_per_s": interval["tokens_per_s"],
            "skipped_steps": self.skipped_steps,
        }
        record["peak_memory_bytes"] = self.meter.summary(self.module, self.optimizer)["peak_memory_bytes"]
        if self.progress is not None:
            self.progress.set_postfix(
                loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", samples_s=f"{record['samples_per_s']:.1f}"
            )
        self.log_event(record)

    def log_event(self, record: dict) -> None:
        """Appends one event to `metrics.jsonl` and prints it as one line (rank 0 only)."""
        if not self.dist.is_main:
            return
        if self.output_dir is not None:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            with open(self.output_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record) + "\n")
        self.echo(format_record(record))

    def echo(self, line: str) -> None:
        if self.dist.is_main:
            tqdm.write(line, file=sys.stdout)

    def make_progress_bar(self):
        if not (self.config.progress_bar and sys.stderr.isatty() and self.dist.is_main):
            return None  # not a terminal: the log lines are the progress report
        try:
            total = planned_updates(len(self.train_loader), self.config)
        except TypeError:  # a loader without a length
            total = self.config.max_steps if self.config.max_steps > 0 else None
        return tqdm(total=total, initial=self.step, unit="step", dynamic_ncols=True)

    def close_progress_bar(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def epoch_progress(self) -> float:
        try:
            return round(self.epoch + self.batch_in_epoch / len(self.train_loader), 4)
        except (TypeError, ZeroDivisionError):
            return float(self.epoch)

    def current_lr(self) -> float:
        groups = self.optimizer.param_groups
        return float(groups[0]["lr"]) if groups else 0.0

    def summary(self, runtime_seconds: float) -> dict:
        """The run's summary: throughput, counters, memory, final evaluation, best checkpoint."""
        train_seconds = max(self._interval.total_seconds, 1e-9)
        result = {
            "train_runtime_s": round(runtime_seconds, 3),
            "train_samples_per_s": round(self._interval.total_samples / train_seconds, 3),
            "train_tokens_per_s": round(self._interval.total_tokens / train_seconds, 3),
            "train_loss": self._interval.total_loss(),
            "optimizer_steps": self.step,
            "skipped_steps": self.skipped_steps,
            "micro_steps": self.micro_step,
            "epochs_completed": self.epoch,
            "device": str(self.device),
            "precision": self.config.precision,
            "final_eval": self.last_eval,
            "best_metric": self.best.best_metric,
            "best_checkpoint": self.best.best_checkpoint,
            "interrupted": self.interrupted,
            "micro_batch_splits": self.micro_batch_splits,
            "config": self.config.to_dict(),
        }
        result.update(self.meter.summary(self.module, self.optimizer))
        return result


# ---------------------------------------------------------------------- small helpers
# torch < 2.5 has only the CUDA-specific class.
OUT_OF_MEMORY_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError)


class TrainingDiverged(RuntimeError):
    """Too many consecutive windows had a non-finite loss or gradient (`LoopConfig.max_bad_windows`)."""


def split_batch(batch, parts: int) -> list:
    """Cuts a batch (tensor, mapping, list or tuple of tensors) into `parts` row-wise pieces.

    Every tensor whose first dimension is the batch's row count is split; anything else is shared.
    """
    if parts == 1:
        return [batch]
    rows = first_dimension(batch)
    bounds = [round(rows * index / parts) for index in range(parts + 1)]

    def piece(value, start, stop):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == rows:
            return value[start:stop]
        if isinstance(value, Mapping):
            return {key: piece(item, start, stop) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(piece(item, start, stop) for item in value)
        return value

    return [piece(batch, start, stop) for start, stop in zip(bounds, bounds[1:]) if stop > start]


def planned_updates(num_batches: int, config: LoopConfig) -> int:
    """Optimizer updates a run makes over `num_batches` micro-batches an epoch (partial windows included)."""
    windows = math.ceil(num_batches / config.accum_steps) * config.epochs
    return min(windows, config.max_steps) if config.max_steps > 0 else windows


def count_items(batch) -> int:
    """Items a mean loss was taken over: labels that are not -100, else the batch's rows."""
    if isinstance(batch, Mapping) and isinstance(batch.get("labels"), torch.Tensor):
        return int((batch["labels"] != -100).sum())
    return first_dimension(batch)


def batch_sizes(batch) -> tuple[int, int]:
    """(samples, real tokens) of a batch, for throughput: tokens are the attention mask's ones."""
    samples = first_dimension(batch)
    if isinstance(batch, Mapping) and isinstance(batch.get("attention_mask"), torch.Tensor):
        return samples, int(batch["attention_mask"].sum())
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        return samples, batch["input_ids"].numel()
    return samples, 0


def first_dimension(batch) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    raise ValueError("cannot tell the batch size: the batch holds no tensor with a batch dimension")


@torch.no_grad()
def scale_gradients_(parameters, factor: float) -> None:
    """Multiplies every existing gradient by `factor`, in place."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


def format_record(record: dict) -> str:
    parts = []
    for key, value in record.items():
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif value is not None and not isinstance(value, (dict, list)):
            parts.append(f"{key}={value}")
    return " ".join(parts)


class _Interval:
    """Sums of samples, tokens, loss and training seconds, per log interval and for the whole run."""

    def __init__(self):
        self.samples = self.tokens = 0
        self.loss_sum = 0.0
        self.items = 0
        self.seconds = 0.0
        self.total_samples = self.total_tokens = 0
        self.total_seconds = 0.0
        self.total_loss_sum = 0.0
        self.total_items = 0
        self.clock = time.perf_counter()

    def add(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        self.total_samples += samples
        self.total_tokens += tokens

    def restart_clock(self) -> None:
        self.clock = time.perf_counter()

    def add_window(self, loss_sum: torch.Tensor, items: int) -> None:
        """Closes one accumulation window: its loss, items, and the seconds since the clock's last tick."""
        now = time.perf_counter()
        seconds, self.clock = now - self.clock, now
        value = float(loss_sum)
        self.loss_sum += value
        self.items += items
        self.seconds += seconds
        self.total_loss_sum += value
        self.total_items += items
        self.total_seconds += seconds

    def pop(self) -> dict:
        seconds = max(self.seconds, 1e-9)
        result = {
            "loss": self.loss_sum / max(self.items, 1),
            "samples_per_s": self.samples / seconds,
            "tokens_per_s": self.tokens / seconds,
        }
        self.samples = self.tokens = self.items = 0
        self.loss_sum = self.seconds = 0.0
        return result

    def total_loss(self) -> Optional[float]:
        return self.total_loss_sum / self.total_items if self.total_items else None
