"""The repository's layout holds: the gate a user runs apart from the lab.

``patchtool/`` is the tool, ``gate/`` the proofs it runs (shipped whole in the
wheel), ``lab/`` the evidence lab that produces the evidence files, ``bench/``
the benchmarks (CONTRIBUTING.md, "Layout").  Read with ``ast`` over every
first-party module (nothing is imported), the checks fail on:

* an import circle anywhere among them, counting ``runpy`` calls and imports
  of a sibling file that only resolve through ``sys.path[0]`` as edges;
* a ``sys.path`` edit (or ``site.addsitedir``) outside ``tests/``: every
  module imports from the repository root, which ``python -m`` or the
  gate runner's ``PYTHONPATH`` provide;
* the gate naming a lab module (import, ``runpy`` or a ``-m`` string), or the
  tool importing either (it runs the gate by path, never imports it);
* a first-party import that resolves to no file (a module moved, a caller not);
* a class or function over 300 lines in ``patchtool/`` or ``gate/``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_import_graph import _resolve, circles

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("patchtool", "gate", "lab", "bench")
MAX_UNIT_LINES = 300


def modules(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Every module under the first-party packages, by dotted name from the root."""
    out: dict[str, Path] = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_sys_path(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "path"
            and isinstance(node.value, ast.Name) and node.value.id == "sys")


def _top_level_names(path: Path) -> set[str]:
    """The names a module binds at its top level (what ``from m import n`` may take)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                    names.add(sub.name)
                elif isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
                elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                    names.add(sub.id)
    return names


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class ModuleFacts:
    """What one module imports, names and does to ``sys.path``."""

    def __init__(self, name: str, path: Path, mods: dict[str, Path], packages: tuple[str, ...]):
        self.name, self.path = name, path
        self.imports: set[str] = set()      # first-party modules it imports (or runs with runpy)
        self.named: set[str] = set()        # first-party modules a string literal names
        self.unresolved: list[str] = []     # first-party imports that resolve to no file
        self.path_edits: list[int] = []     # lines that edit sys.path
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_pkg = path.name == "__init__.py"
        here = name.split(".") if is_pkg else name.split(".")[:-1]
        siblings = {p.stem for p in path.parent.glob("*.py")}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - (node.level - 1)]
                    head = ".".join(base + ([node.module] if node.module else []))
                else:
                    head = node.module or ""
                self._add_from(head, [a.name for a in node.names], mods, packages, siblings)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self._add(a.name, mods, packages, siblings)
            elif isinstance(node, ast.Call):
                self._call(node, mods)
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)):
                        self.path_edits.append(node.lineno)
            s = _const_str(node)
            if s is not None and s in mods and "." in s:
                self.named.add(s)

    def _add_from(self, head: str, names: list[str], mods, packages, siblings) -> None:
        top = head.split(".")[0]
        if top in packages:
            if head not in mods:
                self.unresolved.append(head)
                return
            defined = _top_level_names(mods[head])
            for n in names:
                if f"{head}.{n}" in mods:
                    self.imports.add(f"{head}.{n}")
                elif n == "*" or n in defined:
                    self.imports.add(head)
                else:
                    self.unresolved.append(f"{head}.{n}")
        elif head in siblings and top not in packages:
            # a bare sibling import: resolves only through sys.path[0] (run by path)
            self.unresolved.append(f"{head} (a sibling file, found only through sys.path)")

    def _add(self, dotted: str, mods, packages, siblings) -> None:
        top = dotted.split(".")[0]
        if top in packages:
            # ``import a.b`` names a module: it resolves to a file or not at all
            if dotted in mods:
                self.imports.add(dotted)
            else:
                self.unresolved.append(dotted)
        elif dotted in siblings:
            self.unresolved.append(f"{dotted} (a sibling file, found only through sys.path)")

    def _call(self, node: ast.Call, mods) -> None:
        f = node.func
        if isinstance(f, ast.Attribute) and _is_sys_path(f.value) and f.attr in (
                "insert", "append", "extend", "remove", "clear", "pop"):
            self.path_edits.append(node.lineno)
        elif isinstance(f, ast.Attribute) and f.attr == "addsitedir":
            self.path_edits.append(node.lineno)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "runpy":
            arg = _const_str(node.args[0]) if node.args else None
            if arg and f.attr == "run_module" and _resolve(arg, mods):
                self.imports.add(_resolve(arg, mods))
            elif arg and f.attr == "run_path":
                rel = arg.removesuffix(".py").replace("/", ".")
                if rel in mods:
                    self.imports.add(rel)


def facts(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> dict[str, ModuleFacts]:
    mods = modules(root, packages)
    return {m: ModuleFacts(m, p, mods, packages) for m, p in mods.items()}


def problems(root: Path = REPO, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Every breach of the layout's rules, one line each."""
    fs = facts(root, packages)
    out: list[str] = []
    for m, f in sorted(fs.items()):
        rel = f.path.relative_to(root)
        out += [f"{rel}:{ln}: edits sys.path" for ln in f.path_edits]
        out += [f"{rel}: imports {u}, which resolves to no file" for u in f.unresolved]
        top = m.split(".")[0]
        refs = f.imports | f.named
        if top == "gate":
            out += [f"{rel}: the gate uses the lab module {t}" for t in sorted(refs)
                    if t.split(".")[0] == "lab"]
        if top == "patchtool":
            out += [f"{rel}: the tool imports {t}" for t in sorted(f.imports)
                    if t.split(".")[0] in ("gate", "lab", "bench")]
    edges = {m: {t for t in f.imports if t != m} for m, f in fs.items()}
    out += [f"import circle: {' -> '.join(c)}" for c in circles(edges)]
    for pkg in ("patchtool", "gate"):
        if (root / pkg).is_dir():
            out += long_units(root / pkg, root)
    return out


def long_units(folder: Path, root: Path) -> list[str]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_UNIT_LINES:
                    out.append(f"{path.relative_to(root)}:{node.lineno}: {node.name} is {n} lines")
    return out


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp


CLEAN = {"gate/__init__.py": "", "gate/procs.py": "X = 1\n",
         "gate/restore_gate.py": "from gate import procs\nfrom gate.procs import X\n",
         "lab/__init__.py": "", "lab/sim.py": "from gate import procs\n",
         "lab/probes/__init__.py": "", "lab/probes/p.py": "from lab import sim\n",
         "patchtool/__init__.py": "", "patchtool/cli.py": "from . import runner\n",
         "patchtool/runner.py": "import os\n", "bench/__init__.py": ""}


def test_the_checker_passes_a_clean_tree(tmp_path):
    assert problems(_tree(tmp_path, CLEAN)) == []


def test_the_checker_sees_each_breach(tmp_path):
    """Each rule, broken once in a small tree, is reported."""
    cases = {
        "circle": ({"gate/procs.py": "from gate import restore_gate\n"}, "import circle: gate.procs -> gate.restore_gate"),
        "runpy circle": ({"lab/sim.py": "import runpy\nrunpy.run_module('lab.probes.p')\n"},
                         "import circle: lab.probes.p -> lab.sim"),
        "sys.path": ({"lab/sim.py": "import sys\nsys.path.insert(0, 'x')\n"}, "lab/sim.py:2: edits sys.path"),
        "sys.path assign": ({"bench/b.py": "import sys\nsys.path[:0] = ['x']\n"}, "bench/b.py:2: edits sys.path"),
        "gate uses lab": ({"gate/procs.py": "def f():\n    from lab import sim\n"},
                          "gate/procs.py: the gate uses the lab module lab.sim"),
        "gate runs lab": ({"gate/procs.py": "ARGV = ['-m', 'lab.sim']\n"},
                          "gate/procs.py: the gate uses the lab module lab.sim"),
        "tool imports gate": ({"patchtool/runner.py": "import gate.procs\n"},
                              "patchtool/runner.py: the tool imports gate.procs"),
        "moved": ({"lab/sim.py": "from gate import gone\n"}, "lab/sim.py: imports gate.gone, which resolves to no file"),
        "moved, imported whole": ({"lab/sim.py": "import gate.gone\n"},
                                  "lab/sim.py: imports gate.gone, which resolves to no file"),
        "sibling": ({"lab/sim.py": "import other\n", "lab/other.py": ""},
                    "lab/sim.py: imports other (a sibling file, found only through sys.path), which resolves to no file"),
        "long": ({"gate/procs.py": "def f():\n" + "    x = 1\n" * MAX_UNIT_LINES},
                 "gate/procs.py:1: f is 301 lines"),
    }
    for what, (change, want) in cases.items():
        root = _tree(tmp_path / what.replace(" ", "-"), {**CLEAN, **change})
        assert want in problems(root), (what, problems(root))


def test_the_checker_reads_the_real_tree():
    """It sees the modules and edges it should, so a clean result means something."""
    fs = facts()
    assert {"gate.restore_gate", "gate.engine_gate", "lab.xver_gate", "lab.probes.ed_lock_probe",
            "patchtool.cli", "bench.bench_ci"} <= set(fs)
    assert "gate.harness" in fs["gate.roundtrip"].imports
    assert {"gate.xver_outcome", "lab.xver_share"} <= fs["lab.xver_gate"].imports
    assert "lab.provision" in fs["lab.provision_engine"].imports


def test_the_layout_holds():
    assert problems() == []
