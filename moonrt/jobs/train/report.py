"""What ``moonrt train`` reports while it runs, besides checkpoints: the per-step throughput and memory fields of
its metrics records, the console (a tqdm bar on a terminal, plain lines otherwise), and TensorBoard scalars.

- :func:`rate_fields`: ``time`` (UNIX seconds of the record), ``elapsed_s`` (since this process's loop started),
  ``tokens_per_s``, ``model_tflops_per_s`` (model FLOPs from the family's
  :attr:`~moonrt.models.spec.ModelSpec.flops_per_token`, the PaLM / Megatron ``6 N`` + attention estimate, times
  the global tokens per second), ``mfu`` (that over ``log.peak_tflops`` x the number of processes; only with a
  peak) and ``peak_mem_bytes`` (:func:`peak_memory_bytes`; the loop replaces it by the largest over the ranks).
- :class:`Console`: rank 0's output. On a terminal (stdout and stderr both TTYs) the tqdm bar; otherwise (SLURM
  logs, pipes) no ``\\r`` at all: one plain line every ``log.log_every`` steps and at the last step, starting
  with the local time of its record and ending with the ETA of the run's last step (``--until``'s, else
  ``--steps``'), from the mean step time of the steps this process ran.
  ``--no-progress`` hides the bar and those lines only: the start line, the eval lines and the summary always
  print on rank 0.
- :class:`TensorBoard`: scalar events (``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/tokens_per_s``,
  ``train/mfu``, ``train/maxvio``, ``eval/loss``, ``memory/*``, the step's phase times ``time/*``, and the EP, PP
  and CP series the record has: :data:`TB_SCALARS`) written by rank 0 with ``torch.utils.tensorboard.SummaryWriter``
  when the optional ``tensorboard`` package is installed (imported lazily; :func:`check_tensorboard` names the
  missing package).
"""

from __future__ import annotations

import importlib.util
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from moonrt.config import ConfigError

TB_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
              "tokens_per_s": "train/tokens_per_s", "mfu": "train/mfu", "eval_loss": "eval/loss",
              "maxvio": "train/maxvio", "peak_mem_bytes": "memory/peak_bytes",
              "optimizer_state_bytes": "memory/optimizer_state_bytes", "step_s": "time/step_s",
              "time_data_s": "time/data_s", "time_fwd_bwd_s": "time/fwd_bwd_s", "time_grad_sync_s": "time/grad_sync_s",
              "time_norm_s": "time/norm_s", "time_optimizer_s": "time/optimizer_s", "ckpt_wait_s": "time/ckpt_wait_s",
              "ep_rows_max": "ep/rows_max", "ep_rows_unbalanced_max": "ep/rows_unbalanced_max",
              "ep_token_bytes_sent": "ep/token_bytes_sent", "pp_idle_frac": "pp/idle_frac_max",
              "pp_bytes_sent": "pp/bytes_sent_max", "cp_bytes_sent": "cp/bytes_sent"}
"""Metrics record key -> TensorBoard tag (the scalars :class:`TensorBoard` writes, when the record has them; a
per-rank list, e.g. ``pp_idle_frac`` or ``optimizer_state_bytes``, is written as its largest value)."""


def peak_memory_bytes(device: str) -> int:
    """This process's peak memory in bytes: on ``cuda`` the peak of ``torch.cuda.max_memory_allocated`` (tensors
    only); otherwise the peak resident set size of the process since it started, Python and libraries included: on
    Linux its address space's high-water mark (``VmHWM`` of ``/proc/self/status``), elsewhere
    ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (bytes on macOS). Not ``ru_maxrss`` on Linux: the kernel folds
    the high-water mark of the image a process replaced at ``exec`` into it, so a run started by a large parent
    (a test process, a notebook) would report that parent's resident size at fork as its own peak."""
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    global _peak_rss
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = int(rss if sys.platform == "darwin" else rss * 1024)
    if sys.platform.startswith("linux"):
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024  # kB
        except (OSError, ValueError, IndexError):
            pass
    # the kernel updates the high-water mark lazily (a later reading can be a little lower): never report less
    _peak_rss = max(_peak_rss, peak)
    return _peak_rss


_peak_rss = 0
"""The largest resident size :func:`peak_memory_bytes` has read in this process (its readings are monotonic)."""


def rate_fields(tokens: int, dt: float, t_start: float, flops_per_token: int | None, peak_tflops: float | None,
                world: int, device: str) -> dict[str, Any]:
    """The time, throughput and memory fields of one step's record: ``tokens`` global tokens in ``dt`` seconds,
    ``t_start`` the ``time.perf_counter()`` the loop started at, ``flops_per_token`` the model's (None: no
    FLOP fields), ``peak_tflops`` one device's peak (None: no ``mfu``), ``world`` processes."""
    rate = tokens / dt if dt > 0 else math.nan
    out: dict[str, Any] = {"time": time.time(), "elapsed_s": time.perf_counter() - t_start, "tokens_per_s": rate}
    if flops_per_token is not None:
        out["model_tflops_per_s"] = flops_per_token * rate / 1e12
        if peak_tflops is not None:
            out["mfu"] = out["model_tflops_per_s"] / (peak_tflops * world)
    out["peak_mem_bytes"] = peak_memory_bytes(device)
    return out


def duration(seconds: float) -> str:
    """``seconds`` as a short duration: ``42s``, ``3m05s``, ``2h07m``; ``?`` when not finite."""
    if not math.isfinite(seconds):
        return "?"
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s // 60 % 60:02d}m"


class Console:
    """Rank 0's console output of the loop (nothing on other ranks: ``main`` False).

    ``progress`` (not ``--no-progress``): the bar (``tty``, default: stdout and stderr are both terminals) or the
    plain step lines every ``log_every`` steps and at ``stop``. :meth:`line` (start, eval, summary lines) prints
    whatever ``progress`` says, above the bar when there is one."""

    def __init__(self, main: bool, progress: bool, start: int, stop: int, total: int, log_every: int,
                 tty: bool | None = None) -> None:
        if tty is None:
            tty = sys.stdout.isatty() and sys.stderr.isatty()
        self.main, self.start, self.stop, self.total, self.log_every = main, start, stop, total, log_every
        self.lines = main and progress and not tty
        self.bar = tqdm(initial=start, total=total, dynamic_ncols=True, desc="train") if main and progress and tty \
            else None

    def line(self, text: str) -> None:
        if not self.main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def step(self, record: dict[str, Any], eval_loss: float | None) -> None:
        """After step ``record["step"]``: the bar's postfix (no eval field before the first eval) or a plain line."""
        step = record["step"]
        if self.bar is not None:
            shown = {"loss": f"{record['loss']:.3f}"} | ({} if eval_loss is None else {"eval": f"{eval_loss:.3f}"})
            self.bar.set_postfix(shown | {"tok_s": f"{record['tokens_per_s']:,.0f}"}, refresh=False)
            self.bar.update(1)
        elif self.lines and (step % self.log_every == 0 or step == self.stop):
            parts = [f"step {step}/{self.total}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3g}",
                     f"grad norm {record['grad_norm']:.3g}", f"{record['tokens_per_s']:,.0f} tok/s"]
            if "model_tflops_per_s" in record:
                parts.append(f"{record['model_tflops_per_s']:.4g} TFLOP/s")
            if "mfu" in record:
                parts.append(f"mfu {100 * record['mfu']:.2f}%")
            parts.append(f"peak mem {record['peak_mem_bytes'] / 2**30:.2f} GiB")
            # the time left to this run's last step at the mean step time of the steps this process ran
            left = record["elapsed_s"] / (step - self.start) * (self.stop - step) if step > self.start else math.nan
            parts.append(f"eta {duration(left)}")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["time"]))
            print(f"{when} train: " + ", ".join(parts), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_tensorboard(directory: str | None) -> None:
    """ConfigError (one line) when ``directory`` is set and the ``tensorboard`` package is missing (every rank
    checks, so all of them stop before step 1)."""
    if directory is not None and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"log.tensorboard (--tensorboard) = {directory!r}: needs the tensorboard package, which is "
                          "not installed; expected pip install tensorboard (or moonrt[tensorboard]), or no "
                          "--tensorboard")


class TensorBoard:
    """Scalar events of one run in ``directory`` (rank 0 only), via ``torch.utils.tensorboard.SummaryWriter``.

    The directory is checked before step 1 (:func:`moonrt.jobs.train.outputs.check_tensorboard_dir`: a fresh run
    creates it, so never writes beside another run's events); ``resume_step`` (a resume or restart of this run):
    the events of the steps after it that a killed run wrote are purged when read (``purge_step``), so every step
    appears once. Event files are named by time, host and pid: a resume adds one, never rewrites one."""

    def __init__(self, directory: str, resume_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = Path(directory)
        try:
            self.writer = SummaryWriter(log_dir=str(self.directory),
                                        purge_step=None if resume_step is None else resume_step + 1)
        except OSError as exc:
            raise ConfigError(f"log.tensorboard (--tensorboard) = {directory!r}: cannot write "
                              f"({exc.strerror or exc})") from None

    def write(self, record: dict[str, Any]) -> None:
        """The record's scalars of :data:`TB_SCALARS` at global step ``record["step"]`` (non-finite ones skipped)."""
        for key, tag in TB_SCALARS.items():
            value = record.get(key)
            if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                value = max(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag, value, record["step"])

    def close(self) -> None:
        """Flush and close (also on a stop signal or divergence: the loop closes it in ``finally``)."""
        self.writer.close()


__all__ = ["Console", "duration", "TB_SCALARS", "TensorBoard", "check_tensorboard", "peak_memory_bytes", "rate_fields"]
