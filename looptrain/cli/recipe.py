"""`--config FILE`: a command line's flags as a recipe file (YAML or JSON), and the recipe of a run.

A recipe is one flat mapping: each key is a flag's name without its dashes (``grad_checkpoint``, ``lr``; ``-`` and
``_`` alike) or the field it sets (``gradient_checkpointing``, ``accum_steps``), each value what the flag takes: a
number or a string, ``true`` for a switch, a list for a flag of several values (or one whose repeats add up),
``null`` for "none". The file is
written out as the flags it holds, in front of the command line (`expand_config`), so argparse reads it as it reads
every flag: a flag given on the command line overrides the file's, and everything downstream (the checks of
flags that go together, the planner's "flags you give are kept", the command line a plan prints) sees one command
line. An unknown key or a bad value stops the command (exit 2) naming the file and the key.

YAML is read by the 1.2 rules for booleans: only true and false are booleans, so ``eval_every: no`` is the
string "no" (YAML 1.1 would read it as false).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from looptrain.run_files import write_text_atomic

RECIPE_SUFFIXES = (".yaml", ".yml", ".json")
CONFIG_FLAG = "--config"
NOT_IN_A_RECIPE = ("help", "config")  # the dests no recipe sets


def expand_config(parser: argparse.ArgumentParser, argv: Sequence[str],
                  switch_fields: Mapping[str, str] | None = None) -> list[str]:
    """`argv` with its ``--config FILE`` replaced by the file's flags, in front; a flag on the command line wins.

    The file's flags for a flag the command line gives (or for one it excludes, in a mutually exclusive group) are
    left out, so each flag appears once. An unreadable file, an unknown key or a bad value is `parser.error`:
    exit 2, naming the file and the key. `switch_fields`: keys that name a field a ``--no-...`` switch turns off
    (``{"track_memory": "--no-track-memory"}``: ``track_memory: false`` sets the switch).
    """
    path, typed = _config_path(parser, argv)
    if path is None:
        return typed
    options = _actions_by_option(parser)
    given = {options[token.split("=")[0]] for token in typed if token.split("=")[0] in options}
    excluded = given | {action for group in parser._mutually_exclusive_groups  # argparse has no public accessor
                        if set(group._group_actions) & given for action in group._group_actions}
    tokens = []
    for key, value in read_recipe(parser, path).items():
        action, on, off = _action_of(parser, key, path, switch_fields or {})
        if action in excluded:
            continue
        key_tokens = _tokens_of(parser, action, (on, off), value, f"{path}: {key}")
        _check_value(parser, key_tokens, f"{path}: {key}")
        tokens += key_tokens
    return tokens + typed


def read_recipe(parser: argparse.ArgumentParser, path: str) -> dict:
    """The mapping a recipe file holds (an empty file: none), or `parser.error` naming what is wrong with it."""
    suffix = Path(path).suffix.lower()
    if suffix not in RECIPE_SUFFIXES:
        parser.error(f"--config {path}: a recipe is a .yaml, .yml or .json file (got {suffix or 'no suffix'})")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"--config {path}: cannot read it ({getattr(error, 'strerror', None) or error}); pass a "
                     "recipe file (docs/finetune.md, \"Recipe files\")")
    try:
        values = json.loads(text) if suffix == ".json" else _yaml().load(text, Loader=_recipe_loader())
    except json.JSONDecodeError as error:
        parser.error(f"--config {path}: not JSON at line {error.lineno}: {error.msg}")
    except _yaml().YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        parser.error(f"--config {path}: not YAML{where}: {getattr(error, 'problem', None) or error}")
    if values is None:
        return {}
    if not isinstance(values, dict):
        parser.error(f"--config {path}: a recipe is a mapping of flags to values (key: value lines), not a "
                     f"{type(values).__name__}")
    return values


def recipe_of(parser: argparse.ArgumentParser, values: Mapping[str, Any], *, leave_out: Sequence[str] = (),
              always: Sequence[str] = ()) -> dict:
    """The recipe of parsed flags (`values`, by dest): each flag whose value is not its default (and those of
    `always`), keyed by the flag's name (``grad_checkpoint: true``, ``lr: 2.0e-05``), in the parser's order;
    `leave_out`: dests to leave out."""
    recipe = {}
    for action in parser._actions:  # argparse's flags in order (no public accessor)
        if (not action.option_strings or action.dest in (*NOT_IN_A_RECIPE, *leave_out) or action.dest not in values
                or (values[action.dest] == action.default and action.dest not in always)):
            continue
        value = values[action.dest]
        if action.nargs == 0:  # a switch: set, it says its value itself
            if value == action.const:
                recipe[key_of(action)] = True
            continue
        recipe[key_of(action)] = list(value) if isinstance(value, (list, tuple)) else value
    return recipe


def write_recipe(path: str | os.PathLike, recipe: Mapping[str, Any], comments: Sequence[str] = ()) -> None:
    """Writes `recipe` as YAML (`.yaml`, `.yml`, after `comments` as ``#`` lines) or JSON, through a temporary file
    and a rename."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        text = json.dumps(dict(recipe), indent=2) + "\n"
    else:
        header = "".join(f"# {line}\n" for line in comments)
        text = header + _yaml().safe_dump(dict(recipe), sort_keys=False, default_flow_style=False, allow_unicode=True)
    write_text_atomic(path, text)


def check_recipe_path(flag: str, path: str | None) -> str | None:
    """A problem with a recipe file to write (its suffix), said with `flag`; None when it is fine."""
    if path is not None and Path(path).suffix.lower() not in RECIPE_SUFFIXES:
        return f"{flag} {path}: a recipe is written as .yaml, .yml or .json; pass a name with one of them"
    return None


def key_of(action: argparse.Action) -> str:
    """The recipe key a flag is written with: its long name without dashes, ``_`` for ``-`` (``no_foreach``)."""
    return max(action.option_strings, key=len).lstrip("-").replace("-", "_")


# ---------------------------------------------------------------------- reading one key
def _config_path(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[str | None, list[str]]:
    """The ``--config`` file (None without one) and the command line without it."""
    paths, typed, tokens = [], [], list(argv)
    while tokens:
        token = tokens.pop(0)
        if token == CONFIG_FLAG:
            if not tokens:
                parser.error("argument --config: expected one argument")
            paths.append(tokens.pop(0))
        elif token.startswith(CONFIG_FLAG + "="):
            paths.append(token.split("=", 1)[1])
        else:
            typed.append(token)
    if len(paths) > 1:
        parser.error(f"--config given {len(paths)} times ({', '.join(paths)}); pass one recipe (flags on the command "
                     "line override it)")
    return (paths[0] if paths else None), typed


def _actions_by_option(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {option: action for action in parser._actions for option in action.option_strings}


def _keys(parser: argparse.ArgumentParser, switch_fields: Mapping[str, str]) -> dict[str, tuple]:
    """Every key a recipe may use -> (the flag's action, the value that sets a switch, the value that leaves it off):
    a switch's own name takes true/false, its field's name (its dest) the field's value."""
    keys, options = {}, _actions_by_option(parser)
    for action in parser._actions:
        if not action.option_strings or action.dest in NOT_IN_A_RECIPE:
            continue
        keys[action.dest] = (action, action.const, action.default)
        for option in action.option_strings:
            if option.startswith("--"):
                keys.setdefault(option[2:].replace("-", "_"), (action, True, False))
    keys.update({field: (options[flag], False, True) for field, flag in switch_fields.items()})
    return keys


def _action_of(parser: argparse.ArgumentParser, key: Any, path: str, switch_fields: Mapping[str, str]) -> tuple:
    """The flag a recipe key sets (`_keys`), or `parser.error` naming the closest key."""
    keys = _keys(parser, switch_fields)
    name = str(key).replace("-", "_")
    if name in keys:
        return keys[name]
    if name == "config":
        parser.error(f"{path}: a recipe cannot name another recipe (config); pass one --config")
    close = difflib.get_close_matches(name, keys, n=1)
    hint = (f"; did you mean {close[0]!r}?" if close else
            f"; the keys are the flags' names without dashes ({parser.prog} --help)")
    parser.error(f"{path}: unknown key {key!r}{hint}")
    raise AssertionError  # parser.error exits


def _tokens_of(parser: argparse.ArgumentParser, action: argparse.Action, switch: tuple, value: Any,
               where: str) -> list[str]:
    """The command-line tokens of one recipe value (a switch's flag when `value` is `switch`'s on value, or
    ``--flag=value``)."""
    flag = max(action.option_strings, key=len)
    if action.nargs == 0:
        on, off = switch
        if isinstance(value, bool) is isinstance(on, bool) and value == on:
            return [flag]
        if value == off and (off is None or isinstance(value, bool) is isinstance(off, bool)):
            return []
        parser.error(f"{where}: {flag} is a switch: write {json.dumps(on)} ({flag}) or {json.dumps(off)}, not "
                     f"{json.dumps(value)}")
    if isinstance(value, Mapping):
        parser.error(f"{where}: {flag} takes a value, not a mapping")
    if isinstance(value, list):
        if action.nargs not in (None, "?"):
            return [flag, *(_text(item) for item in value)]
        if type(action) is argparse._StoreAction:  # given twice, the last value would win: one value only
            parser.error(f"{where}: {flag} takes one value, not a list")
        return [f"{flag}={_text(item)}" for item in value]  # a flag whose repeats add up (append, --report-to)
    if value is None:
        return [] if action.default is None else [f"{flag}=none"]  # the flag's own reading of "none"
    return [f"{flag}={_text(value)}"]


def _text(value: Any) -> str:
    """A recipe value as the command line writes it (a bool as true/false, for a flag whose type reads them)."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def _check_value(parser: argparse.ArgumentParser, tokens: list[str], where: str) -> None:
    """The flag's own check of its value (type, choices, bounds), said with the file and the key."""
    if not tokens:
        return
    checking = copy.copy(parser)  # the same flags, raising instead of exiting
    checking.exit_on_error = False
    try:
        checking.parse_known_args(tokens, argparse.Namespace())
    except argparse.ArgumentError as error:
        parser.error(f"{where}: {error}")


# ---------------------------------------------------------------------- YAML, with 1.2's booleans
def _yaml():
    import yaml

    return yaml


def _recipe_loader():
    """PyYAML's safe loader with YAML 1.2's booleans: yes/no/on/off stay strings (``eval_every: no``)."""
    yaml = _yaml()

    class RecipeLoader(yaml.SafeLoader):
        pass

    RecipeLoader.yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:bool",
                                       re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return RecipeLoader
