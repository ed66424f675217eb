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

from looptrain import Loop, Strategy
from looptrain.cli import finetune
from looptrain.lora import apply_lora

from conftest import make_tiny_bert, quiet_config, write_csv
from test_causal_lm import batched, lm_samples, make_causal_lm
from test_finetune_causal_lm import make_lm_tokenizer, text_rows, write_jsonl

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


class SigtermAtStep3(Loop):
    """Sends itself SIGTERM at the end of update 3: the run saves checkpoint-3 and exits 143."""

    def on_step_end(self, *, step, **_):
        if step == 3 and self._signals.received is None:
            os.kill(os.getpid(), signal.SIGTERM)


def test_an_interrupted_lora_run_resumes_to_the_same_adapter_bitwise(bert_run, model_dir, bert_files, tmp_path,
                                                                      monkeypatch):
    import looptrain

    output_dir = tmp_path / "cut"
    with monkeypatch.context() as patch:
        patch.setattr(looptrain, "Loop", SigtermAtStep3)
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
    from looptrain.state import CheckpointError, check_weights_fit

    model = make_tiny_bert(num_labels=2)
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters \(rank 4\).*--lora 4"):
        check_weights_fit(checkpoint, model)
    with pytest.raises(CheckpointError, match=r"--lora 4 in the checkpoint, 8 now"):
        check_weights_fit(checkpoint, apply_lora(make_tiny_bert(num_labels=2), 8))
