"""Exception classes.  A :class:`Refusal` is the only way a command declines to
act: the CLI prints it as ONE line ``patchtool: <file>: <reason>`` and exits
with its code, and nothing has been written by then: refusals are raised
before any transaction starts, except :class:`WriteRefusal`, which is raised
only after the transaction that hit it was rolled back."""

from __future__ import annotations

from .exitcodes import ExitCode


def excerpt(text: str, limit: int = 80) -> str:
    """Another program's output quoted in a refusal: one line, whitespace
    collapsed, at most ``limit`` characters (a refusal stays one short line,
    whatever the program printed; a shell echoing the probe script it was
    handed printed ~600)."""
    flat = " ".join(text.split()) or "no output"
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


class Refusal(Exception):
    code: ExitCode = ExitCode.REFUSED

    def __init__(self, file: object, reason: str, code: ExitCode | None = None) -> None:
        super().__init__(f"{file}: {reason}")
        self.file = str(file)
        self.reason = reason
        if code is not None:
            self.code = code


class NotInstalled(Refusal):
    code = ExitCode.NOT_INSTALLED


class PatchParseError(Refusal):
    """A patch file unidiff cannot parse, or one this tool does not support
    (added/removed/renamed/binary files, paths outside site-packages)."""


class TargetStateRefusal(Refusal):
    """The install is in a state the command cannot act on (drifted, unsupported
    version, fixed upstream); the code is the state's exit code."""


class WriteRefusal(Refusal):
    """The filesystem refused a write during a transaction (ENOSPC, EFBIG,
    EROFS, EIO...); the transaction was rolled back before this was raised."""

    code = ExitCode.WRITE_FAILED
