"""looptrain-predict on chat data: the prompt is the chat rendered by the tokenizer's chat template with the
generation prompt (a trailing assistant answer dropped, the row's tools passed), and the output is the generated
assistant turn."""

from __future__ import annotations

import json
import re

import pytest
import torch
from test_finetune_causal_lm import save_tiny_llama

from looptrain.cli import predict

# Roles and tools written as words of the tiny vocabulary, so that every rendered token is a real one.
TEMPLATE = ("{% if tools %}{% for tool in tools %}{{ tool['function']['name'] }} {% endfor %}{% endif %}"
            "{% for message in messages %}<{{ message['role'] }}> {{ message['content'] }} <eos> {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
TOOLS = [{"type": "function", "function": {"name": "music", "parameters": {"type": "object", "properties": {}}}}]
ROWS = [  # a messages column: the last assistant message is the reference answer, never part of the prompt
    {"messages": [{"role": "user", "content": "good movie"}, {"role": "assistant", "content": "great fun"}]},
    {"messages": [{"role": "user", "content": "the plot"}, {"role": "assistant", "content": "long"},
                  {"role": "user", "content": "bad ending story slow dull"}], "tools": TOOLS},
    {"messages": [{"role": "user", "content": "a sad film"}, {"role": "assistant", "content": "dark"},
                  {"role": "user", "content": "funny"}, {"role": "assistant", "content": "happy"}]},
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("chat-llama"), TEMPLATE)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def fed_prompts(monkeypatch) -> list[list[int]]:
    """Spies on generate: the unpadded ids of every row it is given."""
    from transformers import LlamaForCausalLM

    original, seen = LlamaForCausalLM.generate, []

    def spy(self, *args, **kwargs):
        for ids, mask in zip(kwargs["input_ids"], kwargs["attention_mask"]):
            seen.append(ids[mask.bool()].tolist())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "generate", spy)
    return seen


def test_a_messages_row_generates_the_assistant_turn_after_its_chat_template(chat_model, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data, output = write_jsonl(tmp_path / "chats.jsonl", ROWS), tmp_path / "generated.jsonl"
    seen = fed_prompts(monkeypatch)
    assert predict.main(["--model", str(chat_model), "--data", str(data), "--output", str(output), "--batch-size", "2",
                         "--max-new-tokens", "4", "--no-progress-bar"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    prompts = [row["messages"][:-1] if row["messages"][-1]["role"] == "assistant" else row["messages"] for row in ROWS]
    expected_ids = [tokenizer.apply_chat_template(chat, tools=row.get("tools"), add_generation_prompt=True,
                                                  return_dict=True)["input_ids"] for chat, row in zip(prompts, ROWS)]
    assert sorted(seen) == sorted(expected_ids)  # batched by length: the order of the calls is the loader's
    assert tokenizer.decode(expected_ids[1][:1]) == "music"  # the row's tools reached the template
    assert "great" not in tokenizer.decode(expected_ids[0])  # the reference answer is no part of the prompt
    monkeypatch.undo()
    model = AutoModelForCausalLM.from_pretrained(chat_model).eval()
    expected = []
    for ids in expected_ids:  # one row at a time, no padding: what the model generates after the generation prompt
        with torch.no_grad():
            tokens = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False,
                                    pad_token_id=tokenizer.pad_token_id)
        expected.append(tokenizer.decode(tokens[0, len(ids):], skip_special_tokens=True))
    assert [json.loads(line)["generated"] for line in output.read_text().splitlines()] == expected


def test_a_conversational_prompt_column_is_the_prompt(chat_model, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    rows = [{"prompt": [{"role": "user", "content": "best scene"}],
             "completion": [{"role": "assistant", "content": "music"}]}]
    data = write_jsonl(tmp_path / "prompts.jsonl", rows)
    seen = fed_prompts(monkeypatch)
    assert predict.main(["--model", str(chat_model), "--data", str(data), "--output", str(tmp_path / "out.jsonl"),
                         "--max-new-tokens", "2", "--no-progress-bar"]) == 0
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    assert seen == [tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]]


@pytest.mark.parametrize("case, message", [
    ("no chat template", r"holds chats \(column 'messages'\) and the tokenizer of --model .* has no chat template to "
                         r"render them; pass a chat model's directory \(or set tokenizer.chat_template"),
    ("only an answer", r"line 1: column 'messages' holds only the assistant's answer, nothing to prompt with"),
])
def test_chat_prompts_that_cannot_be_rendered_exit_2_naming_the_fix(case, message, chat_model, tmp_path, capsys):
    model = save_tiny_llama(tmp_path / "plain-llama") if case == "no chat template" else chat_model
    rows = ROWS if case == "no chat template" else [{"messages": [{"role": "assistant", "content": "fun"}]}]
    data = write_jsonl(tmp_path / "chats.jsonl", rows)
    capsys.readouterr()  # saving the model's progress bar
    assert predict.main(["--model", str(model), "--data", str(data), "--output", str(tmp_path / "out.jsonl"),
                         "--max-new-tokens", "2", "--no-progress-bar"]) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1 and "Traceback" not in error
    assert re.search(message, error), error
