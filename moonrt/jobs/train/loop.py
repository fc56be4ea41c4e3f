"""``moonrt train``: train a registered model (default: ``k3_tiny`` on the stdlib sources, bytes) -- the main job.

With no arguments it runs the embedded default :class:`JobConfig`: k3_tiny, byte tokenizer, the
Python standard library's ``*.py`` files as corpus (:mod:`moonrt.jobs.train.data`), AdamW, linear warmup +
cosine decay, gradient clipping, Quantile Balancing bias updates after every step, a tqdm bar with
loss and tokens/s on a terminal (plain lines every ``log.log_every`` steps otherwise, :mod:`moonrt.jobs.train.report`),
periodic held-out eval (and one at the stop step of ``--until`` when this process ran none), and a summary of the
steps this process ran (a resumed run says so at start: ``resumed from step N``) comparing the final eval loss
with the held-out unigram entropy (nats/token).

Exactness contract (what later parallel runs are compared against):

- the global batch of step ``s`` is ``data.global_batch(train, seed, s, batch_size, seq_len)``, a
  function of ``(seed, s)`` only; a rank trains on :func:`moonrt.jobs.train.data.shard` of it;
- the loss is the mean over all tokens of the global batch: each rank computes the *sum* of its
  token losses and divides by the global token count, gradients are summed across ranks;
- the learning rate is a function of the step; checkpoints hold model, optimizer and step, so
  ``--resume`` continues bit-identically (checkpoints are written to a temp file, then renamed);
- checkpoints are layout-independent: they hold the single-process (unsharded) model and optimizer state
  under single-process names, either gathered by the runtime's ``full_state_dict`` into ``checkpoint.pt``
  (one process) or written by every rank as its own pieces into a sharded DCP directory (multi-rank jobs,
  :mod:`moonrt.jobs.checkpoint.sharded`), and sharded again on load, so a checkpoint of ``--ep 2`` resumes in one
  process, ``--ep 2`` or ``--ep 4``;
- only rank 0 writes metrics, checkpoints, TensorBoard events and the progress output;
- ``optim.grad_accum`` micro-steps per step change only the fp32 summation order of the gradients (one sync,
  clip and update per step).

Parallel behaviour comes from one :class:`moonrt.comm.parallelism.Parallelism` object (its parts: the
pipeline, which runs each step's micro-batches through its schedule, expert parallelism, the routing-trace
recorder); a single-process run is that object with no parts.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from pathlib import Path

import numpy as np
import torch

from moonrt.cluster.preempt import StopSignal, stop_signals
from moonrt.comm.parallelism import Parallelism, Precision, Record, Saved
from moonrt.config import ConfigError, load_yaml, to_dict
from moonrt.jobs.checkpoint import sharded as checkpoint_dcp
from moonrt.jobs.checkpoint.store import Checkpointer, load_checkpoint, resume_state
from moonrt.jobs.train import blend, data, outputs, report
from moonrt.jobs.train.assemble import build_model, check_model_size
from moonrt.jobs.train.config import TRAIN_TIERS, JobConfig, lr_at
from moonrt.jobs.train.device import bind_device, host_tensor, resolve_job, use_deterministic
from moonrt.jobs.train.optimizers import build_optimizer
from moonrt.jobs.train.outputs import CHECKPOINT
from moonrt.jobs.train.profile import PhaseClock, StepProfiler
from moonrt.jobs.train.resume import BUILDER, check_resume
from moonrt.jobs.train.step_memory import check_step_memory
from moonrt.parallel.context import LOCAL, AttentionContext
from moonrt.parallel.model import trainable
from moonrt.parallel.packing import DocumentPacking

TRAIN_LOSS_MEAN = 10
"""The summary's ``train loss`` is the mean of the last this many steps' losses (fewer if the run had fewer): one
batch's loss is noisy; the summary line says over how many steps it averages."""
CP_TABLE = "cp_bytes_rank{rank}.txt"
"""Under ``--out``: the CP bytes table of rank ``rank`` > 0 of a ``--cp`` job (rank 0 prints its own)."""


def _open_data(job: JobConfig, vocab_size: int, rt: Parallelism) -> tuple[data.Corpus | None, blend.Blend | None]:
    """The job's corpus, or its blend's corpora (``data.blend``): text tokenized by ``data.tokenizer`` (its vocabulary
    checked against the model's first) into ``data.cache_dir`` (default ``OUT/data_cache``) by rank 0, the others
    waiting for it in one collective (:func:`moonrt.jobs.train.tokenized.cached`)."""
    tok = blend.job_tokenizer(job)
    cache = job.data.cache_dir if job.data.cache_dir is not None else str(Path(job.out_dir) / "data_cache")
    if job.data.blend is not None:
        return None, blend.open_blend(job.data, vocab_size, tok, cache, rt.is_main, rt.any_flag)
    return blend.open_corpus(job.data.corpus, job.data, vocab_size, tok, cache, rt.is_main, rt.any_flag), None


def _describe(corpus: data.Corpus | None, mix: blend.Blend | None) -> str:
    """``<description>: N train / M`` of the start line."""
    parts = mix.corpora if mix is not None else (corpus,)
    what = mix.description if mix is not None else corpus.description
    return (f"{what}: {sum(len(c.train) for c in parts):,} train / {sum(len(c.heldout) for c in parts):,}")


def evaluate(model: torch.nn.Module, windows: np.ndarray, batch_size: int, rt: Parallelism,
             docs: np.ndarray | None = None) -> float:
    """Mean next-token loss (nats/token) over the held-out ``windows [N, T + 1]`` (``docs [N, T + 1]``: packed
    documents, :func:`moonrt.jobs.train.data.packed_eval_windows`; cross-document targets are not counted)."""
    was_training = model.training
    model.eval()
    trainable(model).set_record_routing(False)
    total, count = 0.0, 0.0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            if docs is not None:
                x, y, d = data.shard_packed(windows[i:i + batch_size], docs[i:i + batch_size])
                packing = DocumentPacking.from_doc_ids(host_tensor(d, rt.device))
                total += float(rt.loss_sum(model, host_tensor(x, rt.device), host_tensor(y, rt.device),
                                           packing=packing))
                count += data.packed_targets(docs[i:i + batch_size])
                continue
            x, y = data.shard(windows[i:i + batch_size], 0, 1, rt.cp_rank, rt.cp_size)
            total += float(rt.loss_sum(model, host_tensor(x, rt.device), host_tensor(y, rt.device)))
            count += y.size
    trainable(model).set_record_routing(True)
    model.train(was_training)
    return rt.sum_scalar(total) / rt.sum_scalar(count)


class NothingToDo(Exception):
    """The job has no step left to run (a finished run resumed, ``--until`` already reached): not an error."""


class Preempted(Exception):
    """The job stopped on a stop signal after checkpointing its last completed step ``step`` (exit code
    :data:`moonrt.cluster.preempt.PREEMPTED_EXIT`); ``signum`` is the signal this rank received (None: another
    rank received it)."""

    def __init__(self, step: int, total: int, signum: int | None, path: Path) -> None:
        import signal

        how = f"by {signal.Signals(signum).name}" if signum is not None else "by a stop signal to another rank"
        super().__init__(f"stopped {how} after step {step} of {total}; checkpoint {str(path)!r} holds step {step}: "
                         "continue with --resume")
        self.step, self.signum, self.path = step, signum, path


class Diverged(Exception):
    """A non-finite loss or gradient norm at step ``step`` (1-based): the run stopped before that step's
    optimizer update and before any save (``moonrt train`` exits 1). ``last`` says which checkpoint holds what."""

    def __init__(self, step: int, loss: float, grad_norm: float, last: str) -> None:
        super().__init__(f"diverged at step {step}: loss = {loss}, grad norm = {grad_norm}; {last}; try a lower --lr")
        self.step = step


def train(job: JobConfig, rt: Parallelism | None = None, metrics_path: str | None = None, resume: bool = False,
          until: int | None = None, progress: bool = True, resume_allow: tuple[str, ...] = (),
          requeued: bool = False) -> dict[str, float]:
    """Run the job; returns the summary (``final_eval_loss``, ``unigram_entropy``, ...).

    Raises :class:`NothingToDo` when no step is left (a finished run resumed, ``until`` already reached),
    :class:`moonrt.config.ConfigError` / :class:`moonrt.jobs.checkpoint.single.CheckpointError` (both ``ValueError``) on
    bad input, before step 1 wherever the input can be checked then.

    Stop signals (:mod:`moonrt.cluster.preempt`; SIGTERM, SIGINT and ``job.stop_signal``, handled while this
    runs, in the main thread): the first lets every rank finish its current step; at each step boundary the
    ranks agree on it (:meth:`Parallelism.any_flag`), skip that step's eval, save a checkpoint of that step
    (a signal during start-up: of the starting step) and raise :class:`Preempted`. A signal during an eval
    takes effect right after it (eval is short: it completes); one during the run's last step is moot (the run
    ends normally). A second signal raises :class:`moonrt.cluster.preempt.Aborted` at once (the previous
    checkpoint stays intact: checkpoints are written atomically).

    The main rank holds the lock on ``job.out_dir`` (:func:`moonrt.jobs.train.outputs.lock_out_dir`) from before
    anything is
    written until it returns: a second run into the same directory is a :class:`ConfigError`. A non-finite loss
    or gradient norm raises :class:`Diverged` on every rank before that step's optimizer update and before any
    save (its metrics line is written, non-finite values as ``null``).

    ``requeued`` (``--resume-if-exists`` that found no checkpoint): a fresh start that finds this job's own
    ``config.yaml`` in ``out_dir`` (a run killed before its first checkpoint, or during its first sharded save)
    starts that run again, its moonrt metrics file trimmed to nothing instead of refused.
    """
    rt = rt or Parallelism()
    job = resolve_job(job)  # device and dist as this run uses them: what config.yaml records
    if rt.device.type != job.device:  # one process (a multi-rank runtime is bound in parallel_runtime)
        rt.device = bind_device(job.device)
    use_deterministic(job.deterministic)  # before the job's first matmul (cuBLAS reads its workspace setting then)
    note = str(rt.device)
    if not job.out_dir:
        raise ConfigError("out_dir (--out) = '': expected a directory path")
    if until is not None and until < 1:
        raise ConfigError(f"--until = {until}: expected an integer >= 1 (the step to stop after)")
    lock = outputs.lock_out_dir(Path(job.out_dir), create=not resume) if rt.is_main else contextlib.nullcontext()
    with StopSignal(stop_signals(job.stop_signal)) as preempt, lock:  # one run per --out, before anything is written
        return _train(job, rt, metrics_path, resume, until, progress, resume_allow, preempt, requeued, note)


def _accumulate(model: torch.nn.Module, rt: Parallelism, x: np.ndarray, y: np.ndarray, docs: np.ndarray | None,
                n: int, scale: float, saved: Saved) -> torch.Tensor:
    """Forward and backward of this rank's rows ``x``/``y`` ``[B_r, T]`` (``docs [B_r, T]``: packed documents) in
    ``n`` micro-steps of ``B_r / n`` consecutive rows (``optim.grad_accum``): each back-propagates its summed token
    loss times ``scale`` (1 / the global batch's target count), so ``p.grad`` accumulates the gradient of the
    whole step's loss, and nothing is synced in between (:meth:`Parallelism.sync_grads` runs once after). Returns
    the step's scaled loss on this rank (the micro-steps' sum), detached."""
    rows = len(x) // n
    total = None
    for i in range(n):
        part = slice(i * rows, (i + 1) * rows)
        packing = None if docs is None else DocumentPacking.from_doc_ids(host_tensor(docs[part], rt.device))
        loss = rt.forward_backward(model, host_tensor(x[part], rt.device), host_tensor(y[part], rt.device), scale,
                                   saved, packing)
        total = loss if total is None else total + loss
    return total


class ManualGC:
    """Python's automatic garbage collection off from construction to :meth:`close` (``interval`` > 0);
    :meth:`tick` runs a young-generation collection (``gc.collect(1)``: the objects made since the last one, cycles
    among them freed) on every ``interval``-th completed step. :meth:`close` restores the collector's state. With
    ``interval`` 0 the collector is untouched and ``tick`` does nothing."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._restore = interval > 0 and gc.isenabled()
        if interval > 0:
            gc.disable()

    def tick(self, step: int) -> None:
        if self.interval > 0 and step % self.interval == 0:
            gc.collect(1)

    def close(self) -> None:
        if self._restore:
            gc.enable()
            self._restore = False


def _train(job: JobConfig, rt: Parallelism, metrics_path: str | None, resume: bool, until: int | None,
           progress: bool, resume_allow: tuple[str, ...], preempt: StopSignal, requeued: bool,
           device: str) -> dict[str, float]:
    if job.threads:
        torch.set_num_threads(job.threads)
    # every forward's autocast region, and the dtype of the gradient sums over ranks
    rt.precision = Precision(job.precision.compute, torch.device(job.device).type, job.precision.reduce)
    if rt.ctx is LOCAL:  # the job's KDA backend (kernels.kda) reaches every KDA call through the context
        rt.ctx = AttentionContext(kda_kernel=job.kernels.kda)
    cfg = job.optim
    out = Path(job.out_dir)
    ckpt = out / CHECKPOINT
    report.check_tensorboard(job.log.tensorboard)  # every rank, before any output: the package may be missing
    state = None
    stored = None  # the job config of the checkpoint a resume continues
    start = 0
    src = ckpt  # what --resume loads: the newer of OUT/checkpoint.pt and the sharded OUT/checkpoint/
    init_state, init_note = None, ""  # --init-from: the weights of a released-layout HF directory
    if job.init_from is not None and not resume:
        from moonrt.jobs.checkpoint.hf import job_init

        init_state, init_note = job_init(job)
    if resume:
        src, state = resume_state(out)
        start, stored = state["step"], state["config"]
        if job.init_from is not None:  # the directory is not needed; if there, it must be the one the run started from
            from moonrt.jobs.checkpoint.hf import job_init

            job_init(job, load=False, stored=stored)
        check_resume(stored, to_dict(job), start, resume_allow)
        if start > cfg.steps:
            raise ConfigError(f"optim.steps (--steps) = {cfg.steps}: expected at least the checkpoint's step {start} "
                              f"({str(src)!r})")
        if start == cfg.steps:
            raise NothingToDo(f"the run in {str(out)!r} already finished: checkpoint at step {start} of {cfg.steps}; "
                              "nothing to do (raise --steps to train further)")
        if until is not None and until <= start:
            raise NothingToDo(f"checkpoint {str(src)!r} is at step {start}, already at or past --until {until}; "
                              "nothing to do")
    restart = rt.is_main and outputs.check_outputs(job, metrics_path, resume, stored, requeued)
    mcfg = job.model_cfg()
    corpus, mix = _open_data(job, mcfg.vocab_size, rt)  # mix: a data.blend's corpora (then corpus is None)
    pack = job.data.pack_documents  # documents kept apart (moonrt.parallel.packing); job.py refuses --cp/--pp with it
    if cfg.batch_size % rt.dp_size:
        raise ConfigError(f"optim.batch_size = {cfg.batch_size}: expected a multiple of the data-parallel size "
                          f"{rt.dp_size}")
    m = job.parallel.microbatches
    if (cfg.batch_size // rt.dp_size) % cfg.grad_accum:
        raise ConfigError(f"optim.grad_accum (--grad-accum) = {cfg.grad_accum}: expected a divisor of the per-rank "
                          f"batch {cfg.batch_size // rt.dp_size} (optim.batch_size {cfg.batch_size} / data-parallel "
                          f"size {rt.dp_size})")
    if (cfg.batch_size // rt.dp_size) % m:
        raise ConfigError(f"parallel.microbatches (--microbatches) = {m}: expected a divisor of the per-replica "
                          f"batch {cfg.batch_size // rt.dp_size} (optim.batch_size {cfg.batch_size} / data-parallel "
                          f"size {rt.dp_size})")
    check_model_size(job)
    check_step_memory(job, rt.dp_size, rt.device)  # one step's estimate vs this rank's memory, before building
    model = build_model(job)
    if init_state is not None:
        model.load_state_dict(init_state, strict=True)
        del init_state
    model = model.to(rt.device)  # built on the host, moved whole (parameters, buffers) before the parts
    n_params = sum(p.numel() for p in model.parameters())  # the whole model, before parts shard or prune it
    model = rt.parallelize(model)
    from moonrt.comm.cp.context import ContextParallel

    cp_ctx = rt.ctx if isinstance(rt.ctx, ContextParallel) else None
    cp_log = None if cp_ctx is None else cp_ctx.log  # its CP byte records per layer (K3_SYSTEMS §7)
    cp_bytes: dict[str, dict[str, int]] = {}
    if cp_ctx is not None:
        cp_ctx.tag_layers((n, m) for n, m in model.named_modules() if n.endswith(".attn"))
    opt = build_optimizer(model, cfg)
    if state is not None:
        load_checkpoint(src, model, opt, rt, state=state, builder=BUILDER)
        del state
    mgr = None
    if job.memory_policy is not None:  # saved-tensor storage policies (K3_SYSTEMS §8), matched by module name
        from moonrt.memory.manager import ActivationManager
        from moonrt.memory.policy import MemoryPolicy

        policy = load_yaml(MemoryPolicy, job.memory_policy)
        if not policy.tiers_used() <= set(TRAIN_TIERS):  # remote needs a serving peer per owner rank (README)
            bad = sorted(p for p in policy.policies_used() if p.split("+")[-1] not in TRAIN_TIERS)
            raise ConfigError(f"memory_policy (--memory-policy) = {job.memory_policy!r}: uses {', '.join(bad)}, "
                              "which moonrt train does not support (remote offload needs a peer rank serving each "
                              f"owner: moonrt.memory.remote); expected {', '.join(TRAIN_TIERS)} tiers")
        mgr = ActivationManager(model, policy, fp8_kernel=job.kernels.fp8)
    run_id = ""
    if rt.is_main:  # the run's identity (created at its first start); its config.yaml, never a user's replaced
        run_id = outputs.run_identity(out)
        outputs.write_config(out, job, resume)
    stop = cfg.steps if until is None else min(until, cfg.steps)
    heldout_docs = None
    if mix is not None:
        heldout, heldout_docs = blend.eval_windows(mix, cfg.eval_windows, cfg.seq_len, pack)
        baseline = blend.unigram_entropy(mix, mcfg.vocab_size)
    elif pack:
        heldout, heldout_docs = data.packed_eval_windows(corpus.heldout, corpus.heldout_docs, cfg.eval_windows,
                                                         cfg.seq_len)
    else:
        heldout = data.eval_windows(corpus.heldout, cfg.eval_windows, cfg.seq_len)
    if mix is None:
        baseline = data.unigram_entropy(corpus.heldout, corpus.vocab_size)
    global_tokens = cfg.batch_size * cfg.seq_len
    spec = job.model_spec()
    flops = None if spec.flops_per_token is None else spec.flops_per_token(mcfg, cfg.seq_len)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    metrics = tb = None
    if metrics_path and rt.is_main:
        metrics = outputs.open_metrics(metrics_path, start if resume else (0 if restart else None), run_id)
    console = report.Console(rt.is_main, progress, start, stop, cfg.steps, job.log.log_every)
    shape = spec.describe(mcfg)
    console.line(f"moonrt train: {job.model if job.model_config is None else 'custom'} ({n_params / 1e6:.2f}M params"
                 f"{', ' + shape if shape else ''}), corpus {_describe(corpus, mix)} held-out tokens; {cfg.steps} "
                 f"steps x {global_tokens} tokens; device {device}")
    if resume:
        console.line(f"moonrt train: resumed from step {start} (checkpoint {str(src)!r})")
    elif init_note:
        console.line(f"moonrt train: {init_note}")
    saver = Checkpointer(ckpt, model, opt, job, rt)  # collective with async saves (their gloo group)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    profiler = StepProfiler(job.log.profile_steps, job.log.profile_ranks, rank, out, rt.device.type == "cuda")
    clock = PhaseClock()
    model.train()
    losses: list[float] = []
    eval_loss, eval_step = math.nan, None  # the last held-out eval of this process and its step
    t_start = time.perf_counter()
    tokens_done = 0
    done, saved = start, (start if resume else None)  # last completed step, last checkpointed step
    gc_control = ManualGC(job.gc_interval)
    try:
        if job.log.tensorboard is not None and rt.is_main:
            outputs.mark_tensorboard_dir(job.log.tensorboard, run_id)
            tb = report.TensorBoard(job.log.tensorboard, start if resume else (0 if restart else None))
        stopped = rt.any_flag(preempt.requested)  # a signal during start-up: stop before the first step
        for step in range(start, stop):
            if stopped:
                break
            profiler.begin(step + 1)
            t0 = clock.start()
            lr = lr_at(step, cfg)
            for group in opt.param_groups:
                group["lr"] = lr
            d, targets = None, global_tokens  # d: packed documents; targets: the loss's denominator (tokens it counts)
            if mix is not None:
                batch, docs = blend.batch(mix, cfg.seed, step, cfg.batch_size, cfg.seq_len, pack)
                if pack:
                    x, y, d = data.shard_packed(batch, docs, rt.dp_rank, rt.dp_size)
                    targets = data.packed_targets(docs)
                else:
                    x, y = data.shard(batch, rt.dp_rank, rt.dp_size, rt.cp_rank, rt.cp_size)
            elif pack:
                batch, docs = data.packed_batch(corpus.train, corpus.train_docs, cfg.seed, step, cfg.batch_size,
                                                cfg.seq_len)
                x, y, d = data.shard_packed(batch, docs, rt.dp_rank, rt.dp_size)
                targets = data.packed_targets(docs)
            else:
                batch = data.global_batch(corpus.train, cfg.seed, step, cfg.batch_size, cfg.seq_len)
                x, y = data.shard(batch, rt.dp_rank, rt.dp_size, rt.cp_rank, rt.cp_size)
            if cp_ctx is not None:
                cp_ctx.new_step()
            opt.zero_grad(set_to_none=True)
            clock.mark("data")
            loss = _accumulate(model, rt, x, y, d, cfg.grad_accum, 1.0 / targets, mgr)
            clock.mark("fwd_bwd")
            rt.sync_grads(model)  # once per step, of the gradients of all micro-steps
            clock.mark("grad_sync")
            grad_norm = rt.clip_grad_norm(model.parameters(), cfg.grad_clip)
            loss_value = rt.sum_scalar(float(loss.detach()))
            clock.mark("norm")
            # both global: the ranks agree without a vote (a non-finite loss on any rank makes the sum non-finite)
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                if metrics is not None:
                    metrics.write({"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                                   "tokens": (step + 1) * global_tokens, "diverged": True}
                                  | report.rate_fields(global_tokens, time.perf_counter() - t0, t_start, flops,
                                                       job.log.peak_tflops, world, job.device))
                if saved is None:
                    last = "no checkpoint was written"
                else:
                    path = src if resume and saved == start else (
                        out / checkpoint_dcp.ROOT if checkpoint_dcp.use_sharded(opt) else ckpt)
                    last = f"the last checkpoint {str(path)!r} holds step {saved}"
                saver.wait()  # the save in flight (every rank diverged at this step: each waits for its part)
                raise Diverged(step + 1, loss_value, grad_norm, last)  # before the update and any save
            rt.step(opt)  # ZeRO-1: p.grad is gone after sync_grads; only rt reads the gradients
            stat_sum = rt.sum_stats if rt.replicas is not None else None
            stats = trainable(model).update_routing_bias(stat_sum) if cfg.routing_bias_update else {}
            clock.mark("optimizer")
            dt = time.perf_counter() - t0
            profiler.end(step + 1)
            tokens_done += global_tokens
            losses.append(loss_value)
            record: Record = {"step": step + 1, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                      "tokens": (step + 1) * global_tokens}
            record |= report.rate_fields(global_tokens, dt, t_start, flops, job.log.peak_tflops, world, job.device)
            record |= {"step_s": dt, **clock.fields(), "ckpt_wait_s": saver.take_wait()}
            if cp_log is not None:
                cp_bytes = cp_log.by_layer()
                record["cp_bytes_sent"] = sum(r["fwd_sent"] + r["bwd_sent"] for r in cp_bytes.values())
                record["cp_transport"] = cp_ctx.transport  # what parallel.cp_transport resolved to
            if stats:
                record["maxvio"] = max(s.maxvio for s in stats.values())
            rt.step_metrics(step, model, record)
            done = step + 1
            # one all-reduce MAX: the ranks agree on the stop step, and the record holds the largest peak memory
            flag, record["peak_mem_bytes"] = rt.max_ints([int(preempt.requested), record["peak_mem_bytes"]])
            stopped = done < stop and bool(flag)
            # eval every eval_every steps, at the last step, and at the stop step (--until) if none ran yet
            if not stopped and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps
                                or (step + 1 == stop and eval_step is None)):
                eval_loss, eval_step = evaluate(model, heldout, cfg.batch_size, rt, heldout_docs), step + 1
                stopped = done < stop and rt.any_flag(preempt.requested)
                record["eval_loss"] = eval_loss
                console.line(f"step {step + 1}: train loss {loss_value:.3f}, eval loss {eval_loss:.3f} nats/token "
                             f"(unigram entropy {baseline:.3f})")
            if metrics is not None:
                metrics.write(record)
            if tb is not None:
                tb.write(record)
            console.step(record, None if eval_step is None else eval_loss)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == stop or stopped:
                saver.save(step + 1)  # asynchronous saves: the next step runs while it is written
                saved = step + 1
            gc_control.tick(step + 1)
        profiler.close()
        if stopped and saved != done:
            saver.save(done)
        saver.wait()  # the last save committed (every rank's verdict) before the run ends or reports
        if stopped:
            rt.any_flag(True)  # no rank exits (srun --kill-on-bad-exit) before the main rank's save is complete
        try:
            rt.close()  # the parts' outputs: the routing trace
        except OSError as exc:
            what = f"routing_trace (--routing-trace) = {job.routing_trace!r}" if job.routing_trace else "outputs"
            raise ConfigError(f"{what}: cannot write ({exc.strerror or exc})") from None
    finally:
        if profiler.prof is not None:  # an error inside the profiled steps: what was recorded, if it can be written
            with contextlib.suppress(Exception):
                profiler.close()
        gc_control.close()
        console.close()
        if metrics is not None:
            metrics.close()
        if tb is not None:
            tb.close()
        if mgr is not None:
            if rt.is_main and progress:
                print(mgr.accounting.summary(), flush=True)
            mgr.close()
    if stopped:
        raise Preempted(done, cfg.steps, preempt.signum, out / checkpoint_dcp.ROOT if checkpoint_dcp.use_sharded(opt)
                        else ckpt)
    wall = time.perf_counter() - t_start
    summary = {"steps": stop, "steps_run": stop - start,
               "train_loss": float(np.mean(losses[-TRAIN_LOSS_MEAN:])) if losses else math.nan,
               "train_loss_steps": min(len(losses), TRAIN_LOSS_MEAN),
               "final_eval_loss": eval_loss, "eval_step": eval_step, "unigram_entropy": baseline,
               "tokens_per_s": tokens_done / wall if wall > 0 else math.nan, "wall_s": wall, "params": n_params,
               "ckpt_wait_s": saver.total_wait}
    if rt.is_main:  # with --no-progress too: the summary always prints
        ran = f"{stop} steps" if start == 0 else f"steps {start + 1}-{stop}: {stop - start} steps"
        at = "" if eval_step == stop else f" (step {eval_step})"
        print(f"summary: {ran} in {wall:.0f} s ({summary['tokens_per_s']:,.0f} tokens/s); "
              f"train loss {summary['train_loss']:.3f} (mean of the last {summary['train_loss_steps']} steps); "
              f"eval loss{at} {eval_loss:.3f} nats/token vs held-out "
              f"unigram entropy {baseline:.3f} ({eval_loss - baseline:+.3f}); checkpoint "
              f"{out / checkpoint_dcp.ROOT if checkpoint_dcp.use_sharded(opt) else ckpt}", flush=True)
    if cp_bytes:  # rank 0 prints its CP traffic; every other rank writes its own table under --out
        from moonrt.comm.cp.context import comm_table

        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        table = comm_table(cp_bytes, f"CP bytes per layer, rank {rank} (cp rank {rt.cp_rank}), last step")
        if not rt.is_main:
            outputs.write_file(out / CP_TABLE.format(rank=rank), f"{table}\n".encode(), "out_dir (--out)")
        elif progress:
            print(f"{table}\n(the other ranks' tables: {str(out / CP_TABLE.format(rank='R'))!r})", flush=True)
    return summary
