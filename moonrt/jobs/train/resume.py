"""Resuming a ``moonrt train`` job: which job-config fields a checkpoint pins, and the builder the checkpoint package
rebuilds this job's model and optimizer with.

- **Resume compatibility**: the job config stored in the checkpoint is compared with the new one; fields that change
  the training trajectory must match unless the user names them in ``--resume-allow-changes`` (:func:`check_resume`;
  :data:`FREE_ON_RESUME`, :data:`INERT_ON_RESUME`).
- **The builder** (:data:`BUILDER`, a :class:`moonrt.jobs.checkpoint.job.JobBuilder`): :mod:`moonrt.jobs.checkpoint`
  never imports this package, so the loads and reads that rebuild a model or optimizer from a recorded job config
  (a sharded checkpoint read as one file, the optimizer param groups a marker's own config builds, ``moonrt
  checkpoint convert`` / ``export``, an MXFP4 export loaded for evaluation) are handed this one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from moonrt.config import from_dict, to_dict
from moonrt.jobs.checkpoint.job import JobBuilder
from moonrt.jobs.checkpoint.single import CheckpointError
from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.optimizers import build_optimizer

# Dotted job-config paths that may change on resume without an explicit override: where the outputs go,
# how the work is laid out and stored (layout-independent checkpoints; grad_accum's micro-steps), how often eval and
# checkpoints happen, how the ranks join (dist: backend, timeout, rendezvous), the device (a different layout's
# numerics, like parallel), the compute precision (precision: a checkpoint holds the fp32 master weights and fp32
# moments whatever the run computed in, so fp32 <-> bf16 resumes the same state) and what the run reports (log:
# progress lines, TensorBoard, the peak for MFU); init_from_sha256 is compared with the directory itself
# (moonrt.jobs.checkpoint.hf.job_init), not with the job; deterministic changes how the kernels sum, not the state;
# data.cache_dir is where tokenized text is kept (the tokens are a function of the corpus and tokenizer fields).
FREE_ON_RESUME = ("out_dir", "threads", "parallel", "memory_policy", "routing_trace", "optim.eval_every",
                  "optim.eval_windows", "optim.checkpoint_every", "optim.grad_accum", "stop_signal", "gc_interval",
                  "dist", "device", "deterministic", "precision", "log", "kernels", "checkpoint",
                  "init_from_sha256", "data.cache_dir")


INERT_ON_RESUME = {"qat_block": ("qat", "none")}
"""Field -> (another field, value) under which it changes nothing: ``qat_block`` without QAT (a checkpoint that
recorded another default block resumes)."""


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _free(name: str, allowed: Iterable[str]) -> bool:
    return any(name == a or name.startswith(a + ".") for a in allowed)


def resume_fields(config: Mapping[str, Any]) -> list[str]:
    """Every dotted field of a job config that ``--resume-allow-changes`` can name."""
    return sorted(_flatten(config))


def check_resume(stored: Mapping[str, Any], new: Mapping[str, Any], step: int, allow: Iterable[str] = ()) -> None:
    """Refuse to resume a checkpoint of job config ``stored`` (at ``step``) as job config ``new``.

    A field that changes the trajectory (model, data, seed, batch, sequence length, optimizer
    hyper-parameters: everything except :data:`FREE_ON_RESUME`) must be equal unless ``allow`` names it
    (dotted, e.g. ``optim.lr``, or its last part, e.g. ``lr``). ``optim.steps`` may grow. Raises
    :class:`CheckpointError` naming every differing field with both values. A field the stored config lacks
    (a checkpoint written before the field existed) counts as its default value in :class:`JobConfig`.
    """
    defaults = _flatten(to_dict(JobConfig()))
    old_flat, new_flat = _flatten(stored), _flatten(new)
    old_flat = {**{k: v for k, v in defaults.items() if k not in old_flat and k in new_flat}, **old_flat}
    allow = list(allow)
    known = set(old_flat) | set(new_flat)
    resolved: list[str] = []
    for name in allow:
        matches = [k for k in known if k == name or k.endswith("." + name) or k.startswith(name + ".")]
        if not matches:
            raise CheckpointError(f"--resume-allow-changes: unknown field {name!r}; expected job config fields such "
                                  f"as optim.lr, optim.steps, model, data.corpus")
        resolved += matches
    diffs = []
    for key in sorted(known):
        a, b = old_flat.get(key, "<absent>"), new_flat.get(key, "<absent>")
        if a == b or _free(key, FREE_ON_RESUME) or key in resolved:
            continue
        if key in INERT_ON_RESUME:
            other, value = INERT_ON_RESUME[key]
            if old_flat.get(other, value) == value and new_flat.get(other, value) == value:
                continue
        if key == "optim.steps" and isinstance(a, int) and isinstance(b, int) and b >= a:
            continue
        diffs.append(f"{key}: checkpoint {a!r}, now {b!r}")
    if diffs:
        raise CheckpointError(f"--resume: the job differs from the checkpoint's (step {step}) in "
                              f"{'; '.join(diffs)}. Resume with the same settings, or name the fields in "
                              "--resume-allow-changes (e.g. --resume-allow-changes lr,steps)")


def _read(config: Mapping[str, Any]) -> JobConfig:
    return from_dict(JobConfig, dict(config))


def _optimizer(model: torch.nn.Module, job: JobConfig) -> torch.optim.Optimizer:
    return build_optimizer(model, job.optim)


BUILDER = JobBuilder(read=_read, model=build_model, optimizer=_optimizer)
"""``moonrt train``'s job config, model and optimizer, for :mod:`moonrt.jobs.checkpoint` (module docstring)."""


__all__ = ["BUILDER", "FREE_ON_RESUME", "INERT_ON_RESUME", "check_resume", "resume_fields"]
