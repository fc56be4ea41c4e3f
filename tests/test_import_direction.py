"""The model package is single-device code: it imports nothing from the runtime packages (STYLE habit 1)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import moonrt

RUNTIME = ("moonrt.comm", "moonrt.scheduler", "moonrt.memory", "moonrt.cluster")
MODEL_DIR = Path(moonrt.__file__).parent / "model"


def _imports(path: Path) -> list[str]:
    """Absolute module names imported anywhere in ``path`` (relative imports resolved)."""
    pkg = "moonrt.model"  # every checked file lives directly in moonrt/model
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.append(mod)
            names += [f"{mod}.{a.name}" for a in node.names]
    return names


def _is_runtime(name: str) -> bool:
    return any(name == r or name.startswith(r + ".") for r in RUNTIME)


def test_ast_model_files_import_no_runtime_package() -> None:
    files = sorted(MODEL_DIR.rglob("*.py"))
    assert files, MODEL_DIR
    bad = {str(f.relative_to(MODEL_DIR)): [n for n in _imports(f) if _is_runtime(n)] for f in files}
    assert not {k: v for k, v in bad.items() if v}


def test_ast_checker_catches_violations(tmp_path: Path) -> None:
    f = tmp_path / "x.py"
    f.write_text("import moonrt.comm.mesh\nfrom ..memory import fp8\nfrom moonrt import cluster\n")
    assert [n for n in _imports(f) if _is_runtime(n)] == ["moonrt.comm.mesh", "moonrt.memory",
                                                          "moonrt.memory.fp8", "moonrt.cluster"]


def test_importing_every_model_module_loads_no_runtime_package() -> None:
    mods = sorted("moonrt.model." + p.stem for p in MODEL_DIR.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('moonrt.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(mods) <= set(loaded)
    assert not [m for m in loaded if _is_runtime(m)]
