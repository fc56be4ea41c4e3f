"""Where a ``moonrt train`` step's time goes: per-phase times in every metrics record, and a ``torch.profiler`` trace
of chosen steps (``--profile-steps A:B``).

- :class:`PhaseClock`: ``time.perf_counter()`` at the loop's phase boundaries, nothing else (no device sync, no
  event: the host-sync budget of a step is unchanged). The record gains ``time_<phase>_s`` for the phases of
  :data:`PHASES`, consecutive pieces of the step's ``step_s``, so they sum to at most it. On CUDA these are host
  times: a kernel launched in one phase and waited for by a later host sync (the gradient norm's ``float``) is
  counted where the wait happens. ``ckpt_wait_s`` (the loop's time in checkpoint saves since the previous record,
  :class:`moonrt.jobs.checkpoint.store.Checkpointer`) is outside the step.
- :class:`StepProfiler`: on the ranks of ``log.profile_ranks``, ``torch.profiler.profile`` (CPU, and CUDA
  activities on a GPU) from the start of step ``A`` to the end of step ``B``, each step inside a
  ``record_function("moonrt.step N")`` range; written as Chrome trace JSON (``traceEvents``: what
  ``chrome://tracing``, Perfetto and TensorBoard's profiler plugin read) to ``OUT/profile/trace-rank<r>-steps<A>-<B>
  .json``; on CUDA also the allocator's history of those steps (``torch.cuda.memory._record_memory_history`` /
  ``_dump_snapshot``, for ``pytorch.org/memory_viz``) as ``memory-rank<r>-steps<A>-<B>.pickle``. Files are created
  new (a name taken gets ``.1``, ``.2``, ...: nothing is overwritten) with the umask's mode. A run that stops inside
  the range (``--until``, a stop signal) writes what it recorded.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moonrt.config import ConfigError, umask
from moonrt.jobs.train.config import profile_range

PHASES = ("data", "fwd_bwd", "grad_sync", "norm", "optimizer")
"""The step's phases in order: ``data`` (the lr and this rank's batch), ``fwd_bwd`` (forward and backward of every
micro-step: one runtime call, a pipeline interleaves them), ``grad_sync`` (the gradient sums over replicas; a ZeRO-1
reduce-scatter), ``norm`` (the global gradient norm and clip, and the loss summed over ranks), ``optimizer`` (the
update, a ZeRO-1 all-gather, the router-bias update)."""

PROFILE_DIR = "profile"


class PhaseClock:
    """``perf_counter`` marks of one step: :meth:`start`, then :meth:`mark` at the end of each phase."""

    def __init__(self) -> None:
        self.t0 = 0.0
        self.last = 0.0
        self.times: dict[str, float] = {}

    def start(self) -> float:
        self.t0 = self.last = time.perf_counter()
        self.times = {}
        return self.t0

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[phase] = self.times.get(phase, 0.0) + now - self.last
        self.last = now

    def fields(self) -> dict[str, float]:
        """``time_<phase>_s`` of every phase marked."""
        return {f"time_{p}_s": self.times[p] for p in PHASES if p in self.times}


def _place(write: Callable[[str], None], directory: Path, name: str) -> Path:
    """Write a new file ``directory/name`` through ``write(path)`` (a temp file from ``mkstemp``, given the umask's
    mode, then hard-linked to the first free name of ``name``, ``name.1``, ...): nothing there is overwritten."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".part", dir=directory)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        os.close(fd)
        write(tmp)
        for i in range(1000):
            final = directory / (name if i == 0 else f"{name}.{i}")
            try:
                os.link(tmp, final)
                return final
            except FileExistsError:
                continue
        raise ConfigError(f"log.profile_steps: {str(directory)!r} holds {name} and 999 more of its name; expected "
                          "fewer (remove old traces)")
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def profile_dir(out: Path) -> Path:
    """``OUT/profile``, created if missing; ConfigError (one line) when it is something else than a directory."""
    d = out / PROFILE_DIR
    if d.is_symlink() or (os.path.lexists(d) and not d.is_dir()):
        raise ConfigError(f"log.profile_steps (--profile-steps): {str(d)!r} exists and is not a directory; expected "
                          "a directory for the traces (or nothing there)")
    try:
        d.mkdir(exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"log.profile_steps (--profile-steps): cannot create {str(d)!r} "
                          f"({exc.strerror or exc})") from None
    return d


class StepProfiler:
    """The profiler of steps ``A..B`` of ``log.profile_steps`` on this rank (inactive elsewhere or with none):
    the loop calls :meth:`begin` before each step and :meth:`end` after it, :meth:`close` at the end."""

    def __init__(self, steps: str | None, ranks: list[int], rank: int, out: Path, cuda: bool) -> None:
        self.active = steps is not None and rank in ranks
        self.first, self.last = profile_range(steps) if steps is not None else (0, 0)
        self.rank, self.cuda = rank, cuda
        self.dir = profile_dir(out) if self.active else None
        self.prof: Any = None
        self.range: Any = None
        self.memory = False
        self.written: list[Path] = []

    def begin(self, step: int) -> None:
        """Before 1-based step ``step``."""
        if not self.active or not self.first <= step <= self.last:
            return
        import torch

        if self.prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.memory = _memory_history(True)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
            self.prof.__enter__()
        self.range = torch.profiler.record_function(f"moonrt.step {step}")
        self.range.__enter__()

    def end(self, step: int) -> None:
        """After 1-based step ``step``."""
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.prof is not None and step >= self.last:
            self.close(step)

    def close(self, step: int | None = None) -> None:
        """Stop and write what was recorded (the steps run, up to ``step``)."""
        if self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        last = self.last if step is None else min(step, self.last)
        assert self.dir is not None
        tag = f"rank{self.rank}-steps{self.first}-{last}"
        self.written.append(_place(prof.export_chrome_trace, self.dir, f"trace-{tag}.json"))
        if self.memory:
            import torch

            self.written.append(_place(torch.cuda.memory._dump_snapshot, self.dir, f"memory-{tag}.pickle"))
            _memory_history(False)
            self.memory = False


def _memory_history(on: bool) -> bool:
    """Start (``on``) or stop the CUDA allocator's history; False, with one warning line, where this torch has no
    ``torch.cuda.memory._record_memory_history`` (a private API)."""
    import torch

    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None or not hasattr(torch.cuda.memory, "_dump_snapshot"):
        print("moonrt train: warning: this torch has no torch.cuda.memory._record_memory_history: no memory snapshot",
              file=sys.stderr, flush=True)
        return False
    record(max_entries=100_000) if on else record(enabled=None)
    return True


__all__ = ["PHASES", "PROFILE_DIR", "PhaseClock", "StepProfiler", "profile_dir"]
