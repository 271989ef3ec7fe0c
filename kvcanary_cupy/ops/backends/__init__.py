"""One module per op and backend: ``_cpu`` (numba) and ``_cuda`` (CuPy RawKernels)."""
