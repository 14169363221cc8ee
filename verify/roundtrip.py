#!/usr/bin/env python3
"""In-process CPU round-trip harness for LMCache's LMCache-driven transfer path.

What ``patchtool verify --roundtrip`` runs by path in the target interpreter;
the harness itself is ``lmcache_patchtool_verify/harness.py`` (its docstring
describes the cells, the guards and ``--device cuda``)::

    PYTHONPATH=<overlay> <venv>/bin/python verify/roundtrip.py --json --preset qwen35-0.8b
    ... verify/roundtrip.py --json --matrix fast --path native

Run by path, this file's directory is first on ``sys.path``, so the helper
package imports as ``lmcache_patchtool_verify`` and nothing else of
``verify/`` becomes a top-level module in the target interpreter.
"""

import sys

from lmcache_patchtool_verify.harness import main

if __name__ == "__main__":
    sys.exit(main())
