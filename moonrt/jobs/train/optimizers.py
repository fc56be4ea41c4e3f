"""The optimizers of ``moonrt train`` (job layer), built from the job's :class:`~moonrt.jobs.train.config.OptimConfig`.

``optim.optimizer = adamw`` (default): torch's AdamW; matrices (dim >= 2) get weight decay, vectors and the
modules the model names in its :meth:`~moonrt.parallel.model.TrainableModel.param_groups` (the embedding) do not.

``optim.optimizer = muon``: one :class:`moonrt.ops.muon.Muon` object with two kinds of groups:

- Muon groups: every matrix the model declares through :func:`moonrt.parallel.blocks.matrix_blocks`
  (``nn.Linear`` weights, Q/K/V up-projections cut per head, routed experts per expert), except the
  modules named in ``optim.muon_adamw_modules`` (the LM head). One group, weight decay ``weight_decay``.
- AdamW groups: everything else (embedding, norms, depthwise conv kernels, gate biases, the router,
  AttnRes queries, the LM head), with the AdamW job's decay rule.

Learning rate: both kinds share ``optim.lr`` and its schedule. With ``muon_adjust_lr = match_rms_adamw``
(the default; Moonlight, "Muon is Scalable for LLM Training") each block's orthogonalized update is scaled
by ``0.2 * sqrt(max(a, b))`` so its RMS is 0.2 -- the RMS of a typical AdamW update -- which is why the lr and
weight decay tuned for AdamW carry over unchanged and no second lr field is needed. ``original`` (Keller
Jordan's ``sqrt(max(1, a / b))``) gives updates of RMS ~``1 / sqrt(max(a, b))`` and would need a much larger
lr (the Muon literature uses ~0.02); moonrt does not add a field for it, use ``--lr`` accordingly.
"""

from __future__ import annotations

import torch

from moonrt.jobs.train.config import OptimConfig
from moonrt.ops.muon import Muon
from moonrt.parallel.blocks import MatrixBlocks, matrix_blocks
from moonrt.parallel.model import ParamGroups, default_param_groups


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The job's optimizer over ``model``'s trainable parameters (see the module docstring)."""
    if cfg.optimizer == "muon":
        return build_muon(model, cfg)
    groups = param_groups(model)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if groups.decays(name, p.dim()) else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)


def param_groups(model: torch.nn.Module) -> ParamGroups:
    """The model's weight-decay groups (its ``param_groups()``; a model without one: every ``nn.Embedding`` is
    exempt, :func:`~moonrt.parallel.model.default_param_groups`)."""
    own = getattr(model, "param_groups", None)
    return own() if callable(own) else default_param_groups(model)


def muon_blocks(model: torch.nn.Module, cfg: OptimConfig) -> dict[str, MatrixBlocks]:
    """Parameter name -> blocks of every parameter Muon updates (``named_parameters`` order).

    The model's declarations minus ``cfg.muon_adamw_modules``; with ``muon_per_head = False`` head cuts are
    dropped (whole matrices; stacked experts stay one matrix each).
    """
    out = {}
    for name, spec in matrix_blocks(model).items():
        if any(name == m or name.startswith(m + ".") for m in cfg.muon_adamw_modules):
            continue
        out[name] = spec if cfg.muon_per_head else MatrixBlocks(stack_dims=spec.stack_dims)
    return out


def build_muon(model: torch.nn.Module, cfg: OptimConfig) -> Muon:
    """Muon for the declared matrices, AdamW (same object, ``use_muon=False`` groups) for the rest."""
    blocks = muon_blocks(model, cfg)
    groups = param_groups(model)
    muon, decay, no_decay, spec_of = [], [], [], {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in blocks:
            muon.append(p)
            spec_of[p] = blocks[name]
        else:
            (decay if groups.decays(name, p.dim()) else no_decay).append(p)
    sets = [{"params": muon, "use_muon": True, "weight_decay": cfg.weight_decay},
            {"params": decay, "use_muon": False, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "use_muon": False, "weight_decay": 0.0}]
    return Muon([g for g in sets if g["params"]], lr=cfg.lr, momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov, adjust_lr_fn=cfg.muon_adjust_lr, ns_dtype=cfg.muon_ns_dtype,
                betas=(cfg.beta1, cfg.beta2), adamw_eps=1e-8, blocks=spec_of)
