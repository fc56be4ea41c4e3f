"""Layout of tests/ (issue 46 item 1): tests mirror the moonrt packages, helpers live in helper modules.

- :data:`MIRROR` maps every moonrt package to the tests/ directory that tests it, and every directory of test files
  under tests/ is one of those (a new package, or a directory such as the old ``tests/runtime/``, fails until the
  table names it).
- No file under tests/ imports a test module (``test_*``): what several files share lives in
  ``tests/<pkg>/helpers.py`` (or a top-level module such as ``tests/dist.py``).
- A helper module is imported by its directory-qualified name (``from cluster.helpers import clean_env``): pytest's
  default "prepend" import mode and ``tests/conftest.py`` put tests/ and each test file's directory on ``sys.path``,
  so a bare ``helpers`` would be whichever directory came first, and ``helpers`` beside ``jobs.helpers`` two module
  objects of one file. Each ``<pkg>.helpers`` resolves to ``tests/<pkg>/helpers.py`` (no installed package of that
  name shadows it), and test file names are unique across tests/ (rootdir-less modules are named by their stem).
- Every ``tests/...`` path that README.md, docs/ and benchmarks/ name exists.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import moonrt

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PKG_ROOT = Path(moonrt.__file__).parent

MIRROR: dict[str, str] = {
    "ops": "ops",
    "config": "config",
    "parallel": "model",  # the model-side seams (blocks, packing, CP context) are tested through the models
    "models": "model",
    "cluster": "cluster",
    "scheduler": "scheduler",
    "comm": "comm",
    "memory": "memory",
    "jobs": "jobs",
}
"""moonrt package (``moonrt/<name>/__init__.py``) -> the directory under tests/ holding its tests."""

DOCS = ("README.md", "docs/*.md", "benchmarks/*.md")
"""The files whose ``tests/...`` paths must exist."""


def moonrt_packages(pkg_root: Path) -> set[str]:
    return {p.parent.name for p in pkg_root.glob("*/__init__.py")}


def dirs_with_tests(tests: Path) -> set[str]:
    """Directories directly under ``tests`` that hold test files."""
    return {p.parent.name for p in tests.glob("*/test_*.py")}


def mirror_problems(pkg_root: Path, tests: Path, mirror: dict[str, str]) -> list[str]:
    pkgs = moonrt_packages(pkg_root)
    out = [f"moonrt/{p}/ has no row in MIRROR" for p in sorted(pkgs - mirror.keys())]
    out += [f"MIRROR names moonrt/{p}/, which is no package" for p in sorted(mirror.keys() - pkgs)]
    have = dirs_with_tests(tests)
    out += [f"tests/{d}/ (the tests of moonrt/{p}/) holds no test file"
            for p, d in sorted(mirror.items()) if p in pkgs and d not in have]
    out += [f"tests/{d}/ mirrors no moonrt package (MIRROR)" for d in sorted(have - set(mirror.values()))]
    return out


def _imported(node: ast.AST) -> list[str]:
    """Dotted names an import statement may load (``from a import b``: ``a`` and ``a.b``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level and node.module:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def import_problems(tests: Path) -> list[str]:
    """Imports of a test module, bare ``helpers`` imports and ``<x>.helpers`` imports of no tests/<x>/helpers.py,
    in every file under ``tests`` (imports inside functions included)."""
    out = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported(node):
                parts = name.split(".")
                where = f"tests/{rel}:{node.lineno}"
                if parts[-1].startswith("test_"):
                    out.append(f"{where} imports the test module {name}: move what it uses to tests/<pkg>/helpers.py")
                elif name == "helpers":
                    out.append(f"{where} imports bare 'helpers': name its directory (from <pkg>.helpers import ...)")
                elif len(parts) == 2 and parts[1] == "helpers" and (tests / parts[0]).is_dir() \
                        and not (tests / parts[0] / "helpers.py").is_file():
                    out.append(f"{where} imports {name}, but tests/{parts[0]}/helpers.py does not exist")
    return out


def doc_path_problems(root: Path) -> list[str]:
    out = []
    for pattern in DOCS:
        for doc in sorted(root.glob(pattern)):
            for m in sorted(set(re.findall(r"tests/[A-Za-z0-9_./*]+", doc.read_text()))):
                name = m.rstrip(".")
                if not any(root.glob(name)):
                    out.append(f"{doc.relative_to(root)} names {name}, which does not exist")
    return out


def test_tests_mirror_the_moonrt_packages() -> None:
    assert mirror_problems(PKG_ROOT, TESTS, MIRROR) == []
    assert not (TESTS / "runtime").exists()


def test_no_file_imports_a_test_module_and_helpers_are_imported_by_directory() -> None:
    assert import_problems(TESTS) == []


def test_each_helper_module_is_the_one_in_its_tests_directory() -> None:
    helpers = sorted(TESTS.glob("*/helpers.py"))
    assert {p.parent.name for p in helpers} >= {"cluster", "jobs", "memory", "model", "scheduler"}
    for path in helpers:
        mod = importlib.import_module(f"{path.parent.name}.helpers")
        assert Path(mod.__file__).resolve() == path, (mod.__name__, mod.__file__)


def test_test_file_names_are_unique_across_tests() -> None:
    seen: dict[str, list[str]] = {}
    for p in TESTS.rglob("test_*.py"):
        seen.setdefault(p.name, []).append(str(p.relative_to(TESTS)))
    assert {k: v for k, v in seen.items() if len(v) > 1} == {}


def test_the_docs_name_only_test_paths_that_exist() -> None:
    assert doc_path_problems(ROOT) == []


# ---- the checks catch what they exist for -----------------------------------------------------------------------


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checks_catch_a_bad_layout_in_a_synthetic_tree(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "moonrt/ops/__init__.py": "", "moonrt/comm/__init__.py": "", "moonrt/cluster/__init__.py": "",
        "moonrt/newpkg/__init__.py": "", "tests/cluster/helpers.py": "",
        "tests/ops/test_a.py": "", "tests/runtime/test_b.py": "",
        "tests/comm/helpers.py": "",
        "tests/comm/test_c.py": "from test_a import x\nfrom comm.helpers import y\n"
                                "def f():\n    from runtime.test_b import z\n    import helpers\n",
        "tests/ops/test_d.py": "from ops.helpers import w\nfrom ops import test_a\nimport cluster.test_e as e\n",
        "README.md": "see `tests/ops/test_a.py`, `tests/ops/test_*.py` and tests/comm/test_gone.py.\n",
    })
    mirror = {"ops": "ops", "comm": "comm", "cluster": "cluster", "gone": "gone"}
    assert mirror_problems(tmp_path / "moonrt", tmp_path / "tests", mirror) == [
        "moonrt/newpkg/ has no row in MIRROR",
        "MIRROR names moonrt/gone/, which is no package",
        "tests/cluster/ (the tests of moonrt/cluster/) holds no test file",
        "tests/runtime/ mirrors no moonrt package (MIRROR)",
    ]
    got = import_problems(tmp_path / "tests")
    assert [g.split(" ", 1)[0] for g in got] == [
        "tests/comm/test_c.py:1", "tests/comm/test_c.py:4", "tests/comm/test_c.py:5",
        "tests/ops/test_d.py:1", "tests/ops/test_d.py:2", "tests/ops/test_d.py:3"], got
    assert "runtime.test_b" in got[1] and "bare 'helpers'" in got[2] and "tests/ops/helpers.py does not exist" in got[3]
    assert "ops.test_a" in got[4] and "cluster.test_e" in got[5]
    assert doc_path_problems(tmp_path) == ["README.md names tests/comm/test_gone.py, which does not exist"]
