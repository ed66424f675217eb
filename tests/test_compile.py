"""`compile=True` (--compile): compiled updates equal eager ones, widths do not recompile, checkpoints stay plain.

Most tests compile with the ``aot_eager`` backend (LOOPTRAIN_COMPILE_BACKEND): it traces forward and backward
as inductor does (dynamo, AOTAutograd, the same graphs and guards) but runs torch's own kernels, so it compiles
in a second. One test, marked slow, runs inductor itself.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend, register_backend

from looptrain import Loop, LoopConfig, estimate
from looptrain.compilation import BACKEND_VARIABLE, compile_model
from looptrain.config import ConfigError
from looptrain.memory.tracker import StorageTracker

from conftest import WORDS, make_tiny_bert, quiet_config, random_token_batches

COMPILES = {"graphs": 0, "runs": 0}


@register_backend(name="looptrain_counting")
def _counting_backend(graph_module, example_inputs):
    """aot_eager that counts the graphs it compiles and the times a compiled graph runs."""
    COMPILES["graphs"] += 1
    compiled = lookup_backend("aot_eager")(graph_module, example_inputs)

    def run(*args):
        COMPILES["runs"] += 1
        return compiled(*args)

    return run


@pytest.fixture(autouse=True, scope="module")
def empty_dynamo_caches():
    """The module starts and ends with dynamo's caches empty; its tests share the graphs they compile (as the
    models of one process do), so a test that counts compilations empties them itself."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def counting_backend(monkeypatch):
    """Every test compiles with the counting aot_eager backend, its counts at zero."""
    monkeypatch.setenv(BACKEND_VARIABLE, "looptrain_counting")
    COMPILES.update(graphs=0, runs=0)
    return COMPILES


def make_lm(seed: int = 0):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def lm_batches(widths, rows: int = 2, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for width in widths:
        ids = torch.randint(3, 100, (rows, width), generator=generator)
        labels = ids.clone()
        labels[:, : width // 3] = -100  # a prompt, not scored
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return batches


def build(make_model, lora: int = 0) -> torch.nn.Module:
    model = make_model()
    if lora:
        from looptrain.lora import apply_lora

        model = apply_lora(model, lora)
    return model


def train(make_model, batches, *, compiled: bool, lora: int = 0, **fields) -> torch.nn.Module:
    """The model after `Loop.fit` over `batches` with SGD (no Adam: its normalisation would amplify rounding noise
    in gradients near zero into whole steps)."""
    model = build(make_model, lora)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    Loop(model, optimizer, batches, config=quiet_config(compile=compiled, **fields)).fit()
    return model


def relative_difference(first: torch.nn.Module, second: torch.nn.Module) -> float:
    """The largest difference of a weight, relative to the largest magnitude in its tensor (at least 1e-3).

    The floor: a tensor whose true gradient is zero holds rounding noise only (attention's key bias: softmax ignores
    a shift shared by every key), and noise differs between kernels; relative to itself it would be 100%.
    """
    first_state, second_state = first.state_dict(), second.state_dict()
    assert list(first_state) == list(second_state)
    return max(float((first_state[name].float() - second_state[name].float()).abs().max()
                     / second_state[name].float().abs().max().clamp(min=1e-3)) for name in first_state)


def bert_batches(widths) -> list[dict]:
    """One batch of 4 rows per width, padded to it (dynamic padding): rows of uneven lengths."""
    return random_token_batches([[width, max(1, width - 3), max(1, width // 2), width - 1] for width in widths],
                                vocab_size=len(WORDS) + 5)


def one_layer_bert():
    return make_tiny_bert(num_layers=1)


WIDTHS = [7, 19, 11, 30, 5, 24]  # six widths, one per micro-batch
BERT_BATCHES = bert_batches(WIDTHS)
BERT_BATCHES[-1] = {key: value[:3] for key, value in BERT_BATCHES[-1].items()}  # and a partial last batch


def assert_equal_to_eager(make_model, batches, tolerance, lora: int = 0, **fields) -> torch.nn.Module:
    eager = train(make_model, batches, compiled=False, lora=lora, **fields)
    compiled = train(make_model, batches, compiled=True, lora=lora, **fields)
    assert COMPILES["runs"] >= len(batches)  # every micro-batch ran a compiled graph
    assert relative_difference(compiled, eager) <= tolerance
    assert relative_difference(build(make_model, lora), eager) > 10 * tolerance  # training moved the weights more
    return compiled


@pytest.mark.slow  # over 4 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_compiled_updates_equal_eager_ones_and_six_widths_compile_at_most_twice(counting_backend):
    torch._dynamo.reset()  # counts this test's compilations only
    assert_equal_to_eager(one_layer_bert, BERT_BATCHES, 1e-5, accum_steps=2)
    # Dynamic shapes: the six widths and the short batch share one graph; the second is transformers' doing (the
    # first forward of a sequence classifier sets config.problem_type, a value the first graph was guarded on).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2
    assert counting_backend["runs"] == len(BERT_BATCHES)


@pytest.mark.slow  # ~10 s on 2 cores
def test_a_causal_lm_compiles_its_own_loss_equal_to_eager_chunked_ce(capsys, counting_backend):
    assert_equal_to_eager(make_lm, lm_batches([9, 14, 6, 11]), 1e-5, accum_steps=2)  # eager: chunked CE (auto)
    assert "chunked cross-entropy is off under --compile" in capsys.readouterr().out


INTERPLAY = {  # name: (LoopConfig fields, LoRA rank, tolerance on the weights' relative difference)
    "checkpointing + fused step": ({"gradient_checkpointing": True, "optimizer_in_backward": True}, 0, 1e-5),
    "bf16 autocast + checkpointing": ({"accum_steps": 2, "precision": "bf16", "gradient_checkpointing": True}, 0,
                                      1e-2),
    "fp16 + GradScaler + LoRA": ({"accum_steps": 2, "precision": "fp16"}, 4, 1e-2),
    "bf16 weights": ({"weights": "bf16", "max_grad_norm": None}, 0, 1e-2),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(INTERPLAY))
def test_compile_with_checkpointing_fused_step_autocast_lora_and_bf16_weights(name):
    fields, lora, tolerance = INTERPLAY[name]
    assert_equal_to_eager(one_layer_bert, BERT_BATCHES[:4], tolerance, lora=lora, **fields)


@pytest.mark.slow  # 6-7 s: make test stays under 5 minutes on 2 cores; .ci/run runs it
def test_a_compiled_run_saves_plain_state_dict_keys_and_resumes_exactly(tmp_path):
    from transformers import BertForSequenceClassification

    batches = BERT_BATCHES[:4]
    fields = {"max_steps": 4, "eval_every": 2, "epochs": 2}
    first = one_layer_bert()
    Loop(first, torch.optim.AdamW(first.parameters(), lr=1e-3), batches,
         config=quiet_config(compile=True, output_dir=str(tmp_path / "run"), **fields)).fit()
    assert not any("_orig_mod" in key for key in first.state_dict())
    saved = BertForSequenceClassification.from_pretrained(tmp_path / "run" / "checkpoint-4")  # a plain model
    assert relative_difference(saved, first) == 0.0
    resumed = one_layer_bert()
    Loop(resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-3), batches,
         config=quiet_config(compile=True, output_dir=str(tmp_path / "resumed"),
                             resume=str(tmp_path / "run" / "checkpoint-2"), **fields)).fit()
    assert relative_difference(resumed, first) <= 1e-6


@pytest.mark.slow  # the whole command line: estimate, tokenize, compile, save
def test_the_command_line_trains_compiled_and_its_final_model_loads_plain(model_dir, tmp_path, counting_backend):
    from transformers import AutoModelForSequenceClassification

    from looptrain.cli import finetune

    from conftest import write_csv

    train_file = write_csv(tmp_path / "train.csv", 16)
    out = tmp_path / "out"
    assert finetune.main(["--model", str(model_dir), "--data", str(train_file), "--output-dir", str(out),
                          "--max-length", "32", "--max-steps", "2", "--batch-size", "4", "--eval-every", "no",
                          "--compile", "--no-track-memory", "--no-progress-bar"]) == 0
    assert counting_backend["runs"] >= 2  # the updates ran compiled
    assert (out / "summary.json").is_file()
    _, loading = AutoModelForSequenceClassification.from_pretrained(out / "final", output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]  # plain keys, no _orig_mod. prefix


@pytest.mark.slow  # 7 s: torch.compile; .ci/run runs it, make test stays under 5 minutes
def test_compile_model_keeps_the_module_its_parameters_and_evaluation_works(counting_backend):
    model = one_layer_bert()
    parameters = list(model.parameters())
    assert compile_model(model, True) is model and list(model.parameters()) == parameters
    batch = bert_batches([9])[0]
    eager_logits = one_layer_bert().eval()(**batch).logits
    with torch.no_grad():
        compiled_logits = model.eval()(**batch).logits
    assert counting_backend["runs"] == 1
    assert torch.allclose(compiled_logits, eager_logits, atol=1e-6)


@pytest.mark.slow  # 6 s: torch.compile; .ci/run runs it, make test stays under 5 minutes
def test_the_tensor_tracker_makes_a_compiled_model_run_eagerly(counting_backend):
    """Why compile refuses track_memory on a CPU: under the tracker (a dispatch mode) no compiled graph runs. It counts
    graph runs, so it empties dynamo's caches first (the slow tests before it leave graphs of the same model)."""
    torch._dynamo.reset()
    model = compile_model(one_layer_bert(), True)
    batch = bert_batches([9])[0]
    model(**batch).loss.backward()
    runs = counting_backend["runs"]
    assert runs == 1  # compiled
    with StorageTracker() as tracker:
        model(**batch).loss.backward()
    assert counting_backend["runs"] == runs and tracker.peak_bytes > 0  # eager: the tracker saw every tensor


@pytest.mark.parametrize("fields, message", [
    ({"track_memory": True}, r"compile=True \(--compile\) cannot run under the CPU tensor tracker.*--no-track-memory"),
    ({"chunked_ce": "on"}, r"compile=True \(--compile\).*chunked_ce='on'.*--chunked-ce auto or off"),
])
def test_compile_refuses_what_it_cannot_run(fields, message):
    with pytest.raises(ConfigError, match=message):
        LoopConfig(compile=True, device="cpu", **{"track_memory": False, **fields})


def test_the_estimate_of_a_compiled_strategy_is_the_eager_one():
    from looptrain.estimation.estimator import as_run_eagerly
    from looptrain.strategy import Strategy

    assert as_run_eagerly(Strategy(compile=True)) == Strategy(chunked_ce="off")
    bert = make_tiny_bert().config
    assert estimate(bert, 4, 16, compile=True)["peak_memory_bytes"] == estimate(bert, 4, 16)["peak_memory_bytes"]


@pytest.mark.slow
@pytest.mark.hardware  # .ci/run: natively with the slow tests, then as an AVX2 CPU on the same inductor cache root
def test_inductor_updates_equal_eager_ones(monkeypatch):
    """The real backend (C++ kernels generated and built): the same updates to fp32 noise. Run as an AVX2 CPU after
    a native run, it once read the native run's cached graphs and crashed (`isolate_inductor_cache`)."""
    monkeypatch.setenv(BACKEND_VARIABLE, "inductor")
    torch._dynamo.reset()  # dynamo would reuse this module's aot_eager graphs: their guards do not name the backend
    eager = train(one_layer_bert, BERT_BATCHES, compiled=False, accum_steps=2)
    compiled = train(one_layer_bert, BERT_BATCHES, compiled=True, accum_steps=2)
    assert relative_difference(compiled, eager) <= 1e-5


def test_inductors_default_cache_is_kept_per_cpu_capability_and_a_users_directory_is_kept(monkeypatch, tmp_path):
    """One inductor cache shared by a native run and an AVX2-emulated one (ATEN_CPU_CAPABILITY=avx2) served the
    first run's graphs to the second, which crashed: the default directory gets the capability as a suffix."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from looptrain.compilation import isolate_inductor_cache

    capability = torch.backends.cpu.get_cpu_capability().lower()
    monkeypatch.setenv(BACKEND_VARIABLE, "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compile_model(torch.nn.Linear(2, 2), enabled=True)  # nothing is compiled before the first call
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == f"{default_cache_dir()}-{capability}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch writes back once it has read it
    assert isolate_inductor_cache() == f"{default_cache_dir()}-{capability}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert isolate_inductor_cache() == str(tmp_path)
