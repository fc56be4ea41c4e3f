"""Matrix blocks: the seam through which a model tells its optimizer how each weight is cut into matrices.

Per-Head Muon (K3 report §2.7) orthogonalizes every head of the Q/K/V projections and every expert
separately. Which rows form a head is the model's knowledge, so the model declares it here and the
optimizer (``moonrt.ops.muon.Muon``), its distributed form (``moonrt.comm.zero.muon``) and the planner
(``moonrt.scheduler.muon_plan``) read it through :func:`matrix_blocks` -- nobody matches parameter names.

A module declares its blocked parameters with a method ``matrix_blocks(self) -> dict[str, MatrixBlocks]``
keyed by the parameter's name relative to the module (``"qkv_proj.weight"``, ``"w_gate"``). A method,
not an attribute on the tensor, because expert parallelism and checkpoint loading replace parameter
objects. Every ``nn.Linear`` weight not declared otherwise is one whole matrix; every other parameter
(embeddings, norms, biases, depthwise conv kernels, the router, AttnRes queries) is not a matrix.
"""

from __future__ import annotations

import dataclasses

from torch import nn


@dataclasses.dataclass(frozen=True, slots=True)
class MatrixBlocks:
    """How a parameter ``[*S, A, B]`` is cut into independent ``[a, b]`` matrices.

    ``stack_dims``: leading dims that stack matrices (routed experts ``[E, out, in]``: 1).
    ``head_dim``: when set, matrix axis ``axis`` (0: rows ``A``, 1: columns ``B``) is cut into heads of
    ``head_dim``; None: the ``[A, B]`` matrix is one block.
    """

    stack_dims: int = 0
    head_dim: int | None = None
    axis: int = 0


WHOLE = MatrixBlocks()
"""One 2-D matrix, one block."""


def matrix_blocks(model: nn.Module) -> dict[str, MatrixBlocks]:
    """Every matrix parameter of ``model`` (full dotted name) -> its blocks, in ``named_parameters`` order.

    ``nn.Linear`` weights default to :data:`WHOLE`; a module's ``matrix_blocks()`` declarations override.
    """
    found: dict[str, MatrixBlocks] = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(module, nn.Linear):
            found.setdefault(f"{prefix}weight", WHOLE)
        declare = getattr(module, "matrix_blocks", None)
        if callable(declare):
            for local, spec in declare().items():
                found[f"{prefix}{local}"] = spec
    return {name: found[name] for name, _ in model.named_parameters() if name in found}

