"""Helpers of the memory tests (``from memory.helpers import ...``): the stand-in model the activation-manager tests
run every policy on (:class:`Stack` of :class:`Block`), one forward and backward under a policy (:func:`_run`,
:func:`_run_mgr`), a policy from keywords (:func:`_policy`), and the files a process holds open under a directory
(:func:`_open_files_under`)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from moonrt.config import from_dict
from moonrt.memory.manager import ActivationManager
from moonrt.memory.policy import MemoryPolicy


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.ffn(x)


class Stack(nn.Module):
    def __init__(self, d: int = 128, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _run(policy: MemoryPolicy | None, dtype=torch.float32, seed: int = 0, device: torch.device | str = "cpu"):
    torch.manual_seed(seed)
    model = Stack().to(dtype).to(device)
    x = torch.randn(4, 16, 128, dtype=dtype).to(device).requires_grad_()
    if policy is None:
        loss = model(x).float().square().mean()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()], None
    mgr = ActivationManager(model, policy)
    with mgr:
        loss = model(x).float().square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    acc = mgr.accounting
    mgr.close()
    return grads, acc


def _policy(**kw) -> MemoryPolicy:
    return from_dict(MemoryPolicy, kw)


def _run_mgr(policy: MemoryPolicy, steps: int = 1, **kw):
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(4, 16, 128, requires_grad=True)
    mgr = ActivationManager(model, policy, **kw)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with mgr:
            loss = model(x).float().square().mean()
        loss.backward()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    return grads, mgr


def _open_files_under(pid: int, directory: Path) -> list[str]:
    """Targets of ``pid``'s open descriptors that lie in ``directory`` (Linux ``/proc``)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    out = []
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(directory) + "/"):
            out.append(target)
    return out
