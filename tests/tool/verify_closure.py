"""What of ``verify/`` patchtool runs: the files its wheel must ship, no more.

Roots: every string literal in ``patchtool/`` that names a file at the top of
``verify/`` (``verify_root / "restore_gate.py"``, ``GPU_GATE = "engine_gate.py"``):
the scripts patchtool launches by path.  From each file reached, follow

* every import, module-level or function-local, absolute or relative, that
  resolves to ``verify/<name>.py`` or ``gate/<name>.py``
  (a helper module brings the package's ``__init__.py``);
* every string literal naming a helper module (``"gate.x"``,
  as ``python -m`` runs it) or an entry at the top of ``verify/`` (a file, or a
  folder's files: ``engine_device.SHIM_DIR`` is ``.../"engine_shim"``).

Read with ``ast`` only: nothing here imports the scripts (they may need torch).
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = "lmcache_patchtool_verify"


def _files_under(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _module_file(verify: Path, dotted: str) -> Path | None:
    parts = dotted.split(".")
    if parts[0] == PKG:
        p = verify / PKG / "__init__.py" if len(parts) == 1 else verify / PKG / f"{parts[1]}.py"
    elif len(parts) == 1:
        p = verify / f"{dotted}.py"  # a script imported as a module (run by path: verify/ on sys.path)
    else:
        return None
    return p if p.is_file() else None


def _references(path: Path, verify: Path) -> set[Path]:
    """The verify/ files ``path`` imports or names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {p.name: p for p in verify.iterdir()}
    names: set[str] = set()
    found: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: only the helper package has any
                base = PKG + (f".{base}" if base else "")
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)  # "from pkg import module"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(f"{PKG}."):
                names.add(node.value)
            elif node.value in top:
                entry = top[node.value]
                found.update(_files_under(entry) if entry.is_dir() else [entry])
    for name in names:
        f = _module_file(verify, name)
        if f is not None:
            found.add(f)
            if f.parent.name == PKG:
                found.add(verify / PKG / "__init__.py")
    return found


def launched_scripts(patchtool_dir: Path, verify: Path) -> set[Path]:
    """The verify/ files patchtool's own code names (the scripts it runs by path)."""
    top = {p.name: p for p in verify.iterdir() if p.is_file()}
    out = set()
    for src in patchtool_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(src.read_text(), filename=str(src))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in top:
                out.add(top[node.value])
    return out


def verify_closure(repo: Path) -> set[str]:
    """Paths relative to ``verify/`` of everything patchtool runs from it."""
    verify = repo / "verify"
    todo = list(launched_scripts(repo / "patchtool", verify))
    seen: set[Path] = set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if f.suffix == ".py":
            todo.extend(_references(f, verify) - seen)
    return {str(p.relative_to(verify)) for p in seen}
