"""Where a command line's messages go: one `Console` per rank, rank 0 speaking and every other rank silent.

A run opens its rank's console once (`speaking`); every function that has something to say calls `say`, instead of
receiving a `print` to call.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Console:
    """One rank's messages.

    Args:
        speaks: this rank prints (rank 0); the others say nothing.
        to_stderr: messages go to stderr, because stdout holds the command's result (``--plan-only --json``).
    """

    speaks: bool = True
    to_stderr: bool = False

    def say(self, *parts: object) -> None:
        """Prints `parts` as `print` does, where this rank's messages go."""
        if self.speaks:
            print(*parts, file=sys.stderr if self.to_stderr else sys.stdout)


_ANYWHERE = Console()  # outside a run (a function called from Python): messages print to stdout
_CURRENT: contextvars.ContextVar[Console] = contextvars.ContextVar("looptrain_console", default=_ANYWHERE)


def current() -> Console:
    """This rank's console: the one `speaking` opened, else one that prints to stdout."""
    return _CURRENT.get()


def say(*parts: object) -> None:
    """Prints `parts` on this rank's console (nothing on ranks other than 0 during a run)."""
    _CURRENT.get().say(*parts)


@contextlib.contextmanager
def speaking(console: Console) -> Iterator[Console]:
    """Makes `console` this rank's console while the block runs."""
    token = _CURRENT.set(console)
    try:
        yield console
    finally:
        _CURRENT.reset(token)
