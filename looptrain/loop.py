"""`Loop`: the training control flow, written out so that a reader can follow every step.

`fit()` is the lifecycle: check the evaluation hooks, resume, then epochs of accumulation windows,
evaluating and saving on schedule, and a final evaluation. `run_update()` is one optimizer update,
on one screen, in nanoGPT's order:

    count the window's items (before any forward, over every rank)
    for each micro-batch:  sync control -> forward under autocast -> loss sum -> scaled backward of sum / items
    then:                  unscale -> clip -> step or skip -> zero -> scheduler

Each micro-batch backwards its loss *sum* divided by the *whole window's* item count (samples, or
tokens for token-level losses), so the accumulated gradient is the exact mean over every item of
the window: `B x 1` and any split of the same `B` items over micro-batches of unequal sizes give the
same update, the partial last window included. (Dividing each micro-batch's *mean* by
`accum_steps`, the common recipe, over-weights small micro-batches and the short last window.)

Researchers subclass `Loop` and override a hook: `compute_loss`, `count_items`, `eval_step`,
`make_metrics`, `compute_metrics`, `on_step_end`. Each is called on one visible line.
Everything else is internal (`_`-prefixed).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from looptrain import batches, compilation, distributed, lm_loss, metrics, resume
from looptrain.batches import as_loss_sum, first_dimension, move_to, split_batch, split_by_tokens
from looptrain.config import ConfigError, LoopConfig, check_process_group
from looptrain.embedding_grad import accumulate_embedding_rows
from looptrain.gradient_checkpointing import enable_gradient_checkpointing
from looptrain.guards import (
    OUT_OF_MEMORY_ERRORS,
    BadWindowGuard,
    SignalGuard,
    TrainingDiverged,
    auto_batch_event,
    memory_held,
    split_after_out_of_memory,
)
from looptrain.memory import allocator, make_meter
from looptrain.optim import cast_to_bf16, clip_gradients, optimizer_name_of, stored_in_bf16, wrap_for_config
from looptrain.precision import Precision, resolve_device, resolve_precision
from looptrain.progress import Progress, length_of
from looptrain.run import EvaluationError, Run, TrainingParts, planned_updates
from looptrain.seeding import seed_everything
from looptrain.unfreeze import start_unfreezing

__all__ = ["EvaluationError", "Loop", "TrainingDiverged", "WindowResult", "planned_updates"]


class WindowResult(NamedTuple):
    """One accumulation window's outcome, as tensors (read them once per window, after the step)."""

    loss_sum: torch.Tensor  # the window's loss summed over every item (and every rank)
    num_items: torch.Tensor  # the items count_items counted before the forwards: the gradients' divisor
    loss_items: torch.Tensor  # the items compute_loss reported its losses over (must equal num_items)
    grad_norm: torch.Tensor  # the gradient norm before clipping, at its true scale
    stepped: bool  # whether the update was applied (False: skipped, non-finite or fp16 overflow)


class Loop:
    """An explicit training loop: exact accumulation, autocast + GradScaler, clipping after unscale.

    Args:
        model: the module to train. HF models work as they are (the default `compute_loss` reads
            `outputs.loss`); anything else needs `compute_loss` overridden.
        optimizer: an optimizer over the model's trainable parameters (see `looptrain.optim`).
        train_loader: an iterable of batches (dicts of tensors for the default hooks).
        eval_loader: optional batches for `evaluate()`.
        scheduler: optional LR scheduler, stepped once per applied update (never for a skipped one).
        config: a `LoopConfig`.
        make_precision, wrap_optimizer: doors for the layers above (docs/loop.md): factories called once, as
            `make_precision(device, precision_name)` and `wrap_optimizer(model, optimizer, config)`, in place of
            `Precision` and `looptrain.optim.wrap_for_config` (the estimator's fake-tensor behaviour).
        save_final: `save_final(summary)` writes the final outputs before run.json says "finished" (`Run.finish`).

    Attributes:
        model: the bare model (configs, saving, evaluation hooks read it).
        wrapped_model: what forward and backward run through: `DistributedDataParallel(model)` under
            torchrun, else `model` itself. Hooks call it.
        progress: where training stands, a `looptrain.progress.Progress` the Loop replaces as it trains:
            `step` (optimizer updates applied), `micro_step` (forward/backward passes), `skipped_steps`,
            `epoch` and `batch_in_epoch` (the data position), `last_eval`; each is also a property here.
        run: the `looptrain.run.Run` keeping output_dir: lock, ledger, checkpoints, resume, best, summary.
    """

    def __init__(self, model: nn.Module, optimizer: Any, train_loader, *, eval_loader=None, scheduler=None,
                 config: LoopConfig | None = None, make_precision: Callable[[torch.device, str], Precision] = Precision,
                 wrap_optimizer: Callable[[nn.Module, Any, LoopConfig], Any] = wrap_for_config,
                 save_final: Callable[[dict], dict] | None = None):
        self.config = config if config is not None else LoopConfig()
        self._place = distributed.init_distributed(self.config.device)  # torchrun's group, if launched by it
        self.device = distributed.device_for(resolve_device(self.config.device), self._place)
        check_process_group(self.config, self._place.world_size, sharded=distributed.is_fsdp(model),
                            optimizer_name=optimizer_name_of(optimizer))
        seed_everything(self.config.seed)
        self.model = model if batches.on_device(model, self.device) else model.to(self.device)
        if self.config.weights == "bf16" and not stored_in_bf16(self.model):
            cast_to_bf16(self.model)  # in place (the optimizer holds these same objects); a model cast already is kept
        if self.config.gradient_checkpointing:
            enable_gradient_checkpointing(self.model, every=self.config.checkpoint_every)
        # DDP's and FSDP's reducers wait for autograd's own accumulation; a compiled model keeps its graph whole.
        accumulate_embedding_rows(self.model, enabled=self.config.embedding_row_grads and not self.config.compile
                                  and self._place.world_size == 1 and not distributed.is_fsdp(self.model))
        compilation.compile_model(self.model, self.config.compile)  # in place: the same module, parameters and keys
        self.wrapped_model = distributed.wrap_model(self.model, self.device)
        # HF causal LMs shift their labels inside forward: count_items counts labels[..., 1:] for them.
        self._shifted_labels = batches.model_shifts_labels(self.model)
        self.optimizer, self.scheduler = wrap_optimizer(self.model, optimizer, self.config), scheduler
        self._unfreezing = start_unfreezing(self.model, optimizer, self.config.unfreeze_every)  # None without it
        self.train_loader, self.eval_loader = train_loader, eval_loader
        self.precision = make_precision(self.device, resolve_precision(self.config.compute_precision, self.device))
        self._trainable = (self._unfreezing.parameters if self._unfreezing is not None  # what clipping sees
                           else [parameter for parameter in self.model.parameters() if parameter.requires_grad])
        if not self._trainable:
            raise ValueError("the model has no trainable parameters: unfreeze some (see looptrain.freeze)")
        # The tensor tracker is not built for DTensors: sharded runs measure RSS (CPU) or the allocator (CUDA).
        self.meter = make_meter(self.device,
                                track_tensors=self.config.track_memory and not distributed.is_fsdp(self.model),
                                track_every_update=self.config.track_every_update)
        self.progress = Progress()  # the counters and the data position; a resume replaces it with the saved one
        self.interrupted: str | None = None
        self.run = Run(self.config, is_main=self._place.is_main, save_final=save_final)
        self._log = self.run.log  # the events the loop itself reports (unfreezing, auto_batch, skipped windows)
        # None: the model's own loss. Else a causal LM's head and loss in tiles of the vocabulary (--chunked-ce).
        self._lm_loss = lm_loss.ChunkedLMLoss.for_model(self.model, self.config, self._shifted_labels, self._log.echo)
        self._signals = SignalGuard(echo=self._log.echo)
        self._bad_windows = BadWindowGuard(self.config.max_bad_windows)
        self._micro_batch_splits = 1  # auto_batch doubles it after an out-of-memory

    step = property(lambda self: self.progress.step, doc="Optimizer updates applied (`progress.step`).")
    micro_step = property(lambda self: self.progress.micro_step, doc="Forward/backward passes.")
    skipped_steps = property(lambda self: self.progress.skipped_steps, doc="Windows whose update was skipped.")
    epoch = property(lambda self: self.progress.epoch, doc="Epochs completed.")
    batch_in_epoch = property(lambda self: self.progress.batch_in_epoch, doc="Micro-batches of this epoch consumed.")
    last_eval = property(lambda self: self.progress.last_eval, doc="The latest evaluation's scores, or None.")
    scaler = property(lambda self: self.precision.scaler, doc="The GradScaler (enabled for fp16), `precision`'s.")
    output_dir = property(lambda self: self.run.output_dir, doc="Where the run writes (`run.output_dir`), or None.")
    best = property(lambda self: self.run.best, doc="The best checkpoint so far (`run.best`, a `BestTracker`).")

    # ------------------------------------------------------------------ the lifecycle
    def fit(self) -> dict:
        """Trains for `epochs` (or until `max_steps` updates), evaluating and saving on schedule.

        With `output_dir`, the directory is locked for the whole run and its ledger decides first what
        this run may do there (see `looptrain.ledger`): start fresh, resume, or report a finished run.

        Returns:
            The run's summary, the same dict that is written to `output_dir/summary.json`.
        """
        started = time.perf_counter()
        with self.run.lock():
            plan = self.run.begin(self._parts(), self.step)  # this run's place in output_dir, before all else
            if plan["action"] == "finished":
                return self.run.finished_run_summary()
            self._check_evaluation()  # the eval hooks and metric_for_best fail now, not after hours of training
            if plan["checkpoints"]:  # weights, optimizer, scaler, RNG; the saved counters and data position
                self.progress = self.run.restore(plan["checkpoints"], self._parts())
            # The bar, notices about what the run cannot reach; with measure_mfu, the matmul peak (cached).
            self.run.open_progress(self._parts(), self.step, self._unfreezing)
            self.meter.start(self.model, self.optimizer)
            self._log.totals.restart_clock()
            try:
                with self._signals:
                    self._train()
            except BaseException:
                self.run.fail(step=self.step)  # run.json says "failed"; the trackers close
                raise
            finally:  # an exception must not leave the memory tracker installed or the bar open
                self._log.close_progress()
                self.meter.stop()
            if self.interrupted is None:
                if self.eval_loader is not None and self.progress.last_eval_step != self.step:
                    self._evaluate_and_save()  # the final evaluation: logged, and a candidate for the best
                if self.config.load_best_at_end and self.best.best_checkpoint is not None:
                    self.progress = dataclasses.replace(self.progress, last_eval=self.run.load_best(self._parts()))
            summary = self.run.summary(time.perf_counter() - started, self._parts(), self.progress,
                                       interrupted=self.interrupted, micro_batch_splits=self._micro_batch_splits,
                                       unfreezing=self._unfreezing)
            return self.run.finish(summary)  # summary.json, run.json's status, the log closed

    def _train(self) -> None:
        """Epochs of accumulation windows, each ending in one optimizer update; stops early on a signal."""
        config = self.config
        while self.epoch < config.epochs and not self._reached_max_steps():
            # In mid-epoch after a resume: the same order, the rest of it.
            for window in resume.windows(self.run.start_epoch(self.train_loader, self.progress), config.accum_steps):
                if self._unfreezing is not None:  # enters the stage due before this update
                    self._unfreezing.follow(self.progress, self._parts(), config, self._log)
                result = self._run_window_retrying(window)
                self.progress = self.progress.after_batches(len(window))
                loss_sum, num_items = float(result.loss_sum), int(result.num_items)
                batches.check_item_counts(num_items, int(result.loss_items), self._where())
                self._log.totals.add_window(*batches.window_samples_and_tokens(window, self.device), loss_sum,
                                            num_items)
                self._log.advance_progress(int(result.stepped))
                reason = self._bad_windows.check(math.isfinite(loss_sum), result.stepped, self.scaler.is_enabled(),
                                                 self._where(), self.run.last_good_checkpoint())
                if reason is not None:
                    self._log.event({"event": "skipped", "step": self.step, "micro_step": self.micro_step,
                                     "skipped_steps": self.skipped_steps, "reason": reason})
                self.on_step_end(step=self.step, loss_sum=result.loss_sum, num_items=num_items,
                                 grad_norm=result.grad_norm)
                self._log.heartbeat(lambda: self.run.progress_line(self.progress, self.train_loader))
                if result.stepped and self.step % config.log_every == 0:
                    self.run.log_train(result.grad_norm, self._parts(), self.progress)
                if result.stepped and isinstance(config.eval_every, int) and self.step % config.eval_every == 0:
                    self._evaluate_and_save()
                if self._signals.stop_requested(self.device):
                    self.interrupted = self._signals.received or "signal"
                    self.run.save_on_interrupt(self._parts(), self.progress, self.interrupted)
                    return
                if self._reached_max_steps():
                    return
            self.progress = self.progress.next_epoch()
            if config.eval_every == "epoch":
                self._evaluate_and_save()

    # ------------------------------------------------------------------ one optimizer update
    def run_update(self, window: list, *, compute_loss: Callable[[Any], Any] | None = None) -> WindowResult:
        """One optimizer update over one accumulation window of micro-batches.

        `fit` calls it once per window; it is public so that what sits above the Loop can drive exactly
        the update `fit` runs: the estimator (`looptrain.estimation.estimate`, on fake tensors), the
        planner's probes and the benchmarks. Customise training through the hooks (`compute_loss`,
        `count_items`, ...), not by overriding this method: it owns exact accumulation. It makes no
        host sync beyond `Precision.step`'s finiteness check (item counts stay tensors).

        Args:
            window: the window's micro-batches, as the train loader yields them (the last window of an
                epoch may be shorter than `accum_steps`).
            compute_loss: the loss of this update only, in place of the `compute_loss` hook (the estimator's
                priming update: a loss that gives every trainable parameter a gradient without a forward).

        Returns:
            The window's summed loss and item count (tensors), the gradient norm, and whether the
            optimizer stepped (`WindowResult`); `step` and `micro_step` are advanced.
        """
        self.wrapped_model.train()
        micro_batches = [piece for batch in window for cut in self._token_pieces(batch)
                         for piece in split_batch(cut, self._micro_batch_splits)]
        counts = [self.count_items(batch) for batch in micro_batches]  # before any forward, as HF's num_items_in_batch
        # The window's items, summed over every rank.
        (num_items,) = distributed.all_reduce_tensors_sum(batches.total_items(counts, self.device))
        divisor = num_items.clamp(min=1.0) / self._place.world_size  # DDP and FSDP2 average gradients over ranks
        # The CPU tracker sets aside an update whose micro-batches tracked ones cover (`CpuTensorMeter.update`).
        with self.meter.update(micro_batches, counts, steady=self.step > 0):
            loss_sum, loss_items, grad_norm, stepped = self._update(micro_batches, counts, divisor,
                                                                    compute_loss or self.compute_loss)
        self.meter.outlive(loss_sum, loss_items, grad_norm, num_items)
        self.progress = self.progress.after_update(stepped)  # `step` + 1, or `skipped_steps` + 1
        if stepped and self.scheduler is not None:
            self.scheduler.step()  # never advanced for a skipped update
        return WindowResult(loss_sum, num_items, loss_items, grad_norm, stepped)

    def _update(self, micro_batches: list, counts: list, divisor: torch.Tensor, compute_loss: Callable) -> tuple:
        """`run_update`'s work: forward and backward of each micro-batch, then the step; the gradients cleared."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        loss_items = torch.zeros((), dtype=torch.float32, device=self.device)
        for index, (batch, items) in enumerate(zip(micro_batches, counts)):
            if self.config.trim_heap:
                allocator.release_freed()  # the last micro-batch's freed heap pages: not resident through this one
            batch = move_to(batch, self.device)
            # DDP / FSDP2: gradients are reduced across ranks on the window's last micro-batch only.
            with distributed.gradient_sync(self.wrapped_model, self.model, enabled=index == len(micro_batches) - 1):
                self.meter.mark("forward")
                with self.precision.autocast():
                    micro_loss, micro_items = as_loss_sum(compute_loss(batch), items, self.device)
                self.meter.mark("backward")
                # Each item weighs 1 / (the window's items): the exact mean.
                self.precision.backward(micro_loss / divisor)
            loss_sum += micro_loss.detach()
            loss_items += micro_items
            self.progress = self.progress.after_pass()  # `micro_step` + 1
        self.meter.mark("optimizer")
        if self.config.trim_heap:
            allocator.release_freed()  # the backward's freed heap pages: not resident beside the step's temporaries
        loss_sum, loss_items = distributed.all_reduce_tensors_sum(loss_sum, loss_items)
        self.precision.unscale_(self.optimizer)  # fp16: true gradients *before* clipping
        # Every optimizer clips its own gradients (the fused step in its hooks); the norm is the one before clipping.
        grad_norm = clip_gradients(self.optimizer, self._trainable, self.config.max_grad_norm)
        stepped = self.precision.step(self.optimizer, grad_norm)  # skipped when gradients are not finite
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, loss_items, grad_norm, stepped

    def _token_pieces(self, batch) -> list:
        """The batch cut into micro-batches of at most `micro_batch_tokens` padded tokens (0: the batch itself)."""
        tokens = self.config.micro_batch_tokens
        if not tokens:
            return [batch]
        collator = getattr(self.train_loader, "collate_fn", None)  # its rounding and fixed widths are kept
        return split_by_tokens(batch, tokens, multiple=getattr(collator, "pad_to_multiple_of", None),
                               trim=getattr(collator, "padding", "dynamic") != "max_length")

    def _run_window_retrying(self, window: list) -> WindowResult:
        """`run_update`, retried with each micro-batch split in two after an out-of-memory (`auto_batch`)."""
        while True:
            try:
                return self.run_update(window)
            except OUT_OF_MEMORY_ERRORS as error:
                self.optimizer.zero_grad(set_to_none=True)  # the failed window's partial gradients
                for parameter in self._trainable:
                    parameter.grad = None
                rows = min(first_dimension(batch) for batch in window)
                self._micro_batch_splits = split_after_out_of_memory(
                    error, rows, self._micro_batch_splits, self.config.auto_batch, self._where(step_only=True),
                    lambda: memory_held(self.model, self.optimizer, self.device))
                self._log.event(auto_batch_event(self.step, rows, self._micro_batch_splits))

    # ------------------------------------------------------------------ hooks
    def compute_loss(self, batch) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """Returns the micro-batch's mean loss, or `(loss_sum, num_items)` for exact token-level losses.

        The default calls `wrapped_model(**batch)` and reads `.loss`; with `chunked_ce` a causal LM's loss
        sum is computed by chunks (docs/causal_lm.md). A mean is weighted by the batch's item count (`count_items`):
        its labels that are not -100 (after the shift, for a causal LM), or its number of rows when it has no labels.
        """
        if not isinstance(batch, Mapping):
            raise TypeError(f"the default compute_loss calls model(**batch) and needs dict batches, got a "
                            f"{type(batch).__name__}; override Loop.compute_loss(batch) to run the model on this "
                            "batch and return its loss")
        if self._lm_loss is not None:
            return self._lm_loss(self.wrapped_model, batch)
        outputs = self.wrapped_model(**batch)
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            raise ValueError("the model returned no loss: pass `labels` in the batch or override Loop.compute_loss")
        return loss

    def count_items(self, batch) -> torch.Tensor | int:
        """The items a batch's loss is a mean (or sum) over: labels that are not -100, else rows.

        For a Hugging Face causal LM (decided once, when the Loop is built: see
        `looptrain.batches.model_shifts_labels`) the model shifts a dict batch's `labels` before its
        mean loss, so the items are `labels[..., 1:]` that are not -100 (or the batch's
        `shift_labels`): each row's first label is never scored. Prompt tokens and padding labelled
        -100 are not counted, so accumulation equals the full-batch loss (docs/causal_lm.md). Every
        other model counts all its labels that are not -100 (one per row for sequence classification).

        Counted before the forward passes, over the whole window, to normalise the gradients. Override
        it when `compute_loss` sums over something else (tokens of a key other than `labels`, say):
        the loop checks that each window's count equals what `compute_loss` reported.
        """
        return batches.count_items(batch, shifted=self._shifted_labels)

    def eval_step(self, batch) -> dict:
        """Evaluates one batch; returns `loss_sum` and `num_items`, and `logits` and `labels` when there are some.

        The default runs `compute_loss` (so a subclass that overrides only `compute_loss` is
        evaluated on its own loss) and keeps the logits the model produced on the way when a dict
        batch has integer `labels` they can be scored against (classification, token classification).
        """
        with metrics.captured_output(self.model) as captured:
            loss_sum, num_items = as_loss_sum(self.compute_loss(batch), self.count_items(batch), self.device)
        output = {"loss_sum": loss_sum, "num_items": num_items, "rows": first_dimension(batch)}
        logits = metrics.logits_of(captured.get("output"))
        labels = batch.get("labels") if isinstance(batch, Mapping) else None  # (x, y) batches: a language model's
        if metrics.scoreable_logits(logits, labels, vocab_size=metrics.vocab_size_of(self.model)):
            output["logits"], output["labels"] = logits, labels
        return output

    def make_metrics(self):
        """A fresh streaming metrics object for one evaluation (`update(output)` per batch, `compute()`).

        The default scores the loss always, accuracy and F1 when `eval_step` returns class logits,
        and perplexity for token-level losses otherwise (see `looptrain.metrics.EvalMetrics`).
        """
        return metrics.EvalMetrics.for_model(self.model)  # num_labels and label names from the model's config

    def compute_metrics(self, evaluation) -> dict:
        """The evaluation's scores from its metrics object; override to add or rename scores."""
        return evaluation.compute()

    def on_step_end(self, *, step: int, loss_sum: torch.Tensor, num_items: int, grad_norm: torch.Tensor) -> None:
        """Called after every accumulation window (also when its update was skipped). Does nothing."""

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()  # not inference_mode: DDP's first forward may be this one, and its lazy state must stay trainable
    def evaluate(self, loader=None) -> dict:
        """Evaluates on `loader` (default: the eval loader) through the metrics hooks; returns the scores."""
        loader = loader if loader is not None else self.eval_loader
        if loader is None:
            raise ValueError("evaluate() needs an eval_loader: pass one to Loop(...) or to evaluate(loader)")
        was_training = self.wrapped_model.training
        self.wrapped_model.eval()
        self.meter.mark("eval")
        evaluation, total = self.make_metrics(), length_of(loader)
        of_total = "" if total is None else f"/{total}"
        for index, batch in enumerate(loader, 1):
            batch = move_to(batch, self.device)
            with self.precision.autocast():
                evaluation.update(self.eval_step(batch))
            self._log.heartbeat(lambda index=index: f"evaluating at step {self.step}: batch {index}{of_total}")
        self.wrapped_model.train(was_training)
        evaluation, *others = distributed.all_gather_objects(evaluation)  # under DDP each rank scored its own shard
        for other in others:
            evaluation.merge(other)  # every sample counted once, the same result on every rank
        return self.compute_metrics(evaluation)

    def _check_evaluation(self) -> None:
        """Runs the eval hooks on the first eval batch before training; resolves and checks `metric_for_best`."""
        if self.eval_loader is None:
            if self.config.load_best_at_end:
                raise ConfigError("load_best_at_end=True needs an eval_loader to pick the best checkpoint")
            return
        first = next(iter(self.eval_loader), None)
        if first is None:
            raise EvaluationError("the eval loader yielded no batches: check the evaluation data")
        try:
            scores = self.evaluate([first])
        except OUT_OF_MEMORY_ERRORS:
            raise
        except Exception as error:
            raise EvaluationError(
                f"evaluation fails on the first eval batch ({type(error).__name__}: {error}); this was checked before "
                "training. Override Loop.eval_step (and Loop.compute_loss) for batches of this kind, or "
                "Loop.make_metrics / Loop.compute_metrics for other scores"
            ) from error
        self.run.track_best(scores)  # metric_for_best resolved, and checked against these scores

    def _evaluate_and_save(self) -> None:
        """The evaluation point: evaluate (when there is eval data), log, and write a checkpoint."""
        if self.eval_loader is not None:
            self.progress = self.progress.evaluated(self.evaluate())
            self._log.event({"event": "eval", "step": self.step,
                             "epoch": self.progress.in_epochs(length_of(self.train_loader)), **self.last_eval})
        if self.output_dir is not None and (self.eval_loader is not None or self.run.last_checkpoint_step != self.step):
            self.run.save_checkpoint(self._parts(), self.progress,
                                     self.last_eval if self.eval_loader is not None else None)
        self._log.totals.restart_clock()  # evaluation and saving are not training time

    # ------------------------------------------------------------------ small helpers
    def _parts(self) -> TrainingParts:
        """What the Run reads to save, restore, log and summarise (it holds none of it between calls)."""
        return TrainingParts(self.model, self.optimizer, self.scheduler, self.precision, self.device, self.meter,
                             self.train_loader)

    def _reached_max_steps(self) -> bool:
        return 0 < self.config.max_steps <= self.step

    def _where(self, step_only: bool = False) -> str:
        return f"step {self.step}" if step_only else f"step {self.step} (micro-step {self.micro_step})"

