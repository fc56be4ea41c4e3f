"""MoonEP's greedy placement as a kernel op (K3_SYSTEMS §6.2), ``moonep_greedy`` in :mod:`moonrt.ops.kernels`:
``greedy`` (the contract and its torch and numba backends) and ``triton`` (the same passes as Triton kernels, bit for
bit)."""
