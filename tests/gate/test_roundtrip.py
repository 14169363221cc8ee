"""CPU round-trip harness (gate/roundtrip.py) against pristine and patched 0.5.3.

The harness runs as a real subprocess in the runtime venv with
``PYTHONPATH=<overlay>`` and reports JSON.  On the pristine tree every
sub-paged cell must FAIL the way the bug predicts (this proves the harness sees
the bug); on the patched tree (skipped while no patch exists) every cell must
pass byte-exactly, and k=1 host objects must be byte-identical to pristine.

The host-object format is pinned by an independent, pure-Python reimplementation
of the expected bytes (:func:`expected_object_bytes`) over raw dumps of the
source tensors and stored objects: pass-major for the patched tree, and the
pristine 1/k layout for the pristine tree (which validates the helper itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "gate" / "roundtrip.py"
PATHS = ["python", "native"]
TARGET_FILES = (
    "lmcache/v1/kv_layer_groups.py",
    "lmcache/v1/multiprocess/modules/lmcache_driven_transfer.py",
    "lmcache/v1/platform/base/cache_context.py",
)

# Small cells whose raw bytes are dumped for the out-of-process format check.
DUMP_CELLS = [
    "preset=qwen35-0.8b,chunk_blocks=2,num_chunks=2",
    "preset=qwen35-0.8b@float16,chunk_blocks=1,num_chunks=2",
    "preset=pure-attn-bs128,chunk_blocks=1,num_chunks=3",
    "preset=control-k1,chunk_blocks=1,num_chunks=2",
]

_CACHE: dict[tuple, dict] = {}


def run_harness(python: Path, overlay: Path, args: list[str], timeout: int = 1200) -> dict:
    """Run gate/roundtrip.py in ``python`` with ``overlay`` first on sys.path."""
    key = (str(python), str(overlay), tuple(args))
    if key in _CACHE:
        return _CACHE[key]
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{overlay}:{REPO}"  # the gate imports from the root
    env.pop("PYTHONSTARTUP", None)
    proc = subprocess.run([str(python), str(HARNESS), "--json", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=str(REPO))
    assert proc.returncode == 0, f"harness failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    doc = json.loads(proc.stdout)
    # The one stderr line per finished cell that `patchtool verify` streams to a person.
    doc["progress_lines"] = [ln for ln in proc.stderr.splitlines() if ln.startswith("roundtrip: ")]
    _CACHE[key] = doc
    return doc


def assert_progress(doc: dict) -> None:
    """``roundtrip: [i/n] pass|FAIL <cell>[: <reasons>] (<s> s)``, one per cell, in order."""
    cells = doc["cells"]
    assert len(doc["progress_lines"]) == len(cells), doc["progress_lines"]
    for i, (line, c) in enumerate(zip(doc["progress_lines"], cells), 1):
        word = "pass" if c["verdict"]["pass"] else "FAIL"
        why = "" if c["verdict"]["pass"] else ": " + "; ".join(c["verdict"]["reasons"])
        head = " ".join(f"roundtrip: [{i}/{len(cells)}] {word} {c['name']}{why}".split())
        assert line.startswith(head + " (") and line.endswith(" s)"), (line, head)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_ran_against(doc: dict, overlay: Path) -> None:
    """The JSON must come from the overlay's lmcache, file for file."""
    assert Path(doc["lmcache"]["root"]).resolve() == overlay.resolve()
    assert doc["lmcache"]["version"] == "0.5.3"
    assert doc["lmcache"]["torch_device_type"] == "cpu"
    assert doc["lmcache"]["native_object_group_transfer"] is False  # CPU: emulated only when --path native
    for rel in TARGET_FILES:
        assert doc["lmcache"]["files_sha256"][rel] == _sha256(overlay / rel), rel


def _no_errors(doc: dict) -> None:
    errors = [(c["name"], c.get("error"), c.get("traceback", "")[-2000:]) for c in doc["cells"] if "error" in c]
    assert not errors, errors


def object_groups(cell: dict) -> int:
    """How many objects a chunk is stored as: 1 (merged), or one per group (a
    hybrid on a series that separates its groups: 0.5.3's part 19)."""
    return len(cell.get("object_groups") or [[0]])


def copy_sides(side: dict) -> list[dict]:
    """One direction's copy analysis per object group (the harness nests it by
    group when a chunk has several objects)."""
    per_og = [v for key, v in side.items() if key.startswith("object_group_")]
    return per_og or [side]


def fa_copy_side(side: dict) -> dict:
    """The copy analysis of the object group holding the FA segment."""
    return next(v for v in copy_sides(side) if "fa_per_page_tiling" in v)


def _common(cell: dict, path: str) -> None:
    assert cell["store_ok"] and cell["retrieve_ok"], cell["name"]
    g = cell["guards"]
    assert g["enabled"]
    assert g["frozen_meta"]["ok"], g["frozen_meta"]
    assert g["copies"]["ok"], (g["copies"]["d2h"]["problems"], g["copies"]["h2d"]["problems"])
    assert g["copies"]["paths_seen"] == [path]
    if path == "native":
        # store + retrieve each went through one execute_object_group_transfer call per object group
        assert cell["native"]["calls"] == 2 * object_groups(cell) and cell["native"]["launches"] > 0
    assert cell["src_mutated_bytes"] == 0
    assert cell["host_canary_damage_bytes"] == 0
    if "gdn" in cell["groups"]:
        gdn = cell["groups"]["gdn"]
        assert gdn["fraction"] == 1.0
        assert gdn["foreign_bytes"] == 0 and gdn["misplaced_bytes"] == 0 and gdn["skipped_prefix_written_bytes"] == 0
        assert gdn["object_ratio"] == 1.0
        # gdn-rows-window-head: a one-block window (0.5.3's part 19) at C > N keeps the
        # chunk-end block at the head of a segment the CPU context sizes for the chunk
        windowed = object_groups(cell) > 1 and cell["cell"]["chunk_blocks"] > 1
        assert gdn["object_layouts"] == (["gdn-rows-window-head"] if windowed else ["gdn-rows"])


def check_pristine_cell(cell: dict, path: str) -> None:
    """What 0.5.3 does: 1/k of the FA bytes move, into the wrong pages."""
    _common(cell, path)
    k = cell["geometry"]["k"]
    fa = cell["groups"]["fa"]
    copies = cell["guards"]["copies"]
    nchunks = cell["cell"]["num_chunks"]
    # one whole-object copy per chunk and direction (reported, not a guard failure)
    assert copies["d2h"]["mode"] == ["whole-object"] and copies["d2h"]["copies"] == nchunks
    assert copies["h2d"]["mode"] in (["whole-object"], [])
    assert fa["object_layouts"] == (["pass-major", "pristine"] if k == 1 else ["pristine"])
    if k == 1:
        assert cell["verdict"]["pass"], cell["verdict"]
        assert fa["fraction"] == 1.0 and fa["foreign_bytes"] == 0 and fa["object_ratio"] == 1.0
        return
    assert not cell["verdict"]["pass"]
    assert fa["fraction"] <= 1.0 / k + 1e-12, fa
    assert fa["object_ratio"] == pytest.approx(1.0 / k, abs=1e-12)
    assert cell["registry_object_bytes"] == cell["objects"][0]["size"]  # L2->L1 prefetch inherits 1/k
    assert copies["d2h"]["fa_per_page_tiling"] is False
    # Another logical block's pages get overwritten: with identity ids (1..m)
    # too, the logical ids used as kernel page ids land inside block 0's pages.
    assert fa["foreign_bytes"] > 0, fa


def check_patched_cell(cell: dict, path: str) -> None:
    """The fix: every requested byte, nothing else, full-size pass-major objects."""
    _common(cell, path)
    assert cell["verdict"]["pass"], (cell["name"], cell["verdict"])
    k = cell["geometry"]["k"]
    fa = cell["groups"]["fa"]
    assert fa["fraction"] == 1.0
    assert fa["foreign_bytes"] == 0 and fa["misplaced_bytes"] == 0 and fa["skipped_prefix_written_bytes"] == 0
    assert fa["object_ratio"] == 1.0
    # every object holds its full-fidelity bytes; a windowed GDN segment's tail,
    # which the CPU context sizes for the whole chunk, is neither written nor read
    for obj in cell["objects"]:
        assert obj["size"] - obj["unused_bytes"] == obj["full_size"], (cell["name"], obj["chunk"])
    assert "pass-major" in fa["object_layouts"]
    # the registry describes object group 0 (LMCache's layout_desc)
    assert cell["registry_object_group0_bytes"] == cell["objects"][0]["object_sizes"][0]
    if k > 1:
        for direction in ("d2h", "h2d"):
            c = fa_copy_side(cell["guards"]["copies"][direction])
            if c["copies"]:
                assert c["fa_per_page_tiling"] is True, (direction, c)
                assert c["fa_windows_per_object"] == [k]
                assert c["fa_straddling_windows"] == 0


# ---------------------------------------------------------------------------
# Pure-Python expected object bytes (pins the on-disk format)
# ---------------------------------------------------------------------------

def expected_object_parts(dump: Path, chunk: int, rule: str,
                          gdn_keep: int | None = None) -> tuple[list[tuple[int, bytes]], int]:
    """The known bytes of ``chunk``'s objects (concatenated in object-group
    order, as the harness dumps them) as ``(offset, bytes)`` parts, and their
    total length.  The GDN segment keeps the chunk's last ``gdn_keep`` blocks
    (None: all of them) at its head; a windowed segment (0.5.3's part 19)
    keeps one, and the CPU context still sizes it for the whole chunk, so its
    tail is neither written nor read, and not compared."""
    m = json.loads((dump / "manifest.json").read_text())
    geo = m["geometry"]
    N = geo["tokens_per_block"]
    item = {"bfloat16": 2, "float16": 2, "float32": 4}[geo["dtype"]]
    cb = m["C"] // N
    block = N * geo["num_kv_heads"] * 2 * geo["head_size"] * item
    kinds = m["layer_kinds"]
    parts, off = [], 0
    for kind in sorted(set(kinds), key=kinds.index):
        nl = kinds.count(kind)
        keep = cb if (kind != "gdn" or gdn_keep is None) else gdn_keep
        data = _segment_bytes(dump, m, chunk, rule, kind, keep)
        parts.append((off, data))
        off += nl * cb * block if kind == "gdn" else len(data)
    return parts, off


def expected_object_bytes(dump: Path, chunk: int, rule: str) -> bytes:
    """Host object bytes for ``chunk`` computed from the dumped source tensors
    (every GDN block of the chunk kept: merged objects).

    Segments follow kernel-group order (groups sorted by first layer index).
    GDN segment: ``(1, nl_gdn, C, row/N)`` -- every layer's logical blocks of
    the chunk, whole, in chunk order.  FA segment under ``rule``:

    * ``pass-major``: k page images; image j = ``(1, nl_fa, C/k, H*2D)`` with,
      for each FA layer, for each logical block L of the chunk (chunk order),
      for each slot s < P: the row of kernel page ``L*k + j`` at slot s, heads
      concatenated (HND page ``(H, P, 2D)`` read at ``[:, s, :]``);
    * ``pristine``: 0.5.3's single image built the same way from kernel page
      ``L`` (the logical id used as a kernel page id).
    """
    parts, total = expected_object_parts(dump, chunk, rule)
    out = b"".join(data for _, data in parts)
    assert len(out) == total
    return out


def _segment_bytes(dump: Path, m: dict, chunk: int, rule: str, kind: str, keep: int) -> bytes:
    """One kind's segment of ``chunk``'s object (GDN: its last ``keep`` blocks)."""
    geo = m["geometry"]
    N, P, k = geo["tokens_per_block"], geo["kernel_page"], geo["k"]
    H, D = geo["num_kv_heads"], geo["head_size"]
    item = {"bfloat16": 2, "float16": 2, "float32": 4}[geo["dtype"]]
    cb = m["C"] // N
    kinds = m["layer_kinds"]
    row = 2 * D * item
    page = H * P * row
    block = N * H * 2 * D * item  # one logical block of one layer (GDN pages are padded to this)
    srcs = [(dump / f"src_layer{i}.bin").read_bytes() for i in range(len(kinds))]
    out = bytearray()
    layers = [i for i, x in enumerate(kinds) if x == kind]
    ids = m["ids"]["store"][kind][chunk * cb:(chunk + 1) * cb]
    if kind == "gdn":
        for li in layers:
            for L in ids[len(ids) - keep:]:
                out += srcs[li][L * block:(L + 1) * block]
        return bytes(out)
    passes = list(range(k)) if rule == "pass-major" else [None]
    for j in passes:
        for li in layers:
            src = srcs[li]
            for L in ids:
                pg = L * k + j if j is not None else L
                base = pg * page
                for s in range(P):
                    for h in range(H):
                        off = base + (h * P + s) * row
                        out += src[off:off + row]
    return bytes(out)


def _dump_run(python: Path, overlay: Path, tmp: Path) -> dict:
    args = ["--dump-dir", str(tmp)]
    for cell in DUMP_CELLS:
        args += ["--cell", cell]
    return run_harness(python, overlay, args)


def test_format_helper_reproduces_pristine_layout(runtime_python_053, pristine_overlay_053, tmp_path):
    """Validates expected_object_bytes itself: pristine objects are its 1/k rule."""
    doc = _dump_run(runtime_python_053, pristine_overlay_053, tmp_path)
    _no_errors(doc)
    for cell in doc["cells"]:
        dump = Path(cell["dump"])
        k = cell["geometry"]["k"]
        for chunk in range(cell["cell"]["num_chunks"]):
            got = (dump / f"object{chunk}.bin").read_bytes()
            assert got == expected_object_bytes(dump, chunk, "pristine"), (cell["name"], chunk)
            if k > 1:
                assert len(got) < len(expected_object_bytes(dump, chunk, "pass-major"))


def test_host_object_format_is_pass_major(runtime_python_053, patched_overlay_053, tmp_path):
    """Pins the patched on-disk format: the FA segment is k pass-major page images;
    a hybrid's GDN state is a separate object keeping the chunk-end block (part 19)."""
    doc = _dump_run(runtime_python_053, patched_overlay_053, tmp_path)
    _no_errors(doc)
    for cell in doc["cells"]:
        dump = Path(cell["dump"])
        hybrid = "gdn" in cell["groups"]
        assert object_groups(cell) == (2 if hybrid else 1), cell["name"]
        for chunk in range(cell["cell"]["num_chunks"]):
            got = (dump / f"object{chunk}.bin").read_bytes()
            parts, total = expected_object_parts(dump, chunk, "pass-major", gdn_keep=1 if hybrid else None)
            assert len(got) == total, (cell["name"], chunk)
            for off, want in parts:
                assert got[off:off + len(want)] == want, (cell["name"], chunk, off)


# ---------------------------------------------------------------------------
# Fast matrix (unmarked)
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
def test_pristine_fast_matrix_shows_the_bug(runtime_python_053, pristine_overlay_053, path):
    doc = run_harness(runtime_python_053, pristine_overlay_053, ["--matrix", "fast", "--path", path])
    assert_ran_against(doc, pristine_overlay_053)
    _no_errors(doc)
    sub_paged = [c for c in doc["cells"] if c["geometry"]["k"] > 1]
    assert sub_paged and len(sub_paged) < len(doc["cells"])
    for cell in doc["cells"]:
        check_pristine_cell(cell, path)
    assert_progress(doc)  # failing cells: their reasons on their own line


@pytest.mark.parametrize("path", PATHS)
def test_patched_fast_matrix_round_trips(runtime_python_053, patched_overlay_053, path):
    doc = run_harness(runtime_python_053, patched_overlay_053, ["--matrix", "fast", "--path", path])
    assert_ran_against(doc, patched_overlay_053)
    _no_errors(doc)
    for cell in doc["cells"]:
        check_patched_cell(cell, path)
    assert_progress(doc)


def _compare_with_pristine(pristine: dict, patched: dict) -> None:
    """k=1 objects byte-identical and GDN segments byte-identical where both
    keep every block: one block per chunk (C = N), or no GDN group.  At C > N
    part 19 keeps only the chunk-end GDN block, which the harness checks
    against the source (``gdn-rows-window-head``)."""
    assert [c["name"] for c in pristine["cells"]] == [c["name"] for c in patched["cells"]]
    for a, b in zip(pristine["cells"], patched["cells"]):
        assert a["ids"] == b["ids"], a["name"]
        if "gdn" in a["groups"] and a["cell"]["chunk_blocks"] > 1:
            assert b["groups"]["gdn"]["object_layouts"] == ["gdn-rows-window-head"], b["name"]
            continue
        for oa, ob in zip(a["objects"], b["objects"]):
            if a["geometry"]["k"] == 1:
                assert oa["size"] == ob["size"] and oa["sha256"] == ob["sha256"], (a["name"], oa["chunk"])
                assert [s["shape"] for s in oa["segments"]] == [s["shape"] for s in ob["segments"]]
            ga = [s["sha256"] for s in oa["segments"] if s["kind"] == "gdn"]
            gb = [s["sha256"] for s in ob["segments"] if s["kind"] == "gdn"]
            assert ga == gb, (a["name"], oa["chunk"])


@pytest.mark.parametrize("path", PATHS)
def test_patched_k1_objects_identical_to_pristine(runtime_python_053, pristine_overlay_053,
                                                  patched_overlay_053, path):
    args = ["--matrix", "fast", "--path", path]
    _compare_with_pristine(run_harness(runtime_python_053, pristine_overlay_053, args),
                           run_harness(runtime_python_053, patched_overlay_053, args))


@pytest.mark.parametrize("fault", ["meta-write", "used-size", "address-skew"])
def test_guards_catch_injected_faults(runtime_python_053, pristine_overlay_053, fault):
    """The guards are live: a staging path that touches base metadata, narrows the
    object or hands a view whose meta.address disagrees with data_ptr is caught."""
    doc = run_harness(runtime_python_053, pristine_overlay_053,
                      ["--cell", "preset=control-k1,chunk_blocks=1,num_chunks=2", "--inject", fault])
    _no_errors(doc)
    (cell,) = doc["cells"]
    g = cell["guards"]
    assert not cell["verdict"]["pass"]
    if fault == "address-skew":
        assert not g["copies"]["ok"]
        assert any("meta.address offset" in p for p in g["copies"]["d2h"]["problems"])
    else:
        assert not g["frozen_meta"]["ok"] and g["frozen_meta"]["violations"]
        assert not cell["store_ok"]  # LMCache fails the store closed on the raised guard


# ---------------------------------------------------------------------------
# Full geometry matrix (slow)
# ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_pristine_full_matrix_shows_the_bug(runtime_python_053, pristine_overlay_053, path):
    doc = run_harness(runtime_python_053, pristine_overlay_053, ["--matrix", "full", "--path", path])
    assert_ran_against(doc, pristine_overlay_053)
    _no_errors(doc)
    for cell in doc["cells"]:
        check_pristine_cell(cell, path)


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_patched_full_matrix_round_trips(runtime_python_053, pristine_overlay_053, patched_overlay_053, path):
    args = ["--matrix", "full", "--path", path]
    doc = run_harness(runtime_python_053, patched_overlay_053, args)
    assert_ran_against(doc, patched_overlay_053)
    _no_errors(doc)
    for cell in doc["cells"]:
        check_patched_cell(cell, path)
    _compare_with_pristine(run_harness(runtime_python_053, pristine_overlay_053, args), doc)


# ---------------------------------------------------------------------------
# The script patchtool runs, on the newer releases (0.5.4 in CI; FULL=1: 0.5.5)
# ---------------------------------------------------------------------------

IDENTITY_CELLS = ["preset=qwen35-0.8b,chunk_blocks=1,num_chunks=2,ids=identity",
                  "preset=control-k1,chunk_blocks=1,num_chunks=2,ids=identity"]


@pytest.mark.parametrize("version", ["0.5.4"] + (["0.5.5"] if os.environ.get("LMCACHE_PATCHTOOL_FULL") == "1"
                                                  else []))
def test_identity_cells_round_trip_on_newer_releases(version):
    """gate/roundtrip.py adapts itself to 0.5.4+ (``ports_compat.install``), and
    its identity cells, one block per chunk, store and retrieve into ids 1..m:
    block 0 is vLLM's null block, and a 0.5.4+ server does not store a chunk
    whose ids are all 0, so ids from 0 failed even k = 1 there (retrieve
    failed: the chunk-0 object was never written)."""

    from lab import provision  # noqa: PLC0415

    series = sorted((REPO / "patches" / "hybrid-fa" / version).glob("*.patch"))
    overlay = provision.overlay(version, series)
    args = [a for c in IDENTITY_CELLS for a in ("--cell", c)]
    doc = run_harness(provision.runtime_env(version) / "bin" / "python", overlay, args)
    assert Path(doc["lmcache"]["root"]).resolve() == overlay.resolve()
    _no_errors(doc)
    for cell in doc["cells"]:
        assert cell["store_ok"] and cell["retrieve_ok"], cell["verdict"]
        assert cell["verdict"]["pass"], (cell["name"], cell["verdict"])
        assert cell["ids"]["store"] == cell["ids"]["retrieve"] == {kind: [1, 2] for kind in cell["ids"]["store"]}
        fa = cell["groups"]["fa"]
        assert fa["fraction"] == 1.0 and fa["slots_restored"] == fa["slots_expected"] == 2
        assert fa["foreign_bytes"] == 0 and fa["misplaced_bytes"] == 0
        # Both chunks stored (a windowed GDN group keeps the last chunk's state
        # only, so chunk 0 has no complete object set, by design).
        assert cell["objects"][-1] is not None
    assert_progress(doc)
