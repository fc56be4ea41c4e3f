"""Which checkpoint a ``moonrt train`` job writes and which one it resumes: the one place that decides.

Two formats hold the same thing (the single-process model and optimizer state under single-process names, the
step and the job config): the gathered file ``OUT/checkpoint.pt`` (:mod:`moonrt.jobs.checkpoint.single`) and the
sharded DCP directory ``OUT/checkpoint/step-N`` (:mod:`moonrt.jobs.checkpoint.sharded`). :func:`save_checkpoint`
picks the format (:func:`moonrt.jobs.checkpoint.sharded.use_sharded`: multi-rank AdamW and Muon jobs write sharded),
:func:`resume_state` picks what ``--resume`` continues from (the newer by step, the sharded one on a tie),
:func:`load_checkpoint` loads either into this rank's layout and :func:`read_state` reads either as one dict.
:class:`Checkpointer` is what the loop saves through (synchronous, or asynchronous sharded saves).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from moonrt.comm.parallelism import Parallelism
from moonrt.config import to_dict
from moonrt.jobs.checkpoint import sharded
from moonrt.jobs.checkpoint.job import JobBuilder, SavedJob
from moonrt.jobs.checkpoint.sharded import ROOT, read_marker, resolve, to_single_file
from moonrt.jobs.checkpoint.single import CheckpointError, load, save


def save_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
                    job: SavedJob, rt: Parallelism | None = None) -> None:
    """Atomically write ``{model, optimizer, step, config}`` (:func:`moonrt.jobs.checkpoint.single.save`);
    collective: every rank calls it.

    A multi-rank AdamW or Muon job writes a sharded DCP checkpoint under ``path.parent / "checkpoint"`` instead
    (:mod:`moonrt.jobs.checkpoint.sharded`: every rank its own pieces, nothing gathered). Otherwise model and optimizer
    state are gathered in the single-process layout (``rt.full_state_dict``) and only the main rank writes.
    """
    rt = rt or Parallelism()
    if sharded.use_sharded(opt):
        sharded.save_sharded(path.parent / sharded.ROOT, model, opt, step, job, rt)
        return
    state = rt.full_state_dict(model, opt)
    if not rt.is_main:
        return
    save(path, {"model": _on_host(state["model"]), "optimizer": _on_host(state["optimizer"]), "step": step,
                "config": to_dict(job)})


class Checkpointer:
    """The loop's checkpoint writer: :func:`save_checkpoint` every time, or (``checkpoint.async_save`` and a sharded
    job) :func:`moonrt.jobs.checkpoint.sharded.start_save` with at most one save in flight; collective (every rank
    makes the same calls). :attr:`waited` accumulates the seconds the calling loop spent in it (a synchronous save,
    the staging copy of an asynchronous one, a wait for the one in flight); :meth:`take_wait` reads and resets it.

    Asynchronous saves run over a gloo group of their own (made here, by every rank: a collective), so the loop's
    collectives never interleave with theirs."""

    def __init__(self, path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, job: SavedJob,
                 rt: Parallelism) -> None:
        import torch.distributed as dist

        self.path, self.model, self.opt, self.job, self.rt = path, model, opt, job, rt
        self.background = job.checkpoint.async_save and sharded.use_sharded(opt)
        self.group = dist.new_group(backend="gloo") if self.background else None
        self.pending: sharded.PendingSave | None = None
        self.waited = 0.0
        self.total_wait = 0.0

    def save(self, step: int) -> None:
        """Checkpoint ``step``: a whole save, or (background) wait for the save in flight, stage, start the next."""
        t0 = time.perf_counter()
        try:
            if not self.background:
                save_checkpoint(self.path, self.model, self.opt, step, self.job, self.rt)
                return
            self._join()
            self.pending = sharded.start_save(self.path.parent / ROOT, self.model, self.opt, step, self.job,
                                              self.rt, self.group)
        finally:
            self._count(time.perf_counter() - t0)

    def in_flight(self) -> bool:
        """Whether a background save is still writing (this rank's thread)."""
        return self.pending is not None and not self.pending.done()

    def wait(self) -> None:
        """Wait for the save in flight (if any): its commit, or its :class:`CheckpointError` on every rank."""
        t0 = time.perf_counter()
        try:
            self._join()
        finally:
            self._count(time.perf_counter() - t0)

    def take_wait(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited

    def _join(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _count(self, dt: float) -> None:
        self.waited += dt
        self.total_wait += dt


def _on_host(value: Any) -> Any:
    """``value`` with every tensor in it (nested dicts, lists, tuples) on the host: a checkpoint file holds the
    single-process state on the CPU whatever device the job ran on (the CPU's own tensors are not copied)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_host(v) for v in value)
    return value


def load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    rt: Parallelism | None = None, state: dict[str, Any] | None = None,
                    builder: JobBuilder | None = None) -> int:
    """Load a :func:`save_checkpoint` file (or its already-read ``state``) into this rank's model and optimizer
    (``rt.load_full_state_dict`` shards it for this layout); returns its step. A directory is a sharded DCP
    checkpoint (:func:`moonrt.jobs.checkpoint.sharded.load_sharded`, collective; ``builder``: the job layer's, for
    the param groups the marker's own config builds)."""
    rt = rt or Parallelism()
    if Path(path).is_dir():
        return sharded.load_sharded(Path(path), model, opt, rt, builder)
    state = load(path) if state is None else state
    try:
        rt.load_full_state_dict(model, opt, state)
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {str(path)!r}: does not fit this model and optimizer: {first}") from None
    return int(state["step"])


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


def read_state(out: str | Path, builder: JobBuilder) -> dict[str, Any]:
    """The newest checkpoint of run directory ``out`` (either format) as the gathered ``checkpoint.pt`` dict
    (``builder``: the job layer's, which rebuilds a sharded checkpoint's model and optimizer on the meta device)."""
    path, state = resume_state(Path(out))
    return to_single_file(path, builder) if path.is_dir() else state


__all__ = ["Checkpointer", "load_checkpoint", "read_state", "resume_state", "save_checkpoint"]
