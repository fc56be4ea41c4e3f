"""The configuration of a ``moonrt train`` job: data, optimizer and schedule, parallel layout, outputs.

Nested ``@dataclass(kw_only=True, slots=True)`` trees, loaded from YAML by :mod:`moonrt.config` (unknown
keys and bad values name the field, the value and the expectation). ``configs/k3_tiny.yaml`` writes
out the embedded default. :func:`lr_at` is the learning-rate schedule, a pure function of the step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Literal, get_args

from moonrt.config import ConfigError, DistConfig, ParallelConfig, check
from moonrt.jobs.train import data
from moonrt.models import DEFAULT_PRESET, presets
from moonrt.models.spec import MAX_PARAMS, ModelSpec  # noqa: F401 (MAX_PARAMS re-exported: the job's limit)

MAX_THREADS = 1024
"""Most torch intra-op threads per process (``threads``). A fixed bound, not one of this host's cores, so that a
config stays valid on every machine it moves to: 1024 is above the hardware threads of any one node (two 192-core
SMT sockets have 768), so no real setting is refused, while OpenMP pools of thousands of threads crash the process
(``--threads 5000`` ends in SIGSEGV in the first step)."""

MAX_SEED = 2**63 - 1
"""Largest ``optim.seed``: it seeds ``torch.manual_seed`` (which takes at most 2**64 - 1) and
``numpy.random.default_rng([seed, step])`` (any integer >= 0); int64's range, so it also fits every int64 that
records it."""

QAT_FORMATS = ("none", "mxfp4")
"""Values of :attr:`JobConfig.qat` (:data:`moonrt.ops.qat.QAT_FORMATS`; repeated here so the job config stays
torch-free)."""

TRAIN_TIERS = ("keep", "recompute", "fp8", "host", "disk")
"""The activation storage tiers ``moonrt train --memory-policy`` runs (:mod:`moonrt.memory`); ``remote`` is not among
them (it needs a peer rank serving each owner: :mod:`moonrt.memory.remote`, the ActivationManager API), and it is
what ``moonrt mem-plan`` plans by default (``--tiers``)."""

MAX_COUNT = 2**63 - 1
"""Largest step count or interval (int64: what a step counter in a checkpoint or tensor can hold)."""


def physical_memory_bytes() -> int | None:
    """This host's physical memory (``os.sysconf``), or None where the platform does not say."""
    try:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page if pages > 0 and page > 0 else None


def _finite(obj: Any, name: str, ok: bool, expected: str) -> None:
    """:func:`check` that field ``name`` of ``obj`` is a finite number and ``ok``."""
    value = getattr(obj, name)
    check(isinstance(value, (int, float)) and math.isfinite(value) and ok, name, value, f"a finite number {expected}")


@dataclasses.dataclass(kw_only=True, slots=True)
class BlendEntry:
    """One corpus of ``data.blend`` and its sampling weight (:mod:`moonrt.jobs.train.blend`)."""

    path: str
    """Read as ``data.corpus`` is (an indexed-dataset prefix, a token file with ``token_dtype``, a text file)."""
    weight: float = 1.0
    """Relative weight (> 0): the chance that a window comes from this corpus is weight / the weights' sum."""


@dataclasses.dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where tokens come from (:mod:`moonrt.jobs.train.data`)."""

    corpus: str | None = None
    """None: the stdlib sources (bytes); a path: a text file, or a token file when ``token_dtype`` is set."""
    token_dtype: data.TokenDtype | None = None
    heldout_fraction: float = 0.05
    """Fraction of a user corpus held out for eval (the stdlib corpus holds out every 16th file)."""
    pack_documents: bool = False
    """Tell the model where the documents in each window start (:func:`moonrt.jobs.train.data.packed_batch`): no token
    attends to, or carries KDA/conv state from, another document, and cross-document targets are not trained
    (:mod:`moonrt.parallel.packing`). The stdlib corpus's documents are its files; a user corpus needs ``eos_id``."""
    eos_id: int | None = None
    """Token id (a byte value for a text corpus) that ends each document of a user corpus (with ``pack_documents``)."""
    tokenizer: str | None = None
    """A Hugging Face ``tokenizer.json`` or a tiktoken BPE file (:mod:`moonrt.jobs.train.tokenizer`; read from disk
    only) whose vocabulary must be the model's: text corpora are tokenized with it once into an indexed dataset in
    ``cache_dir`` (:mod:`moonrt.jobs.train.tokenized`) instead of read as bytes. None: bytes."""
    cache_dir: str | None = None
    """Where text tokenized by ``tokenizer`` is cached (None: ``OUT/data_cache``); reused on resume, by every rank
    and by other runs naming the same directory."""
    blend: list[BlendEntry] | None = None
    """Corpora sampled by weight (``[{path, weight}, ...]``, :mod:`moonrt.jobs.train.blend`) instead of ``corpus``;
    the global batch stays a pure function of ``(seed, step)``."""

    def _has_documents(self, path: str) -> bool:
        """Whether corpus ``path`` carries document boundaries of its own (an indexed dataset; text tokenized into
        one)."""
        return (self.tokenizer is not None and self.token_dtype is None) or data.indexed_prefix(path) is not None

    def validate(self) -> None:
        _finite(self, "heldout_fraction", 0.0 < self.heldout_fraction < 1.0, "in (0, 1)")
        check(self.token_dtype is None or self.corpus is not None, "token_dtype", self.token_dtype,
              "null unless corpus names a token file")
        check(self.tokenizer is None or self.token_dtype is None, "data.tokenizer", self.tokenizer,
              "null with data.token_dtype (--token-dtype): a token file is tokenized already")
        user = self.corpus is not None or self.blend is not None
        check(self.eos_id is None or (user and self.pack_documents), "eos_id", self.eos_id,
              "null unless pack_documents is true and corpus names a file (the stdlib corpus's documents are files)")
        check(self.eos_id is None or self.eos_id >= 0, "eos_id", self.eos_id, "a token id >= 0")
        check(self.blend is None or self.corpus is None, "data.blend", self.blend,
              "null when data.corpus (--corpus) is set (a blend names its corpora)")
        check(self.blend is None or len(self.blend) >= 1, "data.blend", self.blend, "at least one {path, weight}")
        for i, e in enumerate(self.blend or ()):
            check(isinstance(e.weight, (int, float)) and math.isfinite(e.weight) and e.weight > 0,
                  f"data.blend[{i}].weight", e.weight, "a finite number > 0")
        for path in ([self.corpus] if self.corpus is not None else [e.path for e in self.blend or ()]):
            check(not self.pack_documents or self.eos_id is not None or self._has_documents(path), "eos_id",
                  self.eos_id, f"the token id that ends each document of corpus {path!r} (pack_documents needs "
                  "document boundaries: an indexed dataset or a --tokenizer has them)")


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
    grad_accum: int = 1
    """Micro-steps per optimizer step on each rank: the rank's rows of the global batch are split into this many
    equal micro-batches, each run forward and backward with gradients accumulated, then one gradient sum, clip and
    update (the same step as 1 up to fp32 summation order). Must divide the per-rank batch; not with ``--pp`` (the
    pipeline has its own micro-batches, ``parallel.microbatches``)."""
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
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "eval_every", "eval_windows", "checkpoint_every"):
            value = getattr(self, name)
            check(value >= 1, name, value, "an integer >= 1")
            check(value <= MAX_COUNT, name, value, f"an integer <= {MAX_COUNT} (int64)")
        check(0 <= self.warmup_steps <= MAX_COUNT, "warmup_steps", self.warmup_steps,
              f"an integer in [0, {MAX_COUNT}]")
        check(0 <= self.seed <= MAX_SEED, "seed", self.seed,
              f"an integer in [0, {MAX_SEED}] (2**63 - 1: torch.manual_seed and numpy's default_rng take it)")
        _finite(self, "lr", self.lr > 0, "> 0")
        _finite(self, "min_lr_ratio", 0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]")
        _finite(self, "weight_decay", self.weight_decay >= 0, ">= 0")
        _finite(self, "beta1", 0 <= self.beta1 < 1, "in [0, 1)")
        _finite(self, "beta2", 0 <= self.beta2 < 1, "in [0, 1)")
        _finite(self, "grad_clip", self.grad_clip > 0, "> 0 (max global grad norm)")
        _finite(self, "muon_momentum", 0 <= self.muon_momentum < 1, "in [0, 1)")
        check(self.batch_size % self.grad_accum == 0, "grad_accum", self.grad_accum,
              f"a divisor of batch_size {self.batch_size} (each rank splits its rows into grad_accum micro-batches)")
        # One step's global batch is built whole on every rank (data.global_batch): batch_size x (seq_len + 1) int64
        # tokens, the least a step allocates; an eval, eval_windows x (seq_len + 1). Refused here, before anything is
        # allocated, when that alone exceeds this host's physical memory.
        phys = physical_memory_bytes()
        for name, rows in (("batch_size", self.batch_size), ("eval_windows", self.eval_windows)):
            need = rows * (self.seq_len + 1) * 8
            what = "step" if name == "batch_size" else "eval"
            check(phys is None or need <= phys, name, rows,
                  f"{name} x (seq_len + 1) x 8 bytes (the int64 tokens of one {what}, {rows} x {self.seq_len + 1} x 8 "
                  f"= {need} bytes) <= this host's physical memory ({phys} bytes)")


@dataclasses.dataclass(kw_only=True, slots=True)
class LogConfig:
    """What a run reports besides its metrics file (:mod:`moonrt.jobs.train.report`); free to change on resume."""

    log_every: int = 10
    """Steps between the plain progress lines printed when the output is not a terminal (SLURM logs), instead of
    the tqdm bar; the eval lines and the summary always print (rank 0)."""
    tensorboard: str | None = None
    """Directory for TensorBoard scalar events (loss, lr, grad_norm, eval_loss, tokens_per_s, mfu), written by rank
    0; needs the ``tensorboard`` package (``pip install 'moonrt[tensorboard]'``). A fresh run creates it (it must
    not exist); a resume appends to it (events after the checkpoint's step are purged when read)."""
    peak_tflops: float | None = None
    """Peak dense throughput of one device (1e12 FLOP/s, e.g. 989 for an H100 in bf16): the metrics' ``mfu`` is
    the model FLOP rate over ``peak_tflops`` x the number of processes. None: no ``mfu`` (``model_tflops_per_s``
    is still recorded)."""

    profile_steps: str | None = None
    """``A:B`` (``--profile-steps``): a ``torch.profiler`` trace of steps ``A`` to ``B`` (1-based, inclusive; steps
    this process runs) written as Chrome trace JSON (``OUT/profile/trace-rank<r>-steps<A>-<B>.json``, what
    ``chrome://tracing``, Perfetto and TensorBoard's profiler plugin read) by the ranks of ``profile_ranks``; on CUDA
    also a memory snapshot of those steps (``memory-rank<r>-steps<A>-<B>.pickle``, for
    ``pytorch.org/memory_viz``). None: no profiler (:mod:`moonrt.jobs.train.profile`)."""
    profile_ranks: list[int] = dataclasses.field(default_factory=lambda: [0])
    """Global ranks that profile ``profile_steps`` (``--profile-ranks 0,3``)."""

    def validate(self) -> None:
        check(1 <= self.log_every <= MAX_COUNT, "log_every", self.log_every, f"an integer in [1, {MAX_COUNT}]")
        if self.profile_steps is not None:
            profile_range(self.profile_steps)
        check(isinstance(self.profile_ranks, list) and bool(self.profile_ranks)
              and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in self.profile_ranks),
              "profile_ranks", self.profile_ranks, "a non-empty list of ranks >= 0, e.g. [0] (--profile-ranks 0,3)")
        check(self.tensorboard is None or (isinstance(self.tensorboard, str) and self.tensorboard != ""),
              "tensorboard", self.tensorboard, "a directory path or null")
        if self.peak_tflops is not None:
            _finite(self, "peak_tflops", self.peak_tflops > 0, "> 0 (TFLOP/s of one device), or null")


def profile_range(text: str) -> tuple[int, int]:
    """The steps ``(A, B)`` of a ``log.profile_steps`` text ``A:B`` (1 <= A <= B); ConfigError naming the field."""
    parts = text.split(":") if isinstance(text, str) else []
    ok = len(parts) == 2 and all(p.strip().isdigit() for p in parts)
    a, b = (int(parts[0]), int(parts[1])) if ok else (0, 0)
    check(ok and 1 <= a <= b <= MAX_COUNT, "profile_steps", text,
          "A:B, the first and last step to profile (1 <= A <= B), e.g. 3:5 (--profile-steps)")
    return a, b


@dataclasses.dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Which sharded checkpoints a run keeps and how it writes them (:mod:`moonrt.jobs.checkpoint.sharded`,
    :mod:`moonrt.jobs.checkpoint.store`); free to change on resume. How often: ``optim.checkpoint_every``."""

    keep_latest: int = 2
    """Committed ``OUT/checkpoint/step-N`` directories kept (``--keep-latest``): after each commit the newest this
    many stay, older ones are removed, except milestones (``keep_every``). Only directories named ``step-N`` holding
    a marker moonrt wrote are ever removed. A single-process run's ``checkpoint.pt`` is one file, replaced."""
    keep_every: int = 0
    """Milestones (``--keep-every``): a committed step that is a multiple of this is never removed (0: none)."""
    async_save: bool = False
    """Sharded saves in the background (``--async-save``): each rank copies its state to host memory, the loop goes
    on while a thread writes it and commits the marker once every rank's write finished; at most one save in
    flight (the next save, a stop and the end of the run wait for it: ``ckpt_wait_s``). A crash or kill during the
    write leaves the previous committed step. Single-process runs (``checkpoint.pt``) save synchronously."""

    def validate(self) -> None:
        check(isinstance(self.keep_latest, int) and 1 <= self.keep_latest <= MAX_COUNT, "keep_latest",
              self.keep_latest, "an integer >= 1 (committed steps kept)")
        check(isinstance(self.keep_every, int) and 0 <= self.keep_every <= MAX_COUNT, "keep_every", self.keep_every,
              "an integer >= 0 (0: no milestones)")
        check(isinstance(self.async_save, bool), "async_save", self.async_save, "true or false")


@dataclasses.dataclass(kw_only=True, slots=True)
class PrecisionConfig:
    """Mixed precision (:class:`moonrt.comm.parallelism.Precision`: torch's native AMP).

    Parameters, master weights, gradients and optimizer moments are fp32 whatever ``compute`` is: the parameters
    are the master weights (held by the optimizer, by each ZeRO-1 shard for its range, and stored by checkpoints),
    gradients arrive in fp32 on them, so accumulation is fp32. ``compute: bf16`` runs every forward (and eval) under
    ``torch.autocast(<device type>, dtype=torch.bfloat16)`` with the numerics rule's fp32 islands (KDA states,
    AttnRes softmax, router logits and top-k, the loss, KCP summaries). ``reduce`` is the dtype the gradient sums
    over ranks are sent and summed in (:mod:`moonrt.comm.grad_reduce`). Both are free to change on resume (the
    checkpoint is the same fp32 state)."""

    compute: Literal["fp32", "bf16"] = "fp32"
    """Forward compute dtype (``--dtype``): ``fp32`` (no autocast) or ``bf16`` (autocast, fp32 master weights)."""
    reduce: Literal["fp32", "bf16"] = "fp32"
    """Gradient reduce dtype (``--reduce-dtype``; Megatron's ``--grad-reduce-in-bf16``): ``fp32`` (the fp32
    gradients summed as they are) or ``bf16`` (each gradient sum over ranks sends bf16 and sums in bf16 arithmetic,
    as NCCL does, then the result is written back into the fp32 gradient or ZeRO-1 shard: half the wire bytes, up
    to one bf16 rounding per input and per addition). One process: nothing is summed, no effect."""

    def validate(self) -> None:
        check(self.compute in ("fp32", "bf16"), "compute", self.compute, "one of 'fp32', 'bf16'")
        check(self.reduce in ("fp32", "bf16"), "reduce", self.reduce, "one of 'fp32', 'bf16'")


KernelChoice = Literal["auto", "torch", "numba", "triton"]
"""A ``kernels`` field: the backend of an op family (:data:`moonrt.ops.kernels.CHOICES`, tested equal)."""

KdaKernelChoice = Literal["auto", "torch", "numba", "triton", "fla"]
"""``kernels.kda``: :data:`KernelChoice` and ``fla`` (:func:`moonrt.ops.kernels.family_choices` of ``kda``, tested
equal)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class KernelsConfig:
    """Which kernel backend runs each op family (:mod:`moonrt.ops.kernels`): ``auto`` follows the tensors' device
    (CPU: numba where the op has one, else torch; CUDA: triton), ``torch`` / ``numba`` / ``triton`` force one (a
    backend that cannot run on the job's device fails at its first call, one line). Free to change on resume (every
    backend computes the same function; FP8's bit for bit)."""

    kda: KdaKernelChoice = "auto"
    """KDA: the chunked forward and backward (``kda_chunk``) and KCP's summaries (``kda_transition``,
    ``kda_state_grad``), through the attention context (:class:`moonrt.parallel.context.AttentionContext`). ``fla``:
    fla-core's ``chunk_kda`` (``pip install 'moonrt[fla]'``; CUDA; single-rank KDA only, ``parallel.cp = 1``: KCP's
    summaries have no fla form)."""
    fp8: KernelChoice = "auto"
    """The FP8 block codec of the activation manager's ``fp8`` tiers (``fp8_quantize``, ``fp8_dequantize``)."""
    moonep: KernelChoice = "auto"
    """MoonEP's greedy planner (``moonep_greedy``), run by every EP dispatcher on the routing counts' device: Triton
    on CUDA (no host synchronization before the one copy the transport needs), numba on CPU; every backend gives the
    same plan."""

    def validate(self) -> None:
        # (moonrt.ops.kernels.family_choices; this module stays torch-free)
        for name, choices in (("kda", get_args(KdaKernelChoice)), ("fp8", get_args(KernelChoice)),
                              ("moonep", get_args(KernelChoice))):
            value = getattr(self, name)
            check(value in choices, name, value, "one of " + ", ".join(repr(c) for c in choices))


@dataclasses.dataclass(kw_only=True, slots=True)
class JobConfig:
    """A whole training job (``moonrt train --config FILE``; every key optional)."""

    model: str = DEFAULT_PRESET
    """A preset name of any registered model family (:func:`moonrt.models.presets`); it selects the family whose
    :class:`~moonrt.models.spec.ModelSpec` reads ``model_config`` and ``moe``."""
    model_config: Any = None
    """A full config of the family of ``model``, overriding the preset: in YAML a mapping of the family's config
    fields (:attr:`ModelSpec.config_type`), read by :meth:`ModelSpec.config_from_dict` when the job is validated
    (then an instance of it, written back out whole by ``to_dict``). None: the preset's config."""
    moe: dict[str, Any] | None = None
    """The family's MoE options (K3: LatentMoE's Quantile Balancing estimator, ...), read by
    :meth:`ModelSpec.options_from_dict`; a family without options takes null."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Retention (latest k, milestones) and asynchronous saves of sharded checkpoints."""
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    """How the ranks join (backend, collective timeout, rendezvous address): wins over what the launcher passes in
    the environment; ``null`` fields take the launcher's values (:func:`moonrt.cluster.env.resolve_dist_config`).
    The run's ``config.yaml`` records the timeout and backend it used."""
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    """Forward compute dtype (``--dtype``) and gradient reduce dtype (``--reduce-dtype``); parameters, gradients and
    optimizer states stay fp32."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the job computes: ``cpu``; ``cuda`` (each rank on ``cuda:LOCAL_RANK``; refused where torch sees no CUDA
    device); ``auto``: cuda where CUDA is available, else cpu (:func:`moonrt.jobs.train.device.resolve_device`). The
    run's ``config.yaml`` and start line record the device it used."""
    deterministic: bool = False
    """``--deterministic``: run with ``torch.use_deterministic_algorithms(True)`` and cuBLAS's fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG=:4096:8``, :func:`moonrt.jobs.train.device.use_deterministic`). On a GPU a
    ``--resume`` is bit-identical to the uninterrupted run only with it (atomics in CUDA kernels sum in a varying
    order; an op without a deterministic CUDA kernel then fails naming itself); on the CPU a resume is bit-identical
    either way. Free to change on resume (it changes how, not what, the step computes)."""
    kernels: KernelsConfig = dataclasses.field(default_factory=KernelsConfig)
    """Kernel backend per op family (``kernels: {kda: auto, fp8: auto}``; ``--set kernels.kda=torch``); the run's
    ``config.yaml`` records the choice."""
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

    init_from: str | None = None
    """A Kimi K3 Hugging Face directory in the released layout (``--init-from``; :mod:`moonrt.jobs.checkpoint.hf`)
    whose weights the model starts from (a fresh run; ``--resume`` continues from its checkpoint instead). Its
    ``config.json`` is the model config when ``model_config`` is null (the job's ``model`` must be a K3 preset);
    a ``model_config`` given must equal it."""
    init_from_sha256: dict[str, str] | None = None
    """The identity of the ``init_from`` directory, recorded by the run that started from it (null: filled in then):
    the SHA-256 of its ``config.json`` and of its index (:func:`moonrt.jobs.checkpoint.hf.identity`). A resume
    needs no directory (the checkpoint holds the weights and ``model_config``); one that is still there must have
    this identity (a changed file is named)."""

    qat: str = "none"
    """Quantization-aware training (``--qat``): ``none``, or ``mxfp4``: the layers the model family declares
    (:attr:`ModelSpec.qat_weights`; K3: routed and shared experts) compute with MXFP4 (E2M1, E8M0 ``floor`` scales)
    fake-quantized weights and MXFP8 (E4M3) fake-quantized inputs, straight-through gradients to the fp32 master
    weights (:mod:`moonrt.ops.qat`)."""
    qat_block: int | None = None
    """Elements per MX scale along each quantized GEMM's reduction axis (``--qat-block``). Must divide every quantized
    reduction axis. None: the model preset's block (:attr:`ModelSpec.qat_block`: ``k3`` the OCP spec's 32,
    ``k3_tiny`` 8, the largest even divisor of its widths 56, 64, 128), filled in by :meth:`validate` (the run's
    config.yaml records the number)."""

    def validate(self) -> None:
        table = presets()
        check(self.model in table, "model", self.model, "a registered model preset: one of " + ", ".join(table))
        spec = table[self.model]
        if self.model_config is not None and not isinstance(self.model_config, spec.config_type):
            check(isinstance(self.model_config, dict), "model_config", self.model_config,
                  f"a mapping of {spec.config_type.__name__} fields (model {self.model!r} is of family {spec.name!r})")
            try:
                self.model_config = spec.config_from_dict(self.model_config)
            except ConfigError as exc:
                raise ConfigError(f"model_config.{exc}") from None
        sums = self.init_from_sha256
        check(sums is None or (self.init_from is not None and all(
            isinstance(v, str) and len(v) == 64 for v in sums.values())), "init_from_sha256", sums,
            "null, or with init_from the SHA-256 hex digests a run started from it recorded")
        from moonrt.cluster.preempt import signal_from_name

        try:
            signal_from_name(self.stop_signal, "stop_signal")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check(self.device in ("auto", "cpu", "cuda"), "device", self.device, "one of 'auto', 'cpu', 'cuda'")
        check(isinstance(self.deterministic, bool), "deterministic", self.deterministic, "true or false")
        check(not (self.device == "cpu" and self.dist.backend == "nccl"), "dist.backend", self.dist.backend,
              "'gloo' or 'auto' with device 'cpu' (nccl reduces CUDA tensors only)")
        check(self.kernels.kda != "fla" or self.parallel.cp == 1, "kernels.kda", self.kernels.kda,
              f"one of 'auto', 'torch', 'numba', 'triton' with parallel.cp = {self.parallel.cp} (--cp): KCP's segment "
              "summaries (kda_transition, kda_state_grad) have no fla form")
        check(0 <= self.threads <= MAX_THREADS, "threads", self.threads,
              f"an integer in [0, {MAX_THREADS}] (0 = torch default; MAX_THREADS)")
        check(0 <= self.gc_interval <= MAX_COUNT, "gc_interval", self.gc_interval,
              "an integer >= 0 (0 = automatic collection)")
        if self.data.eos_id is not None:
            vocab = self.model_cfg().vocab_size
            check(self.data.eos_id < vocab, "data.eos_id", self.data.eos_id, f"a token id < the model's vocab_size "
                  f"({vocab})")
        if self.optim.grad_accum > 1:
            check(self.parallel.pp == 1, "optim.grad_accum", self.optim.grad_accum,
                  f"1 with parallel.pp = {self.parallel.pp} (--pp): the pipeline splits each step into its own "
                  "micro-batches (parallel.microbatches, --microbatches)")
            check(self.routing_trace is None, "optim.grad_accum", self.optim.grad_accum,
                  "1 with routing_trace (--routing-trace): a trace records one forward's routing per step")
        if self.data.pack_documents:  # document boundaries reach the model only on the default (non-part) path
            for name, why in (("cp", "KCP and the MLA all-gather carry no document boundaries"),
                              ("pp", "pipeline stages carry no document boundaries")):
                degree = getattr(self.parallel, name)
                check(degree == 1, "data.pack_documents", True,
                      f"false with parallel.{name} = {degree} (--{name}): {why}")
        self._validate_qat(spec)
        try:
            spec.options_from_dict(self.moe)
        except ConfigError as exc:
            raise ConfigError(str(exc) if str(exc).startswith("moe = ") else f"moe.{exc}") from None

    def _validate_qat(self, spec: ModelSpec) -> None:
        check(self.qat in QAT_FORMATS, "qat", self.qat, "one of " + ", ".join(QAT_FORMATS))
        if self.qat_block is None:
            self.qat_block = spec.default_qat_block(self.model)
        check(self.qat == "none" or spec.qat_weights is not None, "qat", self.qat,
              f"'none' for model {self.model!r}: its family {spec.name!r} declares no quantizable layers")
        problem = spec.qat_block_problem(None if self.qat == "none" else self.model_cfg(), self.qat_block,
                                         flag="--qat-block")
        check(problem is None, "qat_block", self.qat_block, problem or "")

    def fit_world(self, world: int) -> None:
        """The degrees against a job of ``world`` ranks, before any rank imports torch or joins the others (every rank
        fails alike, none waits): at most one CP slice per token of a sequence, and ``dp`` inferred to fill the world
        (:meth:`ParallelConfig.fit_world`). ConfigError naming the field."""
        if self.parallel.cp > self.optim.seq_len:
            raise ConfigError(f"parallel.cp (--cp) = {self.parallel.cp}: expected at most optim.seq_len (--seq-len) = "
                              f"{self.optim.seq_len} (each CP rank holds a slice of every sequence, uneven slices "
                              "allowed)")
        self.parallel.fit_world(world)

    def model_spec(self) -> ModelSpec:
        """The :class:`~moonrt.models.spec.ModelSpec` of ``model``'s family (ConfigError naming the presets)."""
        table = presets()
        check(self.model in table, "model", self.model, "a registered model preset: one of " + ", ".join(table))
        return table[self.model]

    def model_cfg(self) -> Any:
        """The model's config: ``model_config`` read by the family's spec, else the preset's."""
        spec = self.model_spec()
        if self.model_config is None:
            return spec.presets[self.model]()
        if isinstance(self.model_config, dict):
            return spec.config_from_dict(self.model_config)
        return self.model_config


@dataclasses.dataclass(frozen=True, slots=True)
class TrainStateBytes:
    """Persistent bytes per parameter of a training job's state (one replica, before ZeRO-1 sharding)."""

    param: int
    """The parameter itself: fp32, and it is the master weight (no separate master copy)."""
    grad: int
    """Its gradient (fp32: autograd casts each gradient to its parameter's dtype)."""
    optim: int
    """The optimizer's state for it (fp32 moments)."""

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optim


OPTIM_MOMENT_BYTES = {"adamw": 2 * 4, "muon": 4}
"""Optimizer state bytes per parameter: AdamW's two fp32 moments (``exp_avg``, ``exp_avg_sq``), Muon's one fp32
momentum (``moonrt.ops.muon``; the few non-matrix parameters it leaves to AdamW, embedding, norms, router, LM head,
are counted at Muon's 4 bytes)."""


def train_state_bytes(compute: str, optimizer: str) -> TrainStateBytes:
    """Bytes per parameter that a ``moonrt train`` job with ``precision.compute = compute`` and ``optim.optimizer =
    optimizer`` keeps between steps: the one definition ``moonrt train`` holds (tested against a step's live tensors)
    and ``moonrt mem-plan`` plans with.

    The layout is torch AMP's (:class:`PrecisionConfig`), the same for ``fp32`` and ``bf16``: fp32 parameters (the
    master weights), fp32 gradients, fp32 optimizer moments: 16 bytes for AdamW, 12 for Muon. Megatron's bf16 layout
    (bf16 parameters, fp32 gradients, an fp32 main copy and moments: 18 for AdamW) is not what moonrt trains. The
    bf16 weight copies autocast makes for its matmuls are transient: made in a layer's forward, held by autograd
    until that layer's backward, freed after; they are activations of the step, not train state."""
    check(compute in ("fp32", "bf16"), "precision.compute", compute, "one of 'fp32', 'bf16'")
    check(optimizer in OPTIM_MOMENT_BYTES, "optim.optimizer", optimizer, "one of " + ", ".join(OPTIM_MOMENT_BYTES))
    return TrainStateBytes(param=4, grad=4, optim=OPTIM_MOMENT_BYTES[optimizer])


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup, then cosine to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps - 1)
    t = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
