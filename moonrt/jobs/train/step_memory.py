"""One training step's memory, estimated before step 1 and checked against what this rank can use (``moonrt
train``): a batch that cannot fit is refused in one line instead of dying in the allocator minutes later.

- **Estimate** (:func:`step_memory`): the train state (parameters, gradients, optimizer moments:
  :func:`moonrt.jobs.train.config.train_state_bytes` per parameter, this rank's share) plus the peak of the
  activations one step saves for backward, from the model family's memory description, the model ``moonrt
  mem-plan`` plans with (:attr:`moonrt.models.spec.ModelSpec.memory`: the analytic profile,
  :func:`moonrt.memory.model_memory.rank_models` and :func:`~moonrt.memory.model_memory.activation_bytes` at this
  job's layout, every class kept), plus the step's int64 token batch. Not counted: the interpreter and libraries
  (a few hundred MiB on CPU) and transient buffers, so it is a lower bound of the step's peak, within a factor 2 of
  the measured growth of the peak with the batch (``tests/jobs/test_train_outputs_hardening3.py``): it refuses what
  cannot fit, never a batch that fits. A family without a memory description: the train state and tokens only.
- **Limit** (:func:`usable_memory`): on ``cuda`` the device's free memory (``torch.cuda.mem_get_info``); on ``cpu``
  the host's ``MemAvailable`` and the cgroup's limit less its usage (a container, a SLURM job), the smaller,
  shared by the ranks on this host (the launcher's ``LOCAL_WORLD_SIZE``). Unknown: no check.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch

from moonrt.config import ConfigError, ParallelConfig
from moonrt.jobs.train.config import JobConfig, train_state_bytes
from moonrt.memory.model_memory import GIB, JobLayout, activation_bytes, rank_models


@dataclasses.dataclass(frozen=True, slots=True)
class StepMemory:
    """Estimated bytes of one step on the busiest rank: ``state`` (parameters, gradients, optimizer), ``activations``
    (saved for backward, peak over the schedule), ``tokens`` (the step's int64 batch); ``rows`` sequences of
    ``tokens_per_row`` tokens per micro-step on a rank."""

    state: float
    activations: float
    tokens: float
    rows: int
    tokens_per_row: int

    @property
    def total(self) -> float:
        return self.state + self.activations + self.tokens


def _rank_peaks(job: JobConfig, par: ParallelConfig, rows: int, seq_len: int) -> list[tuple[float, float]]:
    """``(state, activations)`` bytes of every pipeline rank at layout ``par`` (ValueError: a layout the memory
    model does not plan)."""
    spec, cfg = job.model_spec(), job.model_cfg()
    state = train_state_bytes(job.precision.compute, job.optim.optimizer)
    layout = JobLayout(parallel=par, micro_batch_size=rows, seq_len=seq_len,
                       act_bytes=4 if job.precision.compute == "fp32" else 2, param_bytes=state.param,
                       grad_bytes=state.grad, optim_bytes=state.optim, dp_bucket_mib=0.0)
    memory = spec.memory_description()
    profile = memory.memory_profile(cfg, layout)
    out = []
    for rm in rank_models(cfg, layout, memory.param_sizes(cfg), profile):
        static = dict(rm.static)
        if not par.zero:  # rank_models shards the moments ZeRO-1 style; moonrt train without --zero replicates them
            static["optimizer"] = state.optim * static["params"] / state.param
        out.append((sum(static.values()), activation_bytes(rm, profile, {}, layout.tokens())[0]))
    return out


def step_memory(job: JobConfig, dp_size: int) -> StepMemory:
    """The estimate of one step of ``job`` on its busiest rank, ``dp_size`` ranks sharing the batch rows (see the
    module docstring). The job's own layout where the memory model plans it (schedules 1f1b, interleaved, gpipe;
    sequences a multiple of ``cp``), else the same rows and tokens per rank on one pipeline stage."""
    o, p = job.optim, job.parallel
    rows = max(1, o.batch_size // dp_size // o.grad_accum // p.microbatches)
    tokens = (o.batch_size + o.eval_windows) * (o.seq_len + 1) * 8
    if job.model_spec().memory is None:
        n = job.model_spec().param_count(job.model_cfg())
        return StepMemory(n * train_state_bytes(job.precision.compute, job.optim.optimizer).total, 0.0, tokens, rows,
                          o.seq_len)
    # the job's layout; else (e.g. zb / zbv, uneven CP slices) one stage with this rank's tokens; else also one EP rank
    per_rank = math.ceil(o.seq_len / p.cp)
    layouts = ((p, o.seq_len), (ParallelConfig(dp=p.dp, ep=p.ep, zero=p.zero), per_rank),
               (ParallelConfig(dp=p.dp, zero=p.zero), per_rank))
    for par, seq_len in layouts:
        try:
            peaks = _rank_peaks(job, par, rows, seq_len)
            break
        except ValueError:
            continue
    else:
        raise ConfigError(f"parallel = {p}: the memory model of model family {job.model_spec().name!r} plans no "
                          "layout of this job")
    state, act = max(peaks, key=sum)
    return StepMemory(state, act, tokens, rows, math.ceil(o.seq_len / p.cp))


def _cgroup_room() -> tuple[int | None, str]:
    """This process's cgroup memory limit less its usage (v2, else v1), or None without a limit."""
    for limit, usage in (("memory.max", "memory.current"), ("memory.limit_in_bytes", "memory.usage_in_bytes")):
        for root in _cgroup_dirs():
            try:
                text = (root / limit).read_text().strip()
                if text == "max" or int(text) >= 1 << 60:
                    continue
                return max(0, int(text) - int((root / usage).read_text())), f"cgroup limit {root / limit}"
            except (OSError, ValueError):
                continue
    return None, ""


def _cgroup_dirs() -> list[Path]:
    dirs = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and (parts[1] == "" or "memory" in parts[1].split(",")):
                dirs += [Path("/sys/fs/cgroup") / parts[2].lstrip("/"),
                         Path("/sys/fs/cgroup/memory") / parts[2].lstrip("/")]
    except OSError:
        pass
    return dirs


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_memory(device: torch.device) -> tuple[int | None, str]:
    """Bytes this rank can use for a step and where that number comes from (None: unknown, no check)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device}"
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    found = [(n, src) for n, src in ((_mem_available(), "MemAvailable of this host"), _cgroup_room()) if n is not None]
    if not found:
        return None, ""
    n, src = min(found)
    return n // ranks, src + (f", shared by {ranks} ranks on this host" if ranks > 1 else "")


def check_step_memory(job: JobConfig, dp_size: int, device: torch.device) -> StepMemory:
    """:class:`ConfigError` (one line, before step 1) when :func:`step_memory` exceeds :func:`usable_memory`, naming
    the batch size, the sequence length, the estimate and the limit; else the estimate."""
    est = step_memory(job, dp_size)
    limit, source = usable_memory(device)
    if limit is not None and est.total > limit:
        o = job.optim
        raise ConfigError(
            f"optim.batch_size (--batch-size) = {o.batch_size}, optim.seq_len (--seq-len) = {o.seq_len}: one step "
            f"needs an estimated {est.total / GIB:.2f} GiB on a rank (train state {est.state / GIB:.2f} + activations "
            f"{est.activations / GIB:.2f} of {est.rows} x {est.tokens_per_row} tokens per micro-step, mem-plan's model "
            f"+ tokens {est.tokens / GIB:.2f}), more than the {limit / GIB:.2f} GiB it can use ({source}); expected a "
            "smaller --batch-size or --seq-len, --grad-accum, or more ranks")
    return est


__all__ = ["StepMemory", "check_step_memory", "step_memory", "usable_memory"]
