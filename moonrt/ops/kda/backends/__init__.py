"""KDA on other engines, the same math as :mod:`moonrt.ops.kda.chunk` (registered in :mod:`moonrt.ops.kernels`):
``numba`` (the chunk form's elementwise work on CPU), ``triton`` (host code: launches, autograd) and
``triton_kernels`` (the ``@triton.jit`` kernels)."""
