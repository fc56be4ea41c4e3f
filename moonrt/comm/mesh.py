"""Process-group mesh: every process group of a job, built once, with one documented rank order.

Rank order (outermost to innermost)::

    rank = ((pp_idx * dp + dp_idx) * ep + ep_idx) * cp + cp_idx

- ``cp`` is innermost: the ranks that split one sequence (KCP, MLA context parallelism) are
  neighbours, which on a real cluster puts the chattiest group inside a node.
- ``ep`` next: the MoonEP group; each EP rank routes different tokens.
- ``dp`` next: plain data-parallel replicas.
- ``pp`` outermost: pipeline stages (virtual stages, ``vpp``, live inside one pipeline rank).

Named groups, each a set of ranks that differ only in the listed dimensions:

=============  ==========================================================================
``pp``         the pipeline of this rank (send/recv between stages)
``dp``         plain data-parallel replicas
``ep``         MoonEP dispatch/combine
``cp``         context parallel (KCP summaries, MLA latent all-gather)
``dp_ep``      ranks that see different data at the same (pp, cp) coordinate
``dp_cp``      expert-parameter replicas: gradient sync of routed experts
``ep_cp``      one data-parallel replica of one pipeline stage
``dp_ep_cp``   dense-parameter replicas: gradient sync of non-expert weights, loss averaging
=============  ==========================================================================

Code names them by :class:`Group` (``Group.DP_CP``, a ``str`` equal to ``"dp_cp"``), never by bare strings;
the mesh's methods accept either.

CPU groups (:meth:`ProcessMesh.cpu_group`): host metadata and pickled objects (``all_gather_object``,
``gather_object``, ``broadcast_object_list``, DCP's planning) travel over gloo, whatever carries the tensors. When
the default group is gloo (a CPU job) the CPU group of the world is the default group and that of a named group
the group itself: no extra group. Otherwise (NCCL, whose collectives take only CUDA tensors and whose object
collectives would stage every object through the GPU) the mesh creates one gloo group over the world and one per
partition of each kind in :data:`CPU_GROUPS`, the named groups the runtime runs object collectives on.

:class:`MeshLayout` is pure rank arithmetic (no processes); :class:`ProcessMesh` creates the
torch.distributed groups from it. Neither keeps module globals: pass the mesh where it is needed.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from datetime import timedelta
from typing import TYPE_CHECKING

from moonrt.config import ConfigError, ParallelConfig

if TYPE_CHECKING:
    import torch.distributed as dist

DIMS: tuple[str, ...] = ("pp", "dp", "ep", "cp")
"""Mesh dimensions, outermost first."""



class Group(str, enum.Enum):
    """The mesh's named process groups (the table of the module docstring). A member is the ``str`` of its value
    (``Group.DP_CP == "dp_cp"``, same hash, formats as ``dp_cp``), so dicts and messages keyed by name still work;
    :attr:`dims` are the mesh dimensions its ranks differ in."""

    PP = "pp"
    DP = "dp"
    EP = "ep"
    CP = "cp"
    DP_EP = "dp_ep"
    DP_CP = "dp_cp"
    EP_CP = "ep_cp"
    DP_EP_CP = "dp_ep_cp"

    __hash__ = str.__hash__
    __str__ = str.__str__
    __format__ = str.__format__

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.value.split("_"))


GROUP_NAMES: tuple[str, ...] = tuple(g.value for g in Group)
"""Every group name, in :class:`Group` order (the order :class:`ProcessMesh` creates them in)."""

CPU_GROUPS: tuple[Group, ...] = (Group.PP, Group.EP)
"""Named groups with a CPU group of their own (:meth:`ProcessMesh.cpu_group`): the pipeline's object collectives
(parameter names, the single-process-layout state gathered onto pipeline rank 0) run over ``pp``; the EP group's
symmetric heap rendezvous (hosts, pids, segment names, each allocation's mapping barrier) over ``ep``."""


@dataclasses.dataclass(frozen=True, slots=True)
class MeshLayout:
    """Rank arithmetic of a ``pp x dp x ep x cp`` mesh (no processes needed)."""

    world_size: int
    parallel: ParallelConfig

    def __post_init__(self) -> None:
        p = self.parallel
        if self.world_size < 1:
            raise ConfigError(f"world_size = {self.world_size!r}: expected an integer >= 1")
        if p.world_size != self.world_size:
            raise ConfigError(
                f"parallel = dp {p.dp} x pp {p.pp} x ep {p.ep} x cp {p.cp} = {p.world_size}: "
                f"expected the degrees to multiply to the world size {self.world_size}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes of :data:`DIMS`, outermost first."""
        p = self.parallel
        return (p.pp, p.dp, p.ep, p.cp)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": i, "dp": j, "ep": k, "cp": l}`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank = {rank!r}: expected 0 <= rank < {self.world_size}")
        out = {}
        for name, size in zip(reversed(DIMS), reversed(self.shape)):
            out[name] = rank % size
            rank //= size
        return {name: out[name] for name in DIMS}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates (all four dimensions required)."""
        missing = [d for d in DIMS if d not in coords]
        if missing or set(coords) - set(DIMS):
            raise ConfigError(f"coords = {coords!r}: expected exactly the keys {', '.join(DIMS)}")
        rank = 0
        for name, size in zip(DIMS, self.shape):
            idx = coords[name]
            if not 0 <= idx < size:
                raise ConfigError(f"{name} = {idx!r}: expected 0 <= {name} < {size}")
            rank = rank * size + idx
        return rank

    def group_ranks(self, name: str, rank: int) -> list[int]:
        """Sorted members of group ``name`` that contains ``rank``."""
        dims = self._dims(name)
        c = self.coords(rank)
        sizes = dict(zip(DIMS, self.shape))
        members = []
        for idx in itertools.product(*(range(sizes[d]) for d in dims)):
            members.append(self.rank_of(**{**c, **dict(zip(dims, idx))}))
        return sorted(members)

    def all_groups(self, name: str) -> list[list[int]]:
        """Every group of kind ``name`` (a partition of all ranks), ordered by their smallest rank."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world_size):
            members = self.group_ranks(name, r)
            seen.setdefault(members[0], members)
        return [seen[k] for k in sorted(seen)]

    def group_size(self, name: str) -> int:
        sizes = dict(zip(DIMS, self.shape))
        size = 1
        for d in self._dims(name):
            size *= sizes[d]
        return size

    @staticmethod
    def _dims(name: str) -> tuple[str, ...]:
        if name not in GROUP_NAMES:
            raise ConfigError(f"group = {name!r}: expected one of {', '.join(GROUP_NAMES)}")
        return Group(name).dims


class ProcessMesh:
    """The torch.distributed groups of a job, built once from a :class:`MeshLayout`.

    Construction is collective: every rank of the default group must build the same mesh, in the
    same order, because ``new_group`` is. Query with :meth:`group`, :meth:`rank`, :meth:`size`.
    ``timeout_s`` bounds every collective on the mesh's groups; by default they inherit the default
    group's timeout (``DistConfig.timeout_s`` via ``init_distributed``), not torch's 30 minutes.
    """

    def __init__(self, parallel: ParallelConfig, *, timeout_s: float | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("ProcessMesh needs torch.distributed initialized (moonrt.cluster.init_distributed)")
        self.layout = MeshLayout(dist.get_world_size(), parallel)
        self.global_rank = dist.get_rank()
        self.coords = self.layout.coords(self.global_rank)
        timeout = timedelta(seconds=timeout_s) if timeout_s else _default_group_timeout()
        kwargs = {"timeout": timeout} if timeout is not None else {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._ranks: dict[str, list[int]] = {}
        # One communicator per distinct member set: names whose extra dimensions have degree 1
        # (e.g. ``dp`` and ``dp_ep`` when ep = 1) share it. Every rank walks the same sets in the
        # same order, as ``new_group`` requires.
        self._owned: dict[tuple[int, ...], dist.ProcessGroup] = {}
        created: set[tuple[int, ...]] = set()
        for name in Group:
            mine = tuple(self.layout.group_ranks(name, self.global_rank))
            self._ranks[name] = list(mine)
            for members in map(tuple, self.layout.all_groups(name)):
                if len(members) == self.layout.world_size:
                    continue  # the default group, never a duplicate
                if members not in created:
                    created.add(members)
                    group = dist.new_group(list(members), **kwargs)
                    if members == mine:
                        self._owned[members] = group
            self._groups[name] = dist.group.WORLD if len(mine) == self.layout.world_size else self._owned[mine]
        self.backend = default_backend()
        """The default group's backend; not ``gloo``: the mesh made gloo groups for metadata and objects."""
        self._cpu: dict[str | None, dist.ProcessGroup] = {}
        self._cpu_owned: list[dist.ProcessGroup] = []
        if self.backend == "gloo":
            self._cpu[None] = dist.group.WORLD
            for name in CPU_GROUPS:
                self._cpu[name] = self._groups[name]
        else:
            self._cpu[None] = dist.new_group(list(range(self.layout.world_size)), backend="gloo", **kwargs)
            self._cpu_owned.append(self._cpu[None])
            made: set[tuple[int, ...]] = set()
            for name in CPU_GROUPS:
                mine = tuple(self._ranks[name])
                for members in map(tuple, self.layout.all_groups(name)):
                    if len(members) == self.layout.world_size:
                        group = self._cpu[None]
                    elif members in made:
                        continue
                    else:
                        made.add(members)
                        group = dist.new_group(list(members), backend="gloo", **kwargs)
                        self._cpu_owned.append(group)
                    if members == mine:
                        self._cpu[name] = group

    def destroy(self) -> None:
        """Destroy the groups this mesh created (not the default group); the mesh is unusable after."""
        import torch.distributed as dist

        for group in [*self._owned.values(), *self._cpu_owned]:
            dist.destroy_process_group(group)
        self._owned.clear()
        self._groups.clear()
        self._cpu_owned.clear()
        self._cpu.clear()

    def cpu_group(self, name: str | None = None) -> dist.ProcessGroup:
        """The gloo group for host metadata and objects over the world (``name`` None) or over this rank's group
        ``name`` (one of :data:`CPU_GROUPS`); see the module docstring for when it is a group of its own."""
        if name is not None:
            MeshLayout._dims(name)
            if name not in CPU_GROUPS:
                raise ConfigError(f"cpu_group({name!r}): expected one of {', '.join(CPU_GROUPS)} or None (the world)")
        if name not in self._cpu:
            raise RuntimeError(f"cpu_group {name!r}: this ProcessMesh was destroyed")
        return self._cpu[name]

    @property
    def parallel(self) -> ParallelConfig:
        return self.layout.parallel

    def group(self, name: str) -> dist.ProcessGroup:
        MeshLayout._dims(name)
        if name not in self._groups:
            raise RuntimeError(f"group {name!r}: this ProcessMesh was destroyed")
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group ``name``, sorted."""
        MeshLayout._dims(name)
        return list(self._ranks[name])

    def rank(self, name: str) -> int:
        """This rank's index inside its group ``name``."""
        return self.ranks(name).index(self.global_rank)

    def size(self, name: str) -> int:
        return self.layout.group_size(name)


def default_backend() -> str:
    """The default group's backend name (``gloo``, ``nccl``, or a per-device list such as ``cpu:gloo,cuda:nccl``)."""
    import torch.distributed as dist

    return str(dist.get_backend())


def _default_group_timeout() -> timedelta | None:
    """Collective timeout of the default group (torch has no public getter; None if unreadable)."""
    import torch
    import torch.distributed as dist

    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
