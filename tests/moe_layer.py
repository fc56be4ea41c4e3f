"""A one-layer model around the k3_tiny LatentMoE, for tests that apply expert parallelism to it."""

from __future__ import annotations

import torch
from torch import nn

from moonrt.models.k3.model.config import k3_tiny
from moonrt.models.k3.model.moe import LatentMoE


class OneLayer(nn.Module):
    """A model with one MoE layer (what ``ExpertParallel.parallelize`` looks for); seeded init."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.moe = LatentMoE(k3_tiny())

    def moe_layers(self) -> list[tuple[int, nn.Module]]:
        return [(1, self.moe)]
