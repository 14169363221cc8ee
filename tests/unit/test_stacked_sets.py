"""Stacked patch sets, on synthetic sets: the unit tier's
base set ``synthset`` (01 edits F1 and F2, 02 edits F1 and F3) and a set
``synthstack`` that requires it (01 edits F1 and UNTOUCHED, 02 edits F2), so
F1 and F2 are edited by both layers, F3 by the base only and UNTOUCHED by the
stacked set only.  Everything runs through the real CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import CRASH_VAR, cli, one_line, stand_in_python

from . import synthwheel as sw
from .synthwheel import F1, F2, F3, SKIP, STATE_DIR, UNTOUCHED, tree_hashes

TOP = "synthstack"
ALL = sorted([F1, F2, F3, UNTOUCHED])


def sp(site: Path) -> tuple[str, str]:
    return ("--site-packages", str(site))


def stack_steps(base_post: dict[str, bytes]) -> list[tuple[str, dict[str, bytes]]]:
    """The stacked series, written against the base set's post-images."""
    f1 = sw.insert_after(base_post[F1], 70, b"# stack 01: over the base")
    untouched = sw.insert_after(base_post[UNTOUCHED], 8, b"# stack 01: its own file")
    f2 = sw.insert_after(base_post[F2], 5, b"# stack 02: transfer over the base")
    return [("01-over.patch", {F1: f1, UNTOUCHED: untouched}), ("02-over2.patch", {F2: f2})]


def base_post(wheel: Path) -> dict[str, bytes]:
    files = sw.wheel_files(wheel)
    for _, edits in sw.default_steps(files):
        files.update(edits)
    return files


def make_stack(root: Path, wheel: Path, *extra: str) -> Path:
    """``root/synthstack/9.9.9`` over the base already in ``root``; returns root."""
    d = sw.write_series(root / TOP / sw.VERSION, base_post(wheel),
                        stack_steps(base_post(wheel)))
    sw.manifest_build(d, wheel, "--requires", sw.SET, *extra)
    return root


@pytest.fixture(scope="session")
def stack_root(tmp_path_factory, patch_root, wheel) -> Path:
    root = tmp_path_factory.mktemp("patches-stack")
    shutil.copytree(patch_root, root, dirs_exist_ok=True)
    return make_stack(root, wheel)


def manifest(root: Path, name: str) -> dict:
    return json.loads((root / name / sw.VERSION / "manifest.json").read_text())


def status(site: Path, root: Path, *args: str) -> dict:
    r = cli("status", *sp(site), "--json", *args, patches=root)
    assert r.rc == 0, r.err
    return r.json["result"]


def set_states(result: dict) -> dict[str, str]:
    return {s["name"]: s["state"] for s in result["sets"]}


def whole_tree(site: Path) -> dict[str, str]:
    """Every file, the state dir included (bytecode caches aside)."""
    return tree_hashes(site, ("__pycache__",))


# ------------------------------------------------------------------ manifest build


def test_manifest_build_stacked_pre_is_base_post(tmp_path, stack_root, wheel):
    base, top = manifest(stack_root, sw.SET), manifest(stack_root, TOP)
    assert top["requires"] == [sw.SET] and "requires" not in base
    for path in (F1, F2):  # edited by both: the stacked pre-image is the base's post-image
        assert top["files"][path]["pre"] == base["files"][path]["post"]
        assert top["files"][path]["pre"] != base["files"][path]["pre"]
    assert top["files"][UNTOUCHED]["pre"]["hash"] == sw.record_hash(
        sw.wheel_files(wheel)[UNTOUCHED])
    # a rebuild without options keeps `requires` and reproduces the manifest exactly
    copy = Path(shutil.copytree(stack_root, tmp_path / "p"))
    sw.manifest_build(copy / TOP / sw.VERSION, wheel)
    assert manifest(copy, TOP) == top
    # without its requirement the series does not apply to the pristine wheel
    bare = tmp_path / "bare" / TOP / sw.VERSION
    shutil.copytree(stack_root / TOP / sw.VERSION, bare)
    (bare / "manifest.json").unlink()
    r = cli("manifest", "build", str(bare), "--wheel", str(wheel))
    assert r.rc == 3 and "does not apply to the pristine wheel" in r.err, r.err
    # a requirement that has no series for the version is refused in one line
    r = cli("manifest", "build", str(bare), "--wheel", str(wheel), "--requires", "nosuchset")
    one_line(r, 3, tmp_path / "bare" / "nosuchset" / sw.VERSION / "manifest.json",
             "requires patch set nosuchset")


def test_list_names_what_a_set_is_stacked_on(stack_root):
    rows = {r["set"]: r for r in cli("list", "--json", patches=stack_root).json["result"]}
    assert rows[TOP]["requires"] == [sw.SET] and rows[sw.SET]["requires"] == []
    assert f"{TOP} (on {sw.SET})" in cli("list", patches=stack_root, env={"COLUMNS": "200"}).out


def test_stacked_manifest_over_another_base_revision_is_refused(tmp_path, stack_root, wheel,
                                                                site):
    """The base moves to revision 2 and the stacked manifest was not rebuilt:
    every command refuses, naming the stacked manifest and the file."""
    root = Path(shutil.copytree(stack_root, tmp_path / "p"))
    d = root / sw.SET / sw.VERSION
    base = sw.wheel_files(wheel)
    sw.write_series(d, base, sw.default_steps(base, variant="b"))
    sw.manifest_build(d, wheel, "--revision", "2")
    before = whole_tree(site)
    r = cli("apply", *sp(site), "--set", TOP, patches=root)
    one_line(r, 3, root / TOP / sw.VERSION / "manifest.json", F1,
             f"is not {sw.SET} revision 2's post-image")
    assert whole_tree(site) == before


# ------------------------------------------------------------------ apply, status, verify


def test_apply_stack_status_and_verify_per_set(site, fresh_site, stack_root):
    # Without --set the base set is the default, as before stacking existed.
    st = status(site, stack_root)
    assert st["patch_set"] == sw.SET and st["state"] == "pristine"
    assert set_states(status(site, stack_root, "--set", TOP)) == {sw.SET: "pristine",
                                                                   TOP: "pristine"}

    # the dry run is the same plan, and writes nothing
    before_all = whole_tree(site)
    dry = cli("apply", *sp(site), "--set", TOP, "--dry-run", "--json", patches=stack_root)
    assert dry.rc == 0 and dry.json["result"]["action"] == "dry-run", dry.err
    assert dry.json["result"]["changed_files"] == ALL and whole_tree(site) == before_all

    r = cli("apply", *sp(site), "--set", TOP, "--json", patches=stack_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["action"] == "applied" and res["state_after"] == "patched"
    assert res["changed_files"] == ALL
    assert [(s["name"], s["changed_files"]) for s in res["sets"]] == [
        (sw.SET, sorted([F1, F2, F3])), (TOP, sorted([F1, F2, UNTOUCHED]))]
    assert {h["patch"].split("/")[0] for h in res["hunks"]} == {sw.SET, TOP}

    # Only the four targets and RECORD changed; RECORD rows hash the new files.
    before, after = tree_hashes(fresh_site, SKIP), tree_hashes(site, SKIP)
    rec = str(sw.record_path(site).relative_to(site))
    assert {k for k in before if before[k] != after.get(k)} == set(ALL) | {rec}
    rows = {ln.split(",")[0]: ln.split(",")[1] for ln in
            sw.record_path(site).read_text().splitlines()}
    for p in ALL:
        assert rows[p] == sw.record_hash((site / p).read_bytes())
    state = json.loads((site / STATE_DIR / "state.json").read_text())
    assert state["schema"] == "lmcache-patchtool/state/v2"
    assert [s["patch_set"] for s in state["sets"]] == [sw.SET, TOP]

    # status (JSON): today's fields name the top set, `sets` every set;
    # without --set an install carrying the stack is shown by its top set.
    for args in ((), ("--set", TOP)):
        st = status(site, stack_root, *args)
        assert st["patch_set"] == TOP and st["state"] == "patched", st["detail"]
        assert set_states(st) == {sw.SET: "patched", TOP: "patched"}
        assert [(s["name"], s["revision"]) for s in st["sets"]] == [(sw.SET, 1), (TOP, 1)]
        assert sorted(f["path"] for f in st["files"]) == ALL
        assert {f["state"] for f in st["files"]} == {"patched"}
    # the base asked for alone still knows what sits on it
    st = status(site, stack_root, "--set", sw.SET)
    assert st["patch_set"] == sw.SET and st["state"] == "patched"
    assert set_states(st) == {sw.SET: "patched", TOP: "patched"}

    human = cli("status", *sp(site), patches=stack_root)
    assert human.rc == 0, human.err
    assert f"set         : {sw.SET} revision 1: patched" in human.out
    assert f"set         : {TOP} revision 1: patched" in human.out
    assert "state       : patched - patched with synthset revision 1 + synthstack revision 1" \
        in human.out.replace("\n", " ")

    v = cli("verify", *sp(site), "--json", patches=stack_root)
    assert v.rc == 0, v.out
    assert set_states(v.json["result"]["status"]) == {sw.SET: "patched", TOP: "patched"}
    hv = cli("verify", *sp(site), "--set", TOP, patches=stack_root)
    assert hv.rc == 0 and f"set         : {TOP} revision 1: patched" in hv.out

    again = cli("apply", *sp(site), "--set", TOP, "--json", patches=stack_root)
    assert again.rc == 0 and again.json["result"]["action"] == "no-op"


def test_base_only_install_reports_the_stacked_set_not_applied(site, stack_root):
    assert cli("apply", *sp(site), patches=stack_root).rc == 0  # the base, by default
    state = json.loads((site / STATE_DIR / "state.json").read_text())
    assert state["schema"] == "lmcache-patchtool/state/v1"  # one set: today's format
    st = status(site, stack_root, "--set", TOP)
    assert st["state"] == "partially-patched"
    assert set_states(st) == {sw.SET: "patched", TOP: "pristine"}
    assert st["next_command"].endswith(f"--set {TOP}")
    v = cli("verify", *sp(site), "--set", TOP, "--json", patches=stack_root)
    assert v.rc == 10 and set_states(v.json["result"]["status"])[TOP] == "pristine"
    # the top set over the applied base: one more layer
    r = cli("apply", *sp(site), "--set", TOP, "--json", patches=stack_root)
    assert r.rc == 0, r.err
    assert [s["changed_files"] for s in r.json["result"]["sets"]] == [
        [], sorted([F1, F2, UNTOUCHED])]
    assert set_states(status(site, stack_root)) == {sw.SET: "patched", TOP: "patched"}


def test_partial_base_is_completed_under_the_stack(site, fresh_site, stack_root):
    assert cli("apply", *sp(site), "--patch", "01", patches=stack_root).rc == 0
    r = cli("apply", *sp(site), "--set", TOP, patches=stack_root)
    assert r.rc == 0, r.err
    assert set_states(status(site, stack_root)) == {sw.SET: "patched", TOP: "patched"}
    assert cli("revert", *sp(site), patches=stack_root).rc == 0
    assert tree_hashes(site, SKIP) == tree_hashes(fresh_site, SKIP)


def test_older_base_revision_is_upgraded_under_the_stack(tmp_path, site, fresh_site, patch_root,
                                                         patch_root_r2, wheel):
    """An install patched with the base's revision 1 (by the tool before
    stacks: state v1), the base now at revision 2 with the stacked set built
    over it: apply --set TOP upgrades the base and applies the top in one
    run, and revert brings back the wheel's bytes."""
    assert cli("apply", *sp(site), patches=patch_root).rc == 0
    root = make_stack(Path(shutil.copytree(patch_root_r2, tmp_path / "p")), wheel)
    st = status(site, root, "--set", TOP)
    assert set_states(st) == {sw.SET: "patched-older-revision", TOP: "pristine"}
    r = cli("apply", *sp(site), "--set", TOP, "--json", patches=root)
    assert r.rc == 0, r.err
    st = status(site, root)
    assert st["state"] == "patched" and set_states(st) == {sw.SET: "patched", TOP: "patched"}
    assert [(s["name"], s["revision"]) for s in st["sets"]] == [(sw.SET, 2), (TOP, 1)]
    assert cli("revert", *sp(site), patches=root).rc == 0
    assert whole_tree(site) == whole_tree(fresh_site)


def test_stacked_set_keeps_its_base_disk_tier_keys(tmp_path, site, patch_root, wheel):
    """A base that writes namespaced keys (l2_format 1): a stacked manifest
    built without --l2-format inherits it, and the stacked install reports
    kvl1 keys with the namespaced note, not the discard warning."""
    root = Path(shutil.copytree(patch_root, tmp_path / "p"))
    sw.manifest_build(root / sw.SET / sw.VERSION, wheel, "--l2-format", "1")
    make_stack(root, wheel)
    assert manifest(root, TOP)["l2_format"] == 1
    r = cli("apply", *sp(site), "--set", TOP, "--json", patches=root)
    assert r.rc == 0, r.err
    assert [n.startswith("disk-tier keys kvl1") for n in r.json["result"]["notes"]] == [True]
    st = status(site, root)
    assert st["disk_tier_keys"] == "kvl1"
    assert any(n.startswith("disk-tier keys kvl1") for n in st["notes"])
    assert not any(n.startswith("disk-tier data written before") for n in st["notes"])


# ------------------------------------------------------------------ one transaction, crashes


def _crash(n: int) -> dict:
    return {CRASH_VAR: f"crash:{n}"}


def test_kill_at_every_write_of_a_stack_apply_recovers_the_before_state(tmp_path, fresh_site,
                                                                        stack_root):
    """One transaction for both sets: killed after ANY write, the next command
    finds the install exactly as before (both sets pristine) until the commit
    point, exactly as after it, and never the base applied on its own."""
    before = whole_tree(fresh_site)
    done = sw.copy_site(fresh_site, tmp_path / "done")
    assert cli("apply", *sp(done), "--set", TOP, patches=stack_root).rc == 0
    after = whole_tree(done)
    seen = []
    for n in range(1, 500):
        site = sw.copy_site(fresh_site, tmp_path / f"s{n}")
        r = cli("apply", *sp(site), "--set", TOP, patches=stack_root, env=_crash(n), unset=())
        if r.rc == 0:
            break
        assert r.rc == 86, (n, r.rc, r.err)
        st = status(site, stack_root, "--set", TOP)
        want = {"pristine": before, "patched": after}
        assert st["state"] in want, (n, st["detail"])
        assert set({s["state"] for s in st["sets"]}) == {st["state"]}, (n, st["sets"])
        assert whole_tree(site) == want[st["state"]], n  # the state dir included
        seen.append(st["state"])
        shutil.rmtree(site)
    # every write up to the commit point rolls back: backups, journal, staging,
    # originals of both sets, RECORD, state, the files; after it, cleanup only
    assert seen.count("pristine") > 20 and seen[:seen.count("pristine")] == \
        ["pristine"] * seen.count("pristine"), seen


@pytest.mark.parametrize("command", ["apply", "revert", "revert-top"])
def test_kill_stack_over_an_applied_base_and_revert(tmp_path, fresh_site, stack_root, command):
    """apply --set TOP over an applied base, revert of the whole stack and
    revert --set TOP, killed at sampled writes: the next command finds the
    before-state or (past the commit point) the after-state, exactly."""
    base = sw.copy_site(fresh_site, tmp_path / "base")
    first = ["apply", *sp(base)] + (["--set", TOP] if command != "apply" else [])
    assert cli(*first, patches=stack_root).rc == 0
    args = [command.split("-")[0], *sp(base)] + (["--set", TOP] if command != "revert" else [])
    before = whole_tree(base)
    done = sw.copy_site(base, tmp_path / "done")
    assert cli(args[0], *sp(done), *args[3:], patches=stack_root).rc == 0
    after = whole_tree(done)
    crashed, n = 0, 1
    while True:
        site = sw.copy_site(base, tmp_path / f"s{n}")
        r = cli(args[0], *sp(site), *args[3:], patches=stack_root, env=_crash(n), unset=())
        if r.rc == 0:
            break
        assert r.rc == 86, (n, r.rc, r.err)
        crashed += 1
        assert cli("status", *sp(site), patches=stack_root).rc == 0
        assert whole_tree(site) in (before, after), n
        shutil.rmtree(site)
        n = 2 * n + 1
        assert n < 1000
    assert crashed >= 3


# ------------------------------------------------------------------ revert


def test_revert_all_is_byte_exact(site, fresh_site, stack_root):
    record_before = sw.record_path(site).read_bytes()
    assert cli("apply", *sp(site), "--set", TOP, patches=stack_root).rc == 0
    r = cli("revert", *sp(site), "--json", patches=stack_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["sets"] == [TOP, sw.SET] and res["remaining"] == []
    assert res["restored_files"] == ALL and res["state_after"] == "pristine"
    assert whole_tree(site) == whole_tree(fresh_site)  # no state dir left either
    assert sw.record_path(site).read_bytes() == record_before


def test_revert_set_top_leaves_exactly_the_base_install(tmp_path, site, fresh_site, stack_root):
    base_only = sw.copy_site(fresh_site, tmp_path / "base-only")
    assert cli("apply", *sp(base_only), patches=stack_root).rc == 0
    assert cli("apply", *sp(site), "--set", TOP, patches=stack_root).rc == 0
    r = cli("revert", *sp(site), "--set", TOP, "--json", patches=stack_root)
    assert r.rc == 0, r.err
    assert r.json["result"]["sets"] == [TOP] and r.json["result"]["remaining"] == [sw.SET]
    assert r.json["result"]["state_after"] == "patched"  # the base, now the top of the stack
    # files, RECORD and the tool's state (v1 again): what applying the base alone leaves
    assert whole_tree(site) == whole_tree(base_only)
    st = status(site, stack_root, "--set", TOP)
    assert set_states(st) == {sw.SET: "patched", TOP: "pristine"}
    human = cli("revert", *sp(site), patches=stack_root)  # one set left: today's output
    assert human.rc == 0 and "peeled" not in human.out
    assert whole_tree(site) == whole_tree(fresh_site)


def test_revert_without_saved_state_reverses_each_layer(tmp_path, site, fresh_site, stack_root):
    """The state dir deleted by hand: revert --set TOP reverses the stacked
    series over the base and checks each result against the pre-images;
    then the base is reverted as an unstacked set is."""
    base_only = sw.copy_site(fresh_site, tmp_path / "base-only")
    assert cli("apply", *sp(base_only), patches=stack_root).rc == 0
    assert cli("apply", *sp(site), "--set", TOP, patches=stack_root).rc == 0
    shutil.rmtree(site / STATE_DIR)
    before = whole_tree(site)
    r = cli("revert", *sp(site), "--set", sw.SET, patches=stack_root)
    one_line(r, 3, next(site.glob("lmcache-*.dist-info")), f"required by the applied set {TOP}")
    assert whole_tree(site) == before
    r = cli("revert", *sp(site), "--set", TOP, "--json", patches=stack_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    assert res["source"] == "reverse patch" and res["sets"] == [TOP]
    assert res["restored_files"] == sorted([F1, F2, UNTOUCHED])
    assert tree_hashes(site, SKIP) == tree_hashes(base_only, SKIP)  # files and RECORD
    assert cli("revert", *sp(site), patches=stack_root).rc == 0
    assert whole_tree(site) == whole_tree(fresh_site)


def test_revert_set_that_is_not_the_top_is_refused(site, stack_root):
    assert cli("apply", *sp(site), "--set", TOP, patches=stack_root).rc == 0
    before = whole_tree(site)
    r = cli("revert", *sp(site), "--set", sw.SET, patches=stack_root)
    one_line(r, 3, site / STATE_DIR / "state.json",
             f"{sw.SET} is required by the applied set {TOP}", f"revert --set {TOP} first")
    r = cli("revert", *sp(site), "--set", sw.SET, "--json", patches=stack_root)
    assert r.rc == 3 and r.json["error"]["exit_code"] == 3
    assert whole_tree(site) == before
    human = cli("revert", *sp(site), "--set", TOP, patches=stack_root)
    assert human.rc == 0 and f"peeled {TOP}; still applied: {sw.SET}" in human.out
    assert "state       : patched" in human.out


def test_revert_set_that_is_not_applied_is_refused(site, stack_root):
    assert cli("apply", *sp(site), patches=stack_root).rc == 0  # the base only
    before = whole_tree(site)
    r = cli("revert", *sp(site), "--set", TOP, patches=stack_root)
    one_line(r, 3, site / STATE_DIR / "state.json", f"{TOP} is not applied")
    assert whole_tree(site) == before


# ------------------------------------------------------------------ refusals


def _set_row(site: Path, path: str) -> None:
    """Rewrite RECORD's row of ``path`` to match the file (a reinstall of that
    one file would), so only the stack, not RECORD, is inconsistent."""
    rec = sw.record_path(site)
    data = (site / path).read_bytes()
    lines = rec.read_bytes().split(b"\r\n")
    for i, ln in enumerate(lines):
        if ln.startswith(path.encode() + b","):
            lines[i] = f"{path},{sw.record_hash(data)},{len(data)}".encode()
    rec.write_bytes(b"\r\n".join(lines))


def test_half_stacked_install_is_refused(site, fresh_site, stack_root):
    """The stack applied, then the base's own file F3 put back to the wheel's
    bytes: the stacked set sits on a base that is not fully patched."""
    assert cli("apply", *sp(site), "--set", TOP, patches=stack_root).rc == 0
    shutil.copyfile(fresh_site / F3, site / F3)
    _set_row(site, F3)
    before = whole_tree(site)
    st = status(site, stack_root)
    assert st["state"] == "drifted" and st["problem"]["file"] == F3
    # the base's own files are at different steps (F3 pristine, F1/F2 under the stack)
    assert set_states(st) == {sw.SET: "drifted", TOP: "patched"}
    assert "half-stacked" in st["problem"]["reason"]
    r = cli("apply", *sp(site), "--set", TOP, patches=stack_root)
    one_line(r, 6, site / F3, "half-stacked", f"{sw.SET} is drifted (pristine here) under {TOP}")
    v = cli("verify", *sp(site), patches=stack_root)
    assert v.rc == 6
    assert whole_tree(site) == before


def test_stacked_file_that_matches_neither_image_is_refused(site, stack_root):
    """F1 edited by hand after the stack: neither the base's post-image nor
    any state of the stacked set."""
    assert cli("apply", *sp(site), "--set", TOP, patches=stack_root).rc == 0
    (site / F1).write_bytes((site / F1).read_bytes() + b"# local edit\n")
    _set_row(site, F1)
    before = whole_tree(site)
    r = cli("apply", *sp(site), "--set", TOP, "--json", patches=stack_root)
    line = one_line(r, 6, site / F1, "none of the wheel's file", f"{sw.SET}'s post-image",
                    f"{TOP}'s post-image")
    assert r.json["error"]["exit_code"] == 6 and "drifted" in line
    assert cli("verify", *sp(site), patches=stack_root).rc == 6
    r = cli("revert", *sp(site), patches=stack_root)
    one_line(r, 6, site / F1, "was changed after patchtool patched it")
    assert whole_tree(site) == before


def test_stacked_set_on_a_drifted_pristine_install_is_refused(site, stack_root):
    (site / F2).write_bytes((site / F2).read_bytes().replace(b"VALUE_005 = 5", b"VALUE_005 = 7"))
    _set_row(site, F2)
    before = whole_tree(site)
    r = cli("apply", *sp(site), "--set", TOP, patches=stack_root)
    one_line(r, 6, site / F2, "none of the wheel's file", "drifted")
    assert whole_tree(site) == before


# ------------------------------------------------------------------ wheel


def _venv_site(venv: Path) -> Path:
    return sw.venv_site(venv)


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_stacked_wheel_installs_and_reports_both_sets(tmp_path, wheel, stack_root, installer):
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if installer == "uv" and not Path(uv).exists():
        pytest.skip("uv is not installed")
    out = tmp_path / "dist"
    r = cli("wheel", "--from", str(wheel), "--set", TOP, "-o", str(out), "--json",
            patches=stack_root)
    assert r.rc == 0, r.err
    res = r.json["result"]
    version = f"{sw.VERSION}+{sw.SET}.r1.{TOP}.r1"
    assert res["version"] == version and res["patch_set"] == TOP
    assert res["sets"] == [{"name": sw.SET, "revision": 1}, {"name": TOP, "revision": 1}]
    assert sorted(res["files"]) == ALL
    built = Path(res["path"])
    assert built.name == f"lmcache-{version}-py3-none-any.whl"

    venv = tmp_path / "venv"
    python = sw.make_venv(venv)
    cmd = ([sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
           if installer == "pip" else [uv, "pip", "install", "-q", "--python", str(python)])
    subprocess.run([*cmd, "--no-deps", "--no-index", str(built)], check=True,
                   capture_output=True)
    st = cli("status", "--python", str(python), "--deep", "--json", patches=stack_root)
    assert st.rc == 0, st.err
    s = st.json["result"]
    assert s["lmcache_version"] == version and s["installer"] == installer
    assert s["state"] == "patched" and s["record"]["mismatches"] == 0, s["detail"]
    assert set_states(s) == {sw.SET: "patched", TOP: "patched"}
    assert [x["patch_set"] for x in s["wheel_build"]["sets"]] == [sw.SET, TOP]
    assert cli("verify", "--python", str(python), patches=stack_root).rc == 0
    r = cli("revert", "--python", str(python), patches=stack_root)
    assert r.rc == 3 and "reinstall the upstream wheel" in r.err
    # the unstacked wheel keeps today's name: X+synthset.r1
    one = cli("wheel", "--from", str(wheel), "-o", str(tmp_path / "one"), "--json",
              patches=stack_root)
    assert one.rc == 0 and one.json["result"]["version"] == f"{sw.VERSION}+{sw.SET}.r1"


def test_stack_commands_import_nothing_heavy(tmp_path, site, stack_root):
    """status/apply/revert of a stack under the import guard of
    test_no_heavy_imports: no torch, vllm or lmcache import is attempted."""
    from .test_no_heavy_imports import GUARD, attempted

    d = tmp_path / "guard"
    d.mkdir()
    (d / "sitecustomize.py").write_text(GUARD)
    env = {"PYTHONPATH": str(d), "PATCHTOOL_IMPORT_GUARD_LOG": str(tmp_path / "imports.log")}
    for args in (("status", "--set", TOP), ("apply", "--set", TOP), ("verify",), ("revert",)):
        r = cli(*args, *sp(site), patches=stack_root, env=env)
        assert r.rc == 0, (args, r.err)
    assert attempted(env) == []


def test_ci_builds_installs_and_verifies_the_stack(tmp_path, wheel, stack_root):
    """``ci --set TOP`` up to its verify phase, with a stand-in interpreter
    (this one, plus an empty ``torch`` package so the up-front probe accepts
    it): the stack is built, installed and classified patched with both sets.
    The round-trip phase then fails, as it must without a real torch."""
    py = stand_in_python(tmp_path)
    r = cli("ci", "--wheel", str(wheel), "--set", TOP, "--python", str(py), "--json",
            "--check-timeout", "120", patches=stack_root)
    phases = {p["phase"]: p for p in r.json["result"]["phases"]}
    for name in ("resolve", "patch-set", "fetch", "build", "install", "verify"):
        assert phases[name]["result"] == "pass", (name, phases[name]["detail"])
    assert f"{sw.SET} revision 1 + {TOP} revision 1" in phases["patch-set"]["detail"]
    assert r.json["result"]["wheel"]["version"] == f"{sw.VERSION}+{sw.SET}.r1.{TOP}.r1"
    assert phases["verify"]["data"]["state"] == "patched"
    assert [(x["name"], x["state"]) for x in phases["verify"]["data"]["sets"]] == [
        (sw.SET, "patched"), (TOP, "patched")]
    assert phases["roundtrip"]["result"] in ("fail", "error") and r.rc != 0


def test_stack_over_a_fixed_upstream_base(tmp_path, site, fresh_site, wheel):
    """A required set that is fixed upstream for this version edits nothing:
    the stacked set applies over the wheel's files, and is all the wheel's
    local version names."""
    root = tmp_path / "p"
    (root / sw.SET / sw.VERSION).mkdir(parents=True)
    sw.manifest_build(root / sw.SET / sw.VERSION, wheel, "--fixed-upstream", "fixed in 9.9.9")
    files = sw.wheel_files(wheel)
    d = sw.write_series(root / TOP / sw.VERSION, files,
                        [("01-over.patch", {F1: sw.insert_after(files[F1], 70, b"# over")})])
    sw.manifest_build(d, wheel, "--requires", sw.SET)
    r = cli("apply", *sp(site), "--set", TOP, patches=root)
    assert r.rc == 0, r.err
    st = status(site, root, "--set", TOP)
    assert st["state"] == "patched"
    assert set_states(st) == {sw.SET: "fixed-upstream", TOP: "patched"}
    assert cli("verify", *sp(site), "--set", TOP, patches=root).rc == 0
    w = cli("wheel", "--from", str(wheel), "--set", TOP, "-o", str(tmp_path / "d"), "--json",
            patches=root)
    assert w.rc == 0 and w.json["result"]["version"] == f"{sw.VERSION}+{TOP}.r1", w.err
    assert cli("revert", *sp(site), patches=root).rc == 0
    assert whole_tree(site) == whole_tree(fresh_site)
