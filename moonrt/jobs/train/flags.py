"""The ``moonrt train`` flags, generated from the job config: one spelling per knob (issue 46 item 5).

Every knob of a job is a field of the :class:`~moonrt.jobs.train.config.JobConfig` tree, and its one general
spelling on the command line is ``--set section.field=VALUE`` (:mod:`moonrt.jobs.train.overrides`). The dedicated
flags are short aliases of the common fields, each listed once in :data:`ALIASES` (flag, field path, a help phrase);
:func:`add_arguments` takes each alias's type, accepted values, default, ``--help`` section and ``dest`` from the
field itself. The few flags that are no config field (the config file and ``--set``, resume and run control) are
the second table, :data:`RUN_FLAGS`. The parser holds the flags of these two tables and nothing else:
``tests/jobs/test_train_flags.py`` compares the two, so a flag added by hand fails it.

argparse keeps an alias's text; :func:`flag_values` reads it as its field's type (an integer, a number,
comma-separated integers) and the schema checks the value (ranges, the accepted words of a ``Literal`` field), the
same checks as for ``--config`` and ``--set``: a bad value is one :class:`~moonrt.config.ConfigError` line naming the
field and the flag (``optim.steps (--steps) = 'abc': expected an integer``, ``parallel.schedule (--schedule) =
'zigzag': expected one of ...``), exit 2.

``--help`` lists one section per config section (its class's summary and the fields reachable only by ``--set``),
and imports no torch: this module reads the dataclasses and the lazy model registry only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from moonrt.cluster.preempt import PREEMPTED_EXIT
from moonrt.config import ConfigError, show
from moonrt.jobs.train.config import JobConfig
from moonrt.jobs.train.overrides import SET_HELP
from moonrt.models import presets


@dataclasses.dataclass(frozen=True, slots=True)
class Alias:
    """A short flag for one job config field: ``--ep`` sets ``parallel.ep``. Type, default and section come from the
    field; ``values`` lists the accepted words in ``--help`` where the field's type does not (``model``)."""

    flag: str
    field: str
    help: str
    metavar: str | None = None
    values: Callable[[], Iterable[str]] | None = None

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.field.split("."))

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


ALIASES: tuple[Alias, ...] = (
    # top-level JobConfig fields
    Alias("--model", "model", "model preset", values=lambda: sorted(presets())),
    Alias("--out", "out_dir", "output dir for checkpoints and config.yaml; one run at a time (OUT/.moonrt.lock)"),
    Alias("--init-from", "init_from", "start from the weights of a Kimi K3 Hugging Face directory in the released "
          "layout (config.json, safetensors shards and model.safetensors.index.json; packed MXFP4 experts decoded); "
          "its config.json gives the model config unless the job sets model_config; a resume needs no directory, one "
          "still there must be unchanged (init_from_sha256)", metavar="HF_DIR"),
    Alias("--device", "device", "where the job computes: auto = cuda where CUDA is available, else cpu; each rank on "
          "cuda:LOCAL_RANK"),
    Alias("--deterministic", "deterministic", "deterministic kernels (torch.use_deterministic_algorithms, cuBLAS's "
          "fixed workspace): on a GPU, --resume is bit-identical only with it; on the CPU always"),
    Alias("--threads", "threads", "torch threads per process; 0: torch's own count", metavar="N"),
    Alias("--gc-interval", "gc_interval", "Python garbage collection: off in the training loop, one young-generation "
          "collection every N steps; 0 = automatic", metavar="N"),
    Alias("--memory-policy", "memory_policy", "activation memory policy YAML (moonrt.memory)", metavar="YAML"),
    Alias("--routing-trace", "routing_trace", "write per-step, per-layer [R, E] routing counts to this .npz (read by "
          "moonrt ep-sim --trace)", metavar="NPZ"),
    Alias("--signal", "stop_signal", "stop signal besides SIGTERM and SIGINT, e.g. USR1: every rank finishes its step, "
          f"checkpoints and exits with {PREEMPTED_EXIT}", metavar="NAME"),
    Alias("--qat", "qat", "quantization-aware training: none or mxfp4 (MXFP4 weights, MXFP8 inputs of the model's "
          "quantizable layers, K3: the experts; straight-through gradients)", metavar="{none,mxfp4}"),
    Alias("--qat-block", "qat_block", "elements per MX scale along the reduction axis, must divide it (default: the "
          "model preset's, k3: 32, the OCP MX block; k3_tiny: 8, as its expert width 56 takes)", metavar="N"),
    # data
    Alias("--corpus", "data.corpus", "text file, token file with --token-dtype, or a Megatron indexed dataset PREFIX "
          "(PREFIX.bin/.idx) (default: stdlib sources; several by weight: --set data.blend=...)", metavar="PATH"),
    Alias("--tokenizer", "data.tokenizer", "the model's tokenizer: a Hugging Face tokenizer.json or a tiktoken BPE "
          "file, read from disk (never downloaded); its vocabulary must be the model's; a text --corpus is tokenized "
          "once into an indexed dataset in data.cache_dir (default OUT/data_cache) (needs moonrt[data])",
          metavar="PATH"),
    Alias("--token-dtype", "data.token_dtype", "--corpus is a binary token file of this dtype"),
    Alias("--pack-documents", "data.pack_documents", "keep the documents packed in each sequence apart: per-document "
          "KDA state and conv, block-diagonal MLA mask, no cross-document targets (not with --cp or --pp)"),
    Alias("--eos-id", "data.eos_id", "token id (byte value for a text --corpus) that ends each document, for "
          "--pack-documents with --corpus", metavar="ID"),
    # optim
    Alias("--steps", "optim.steps", "optimizer steps", metavar="N"),
    Alias("--seed", "optim.seed", "data order and init seed", metavar="N"),
    Alias("--batch-size", "optim.batch_size", "sequences per global batch", metavar="N"),
    Alias("--seq-len", "optim.seq_len", "tokens per sequence", metavar="N"),
    Alias("--lr", "optim.lr", "peak learning rate", metavar="LR"),
    Alias("--optimizer", "optim.optimizer", "adamw, or muon: Per-Head Muon for the model's matrices and AdamW for the "
          "rest, same lr"),
    Alias("--grad-accum", "optim.grad_accum", "micro-steps per optimizer step on each rank: gradients accumulated, one "
          "sync/clip/update per step (not with --pp)", metavar="N"),
    Alias("--eval-every", "optim.eval_every", "eval interval in steps", metavar="N"),
    Alias("--eval-windows", "optim.eval_windows", "held-out windows of seq_len tokens per eval, the same every time",
          metavar="N"),
    Alias("--checkpoint-every", "optim.checkpoint_every", "steps between checkpoints; the last step, --until's and a "
          "stop signal's are saved too", metavar="N"),
    # parallel
    Alias("--ep", "parallel.ep", "expert-parallel degree: MoonEP over EP ranks, E/EP home experts per rank",
          metavar="N"),
    Alias("--cp", "parallel.cp", "context-parallel degree: each sequence split over CP ranks, KCP for KDA, latent "
          "all-gather for MLA", metavar="N"),
    Alias("--pp", "parallel.pp", "pipeline-parallel degree: the decoder layers cut into contiguous stages over PP "
          "ranks", metavar="N"),
    Alias("--vpp", "parallel.vpp", "virtual pipeline stages per PP rank (interleaved)", metavar="N"),
    Alias("--microbatches", "parallel.microbatches", "micro-batches per step of each pipeline", metavar="N"),
    Alias("--schedule", "parallel.schedule", "pipeline schedule"),
    Alias("--zero", "parallel.zero", "ZeRO stage: 0 (replicated AdamW states) or 1 (states and reduced gradients "
          "sharded over each parameter's data-parallel replicas)", metavar="{0,1}"),
    Alias("--attn-res-comm", "parallel.attn_res_comm", "AttnRes blocks between PP ranks: cached (only blocks the "
          "receiver lacks) or naive (every completed block)"),
    # log
    Alias("--log-every", "log.log_every", "steps between plain progress lines when the output is not a terminal, "
          "e.g. SLURM logs", metavar="N"),
    Alias("--tensorboard", "log.tensorboard", "write TensorBoard scalars (loss, lr, grad_norm, eval_loss, "
          "tokens_per_s, mfu) to this dir; a fresh run needs it absent or empty (needs tensorboard)", metavar="DIR"),
    Alias("--peak-tflops", "log.peak_tflops", "one device's peak TFLOP/s: metrics record mfu (without it only "
          "model_tflops_per_s)", metavar="TFLOPS"),
    Alias("--profile-steps", "log.profile_steps", "torch.profiler trace of steps A to B as Chrome trace JSON in "
          "OUT/profile/ (CUDA: a memory snapshot too)", metavar="A:B"),
    Alias("--profile-ranks", "log.profile_ranks", "comma-separated ranks that profile --profile-steps",
          metavar="R,R"),
    # checkpoint
    Alias("--keep-latest", "checkpoint.keep_latest", "committed sharded checkpoints kept, newest first; older ones are "
          "removed after each commit", metavar="K"),
    Alias("--keep-every", "checkpoint.keep_every", "milestones: sharded checkpoints of steps that are multiples of N "
          "are never removed (0: none)", metavar="N"),
    Alias("--async-save", "checkpoint.async_save", "write sharded checkpoints in the background: host copy, then "
          "training goes on while every rank writes; the marker is committed once all finished, at most one save in "
          "flight"),
    # dist
    Alias("--dist-timeout", "dist.timeout_s", "timeout of the rendezvous and every collective (wins over moonrt "
          "launch/sbatch --timeout; default: theirs, else 300)", metavar="SECONDS"),
    # precision
    Alias("--dtype", "precision.compute", "forward compute dtype (autocast; parameters, gradients and optimizer states "
          "stay fp32)"),
    Alias("--reduce-dtype", "precision.reduce", "dtype the gradient sums over ranks are sent and summed in (bf16 "
          "arithmetic in the collective, written back into the fp32 gradients)"),
)
"""The short flags: one per field at most, each field's only spelling besides ``--set`` (in ``--help`` order within
its section)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RunFlag:
    """A flag that is no job config field: how the run starts, resumes, stops and reports. ``kwargs`` go to
    ``add_argument`` as they are."""

    flag: str
    group: str
    help: str
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


JOB_CONFIG = "job config"
RUN_CONTROL = "run control"

RUN_GROUPS: dict[str, str] = {
    JOB_CONFIG: "precedence, lowest first: the embedded default < --config < --set (in order) < the flags of the "
                "config sections below; a --set and a flag naming one field must agree. --set SECTION.KEY=VALUE "
                "reaches every field; the flags below are short aliases of the common ones",
    RUN_CONTROL: "resume, stop and report (no job config fields)",
}
"""The ``--help`` sections of :data:`RUN_FLAGS`: title -> description (``job config`` first, ``run control`` last)."""

RUN_FLAGS: tuple[RunFlag, ...] = (
    RunFlag("--config", JOB_CONFIG, "job config YAML (a JobConfig; all keys optional)", {"metavar": "YAML"}),
    RunFlag("--set", JOB_CONFIG, SET_HELP, {"action": "append", "default": [], "metavar": "KEY=VALUE"}),
    RunFlag("--metrics", RUN_CONTROL, "write JSON lines {step, loss, lr, tokens_per_s, ...} to this file",
            {"metavar": "JSONL"}),
    RunFlag("--resume", RUN_CONTROL, "continue from OUT's newest checkpoint, OUT/checkpoint.pt or the sharded "
            "OUT/checkpoint/ (the job config must match the checkpoint's in every field that changes the trajectory; "
            "--steps may grow)", {"action": "store_true"}),
    RunFlag("--resume-if-exists", RUN_CONTROL, "--resume when OUT holds a checkpoint, else start a new run (for jobs "
            "that may be requeued: moonrt sbatch --requeue); an interrupted first sharded save of the same job counts "
            "as no checkpoint", {"action": "store_true"}),
    RunFlag("--resume-allow-changes", RUN_CONTROL, "comma-separated job config fields that may differ from the "
            "checkpoint's on --resume (e.g. lr,steps or optim.lr,data.corpus)", {"metavar": "FIELDS", "default": ""}),
    RunFlag("--until", RUN_CONTROL, "stop after this step (checkpointed); schedule still uses --steps",
            {"type": int, "metavar": "STEP"}),
    RunFlag("--no-progress", RUN_CONTROL, "no progress bar or periodic step lines (the start, eval and summary lines "
            "still print)", {"action": "store_true"}),
)
"""The flags that are no config field, with their argparse arguments."""

_ROLE = re.compile(r":\w+:`~?([^`]+)`")


def _plain(doc: str | None) -> str:
    """The first sentence of a docstring without reST markup (``--help`` text)."""
    text = " ".join((doc or "").split())
    text = _ROLE.sub(r"\1", text).replace("``", "")
    end = re.search(r"\.(\s|$)", text)
    return text[:end.start()] if end else text


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def field_of(path: tuple[str, ...]) -> tuple[type, dataclasses.Field, Any]:
    """``(section class, field, type hint)`` of the JobConfig field at ``path``; KeyError naming the path when there
    is none (or a step of it is no section)."""
    cls: Any = JobConfig
    for depth, key in enumerate(path):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if key not in fields:
            raise KeyError(f"{'.'.join(path)}: {cls.__name__} has no field {key!r}")
        hint = _hints(cls)[key]
        if depth == len(path) - 1:
            return cls, fields[key], hint
        if not dataclasses.is_dataclass(hint):
            raise KeyError(f"{'.'.join(path)}: {'.'.join(path[:depth + 1])} is a field, not a section")
        cls = hint
    raise KeyError("empty field path")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value: Any) -> str:
    """A default as it is typed on the command line: null, true/false, 0,3 for a list."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


FlagKind = Literal["switch", "int", "float", "str", "ints"]


def flag_kind(hint: Any) -> tuple[FlagKind, tuple[str, ...]]:
    """How a field of type ``hint`` is read from one flag: ``(kind, accepted words)``. ``X | None`` is read as ``X``
    (null only by ``--set``); a ``bool`` is a switch that sets true (false by ``--set``); a ``Literal`` of strings is
    text whose words ``--help`` lists (the schema checks them); ``list[int]`` is comma-separated. TypeError for any
    other type: such a field has no flag, only ``--set``."""
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return flag_kind(inner[0])
    if hint is bool:
        return "switch", ()
    if hint in (int, float, str):
        return hint.__name__, ()
    if origin is Literal and all(isinstance(a, str) for a in get_args(hint)):
        return "str", get_args(hint)
    if origin is list and get_args(hint) == (int,):
        return "ints", ()
    raise TypeError(f"a field of type {hint} has no flag form (set it with --set)")


def _read(kind: FlagKind, a: Alias, text: str) -> Any:
    """Alias ``a``'s text read as its field's type (``kind``): ConfigError naming the field and the flag when it is
    malformed, as the schema's own messages do."""
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "ints":
            return [int(p) for p in text.split(",")]
    except ValueError:
        expected = {"int": "an integer", "float": "a number", "ints": "comma-separated integers, e.g. 0,3"}[kind]
        raise ConfigError(f"{a.field} ({a.flag}) = {show(text)}: expected {expected}") from None
    return text


def _alias_kwargs(a: Alias) -> dict[str, Any]:
    """The ``add_argument`` keywords of alias ``a``, from its field (type, default, accepted words)."""
    _cls, f, hint = field_of(a.path)
    kind, words = flag_kind(hint)
    text = a.help + (f" (one of: {', '.join(a.values())})" if a.values is not None else "")
    where = a.field if "default" in a.help else f"{a.field}; default {_show(_default(f))}"
    kwargs: dict[str, Any] = {"dest": a.dest, "help": f"{text} ({where})".replace("%", "%%")}
    if kind == "switch":  # sets true; unset leaves the config's value
        return {**kwargs, "action": "store_true", "default": None}
    metavar = a.metavar or ("{" + ",".join(words) + "}" if words else None)
    if metavar is not None:
        kwargs["metavar"] = metavar
    return kwargs


def sections() -> dict[str, tuple[type, str]]:
    """The ``--help`` sections of the config, in JobConfig order: ``"job"`` (JobConfig's own fields) then each
    section field -> (its class, its title)."""
    out: dict[str, tuple[type, str]] = {"job": (JobConfig, "job (JobConfig's top-level fields)")}
    for f in dataclasses.fields(JobConfig):
        hint = _hints(JobConfig)[f.name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            out[f.name] = (hint, f"{f.name} ({hint.__name__})")
    return out


def _section_of(a: Alias) -> str:
    return a.path[0] if len(a.path) > 1 else "job"


def _description(section: str, cls: type) -> str:
    """A section's ``--help`` text: its class's summary and the fields that have no flag, by ``--set``."""
    flagged = {a.path[-1] for a in ALIASES if _section_of(a) == section}
    hints = _hints(cls)
    rest = [f.name for f in dataclasses.fields(cls) if f.name not in flagged
            and not (section == "job" and dataclasses.is_dataclass(hints[f.name]))]
    key = "KEY" if section == "job" else f"{section}.KEY"
    summary = _plain(cls.__doc__) if section != "job" else "the job's own fields (not in a section)"
    more = f"; also --set {key}=VALUE for KEY in: {', '.join(rest)}" if rest else ""
    return f"{summary}{more}".replace("%", "%%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Every ``moonrt train`` flag, from :data:`ALIASES` and :data:`RUN_FLAGS` only, in ``--help`` sections."""
    groups = {JOB_CONFIG: parser.add_argument_group(JOB_CONFIG, RUN_GROUPS[JOB_CONFIG])}
    for section, (cls, title) in sections().items():
        groups[section] = parser.add_argument_group(title, _description(section, cls))
    groups[RUN_CONTROL] = parser.add_argument_group(RUN_CONTROL, RUN_GROUPS[RUN_CONTROL])
    for r in RUN_FLAGS:
        if r.group == JOB_CONFIG:
            groups[r.group].add_argument(r.flag, dest=r.dest, help=r.help, **r.kwargs)
    for a in ALIASES:
        groups[_section_of(a)].add_argument(a.flag, **_alias_kwargs(a))
    for r in RUN_FLAGS:
        if r.group != JOB_CONFIG:
            groups[r.group].add_argument(r.flag, dest=r.dest, help=r.help, **r.kwargs)


def flag_values(args: argparse.Namespace) -> dict[tuple[str, ...], tuple[str, Any]]:
    """The aliases given on the command line: field path -> (flag, value), as
    :func:`moonrt.jobs.train.overrides.job_config` takes them, each text read as its field's type (ConfigError naming
    the field and the flag when malformed)."""
    given = {}
    for a in ALIASES:
        value = getattr(args, a.dest, None)
        if value is not None:
            kind = flag_kind(field_of(a.path)[2])[0]
            given[a.path] = (a.flag, _read(kind, a, value) if isinstance(value, str) else value)
    return given


__all__ = ["ALIASES", "Alias", "RUN_FLAGS", "RUN_GROUPS", "RunFlag", "add_arguments", "field_of", "flag_kind",
           "flag_values", "sections"]
