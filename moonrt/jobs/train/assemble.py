"""Assembly of a ``moonrt train`` job (job layer): the model from the registry (:mod:`moonrt.models`) and
this rank's :class:`~moonrt.comm.parallelism.Parallelism` with its parts for the job's parallel layout."""

from __future__ import annotations

from typing import Any

import torch

from moonrt.comm.compose import compose
from moonrt.comm.mesh import Group, MeshLayout
from moonrt.comm.parallelism import Parallelism, Part, RoutingTrace
from moonrt.config import ConfigError
from moonrt.jobs.train.config import MAX_PARAMS, JobConfig
from moonrt.parallel.context import LOCAL


def check_model_size(job: JobConfig) -> None:
    """:class:`ConfigError` when the job's model has more than :data:`MAX_PARAMS` parameters (counted from its
    config, nothing built)."""
    total = job.model_spec().param_count(job.model_cfg())
    if total > MAX_PARAMS:  # e.g. a released model's planning preset (K3: 2.78T), never instantiated
        raise ConfigError(f"model = {job.model if job.model_config is None else 'model_config'}: {total:,} parameters; "
                          f"expected at most {MAX_PARAMS:,} (moonrt train builds the whole model in one process)")


def build_model(job: JobConfig) -> torch.nn.Module:
    """The job's model, built through its family's :class:`~moonrt.models.spec.ModelSpec` (seeded with
    ``optim.seed``): ``model`` names the preset and so the family, ``model_config`` (when given) is that family's
    config; with ``qat`` the layers its family declares fake-quantize (``enable_qat``). The model is a
    :class:`moonrt.parallel.model.TrainableModel`."""
    spec = job.model_spec()
    cfg = job.model_cfg()
    check_model_size(job)
    torch.manual_seed(job.optim.seed)
    model = spec.build(cfg, job.moe)
    if job.qat != "none":  # validated: the family declares quantizable layers, qat_block divides their axes
        from moonrt.ops.qat import scheme_for

        spec.quantizable(model).enable_qat(scheme_for(job.qat, job.qat_block))
    return model


def routing_trace(job: JobConfig, **kwargs: Any) -> RoutingTrace:
    """The job's routing-trace recorder, the trace labelled with the job's model and its expert sizes (in the
    training dtype, fp32; :attr:`ModelSpec.expert_sizes <moonrt.models.spec.ModelSpec.expert_sizes>`) so that
    ``moonrt ep-sim --trace`` sizes its MB columns for this model, not its defaults (a family without routed
    experts: no sizes)."""
    spec = job.model_spec()
    name = job.model if job.model_config is None else "custom"
    sizes = spec.expert_sizes(job.model_cfg(), "fp32") if spec.expert_sizes is not None else None
    return RoutingTrace(job.routing_trace, model=name, sizes=sizes, **kwargs)


def parallel_runtime(job: JobConfig, progress: bool = False) -> Parallelism:
    """This rank's :class:`Parallelism` in a multi-rank job (``moonrt launch``, torchrun, SLURM or MPI).

    Binds this rank's device (:func:`moonrt.jobs.train.device.bind_device`: ``cuda:LOCAL_RANK`` on CUDA, the
    runtime's :attr:`Parallelism.device`), then joins the default group (:func:`moonrt.cluster.env.init_distributed`;
    a multi-rank CUDA job on gloo is refused); ``parallel.dp`` is raised to fill the
    world when the other degrees divide it (ConfigError naming the degrees and the world otherwise). Any product
    of ``pp x dp x ep x cp`` composes; the mesh's rank order (:mod:`moonrt.comm.mesh`) decides the groups. With
    ``progress``, rank 0 prints the layout once (:func:`layout_table`: every rank's coordinates, its batch shard
    and pipeline stages, and the groups; gathered from the ranks with one ``all_gather_object`` over the mesh's CPU
    group).

    Batch rows are split over ``dp_ep`` (ranks that see different data), each sequence over ``cp``
    (:class:`moonrt.comm.cp.context.ContextParallel`: KCP, conv halo, MLA latent gather); gradients, router
    statistics and scalars are summed over the replicas ``dp_ep_cp``. Parts built here:
    :class:`moonrt.comm.pp.part.PipelineParallel` when ``pp > 1`` (stages over the ``pp`` group),
    :class:`moonrt.comm.ep.parallel.ExpertParallel` when ``ep > 1``, a routing-trace recorder when asked for;
    :class:`moonrt.comm.zero.adamw.Zero1` when ``zero = 1`` (:class:`moonrt.comm.zero.muon.ZeroMuon` with ``optimizer =
    muon``). Their order and which wraps which is the composition table's (:func:`moonrt.comm.compose.compose`).
    """
    import torch.distributed as dist

    from moonrt.cluster.detect import detect_rendezvous
    from moonrt.cluster.env import init_distributed
    from moonrt.comm.cp.context import ContextParallel
    from moonrt.comm.mesh import ProcessMesh
    from moonrt.jobs.train.device import bind_device, resolve_job

    p = job.parallel
    job.fit_world(detect_rendezvous().world_size)  # before joining: every rank fails alike, none waits for the others
    # the job's dist (wins over the launcher's environment; backend for its device); a device that cannot run
    # fails here, on every rank alike, before any rank waits at the rendezvous
    resolved = resolve_job(job, multi_rank=True)
    device = bind_device(resolved.device)  # cuda:LOCAL_RANK current before the group exists: NCCL binds that GPU
    init_distributed(resolved.dist)
    world = dist.get_world_size()
    p.fit_world(world)  # the world joined (the launcher's, as detected above: a no-op then)
    mesh = ProcessMesh(p)
    # the job's KDA backend reaches every KDA call through the context (no CP: _train gives LOCAL's place one)
    ctx = LOCAL
    if p.cp > 1:  # KCP's summaries over parallel.cp_transport (collective over the CP group: every rank alike)
        try:
            ctx = ContextParallel(mesh.group(Group.CP), kda_kernel=job.kernels.kda, transport=p.cp_transport,
                                  device_type=device.type, backend=mesh.backend)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    rt = Parallelism(dp_rank=mesh.rank(Group.DP_EP), dp_size=mesh.size(Group.DP_EP), cp_rank=mesh.rank(Group.CP),
                     cp_size=mesh.size(Group.CP), is_main=dist.get_rank() == 0, ctx=ctx,
                     replicas=mesh.group(Group.DP_EP_CP), device=device)
    rt.cpu_group = mesh.cpu_group()  # objects and metadata: gloo whatever carries the tensors
    parts: list[Part] = []
    counts = pipe = None
    if p.pp > 1:  # the pipeline runs the step
        from moonrt.comm.pp.part import PipelineParallel
        from moonrt.scheduler.pipeline import build_schedule

        schedule = build_schedule(p.pipeline_schedule, p.pp, p.microbatches, p.vpp)
        pipe = PipelineParallel(schedule, group=mesh.group(Group.PP), rank=mesh.rank(Group.PP), mode=p.attn_res_comm,
                                objects=mesh.cpu_group(Group.PP))
        parts.append(pipe)
    if p.ep > 1:  # MoonEP: shard experts, per-group grad sync, global-norm terms over the shards
        from moonrt.comm.ep.parallel import ExpertParallel

        ep = ExpertParallel(p, mesh=mesh, capacity=job.optim.batch_size * job.optim.seq_len,
                            kernels=job.kernels.moonep, device_type=device.type)
        p.ep_transport = ep.ep_transport  # the backend it resolved to (auto: shm on one host's CPUs): config.yaml
        parts.append(ep)
        counts = ep.layer_counts
    if p.zero:  # ZeRO-1 owns sync, norm, update and the state of every parameter
        from moonrt.comm.zero.adamw import Zero1
        from moonrt.comm.zero.muon import ZeroMuon
        from moonrt.jobs.train.optimizers import muon_blocks

        if job.optim.optimizer == "muon":  # each Muon block / AdamW parameter owned whole by one replica
            parts.append(ZeroMuon.from_mesh(mesh, assign=lambda model: muon_blocks(model, job.optim)))
        else:
            parts.append(Zero1.from_mesh(mesh))
    if job.routing_trace:
        if p.pp > 1:  # rank 0 holds only its own stages' MoE layers
            raise ConfigError(f"routing_trace (--routing-trace) = {job.routing_trace!r}: expected parallel.pp = 1 "
                              f"(got {p.pp}: each pipeline rank holds only its stages' MoE layers)")
        parts.append(routing_trace(job, is_main=rt.is_main, counts=counts))
    rt.parts = compose(parts)
    if progress:  # every rank reports what it uses, rank 0 prints the table
        import socket

        mine = {"coords": mesh.coords, "batch": rt.dp_rank, "stages": getattr(pipe, "my_stages", [0]),
                "host": socket.gethostname()}
        rows: list[dict] = [{}] * world
        dist.all_gather_object(rows, mine, group=rt.cpu_group)
        if rt.is_main:
            print(layout_table(mesh.layout, rows), flush=True)
    return rt


_GROUP_ROLES: dict[Group, str] = {
    Group.PP: "pipeline send/recv", Group.DP_EP: "different batch rows", Group.EP: "MoonEP dispatch/combine",
    Group.CP: "one sequence split: KCP, MLA", Group.DP_CP: "expert-parameter replicas: grad sum, ZeRO-1 shards",
    Group.DP_EP_CP: "dense-parameter replicas: grad sum, ZeRO-1 shards, loss sum",
    Group.DP: "plain data-parallel replicas", Group.EP_CP: "one replica of one pipeline stage",
}
"""What each group does, in the order :func:`layout_table` lists them."""


def layout_table(layout: MeshLayout, rows: list[dict[str, Any]]) -> str:
    """The job's layout as text: one line per rank and the process groups (what ``moonrt train`` prints at start).

    ``rows[r]``: what rank ``r`` reports: ``coords`` (``{"pp", "dp", "ep", "cp"}`` of :meth:`MeshLayout.coords`),
    ``batch`` (its batch shard, the index in its ``dp_ep`` group), ``stages`` (its pipeline stages), ``host``.
    Groups: every kind of :data:`moonrt.comm.mesh.GROUP_NAMES` with more than one member, kinds with the same
    member sets on one line, each listed as the partition of all ranks. The head names the EP placement when it is
    not MoonEP's (``parallel.ep_dispatcher``).
    """
    p = layout.parallel
    head = (f"moonrt train: layout pp {p.pp} x dp {p.dp} x ep {p.ep} x cp {p.cp} = {layout.world_size} ranks"
            + (f", vpp {p.vpp}" if p.vpp > 1 else "")
            + (f", ep_dispatcher {p.ep_dispatcher}" if p.ep > 1 and p.ep_dispatcher != "moonep" else "")
            + f", zero {p.zero}; rank = ((pp * {p.dp} + dp) * {p.ep} + ep) "
            f"* {p.cp} + cp")
    width = max(len(str(layout.world_size - 1)), 4)
    lines = [head, f"  {'rank':>{width}}  pp  dp  ep  cp  batch  stages  host"]
    shards = layout.group_size(Group.DP_EP)
    for r, row in enumerate(rows):
        c = row["coords"]
        stages = ",".join(map(str, row["stages"]))
        lines.append(f"  {r:>{width}}  {c['pp']:>2}  {c['dp']:>2}  {c['ep']:>2}  {c['cp']:>2}  "
                     f"{row['batch']:>2}/{shards:<2}  {stages:<6}  {row['host']}")
    kinds: dict[tuple[tuple[int, ...], ...], list[str]] = {}
    for name in _GROUP_ROLES:
        if layout.group_size(name) > 1:
            kinds.setdefault(tuple(map(tuple, layout.all_groups(name))), []).append(name)
    lines.append("  groups:")
    for groups, names in kinds.items():
        members = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups)
        lines.append(f"    {' = '.join(names)}: {members}  ({'; '.join(_GROUP_ROLES[n] for n in names)})")
    return "\n".join(lines)
