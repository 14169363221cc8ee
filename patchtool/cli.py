"""Command line: parse arguments, call the logic, hand results to output.

Thin on purpose; start-up imports stay light (no rich, no unidiff) so that
``patchtool status --json`` is cheap.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from . import __version__
from .errors import Refusal
from .exitcodes import ExitCode


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def _targeting() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--python", metavar="PATH",
                   help="interpreter of the venv to act on (default: this one)")
    g.add_argument("--site-packages", metavar="DIR",
                   help="a plain site dir (e.g. from pip install --target)")
    p.add_argument("--set", dest="set_name", metavar="NAME",
                   help="patch set name (needed only when several cover one version)")
    return p


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="patchtool", description="Patch an installed LMCache "
                                 "with a shipped, hash-pinned series of unified diffs.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    common, targeting = _common(), _targeting()

    s = sub.add_parser("status", parents=[common, targeting], help="classify the install")
    s.add_argument("--deep", action="store_true", help="verify every RECORD row, not only "
                   "the target files'")
    a = sub.add_parser("apply", parents=[common, targeting], help="apply the patch series")
    a.add_argument("--dry-run", action="store_true", help="write nothing; show per-hunk results")
    a.add_argument("--patch", metavar="ID", help="apply the series only up to this patch "
                   "(id, file name or NN prefix)")
    r = sub.add_parser("revert", parents=[common, targeting], help="restore the original files")
    r.add_argument("--dry-run", action="store_true")
    v = sub.add_parser("verify", parents=[common, targeting],
                       help="exit 0 only if patched with the current revision and every hash matches")
    v.add_argument("--restore", choices=("cpu", "gpu"), help="also run the restore check")
    sub.add_parser("list", parents=[common], help="list shipped patch sets")
    m = sub.add_parser("manifest", help="manifest tooling")
    msub = m.add_subparsers(dest="manifest_command", required=True)
    b = msub.add_parser("build", parents=[common], help="generate manifest.json from a wheel")
    b.add_argument("directory", metavar="PATCHSET_DIR", help="e.g. patches/hybrid-fa/0.5.3")
    b.add_argument("--wheel", required=True, metavar="FILE.whl", help="the real lmcache wheel")
    b.add_argument("--revision", type=int, help="default: keep the existing manifest's, else 1")
    b.add_argument("--vllm", action="append", dest="vllm_versions", metavar="VERSION",
                   help="vLLM version verified with (repeatable; default: keep existing)")
    b.add_argument("--upstream", action="append", metavar="REF",
                   help="upstream issue/PR URL (repeatable; default: keep existing)")
    b.add_argument("--fixed-upstream", metavar="REASON",
                   help="mark this version as needing no patch, with a reason")
    return ap


@contextmanager
def _session(args, *, writes: bool) -> Iterator[tuple]:
    """Locate the target, take the lock, roll back any interrupted run, load
    the patch set; yields (discovery, patch set or None, recovered count)."""
    from . import resources
    from .manifest import find_patch_set
    from .target import discover
    from .transaction import JOURNAL, Lock, recover

    disc = discover(args.python, args.site_packages)
    t = disc.target
    if t is None:
        yield disc, None, 0
        return
    if not writes and not (t.state_dir / JOURNAL).exists():
        # Nothing to recover: a reader needs no lock (and works on a site dir
        # it cannot write).
        yield disc, find_patch_set(resources.patches_root(), t.version, args.set_name), 0
        return
    with Lock(t.site):
        recovered = recover(t.state_dir) if t.state_dir.exists() else 0
        yield disc, find_patch_set(resources.patches_root(), t.version, args.set_name), recovered


def _emit(args, kind: str, obj, code: int = 0) -> int:
    from . import output

    (output.emit_json if args.json else output.emit_human)(kind, obj, code)
    return int(code)


def cmd_status(args) -> int:
    from .classify import classify

    with _session(args, writes=False) as (disc, pset, recovered):
        st = classify(disc, pset, deep=args.deep, set_name=args.set_name)
    st.recovered_files = recovered
    return _emit(args, "status", st)


def cmd_apply(args) -> int:
    from . import actions
    from .classify import classify
    from .target import require_target

    # A dry run takes the lock only to recover; it never creates anything.
    with _session(args, writes=not args.dry_run) as (disc, pset, _):
        target = require_target(disc)
        st = classify(disc, pset, set_name=args.set_name)
        if pset is None:
            actions._refuse_state(st, target)
        res = actions.apply(target, pset, st, patch_id=args.patch, dry_run=args.dry_run)
        if res.action == "applied":
            res.state_after = classify(disc, pset).state
    return _emit(args, "apply", res)


def cmd_revert(args) -> int:
    from . import actions
    from .classify import classify
    from .target import require_target

    with _session(args, writes=not args.dry_run) as (disc, pset, _):
        target = require_target(disc)
        st = classify(disc, pset, set_name=args.set_name)
        res = actions.revert(target, pset, st, dry_run=args.dry_run)
        if res.action == "reverted":
            res.state_after = classify(disc, pset).state
    return _emit(args, "revert", res)


def cmd_verify(args) -> int:
    from . import resources, verify_checks as vc
    from .classify import classify

    extra = []
    if args.restore:
        name = vc.restore_check_name(args.restore)
        if name not in vc.REGISTRY:
            raise Refusal(f"--restore {args.restore}", "not available yet in this version of "
                          "patchtool")
        extra.append(name)
    with _session(args, writes=False) as (disc, pset, recovered):
        st = classify(disc, pset, deep=True, set_name=args.set_name)
        st.recovered_files = recovered
        if disc.target is None:
            res = vc.VerifyResult(False, st.state, ExitCode.NOT_INSTALLED, st)
        else:
            ctx = vc.CheckContext(disc.target, st, pset, resources.verify_root())
            res = vc.run_verify(ctx, extra)
    return _emit(args, "verify", res, res.exit_code)


def cmd_list(args) -> int:
    from . import resources
    from .manifest import list_patch_sets

    return _emit(args, "list", list_patch_sets(resources.patches_root()))


def cmd_manifest(args) -> int:
    from .manifest import BuildSummary, build_manifest

    m = build_manifest(Path(args.directory), Path(args.wheel), revision=args.revision,
                       vllm_versions=args.vllm_versions, upstream=args.upstream,
                       fixed_upstream=args.fixed_upstream)
    summary = BuildSummary(str(Path(args.directory) / "manifest.json"), m.lmcache_version,
                           m.state, m.revision, len(m.patches), len(m.files), m.to_json())
    return _emit(args, "manifest", summary)


COMMANDS = {"status": cmd_status, "apply": cmd_apply, "revert": cmd_revert,
            "verify": cmd_verify, "list": cmd_list, "manifest": cmd_manifest}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except Refusal as exc:
        from . import output

        output.refusal(exc, getattr(args, "json", False))
        return int(exc.code)


if __name__ == "__main__":
    sys.exit(main())
