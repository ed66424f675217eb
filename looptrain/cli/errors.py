"""The command lines' own error: a bad flag or input, reported as one line naming the fix (no traceback)."""


class UsageError(Exception):
    """A bad flag or input found by a command line itself (`looptrain-finetune`, `looptrain-predict`, ...)."""
