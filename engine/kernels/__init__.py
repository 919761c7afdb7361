"""strata.engine.kernels: the engine form of each GGML block type, ActQ, CPU (Numba) and GPU (CuPy) kernels."""
