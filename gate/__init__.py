"""Helpers of the verification scripts in ``verify/`` (lmcache-patchtool).

The scripts at the top of ``verify/`` (``restore_gate.py``, ``roundtrip.py``,
``engine_gate.py``, ``tiny_hybrid_model.py``) run by path in the TARGET
interpreter, which puts ``verify/`` first on ``sys.path``; everything they
import lives in this one uniquely named package, so no helper name
(``procs``, ``geometry``, ...) can shadow or be shadowed by a module of the
target environment.  Drivers used by the tests and the lent-device run
(``ports_roundtrip``, ``ports_dcp_probe``, ``registration_probe``,
``resync_sim``, ``roundtrip_device``, ``ed_lock_probe``,
``ed_staging_probe``) run as
``python -m lmcache_patchtool_verify.<name>`` with ``verify/`` on
``PYTHONPATH``.

The wheel ships only the three scripts patchtool runs (``restore_gate.py``,
``roundtrip.py``, ``engine_gate.py``) and the modules they import: the explicit
list in pyproject.toml, which tests/tool/test_packaging.py checks.  The rest
stays in the checkout.

Importing the package imports nothing else (no torch, no lmcache).
"""
