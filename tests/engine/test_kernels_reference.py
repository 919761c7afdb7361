"""The first links of the chain of checks (docs/kernels.md):

    gguf.quants.dequantize  ==  reference.dequantize     bit for bit, every type gguf knows
    ggml's dequantize_row_q2_0 (transcribed in tests/reference/requant.py)  ==  reference.dequantize for Q2_0
    reference.IntForm  denotes the dequantized values  (to the f32 rounding of the dequantizer)

plus the engine form (widen/narrow, rebf16), the IQ tables and the activation quantizer.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import quants as gq
from kernel_blocks import random_weights
from reference.requant import dequantize_q2_0

from strata.engine.kernels import actq as A
from strata.engine.kernels import engine_form as EF
from strata.engine.kernels import iq_tables
from strata.engine.kernels import reference as R
from strata.index_format.ggml_types import BY_NAME, TYPES

GGUF_KNOWS = [t for t in TYPES if t.name in gguf.GGMLQuantizationType.__members__]
BLOCK_TYPES = [t for t in TYPES if t.quantized]
EPS = float(np.finfo(np.float32).eps)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _n(t, blocks=48):
    return blocks * t.block_size


def test_gguf_knows_every_type_but_q2_0():
    # If a gguf upgrade learns Q2_0, the Q2_0 check below should start comparing with it too.
    assert {t.name for t in TYPES} - {t.name for t in GGUF_KNOWS} == {"Q2_0"}


@pytest.mark.parametrize("t", GGUF_KNOWS, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_with_gguf(t):
    rng = np.random.default_rng(t.id)
    raw = random_weights(t, _n(t), rng)
    ref = gq.dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType[t.name]).reshape(-1)
    got = R.dequantize(raw, t.id, _n(t))
    assert got.dtype == np.float32 and got.shape == (_n(t),)
    bad = np.flatnonzero(_bits(got) != _bits(ref))
    assert bad.size == 0, f"{t.name}: {bad.size} mismatches, first at {bad[0]}: {got[bad[0]]!r} vs gguf {ref[bad[0]]!r}"


QUANTIZABLE = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_dequantize_blocks_written_by_gguf_quantize(name):
    t = BY_NAME[name]
    x = (np.random.default_rng(5).standard_normal((4, 256)) * np.array([[1e-3], [0.1], [3.0], [200.0]])).astype(np.float32)
    raw = np.ascontiguousarray(gq.quantize(x, gguf.GGMLQuantizationType[name])).view(np.uint8).reshape(-1)
    ref = gq.dequantize(raw.reshape(4, -1), gguf.GGMLQuantizationType[name]).reshape(-1)
    got = R.dequantize(raw, t.id, x.size)
    assert np.array_equal(_bits(got), _bits(ref))
    assert np.allclose(got, x.reshape(-1), rtol=0.2, atol=0.2 * np.abs(x).max(axis=1).repeat(256))


def test_q2_0_matches_ggml_c_reference():
    t = BY_NAME["Q2_0"]
    raw = random_weights(t, 64 * 40, np.random.default_rng(42))
    raw[18 * 3 : 18 * 3 + 2] = np.frombuffer(np.float16(-0.0).tobytes(), np.uint8)  # a block with d = -0
    got = R.dequantize(raw, t.id, 64 * 40)
    assert np.array_equal(_bits(got), _bits(dequantize_q2_0(raw)))  # ggml-quants.c, transcribed there
    assert set(np.unique(got[:64] / np.float32(raw[:2].view(np.float16)[0]))) <= {-1.0, 0.0, 1.0, 2.0}


@pytest.mark.parametrize("t", BLOCK_TYPES, ids=lambda t: t.name)
def test_integer_form_denotes_the_dequantized_weights(t):
    raw = random_weights(t, _n(t), np.random.default_rng(100 + t.id))
    deq = R.dequantize(raw, t.id, _n(t)).astype(np.float64)
    form = R.decompose(raw, t.id, _n(t))
    assert form.q.dtype == np.int8 and form.q.shape == (_n(t) // 32, 32)
    assert form.ws.shape == (_n(t) // 32, 2) and form.wf.dtype == np.float32
    # dequantize rounds 2-3 times in f32 (e.g. (d * sc) * q - dmin * m); the form has no rounding
    scale = np.abs(deq).reshape(-1, 32).max(axis=1).repeat(32) + 1e-30
    err = np.abs(form.values() - deq) / scale
    worst = int(np.argmax(err))
    assert err[worst] <= 4 * EPS, f"{t.name}: element {worst}: form {form.values()[worst]!r} vs {deq[worst]!r}"


def test_integer_forms_stay_inside_the_exact_f32_range():
    # An act-block's integer sum must be exact in f32 (< 2^24) for activations in [-127, 127]:
    # max |ws| * sum |q| * 127. docs/kernels.md derives the bound per type; this samples it
    # on all-zero, all-ones and random blocks.
    for t in BLOCK_TYPES:
        zeros, ones = np.zeros(t.type_size, np.uint8), np.full(t.type_size, 255, np.uint8)
        raw = np.concatenate([zeros, ones, random_weights(t, _n(t, 64), np.random.default_rng(t.id))])
        with np.errstate(invalid="ignore", over="ignore"):  # the f32 values of 0xff scales: unused here
            form = R.decompose(raw, t.id, raw.size // t.type_size * t.block_size)
        bound = (np.abs(form.ws).astype(np.int64) * np.abs(form.q.reshape(-1, 2, 16)).sum(-1)).sum(-1).max() * 127
        assert bound < 2**24, f"{t.name}: |isum| can reach {bound}"


# --------------------------------------------------------------------------------------------
# IQ tables


@pytest.mark.parametrize(
    "cls,table,view",
    [
        (gq.IQ2_XXS, iq_tables.IQ2XXS_GRID, np.uint8),
        (gq.IQ2_XS, iq_tables.IQ2XS_GRID, np.uint8),
        (gq.IQ2_S, iq_tables.IQ2S_GRID, np.uint8),
        (gq.IQ3_XXS, iq_tables.IQ3XXS_GRID, np.uint8),
        (gq.IQ3_S, iq_tables.IQ3S_GRID, np.uint8),
        (gq.IQ1_S, iq_tables.IQ1S_GRID, np.int8),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)
def test_iq_grids_match_gguf_py(cls, table, view):
    # two independent transcriptions of ggml-common.h: gguf-py's packed hex and our generator
    cls.init_grid()
    assert np.array_equal(table.view(view).reshape(cls.grid_shape).astype(np.float32), cls.grid.reshape(cls.grid_shape))


def test_sign_and_value_tables_match_gguf_py():
    assert np.array_equal(iq_tables.KSIGNS_IQ2XS, np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8))
    assert tuple(iq_tables.KVALUES_IQ4NL.tolist()) == gq.IQ4_NL.kvalues


def test_table_generator_round_trips(tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "gen_iq_tables.py"
    spec = importlib.util.spec_from_file_location("gen_iq_tables", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    header = "#define GGML_TABLE_BEGIN(type, name, size) static const type name[size] = {\n"
    for cname, ctype, n, pyname, dtype in gen.TABLES:
        vals = getattr(iq_tables, pyname).tolist()
        header += f"GGML_TABLE_BEGIN({ctype}, {cname}, {n})\n    " + ", ".join(hex(v) if v >= 0 else str(v) for v in vals) + ",\nGGML_TABLE_END()\n"
    tables = gen.parse_tables(header, "synthetic.h")
    gen.check(tables, "synthetic.h")
    namespace: dict = {}
    exec(gen.render(tables, "synthetic.h", "0" * 64), namespace)
    for _, _, _, pyname, _ in gen.TABLES:
        assert np.array_equal(namespace[pyname], getattr(iq_tables, pyname))
    with pytest.raises(gen.TableError, match="kvalues_iq4nl has 15 values"):
        gen.check({**tables, "kvalues_iq4nl": ("int8_t", list(range(15)))}, "synthetic.h")


# --------------------------------------------------------------------------------------------
# engine form


WIDENED = [t for t in BLOCK_TYPES if t.fp16_fields]


@pytest.mark.parametrize("t", WIDENED, ids=lambda t: t.name)
def test_widen_narrow_round_trip_is_exact(t):
    raw = random_weights(t, _n(t), np.random.default_rng(7 + t.id))
    scales, rest = EF.widen(raw, t.id)
    blocks = raw.reshape(-1, t.type_size)
    assert scales.dtype == np.float32 and scales.shape == (blocks.shape[0], t.n_scales)
    assert rest.shape == (blocks.shape[0], t.rest_bytes)
    halves = np.concatenate([blocks[:, off : off + 2 * n].copy().view(np.float16) for off, n in t.fp16_fields], axis=1)
    assert np.array_equal(_bits(scales), _bits(halves.astype(np.float32)))
    mask = np.ones(t.type_size, bool)
    for off, n in t.fp16_fields:
        mask[off : off + 2 * n] = False
    assert np.array_equal(rest, blocks[:, mask])
    assert np.array_equal(EF.narrow(scales, rest, t.id), raw)


@pytest.mark.parametrize("t", WIDENED, ids=lambda t: t.name)
def test_widen_into_given_planes_writes_the_same_bytes(t):
    """widen into caller's planes (the GPU tier's pinned staging: parts of one uint8 buffer) gives
    widen's own arrays' bytes, and writes nothing past them; planes of the wrong size are refused."""
    raw = random_weights(t, _n(t, 40), np.random.default_rng(11 + t.id))
    want_s, want_r = EF.widen(raw, t.id)
    nb = raw.size // t.type_size
    a, b = nb * t.rest_bytes, nb * t.n_scales * 4
    buf = np.full(EF.align(a) + b + 64, 0xA5, np.uint8)
    scales, rest = buf[EF.align(a) : EF.align(a) + b].view(np.float32), buf[:a]
    EF.widen(raw, t.id, scales=scales, rest=rest)
    assert np.array_equal(rest, want_r.reshape(-1))
    assert np.array_equal(_bits(scales), _bits(want_s.reshape(-1)))
    assert (buf[a : EF.align(a)] == 0xA5).all() and (buf[EF.align(a) + b :] == 0xA5).all()
    with pytest.raises(ValueError, match="output"):
        EF.widen(raw, t.id, scales=scales[:-1], rest=rest)


def test_nothing_to_widen_for_iq1_m_and_float_types():
    for name in ("IQ1_M", "F16", "BF16", "F32"):
        t = BY_NAME[name]
        raw = random_weights(t, _n(t, 4), np.random.default_rng(1))
        scales, rest = EF.widen(raw, t.id)
        assert scales.shape[1] == 0 and np.array_equal(rest.reshape(-1), raw)
        assert EF.widened_bytes(t.id, (_n(t, 4),)) == 0


def test_widened_bytes_counts_two_bytes_per_half():
    assert EF.widened_bytes(BY_NAME["Q8_0"].id, (2560, 640)) == 2560 * 640 // 32 * 2
    assert EF.widened_bytes(BY_NAME["Q4_K"].id, (2560, 640)) == 2560 * 640 // 256 * 4
    assert EF.widened_bytes(BY_NAME["Q2_0"].id, (640, 2560)) == 640 * 2560 // 64 * 2


def test_widen_refuses_a_non_finite_scale_and_names_the_tensor():
    t = BY_NAME["Q4_0"]
    raw = random_weights(t, 32 * 8, np.random.default_rng(0))
    raw[18 * 5 : 18 * 5 + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    with pytest.raises(ValueError, match=r"blk\.3\.ffn_down .*block 5 .*inf"):
        EF.widen(raw, t.id, name="blk.3.ffn_down")


def test_narrow_refuses_a_scale_that_is_not_an_fp16_value():
    t = BY_NAME["Q8_0"]
    scales, rest = EF.widen(random_weights(t, 32 * 4, np.random.default_rng(0)), t.id)
    scales[2, 0] = np.float32(0.1)  # not representable in fp16
    with pytest.raises(ValueError, match="block 2 scale 0"):
        EF.narrow(scales, rest, t.id, name="x")


def test_rebf16_gives_back_the_16_bits_exactly():
    bits = np.random.default_rng(3).integers(0, 1 << 16, 4096, dtype=np.uint32).astype(np.uint16)
    bits[:6] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7FC0]  # +-0, +-inf, a subnormal, a NaN
    as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(EF.rebf16(as_f32), bits)


def test_rebf16_refuses_a_value_that_is_not_bf16_and_names_the_tensor():
    x = (np.arange(8, dtype=np.uint32) << 16).view(np.float32).copy()
    x[5] = np.float32(1.0000001)
    with pytest.raises(ValueError, match=r"output_norm\.weight: 1 of 8 values .*index \(5,\)"):
        EF.rebf16(x, name="output_norm.weight")


# --------------------------------------------------------------------------------------------
# ActQ


def _activations(rng):
    x = (rng.standard_normal((5, 2560)) * rng.uniform(1e-3, 30, (5, 1))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: d = 0, q = 0
    x[1, 32:64] = np.float32(1e-42)  # subnormal amax: no flush to zero anywhere
    x[2, 64:96] = rng.integers(-127, 128, 32).astype(np.float32) + np.float32(0.5)  # exact ties
    x[2, 64] = 127.5  # amax/127 is not 1 here, so not every tie survives; the next block keeps them
    x[3, 96:128] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)
    x[3, 127] = 127.0  # d = 1 exactly: every other element is a tie
    x[4, :32] = np.float32(1e-44)  # amax / 127 underflows: d = 0 though the block is not zero, so q = 0
    return x


def test_actq_numba_equals_numpy_reference_bit_for_bit():
    x = _activations(np.random.default_rng(11))
    for arr in (x, x[3], x[3:4], x[2:3]):  # [1, n]: a decode token's row (quantize_act's one-row path)
        a, b = A.quantize_act(arr), A.quantize_act_reference(arr)
        for k in ("q", "d", "s16"):
            assert getattr(a, k).dtype == getattr(b, k).dtype
            assert np.array_equal(getattr(a, k), getattr(b, k)), k


def test_actq_rounds_half_to_even_and_keeps_sums():
    x = np.zeros(32, np.float32)
    x[:6] = [2.5, 3.5, -2.5, -0.5, 0.5, 1.5]
    x[31] = 127.0  # d = 127 / 127 = 1, so q = rint(x)
    a = A.quantize_act(x)
    assert a.d[0] == 1.0
    assert a.q[:6].tolist() == [2, 4, -2, 0, 0, 2]
    assert a.s16.tolist() == [a.q[:16].sum(), a.q[16:].sum()]


def test_actq_values_are_close_to_the_input():
    x = _activations(np.random.default_rng(12))
    a = A.quantize_act(x)
    err = np.abs(a.values() - x).reshape(5, -1, 32).max(-1)
    assert (err <= a.d.astype(np.float64) * (0.5 + 1e-5) + 1e-44).all()  # + the rounding of x / d


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_actq_refuses_non_finite_activations(bad):
    x = np.ones((2, 64), np.float32)
    x[1, 40] = bad
    with pytest.raises(ValueError, match=r"non-finite activation .* index \(1, 40\)"):
        A.quantize_act(x)
    with pytest.raises(ValueError, match=r"non-finite activation .* index \(0, 40\)"):
        A.quantize_act(x[1:])  # one row: the one-row path


def test_actq_refuses_wrong_shapes_and_dtypes():
    with pytest.raises(ValueError, match="multiple of 32"):
        A.quantize_act(np.ones(48, np.float32))
    with pytest.raises(TypeError, match="float32"):
        A.quantize_act(np.ones(64, np.float64))
