"""Which tokens a causal LM's loss is on (`tokenize_lm`, `looptrain.data.chat`), for every data format and a table of
chat templates written here; each expectation is the template's text cut by hand into trained and untrained pieces.

The tokenizer is byte-level with a single merge (" w"): every piece tokenizes alone as it does inside the whole
text, so the expected ids and labels are the pieces' tokens, joined (no piece boundary falls before a "w").
"""

from __future__ import annotations

import logging
import re

import pytest

from looptrain.data import DataError, LanguageModelingData, tokenize_lm

IGNORE = -100

# ----------------------------------------------------------------------------------------------- chat templates
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
# DeepSeek-R1: the generation prompt opens a think block, and every assistant turn is written without its own.
DEEPSEEK_R1 = ("{{ '<|bos|>' }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|User|>' + m['content'] }}"
               "{% else %}{% set content = m['content'] %}{% if '</think>' in content %}"
               "{% set content = content.split('</think>')[-1] %}{% endif %}"
               "{{ '<|Assistant|>' + content + '<|eos|>' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|Assistant|><think>\\n' }}{% endif %}")
# Qwen3: think blocks are stripped from the assistant turns before the last user message only.
QWEN3 = ("{% set ns = namespace(last_query=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
         "{% for m in messages %}{% set content = m['content'] %}"
         "{% if m['role'] == 'assistant' and loop.index0 < ns.last_query and '</think>' in content %}"
         "{% set content = content.split('</think>')[-1] %}{% endif %}"
         "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
          "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
          "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOLS = ("{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}"
         "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
         "{% if m.content %}{{ m.content }}{% endif %}{% for call in m.tool_calls or [] %}"
         "{{ '<tool_call>' + call['function']['name'] + '</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|bos|>", "<|User|>", "<|Assistant|>", "<|eos|>"]
EOS = {CHATML: "<|im_end|>", LLAMA3: "<|eot_id|>", DEEPSEEK_R1: "<|eos|>", QWEN3: "<|im_end|>", MARKED: "<|im_end|>",
       TOOLS: "<|im_end|>"}


def byte_tokenizer(chat_template: str | None = None, eos: str = "<|im_end|>", post: str | None = None):
    """A fast byte-level BPE tokenizer (one merge: " w") with the templates' special tokens; `post` a
    TemplateProcessing single-sequence pattern ("<|begin_of_text|> $A": a BOS, "$A <|im_end|>": an EOS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {character: index for index, character in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["Ġw"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "w")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    if post is not None:
        names = [token for token in post.split() if token in SPECIALS]
        backend.post_processor = processors.TemplateProcessing(
            single=post, special_tokens=[(name, backend.token_to_id(name)) for name in names])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, pad_token=eos,
                                        name_or_path="test-template")
    tokenizer.chat_template = chat_template
    return tokenizer


def expected(tokenizer, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of hand-cut pieces of text: each piece's tokens, labelled when the piece is trained."""
    ids, labels = [], []
    for text, trained in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    return ids, labels


def chats(*chat, prompt_turns=None, tools=None) -> LanguageModelingData:
    return LanguageModelingData("messages", [], None, list(chat), "chats.jsonl",
                                prompt_turns=prompt_turns, tools=tools)


def tokenized(tokenizer, data, loss_on="assistant", max_length=512):
    dataset = tokenize_lm(data, tokenizer, max_length, loss_on=loss_on)
    return dataset.input_ids[0], dataset.labels[0]


# ----------------------------------------------------------------------------------- chats with two assistant turns
TWO_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>ok</think>Hello"},
             {"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "<think>hm</think>Bye"}]

# Per template, TWO_TURNS rendered and cut by hand: (text, the assistant's).
RENDERED = {
    "chatml": (CHATML, [("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
                        ("<think>ok</think>Hello<|im_end|>\n", True),
                        ("<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n", False),
                        ("<think>hm</think>Bye<|im_end|>\n", True)]),
    "llama3": (LLAMA3, [("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
                        ("<think>ok</think>Hello<|eot_id|>", True),
                        ("<|start_header_id|>user<|end_header_id|>\n\nBye?<|eot_id|>"
                         "<|start_header_id|>assistant<|end_header_id|>\n\n", False),
                        ("<think>hm</think>Bye<|eot_id|>", True)]),
    "deepseek-r1": (DEEPSEEK_R1, [("<|bos|><|User|>Hi<|Assistant|>", False), ("Hello<|eos|>", True),
                                  ("<|User|>Bye?<|Assistant|>", False), ("Bye<|eos|>", True)]),
    "qwen3": (QWEN3, [("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
                      ("Hello<|im_end|>\n", True),  # the think block of a turn before the last user message: gone
                      ("<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n", False),
                      ("<think>hm</think>Bye<|im_end|>\n", True)]),
    "generation-markers": (MARKED, [("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
                                    ("<think>ok</think>Hello<|im_end|>", True), ("\n", False),
                                    ("<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n", False),
                                    ("<think>hm</think>Bye<|im_end|>", True), ("\n", False)]),
}


@pytest.mark.parametrize("name", list(RENDERED))
def test_every_assistant_turn_is_trained(name):
    template, pieces = RENDERED[name]
    tokenizer = byte_tokenizer(template, EOS[template])
    assert tokenized(tokenizer, chats(TWO_TURNS)) == expected(tokenizer, pieces)  # and no EOS appended


@pytest.mark.parametrize("name", list(RENDERED))
def test_last_trains_the_last_turn_and_all_every_token(name):
    template, pieces = RENDERED[name]
    tokenizer = byte_tokenizer(template, EOS[template])
    last = [(text, trained and index == max(i for i, (_, t) in enumerate(pieces) if t))
            for index, (text, trained) in enumerate(pieces)]
    assert tokenized(tokenizer, chats(TWO_TURNS), "last") == expected(tokenizer, last)
    assert tokenized(tokenizer, chats(TWO_TURNS), "all") == expected(tokenizer, [(text, True) for text, _ in pieces])


@pytest.mark.parametrize("name", list(RENDERED))
def test_conversational_prompt_completion_trains_the_completion(name):
    """The first three messages are the prompt: its assistant turn is context, not trained (TRL's completion mask)."""
    template, pieces = RENDERED[name]
    tokenizer = byte_tokenizer(template, EOS[template])
    data = chats(TWO_TURNS, prompt_turns=[3])
    completion_only = [(text, trained and index >= 3) for index, (text, trained) in enumerate(pieces)]
    assert tokenized(tokenizer, data) == expected(tokenizer, completion_only)
    assert tokenized(tokenizer, data, "last") == expected(tokenizer, completion_only)
    assert tokenized(tokenizer, data, "all") == expected(tokenizer, [(text, True) for text, _ in pieces])


def test_generation_markers_give_transformers_assistant_mask():
    tokenizer = byte_tokenizer(MARKED)
    reference = tokenizer.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
    ids, labels = tokenized(tokenizer, chats(TWO_TURNS))
    assert ids == list(reference["input_ids"])
    assert [label != IGNORE for label in labels] == [bool(flag) for flag in reference["assistant_masks"]]


def test_tool_calls_and_tools_are_rendered_and_every_assistant_turn_trained():
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "Rain?"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                "name": "weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "content": "sun"}, {"role": "assistant", "content": "No, sun"}]
    tokenizer = byte_tokenizer(TOOLS)
    pieces = [("<|im_start|>system\nTools: weather<|im_end|>\n<|im_start|>user\nRain?<|im_end|>\n"
               "<|im_start|>assistant\n", False),
              ("<tool_call>weather</tool_call><|im_end|>\n", True),
              ("<|im_start|>tool\nsun<|im_end|>\n<|im_start|>assistant\n", False),
              ("No, sun<|im_end|>\n", True)]
    assert tokenized(tokenizer, chats(chat, tools=[tools])) == expected(tokenizer, pieces)


# ------------------------------------------------------------------------------------- text and prompt/completion
def test_text_gets_special_tokens_and_one_eos_and_trains_every_token():
    tokenizer = byte_tokenizer(eos="<|eot_id|>", post="<|begin_of_text|> $A")
    data = LanguageModelingData("text", ["a good film"])
    ids, labels = expected(tokenizer, [("<|begin_of_text|>a good film<|eot_id|>", True)])
    for loss_on in ("assistant", "last", "all"):
        assert tokenized(tokenizer, data, loss_on) == (ids, labels)


def test_prompt_and_completion_are_tokenized_together_and_the_completion_trained():
    tokenizer = byte_tokenizer(eos="<|eot_id|>", post="<|begin_of_text|> $A")
    data = LanguageModelingData("prompt_response", ["The capital of France is"], [" Paris."])
    pieces = [("<|begin_of_text|>The capital of France is", False), (" Paris.<|eot_id|>", True)]
    assert tokenized(tokenizer, data) == expected(tokenizer, pieces)
    assert tokenized(tokenizer, data, "last") == expected(tokenizer, pieces)
    assert tokenized(tokenizer, data, "all") == expected(tokenizer, [(text, True) for text, _ in pieces])


def test_a_prompt_ending_in_a_space_trains_the_merged_token_and_warns_once(caplog):
    tokenizer = byte_tokenizer()
    data = LanguageModelingData("prompt_response", ["say ", "say "], ["wow", "wow"], source="sft.jsonl")
    with caplog.at_level(logging.WARNING, logger="looptrain.data.tokenize"):
        dataset = tokenize_lm(data, tokenizer, 64)
    # "say " + "wow" is "say wow": " w" is one token, so the prompt's last token (" ") is not in the whole.
    ids, labels = expected(tokenizer, [("say", False), (" wow<|im_end|>", True)])
    assert dataset.input_ids == [ids, ids] and dataset.labels == [labels, labels]
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1
    assert "in 2 of 2 samples of sft.jsonl the prompt's tokens are not the start" in warnings[0]
    assert "merged token is trained. First: sample 0, prompt 'say '" in warnings[0]


def test_a_tokenizer_that_appends_eos_puts_none_inside_the_prompt(caplog):
    tokenizer = byte_tokenizer(post="$A <|im_end|>")
    data = LanguageModelingData("prompt_response", ["The capital is"], [" Oslo."])
    with caplog.at_level(logging.WARNING):
        ids, labels = tokenized(tokenizer, data)
    assert (ids, labels) == expected(tokenizer, [("The capital is", False), (" Oslo.<|im_end|>", True)])
    assert ids.count(tokenizer.eos_token_id) == 1 and not caplog.records


# -------------------------------------------------------------------------------------- chats that cannot be masked
def test_a_chat_not_ending_with_the_assistant():
    tokenizer = byte_tokenizer(CHATML)
    chat = TWO_TURNS[:3]
    with pytest.raises(DataError, match=r"^chats\.jsonl, sample 0: cannot find the assistant tokens to train with the "
                                        r"chat template of 'test-template': its last message is the 'user' one, so it "
                                        r"has no last assistant turn to train; .*--loss-on assistant"):
        tokenize_lm(chats(chat), tokenizer, 64, loss_on="last")
    pieces = [("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", False),
              ("<think>ok</think>Hello<|im_end|>\n", True), ("<|im_start|>user\nBye?<|im_end|>\n", False)]
    assert tokenized(tokenizer, chats(chat)) == expected(tokenizer, pieces)


def test_a_chat_without_an_assistant_turn_names_the_lever():
    misspelt = [{"role": "user", "content": "Hi"}, {"role": "assitant", "content": "Hello"}]  # once trained in full
    for chat in (TWO_TURNS[:1], misspelt):
        with pytest.raises(DataError, match=r"sample 0: .*it has no assistant turn; train on every token of such "
                                            r"chats with --loss-on all, or drop them"):
            tokenize_lm(chats(chat), byte_tokenizer(CHATML), 64)


def test_renders_that_are_not_prefixes_are_an_error_naming_the_template_and_the_levers():
    counted = "{{ messages | length }} messages\n" + CHATML  # every render starts with its own message count
    with pytest.raises(DataError, match=r"chat template of 'test-template': the render of its first 1 messages is not "
                                        r"the start of the render of the whole chat; train on every token with "
                                        r"--loss-on all, or give the tokenizer a chat template whose assistant text "
                                        r"is wrapped in \{% generation %\} \.\.\. \{% endgeneration %\} markers"):
        tokenize_lm(chats(TWO_TURNS), byte_tokenizer(counted), 64)
    assert tokenize_lm(chats(TWO_TURNS), byte_tokenizer(counted), 64, loss_on="all").num_scored > 0


def test_an_unknown_loss_on_is_refused():
    with pytest.raises(DataError, match=r"loss_on must be one of assistant, last, all, got 'first'"):
        tokenize_lm(chats(TWO_TURNS), byte_tokenizer(CHATML), 64, loss_on="first")


def test_truncation_and_the_scored_count():
    tokenizer = byte_tokenizer(CHATML)
    ids, labels = expected(tokenizer, RENDERED["chatml"][1])
    dataset = tokenize_lm(chats(TWO_TURNS), tokenizer, 40)
    assert dataset.input_ids == [ids[:40]] and dataset.labels == [labels[:40]] and dataset.num_truncated == 1
    assert dataset.num_scored == sum(label != IGNORE for label in labels[1:40])


def test_the_command_line_stops_on_a_chat_it_cannot_mask(tmp_path, capsys):
    """--loss-on last on a chat that ends with the user's turn: exit 2, the row and the lever, no traceback, no run."""
    import json

    from test_finetune_causal_lm import CHAT_TEMPLATE, save_tiny_llama

    from looptrain.cli import finetune

    model = save_tiny_llama(tmp_path / "model", CHAT_TEMPLATE)
    rows = [{"messages": [{"role": "user", "content": "good"}, {"role": "assistant", "content": "fun"}]}] * 3
    rows.append({"messages": [{"role": "user", "content": "good"}, {"role": "assistant", "content": "fun"},
                              {"role": "user", "content": "bad"}]})
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    argv = ["--task", "causal-lm", "--model", str(model), "--data", str(data), "--output-dir", str(tmp_path / "out"),
            "--max-length", "32", "--max-steps", "1", "--no-track-memory", "--no-progress-bar", "--loss-on", "last"]
    assert finetune.main(argv) == 2
    error = capsys.readouterr().err
    assert re.search(r"chats\.jsonl, sample 3: cannot find the assistant tokens to train with the chat template of "
                     r"'.*model': its last message is the 'user' one", error)
    assert "Traceback" not in error and not (tmp_path / "out" / "summary.json").exists()


def test_a_template_that_refuses_a_chat_names_the_sample():
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 is even) %}"
              "{{ raise_exception('roles must alternate') }}{% endif %}{% endfor %}" + CHATML)
    chat = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Yo"}]
    with pytest.raises(DataError, match=r"^chats\.jsonl, sample 0: the chat template of 'test-template' refused the "
                                        r"chat or its first messages \(roles must alternate\); fix the chat's roles"):
        tokenize_lm(chats(chat), byte_tokenizer(strict), 64)
