"""Pack form -> engine form (S3): exact widenings the loader applies before any kernel sees a tensor.

1. Block types whose scales are fp16 are WIDENED: the fp16 run of every block (the table's
   `fp16_fields`) moves to an f32 plane [n_blocks, n_scales]; the other bytes stay as they are, in
   order, in `rest` [n_blocks, rest_bytes]. fp16 -> f32 is exact, so `narrow` gives the pack bytes
   back bit for bit. IQ1_M has no plain fp16 field (its scale is spread over four nibbles) and
   F32/F16/BF16 have no block scales: for those nothing is widened (n_scales = 0).
2. A BF16 source tensor is stored in the pack as F32 (lossless, keeps the pack decoder simple);
   `rebf16` takes it back to 16 bits. That is exact only because the value came from 16 bits; a
   value with nonzero low bits means the pack is not what it claims, and is refused.

Budgets read `widened_bytes` (what widening adds), never an assumed 4 bytes per scale.
"""

from __future__ import annotations

import functools

import numpy as np

from strata.index_format.ggml_types import GGMLType, ggml_type

F16_TO_F32 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
F16_TO_F32.setflags(write=False)


def _fp16_columns(t: GGMLType) -> np.ndarray:
    """Byte columns of a block that hold its fp16 run(s), in field order."""
    cols = [np.arange(off, off + 2 * n) for off, n in t.fp16_fields]
    return np.concatenate(cols) if cols else np.zeros(0, np.int64)


def _rest_columns(t: GGMLType) -> np.ndarray:
    return np.setdiff1d(np.arange(t.type_size), _fp16_columns(t))  # sorted: original byte order


def _label(t: GGMLType, name: str | None) -> str:
    return f"{name} ({t.name})" if name else t.name


def widen(raw: np.ndarray, type_id: int, name: str | None = None, scales: np.ndarray | None = None,
          rest: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks -> (scales f32 [n_blocks, n_scales], rest uint8 [n_blocks, rest_bytes]), written
    into `scales` and `rest` when given (contiguous, that many elements: the GPU tier's pinned
    staging, engine/kernels/gpu.py `place`).

    A non-finite fp16 scale is refused: no quantizer writes one, so the bytes are not a tensor."""
    t = ggml_type(type_id, where=f"widen {name or ''}".strip())
    if raw.dtype != np.uint8 or raw.size % t.type_size:
        raise ValueError(f"widen {_label(t, name)}: {raw.size} bytes of {raw.dtype} are not whole {t.type_size}-byte blocks")
    blocks = np.ascontiguousarray(raw).reshape(-1, t.type_size)
    nb = blocks.shape[0]
    scales = np.empty((nb, t.n_scales), np.float32) if scales is None else _plane(scales, np.float32, nb, t.n_scales, t, name)
    rest = np.empty((nb, t.rest_bytes), np.uint8) if rest is None else _plane(rest, np.uint8, nb, t.rest_bytes, t, name)
    # Straight into the outputs, with each type's column runs worked out once. numpy's form before
    # (the runs and the columns found again at every call, the scales gathered byte by byte, then
    # the caller's copy into the pinned staging) ran at 0.7-1.3 GB/s on an expert's three tensors,
    # and that rate is what streaming an expert to the device for a prompt chunk costs
    # (engine/tier/staging.py: the H200's host widened seed-4l's experts at 0.71 GB/s, so a chunk
    # streamed only the experts routed 316+ of its tokens, none of a 256-token chunk's).
    runs, fields = _runs(t.id)
    at = 0
    for first, n in runs:
        np.copyto(rest[:, at : at + n], blocks[:, first : first + n])
        at += n
    k = 0
    for off, n in fields:
        halves = blocks.view(np.uint16)[:, off // 2 : off // 2 + n] if t.type_size % 2 == 0 and off % 2 == 0 else \
            np.ascontiguousarray(blocks[:, off : off + 2 * n]).view(np.uint16)  # (every type's are aligned)
        scales[:, k : k + n] = F16_TO_F32[halves]  # exact, as numpy's astype from float16
        k += n
    if t.n_scales:
        bad = ~np.isfinite(scales)
        if bad.any():
            blk, k = np.argwhere(bad)[0]
            raise ValueError(f"widen {_label(t, name)}: block {blk} fp16 scale {k} is {scales[blk, k]} (expected a finite scale)")
    return scales, rest


WIDEN_SKIP = -(1 << 20)  # widen_columns: a byte that goes nowhere (an fp16 scale's high byte)


def widen_columns(t: GGMLType) -> np.ndarray:
    """`widen`'s layout byte by byte, for the device's widen (dev_widen): col[c] for byte c of a
    block is its column of the rest (>= 0), -1 - k for the low byte of fp16 scale k, or WIDEN_SKIP."""
    col = np.full(t.type_size, WIDEN_SKIP, np.int32)
    rest = _rest_columns(t)
    col[rest] = np.arange(rest.size, dtype=np.int32)
    col[_fp16_columns(t)[0::2]] = -1 - np.arange(t.n_scales, dtype=np.int32)
    return col


def _plane(out: np.ndarray, dtype, rows: int, cols: int, t: GGMLType, name: str | None) -> np.ndarray:
    if out.dtype != dtype or out.size != rows * cols or not out.flags.c_contiguous:
        raise ValueError(f"widen {_label(t, name)}: an output of {out.dtype}[{out.size}] for {np.dtype(dtype)}[{rows} x {cols}]")
    return out.reshape(rows, cols)


@functools.cache
def _runs(type_id: int) -> tuple[list, list]:
    """([(first byte, length)] of the rest's runs of columns in block order, the fp16 fields
    [(byte offset, halves)]) of a type, worked out once."""
    t = ggml_type(type_id)
    cols = _rest_columns(t)
    breaks = np.flatnonzero(np.diff(cols) != 1) + 1
    runs = [(int(r[0]), int(r.size)) for r in np.split(cols, breaks)] if cols.size else []
    return runs, [(int(o), int(n)) for o, n in t.fp16_fields]


_SCAN_BLOCKS = 1 << 20  # blocks per step of the scan: bounds its temporaries on multi-GB tensors


def first_non_finite(raw: np.ndarray, type_id: int) -> tuple[int, str, float] | None:
    """The first NaN/inf stored value a kernel would read: an element of F32/F16/BF16 (BF16 given as
    its 16 bits), or an fp16 block scale of a quantized type; (element or block number, what, value),
    or None. Nothing writes such values on purpose; they pass every size and offset check, and a run
    then stopped at "non-finite activation" naming no tensor. IQ1_M keeps its scale in nibbles, with
    no fp16 field: nothing to check there."""
    t = ggml_type(type_id, where="first_non_finite")
    raw = raw.reshape(-1).view(np.uint8)
    if t.name in ("F32", "F16", "BF16"):
        step = _SCAN_BLOCKS * 32
        for a in range(0, raw.size, step):
            chunk = raw[a : a + step]
            x = (chunk.view(np.float32) if t.name == "F32" else chunk.view(np.float16) if t.name == "F16"
                 else (chunk.view(np.uint16).astype(np.uint32) << 16).view(np.float32))
            bad = np.flatnonzero(~np.isfinite(x))
            if bad.size:
                i = int(bad[0])
                return a // t.type_size + i, f"element {a // t.type_size + i}", float(x[i])
        return None
    cols = _fp16_columns(t)
    if cols.size == 0:
        return None
    blocks = raw.reshape(-1, t.type_size)
    for a in range(0, blocks.shape[0], _SCAN_BLOCKS):
        halves = np.ascontiguousarray(blocks[a : a + _SCAN_BLOCKS, cols]).view(np.uint16)
        bad = np.argwhere((halves & 0x7C00) == 0x7C00)  # exponent all ones: inf or NaN
        if bad.size:
            b, k = (int(v) for v in bad[0])
            return a + b, f"block {a + b} fp16 scale {k}", float(F16_TO_F32[halves[b, k]])
    return None


def narrow(scales: np.ndarray, rest: np.ndarray, type_id: int, name: str | None = None) -> np.ndarray:
    """The exact inverse of `widen`: -> raw uint8 [n_blocks * type_size]. A scale that is not
    exactly an fp16 value is refused (it did not come from `widen`)."""
    t = ggml_type(type_id, where=f"narrow {name or ''}".strip())
    n_blocks = rest.shape[0] if rest.ndim == 2 else -1
    if scales.shape != (n_blocks, t.n_scales) or rest.shape != (n_blocks, t.rest_bytes) or scales.dtype != np.float32:
        raise ValueError(
            f"narrow {_label(t, name)}: scales {scales.dtype}{list(scales.shape)} and rest {rest.dtype}{list(rest.shape)} "
            f"do not match f32[n, {t.n_scales}] and uint8[n, {t.rest_bytes}]"
        )
    halves = scales.astype(np.float16)
    back = F16_TO_F32[halves.view(np.uint16)]
    inexact = back.view(np.uint32) != scales.view(np.uint32)
    if inexact.any():
        blk, k = np.argwhere(inexact)[0]
        raise ValueError(f"narrow {_label(t, name)}: block {blk} scale {k} = {scales[blk, k]!r} is not an fp16 value")
    out = np.empty((n_blocks, t.type_size), np.uint8)
    out[:, _fp16_columns(t)] = halves.view(np.uint8).reshape(n_blocks, -1)
    out[:, _rest_columns(t)] = rest
    return out.reshape(-1)


def widened_bytes(type_id: int, shape: tuple[int, ...]) -> int:
    """Bytes that widening adds to a tensor of `shape` (GGUF order): 2 per fp16 scale."""
    t = ggml_type(type_id, where="widened_bytes")
    return t.nbytes(tuple(shape)) // t.type_size * (t.engine_block_bytes - t.type_size)


def rebf16(x: np.ndarray, name: str | None = None) -> np.ndarray:
    """F32 values that came from BF16 -> their uint16 BF16 bits, exactly.

    Refuses any value whose low 16 bits are not zero: it is not a BF16 value, so the pack is not
    what it claims (rounding it would hide that)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(f"rebf16 {name or '<unnamed tensor>'}: expected float32 values, got {x.dtype}")
    bits = np.ascontiguousarray(x).view(np.uint32)
    low = (bits & 0xFFFF) != 0
    if low.any():
        where = np.argwhere(low)
        first = tuple(int(i) for i in where[0])
        raise ValueError(
            f"rebf16 {name or '<unnamed tensor>'}: {len(where)} of {x.size} values are not BF16 values "
            f"(first at index {first}: {x[first]!r}, bits 0x{int(bits[first]):08x}); the pack says BF16-as-F32, "
            "so it is not what it claims -- rebuild it"
        )
    return (bits >> 16).astype(np.uint16)


# --- the planes as the GPU tier places them in its arenas (engine/budget.py counts the same) ---

PLANE_ALIGN = 256  # each plane of a weight placed in an arena starts on a 256-byte boundary


def align(n: int) -> int:
    """n rounded up to a whole number of PLANE_ALIGN bytes."""
    return -(-n // PLANE_ALIGN) * PLANE_ALIGN


def planes(type_id: int, n_in: int, n_out: int) -> tuple[int, int]:
    """(first plane's bytes, second plane's bytes) of a weight in engine form: block types (rest,
    f32 scales), float types (values, 0). `placed_bytes` is what `place` takes of an arena."""
    t = ggml_type(type_id)
    blocks = t.nbytes((n_in, n_out)) // t.type_size
    if not t.quantized:
        return n_in * n_out * (4 if t.name == "F32" else 2), 0
    return blocks * t.rest_bytes, blocks * t.n_scales * 4


def placed_bytes(type_id: int, n_in: int, n_out: int) -> int:
    a, b = planes(type_id, n_in, n_out)
    return align(a) + align(b)
