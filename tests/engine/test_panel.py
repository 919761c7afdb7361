"""panel.py's many-token kernels (16 rows in the vector lanes) against the numpy reference, bit for
bit: every type (block and float), panels of fewer than 16 rows, more tokens than one token tile, rows of more
act-blocks than lanes (lane b % 32 taking several terms) and of fewer; serial, parallel and any
thread count; no FMA in its code; and which products take it (cpu.PANEL_FROM).

On a host without AVX512-VNNI matmul never takes this kernel: the tests skip there, saying so."""

from __future__ import annotations

import re

import numpy as np
import pytest
from kernel_blocks import random_weights
from kernel_paths import cpu_path

from strata.engine.kernels import cpu, panel
from strata.engine.kernels import reference as R
from strata.engine.kernels.actq import quantize_act
from strata.index_format.ggml_types import BY_NAME, TYPES

N_OUT = 2 * panel.ROWS + 5  # two whole panels and one of 5 rows
N_TOK = 2 * panel.TOKEN_TILE + 3  # two whole token tiles and a partial one


def _n_in(t) -> int:
    """More act-blocks than lanes, and not a multiple of 16 (the padded panel width): 45, 46 or 40;
    for float weights 488 elements: 15 whole rounds of the lanes and 8 lanes of a 16th."""
    return {32: 32 * 45, 64: 64 * 23, 256: 256 * 5, 1: 488}[t.block_size]


def _acts(n_in: int, n_tok: int, seed: int, t=None):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_tok, n_in)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    x[:, 32:64] *= 1e-3  # act-blocks of very different scales
    x[n_tok // 2] = 0.0  # an all-zero token: half sums 0, scale 0
    return x if t is not None and not t.quantized else quantize_act(x)


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{what}: {len(bad)} outputs differ, first {tuple(bad[0])}: {got[tuple(bad[0])]!r} vs reference {want[tuple(bad[0])]!r}"


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_panel_equals_the_reference_bit_for_bit(t):
    n_in = _n_in(t)
    raw = random_weights(t, n_in * N_OUT, np.random.default_rng(t.id))
    act = _acts(n_in, N_TOK, t.id, t)
    with cpu_path(True, kernel="panel"):
        got = cpu.matmul(raw, t.id, n_in, N_OUT, act)
    assert cpu._PANEL[(t.name, False, True)].signatures, "the panel kernel was not taken"
    _same(got, R.dot_reference(raw, t.id, n_in, N_OUT, act), f"{t.name} panel")


@pytest.mark.parametrize("name,n_in", [("Q8_0", 320), ("Q4_K", 256), ("IQ4_NL", 32), ("Q2_0", 64), ("Q2_0", 640)])
def test_short_rows_equal_the_reference(name, n_in):
    # fewer act-blocks than lanes (10, 8, 1): untouched lanes stay +0.0 into the fold
    t = BY_NAME[name]
    raw = random_weights(t, n_in * N_OUT, np.random.default_rng(2))
    act = _acts(n_in, 7, 2)
    with cpu_path(False, kernel="panel"):
        got = cpu.matmul(raw, t.id, n_in, N_OUT, act)
    _same(got, R.dot_reference(raw, t.id, n_in, N_OUT, act), f"{name} [{n_in}]")


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XS", "Q5_1", "BF16"])
def test_serial_parallel_and_thread_counts_give_the_same_bits(name):
    t = BY_NAME[name]
    n_in = _n_in(t)
    raw = random_weights(t, n_in * N_OUT, np.random.default_rng(5))
    act = _acts(n_in, 5, 5, t)
    with cpu_path(False, kernel="panel"):
        one = cpu.matmul(raw, t.id, n_in, N_OUT, act)
    for threads in (2, cpu.numba.config.NUMBA_NUM_THREADS):
        with cpu_path(True, threads=threads, kernel="panel"):
            _same(cpu.matmul(raw, t.id, n_in, N_OUT, act), one, f"{name} parallel on {threads} threads")
    assert cpu._PANEL[(name, False, False)].signatures and cpu._PANEL[(name, False, True)].signatures


def test_products_of_few_tokens_keep_the_row_kernel(monkeypatch):
    # below PANEL_FROM tokens (PANEL_FROM_FLOAT for float weights, which also need 16 rows) the
    # panel's decode-and-transpose costs more than it saves: matvec and small batches take
    # cpu.py's row kernel, larger ones the panel
    if not panel.AVAILABLE:
        pytest.skip("no AVX512-VNNI: every product takes the row kernel")
    taken = []
    monkeypatch.setattr(cpu, "_panel", lambda *a, f=cpu._panel: taken.append("panel") or f(*a))
    monkeypatch.setattr(cpu, "_kernel", lambda *a, f=cpu._kernel: taken.append("rows") or f(*a))
    for name, first in (("Q6_K", cpu.PANEL_FROM), ("BF16", cpu.PANEL_FROM_FLOAT)):
        t = BY_NAME[name]
        raw = random_weights(t, 1024 * 16, np.random.default_rng(1))
        for n_tok in (1, first - 1, first):
            cpu.matmul(raw, t.id, 1024, 16, _acts(1024, n_tok, n_tok, t))
        cpu.matvec(raw, t.id, 1024, 16, _acts(1024, 1, 0, t)[0] if not t.quantized else quantize_act(np.ones(1024, np.float32)))
        assert taken == ["rows", "rows", "panel", "rows"], name
        taken.clear()
    cpu.matmul(raw[: 1024 * 8 * 2], t.id, 1024, 8, _acts(1024, 64, 0, t))  # BF16 of 8 rows
    assert taken == ["rows"]


def test_raw_types_take_the_panel_from_two_tokens(monkeypatch):
    # the 32-element unit-scale types build their panels from the raw blocks (panel.RAW), with no
    # decode to pay back: 2 tokens (two serving streams' step) already take the panel, which
    # gives the same bits; one token keeps the token path (rowdot.py)
    if not panel.RAW:
        pytest.skip("no AVX512-VNNI and F16C: no raw panels here")
    taken = []
    monkeypatch.setattr(cpu, "_panel", lambda *a, f=cpu._panel: taken.append("panel") or f(*a))
    monkeypatch.setattr(cpu, "_kernel", lambda *a, f=cpu._kernel: taken.append("rows") or f(*a))
    for name in panel.RAW:
        t = BY_NAME[name]
        n_in = 32 * 45 if t.block_size == 32 else 64 * 23  # an odd count of blocks (Q2_0: of act-block pairs)
        raw = random_weights(t, n_in * N_OUT, np.random.default_rng(9))
        for n_tok in (1, 2):
            act = _acts(n_in, n_tok, n_tok)
            _same(cpu.matmul(raw, t.id, n_in, N_OUT, act), R.dot_reference(raw, t.id, n_in, N_OUT, act), f"{name} at {n_tok} tokens")
        assert taken == ["rows", "panel"], name
        taken.clear()


def test_no_fused_multiply_add_in_the_panel_kernels(monkeypatch):
    # as test_kernels_cpu's check: an FMA rounds once where the specification rounds twice
    if not panel.AVAILABLE:
        pytest.skip("no AVX512-VNNI: the panel kernel is never compiled here")
    for name in ("Q4_K", "Q8_0", "F16"):
        t = BY_NAME[name]
        raw = random_weights(t, 256 * 20, np.random.default_rng(0))
        act = _acts(256, 4, 0, t)
        for parallel in (False, True):
            if t.quantized:
                dec, per, has_min, preset = cpu._DECODERS[name]
                kernel = panel.matmul_kernel(name, dec, per, has_min, preset, cpu._scales(name, preset), parallel)
            else:
                kernel = panel.float_matmul_kernel(name, cpu.simd.widen16["f16"], cpu._FLOAT[name][1], parallel)
            kernel._cache.disable()  # compile here: numba shows no machine code for a disk-cache load
            monkeypatch.setitem(cpu._PANEL, (name, False, parallel), kernel)
            with cpu_path(parallel, kernel="panel"):
                cpu.matmul(raw, t.id, 256, 20, act)
            asm = "\n".join(kernel.inspect_asm().values())
            assert "vmulps" in asm and ("vpdpbusd" in asm or not t.quantized), "no vpdpbusd or f32 multiply: the check itself is broken"
            assert not re.search(r"\bv?f(n)?m(add|sub)\d", asm), f"{name}: FMA instruction in the panel kernel"
