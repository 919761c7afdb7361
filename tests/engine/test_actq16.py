"""The wide activation form (actq.ActQ16: 16 bits per activation as two int8 planes) for the weight
types llama.cpp reads with Q8_0 activations: the quantizer against its numpy statement, every CPU
kernel against reference.dot_reference to the bit, and the products against float64."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_blocks import random_weights
from kernel_paths import KERNELS, cpu_path

from strata.engine.kernels import cpu
from strata.engine.kernels import reference as R
from strata.engine.kernels.actq import (
    Q16,
    WIDE,
    ActQ,
    ActQ16,
    NonFiniteActivation,
    quantize_act,
    quantize_act16,
    quantize_act16_reference,
)
from strata.engine.weights import Input, Weight
from strata.index_format.ggml_types import BY_NAME

WIDE_TYPES = sorted(WIDE)


def _acts(n_in: int, n_tok: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_tok, n_in)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    x[:, 32:64] *= 1e-3  # blocks of very different scales
    x[:, 64:96] = 0  # an all-zero block: d = 0, q = 0
    return x


def _same(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    g, r = got.view(np.uint32), np.ascontiguousarray(ref, np.float32).view(np.uint32)
    bad = np.argwhere(g != r)
    assert bad.size == 0, f"{what}: {len(bad)} outputs differ, first {tuple(bad[0])}: {got[tuple(bad[0])]!r} vs reference {ref[tuple(bad[0])]!r}"


def _shape(name: str) -> tuple[int, int]:
    # 15 act-blocks (Q2_0's 64-blocks: 14), an odd row count
    return (64 * 7 if name == "Q2_0" else 32 * 15), 9


def test_quantizer_equals_its_statement_and_is_16_bit():
    x = _acts(512, 3, 1)
    x[0, 96:128] = np.linspace(-1, 1, 32, dtype=np.float32)
    x[1, 128:160] = np.float32(1e-40)  # subnormal activations: a subnormal d
    # q = 256 k - 128 puts the lo byte at -128, the bottom of int8 (amax 1: d = 1 / 32639)
    x[2, 160:192] = (256 * (np.arange(32) - 16) - 128) / np.float32(Q16)
    x[2, 160] = -1
    got, ref = quantize_act16(x), quantize_act16_reference(x)
    for name in ("q", "d", "s16"):
        assert np.array_equal(getattr(got.planes, name), getattr(ref.planes, name)), f"plane {name} differs from the reference"
    T = 3
    hi, lo = got.planes.q[0::2].astype(np.int64), got.planes.q[1::2].astype(np.int64)  # rows 2t, 2t + 1
    assert hi.min() >= -127 and hi.max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    assert (lo == -128).any(), "the case lo = -128 was not met"
    assert np.array_equal(got.planes.d[0::2], got.planes.d[1::2])
    d = got.planes.d[0::2].repeat(32, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        assert np.array_equal(hi * 256 + lo, np.where(d == 0, 0, np.clip(np.rint(x / d), -Q16, Q16)))
    assert np.array_equal(got.planes.s16, got.planes.q.reshape(2 * T, -1, 16).sum(-1))
    # each activation within half a step of d = amax / 32639 of its block (float64, from x alone),
    # but the subnormal block, whose d rounds to a few subnormal ulps (checked to the bit above)
    amax = np.abs(x.astype(np.float64)).reshape(T, -1, 32).max(-1)
    step = np.repeat(amax / Q16, 32, axis=1)
    ok = np.abs(got.values() - x) <= step * (0.5 + 1e-6)
    ok[1, 128:160] = True
    assert ok.all(), f"{np.count_nonzero(~ok)} activations off by more than half a step, first {np.argwhere(~ok)[0]}"
    assert np.abs(got.values() - x).max() < np.abs(quantize_act(x).values() - x).max() / 200  # 16 bits, not 8


def test_quantizer_refuses_non_finite_input_and_a_wrong_out():
    x = _acts(64, 2, 2)
    x[1, 40] = np.nan
    with pytest.raises(NonFiniteActivation, match=r"index \(1, 40\)"):
        quantize_act16(x)
    with pytest.raises(TypeError, match="ActQ16"):
        quantize_act16(x[:1], out=ActQ.empty((1, 64)))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", WIDE_TYPES)
def test_products_equal_the_reference_bit_for_bit(name, kernel):
    t = BY_NAME[name]
    n_in, n_out = _shape(name)
    raw = random_weights(t, n_in * n_out, np.random.default_rng(t.id))
    act = quantize_act16(_acts(n_in, 5, t.id))
    with cpu_path(kernel=kernel):
        y = cpu.matmul(raw, t.id, n_in, n_out, act)
    want = R.dot_reference(raw, t.id, n_in, n_out, act)
    _same(y, want, f"{name} matmul")
    # the reference's combination, spelled out: 256 times the hi plane's product plus the lo's
    hi = R.dot_reference(raw, t.id, n_in, n_out, act.hi())
    _same(want, np.float32(256) * hi + R.dot_reference(raw, t.id, n_in, n_out, act.lo()), f"{name} reference")
    for b in range(5):  # a batch row is the single-token product (rowdot.py's kernel where it applies)
        _same(cpu.matvec(raw, t.id, n_in, n_out, act.row(b)), y[b], f"{name} matvec token {b}")


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q2_0"])
def test_token_kernel_reads_both_planes(name, parallel):
    from strata.engine.kernels import rowdot

    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
    t = BY_NAME[name]
    n_in = 640 if name == "Q2_0" else 544  # a 16-block group and a tail of 1 (Q2_0's pairs: of 4)
    raw = random_weights(t, n_in * 37, np.random.default_rng(7))
    act = quantize_act16(_acts(n_in, 1, 7)[0])
    with cpu_path(parallel):
        got = cpu.matvec(raw, t.id, n_in, 37, act)
    assert rowdot._KERNELS[name, parallel, "wide"].signatures, "the token kernel was not taken"
    _same(got, R.dot_reference(raw, t.id, n_in, 37, act), f"{name} token kernel")


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("name", ["Q8_0", "IQ4_NL"])
def test_token_kernel_is_exact_at_the_extreme_values(name, parallel):
    # AVX2 hosts multiply the offset-128 types as |w| times x with w's sign (vpsignb), which has no
    # +128 in int8: the lo plane's -128 against a negative weight would come back as -128. So the
    # wide form takes another route there; this holds every weight at the type's most negative
    # value (Q8_0 -128, IQ4_NL -127) against a lo plane full of -128 and an 8-bit one at +-127.
    from strata.engine.kernels import rowdot

    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
    t = BY_NAME[name]
    n_in, n_out = 544, 37  # a 16-block group and a tail of 1
    raw = random_weights(t, n_in * n_out, np.random.default_rng(11)).reshape(-1, t.type_size)
    raw[::2, 2:] = 0x80 if name == "Q8_0" else 0x00  # every other block: qs all -128 / nibbles 0 (-127)
    raw = raw.reshape(-1)
    rng = np.random.default_rng(12)
    # d = 32639 / 32639 = 1 (the wide form), so q = x: +-128 gives lo = -128 (hi 1 or 0), +-32639 the ends
    x = rng.choice(np.float32([128, -128, 32639, -32639]), size=n_in).astype(np.float32)
    x[::32] = 32639
    wide = quantize_act16(x)
    assert (wide.lo().q == -128).sum() > n_in // 4, "the lo plane does not hold -128"
    act8 = quantize_act(x)
    assert np.abs(act8.q.astype(np.int32)).max() == 127
    for act in (act8, wide):
        with cpu_path(parallel):
            got = cpu.matvec(raw, t.id, n_in, n_out, act)
        _same(got, R.dot_reference(raw, t.id, n_in, n_out, act), f"{name} token kernel, {type(act).__name__}")
    assert rowdot._KERNELS[name, parallel, "wide"].signatures, "the token kernel was not taken"


@pytest.mark.parametrize("name", ["Q2_0", "IQ4_NL", "Q8_0"])
def test_grouped_products_equal_each_matrix_alone(name):
    t = BY_NAME[name]
    n_in, n_out = _shape(name)
    G = 4
    raw = random_weights(t, G * n_in * n_out, np.random.default_rng(11))
    size = t.nbytes((n_in, n_out))
    experts = np.array([3, 0, 2, 1])
    starts = np.array([0, 2, 2, 7, 8])  # an empty group, groups of 1, 2 and 5 rows
    act = quantize_act16(_acts(n_in, 8, 11))
    for kernel in KERNELS:
        with cpu_path(kernel=kernel):
            y = cpu.matmul_grouped(raw, t.id, n_in, n_out, experts * size, act, starts)
        for g in range(G):
            a, b = starts[g], starts[g + 1]
            if a < b:
                w = raw[experts[g] * size : (experts[g] + 1) * size]
                _same(y[a:b], R.dot_reference(w, t.id, n_in, n_out, act.take(np.arange(a, b))), f"{name} group {g} ({kernel})")


@pytest.mark.parametrize("name", WIDE_TYPES)
def test_products_are_accurate_against_float64(name):
    # against the dequantized weights times the activations the ActQ16 denotes, in float64: the
    # two planes' f32 products and their sum stay within f32 rounding of sum |w a| (a lost or
    # misplaced plane is off by ~1/256 of it or more)
    t = BY_NAME[name]
    n_in, n_out = _shape(name)
    raw = random_weights(t, n_in * n_out, np.random.default_rng(5))
    act = quantize_act16(_acts(n_in, 2, 5))
    y = cpu.matmul(raw, t.id, n_in, n_out, act).astype(np.float64)
    w = R.dequantize(raw, t.id, n_in * n_out).astype(np.float64).reshape(n_out, n_in)
    a = act.values()
    err = np.abs(y - a @ w.T) / (np.abs(a) @ np.abs(w).T + 1e-300)
    assert err.max() < 64 * float(np.finfo(np.float32).eps), f"{name}: relative error {err.max():.3g}"


def test_input_gives_each_reader_its_form_once():
    x = _acts(256, 2, 3)
    inp = Input(x.copy())
    wide, narrow = inp.form(BY_NAME["Q8_0"], wide=True), inp.form(BY_NAME["Q8_0"])
    assert isinstance(wide, ActQ16) and isinstance(narrow, ActQ)
    assert inp.form(BY_NAME["IQ4_NL"], wide=True) is wide, "one wide form per vector, shared by every reader"
    assert inp.form(BY_NAME["F32"], wide=True) is inp.x
    inp.set(x * 2)
    assert inp.form(BY_NAME["Q8_0"], wide=True) is not wide, "new values make a new form"


def test_the_query_and_key_projections_of_the_wide_types_read_the_wide_form():
    t = BY_NAME["Q8_0"]
    raw = random_weights(t, 256 * 3, np.random.default_rng(3))
    reads = {n: Weight(n, (256, 3), t.id, raw).wide for n in
             ("blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.3.attn_k.weight", "blk.3.attn_v.weight",
              "blk.0.ssm_out.weight", "blk.0.hc_attn_down.weight", "output.weight", "blk.0.ffn_down_shexp.weight")}
    assert reads == {"blk.0.attn_qkv.weight": True, "blk.3.attn_q.weight": True, "blk.3.attn_k.weight": True,
                     "blk.3.attn_v.weight": True, "blk.0.ssm_out.weight": False, "blk.0.hc_attn_down.weight": False,
                     "output.weight": False, "blk.0.ffn_down_shexp.weight": False}
    k = BY_NAME["Q4_K"]
    assert not Weight("blk.0.attn_qkv.weight", (256, 3), k.id, random_weights(k, 256 * 3, np.random.default_rng(3))).wide
    # a weight given f32 rows quantizes them to its own form
    x = _acts(256, 2, 3)
    W = Weight("blk.0.attn_qkv.weight", (256, 3), t.id, raw)
    _same(W.matmul(x), R.dot_reference(raw, t.id, 256, 3, quantize_act16_reference(x)), "Weight.matmul (wide)")
    W = Weight("blk.0.ssm_out.weight", (256, 3), t.id, raw)
    _same(W.matmul(x), R.dot_reference(raw, t.id, 256, 3, quantize_act(x)), "Weight.matmul (8-bit)")


def test_a_type_that_reads_8_bit_activations_refuses_the_wide_form():
    t = BY_NAME["Q4_K"]
    raw = random_weights(t, 256 * 2, np.random.default_rng(0))
    with pytest.raises(TypeError, match=r"Q4_K weights read 8-bit activations"):
        cpu.matvec(raw, t.id, 256, 2, quantize_act16(_acts(256, 1, 0)[0]))
    with pytest.raises(TypeError, match=r"single vector"):
        cpu.matvec(raw, BY_NAME["Q8_0"].id, 256, 2, quantize_act16(_acts(256, 2, 0)))
