"""bf16 mixed precision keeps the numerics rule: inside a bf16 autocast region (``Precision("bf16")``, what
``moonrt train --dtype bf16`` runs every forward in) the KDA state chain, the router's logits and top-k, the AttnRes
softmax and the loss compute in fp32, while the projections do run in bf16; parameters and gradients stay fp32.

The dtypes are read from the calls themselves: a ``TorchFunctionMode`` records every torch call made during one
forward and backward of a model, with the dtype of its result and the function of moonrt's code that issued it
(the nearest frame of a file under ``moonrt/``), so an island that computes in bf16 and casts its result back up
would be seen. An fp64 input stays fp64 inside an island (the islands lift to at least fp32, never narrow).
"""

from __future__ import annotations

import pytest
import torch
from model.helpers import Calls

from moonrt.comm.parallelism import Parallelism, Precision
from moonrt.jobs.train.assemble import build_model
from moonrt.jobs.train.config import JobConfig
from moonrt.ops.precision import at_least_fp32, fp32_island, token_loss_sum


def _step(model_name: str, compute: str) -> tuple[torch.nn.Module, Calls, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(JobConfig(model=model_name))
    rt = Parallelism(precision=Precision(compute))
    x, y = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    with Calls() as calls:
        loss = rt.forward_backward(model, x, y, 1.0 / y.numel())
    return model, calls, loss


def _dtypes(calls: Calls, stem: str, fn: str) -> set[torch.dtype]:
    return set().union(*calls.seen[(stem, fn)].values())


def test_k3_bf16_islands_compute_in_fp32_and_the_projections_in_bf16() -> None:
    model, calls, loss = _step("k3_tiny", "bf16")
    fp32 = {torch.float32}
    # the numerics rule's islands: every math call made in them has an fp32 result
    assert calls.seen[("moe", "forward")]["matmul"] == fp32  # router logits x W_r^T
    assert calls.seen[("moe", "forward")]["topk"] == fp32  # top-k over the biased scores
    assert _dtypes(calls, "attnres", "mix") == fp32 and calls.seen[("attnres", "mix")]["softmax"] == fp32
    assert _dtypes(calls, "autograd", "forward") == fp32  # ChunkKDA: the chunked state chain
    assert _dtypes(calls, "terms", "chunk_transitions") == fp32
    assert calls.seen[("precision", "token_loss_sum")]["cross_entropy"] == fp32 and loss.dtype == torch.float32
    # autocast is really on outside them: the projections (nn.Linear) run in bf16
    assert calls.seen[("kda_layer", "forward")]["linear"] == {torch.bfloat16}
    assert calls.seen[("mla", "forward")]["linear"] == {torch.bfloat16}
    # the fp32 master weights: parameters and every gradient fp32
    assert {p.dtype for p in model.parameters()} == fp32
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == fp32


def test_kda_inside_autocast_equals_fp32_bitwise_forward_and_backward() -> None:
    """The KDA op (and its backward, which the pipeline runs inside the autocast region) under bf16 autocast gives
    exactly the fp32 results: nothing in it was rounded to bf16. (A TorchFunctionMode does not see backward code.)"""
    torch.manual_seed(0)
    B, T, H, K = 1, 40, 2, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, T, H, K), torch.rand(B, T, H)
    g = -torch.rand(B, T, H, K)
    from moonrt.ops.kda import kda_chunk

    def run(autocast: bool) -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o, _ = kda_chunk(*leaves, chunk_size=16)
            o.square().sum().backward()
        return [o.detach()] + [t.grad for t in leaves]

    ref, got = run(False), run(True)
    assert all(r.dtype == torch.float32 and torch.equal(r, x) for r, x in zip(ref, got))


def test_fp32_runs_no_bf16_anywhere() -> None:
    _, calls, _ = _step("k3_tiny", "fp32")
    assert set().union(*(d for per in calls.seen.values() for d in per.values())) == {torch.float32}


def test_dense_bf16_loss_is_fp32_and_its_projections_bf16() -> None:
    model, calls, loss = _step("dense_tiny", "bf16")
    assert calls.seen[("precision", "token_loss_sum")]["cross_entropy"] == {torch.float32}
    assert loss.dtype == torch.float32
    assert torch.bfloat16 in set().union(*(d for per in calls.seen.values() for d in per.values()))
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def test_islands_lift_to_at_least_fp32_and_never_narrow() -> None:
    @fp32_island
    def dtypes(*xs: torch.Tensor) -> list[torch.dtype]:
        return [(x @ x.T).dtype for x in xs]

    a = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ a.T).dtype == torch.bfloat16  # autocast on
        assert dtypes(a.bfloat16(), a, a.double()) == [torch.float32, torch.float32, torch.float64]
        assert token_loss_sum(a.bfloat16(), torch.zeros(4, dtype=torch.long)).dtype == torch.float32
    assert dtypes(a.bfloat16()) == [torch.bfloat16]  # outside autocast: the dtypes as given
    assert at_least_fp32(a.double()).dtype == torch.float64 and at_least_fp32(a.half()).dtype == torch.float32


def test_precision_names_the_field_on_an_unknown_dtype() -> None:
    with pytest.raises(ValueError, match=r"precision.compute = 'fp16': expected one of fp32, bf16"):
        Precision("fp16")
