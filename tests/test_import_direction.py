"""Layering of the moonrt packages, checked on every import of every file (docs/ARCHITECTURE.md §1).

:data:`MAY_IMPORT` is the rule as a table: for each package (bottom up), the moonrt packages its files may import
(itself always allowed). A model's network code is the ``model`` package of its client (``moonrt.models.<name>.model``);
the rest of ``moonrt.models`` (registry records, memory descriptions) may use the runtime but never a job. Every
``import`` / ``from ... import`` counts, including those inside functions and under ``TYPE_CHECKING`` (relative
imports resolved), so a lazy import cannot hide an upward arrow. There is no list of tolerated exceptions. The file
import graph has no cycle (:func:`file_cycles`), and the package root holds only the files ``__init__`` and ``cli``
beside its packages (``config`` among them).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import moonrt

PKG_ROOT = Path(moonrt.__file__).parent
RUNTIME = ("moonrt.parallel", "moonrt.cluster", "moonrt.scheduler", "moonrt.comm", "moonrt.memory")

MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "moonrt.ops": (),
    "moonrt.config": (),
    "moonrt.parallel": ("moonrt.ops", "moonrt.config"),
    "moonrt.cluster": ("moonrt.ops", "moonrt.config"),
    "moonrt.scheduler": ("moonrt.ops", "moonrt.config"),
    "moonrt.comm": ("moonrt.ops", "moonrt.config", "moonrt.parallel", "moonrt.scheduler", "moonrt.cluster"),
    "moonrt.memory": ("moonrt.ops", "moonrt.config", "moonrt.parallel", "moonrt.scheduler", "moonrt.cluster"),
    "moonrt.models.*.model": ("moonrt.ops", "moonrt.parallel", "moonrt.config"),
    "moonrt.models": ("moonrt.ops", "moonrt.config") + RUNTIME,
    "moonrt.jobs": ("moonrt.ops", "moonrt.config", "moonrt.models") + RUNTIME,
    "moonrt.cli": ("moonrt.ops", "moonrt.config", "moonrt.models", "moonrt.jobs") + RUNTIME,
}
"""Package -> the moonrt packages it may import besides itself (bottom up; ``*``: any one model client)."""

RUNTIME_MAY_IMPORT = RUNTIME + ("moonrt.ops", "moonrt.config")
MODEL_MAY_IMPORT = ("moonrt.ops", "moonrt.parallel", "moonrt.config")
ROOT_FILES = {"__init__.py", "cli.py"}


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


def layer_of(module: str) -> str | None:
    """The :data:`MAY_IMPORT` key ``module`` belongs to (a model's network code: ``moonrt.models.<name>.model``)."""
    parts = module.split(".")
    if parts[:2] == ["moonrt", "models"] and len(parts) >= 4 and parts[3] == "model":
        return "moonrt.models.*.model"
    for key in MAY_IMPORT:
        if "*" not in key and _under(module, (key,)):
            return key
    return None


def rule_broken(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` (None when allowed). Only ``moonrt.*`` names are judged; a
    module may always import inside its own package (a model's network code: inside its own ``model`` package)."""
    if not imported.startswith("moonrt."):
        return None
    layer = layer_of(importer)
    if layer is None:
        return f"{importer} is in no layer of MAY_IMPORT (a new package: add it to the table and docs/ARCHITECTURE.md)"
    own = ".".join(importer.split(".")[:4]) if layer == "moonrt.models.*.model" else layer
    if _under(imported, (own,)) or _under(imported, MAY_IMPORT[layer]):
        return None
    return f"{layer} imports only {', '.join(MAY_IMPORT[layer]) or 'itself'}"


def violations(root: Path) -> list[tuple[str, str, str]]:
    """Every ``(importer, imported, rule)`` breaking the layering in ``root/moonrt`` (sorted, de-duplicated)."""
    found = set()
    for path in sorted((root / "moonrt").rglob("*.py")):
        importer = module_name(path, root)
        if importer == "moonrt":  # the root package (the version string) is below every layer
            continue
        for imported in imports(path, root):
            why = rule_broken(importer, imported)
            if why is not None:
                found.add((importer, imported, why))
    return sorted(found)


def file_cycles(root: Path) -> list[list[str]]:
    """Import cycles between the files of ``root/moonrt`` (each a list of modules, the first repeated at the end;
    an import of a package counts as one of its ``__init__``). Depth-first search over the file graph."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / "moonrt").rglob("*.py")):
        mod = module_name(path, root)
        graph[mod] = {m for m in imports(path, root) if m.startswith("moonrt") and m != mod}
    graph = {m: {n for n in deps if n in graph} for m, deps in graph.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_moonrt_respects_the_layers() -> None:
    assert violations(PKG_ROOT.parent) == []


def test_no_import_cycle_between_files() -> None:
    assert file_cycles(PKG_ROOT.parent) == []


def test_package_root_holds_only_the_entry_points_and_the_packages() -> None:
    files = {p.name for p in PKG_ROOT.iterdir() if p.is_file() and p.suffix == ".py"}
    assert files == ROOT_FILES
    packages = {p.name for p in PKG_ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"config", "ops", "parallel", "cluster", "scheduler", "comm", "memory", "models", "jobs"}
    # every package is a row of the table (a new one must say where it sits)
    assert {f"moonrt.{name}" for name in packages} <= set(MAY_IMPORT)


COMM_PARTS = ("ep", "cp", "pp", "zero", "state", "transport")
"""The part packages of ``moonrt.comm``, beside its root modules (``mesh``, ``parallelism``, ``compose``,
``grad_reduce``). A part imports the root modules, ``state`` (the sharded-state description every part declares
what it holds in) and ``transport`` (the transport seam and its backends every part may move data with), never
another part; ``state`` and ``transport`` import no part."""
SHARED_PARTS = ("state", "transport")
"""The parts every other part may import (they import none)."""


def comm_part_violations(root: Path) -> list[tuple[str, str]]:
    """Every ``(importer, imported)`` where a comm part package imports another part (sorted)."""
    found = set()
    for part in COMM_PARTS:
        allowed = {part} | (set(SHARED_PARTS) if part not in SHARED_PARTS else set())
        for path in sorted((root / "moonrt" / "comm" / part).rglob("*.py")):
            importer = module_name(path, root)
            for imported in imports(path, root):
                names = imported.split(".")
                if names[:2] == ["moonrt", "comm"] and len(names) > 2 and names[2] in COMM_PARTS \
                        and names[2] not in allowed:
                    found.add((importer, imported))
    return sorted(found)


def test_comm_parts_import_the_root_modules_but_not_each_other() -> None:
    present = {p.name for p in (PKG_ROOT / "comm").iterdir() if (p / "__init__.py").is_file()}
    assert present == set(COMM_PARTS)
    assert comm_part_violations(PKG_ROOT.parent) == []


def test_comm_part_rule_catches_a_part_importing_another(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "moonrt/comm/__init__.py": "", "moonrt/comm/mesh.py": "",
        **{f"moonrt/comm/{p}/__init__.py": "" for p in COMM_PARTS},
        "moonrt/comm/ep/x.py": "", "moonrt/comm/state/shards.py": "",
        "moonrt/comm/zero/core.py": "from moonrt.comm.mesh import Group\nfrom moonrt.comm.state.shards import Shard\n"
                                    "def f():\n    from moonrt.comm.ep import x\n",
        "moonrt/comm/state/bad.py": "from ..ep.x import y\n",
        "moonrt/comm/transport/shm.py": "", "moonrt/comm/ep/y.py": "from moonrt.comm.transport import shm\n",
        "moonrt/comm/transport/bad.py": "from moonrt.comm.state.shards import Shard\n",
    })
    assert comm_part_violations(tmp_path) == [("moonrt.comm.state.bad", "moonrt.comm.ep.x"),
                                              ("moonrt.comm.transport.bad", "moonrt.comm.state.shards"),
                                              ("moonrt.comm.zero.core", "moonrt.comm.ep.x")]


JOBS_BELOW: dict[str, tuple[str, ...]] = {"moonrt.jobs.checkpoint": ("moonrt.jobs.train",)}
"""Arrows inside ``moonrt.jobs``: a job package -> the job packages it never imports (they import it). Checkpoints sit
below ``moonrt train``: train saves and resumes through them, and the checkpoint code gets the train job's config
reader and builders as values (:class:`moonrt.jobs.checkpoint.job.JobBuilder`)."""


def jobs_violations(root: Path) -> list[tuple[str, str]]:
    """Every ``(importer, imported)`` where a job package imports one :data:`JOBS_BELOW` puts above it (sorted)."""
    found = set()
    for below, above in JOBS_BELOW.items():
        for path in sorted(root.joinpath(*below.split(".")).rglob("*.py")):
            importer = module_name(path, root)
            found |= {(importer, imported) for imported in imports(path, root) if _under(imported, above)}
    return sorted(found)


def test_checkpoint_never_imports_the_train_job() -> None:
    assert (PKG_ROOT / "jobs" / "checkpoint" / "__init__.py").is_file()
    assert jobs_violations(PKG_ROOT.parent) == []


def test_jobs_rule_catches_checkpoint_importing_train(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "moonrt/__init__.py": "", "moonrt/jobs/__init__.py": "", "moonrt/jobs/mem_plan.py": "",
        "moonrt/jobs/train/__init__.py": "", "moonrt/jobs/train/config.py": "",
        "moonrt/jobs/train/loop.py": "from moonrt.jobs.checkpoint import store\n",  # the allowed direction
        "moonrt/jobs/checkpoint/__init__.py": "",
        "moonrt/jobs/checkpoint/store.py": "from moonrt.jobs import mem_plan\n",
        "moonrt/jobs/checkpoint/lazy.py": "def f():\n    from moonrt.jobs.train.config import JobConfig\n",
        "moonrt/jobs/checkpoint/rel.py": "from ..train import config\n",
        "moonrt/jobs/checkpoint/typing_only.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                 "    import moonrt.jobs.train.loop\n",
    })
    assert jobs_violations(tmp_path) == [("moonrt.jobs.checkpoint.lazy", "moonrt.jobs.train.config"),
                                         ("moonrt.jobs.checkpoint.rel", "moonrt.jobs.train.config"),
                                         ("moonrt.jobs.checkpoint.typing_only", "moonrt.jobs.train.loop")]


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_checker_catches_forbidden_imports_in_a_synthetic_tree(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "moonrt/ops/fp8/codec.py": "",
        "moonrt/models/k3/model/moe.py": "",
        "moonrt/models/k3/memory.py": "",
        "moonrt/models/dense/model/attn.py": "",
        "moonrt/memory/manager.py": "",
        "moonrt/memory/bad.py": "from moonrt.config import ParallelConfig\nfrom .manager import ActivationManager\n\n"
                                "def profile():\n    from moonrt.models import MODELS\n"
                                "    from moonrt.comm import mesh\n",
        "moonrt/ops/bad.py": "import torch\nfrom . import fp8\n\ndef f():\n    from ..models.k3.model import moe\n",
        "moonrt/comm/__init__.py": "from moonrt.parallel.context import LOCAL\n",
        "moonrt/comm/bad.py": "from moonrt.ops.kda import kda_chunk\nif True:\n    import moonrt.jobs.train.loop\n"
                              "class A:\n    def g(self):\n        from ..memory import manager\n",
        "moonrt/scheduler/bad.py": "from moonrt.cluster import env\n",
        "moonrt/parallel/bad.py": "from moonrt.scheduler import pipeline\n",
        "moonrt/models/k3/model/bad.py": "from moonrt.config import check\nfrom ...k3.model.moe import LatentMoE\n"
                                          "from ..memory import X\nimport moonrt.comm.mesh\n"
                                          "from moonrt import __version__\n"
                                          "\ndef h():\n    from moonrt.models.dense.model import attn\n",
        "moonrt/models/k3/spec.py": "from moonrt.memory.manager import ActivationManager\n"
                                    "from moonrt.jobs import train\n",
        "moonrt/newpkg/x.py": "import moonrt.ops.fp8.codec as fp8\n",
    })
    got = [(a, b) for a, b, _ in violations(tmp_path)]
    assert got == [
        ("moonrt.comm.bad", "moonrt.jobs.train.loop"),
        ("moonrt.comm.bad", "moonrt.memory.manager"),
        ("moonrt.memory.bad", "moonrt.comm"),
        ("moonrt.memory.bad", "moonrt.models"),
        ("moonrt.models.k3.model.bad", "moonrt.comm.mesh"),
        ("moonrt.models.k3.model.bad", "moonrt.models.dense.model.attn"),
        ("moonrt.models.k3.model.bad", "moonrt.models.k3.memory"),
        ("moonrt.models.k3.spec", "moonrt.jobs"),
        ("moonrt.newpkg.x", "moonrt.ops.fp8.codec"),
        ("moonrt.ops.bad", "moonrt.models.k3.model.moe"),
        ("moonrt.parallel.bad", "moonrt.scheduler"),
        ("moonrt.scheduler.bad", "moonrt.cluster"),
    ]
    # the real tree with one forbidden import added back is caught
    real = tmp_path / "real"
    (real / "moonrt" / "comm" / "cp").mkdir(parents=True)
    src = (PKG_ROOT / "comm" / "cp" / "kcp.py").read_text()
    (real / "moonrt" / "comm" / "cp" / "kcp.py").write_text(src.replace(
        "from moonrt.ops.kda import check_chunk_size", "from moonrt.models.k3.model.kda_layer import KDALayer\n"
        "    from moonrt.ops.kda import check_chunk_size"))
    assert [(a, b) for a, b, _ in violations(real)] == [("moonrt.comm.cp.kcp", "moonrt.models.k3.model.kda_layer")]


def test_cycle_finder_sees_a_cycle_through_a_lazy_import(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "moonrt/jobs/a.py": "from moonrt.jobs import b\n",
        "moonrt/jobs/b.py": "def f():\n    from moonrt.jobs.c import x\n",
        "moonrt/jobs/c.py": "import moonrt.jobs.a\nx = 1\n",
        "moonrt/jobs/d.py": "from moonrt.jobs import a\n",
    })
    assert file_cycles(tmp_path) == [["moonrt.jobs.a", "moonrt.jobs.b", "moonrt.jobs.c", "moonrt.jobs.a"]]


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
    for client in sorted(p.parent.name for p in (PKG_ROOT / "models").glob("*/model/__init__.py")):
        prefix = f"moonrt.models.{client}.model"
        mods, loaded = _loaded_after_importing(prefix, f"models/{client}/model")
        assert set(mods) <= set(loaded)
        # the parent packages' __init__ (the registry records) are loaded by Python on the way; nothing else is
        allowed = MODEL_MAY_IMPORT + (prefix,)
        parents = {"moonrt.models", f"moonrt.models.{client}"}
        assert [m for m in loaded if not _under(m, allowed) and m not in parents] == []


def test_importing_every_memory_module_loads_neither_the_model_nor_a_job_module() -> None:
    mods, loaded = _loaded_after_importing("moonrt.memory", "memory")
    assert set(mods) <= set(loaded)
    assert [m for m in loaded if not _under(m, RUNTIME_MAY_IMPORT)] == []


def test_importing_every_ops_module_loads_no_other_moonrt_package() -> None:
    mods, loaded = _loaded_after_importing("moonrt.ops", "ops")
    assert set(mods) <= set(loaded)
    assert [m for m in loaded if not _under(m, ("moonrt.ops",))] == []


def test_a_ranks_start_imports_no_distributed_checkpoint() -> None:
    """Every ``moonrt.comm`` module but the DCP planners (:mod:`moonrt.comm.state.dcp`), the train job's run, loop and
    assembly, and the self-test import no ``torch.distributed.checkpoint``: it costs ~0.6-0.8 s of every rank's start
    (it imports ``torch.distributed.tensor`` and sympy) and only a multi-rank save or load uses it
    (:mod:`moonrt.jobs.checkpoint.sharded` imports it then)."""
    mods = sorted(module_name(p, PKG_ROOT.parent) for p in (PKG_ROOT / "comm").rglob("*.py"))
    mods = [m for m in mods if m != "moonrt.comm.state.dcp"]
    mods += ["moonrt.jobs.train.cli", "moonrt.jobs.train.loop", "moonrt.jobs.train.assemble",
             "moonrt.jobs.checkpoint.sharded", "moonrt.jobs.selftest.cli", "moonrt.cluster.rank_preload"]
    code = ("import importlib, sys\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
