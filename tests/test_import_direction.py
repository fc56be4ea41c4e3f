"""Layering of the moonrt packages, checked on every import of every file (docs/ARCHITECTURE.md).

The layers, bottom up, and what each may import from moonrt:

- ``moonrt.ops``: pure tensor math; no other moonrt package.
- runtime (``moonrt.comm``, ``scheduler``, ``memory``, ``cluster``, ``parallel``): never the model
  client (``moonrt.model``) nor the job modules (``moonrt.train``, ``cli``, ``checkpoint``,
  ``outputs``, ``data``).
- ``moonrt.model``: only ``moonrt.ops``, the seam protocols in ``moonrt.parallel``,
  ``moonrt.config`` and itself (no ranks, process groups or runtime internals).

Every ``import`` / ``from ... import`` counts, including those inside functions and under
``TYPE_CHECKING`` (relative imports resolved), so a lazy import cannot hide an upward arrow.
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
JOBS = ("moonrt.train", "moonrt.job", "moonrt.cli", "moonrt.checkpoint", "moonrt.outputs", "moonrt.data")
MODEL_MAY_IMPORT = ("moonrt.ops", "moonrt.parallel", "moonrt.config", "moonrt.model")

ALLOWED: frozenset[tuple[str, str]] = frozenset({
    # Known debt: the memory planner's K3 adapter. k3_profile builds one K3 layer of each kind to
    # trace its saved activations, plan reads the K3 parameter table, plan_cli lists the K3 presets.
    # They should take a per-layer profile object the model client provides (a model-registry
    # record) instead of importing moonrt.model.
    ("moonrt.memory.k3_profile", "moonrt.model.attnres"),
    ("moonrt.memory.k3_profile", "moonrt.model.ffn"),
    ("moonrt.memory.k3_profile", "moonrt.model.kda_layer"),
    ("moonrt.memory.k3_profile", "moonrt.model.mla"),
    ("moonrt.memory.k3_profile", "moonrt.model.moe"),
    ("moonrt.memory.k3_profile", "moonrt.model.norm"),
    ("moonrt.memory.plan", "moonrt.model.params"),
    ("moonrt.memory.plan_cli", "moonrt.model.config"),
})
"""(importer, imported) pairs that break the rules today and are tolerated until the planner takes
a model description through an interface. Remove a pair when its import goes away (a test checks
that every pair listed is still present, so the list cannot go stale)."""


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path, root: Path) -> str:
    """Dotted module name of ``path`` inside the source tree ``root`` (the folder holding ``moonrt/``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[str]:
    """Absolute module names imported anywhere in ``path`` (a file under ``root``), relative imports resolved.

    ``from X import a`` yields ``X.a`` when that is a module or package under ``root`` (or ``X`` is
    the root package ``moonrt``), else ``X``.
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
                names.append(f"{src}.{a.name}" if is_module or src == "moonrt" else src)
    return names


def rule_broken(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` (None when allowed). Only ``moonrt.*`` names are judged."""
    if not imported.startswith("moonrt.") or _under(imported, (importer,)):
        return None
    if _under(importer, ("moonrt.ops",)) and not _under(imported, ("moonrt.ops",)):
        return "moonrt.ops imports no other moonrt package"
    if _under(importer, RUNTIME) and _under(imported, ("moonrt.model",) + JOBS):
        return "runtime packages import neither the model nor the job modules"
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


def test_moonrt_respects_the_layers_except_listed_debt() -> None:
    found = violations(PKG_ROOT.parent)
    assert [v for v in found if (v[0], v[1]) not in ALLOWED] == []


def test_every_allowed_pair_is_still_a_violation() -> None:
    found = {(a, b) for a, b, _ in violations(PKG_ROOT.parent)}
    assert sorted(ALLOWED - found) == []


def test_checker_catches_forbidden_imports_in_a_synthetic_tree(tmp_path: Path) -> None:
    (tmp_path / "moonrt" / "ops").mkdir(parents=True)
    (tmp_path / "moonrt" / "comm").mkdir()
    (tmp_path / "moonrt" / "model").mkdir()
    (tmp_path / "moonrt" / "memory").mkdir()
    (tmp_path / "moonrt" / "model" / "moe.py").write_text("")
    (tmp_path / "moonrt" / "memory" / "manager.py").write_text("")
    (tmp_path / "moonrt" / "ops" / "bad.py").write_text(
        "import torch\nfrom . import fp8\n\ndef f():\n    from ..model import moe\n    return moe\n")
    (tmp_path / "moonrt" / "comm" / "__init__.py").write_text("from moonrt.parallel.context import LOCAL\n")
    (tmp_path / "moonrt" / "comm" / "bad.py").write_text(
        "from moonrt.ops.kda import kda_chunk\nif True:\n    import moonrt.train\n"
        "class A:\n    def g(self):\n        from ..model.context import LOCAL\n")
    (tmp_path / "moonrt" / "model" / "bad.py").write_text(
        "from moonrt.config import check\nfrom ..parallel import context\nfrom .ffn import GLUFFN\n"
        "import moonrt.comm.mesh\n\ndef h():\n    from ..memory import manager\n    from moonrt import cluster\n")
    got = [(a, b) for a, b, _ in violations(tmp_path)]
    assert got == [
        ("moonrt.comm.bad", "moonrt.model.context"),
        ("moonrt.comm.bad", "moonrt.train"),
        ("moonrt.model.bad", "moonrt.cluster"),
        ("moonrt.model.bad", "moonrt.comm.mesh"),
        ("moonrt.model.bad", "moonrt.memory.manager"),
        ("moonrt.ops.bad", "moonrt.model.moe"),
    ]
    # the real tree with one forbidden import added back is caught, and ALLOWED does not hide it
    real = tmp_path / "real"
    (real / "moonrt" / "comm").mkdir(parents=True)
    src = (PKG_ROOT / "comm" / "kcp.py").read_text()
    (real / "moonrt" / "comm" / "kcp.py").write_text(src.replace(
        "from moonrt.ops.kda import MIN_LOG_DECAY", "from moonrt.model.kda_layer import KDALayer\n"
        "    from moonrt.ops.kda import MIN_LOG_DECAY"))
    assert [(a, b) for a, b, _ in violations(real) if (a, b) not in ALLOWED] == [
        ("moonrt.comm.kcp", "moonrt.model.kda_layer")]


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


def test_importing_every_ops_module_loads_no_other_moonrt_package() -> None:
    mods, loaded = _loaded_after_importing("moonrt.ops", "ops")
    assert set(mods) <= set(loaded)
    assert [m for m in loaded if not _under(m, ("moonrt.ops",))] == []
