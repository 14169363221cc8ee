"""The states of an install and of one target file.

:class:`State` is the overall state of an install (docs/reference.md,
"States"), each with the exit code ``verify`` returns for it; the ``F_*``
words are the states of one target file.  They live below everything that
judges or changes an install, so that every module speaks of states without
importing the classifier.
"""

from __future__ import annotations

from enum import Enum

from .exitcodes import ExitCode


class State(str, Enum):
    """The overall state of an install; each carries the exit code ``verify``
    returns for it, so no table elsewhere maps the two."""

    NOT_INSTALLED = ("not-installed", ExitCode.NOT_INSTALLED)
    PRISTINE = ("pristine", ExitCode.PRISTINE)
    PATCHED = ("patched", ExitCode.OK)
    PATCHED_OLDER = ("patched-older-revision", ExitCode.PATCHED_OLDER_REVISION)
    PARTIAL = ("partially-patched", ExitCode.PARTIALLY_PATCHED)
    DRIFTED = ("drifted", ExitCode.DRIFTED)
    UNSUPPORTED = ("unsupported-version", ExitCode.UNSUPPORTED_VERSION)
    FIXED_UPSTREAM = ("fixed-upstream", ExitCode.FIXED_UPSTREAM)

    exit_code: ExitCode

    def __new__(cls, value: str, exit_code: ExitCode) -> "State":
        obj = str.__new__(cls, value)
        obj._value_ = value
        obj.exit_code = exit_code
        return obj

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


# The state of one target file.
F_PRISTINE, F_PATCHED, F_PARTIAL, F_OLDER, F_DRIFTED, F_MISSING = (
    "pristine", "patched", "partial", "patched-older-revision", "drifted", "missing")
