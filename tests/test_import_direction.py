"""Layering of the moonrt packages, checked on every import of every file (docs/ARCHITECTURE.md).

The layers, bottom up, and what each may import from moonrt:

- ``moonrt.ops``: pure tensor math; no other moonrt package.
- runtime (``moonrt.comm``, ``scheduler``, ``memory``, ``cluster``, ``parallel``): only ``moonrt.ops``,
  ``moonrt.config`` and each other; never the model client (``moonrt.model``) nor the job layer
  (every other top-level module: ``moonrt.train``, ``job``, ``cli``, ``checkpoint``, ``outputs``,
  ``data``, the model registry ``models`` and its adapters such as ``k3_memory``, the CLI modules such
  as ``mem_plan``).
- ``moonrt.model``: only ``moonrt.ops``, the seam protocols in ``moonrt.parallel``,
  ``moonrt.config`` and itself (no ranks, process groups or runtime internals).

Every ``import`` / ``from ... import`` counts, including those inside functions and under
``TYPE_CHECKING`` (relative imports resolved), so a lazy import cannot hide an upward arrow. There is
no list of tolerated exceptions: the last ones (the memory planner's K3 adapter) moved to the job layer.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import moonrt

PKG_ROOT = Path(moonrt.__file__).parent
RUNTIME = ("moonrt.comm", "moonrt.scheduler", "moonrt.memory", "moonrt.cluster", "moonrt.parallel")
RUNTIME_MAY_IMPORT = RUNTIME + ("moonrt.ops", "moonrt.config")
MODEL_MAY_IMPORT = ("moonrt.ops", "moonrt.parallel", "moonrt.config", "moonrt.model")

def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path, root: Path) -> str:
    """Dotted module name of ``path`` inside the source tree ``root`` (the folder holding ``moonrt/``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[str]:
    """Absolute module names imported anywhere in ``path`` (a file under ``root``), relative imports resolved.

    ``from X import a`` yields ``X.a`` when that is a module or package under ``root`` (or ``X`` is
    the root package ``moonrt`` and ``a`` is not one of its dunder attributes such as ``__version__``),
    else ``X``. The root package ``moonrt`` itself (``moonrt/__init__.py``, the version string) is
    below every layer and never judged.
    """
    mod = module_name(path, root)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = pkg.split(".")
                if node.level - 1 > len(parts) - 1:
                    raise ValueError(f"{path}: relative import of level {node.level} escapes package {pkg!r}")
                base = parts[: len(parts) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            for a in node.names:
                sub = root.joinpath(*f"{src}.{a.name}".split("."))
                is_module = sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file()
                root_name = src == "moonrt" and not a.name.startswith("__")
                names.append(f"{src}.{a.name}" if is_module or root_name else src)
    return names


def rule_broken(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` (None when allowed). Only ``moonrt.*`` names are judged."""
    if not imported.startswith("moonrt.") or _under(imported, (importer,)):
        return None
    if _under(importer, ("moonrt.ops",)) and not _under(imported, ("moonrt.ops",)):
        return "moonrt.ops imports no other moonrt package"
    if _under(importer, RUNTIME) and not _under(imported, RUNTIME_MAY_IMPORT):
        return "runtime packages import only moonrt.ops, moonrt.config and each other (not the model or jobs)"
    if _under(importer, ("moonrt.model",)) and not _under(imported, MODEL_MAY_IMPORT):
        return "moonrt.model imports only moonrt.ops, moonrt.parallel, moonrt.config and itself"
    return None


def violations(root: Path) -> list[tuple[str, str, str]]:
    """Every ``(importer, imported, rule)`` breaking the layering in ``root/moonrt`` (sorted, de-duplicated)."""
    found = set()
    for path in sorted((root / "moonrt").rglob("*.py")):
        importer = module_name(path, root)
        for imported in imports(path, root):
            why = rule_broken(importer, imported)
            if why is not None:
                found.add((importer, imported, why))
    return sorted(found)


def test_moonrt_respects_the_layers() -> None:
    assert violations(PKG_ROOT.parent) == []


def test_checker_catches_forbidden_imports_in_a_synthetic_tree(tmp_path: Path) -> None:
    (tmp_path / "moonrt" / "ops").mkdir(parents=True)
    (tmp_path / "moonrt" / "comm").mkdir()
    (tmp_path / "moonrt" / "model").mkdir()
    (tmp_path / "moonrt" / "memory").mkdir()
    (tmp_path / "moonrt" / "model" / "moe.py").write_text("")
    (tmp_path / "moonrt" / "memory" / "manager.py").write_text("")
    (tmp_path / "moonrt" / "memory" / "bad.py").write_text(
        "from moonrt.config import ParallelConfig\nfrom .manager import ActivationManager\n\n"
        "def profile():\n    from moonrt.models import MODELS\n    from moonrt import k3_memory\n")
    (tmp_path / "moonrt" / "ops" / "bad.py").write_text(
        "import torch\nfrom . import fp8\n\ndef f():\n    from ..model import moe\n    return moe\n")
    (tmp_path / "moonrt" / "comm" / "__init__.py").write_text("from moonrt.parallel.context import LOCAL\n")
    (tmp_path / "moonrt" / "comm" / "bad.py").write_text(
        "from moonrt.ops.kda import kda_chunk\nif True:\n    import moonrt.train\n"
        "class A:\n    def g(self):\n        from ..model.context import LOCAL\n")
    (tmp_path / "moonrt" / "model" / "bad.py").write_text(
        "from moonrt.config import check\nfrom ..parallel import context\nfrom .ffn import GLUFFN\n"
        "import moonrt.comm.mesh\nfrom moonrt import __version__\n\n"
        "def h():\n    from ..memory import manager\n    from moonrt import cluster\n")
    got = [(a, b) for a, b, _ in violations(tmp_path)]
    assert got == [
        ("moonrt.comm.bad", "moonrt.model.context"),
        ("moonrt.comm.bad", "moonrt.train"),
        ("moonrt.memory.bad", "moonrt.k3_memory"),
        ("moonrt.memory.bad", "moonrt.models"),
        ("moonrt.model.bad", "moonrt.cluster"),
        ("moonrt.model.bad", "moonrt.comm.mesh"),
        ("moonrt.model.bad", "moonrt.memory.manager"),
        ("moonrt.ops.bad", "moonrt.model.moe"),
    ]
    # the real tree with one forbidden import added back is caught
    real = tmp_path / "real"
    (real / "moonrt" / "comm").mkdir(parents=True)
    src = (PKG_ROOT / "comm" / "kcp.py").read_text()
    (real / "moonrt" / "comm" / "kcp.py").write_text(src.replace(
        "from moonrt.ops.kda import MIN_LOG_DECAY", "from moonrt.model.kda_layer import KDALayer\n"
        "    from moonrt.ops.kda import MIN_LOG_DECAY"))
    assert [(a, b) for a, b, _ in violations(real)] == [("moonrt.comm.kcp", "moonrt.model.kda_layer")]


def _loaded_after_importing(prefix: str, folder: str) -> tuple[list[str], list[str]]:
    mods = sorted(f"{prefix}.{p.stem}" for p in (PKG_ROOT / folder).glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('moonrt.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return mods, json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_every_model_module_loads_only_ops_seams_and_config() -> None:
    mods, loaded = _loaded_after_importing("moonrt.model", "model")
    assert set(mods) <= set(loaded)
    assert [m for m in loaded if not _under(m, MODEL_MAY_IMPORT)] == []


def test_importing_every_memory_module_loads_neither_the_model_nor_a_job_module() -> None:
    mods, loaded = _loaded_after_importing("moonrt.memory", "memory")
    assert set(mods) <= set(loaded)
    assert [m for m in loaded if not _under(m, RUNTIME_MAY_IMPORT)] == []


def test_importing_every_ops_module_loads_no_other_moonrt_package() -> None:
    mods, loaded = _loaded_after_importing("moonrt.ops", "ops")
    assert set(mods) <= set(loaded)
    assert [m for m in loaded if not _under(m, ("moonrt.ops",))] == []
