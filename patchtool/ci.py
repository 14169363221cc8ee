"""``patchtool ci``: the deployment gate.

From a pin (``--pin lmcache==X``, ``--requirements FILE`` or ``--wheel
FILE``) it resolves the lmcache version, finds its patch set, fetches the
real wheel, builds the patched wheel (``wheelbuild``), installs it into a
scratch ``--target`` dir, checks the install is ``patched``, and runs the
round-trip harness and the CPU restore gate against it in ``--python`` (an
interpreter with torch and lmcache's dependencies; the scratch dir goes
first on its PYTHONPATH).  Each phase is timed; the first failure decides
the exit code; later phases are skipped.  Warnings (a wheel unknown to the
manifest whose files still match, a deployment vLLM the patch set was not
verified with, a requirements pin the rebuild does not reproduce) fail the
gate unless ``--allow-warnings``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from packaging.requirements import InvalidRequirement, Requirement

from . import resources, runner, wheelbuild
from . import checks as vc
from .classify import classify
from .distinfo import DIST, canonical_name
from .errors import Refusal
from .exitcodes import ExitCode
from .manifest import STATE_FIXED_UPSTREAM, PatchSetDir
from .provenance import pinned_set, split_local
from .stack import resolve as resolve_stack
from .target import discover
from .wheelbuild import WheelBuild, parse_pin

PASS, FAIL, ERROR, WARN, SKIPPED = "pass", "fail", "error", "warn", "skipped"
PHASES = ("resolve", "patch-set", "fetch", "build", "install", "verify", "roundtrip", "restore")


@dataclass
class Phase:
    phase: str
    result: str  # pass | warn | fail | error | skipped
    seconds: float
    detail: str = ""
    exit_code: int = 0
    data: dict = field(default_factory=dict)


@dataclass
class CiResult:
    ok: bool
    verdict: str
    exit_code: int
    source: str  # what was gated: the pin, the requirements file or the wheel
    lmcache_version: str | None = None
    patch_set: str | None = None
    revision: int | None = None
    python: str | None = None
    wheel: dict | None = None  # the built wheel (WheelBuild)
    warnings: list[str] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    work_dir: str | None = None
    total_seconds: float = 0.0


@dataclass
class Pin:
    version: str
    source: str
    requirement: str | None  # the lmcache line as given
    pinned_local: str | None = None  # "0.5.3+hybridfa.r1" when the file pins a patched build
    pinned_hashes: list[str] = field(default_factory=list)
    vllm: str | None = None  # the deployment's vLLM pin, when the file has one


def parse_requirements(path: Path) -> Pin:
    """The exact lmcache pin (and a vllm pin, if any) of a requirements file.
    Options lines (``-r``, ``--index-url``) are skipped; ``--hash`` options
    on the lmcache line are kept to compare with the rebuilt wheel."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise Refusal(path, f"cannot read: {exc.strerror or exc}") from None
    logical = text.replace("\\\r\n", " ").replace("\\\n", " ")
    lmcache: list[tuple[str, list[str]]] = []
    vllm = None
    for raw in logical.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        parts = line.split(" --")
        spec, opts = parts[0].strip(), parts[1:]
        try:
            req = Requirement(spec)
        except InvalidRequirement as exc:
            raise Refusal(path, f"cannot parse {spec!r} ({exc})") from None
        if req.marker is not None and not req.marker.evaluate():
            continue
        name = canonical_name(req.name)
        if name == DIST:
            hashes = [o.split("=", 1)[1].strip().removeprefix("sha256:") for o in opts
                      if o.startswith("hash=")]
            lmcache.append((spec, hashes))
        elif name == "vllm":
            pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
            vllm = pins[0] if pins else None
    if not lmcache:
        raise Refusal(path, "does not pin lmcache")
    if len(lmcache) > 1:
        raise Refusal(path, "has several lmcache lines")
    spec, hashes = lmcache[0]
    version, _ = parse_pin(spec)
    public, tag, _ = split_local(version)
    return Pin(public, str(path), spec, version if tag else None, hashes, vllm)


class _Gate:
    """Runs the phases; owns the timing and the first-failure rule."""

    def __init__(self, result: CiResult) -> None:
        self.result = result
        self.failed = False

    def run(self, name: str, fn: Callable[[Phase], Any]) -> Any:
        ph = Phase(name, PASS, 0.0)
        self.result.phases.append(ph)
        if self.failed:
            ph.result, ph.detail = SKIPPED, "an earlier phase failed"
            return None
        started = time.monotonic()
        try:
            value = fn(ph)
        except Refusal as exc:
            ph.result, ph.exit_code = FAIL, int(exc.code)
            ph.detail = f"{exc.file}: {exc.reason}"
            value = None
        ph.seconds = round(time.monotonic() - started, 3)
        if ph.result in (FAIL, ERROR):
            self.failed = True
            if not self.result.exit_code:
                self.result.exit_code = ph.exit_code or int(ExitCode.REFUSED)
        return value

    def warn(self, ph: Phase, text: str) -> None:
        ph.result = WARN if ph.result == PASS else ph.result
        self.result.warnings.append(text)


@dataclass
class _Inputs:
    """What the command line gave the gate."""

    pin: str | None
    requirements: str | None
    wheel: str | None
    python: str  # the interpreter the phases run in
    set_name: str | None
    presets: list[str]
    vllm: str | None
    output_dir: str | None
    timeout: float | None
    echo: bool
    roundtrip_matrix: str


class _Phases:
    """The gate's phases, in order; each fills in what the next one needs
    (``None`` until its phase has run).  :class:`_Gate` runs them."""

    def __init__(self, given: _Inputs, res: CiResult, gate: _Gate, scratch: Path,
                 probe: dict) -> None:
        self.given, self.res, self.gate, self.scratch, self.probe = given, res, gate, scratch, probe
        self.pin: Pin | None = None
        self.vllm: str | None = None
        self.pset: PatchSetDir | None = None
        self.layers: list[PatchSetDir] = []
        self.wheel: Path | None = None
        self.build: WheelBuild | None = None
        self.site: Path | None = None
        self.vctx: vc.CheckContext | None = None

    def resolve(self, ph: Phase) -> None:
        """The lmcache version the input pins (and the deployment's vLLM)."""
        g = self.given
        if g.pin is not None:
            version, _ = parse_pin(g.pin)
            public, tag, _ = split_local(version)
            self.pin = Pin(public, g.pin, g.pin, version if tag else None)
        elif g.requirements is not None:
            self.pin = parse_requirements(Path(g.requirements))
        else:
            assert g.wheel is not None
            self.pin = Pin(wheelbuild.wheel_version(Path(g.wheel)), g.wheel, None)
        p = self.pin
        self.res.lmcache_version = p.version
        self.vllm = g.vllm or p.vllm or self.probe.get("vllm")
        ph.detail = f"lmcache {p.version}" + (f" (pinned as {p.pinned_local})"
                                              if p.pinned_local else "") + \
            (f", vLLM {self.vllm}" if self.vllm else ", vLLM not pinned")
        ph.data = {"version": p.version, "requirement": p.requirement, "vllm": self.vllm}

    def patch_set(self, ph: Phase) -> None:
        """The shipped set (and its stack) for that version."""
        assert self.pin is not None and self.res.lmcache_version is not None
        chosen, p = self.given.set_name, self.pin
        if p.pinned_local:  # a pin of a wheel this tool built names its top set
            chosen = pinned_set(resources.patches_root(), p.requirement or p.source,
                                p.pinned_local, chosen)[1]
        pset = wheelbuild.locate_patch_set(resources.patches_root(), self.res.lmcache_version,
                                           chosen)
        m = pset.manifest
        self.res.patch_set, self.res.revision = pset.name, m.revision
        if m.state == STATE_FIXED_UPSTREAM:
            raise Refusal(pset.path / "manifest.json", f"lmcache {pset.version} needs no "
                          f"patch: {m.reason}", ExitCode.FIXED_UPSTREAM)
        self.pset = pset
        self.layers = layers = resolve_stack(resources.patches_root(), pset)
        below = "".join(f"{p.name} revision {p.manifest.revision} + " for p in layers[:-1])
        ph.detail = (f"{below}{pset.name} revision {m.revision}, {len(m.patches)} patches, "
                     f"vLLM verified: {', '.join(m.vllm_versions) or '-'}")
        ph.data = {"path": str(pset.path), "vllm_versions": m.vllm_versions}
        if self.vllm and self.vllm not in m.vllm_versions:
            self.gate.warn(ph, f"the deployment's vLLM {self.vllm} is not among the versions "
                           f"the patch set was verified with "
                           f"({', '.join(m.vllm_versions) or 'none'})")

    def fetch(self, ph: Phase) -> None:
        """The real upstream wheel: the one given, or pip download's."""
        if self.given.wheel is not None:
            self.wheel = Path(self.given.wheel)
            ph.detail = f"local file {self.wheel.name}"
            return
        assert self.res.lmcache_version is not None
        self.wheel = wheelbuild.download(self.res.lmcache_version, self.given.python,
                                         self.scratch / "download")
        ph.detail = f"downloaded {self.wheel.name}"

    def build_wheel(self, ph: Phase) -> None:
        """The patched wheel, and what about it the operator must know."""
        assert self.wheel is not None and self.pset is not None and self.pin is not None
        b = wheelbuild.build(self.wheel, self.pset, self.scratch / "wheel", self.layers)
        self.build = b
        self.res.wheel = {k: getattr(b, k) for k in ("filename", "sha256", "version",
                                                     "requirement", "source")}
        ph.detail = (f"{b.filename} sha256 {b.sha256[:16]}… (source verified by "
                     f"{b.source['verified_by']})")
        for w in b.warnings:
            self.gate.warn(ph, w)
        p = self.pin
        if p.pinned_local and p.pinned_local != b.version:
            self.gate.warn(ph, f"the requirements pin {p.pinned_local}, but the shipped patch "
                           f"set builds {b.version}")
        if p.pinned_hashes and b.sha256 not in p.pinned_hashes:
            self.gate.warn(ph, f"the requirements' --hash for lmcache does not match the "
                           f"rebuilt wheel (sha256 {b.sha256})")
        if self.given.output_dir:
            dest = Path(self.given.output_dir)
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(b.path, dest / b.filename)
            self.res.wheel["path"] = str(dest / b.filename)

    def install(self, ph: Phase) -> None:
        """``pip install --no-deps --target`` of the patched wheel into scratch."""
        assert self.build is not None
        site = self.scratch / "site"
        shutil.rmtree(site, ignore_errors=True)
        cmd = [self.given.python, "-m", "pip", "install", "--no-deps", "--no-index",
               "--disable-pip-version-check", "-q", "--target", str(site), self.build.path]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise Refusal(self.build.filename, f"pip install --target failed: {last}",
                          ExitCode.PIP_FAILED)
        self.site = site
        ph.detail = f"pip install --no-deps --target {site}"

    def verify(self, ph: Phase) -> None:
        """The install is ``patched`` with every hash matching; then the
        environment the restore phases run in."""
        assert self.site is not None and self.pset is not None
        disc = discover(None, str(self.site))
        st = classify(disc, self.pset, deep=True, stack=self.layers)
        assert disc.target is not None
        vr = vc.run_verify(vc.CheckContext(disc.target, st, self.pset,
                                           resources.gate_root()), [])
        ph.data = {"state": st.state, "checks": [c.name for c in vr.checks if c.ok],
                   "sets": [{"name": s.name, "revision": s.revision, "state": s.state}
                            for s in st.sets]}
        if not vr.ok:
            ph.result, ph.exit_code = FAIL, vr.exit_code
            ph.detail = f"installed wheel is {vr.verdict}: {st.detail}"
            return
        rec = st.record
        ph.detail = f"status patched, {rec.checked if rec else 0} RECORD rows verified"
        g = self.given
        env = runner.resolve(g.python, str(self.site), self.site,
                             "the ci gate's round-trip and restore phases")
        self.vctx = vc.CheckContext(disc.target, st, self.pset, resources.gate_root(),
                                    vc.CheckOptions(env=env, presets=g.presets,
                                                    timeout=g.timeout, echo=g.echo,
                                                    matrix=g.roundtrip_matrix))

    def check(self, name: str) -> Callable[[Phase], None]:
        """A registered restore check (checks.py) as a phase."""
        def run(ph: Phase) -> None:
            assert self.vctx is not None
            c = vc.REGISTRY[name](self.vctx)
            ph.detail, ph.data = c.detail, c.data
            if not c.ok:
                ph.result = ERROR if c.error else FAIL
                ph.exit_code = ExitCode.RESTORE_ERROR if c.error else ExitCode.RESTORE_FAILED
        return run


def run_ci(*, pin: str | None, requirements: str | None, wheel: str | None,
           python: str | None, set_name: str | None, presets: list[str] | None,
           vllm: str | None, allow_warnings: bool, work_dir: str | None, keep: bool,
           output_dir: str | None, timeout: float | None, echo: bool,
           roundtrip_matrix: str = "fast") -> CiResult:
    started = time.monotonic()
    res = CiResult(False, "", 0, pin or requirements or wheel or "")
    given = _Inputs(pin, requirements, wheel, python or sys.executable, set_name, presets or [],
                    vllm, output_dir, timeout, echo, roundtrip_matrix)
    res.python = given.python
    probe = _refuse_unusable_input(given, python)
    scratch = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="patchtool-ci-"))
    scratch.mkdir(parents=True, exist_ok=True)
    res.work_dir = str(scratch)
    gate = _Gate(res)
    phases = _Phases(given, res, gate, scratch, probe)
    try:
        for name, step in (("resolve", phases.resolve), ("patch-set", phases.patch_set),
                           ("fetch", phases.fetch), ("build", phases.build_wheel),
                           ("install", phases.install), ("verify", phases.verify),
                           ("roundtrip", phases.check(vc.ROUNDTRIP_CHECK)),
                           ("restore", phases.check("restore-cpu"))):
            gate.run(name, step)
    finally:
        if not keep and work_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
            res.work_dir = None
    res.total_seconds = round(time.monotonic() - started, 3)
    _verdict(res, gate, allow_warnings)
    return res


def _refuse_unusable_input(given: _Inputs, python: str | None) -> dict:
    """Input that cannot work is refused up front, in one line, before any
    phase: a missing file, or an interpreter without torch.  Returns the
    interpreter's probe."""
    if given.wheel is not None and not Path(given.wheel).is_file():
        raise Refusal(given.wheel, "no such wheel file")
    if given.requirements is not None and not Path(given.requirements).is_file():
        raise Refusal(given.requirements, "no such requirements file")
    return runner.resolve(python, None, None, "the ci gate's round-trip and restore phases").probe


def _verdict(res: CiResult, gate: _Gate, allow_warnings: bool) -> None:
    """The first failed phase decides; else unaccepted warnings fail; else pass."""
    if gate.failed:
        bad = next(p for p in res.phases if p.result in (FAIL, ERROR))
        res.verdict = f"{bad.result}: {bad.phase}"
    elif res.warnings and not allow_warnings:
        res.exit_code = int(ExitCode.CI_WARNINGS)
        res.verdict = f"fail: {len(res.warnings)} warning(s) (--allow-warnings accepts them)"
    else:
        res.ok, res.exit_code = True, int(ExitCode.OK)
        res.verdict = "pass" + (f" with {len(res.warnings)} accepted warning(s)"
                                if res.warnings else "")
