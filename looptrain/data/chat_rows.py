"""Chat rows: a causal LM's conversational values (TRL's ``messages``, conversational prompt/completion, ``tools``,
ShareGPT ``conversations``) checked into the message dicts a chat template renders.

A message becomes ``{"role": str, "content": str | None}`` plus any of `MESSAGE_KEYS` the row gives, kept as read
(a key whose value is null is left out: Arrow-backed data sets give every message every key of the column). The
content is a string; it may be null, absent or empty only in an assistant message that has ``tool_calls``. A
content that is a list of typed parts (``[{"type": "text", "text": ...}]``, the multimodal form) is refused:
looptrain trains text-only models, whose templates render a string. ShareGPT's ``from``/``value`` messages are
renamed to role/content (`SHAREGPT_ROLES`). Every error is a :class:`DataError` naming the source, the row, the
message and the fix.
"""

from __future__ import annotations

import difflib
import json
import math
import reprlib
from collections.abc import Mapping
from typing import Any

from looptrain.data.errors import DataError
from looptrain.data.sources import one_line

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
# Keys of a message passed to the chat template as read, beside role and content.
MESSAGE_KEYS = ("tool_calls", "name", "tool_call_id", "reasoning_content", "thinking")
_TEXT_KEYS = ("name", "tool_call_id", "reasoning_content", "thinking")
# ShareGPT's "from" values and the roles they mean.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool", "function_response": "tool"}
_CHAT_EXAMPLE = '[{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]'


def is_message_list(value: Any) -> bool:
    """Whether `value` looks like a list of chat messages (objects with a role or a ShareGPT "from")."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(item, Mapping) and ("role" in item or "from" in item) for item in value))


def describe(value: Any) -> str:
    """What a value that is not the expected string is, for an error: "a list of messages", "an int (5)"."""
    if value is None:
        return "nothing (null or missing)"
    if is_message_list(value):
        return f"a list of messages ({reprlib.repr(value)})"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name} ({reprlib.repr(value)})"


def read_chat(value: Any, where: str, renamed: dict[str, str]) -> list[dict[str, Any]]:
    """A row's chat: a non-empty list of messages (its JSON text, as in a CSV cell, is parsed).

    Args:
        value: The cell.
        where: ``"<source> <row>: column 'messages'"``, for errors.
        renamed: Collects the ShareGPT ``from`` values read and the role each became.

    Returns:
        The messages, checked (see the module's docstring).

    Raises:
        DataError: On a value that is not a non-empty list of messages, a message that is not an object, a role
            outside `CHAT_ROLES` (naming the closest), an unknown ShareGPT ``from``, a content that is not a string.
    """
    if isinstance(value, str):  # a chat in a CSV / TSV cell is its JSON text
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError, ValueError) as error:
            raise DataError(f"{where} is a string that is not JSON ({one_line(error)}); write the chat as a JSON "
                            f"{_CHAT_EXAMPLE}") from error
    if not isinstance(value, list) or not value:
        raise DataError(f"{where} must hold a non-empty list of messages {_CHAT_EXAMPLE}, got "
                        f"{reprlib.repr(value)}; fix or drop the row")
    return [_message(message, f"{where}, message {index}", renamed) for index, message in enumerate(value)]


def check_has_assistant(chat: list[dict[str, Any]], where: str) -> None:
    """Refuses a chat without an assistant message: nothing in it is the model's to learn."""
    if not any(message["role"] == "assistant" for message in chat):
        roles = ", ".join(dict.fromkeys(message["role"] for message in chat))
        raise DataError(f"{where} has no assistant message (roles: {roles}), so there is nothing to learn from; add "
                        "the assistant's reply or drop the row")


def read_tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A row's tool schemas (a list of JSON-schema objects, or its JSON text); None where the row has none."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, str):  # a CSV cell, or a data set that stores the schemas as JSON text
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError, ValueError) as error:
            raise DataError(f"{where} is a string that is not JSON ({one_line(error)}); write the tools as a JSON "
                            'list of schemas [{"type": "function", "function": {"name": ...}}]') from error
        if value is None:
            return None
    if not isinstance(value, list) or not all(isinstance(tool, Mapping) for tool in value):
        raise DataError(f"{where} must hold a list of tool schemas (JSON-schema objects "
                        f'{{"type": "function", "function": {{...}}}}), got {reprlib.repr(value)}; fix or drop the row')
    return list(value)


def sharegpt_notice(column: str, renamed: dict[str, str], source_name: str) -> list[str]:
    """The one notice saying that ShareGPT messages were renamed (none when none were)."""
    if not renamed:
        return []
    roles = ", ".join(f"{name}->{role}" for name, role in renamed.items())
    return [f"{source_name}: read the ShareGPT {column!r} column (from/value as role/content): roles {roles}"]


def _message(message: Any, at: str, renamed: dict[str, str]) -> dict[str, Any]:
    if not isinstance(message, Mapping) or ("role" not in message and "from" not in message):
        raise DataError(f"{at}: expected an object with 'role' and 'content' (or ShareGPT's 'from' and 'value'), got "
                        f"{reprlib.repr(message)}; fix or drop the row")
    if message.get("role") is None and "from" in message:
        role, content = _sharegpt_role(message["from"], at), message.get("value")
        renamed.setdefault(message["from"], role)
    else:
        role, content = _role(message.get("role"), at), message.get("content")
    read = {"role": role, "content": content}
    read.update({key: message[key] for key in MESSAGE_KEYS if message.get(key) is not None})
    _check_extras(read, at)
    _check_content(read, at)
    return read


def _role(role: Any, at: str) -> str:
    if isinstance(role, str) and role in CHAT_ROLES:
        return role
    if not isinstance(role, str):
        raise DataError(f"{at}: the role must be a string ({', '.join(CHAT_ROLES)}), got {reprlib.repr(role)}; fix "
                        "the role")
    closest = (role.lower() if role.lower() in CHAT_ROLES else SHAREGPT_ROLES.get(role.lower())
               or difflib.get_close_matches(role.lower(), CHAT_ROLES, n=1, cutoff=0.0)[0])
    raise DataError(f"{at}: unknown role {role!r}: did you mean {closest!r}? (the roles are "
                    f"{', '.join(CHAT_ROLES)}); fix the role")


def _sharegpt_role(name: Any, at: str) -> str:
    if isinstance(name, str) and name in SHAREGPT_ROLES:
        return SHAREGPT_ROLES[name]
    raise DataError(f"{at}: unknown ShareGPT 'from' value {reprlib.repr(name)} (read as roles: "
                    f"{', '.join(f'{key}->{role}' for key, role in SHAREGPT_ROLES.items())}); fix the value or "
                    "write the chat as role/content messages")


def _check_extras(read: dict[str, Any], at: str) -> None:
    for key in _TEXT_KEYS:
        if key in read and not isinstance(read[key], str):
            raise DataError(f"{at}: {key!r} must be a string, got {reprlib.repr(read[key])}; fix or drop the row")
    calls = read.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(call, Mapping) for call in calls)):
        raise DataError(f"{at}: 'tool_calls' must be a list of objects "
                        f'[{{"type": "function", "function": {{"name": ..., "arguments": ...}}}}], got '
                        f"{reprlib.repr(calls)}; fix or drop the row")


def _check_content(read: dict[str, Any], at: str) -> None:
    content = read["content"]
    if isinstance(content, str) or (content is None and read["role"] == "assistant" and read.get("tool_calls")):
        return  # None: an assistant turn that only calls tools
    if content is None or (isinstance(content, float) and math.isnan(content)):
        raise DataError(f"{at}: the {read['role']} message has no content (only an assistant message with "
                        "'tool_calls' may leave it out); fill or drop the row")
    if isinstance(content, list) and content and all(isinstance(part, Mapping) and "type" in part
                                                     for part in content):
        raise DataError(f"{at}: the content is a list of typed parts ({reprlib.repr(content)}), the multimodal "
                        "form; looptrain trains text-only models: write each message's content as a string")
    raise DataError(f"{at}: the content must be a string, got {describe(content)}; fix or drop the row")
