"""Find the LMCache installation to act on, without importing lmcache.

Three sources: the running interpreter (default), another interpreter given by
``--python`` (asked in a subprocess for its site dirs), or a plain directory
given by ``--site-packages`` (``pip install --target``).  The distribution is
found by its ``lmcache-*.dist-info`` directory only.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from .distinfo import DIST as DIST_NAME  # the one owner of the project name
from .distinfo import dists_in, read_installer, read_json, read_metadata
from .errors import NotInstalled, Refusal, excerpt

# Run in the target interpreter with -I (isolated: no PYTHONPATH, no cwd on
# sys.path, so a stray json.py cannot shadow the stdlib).  Only stdlib modules
# are imported there; lmcache never is.
_SITE_PROBE = r"""
import json, site, sys, sysconfig
paths = sysconfig.get_paths()
dirs = [paths.get("purelib"), paths.get("platlib")]
try:
    dirs += site.getsitepackages()
except AttributeError:
    pass
# The user site is disabled by -I, but the interpreter would normally see it
# (outside a venv), so report it as long as it exists.
if sys.prefix == sys.base_prefix:
    dirs.append(site.getusersitepackages())
print(json.dumps({"executable": sys.executable, "version": sys.version.split()[0], "dirs": dirs}))
"""


@dataclass
class Target:
    """One located lmcache distribution."""

    python: str | None  # interpreter whose site dirs were searched; None for --site-packages
    python_version: str | None
    site_dirs: list[str]  # every dir searched, in order
    site: Path  # the dir holding lmcache-*.dist-info
    dist_info: Path
    version: str
    installer: str
    direct_url: dict | None = field(default=None, repr=False)

    @property
    def record_path(self) -> Path:
        return self.dist_info / "RECORD"

    @property
    def state_dir(self) -> Path:
        # Outside the lmcache package (pip never looks at it, uninstall of
        # lmcache leaves it alone) but on the same filesystem as the targets.
        return self.site / ".lmcache-patchtool"


@dataclass
class Discovery:
    """What was searched; ``target`` is None when lmcache is not installed."""

    python: str | None
    python_version: str | None
    site_dirs: list[str]
    target: Target | None


def resolve_interpreter(python: str) -> Path:
    """``--python`` as a shell would run it: a bare name is looked up on PATH,
    a path is taken relative to the working directory (``./python`` must not
    become ``python``, which the OS would look up on PATH), and a venv
    directory means its ``bin/python``.  Links are not resolved: a venv's
    ``bin/python`` is a link whose own path is what makes it the venv's."""
    if os.sep not in python and (os.altsep is None or os.altsep not in python):
        found = shutil.which(python)
        if found is None:
            raise Refusal(python, "no such interpreter on PATH (give a path, e.g. "
                          "/srv/venv/bin/python)")
        return Path(os.path.abspath(found))
    exe = Path(os.path.abspath(python))
    if exe.is_dir():
        for cand in (exe / "bin" / "python", exe / "bin" / "python3"):
            if cand.is_file():
                return cand
        raise Refusal(python, "is a directory without bin/python: give the venv's "
                      "interpreter, e.g. VENV/bin/python")
    if not exe.exists():
        raise Refusal(python, "no such interpreter")
    if not os.access(exe, os.X_OK):
        raise Refusal(python, "is not executable")
    return exe


def _parse_probe(python: str, stdout: str) -> tuple[str, str, list[str]]:
    """Validate the probe's one JSON line; anything else is a refusal (a
    wrapper script that prints a banner, a non-Python program)."""
    try:
        info = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else None
        exe, version, dirs = info["executable"], info["version"], info["dirs"]
        if not (isinstance(exe, str) and isinstance(version, str) and isinstance(dirs, list)
                and all(d is None or isinstance(d, str) for d in dirs)):
            raise TypeError
    except (ValueError, TypeError, KeyError, IndexError):
        shown = " ".join(stdout.split())[:60] or "nothing"
        raise Refusal(python, f"did not answer like a Python interpreter (printed: {shown!r})") \
            from None
    return exe, version, [d for d in dirs if d]


def _probe_interpreter(python: str) -> tuple[str, str, list[str]]:
    exe = resolve_interpreter(python)
    try:
        # The script goes on stdin ("-"), not argv: a program that is not
        # Python cannot echo it back into the refusal.
        proc = subprocess.run([str(exe), "-I", "-"], input=_SITE_PROBE, capture_output=True,
                              text=True, errors="replace", timeout=60)
    except OSError as exc:
        raise Refusal(python, f"cannot run interpreter: {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        raise Refusal(python, "interpreter did not answer within 60 s") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise Refusal(python, f"interpreter failed to report its site dirs: {excerpt(last)}")
    return _parse_probe(python, proc.stdout)


def _own_site_dirs() -> list[str]:
    paths = sysconfig.get_paths()
    dirs = [paths.get("purelib"), paths.get("platlib")] + list(site.getsitepackages())
    if sys.prefix == sys.base_prefix and site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if d]


def _dedupe_existing(dirs: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for d in dirs:
        if not d or not os.path.isdir(d):
            continue
        real = os.path.realpath(d)
        if real not in seen:
            seen.add(real)
            out.append(d)
    return out


def _refuse_non_wheel_install(dist: Path) -> dict | None:
    if dist.suffix != ".dist-info":
        raise Refusal(dist, "legacy egg/develop install: its files are not a wheel's, "
                      "so no manifest hash can vouch for them; reinstall lmcache from its wheel")
    direct_url = read_json(dist / "direct_url.json")
    if direct_url is None:
        return None
    if direct_url.get("dir_info", {}).get("editable"):
        raise Refusal(dist, f"editable install of {direct_url.get('url', 'a source tree')}: "
                      "patching would edit a source checkout, and its files are not the wheel's; "
                      "apply the patches to the checkout with git instead")
    if "vcs_info" in direct_url:
        raise Refusal(dist, f"installed from VCS ({direct_url.get('url', '?')}): its files "
                      "were built from a commit, not the release wheel, so the manifest's "
                      "hashes cannot be trusted for it")
    return direct_url


def discover(python: str | None = None, site_packages: str | None = None) -> Discovery:
    """Search the chosen interpreter's (or directory's) site dirs.

    Refuses (one line) on two visible lmcache distributions and on editable,
    VCS and egg installs.  Not being installed is a state, not an error here.
    """
    if site_packages is not None:
        if not os.path.isdir(site_packages):
            raise Refusal(site_packages, "not a directory")
        exe, pyver, dirs = None, None, [site_packages]
    elif python is not None:
        exe, pyver, dirs = _probe_interpreter(python)
    else:
        exe, pyver = sys.executable, sys.version.split()[0]
        dirs = _own_site_dirs()
    dirs = _dedupe_existing(dirs)

    found: list[Path] = []
    for d in dirs:
        found.extend(dists_in(d, DIST_NAME))
    if not found:
        return Discovery(exe, pyver, dirs, None)
    if len(found) > 1:
        listed = ", ".join(str(p) for p in found)
        raise Refusal(found[1], f"two lmcache distributions are visible ({listed}); "
                      "which one Python imports depends on sys.path order, so the tool "
                      "will not guess: uninstall one")
    dist = found[0]
    direct_url = _refuse_non_wheel_install(dist)
    version = read_metadata(dist).version
    installer = read_installer(dist)
    if not (dist / "RECORD").is_file():
        # The spec says tools must not modify a distribution without RECORD.
        raise Refusal(dist / "RECORD", "missing: without RECORD the install cannot be "
                      "checked or kept consistent")
    target = Target(exe, pyver, dirs, dist.parent, dist, version, installer, direct_url)
    return Discovery(exe, pyver, dirs, target)


def require_target(discovery: Discovery) -> Target:
    if discovery.target is None:
        where = discovery.python or (discovery.site_dirs[0] if discovery.site_dirs else "?")
        raise NotInstalled(where, "lmcache is not installed (searched: "
                           + ", ".join(discovery.site_dirs) + ")")
    return discovery.target
