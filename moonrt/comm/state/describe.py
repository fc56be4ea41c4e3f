"""Checkpoint state described once: what of the single-process state this rank holds, and the generic functions
over that description (gather into the single-process layout, scatter from it, the DCP save and load entries).

A :class:`StateDescription` answers, for one rank of a job, the only question checkpointing asks of the parallel
parts: which pieces of the single-process ``{"model", "optimizer"}`` state this rank holds, as tensors, :class:`Shard`
s and :class:`Boxes` over the single-process shapes by single-process name (the sharded-state names of
:mod:`moonrt.comm.state.shards`), which of them it writes (a copy another rank writes is left out), where the loaded
pieces go afterwards, and the full layout's names (the model keys and every optimizer param group's parameters, in
order). :meth:`moonrt.comm.parallelism.Parallelism.describe` starts from :func:`local_description` (every tensor
whole, ``optim.state`` the optimizer state) and lets every part refine it, innermost part first
(:meth:`moonrt.comm.parallelism.Part.describe`):

- expert parallelism restricts the routed experts to this rank's rows (``shards``);
- ZeRO replaces the optimizer pieces by its owned shards (flat ranges, Muon blocks) and how a load ends (``finish``);
- the pipeline restricts to this rank's stages (it holds only them already), names the full layout (``layout``:
  collective, every stage's names) and leaves the replicated pseudo-queries to their lowest pp rank (``not_saved``).

Then :func:`gather_full_state` (every rank's pieces assembled into the gathered ``checkpoint.pt`` layout: torch's
``optimizer.state_dict()`` numbering), :func:`scatter_full_state` (the reverse: each rank copies its pieces out
of a single-process state) and :meth:`StateDescription.entries` (the DCP save source and load target, then
``finish``) are the same code whatever the layout.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moonrt.comm.state.shards import MOMENTS, MOMENTUM, Boxes, Shard, finish_local_load, model_entries, optim_entries
from moonrt.ops.muon import Muon, step_count

Layout = tuple[list[str], list[list[str]]]
"""``(model keys, parameter names of every optimizer param group)`` of the single-process layout, in order."""


@dataclasses.dataclass
class StateDescription:
    """This rank's part of the single-process checkpoint state (see the module docstring).

    ``shards``: ``id(param) -> (single-process shape, first row)`` of the parameters this rank holds rows of (EP's
    home experts); ``optimizer(desc)``: this rank's optimizer-state entries (``optimizer.<name>.<key>``);
    ``finish(entries)``: after the entries were filled (DCP load or :func:`scatter_full_state`), put the loaded
    optimizer state where the optimizer reads it; ``layout()``: the full layout's names (may be collective: called
    on every rank at once); ``not_saved``: parameter names whose entries another rank writes.
    """

    model: nn.Module
    optim: torch.optim.Optimizer
    shards: dict[int, tuple[tuple[int, ...], int]]
    optimizer: Callable[[StateDescription], dict[str, Any]]
    finish: Callable[[dict[str, Any]], None]
    layout: Callable[[], Layout]
    not_saved: set[str] = dataclasses.field(default_factory=set)

    def entries(self, save: bool = False) -> dict[str, Any]:
        """The sharded state by single-process name: views of this rank's tensors (load targets; with ``save`` the
        save source, less the entries of :attr:`not_saved`)."""
        out = model_entries(self.model, self.shards) | self.optimizer(self)
        if save and self.not_saved:
            out = {k: v for k, v in out.items() if _param_of(k) not in self.not_saved}
        return out


def _param_of(key: str) -> str:
    """The parameter (or model key) an entry name is of: ``model.<k>`` -> k, ``optimizer.<n>.<key>`` -> n."""
    head, _, rest = key.partition(".")
    return rest if head == "model" else rest.rpartition(".")[0]


def local_description(model: nn.Module, optim: torch.optim.Optimizer) -> StateDescription:
    """One process's description: every tensor whole, the optimizer state in ``optim.state``
    (:func:`moonrt.comm.state.shards.optim_entries`, :func:`moonrt.comm.state.shards.finish_local_load`)."""
    name_of = {id(p): n for n, p in model.named_parameters()}

    def layout() -> Layout:
        return list(model.state_dict()), [[name_of[id(p)] for p in g["params"]] for g in optim.param_groups]

    return StateDescription(
        model=model, optim=optim, shards={},
        optimizer=lambda d: optim_entries(d.model, d.optim, d.shards),
        finish=lambda entries: finish_local_load(model, optim, entries),
        layout=layout)


def _muon(desc: StateDescription, groups: list[list[str]]) -> set[str]:
    """The parameters of the layout's ``use_muon`` groups (a momentum buffer, no AdamW moments): group ``g`` of the
    layout is group ``g`` of every rank's optimizer."""
    return {n for names, g in zip(groups, desc.optim.param_groups) if g.get("use_muon", False) for n in names}


def _check_optimizer(optim: torch.optim.Optimizer) -> None:
    """TypeError unless ``optim`` keeps a state layout the descriptions name (torch's AdamW, moonrt's Muon): the
    generic functions would lose another optimizer's state."""
    if not isinstance(optim, torch.optim.AdamW | Muon):
        raise TypeError(f"checkpoint state of a {type(optim).__name__} optimizer: expected torch.optim.AdamW or "
                        "moonrt.ops.muon.Muon (the state layouts moonrt.comm.state.shards names)")


# ---- pieces of an entry -------------------------------------------------------------------------------------------

def _pieces(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``(offsets, local tensor)`` of every box of a sharded-state value (a whole tensor: one box at 0)."""
    if isinstance(value, Boxes):
        return [(p.offsets, p.local) for p in value.parts]
    if isinstance(value, Shard):
        return [(value.offsets, value.local)]
    return [((0,) * value.dim(), value)]


def _shape(value: Any) -> tuple[int, ...]:
    """The single-process shape of a sharded-state value (a :class:`Shard` / :class:`Boxes`' ``shape``)."""
    return tuple(value.shape)


def _box(offsets: tuple[int, ...], shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


# ---- gather: every rank's pieces into the single-process layout ----------------------------------------------------

def gather_full_state(desc: StateDescription, group: Any = None) -> dict[str, Any]:
    """``{"model", "optimizer"}`` in the single-process layout, on every rank (collective over ``group``, the
    ranks whose pieces make the whole state: None, the default group): each rank's pieces (host copies) are
    all-gathered as objects and assembled by name (a tensor this rank holds whole is its own copy); the optimizer
    part is torch's ``optimizer.state_dict()`` of the single-process optimizer (AdamW parameters with step > 0:
    ``{step, exp_avg, exp_avg_sq}``, ``use_muon`` ones: ``{momentum_buffer}``; the param groups' hyperparameters
    are this rank's). ValueError naming the entry when the ranks' pieces do not cover it."""
    _check_optimizer(desc.optim)
    model_keys, groups = desc.layout()
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    mine = {k: (_shape(v), [(o, t.detach().to("cpu", copy=True) if multi else t.detach()) for o, t in _pieces(v)])
            for k, v in desc.entries().items()}  # one process: the tensors themselves, as ``state_dict()`` gives them
    if multi:
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        me = dist.get_rank(group)
        every = [mine, *every[:me], *every[me + 1:]]  # this rank's copy of a replicated tensor first: its own
    else:
        every = [mine]
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for rank_pieces in every:
        for k, (shape, pieces) in rank_pieces.items():
            if k in full and k not in covered:
                continue  # already whole (a replica's copy)
            for offsets, t in pieces:
                if k not in full and tuple(t.shape) == shape:
                    full[k] = t  # a whole copy: nothing to assemble
                    break
                if k not in full:
                    full[k] = torch.empty(shape, dtype=t.dtype)
                    covered[k] = torch.zeros(shape, dtype=torch.bool)
                full[k][_box(offsets, t.shape)] = t
                covered[k][_box(offsets, t.shape)] = True
            if k in covered and bool(covered[k].all()):
                del covered[k]
    for k, mask in covered.items():
        raise ValueError(f"state entry {k!r}: the ranks hold {int(mask.sum())} of its {mask.numel()} elements "
                         "(a description that leaves a piece to no rank)")
    model_sd = {k: full[f"model.{k}"] for k in model_keys}
    muon = _muon(desc, groups)
    state, param_groups, i = {}, [], 0
    for names, hyper in zip(groups, desc.optim.param_groups, strict=True):
        ids = []
        for n in names:
            step = float(full[f"optimizer.{n}.step"])
            shape = model_sd[n].shape
            if step > 0 and n in muon:
                state[i] = {MOMENTUM: full[f"optimizer.{n}.{MOMENTUM}"].view(shape)}
            elif step > 0:
                state[i] = {"step": step_count(step)} | {k: full[f"optimizer.{n}.{k}"].view(shape) for k in MOMENTS}
            ids.append(i)
            i += 1
        param_groups.append({**{k: v for k, v in hyper.items() if k != "params"}, "params": ids})
    return {"model": model_sd, "optimizer": {"state": state, "param_groups": param_groups}}


# ---- scatter: a single-process state into this rank's pieces -------------------------------------------------------

def _check_model(model_keys: list[str], model_sd: dict[str, Any], entries: dict[str, Any]) -> None:
    """KeyError naming the first key the saved model state lacks or has beyond ``model_keys``; ValueError naming the
    first of this rank's model entries whose saved tensor has another single-process shape."""
    if missing := [k for k in model_keys if k not in model_sd]:
        raise KeyError(f"model state lacks {missing[0]!r}")
    keys = set(model_keys)
    if extra := [k for k in model_sd if k not in keys]:
        raise KeyError(f"model state has {extra[0]!r}, which this model has not")
    for k, v in entries.items():
        if k.startswith("model.") and tuple(model_sd[k[6:]].shape) != _shape(v):
            raise ValueError(f"checkpoint {k[6:]}: shape {tuple(model_sd[k[6:]].shape)}, expected {_shape(v)} "
                             "(the single-process layout)")


def _flat_state(desc: StateDescription, state: dict[str, Any], layout: Layout) -> dict[str, torch.Tensor]:
    """A single-process ``{"model", "optimizer"}`` as whole sharded-state entries (moments flat, step counts 0-d
    fp64, absent state as zeros and step 0); ValueError naming the param group or the parameter whose saved state
    does not fit."""
    model_keys, groups = layout
    model_sd, optim_sd = state["model"], state["optimizer"]
    saved_groups = optim_sd["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"optimizer state: {len(saved_groups)} param groups, expected {len(groups)}")
    for g, (saved, names) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(names):
            raise ValueError(f"optimizer param_groups[{g}]: {len(saved['params'])} parameters, expected {len(names)}")
    flat = {f"model.{k}": model_sd[k] for k in model_keys}
    muon = _muon(desc, groups)
    i = 0
    for names in groups:
        for n in names:
            st, shape = optim_sd["state"].get(i) or {}, tuple(model_sd[n].shape)
            i += 1
            for key in (MOMENTUM,) if n in muon else MOMENTS:
                t = st.get(key)
                if t is not None and tuple(t.shape) != shape:
                    raise ValueError(f"checkpoint optimizer state of {n}: {key} shape {tuple(t.shape)}, "
                                     f"expected {shape}")
                whole = t if t is not None else torch.zeros(shape, dtype=model_sd[n].dtype)
                flat[f"optimizer.{n}.{key}"] = whole if n in muon else whole.reshape(-1)
            step = float(MOMENTUM in st) if n in muon else float(st["step"]) if "step" in st else 0.0
            flat[f"optimizer.{n}.step"] = step_count(step, torch.float64)
    return flat


def scatter_full_state(desc: StateDescription, state: dict[str, Any]) -> None:
    """Load a single-process-layout ``{"model", "optimizer"}`` (a gathered ``checkpoint.pt``, or
    :func:`gather_full_state`'s result) into this rank's pieces: each entry of :meth:`StateDescription.entries`
    copies its boxes out of the whole tensor, then :attr:`StateDescription.finish`; the param groups'
    hyperparameters become the saved ones. KeyError / ValueError before anything is loaded when the state does not
    fit (``checkpoint <name>: shape ..., expected ...`` for a tensor of another single-process shape)."""
    _check_optimizer(desc.optim)
    layout = desc.layout()
    entries = desc.entries()
    _check_model(layout[0], state["model"], entries)
    flat = _flat_state(desc, state, layout)
    with torch.no_grad():
        for k, v in entries.items():
            whole = flat[k]
            if whole.numel() != math.prod(_shape(v)):
                raise ValueError(f"checkpoint {_param_of(k)}: {k} holds {whole.numel()} elements, expected "
                                 f"{math.prod(_shape(v))}")
            whole = whole.reshape(_shape(v))
            for offsets, t in _pieces(v):
                t.copy_(whole[_box(offsets, t.shape)])
    for group, saved in zip(desc.optim.param_groups, state["optimizer"]["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    desc.finish(entries)


__all__ = ["Layout", "StateDescription", "gather_full_state", "local_description", "scatter_full_state"]
