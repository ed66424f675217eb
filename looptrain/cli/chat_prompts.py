"""A causal LM's prompts as chats, for `looptrain-predict`: each row's messages (parsed as the training reader parses
them, a trailing assistant answer dropped) and tools, rendered by the tokenizer's chat template with the assistant's
generation prompt."""

from __future__ import annotations

import dataclasses

from looptrain.cli.errors import UsageError


@dataclasses.dataclass
class Chats:
    """A causal LM's prompts as chats: each row's messages (a trailing assistant answer dropped) and its tools."""

    chats: list[list[dict]]
    tools: list[list[dict] | None]
    column: str
    source: str
    notices: list[str] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.chats)


def read_chats(args, prompt_columns: tuple[str, ...]) -> Chats | None:
    """The rows' chats when the prompt column (--text-column, else the first of `prompt_columns` the data has) holds
    them: a column named messages, or one whose values are lists of messages (TRL's conversational prompt); None for
    a text column (then --text-column is set to it)."""
    from looptrain.data.sources import open_source

    rows, columns, source_name = open_source(args.data, "utf-8", args.encoding_errors)
    column = args.text_column or next((name for name in prompt_columns if name in columns), "text")
    args.text_column = column
    if column not in columns:
        return None  # the text reader names the columns there are
    rows = list(rows)
    if column != "messages" and not any(isinstance(row.get(column), list) for _, row in rows):
        return None  # text prompts
    chats = [chat_prompt(row, column, source_name, location) for location, row in rows]
    if not chats:
        from looptrain.data.errors import DataError

        raise DataError(f"{source_name} has a header but no data rows; add rows or point to the right file")
    return Chats(chats, [row_tools(row, source_name, location) for location, row in rows], column, source_name)


def chat_prompt(row, column: str, source_name: str, location: str) -> list[dict]:
    """A row's chat, parsed as the training reader parses one (`looptrain.data.readers`), without a trailing
    assistant message: that is the reference answer the model is to generate."""
    from looptrain.data.chat_rows import read_chat  # the training reader's own parsing of a chat
    from looptrain.data.errors import DataError

    chat = read_chat(row.get(column), f"{source_name} {location}: column {column!r}", {})
    if chat[-1].get("role") == "assistant":
        chat = chat[:-1]
    if not chat:
        raise DataError(f"{source_name} {location}: column {column!r} holds only the assistant's answer, nothing to "
                        "prompt with; add the messages before it or drop the row")
    return chat


def row_tools(row, source_name: str, location: str) -> list[dict] | None:
    """A row's tool schemas (a `tools` column), passed to the chat template; None without one."""
    from looptrain.data.chat_rows import read_tools  # the training reader's own parsing of the schemas

    return read_tools(row.get("tools"), f"{source_name} {location}: column 'tools'")


def chat_ids(chats: Chats, tokenizer, args) -> tuple[list[list[int]], int]:
    """Each chat rendered by the tokenizer's chat template with the assistant's generation prompt and tokenized as
    the template writes it (`apply_chat_template`: no special tokens added); a chat longer than --max-length keeps
    its last tokens (the generation prompt and the latest turns). Returns (ids, how many were truncated)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UsageError(f"--data {args.data} holds chats (column {chats.column!r}) and the tokenizer of --model "
                         f"{args.model} has no chat template to render them; pass a chat model's directory (or set "
                         "tokenizer.chat_template and save it with the model), or write the prompts as a text column")
    ids, truncated = [], 0
    for chat, tools in zip(chats.chats, chats.tools):
        row = list(tokenizer.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
        truncated += len(row) > args.max_length
        ids.append(row[-args.max_length:])
    return ids, truncated
