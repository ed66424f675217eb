"""Causal LMs with the Loop's default hooks: accumulation is exact, checked against a hand-written full-batch loop.

Hugging Face causal LMs shift their labels inside the model: the loss at position t predicts token t+1, so their
mean is taken over `labels[..., 1:]` that are not -100. The Loop's default `count_items` counts those items for
such models (decided once, when the Loop is built), and today's counts for every other model.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from looptrain import Loop
from looptrain.batches import count_items, model_shifts_labels

from conftest import make_tiny_bert, quiet_config, run_two_ranks

VOCAB = 100
PAD = 0
FAMILIES = ("qwen2", "llama", "gpt2")


def make_causal_lm(family: str, seed: int = 0) -> nn.Module:
    """A tiny random decoder LM (hidden 32, 2 layers, vocab 100, dropout off) through AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    shared = {"vocab_size": VOCAB, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
    if family == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **shared)
    else:
        config_class = {"qwen2": Qwen2Config, "llama": LlamaConfig}[family]
        config = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, **shared)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def lm_samples(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` (input_ids, labels) rows of 3 to 23 tokens; every other row masks a prompt (labels -100 on it).

    Plain rows have a valid first label, the one a causal LM's shifted loss never scores; prompt rows keep at
    least two response tokens, so every row has items under either count.
    """
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        length = int(torch.randint(3, 24, (1,), generator=generator))
        input_ids = torch.randint(3, VOCAB, (length,), generator=generator)
        labels = input_ids.clone()
        if index % 2 == 0:
            labels[:int(torch.randint(1, length - 1, (1,), generator=generator))] = -100
        samples.append((input_ids, labels))
    return samples


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Right padding to the longest row: pad ids, attention mask 0 and labels -100 on the pads."""
    width = max(len(input_ids) for input_ids, _ in samples)
    batch = {"input_ids": torch.full((len(samples), width), PAD), "attention_mask": torch.zeros(len(samples), width,
                                                                                                 dtype=torch.long),
             "labels": torch.full((len(samples), width), -100)}
    for row, (input_ids, labels) in enumerate(samples):
        batch["input_ids"][row, :len(input_ids)] = input_ids
        batch["attention_mask"][row, :len(input_ids)] = 1
        batch["labels"][row, :len(labels)] = labels
    return batch


def batched(samples: list, rows: int) -> list[dict]:
    return [collate(samples[start:start + rows]) for start in range(0, len(samples), rows)]


def reference_run(family: str, samples: list, rows_per_update: int, epochs: int, lr: float) -> nn.Module:
    """The hand-written full-batch loop: one SGD step per `rows_per_update` rows on the model's own mean loss."""
    model = make_causal_lm(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for batch in batched(samples, rows_per_update):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return model


def loop_run(family: str, samples: list, epochs: int, lr: float) -> tuple[nn.Module, Loop]:
    """The Loop with its default hooks: micro-batches of 4 rows (each padded to its own longest) x accumulation 4."""
    model = make_causal_lm(family)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=lr), batched(samples, 4),
                config=quiet_config(accum_steps=4, epochs=epochs, max_grad_norm=None))
    loop.fit()
    return model, loop


def max_difference(first: nn.Module, second: nn.Module) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first.state_dict().values(), second.state_dict().values()))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("count, updates_per_epoch", [(64, 4), (60, 4)], ids=["full-windows", "partial-last-window"])
def test_accumulation_equals_the_full_batch_loop(family, count, updates_per_epoch):
    # 64 rows: 4 windows of 4 micro-batches of 4. 60 rows: the last window holds 3 micro-batches (12 rows), and
    # the reference's last update takes those 12 rows as one batch.
    samples = lm_samples(count, seed=1)
    reference = reference_run(family, samples, rows_per_update=16, epochs=2, lr=1.0)
    accumulated, loop = loop_run(family, samples, epochs=2, lr=1.0)
    assert loop.step == 2 * updates_per_epoch
    # The check can fail: training moved the weights four orders of magnitude beyond the tolerance.
    moved = max_difference(reference, make_causal_lm(family))
    assert moved > 1e-2
    assert max_difference(reference, accumulated) < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_token_micro_batches_of_a_causal_lm_equal_the_full_batch_loop(family):
    # Batches of 16 rows (3-23 tokens) cut into micro-batches of at most 48 padded tokens, each trimmed to its own
    # longest row, its labels with it: the shifted token counts of every piece add up to the batch's mean.
    samples = lm_samples(32, seed=2)
    reference = reference_run(family, samples, rows_per_update=16, epochs=1, lr=1.0)
    model = make_causal_lm(family)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=1.0), batched(samples, 16),
                config=quiet_config(micro_batch_tokens=48, max_grad_norm=None))
    loop.fit()
    assert loop.step == 2 and loop.micro_step > 2 * 5  # at most 2 rows of 23 tokens in 48: many pieces per batch
    assert max_difference(reference, make_causal_lm(family)) > 1e-2
    assert max_difference(reference, model) < 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_a_causal_lm_counts_its_shifted_labels(family):
    model = make_causal_lm(family)
    batch = collate(lm_samples(8, seed=2))
    assert model_shifts_labels(model)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config())
    assert int(loop.count_items(batch)) == int((batch["labels"][:, 1:] != -100).sum())
    # A batch that brings transformers' `shift_labels` is counted on them, as the model's loss takes them.
    shift_labels = torch.full_like(batch["labels"], -100)
    shift_labels[:, :2] = 7
    assert int(loop.count_items({**batch, "shift_labels": shift_labels})) == 2 * 8
    # (x, y) batches are the user's own, already aligned: never shifted.
    assert int(count_items((batch["input_ids"], batch["labels"]), shifted=True)) == int((batch["labels"] != -100).sum())


def make_model(kind: str) -> nn.Module:
    """One model of each kind of loss: shifting causal LMs, and models whose labels align with their logits."""
    import transformers

    torch.manual_seed(0)
    if kind in FAMILIES:
        return make_causal_lm(kind)
    if kind == "bert-sequence":
        return make_tiny_bert(num_labels=3, vocab_size=VOCAB)
    bert = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "intermediate_size": 37, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}
    if kind == "bert-token":
        return transformers.BertForTokenClassification(transformers.BertConfig(num_labels=VOCAB, **bert))
    if kind == "bert-masked-lm":
        return transformers.BertForMaskedLM(transformers.BertConfig(**bert))
    if kind == "bert-lm-head":  # BERT as a decoder: in the causal-LM mapping, and its loss shifts
        return transformers.BertLMHeadModel(transformers.BertConfig(is_decoder=True, **bert))
    if kind == "bart-causal-lm":  # in the causal-LM mapping, but its loss takes the labels as they are
        return transformers.BartForCausalLM(transformers.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD))
    if kind == "t5":  # encoder-decoder: labels are the decoder's targets, unshifted
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, dropout_rate=0.0,
            pad_token_id=PAD, decoder_start_token_id=PAD))
    raise ValueError(kind)


SHIFTS = {"qwen2": True, "llama": True, "gpt2": True, "bert-lm-head": True, "bert-sequence": False,
          "bert-token": False, "bert-masked-lm": False, "bart-causal-lm": False, "t5": False}


@pytest.mark.parametrize("kind", sorted(SHIFTS))
def test_the_count_is_what_the_models_own_mean_is_taken_over(kind):
    # Model-agnostic oracle: the batch's mean loss is the count-weighted mean of its rows' mean losses exactly
    # when the per-row counts are the items the model's loss averages over.
    model = make_model(kind).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # sharp predictions: the rows' losses lie far apart, so a wrong weight shows
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    batch = collate(lm_samples(6, seed=3))
    if kind == "bert-sequence":
        batch["labels"] = torch.tensor([0, 1, 2, 0, 1, 2])
    assert model_shifts_labels(model) is SHIFTS[kind]
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config())
    with torch.no_grad():
        batch_loss = model(**batch).loss
        rows = [{key: value[row:row + 1] for key, value in batch.items()} for row in range(6)]
        counts = torch.stack([torch.as_tensor(loop.count_items(row), dtype=torch.float32) for row in rows])
        row_losses = torch.stack([model(**row).loss for row in rows])
    assert int(loop.count_items(batch)) == int(counts.sum())
    torch.testing.assert_close((row_losses * counts).sum() / counts.sum(), batch_loss, rtol=1e-5, atol=1e-6)
    if kind == "bert-sequence":  # one item per row, as before
        assert int(loop.count_items(batch)) == 6


def test_subclasses_and_wrappers_are_judged_by_the_model_they_hold():
    from torch.distributed.fsdp import FSDPModule

    class Tuned(type(make_causal_lm("qwen2"))):  # a research subclass that wraps the forward
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    class PeftLike(nn.Module):  # peft's PeftModel: the model under `get_base_model()`
        def __init__(self, model):
            super().__init__()
            self.base_model = model

        def get_base_model(self):
            return self.base_model

    tuned, sharded = make_causal_lm("qwen2"), make_causal_lm("gpt2")
    tuned.__class__ = Tuned
    sharded.__class__ = type(f"FSDP{type(sharded).__name__}", (FSDPModule, type(sharded)), {})  # fully_shard's swap
    for model in (tuned, sharded, PeftLike(make_causal_lm("llama")), nn.DataParallel(make_causal_lm("qwen2"))):
        assert model_shifts_labels(model), type(model).__name__
    assert not model_shifts_labels(PeftLike(make_model("bert-token")))
    assert not model_shifts_labels(nn.Linear(2, 2))


def test_sequence_and_token_classification_counts_are_unchanged():
    sequence = collate(lm_samples(5, seed=4))
    sequence["labels"] = torch.tensor([0, 1, 2, 0, 1])
    token = collate(lm_samples(5, seed=4))
    for kind, batch, expected in [("bert-sequence", sequence, 5),
                                  ("bert-token", token, int((token["labels"] != -100).sum()))]:
        model = make_model(kind)
        assert not model_shifts_labels(model)
        loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config())
        assert int(loop.count_items(batch)) == expected


def test_eval_loss_is_the_token_mean_and_perplexity_picks_the_best(tmp_path):
    samples = lm_samples(32, seed=5)
    eval_batches = batched(lm_samples(12, seed=6), 4)
    model = make_causal_lm("qwen2")
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=1.0), batched(samples, 4), eval_loader=eval_batches,
                config=quiet_config(accum_steps=2, metric_for_best="perplexity", eval_every=2,
                                    output_dir=str(tmp_path), max_grad_norm=None))
    summary = loop.fit()
    # By hand: next-token cross-entropy summed over every scored token of the eval set, over their number.
    model.eval()
    loss_sum = tokens = 0.0
    with torch.no_grad():
        for batch in eval_batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            targets = batch["labels"][:, 1:]
            loss_sum += nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                                    ignore_index=-100, reduction="sum").item()
            tokens += int((targets != -100).sum())
    scores = loop.evaluate()
    assert scores["count"] == tokens
    assert scores["loss"] == pytest.approx(loss_sum / tokens, rel=1e-5)
    assert scores["perplexity"] == pytest.approx(math.exp(scores["loss"]), rel=1e-6)
    assert summary["metric_for_best"] == "perplexity"
    assert summary["best_metric"] == pytest.approx(min(event["perplexity"] for event in eval_events(tmp_path)))


def eval_events(output_dir) -> list[dict]:
    import json

    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [event for event in map(json.loads, lines) if event["event"] == "eval"]


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.slow  # over 6 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_ddp_counts_every_ranks_shifted_labels(tmp_path):
    # 2 ranks x 2 micro-batches of 4 per window; the last window (12 rows) leaves rank 1 one micro-batch. The
    # window's item count is summed over both ranks before any forward: the full-batch reference's update.
    saved = run_two_ranks("causal_lm_ddp.py", ["qwen2", "60"], tmp_path / "ddp.pt")
    assert saved["step"] == 8
    reference = reference_run("qwen2", lm_samples(60, seed=1), rows_per_update=16, epochs=2, lr=1.0)
    difference = max((value - saved["state_dict"][name]).abs().max().item()
                     for name, value in reference.state_dict().items())
    assert difference < 1e-6
