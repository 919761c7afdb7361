"""The Numba kernels against the numpy statement of the same arithmetic (reference.dot_reference),
bit for bit, and against float64, within the rounding the specification allows (docs/kernels.md).

Each block type compiles its own kernels (1-3 s each, serial and parallel, then kept in the disk
cache), so shapes stay small except the two expert shapes on a few types."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from kernel_blocks import random_weights
from kernel_paths import KERNELS, cpu_path

from strata.engine.kernels import cpu
from strata.engine.kernels import iq_tables as T
from strata.engine.kernels import reference as R
from strata.engine.kernels.actq import ActQ, quantize_act, quantize_act_reference
from strata.index_format.ggml_types import BY_NAME, TYPES

EPS = float(np.finfo(np.float32).eps)
BLOCK_TYPES = [t for t in TYPES if t.quantized]
FLOAT_TYPES = [t for t in TYPES if not t.quantized]


def _shape(t) -> tuple[int, int]:
    """A row length whose act-block count is not a multiple of 8 where the type allows it (the
    kernel's 8-block steps then meet its 4- and 1-block tails), and an odd row count (uneven chunks)."""
    n_in = {32: 32 * 15, 64: 64 * 7, 256: 256 * 3, 1: 488}[t.block_size]  # 15 = 8 + 4 + 3 act-blocks; 488 % 16 = 8
    return n_in, 9


def _acts(n_in: int, n_tok: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_tok, n_in)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    x[:, 32:64] *= 1e-3  # blocks of very different scales
    return x


def _same(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    g, r = got.view(np.uint32), np.ascontiguousarray(ref, np.float32).view(np.uint32)
    bad = np.argwhere(g != r)
    assert bad.size == 0, f"{what}: {len(bad)} outputs differ, first {tuple(bad[0])}: {got[tuple(bad[0])]!r} vs reference {ref[tuple(bad[0])]!r}"


# F32/F16/BF16 weights have the row kernels only
@pytest.mark.parametrize("t,kernel", [(t, k) for t in TYPES for k in KERNELS if t.quantized or k == "rows"],
                         ids=lambda v: getattr(v, "name", v))
def test_matvec_and_matmul_equal_the_reference_bit_for_bit(t, kernel):
    n_in, n_out = _shape(t)
    raw = random_weights(t, n_in * n_out, np.random.default_rng(t.id))
    x = _acts(n_in, 5, t.id)
    act = quantize_act(x) if t.quantized else x
    with cpu_path(kernel=kernel):
        y = cpu.matmul(raw, t.id, n_in, n_out, act)
    _same(y, R.dot_reference(raw, t.id, n_in, n_out, act), f"{t.name} matmul")
    for b in range(5):  # a batch row is the single-token product, to the bit
        one = ActQ(act.q[b], act.d[b], act.s16[b]) if t.quantized else x[b]
        _same(cpu.matvec(raw, t.id, n_in, n_out, one), y[b], f"{t.name} matvec token {b}")


@pytest.mark.parametrize("name,n_in,n_out", [("Q8_0", 2560, 640), ("IQ2_XXS", 2560, 640), ("Q2_0", 640, 2560), ("IQ4_NL", 640, 2560)])
def test_expert_shapes_equal_the_reference(name, n_in, n_out):
    t = BY_NAME[name]
    raw = random_weights(t, n_in * n_out, np.random.default_rng(1))
    act = quantize_act(_acts(n_in, 2, 2))
    y = cpu.matmul(raw, t.id, n_in, n_out, act)
    _same(y, R.dot_reference(raw, t.id, n_in, n_out, act), f"{name} [{n_in} x {n_out}]")


ROWDOT_TYPES = ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL"]
# Q2_0's 64-element blocks go in act-block pairs: 2 blocks (a 4-block tail group of 2), 10 (the
# expert down projections' 640: a whole group and a tail of 4), 12 (16 + 8), 18 (two groups and 4),
# 40 (whole groups only)
Q2_SIZES = [128, 640, 768, 1152, 2560]


def _need_rowdot():
    from strata.engine.kernels import rowdot

    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
    return rowdot


def _need_iq(*names):
    rowdot = _need_rowdot()
    if any(n in rowdot.IQTYPES for n in names) and not rowdot.IQ_AVAILABLE:
        pytest.skip(f"rowdot.py's IQ2/IQ3 kernels need AVX512-VBMI and AVX512VL, or AVX2 (and STRATA_ROWDOT_IQ_AVX2 not 0); this host's features: {sorted(cpu.simd._X86) or 'none'}")
    return rowdot


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("name,n_in", [(n, k) for n in ROWDOT_TYPES for k in (320, 544, 640, 704, 768, 2560)] + [("Q2_0", k) for k in Q2_SIZES],
                         ids=lambda v: v if isinstance(v, str) else f"{v // 32}-blocks")
def test_token_kernel_equals_the_general_kernel_and_the_reference(name, n_in, parallel):
    # rowdot.py's one-token kernel (the LM head, hyper-connections, GDN projections) reads the
    # blocks in place: its 16-block groups meet a tail of 9-15 (10 blocks), an 8-block tail group
    # (22 = 16 + 6, 24 = 16 + 8), a 4-block one (17 = 16 + 1, 20 = 16 + 4: the expert downs' rows
    # of 640) and whole groups only (80, the head's rows), on the calling thread and over the pool
    # (uneven chunks: 37 rows)
    rowdot = _need_rowdot()
    t = BY_NAME[name]
    raw = random_weights(t, n_in * 37, np.random.default_rng(n_in + t.id))
    act = quantize_act(_acts(n_in, 1, n_in)[0])
    with cpu_path(parallel):
        got = cpu.matvec(raw, t.id, n_in, 37, act)
    assert rowdot._KERNELS[name, parallel, False].signatures, "the token kernel was not taken"
    general = np.empty((1, 37), np.float32)
    cpu._kernel(name, False)(raw, t.type_size, t.row_bytes(n_in), act.q, act.d[None], act.s16[None], cpu.F16_TO_F32, general, 1)
    _same(got, general[0], f"{name} [{n_in} x 37] token kernel vs the general row kernel")
    _same(got, R.dot_reference(raw, t.id, n_in, 37, ActQ(act.q[None], act.d[None], act.s16[None]))[0], "vs the reference")


def _fine_reference(raw: np.ndarray, t, n_in: int, n_out: int, q: np.ndarray, d16: np.ndarray) -> np.ndarray:
    """docs/kernels.md's arithmetic for a unit-scale 32-element type against activations with a
    scale per 16 (the fine ActQ form), in numpy f32: term[b] = wf[b] (xd0[b] f32(lo[b]) + xd1[b]
    f32(hi[b])), lanes b % 32 from +0 in block order, then the fold."""
    nb = n_in // 32
    f = R.decompose(raw, t.id, n_in * n_out)
    wf = f.wf.reshape(n_out, nb).astype(np.float32)
    wq = f.q.astype(np.int64).reshape(n_out, nb, 2, 16)
    sums = (wq * q.astype(np.int64).reshape(1, nb, 2, 16)).sum(axis=-1)  # [n_out, nb, 2], exact
    xd = d16.reshape(nb, 2)
    term = wf * (xd[:, 0] * sums[:, :, 0].astype(np.float32) + xd[:, 1] * sums[:, :, 1].astype(np.float32))
    return R.fold_lanes(R.accumulate_lanes(term))


@pytest.mark.parametrize("name,n_in", [(n, k) for n in ROWDOT_TYPES for k in (320, 544, 2560)] + [("Q2_0", k) for k in Q2_SIZES],
                         ids=lambda v: v if isinstance(v, str) else f"{v // 32}-blocks")
def test_token_kernel_reads_the_fine_activation_form(name, n_in):
    # The fine ActQ (a scale per 16 elements: what llama.cpp's Q8_0-activation types read) has
    # twice the scales: the token kernel takes each block's two halves with their own scale
    rowdot = _need_rowdot()
    t = BY_NAME[name]
    raw = random_weights(t, n_in * 37, np.random.default_rng(n_in + 1))
    x = _acts(n_in, 1, n_in + 1)[0].reshape(-1, 16)
    d16 = (np.abs(x).max(axis=1) / np.float32(127)).astype(np.float32)
    q = np.clip(np.rint(x / d16[:, None]), -127, 127).astype(np.int8).reshape(-1)
    s16 = q.astype(np.int32).reshape(-1, 16).sum(axis=1, dtype=np.int32)
    out = np.empty(37, np.float32)
    want = _fine_reference(raw, t, n_in, 37, q, d16)
    for parallel in (False, True):
        rowdot.matvec(name, raw, t.row_bytes(n_in), q, d16, s16, out, parallel, 3 if parallel else 1)
        _same(out, want, f"{name} [{n_in} x 37] fine form, parallel={parallel}")


@pytest.mark.parametrize("n_in", [256, 1280, 2560, 6144], ids=lambda n: f"{n // 256}-superblocks")
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ3_XXS"])
def test_k_quant_token_kernel_equals_the_general_kernel_and_the_reference(name, n_in, parallel):
    # qwen35moe's LM head (Q6_K), projections and shared experts (Q4_K, Q6_K), the seed-4l shared
    # experts' gate and up (IQ4_XS) and routed experts' (IQ2_XXS, IQ2_XS, IQ3_XXS: grids, sign bits,
    # per-half scales)
    # take rowdot.py's one-token super-block kernel: super-blocks go four to a loop turn (one lane
    # quarter each), so 1, 5 (4 + 1), 10 (4 + 4 + 2) and 24 super-blocks meet every partial turn;
    # 37 rows split unevenly; random bytes give every grid index, sign pattern and scale
    rowdot = _need_iq(name)
    t = BY_NAME[name]
    raw = random_weights(t, n_in * 37, np.random.default_rng(n_in + t.id))
    act = quantize_act(_acts(n_in, 1, n_in)[0])
    with cpu_path(parallel):
        got = cpu.matvec(raw, t.id, n_in, 37, act)
    assert rowdot._KERNELS[name, parallel, False].signatures, "the token kernel was not taken"
    general = np.empty((1, 37), np.float32)
    cpu._kernel(name, False)(raw, t.type_size, t.row_bytes(n_in), act.q, act.d[None], act.s16[None], cpu.F16_TO_F32, general, 1)
    _same(got, general[0], f"{name} [{n_in} x 37] token kernel vs the general row kernel")
    _same(got, R.dot_reference(raw, t.id, n_in, 37, ActQ(act.q[None], act.d[None], act.s16[None]))[0], "vs the reference")


def test_k_quant_token_kernel_refuses_the_fine_activation_form():
    # the K kernels read one activation scale per 32 elements; a scale per 16 would be read as the
    # wrong blocks' scales, so it is refused by name instead
    rowdot = _need_rowdot()
    t = BY_NAME["Q4_K"]
    raw = random_weights(t, 256 * 2, np.random.default_rng(5))
    q, d16, s16 = np.zeros(256, np.int8), np.ones(16, np.float32), np.zeros(16, np.int32)
    with pytest.raises(ValueError, match="Q4_K takes activations with a scale per 32 elements, got 16 scales for 256"):
        rowdot.matvec("Q4_K", raw, t.row_bytes(256), q, d16, s16, np.empty(2, np.float32), False, 1)


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("names", [("Q5_0", "Q4_0"), ("IQ4_NL", "Q8_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q8_0"),
                                   ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"), ("IQ4_XS", "IQ4_XS")],
                         ids="+".join)
def test_several_products_of_one_token_in_one_region_equal_matvec_each(names, parallel):
    # a decode step's products on one input (GDN qkv and gate, attention q/k/v, a shared expert's
    # gate and up) run as one parallel region: every row of every matrix is its own matvec's,
    # whichever matrix the chunk boundaries cut through (19, 37 and 5 rows)
    rowdot = _need_iq(*names)
    n_in, sizes = 512, (19, 37, 5)
    act = quantize_act(_acts(n_in, 1, 11)[0])
    products, want = [], []
    for i, name in enumerate(names):
        t = BY_NAME[name]
        raw = random_weights(t, n_in * sizes[i], np.random.default_rng(i))
        products.append((raw, t.id, n_in, sizes[i], np.full(sizes[i], np.nan, np.float32)))
        want.append(cpu.matvec(raw, t.id, n_in, sizes[i], act))
    with cpu_path(parallel):
        cpu.matvec_many(products, act)
    assert rowdot._MANY[names, (False,) * len(names), parallel].signatures, "the one-region kernel was not taken"
    for (*_, out), w, name in zip(products, want, names):
        _same(out, w, f"{name} in {'+'.join(names)}")


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("names, wides", [(("Q5_0", "Q4_0"), (True, False)), (("IQ4_NL", "Q8_0", "Q8_0"), (True, True, True)),
                                          (("Q4_K", "Q8_0", "Q5_0"), (False, True, False)),
                                          (("Q5_0", "Q4_0", "BF16", "BF16"), (True, False, False, False)),
                                          (("IQ4_NL", "Q8_0", "Q8_0", "BF16", "BF16"), (True, True, True, False, False)),
                                          (("F32", "F16"), (False, False))],
                         ids=["gdn-qkv-wide+gate", "qsa-qkv-all-wide", "k+wide+8bit", "gdn-qkv+gate+alpha+beta",
                              "qsa-qkv+indexer", "f32+f16"])
def test_products_of_the_wide_and_the_8bit_form_of_one_input_share_one_region(names, wides, parallel):
    # a GDN layer's qkv reads the wide form (ActQ16) and its gate the 8-bit one, QSA's q/k/v all
    # the wide form: with a product per region for them (as before), a token paid 5 regions more
    # (docs/performance.md). Each out must be bit for bit its own matvec of its own form.
    rowdot = _need_rowdot()
    from strata.engine.kernels.actq import quantize_act16

    n_in = 512
    sizes = (19, 37, 5, 11, 3)
    x = _acts(n_in, 1, 12)[0]
    act, act16 = quantize_act(x), quantize_act16(x)
    products, forms, want = [], [], []
    for i, (name, wide) in enumerate(zip(names, wides)):
        t = BY_NAME[name]
        raw = random_weights(t, n_in * sizes[i], np.random.default_rng(20 + i))
        form = act16 if wide else act if t.quantized else x
        products.append((raw, t.id, n_in, sizes[i], np.full(sizes[i], np.nan, np.float32)))
        forms.append(form)
        want.append(cpu.matvec(raw, t.id, n_in, sizes[i], form))
    with cpu_path(parallel):
        cpu.matvec_many(products, forms)
    assert rowdot._MANY[names, wides, parallel].signatures, "the one-region kernel was not taken"
    for (*_, out), w, name in zip(products, want, names):
        _same(out, w, f"{name} in {'+'.join(names)}")


@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("name", ["IQ4_XS", "Q3_K", "BF16", "F32"])
def test_two_products_of_a_type_without_a_token_kernel_share_one_region(name, parallel):
    # a shared expert's gate and up (IQ4_XS in the released qwen4exp mix) and QSA's indexer q/k
    # (BF16) were a region each: 6 more per seed-4l token. The pair kernel walks both matrices'
    # rows as one range (the chunk cuts through either): each out is its own matvec's bits.
    n_in, sizes = 512, (37, 19)
    t = BY_NAME[name]
    x = _acts(n_in, 1, 13)[0]
    act = quantize_act(x) if t.quantized else x
    products, want = [], []
    for i, n_out in enumerate(sizes):
        raw = random_weights(t, n_in * n_out, np.random.default_rng(30 + i))
        products.append((raw, t.id, n_in, n_out, np.full(n_out, np.nan, np.float32)))
        want.append(cpu.matvec(raw, t.id, n_in, n_out, act))
    rowdot = cpu.rowdot
    available = rowdot.AVAILABLE
    # float rows go to rowdot's kernel where it runs, and so does IQ4_XS (its super-block token kernel):
    # the pair kernel is what a host without rowdot takes for them
    rowdot.AVAILABLE = available and t.quantized and name not in rowdot.KTYPES
    try:
        with cpu_path(parallel):
            cpu.matvec_many(products, act)
    finally:
        rowdot.AVAILABLE = available
    assert cpu._PAIRS[name, parallel].signatures, "the pair kernel was not taken"
    for (*_, out), w, which in zip(products, want, ("first", "second")):
        _same(out, w, f"{name} pair, {which} matrix")


def test_several_products_fall_back_to_one_matvec_each_where_a_type_has_no_token_kernel():
    t, f = BY_NAME["Q4_0"], BY_NAME["BF16"]
    raw_q, raw_f = random_weights(t, 256 * 3, np.random.default_rng(1)), random_weights(f, 256 * 4, np.random.default_rng(2))
    act = quantize_act(_acts(256, 1, 3)[0])
    out_q = np.empty(3, np.float32)
    cpu.matvec_many([(raw_q, t.id, 256, 3, out_q)], act)
    _same(out_q, cpu.matvec(raw_q, t.id, 256, 3, act), "one product")
    with pytest.raises(TypeError, match=r"BF16 weights take f32 activations \[256\], got ActQ"):
        cpu.matvec_many([(raw_q, t.id, 256, 3, out_q), (raw_f, f.id, 256, 4, np.empty(4, np.float32))], act)
    with pytest.raises(ValueError, match=r"matvec_many\(Q4_0\): out must be contiguous f32 \[3\]"):
        cpu.matvec_many([(raw_q, t.id, 256, 3, np.empty(4, np.float32)), (raw_q, t.id, 256, 3, out_q)], act)


def _accuracy(t, n_in, n_out, seed):
    """Kernel error relative to sum |w_i a_i| (scale-free), against float64 on the same inputs:
    the dequantized weights times the dequantized ActQ activations (or the f32 activations)."""
    raw = random_weights(t, n_in * n_out, np.random.default_rng(seed))
    x = _acts(n_in, 2, seed)
    act = quantize_act(x) if t.quantized else x
    y = cpu.matmul(raw, t.id, n_in, n_out, act).astype(np.float64)
    w = R.dequantize(raw, t.id, n_in * n_out).astype(np.float64).reshape(n_out, n_in)
    a = act.values() if t.quantized else x.astype(np.float64)
    exact = a @ w.T
    w_mag = np.abs(w)
    if t.quantized:  # with a min term, |w| can cancel: measure against |d sc q| + |dmin m|
        f = R.decompose(raw, t.id, n_in * n_out)
        w_mag = np.abs(f.wf[:, None, None] * f.ws[:, :, None].astype(np.float64) * f.q.reshape(-1, 2, 16))
        if f.mn is not None:
            w_mag = w_mag + np.abs(f.wm[:, None] * f.mn.astype(np.float64))[:, :, None]
        w_mag = w_mag.reshape(n_out, n_in)
    mag = np.abs(a) @ w_mag.T + 1e-300
    return np.abs(y - exact) / mag, y, exact


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_accuracy_against_float64(t):
    # Budget in units of eps * sum|w a|: the dequantizer's own f32 roundings (<= 3), each term's
    # (<= 3: two products and the conversion is exact), the lane chain (n_in/32/32 adds at most)
    # and the fold (5); doubled for margin. A wrong scale or a lost block is off by >> 1e-3.
    n_in, n_out = _shape(t)
    err, y, exact = _accuracy(t, n_in, n_out, 100 + t.id)
    tol = 2 * (3 + 3 + 1 + n_in // 1024 + 5) * EPS
    if not t.quantized:  # f32 products of f32 values: one rounding each, n_in/32 adds per lane
        tol = 2 * (1 + n_in // 32 + 5) * EPS
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] <= tol, f"{t.name}: worst row {worst}: {y[worst]!r} vs float64 {exact[worst]!r} (rel {err[worst]:.3g} > {tol:.3g})"


def test_results_do_not_depend_on_the_thread_count():
    t = BY_NAME["Q4_K"]
    raw = random_weights(t, 1024 * 37, np.random.default_rng(3))
    act = quantize_act(_acts(1024, 3, 3))
    with cpu_path(False, threads=1):
        one = cpu.matmul(raw, t.id, 1024, 37, act)
    with cpu_path(True, threads=cpu.numba.config.NUMBA_NUM_THREADS):
        many = cpu.matmul(raw, t.id, 1024, 37, act)
    _same(many, one, "threads")


@pytest.mark.parametrize("name", ["Q8_0", "IQ2_XS", "Q4_K"])
def test_many_tokens_walked_in_tiles_equal_the_reference(name):
    # more tokens than one tile of activations (cpu._TILE_BYTES): the rows meet them tile by tile
    t = BY_NAME[name]
    n_in = 2560
    n_tok = 2 * (cpu._TILE_BYTES // n_in) + 7  # two whole tiles and a partial one
    raw = random_weights(t, n_in * 9, np.random.default_rng(4))
    act = quantize_act(_acts(n_in, n_tok, 4))
    want = R.dot_reference(raw, t.id, n_in, 9, act)
    for parallel in (False, True):
        with cpu_path(parallel):
            _same(cpu.matmul(raw, t.id, n_in, 9, act), want, f"{name} {n_tok} tokens, parallel={parallel}")


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XS", "Q5_1", "BF16"])
def test_serial_and_parallel_paths_give_the_same_bits(name):
    # Small calls run on the calling thread, large ones over the pool (cpu.SERIAL_BELOW): two
    # compiled kernels, one arithmetic. 37 rows: uneven chunks for the parallel one.
    if cpu.numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one CPU thread (NUMBA_NUM_THREADS=1): every call takes the serial path")
    t = BY_NAME[name]
    n_in = _shape(t)[0]
    raw = random_weights(t, n_in * 37, np.random.default_rng(5))
    x = _acts(n_in, 3, 5)
    act = quantize_act(x) if t.quantized else x
    with cpu_path(False):
        one = cpu.matmul(raw, t.id, n_in, 37, act)
    with cpu_path(True):
        many = cpu.matmul(raw, t.id, n_in, 37, act)
    assert cpu._kernel(name, False).signatures and cpu._kernel(name, True).signatures, "a path was not taken"
    _same(many, one, f"{name} parallel vs serial")
    _same(one, R.dot_reference(raw, t.id, n_in, 37, act), f"{name} serial")


def test_set_threads_refuses_an_impossible_count():
    with pytest.raises(ValueError, match="threads asked for"):
        cpu.set_threads(0)
    with pytest.raises(ValueError, match="NUMBA_NUM_THREADS"):
        cpu.set_threads(cpu.numba.config.NUMBA_NUM_THREADS + 1)


def test_no_fused_multiply_add_in_the_compiled_kernels(monkeypatch):
    # The specification rounds every product before the add; an FMA (fastmath, or a compiler
    # contracting a*b+c) would change the bits and the GPU could no longer match them.
    for name in ("Q4_K", "Q8_0", "F16"):
        t = BY_NAME[name]
        n_in, n_out = _shape(t)
        raw = random_weights(t, n_in * n_out, np.random.default_rng(0))
        # 2 tokens: a single token of Q8_0 takes rowdot.py's kernel, checked below
        act = quantize_act(_acts(n_in, 2, 0)) if t.quantized else _acts(n_in, 2, 0)
        for parallel in (False, True):
            kernel = cpu._build(name, parallel)
            kernel._cache.disable()  # compile here: numba shows no machine code for a disk-cache load
            monkeypatch.setitem(cpu._KERNELS, (name, parallel), kernel)
            with cpu_path(parallel):
                cpu.matmul(raw, t.id, n_in, n_out, act)
            asm = "\n".join(kernel.inspect_asm().values())
            assert "vmulss" in asm or "vmulps" in asm, "no f32 multiply found: the check itself is broken"
            assert not re.search(r"\bv?f(n)?m(add|sub)\d", asm), f"{name}: FMA instruction in the kernel"
    from strata.engine.kernels import rowdot

    if rowdot.AVAILABLE:  # the one-token Q8_0 kernel (its own f32 terms and fold)
        kernel = rowdot._kernel("Q8_0", False, False)
        kernel._cache.disable()
        monkeypatch.setitem(rowdot._KERNELS, ("Q8_0", False, False), kernel)
        t = BY_NAME["Q8_0"]
        raw = random_weights(t, 2560 * 4, np.random.default_rng(0))
        with cpu_path(False):
            cpu.matvec(raw, t.id, 2560, 4, quantize_act(_acts(2560, 1, 0)[0]))
        asm = "\n".join(kernel.inspect_asm().values())
        assert "vmulps" in asm, "no f32 multiply found: the check itself is broken"
        assert not re.search(r"\bv?f(n)?m(add|sub)\d", asm), "Q8_0 token kernel: FMA instruction"


def test_bad_inputs_are_refused_with_the_reason():
    t = BY_NAME["Q8_0"]
    raw = random_weights(t, 256 * 4, np.random.default_rng(0))
    act = quantize_act(_acts(256, 1, 0)[0])
    with pytest.raises(ValueError, match=r"Q8_0 \[256 x 5\] is 1360 bytes, got 1088"):
        cpu.matvec(raw, t.id, 256, 5, act)
    with pytest.raises(TypeError, match="ActQ"):
        cpu.matvec(raw, t.id, 256, 4, _acts(256, 1, 0)[0])
    with pytest.raises(TypeError, match="ActQ"):
        cpu.matvec(raw, t.id, 512, 2, quantize_act(_acts(256, 1, 0)[0]))  # 512 != 256 activations
    with pytest.raises(TypeError, match="f32 activations"):
        cpu.matvec(random_weights(BY_NAME["F16"], 256 * 4, np.random.default_rng(0)), BY_NAME["F16"].id, 256, 4, act)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.matvec(np.repeat(raw, 2)[::2], t.id, 256, 4, act)
    with pytest.raises(ValueError, match="out must be contiguous"):  # a reshaped copy would be filled instead
        cpu.matvec(raw, t.id, 256, 4, act, out=np.empty(8, np.float32)[::2])
    with pytest.raises(ValueError, match="unknown GGML type 99"):
        cpu.matvec(raw, 99, 256, 4, act)


def test_out_buffer_is_filled_in_place():
    t = BY_NAME["IQ4_NL"]
    raw = random_weights(t, 256 * 6, np.random.default_rng(0))
    act = quantize_act(_acts(256, 1, 0)[0])
    out = np.full(6, np.nan, np.float32)
    assert cpu.matvec(raw, t.id, 256, 6, act, out=out) is not None
    _same(out, R.dot_reference(raw, t.id, 256, 6, act), "out=")


_FALLBACK_CHECK = """
import numpy as np, sys
sys.path.insert(0, {tests!r})
from kernel_blocks import random_weights
from strata.engine.kernels import cpu, reference as R, simd
from strata.engine.kernels.actq import quantize_act
from strata.index_format.ggml_types import BY_NAME
print("features:", sorted(simd._X86))
for name in ("Q2_K", "IQ4_NL", "Q2_0"):
    t = BY_NAME[name]
    n_in = 448 if name == "Q2_0" else (480 if t.block_size == 32 else 768)
    raw = random_weights(t, n_in * 5, np.random.default_rng(t.id))
    act = quantize_act(np.random.default_rng(1).standard_normal((2, n_in)).astype(np.float32))
    y = cpu.matmul(raw, t.id, n_in, 5, act)
    ok = np.array_equal(y.view(np.uint32), R.dot_reference(raw, t.id, n_in, 5, act).view(np.uint32))
    print(name, "same" if ok else "DIFFERENT")
"""


# the last: rowdot.py and the raw panels without AVX512-VBMI (Q2_0's fields by shifts, not vpmultishiftqb)
@pytest.mark.parametrize("features", ["", "ssse3,avx2", "ssse3,avx2,avx512bw,f16c", "ssse3,avx2,avx512f,avx512bw,avx512vnni,f16c"],
                         ids=["portable", "avx2", "avx512bw-no-vnni", "avx512-vnni-no-vbmi"])
def test_fallback_simd_paths_give_the_same_bits(features):
    # Each host compiles one path per primitive (VNNI, vpmaddwd, pshufb, F16C ...); the others
    # would first run on someone else's machine. Narrow the features and check them here.
    env = dict(os.environ, STRATA_SIMD_FEATURES=features)
    code = _FALLBACK_CHECK.format(tests=str(Path(__file__).resolve().parents[1]))  # tests/: kernel_paths.py
    # -P: the installed package, whatever the working directory holds
    res = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("same") == 3, res.stdout


def test_quantize_act_fills_out_in_place_and_allocates_nothing():
    x = _acts(4096, 3, 7)
    ref = quantize_act_reference(x)
    out = ActQ.empty(x.shape)
    assert quantize_act(x, out=out) is out
    one = ActQ.empty((4096,))
    assert quantize_act(x[1], out=one) is one
    for k in ("q", "d", "s16"):
        assert np.array_equal(getattr(out, k), getattr(ref, k)), f"out.{k} differs from the reference"
        assert np.array_equal(getattr(one, k), getattr(ref, k)[1]), f"out.{k} of one vector differs from the reference"
    # numpy reports its buffers to tracemalloc: the old path made q, d, s16 and an isfinite mask
    big = _acts(1 << 16, 1, 8)[0]
    buf = ActQ.empty(big.shape)
    quantize_act(big, out=buf)
    tracemalloc.start()
    try:
        quantize_act(big, out=buf)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4096, f"quantize_act(out=) allocated {peak} bytes for {big.nbytes} bytes of activations"


def test_quantize_act_refuses_a_wrong_out_and_non_finite_input():
    x = _acts(256, 2, 9)
    with pytest.raises(ValueError, match=r"out.q must be .* shape \[2, 256\]"):
        quantize_act(x, out=ActQ.empty((256,)))
    bad = ActQ.empty((2, 256))
    with pytest.raises(ValueError, match=r"out.s16 must be .*int32"):
        quantize_act(x, out=ActQ(bad.q, bad.d, bad.s16.astype(np.int64)))
    with pytest.raises(TypeError, match="out must be an ActQ"):
        quantize_act(x, out=np.empty(256, np.int8))
    x[1, 77] = np.inf
    with pytest.raises(ValueError, match=r"non-finite activation inf at index \(1, 77\)"):
        quantize_act(x, out=bad)


_CACHE_CHECK = """
import numpy as np, sys
sys.path.insert(0, {tests!r})
from kernel_blocks import random_weights
from strata.engine.kernels import cpu
from strata.engine.kernels.actq import quantize_act
from strata.index_format.ggml_types import BY_NAME
t = BY_NAME["Q4_1"]  # the row kernel: Q4_0 would take rowdot.py's kernel at 1 token and a raw panel at 2
raw = random_weights(t, 256 * 8, np.random.default_rng(0))
x = np.linspace(-1, 1, 256, dtype=np.float32)
y = cpu.matmul(raw, t.id, 256, 8, quantize_act(np.stack([x, x[::-1]])))
k = cpu._kernel("Q4_1", False)
print(sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()), y.view(np.uint32).tolist())
"""


_MANY_CACHE_CHECK = """
import numpy as np, sys
sys.path.insert(0, {tests!r})
from kernel_blocks import random_weights
from strata.engine.kernels import cpu, rowdot
from strata.engine.kernels.actq import quantize_act
from strata.index_format.ggml_types import BY_NAME
act = quantize_act(np.linspace(-1, 1, 512, dtype=np.float32))
ps = [(random_weights(BY_NAME[n], 512 * 3, np.random.default_rng(i)), BY_NAME[n].id, 512, 3, np.empty(3, np.float32))
      for i, n in enumerate({names!r})]
cpu.matvec_many(ps, act)
k = rowdot._MANY[{names!r}, (False, False), False]
print(sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()))
"""


def test_the_one_region_kernel_loads_from_the_disk_cache_in_a_new_process(tmp_path):
    # rowdot.many_kernel's kernels are made from source text per type tuple: their cached
    # environment names their module, or the second process failed loading it (a traceback at the
    # first decode step of every start after the first)
    _need_rowdot()
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    code = _MANY_CACHE_CHECK.format(tests=str(Path(__file__).resolve().parents[1]), names=("Q4_K", "Q8_0"))
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(res.stdout.split())
    assert runs == [["0", "1"], ["1", "0"]], f"(cache hits, compilations) of the two processes: {runs}"


_ORCHESTRATED = """
import hashlib, numpy as np, sys
sys.path.insert(0, {tests!r})
from numba import get_thread_id, njit
from kernel_blocks import random_weights
from kernel_paths import cpu_path
from strata.engine import ops
from strata.engine.kernels import cpu, simd
from strata.engine.kernels.actq import quantize_act
from strata.index_format.ggml_types import BY_NAME

@njit(inline="always")
def chunk(c, a):
    a[c] = get_thread_id()

def who(parallel):  # which thread took each of 64 queue items
    ids = np.full(64, -1, np.int64)
    njit(parallel=parallel)(lambda ids: simd.run_queue(8, 64, chunk, ids))(ids)
    return ",".join(map(str, sorted(set(ids.tolist()))))

out = hashlib.sha256()
rng = np.random.default_rng(0)
act = quantize_act(rng.standard_normal(2560).astype(np.float32))
for parallel in (True, False):
    with cpu_path(parallel):  # the token kernels: one product, one region of several, the routed experts
        for name in ("Q8_0", "Q4_K"):
            raw = random_weights(BY_NAME[name], 2560 * 300, np.random.default_rng(1))
            out.update(cpu.matvec(raw, BY_NAME[name].id, 2560, 300, act).tobytes())
        ps = [(random_weights(BY_NAME[n], 2560 * 70, np.random.default_rng(i)), BY_NAME[n].id, 2560, 70, np.empty(70, np.float32))
              for i, n in enumerate(("Q8_0", "Q5_0", "Q4_K"))]
        for y in cpu.matvec_many(ps, act):
            out.update(y.tobytes())
        for name, n_in, n_out in (("IQ4_NL", 640, 256), ("IQ2_XS", 2560, 64)):  # 3 experts, a token each
            t = BY_NAME[name]
            raw = random_weights(t, n_in * n_out * 3, np.random.default_rng(2))
            x = quantize_act(np.random.default_rng(3).standard_normal((3, n_in)).astype(np.float32))
            got = cpu.matmul_grouped(raw, t.id, n_in, n_out, np.arange(3) * t.nbytes((n_in, n_out)), x, np.arange(4))
            out.update(got.tobytes())
    S = rng.standard_normal((48, 16, 16)).astype(np.float32)
    v, o = rng.standard_normal((48, 16)).astype(np.float32), np.empty((48, 16), np.float32)
    qk = rng.standard_normal((2, 16, 16)).astype(np.float32) * 0.1
    ops.PARALLEL_MIN_STATE = 1 if parallel else 1 << 40
    ops.delta_rule_step(S, qk[0], qk[1], v, -np.ones(48, np.float32), np.full(48, 0.5, np.float32), o)
    out.update(S.tobytes() + o.tobytes())
print(simd.ORCHESTRATE, who(True), who(False), out.hexdigest())
"""


def test_an_orchestrating_main_thread_takes_no_chunk_and_changes_no_bit(tmp_path):
    # STRATA_MAIN_ORCHESTRATES=1 (simd.run_queue): in a parallel region the pool's thread 0 takes
    # nothing from the work queue, the other threads take everything; in a serial kernel (thread 0
    # alone) its drain after the loop does it all. The token kernels that share the queue give the
    # same bits with it and without it, and the orchestrated code loads from the disk cache in a
    # second process (it segfaulted there until the threading layer was started at import).
    if cpu.numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread in numba's pool: no other thread to leave the work to")
    code = _ORCHESTRATED.format(tests=str(Path(__file__).resolve().parents[1]))
    runs = {}
    for orchestrated in ("0", "1", "1"):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / orchestrated), STRATA_MAIN_ORCHESTRATES=orchestrated)
        res = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.setdefault(orchestrated, []).append(res.stdout.split(maxsplit=3))
    (plain,), (first, second) = runs["0"], runs["1"]
    # every item taken (none left at -1); plain, by any thread (the first to come may take all 64);
    # orchestrated, in the region by threads other than 0, and serially by thread 0
    assert plain[0] == "False" and "-1" not in plain[1].split(",") and plain[2] == "0", plain
    assert first[0] == "True" and not {"-1", "0"} & set(first[1].split(",")) and first[2] == "0", first
    assert first[2:] == second[2:] and first[3] == plain[3], (plain, first, second)


def test_a_kernel_switch_setting_never_loads_the_other_settings_machine_code(tmp_path):
    # the disk cache keys an entry by the kernels' source files, not by the environment: a region of
    # Q4_K and Q2_0 rows compiled with STRATA_ROWDOT_K_HADD=0 (or Q2_SHUFFLE=0, or another
    # PREFETCH) must compile its own code, not load the default's (rowdot._tag), else a comparison
    # run measures the same machine code twice
    rowdot = _need_rowdot()
    if not rowdot.AVX2:
        pytest.skip("the switches change the code on AVX2 hosts only (without AVX512-VNNI)")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    for k in ("STRATA_ROWDOT_K_HADD", "STRATA_ROWDOT_Q2_SHUFFLE", "STRATA_ROWDOT_PREFETCH", "STRATA_ROWDOT_PREFETCH_CACHE"):
        env.pop(k, None)
    code = _MANY_CACHE_CHECK.format(tests=str(Path(__file__).resolve().parents[1]), names=("Q4_K", "Q2_0"))
    runs = []
    for extra in ({}, {}, {"STRATA_ROWDOT_K_HADD": "0"}, {"STRATA_ROWDOT_Q2_SHUFFLE": "0"}, {"STRATA_ROWDOT_PREFETCH": "0"}):
        res = subprocess.run([sys.executable, "-P", "-c", code], env=dict(env, **extra), capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(res.stdout.split())
    assert runs == [["0", "1"], ["1", "0"], ["0", "1"], ["0", "1"], ["0", "1"]], f"(cache hits, compilations) of the five processes: {runs}"


def test_the_prefetch_cache_setting_compiles_its_own_code_on_every_rowdot_host(tmp_path):
    # STRATA_ROWDOT_PREFETCH_CACHE changes the prefetch instruction of every token kernel (not only
    # on AVX2 hosts, as the switches above): a comparison run with "l1" must not load the default's
    # machine code from the disk cache, nor the default the "l1" code
    _need_rowdot()
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("STRATA_ROWDOT_PREFETCH_CACHE", None)
    code = _MANY_CACHE_CHECK.format(tests=str(Path(__file__).resolve().parents[1]), names=("Q4_K", "Q2_0"))
    runs = []
    for extra in ({}, {"STRATA_ROWDOT_PREFETCH_CACHE": "l1"}, {"STRATA_ROWDOT_PREFETCH_CACHE": "l1"}, {}):
        res = subprocess.run([sys.executable, "-P", "-c", code], env=dict(env, **extra), capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(res.stdout.split())
    assert runs == [["0", "1"], ["0", "1"], ["1", "0"], ["1", "0"]], f"(cache hits, compilations) of the four processes: {runs}"
    bad = subprocess.run([sys.executable, "-P", "-c", "import strata.engine.kernels.rowdot"], capture_output=True, text=True,
                         env=dict(env, STRATA_ROWDOT_PREFETCH_CACHE="L3"), timeout=600)
    assert bad.returncode != 0 and "STRATA_ROWDOT_PREFETCH_CACHE='L3': expected one of l1, l2, nta" in bad.stderr, bad.stderr[-2000:]


_GRID_FORMS_CHECK = """
import numpy as np, sys
sys.path.insert(0, {tests!r})
from kernel_blocks import random_weights
from strata.engine.kernels import cpu, rowdot
from strata.engine.kernels import reference as R
from strata.engine.kernels.actq import ActQ, quantize_act
from strata.index_format.ggml_types import BY_NAME
cpu.set_threads(1)
rng = np.random.default_rng(5)
n_in, n_out = 1280, 37
act = quantize_act(rng.standard_normal((3, n_in)).astype(np.float32))
for name in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS"):
    t = BY_NAME[name]
    raw = random_weights(t, n_in * n_out, np.random.default_rng(t.id))
    one = ActQ(act.q[0], act.d[0], act.s16[0])
    assert np.array_equal(cpu.matvec(raw, t.id, n_in, n_out, one), R.dot_reference(raw, t.id, n_in, n_out, one)), name
    size = t.nbytes((n_in, n_out))
    got = cpu.matmul_grouped(np.concatenate([raw, raw]), t.id, n_in, n_out, np.array([0, size]), act, np.array([0, 1, 3]))
    assert np.array_equal(got, R.dot_reference(raw, t.id, n_in, n_out, act)), name + " (1 and 2 tokens an expert)"
print(sorted(rowdot.IQ_CODES))
"""


def test_the_grid_kernels_two_forms_give_the_same_bits_and_their_own_machine_code(tmp_path):
    # STRATA_ROWDOT_IQ_CODES picks, per grid type, the entries by byte permutes of their codes or
    # by loads (rowdot._grid_codes): each type's other form must give the reference's bits too (one
    # token, and 1 and 2 tokens an expert: the few-token kernel), compile its own code rather than
    # load the default's from the disk cache, and a type that is not a grid type is refused
    rowdot = _need_iq("IQ2_XXS")
    if not rowdot.IQ_VBMI:
        pytest.skip("the two forms are the AVX512-VBMI kernels' (the AVX2 form has one)")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    code = _GRID_FORMS_CHECK.format(tests=str(Path(__file__).resolve().parents[1]))
    for setting, want in ((None, ["IQ2_XXS", "IQ3_XXS"]), ("IQ2_XS", ["IQ2_XS"]), ("0", [])):
        e = {k: v for k, v in env.items() if k != "STRATA_ROWDOT_IQ_CODES"}
        if setting is not None:
            e["STRATA_ROWDOT_IQ_CODES"] = setting
        res = subprocess.run([sys.executable, "-P", "-c", code], env=e, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.split("\n")[-2] == str(want), res.stdout
    names = " ".join(p.name for p in tmp_path.rglob("*.nbi"))
    for tag in ("iq2_xxsloads", "iq3_xxsloads", "iq2_xscodes"):
        assert tag in names, f"no kernel compiled for the non-default form {tag}: {names}"
    bad = subprocess.run([sys.executable, "-P", "-c", "import strata.engine.kernels.rowdot"], capture_output=True, text=True,
                         env=dict(env, STRATA_ROWDOT_IQ_CODES="IQ4_NL"), timeout=600)
    assert bad.returncode != 0 and "STRATA_ROWDOT_IQ_CODES='IQ4_NL': expected grid types of" in bad.stderr, bad.stderr[-2000:]


def test_kernels_load_from_the_disk_cache_in_a_new_process(tmp_path):
    # Compiling took 20-30 s at every start of the demo model; a second process must load the
    # machine code. A narrowed feature set compiles other code for the same CPU: it must not
    # load the full set's entry (the fallback test above would then test nothing).
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("STRATA_SIMD_FEATURES", None)
    code = _CACHE_CHECK.format(tests=str(Path(__file__).resolve().parents[1]))  # tests/: kernel_paths.py
    runs = []
    for e in (env, env, dict(env, STRATA_SIMD_FEATURES="")):
        res = subprocess.run([sys.executable, "-P", "-c", code], env=e, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(res.stdout.split(maxsplit=2))
    (hit0, miss0, y0), (hit1, miss1, y1), (hit2, miss2, y2) = runs
    assert (hit0, miss0) == ("0", "1"), f"first process: {hit0} cache hits, {miss0} compilations"
    assert (hit1, miss1) == ("1", "0"), f"second process: {hit1} cache hits, {miss1} compilations (expected a load)"
    assert (hit2, miss2) == ("0", "1"), "narrowed SIMD features loaded the full feature set's machine code"
    assert y0 == y1 == y2
    assert list(tmp_path.rglob("strata-Q4_1-serial-*.nbc")), sorted(p.name for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("few", [True, False], ids=["unpacked-once", "token-by-token"])
@pytest.mark.parametrize("n_tok", [2, 3, 4])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("name", [*ROWDOT_TYPES, "Q2_0"])
def test_a_few_tokens_take_the_token_kernels_bits_with_each_row_read_once(name, parallel, n_tok, few, monkeypatch):
    # speculative decoding's verify forward (2-4 rows) multiplies through rowdot.matmul: each
    # token's result must be the one-token kernel's to the bit (greedy --spec N is --spec 0's).
    # Rows of 17 act-blocks (a 16-block group and 1), 20 (16 and 4: the expert downs), 80 (whole
    # groups); Q2_0's in pairs (Q2_SIZES). The wide form's planes (2 a token) too. Both kernels:
    # each block unpacked once for every token (ROW_FEW, up to 4 activation rows) and the
    # one-token row function token by token (_rows_kernel: more rows, the fine form, FEW off).
    from strata.engine.kernels.actq import WIDE, quantize_act16

    rowdot = _need_rowdot()
    monkeypatch.setattr(rowdot, "FEW", few)
    monkeypatch.setattr(rowdot, "_FEW_KERNELS", {})  # (so that the checks below see this test's calls)
    monkeypatch.setattr(rowdot, "_ROWS_KERNELS", {})
    t = BY_NAME[name]
    for n_in in Q2_SIZES[:3] if name == "Q2_0" else (544, 640, 2560):
        raw = random_weights(t, n_in * 37, np.random.default_rng(n_tok + t.id + n_in))
        act = quantize_act(_acts(n_in, n_tok, n_in + n_tok))
        with cpu_path(parallel):
            cpu.ROWDOT_ROWS_MAX = rowdot.ROWS_MAX  # cpu_path pins the row kernels; this is the few-token one
            got = cpu.matmul(raw, t.id, n_in, 37, act)
            alone = [cpu.matvec(raw, t.id, n_in, 37, ActQ(act.q[i], act.d[i], act.s16[i])) for i in range(n_tok)]
        for i in range(n_tok):
            _same(got[i], alone[i], f"{name} [{n_in} x 37] token {i} of {n_tok} vs alone")
        if name in WIDE:
            wide = quantize_act16(_acts(n_in, n_tok, 7 * n_in + n_tok) * 300)
            with cpu_path(parallel):
                cpu.ROWDOT_ROWS_MAX = rowdot.ROWS_MAX
                got = cpu.matmul(raw, t.id, n_in, 37, wide)
                alone = [cpu.matvec(raw, t.id, n_in, 37, wide.row(i)) for i in range(n_tok)]
            for i in range(n_tok):
                _same(got[i], alone[i], f"{name} [{n_in} x 37] wide, token {i} of {n_tok} vs alone")
            if few and 2 * n_tok <= rowdot.ROWS_MAX and not rowdot.needs_full(name, True):
                assert rowdot._FEW_KERNELS[name, parallel, 2 * n_tok].signatures, "ROW_FEW was not taken for the planes"
    if few:
        assert rowdot._FEW_KERNELS[name, parallel, n_tok].signatures, "ROW_FEW was not taken"
    else:
        assert rowdot._ROWS_KERNELS[name, parallel, False, False].signatures, "the token-by-token kernel was not taken"


def test_two_tokens_of_long_rows_take_the_few_token_rows_and_the_rest_the_raw_panel(monkeypatch):
    # cpu._multiply's rule (FEW_MIN_IN, FEW_MAX_ROWS: where ROW_FEW was measured faster than the
    # raw panel): 2 tokens of 2560-long Q8_0 rows take ROW_FEW; 3 tokens, or rows of 320, the panel
    rowdot = _need_rowdot()
    from strata.engine.kernels import panel

    if "Q8_0" not in panel.RAW:
        pytest.skip("no raw panel on this host: 2-4 tokens always take rowdot.matmul")
    t = BY_NAME["Q8_0"]
    taken = []
    monkeypatch.setattr(rowdot, "matmul", lambda *a, **k: taken.append("rows") or None)
    monkeypatch.setattr(cpu, "_panel", lambda *a, **k: lambda *b: taken.append("panel"))
    for n_in, n_tok in ((2560, 2), (2560, 3), (320, 2)):
        raw = random_weights(t, n_in * 37, np.random.default_rng(n_in))
        cpu.matmul(raw, t.id, n_in, 37, quantize_act(_acts(n_in, n_tok, n_in)))
    assert taken == ["rows", "panel", "panel"]


# The quant bytes of a block (what the extreme values overwrite; the fp16 and sub-block scales stay
# random): Q5_0's qh and qs, Q4_K's qs, Q6_K's ql and qh, IQ4_XS's qs
_QUANT_BYTES = {"Q8_0": (2, 34), "Q4_0": (2, 18), "Q5_0": (2, 22), "IQ4_NL": (2, 18), "Q2_0": (2, 18),
                "Q4_K": (16, 144), "Q6_K": (0, 192), "IQ4_XS": (8, 136)}  # fmt: skip


def _extreme_weights(t, n_in: int, n_out: int, seed: int) -> np.ndarray:
    """Random blocks, and blocks whose quant bytes are all 0x00 (every packed type's most negative
    value: Q4_0 -8, Q5_0 -16, IQ4_NL/IQ4_XS -127, Q2_0 -1, Q6_K -32), 0x80 (Q8_0's -128), 0x7F or
    0xFF (the most positive), a third of the blocks random."""
    raw = random_weights(t, n_in * n_out, np.random.default_rng(seed)).reshape(-1, t.type_size)
    a, b = _QUANT_BYTES[t.name]
    fills = np.uint8([0x00, 0x80, 0xFF, 0x7F])
    pick = np.random.default_rng(seed + 1).integers(0, 6, raw.shape[0])
    for k, v in enumerate(fills):
        raw[pick == k, a:b] = v
    return raw.reshape(-1)


def _extreme_acts(n_in: int, n_tok: int, top: int, seed: int) -> np.ndarray:
    """Activations whose every block has |x| = `top` at its first element, so d = 1 and q = x: the
    other values from +-top, +-128 (the wide form's lo plane -128, hi 1 or 0), +-1 and 0."""
    rng = np.random.default_rng(seed)
    vals = np.float32([top, -top, 128, -128, 1, -1, 0] if top > 128 else [top, -top, 1, -1, 0])
    x = rng.choice(vals, size=(n_tok, n_in)).astype(np.float32)
    x[:, ::32] = top * rng.choice(np.float32([1, -1]), size=(n_tok, n_in // 32))
    return x


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q2_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_every_token_kernel_form_is_exact_at_the_extreme_values(name):
    # AVX2 hosts have no vpdpbusd: rowdot multiplies by vpmaddubsw (pair sums saturating to int16),
    # and for the offset-128 types (Q8_0, IQ4_NL, IQ4_XS) as |w| times x with w's sign moved onto x
    # by vpsignb, which cannot negate -128 (it stays -128). The 8-bit forms never hold -128 (ActQ's
    # q is in -127..127); the wide form's lo plane does. Here every form the token kernels take
    # (8-bit and fine matvec, 2 rows through rowdot.matmul, the wide form of 1 and 2 rows, a
    # region of several products, one token per expert) meets blocks of the most negative and the
    # most positive weights against activations at +-127 (8-bit), +-32639 and lo = -128 (wide),
    # bit for bit the reference's. With f59059f's AVX2 kernels the wide form of 2 rows of Q8_0 and
    # IQ4_NL differed (every output): its 4 plane rows went through rowdot.matmul's 8-bit row
    # function, lo planes included (rowdot.ROW_FULL). One row takes the wide token kernel (ROW16).
    rowdot = _need_rowdot()
    from strata.engine.kernels.actq import WIDE, quantize_act16

    t = BY_NAME[name]
    n_in = {32: 544, 64: 640, 256: 1280}[t.block_size]  # a 16-block group and a tail; 5 super-blocks
    n_out = 37
    raw = _extreme_weights(t, n_in, n_out, 30 + t.id)
    act = quantize_act(_extreme_acts(n_in, 2, 127, 31))
    assert np.abs(act.q.astype(np.int32)).max() == 127 and (act.d == 1).all()

    def check(got, a, what):
        _same(got, R.dot_reference(raw, t.id, n_in, n_out, a), f"{name} {what}")

    def one8(i):
        return ActQ(act.q[i], act.d[i], act.s16[i])

    def both_row_kernels(got, what):  # rowdot.matmul's two kernels: each block unpacked once, token by token
        setting = rowdot.FEW
        for few in (True, False):
            rowdot.FEW = few
            try:
                got(f"{what}, {'unpacked once' if few else 'token by token'}")
            finally:
                rowdot.FEW = setting

    with cpu_path(False):
        cpu.ROWDOT_ROWS_MAX = rowdot.ROWS_MAX  # cpu_path pins the row kernels; 2-4 rows take rowdot.matmul here
        check(cpu.matvec(raw, t.id, n_in, n_out, one8(0)), one8(0), "8-bit matvec")
        both_row_kernels(lambda what: check(cpu.matmul(raw, t.id, n_in, n_out, act), act, what), "8-bit, 2 rows")
        out = np.full(n_out, np.nan, np.float32)
        cpu.matvec_many([(raw, t.id, n_in, n_out, out), (raw, t.id, n_in, n_out, np.empty(n_out, np.float32))], one8(1))
        check(out, one8(1), "8-bit in one region")
        size = t.nbytes((n_in, n_out))
        two = np.concatenate([raw, raw])
        got = cpu.matmul_grouped(two, t.id, n_in, n_out, np.array([size, 0]), act, np.array([0, 1, 2]))
        check(got, act, "one token per expert")
        if name in rowdot.TYPES:
            assert rowdot._KERNELS[name, False, False].signatures and rowdot._ROWS_KERNELS[name, False, False, False].signatures
            assert rowdot._FEW_KERNELS[name, False, 2].signatures
        if name in rowdot.TYPES and name not in rowdot.PAIRED:  # the fine form (a scale per 16): rowdot.matvec itself
            d16 = np.ones(n_in // 16, np.float32)
            fine = np.empty(n_out, np.float32)
            rowdot.matvec(name, raw, t.row_bytes(n_in), act.q[0], d16, act.s16[0], fine, False, 1)
            _same(fine, _fine_reference(raw, t, n_in, n_out, act.q[0], d16), f"{name} fine form")
        if name not in WIDE:
            return
        wide = quantize_act16(_extreme_acts(n_in, 2, 32639, 32))
        lo = wide.planes.q[1::2]
        assert (lo == -128).sum() > n_in // 4 and (wide.planes.d == 1).all(), "the lo plane does not hold -128"
        check(cpu.matvec(raw, t.id, n_in, n_out, wide.row(0)), wide.row(0), "wide matvec")
        one_row = wide.take(np.array([1]))
        check(cpu.matmul(raw, t.id, n_in, n_out, one_row), one_row, "wide, 1 row")
        both_row_kernels(lambda what: check(cpu.matmul(raw, t.id, n_in, n_out, wide), wide, what), "wide, 2 rows (4 plane rows)")
        out, out8 = np.full(n_out, np.nan, np.float32), np.full(n_out, np.nan, np.float32)
        cpu.matvec_many([(raw, t.id, n_in, n_out, out), (raw, t.id, n_in, n_out, out8)], [wide.row(1), one8(0)])
        check(out, wide.row(1), "wide in one region")
        check(out8, one8(0), "8-bit beside the wide form in one region")
        assert rowdot._KERNELS[name, False, "wide"].signatures, "the wide token kernel was not taken"
        key = (name, False, False, rowdot.needs_full(name, True))  # the lo rows by the full path on AVX2
        assert rowdot._ROWS_KERNELS[key].signatures, "rowdot.matmul was not taken for the wide form's planes"
        if name in rowdot.TYPES and not rowdot.needs_full(name, True):
            assert rowdot._FEW_KERNELS[name, False, 4].signatures, "ROW_FEW was not taken for the wide form's planes"


def _extreme_iq_weights(t, n_in: int, n_out: int, seed: int) -> np.ndarray:
    """Random IQ2_XXS / IQ2_XS / IQ3_XXS blocks, and blocks at the extremes of the integer sums:
    every grid index the entry with the largest aligned byte pair (vpmaddubsw sums pairs 2i, 2i + 1:
    43 + 43 for the IQ2 grids, 62 + 36 for IQ3_XXS's), the largest scales (2 * 15 + 1), and every
    sign negative (sign index 127, whose ksigns byte is 0xFF), every sign positive (0) or random,
    beside blocks left random. The fp16 d stays random."""
    rng = np.random.default_rng(seed)
    raw = random_weights(t, n_in * n_out, rng).reshape(-1, t.type_size)
    table, width = {"IQ2_XXS": (T.IQ2XXS_GRID, 8), "IQ2_XS": (T.IQ2XS_GRID, 8), "IQ3_XXS": (T.IQ3XXS_GRID, 4)}[t.name]
    entries = np.asarray(table, np.uint64 if width == 8 else np.uint32).view(np.uint8).reshape(-1, width).astype(int)
    top = int((entries[:, 0::2] + entries[:, 1::2]).max(axis=1).argmax())
    pick = rng.integers(0, 5, raw.shape[0])  # 0: all negative, 1: all positive, 2: random signs, else random
    for kind in (0, 1, 2):
        rows = raw[pick == kind]
        signs = {0: np.full((len(rows), 32), 127), 1: np.zeros((len(rows), 32), int), 2: rng.integers(0, 128, (len(rows), 32))}[kind]
        if t.name == "IQ2_XS":  # 32 x u16 at 2: grid index | sign index << 9; scale nibbles at 66
            rows[:, 2:66] = (top | signs << 9).astype("<u2").view(np.uint8).reshape(len(rows), 64)
            rows[:, 66:74] = 0xFF
        else:  # per act-block a u32 of 4 sign indices (bits 0, 7, 14, 21) and ls << 28
            aux = (signs.reshape(-1, 8, 4) << np.array([0, 7, 14, 21])).sum(axis=2) | 15 << 28
            aux = aux.astype("<u4").view(np.uint8).reshape(len(rows), 8, 4)
            if t.name == "IQ2_XXS":  # 8 x (4 grid index bytes, the u32) at 2
                rows[:, 2:66] = np.concatenate([np.full((len(rows), 8, 4), top), aux], axis=2).reshape(len(rows), 64)
            else:  # 64 grid index bytes at 2, the 8 u32 at 66
                rows[:, 2:66], rows[:, 66:98] = top, aux.reshape(len(rows), 32)
        raw[pick == kind] = rows
    return raw.reshape(-1)


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ3_XXS"])
def test_grid_token_kernels_are_exact_at_the_extreme_values(name):
    # The AVX2 form has no vpdpbusd: vpmaddubsw sums pairs saturating to int16, and vpsignb cannot
    # negate -128 (rowdot._iq_superblock_avx2 says how it avoids both). Every form the grid kernels
    # take (matvec, one region, one token per expert, 2-4 tokens per expert: the few-token
    # kernel) meets blocks of the largest grid pairs and scales, all signs negative or
    # positive, against activations at +-127, bit for bit the reference's. ActQ never holds -128
    # and these types never read the wide form, but the AVX2 form is exact for it too: q planes
    # holding -128, made by hand, through rowdot.matvec itself.
    rowdot = _need_iq(name)
    t = BY_NAME[name]
    n_in, n_out = 1280, 37  # 5 super-blocks: one whole turn of 4 and a partial one
    raw = _extreme_iq_weights(t, n_in, n_out, 40 + t.id)
    act = quantize_act(_extreme_acts(n_in, 5, 127, 41))
    assert np.abs(act.q.astype(np.int32)).max() == 127 and (act.d == 1).all()

    def check(got, a, what):
        _same(got, R.dot_reference(raw, t.id, n_in, n_out, a), f"{name} {what}")

    def rows(a, b):
        return ActQ(act.q[a:b], act.d[a:b], act.s16[a:b])

    with cpu_path(False):
        check(cpu.matvec(raw, t.id, n_in, n_out, ActQ(act.q[0], act.d[0], act.s16[0])), ActQ(act.q[0], act.d[0], act.s16[0]), "matvec")
        assert rowdot._KERNELS[name, False, False].signatures, "the token kernel was not taken"
        out = np.full(n_out, np.nan, np.float32)
        cpu.matvec_many([(raw, t.id, n_in, n_out, out), (raw, t.id, n_in, n_out, np.empty(n_out, np.float32))], ActQ(act.q[1], act.d[1], act.s16[1]))
        check(out, ActQ(act.q[1], act.d[1], act.s16[1]), "in one region")
        size = t.nbytes((n_in, n_out))
        three = np.concatenate([raw, raw, raw])
        for starts in ([0, 1, 2, 3], [0, 2, 3, 5]):  # one token per expert; 2, 1 and 2 tokens (the few-token kernel)
            n = starts[-1]
            got = cpu.matmul_grouped(three, t.id, n_in, n_out, np.array([0, size, 2 * size]), rows(0, n), np.array(starts))
            check(got, rows(0, n), f"tokens per expert {np.diff(starts).tolist()}")
        assert rowdot._GROUPED[name, False, True].signatures, "the few-token kernel was not taken"
    if not rowdot.IQ_AVX2:
        return  # the VNNI form negates the activations (x' = -x): exact for ActQ's -127..127 only
    q = np.random.default_rng(42).choice(np.int8([-128, 127, -127, 1, -1, 0]), n_in).astype(np.int8)
    q[::7] = -128
    s16 = q.astype(np.int32).reshape(-1, 16).sum(axis=1).astype(np.int32)
    d = np.ones(n_in // 32, np.float32)
    got = np.empty(n_out, np.float32)
    rowdot.matvec(name, raw, t.row_bytes(n_in), q, d, s16, got, False, 1)
    _same(got, R.dot_reference(raw, t.id, n_in, n_out, ActQ(q[None], d[None], s16[None]))[0], f"{name} activations holding -128")
