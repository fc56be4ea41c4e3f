"""Sharded checkpoints of ``moonrt train`` with ``torch.distributed.checkpoint`` (DCP): no gather to one rank.

Layout on disk (``OUT/checkpoint/``)::

    OUT/checkpoint/step-00000020/     one committed checkpoint (older ones are removed after a commit)
        .metadata                     DCP's index: every entry's global shape, dtype and saved chunks
        __<rank>_0.distcp             what each rank wrote (DCP's files, one per rank)
        moonrt.json                   the commit marker: step, job config, layout, optimizer hyperparameters
    OUT/checkpoint/step-00000030.tmp/ a save in progress or interrupted (never loaded)

Entries (:mod:`moonrt.comm.dcp_state`): ``model.<name>`` for every single-process ``model.state_dict()`` entry
(single-process shapes: experts ``[E, ...]`` written as row shards by the EP ranks holding them, each
pipeline stage's tensors by its ranks, replicas once), ``optimizer.<name>.exp_avg`` / ``.exp_avg_sq`` (the
AdamW moments flattened to ``[numel]``: ZeRO-1 owners write their flat ranges) and ``optimizer.<name>.step``;
with ``--optimizer muon`` its AdamW-group parameters the same, its Muon parameters ``optimizer.<name>.momentum_buffer``
(the parameter's shape: ZeRO-Muon owners write their blocks as boxes, rows or columns) and ``.step`` (> 0: has state).

- **Every rank writes what it owns**: ``Parallelism.sharded_state_dict`` hands DCP views of this rank's
  parameters and optimizer shards; nothing is gathered (``moonrt.json`` records the bytes each rank passed).
- **Atomic**: ranks write into ``step-N.tmp``; after DCP's collective finish (``.metadata`` written), rank 0
  writes ``moonrt.json`` (temp file, fsync, rename) and renames the directory to ``step-N``. Loading requires
  the marker: a ``.tmp`` directory or one without ``moonrt.json`` is refused, and ``OUT/checkpoint`` resolves
  to its newest committed step, so an interrupted save leaves the previous checkpoint loadable.
- **Loading reshards** to any layout, one process included (DCP without a process group): each rank asks
  for the ranges its own tensors cover, DCP reads them from whichever saved chunks overlap; a range no saved
  chunk covers is an error (:class:`moonrt.comm.dcp_state.ShardLoadPlanner`).
- **No pickled objects run**: tensor data is read with ``torch.load(weights_only=True)`` (DCP), the step and
  config live in ``moonrt.json``; DCP's ``.metadata`` is a pickle that torch 2.13 reads with plain
  ``pickle.load``, so it is read here with an allow-list unpickler (DCP metadata classes, ``torch.Size``,
  dtypes) instead; non-tensor entries are refused.

Which format a job writes (:func:`use_sharded`): multi-rank jobs with AdamW or Muon write DCP; a single process
keeps writing ``OUT/checkpoint.pt`` (it holds everything anyway, and the one file is what other tools read); other
optimizers would keep the gathered file. ``--resume`` takes the newer of the two (:func:`resume_state`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moonrt.checkpoint import CheckpointError, load
from moonrt.cluster.preempt import raised_abort
from moonrt.comm.parallelism import Parallelism
from moonrt.config import from_dict, to_dict
from moonrt.job import JobConfig
from moonrt.ops.muon import Muon

# torch.distributed.checkpoint (and moonrt.comm.dcp_state, built on it) is imported by the functions that read or
# write a DCP checkpoint, not here: it costs ~1.5 s per process (it imports torch.distributed.tensor and sympy),
# and every `moonrt train` imports this module while a single process never writes DCP (use_sharded).

ROOT = "checkpoint"
MARKER = "moonrt.json"
FORMAT = "moonrt-dcp/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _multi() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def use_sharded(opt: torch.optim.Optimizer) -> bool:
    """True where a job writes DCP checkpoints: more than one rank and torch's AdamW or moonrt's Muon (the state
    layouts :mod:`moonrt.comm.dcp_state` names); else the gathered ``checkpoint.pt``."""
    return _multi() and isinstance(opt, torch.optim.AdamW | Muon)


@contextlib.contextmanager
def _quiet(multi: bool) -> Any:
    """Silence DCP's "torch.distributed is disabled ... assuming a single process" warning (that is the intent)."""
    with warnings.catch_warnings():
        if not multi:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _reason(exc: BaseException) -> str:
    """``Type: message`` of the underlying error (DCP wraps each rank's exception, with its traceback, in a
    ``CheckpointException``: the lowest failing rank's)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        exc = inner[0] if isinstance(inner, tuple) else inner
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON atomically (temp file beside it, fsync, rename)."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def _hyper(saved: dict[str, Any]) -> dict[str, Any]:
    """Hyperparameters of a param group as read back from JSON (lists were tuples: ``betas``)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}


# ---- writing -------------------------------------------------------------------------------------------


def save_sharded(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, job: JobConfig,
                 rt: Parallelism | None = None) -> Path:
    """Write this job's state at ``step`` under ``root`` (``OUT/checkpoint``); collective: every rank calls it.

    Returns the committed ``root/step-N`` directory. :class:`CheckpointError` (nothing committed, the previous
    checkpoint untouched) when a rank's write fails.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from moonrt.comm.dcp_state import SafeReader, ShardSavePlanner, entry_bytes

    rt = rt or Parallelism()
    root = Path(root)
    multi = _multi()
    state = rt.sharded_state_dict(model, opt, save=True)
    mine = [sum(entry_bytes(v) for k, v in state.items() if k.startswith("model.")),
            sum(entry_bytes(v) for k, v in state.items() if k.startswith("optimizer."))]
    name = f"step-{step:08d}"
    tmp, final = root / f"{name}.tmp", root / name
    if rt.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if multi:
        dist.barrier()
    planner = ShardSavePlanner()
    try:
        with _quiet(multi):
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1, sync_files=True),
                     planner=planner, no_dist=not multi)
    except (Exception, CheckpointException) as exc:  # DCP re-raises every rank's failure on every rank
        abort = raised_abort()  # a second stop signal during the save: DCP wrapped the abort too
        if abort is not None:
            raise abort from None
        raise CheckpointError(f"checkpoint write failed: {tmp}: {_reason(exc)}") from None
    written = sum(math.prod(it.tensor_data.chunk.sizes) * it.tensor_data.properties.dtype.itemsize
                  for it in planner.plan.items if it.tensor_data is not None)  # this rank's chunks after dedup
    row = [*mine, int(written)]
    rows: list[Any] = [None] * dist.get_world_size() if multi else [row]
    if multi:  # small Python lists: no device to pick (NCCL's tensors live on the GPU)
        dist.all_gather_object(rows, row)
    if rt.is_main:
        md = SafeReader(tmp).read_metadata()
        tensors = [m for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
        p = job.parallel
        marker = {"format": FORMAT, "step": step, "config": to_dict(job),
                  "layout": {"world": len(rows), "dp": p.dp, "pp": p.pp, "vpp": p.vpp, "ep": p.ep, "cp": p.cp,
                             "zero": p.zero},
                  "param_groups": [{k: _jsonable(v) for k, v in g.items() if k != "params"}
                                   for g in opt.param_groups],
                  "tensors": len(tensors),
                  "bytes": sum(math.prod(m.size) * m.properties.dtype.itemsize for m in tensors),
                  "ranks": [{"model_bytes": int(r[0]), "optimizer_bytes": int(r[1]), "written_bytes": int(r[2])}
                            for r in rows]}
        _write_json(tmp / MARKER, marker)
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in root.iterdir():  # older checkpoints and interrupted saves
            if old != final and old.is_dir() and (_STEP_DIR.match(old.name) or old.name.endswith(".tmp")):
                shutil.rmtree(old, ignore_errors=True)
    if multi:
        dist.barrier()
    return final


# ---- reading -------------------------------------------------------------------------------------------


def resolve(path: str | Path) -> Path:
    """The committed checkpoint directory ``path`` names: itself (a ``step-N`` directory with its marker) or
    the newest committed ``step-N`` in it (``OUT/checkpoint``). :class:`CheckpointError` for a torn one."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    if path.name.endswith(".tmp") or (path / ".metadata").exists() or any(path.glob("*.distcp")):
        raise CheckpointError(f"checkpoint {str(path)!r}: incomplete (no {MARKER} commit marker: the save was "
                              "interrupted or is still running); expected a committed checkpoint directory")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r}: expected a directory (OUT/checkpoint or one of its "
                              "step-N directories)")
    done = sorted((int(m.group(1)), d) for d in path.iterdir()
                  if (m := _STEP_DIR.match(d.name)) and (d / MARKER).is_file())
    if done:
        return done[-1][1]
    found = sorted(d.name for d in path.iterdir())
    raise CheckpointError(f"checkpoint {str(path)!r}: no committed checkpoint (holds {found or 'nothing'}; a "
                          f"step-N directory counts once it holds {MARKER}: a save was interrupted?)")


def read_marker(step_dir: Path) -> dict[str, Any]:
    """The ``moonrt.json`` of a committed checkpoint directory, checked."""
    path = Path(step_dir) / MARKER
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: unreadable {MARKER}: {exc}") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        got = marker.get("format") if isinstance(marker, dict) else type(marker).__name__
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {MARKER} format = {got!r}; expected {FORMAT!r}")
    if not isinstance(marker.get("step"), int) or marker["step"] < 0:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: step = {marker.get('step')!r}; expected an integer >= 0")
    return marker


def load_sharded(step_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 rt: Parallelism | None = None) -> int:
    """Load a committed checkpoint into this rank's model and optimizer, whatever layout wrote it; returns its
    step. Collective in a multi-rank job. :class:`CheckpointError` when it does not fit the model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from moonrt.comm.dcp_state import SafeReader, ShardLoadPlanner

    rt = rt or Parallelism()
    step_dir = resolve(step_dir)
    marker = read_marker(step_dir)
    groups = marker.get("param_groups", [])
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: {len(groups)} optimizer param groups; this optimizer "
                              f"has {len(opt.param_groups)} (another optimizer?)")
    state = rt.sharded_state_dict(model, opt, save=False)
    try:
        with _quiet(_multi()):
            dcp.load(state, storage_reader=SafeReader(step_dir), planner=ShardLoadPlanner(), no_dist=not _multi())
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: does not fit this model and optimizer: "
                              f"{_reason(exc)}") from None
    rt.load_sharded_state_dict(model, opt, state)
    for group, saved in zip(opt.param_groups, groups):
        group.update(_hyper(saved))
    return int(marker["step"])


def read_full(step_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every entry of a checkpoint whole (single-process shapes, moments flat) and its marker; one process,
    no process group needed (the caller's memory holds the whole state: a tool for models that fit)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from moonrt.comm.dcp_state import SafeReader, ShardLoadPlanner

    step_dir = resolve(step_dir)
    marker = read_marker(step_dir)
    reader = SafeReader(step_dir)
    try:
        md = reader.read_metadata()
        bad = [k for k, m in md.state_dict_metadata.items() if not isinstance(m, TensorStorageMetadata)]
        if bad:
            raise ValueError(f"entry {bad[0]!r} is a pickled object, expected a tensor")
        out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()}
        with _quiet(False):
            dcp.load(out, storage_reader=SafeReader(step_dir), planner=ShardLoadPlanner(), no_dist=True)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: unreadable: {_reason(exc)}") from None
    return out, marker


def to_single_file(step_dir: str | Path) -> dict[str, Any]:
    """The checkpoint in the gathered ``checkpoint.pt`` format: ``{"model", "optimizer", "step", "config"}``
    with torch's ``optimizer.state_dict()`` numbering (the job's model and optimizer rebuilt on the meta
    device give the single-process parameter order and param groups): AdamW parameters with step > 0 get
    ``{step, exp_avg, exp_avg_sq}``, Muon parameters with step > 0 ``{momentum_buffer}`` (as
    :class:`moonrt.ops.muon.Muon` and the gathered path hold them), the others no state."""
    from moonrt.assemble import build_model
    from moonrt.comm.dcp_state import MOMENTS, MOMENTUM
    from moonrt.optimizers import build_optimizer

    flat, marker = read_full(step_dir)
    job = from_dict(JobConfig, marker["config"])
    with torch.device("meta"):
        model = build_model(job)
    opt = build_optimizer(model, job.optim)
    name_of = {id(p): n for n, p in model.named_parameters()}
    try:
        model_sd = {k: flat[f"model.{k}"] for k in model.state_dict()}
        state, groups, i = {}, [], 0
        for group, saved in zip(opt.param_groups, marker["param_groups"], strict=True):
            ids = []
            for p in group["params"]:
                n = name_of[id(p)]
                step = float(flat[f"optimizer.{n}.step"])
                if step > 0 and group.get("use_muon", False):  # Muon: the buffer, no step count
                    state[i] = {MOMENTUM: flat[f"optimizer.{n}.{MOMENTUM}"].view(p.shape)}
                elif step > 0:
                    state[i] = {"step": torch.tensor(step)} | {
                        k: flat[f"optimizer.{n}.{k}"].view(p.shape) for k in MOMENTS}
                ids.append(i)
                i += 1
            groups.append({**_hyper(saved), "params": ids})
    except (KeyError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {str(step_dir)!r}: does not match its own config's model: "
                              f"{_reason(exc)}") from None
    return {"model": model_sd, "optimizer": {"state": state, "param_groups": groups}, "step": marker["step"],
            "config": marker["config"]}


def resume_state(out: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``--resume`` continues from in ``out``: the newer (by step) of ``out/checkpoint/``
    (committed; header = its marker) and ``out/checkpoint.pt`` (header = the whole file's state).

    :class:`CheckpointError` when neither exists (naming a torn ``checkpoint/`` if that is all there is).
    """
    pt, root = out / "checkpoint.pt", out / ROOT
    sharded: tuple[Path, dict[str, Any]] | None = None
    if root.exists():
        try:
            step_dir = resolve(root)
            sharded = (step_dir, read_marker(step_dir))
        except CheckpointError:
            if not pt.is_file():
                raise
    if pt.is_file():
        state = load(pt)
        if sharded is None or state["step"] > sharded[1]["step"]:
            return pt, state
    if sharded is None:
        raise CheckpointError(f"--resume: no checkpoint at {str(pt)!r} or {str(root)!r}")
    return sharded


def read_state(out: str | Path) -> dict[str, Any]:
    """The newest checkpoint of run directory ``out`` (either format) as the gathered ``checkpoint.pt`` dict."""
    path, state = resume_state(Path(out))
    return to_single_file(path) if path.is_dir() else state


__all__ = ["FORMAT", "MARKER", "ROOT", "load_sharded", "read_full", "read_marker", "read_state", "resolve",
           "resume_state", "save_sharded", "to_single_file", "use_sharded"]
