"""The wide activation form on the GPU side (gpu.quantize_act16_gpu, gpu.matvec / matmul of a
GpuActQ16, gpu_kernels.cu's actq16 and combine16) against actq.quantize_act16 and
reference.dot_reference, bit for bit; on the device ("cuda") or the host emulation ("emu"), as
test_kernels_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_blocks import random_weights

from strata.engine.kernels import gpu
from strata.engine.kernels import reference as R
from strata.engine.kernels.actq import Q16, WIDE, quantize_act16
from strata.index_format.ggml_types import BY_NAME


def _acts(n_in: int, n_tok: int, seed: int) -> np.ndarray:
    """Blocks of very different scales, an all-zero block, a subnormal one, and one whose q puts
    the lo byte at -128 (q = 256 k - 128)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_tok, n_in)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    x[:, 32:64] *= np.float32(1e-3)
    x[:, 64:96] = 0
    x[:, 96:128] = rng.standard_normal((n_tok, 32)).astype(np.float32) * np.float32(1e-40)
    x[:, 128:160] = (256 * (np.arange(32) - 16) - 128) / np.float32(Q16)
    x[:, 128] = -1
    return x


def _same(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    g, r = np.ascontiguousarray(got).view(np.uint32), np.ascontiguousarray(ref, np.float32).view(np.uint32)
    bad = np.argwhere(g != r)
    assert bad.size == 0, f"{what}: {len(bad)} differ, first {tuple(bad[0])}: GPU {got[tuple(bad[0])]!r} vs reference {ref[tuple(bad[0])]!r}"


@pytest.mark.parametrize("shape", [(3, 640), (1, 160), (320,)], ids=str)
def test_wide_actq_on_the_device_is_bit_identical(rt, shape):
    x = _acts(shape[-1], 1 if len(shape) == 1 else shape[0], 3).reshape(shape)
    got, want = gpu.quantize_act16_gpu(rt.to_device(x)).to_host(), quantize_act16(x)
    assert got.one == want.one
    assert (want.planes.q == -128).any(), "the case lo = -128 was not met"
    for field in ("q", "d", "s16"):
        g, w = getattr(got.planes, field), getattr(want.planes, field)
        assert g.shape == w.shape and np.array_equal(g.view(np.uint8), w.view(np.uint8)), f"plane {field} differs"


def test_wide_actq_refuses_a_non_finite_activation(rt):
    x = _acts(256, 2, 1)
    x[1, 37] = np.inf
    with pytest.raises(ValueError, match=r"non-finite activation inf at index \(1, 37\)"):
        gpu.quantize_act16_gpu(rt.to_device(x))


@pytest.mark.parametrize("name", sorted(WIDE))
def test_wide_products_are_bit_identical_to_the_reference(rt, name):
    t = BY_NAME[name]
    n_in, n_out = 64 * 5, 9
    raw = random_weights(t, n_in * n_out, np.random.default_rng(t.id))
    w = gpu.upload(raw, t.id, n_in, n_out)
    x = _acts(n_in, 5, t.id)
    act = quantize_act16(x)
    ref = R.dot_reference(raw, t.id, n_in, n_out, act)
    _same(rt.to_host(gpu.matmul(w, gpu.quantize_act16_gpu(rt.to_device(x)))), ref, f"{name} matmul")
    for b in (0, 4):
        one = gpu.quantize_act16_gpu(rt.to_device(x[b]))
        _same(rt.to_host(gpu.matvec(w, one)), ref[b], f"{name} matvec token {b}")
        out = rt.empty((n_out,), np.float32)
        gpu.matvec_into(w, one, out)
        _same(rt.to_host(out), ref[b], f"{name} matvec_into token {b}")


@pytest.mark.parametrize("name", sorted(WIDE))
def test_a_few_wide_rows_of_a_small_matrix_take_the_one_row_kernel(rt, name, monkeypatch):
    # mv<T, KPL, 1, NT>: a verify's 2-4 rows of the wide form in one launch, both planes of each row
    # (rows 2t, 2t + 1 of the planes) in registers, on a matrix of few weight rows, while 2 x NT x
    # KPL <= MVT_ACT (STRATA_MVT_TOKENS > 1); past that both planes as 2 NT rows and combine16. The
    # reference's bits either way.
    t = BY_NAME[name]
    monkeypatch.setattr(gpu, "_plans", {})
    monkeypatch.setattr(gpu, "MVT_TOKENS", gpu.MVT_MOST)
    for n_in in (64 * 5, 2560):
        kpl = next(k for k in gpu.KPLS if 32 * k >= n_in // 32)
        raw = random_weights(t, n_in * 9, np.random.default_rng(t.id + n_in))
        w = gpu.upload(raw, t.id, n_in, 9)
        x = _acts(n_in, 4, n_in)
        for n in (2, 3, 4):
            plan = gpu._wide_mv_plan(t.id, n_in, 9, n)
            assert (plan is not None and plan[1] == f"mv<{t.id}, {kpl}, 1, {n}>") == (2 * n * kpl <= gpu.MVT_ACT), (n_in, n, plan)
            ref = R.dot_reference(raw, t.id, n_in, 9, quantize_act16(x[:n]))
            _same(rt.to_host(gpu.matmul(w, gpu.quantize_act16_gpu(rt.to_device(x[:n])))), ref, f"{name} [{n_in} x 9], {n} rows")
    assert gpu._wide_mv_plan(t.id, 320, 2 * gpu.MVF_TASKS_PER_SM * rt.n_sm * 4, 2) is None  # (many weight rows: the planes on mvf)


@pytest.mark.parametrize("name", ["Q8_0", "Q2_0"])
def test_wide_rows_longer_than_matvec_holds_and_the_combine(rt, name):
    # 9216 elements: past mv's 8192, the one-token product takes the batched kernel on both planes
    t = BY_NAME[name]
    n_in, n_out = 9216, 3
    raw = random_weights(t, n_in * n_out, np.random.default_rng(2))
    w = gpu.upload(raw, t.id, n_in, n_out)
    x = _acts(n_in, 1, 2)[0]
    ref = R.dot_reference(raw, t.id, n_in, n_out, quantize_act16(x))
    _same(rt.to_host(gpu.matvec(w, gpu.quantize_act16_gpu(rt.to_device(x)))), ref, f"{name} [{n_in} x {n_out}]")
    # combine16 of the planes' products, several rows: rows 2t, 2t + 1 -> row t
    xs = _acts(n_in, 3, 4)
    y2 = gpu.matmul(w, gpu.quantize_act16_gpu(rt.to_device(xs)).planes)
    out = rt.empty((3, n_out), np.float32)
    gpu.combine16(y2, out)
    _same(rt.to_host(out), R.dot_reference(raw, t.id, n_in, n_out, quantize_act16(xs)), f"{name} combined")


def test_a_type_that_reads_8_bit_activations_refuses_the_wide_form(rt):
    t = BY_NAME["Q4_K"]
    w = gpu.upload(random_weights(t, 256 * 2, np.random.default_rng(0)), t.id, 256, 2)
    with pytest.raises(TypeError, match="Q4_K weights read 8-bit activations"):
        gpu.matvec(w, gpu.quantize_act16_gpu(rt.to_device(_acts(256, 1, 0)[0])))
