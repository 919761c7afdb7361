"""The Numba flags of every kernel, in one place (STUMPY's habit).

fastmath stays False: it would let LLVM contract a*b+c into an FMA and reassociate sums, and the
specified arithmetic (docs/kernels.md) would no longer be what runs -- the GPU could not match it.
error_model="numpy" drops Python's ZeroDivisionError checks from the inner loops (every divisor in
the kernels is checked or a nonzero constant). boundscheck stays off: the wrappers validate sizes.
"""

JIT = dict(nogil=True, fastmath=False, boundscheck=False, error_model="numpy")
