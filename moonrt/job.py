"""The configuration of a ``moonrt train`` job: data, optimizer and schedule, parallel layout, outputs.

Nested ``@dataclass(kw_only=True, slots=True)`` trees, loaded from YAML by :mod:`moonrt.config` (unknown
keys and bad values name the field, the value and the expectation). ``configs/k3_tiny.yaml`` writes
out the embedded default. :func:`lr_at` is the learning-rate schedule, a pure function of the step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from moonrt import data
from moonrt.config import ConfigError, ParallelConfig, check
from moonrt.model.config import PRESETS, K3Config

MAX_PARAMS = 5_000_000_000
"""Largest model (parameters, from the config) that ``moonrt train`` will instantiate."""


@dataclasses.dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where tokens come from (:mod:`moonrt.data`)."""

    corpus: str | None = None
    """None: the stdlib sources (bytes); a path: a text file, or a token file when ``token_dtype`` is set."""
    token_dtype: data.TokenDtype | None = None
    heldout_fraction: float = 0.05
    """Fraction of a user corpus held out for eval (the stdlib corpus holds out every 16th file)."""
    pack_documents: bool = False
    """Tell the model where the documents in each window start (:func:`moonrt.data.packed_batch`): no token
    attends to, or carries KDA/conv state from, another document, and cross-document targets are not trained
    (:mod:`moonrt.model.packing`). The stdlib corpus's documents are its files; a user corpus needs ``eos_id``."""
    eos_id: int | None = None
    """Token id (a byte value for a text corpus) that ends each document of a user corpus (with ``pack_documents``)."""

    def validate(self) -> None:
        check(0.0 < self.heldout_fraction < 1.0, "heldout_fraction", self.heldout_fraction, "a number in (0, 1)")
        check(self.token_dtype is None or self.corpus is not None, "token_dtype", self.token_dtype,
              "null unless corpus names a token file")
        check(self.eos_id is None or (self.corpus is not None and self.pack_documents), "eos_id", self.eos_id,
              "null unless pack_documents is true and corpus names a file (the stdlib corpus's documents are files)")
        check(self.eos_id is None or self.eos_id >= 0, "eos_id", self.eos_id, "a token id >= 0")
        check(not self.pack_documents or self.corpus is None or self.eos_id is not None, "eos_id", self.eos_id,
              "the token id that ends each document of corpus "
              f"{self.corpus!r} (pack_documents needs document boundaries)")


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizer, schedule and step knobs."""

    steps: int = 200
    batch_size: int = 8
    """Sequences per global batch (per optimizer step), whatever the parallel layout."""
    seq_len: int = 128
    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    """Cosine decays to ``lr * min_lr_ratio`` at the last step."""
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    eval_every: int = 50
    eval_windows: int = 32
    """Held-out windows of ``seq_len`` tokens per eval (the same windows every time)."""
    checkpoint_every: int = 100
    routing_bias_update: bool = True
    """Quantile Balancing update of every MoE layer's router bias after each step (K3_SYSTEMS §5.3)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """``muon``: Per-Head Muon (``moonrt.ops.muon``) for the model's matrices (``moonrt.parallel.blocks``),
    AdamW for everything else; both use ``lr``, ``weight_decay`` and the schedule (``muon_adjust_lr``)."""
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """Muon's update scale per block: ``match_rms_adamw`` (Moonlight: 0.2 * sqrt(max(a, b)), an update RMS of 0.2
    like AdamW's, so AdamW's lr and weight decay carry over) or ``original`` (Keller Jordan's; needs its own lr)."""
    muon_ns_dtype: Literal["float32", "bfloat16"] = "float32"
    """Newton-Schulz precision (torch.optim.Muon uses bfloat16; fp32 is the exact choice on CPU)."""
    muon_per_head: bool = True
    """Orthogonalize the declared heads separately (K3); False: whole matrices (experts stay per expert)."""
    muon_adamw_modules: list[str] = dataclasses.field(default_factory=lambda: ["lm_head"])
    """Modules (dotted-name prefixes) whose matrices AdamW updates under ``optimizer: muon`` (the LM head)."""

    def validate(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_windows", "checkpoint_every"):
            value = getattr(self, name)
            check(value >= 1, name, value, "an integer >= 1")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "an integer >= 0")
        check(self.lr > 0, "lr", self.lr, "a positive number")
        check(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        check(0 <= self.beta1 < 1, "beta1", self.beta1, "a number in [0, 1)")
        check(0 <= self.beta2 < 1, "beta2", self.beta2, "a number in [0, 1)")
        check(self.grad_clip > 0, "grad_clip", self.grad_clip, "a positive number (max global grad norm)")
        check(0 <= self.muon_momentum < 1, "muon_momentum", self.muon_momentum, "a number in [0, 1)")


@dataclasses.dataclass(kw_only=True, slots=True)
class JobConfig:
    """A whole training job (``moonrt train --config FILE``; every key optional)."""

    model: str = "k3_tiny"
    """A preset name of :data:`moonrt.model.config.PRESETS` (ignored when ``model_config`` is given)."""
    model_config: K3Config | None = None
    """A full model config; overrides ``model``."""
    moe: dict[str, Any] | None = None
    """LatentMoE options (Quantile Balancing estimator, ...), the fields of the MoE config class."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    memory_policy: str | None = None
    """Path of an activation-memory policy YAML (applied by the activation manager when present)."""
    out_dir: str = "runs/train"
    """Checkpoints (``checkpoint.pt``) and the resolved ``config.yaml`` go here."""
    routing_trace: str | None = None
    """Record every step's per-MoE-layer ``[R, E]`` routing counts into this ``.npz`` (the trace format
    ``moonrt ep-sim --trace`` reads, :mod:`moonrt.scheduler.workload`)."""
    threads: int = 1
    """torch intra-op threads per process (0: torch's default). One is the robust choice on a shared
    2-core machine (spinning OpenMP threads of several processes slow everyone down many-fold)."""
    stop_signal: str = "SIGTERM"
    """Signal (besides SIGTERM and SIGINT) on which every rank finishes its step, checkpoints and exits with
    :data:`moonrt.cluster.preempt.PREEMPTED_EXIT` (``--signal USR1`` for ``#SBATCH --signal=B:USR1@...``)."""
    gc_interval: int = 50
    """Python's automatic garbage collection is off in the training loop and a young-generation collection
    (``gc.collect(1)``) runs every this many steps instead, as torchtitan's ``gc_freq`` and Megatron's
    ``--manual-gc`` do: a full collection scans every live Python object (~370k for k3_tiny) and the saved-tensor
    records of an activation-manager step trigger one every few steps (benchmarks/RESULTS.md). 0: automatic."""

    def validate(self) -> None:
        check(self.model in PRESETS, "model", self.model, "one of " + ", ".join(sorted(PRESETS)))
        from moonrt.cluster.preempt import signal_from_name

        try:
            signal_from_name(self.stop_signal, "stop_signal")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check(self.threads >= 0, "threads", self.threads, "an integer >= 0 (0 = torch default)")
        check(self.gc_interval >= 0, "gc_interval", self.gc_interval, "an integer >= 0 (0 = automatic collection)")
        if self.data.pack_documents:  # document boundaries reach the model only on the default (non-part) path
            for name, why in (("cp", "KCP and the MLA all-gather carry no document boundaries"),
                              ("pp", "pipeline stages carry no document boundaries")):
                degree = getattr(self.parallel, name)
                check(degree == 1, "data.pack_documents", True,
                      f"false with parallel.{name} = {degree} (--{name}): {why}")
        from moonrt.model.moe import moe_config_from_dict

        try:
            moe_config_from_dict(self.moe)
        except ConfigError as exc:
            raise ConfigError(f"moe.{exc}") from None

    def model_cfg(self) -> K3Config:
        return self.model_config if self.model_config is not None else PRESETS[self.model]()


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
