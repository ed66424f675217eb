"""Chunked cross-entropy (looptrain.lm_loss): the same loss and gradients as the model's own, without the full logits.

Tiny random decoder LMs built from their configs (Qwen2 with tied and untied embeddings, Llama, GPT-2 with its
tied head); batches with masked prompts and right padding; chunks of 5 tokens, so every batch runs several
chunks and an uneven last one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from looptrain import Loop, lm_loss
from looptrain.batches import count_items, model_shifts_labels
from looptrain.strategy import ConfigError

from conftest import quiet_config

VOCAB, PAD = 96, 0
FAMILIES = ("qwen2-tied", "qwen2-untied", "llama", "gpt2")


def make_lm(family: str, seed: int = 0, vocab: int = VOCAB, hidden: int = 32) -> nn.Module:
    """A tiny random decoder LM (2 layers, dropout off) through AutoModelForCausalLM."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    shared = {"vocab_size": vocab, "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2}
    if family == "gpt2":
        config = GPT2Config(n_embd=hidden, n_layer=2, n_head=4, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **shared)
    else:
        config_class = LlamaConfig if family == "llama" else Qwen2Config
        config = config_class(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                              tie_word_embeddings=family == "qwen2-tied", **shared)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def make_batch(rows: int = 4, seed: int = 0) -> dict:
    """Rows of 4 to 15 tokens, right-padded; every other row's prompt is labelled -100."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(4, 16, (1,), generator=generator)) for _ in range(rows)]
    width = max(lengths)
    batch = {"input_ids": torch.full((rows, width), PAD), "attention_mask": torch.zeros(rows, width, dtype=torch.long),
             "labels": torch.full((rows, width), -100)}
    for row, length in enumerate(lengths):
        ids = torch.randint(3, VOCAB, (length,), generator=generator)
        batch["input_ids"][row, :length], batch["attention_mask"][row, :length] = ids, 1
        batch["labels"][row, :length] = ids
        if row % 2 == 0:
            batch["labels"][row, :length // 2] = -100
    return batch


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def chunked_loss(model: nn.Module, fused: bool = True, **fields) -> lm_loss.ChunkedLMLoss:
    loss = lm_loss.ChunkedLMLoss.for_model(model, quiet_config(**fields), model_shifts_labels(model), print)
    loss.fuse_tied_gradient = fused
    return loss


@pytest.fixture
def lookups(monkeypatch) -> list:
    """One entry per fused lookup of a tied embedding (`lm_loss._TiedLookup`) that ran."""
    calls, forward = [], lm_loss._TiedLookup.forward

    def counted(ctx, *args):
        calls.append(args[2])  # padding_idx
        return forward(ctx, *args)

    monkeypatch.setattr(lm_loss._TiedLookup, "forward", staticmethod(counted))
    return calls


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_every_gradient_equal_the_models_own(family, precision, lookups):
    model, batch = make_lm(family), make_batch()
    tied = family in ("qwen2-tied", "gpt2")
    if tied:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    else:
        assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    items = count_items(batch, shifted=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        reference = model(**batch).loss.float() * items  # the model's own mean, times the items it is over
    reference.backward()
    expected = gradients(model)
    loss = chunked_loss(model, ce_chunk_tokens=5)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss_sum, num_items = loss(model, batch)
    loss_sum.backward()
    got = gradients(model)
    # A tied embedding's lookup ran fused (Qwen2's with its padding row, GPT-2's without one).
    assert lookups == ([PAD if family == "qwen2-tied" else None] if tied else [])
    assert int(num_items) == int(items) > 10 * 5 // 5  # several chunks of 5, an uneven last one
    # fp32: noise of summation order. bf16: the logits are rounded to bf16 per chunk, as the model rounds them
    # per batch, and the weight gradient is summed over chunks in fp32 instead of in one bf16 matmul.
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if precision == "fp32" else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(loss_sum, reference.detach(), **tolerance)
    assert got.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max()
        torch.testing.assert_close(got[name] / scale, expected[name] / scale, **tolerance, msg=name)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("family", ["qwen2-tied", "gpt2"])
def test_a_tied_embeddings_gradient_over_two_micro_batches_equals_the_models_own(family, fused, lookups):
    """Accumulated in .grad without a fused step: the first micro-batch's gradient is taken as .grad, the
    second added to it in place. bf16 weights: bf16 gradients, the fused ones as close as the unfused."""
    model, batches = make_lm(family), [make_batch(seed=0), make_batch(seed=1)]
    for batch in batches:
        (model(**batch).loss * count_items(batch, shifted=True)).backward()
    expected = gradients(model)
    loss = chunked_loss(model, fused=fused, ce_chunk_tokens=5)
    for batch in batches:
        loss(model, batch)[0].backward()
    got = gradients(model)
    assert len(lookups) == (2 if fused else 0)
    for name in expected:
        scale = expected[name].abs().max()
        torch.testing.assert_close(got[name] / scale, expected[name] / scale, rtol=1e-5, atol=1e-6, msg=name)
    model.to(torch.bfloat16)
    for batch in batches:
        loss(model, batch)[0].backward()
    got = gradients(model)
    embedding = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    assert got[embedding].dtype == torch.bfloat16
    for name in expected:
        scale = expected[name].abs().max()
        torch.testing.assert_close(got[name].float() / scale, expected[name] / scale, rtol=2e-2, atol=2e-2, msg=name)


def test_the_fused_lookups_padding_row_gets_nothing_from_the_lookup():
    """`_TiedLookup` returns the head's gradient plus what nn.Embedding's backward gives: nothing for padding_idx."""
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, padding_idx=3)
    ids = torch.tensor([[3, 1, 3, 5], [1, 3, 9, 3]])
    upstream = torch.randn(2, 4, 4)
    (embedding(ids) * upstream).sum().backward()
    expected = embedding.weight.grad
    assert expected[3].abs().max() == 0 and expected[1].abs().max() > 0
    head = torch.randn(10, 4)
    for head_gradient in (None, head):
        tied = lm_loss._TiedGradient()
        tied.gradient = head_gradient.clone() if head_gradient is not None else None
        weight = embedding.weight.detach().clone().requires_grad_()
        (lm_loss._TiedLookup.apply(ids, weight, 3, tied) * upstream).sum().backward()
        torch.testing.assert_close(weight.grad, expected + (head if head_gradient is not None else 0))
        assert tied.consumed and tied.gradient is None  # handed over: AccumulateGrad holds the only reference
        if head_gradient is not None:
            assert torch.equal(weight.grad[3], head[3])  # the head's part of the padding row, untouched


def test_the_head_never_sees_unscored_positions_and_shift_labels_are_taken_as_they_are():
    model, batch = make_lm("qwen2-untied"), make_batch()
    seen = []
    handle = model.lm_head.register_forward_hook(lambda module, args, output: seen.append(args[0].shape))
    loss = chunked_loss(model)
    loss_sum, num_items = loss(model, batch)
    handle.remove()
    assert seen == [(1, 8, 32)] * 2  # the first batch's check (the model, then head(body)) on one row of 8 tokens
    assert int(num_items) == int((batch["labels"][:, 1:] != -100).sum())
    shift_labels = torch.full_like(batch["labels"], -100)
    shift_labels[:, :3] = 7
    with torch.no_grad():
        own = model(**{**batch, "shift_labels": shift_labels}).loss * 12
        got, items = loss(model, {**batch, "shift_labels": shift_labels})
    assert int(items) == 12
    torch.testing.assert_close(got, own, rtol=1e-5, atol=1e-6)


def loop_weights(chunked_ce: str, family: str, windows: int = 2, lr: float = 1.0, **fields) -> tuple[nn.Module, Loop]:
    model = make_lm(family)
    micro_batches = [make_batch(rows=4, seed=seed) for seed in range(4 * windows)]
    fields = {"accum_steps": 4, **fields}
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=lr), micro_batches,
                config=quiet_config(max_grad_norm=None, chunked_ce=chunked_ce, ce_chunk_tokens=7, **fields))
    loop.fit()
    return model, loop


@pytest.mark.parametrize("fields", [{}, {"accum_steps": 1, "optimizer_in_backward": True,
                                         "gradient_checkpointing": True, "windows": 1, "lr": 0.1}],
                         ids=["accumulated", "fused-step"])
@pytest.mark.parametrize("family", ["qwen2-tied"])  # GPT-2 through the Loop: tests/test_causal_lm.py
def test_the_loop_with_chunked_ce_equals_the_loop_without(family, fields, lookups):
    chunked, loop = loop_weights("on", family, **fields)
    assert lookups  # the tied embedding's one gradient: stepped in backward by the fused step
    plain, plain_loop = loop_weights("off", family, **fields)
    assert loop._lm_loss is not None and plain_loop._lm_loss is None
    moved = max((a - b).abs().max().item() for a, b in zip(plain.state_dict().values(),
                                                            make_lm(family).state_dict().values()))
    difference = max((a - b).abs().max().item() for a, b in zip(chunked.state_dict().values(),
                                                                 plain.state_dict().values()))
    assert moved > 1e-2 and difference < 1e-6


def test_auto_is_on_for_causal_lms_and_off_for_other_models():
    from conftest import make_tiny_bert

    assert Loop(make_lm("llama"), torch.optim.SGD(make_lm("llama").parameters(), lr=0.1), [],
                config=quiet_config())._lm_loss is not None
    bert = make_tiny_bert()
    assert Loop(bert, torch.optim.SGD(bert.parameters(), lr=0.1), [], config=quiet_config())._lm_loss is None
    with pytest.raises(ConfigError, match="chunked_ce='on'.*not a causal LM"):
        Loop(bert, torch.optim.SGD(bert.parameters(), lr=0.1), [], config=quiet_config(chunked_ce="on"))


def test_logit_softcapping_falls_back_to_the_models_own_loss_with_a_notice(capsys):
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=PAD)
    assert config.final_logit_softcapping is not None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config())
    assert loop._lm_loss is None
    assert "notice: chunked cross-entropy is off for this model (it softcaps its logits" in capsys.readouterr().out
    batch = make_batch()
    with torch.no_grad():
        torch.testing.assert_close(loop.compute_loss(batch), model(**batch).loss)
    with pytest.raises(ConfigError, match="softcaps"):
        Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config(chunked_ce="on"))


def scaled_logits_lm() -> nn.Module:
    """A Qwen2 whose forward scales its logits after the head: only the first batch's check can tell."""
    from transformers import Qwen2ForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class ScaledLogits(Qwen2ForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            logits = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits * 0.5
            loss = self.loss_function(logits, labels, self.config.vocab_size) if labels is not None else None
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    reference = make_lm("qwen2-untied")
    model = ScaledLogits(reference.config)
    model.load_state_dict(reference.state_dict())
    return model


def test_a_head_that_does_more_than_its_linear_falls_back_on_the_first_batch(capsys):
    model, batch = scaled_logits_lm(), make_batch()
    assert model_shifts_labels(model)
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config())
    assert loop._lm_loss is not None  # nothing in its structure tells
    with torch.no_grad():
        torch.testing.assert_close(loop.compute_loss(batch), model(**batch).loss)
        assert "not its output embedding applied to its decoder's last hidden states" in capsys.readouterr().out
        loop.compute_loss(batch)
    assert capsys.readouterr().out == ""  # one notice
    strict = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config(chunked_ce="on"))
    with pytest.raises(ConfigError, match="not its output embedding"):
        strict.compute_loss(batch)


def test_a_head_that_is_no_linear_falls_back(capsys):
    model = make_lm("qwen2-untied")

    class Quantized(nn.Linear):  # a Linear subclass may compute more than weight @ x: not trusted
        pass

    head = Quantized(32, VOCAB, bias=False)
    head.weight = model.lm_head.weight
    model.lm_head = head
    assert Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [], config=quiet_config())._lm_loss is None
    assert "its output embedding is a Quantized, not a torch.nn.Linear" in capsys.readouterr().out


def training_step_peak(chunked_ce: str) -> int:
    """The tracker's peak of one update of a large-vocabulary, tiny-body Qwen2 on 1 x 512 tokens."""
    model = make_lm("qwen2-untied", vocab=32000, hidden=64)
    batch = {"input_ids": torch.randint(3, 32000, (1, 512), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"].clone()
    loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [batch],
                config=quiet_config(chunked_ce=chunked_ce, track_memory=True))
    return loop.fit()["peak_memory_bytes"]


def test_the_training_steps_peak_drops_by_at_least_the_fp32_logits():
    logits_bytes = 512 * 32000 * 4  # 65.5 MB
    plain, chunked = training_step_peak("off"), training_step_peak("auto")
    print(f"peak: plain {plain / 2**20:.1f} MiB, chunked {chunked / 2**20:.1f} MiB, "
          f"drop {(plain - chunked) / 2**20:.1f} MiB, fp32 logits {logits_bytes / 2**20:.1f} MiB")
    assert plain - chunked >= logits_bytes


def test_the_tied_embeddings_one_gradient_drops_the_backward_peak(monkeypatch):
    """A tiny-body tied Qwen2 with a large vocabulary, small chunks: without the fused lookup the backward holds
    the head's [V, H] gradient, the lookup's and their sum; with it one."""
    vocab, hidden = 16384, 64
    batch = {"input_ids": torch.randint(3, vocab, (1, 128), generator=torch.Generator().manual_seed(0))}
    batch["labels"] = batch["input_ids"].clone()
    peaks = {}
    for fused in (False, True):
        monkeypatch.setattr(lm_loss.ChunkedLMLoss, "fuse_tied_gradient", fused)
        model = make_lm("qwen2-tied", vocab=vocab, hidden=hidden)
        loop = Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), [batch],
                    config=quiet_config(track_memory=True, ce_chunk_tokens=4))
        summary = loop.fit()
        assert summary["memory_breakdown"]["peak_phase"] == "backward"
        peaks[fused] = summary["peak_memory_bytes"]
    gradient_bytes = vocab * hidden * 4  # 4 MiB
    print(f"peak: unfused {peaks[False] / 2**20:.2f} MiB, fused {peaks[True] / 2**20:.2f} MiB, "
          f"drop {(peaks[False] - peaks[True]) / gradient_bytes:.2f} x [V, H] fp32")
    assert peaks[False] - peaks[True] >= gradient_bytes


def test_through_a_wrapper_the_models_own_forward_runs_with_its_head_standing_aside():
    # What DDP needs (the wrapper must run the forward to sync gradients); tests/test_causal_lm.py's
    # test_ddp_counts_every_ranks_shifted_labels runs it under torchrun against the full-batch loop.
    class Wrapper(nn.Module):
        def __init__(self, module: nn.Module):
            super().__init__()
            self.module = module

        def forward(self, **inputs):
            return self.module(**inputs)

    model, batch = make_lm("gpt2"), make_batch()
    loss = chunked_loss(model, ce_chunk_tokens=5)
    direct, _ = loss(model, batch)
    direct.backward()
    expected = gradients(model)
    wrapped, _ = loss(Wrapper(model), batch)
    wrapped.backward()
    assert "forward" not in vars(model.lm_head)  # the head is itself again
    assert "forward" not in vars(model.get_input_embeddings())  # and the embedding
    torch.testing.assert_close(wrapped, direct, rtol=1e-6, atol=1e-6)
    for name, grad in gradients(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("chunk_tokens, min_rows, tiling", [
    (10, 16, (24, 40)),  # 4 tiles of 24 vocabulary rows, each for all 40 tokens
    (9, 16, (21, 40)),  # 5 tiles, the last of 12 rows: the vocabulary is no multiple of the tile
    (5, 20, (20, 24)),  # two levels: blocks of 24 and 16 tokens, each over tiles of 20 rows and a last of 16
])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_vocabulary_tiles_equal_torchs_unchunked_cross_entropy(chunk_tokens, min_rows, tiling, precision,
                                                                    monkeypatch):
    """`chunked_cross_entropy` on 40 tokens (every fifth label -100) against ``F.linear`` + ``F.cross_entropy``
    over the whole vocabulary and autograd: the loss, the hidden states', weight's and bias's gradients, untied and
    tied (the hidden states come through the embedding's fused lookup, `_TiedLookup`)."""
    monkeypatch.setattr(lm_loss, "MIN_TILE_ROWS", min_rows)
    assert lm_loss._tiling(40, VOCAB, chunk_tokens * VOCAB) == tiling
    generator = torch.Generator().manual_seed(0)
    base, weight = torch.randn(40, 32, generator=generator), torch.randn(VOCAB, 32, generator=generator)
    bias, ids = torch.randn(VOCAB, generator=generator), torch.randint(0, VOCAB, (40,), generator=generator)
    labels = torch.randint(0, VOCAB, (40,), generator=generator)
    labels[::5] = -100
    # bf16: each tile's part of the hidden states' gradient is rounded to bf16 before their fp32 sum
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if precision == "fp32" else {"rtol": 2e-2, "atol": 1e-2}
    for tied in (False, True):
        results = []
        for chunked in (False, True):
            leaves = [tensor.clone().requires_grad_() for tensor in (base, weight, bias)]
            fused = lm_loss._TiedGradient() if chunked and tied else None
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                hidden = leaves[0]
                if tied:
                    lookup = lm_loss._TiedLookup.apply(ids, leaves[1], None, fused) if chunked else F.embedding(
                        ids, leaves[1])
                    hidden = hidden + lookup
                loss = (lm_loss.chunked_cross_entropy(hidden, leaves[1], leaves[2], labels, chunk_tokens, fused)
                        if chunked else F.cross_entropy(F.linear(hidden, leaves[1], leaves[2]).float(), labels,
                                                        ignore_index=-100, reduction="sum"))
            loss.backward()
            results.append([loss.detach()] + [leaf.grad for leaf in leaves])
        for name, expected, got in zip(("loss", "hidden", "weight", "bias"), *results):
            scale = expected.abs().max()
            torch.testing.assert_close(got / scale, expected / scale, **tolerance, msg=f"{name}, tied={tied}")


def test_a_label_outside_the_vocabulary_is_an_error_as_in_torchs_cross_entropy():
    hidden, weight = torch.randn(4, 32), torch.randn(VOCAB, 32)
    with pytest.raises(IndexError, match=f"Target {VOCAB} is out of bounds"):
        lm_loss.chunked_cross_entropy(hidden, weight, None, torch.tensor([1, -100, VOCAB, 2]))


def test_a_probes_sample_of_the_tiles_is_the_cross_entropy_over_the_computed_tiles_rows(monkeypatch):
    """Inside `sampled_tiles(2)` a loop of 5 tiles of 21 vocabulary rows (the last 12) computes tiles 0, 1 and 3
    only: the loss and every gradient are those of ``F.linear`` + logsumexp over those 63 rows alone, by autograd
    (a label outside them scores its logsumexp alone), the other rows' weight gradient is zero, and the skipped
    tiles' seconds are recorded once per loop (forward, backward)."""
    from looptrain.tile_sample import sampled_tiles

    monkeypatch.setattr(lm_loss, "MIN_TILE_ROWS", 16)
    assert lm_loss._tiling(40, VOCAB, 9 * VOCAB) == (21, 40)
    computed = torch.cat([torch.arange(0, 42), torch.arange(63, 84)])
    generator = torch.Generator().manual_seed(0)
    base, weight = torch.randn(40, 32, generator=generator), torch.randn(VOCAB, 32, generator=generator)
    bias, ids = torch.randn(VOCAB, generator=generator), torch.randint(0, VOCAB, (40,), generator=generator)
    labels = torch.randint(0, VOCAB, (40,), generator=generator)
    labels[::5] = -100
    for tied in (False, True):
        results = []
        for sampled in (True, False):
            leaves = [tensor.clone().requires_grad_() for tensor in (base, weight, bias)]
            fused = lm_loss._TiedGradient() if sampled and tied else None
            hidden = leaves[0]
            if tied:
                hidden = hidden + (lm_loss._TiedLookup.apply(ids, leaves[1], None, fused) if sampled
                                   else F.embedding(ids, leaves[1]))
            if sampled:
                with sampled_tiles(2) as sample:
                    loss = lm_loss.chunked_cross_entropy(hidden, leaves[1], leaves[2], labels, 9, fused)
                    loss.backward()
                assert len(sample.added) == 2 and all(seconds >= 0 for _, seconds in sample.added)
            else:  # the reference: the same head over the computed rows alone
                logits = F.linear(hidden, leaves[1][computed], leaves[2][computed])
                inside = (labels[:, None] == computed[None, :])
                target = torch.where(inside, logits, 0.0).sum(dim=1)
                loss = torch.where(labels != -100, torch.logsumexp(logits, dim=1) - target, 0.0).sum()
                loss.backward()
            results.append([loss.detach()] + [leaf.grad for leaf in leaves])
        for name, got, expected in zip(("loss", "hidden", "weight", "bias"), *results):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{name}, tied={tied}")
        skipped = torch.ones(VOCAB, dtype=torch.bool)
        skipped[computed] = False
        if not tied:  # a tied weight's skipped rows still get the lookup's gradient
            assert torch.count_nonzero(results[0][2][skipped]) == 0
        assert torch.count_nonzero(results[0][3][skipped]) == 0
