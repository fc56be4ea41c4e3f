"""Kimi Delta Attention (K3_SYSTEMS §2): the public, fla-compatible API.

``kda_recurrent`` (the token recurrence, :mod:`.naive`, the reference every backend is tested against) and
``kda_chunk`` (the chunkwise-parallel form with its hand-written backward, :mod:`.chunk`) take fla's
``fused_recurrent_kda`` / ``chunk_kda`` arguments (:mod:`.contract`, :mod:`.fla_options`); ``kda_transition`` and
``kda_state_grad`` expose the chunk form's affine state map for KCP. Inside the package:

- ``contract``: the input contract shared by every backend (shapes, options, default scale, compute dtype);
- ``terms``: the chunk form's building blocks (batched per-chunk terms, decay sub-tiles, transitions);
- ``autograd``: ``ChunkKDA``, the chunk form's autograd node and its chunked backward;
- ``fla_options``: fla's keyword options applied as the same computation on the inputs;
- ``backends/``: the same math on other engines, chosen through :mod:`moonrt.ops.kernels`: ``numba`` (CPU
  elementwise work), ``triton`` (host side) and ``triton_kernels`` (the ``@triton.jit`` kernels).
"""

from moonrt.ops.kda.chunk import kda_chunk, kda_state_grad, kda_transition
from moonrt.ops.kda.contract import MIN_LOG_DECAY
from moonrt.ops.kda.fla_options import FlaOptions
from moonrt.ops.kda.naive import kda_recurrent
from moonrt.ops.kda.terms import (
    LOG_FLOOR,
    SUB_TILE,
    ChunkTerms,
    check_chunk_size,
    chunk_terms,
    chunk_transitions,
    log_decay_floor,
    sub_tile,
)

__all__ = ["ChunkTerms", "FlaOptions", "LOG_FLOOR", "MIN_LOG_DECAY", "SUB_TILE", "check_chunk_size", "chunk_terms",
           "chunk_transitions", "kda_chunk", "kda_recurrent", "kda_state_grad", "kda_transition", "log_decay_floor",
           "sub_tile"]
