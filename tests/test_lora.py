"""LoRA and QLoRA (peft) through the Loop and the command line: final/ and --merge-lora, resume, exact accumulation,
and composition with the other levers. Tiny models (hidden 32 to 64, 2 blocks), a few updates each."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file
from test_causal_lm import batched, lm_samples, make_causal_lm

from looptrain import Loop, Strategy
from looptrain.cli import finetune
from looptrain.lora import apply_lora

from conftest import make_tiny_bert, quiet_config, write_csv

QWEN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BERT_TARGETS = ["query", "key", "value", "dense"]  # BERT's pooler.dense too, as a plain peft user would name them


# ------------------------------------------------------------------ the command line: final/, --merge-lora, resume
def bert_argv(model_dir, files, output_dir, *extra, lora=("--lora", "4")) -> list[str]:
    train, evaluation = files
    return ["--model", str(model_dir), "--data", str(train), "--eval-data", str(evaluation),
            "--output-dir", str(output_dir), *lora, "--batch-size", "4", "--epochs", "2", "--eval-every", "2",
            "--seed", "3", "--max-length", "32", "--lr", "1e-2", "--precision", "fp32", "--device", "cpu",
            "--no-track-memory", "--no-progress-bar", *extra]


def run_quietly(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = finetune.main(argv)
    return code, out.getvalue()


@pytest.fixture(scope="module")
def bert_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-data")
    return write_csv(root / "train.csv", 16, seed=5), write_csv(root / "eval.csv", 8, seed=6)


@pytest.fixture(scope="module")
def bert_run(model_dir, bert_files, tmp_path_factory):
    """A --lora 4 --merge-lora run of the tiny BERT classifier: 8 updates, a checkpoint every 2."""
    output_dir = tmp_path_factory.mktemp("lora-bert")
    code, out = run_quietly(bert_argv(model_dir, bert_files, output_dir, "--merge-lora"))
    assert code == 0, out
    return output_dir, out


def eval_loss(model, model_dir, bert_files) -> float:
    """The mean cross-entropy of `model` on the eval file, tokenized and labelled as the run did."""
    from looptrain.data import DynamicPaddingCollator, load_tokenizer, read_classification_data, tokenize

    train = read_classification_data(bert_files[0], "text", "label")
    data = read_classification_data(bert_files[1], "text", "label", label_names=train.label_names)
    tokenizer = load_tokenizer(str(model_dir))
    dataset = tokenize(data, tokenizer, 32)
    batch = DynamicPaddingCollator(tokenizer)([dataset[index] for index in range(len(dataset))])
    with torch.no_grad():
        return float(model.eval()(**batch).loss)


def test_final_holds_the_adapter_peft_loads_and_it_reproduces_the_eval(bert_run, model_dir, bert_files):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    output_dir, out = bert_run
    final = output_dir / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in final.iterdir()}
    assert not (final / "model.safetensors").exists()  # the base is --model's, not copied
    assert "LoRA rank 4 (alpha 8) on 12 modules, frozen base: " in out and "trained fully: classifier" in out
    summary = json.loads((output_dir / "summary.json").read_text())
    loaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(model_dir), final)
    assert eval_loss(loaded, model_dir, bert_files) == pytest.approx(summary["final_eval"]["loss"], abs=1e-5)


def test_merge_lora_writes_full_weights_that_load_alone_and_reproduce_the_eval(bert_run, model_dir, bert_files):
    from transformers import AutoModelForSequenceClassification

    output_dir, out = bert_run
    merged_dir = output_dir / "final" / "merged"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in merged_dir.iterdir()}
    assert not any("lora" in key for key in load_file(str(merged_dir / "model.safetensors")))
    merged = AutoModelForSequenceClassification.from_pretrained(merged_dir)
    summary = json.loads((output_dir / "summary.json").read_text())
    assert eval_loss(merged, model_dir, bert_files) == pytest.approx(summary["final_eval"]["loss"], abs=1e-5)


# ------------------------------------------------------------------ final/ used from elsewhere: the base it records
@pytest.fixture(scope="module")
def relative_run(model_dir, bert_files, tmp_path_factory):
    """A --lora 4 run started in --model's parent directory with --model given as a relative path."""
    output_dir = tmp_path_factory.mktemp("lora-relative") / "run"
    before = os.getcwd()
    os.chdir(model_dir.parent)
    try:
        code, out = run_quietly(bert_argv(model_dir.name, bert_files, output_dir))
    finally:
        os.chdir(before)
    assert code == 0, out
    return output_dir


def predict_quietly(*argv) -> tuple[int, str]:
    from looptrain.cli import predict

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = predict.main([str(value) for value in argv] + ["--no-progress-bar"])
    return code, err.getvalue()


def test_the_adapter_records_its_base_as_an_absolute_path_and_its_task(relative_run, model_dir, tmp_path,
                                                                        monkeypatch):
    from transformers import AutoModelForSequenceClassification

    saved = json.loads((relative_run / "final" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(model_dir.resolve())  # not "model" as typed
    assert saved["task_type"] == "SEQ_CLS"
    assert json.loads((relative_run / "run_config.json").read_text())["model_path"] == model_dir.name
    monkeypatch.chdir(tmp_path)  # transformers' from_pretrained finds the base from anywhere too
    loaded = AutoModelForSequenceClassification.from_pretrained(relative_run / "final")
    assert loaded.name_or_path == str(model_dir.resolve())


def test_predict_on_a_lora_final_from_elsewhere_reproduces_the_runs_evaluation(relative_run, bert_files, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)  # neither the run's directory nor --model's
    metrics = tmp_path / "metrics.json"
    code, err = predict_quietly("--model", relative_run / "final", "--data", bert_files[1], "--label-column", "label",
                                "--metrics-json", metrics, "--max-length", "32")
    assert code == 0, err
    scores = json.loads(metrics.read_text())["metrics"]
    summary = json.loads((relative_run / "summary.json").read_text())
    assert scores["loss"] == pytest.approx(summary["final_eval"]["loss"], abs=1e-5)
    assert (scores["accuracy"], scores["f1"]) == (summary["final_eval"]["accuracy"], summary["final_eval"]["f1"])


def test_an_adapter_whose_base_is_gone_names_base_model_and_merge_lora(relative_run, model_dir, bert_files, tmp_path):
    import shutil

    moved = tmp_path / "final"
    shutil.copytree(relative_run / "final", moved)
    saved = json.loads((moved / "adapter_config.json").read_text())
    saved["base_model_name_or_path"] = "models/gone"  # an adapter saved by hand, from elsewhere, with a relative base
    (moved / "adapter_config.json").write_text(json.dumps(saved))
    code, err = predict_quietly("--model", moved, "--data", bert_files[1], "--output", tmp_path / "p.jsonl")
    assert code == 2
    assert err == (f"predict.py: error: --model {moved} holds LoRA adapters, and its base 'models/gone' (as "
                   "adapter_config.json records it) is not here (no such directory, nor a hub model in the local "
                   "cache); pass the base the run trained on with --base-model DIR, or merge the adapters into full "
                   "weights with looptrain-finetune --merge-lora (its final/merged/ loads alone)\n")
    assert not (tmp_path / "p.jsonl").exists()
    code, err = predict_quietly("--model", moved, "--base-model", model_dir, "--data", bert_files[1],
                                "--output", tmp_path / "p.jsonl")
    assert code == 0, err
    assert len((tmp_path / "p.jsonl").read_text().splitlines()) == 8
    code, err = predict_quietly("--model", relative_run / "final", "--base-model", "nowhere", "--data", bert_files[1],
                                "--output", tmp_path / "p.jsonl")
    assert code == 2 and "--base-model nowhere is not here (no such directory" in err


def test_base_model_with_a_full_model_is_refused(model_dir, bert_files, tmp_path):
    code, err = predict_quietly("--model", model_dir, "--base-model", model_dir, "--data", bert_files[1],
                                "--output", tmp_path / "p.jsonl")
    assert code == 2
    assert err == (f"predict.py: error: --base-model is for a LoRA adapter as --model, and {model_dir} holds a full "
                   "model; drop --base-model\n")


def test_a_causal_lm_adapter_says_causal_lm_and_a_relative_base_is_resolved(tmp_path, monkeypatch):
    from looptrain.lora import save_lora

    tiny_qwen().save_pretrained(tmp_path / "qwen")
    monkeypatch.chdir(tmp_path)
    from transformers import AutoModelForCausalLM

    model = apply_lora(AutoModelForCausalLM.from_pretrained("qwen"), 4)
    save_lora(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (saved["task_type"], saved["base_model_name_or_path"]) == ("CAUSAL_LM", str(tmp_path / "qwen"))
    assert apply_lora(tiny_qwen(), 4).peft_config["default"].base_model_name_or_path is None  # built in code: none


class SigtermAtStep3(Loop):
    """Sends itself SIGTERM at the end of update 3: the run saves checkpoint-3 and exits 143."""

    def on_step_end(self, *, step, **_):
        if step == 3 and self._signals.received is None:
            os.kill(os.getpid(), signal.SIGTERM)


def test_an_interrupted_lora_run_resumes_to_the_same_adapter_bitwise(bert_run, model_dir, bert_files, tmp_path,
                                                                      monkeypatch):
    import looptrain.loop

    output_dir = tmp_path / "cut"
    with monkeypatch.context() as patch:
        patch.setattr(looptrain.loop, "Loop", SigtermAtStep3)  # what the command line builds
        code, out = run_quietly(bert_argv(model_dir, bert_files, output_dir))
    assert code == 143, out
    checkpoint = output_dir / "checkpoint-3"
    names = {path.name for path in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt"} <= names
    assert "model.safetensors" not in names  # the adapters and the head only: the base is --model's

    # Another LoRA setting, or none, is refused naming the flag, and the checkpoint is left as it is.
    code, _ = run_quietly(bert_argv(model_dir, bert_files, output_dir, "--resume", "auto", lora=()))
    assert code == 2
    code, _ = run_quietly(bert_argv(model_dir, bert_files, output_dir, "--resume", str(checkpoint),
                                    lora=("--lora", "8")))
    assert code == 2
    code, _ = run_quietly(bert_argv(model_dir, bert_files, output_dir, "--resume", str(checkpoint), lora=()))
    assert code == 2

    code, out = run_quietly(bert_argv(model_dir, bert_files, output_dir, "--resume", "auto"))
    assert code == 0, out
    assert f"resumed from {checkpoint} at step 3" in out
    reference = load_file(str(bert_run[0] / "final" / "adapter_model.safetensors"))
    resumed = load_file(str(output_dir / "final" / "adapter_model.safetensors"))
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[key], resumed[key]) for key in reference)


def test_resuming_other_lora_settings_names_the_flag(bert_run, model_dir, bert_files, capsys):
    checkpoint = sorted((bert_run[0]).glob("checkpoint-*"))[-1]
    from looptrain.checkpoint import CheckpointError, check_weights_fit

    model = make_tiny_bert(num_labels=2)
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters \(rank 4\).*--lora 4"):
        check_weights_fit(checkpoint, model)
    with pytest.raises(CheckpointError, match=r"--lora 4 in the checkpoint, 8 now"):
        check_weights_fit(checkpoint, apply_lora(make_tiny_bert(num_labels=2), 8))


# ------------------------------------------------------------------ exact accumulation
def peft_reference(model, targets, head=None):
    """LoRA as a plain peft user writes it (no looptrain): rank 4, alpha 8, dropout 0."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                                            modules_to_save=head))


def bert_samples(count: int, seed: int = 0) -> list[dict]:
    """Rows of 3 to 20 tokens with a label (uneven lengths: each micro-batch pads to its own longest)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        ids = torch.randint(5, 30, (int(torch.randint(3, 21, (1,), generator=generator)),), generator=generator)
        rows.append((ids, ids[0] % 3))
    return rows


def bert_batches(rows, size: int) -> list[dict]:
    batches = []
    for start in range(0, len(rows), size):
        chunk = rows[start:start + size]
        width = max(len(ids) for ids, _ in chunk)
        batch = {"input_ids": torch.zeros(len(chunk), width, dtype=torch.long),
                 "attention_mask": torch.zeros(len(chunk), width, dtype=torch.long),
                 "labels": torch.stack([label for _, label in chunk])}
        for row, (ids, _) in enumerate(chunk):
            batch["input_ids"][row, :len(ids)], batch["attention_mask"][row, :len(ids)] = ids, 1
        batches.append(batch)
    return batches


def full_batch_sgd(model, batches, lr: float):
    """The hand-written loop: one SGD step per batch on the model's own mean loss."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for batch in batches:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters() if parameter.requires_grad}


@pytest.mark.parametrize("kind", ["qwen2", "bert"])
def test_lora_accumulation_equals_the_full_batch_loop(kind):
    if kind == "qwen2":
        samples, make, targets, head = lm_samples(48, seed=1), lambda: make_causal_lm("qwen2"), QWEN_TARGETS, None
        to_batches = batched
    else:
        samples, targets, head = bert_samples(48, seed=1), BERT_TARGETS, ["classifier"]
        make, to_batches = make_tiny_bert, bert_batches
    reference = full_batch_sgd(peft_reference(make(), targets, head), to_batches(samples, 16), lr=0.5)
    model = peft_reference(make(), targets, head)
    before = trainable(model)
    Loop(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5), to_batches(samples, 4),
         config=quiet_config(accum_steps=4, max_grad_norm=None)).fit()
    expected, got = trainable(reference), trainable(model)
    assert max((expected[name] - before[name]).abs().max().item() for name in expected) > 1e-2  # training moved them
    assert max((expected[name] - got[name]).abs().max().item() for name in expected) < 1e-6


# ------------------------------------------------------------------ composition with the other levers
def tiny_qwen(hidden: int = 64):
    """A tiny Qwen2 causal LM whose Linears take multiples of 64 inputs (bitsandbytes' 4-bit CPU kernels)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=100, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def train_with(levers: dict, samples, steps: int = 2):
    strategy = Strategy(lora_rank=4, batch_size=4, **levers)
    model = strategy.wrap_model(tiny_qwen())
    optimizer = strategy.build_optimizer(model, 1e-2)
    frozen = {name: parameter.detach().float().clone() for name, parameter in model.named_parameters()
              if not parameter.requires_grad and parameter.dtype.is_floating_point}
    before = trainable(model)
    Loop(model, optimizer, batched(samples, 4),
         config=quiet_config(max_steps=steps, max_grad_norm=None, **strategy.loop_fields())).fit()
    return model, before, frozen


COMPOSED = {"grad-checkpoint": {"gradient_checkpointing": True}, "adamw8bit": {"optimizer": "adamw8bit"},
            "optim-in-backward": {"optimizer_in_backward": True}, "bf16-weights": {"weights": "bf16"}}


@pytest.mark.parametrize("lever, qlora", [(lever, qlora) for lever in sorted(COMPOSED) for qlora in (False, True)])
def test_lora_composes_with_the_lever(lever, qlora):
    levers = {**COMPOSED[lever], "qlora": qlora}
    model, before, frozen = train_with(levers, lm_samples(16, seed=2))
    after = trainable(model)
    # Every adapter moved (the B matrices start at zero: a zero gradient would leave them there), the base did not.
    assert all(not torch.equal(before[name].float(), after[name].float()) for name in before), \
        [name for name in before if torch.equal(before[name], after[name])]
    stored = torch.bfloat16 if lever == "bf16-weights" else torch.float32  # --weights bf16 casts the base once
    assert all(torch.equal(value.to(stored).float(), dict(model.named_parameters())[name].detach().float())
               for name, value in frozen.items())
    if lever == "bf16-weights":
        assert {parameter.dtype for parameter in model.parameters() if parameter.requires_grad} == {torch.bfloat16}


def test_checkpointed_lora_equals_plain_lora_without_input_require_grads():
    """Non-reentrant checkpointing (looptrain's) gives the adapters inside checkpointed blocks their gradients
    although no input requires grad: peft's enable_input_require_grads hook is not needed."""
    samples = lm_samples(16, seed=3)
    plain, _, _ = train_with({}, samples)
    checkpointed, _, _ = train_with({"gradient_checkpointing": True}, samples)
    assert not any(getattr(module, "_require_grads_hook", None) for module in checkpointed.modules())
    expected, got = trainable(plain), trainable(checkpointed)
    assert max((expected[name] - got[name]).abs().max().item() for name in expected) < 1e-6


def test_bf16_weights_store_the_adapters_in_bf16_over_a_base_loaded_in_bf16():
    """peft keeps adapters in fp32 over a bf16 base; --weights bf16 means every weight in bf16 (the estimate's)."""
    model = Strategy(lora_rank=4, weights="bf16").wrap_model(tiny_qwen().to(torch.bfloat16))
    assert {parameter.dtype for parameter in model.parameters() if parameter.is_floating_point()} == {torch.bfloat16}
    fp32 = Strategy(lora_rank=4).wrap_model(tiny_qwen().to(torch.bfloat16))
    assert {parameter.dtype for parameter in fp32.parameters() if parameter.requires_grad} == {torch.float32}


# ------------------------------------------------------------------ QLoRA on GPT-2's Conv1D layers
def tiny_gpt2():
    """A tiny GPT-2 (hidden 64, 2 blocks, dropout off): its projections are transformers' Conv1D, weight [in, out]."""
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def test_qlora_quantizes_gpt2s_conv1d_layers_as_the_linears_they_are():
    """GPT-2's c_attn, c_proj and c_fc (Conv1D: x @ W + b, W stored [in, out]) once quantized nothing (before: 0 layers
    in 4 bits, printed as a "4-bit NF4 base"). Each is now a 4-bit Linear storing W transposed, computing what the
    Conv1D computed up to NF4's rounding."""
    import bitsandbytes as bnb

    reference, model = tiny_gpt2().eval(), apply_lora(tiny_gpt2(), 4, qlora=True, compute_dtype=torch.float32).eval()
    quantized = [name for name, module in model.named_modules() if isinstance(module, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj in each block
    assert not any(type(module).__name__ == "Conv1D" for module in model.modules())
    conv = reference.transformer.h[0].attn.c_attn  # [64, 192]: a transposition shows in the shape
    layer = model.base_model.model.transformer.h[0].attn.c_attn.base_layer
    stored = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
    assert stored.shape == conv.weight.t().shape == (192, 64)
    assert (stored - conv.weight.t()).norm() < 0.1 * conv.weight.norm()  # NF4: about 1/16 of each block's range
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits
    assert (got - expected).norm() < 0.1 * expected.norm()


def test_a_qlora_gpt2_adapter_merges_into_its_full_precision_conv1d_base(tmp_path):
    """The adapter trained over 4-bit Linears records the Conv1D base it belongs to (fan_in_fan_out): merged into
    the full-precision GPT-2, each weight gains exactly (B @ A) transposed, and peft warns of nothing."""
    import warnings

    from looptrain.lora import merge_lora, save_lora

    model = apply_lora(tiny_gpt2(), 4, qlora=True, compute_dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: a trained adapter's update
            parameter.data = torch.randn(parameter.shape, generator=generator)
    save_lora(model, tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fan_in_fan_out.*")
        merged = merge_lora(tiny_gpt2(), tmp_path / "adapter")
    adapter = model.base_model.model.transformer.h[1].mlp.c_fc
    update = adapter.lora_B["default"].weight @ adapter.lora_A["default"].weight * adapter.scaling["default"]
    assert torch.allclose(merged.transformer.h[1].mlp.c_fc.weight, tiny_gpt2().transformer.h[1].mlp.c_fc.weight
                          + update.t(), atol=1e-6)


def test_a_qlora_that_quantizes_nothing_is_refused():
    """QLoRA whose targets hold no block Linear (the head, outside the blocks) stores nothing in 4 bits: refused."""
    from looptrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^QLoRA stores the Linear \(and Conv1D\) layers of the transformer blocks "
                                          r"in 4 bits, and the LoRA targets lm_head of GPT2LMHeadModel hold none: "
                                          r"nothing would be quantized; target block layers \(c_attn, c_proj, c_fc\) "
                                          r"or drop --qlora$"):
        apply_lora(tiny_gpt2(), 4, targets="lm_head", qlora=True)
def test_a_rank_not_below_a_targets_width_is_refused_and_one_below_is_taken():
    """On a 64-wide Qwen2, r 64 would train r x (64 + 64) weights per 64 x 64 projection: more than the layer."""
    from looptrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--lora 64 is not below the width 32 of model\.layers\.0\.self_attn\."
                                          r"[kv]_proj \(64 x 32\); a rank that large trains more than full "
                                          r"fine-tuning; pass a rank below 32 or drop --lora for a full fine-tune$"):
        apply_lora(tiny_qwen(), 64)
    with pytest.raises(ConfigError, match=r"--lora 100000 is not below the width 64 of model\.layers\.0\.self_attn"
                                          r"\.q_proj \(64 x 64\)"):
        apply_lora(tiny_qwen(), 100000, targets="q_proj")
    model = apply_lora(tiny_qwen(), 63, targets="q_proj")
    trainable, total = model.get_nb_trainable_parameters()
    assert trainable == 2 * 63 * (64 + 64)  # two blocks' q_proj adapters, each below the layer's 64 x 64
