"""apply and revert: commit the plan that :mod:`patchtool.planning` made.

``--dry-run`` returns the plan's result without writing; the real command
commits exactly the plan's changes in one :func:`transaction.commit`, so what
the dry run said is what happens.  State kept in ``<site>/.lmcache-patchtool/``
(see :mod:`patchtool.state`): ``state.json`` and ``originals/``, written in
the same transaction as the patched files.
"""

from __future__ import annotations

from . import classify as C
from .fsio import Reader
from .manifest import PatchSetDir
from .planning import ApplyResult, RevertResult, plan_apply, plan_revert
from .target import Target
from .transaction import commit


def apply(target: Target, pset: PatchSetDir, assessed: C.Assessment, *,
          patch_id: str | None = None,
          dry_run: bool = False, accept_record_mismatch: bool = False,
          reader: Reader | None = None, layers: list[PatchSetDir] | None = None,
          discovery=None) -> ApplyResult:
    """Apply ``pset``; for a stacked set, with the layers below it that are
    not applied yet, in the same single transaction."""
    plan = plan_apply(target, pset, assessed, reader or Reader(), patch_id=patch_id,
                      accept_record_mismatch=accept_record_mismatch, layers=layers,
                      discovery=discovery)
    plan.raise_first()
    res = plan.result
    assert isinstance(res, ApplyResult)
    if not plan.changes:
        res.removed_pyc = []
        return res
    if dry_run:
        res.action = "dry-run"
        return res
    commit(target.state_dir, plan.changes)
    # Changes that only remove leftover state leave the install as it was.
    res.action = "applied" if res.changed_files else "no-op"
    return res


def revert(target: Target, pset: PatchSetDir | None, assessed: C.Assessment, *,
           dry_run: bool = False, reader: Reader | None = None,
           layers: list[PatchSetDir] | None = None, only: str | None = None) -> RevertResult:
    """Peel every applied set, top first, or with ``only`` just the top one."""
    plan = plan_revert(target, pset, assessed, reader or Reader(), layers=layers, only=only)
    plan.raise_first()
    res = plan.result
    assert isinstance(res, RevertResult)
    if not plan.changes:
        return res
    if dry_run:
        res.action = "dry-run"
        return res
    commit(target.state_dir, plan.changes)
    res.action = "reverted" if res.restored_files else "no-op"
    return res
