"""The configs every runtime part shares: :class:`ParallelConfig` (the degrees of a job's parallel dimensions and
its pipeline schedule, with the schedule rules :func:`schedule_error` / :func:`schedule_cells_error`) and
:class:`DistConfig` (how torch.distributed is initialized, with its timeout bounds).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Literal

from moonrt.config.schema import ConfigError, check

PIPELINE_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb", "zbv")
"""Pipeline schedules (:mod:`moonrt.scheduler.pipeline` builds them)."""


def schedule_error(kind: str, pp: int, microbatches: int, vpp: int) -> tuple[str, Any, str] | None:
    """The first rule of pipeline schedule ``kind`` that the degrees break, as ``(field, value, expected)``
    (for :func:`check`), or None: the one statement of these rules, used by :class:`ParallelConfig` and by
    :func:`moonrt.scheduler.pipeline.build_schedule`.

    ``vpp`` is 1 for gpipe / 1f1b, >= 2 for interleaved, 2 for zbv; interleaved (and zb with ``vpp > 1``) need
    ``microbatches`` a multiple of ``pp``, so at least ``pp`` (as in Megatron)."""
    if kind not in PIPELINE_SCHEDULES:
        return "schedule", kind, "one of " + ", ".join(PIPELINE_SCHEDULES) + " (zb1p = zb)"
    for name, v in (("pp", pp), ("microbatches", microbatches), ("vpp", vpp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return name, v, "an integer >= 1"
    if kind in ("gpipe", "1f1b") and vpp != 1:
        return "vpp", vpp, f"1 for schedule {kind!r} (use 'interleaved' or 'zb' for vpp > 1)"
    if kind == "interleaved" and vpp < 2:
        return "vpp", vpp, ">= 2 for schedule 'interleaved' (use '1f1b' for vpp = 1)"
    if kind == "zbv" and vpp != 2:
        return "vpp", vpp, "2 for schedule 'zbv' (two chunks per rank, V placement)"
    if kind == "interleaved" or (kind == "zb" and vpp > 1):
        if microbatches < pp:
            return "microbatches", microbatches, f">= pp ({pp}) for schedule {kind!r} with vpp > 1"
        if microbatches % pp:
            return "microbatches", microbatches, f"a multiple of pp ({pp}) for schedule {kind!r} with vpp > 1"
    return None


EP_DISPATCHERS: tuple[str, ...] = ("moonep", "alltoall")
"""Placement policies of the EP dispatcher (``parallel.ep_dispatcher``; :mod:`moonrt.comm.ep.placement`)."""

EP_TRANSPORTS: tuple[str, ...] = ("auto", "shm", "cuda", "collectives")
"""Backends of the transport seam (``parallel.ep_transport``; :mod:`moonrt.comm.transport`)."""

CP_TRANSPORTS: tuple[str, ...] = ("auto", "shm", "collectives")
"""What moves KCP's per-rank summaries (``parallel.cp_transport``; :mod:`moonrt.comm.cp.gather`). No ``cuda``: KCP's
summary gather over torch symmetric memory is not wired (unproven without GPUs); asking for it is one line."""

MAX_DEGREE = 1 << 20
"""Largest degree of a parallel dimension (and micro-batch count): a million ranks, far beyond any cluster; a bound
so that a typo (``--ep 1000000000``) is refused here, not in the arithmetic of the mesh."""

MAX_SCHEDULE_CELLS = 1 << 17
"""Most (stage, micro-batch) cells of a pipeline schedule, ``pp x vpp x microbatches``: the schedule holds actions per
cell and the planners simulate them one by one (2**17 cells: about half a minute and 250 MB on one core). Real
layouts have a few thousand (K3's pp 16 x vpp 2 x 32 micro-batches = 1,024)."""


def schedule_cells_error(pp: int, vpp: int, microbatches: int) -> str | None:
    """The ``expected`` text when ``pp x vpp x microbatches`` exceeds :data:`MAX_SCHEDULE_CELLS`, else None."""
    cells = pp * vpp * microbatches
    if cells <= MAX_SCHEDULE_CELLS:
        return None
    return (f"pp x vpp x microbatches ({pp} x {vpp} x {microbatches} = {cells}) <= {MAX_SCHEDULE_CELLS} "
            "(MAX_SCHEDULE_CELLS, the schedule cells a planner simulates)")


MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest collective / rendezvous timeout (a week): a collective that has not finished by then is a hung job;
beyond this, the deadline arithmetic of torch and threading overflows (``inf``: OverflowError)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Degrees of the parallel dimensions of one job (K3_SYSTEMS §10).

    ``dp * pp * ep * cp`` must equal the world size (checked by the mesh, which knows it).
    ``vpp`` is the number of virtual pipeline stages per pipeline rank (interleaved 1F1B);
    it does not change the number of ranks.
    """

    dp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    schedule: Literal["auto", "gpipe", "1f1b", "interleaved", "zb", "zbv"] = "auto"
    """Pipeline schedule (``moonrt.scheduler.pipeline``: zb = zero-bubble ZB1P, zbv = ZB-V with two chunks per
    rank in V placement); ``auto``: 1f1b, or interleaved when ``vpp > 1``."""
    microbatches: int = 1
    """Micro-batches per step of each pipeline (they split the data-parallel replica's batch rows)."""
    attn_res_comm: Literal["cached", "naive"] = "cached"
    """Block AttnRes traffic between pipeline ranks (K3_SYSTEMS §9): ``cached`` sends each rank only the
    blocks it does not hold yet, ``naive`` every completed block on every hop."""
    ep_dispatcher: Literal["moonep", "alltoall"] = "moonep"
    """Expert parallelism: where each token-expert assignment is computed (:mod:`moonrt.comm.ep.placement`).
    ``moonep``: MoonEP's balanced placement (K3_SYSTEMS §6.3: copies of hot experts in slots, every rank computes
    ``s * k`` rows); ``alltoall``: the plain all-to-all baseline, every assignment on its expert's home rank (no
    slots; rows follow the routing). Same math, so the same loss; free to change on resume like the degrees."""
    ep_dedup: bool = True
    """Expert parallelism (MoonEP, K3_SYSTEMS §6.3): send a token once per destination rank, however many of its
    top-k experts that rank computes (the receiver expands it, and sums the rows back before combine's return
    trip); ``false``: one row per token-expert assignment."""
    ep_transport: Literal["auto", "shm", "cuda", "collectives"] = "auto"
    """Expert parallelism: what moves the EP group's data (:mod:`moonrt.comm.transport`). ``shm``: the symmetric
    heap in POSIX shared memory (CPU ranks of one host), ``cuda``: torch symmetric memory (GPUs of one NVLink domain,
    unproven without GPUs), ``collectives``: gloo/NCCL all-to-alls (any group). ``auto``: the heap when the group is on
    one host; today the EP dispatcher has no path over the heap (MoonEP's one-sided dispatch, issue 48 item 2), so
    ``auto`` moves EP data by collectives and ``shm`` / ``cuda`` with ``ep > 1`` are refused. Free on resume."""
    cp_transport: Literal["auto", "shm", "collectives"] = "auto"
    """Context parallelism: what carries KCP's fixed-size per-rank summaries (``[S_ext | M]`` forward, ``[a | M]``
    backward; :mod:`moonrt.comm.cp.gather`). ``shm``: one-sided writes into every peer's slot of a symmetric heap in
    POSIX shared memory (CPU ranks of one host), ``collectives``: gloo/NCCL all-gathers (any group). ``auto``: ``shm``
    when the CP group's ranks share a host and the device is the CPU, else ``collectives``. Bitwise the same
    result either way; free on resume. The choice it resolved to is in every metrics record of a job with
    ``cp > 1`` (``cp_transport``)."""
    token_padding: int = 1
    """Expert parallelism: pad every expert segment of the dispatched rows with zero rows to a multiple of this
    (aligned grouped GEMMs); 1 = no padding. Padding rows never reach the output or a gradient. The three EP fields act
    only with ``ep > 1`` (one process has no dispatcher to configure)."""
    zero: int = 0
    """ZeRO stage of data parallelism: 0 replicates the AdamW states on every replica, 1 shards them (and the
    reduced gradients) over each parameter's replicas (:class:`moonrt.comm.zero.adamw.Zero1`); with one replica a
    no-op."""

    def validate(self) -> None:
        for name in ("dp", "pp", "vpp", "ep", "cp", "microbatches"):
            value = getattr(self, name)
            check(isinstance(value, int) and value >= 1, name, value, "an integer >= 1")
            check(value <= MAX_DEGREE, name, value, f"an integer <= {MAX_DEGREE} (MAX_DEGREE)")
        check(self.ep_dispatcher in EP_DISPATCHERS, "ep_dispatcher", self.ep_dispatcher,
              "one of " + ", ".join(EP_DISPATCHERS))
        check(isinstance(self.ep_dedup, bool), "ep_dedup", self.ep_dedup, "true or false")
        check(self.ep_transport in EP_TRANSPORTS, "ep_transport", self.ep_transport,
              "one of " + ", ".join(EP_TRANSPORTS))
        check(self.cp_transport in CP_TRANSPORTS, "cp_transport", self.cp_transport,
              "one of " + ", ".join(CP_TRANSPORTS) + (" (KCP over torch symmetric memory is not wired: cuda is "
                                                      "unproven without GPUs)" if self.cp_transport == "cuda" else ""))
        check(isinstance(self.token_padding, int) and not isinstance(self.token_padding, bool)
              and self.token_padding >= 1, "token_padding", self.token_padding, "an integer >= 1")
        check(self.zero in (0, 1) and not isinstance(self.zero, bool), "zero", self.zero,
              "0 (replicated optimizer states) or 1 (ZeRO-1: sharded over the data-parallel replicas)")
        check(self.attn_res_comm in ("cached", "naive"), "attn_res_comm", self.attn_res_comm, "cached or naive")
        kinds = ("auto", *PIPELINE_SCHEDULES)
        check(self.schedule in kinds, "schedule", self.schedule, "one of " + ", ".join(kinds))
        check(self.pp > 1 or self.microbatches == 1, "microbatches", self.microbatches,
              "1 without pipeline parallelism (pp = 1)")
        check(self.pp > 1 or self.vpp == 1, "vpp", self.vpp, "1 without pipeline parallelism (pp = 1)")
        bad = schedule_error(self.pipeline_schedule, self.pp, self.microbatches, self.vpp)
        if bad is not None:
            check(False, *bad)
        too_many = schedule_cells_error(self.pp, self.vpp, self.microbatches)
        check(too_many is None, "microbatches", self.microbatches, too_many or "")

    @property
    def pipeline_schedule(self) -> str:
        """The schedule that runs: ``schedule``, with ``auto`` resolved (interleaved when ``vpp > 1``)."""
        if self.schedule != "auto":
            return self.schedule
        return "interleaved" if self.vpp > 1 else "1f1b"

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.ep * self.cp

    def fit_world(self, world: int) -> None:
        """Raise ``dp`` (left at 1) to fill a job of ``world`` ranks: ``dp = world / (pp x ep x cp)``; ConfigError
        when those degrees do not divide the world. A ``dp`` set above 1 is left as given (the mesh checks the
        product)."""
        if self.world_size != world and self.dp == 1:
            if world % self.world_size:
                raise ConfigError(f"parallel = pp {self.pp} x ep {self.ep} x cp {self.cp} = {self.world_size} ranks "
                                  f"per data-parallel replica: expected a divisor of the world size {world} (dp = "
                                  "world / (pp x ep x cp) is inferred)")
            self.dp = world // self.world_size


DEFAULT_TIMEOUT_S = 300.0
"""Collective / rendezvous timeout when neither the job config (``dist.timeout_s``) nor the launcher
(``MOONRT_DIST_TIMEOUT``) gives one."""

_HOST = re.compile(r"[\w.:%-]{1,255}", re.ASCII)
"""An IP address (v4, v6 with ``%zone``) or host name: also one shell word, as ``moonrt sbatch`` writes it."""


@dataclasses.dataclass(kw_only=True, slots=True)
class DistConfig:
    """How torch.distributed is initialized (:func:`moonrt.cluster.env.init_distributed`): a job's ``dist`` section.

    A field left ``None`` takes the value the launcher passes to every rank in the environment (``moonrt launch``
    and ``moonrt sbatch`` write it there), else the default; a value set here wins over the launcher's
    (:func:`moonrt.cluster.env.resolve_dist_config`)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: the job's device decides (gloo on cpu, nccl on cuda); outside a job, nccl when CUDA is available,
    else gloo."""
    timeout_s: float | None = None
    """Timeout in seconds of every collective and of the rendezvous: a dead rank never hangs a job longer. ``None``:
    the launcher's ``MOONRT_DIST_TIMEOUT`` (``moonrt launch --timeout``, ``moonrt sbatch --timeout``), else
    :data:`DEFAULT_TIMEOUT_S`."""
    rdzv_host: str | None = None
    """Address (or name) of the interface rank 0's rendezvous store listens on (``0.0.0.0``: every interface).
    ``None``: the launcher's ``MOONRT_RDZV_HOST`` (``moonrt sbatch --rdzv-host``), else the address ``MASTER_ADDR``
    resolves to on rank 0's host (:func:`moonrt.cluster.store.rendezvous_bind_host`)."""

    def validate(self) -> None:
        check(self.backend in ("auto", "gloo", "nccl"), "backend", self.backend, "one of 'auto', 'gloo', 'nccl'")
        t = self.timeout_s
        check(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t)
                            and 0 < t <= MAX_TIMEOUT_S), "timeout_s", t,
              f"a positive number of seconds <= {MAX_TIMEOUT_S:g} (MAX_TIMEOUT_S, a week), or null (the launcher's)")
        check(self.rdzv_host is None or (isinstance(self.rdzv_host, str) and bool(_HOST.fullmatch(self.rdzv_host))),
              "rdzv_host", self.rdzv_host, "an IP address or host name of rank 0's interface (letters, digits, "
              "'.', ':', '%', '_', '-'; 0.0.0.0: every interface), or null (the launcher's)")
