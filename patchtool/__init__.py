"""lmcache-patchtool: hash-pinned patch series for an installed LMCache.

Importing this package is cheap on purpose (no rich, no unidiff): ``status
--json`` is meant to be faster than ``pip show``.
"""

__version__ = "0.1.0"
