"""Random but valid GGML weights for the kernel tests (imported by test_kernels_*.py).

Random bytes everywhere except the fp16 scales, which are finite and moderate (random bytes
there would be NaN/inf now and then, and no quantizer writes those), with a few subnormal
halves so the fp16 -> f32 conversion is exercised at the bottom of its range.

Not tools/synth_blocks.random_blocks, on purpose: that one makes blocks a model could hold (mins tied
to scales, sub-scales in their usual range, one RMS), so it never feeds a decoder an arbitrary
sub-scale, min or sign field, nor a subnormal scale; a kernel test wants exactly those, every
field's bits as random as the format allows."""

from __future__ import annotations

import numpy as np

from strata.index_format.ggml_types import GGMLType


def _halves(rng: np.random.Generator, shape) -> np.ndarray:
    v = (rng.standard_normal(shape) * 0.05).astype(np.float16)
    tiny = rng.random(shape) < 0.02
    v[tiny] = np.float16(3e-6)  # subnormal in fp16
    return v


def random_weights(t: GGMLType, n_elements: int, rng: np.random.Generator) -> np.ndarray:
    """n_elements of type t as raw GGUF bytes (uint8, flat)."""
    if not t.quantized:
        v = (rng.standard_normal(n_elements) * 0.05).astype(np.float32)
        if t.name == "F32":
            return v.view(np.uint8)
        if t.name == "F16":
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # BF16
    n_blocks = n_elements // t.block_size
    raw = rng.integers(0, 256, size=(n_blocks, t.type_size), dtype=np.uint8)
    for off, n in t.fp16_fields:
        raw[:, off : off + 2 * n] = _halves(rng, (n_blocks, n)).view(np.uint8)
    if t.name == "IQ1_M":  # its fp16 scale is the top nibble of each of the four scale words
        d = np.abs(_halves(rng, n_blocks)).view(np.uint16)
        words = raw[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i in range(4):
            words[:, i] |= ((d >> np.uint16(4 * i)) & np.uint16(15)) << np.uint16(12)
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(-1)
