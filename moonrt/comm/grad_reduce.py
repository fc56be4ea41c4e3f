"""The gradient sums over ranks, in the job's reduce dtype (``precision.reduce``, ``--reduce-dtype``; K3_SYSTEMS §11).

Every cross-rank sum of parameter gradients goes through :func:`all_reduce_grad` or :func:`reduce_scatter_grad`:
the default data-parallel all-reduce (:meth:`moonrt.comm.parallelism.Parallelism.sync_grads`), the expert-parallel
part's per-group sums (:mod:`moonrt.comm.ep.parallel`), the ZeRO core's bucket reduce-scatter
(:mod:`moonrt.comm.zero.core`) and the pipeline's sum of the pseudo-query gradients over its stages
(:mod:`moonrt.comm.pp.part`). Each takes the dtype the sum travels in, :attr:`Precision.reduce_dtype
<moonrt.comm.parallelism.Precision.reduce_dtype>`, which :meth:`Parallelism.sync_grads
<moonrt.comm.parallelism.Parallelism.sync_grads>` hands to the parts.

``fp32`` (the default): the fp32 gradient is summed as it is (one collective, no copy; what every job did before
the option existed). ``bf16`` (Megatron's ``--grad-reduce-in-bf16``, torchtitan's
``MixedPrecisionPolicy.reduce_dtype``): the gradient is cast to bf16 (round to nearest), the collective sums bf16
tensors, and the result is written back into the fp32 gradient (or fp32 shard). The sum itself is then bf16
arithmetic, as NCCL's bf16 sum is: every addition the collective does rounds its result to bf16 (gloo adds two
``c10::BFloat16`` values in fp32 and rounds the sum to bf16, so two ranks give exactly ``bf16(bf16(a) + bf16(b))``;
with more ranks the order of the additions is the collective's algorithm's), so a summed element carries one bf16
rounding per input and per addition. Half the wire bytes, at that cost in accuracy. Norms, loss scalars and router
statistics are never summed here (they stay fp32/fp64). bf16 is a dtype NCCL's sums support (``ncclBfloat16``), as
gloo's do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""The dtypes a job may sum gradients in (``precision.reduce``, ``--reduce-dtype``) and their torch dtypes."""


def _narrower(dtype: torch.dtype, grad: torch.dtype) -> bool:
    """Whether summing in ``dtype`` rounds gradients of dtype ``grad``: only a reduce dtype narrower than fp32
    (bf16) is a cast; the default fp32 sums every gradient in its own dtype (fp64 gradients of a float64 reference
    run stay fp64, never rounded to fp32)."""
    return dtype != torch.float32 and torch.finfo(dtype).bits < torch.finfo(grad).bits


def all_reduce_grad(grad: torch.Tensor, group: Any, dtype: torch.dtype = torch.float32) -> None:
    """Sum ``grad`` in place over ``group`` (None: the default group), sent and summed in ``dtype``: ``grad``'s own
    dtype, or a wider one, sums it directly; a narrower dtype sums a cast copy and writes the result back into
    ``grad``. A group of one rank sums nothing: ``grad`` is left as it is (no cast, no rounding)."""
    if dist.get_world_size(group) == 1:
        return
    if not _narrower(dtype, grad.dtype):
        dist.all_reduce(grad, group=group)
        return
    wire = grad.to(dtype)
    dist.all_reduce(wire, group=group)
    grad.copy_(wire)


def reduce_scatter_grad(out: torch.Tensor, flat: torch.Tensor, group: Any, dtype: torch.dtype = torch.float32) -> None:
    """Sum ``flat [n * S]`` over the ``n`` ranks of ``group`` and leave this rank's ``[S]`` piece of the sum in
    ``out``, sent and summed in ``dtype`` (``flat``'s own dtype: directly into ``out``; another dtype: a cast copy of
    ``flat`` is reduce-scattered into a ``dtype`` buffer that is then copied into ``out``). A group of one rank:
    ``out`` is ``flat``, copied as it is."""
    if dist.get_world_size(group) == 1:
        out.copy_(flat)
        return
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if flat.dtype == out.dtype and not _narrower(dtype, flat.dtype):
        fn(out, flat, group=group)
        return
    wire = torch.empty_like(out, dtype=dtype)
    fn(wire, flat.to(dtype), group=group)
    out.copy_(wire)
