"""Quantized GGUFs of the tiny reference models: an F32 conversion re-encoded tensor by tensor.

llama.cpp's quantizer is C++ and not built here, and gguf-py 0.19 quantizes only the legacy types
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). For the other types this module has plain encoders, far simpler
than llama.cpp's searches but exact about the format: every block is VALID (any decoder accepts
it) and its dequantization is a faithful approximation of the weights
(tests/engine/test_quantized_reference.py measures each type's error with gguf-py's decoder):

  Q2_0     per 64: levels (q - 1) d, q 0..3; d (and its sign) searched over a few candidates
  Q4_K     per 256: 8 sub-blocks of 32, scale (max - min) / 15 and min, both as 6-bit multiples
           of the fp16 d / dmin; q = round((x + m) / s) in 0..15
  Q6_K     per 256: 16 sub-blocks of 16, int8 scales of the fp16 d; q in -32..31
  IQ4_NL   per 32: d from the largest element (mapped to -127 or to 113, the better of the two),
           each element the nearest entry of the 16-value table
  IQ2_XXS, per 256: fp16 d, a 4-bit scale per 32 (every one of the 16 tried), signs per 8 with
  IQ3_XXS  even parity (ksigns: the smallest element gives way, as in llama.cpp), magnitudes
           rounded to the nearest grid LEVEL, then the grid entry nearest to those levels

`requantize(src, out_dir, mix)` writes the shards of an F32 GGUF again with each tensor in the
mix's type (tools/gguf_io.GGUFWriter, metadata copied as is); `requantized_gguf(arch, mix, ...)`
caches that beside the converter's outputs. The grids and tables come from gguf-py (the
independent decoder), never from the engine.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import quants
from gguf.constants import GGMLQuantizationType as GQ

from strata.index_format.ggml_types import BY_NAME
from strata.tools.gguf_io import GGUFWriter, read_gguf, shard_names
from strata.tools.synth import resolve_type
from strata.tools.synth_blocks import decode_floats, encode_floats

from . import convert

REQUANT_VERSION = 1  # part of the cache key: bump when an encoder or a mix changes
F32 = np.float32

# --------------------------------------------------------------------------------------- helpers


def _h(x) -> np.ndarray:
    """float values -> the fp16 a block stores, back as f32 (what every decoder reads)."""
    return np.asarray(x, F32).astype(np.float16).astype(F32)


def _h_bytes(x) -> np.ndarray:
    return np.asarray(x, F32).astype("<f2").view(np.uint8).reshape(-1, 2)


def _div(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    """x / s with 0 where s == 0 (an all-zero sub-block)."""
    return np.divide(x, s, out=np.zeros(np.broadcast(x, s).shape, F32), where=s != 0)


def _nearest(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the sorted 1-D `table` for every element of `values`."""
    mids = (table[1:] + table[:-1]) / 2
    return np.searchsorted(mids, values).astype(np.int64)


# --------------------------------------------------------------------------------------- Q2_0


def _enc_q2_0(x: np.ndarray) -> np.ndarray:
    # block_q2_0 (ggml-common.h): d fp16 | qs[16], element j in bits 2(j%4) of qs[j/4]; w = (q - 1) d
    amax = np.abs(x).max(axis=1, keepdims=True)
    best_err, best_d = np.full((len(x), 1), np.inf, F32), np.zeros((len(x), 1), F32)
    for sign in (1.0, -1.0):  # levels {-1, 0, 1, 2} d: the long side on either sign
        for f in np.linspace(0.3, 1.0, 15):
            d = _h(sign * f * amax / 2)
            q = np.clip(np.rint(_div(x, d)) + 1, 0, 3)
            err = (((q - 1) * d - x) ** 2).sum(axis=1, keepdims=True)
            better = err < best_err
            best_err, best_d = np.where(better, err, best_err), np.where(better, d, best_d)
    q = np.clip(np.rint(_div(x, best_d)) + 1, 0, 3).astype(np.uint8).reshape(-1, 16, 4)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return np.concatenate([_h_bytes(best_d), qs], axis=1)


def dequantize_q2_0(raw: np.ndarray) -> np.ndarray:
    """ggml-quants.c dequantize_row_q2_0 (gguf 0.19 does not know type 42): f32 [n_blocks * 64].

    Block = fp16 d | qs[16]; element j = ((qs[j / 4] >> 2 (j % 4)) & 3) - 1, times d in float. The
    tests' one Q2_0 reference: the engine's decoder (test_kernels_reference.py) and synth's blocks
    (test_synth.py) are checked against it."""
    b = raw.reshape(-1, 18)
    d = b[:, :2].copy().view(np.float16).astype(F32)
    q = ((b[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3).reshape(-1, 64)
    return ((q.astype(np.int32) - 1).astype(F32) * d).reshape(-1)


# --------------------------------------------------------------------------------------- K types


def _enc_q4_k(x: np.ndarray) -> np.ndarray:
    # block_q4_K: d | dmin | scales[12] (6-bit sc/m of 8 sub-blocks) | qs[128]; w = d sc q - dmin m
    n = len(x)
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)
    scale, mins = (sub.max(axis=2) - lo) / 15, -lo
    d, dmin = _h(scale.max(axis=1) / 63), _h(mins.max(axis=1) / 63)
    sc = np.clip(np.rint(_div(scale, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(mins, dmin[:, None])), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[:, :, None]
    q = np.clip(np.rint(_div(sub + (dmin[:, None] * m)[:, :, None], step)), 0, 15).astype(np.uint8)
    S = np.empty((n, 12), np.uint8)
    S[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    S[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    S[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    q = q.reshape(n, 4, 2, 32)  # element 64i + 32h + l is nibble h of qs[32i + l]
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_h_bytes(d), _h_bytes(dmin), S, qs], axis=1)


def _enc_q6_k(x: np.ndarray) -> np.ndarray:
    # block_q6_K: ql[128] | qh[64] | scales int8[16] | d; w = d sc (q - 32), 16 sub-blocks of 16
    n = len(x)
    sub = x.reshape(n, 16, 16)
    big = np.take_along_axis(sub, np.abs(sub).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    scale = big / -32  # the largest element lands on -32 (the end without a +32 partner)
    d = _h(np.abs(scale).max(axis=1) / 127)
    sc = np.clip(np.rint(_div(scale, d[:, None])), -127, 127).astype(np.int8)
    q = np.clip(np.rint(_div(sub, (d[:, None] * sc)[:, :, None])), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # element 128h + 32j + l
    # low nibble of element (h, j, l) is nibble j // 2 of ql[64h + 32 (j % 2) + l]
    ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _h_bytes(d)], axis=1)


# --------------------------------------------------------------------------------------- IQ types

_KVALUES = np.asarray(quants.IQ4_NL.kvalues, F32)
# ksigns_iq2xs[i] is i with the parity bit on top, so a sign pattern's index is its low 7 bits
if not (np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8) & 127 == np.arange(128)).all():
    raise ImportError("gguf-py's ksigns_iq2xs is not the table this encoder assumes (index = low 7 sign bits)")


def _enc_iq4_nl(x: np.ndarray) -> np.ndarray:
    # block_iq4_nl: d | qs[16] in Q4_0's nibble order; w = d kvalues[nibble]
    big = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)
    cands = []
    for end in (_KVALUES[0], _KVALUES[-1]):  # the table is asymmetric: try the largest on either end
        d = _h(big / end)
        idx = _nearest(_div(x, d), _KVALUES)
        cands.append((d, idx, ((d * _KVALUES[idx] - x) ** 2).sum(axis=1, keepdims=True)))
    (d0, i0, e0), (d1, i1, e1) = cands
    d, idx = np.where(e0 <= e1, d0, d1), np.where(e0 <= e1, i0, i1).astype(np.uint8)
    return np.concatenate([_h_bytes(d), idx[:, :16] | (idx[:, 16:] << 4)], axis=1)


@dataclass(frozen=True)
class _Grid:
    """A sign-free IQ grid: `values` [entries, width] from `levels`; `lut` maps every combination
    of level indices (base len(levels), first element least significant) to its nearest entry."""

    values: np.ndarray
    levels: np.ndarray
    lut: np.ndarray

    @classmethod
    def of(cls, q) -> _Grid:
        q.init_grid()
        values = np.asarray(q.grid, F32).reshape(-1, q.grid_shape[1])
        levels = np.unique(values)
        width, base = values.shape[1], len(levels)
        combos = levels[(np.arange(base**width)[:, None] // base ** np.arange(width)) % base]
        d2 = (combos**2).sum(1)[:, None] - 2 * combos @ values.T + (values**2).sum(1)[None, :]
        return cls(values, levels, d2.argmin(axis=1))

    def encode(self, a: np.ndarray) -> np.ndarray:
        """Magnitudes already divided by the scale, [..., width] -> grid entry indices [...]."""
        k = _nearest(a, self.levels)
        return self.lut[(k * len(self.levels) ** np.arange(a.shape[-1])).sum(axis=-1)]


def _signs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Groups of 8 [..., 8] -> (ksigns index [...] (7 bits), the sign each element is decoded with).

    The 8th sign is implied (even count of negatives): when the count is odd, the smallest
    element's sign is flipped, as llama.cpp's quantizers do."""
    neg = x < 0
    odd = neg.sum(axis=-1) % 2 == 1
    smallest = np.abs(x).argmin(axis=-1)
    flip = odd[..., None] & (np.arange(8) == smallest[..., None])
    neg ^= flip
    bits = (neg.astype(np.uint32) << np.arange(8, dtype=np.uint32)).sum(axis=-1)
    return (bits & 127).astype(np.uint32), np.where(neg, F32(-1), F32(1))


def _enc_iq_grid(x: np.ndarray, grid: _Grid, div: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shared by IQ2_XXS (div 8) and IQ3_XXS (div 4): per 32 the scale d/div (2 ls + 1).
    Returns (d [n], ls [n, 8], grid indices [n, 8, groups of width], sign indices [n, 8, 4])."""
    n, width = len(x), grid.values.shape[1]
    blk = x.reshape(n, 8, 4, 8)  # 32-blocks of 4 sign groups of 8
    sign_idx, sgn = _signs(blk)
    a = (blk * sgn).reshape(n, 8, 32)  # magnitudes as decoded (a flipped element is negative here)
    d = _h(np.abs(x).max(axis=1) * div / (31 * grid.levels[-1]))
    best_err, best_ls = np.full((n, 8), np.inf, F32), np.zeros((n, 8), np.int64)
    for ls in range(16):
        s = (d * (2 * ls + 1) / div)[:, None, None]
        idx = grid.encode(_div(a, s).reshape(n, 8, -1, width))
        err = ((grid.values[idx].reshape(n, 8, 32) * s - a) ** 2).sum(axis=2)
        better = err < best_err
        best_err, best_ls = np.where(better, err, best_err), np.where(better, ls, best_ls)
    s = (d[:, None] * (2 * best_ls + 1) / div)[:, :, None]
    idx = grid.encode(_div(a, s).reshape(n, 8, -1, width))
    return d, best_ls, idx, sign_idx


_GRIDS: dict[str, _Grid] = {}


def _grid(name: str) -> _Grid:
    if name not in _GRIDS:
        _GRIDS[name] = _Grid.of({"IQ2_XXS": quants.IQ2_XXS, "IQ3_XXS": quants.IQ3_XXS}[name])
    return _GRIDS[name]


def _sign_words(ls: np.ndarray, sign_idx: np.ndarray) -> np.ndarray:
    """Per 32-block: four 7-bit ksigns indices, then the 4-bit scale in bits 28..31 -> u32 [n, 8]."""
    w = (sign_idx << (7 * np.arange(4, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)
    return w | (ls.astype(np.uint32) << 28)


def _enc_iq3_xxs(x: np.ndarray) -> np.ndarray:
    # block_iq3_xxs: d | qs[64] (two 4-wide grid indices per group of 8) | u32[8] (signs, ls)
    n = len(x)
    d, ls, idx, sign_idx = _enc_iq_grid(x, _grid("IQ3_XXS"), 4)
    words = _sign_words(ls, sign_idx).astype("<u4").view(np.uint8).reshape(n, 32)
    return np.concatenate([_h_bytes(d), idx.reshape(n, 64).astype(np.uint8), words], axis=1)


def _enc_iq2_xxs(x: np.ndarray) -> np.ndarray:
    # block_iq2_xxs: d | per 32-block two u32: four 8-wide grid byte indices, then (signs, ls)
    n = len(x)
    d, ls, idx, sign_idx = _enc_iq_grid(x, _grid("IQ2_XXS"), 8)
    grid_words = (idx.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)
    pairs = np.stack([grid_words, _sign_words(ls, sign_idx)], axis=-1).astype("<u4")
    return np.concatenate([_h_bytes(d), pairs.view(np.uint8).reshape(n, 64)], axis=1)


# --------------------------------------------------------------------------------------- API

_OWN = {"Q2_0": _enc_q2_0, "Q4_K": _enc_q4_k, "Q6_K": _enc_q6_k, "IQ4_NL": _enc_iq4_nl,
        "IQ2_XXS": _enc_iq2_xxs, "IQ3_XXS": _enc_iq3_xxs}
_GGUF_PY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
TYPES = ("F32", "F16", "BF16", *_GGUF_PY, *_OWN)


def quantize(type_name: str, x: np.ndarray) -> np.ndarray:
    """f32 rows (last axis a whole number of the type's blocks) -> the type's bytes, uint8 flat."""
    t = BY_NAME[type_name]
    x = np.ascontiguousarray(x, F32)
    if not t.quantized:
        return encode_floats(t, x)
    if x.shape[-1] % t.block_size:
        raise ValueError(f"requant {type_name}: rows of {x.shape[-1]} are not whole {t.block_size}-blocks")
    if type_name in _GGUF_PY:
        return quants.quantize(x.reshape(-1, t.block_size), GQ[type_name]).reshape(-1)
    if type_name not in _OWN:
        raise ValueError(f"requant: no encoder for {type_name} (have {', '.join(TYPES)})")
    out = _OWN[type_name](x.reshape(-1, t.block_size))
    if out.shape[1] != t.type_size:  # a layout slip here would write a file every decoder misreads
        raise AssertionError(f"requant {type_name}: encoder wrote {out.shape[1]}-byte blocks, the type has {t.type_size}")
    return out.reshape(-1)


def dequantize(type_name: str, raw: np.ndarray, n: int) -> np.ndarray:
    """Bytes -> f32 [n] with gguf-py's decoders (ggml's own rule for Q2_0, which gguf 0.19 lacks)."""
    t = BY_NAME[type_name]
    raw = np.ascontiguousarray(raw, np.uint8).reshape(-1)
    if not t.quantized:
        return decode_floats(t, raw)
    if type_name == "Q2_0":
        return dequantize_q2_0(raw)[:n]
    return quants.dequantize(raw.reshape(-1, t.type_size), GQ[type_name]).reshape(-1)[:n]


# --------------------------------------------------------------------------------------- mixes


@dataclass(frozen=True)
class Mix:
    """Block types of a quantized model. dense: every 2-D weight not named otherwise; experts:
    (gate/up, down) of layer l = experts[l % len]. Norms, 1-D tensors, routers (ffn_gate_inp*),
    conv weights stay F32 (converter / llama-quantize rule); a row that is not whole blocks falls
    back as llama-quantize does (tools/synth.resolve_type)."""

    name: str
    dense: str
    experts: tuple[tuple[str, str], ...]
    embd: str
    head: str
    ple_table: str = "F32"

    def type_for(self, name: str, shape: tuple[int, ...]) -> str:
        if len(shape) == 1 or re.search(r"(norm\.weight|ffn_gate_inp(_shexp)?\.weight|conv1d\.weight)$", name):
            return "F32"
        m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$", name)
        if m:
            gu, down = self.experts[int(m.group(1)) % len(self.experts)]
            target = down if m.group(2) == "down" else gu
        else:
            target = {"token_embd.weight": self.embd, "output.weight": self.head,
                      "per_layer_token_embd.weight": self.ple_table}.get(name, self.dense)
        return target if target == "F32" else resolve_type(target, shape)


MIXES = {
    m.name: m
    for m in (
        Mix("q8_k", dense="Q8_0", experts=(("Q4_K", "Q6_K"), ("Q6_K", "Q4_K")), embd="Q4_0", head="Q6_K"),
        Mix("q8_iq3", dense="Q8_0", experts=(("IQ3_XXS", "Q2_0"), ("IQ2_XXS", "Q2_0")), embd="Q5_0", head="Q8_0",
            ple_table="Q8_0"),
        Mix("iq4nl", dense="IQ4_NL", experts=(("IQ4_NL", "IQ4_NL"), ("Q5_0", "Q4_0")), embd="IQ4_NL", head="IQ4_NL"),
    )
}


def requantize(src: Path, out_dir: Path, mix: Mix) -> list[Path]:
    """Every shard of the F32 GGUF `src` written again into out_dir with the mix's types
    (same names, shard names, metadata and tensor order); returns the new shards, main first."""
    out = []
    for shard in shard_names(Path(src)):
        f = read_gguf(shard)
        w = GGUFWriter(out_dir / shard.name, alignment=f.alignment)
        for key, kv in f.kv.items():
            w.add(key, kv.value, kv.type, kv.sub_type)
        for name, info in f.tensors.items():
            if BY_NAME["F32"].id != info.type_id:
                raise ValueError(f"{shard}: tensor {name} is not F32; requantize reads an F32 conversion")
            target = mix.type_for(name, info.shape)
            w.add_tensor(name, info.shape, BY_NAME[target].id,
                         lambda name=name, f=f, target=target, shape=info.shape:
                         quantize(target, f.tensor_bytes(name).view(F32).reshape(-1, shape[0])))
        out.append(w.write())
    return out


def requantized_gguf(arch: str, mix: str, seed: int = 0, **overrides) -> list[Path]:
    """Cached quantized GGUF shard(s) of the tiny `arch` model (convert.reference_gguf, F32) in `mix`."""
    src = convert.reference_gguf(arch, "f32", seed=seed, **overrides)
    key = hashlib.sha256(f"{src[0].parent.name}|{MIXES[mix]}|{REQUANT_VERSION}".encode()).hexdigest()[:16]
    target = convert.cache_root() / "requant" / f"{arch}-{mix}-s{seed}-{key}"
    done = target / "files.txt"
    if done.is_file():
        return [target / line for line in done.read_text(encoding="utf-8").split()]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-{mix}-", dir=target.parent))
    try:
        paths = requantize(src[0], tmp, MIXES[mix])
        (tmp / "files.txt").write_text("\n".join(p.name for p in paths) + "\n", encoding="utf-8")
        convert._publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [target / p.name for p in paths]
