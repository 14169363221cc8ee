"""The CPU restore gate's human progress lines (stderr; stdlib only).

Plain lines, colour only on a terminal (and not under ``NO_COLOR``); nothing
here reaches the JSON report.  ``gate/restore_gate.py`` re-exports
:class:`Display` under its old name.
"""

from __future__ import annotations

import os
from typing import TextIO


class Display:
    def __init__(self, stream: TextIO, quiet: bool = False) -> None:
        self.stream, self.quiet = stream, quiet
        self.color = hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")

    def _c(self, text: str, code: str) -> str:
        return f"\x1b[{code}m{text}\x1b[0m" if self.color else text

    def line(self, text: str = "") -> None:
        if not self.quiet:
            print(text, file=self.stream, flush=True)

    def head(self, text: str) -> None:
        self.line(self._c(text, "1"))

    def step(self, text: str, seconds: float | None = None, ok: bool | None = True) -> None:
        mark = {True: self._c("ok  ", "32"), False: self._c("FAIL", "31;1"), None: "..  "}[ok]
        took = f"  ({seconds:.2f} s)" if seconds is not None else ""
        self.line(f"  {mark} {text}{took}")

    def verdict(self, text: str, passed: bool | None) -> None:
        colour = {True: "32;1", False: "31;1", None: "33;1"}[passed]
        self.line(self._c(text, colour))
