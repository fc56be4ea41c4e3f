"""The kernel op ``moonep_greedy`` (MoonEP's greedy placement, K3_SYSTEMS §6.2): its torch, numba and Triton backends
return the same ``alloc3`` bit for bit, and that placement conserves every expert's load and meets every rank's
target exactly (the theorem's balance). Triton runs under its interpreter on CPU (the ``triton_kernels`` fixture),
on the GPU with ``MOONRT_TEST_DEVICE=cuda``. The planner-level equality with ``moonep.plan`` on the adversarial
corpus is in tests/scheduler/test_moonep_corpus.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moonrt.ops import kernels
from moonrt.ops.moonep.greedy import greedy_numba, greedy_torch
from moonrt.scheduler.moonep import capacities
from moonrt.scheduler.workload import synthetic


def _cases() -> list[np.ndarray]:
    """``[R, G]`` loads: random small shapes of several skews, all-zero, one hot expert, K3's shape and E = 2,050."""
    rng = np.random.default_rng(7)
    out = []
    for i in range(24):
        R, G = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        p = rng.lognormal(0, [0.1, 1.0, 3.0][i % 3], R * G)
        out.append(rng.multinomial(int(rng.integers(0, 400)), p / p.sum()).reshape(R, G))
    out.append(np.zeros((4, 3), np.int64))
    hot = np.zeros((4, 2), np.int64)
    hot[1, 1] = 64
    out.append(hot)
    for E, R in ((896, 64), (2050, 41)):
        wl = synthetic("zipf", num_experts=E, num_ranks=R, top_k=16, tokens_per_rank=512, steps=1, layers=1, seed=3)
        out.append(wl.counts[0, 0].sum(0).reshape(R, E // R))
    return [c.astype(np.int64) for c in out]


def _check_balance(load: torch.Tensor, cap: torch.Tensor, alloc3: torch.Tensor) -> None:
    """Every expert's load is placed whole, every rank computes exactly its target, nothing negative."""
    assert alloc3.dtype == torch.int64 and alloc3.shape == (*load.shape, load.shape[0])
    assert (alloc3 >= 0).all()
    torch.testing.assert_close(alloc3.sum(2), load, rtol=0, atol=0)
    torch.testing.assert_close(alloc3.sum((0, 1)), cap, rtol=0, atol=0)


def test_torch_and_numba_backends_equal() -> None:
    for load in _cases():
        lt = torch.from_numpy(load)
        cap = torch.from_numpy(capacities(int(load.sum()), load.shape[0]))
        a = greedy_numba(lt, cap)
        _check_balance(lt, cap, a)
        assert torch.equal(greedy_torch(lt, cap), a), load.shape


def test_triton_backend_equals_numba(triton_kernels) -> None:
    mt = triton_kernels.load("moonrt.ops.moonep.triton")
    dev = triton_kernels.device
    for load in _cases():
        lt = torch.from_numpy(load)
        cap = torch.from_numpy(capacities(int(load.sum()), load.shape[0]))
        got = mt.greedy(lt.to(dev), cap.to(dev))
        assert got.device.type == dev.type
        assert torch.equal(got.cpu(), greedy_numba(lt, cap)), load.shape


def test_triton_backend_refuses_oversized_groups(triton_kernels) -> None:
    mt = triton_kernels.load("moonrt.ops.moonep.triton")
    load = torch.zeros(2, 1 << 16, dtype=torch.int64, device=triton_kernels.device)
    with pytest.raises(ValueError, match=r"load: shape \[R, G\] = \[2, 65536\].*kernels.moonep: torch"):
        mt.greedy(load, torch.zeros(2, dtype=torch.int64, device=triton_kernels.device))


def test_registry_routes_the_greedy_by_device() -> None:
    """``auto``: numba on CPU, Triton on CUDA, torch elsewhere; config key ``kernels.moonep``."""
    reg = kernels.default_registry()
    assert reg.choose("moonep_greedy", "auto", "cpu").name == "numba"
    assert reg.choose("moonep_greedy", "auto", "cuda").name == "triton"
    assert reg.choose("moonep_greedy", "auto", "meta").name == "torch"
    assert kernels.OPS["moonep_greedy"] == "moonep" and kernels.check_choice("moonep", "torch") == "torch"
    with pytest.raises(ValueError, match=r"kernels.moonep = 'numba': the numba backend of moonep_greedy runs on cpu"):
        reg.choose("moonep_greedy", "numba", "cuda")
