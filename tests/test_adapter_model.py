"""A peft LoRA adapter directory (a --lora run's final/) as `looptrain-finetune --model`: its own adapters loaded
bitwise and trained on, its base frozen, its rank and targets kept (the --lora flags refused beside it), its files
part of the run's identity, and the estimate priced with them."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_finetune_causal_lm import save_tiny_llama, text_rows, write_jsonl

from looptrain.cli import estimate, finetune


def run_quietly(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = finetune.main([str(value) for value in argv])
    return code, out.getvalue(), err.getvalue()


def lm_argv(model, data, output_dir, *extra) -> list:
    return ["--task", "causal-lm", "--model", model, "--data", data, "--output-dir", output_dir, "--max-steps", "2",
            "--batch-size", "4", "--max-length", "16", "--lr", "1e-2", "--no-track-memory", "--no-progress-bar",
            *extra]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny Llama, its data, and a --lora 4 run of 2 updates on it (its final/ is the adapter)."""
    root = tmp_path_factory.mktemp("adapter-model")
    base, data = save_tiny_llama(root / "llama"), write_jsonl(root / "train.jsonl", text_rows(8))
    code, out, err = run_quietly(lm_argv(base, data, root / "first", "--lora", "4", "--lora-alpha", "16"))
    assert code == 0, out + err
    return base, data, root / "first" / "final"


def test_an_adapter_continues_training_from_its_saved_weights_on_a_frozen_base(lora_run, tmp_path, monkeypatch):
    from peft import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    import looptrain.lora

    base, data, adapter = lora_run
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert (saved["task_type"], saved["r"], saved["lora_alpha"]) == ("CAUSAL_LM", 4, 16)
    seen = {}
    load_lora = looptrain.lora.load_lora

    def spy(model, directory, **options):  # what the run trains from, right after loading
        loaded = seen["model"] = load_lora(model, directory, **options)
        seen["adapter"] = {key: value.clone() for key, value in get_peft_model_state_dict(loaded).items()}
        seen["trainable"] = [name for name, parameter in loaded.named_parameters() if parameter.requires_grad]
        return loaded

    monkeypatch.setattr(looptrain.lora, "load_lora", spy)
    code, out, err = run_quietly(lm_argv(adapter, data, tmp_path / "second"))
    assert code == 0, out + err
    assert f"continuing the adapters of {adapter}: LoRA rank 4 (alpha 16)" in out
    assert "estimated peak of live tensors: " in out  # the run's own estimate, of the loaded adapter
    recipe = (tmp_path / "second" / "config.yaml").read_text()
    assert f"model: {adapter}" in recipe and "lora" not in recipe  # the adapter brings them: a rerun takes it again
    written = load_file(str(adapter / "adapter_model.safetensors"))
    assert written.keys() == seen["adapter"].keys()
    assert all(torch.equal(written[key], seen["adapter"][key]) for key in written)  # loaded bitwise
    assert seen["trainable"] and all("lora_" in name for name in seen["trainable"])
    original = AutoModelForCausalLM.from_pretrained(base).state_dict()
    frozen = {name.removeprefix("base_model.model."): parameter for name, parameter
              in seen["model"].named_parameters() if "lora_" not in name}
    assert frozen and all(torch.equal(parameter, original[name.replace(".base_layer", "")])
                          for name, parameter in frozen.items())  # the base after training: unchanged
    continued = load_file(str(tmp_path / "second" / "final" / "adapter_model.safetensors"))
    assert any(not torch.equal(continued[key], written[key]) for key in written)  # the adapters trained on
    resaved = json.loads((tmp_path / "second" / "final" / "adapter_config.json").read_text())
    assert (resaved["task_type"], resaved["r"], resaved["base_model_name_or_path"]) == ("CAUSAL_LM", 4,
                                                                                        str(base.resolve()))


def identity_of(argv) -> dict:
    from looptrain.cli.finetune.request import Process

    argv = [str(value) for value in argv]
    flags = finetune.request_of(finetune.build_parser().parse_args(argv), Process(argv=tuple(argv))).flags
    return finetune.run_identity(flags, flags.adapter["base"] if flags.adapter else flags.model, 1)


def test_the_adapters_files_are_part_of_the_runs_identity(lora_run, tmp_path):
    base, data, adapter = lora_run
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    before = identity_of(lm_argv(copy, data, tmp_path / "run"))
    assert before["lora"]["rank"] == 4 and before["model"] == identity_of(lm_argv(base, data, tmp_path / "run",
                                                                                  "--lora", "4"))["model"]
    weights = load_file(str(copy / "adapter_model.safetensors"))
    save_file({key: value + 1 for key, value in weights.items()}, str(copy / "adapter_model.safetensors"))
    after = identity_of(lm_argv(copy, data, tmp_path / "run"))
    weights_file = "adapter_model.safetensors"
    assert before["lora"]["adapter"][weights_file] != after["lora"]["adapter"][weights_file]
    assert {**before, "lora": None} == {**after, "lora": None}


@pytest.mark.slow  # two more runs; the identity above is what refuses, the ledger's refusal is tested on its own
def test_a_resume_onto_another_adapter_is_refused(lora_run, tmp_path):
    base, data, adapter = lora_run
    copy = tmp_path / "adapter"
    shutil.copytree(adapter, copy)
    code, out, err = run_quietly(lm_argv(copy, data, tmp_path / "run", "--max-steps", "1"))
    assert code == 0, out + err
    weights = load_file(str(copy / "adapter_model.safetensors"))  # the same directory, other adapters in it
    save_file({key: value + 1 for key, value in weights.items()}, str(copy / "adapter_model.safetensors"))
    code, out, err = run_quietly(lm_argv(copy, data, tmp_path / "run", "--max-steps", "1", "--resume", "auto"))
    assert code == 2
    assert re.search(r"is another run; these settings differ \(saved -> now\):\n  lora\.adapter\."
                     r"adapter_model\.safetensors\.", err), err


@pytest.mark.parametrize("extra, message", [
    (("--lora", "8"), r"--model \S+ is a LoRA adapter, which keeps its own rank, alpha, dropout and targets "
                      r"\(adapter_config.json\) and trains on its base as saved; drop --lora \(or pass the base"),
    (("--qlora",), r"drop --qlora \(or pass the base as --model to train new adapters\)"),
    (("--lora-targets", "q_proj"), r"drop --lora-targets"),
])
def test_lora_flags_beside_an_adapter_are_refused(lora_run, tmp_path, extra, message):
    base, data, adapter = lora_run
    code, out, err = run_quietly(lm_argv(adapter, data, tmp_path / "run", *extra))
    assert code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_an_adapter_of_another_task_names_its_task(lora_run, tmp_path):
    base, data, adapter = lora_run
    code, out, err = run_quietly(["--model", adapter, "--data", data, "--output-dir", tmp_path / "run"])
    assert code == 2
    assert f"--model {adapter} holds LoRA adapters of a causal lm model; pass --task causal-lm" in err


def test_the_estimate_prices_an_adapter_with_its_own_rank_and_targets(lora_run, capsys):
    base, data, adapter = lora_run
    assert estimate.main(["--model", str(adapter), "--seq-len", "16", "--batch-size", "2", "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    adapter_weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert priced["trainable_parameters"] == sum(tensor.numel() for tensor in adapter_weights.values())
    assert estimate.main(["--model", str(adapter), "--lora", "8"]) == 2
    assert "drop --lora" in capsys.readouterr().err
