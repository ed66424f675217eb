"""The command lines' own error: a bad flag or input, reported as one line naming the fix (no traceback)."""


class UsageError(Exception):
    """A bad flag or input found by a command line itself (`looptrain-finetune`, `looptrain-predict`, ...)."""


def program_name(script: str) -> str:
    """The command's name as the user typed it, for its usage line (argparse's ``prog``).

    The console script's name under it (``looptrain-predict``), ``python -m looptrain.memory`` when run as a module
    (argparse's default would say ``__main__.py``), else `script`: the file of scripts/ (``predict.py``, argparse's
    own default there) and what a caller of ``main(argv)`` from Python sees.
    """
    import os
    import sys

    typed = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if typed.startswith("looptrain-"):
        return typed.removesuffix(".exe")
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("looptrain."):
        return "python -m " + spec.name.removesuffix(".__main__")
    return script
