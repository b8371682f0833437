"""Errors raised while finding and reading datasets.

All of them derive from :class:`DatasetError`, so a caller (the CLI) can catch one class and
print the message, which always says what was expected, where it looked and how to fix it.
"""

from __future__ import annotations

from revtrain.errors import RevtrainError

__all__ = ["DatasetError", "DatasetNotFoundError", "DatasetFormatError"]


class DatasetError(RevtrainError):
    """Base class of every revtrain data error."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """A dataset folder or one of its files does not exist."""


class DatasetFormatError(DatasetError, ValueError):
    """A dataset file exists but does not hold what its format promises."""
