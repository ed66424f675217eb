"""scripts/finetune.py --task causal-lm end to end, in-process through main(argv), on a tiny Llama and made-up data."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from looptrain.cli import finetune
from looptrain.data import DataError, DynamicPaddingCollator, read_lm_data, tokenize_lm

from conftest import WORDS

SPECIALS = ["<pad>", "<unk>", "<eos>"]
CHAT_TEMPLATE = ("{% for message in messages %}<{{ message['role'] }}> {{ message['content'] }} <eos> {% endfor %}"
                 "{% if add_generation_prompt %}<assistant> {% endif %}")


def make_lm_tokenizer(chat_template: str | None = None):
    """A fast word-level tokenizer over WORDS with pad and EOS tokens (and role tokens for the chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS + ["<user>", "<assistant>"] + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<eos>", model_max_length=64)
    tokenizer.chat_template = chat_template
    return tokenizer


def save_tiny_llama(directory, chat_template: str | None = None):
    """A tiny Llama causal LM (2 blocks, tied embeddings) and its tokenizer, saved like a hub checkpoint.

    Llama, not Qwen2: transformers 5 loads a qwen2 checkpoint's tokenizer as Qwen2Tokenizer, which rebuilds a
    byte-level BPE from the vocabulary instead of reading tokenizer.json's word-level model.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = make_lm_tokenizer(chat_template)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def chat_llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-chat-llama"), CHAT_TEMPLATE)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def text_rows(count: int, seed: int = 0) -> list[dict]:
    """A learnable language: each sentence counts up WORDS from a random start."""
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        start, length = generator.randrange(len(WORDS) - 8), generator.randint(3, 8)
        rows.append({"text": " ".join(WORDS[start:start + length])})
    return rows


def prompt_rows(count: int, seed: int = 0) -> list[dict]:
    generator = random.Random(seed)
    return [{"prompt": " ".join(generator.choice(WORDS) for _ in range(generator.randint(2, 5))),
             "response": " " + " ".join(generator.choice(WORDS) for _ in range(generator.randint(1, 4)))}
            for _ in range(count)]


def run(model_dir, data, output_dir, *extra, eval_data=None):
    argv = ["--task", "causal-lm", "--model", str(model_dir), "--data", str(data), "--output-dir", str(output_dir),
            "--max-length", "32", "--lr", "3e-3", "--no-track-memory", "--no-progress-bar", *extra]
    if eval_data is not None:
        argv += ["--eval-data", str(eval_data)]
    return finetune.main(argv)


def events(output_dir) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ reading and tokenizing
def test_text_samples_end_with_eos_and_their_labels_are_their_ids(tmp_path):
    tokenizer = make_lm_tokenizer()
    data = read_lm_data(write_jsonl(tmp_path / "train.jsonl", text_rows(4)))
    assert data.kind == "text"
    dataset = tokenize_lm(data, tokenizer, 32)
    for ids, labels in zip(dataset.input_ids, dataset.labels):
        assert ids[-1] == tokenizer.eos_token_id and ids.count(tokenizer.eos_token_id) == 1
        assert labels == ids  # loss on every token (the model shifts them)
    assert tokenizer.decode(dataset.input_ids[0][:-1]) == data.texts[0]


def test_prompt_positions_are_masked_in_the_collated_batch(tmp_path):
    tokenizer = make_lm_tokenizer()
    # TRL's convention: the completion carries the space that parts it from the prompt (they are tokenized joined).
    rows = [{"prompt": "the good movie", "response": " great fun"}, {"prompt": "a", "response": " bad plot ending"}]
    path = tmp_path / "sft.csv"
    path.write_text("prompt,response\n" + "".join(f"{row['prompt']},{row['response']}\n" for row in rows))
    data = read_lm_data(path)
    assert data.kind == "prompt_response"
    batch = DynamicPaddingCollator(tokenizer)([tokenize_lm(data, tokenizer, 32)[index] for index in range(2)])
    ids = {word: tokenizer.convert_tokens_to_ids(word) for word in "the good movie great fun a bad plot ending".split()}
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[ids["the"], ids["good"], ids["movie"], ids["great"], ids["fun"], eos],
                                           [ids["a"], ids["bad"], ids["plot"], ids["ending"], eos, pad]]
    assert batch["labels"].tolist() == [[-100, -100, -100, ids["great"], ids["fun"], eos],
                                        [-100, ids["bad"], ids["plot"], ids["ending"], eos, -100]]
    assert batch["attention_mask"].tolist() == [[1] * 6, [1] * 5 + [0]]


def test_messages_render_with_the_chat_template_and_mask_all_but_the_last_answer(tmp_path):
    tokenizer = make_lm_tokenizer(CHAT_TEMPLATE)
    chat = [{"role": "user", "content": "good movie"}, {"role": "assistant", "content": "great fun"}]
    data = read_lm_data([{"messages": chat}])
    dataset = tokenize_lm(data, tokenizer, 32)
    tokens = tokenizer.convert_ids_to_tokens(dataset.input_ids[0])
    assert tokens == ["<user>", "good", "movie", "<eos>", "<assistant>", "great", "fun", "<eos>"]
    scored = [token for token, label in zip(tokens, dataset.labels[0]) if label != -100]
    assert scored == ["great", "fun", "<eos>"]  # no second EOS: the template's own ends the sample
    # A messages cell of a CSV file is the chat's JSON text.
    path = tmp_path / "chats.csv"
    path.write_text('messages\n"' + json.dumps(chat).replace('"', '""') + '"\n')
    assert read_lm_data(path).messages == [chat]


def test_messages_without_a_chat_template_name_the_fix(llama_dir, tmp_path, capsys):
    chats = [{"messages": [{"role": "user", "content": "good"}, {"role": "assistant", "content": "fun"}]}] * 4
    assert run(llama_dir, write_jsonl(tmp_path / "chats.jsonl", chats), tmp_path / "out") == 2
    error = capsys.readouterr().err
    assert "no chat template" in error and "tokenizer.chat_template" in error and "Traceback" not in error


def test_messages_train_with_a_chat_template(chat_llama_dir, tmp_path, capsys):
    chats = [{"messages": [{"role": "user", "content": row["prompt"]},
                           {"role": "assistant", "content": row["response"]}]} for row in prompt_rows(8)]
    data = write_jsonl(tmp_path / "chats.jsonl", chats)
    assert run(chat_llama_dir, data, tmp_path / "out", "--max-steps", "2", "--batch-size", "4",
               "--eval-every", "no") == 0
    printed = capsys.readouterr().out
    assert "chats in column 'messages', loss on every assistant turn" in printed
    # "<user> P <eos> <assistant> R <eos>": the answer's words and its EOS are scored, of 4 tokens more than P and R.
    answers = [len(row["response"].split()) for row in prompt_rows(8)]
    tokens = sum(len(row["prompt"].split()) + len(row["response"].split()) + 4 for row in prompt_rows(8))
    assert f"loss on {sum(answers) + 8} of {tokens} training tokens (every assistant turn)" in printed


@pytest.mark.parametrize("form", ["csv", "tsv", "json", "parquet", "save_to_disk"])
def test_every_format_reads_the_same_lm_samples(form, tmp_path):
    rows = prompt_rows(5)
    if form in ("csv", "tsv"):
        separator = "," if form == "csv" else "\t"
        lines = [separator.join(("prompt", "response"))] + [separator.join((r["prompt"], r["response"])) for r in rows]
        source = tmp_path / f"sft.{form}"
        source.write_text("\n".join(lines) + "\n")
    elif form == "json":
        source = tmp_path / "sft.json"
        source.write_text(json.dumps(rows))
    elif form == "parquet":
        pyarrow, parquet = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        source = tmp_path / "sft.parquet"
        parquet.write_table(pyarrow.Table.from_pylist(rows), source)
    else:
        datasets = pytest.importorskip("datasets")
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(tmp_path / "sft")
        source = f"{tmp_path / 'sft'}:train"
    data = read_lm_data(source)
    assert data.kind == "prompt_response"
    assert data.texts == [r["prompt"] for r in rows] and data.responses == [r["response"] for r in rows]


def test_eval_split_holds_out_lm_samples(llama_dir, tmp_path):
    data = write_jsonl(tmp_path / "train.jsonl", text_rows(16))
    assert run(llama_dir, data, tmp_path / "out", "--eval-split", "0.25", "--max-steps", "1", "--batch-size", "4") == 0
    final = [record for record in events(tmp_path / "out") if record["event"] == "eval"][-1]
    assert final["count"] > 0 and final["perplexity"] == pytest.approx(math.exp(final["loss"]), rel=1e-6)


def test_truncated_samples_are_counted_and_printed(llama_dir, tmp_path, capsys):
    rows = [{"text": " ".join(WORDS[:20])}] * 3 + text_rows(5)  # 3 of 21 tokens with EOS, the rest at most 9
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    assert run(llama_dir, data, tmp_path / "out", "--max-length", "12", "--max-steps", "1", "--eval-every", "no") == 0
    assert "3 of 8 training samples were truncated to --max-length 12 tokens" in capsys.readouterr().out
    dataset = tokenize_lm(read_lm_data(data), make_lm_tokenizer(), 12)
    assert dataset.num_truncated == 3 and max(dataset.lengths) == 12


def test_a_prompt_that_fills_max_length_is_dropped_and_counted(llama_dir, tmp_path, capsys):
    rows = [{"prompt": " ".join(WORDS[:12]), "response": " good"}] + prompt_rows(7)  # prompts of at most 5 words
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    assert run(llama_dir, data, tmp_path / "out", "--max-length", "10", "--max-steps", "1", "--eval-every", "no") == 0
    printed = capsys.readouterr().out
    assert "1 of 8 training samples were truncated to --max-length 10 tokens" in printed
    assert "1 of 8 training samples were left out: no token to predict within --max-length 10" in printed


def test_tokenizer_without_eos_names_the_fix(tmp_path):
    tokenizer = make_lm_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(DataError, match=r"has no EOS token.*tokenizer\.eos_token = "):
        tokenize_lm(read_lm_data([{"text": "good movie"}]), tokenizer, 32)


# ------------------------------------------------------------------ training, evaluation, final/
@pytest.fixture(scope="module")
def finished_run(llama_dir, tmp_path_factory):
    """Text data, 2 epochs of 6 updates, evaluated every 6: the run the next tests read."""
    directory = tmp_path_factory.mktemp("clm-run")
    train = write_jsonl(directory / "train.jsonl", text_rows(48))
    dev = write_jsonl(directory / "dev.jsonl", text_rows(16, seed=1))
    output_dir = directory / "out"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = run(llama_dir, train, output_dir, "--epochs", "2", "--batch-size", "8", "--log-every", "1",
                   "--eval-every", "6", "--group-by-length", eval_data=dev)
    assert code == 0, printed.getvalue()
    return output_dir, printed.getvalue()


def test_loss_goes_down_and_eval_reports_loss_and_perplexity(finished_run):
    output_dir, printed = finished_run
    records = events(output_dir)
    losses = [record["loss"] for record in records if record["event"] == "train"]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    evaluations = [record for record in records if record["event"] == "eval"]
    assert [record["step"] for record in evaluations] == [6, 12]
    for record in evaluations:
        assert record["perplexity"] == pytest.approx(math.exp(record["loss"]), rel=1e-6)
    assert evaluations[-1]["loss"] < evaluations[0]["loss"]
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["final_eval"]["perplexity"] == pytest.approx(math.exp(summary["final_eval"]["loss"]), rel=1e-6)
    assert "accuracy" not in summary["final_eval"] and summary["majority_baseline"] is None
    assert summary["config"]["metric_for_best"] == "loss"
    assert summary["best_metric"] == pytest.approx(min(record["loss"] for record in evaluations))
    table = printed[printed.index("looptrain run in"):]
    assert f"| eval loss | {summary['final_eval']['loss']:.4f} | |" in table
    assert f"| eval perplexity | {summary['final_eval']['perplexity']:.4f} | |" in table
    assert "accuracy" not in table and "majority" not in table and "macro-F1" not in table


def test_final_reloads_as_a_causal_lm_and_generates(finished_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir, _ = finished_run
    model = AutoModelForCausalLM.from_pretrained(output_dir / "final")
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "final")
    assert tokenizer.eos_token == "<eos>" and tokenizer.is_fast
    prompt = tokenizer(["the a good"], return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(generated[0], skip_special_tokens=True), str)


# ------------------------------------------------------------------ every lever, two updates
LEVERS = {
    "grad-checkpoint": ["--grad-checkpoint"],
    "adamw8bit": ["--optim", "adamw8bit"],
    "adafactor": ["--optim", "adafactor"],
    "optim-in-backward": ["--optim-in-backward"],
    "bf16-weights": ["--weights", "bf16"],
    "freeze-layers": ["--freeze-layers", "1", "--freeze-embeddings"],
    "layer-lr-decay": ["--layer-lr-decay", "0.8"],
    "unfreeze-schedule": ["--unfreeze-schedule", "1"],
    "max-tokens": ["--max-tokens", "64"],
    "amp": ["--amp"],
    "chunked-ce-off": ["--chunked-ce", "off"],
    "chunked-ce-on": ["--chunked-ce", "on", "--ce-chunk-tokens", "5"],
    "packing": ["--packing", "--batch-size", "2"],  # 16 samples in 4 packed rows: 2 updates of 2 rows
    "batch-packing": ["--batch-packing", "on", "--micro-batch-tokens", "32"],  # 4 samples a batch, packed, cut
}


@pytest.mark.parametrize("lever", sorted(LEVERS))
def test_each_lever_trains_a_causal_lm(lever, llama_dir, tmp_path):
    if lever == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    data = write_jsonl(tmp_path / "sft.jsonl", prompt_rows(16))
    assert run(llama_dir, data, tmp_path / "out", "--max-steps", "2", "--batch-size", "4", "--eval-every", "no",
               "--log-every", "1", *LEVERS[lever]) == 0
    losses = [record["loss"] for record in events(tmp_path / "out") if record["event"] == "train"]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    if lever in ("packing", "batch-packing"):  # samples, not packed rows: every one of 16; 2 updates of 4
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        assert summary["train_samples"] == (16 if lever == "packing" else 8)


def test_checkpointed_run_equals_the_plain_run(llama_dir, tmp_path):
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "sft.jsonl", prompt_rows(16))
    weights = []
    for name, extra in (("plain", []), ("checkpointed", ["--grad-checkpoint"])):
        assert run(llama_dir, data, tmp_path / name, "--max-steps", "2", "--batch-size", "4", "--eval-every", "no",
                   *extra) == 0
        weights.append(load_file(str(tmp_path / name / "final" / "model.safetensors")))
    start = load_file(str(llama_dir / "model.safetensors"))
    assert any(not torch.equal(weights[0][key], start[key]) for key in start)  # it trained
    for key in weights[0]:
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_adamw8bit_keeps_the_lm_head_state_32_bit(tied):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from looptrain.optim import build_optimizer

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = build_optimizer(model, "adamw8bit", 1e-3)
    ids = torch.randint(0, 300, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    for parameter in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        assert optimizer.state[parameter]["state1"].dtype == torch.float32


def test_memory_budget_plans_a_causal_lm(llama_dir, tmp_path):
    """A budget of live tensors (the tracker on): the plan keeps the effective batch, and the run's tracker peak
    stays within the plan's estimate of the worst padded batch, plus the margin the plan keeps free."""
    data = write_jsonl(tmp_path / "sft.jsonl", prompt_rows(16))
    argv = ["--task", "causal-lm", "--model", str(llama_dir), "--data", str(data),
            "--output-dir", str(tmp_path / "out"), "--max-length", "32", "--lr", "3e-3", "--no-progress-bar",
            "--max-steps", "2", "--batch-size", "4", "--eval-every", "no", "--memory-budget", "1GiB",
            "--plan-time", "0", "--budget-meter", "tensors", "--device", "cpu"]  # the CPU's tracker, asserted below
    assert finetune.main(argv) == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    settings = summary["plan"]["settings"]
    assert settings["batch_size"] * settings["accum_steps"] == 4  # the effective batch kept
    assert summary["memory_meter"] == "cpu_tensor_tracker" and summary["plan"]["meter"] == "of live tensors"
    assert summary["estimated_peak_bytes"] == summary["plan"]["estimated_peak_bytes"]
    margin = summary["plan"]["margin"]  # what the plan keeps free above its estimate (5% on a CPU)
    assert 0.5 * summary["estimated_peak_bytes"] < summary["peak_memory_bytes"] \
        <= summary["estimated_peak_bytes"] * (1 + margin) <= summary["plan"]["budget_bytes"]


@pytest.mark.slow
def test_memory_budget_plans_a_packed_causal_lm(llama_dir, tmp_path, capsys):
    """The planner plans over the packed rows (packing kept as given: it is the data's shape) and trains them."""
    data = write_jsonl(tmp_path / "sft.jsonl", prompt_rows(16))
    assert run(llama_dir, data, tmp_path / "out", "--max-steps", "2", "--batch-size", "2", "--eval-every", "no",
               "--packing", "--memory-budget", "1GiB", "--plan-time", "0") == 0
    output = capsys.readouterr().out
    assert "packing: 16 samples into 4 rows of at most 32 tokens" in output and "fixed: packing" in output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["plan"]["settings"]["packing"] is True


# ------------------------------------------------------------------ bad inputs: exit 2, the fix named
@pytest.mark.parametrize("rows, extra, expected", [
    ([{"sentence": "good movie", "label": "pos"}] * 4, [],
     "has the columns 'sentence', 'label', and a causal LM's data needs a 'text' column"),
    ([{"prompt": "good movie", "label": "pos"}] * 4, [],
     "has a 'prompt' column but no 'completion' or 'response' column"),
    ([{"prompt": "good movie", "completion": [{"role": "assistant", "content": "fun"}]}] * 4, ["--response-column",
     "completion"], "column 'prompt' holds a str ('good movie') and column 'completion' a list of messages"),
    ([{"txt": "good movie"}] * 4, [], "Did you mean --text-column txt?"),
    ([{"text": "good movie"}] * 4, ["--label-column", "label"], "--label-column belong to --task sequence"),
    ([{"text": "good movie"}] * 4, ["--metric-for-best", "f1"], "pass --metric-for-best loss"),
    ([{"messages": "not json"}] * 4, [], "is a string that is not JSON"),
])
def test_bad_lm_inputs_exit_2_naming_the_fix(rows, extra, expected, llama_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    assert run(llama_dir, data, tmp_path / "out", *extra) == 2
    error = capsys.readouterr().err
    assert expected in error and "Traceback" not in error


def test_a_causal_lm_needs_a_model_and_data(tmp_path, capsys):
    assert finetune.main(["--task", "causal-lm", "--output-dir", str(tmp_path)]) == 2
    assert "pass --model and --data" in capsys.readouterr().err



@pytest.mark.parametrize("extra, expected", [
    (["--prompt-column", "question"], "--prompt-column belong to --task causal-lm"),
    (["--metric-for-best", "perplexity"], "--metric-for-best perplexity scores a causal LM"),
])
def test_language_model_flags_without_the_task_exit_2(extra, expected, model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": "good movie", "label": "pos"}] * 4)
    assert finetune.main(["--model", str(model_dir), "--data", str(data), "--output-dir", str(tmp_path / "out"),
                          *extra]) == 2
    assert expected in capsys.readouterr().err


def test_an_encoder_is_refused_as_a_causal_lm(model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", text_rows(4))
    assert run(model_dir, data, tmp_path / "out") == 2
    assert "is an encoder (bert, BertModel)" in capsys.readouterr().err


def test_a_bf16_checkpoint_is_loaded_in_the_dtype_the_run_stores_its_weights_in(tmp_path):
    """transformers keeps a checkpoint's own dtype: a bf16 one trained with fp32 AdamW would round its updates away."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = save_tiny_llama(tmp_path / "bf16-llama")
    AutoModelForCausalLM.from_pretrained(directory).to(torch.bfloat16).save_pretrained(directory)
    config = AutoConfig.from_pretrained(directory)
    for flags, dtype in (([], torch.float32), (["--weights", "bf16"], torch.bfloat16)):
        args = finetune.build_parser().parse_args(["--model", str(directory), "--data", "x", *flags])
        model = finetune.load_weights(AutoModelForCausalLM, str(directory), config, args)
        assert {parameter.dtype for parameter in model.parameters()} == {dtype}, flags
