"""The optimizers of ``moonrt train`` (job layer): which parameters get weight decay, built from the job's
:class:`~moonrt.job.OptimConfig`."""

from __future__ import annotations

import torch

from moonrt.job import OptimConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; matrices (dim >= 2, except the embedding) get weight decay, vectors and embedding do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and not name.startswith("embed") else no_decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8)
