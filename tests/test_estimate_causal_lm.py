"""The estimator and the planner on causal LMs: token labels shifted by the model, the tied embedding, GQA."""

from __future__ import annotations

import json

import pytest
import torch

from looptrain import Loop, LoopConfig, estimation, planning
from looptrain.cli import finetune
from looptrain.cli.estimate import main as estimate_main
from looptrain.data import DynamicPaddingCollator
from looptrain.strategy import Strategy

# The estimator runs the Loop's own update on fake tensors: on these models it is within 0.2% of the tracker.
TOLERANCE = 0.01


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0)


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)


CONFIGS = {"qwen2 tied": qwen2_config, "llama": llama_config, "gpt2": gpt2_config}
MIXES = {  # one per shape (each shape with every mix is within 0.2% too; the suite keeps it short)
    "bf16 weights + adafactor fused": {"weights": "bf16", "optimizer": "adafactor", "optimizer_in_backward": True},
    "bf16 + checkpointing + accumulation 2": {"precision": "bf16", "gradient_checkpointing": True, "accum_steps": 2},
    "fp32 adamw": {},
}


def causal_lm(make_config, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(make_config())


@pytest.mark.parametrize("shape, mix", list(zip(CONFIGS, MIXES)))
def test_estimate_matches_the_peak_of_a_real_loop_fit(shape, mix):
    options = MIXES[mix]
    estimated = estimation.estimate(causal_lm(CONFIGS[shape]), 2, 24, **options)
    measured = estimation.measure(causal_lm(CONFIGS[shape]), 2, 24, **options)
    assert measured["memory_meter"] == "cpu_tensor_tracker" and measured["optimizer_steps"] == 2
    error = abs(estimated["peak_memory_bytes"] - measured["peak_memory_bytes"]) / measured["peak_memory_bytes"]
    assert error <= TOLERANCE, (shape, mix, estimated["peak_memory_bytes"], measured["peak_memory_bytes"])
    assert estimated["memory_breakdown"]["params"] == measured["memory_breakdown"]["params"]


def test_a_config_is_built_as_the_causal_lm_it_describes():
    from transformers import BertConfig

    config = qwen2_config()
    assert estimation.shapes.is_causal_lm_config(config)
    assert not estimation.shapes.is_causal_lm_config(BertConfig())  # a BERT config stays a classifier
    model = causal_lm(qwen2_config)
    from_config = estimation.estimate(config, 2, 16)
    from_module = estimation.estimate(model, 2, 16)
    # The tied embedding is one parameter: counted once, and the same model either way.
    assert from_config["parameters"] == from_module["parameters"] == sum(p.numel() for p in model.parameters())
    assert from_config["peak_memory_bytes"] == from_module["peak_memory_bytes"]
    # The LM head's logits are priced: the peak grows with the vocabulary.
    wider = qwen2_config()
    wider.vocab_size = 4096
    assert estimation.estimate(wider, 2, 16)["peak_memory_bytes"] > from_config["peak_memory_bytes"] * 2


def test_presets_have_the_published_shapes():
    config = estimation.preset_config("qwen2.5-1.5b")
    assert (config.model_type, config.vocab_size, config.hidden_size, config.intermediate_size,
            config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.tie_word_embeddings) == ("qwen2", 151936, 1536, 8960, 28, 12, 2, True)
    assert estimation.shapes.is_causal_lm_config(estimation.preset_config("qwen2.5-0.5b"))


def test_a_padded_batch_is_priced_with_its_mask_and_repeated_kv_heads():
    # A whole-row batch lets sdpa run causal GQA on the KV heads as they are; a padded one builds a mask
    # and repeats the KV heads, in the real run as in the estimate.
    model = causal_lm(qwen2_config)
    whole = estimation.estimate(model, 4, 32)["peak_memory_bytes"]
    padded = estimation.estimate(model, 4, 32, padded=True)["peak_memory_bytes"]
    assert padded > whole


def save_qwen2_dir(directory):
    qwen2_config().save_pretrained(directory)
    return directory


@pytest.mark.slow  # over 6 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_lowest_json_is_the_minimum_and_its_flags_train_it(tmp_path, capsys):
    model_dir = save_qwen2_dir(tmp_path / "qwen2")
    assert not any(path.name.endswith((".safetensors", ".bin")) for path in model_dir.iterdir())  # no weights
    assert estimate_main(["--model", str(model_dir), "--seq-len", "32", "--batch-size", "1", "--lowest", "--json",
                          "--cpu-kind", "native-bf16"]) == 0
    result = json.loads(capsys.readouterr().out)
    tried = [entry["estimated_peak_bytes"] for entry in result["tried"]]
    assert len(tried) >= 6 and result["estimated_peak_bytes"] == min(tried)
    strategy = Strategy(**result["settings"]["strategy"])
    assert strategy.flags() == result["settings"]["flags"]
    assert not (strategy.freeze_embeddings or strategy.freeze_layers or strategy.freeze_encoder)
    arguments = finetune.build_parser().parse_args(result["settings"]["flags"])
    assert all(getattr(arguments, name) == value for name, value in result["settings"]["strategy"].items()
               if hasattr(arguments, name))
    assert set(result["memory_breakdown"]) >= {"params", "grads", "optimizer_state", "activations_and_temps"}
    # bf16 weights are the lowest numerics where bf16 is native; a lever passed on the command line is kept.
    assert strategy.weights == "bf16"
    assert estimate_main(["--model", str(model_dir), "--seq-len", "32", "--batch-size", "1", "--lowest", "--json",
                          "--cpu-kind", "no-bf16", "--optim", "adamw", "--grad-checkpoint"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["settings"]["strategy"]["optimizer"] == "adamw"
    chosen = kept["settings"]["strategy"]
    assert chosen["gradient_checkpointing"] and chosen["checkpoint_every"] == 1
    assert kept["settings"]["strategy"]["weights"] == "fp32" and kept["settings"]["strategy"]["precision"] == "fp32"
    assert kept["estimated_peak_bytes"] == min(entry["estimated_peak_bytes"] for entry in kept["tried"])


def test_lowest_refuses_freezing(tmp_path, capsys):
    model_dir = save_qwen2_dir(tmp_path / "qwen2")
    assert estimate_main(["--model", str(model_dir), "--seq-len", "16", "--batch-size", "1", "--lowest",
                          "--freeze-layers", "1"]) == 2
    assert "the lowest full fine-tune freezes nothing: drop freeze_layers" in capsys.readouterr().err


class CausalLMCollator(DynamicPaddingCollator):
    """Pads input_ids like DynamicPaddingCollator, and token labels with -100."""

    def __call__(self, features):
        batch = super().__call__([{key: value for key, value in item.items() if key != "labels"}
                                  for item in features])
        labels = torch.full_like(batch["input_ids"], -100)
        for row, item in enumerate(features):
            labels[row, :len(item["labels"])] = torch.tensor(item["labels"])
        batch["labels"] = labels
        return batch


class TokenDataset(torch.utils.data.Dataset):
    """Causal-LM samples as a TokenizedDataset holds them: unpadded input_ids, their labels, `lengths`."""

    def __init__(self, count: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = [torch.randint(3, 256, (int(length),), generator=generator).tolist()
                          for length in torch.randint(4, 20, (count,), generator=generator)]
        self.input_ids[5] = self.input_ids[5] + [7] * (40 - len(self.input_ids[5]))  # one long sample: 40 tokens
        self.lengths = [len(ids) for ids in self.input_ids]

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, index):
        ids = self.input_ids[index]
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids}


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_the_planner_plans_a_causal_lm_dataset_for_its_worst_batch():
    dataset, collator = TokenDataset(32), CausalLMCollator(0, max_length=48)
    model = causal_lm(qwen2_config)
    low = estimation.estimate(model, 2, 40, accum_steps=4, padded=True)["peak_memory_bytes"]
    high = estimation.estimate(model, 4, 40, accum_steps=2, padded=True)["peak_memory_bytes"]
    budget = int(1.05 * (low + high) / 2)
    result = planning.plan(model, dataset, collator, memory_budget=budget, effective_batch=8, probe=False,
                           token_micro_batches=False)  # the splits as searched, trained as they are
    assert result.worst_width == 40  # the longest padded batch, in tokens
    for candidate in result.candidates:
        assert candidate.settings.batch_size * candidate.settings.accum_steps == 8
        assert candidate.estimated_peak_bytes * (1 + result.margin) <= budget
    plain = [c.settings.batch_size for c in result.candidates if not c.settings.gradient_checkpointing
             and not c.settings.optimizer_in_backward]
    assert plain == [2]
    # The plain winner, trained for real on the dataset's worst batch (the long sample and its padded neighbours):
    # within the budget.
    settings = next(c.settings for c in result.candidates if not c.settings.gradient_checkpointing
                    and not c.settings.optimizer_in_backward)
    order = sorted(range(len(dataset)), key=lambda index: -dataset.lengths[index])
    batches = [collator([dataset[index] for index in order[:settings.batch_size]])] * (2 * settings.accum_steps)
    loop = Loop(model, settings.build_optimizer(model, 1e-3), batches,
                config=LoopConfig(**settings.loop_fields(), device="cpu", progress_bar=False, eval_every="no",
                                  log_every=1000, track_memory=True))
    measured = loop.fit()["peak_memory_bytes"]
    estimated = next(c.estimated_peak_bytes for c in result.candidates if c.settings == settings)
    # At most the estimate (2% for noise): the estimate pads one token per row, the real worst batch more, which
    # the chunked cross-entropy (on by default for causal LMs) drops before the head.
    assert measured <= budget and 0.9 * estimated <= measured <= 1.02 * estimated, (measured, estimated)


def test_json_with_ladder_is_refused(capsys):
    # --json prints one estimate (tests/test_estimate_lora.py) or --lowest's search, not the ladder's table.
    assert estimate_main(["--preset", "qwen2.5-0.5b", "--json", "--ladder"]) == 2
    assert "--json prints one estimate or --lowest's result, not --ladder's table" in capsys.readouterr().err


def test_lowest_tries_a_math_preserving_lever_the_strategy_gains():
    # A lever added later (the chunked cross-entropy) is searched by its name, with no change to the search.
    from dataclasses import dataclass

    from looptrain.strategy import lever

    @dataclass(kw_only=True)
    class WithChunkedLoss(Strategy):
        chunked_ce: bool = lever(False, flag="--chunked-ce", applied_by="model", help="a lever declared in the test")

    fixed = ("optimizer", "gradient_checkpointing", "checkpoint_every", "optimizer_in_backward")  # a short search
    result = planning.lowest(qwen2_config(), 1, 16, WithChunkedLoss(), native_bf16=False, fixed=fixed)
    assert any("--chunked-ce" in entry.flags() for entry, _ in result.tried)
    assert result.settings.chunked_ce  # it saves nothing here: a tie keeps it on
    assert result.estimate["peak_memory_bytes"] == min(peak for _, peak in result.tried)
