"""``moonrt train``: train the K3 model (default: ``k3_tiny`` on the stdlib sources, bytes) -- the main job.

With no arguments it runs the embedded default :class:`JobConfig`: k3_tiny, byte tokenizer, the
Python standard library's ``*.py`` files as corpus (:mod:`moonrt.data`), AdamW, linear warmup +
cosine decay, gradient clipping, Quantile Balancing bias updates after every step, a tqdm bar with
loss and tokens/s, periodic held-out eval, and a summary comparing the final eval loss with the
held-out unigram entropy (nats/token).

Exactness contract (what later parallel runs are compared against):

- the global batch of step ``s`` is ``data.global_batch(train, seed, s, batch_size, seq_len)``, a
  function of ``(seed, s)`` only; a rank trains on :func:`moonrt.data.shard` of it;
- the loss is the mean over all tokens of the global batch: each rank computes the *sum* of its
  token losses and divides by the global token count, gradients are summed across ranks;
- the learning rate is a function of the step; checkpoints hold model, optimizer and step, so
  ``--resume`` continues bit-identically (checkpoints are written to a temp file, then renamed);
- checkpoints are layout-independent: they always hold the single-process (unsharded) model and
  optimizer state, gathered by the runtime's ``full_state_dict`` and sharded again on load by
  ``load_full_state_dict``, so a checkpoint of ``--ep 2`` resumes in one process, ``--ep 2`` or ``--ep 4``;
- only rank 0 writes metrics, checkpoints and the progress bar.

Parallel behaviour comes from one :class:`moonrt.comm.parallelism.Parallelism` object (its parts: the
pipeline, which runs each step's micro-batches through its schedule, expert parallelism, the routing-trace
recorder); a single-process run is that object with no parts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from moonrt import checkpoint, data, outputs
from moonrt.comm.parallelism import Parallelism, RoutingTrace
from moonrt.config import ConfigError, from_dict, load_yaml, save_yaml, to_dict
from moonrt.job import MAX_PARAMS, JobConfig, OptimConfig, lr_at
from moonrt.model.config import PRESETS
from moonrt.parallel.context import LOCAL

CHECKPOINT = "checkpoint.pt"
def build_model(job: JobConfig) -> torch.nn.Module:
    from moonrt.model.model import K3Model
    from moonrt.model.moe import moe_config_from_dict
    from moonrt.model.params import count_params

    cfg = job.model_cfg()
    total = count_params(cfg).total
    if total > MAX_PARAMS:  # e.g. the real k3 (2.78T): a planning config, never instantiated
        raise ConfigError(f"model = {job.model if job.model_config is None else 'model_config'}: {total:,} parameters; "
                          f"expected at most {MAX_PARAMS:,} (moonrt train builds the whole model in one process)")
    torch.manual_seed(job.optim.seed)
    return K3Model(cfg, moe_config_from_dict(job.moe))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; matrices (dim >= 2, except the embedding) get weight decay, vectors and embedding do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and not name.startswith("embed") else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def evaluate(model: torch.nn.Module, windows: np.ndarray, batch_size: int, rt: Parallelism) -> float:
    """Mean next-token loss (nats/token) over the held-out ``windows [N, T + 1]``."""
    was_training = model.training
    model.eval()
    model.set_record_routing(False)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            x, y = data.shard(windows[i:i + batch_size], 0, 1, rt.cp_rank, rt.cp_size)
            total += float(rt.loss_sum(model, torch.from_numpy(x), torch.from_numpy(y)))
            count += y.size
    model.set_record_routing(True)
    model.train(was_training)
    return rt.sum_scalar(total) / rt.sum_scalar(count)


def save_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
                    job: JobConfig, rt: Parallelism | None = None) -> None:
    """Atomically write ``{model, optimizer, step, config}`` (:func:`moonrt.checkpoint.save`).

    Model and optimizer state are in the single-process layout (``rt.full_state_dict``, collective:
    every rank calls this function); only the main rank writes.
    """
    rt = rt or Parallelism()
    state = rt.full_state_dict(model, opt)
    if not rt.is_main:
        return
    checkpoint.save(path, {"model": state["model"], "optimizer": state["optimizer"], "step": step,
                           "config": to_dict(job)})


def load_checkpoint(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                    rt: Parallelism | None = None, state: dict[str, Any] | None = None) -> int:
    """Load a :func:`save_checkpoint` file (or its already-read ``state``) into this rank's model and optimizer
    (``rt.load_full_state_dict`` shards it for this layout); returns its step."""
    rt = rt or Parallelism()
    state = checkpoint.load(path) if state is None else state
    try:
        rt.load_full_state_dict(model, opt, state)
    except (RuntimeError, KeyError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise checkpoint.CheckpointError(f"checkpoint {str(path)!r}: does not fit this model and optimizer: "
                                         f"{first}") from None
    return int(state["step"])


class NothingToDo(Exception):
    """The job has no step left to run (a finished run resumed, ``--until`` already reached): not an error."""


def _check_outputs(job: JobConfig, metrics_path: str | None, resume: bool, rt: Parallelism) -> None:
    """Fail before step 1 on outputs that cannot be written or would overwrite another run's files."""
    out = Path(job.out_dir)
    if not rt.is_main:
        return
    outputs.probe_dir(out, "out_dir (--out)")
    if not resume and (out / CHECKPOINT).exists():
        raise ConfigError(f"out_dir (--out) = {str(out)!r}: already holds {CHECKPOINT} of another run; expected "
                          "--resume to continue it, or a new --out")
    if metrics_path is not None:
        m = Path(metrics_path)
        if m.is_dir():
            raise ConfigError(f"--metrics = {metrics_path!r}: is a directory; expected a file path")
        if not resume and m.exists():
            raise ConfigError(f"--metrics = {metrics_path!r}: file exists; expected a new path (or --resume to "
                              "continue the run that wrote it)")
        outputs.probe_dir(m.parent, "--metrics directory")
    if job.routing_trace is not None:
        t = Path(job.routing_trace)
        if t.is_dir():
            raise ConfigError(f"routing_trace (--routing-trace) = {job.routing_trace!r}: is a directory; "
                              "expected a .npz file path")
        outputs.probe_dir(t.parent, "routing_trace (--routing-trace) directory")


def train(job: JobConfig, rt: Parallelism | None = None, metrics_path: str | None = None, resume: bool = False,
          until: int | None = None, progress: bool = True, resume_allow: tuple[str, ...] = ()) -> dict[str, float]:
    """Run the job; returns the summary (``final_eval_loss``, ``unigram_entropy``, ...).

    Raises :class:`NothingToDo` when no step is left (a finished run resumed, ``until`` already reached),
    :class:`moonrt.config.ConfigError` / :class:`moonrt.checkpoint.CheckpointError` (both ``ValueError``) on
    bad input, before step 1 wherever the input can be checked then.
    """
    rt = rt or Parallelism()
    if job.threads:
        torch.set_num_threads(job.threads)
    cfg = job.optim
    if until is not None and until < 1:
        raise ConfigError(f"--until = {until}: expected an integer >= 1 (the step to stop after)")
    out = Path(job.out_dir)
    ckpt = out / CHECKPOINT
    state = None
    start = 0
    if resume:
        if not ckpt.is_file():
            raise checkpoint.CheckpointError(f"--resume: no checkpoint at {str(ckpt)!r}")
        state = checkpoint.load(ckpt)
        start = state["step"]
        checkpoint.check_resume(state["config"], to_dict(job), start, resume_allow)
        if start > cfg.steps:
            raise ConfigError(f"optim.steps (--steps) = {cfg.steps}: expected at least the checkpoint's step {start} "
                              f"({str(ckpt)!r})")
        if start == cfg.steps:
            raise NothingToDo(f"the run in {str(out)!r} already finished: checkpoint at step {start} of {cfg.steps}; "
                              "nothing to do (raise --steps to train further)")
        if until is not None and until <= start:
            raise NothingToDo(f"checkpoint {str(ckpt)!r} is at step {start}, already at or past --until {until}; "
                              "nothing to do")
    _check_outputs(job, metrics_path, resume, rt)
    mcfg = job.model_cfg()
    corpus = data.load_corpus(job.data.corpus, job.data.token_dtype, mcfg.vocab_size, job.data.heldout_fraction)
    if cfg.batch_size % rt.dp_size:
        raise ConfigError(f"optim.batch_size = {cfg.batch_size}: expected a multiple of the data-parallel size "
                          f"{rt.dp_size}")
    m = job.parallel.microbatches
    if (cfg.batch_size // rt.dp_size) % m:
        raise ConfigError(f"parallel.microbatches (--microbatches) = {m}: expected a divisor of the per-replica "
                          f"batch {cfg.batch_size // rt.dp_size} (optim.batch_size {cfg.batch_size} / data-parallel "
                          f"size {rt.dp_size})")
    model = build_model(job)
    model = rt.parallelize(model)
    cp_log = getattr(rt.ctx, "log", None)  # ContextParallel's CP byte records per layer (K3_SYSTEMS §7)
    cp_bytes: dict[str, dict[str, int]] = {}
    if cp_log is not None:
        rt.ctx.tag_layers((n, m) for n, m in model.named_modules() if n.endswith(".attn"))
    opt = build_optimizer(model, cfg)
    if state is not None:
        load_checkpoint(ckpt, model, opt, rt, state=state)
        del state
    mgr = None
    if job.memory_policy is not None:  # saved-tensor storage policies (K3_SYSTEMS §8), matched by module name
        from moonrt.memory.manager import ActivationManager
        from moonrt.memory.policy import MemoryPolicy

        policy = load_yaml(MemoryPolicy, job.memory_policy)
        if "remote" in policy.tiers_used():  # needs a serving peer per owner rank: the ActivationManager API (README)
            remote = sorted(p for p in policy.policies_used() if p.endswith("remote"))
            raise ConfigError(f"memory_policy (--memory-policy) = {job.memory_policy!r}: uses {', '.join(remote)}, "
                              "which moonrt train does not support (remote offload needs a peer rank serving each "
                              "owner: moonrt.memory.remote); expected keep, recompute, fp8, host or disk tiers")
        mgr = ActivationManager(model, policy)
    if rt.is_main:
        save_yaml(job, out / "config.yaml")
    stop = cfg.steps if until is None else min(until, cfg.steps)
    heldout = data.eval_windows(corpus.heldout, cfg.eval_windows, cfg.seq_len)
    baseline = data.unigram_entropy(corpus.heldout, corpus.vocab_size)
    global_tokens = cfg.batch_size * cfg.seq_len
    metrics = outputs.open_metrics(metrics_path, start if resume else None) if (metrics_path and rt.is_main) else None
    n_params = sum(p.numel() for p in model.parameters())
    if rt.is_main and progress:
        print(f"moonrt train: {job.model if job.model_config is None else 'custom'} ({n_params / 1e6:.2f}M params, "
              f"pattern {mcfg.pattern}), corpus {corpus.description}: {len(corpus.train):,} train / "
              f"{len(corpus.heldout):,} held-out tokens; {cfg.steps} steps x {global_tokens} tokens", flush=True)
    bar = tqdm(range(start, stop), initial=start, total=cfg.steps, disable=not (rt.is_main and progress),
               dynamic_ncols=True, desc="train")
    model.train()
    losses: list[float] = []
    eval_loss = math.nan
    t_start = time.perf_counter()
    tokens_done = 0
    try:
        for step in bar:
            t0 = time.perf_counter()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = data.global_batch(corpus.train, cfg.seed, step, cfg.batch_size, cfg.seq_len)
            x, y = data.shard(batch, rt.dp_rank, rt.dp_size, rt.cp_rank, rt.cp_size)
            if cp_log is not None:
                rt.ctx.new_step()
            opt.zero_grad(set_to_none=True)
            loss = rt.forward_backward(model, torch.from_numpy(x), torch.from_numpy(y), 1.0 / global_tokens, mgr)
            rt.sync_grads(model)
            grad_norm = rt.clip_grad_norm(model.parameters(), cfg.grad_clip)
            rt.step(opt)  # ZeRO-1: p.grad is gone after sync_grads; only rt reads the gradients
            stat_sum = rt.sum_stats if rt.replicas is not None else None
            stats = model.update_routing_bias(stat_sum) if cfg.routing_bias_update else {}
            loss_value = rt.sum_scalar(float(loss.detach()))
            dt = time.perf_counter() - t0
            tokens_done += global_tokens
            losses.append(loss_value)
            record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": global_tokens / dt, "tokens": (step + 1) * global_tokens}
            if cp_log is not None:
                cp_bytes = cp_log.by_layer()
                record["cp_bytes_sent"] = sum(r["fwd_sent"] + r["bwd_sent"] for r in cp_bytes.values())
            if stats:
                record["maxvio"] = max(s.maxvio for s in stats.values())
            rt.step_metrics(step, model, record)
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                eval_loss = evaluate(model, heldout, cfg.batch_size, rt)
                record["eval_loss"] = eval_loss
                if rt.is_main and progress:
                    bar.write(f"step {step + 1}: train loss {loss_value:.3f}, eval loss {eval_loss:.3f} nats/token "
                              f"(unigram entropy {baseline:.3f})")
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            bar.set_postfix(loss=f"{loss_value:.3f}", eval=f"{eval_loss:.3f}", tok_s=f"{global_tokens / dt:,.0f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == stop:
                save_checkpoint(ckpt, model, opt, step + 1, job, rt)
        rt.close()
    finally:
        bar.close()
        if metrics is not None:
            metrics.close()
        if mgr is not None:
            if rt.is_main and progress:
                print(mgr.accounting.summary(), flush=True)
            mgr.close()
    wall = time.perf_counter() - t_start
    summary = {"steps": stop, "train_loss": float(np.mean(losses[-10:])) if losses else math.nan,
               "final_eval_loss": eval_loss, "unigram_entropy": baseline,
               "tokens_per_s": tokens_done / wall if wall > 0 else math.nan, "wall_s": wall, "params": n_params}
    if rt.is_main and progress:
        print(f"summary: {stop} steps in {wall:.0f} s ({summary['tokens_per_s']:,.0f} tokens/s); "
              f"train loss {summary['train_loss']:.3f}; eval loss {eval_loss:.3f} nats/token vs held-out "
              f"unigram entropy {baseline:.3f} ({eval_loss - baseline:+.3f}); checkpoint {ckpt}", flush=True)
    if cp_bytes and progress:  # every rank reports its own CP traffic (moonrt launch prefixes [rank r])
        from moonrt.comm.cp_context import comm_table

        print(comm_table(cp_bytes, f"CP bytes per layer, cp rank {rt.cp_rank}, last step"), flush=True)
    return summary


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="job config YAML (a JobConfig; all keys optional)")
    parser.add_argument("--steps", type=int, help="optimizer steps (optim.steps)")
    parser.add_argument("--seed", type=int, help="data order and init seed (optim.seed)")
    parser.add_argument("--batch-size", type=int, help="sequences per global batch (optim.batch_size)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (optim.seq_len)")
    parser.add_argument("--lr", type=float, help="peak learning rate (optim.lr)")
    parser.add_argument("--eval-every", type=int, help="eval interval in steps (optim.eval_every)")
    parser.add_argument("--model", help="model preset: " + ", ".join(sorted(PRESETS)))
    parser.add_argument("--corpus", help="text file, or token file with --token-dtype (default: stdlib sources)")
    parser.add_argument("--token-dtype", choices=["uint16", "uint32"], help="--corpus is a binary token file")
    parser.add_argument("--out", help="output dir for checkpoints and config.yaml (out_dir)")
    parser.add_argument("--metrics", help="write JSON lines {step, loss, lr, tokens_per_s, ...} to this file")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (the job config must "
                        "match the checkpoint's in every field that changes the trajectory; --steps may grow)")
    parser.add_argument("--resume-allow-changes", metavar="FIELDS", default="",
                        help="comma-separated job config fields that may differ from the checkpoint's on --resume "
                        "(e.g. lr,steps or optim.lr,data.corpus)")
    parser.add_argument("--until", type=int, help="stop after this step (checkpointed); schedule still uses --steps")
    parser.add_argument("--threads", type=int, help="torch threads per process, 0 = torch default (threads)")
    parser.add_argument("--memory-policy", help="activation memory policy YAML (memory_policy; moonrt.memory)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or summary line")
    parser.add_argument("--ep", type=int, help="expert-parallel degree: MoonEP over EP ranks, E/EP home experts "
                        "per rank (parallel.ep)")
    parser.add_argument("--routing-trace", help="write per-step, per-layer [R, E] routing counts to this .npz "
                        "(routing_trace; read by moonrt ep-sim --trace)")
    parser.add_argument("--cp", type=int, help="context-parallel degree: each sequence split over CP ranks, KCP for "
                        "KDA, latent all-gather for MLA (parallel.cp)")
    parser.add_argument("--pp", type=int, help="pipeline-parallel degree: the decoder layers cut into contiguous "
                        "stages over PP ranks (parallel.pp)")
    parser.add_argument("--vpp", type=int, help="virtual pipeline stages per PP rank (parallel.vpp; interleaved)")
    parser.add_argument("--microbatches", type=int, help="micro-batches per step of each pipeline "
                        "(parallel.microbatches)")
    parser.add_argument("--schedule", help="pipeline schedule: auto, gpipe, 1f1b, interleaved, zb, zbv "
                        "(parallel.schedule)")
    parser.add_argument("--zero", type=int, help="ZeRO stage: 0 (replicated AdamW states) or 1 (states and reduced "
                        "gradients sharded over each parameter's data-parallel replicas) (parallel.zero)")
    parser.add_argument("--attn-res-comm", help="AttnRes blocks between PP ranks: cached (only blocks the receiver "
                        "lacks) or naive (every completed block) (parallel.attn_res_comm)")


# Command-line flag (argparse dest) -> path of the JobConfig field it overrides.
_OVERRIDES: dict[str, tuple[str, ...]] = {
    "steps": ("optim", "steps"), "seed": ("optim", "seed"), "batch_size": ("optim", "batch_size"),
    "seq_len": ("optim", "seq_len"), "lr": ("optim", "lr"), "eval_every": ("optim", "eval_every"),
    "model": ("model",), "corpus": ("data", "corpus"), "token_dtype": ("data", "token_dtype"),
    "out": ("out_dir",), "threads": ("threads",), "memory_policy": ("memory_policy",),
    "cp": ("parallel", "cp"), "ep": ("parallel", "ep"), "routing_trace": ("routing_trace",),
    "pp": ("parallel", "pp"), "vpp": ("parallel", "vpp"), "microbatches": ("parallel", "microbatches"),
    "schedule": ("parallel", "schedule"), "attn_res_comm": ("parallel", "attn_res_comm"),
    "zero": ("parallel", "zero"),
}


def job_from_args(args: argparse.Namespace) -> JobConfig:
    """The job config: ``--config`` (or the default), then command-line overrides (:data:`_OVERRIDES`)."""
    raw = to_dict(load_yaml(JobConfig, args.config)) if args.config else to_dict(JobConfig())
    for dest, path in _OVERRIDES.items():
        value = getattr(args, dest)
        if value is None:
            continue
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return from_dict(JobConfig, raw)


def _launched() -> bool:
    """True when a launcher (moonrt launch, torchrun, SLURM, MPI) started this process as one rank of several."""
    from moonrt.cluster.env import detect_rendezvous

    return detect_rendezvous().world_size > 1


def parallel_runtime(job: JobConfig) -> Parallelism:
    """This rank's :class:`Parallelism` in a multi-rank job (``moonrt launch``, torchrun, SLURM or MPI).

    Joins the default group (:func:`moonrt.cluster.env.init_distributed`); ``parallel.dp`` is raised to fill the
    world when the other degrees divide it. Batch rows are split over ``dp_ep`` (ranks that see different data),
    each sequence over ``cp`` (:class:`moonrt.comm.cp_context.ContextParallel`: KCP, conv halo, MLA latent
    gather); gradients, router statistics and scalars are summed over the replicas ``dp_ep_cp``. Parts:
    :class:`moonrt.comm.pp_part.PipelineParallel` when ``pp > 1`` (stages over the ``pp`` group),
    :class:`moonrt.comm.ep_parallel.ExpertParallel` when ``ep > 1``, a routing-trace recorder when asked for;
    :class:`moonrt.comm.zero.Zero1` when ``zero = 1``, after the pipeline and before EP (the pipeline's inner
    part then: see :mod:`moonrt.comm.zero` for the composition).
    """
    import torch.distributed as dist

    from moonrt.cluster.env import init_distributed
    from moonrt.comm.cp_context import ContextParallel
    from moonrt.comm.mesh import ProcessMesh

    init_distributed()
    p = job.parallel
    world = dist.get_world_size()
    if p.world_size != world and p.dp == 1 and world % p.world_size == 0:
        p.dp = world // p.world_size
    mesh = ProcessMesh(p)
    ctx = ContextParallel(mesh.group("cp")) if p.cp > 1 else LOCAL
    rt = Parallelism(dp_rank=mesh.rank("dp_ep"), dp_size=mesh.size("dp_ep"), cp_rank=mesh.rank("cp"),
                     cp_size=mesh.size("cp"), is_main=dist.get_rank() == 0, ctx=ctx, replicas=mesh.group("dp_ep_cp"))
    counts = None
    if p.pp > 1:  # the pipeline runs the step: it comes first
        from moonrt.comm.pp_part import PipelineParallel
        from moonrt.scheduler.pipeline import build_schedule

        schedule = build_schedule(p.pipeline_schedule, p.pp, p.microbatches, p.vpp)
        rt.parts.append(PipelineParallel(schedule, group=mesh.group("pp"), rank=mesh.rank("pp"),
                                         mode=p.attn_res_comm))
    ep = None
    if p.ep > 1:  # MoonEP: shard experts, per-group grad sync, global-norm clip over the shards
        from moonrt.comm.ep_parallel import ExpertParallel

        ep = ExpertParallel(p, mesh=mesh, capacity=job.optim.batch_size * job.optim.seq_len)
        rt.parts.append(ep)
        if p.pp > 1:  # the pipeline combines the expert shards' norm and checkpoint state over its stages
            rt.parts[0].inner = ep
        counts = ep.layer_counts
    if p.zero:  # ZeRO-1 owns sync, clip, update and the state of every parameter: before EP, after the pipeline
        from moonrt.comm.zero import Zero1

        zero = Zero1.from_mesh(mesh, ep=ep)
        rt.parts.insert(1 if p.pp > 1 else 0, zero)
        if p.pp > 1:  # runs after the pipeline's pseudo-query sum; the pipeline combines its state over stages
            rt.parts[0].inner = zero
    if job.routing_trace:
        if p.pp > 1:  # rank 0 holds only its own stages' MoE layers
            raise ConfigError(f"routing_trace (--routing-trace) = {job.routing_trace!r}: expected parallel.pp = 1 "
                              f"(got {p.pp}: each pipeline rank holds only its stages' MoE layers)")
        rt.parts.append(RoutingTrace(job.routing_trace, is_main=rt.is_main, counts=counts))
    return rt


def run(args: argparse.Namespace) -> int:
    allow = tuple(f.strip() for f in args.resume_allow_changes.split(",") if f.strip())
    try:
        if allow and not args.resume:
            raise ConfigError("--resume-allow-changes: expected together with --resume")
        job = job_from_args(args)
        if job.parallel.world_size != 1 or _launched():
            rt = parallel_runtime(job)
        else:
            rt = Parallelism(parts=[RoutingTrace(job.routing_trace)] if job.routing_trace else [])
            if job.parallel.zero and not args.no_progress:
                print("moonrt train: parallel.zero = 1 with one process: nothing to shard, ZeRO-1 is a no-op",
                      flush=True)
        summary = train(job, rt=rt, metrics_path=args.metrics, resume=args.resume, until=args.until,
                        progress=not args.no_progress, resume_allow=allow)
    except NothingToDo as exc:
        print(f"moonrt train: {exc}", flush=True)
        return 0
    except (ConfigError, ValueError) as exc:
        print(f"moonrt train: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if not math.isfinite(summary["train_loss"]):
        print(f"moonrt train: error: train loss is {summary['train_loss']} after step {summary['steps']} (diverged; "
              "try a lower --lr)", file=sys.stderr, flush=True)
        return 1
    return 0
