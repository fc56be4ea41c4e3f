"""Pure tensor math, the bottom layer: KDA (``kda``: the token recurrence, the chunk form and
``kda_transition``), the block-wise FP8 codec (``fp8``), the GLU activations (``glu``), RMSNorm (``rmsnorm``) and
the routed experts (``grouped``: one GLU expert, the grouped-expert op over ``cu_seqlens`` segments, the MoE
reference).

These modules import only torch / numpy / numba and ``moonrt.ops`` itself (no ranks, no process
groups, no model classes), so the model, the runtime and the benchmarks all share one copy
(``tests/test_import_direction.py`` enforces it). The Triton kernels (``*_triton``) import Triton too; they are
reached only through the kernel-backend registry (``kernels``), which imports a backend when it is chosen."""
