"""No private name crosses a file of ``moonrt/memory`` (issue 46 item 4): a name one of its modules takes from another
moonrt module is public. Checked on the source (an ast walk): ``from moonrt.x import _y`` (relative imports too) and
``mod._y`` on a module bound by ``import moonrt.x as mod`` / ``from moonrt import x`` both count; dunder names
(``__version__``) do not, nor do names of other libraries (``torch._C``)."""

from __future__ import annotations

import ast
from pathlib import Path

import moonrt

PKG_ROOT = Path(moonrt.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _source_module(path: Path, root: Path, node: ast.ImportFrom) -> str:
    """The absolute module ``node`` imports from (relative imports resolved against ``path``'s package)."""
    if not node.level:
        return node.module or ""
    pkg = list(path.relative_to(root).with_suffix("").parts[:-1])
    base = pkg[: len(pkg) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(path: Path, root: Path) -> list[str]:
    """``"module.name"`` for each private name that ``path`` (a file under ``root``, the folder holding ``moonrt/``)
    imports from, or reads as an attribute of, another moonrt module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    modules: dict[str, str] = {}  # local name -> the moonrt module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("moonrt."):
                    modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else "moonrt"
                    found += [f"{a.name}" for part in a.name.split(".") if _private(part)]
        elif isinstance(node, ast.ImportFrom):
            src = _source_module(path, root, node)
            if src != "moonrt" and not src.startswith("moonrt."):
                continue
            for a in node.names:
                if _private(a.name):
                    found.append(f"{src}.{a.name}")
                sub = root.joinpath(*f"{src}.{a.name}".split("."))
                if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
                    modules[a.asname or a.name] = f"{src}.{a.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return sorted(set(found))


def test_no_private_name_crosses_a_memory_file() -> None:
    bad = {str(p.relative_to(PKG_ROOT.parent)): names for p in sorted((PKG_ROOT / "memory").rglob("*.py"))
           if (names := private_imports(p, PKG_ROOT.parent))}
    assert not bad, f"private names imported from another module (make them public, or keep them in one file): {bad}"


def test_private_name_check_catches_each_form(tmp_path: Path) -> None:
    """The checker sees a private name taken by absolute and relative ``from`` imports and through a module alias,
    and lets public names, dunders and other libraries' private names pass."""
    pkg = tmp_path / "moonrt" / "memory"
    pkg.mkdir(parents=True)
    (tmp_path / "moonrt" / "__init__.py").write_text("__version__ = '0'\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "entries.py").write_text("class _Entry: ...\nclass Entry: ...\n_x = 1\n")
    cases = {
        "from moonrt.memory.entries import _Entry\n": ["moonrt.memory.entries._Entry"],
        "from .entries import Entry, _x\n": ["moonrt.memory.entries._x"],
        "import moonrt.memory.entries as ent\ny = ent._Entry\n": ["moonrt.memory.entries._Entry"],
        "from moonrt.memory import entries\ny = entries._x\n": ["moonrt.memory.entries._x"],
        "from moonrt.memory.entries import Entry\nfrom moonrt import __version__\nimport torch\ny = torch._C\n": [],
    }
    for src, want in cases.items():
        (pkg / "user.py").write_text(src)
        assert private_imports(pkg / "user.py", tmp_path) == want, src
