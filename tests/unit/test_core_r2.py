"""patchtool core revision 2: each input that used to end in a
traceback, a wrong target or an inexact revert, on the synthetic wheel.

Full-disk and read-only cases use real tmpfs mounts (root only, as on these
machines and in CI); the write-size limit is a real ``RLIMIT_FSIZE``."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from _cli import CRASH_VAR, Run, cli

from . import synthwheel as sw
from .synthwheel import F1, STATE_DIR, tree_hashes
from .test_states_and_refusals import one_line, sp

WRITE_FAILED = 19


def leftovers(site: Path) -> list[str]:
    """What a transaction may leave behind: staging files, a journal, backups."""
    out = [str(p) for p in site.rglob("*.patchtool-*.tmp")]
    state = site / STATE_DIR
    out += [str(p) for p in (state.glob("journal*") if state.exists() else [])]
    if (state / "tx").exists():
        out.append(str(state / "tx"))
    return out


# ----------------------------------------------------------- OS write errors


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path, leave: int) -> None:
    """Fill ``fs`` completely, then free ``leave`` bytes of it."""
    filler = fs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        block = b"\0" * 65536
        while True:
            try:
                if os.write(fd, block) == 0:
                    break
            except OSError:
                break
    finally:
        os.close(fd)
    os.truncate(filler, max(0, filler.stat().st_size - leave))


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_full_disk_at_several_levels(tmp_path, fresh_site, patch_root, command):
    """With 0, 4, 8 ... KiB free, the command either completes or refuses in
    one line (exit 19) leaving the install exactly as before; no staging file
    or journal survives the command itself."""
    base = sw.copy_site(fresh_site, tmp_path / "base")
    if command == "revert":
        assert cli("apply", *sp(base), patches=patch_root).rc == 0
    before = tree_hashes(base, ("__pycache__",))
    refused = 0
    with tmpfs(tmp_path / "fs", "2m") as fs:
        for kib in (0, 8, 24, 64, 256):
            site = fs / "site"
            if site.exists():
                shutil.rmtree(site)
            (fs / "filler").unlink(missing_ok=True)
            sw.copy_site(base, site)
            fill(fs, kib * 1024)
            r = cli(command, *sp(site), patches=patch_root)
            if r.rc == 0:
                break
            refused += 1
            line = one_line(r, WRITE_FAILED, r.err.split(": ")[1], "No space left on device")
            assert "nothing was changed" in line, line
            assert leftovers(site) == [], (kib, leftovers(site))
            assert tree_hashes(site, ("__pycache__",)) == before, kib
            # and the next command sees the install as it was
            (fs / "filler").unlink()
            assert cli("verify", *sp(site), patches=patch_root).rc == \
                (5 if command == "apply" else 0)
        else:
            pytest.fail("the command never had enough space")
    assert refused >= 2  # really failed at more than one level


def _run_limited(args: list[str], patches: Path, fsize: int) -> Run:
    env = dict(os.environ, LMCACHE_PATCHTOOL_PATCHES=str(patches))
    env.pop(CRASH_VAR, None)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    proc = subprocess.run([sys.executable, "-m", "patchtool", *args], capture_output=True,
                          text=True, env=env, preexec_fn=limit, timeout=120)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def test_write_size_limit(site, patch_root):
    """``ulimit -f``: a write past the limit fails with EFBIG; one refusal line,
    the install unchanged, nothing left."""
    before = tree_hashes(site)
    r = _run_limited(["apply", *sp(site)], patch_root, 512)
    one_line(r, WRITE_FAILED, r.err.split(": ")[1], "File too large")
    assert tree_hashes(site) == before
    assert leftovers(site) == [] and not (site / STATE_DIR).exists()


def test_read_only_install(tmp_path, fresh_site, patch_root):
    """EROFS: apply refuses in one line; status and verify keep working."""
    with tmpfs(tmp_path / "ro", "4m") as fs:
        site = sw.copy_site(fresh_site, fs / "site")
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        r = cli("apply", *sp(site), patches=patch_root)
        one_line(r, WRITE_FAILED, r.err.split(": ")[1], "Read-only file system")
        st = cli("status", *sp(site), "--json", patches=patch_root)
        assert st.rc == 0 and st.json["result"]["state"] == "pristine", st.err
        assert cli("verify", *sp(site), patches=patch_root).rc == 5
        assert cli("apply", "--dry-run", *sp(site), patches=patch_root).rc == 0


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_injected_write_error_at_every_write(tmp_path, fresh_site, patch_root, command,
                                             monkeypatch, capsys):
    """ENOSPC at the 1st, 2nd, ... write: exit 19, exactly as before, and no
    leftover even before any other command runs.  In-process (the hook is the
    same; a process per write would cost seconds)."""
    from patchtool import fsio
    from patchtool.cli import main

    base = sw.copy_site(fresh_site, tmp_path / "base")
    if command == "revert":
        assert cli("apply", *sp(base), patches=patch_root).rc == 0
    before = tree_hashes(base)
    monkeypatch.setenv("LMCACHE_PATCHTOOL_PATCHES", str(patch_root))
    for n in range(1, 80):
        site = sw.copy_site(base, tmp_path / f"s{n}")
        monkeypatch.setenv(fsio.FAULT_ENV, f"enospc:{n}")
        monkeypatch.setattr(fsio, "_fault", fsio._Fault())
        rc = main([command, *sp(site), "--json"])
        err = capsys.readouterr().err
        if rc == 0:
            break
        assert rc == WRITE_FAILED and len(err.splitlines()) == 1, (n, rc, err)
        assert "(ENOSPC)" in err and "nothing was changed" in err, err
        assert tree_hashes(site) == before, n
        shutil.rmtree(site)
    else:
        pytest.fail("never completed")
    assert n > 10


# ----------------------------------------------------------- unreadable inputs


def test_target_that_is_a_directory(site, patch_root):
    (site / F1).unlink()
    (site / F1).mkdir()
    for cmd in ("status", "apply", "revert", "verify"):
        r = cli(cmd, *sp(site), patches=patch_root)
        one_line(r, 3, site / F1, "is a directory")


def test_target_whose_parent_is_a_file(site, patch_root):
    parent = (site / F1).parent
    shutil.rmtree(parent)
    parent.write_text("not a dir\n")
    for cmd in ("status", "apply"):
        r = cli(cmd, *sp(site), patches=patch_root)
        one_line(r, 3, site / F1, "not a directory")


def test_python_that_prints_garbage(tmp_path, patch_root):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Welcome to the cluster! \\xff'\nexit 0\n")
    fake.chmod(0o755)
    r = cli("status", "--python", str(fake), patches=patch_root)
    one_line(r, 3, fake, "did not answer like a Python interpreter")


# ----------------------------------------------------------- --python resolution


def test_relative_python_is_the_venv_not_path(venv, patch_root):
    """From the venv's bin/, ``./python`` is that venv (it used to become
    ``python`` and run whatever PATH found)."""
    bin_dir = venv / "bin"
    r = cli("status", "--python", "./python", "--json", patches=patch_root, cwd=bin_dir)
    assert r.rc == 0, r.err
    assert r.json["result"]["state"] == "pristine"
    assert r.json["result"]["site"] == str(sw.venv_site(venv))


def test_bare_name_is_looked_up_on_path(venv, patch_root):
    env = {"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    r = cli("status", "--python", "python3", "--json", patches=patch_root, env=env)
    assert r.rc == 0, r.err
    assert r.json["result"]["state"] == "pristine"
    r = cli("status", "--python", "no-such-python-anywhere", patches=patch_root)
    one_line(r, 3, "no-such-python-anywhere", "no such interpreter on PATH")


def test_venv_directory_means_its_interpreter(venv, patch_root):
    r = cli("status", "--python", str(venv), "--json", patches=patch_root)
    assert r.rc == 0, r.err
    assert r.json["result"]["site"] == str(sw.venv_site(venv))


# ----------------------------------------------------------- symlinks


def test_symlinked_target_file_refused(tmp_path, site, patch_root):
    real = tmp_path / "elsewhere.py"
    shutil.copy2(site / F1, real)
    (site / F1).unlink()
    (site / F1).symlink_to(real)
    for cmd in ("status", "apply"):
        r = cli(cmd, *sp(site), patches=patch_root)
        one_line(r, 3, site / F1, "symbolic link")
    assert (site / F1).is_symlink() and not (site / STATE_DIR).exists()


def test_target_under_symlinked_directory_refused(tmp_path, site, patch_root):
    parent = (site / F1).parent
    moved = tmp_path / "moved"
    shutil.move(str(parent), moved)
    parent.symlink_to(moved, target_is_directory=True)
    r = cli("apply", *sp(site), patches=patch_root)
    one_line(r, 3, parent, "symbolic link")
    assert parent.is_symlink()


# ----------------------------------------------------------- dry run == apply


def _drop_record_row(site: Path, rel: str) -> None:
    rec = next(site.glob("lmcache-*.dist-info")) / "RECORD"
    lines = rec.read_bytes().splitlines(keepends=True)
    rec.write_bytes(b"".join(ln for ln in lines if not ln.startswith(rel.encode() + b",")))


def test_dry_run_and_apply_agree_on_a_missing_record_row(site, patch_root):
    _drop_record_row(site, F1)
    dry = cli("apply", "--dry-run", *sp(site), patches=patch_root)
    real = cli("apply", *sp(site), patches=patch_root)
    assert dry.rc == real.rc == 3, (dry.rc, real.rc)
    assert dry.err == real.err and "has no row for" in real.err


# ----------------------------------------------------------- RECORD mismatch policy


def _set_record_size(site: Path, rel: str, size: str) -> bytes:
    rec = next(site.glob("lmcache-*.dist-info")) / "RECORD"
    out = []
    for ln in rec.read_bytes().splitlines(keepends=True):
        if ln.startswith(rel.encode() + b","):
            path, h, _ = ln.rstrip(b"\r\n").split(b",")
            ln = b",".join([path, h, size.encode()]) + ln[len(ln.rstrip(b"\r\n")):]
        out.append(ln)
    rec.write_bytes(b"".join(out))
    return rec.read_bytes()


def test_record_row_mismatch_is_refused_unless_accepted(site, patch_root):
    record_before = _set_record_size(site, F1, "1")
    st = cli("status", *sp(site), "--json", patches=patch_root).json["result"]
    assert st["state"] == "pristine"
    assert any("inconsistent" in n for n in st["notes"])
    for args in (("--dry-run",), ()):
        r = cli("apply", *args, *sp(site), patches=patch_root)
        one_line(r, 6, next(site.glob("lmcache-*.dist-info")) / "RECORD", "inconsistent")
    assert cli("apply", "--accept-record-mismatch", *sp(site), patches=patch_root).rc == 0
    assert cli("revert", *sp(site), patches=patch_root).rc == 0
    rec = next(site.glob("lmcache-*.dist-info")) / "RECORD"
    assert rec.read_bytes() == record_before  # the row comes back as it was


# ----------------------------------------------------------- small things


def test_no_state_dir_leftovers_after_transactions(site, patch_root):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    names = sorted(p.name for p in (site / STATE_DIR).iterdir())
    assert names == ["originals", "state.json"]
    assert cli("revert", *sp(site), patches=patch_root).rc == 0
    assert not (site / STATE_DIR).exists()


def test_verify_accepts_deep(site, patch_root):
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    assert cli("verify", "--deep", *sp(site), patches=patch_root).rc == 0


def test_status_without_target_hints_at_python(tmp_path, patch_root):
    """From a pipx venv (here: one without lmcache), status says how to point
    at the serving venv."""
    import patchtool

    py = sw.make_venv(tmp_path / "pipxlike")
    src = Path(patchtool.__file__).resolve().parents[1]  # the patchtool under test
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src)] + sys.path[1:]),
               LMCACHE_PATCHTOOL_PATCHES=str(patch_root))
    proc = subprocess.run([str(py), "-m", "patchtool", "status", "--json"], capture_output=True,
                          text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import json
    res = json.loads(proc.stdout)["result"]
    assert res["state"] == "not-installed"
    assert "--python" in res["detail"]
