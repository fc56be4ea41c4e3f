"""Packed MXFP4 export of a checkpoint (``moonrt checkpoint export --mxfp4``, written by
:func:`moonrt.jobs.checkpoint.cli.pack_mxfp4`) and its loader for evaluation (issue 33 item 3).

The weights the model family declares quantizable (:attr:`moonrt.models.spec.ModelSpec.qat_weights`; K3: the routed
and shared experts of every MoE layer) are written as the MXFP4 codes and scales that QAT's forward decodes
(:meth:`moonrt.ops.qat.QATScheme.quantize_weight`: E2M1 codes, blocks of the job's ``qat_block`` along the last
axis -- the GEMM's reduction axis --, E8M0 ``floor`` scales); every other tensor is written as ``export`` writes it.
For an exported tensor ``<base>.weight`` (``[..., n]``, e.g. HF's ``model.layers.i.mlp.experts.e.gate_proj.weight``;
a name without the ``.weight`` suffix, moonrt's stacked ``layers.i.moe.experts.w_gate``, appends to the whole name):

======================================  ========  =================================================================
name                                    dtype     contents
======================================  ========  =================================================================
``<base>.weight_packed``                uint8     ``[..., n / 2]``: two E2M1 codes a byte, element ``2j`` in the low
                                                  nibble, ``2j + 1`` in the high one (code bit 3 is the sign)
``<base>.weight_scale``                 uint8     ``[..., n / block]``: E8M0 scale bytes, ``2^(s - 127)``, 255 NaN
======================================  ========  =================================================================

The file's ``__metadata__`` adds ``moonrt_mxfp4`` (JSON: ``{"block", "scale_mode", "element": "e2m1", "tensors":
{exported name: [packed name, scale name, shape]}}``); ``moonrt_names`` still maps each exported (unpacked) name to
its moonrt name. Decoding (:func:`decode`) is ``value(code) * 2^(s - 127)`` in fp32: bitwise the weight the QAT
forward used (the fake-quantizer is the same codec round trip, :mod:`moonrt.ops.qat`). At K3's size the packed
experts take 4.25 bits a weight with block 32 (``moonrt mem-plan --qat mxfp4`` counts them).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from moonrt.jobs.checkpoint.job import JobBuilder
from moonrt.ops import mx
from moonrt.ops.qat import QATScheme


def decode(packed: torch.Tensor, scales: torch.Tensor, shape: list[int] | tuple[int, ...], block: int) -> torch.Tensor:
    """fp32 ``[shape]`` from ``packed [..., n / 2]`` and ``scales [..., n / block]`` (uint8, module docstring)."""
    q = mx.MXQuantized(packed, scales, "mxfp4", len(shape) - 1, block, torch.Size(shape))
    return q.dequantize(torch.float32)


@dataclasses.dataclass(frozen=True, slots=True)
class Exported:
    """A file :func:`load` read: ``state`` (moonrt names -> tensors, the quantized weights decoded, stacked experts
    stacked again: a ``model.state_dict()``), the job ``config`` (plain data), the ``step``, and ``scheme`` (None
    for a file written without ``--mxfp4``)."""

    state: dict[str, torch.Tensor]
    config: dict[str, Any]
    step: int
    scheme: QATScheme | None


def load(path: str | Path) -> Exported:
    """Read an ``export`` file (with or without ``--mxfp4``): decode the packed weights and map every name back to
    moonrt's (:func:`moonrt.jobs.checkpoint.cli.from_hf`). ValueError naming the file for one that is not a moonrt
    export."""
    from safetensors import safe_open

    from moonrt.jobs.checkpoint.cli import from_hf

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if "moonrt_names" not in meta:
            raise ValueError(f"{str(path)!r}: no moonrt_names metadata; expected a moonrt checkpoint export")
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    scheme = None
    if "moonrt_mxfp4" in meta:
        info = json.loads(meta["moonrt_mxfp4"])
        scheme = QATScheme(block=info["block"], scale_mode=info["scale_mode"])
        for name, (p, s, shape) in info["tensors"].items():
            tensors[name] = decode(tensors.pop(p), tensors.pop(s), shape, info["block"])
    state = from_hf(tensors, json.loads(meta["moonrt_names"]))
    return Exported(state, json.loads(meta["moonrt_config"]), int(meta["moonrt_step"]), scheme)


def eval_model(path: str | Path, builder: JobBuilder) -> tuple[torch.nn.Module, Any]:
    """The model of an export file, ready to evaluate: built from the file's job config by ``builder`` (the job
    layer's, :data:`moonrt.jobs.train.resume.BUILDER`), its weights loaded (the quantized ones decoded), QAT switched
    on with the file's scheme when it is an ``--mxfp4`` export (the fake quantizer leaves decoded MXFP4 weights
    unchanged and quantizes the activations as training did). Returns ``(model, job config)``."""
    exported = load(path)
    job = builder.read(exported.config)
    job.qat = "none"  # built plain, then the file's scheme (its block) switched on
    model = builder.model(job)
    model.load_state_dict(exported.state, strict=True)
    if exported.scheme is not None:
        job.model_spec().quantizable(model).enable_qat(exported.scheme)
    return model, job


__all__ = ["Exported", "decode", "eval_model", "load"]
