"""The Loop's arithmetic: exact accumulation, autocast, GradScaler skips, clipping after unscale."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from looptrain import Loop, LoopConfig

from conftest import DtypeProbe, OneWeight, live_loops_and_optimizers, make_tiny_bert, random_token_batches

SUMMARY_KEYS = {
    "train_runtime_s", "train_samples", "train_tokens", "train_samples_per_s", "train_tokens_per_s", "optimizer_steps",
    "skipped_steps",
    "peak_memory_bytes", "memory_meter", "peak_rss_bytes", "memory_breakdown", "final_eval", "best_metric",
    "best_checkpoint", "config",
}


def quiet(**fields) -> LoopConfig:
    fields.setdefault("progress_bar", False)
    fields.setdefault("log_every", 1000)
    fields.setdefault("eval_every", "no")
    fields.setdefault("device", "cpu")
    fields.setdefault("track_memory", False)  # the tensor tracker has its own tests; it slows every op
    return LoopConfig(**fields)


def split_batch(batch: dict, sizes: list[int]) -> list[dict]:
    """Cuts one padded batch into micro-batches of the given sizes, each re-trimmed to its own longest row."""
    pieces, start = [], 0
    for size in sizes:
        piece = {key: value[start:start + size] for key, value in batch.items()}
        width = int(piece["attention_mask"].sum(dim=1).max())
        piece["input_ids"] = piece["input_ids"][:, :width]
        piece["attention_mask"] = piece["attention_mask"][:, :width]
        pieces.append(piece)
        start += size
    return pieces


def train_bert(batches: list[dict], accum_steps: int, epochs: int = 1, **config) -> nn.Module:
    model = make_tiny_bert(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    Loop(model, optimizer, batches,
         config=quiet(accum_steps=accum_steps, epochs=epochs, max_grad_norm=None, **config)).fit()
    return model


def assert_same_weights(first: nn.Module, second: nn.Module, **tolerance) -> None:
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}", **tolerance)


@pytest.fixture(scope="module")
def eight_uneven():
    # Eight sequences of very different lengths, so every micro-batch has a different padded width.
    (batch,) = random_token_batches([[3, 17, 5, 9, 12, 4, 20, 7]], vocab_size=30, seed=1)
    return batch


def test_accumulation_bs8x1_equals_1x8_and_uneven_splits(eight_uneven):
    reference = train_bert([eight_uneven], accum_steps=1, epochs=2)
    one_by_eight = train_bert(split_batch(eight_uneven, [1] * 8), accum_steps=8, epochs=2)
    three_three_two = train_bert(split_batch(eight_uneven, [3, 3, 2]), accum_steps=3, epochs=2)
    five_three = train_bert(split_batch(eight_uneven, [5, 3]), accum_steps=2, epochs=2)
    untrained = make_tiny_bert(seed=0)
    # The test must be able to fail: training moved the weights well beyond the tolerance.
    moved = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), untrained.parameters()))
    assert moved > 1e-3
    for model in (one_by_eight, three_three_two, five_three):
        assert_same_weights(reference, model, rtol=1e-5, atol=1e-6)


def test_partial_last_window_is_stepped_and_normalised_by_what_it_holds(eight_uneven):
    # 8 micro-batches of 1 with accum 3: windows of 3, 3 and 2 samples -> three updates whose batches
    # are exactly the 3-, 3- and 2-sample batches of a run without accumulation.
    accumulated = train_bert(split_batch(eight_uneven, [1] * 8), accum_steps=3)
    reference = train_bert(split_batch(eight_uneven, [3, 3, 2]), accum_steps=1)
    assert_same_weights(reference, accumulated, rtol=1e-5, atol=1e-6)
    # Dividing the last window by accum_steps (3) instead of its 2 items gives a different model.
    wrong = make_tiny_bert(seed=0)
    optimizer = torch.optim.SGD(wrong.parameters(), lr=0.5)
    for window in [[0, 1, 2], [3, 4, 5], [6, 7]]:
        for position in window:
            piece = split_batch(eight_uneven, [1] * 8)[position]
            (wrong(**piece).loss / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
    difference = max((a - b).abs().max().item() for a, b in zip(wrong.parameters(), accumulated.parameters()))
    assert difference > 1e-4


def test_step_and_micro_step_counters(eight_uneven):
    model = make_tiny_bert(seed=0)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), split_batch(eight_uneven, [1] * 8),
                config=quiet(accum_steps=3, epochs=2))
    summary = loop.fit()
    assert (loop.step, loop.micro_step) == (6, 16)  # 3 windows (3+3+2) per epoch
    assert summary["optimizer_steps"] == 6 and summary["skipped_steps"] == 0
    assert SUMMARY_KEYS <= set(summary)


class TokenModel(nn.Module):
    """Per-token classifier: embedding + linear, no mixing across positions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


class TokenLoop(Loop):
    def compute_loss(self, batch):
        targets = batch["labels"] if "labels" in batch else batch["targets"]
        logits = self.model(batch["input_ids"])
        loss_sum = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                               reduction="sum")
        return loss_sum, (targets != -100).sum()


def token_batch(lengths: list[int], seed: int = 0, label_key: str = "labels") -> dict:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.randint(1, 20, (len(lengths), width), generator=generator)
    labels = torch.randint(0, 3, (len(lengths), width), generator=generator)
    for row, length in enumerate(lengths):
        labels[row, length:] = -100
    return {"input_ids": input_ids, label_key: labels}


class TargetsLoop(TokenLoop):
    """Token targets under another key than `labels`: count_items says which items the loss sums over."""

    def count_items(self, batch):
        return (batch["targets"] != -100).sum()


# "labels": the default count_items counts the same tokens before the forward that compute_loss reports.
# "targets": the subclass's count_items counts them.
@pytest.mark.parametrize("label_key, loop_class", [("labels", TokenLoop), ("targets", TargetsLoop)])
def test_token_level_accumulation_uses_the_window_token_count(label_key, loop_class):
    full = token_batch([2, 9, 4, 7], label_key=label_key)
    rows = [{key: value[i:i + 1] for key, value in full.items()} for i in range(4)]

    def train(batches, accum_steps):
        model = TokenModel()
        loop_class(model, torch.optim.SGD(model.parameters(), lr=1.0), batches,
                   config=quiet(accum_steps=accum_steps, max_grad_norm=None)).fit()
        return model

    reference, accumulated = train([full], 1), train(rows, 4)
    assert_same_weights(reference, accumulated, rtol=1e-5, atol=1e-6)
    # The naive recipe (mean per micro-batch / accum_steps) weights short rows' tokens more: it differs.
    naive = TokenModel()
    optimizer = torch.optim.SGD(naive.parameters(), lr=1.0)
    for row in rows:
        logits = naive(row["input_ids"])
        (nn.functional.cross_entropy(logits.flatten(0, 1), row[label_key].flatten(), ignore_index=-100) / 4).backward()
    optimizer.step()
    assert (naive.head.weight - accumulated.head.weight).abs().max() > 1e-3


def test_a_loss_over_other_items_than_counted_is_refused_naming_count_items():
    # Targets under "targets": the default count_items sees no labels and counts rows (1), while the
    # loss sums over 9 tokens. The mean would be off by 9x: the loop stops and names the hook.
    model = TokenModel()
    batch = token_batch([9], label_key="targets")
    with pytest.raises(ValueError, match=r"reported its loss over 9 items but count_items counted 1.*"
                                         r"override Loop.count_items"):
        TokenLoop(model, torch.optim.SGD(model.parameters(), lr=1.0), [batch], config=quiet()).fit()


class OneWeightLoop(Loop):
    def compute_loss(self, batch):
        x, y = batch
        return ((self.model(x) - y) ** 2).mean()


def test_one_weight_oracle_with_partial_window():
    # loss = mean((w x - y)^2), SGD: w <- w - lr * (2 / N) * sum(x (w x - y)) over the window's N items.
    xs = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0])
    ys = torch.tensor([2.0, 3.0, 1.0, -1.0, 4.0])
    batches = [(xs[i:i + 1], ys[i:i + 1]) for i in range(5)]
    model = OneWeight(w=0.5)
    lr = 0.05
    OneWeightLoop(model, torch.optim.SGD(model.parameters(), lr=lr), batches,
                  config=quiet(accum_steps=2, max_grad_norm=None)).fit()
    w = 0.5
    for window in ([0, 1], [2, 3], [4]):  # the last window holds one item
        gradient = sum(2 * xs[i].item() * (w * xs[i].item() - ys[i].item()) for i in window) / len(window)
        w -= lr * gradient
    assert model.w.item() == pytest.approx(w, rel=1e-6)


@pytest.mark.parametrize("precision, dtype",
                         [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_dtype_inside_forward(precision, dtype):
    model = DtypeProbe()
    batches = [{"x": torch.randn(3, 4), "labels": torch.tensor([0, 1, 0])} for _ in range(2)]
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, eval_loader=batches,
         config=quiet(precision=precision, eval_every="epoch")).fit()
    assert model.seen and set(model.seen) == {dtype}  # training and evaluation forwards alike
    assert model.linear.weight.dtype == torch.float32  # master weights stay fp32


class Overflowing(nn.Module):
    """In fp16 the weight's gradient is scale * 100 per element: it overflows (> 65504) until scale <= 512."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1, bias=False)
        nn.init.constant_(self.linear.weight, 0.0)

    def forward(self, x):
        return self.linear(x)


class SumLoop(Loop):
    def compute_loss(self, batch):
        return self.model(batch).float().sum(), 1


def test_fp16_overflow_is_skipped_counted_and_scheduler_not_advanced(tmp_path):
    model = Overflowing()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    batches = [torch.full((1, 1), 100.0) for _ in range(10)]
    loop = SumLoop(model, optimizer, batches, scheduler=scheduler,
                   config=quiet(precision="fp16", max_grad_norm=None, output_dir=str(tmp_path), eval_every=3))
    summary = loop.fit()
    # Scales 2^16 .. 2^10 overflow (7 skips); 2^9 = 512 gives 51200 < 65504 and steps.
    expected_skips = sum(1 for exponent in range(16, 0, -1) if 2.0 ** exponent * 100 > 65504)
    assert summary["skipped_steps"] == expected_skips == 7
    assert summary["optimizer_steps"] == 10 - 7
    assert scheduler.last_epoch == 3  # stepped only with the optimizer
    assert loop.scaler.get_scale() == 512.0
    # The weight moved by exactly three SGD steps of gradient 100 (true scale, after unscaling).
    assert model.linear.weight.item() == pytest.approx(-3 * 1e-3 * 100, rel=1e-3)
    saved = torch.load(tmp_path / "checkpoint-3" / "scaler.pt", weights_only=True)
    assert saved["scale"] == 512.0


def test_clip_after_unscale_logs_the_fp32_norm_and_clips_the_same():
    torch.manual_seed(0)
    batches = [{"x": torch.randn(8, 4), "labels": torch.randint(0, 2, (8,))} for _ in range(3)]
    norms, models = {}, {}
    for precision in ("fp32", "fp16"):
        torch.manual_seed(1)
        model = DtypeProbe()
        recorded = []

        class Recording(Loop):
            def on_step_end(self, *, grad_norm, recorded=recorded, **_):
                recorded.append(float(grad_norm))

        Recording(model, torch.optim.SGD(model.parameters(), lr=0.5), batches,
                  config=quiet(precision=precision, max_grad_norm=0.01)).fit()
        norms[precision], models[precision] = recorded, model
    # Had clipping seen the scaled fp16 gradients, the norm would be ~65536x larger.
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=2e-2)
    assert min(norms["fp32"]) > 0.01  # clipping was active on every step
    assert_same_weights(models["fp32"], models["fp16"], rtol=2e-2, atol=1e-3)


def test_nonfinite_fp32_window_is_skipped_not_applied():
    model = OneWeight(w=1.0)
    batches = [(torch.tensor([1.0]), torch.tensor([2.0])), (torch.tensor([math.inf]), torch.tensor([0.0])),
               (torch.tensor([1.0]), torch.tensor([2.0]))]
    summary = OneWeightLoop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                            config=quiet(max_grad_norm=None)).fit()
    assert summary["skipped_steps"] == 1 and summary["optimizer_steps"] == 2
    assert math.isfinite(model.w.item())


def test_max_steps_stops_early_and_fit_evaluates(eight_uneven):
    model = make_tiny_bert(seed=0)
    batches = split_batch(eight_uneven, [1] * 8)
    summary = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, eval_loader=[eight_uneven],
                   config=quiet(max_steps=3, epochs=5)).fit()
    assert summary["optimizer_steps"] == 3
    assert set(summary["final_eval"]) >= {"loss", "accuracy", "f1"}
    with torch.no_grad():
        model.eval()
        predictions = model(**eight_uneven).logits.argmax(-1)
    assert summary["final_eval"]["accuracy"] == (predictions == eight_uneven["labels"]).float().mean().item()


def test_a_max_steps_the_epochs_cannot_reach_is_said_at_the_start(eight_uneven, capsys):
    model = make_tiny_bert(seed=0)
    batches = split_batch(eight_uneven, [1] * 8)  # 8 micro-batches, accumulation 2: 4 updates an epoch
    summary = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                   config=quiet(max_steps=100, epochs=2, accum_steps=2)).fit()
    assert summary["optimizer_steps"] == 8
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("notice: max_steps")]
    assert notices == ["notice: max_steps=100 (--max-steps) but 2 epoch(s) of this data make 8 updates: the run "
                       "stops at 8; raise epochs (--epochs) to reach 100"]
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, config=quiet(max_steps=3, epochs=2)).fit()
    assert "notice: max_steps" not in capsys.readouterr().out  # reachable: nothing to say


@pytest.mark.parametrize("fields", [{}, {"track_memory": True, "eval_every": 1}, {"optimizer_in_backward": True}],
                         ids=["plain", "tracked, evaluated, saved", "fused step"])
def test_a_dropped_loop_frees_its_optimizer_state_without_the_collector(fields, tmp_path):
    """A researcher's second Loop in one process (a sweep, a ladder, the planner's probes) starts without the first
    one's optimizer state: dropping a Loop frees it by reference counting. Its `Run` held the Loop back, a cycle that
    kept the Loop, the optimizer and its state (AdamW: 2 x the weights) until the collector's next full pass, which
    a long run of young objects rarely reaches."""
    import gc

    model = make_tiny_bert(num_labels=3)
    batches = random_token_batches([[6, 4], [5, 5], [3, 7]], model.config.vocab_size)
    gc.collect()
    before = live_loops_and_optimizers()
    gc.disable()
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loop = Loop(model, optimizer, batches, eval_loader=batches[:1],
                    config=quiet(output_dir=str(tmp_path), **fields))
        loop.fit()
        assert len(optimizer.state) > 0 or fields.get("optimizer_in_backward")
        del loop, optimizer
        assert live_loops_and_optimizers() == before
    finally:
        gc.enable()
