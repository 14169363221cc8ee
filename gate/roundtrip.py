#!/usr/bin/env python3
"""In-process CPU round-trip harness for LMCache's LMCache-driven transfer path.

What ``patchtool verify --roundtrip`` runs by path in the target interpreter;
the harness itself is ``gate/harness.py`` (its docstring
describes the cells, the guards and ``--device cuda``)::

    PYTHONPATH=<overlay>:<repo> <venv>/bin/python gate/roundtrip.py --json --preset qwen35-0.8b
    ... gate/roundtrip.py --json --matrix fast --path native

The harness was written against 0.5.3; before any cell runs,
:func:`ports_compat.install` adapts it to the lmcache it finds (0.5.4+ moved
the ops module, 0.5.6 the transfer functions and the storage-manager
surface), as every other driver of the harness does.

The folder above ``gate/`` is on ``PYTHONPATH`` (patchtool's runner puts
it there), so the helpers import as ``gate.<name>``.
"""

import sys

from gate import harness, ports_compat


def main(argv: list[str] | None = None) -> int:
    # After argparse (``--help`` needs no torch), before the first cell.
    return harness.main(argv, prepare=ports_compat.install)


if __name__ == "__main__":
    sys.exit(main())
