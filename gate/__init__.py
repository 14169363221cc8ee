"""The gate: the proofs ``patchtool verify`` runs (lmcache-patchtool).

Three scripts run by path in the TARGET interpreter (the one with torch and
the lmcache under test): ``restore_gate.py`` (the CPU restore gate: a real
``lmcache server``, an fs or Redis tier, a restart, a byte-exact restore),
``roundtrip.py`` (the in-process round trip) and ``engine_gate.py`` (the
restore gate through a real vLLM, on CPU or a GPU).  Everything else here is
what they import: ``restore_*`` the restore gate's steps, ``engine_*`` the
engine gate's, ``harness*`` the round trip's, and the geometry, tier and
process helpers they share; ``engine_shim/`` is put on vLLM's ``PYTHONPATH``
by the engine gate.

Every module imports its siblings as ``gate.<name>``: the folder above this
one is on ``PYTHONPATH`` (patchtool's runner puts it there: the repository
root in a checkout, ``patchtool/_data`` in the wheel).  The wheel ships this
folder whole; nothing here imports the lab (``lab/``), which may import the
gate (tests/unit/test_layout.py).

Importing the package imports nothing else (no torch, no lmcache).
"""
