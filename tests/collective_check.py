"""The NCCL-op check (issue 30 item 4): record every torch.distributed call the runtime issues, then check the calls
of all ranks against what NCCL supports and against NCCL's ordering rules.

:func:`collective_check` is a context manager (``with collective_check("cpu") as found: ...``), entered in every rank
of a run at the same point. While active it records every call made through the ``torch.distributed`` namespace
(the collectives, the object collectives, ``barrier`` / ``monitored_barrier``, bare ``send`` / ``recv`` / ``isend`` /
``irecv`` and ``batch_isend_irecv`` with its :class:`~torch.distributed.P2POp` s) as a :class:`Call`: the function,
the group (its name, global ranks, backend, and whether it is a CPU group), every tensor's device, dtype and shape,
the reduce op, each point-to-point operation's peer and tag, and the call site (the first frame outside torch;
``via``: the torch module in between, e.g. DCP's planning). On exit the ranks all-gather their records and
:func:`check` returns the same list of :class:`Violation` s on every rank (empty: the run would be NCCL-correct).

How: the public functions of the ``torch.distributed`` namespace are replaced by recording wrappers (and
``P2POp`` by a subclass that unwraps them), so a call is recorded as the code spelled it, once: torch's own
implementations call each other through ``distributed_c10d``'s module globals, which stay untouched (an
``all_gather_object`` is one record, not also the ``all_gather`` it runs; ``batch_isend_irecv`` is one record, not
also its ``isend`` s). Gloo still does the communication, so the step is the real one. A recording ProcessGroup
wrapper would see only the backend's lowered ops (pickled objects as byte all-gathers, a batch as single sends) and
lose exactly the distinctions NCCL's rules are about; torch's fake backend does no communication, so a training
step under it would run on garbage.

As NCCL: the check runs the mesh as an NCCL job builds it (:func:`moonrt.comm.mesh.default_backend` reports
``nccl`` while active), so the mesh makes its own gloo CPU groups (:meth:`moonrt.comm.mesh.ProcessMesh.cpu_group`)
and every other group stands for an NCCL communicator. Groups made with ``new_group(..., backend="gloo")`` are CPU
groups (gloo on every job); the rest, the default group included, are device groups.

Rules (a), per call: no call NCCL lacks (``monitored_barrier``, the deprecated coalesced calls); object collectives
only on a CPU group; no bare ``send`` / ``recv`` / ``isend`` / ``irecv`` on a device group (NCCL needs them in
``batch_isend_irecv`` groups); on a device group every tensor on the job's device with a dtype NCCL has and no
bitwise reduce op; on a CPU group host tensors only.

Rule (b), over all ranks: deadlock freedom under NCCL's semantics. Each rank runs its calls in issue order and
stays in a call until it completes (stricter than NCCL, whose host does not wait for a launched kernel: an order
that finishes here finishes there). A collective completes when every member of its group is in its k-th
collective on that group, and those must be the same function; a point-to-point call (a batch, or a bare op as a
batch of one) completes when every operation in it has its partner posted: the n-th send from a to b on a group
pairs with b's n-th receive from a there (tags ignored), and the partners must agree in tag, shape and dtype (gloo
matched them by tag; NCCL would pair them in order). Every rank must finish.

:data:`CHECKERS` (from ``tests/device_discipline.py``) takes :func:`collective_check` as is: a factory
``(device) -> context manager`` whose ``__enter__`` returns the list the violations are put in (a :class:`Findings`,
whose ``calls`` holds every rank's records after the exit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RECORDED: tuple[str, ...] = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all", "all_to_all_single",
    "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "gather", "scatter",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_gather_object",
    "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list", "recv_object_list",
    "all_gather_coalesced", "all_reduce_coalesced",
)
"""The ``torch.distributed`` functions recorded (those this torch has)."""

NCCL_CALLS = frozenset(RECORDED) - {"monitored_barrier", "all_gather_coalesced", "all_reduce_coalesced"}
"""Calls an NCCL process group runs (``monitored_barrier`` is gloo's; the coalesced pair is deprecated and not
implemented by ProcessGroupNCCL)."""

OBJECT_CALLS = frozenset({"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                          "send_object_list", "recv_object_list"})
BARE_P2P = frozenset({"send", "recv", "isend", "irecv"})
P2P_CALLS = BARE_P2P | {"batch_isend_irecv"}

NCCL_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2})
"""Dtypes ProcessGroupNCCL maps to an NCCL type (bool and fp8 as bytes); no int16, uint16 or complex."""

NCCL_LACKS_OPS = frozenset({"BAND", "BOR", "BXOR"})
"""Reduce ops NCCL does not have."""

_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)
_ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    device: str
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class P2P:
    """One operation of a point-to-point call: ``send`` (else receive), the peer's global rank, the tag, the tensor."""

    send: bool
    peer: int
    tag: int
    tensor: TensorInfo


@dataclasses.dataclass(frozen=True)
class Call:
    """One recorded call of global rank ``rank`` (see the module docstring)."""

    rank: int
    fn: str
    group: str
    """The process group's name (unique per group within a run, the same on every rank)."""
    ranks: tuple[int, ...]
    backend: str
    cpu: bool
    """A CPU group: made with ``backend="gloo"``, gloo on every job."""
    labels: tuple[str, ...]
    """What the group is to the mesh (``pp``, ``ep``, ``dp_ep_cp``, ..., ``world``; CPU groups ``cpu`` and
    ``cpu_<name>``), every name it holds; ``world`` for the default group."""
    tensors: tuple[TensorInfo, ...]
    p2p: tuple[P2P, ...]
    op: str | None
    where: str
    via: str | None


@dataclasses.dataclass(frozen=True)
class Violation:
    rule: str
    where: str
    what: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.what}"


class Findings(list):
    """The violations (a list); ``calls[r]``: rank r's records, once the context has exited."""

    calls: list[list[Call]]


def _info(t: torch.Tensor) -> TensorInfo:
    return TensorInfo(str(t.device), str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _site() -> tuple[str, str | None]:
    """The call site: the first frame outside torch and this file (``path:line``, relative to the repo when inside
    it) and the torch module in between, if any."""
    f = sys._getframe(2)
    via = None
    while f is not None:
        name = f.f_code.co_filename
        if name == _HERE:
            f = f.f_back
            continue
        if name.startswith(_TORCH):
            via = via or Path(name).relative_to(_TORCH).with_suffix("").as_posix().replace("/", ".")
            f = f.f_back
            continue
        break
    if f is None:
        return "?", via
    path = Path(f.f_code.co_filename)
    try:
        path = path.resolve().relative_to(_ROOT)
    except ValueError:
        pass
    return f"{path.as_posix()}:{f.f_lineno}", (f"torch.{via}" if via else None)


class _Recorder:
    def __init__(self, nccl: bool) -> None:
        self.nccl = nccl
        self.calls: list[Call] = []
        self.cpu: set[int] = set()
        self.labels: dict[int, set[str]] = {}
        self.saved: list[tuple[Any, str, Any]] = []
        self.orig: dict[str, Any] = {}

    # ---- installing --------------------------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def install(self) -> None:
        import moonrt.comm.mesh as mesh

        for name in RECORDED:
            if hasattr(dist, name):
                self.orig[name] = getattr(dist, name)
                self._patch(dist, name, self._wrap(name, self.orig[name]))
        unwrap = {id(w): o for w, o in ((getattr(dist, n), o) for n, o in self.orig.items())}
        base = dist.P2POp

        class P2POp(base):  # the recording isend / irecv given to a P2POp stand for torch's own
            def __new__(cls, op: Any, *args: Any, **kwargs: Any) -> Any:
                return base.__new__(cls, unwrap.get(id(op), op), *args, **kwargs)

            def __init__(self, op: Any, *args: Any, **kwargs: Any) -> None:
                super().__init__(unwrap.get(id(op), op), *args, **kwargs)

        self._patch(dist, "P2POp", P2POp)
        new_group = dist.new_group

        @functools.wraps(new_group)
        def recording_new_group(*args: Any, **kwargs: Any) -> Any:
            group = new_group(*args, **kwargs)
            backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
            if backend is not None and str(backend).lower() == "gloo":
                self.cpu.add(id(group))
            return group

        self._patch(dist, "new_group", recording_new_group)
        if self.nccl:
            self._patch(mesh, "default_backend", lambda: "nccl")
        init = mesh.ProcessMesh.__init__

        @functools.wraps(init)
        def labelled_init(m: Any, *args: Any, **kwargs: Any) -> None:
            init(m, *args, **kwargs)
            for name, group in m._groups.items():
                self.labels.setdefault(id(group), set()).add(str(name))
            for name, group in m._cpu.items():
                self.labels.setdefault(id(group), set()).add("cpu" if name is None else f"cpu_{name}")

        self._patch(mesh.ProcessMesh, "__init__", labelled_init)

    def uninstall(self) -> None:
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        self.saved.clear()

    # ---- recording ---------------------------------------------------------------------------------------------
    def _wrap(self, name: str, orig: Any) -> Any:
        sig = inspect.signature(orig)

        @functools.wraps(orig)
        def recording(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs).arguments
            except TypeError:
                bound = {}
            self._record(name, bound)
            return orig(*args, **kwargs)

        return recording

    def _group(self, group: Any) -> Any:
        return group if group is not None else dist.distributed_c10d._get_default_group()

    def _record(self, fn: str, args: dict[str, Any]) -> None:
        where, via = _site()
        p2p: list[P2P] = []
        tensors: list[TensorInfo] = []
        if fn == "batch_isend_irecv":
            ops = list(args.get("p2p_op_list") or [])
            group = self._group(ops[0].group if ops else None)
            for op in ops:
                p2p.append(P2P(getattr(op.op, "__name__", "") == "isend", int(op.peer), int(op.tag), _info(op.tensor)))
                tensors.append(_info(op.tensor))
        else:
            group = self._group(args.get("group"))
            if fn not in OBJECT_CALLS:
                for value in args.values():
                    if isinstance(value, torch.Tensor):
                        tensors.append(_info(value))
                    elif isinstance(value, list | tuple):
                        tensors += [_info(v) for v in value if isinstance(v, torch.Tensor)]
            if fn in BARE_P2P:
                peer = next((args[k] for k in ("dst", "src") if args.get(k) is not None), None)
                if peer is None:
                    local = next((args[k] for k in ("group_dst", "group_src") if args.get(k) is not None), 0)
                    peer = dist.get_global_rank(group, local)
                p2p.append(P2P(fn in ("send", "isend"), int(peer), int(args.get("tag") or 0), tensors[0]))
        op = args.get("op")
        ranks = tuple(dist.get_process_group_ranks(group))
        labels = set(self.labels.get(id(group), set()))
        if group is dist.distributed_c10d._get_default_group():
            labels.add("world")
        self.calls.append(Call(
            rank=dist.get_rank(), fn=fn, group=str(group.group_name), ranks=ranks, backend=str(dist.get_backend(group)),
            cpu=id(group) in self.cpu, labels=tuple(sorted(labels)), tensors=tuple(tensors), p2p=tuple(p2p),
            op=None if op is None else str(getattr(op, "name", op)).split(".")[-1], where=where, via=via))


# ---- the checks ------------------------------------------------------------------------------------------------


def _per_call(call: Call, device: str) -> list[Violation]:
    out = []
    at = f"rank {call.rank} {call.where}" + (f" (via {call.via})" if call.via else "")
    group = f"group {call.group} {list(call.ranks)}" + (" (CPU)" if call.cpu else "")
    if call.fn not in NCCL_CALLS:
        out.append(Violation("nccl-op", at, f"{call.fn} on {group}: NCCL has no {call.fn}"))
    if call.fn in OBJECT_CALLS and not call.cpu:
        out.append(Violation("objects", at, f"{call.fn} on {group}: object collectives belong on the mesh's CPU "
                                            "group (ProcessMesh.cpu_group)"))
    if call.fn in BARE_P2P and not call.cpu:
        out.append(Violation("bare-p2p", at, f"bare {call.fn} on {group}: NCCL needs point-to-point in "
                                             "batch_isend_irecv groups"))
    for t in call.tensors:
        if call.cpu and t.device != "cpu":
            out.append(Violation("device", at, f"{call.fn} on {group}: a {t.device} tensor on a CPU group"))
        elif not call.cpu and t.device != device:
            out.append(Violation("device", at, f"{call.fn} on {group}: tensor on {t.device}, the job's device is "
                                               f"{device} (NCCL takes only tensors of its GPU)"))
        if not call.cpu and getattr(torch, t.dtype) not in NCCL_DTYPES:
            out.append(Violation("dtype", at, f"{call.fn} on {group}: dtype {t.dtype} (NCCL has no such type)"))
    if not call.cpu and call.op in NCCL_LACKS_OPS:
        out.append(Violation("reduce-op", at, f"{call.fn} on {group}: ReduceOp.{call.op} (NCCL has none)"))
    return out


def _order(calls: Sequence[Sequence[Call]]) -> list[Violation]:
    """Rule (b): the NCCL dry run over every rank's calls (see the module docstring)."""
    out: list[Violation] = []
    seq = [list(cs) for cs in calls]  # seq[r]: global rank r's calls
    keys: list[list[tuple]] = []
    ops: dict[tuple[str, int, int, int, bool], tuple[int, P2P]] = {}  # (group, me, peer, n, send) -> (pos, op)
    for cs in seq:
        ks, count, pairs = [], {}, {}
        for pos, c in enumerate(cs):
            if c.fn in P2P_CALLS:
                mine = []
                for op in c.p2p:
                    n = pairs.get((c.group, op.peer, op.send), 0)
                    pairs[(c.group, op.peer, op.send)] = n + 1
                    ops[(c.group, c.rank, op.peer, n, op.send)] = (pos, op)
                    mine.append((op.peer, n, op.send))
                ks.append(("p2p", c.group, tuple(mine)))
            else:
                k = count.get(c.group, 0)
                count[c.group] = k + 1
                ks.append(("coll", c.group, k))
        keys.append(ks)
    for (group, me, peer, n, send), (at, op) in ops.items():
        other = ops.get((group, peer, me, n, not send))
        where = f"rank {me} {seq[me][at].where}"
        if other is None:
            out.append(Violation("order", where, f"{'send' if send else 'receive'} {n} {'to' if send else 'from'} "
                                 f"rank {peer} on group {group} has no partner there"))
        elif send and (other[1].tag, other[1].tensor.shape, other[1].tensor.dtype) != (
                op.tag, op.tensor.shape, op.tensor.dtype):
            out.append(Violation("order", where, f"send {n} to rank {peer} on group {group} (tag {op.tag}, "
                                 f"{op.tensor.dtype} {list(op.tensor.shape)}) pairs in order with a receive of tag "
                                 f"{other[1].tag}, {other[1].tensor.dtype} {list(other[1].tensor.shape)}: NCCL "
                                 "ignores tags"))
    pos = [0] * len(seq)
    moved = True
    while moved:
        moved = False
        for i, cs in enumerate(seq):
            while pos[i] < len(cs):
                kind, group, data = keys[i][pos[i]]
                c = cs[pos[i]]
                if kind == "coll":
                    members = [m for m in c.ranks if m < len(seq)]
                    heads = [keys[m][pos[m]] if pos[m] < len(keys[m]) else None for m in members]
                    if not all(h == ("coll", group, data) for h in heads):
                        break
                    fns = {seq[m][pos[m]].fn for m in members}
                    if len(fns) > 1:
                        out.append(Violation("order", f"group {group} {list(c.ranks)}", f"collective {data} differs "
                                             f"across ranks: {sorted(fns)}"))
                    for m in members:
                        pos[m] += 1
                else:
                    ready = True
                    for peer, n, send in data:
                        partner = ops.get((group, peer, c.rank, n, not send))
                        if partner is None or peer >= len(seq) or partner[0] > pos[peer]:
                            ready = False
                            break
                    if not ready:
                        break
                    pos[i] += 1
                moved = True
    stuck = [i for i, cs in enumerate(seq) if pos[i] < len(cs)]
    if stuck:
        waits = "; ".join(f"rank {seq[i][pos[i]].rank} in {seq[i][pos[i]].fn} on group {seq[i][pos[i]].group} at "
                          f"{seq[i][pos[i]].where}" for i in stuck)
        out.append(Violation("deadlock", "ranks " + ", ".join(map(str, stuck)),
                             f"under NCCL's rules these ranks never finish: {waits}"))
    return out


def check(calls: Sequence[Sequence[Call]], device: str = "cpu") -> list[Violation]:
    """Every violation of rules (a) and (b) in ``calls[r]`` (global rank r's records in issue order), duplicates
    dropped."""
    found: list[Violation] = []
    for cs in calls:
        for c in cs:
            found += _per_call(c, device)
    found += _order(calls)
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def collective_check(device: str | torch.device = "cpu", nccl: bool = True) -> Iterator[Findings]:
    """Record this rank's calls while active; on exit every rank gets the violations of all ranks' calls.

    Collective on exit when torch.distributed is initialized with more than one rank (the records are all-gathered
    over the default group): every rank must enter and leave it at the same point. ``nccl``: build meshes as an
    NCCL job would (see the module docstring)."""
    found = Findings()
    found.calls = []
    rec = _Recorder(nccl)
    rec.install()
    try:
        yield found
    finally:
        rec.uninstall()
        mine = rec.calls
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        else:
            every = [mine]
        found.calls = every
        found.extend(check(every, str(torch.device(device))))
