"""The input embedding's gradient accumulated row by row (`looptrain.embedding_grad`).

The reference is torch's own dense path: ``nn.Embedding``'s backward (``embedding_dense_backward``) and
autograd's accumulation into ``.grad``. The row path must give the same bits, hold no vocabulary-sized
temporary, and step aside wherever it would not be exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from looptrain import Loop
from looptrain.embedding_grad import RowGradEmbedding, accumulate_embedding_rows, add_rows
from looptrain.memory import StorageTracker

from conftest import make_tiny_bert, quiet_config, random_token_batches

VOCAB, HIDDEN = 3000, 48


def _ids(rows: int, width: int, seed: int, padding: int = 0) -> torch.Tensor:
    """Token ids with repeats (a few frequent ids, as text has) and right padding on every other row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (rows, width), generator=generator)
    ids[:, ::3] = torch.randint(1, 8, (rows, len(range(0, width, 3))), generator=generator)
    ids[::2, width // 2:] = padding
    return ids


@pytest.mark.parametrize("padding_idx", [0, None])
def test_rows_accumulate_bitwise_as_the_dense_backward(padding_idx):
    torch.manual_seed(0)
    dense = nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx)
    rows = copy.deepcopy(dense)
    assert accumulate_embedding_rows(nn.ModuleDict({"embedding": rows})) is None  # no get_input_embeddings
    holder = _Holder(rows)
    assert accumulate_embedding_rows(holder) is rows
    generator = torch.Generator().manual_seed(1)
    # Four micro-batches, one of 8192 tokens (where a kernel might go parallel): the first creates .grad.
    for index, (batch, width) in enumerate([(4, 40), (2, 7), (64, 128), (3, 33)]):
        ids = _ids(batch, width, seed=index)
        upstream = torch.randn(batch, width, HIDDEN, generator=generator)
        (dense(ids) * upstream).sum().backward()
        (holder(ids) * upstream).sum().backward()
        assert torch.equal(rows.weight.grad, dense.weight.grad), f"micro-batch {index}"
    if padding_idx is not None:
        assert not dense.weight.grad[padding_idx].any() and not rows.weight.grad[padding_idx].any()


class _Holder(nn.Module):
    """A model whose input embedding is `embedding` (as Hugging Face models name it)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.embedding = embedding

    def get_input_embeddings(self) -> nn.Module:
        return self.embedding

    def forward(self, ids):
        return self.embedding(ids)


def test_a_backward_holds_no_vocabulary_sized_temporary():
    weight_bytes = VOCAB * HIDDEN * 4
    peaks = {}
    for name in ("dense", "rows"):
        torch.manual_seed(0)
        embedding = nn.Embedding(VOCAB, HIDDEN, padding_idx=0)
        holder = _Holder(embedding)
        if name == "rows":
            accumulate_embedding_rows(holder)
        ids, upstream = _ids(4, 32, seed=0), torch.randn(4, 32, HIDDEN)
        holder(ids).mul(upstream).sum().backward()  # .grad exists: the next micro-batch accumulates into it
        with StorageTracker() as tracker:
            holder(ids).mul(upstream).sum().backward()
        peaks[name] = tracker.peak_bytes - tracker.current_bytes  # above the weight and its gradient
    assert peaks["dense"] >= weight_bytes  # embedding_dense_backward's [vocab, hidden] gradient
    assert peaks["rows"] < 0.1 * weight_bytes  # the forward's activations and a few [tokens, hidden] buffers


def test_a_loop_trains_bitwise_as_with_the_dense_gradient():
    """Two updates of 3 micro-batches each: weights equal bit for bit with and without the row path."""
    batches = random_token_batches([[12, 5, 9, 3], [7, 7, 2, 11], [4, 12, 6, 1]] * 2, vocab_size=60, seed=3)
    models = {}
    for rows in (False, True):
        model = make_tiny_bert(vocab_size=60, pad_token_id=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loop = Loop(model, optimizer, batches, config=quiet_config(accum_steps=3, embedding_row_grads=rows))
        loop.fit()
        models[rows] = model
        assert (type(model.get_input_embeddings()) is RowGradEmbedding) == rows
    for (name, dense), (_, row) in zip(models[False].named_parameters(), models[True].named_parameters()):
        assert torch.equal(dense, row), name
    assert not torch.equal(models[True].get_input_embeddings().weight, make_tiny_bert(vocab_size=60).bert.embeddings
                           .word_embeddings.weight)  # the embedding did train


def test_post_accumulate_grad_hooks_run_once_per_backward():
    embedding = nn.Embedding(50, 8)
    holder = _Holder(embedding)
    accumulate_embedding_rows(holder)
    seen = []
    embedding.weight.register_post_accumulate_grad_hook(lambda weight: seen.append(weight.grad.clone()))
    for seed in range(3):
        holder(torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(seed))).sum().backward()
    assert len(seen) == 3
    assert torch.equal(seen[-1], embedding.weight.grad)


def test_the_fused_step_still_steps_the_embedding():
    model = make_tiny_bert(vocab_size=60)
    before = model.get_input_embeddings().weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = random_token_batches([[12, 5, 9, 3]], vocab_size=60, seed=1)
    Loop(model, optimizer, batches, config=quiet_config(optimizer_in_backward=True)).fit()
    weight = model.get_input_embeddings().weight
    used = batches[0]["input_ids"][batches[0]["attention_mask"].bool()].unique()
    assert weight.grad is None  # the fused step frees each gradient after its step
    assert not torch.equal(weight[used], before[used])
    unused = torch.ones(60, dtype=torch.bool)
    unused[used] = False
    unused[0] = False  # the padding row
    assert torch.equal(weight[unused], before[unused])  # SGD without decay leaves rows without gradient alone


def test_where_it_would_not_be_exact_the_embedding_is_left_dense():
    from transformers import GPT2Config, GPT2LMHeadModel

    tied = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    assert accumulate_embedding_rows(tied) is None  # the LM head's gradient and the embedding's share one tensor
    scaled = _Holder(nn.Embedding(50, 8, scale_grad_by_freq=True))
    assert accumulate_embedding_rows(scaled) is None

    # Decided at each forward: a bf16 weight, a tensor hook, no grad, a frozen weight take the dense path.
    embedding = nn.Embedding(50, 8)
    holder = _Holder(embedding)
    assert accumulate_embedding_rows(holder) is embedding
    ids = torch.randint(0, 50, (2, 5))
    assert holder(ids).grad_fn.name() != "EmbeddingBackward0"
    with torch.no_grad():
        assert holder(ids).grad_fn is None
    handle = embedding.weight.register_hook(lambda grad: grad * 2)
    assert holder(ids).grad_fn.name() == "EmbeddingBackward0"
    handle.remove()
    embedding.to(torch.bfloat16)
    assert holder(ids).grad_fn.name() == "EmbeddingBackward0"
    embedding.float().weight.requires_grad_(False)
    assert holder(ids).grad_fn is None


def test_the_flag_turns_it_off():
    model = make_tiny_bert(vocab_size=60)
    assert type(accumulate_embedding_rows(model)) is RowGradEmbedding  # as an earlier Loop on this model left it
    batches = random_token_batches([[5, 3]], vocab_size=60)
    Loop(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
         config=quiet_config(embedding_row_grads=False)).fit()
    assert type(model.get_input_embeddings()) is nn.Embedding

    from looptrain.cli.finetune.arguments import build_parser

    assert build_parser().parse_args(["--no-embedding-row-grads"]).embedding_row_grads is False


def test_on_fake_tensors_it_prices_one_row_a_token():
    """The estimator's fake token ids hold no values: the row path prices the most rows a micro-batch can use."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        weight = nn.Parameter(torch.zeros(VOCAB, HIDDEN))
        ids, upstream = torch.zeros(3, 7, dtype=torch.long), torch.ones(3, 7, HIDDEN)
        with StorageTracker() as tracker:
            add_rows(weight, ids, upstream, padding_idx=0)
        assert weight.grad.shape == (VOCAB, HIDDEN)
    # The tracker meets the weight (zeros_like's input) and makes its gradient; above them, for 21 tokens: the
    # upstream gradient and the ids it meets, the row sums and their index ([tokens, hidden], not [vocab, hidden]).
    assert 0 < tracker.peak_bytes - 2 * VOCAB * HIDDEN * 4 <= 2 * (3 * 7 * HIDDEN * 4 + 3 * 7 * 8)
