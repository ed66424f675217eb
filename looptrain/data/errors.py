"""DataError, the one exception for bad input data and bad data options."""

from __future__ import annotations


class DataError(ValueError):
    """Bad input data or data options; the message names the problem and the fix."""
