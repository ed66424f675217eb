"""Which tokens of a rendered chat a causal LM's loss is on: the assistant turns, found for any chat template.

Two ways, tried in this order:

- A template with ``{% generation %}`` markers: transformers' ``apply_chat_template(...,
  return_assistant_tokens_mask=True)`` marks the tokens (TRL's ``assistant_only_loss`` positions).
- Any other template, by rendering message prefixes on the full chat's text ``F``: assistant message ``i``
  starts where ``render(chat[:i], add_generation_prompt=True)`` ends (when only ``render(chat[:i])`` is a prefix
  of ``F``, as for templates whose generation prompt opens ``<think>``, where ``F`` and that render part), and
  ends where ``render(chat[:i + 1])`` ends (when that is not a prefix of ``F``, as for templates that strip
  ``<think>`` blocks from earlier turns: where the text the template writes after the turn's content is next
  found in ``F``). A token is trained when any of its characters lies within a span (transformers' rule for
  generation markers), read from the fast tokenizer's offsets.

Where neither works the chat is refused with a :class:`DataError` naming the template, the row, what failed
and the levers; the loss never silently falls back to every token.
"""

from __future__ import annotations

import os
import re
from typing import Any

from looptrain.data.errors import DataError

LOSS_ON = ("assistant", "last", "all")
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PLACEHOLDER = "\ue000"  # a private-use character: the content whose closing text a template writes after it


def loss_description(kind: str, loss_on: str, conversational_prompt: bool = False) -> str:
    """What the loss is on, in words ("every assistant turn"), for a kind of data and a `loss_on`."""
    if loss_on == "all" or kind == "text":
        return "every token"
    if kind == "prompt_response":
        return "the completion only"
    if loss_on == "last":
        return "the last assistant turn"
    return "the completion's assistant turns" if conversational_prompt else "every assistant turn"


def has_generation_markers(tokenizer, tools: Any = None) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    return bool(_GENERATION_MARKER.search(tokenizer.get_chat_template(None, tools)))


def chat_sample(tokenizer, chat: list[dict], tools: list[dict] | None, prompt_turns: int, loss_on: str,
                row: int) -> tuple[list[int], list[bool]]:
    """The token ids of one rendered chat and which of them the loss is on.

    Args:
        tokenizer: A fast tokenizer with a chat template.
        chat: The messages (for conversational prompt/completion data, prompt then completion).
        tools: The tool schemas passed as ``tools=`` to the template, or None.
        prompt_turns: How many of the first messages are the prompt (0 for a plain chat): their assistant turns
            are not trained.
        loss_on: ``"assistant"`` (every assistant turn after the prompt), ``"last"`` (the last one) or ``"all"``.
        row: The chat's row number, for error messages.

    Returns:
        (ids, mask): the ids as ``apply_chat_template`` tokenizes them, and True where the loss is.

    Raises:
        DataError: When the chat has no assistant turn to train, ``"last"`` is asked of a chat that does not
            end with the assistant's turn, or the template's renders do not show where the turns are.
    """
    if loss_on == "all":
        ids = _token_ids(tokenizer, render(tokenizer, chat, tools))
        return ids, [True] * len(ids)
    turns = [index for index, message in enumerate(chat) if message.get("role") == "assistant"
             and index >= prompt_turns]
    if not turns:
        raise _span_error(tokenizer, row, "it has no assistant turn" + (" in its completion" if prompt_turns else ""),
                          "train on every token of such chats with --loss-on all, or drop them")
    if loss_on == "last" and chat[-1].get("role") != "assistant":
        raise _span_error(tokenizer, row, f"its last message is the {chat[-1].get('role')!r} one, so it has no last "
                          "assistant turn to train", "end the chat with the assistant's turn, or train every "
                          "assistant turn (--loss-on assistant, the default)")
    if has_generation_markers(tokenizer, tools):
        return _marked_sample(tokenizer, chat, tools, prompt_turns, loss_on, row)
    text = render(tokenizer, chat, tools)
    if loss_on == "last":
        turns = turns[-1:]
    spans = [_turn_span(tokenizer, chat, tools, index, text, row) for index in turns]
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise _span_error(tokenizer, row, "its assistant turns' spans overlap in the rendered text")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return list(encoded["input_ids"]), token_mask(encoded["offset_mapping"], spans)


def render(tokenizer, chat: list[dict], tools: list[dict] | None, add_generation_prompt: bool = False) -> str:
    """The chat's text as the template writes it."""
    return tokenizer.apply_chat_template(chat, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token with a character inside one of `spans` (sorted, disjoint ``[start, end)``)."""
    mask, span = [], 0
    for start, end in offsets:
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        mask.append(span < len(spans) and end > spans[span][0])
    return mask


def _turn_span(tokenizer, chat: list[dict], tools, index: int, text: str, row: int) -> tuple[int, int]:
    """The characters of `text` (the whole chat rendered) that assistant message `index` writes."""
    if index == 0:
        raise _span_error(tokenizer, row, "it opens with an assistant message, so no prompt renders before it")
    before = render(tokenizer, chat[:index], tools, add_generation_prompt=True)
    if text.startswith(before):
        start = len(before)
    elif text.startswith(prompt := render(tokenizer, chat[:index], tools)):
        start = max(len(prompt), len(os.path.commonprefix([text, before])))
    else:
        raise _span_error(tokenizer, row, f"the render of its first {index} messages is not the start of the "
                          "render of the whole chat")
    through = render(tokenizer, chat[:index + 1], tools)
    if text.startswith(through):
        end = len(through)
    else:
        placeholder = render(tokenizer, chat[:index] + [dict(chat[index], content=_PLACEHOLDER)], tools)
        closing = placeholder[placeholder.rfind(_PLACEHOLDER) + 1:] if _PLACEHOLDER in placeholder else ""
        found = text.find(closing, start) if closing else -1
        if found < 0:
            raise _span_error(tokenizer, row, f"the end of its assistant turn (message {index}) is not found in the "
                              "render of the whole chat")
        end = found + len(closing)
    if end <= start:
        raise _span_error(tokenizer, row, f"its assistant turn (message {index}) renders as no text")
    return start, end


def _marked_sample(tokenizer, chat, tools, prompt_turns: int, loss_on: str, row: int):
    """(ids, mask) from transformers' assistant mask of a template with generation markers."""
    encoded = tokenizer.apply_chat_template(chat, tools=tools, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    ids, mask = list(encoded["input_ids"]), [bool(flag) for flag in encoded["assistant_masks"]]
    if prompt_turns:  # TRL's completion mask: nothing of the prompt and its generation prompt
        prompt = _token_ids(tokenizer, render(tokenizer, chat[:prompt_turns], tools, add_generation_prompt=True))
        boundary = len(os.path.commonprefix([prompt, ids]))
        mask = [False] * boundary + mask[boundary:]
    if loss_on == "last" and any(mask):  # the last run of marked tokens: the last generation block
        end = len(mask) - mask[::-1].index(True)
        start = end - (mask[:end][::-1] + [False]).index(False)
        mask = [start <= position < end for position in range(len(mask))]
    if not any(mask):
        raise _span_error(tokenizer, row, "its template's {% generation %} markers mark none of its tokens")
    return ids, mask


def _token_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def _span_error(tokenizer, row: int, problem: str, fix: str = "") -> DataError:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    fix = fix or ("train on every token with --loss-on all, or give the tokenizer a chat template whose assistant "
                  "text is wrapped in {% generation %} ... {% endgeneration %} markers")
    return DataError(f"sample {row}: cannot find the assistant tokens to train with the chat template of {name!r}: "
                     f"{problem}; {fix}")
