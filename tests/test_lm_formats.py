"""read_lm_data on every TRL SFT data format: the exact LanguageModelingData each gives, and the inputs it refuses.

Pure reader tests (no tokenizer, no model): each format as Python rows, as a JSONL file, and (where a format lives in
spreadsheets) as a CSV file; the expected fields are written out by hand.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from looptrain.data import DataError, read_lm_data

USER = {"role": "user", "content": "What is 2+2?"}
ASSISTANT = {"role": "assistant", "content": "4"}
SYSTEM = {"role": "system", "content": "Be brief."}
TOOL_SCHEMA = {"type": "function", "function": {"name": "add", "description": "Adds two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}
CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add",
                                                                              "arguments": {"a": 2, "b": 2}}}]}
CALLED = {**CALL, "content": None}  # how the reader gives it: an assistant message's content is None, not absent
RESULT = {"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "4"}
THINKING = {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4"}


def read_as(kind: str, columns: tuple[str, ...], *, texts=(), responses=None, messages=None, prompt_turns=None,
            tools=None, notices=()) -> dict:
    """The LanguageModelingData fields a format must give (`fields_of`)."""
    return {"kind": kind, "texts": list(texts), "responses": responses, "messages": messages,
            "prompt_turns": prompt_turns, "tools": tools, "columns": columns, "notices": list(notices)}


# (id, rows, the fields read)
FORMATS = [
    ("text", [{"text": "a good film"}, {"text": "a dull plot"}],
     read_as("text", ("text",), texts=["a good film", "a dull plot"])),
    ("prompt/completion (TRL)", [{"prompt": "The capital of France is", "completion": " Paris."}],
     read_as("prompt_response", ("prompt", "completion"), texts=["The capital of France is"], responses=[" Paris."])),
    ("prompt/response", [{"prompt": "2+2=", "response": "4", "id": 7}],
     read_as("prompt_response", ("prompt", "response"), texts=["2+2="], responses=["4"])),
    ("messages", [{"messages": [SYSTEM, USER, ASSISTANT]}, {"messages": [USER, ASSISTANT, USER, ASSISTANT]}],
     read_as("messages", ("messages",), messages=[[SYSTEM, USER, ASSISTANT], [USER, ASSISTANT, USER, ASSISTANT]])),
    ("conversational prompt/completion",
     [{"prompt": [SYSTEM, USER], "completion": [ASSISTANT]}, {"prompt": [USER], "completion": [ASSISTANT]}],
     read_as("messages", ("prompt", "completion"), messages=[[SYSTEM, USER, ASSISTANT], [USER, ASSISTANT]],
             prompt_turns=[2, 1])),
    ("tools and tool calls",
     [{"messages": [USER, CALL, RESULT, ASSISTANT], "tools": [TOOL_SCHEMA]},
      {"messages": [USER, THINKING], "tools": None}],
     read_as("messages", ("messages",), messages=[[USER, CALLED, RESULT, ASSISTANT], [USER, THINKING]],
             tools=[[TOOL_SCHEMA], None])),
    ("tools as JSON text (TRL's storage)",
     [{"prompt": [USER], "completion": [CALL, RESULT, ASSISTANT], "tools": json.dumps([TOOL_SCHEMA])}],
     read_as("messages", ("prompt", "completion"), messages=[[USER, CALLED, RESULT, ASSISTANT]], prompt_turns=[1],
             tools=[[TOOL_SCHEMA]])),
    ("ShareGPT conversations",
     [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2+2?"},
                         {"from": "gpt", "value": "4"}]},
      {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]}],
     read_as("messages", ("conversations",), messages=[[SYSTEM, USER, ASSISTANT], [USER, ASSISTANT]],
             notices=["SOURCE: read the ShareGPT 'conversations' column (from/value as role/content): roles "
                      "system->system, human->user, gpt->assistant"])),
]


def fields_of(data) -> dict:
    names = ("kind", "texts", "responses", "messages", "prompt_turns", "tools", "columns", "notices")
    return {name: getattr(data, name) for name in names}


def expected_of(expected: dict, source: str) -> dict:
    return {**expected, "notices": [notice.replace("SOURCE", source) for notice in expected["notices"]]}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("rows, expected", [case[1:] for case in FORMATS], ids=[case[0] for case in FORMATS])
def test_every_trl_format_reads_as_written(rows, expected, tmp_path):
    assert fields_of(read_lm_data(rows)) == expected_of(expected, "<list>")
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    assert fields_of(read_lm_data(path)) == expected_of(expected, str(path))


def test_chats_and_tools_in_csv_cells_are_their_json_text(tmp_path):
    path = tmp_path / "train.csv"
    with path.open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["messages", "tools"])
        writer.writerow([json.dumps([USER, CALL, RESULT, ASSISTANT]), json.dumps([TOOL_SCHEMA])])
        writer.writerow([json.dumps([USER, ASSISTANT]), ""])
    data = read_lm_data(path)
    assert data.messages == [[USER, CALLED, RESULT, ASSISTANT], [USER, ASSISTANT]]
    assert data.tools == [[TOOL_SCHEMA], None]


def test_arrow_rows_leave_out_the_keys_other_messages_have():
    """A datasets.Dataset gives every message every key of its column (null where absent): those are left out."""
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": [USER, CALL, RESULT, ASSISTANT]}, {"messages": [USER, ASSISTANT]}]
    data = read_lm_data(datasets.Dataset.from_list(rows))
    call = data.messages[0][1]
    assert call["role"] == "assistant" and call["content"] is None and set(call) == {"role", "content", "tool_calls"}
    assert data.messages[0][2] == RESULT and data.messages[1] == [USER, ASSISTANT]


def test_named_columns_and_the_selection_keep_every_field_aligned():
    rows = [{"q": [USER], "a": [ASSISTANT], "t": [TOOL_SCHEMA]}, {"q": [SYSTEM, USER], "a": [ASSISTANT], "t": None}]
    data = read_lm_data(rows, prompt_column="q", response_column="a", tools_column="t")
    assert (data.kind, data.columns, data.prompt_turns, data.tools) == ("messages", ("q", "a"), [1, 2],
                                                                        [[TOOL_SCHEMA], None])
    picked = data.select([1])
    assert (picked.messages, picked.prompt_turns, picked.tools) == ([[SYSTEM, USER, ASSISTANT]], [2], [None])
    # --response-column completion on conversational data: the chats, not the Python repr of the lists
    conversational = read_lm_data([{"prompt": [USER], "completion": [ASSISTANT]}], response_column="completion")
    assert conversational.messages == [[USER, ASSISTANT]] and conversational.texts == []
    notice = read_lm_data([{"prompt": "a", "completion": "b", "tools": "[]"}]).notices
    assert notice == ["<list>: column 'tools' is left unused: tools are rendered in chats, and these rows hold "
                      "string prompts and completions"]


# (id, rows, the DataError's message, matched from its start)
ERRORS = [
    ("non-string completion", [{"prompt": "2+2=", "completion": 4}],
     r"<list> row 0: text column 'completion' holds an int \(4\), not a string; write the text as a string"),
    ("list in the response", [{"prompt": "2+2=", "response": [ASSISTANT]}],
     r"<list> row 0: column 'prompt' holds a str \('2\+2='\) and column 'response' a list of messages "
     r"\(\[\{.*\}\]\); conversational prompt/completion data holds lists of messages in both"),
    ("list of messages in a text column", [{"text": [USER, ASSISTANT]}],
     r"<list> row 0: text column 'text' holds a list of messages \(.*\), not a string; chats go in a 'messages' "
     r"column, or in 'prompt' and 'completion' columns"),
    ("misspelt role", [{"messages": [USER, {"role": "assitant", "content": "4"}]}],
     r"<list> row 0: column 'messages', message 1: unknown role 'assitant': did you mean 'assistant'\? \(the roles "
     r"are system, developer, user, assistant, tool, ipython\); fix the role"),
    ("ShareGPT role in a messages column", [{"messages": [{"role": "human", "content": "hi"}, ASSISTANT]}],
     r"<list> row 0: column 'messages', message 0: unknown role 'human': did you mean 'user'\?"),
    ("unknown ShareGPT from", [{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "4"}]}],
     r"<list> row 0: column 'conversations', message 1: unknown ShareGPT 'from' value 'bot' \(read as roles: "
     r"human->user, .*\); fix the value"),
    ("no assistant message", [{"messages": [USER, ASSISTANT]}, {"messages": [SYSTEM, USER]}],
     r"<list> row 1: the chat in column 'messages' has no assistant message \(roles: system, user\), so there is "
     r"nothing to learn from"),
    ("completion without an assistant message", [{"prompt": [USER], "completion": [USER]}],
     r"<list> row 0: the completion in column 'completion' has no assistant message"),
    ("mixed prompt kinds", [{"prompt": [USER], "completion": [ASSISTANT]}, {"prompt": "2+2=", "completion": "4"}],
     r"<list> row 1: columns 'prompt'/'completion' hold strings, and lists of messages in row 0; write every row "
     r"in one format"),
    ("both completion and response", [{"prompt": "a", "completion": "b", "response": "c"}],
     r"<list> has both 'completion' and 'response' columns \(.*\); name the one to train on with --response-column"),
    ("prompt without completion", [{"prompt": "a"}],
     r"<list> has a 'prompt' column but no 'completion' or 'response' column"),
    ("typed content parts", [{"messages": [USER, {"role": "assistant", "content": [{"type": "text", "text": "4"}]}]}],
     r"<list> row 0: column 'messages', message 1: the content is a list of typed parts .*; looptrain trains "
     r"text-only models: write each message's content as a string"),
    ("user message without content", [{"messages": [{"role": "user"}, ASSISTANT]}],
     r"<list> row 0: column 'messages', message 0: the user message has no content \(only an assistant message "
     r"with 'tool_calls' may leave it out\)"),
    ("tools not a list", [{"messages": [USER, ASSISTANT], "tools": {"name": "add"}}],
     r"<list> row 0: column 'tools' must hold a list of tool schemas"),
    ("tools not JSON", [{"messages": [USER, ASSISTANT], "tools": "add(a, b)"}],
     r"<list> row 0: column 'tools' is a string that is not JSON"),
    ("tool calls not a list", [{"messages": [USER, {**CALL, "tool_calls": "add(2, 2)"}, ASSISTANT]}],
     r"<list> row 0: column 'messages', message 1: 'tool_calls' must be a list of objects"),
]


@pytest.mark.parametrize("rows, message", [case[1:] for case in ERRORS], ids=[case[0] for case in ERRORS])
def test_bad_rows_are_data_errors_naming_the_row(rows, message):
    with pytest.raises(DataError, match="^" + message):
        read_lm_data(rows)


def test_classification_text_refuses_what_is_not_a_string():
    from looptrain.data import read_classification_data

    with pytest.raises(DataError, match=r"^<list> row 1: text column 'text' holds a dict \(\{'a': 1\}\), not a "
                                        r"string"):
        read_classification_data([{"text": "good", "label": 0}, {"text": {"a": 1}, "label": 1}])


def test_tools_reach_the_chat_template():
    """tokenize_lm renders each chat with its own row's tools (apply_chat_template(tools=...))."""
    from test_finetune_causal_lm import make_lm_tokenizer

    from looptrain.data import tokenize_lm

    template = ("{% if tools %}{% for tool in tools %}<user> {{ tool['function']['name'] }} {% endfor %}{% endif %}"
                "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}")
    tokenizer = make_lm_tokenizer(template)
    schema = {"type": "function", "function": {"name": "good"}}
    data = read_lm_data([{"messages": [{"role": "user", "content": "movie"}, {"role": "assistant", "content": "fun"}],
                          "tools": tools} for tools in ([schema], None)])
    with_tools, without = (tokenize_lm(data, tokenizer, 32)[index]["input_ids"] for index in (0, 1))
    assert tokenizer.convert_ids_to_tokens(with_tools[:2]) == ["<user>", "good"]
    assert with_tools[2:] == without


def test_the_command_line_reads_conversational_prompt_completion_without_a_flag(tmp_path):
    """The issue's "silent garbage": TRL's conversational prompt/completion file, with no column flag or with
    --response-column completion, is read as chats (never as the Python repr of the lists)."""
    from looptrain.cli import finetune
    from looptrain.cli.finetune.inputs import load_lm_data

    rows = [{"prompt": [USER], "completion": [CALL, RESULT, ASSISTANT], "tools": [TOOL_SCHEMA]}] * 2
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    for extra in ([], ["--response-column", "completion"]):
        flags = finetune.build_parser().parse_args(["--task", "causal-lm", "--data", str(path), *extra])
        train, eval_data, description = load_lm_data(flags)
        assert (train.kind, train.prompt_turns, train.tools) == ("messages", [1, 1], [[TOOL_SCHEMA]] * 2)
        assert train.messages == [[USER, CALLED, RESULT, ASSISTANT]] * 2 and eval_data is None
        assert description.startswith(f"{path} (chats in column 'prompt'/'completion'")
