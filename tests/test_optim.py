"""Optimizer factory, 8-bit state dtypes, state bytes, and the step fused into backward."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from looptrain.freeze import freeze_embeddings, freeze_layers
from looptrain.optim import (
    OPTIMIZER_NAMES,
    OptimizerInBackward,
    build_optimizer,
    build_parameter_groups,
    inner_optimizers,
    optimizer_state_bytes,
)

from conftest import SmallMLP, make_tiny_bert, quiet_config, random_token_batches


class EmbedMLP(nn.Module):
    """Big enough for 8-bit state: a 6400-element embedding and 4096-element linear weights."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(200, 32)
        self.norm = nn.LayerNorm(32)
        self.hidden = nn.Linear(64, 64)
        self.out = nn.Linear(64, 3)

    def forward(self, ids, labels):
        hidden = self.norm(self.embed(ids)).flatten(1)
        logits = self.out(torch.relu(self.hidden(hidden)))
        return nn.functional.cross_entropy(logits, labels)


def _data(steps=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 200, (4, 2), generator=generator), torch.randint(0, 3, (4,), generator=generator))
            for _ in range(steps)]


def _group_ids(optimizer):
    return [id(p) for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_trainable_parameter_in_exactly_one_group(name):
    model = make_tiny_bert(num_layers=2)
    freeze_embeddings(model)
    freeze_layers(model, 1)
    optimizer = build_optimizer(model, name, lr=1e-3, weight_decay=0.01)
    grouped = _group_ids(optimizer)
    assert len(grouped) == len(set(grouped))
    assert set(grouped) == {id(p) for p in model.parameters() if p.requires_grad}


def test_decay_groups_on_tiny_bert():
    model = make_tiny_bert(num_layers=1)
    decay, no_decay = build_parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): name for name, p in model.named_parameters()}
    decay_names = {names[id(p)] for p in decay["params"]}
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    assert "bert.embeddings.word_embeddings.weight" in decay_names  # Trainer's convention
    assert "bert.encoder.layer.0.attention.self.query.weight" in decay_names
    assert "classifier.weight" in decay_names
    assert "bert.embeddings.LayerNorm.weight" in no_decay_names
    assert "bert.encoder.layer.0.output.LayerNorm.weight" in no_decay_names
    assert all(name.endswith("bias") or "LayerNorm" in name for name in no_decay_names)
    _, no_decay = build_parameter_groups(model, 0.1, decay_embeddings=False)
    assert model.bert.embeddings.word_embeddings.weight in no_decay["params"]


def test_errors():
    model = SmallMLP()
    with pytest.raises(ValueError, match="valid names are adamw, adamw8bit, paged_adamw8bit, adafactor, sgd"):
        build_optimizer(model, "adam", lr=1e-3)
    with pytest.raises(ValueError, match="foreach/fused apply to adamw and sgd only"):
        build_optimizer(model, "adafactor", lr=1e-3, foreach=False)
    with pytest.raises(ValueError, match="embedding_bits must be 8 or 32"):
        build_optimizer(model, "adamw8bit", lr=1e-3, embedding_bits=16)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="SmallMLP has no trainable parameter"):
        build_optimizer(model, "adamw", lr=1e-3)


def _train(model, optimizer, data, in_backward=None):
    for ids, labels in data:
        loss = model(ids, labels)
        loss.backward()
        if in_backward is None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit"])
def test_8bit_state_dtypes_on_cpu(name, recwarn):
    model = EmbedMLP()
    optimizer = build_optimizer(model, name, lr=1e-3)
    _train(model, optimizer, _data(1))
    state = optimizer.state
    assert state[model.hidden.weight]["state1"].dtype == torch.uint8  # 4096 elements: 8-bit
    assert state[model.hidden.weight]["state2"].dtype == torch.uint8
    assert state[model.embed.weight]["state1"].dtype == torch.float32  # 6400 elements, overridden to 32-bit
    assert state[model.embed.weight]["state2"].dtype == torch.float32
    if name == "paged_adamw8bit":  # bitsandbytes falls back to unpaged buffers on CPU, with a warning
        assert any("not supported on CPU" in str(warning.message) for warning in recwarn)


def test_8bit_embeddings_without_override_are_8bit():
    model = EmbedMLP()
    optimizer = build_optimizer(model, "adamw8bit", lr=1e-3, embedding_bits=8)
    _train(model, optimizer, _data(1))
    assert optimizer.state[model.embed.weight]["state1"].dtype == torch.uint8


def test_two_8bit_optimizers_in_one_process_keep_their_own_embedding_overrides():
    """bitsandbytes resolves overrides by (group, parameter) position in its process-global manager: the first
    optimizer's 32-bit embedding would make whatever sits at that position in a later one 32-bit."""
    first = EmbedMLP()
    first_optimizer = build_optimizer(first, "adamw8bit", lr=1e-3)
    _train(first, first_optimizer, _data(1))
    second = EmbedMLP()
    second_optimizer = build_optimizer(second, "adamw8bit", lr=1e-3, embedding_bits=8)
    _train(second, second_optimizer, _data(1))
    assert first_optimizer.state[first.embed.weight]["state1"].dtype == torch.float32
    assert second_optimizer.state[second.embed.weight]["state1"].dtype == torch.uint8


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused step"])
@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_a_loop_that_is_dropped_frees_its_weights_and_optimizer_state(name, fused):
    """Measured on a GPU: every fused run of a ladder left its weights and states allocated after its Loop was gone
    (the parameters' hooks held the wrapper), and every 8-bit one its embeddings (bitsandbytes' global manager)."""
    import gc
    import weakref

    from looptrain import Loop

    class EmbedLoop(Loop):
        def compute_loss(self, batch):
            return self.model(**batch), len(batch["labels"])

    model = EmbedMLP()
    optimizer = build_optimizer(model, name, lr=1e-3)
    batches = [{"ids": ids, "labels": labels} for ids, labels in _data(2)]
    loop = EmbedLoop(model, optimizer, batches, config=quiet_config(optimizer_in_backward=fused))
    loop.fit()
    tensors = [*model.parameters(), *(value for optimizer in inner_optimizers(loop.optimizer)
                                       for state in optimizer.state.values() for value in state.values()
                                       if isinstance(value, torch.Tensor))]
    assert len(tensors) > 3 * len(list(model.parameters()))  # two moments (and a step) per parameter, to be freed
    references = [weakref.ref(tensor) for tensor in tensors]
    del loop, model, optimizer, batches, tensors
    gc.collect()
    assert [reference for reference in references if reference() is not None] == []


def test_8bit_state_on_bert_embeddings_is_32bit():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=200, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=80)
    model = BertForSequenceClassification(config)
    optimizer = build_optimizer(model, "adamw8bit", lr=1e-3)
    batch = random_token_batches([[5, 7]], vocab_size=200)[0]
    model(**batch).loss.backward()
    optimizer.step()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            assert optimizer.state[module.weight]["state1"].dtype == torch.float32
    assert optimizer.state[model.bert.encoder.layer[0].attention.self.query.weight]["state1"].dtype == torch.uint8


def test_state_bytes_arithmetic():
    model = EmbedMLP()
    parameters = list(model.parameters())
    numel = sum(p.numel() for p in parameters)
    adamw = build_optimizer(model, "adamw", lr=1e-3)
    _train(model, adamw, _data(1))
    # exp_avg + exp_avg_sq in fp32 (8 bytes/param) + one fp32 `step` scalar per tensor.
    assert optimizer_state_bytes(adamw) == 8 * numel + 4 * len(parameters)

    model = EmbedMLP()
    adamw8bit = build_optimizer(model, "adamw8bit", lr=1e-3)
    _train(model, adamw8bit, _data(1))
    assert optimizer_state_bytes(adamw8bit) < 0.75 * optimizer_state_bytes(adamw)

    model = EmbedMLP()
    adafactor = build_optimizer(model, "adafactor", lr=1e-3)
    _train(model, adafactor, _data(1))
    assert optimizer_state_bytes(adafactor) < 0.25 * optimizer_state_bytes(adamw)


def test_adafactor_trains_with_factored_state():
    model = make_tiny_bert(num_layers=1)
    optimizer = build_optimizer(model, "adafactor", lr=1e-2)
    batch = random_token_batches([[6, 5, 7, 4]], vocab_size=model.config.vocab_size)[0]
    losses = []
    for _ in range(8):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    query_state = optimizer.state[model.bert.encoder.layer[0].attention.self.query.weight]
    assert "exp_avg_sq_row" in query_state and "exp_avg_sq_col" in query_state
    assert optimizer.param_groups[0]["lr"] == 1e-2


ADAFACTOR_OPTIONS = {
    "trainer's": {"scale_parameter": False, "relative_step": False, "warmup_init": False},
    "relative step": {"lr": None, "scale_parameter": True, "relative_step": True, "warmup_init": True},
    "first moment, weight decay": {"beta1": 0.9, "weight_decay": 0.01, "scale_parameter": False,
                                   "relative_step": False},
    "defaults": {"lr": None},  # relative step (at most 1e-2), parameter scale, no warm-up
    "eps, clip threshold, decay rate": {"eps": (1e-20, 1e-2), "clip_threshold": 0.5, "decay_rate": -0.6,
                                        "relative_step": False},
}


def test_adafactor_takes_hugging_faces_options_and_refuses_what_it_refuses():
    """looptrain's Adafactor is not a subclass of transformers' (whose module imports peft and bitsandbytes): the
    same defaults in each parameter group, and the same errors for the same contradictory options."""
    from transformers.optimization import Adafactor as Reference

    from looptrain.optim.adafactor import Adafactor

    parameter = nn.Parameter(torch.zeros(4, 3))
    assert Adafactor([parameter]).defaults == Reference([parameter]).defaults
    assert Adafactor([parameter], lr=0.1, relative_step=False).defaults == \
        Reference([parameter], lr=0.1, relative_step=False).defaults
    for options, message in (({"lr": 0.1}, "Cannot combine manual `lr` and `relative_step=True` options"),
                             ({"relative_step": False, "warmup_init": True},
                              "`warmup_init=True` requires `relative_step=True`")):
        for optimizer_class in (Reference, Adafactor):
            with pytest.raises(ValueError, match=re.escape(message)):
                optimizer_class([parameter], **options)


@pytest.mark.slow  # among the costliest fast checks (docs/results.md): .ci/run runs it, make test leaves it out
def test_building_adafactor_imports_neither_peft_nor_bitsandbytes():
    """`transformers.optimization` imports `transformers.trainer_utils`, peft and bitsandbytes (55 MiB of resident
    modules on a CPU, which a budget of process RSS pays for); looptrain's Adafactor is built without any of them."""
    code = ("import sys; from torch import nn; from looptrain.optim import build_optimizer; "
            "build_optimizer(nn.Linear(4, 4), 'adafactor', lr=1e-3); "
            "print(sorted(m for m in ('peft', 'bitsandbytes', 'transformers.optimization', "
            "'transformers.trainer_utils') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parent.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("options", ADAFACTOR_OPTIONS)
def test_adafactor_steps_bitwise_as_hugging_faces(options, dtype):
    """looptrain's Adafactor (its step in place) against transformers' own: the same weights and state, bit for bit,
    after five steps of a 3-D, a 2-D and a 1-D parameter (factored and not), with every option that changes the
    step."""
    from transformers.optimization import Adafactor as Reference

    from looptrain.optim.adafactor import Adafactor

    torch.manual_seed(0)
    shapes = [(3, 20, 12), (48, 16), (16,)]
    start = [torch.randn(shape).to(dtype) for shape in shapes]
    grads = [[torch.randn(shape).to(dtype) for shape in shapes] for _ in range(5)]
    settings = {"lr": 1e-2, **ADAFACTOR_OPTIONS[options]}
    results = []
    for optimizer_class in (Reference, Adafactor):
        parameters = [nn.Parameter(tensor.clone()) for tensor in start]
        optimizer = optimizer_class(parameters, **settings)
        for step_grads in grads:
            for parameter, grad in zip(parameters, step_grads):
                parameter.grad = grad.clone()
            optimizer.step()
        results.append((parameters, optimizer.state_dict()["state"]))
    (reference, reference_state), (ours, our_state) = results
    for expected, got in zip(reference, ours):
        assert torch.equal(expected, got)
    assert reference_state.keys() == our_state.keys()
    for index, state in reference_state.items():
        assert state.keys() == our_state[index].keys()
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(our_state[index][name])), (index, name)


def test_adafactor_steps_a_large_parameter_with_one_temporary_instead_of_two():
    """The peak of one step over a 2,048 x 512 weight (4 MiB) with the tensor tracker: transformers' Adafactor holds
    two weight-sized temporaries at once, looptrain's one."""
    from transformers.optimization import Adafactor as Reference

    from looptrain.memory import StorageTracker
    from looptrain.optim.adafactor import Adafactor

    weight_bytes = 2048 * 512 * 4
    peaks = []
    for optimizer_class in (Reference, Adafactor):
        torch.manual_seed(0)
        parameter = nn.Parameter(torch.randn(2048, 512))
        parameter.grad = torch.randn(2048, 512)
        optimizer = optimizer_class([parameter], lr=1e-3, scale_parameter=False, relative_step=False)
        optimizer.step()  # the state exists; the second step is measured
        with StorageTracker() as tracker:
            optimizer.step()
        # The tracker meets the weight and its gradient at the step's first op: what stays is theirs (and the small
        # state), what the peak has above it the step's temporaries.
        assert 2 * weight_bytes <= tracker.current_bytes < 2.01 * weight_bytes
        peaks.append(tracker.peak_bytes - tracker.current_bytes)
    reference, ours = peaks
    assert 2 * weight_bytes <= reference < 2.1 * weight_bytes
    assert weight_bytes <= ours < 1.1 * weight_bytes


def test_sgd_momentum_and_adamw_foreach_false():
    model = SmallMLP()
    sgd = build_optimizer(model, "sgd", lr=0.1, momentum=0.9)
    assert sgd.param_groups[0]["momentum"] == 0.9
    adamw = build_optimizer(model, "adamw", lr=0.1, foreach=False)
    assert adamw.param_groups[0]["foreach"] is False


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "sgd"])
def test_step_in_backward_matches_plain_optimizer(name):
    plain_model = EmbedMLP()
    fused_model = copy.deepcopy(plain_model)
    extra = {"momentum": 0.9} if name == "sgd" else {}
    plain = build_optimizer(plain_model, name, lr=1e-2, weight_decay=0.01, **extra)
    fused = OptimizerInBackward(fused_model, build_optimizer(fused_model, name, lr=1e-2, weight_decay=0.01, **extra))
    # For adamw8bit this also guards the per-parameter override managers: with bitsandbytes'
    # global one, index (0, 0) collides and every parameter after the embedding goes 32-bit.
    steps = 4
    data = _data(steps)
    _train(plain_model, plain, data)
    for ids, labels in data:
        fused_model(ids, labels).backward()
        assert all(p.grad is None for p in fused_model.parameters())
    assert fused.steps == steps
    assert not fused.optimizer.state  # the original never allocates state
    for expected, actual in zip(plain_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    if name == "adamw8bit":
        embed, hidden = fused_model.embed.weight, fused_model.hidden.weight
        assert fused._per_parameter[id(embed)].state[embed]["state1"].dtype == torch.float32
        assert fused._per_parameter[id(hidden)].state[hidden]["state1"].dtype == torch.uint8
    assert optimizer_state_bytes(fused) == optimizer_state_bytes(plain) or name == "adamw8bit"


def test_step_in_backward_follows_scheduler_and_reports_grad_norm():
    plain_model = EmbedMLP()
    fused_model = copy.deepcopy(plain_model)
    plain = build_optimizer(plain_model, "adamw", lr=1e-2)
    fused = OptimizerInBackward(fused_model, build_optimizer(fused_model, "adamw", lr=1e-2))
    plain_scheduler = torch.optim.lr_scheduler.LambdaLR(plain, lambda step: 1.0 / (1 + step))
    fused_scheduler = torch.optim.lr_scheduler.LambdaLR(fused.optimizer, lambda step: 1.0 / (1 + step))
    for ids, labels in _data(3):
        loss = plain_model(ids, labels)
        loss.backward()
        expected_norm = torch.nn.utils.get_total_norm([p.grad for p in plain_model.parameters()])
        plain.step()
        plain.zero_grad()
        plain_scheduler.step()
        fused_model(ids, labels).backward()
        fused_scheduler.step()
        assert fused.grad_norm == pytest.approx(float(expected_norm), rel=1e-5)
    for expected, actual in zip(plain_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(actual, expected)


def test_per_parameter_clipping_equals_clipping_each_parameter_by_hand():
    plain_model = EmbedMLP()
    fused_model = copy.deepcopy(plain_model)
    plain = build_optimizer(plain_model, "sgd", lr=0.1)
    fused = OptimizerInBackward(fused_model, build_optimizer(fused_model, "sgd", lr=0.1), max_grad_norm=0.05)
    for ids, labels in _data(3):
        plain_model(ids, labels).backward()
        unclipped = torch.nn.utils.get_total_norm([p.grad for p in plain_model.parameters()])
        for parameter in plain_model.parameters():
            torch.nn.utils.clip_grad_norm_([parameter], 0.05)
        plain.step()
        plain.zero_grad()
        fused_model(ids, labels).backward()
        assert fused.grad_norm == pytest.approx(float(unclipped), rel=1e-5)  # logged before clipping
    for expected, actual in zip(plain_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(actual, expected)


def test_previous_global_clipping_scales_by_last_steps_norm():
    plain_model = EmbedMLP()
    fused_model = copy.deepcopy(plain_model)
    plain = build_optimizer(plain_model, "sgd", lr=0.1)
    # Never read by name: constructing it registers the hooks that step fused_model inside backward(); the name
    # makes its lifetime (the whole test) explicit.
    _fused = OptimizerInBackward(
        fused_model, build_optimizer(fused_model, "sgd", lr=0.1), max_grad_norm=0.05, clip="previous_global"
    )
    previous_norm = None
    for ids, labels in _data(3):
        plain_model(ids, labels).backward()
        grads = [p.grad for p in plain_model.parameters()]
        norm = torch.nn.utils.get_total_norm(grads)
        for parameter in plain_model.parameters():
            if previous_norm is None:  # first step: per-parameter clipping
                torch.nn.utils.clip_grad_norm_([parameter], 0.05)
            else:
                parameter.grad.mul_(torch.clamp(0.05 / (previous_norm + 1e-6), max=1.0))
        previous_norm = norm
        plain.step()
        plain.zero_grad()
        fused_model(ids, labels).backward()
    for expected, actual in zip(plain_model.parameters(), fused_model.parameters()):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("name", ["adamw", "adamw8bit"])
def test_state_dict_round_trip_continues_identically(name):
    data = _data(6)
    model = EmbedMLP()
    fused = OptimizerInBackward(model, build_optimizer(model, name, lr=1e-2), max_grad_norm=1.0, clip="previous_global")
    for ids, labels in data[:3]:
        model(ids, labels).backward()
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(fused.state_dict())
    for ids, labels in data[3:]:
        model(ids, labels).backward()

    resumed_model = EmbedMLP()
    resumed_model.load_state_dict(saved_model)
    resumed = OptimizerInBackward(resumed_model, build_optimizer(resumed_model, name, lr=1e-2), max_grad_norm=1.0,
                                  clip="previous_global")
    resumed.load_state_dict(saved)
    for ids, labels in data[3:]:
        resumed_model(ids, labels).backward()
    for expected, actual in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(actual, expected)
    assert resumed.steps == fused.steps == 6


def test_step_in_backward_with_frozen_layers_and_remove():
    model = make_tiny_bert(num_layers=2)
    freeze_embeddings(model)
    freeze_layers(model, 1)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    fused = OptimizerInBackward(model, build_optimizer(model, "adamw", lr=1e-2))
    batch = random_token_batches([[5, 6]], vocab_size=model.config.vocab_size)[0]
    model(**batch).loss.backward()
    assert len(fused._per_parameter) == sum(p.requires_grad for p in model.parameters())
    for name, parameter in model.named_parameters():
        if name in frozen:
            assert torch.equal(parameter, frozen[name])
    fused.remove()
    model(**batch).loss.backward()
    assert model.classifier.weight.grad is not None  # hooks gone: grads stay, nothing steps
    assert fused.steps == 1


def test_step_in_backward_errors():
    model = EmbedMLP()
    optimizer = build_optimizer(model, "adamw", lr=1e-3)
    with pytest.raises(ValueError, match="clip must be one of"):
        OptimizerInBackward(model, optimizer, clip="global")
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        OptimizerInBackward(model, optimizer, max_grad_norm=0.0)
    partial = torch.optim.AdamW(model.out.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=r"\['embed.weight'.*are in no param group"):
        OptimizerInBackward(model, partial)
    _train(model, optimizer, _data(1))
    with pytest.raises(ValueError, match="already has state"):
        OptimizerInBackward(model, optimizer)
