"""A weight in engine form, and the one activation object that feeds many weights.

`Weight` is a named GGML tensor the kernels read in place: `raw` is a uint8 view (of pool.bin, of
the mapped GGUF, or of the BF16 bits re-rounded at load), `shape` is in GGUF order (shape[0] = ne0,
the contiguous row length), so `W x` maps n_in = shape[0] features to n_out = prod(shape[1:]).

`Input` is QUANTIZE ONCE, MULTIPLY MANY: block-type weights read activations as ActQ (S10: one
quantizer, CPU and GPU alike), and every weight that reads the same vector (q/k/v, gate/up of all
routed experts and the shared expert) must read the same ActQ; making it once per vector is both
the speed and the guarantee. The query/key projections of the types in actq.WIDE read the wide
form (ActQ16, 16 bits per activation; actq.reads_wide), made once per vector as well.
"""

from __future__ import annotations

from math import prod

import numpy as np

from strata.index_format.ggml_types import GGMLType, ggml_type

from .kernels import cpu
from .kernels.actq import ActQ, ActQ16, quantize_act, quantize_act16, reads_wide
from .kernels.reference import dequantize

F32 = np.float32


class Input:
    """One f32 activation vector [n] (or rows [T, n]) and, made on first need, its ActQ.

    Call `set(x)` (or write into `.x` and call `changed()`) for each new vector; the f32 buffer is
    the caller's scratch, kept, and the ActQ is dropped so it is remade from the new values."""

    __slots__ = ("x", "_q", "_q16", "version")

    def __init__(self, x: np.ndarray, q: ActQ | None = None):
        """q: x's ActQ when its maker quantized the rows as it wrote them (hyper.py's fused norm)."""
        if x.dtype != F32:
            raise TypeError(f"Input: activations must be float32, got {x.dtype}")
        self.x = x
        self._q = q
        self._q16 = None
        self.version = 0  # counts new values: the GPU tier uploads a vector once per version

    def set(self, x: np.ndarray) -> Input:
        self.x[...] = x
        return self.changed()

    def changed(self) -> Input:
        self._q = self._q16 = None
        self.version += 1
        return self

    def form(self, t: GGMLType, wide: bool = False, quantize=None):
        """What a weight of type `t` multiplies: the f32 values for float types, else the ActQ, or
        the ActQ16 where `wide` (the weight's Weight.wide). `quantize`: where the values are not host
        arrays, their device's quantizer, quantize(x, wide) (the GPU's ActQ kernels give the host
        quantizers' bits, engine/kernels/gpu.py)."""
        if not t.quantized:
            return self.x
        if wide:
            if self._q16 is None:
                self._q16 = quantize_act16(self.x, where="Input") if quantize is None else quantize(self.x, True)
            return self._q16
        if self._q is None:
            self._q = quantize_act(self.x, where="Input") if quantize is None else quantize(self.x, False)
        return self._q


class Weight:
    """A tensor the kernels multiply: name, shape (GGUF order), GGML type id, raw bytes."""

    __slots__ = ("name", "shape", "type", "raw", "n_in", "n_out", "device", "wide")

    def __init__(self, name: str, shape: tuple[int, ...], type_id: int, raw: np.ndarray):
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.type = ggml_type(type_id, where=f"weight {name}")
        need = self.type.nbytes(self.shape)
        if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != need:
            raise ValueError(f"weight {name}: {self.type.name} {list(self.shape)} is {need} bytes, "
                             f"got {raw.dtype}[{raw.size}]")
        self.raw = raw
        self.wide = reads_wide(self.type, name)  # it multiplies the wide form (actq.reads_wide)
        self.n_in = self.shape[0]
        self.n_out = prod(self.shape[1:])
        # this weight's GpuWeight once the GPU tier placed it on the device: the tier's backend
        # multiplies it there, bit for bit the CPU kernels' result (engine/tier/backend.py)
        self.device = None

    @property
    def type_id(self) -> int:
        return self.type.id

    def _act(self, x):
        return x.form(self.type, self.wide) if isinstance(x, Input) else x

    def matvec(self, x, out: np.ndarray | None = None) -> np.ndarray:
        """y = W x -> f32 [n_out]; x: an Input, an ActQ (block types) or f32 [n_in] (float types)."""
        act = self._act(x)
        if self.type.quantized and not isinstance(act, (ActQ, ActQ16)):
            act = quantize_act16(act, where=f"weight {self.name}") if self.wide else quantize_act(act, where=f"weight {self.name}")
        return cpu.matvec(self.raw, self.type.id, self.n_in, self.n_out, act, out)

    def matmul(self, X, out: np.ndarray | None = None) -> np.ndarray:
        """Y = X W^T -> f32 [T, n_out] for X f32 [T, n_in] (or an Input / ActQ of T rows)."""
        act = self._act(X)
        if self.type.quantized and not isinstance(act, (ActQ, ActQ16)):
            act = quantize_act16(act, where=f"weight {self.name}") if self.wide else quantize_act(act, where=f"weight {self.name}")
        return cpu.matmul(self.raw, self.type.id, self.n_in, self.n_out, act, out)

    def f32(self) -> np.ndarray:
        """A dequantized copy in numpy order ([ne1, ne0] for 2-D): for small tensors, made once at load."""
        values = dequantize(self.raw, self.type.id, prod(self.shape))
        return values.reshape(self.shape[::-1])

    def rows(self, start: int, stop: int) -> np.ndarray:
        """The raw bytes of rows [start, stop) (a view): an embedding lookup reads one row."""
        row = self.type.row_bytes(self.n_in)
        return self.raw[start * row : stop * row]

    def __repr__(self) -> str:
        return f"Weight({self.name}, {self.type.name} {list(self.shape)})"
