"""The GPU kernels (engine/kernels/gpu.py, gpu_kernels.cu) against the specification, bit for bit:

    quantize_act_gpu            ==  actq.quantize_act
    gpu.matvec / gpu.matmul     ==  reference.dot_reference  (==  cpu.matvec / cpu.matmul on the device run)
    upload -> GpuWeight.to_raw  ==  the pack bytes (engine form round trip)

Each test runs on two runtimes:
- "cuda" (@pytest.mark.gpu): CuPy on a CUDA device, every type at the expert shapes (640 x 2560 and
  2560 x 640), rows long enough for each register variant and one longer than the matvec kernel
  holds; skipped with the reason when CuPy or a device is missing. scripts/gpu_suite.sh runs these.
- "emu": the same CUDA source compiled for the host (tests/gpu_emu.py) on small shapes, so the
  kernels' logic is checked on every machine with a C++ compiler. What it cannot check: the
  asynchronous copies (emulated as synchronous), and the device's own float and integer
  instructions (emulated by their IEEE / C definitions).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_emu import EmuRuntime, unavailable_reason
from kernel_blocks import random_weights

from strata.engine.kernels import gpu
from strata.engine.kernels import reference as R
from strata.engine.kernels.actq import quantize_act
from strata.index_format.ggml_types import BY_NAME, TYPES

_CUDA_OK, _CUDA_WHY = gpu.available()
_EMU_WHY = unavailable_reason()



def _on_device(rt) -> bool:
    return isinstance(rt, gpu.CupyRuntime)


def _acts(n_in: int, n_tok: int, seed: int) -> np.ndarray:
    """Activations whose 32-blocks differ in scale by orders of magnitude, with an all-zero block
    (d == 0), a subnormal one, and exact ties (x / d = k + 1/2: round half to even decides)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_tok, n_in)) * rng.uniform(0.1, 10, (n_tok, 1))).astype(np.float32)
    if n_in >= 160:
        x[:, 32:64] *= np.float32(1e-3)
        x[:, 64:96] = 0
        x[:, 96:128] = rng.standard_normal((n_tok, 32)).astype(np.float32) * np.float32(1e-40)
        x[:, 128:160] = np.float32(2.5) * (np.arange(32) % 5 - 2)
        x[:, 159] = np.float32(127)  # amax 127: d = 1 exactly, so +-2.5 are ties (-> +-2)
    return x


def _bits_equal(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(got, np.float32).view(np.uint32) == np.ascontiguousarray(ref, np.float32).view(np.uint32)


def _assert_same(got: np.ndarray, ref: np.ndarray, what: str, cpu: np.ndarray | None = None) -> None:
    """Bit equality; on failure name the first differing (token, row), both values and their bits."""
    same = _bits_equal(got, ref)
    if same.all():
        return
    bad = np.argwhere(~same)
    i = tuple(int(v) for v in bad[0])
    g, r = np.float32(got[i]), np.float32(ref[i])
    msg = (
        f"{what}: {len(bad)} of {same.size} outputs differ; first at {'(token, row)' if len(i) == 2 else 'row'} {i}: "
        f"GPU {g!r} (0x{g.view(np.uint32):08x}) vs reference {r!r} (0x{r.view(np.uint32):08x})"
    )
    if cpu is not None:
        msg += f", CPU kernel {np.float32(cpu[i])!r}"
    pytest.fail(msg)


# ---------------------------------------------------------------------------------------------
# ActQ


@pytest.mark.parametrize("shape", [(5, 2560), (1, 640), (3, 96), (160,)], ids=str)
def test_actq_on_the_device_is_bit_identical(rt, shape):
    n = shape[-1]
    x = _acts(n, 1 if len(shape) == 1 else shape[0], 7).reshape(shape)
    got = gpu.quantize_act_gpu(rt.to_device(x)).to_host()
    want = quantize_act(x)
    assert got.q.shape == want.q.shape and got.d.shape == want.d.shape and got.s16.shape == want.s16.shape
    for field in ("q", "d", "s16"):
        g, w = getattr(got, field), getattr(want, field)
        same = g.view(np.uint8) == w.view(np.uint8) if field == "q" else g.view(np.uint32) == w.view(np.uint32)
        if not same.all():
            i = tuple(int(v) for v in np.argwhere(~same)[0])
            pytest.fail(f"ActQ {field}{list(shape)}: {int((~same).sum())} differ, first at {i}: device {g[i]!r} vs actq.quantize_act {w[i]!r}")


def test_actq_refuses_a_non_finite_activation(rt):
    x = _acts(256, 3, 1)
    x[1, 37] = np.inf
    x[2, 5] = np.nan
    with pytest.raises(ValueError, match=r"non-finite activation inf at index \(1, 37\)"):
        gpu.quantize_act_gpu(rt.to_device(x))


def test_actq_out_buffers_are_reused(rt):
    x = _acts(256, 2, 2)
    out = gpu.empty_act((2, 256))
    assert gpu.quantize_act_gpu(rt.to_device(x), out=out) is out
    assert np.array_equal(out.to_host().q, quantize_act(x).q)
    with pytest.raises(ValueError, match=r"out holds \[2, 256\] activations, x is \[3, 256\]"):
        gpu.quantize_act_gpu(rt.to_device(_acts(256, 3, 2)), out=out)


# ---------------------------------------------------------------------------------------------
# engine form on the device


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_engine_form_round_trip_on_the_device(rt, t):
    n_in, n_out = (256 * 3, 5) if t.quantized else (352, 5)
    raw = random_weights(t, n_in * n_out, np.random.default_rng(t.id))
    w = gpu.upload(raw, t.id, n_in, n_out, name="blk.0.test")
    assert np.array_equal(w.to_raw(), raw), f"{t.name}: upload -> to_raw changed the bytes"
    blocks = n_in * n_out // t.block_size
    assert w.nbytes == blocks * t.engine_block_bytes, f"{t.name}: {w.nbytes} device bytes, the table says {blocks} x {t.engine_block_bytes}"
    if t.quantized and t.n_scales:  # the scale plane holds the widened fp16 values themselves
        halves = np.concatenate([raw.reshape(blocks, t.type_size)[:, off : off + 2 * n] for off, n in t.fp16_fields], axis=1)
        assert np.array_equal(rt.to_host(w.scales), halves.copy().view(np.float16).astype(np.float32).reshape(-1))


# ---------------------------------------------------------------------------------------------
# the products


def _small_shape(t) -> tuple[int, int]:
    """An act-block count that is not a multiple of 32 (lanes with fewer blocks), odd row count."""
    return {32: 32 * 11, 64: 64 * 5, 256: 256 * 3, 1: 352}[t.block_size], 9


# (n_in, n_out, tokens): expert shapes, rows for each matvec register variant (nb = n_in / 32 up to
# 32, 64, 96, 128, 192, 256) and one row longer than matvec holds (the batched kernel, 1 token)
CUDA_SHAPES = [(2560, 640, (1, 5)), (640, 2560, (1, 5)), (2048, 16, (1,)), (4096, 16, (1,)), (6144, 16, (1,)), (8192, 16, (1, 3)), (16384, 24, (1, 3))]
EMU_LONG = {"Q4_K", "IQ4_XS", "Q5_0", "Q2_0", "IQ1_M", "F16"}  # the emulation's longer rows: one type per copy path


def _cases(rt, t):
    n_in, n_out = _small_shape(t)
    yield n_in, n_out, (1, 5, 70)  # 70 tokens: two passes of the batched kernel
    if _on_device(rt):
        for n_in, n_out, tokens in CUDA_SHAPES:  # 640 is not whole 256-blocks: 768 for those types
            yield -(-n_in // t.block_size) * t.block_size, n_out, tokens
        return
    yield 2560, 37, (1, 3)  # on one emulated multiprocessor: several rows per warp step, a ragged last step
    if t.name in EMU_LONG:
        yield 4096, 3, (1,)
        yield 8192 + 1024, 3, (1, 2)


def _reference(raw, t, n_in, n_out, act, rows: int = 2048):
    """R.dot_reference in pieces of `rows` rows: its block terms of a whole product are [tokens,
    n_out, blocks, ...] arrays, and mmt's many-tiles case on the H200 (135171 rows of 2560, 69
    tokens) took the host's 124 GiB and the OOM killer stopped the test process (2026-12-04)."""
    row_bytes = n_in // t.block_size * t.type_size
    return np.concatenate([R.dot_reference(raw[a * row_bytes : min(n_out, a + rows) * row_bytes], t.id, n_in,
                                           min(n_out, a + rows) - a, act) for a in range(0, n_out, rows)], axis=-1)


def _check_products(rt, t, n_in, n_out, tokens, seed):
    raw = random_weights(t, n_in * n_out, np.random.default_rng(seed))
    w = gpu.upload(raw, t.id, n_in, n_out)
    n_tok = max(tokens)
    x = _acts(n_in, n_tok, seed + 1)
    x_dev = rt.to_device(x)
    if t.quantized:  # the device's own ActQ, while the reference quantizes on the host
        act_dev, act = gpu.quantize_act_gpu(x_dev), quantize_act(x)
    else:
        act_dev, act = x_dev, x
    ref = _reference(raw, t, n_in, n_out, act)
    cpu_y = None
    if _on_device(rt):  # the triple equality (issue item 6) where the device is real
        from strata.engine.kernels import cpu

        cpu_y = cpu.matmul(raw, t.id, n_in, n_out, act)
    what = f"{t.name} [{n_in} x {n_out}]"
    for n in tokens:
        if n == 1:
            for b in (0, n_tok - 1):
                one = gpu.quantize_act_gpu(rt.to_device(x[b])) if t.quantized else rt.to_device(x[b])
                got = rt.to_host(gpu.matvec(w, one))
                _assert_same(got, ref[b], f"{what} matvec token {b}", None if cpu_y is None else cpu_y[b])
        else:
            sub = gpu.GpuActQ(act_dev.q[:n], act_dev.d[:n], act_dev.s16[:n], act_dev.bad) if t.quantized else act_dev[:n]
            got = rt.to_host(gpu.matmul(w, sub))
            _assert_same(got, ref[:n], f"{what} matmul T={n}", None if cpu_y is None else cpu_y[:n])
    if cpu_y is not None:
        _assert_same(cpu_y, ref, f"{what} CPU kernel (not the GPU) vs reference")


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_products_are_bit_identical_to_the_reference(rt, t):
    for n_in, n_out, tokens in _cases(rt, t):
        _check_products(rt, t, n_in, n_out, tokens, seed=t.id * 1000 + n_in)


@pytest.mark.parametrize("t", [t for t in TYPES if t.name.startswith(("IQ1", "IQ2", "IQ3"))], ids=lambda t: t.name)
def test_grid_types_with_the_grid_in_shared_memory(rt, t, monkeypatch, batched_kernel):
    # Head-sized matrices read the IQ grid from a per-block shared copy; force it on a small one
    # (mmq's decoded chunk then follows the copy in shared memory).
    monkeypatch.setattr(gpu, "SHARED_TABLE_ROWS", 0)
    _check_products(rt, t, 2048, 33, (1, 3), seed=t.id)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "IQ2_XXS", "F32", "F16"])
@pytest.mark.parametrize("n_outs", [(37, 5), (300, 1, 64), (33, 96, 7, 2)], ids=str)
def test_matvec_many_gives_each_matrix_its_own_bits(rt, name, n_outs, monkeypatch):
    # several matrices of one input in one launch (mvm / fmvm: each its share of the grid) against
    # each one's reference product; rows of different counts, so the plans' rows a warp step and
    # warps differ (the launch takes the widest block), and for a grid type the shared copy
    t = BY_NAME[name]
    if t.name == "IQ2_XXS":
        monkeypatch.setattr(gpu, "SHARED_TABLE_ROWS", 0)
    n_in = 2560
    rng = np.random.default_rng(t.id + len(n_outs))
    raws = [random_weights(t, n_in * n, rng) for n in n_outs]
    ws = [gpu.upload(raw, t.id, n_in, n) for raw, n in zip(raws, n_outs)]
    x = _acts(n_in, 1, 7)
    act = gpu.quantize_act_gpu(rt.to_device(x)) if t.quantized else rt.to_device(x)
    outs = [rt.to_device(np.full((1, n), np.nan, np.float32)) for n in n_outs]
    assert gpu.matvec_many(ws, act, outs)
    host_act = quantize_act(x) if t.quantized else x
    for j, (raw, n, out) in enumerate(zip(raws, n_outs, outs)):
        ref = R.dot_reference(raw, t.id, n_in, n, host_act)
        _assert_same(rt.to_host(out), ref, f"{name} matrix {j} of {len(n_outs)} [{n_in} x {n}]")


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "IQ2_XXS", "F32", "BF16"])
@pytest.mark.parametrize("n_tok", [2, 3, 8])
def test_matmul_many_gives_each_matrix_its_own_bits(rt, name, n_tok, monkeypatch):
    # a verify's few rows against several matrices of one input in one launch (mvfm / fmvm over the
    # rows) against each one's reference product, row by row; rows of different counts (the shared
    # expert's one-row gate among them), and for a grid type the shared copy
    t = BY_NAME[name]
    if t.name == "IQ2_XXS":
        monkeypatch.setattr(gpu, "SHARED_TABLE_ROWS", 0)
    n_in, n_outs = 2560, (33, 1, 96, 7)
    rng = np.random.default_rng(t.id + n_tok)
    raws = [random_weights(t, n_in * n, rng) for n in n_outs]
    ws = [gpu.upload(raw, t.id, n_in, n) for raw, n in zip(raws, n_outs)]
    x = _acts(n_in, n_tok, 11)
    act = gpu.quantize_act_gpu(rt.to_device(x)) if t.quantized else rt.to_device(x)
    outs = [rt.to_device(np.full((n_tok, n), np.nan, np.float32)) for n in n_outs]
    assert gpu.matmul_many(ws, act, outs)
    host_act = quantize_act(x) if t.quantized else x
    for j, (raw, n, out) in enumerate(zip(raws, n_outs, outs)):
        ref = R.dot_reference(raw, t.id, n_in, n, host_act)
        _assert_same(rt.to_host(out), ref, f"{name} matrix {j} of {len(n_outs)} [{n_in} x {n}], {n_tok} rows")


def test_matmul_many_refuses_what_one_launch_cannot_hold(rt, monkeypatch):
    rng = np.random.default_rng(4)
    q4 = BY_NAME["Q4_K"]
    a, b = (gpu.upload(random_weights(q4, 256 * 4, rng), q4.id, 256, 4) for _ in range(2))
    for n_tok in (1, gpu.MVF_TOKENS + 1):  # one row: matvec_many's; more than mvf takes: matmul's own launches
        act = gpu.quantize_act_gpu(rt.to_device(_acts(256, n_tok, 1)))
        assert not gpu.matmul_many([a, b], act, [rt.empty((n_tok, 4), np.float32) for _ in range(2)])
    monkeypatch.setattr(gpu, "MVF_TOKENS", 1)  # STRATA_MVF_TOKENS=1 and STRATA_MVT_TOKENS=1: the rows take mmq, one launch each
    monkeypatch.setattr(gpu, "MVT_TOKENS", 1)
    gpu._plans.clear()
    act = gpu.quantize_act_gpu(rt.to_device(_acts(256, 3, 1)))
    try:
        assert not gpu.matmul_many([a, b], act, [rt.empty((3, 4), np.float32) for _ in range(2)])
    finally:
        gpu._plans.clear()


def test_matvec_many_refuses_what_one_launch_cannot_hold(rt):
    rng = np.random.default_rng(3)
    q4, q6 = BY_NAME["Q4_K"], BY_NAME["Q6_K"]
    a = gpu.upload(random_weights(q4, 256 * 4, rng), q4.id, 256, 4)
    b = gpu.upload(random_weights(q6, 256 * 4, rng), q6.id, 256, 4)
    act = gpu.quantize_act_gpu(rt.to_device(_acts(256, 1, 1)))
    outs = [rt.empty((1, 4), np.float32) for _ in range(gpu.MANY + 1)]
    assert not gpu.matvec_many([a, b], act, outs[:2])  # two types
    assert not gpu.matvec_many([a], act, outs[:1])  # one matrix: matvec's own launch
    assert not gpu.matvec_many([a] * (gpu.MANY + 1), act, outs)  # more than the kernel's table


# ---------------------------------------------------------------------------------------------
# the batched products on the int8 tensor cores (mmt, or mmq where gpu.MMT_TYPES leaves a type out:
# gpu.MMA_TYPES) and on __dp4a (mm)


def test_mma_fragment_layout_is_a_plain_integer_product(rt):
    # mma_s8's fragments as gpu_kernels.cu loads them, through the instruction (the card's, or the
    # emulation's, written from the PTX ISA on its own), against numpy: a wrong layout on either
    # side moves or mixes sums. Extreme values included (-128 x -128, 127 x -128).
    rng = np.random.default_rng(5)
    A = rng.integers(-128, 128, (16, 16), dtype=np.int8)
    Bt = rng.integers(-128, 128, (8, 16), dtype=np.int8)
    A[0, :], Bt[0, :] = -128, -128
    A[15, :], Bt[7, :] = 127, -128
    mod = rt.compile(["mma_probe"])
    D = rt.to_device(np.zeros((16, 8), np.int32))
    rt.launch(mod, "mma_probe", 1, 32, (rt.to_device(A), rt.to_device(Bt), D))
    want = A.astype(np.int32) @ Bt.astype(np.int32).T
    got = rt.to_host(D)
    bad = np.argwhere(got != want)
    assert len(bad) == 0, f"{len(bad)} of 128 sums differ, first D{tuple(bad[0])}: {got[tuple(bad[0])]} vs {want[tuple(bad[0])]}"


def _take_batched(monkeypatch, kernel: str, names) -> None:
    """gpu.matmul's batched launches of the types `names` on `kernel` ("mm", "mmq" or "mmt") whatever
    the product's size (mmt's size rules have their own test); the launch plans made for this
    choice are dropped after."""
    names = frozenset(names)
    monkeypatch.setattr(gpu, "MMA_TYPES", names if kernel != "mm" else frozenset())
    monkeypatch.setattr(gpu, "MMT_TYPES", names if kernel == "mmt" else frozenset())
    monkeypatch.setattr(gpu, "MMT_MIN_TILES", 0)
    monkeypatch.setattr(gpu, "MMT_MIN_BLOCKS", 0)
    monkeypatch.setattr(gpu, "_plans", {})


@pytest.fixture(params=["mm", "mmq", "mmt"])
def batched_kernel(request, monkeypatch):
    """Which kernel gpu.matmul's batched launches take for every block type."""
    _take_batched(monkeypatch, request.param, (t.name for t in TYPES if t.quantized))
    return request.param


# mmq's item is 16 rows x 8 nw tokens and its chunk 32 act-blocks: rows 5 (< one group), 17 (one
# past) and 37; tokens 2 .. 40 (one n-block short, whole, one past, several warps and a ragged one);
# nb 24 (256-blocks x 3: one partial chunk) and 40 (x 5: a whole chunk and a partial one), 11 / 44
# for 32-blocks, 10 for 64-blocks. mmt (64 rows x 32 tokens a block, 8 entries a step): every row
# count is a ragged block; nb 11 / 10 leave most of fold's leaves empty, 40 / 44 give leaves of 1
# and 2 act-blocks, with steps that end inside a leaf (nchunk 2: a step holds 4 leaves)
_RAGGED = {32: (32 * 11, 32 * 44), 64: (64 * 5,), 256: (256 * 3, 256 * 5)}


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_batched_kernels_with_ragged_tiles(rt, name, batched_kernel):
    t = BY_NAME[name]
    for n_in in _RAGGED[t.block_size]:
        for n_out in (5, 17, 37):
            assert gpu._quant_plan(t.id, n_in, n_out, 9)[1] == f"{batched_kernel}<{t.id}>"
            _check_products(rt, t, n_in, n_out, (2, 7, 8, 9, 17, 33, 40), seed=t.id * 100 + n_in + n_out)


@pytest.mark.parametrize("kernel", ["mmq", "mmt"])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ3_XXS", "Q5_1"])
def test_mmq_one_launch_for_many_tokens_is_per_64_launches(rt, name, kernel, monkeypatch):
    """gpu.matmul on mmq / mmt takes up to MMQ_LAUNCH_TOKENS tokens a launch (every 64-token tile of the product
    in one grid) where it took a launch per MAX_TOKENS: the same bits (each tile's arithmetic is its own
    launch's), the reference's, on ragged rows and a ragged last tile; launches counted."""
    t = BY_NAME[name]
    _take_batched(monkeypatch, kernel, {name})
    n_in, n_out, n_tok = _RAGGED[t.block_size][-1], 37, 3 * gpu.MAX_TOKENS + 9
    rng = np.random.default_rng(t.id + 7)
    raw = random_weights(t, n_in * n_out, rng)
    w = gpu.upload(raw, t.id, n_in, n_out)
    x = _acts(n_in, n_tok, t.id + 8)
    act = gpu.quantize_act_gpu(rt.to_device(x))
    ref = R.dot_reference(raw, t.id, n_in, n_out, quantize_act(x))
    names = []
    launch = rt.launch

    def counted(mod, name, *a, **k):
        names.append(name)
        return launch(mod, name, *a, **k)

    monkeypatch.setattr(rt, "launch", counted)
    got = {}
    for per in (4096, 128, gpu.MAX_TOKENS):
        monkeypatch.setattr(gpu, "MMQ_LAUNCH_TOKENS", per)
        names.clear()
        got[per] = rt.to_host(gpu.matmul(w, act))
        products = [n for n in names if not n.startswith("traits<")]  # (the module's check at its first use)
        assert products == [f"{kernel}<{t.id}>"] * -(-n_tok // max(per, gpu.MAX_TOKENS)), (per, names)
        _assert_same(got[per], ref, f"{name} [{n_in} x {n_out}] {n_tok} tokens, {per} a launch", None)
    assert np.array_equal(got[4096].view(np.uint32), got[gpu.MAX_TOKENS].view(np.uint32))


@pytest.mark.parametrize("t", [t for t in TYPES if t.quantized and t.name not in ("Q4_K", "Q6_K")], ids=lambda t: t.name)
def test_batched_kernels_every_type(rt, t, batched_kernel):
    # mmq is generic over Ty<T>::dec: every block type keeps mm's bits through it (a type may then
    # be switched to it with STRATA_MMA once the card says it is faster)
    assert gpu._quant_plan(t.id, _RAGGED[t.block_size][0], 17, 9)[1] == f"{batched_kernel}<{t.id}>"
    _check_products(rt, t, _RAGGED[t.block_size][-1], 17, (3, 9, 40), seed=t.id * 31)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "IQ4_XS", "IQ2_XS", "Q5_1"])
def test_few_row_products_take_mvf_with_mm_bits(rt, name, monkeypatch):
    # mvf (a warp a row, blocks read from global memory) for 1..8 activation rows: rows longer
    # than mv holds (qwen4exp's hyper-connection down reads 4 x 2560 elements) and short ones,
    # a ragged lane count (nb not a multiple of 32) and an odd row count; the reference's bits
    t = BY_NAME[name]
    monkeypatch.setattr(gpu, "MVF_TOKENS", 8)
    monkeypatch.setattr(gpu, "MVT_TOKENS", 1)  # (with STRATA_MVT_TOKENS > 1, 2-4 rows of a matrix of few rows take mv<T, KPL, 0, NT>)
    monkeypatch.setattr(gpu, "_plans", {})
    long_in = -(-(8192 + 2048 + 32) // t.block_size) * t.block_size
    for n_in, n_out in ((long_in, 7), (_small_shape(t)[0], 9)):
        assert gpu._quant_plan(t.id, n_in, n_out, 1)[1].startswith(f"mvf<{t.id}, " if n_in > 8192 else f"mv<{t.id}, ")
        assert all(gpu._quant_plan(t.id, n_in, n_out, n)[1] == f"mvf<{t.id}, 1>" for n in range(2, 9))  # (few rows: 1 a warp)
        assert not gpu._quant_plan(t.id, n_in, n_out, 9)[1].startswith("mvf")
        _check_products(rt, t, n_in, n_out, (1, 2, 3, 8), seed=t.id * 7 + n_in)
    monkeypatch.setattr(gpu, "MVF_TOKENS", 0)  # (a benchmark's switch: the batched kernel as before)
    monkeypatch.setattr(gpu, "_plans", {})
    assert gpu._quant_plan(t.id, long_in, 7, 1)[1] in (f"mmt<{t.id}>", f"mmq<{t.id}>", f"mm<{t.id}>")


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "IQ2_XXS", "Q5_1"])
def test_a_few_rows_of_a_small_matrix_take_the_one_row_kernel_with_its_bits(rt, name, monkeypatch):
    # mv<T, KPL, 0, NT>: 2-4 activation rows (a verify's 1 + N) through the one-row kernel, each
    # weight row staged and decoded once for all of them, each row's activation in registers, on a
    # matrix of few weight rows (where mvf gives a warp one): every KPL a row length takes (ragged:
    # nb one block of the type past a multiple of 32), up to NT x KPL = MVT_ACT; past that, and on
    # many weight rows, mvf. The reference's bits, and matmul_many's (mvm of NT rows, by the
    # matrices' rows together).
    t = BY_NAME[name]
    monkeypatch.setattr(gpu, "_plans", {})
    monkeypatch.setattr(gpu, "MVT_TOKENS", gpu.MVT_MOST)  # (STRATA_MVT_TOKENS=4; the default, 1, is mvf's)
    if t.name == "IQ2_XXS":
        monkeypatch.setattr(gpu, "SHARED_TABLE_ROWS", 0)  # (the grid's shared copy in every block)
    apb, before = t.block_size // 32, 0
    for kpl in gpu.KPLS:
        n_in = 32 * (32 * before + apb)  # (nb = 32 before + one block: KPL's shortest row)
        before = kpl
        for n in range(2, 5):
            kernel = gpu._quant_plan(t.id, n_in, 13, n)[1]
            assert kernel == (f"mv<{t.id}, {kpl}, 0, {n}>" if kpl * n <= gpu.MVT_ACT else f"mvf<{t.id}, 1>"), (n_in, n)
        _check_products(rt, t, n_in, 13, (2, 3, 4), seed=t.id * 11 + kpl)
    many = 2 * gpu.MVF_TASKS_PER_SM * rt.n_sm * 4  # (rows for 4 a warp: mvf's R > 1)
    assert gpu._quant_plan(t.id, 2560, many, 3)[1].startswith(f"mvf<{t.id}, ")
    monkeypatch.setattr(gpu, "MVT_TOKENS", 1)  # (STRATA_MVT_TOKENS=1, the default: mvf)
    monkeypatch.setattr(gpu, "_plans", {})
    assert gpu._quant_plan(t.id, 2560, 13, 3)[1] == f"mvf<{t.id}, 1>"
    monkeypatch.setattr(gpu, "MVT_TOKENS", gpu.MVT_MOST)
    monkeypatch.setattr(gpu, "_plans", {})
    n_in, n_outs = 2560, (33, 1, 7, 5)
    rng = np.random.default_rng(t.id)
    raws = [random_weights(t, n_in * n, rng) for n in n_outs]
    ws = [gpu.upload(raw, t.id, n_in, n) for raw, n in zip(raws, n_outs)]
    x = _acts(n_in, 4, 13)
    for n in (2, 4):
        launched, launch = [], rt.launch
        rt.launch = lambda mod, kernel, *a, **k: (launched.append(kernel), launch(mod, kernel, *a, **k))[1]
        try:
            outs = [rt.to_device(np.full((n, m), np.nan, np.float32)) for m in n_outs]
            assert gpu.matmul_many(ws, gpu.quantize_act_gpu(rt.to_device(x[:n])), outs)
        finally:
            del rt.launch
        assert launched[-1] == f"mvm<{t.id}, 3, {n}>", launched
        for j, (raw, m, out) in enumerate(zip(raws, n_outs, outs)):
            _assert_same(rt.to_host(out), R.dot_reference(raw, t.id, n_in, m, quantize_act(x[:n])), f"mvm<{t.id}, 3, {n}> matrix {j}")


@pytest.mark.parametrize("rows", [2, 3, 4])
def test_few_row_products_keep_their_bits_with_several_rows_a_warp(rt, rows, monkeypatch):
    # mvf<T, R>: a warp takes R weight rows at once (its lanes load each act-block of the activations
    # once for all R); the row counts here leave the last warp's group short (a row past the end
    # is read again, its sums dropped), and mvfm shares one R among matrices of 1 to 96 rows
    monkeypatch.setattr(gpu, "MVF_ROWS", rows)
    monkeypatch.setattr(gpu, "MVT_TOKENS", 1)  # (else these rows take mv<T, KPL, 0, NT>)
    monkeypatch.setattr(gpu, "_plans", {})
    for name in ("Q6_K", "Q4_K", "IQ3_XXS", "Q8_0"):
        t = BY_NAME[name]
        assert gpu._quant_plan(t.id, 2560, 13, 3)[1] == f"mvf<{t.id}, {rows}>"
        _check_products(rt, t, 2560, 13, (2, 3), seed=t.id * 5 + rows)
    t = BY_NAME["Q6_K"]
    n_in, n_outs = 2560, (33, 1, 96, 7)
    rng = np.random.default_rng(rows)
    raws = [random_weights(t, n_in * n, rng) for n in n_outs]
    ws = [gpu.upload(raw, t.id, n_in, n) for raw, n in zip(raws, n_outs)]
    x = _acts(n_in, 3, 12)
    outs = [rt.to_device(np.full((3, n), np.nan, np.float32)) for n in n_outs]
    assert gpu.matmul_many(ws, gpu.quantize_act_gpu(rt.to_device(x)), outs)
    for j, (raw, n, out) in enumerate(zip(raws, n_outs, outs)):
        _assert_same(rt.to_host(out), R.dot_reference(raw, t.id, n_in, n, quantize_act(x)), f"mvfm<{t.id}, {rows}> matrix {j}")


def test_the_rows_a_few_row_warp_takes_follow_the_rows_there_are():
    # the most rows a warp (at most the type's cap) that leave MVF_TASKS_PER_SM warps' worth a
    # multiprocessor: a head takes 4 (Q8_0 2), a 12288-row product 3, a 1024-row one 1
    n_sm = 132
    assert gpu._mvf_rows("Q6_K", 248320, n_sm) == 4 and gpu._mvf_rows("Q8_0", 248320, n_sm) == 2
    assert gpu._mvf_rows("Q4_K", 12288, n_sm) == 3
    assert gpu._mvf_rows("Q4_K", 2 * gpu.MVF_TASKS_PER_SM * n_sm, n_sm) == 2
    assert gpu._mvf_rows("Q4_K", 2 * gpu.MVF_TASKS_PER_SM * n_sm - 2, n_sm) == 1  # (-(-n // 2) warps a row pair)
    assert gpu._mvf_rows("IQ2_XXS", 1024, n_sm) == 1


def test_out_buffer_is_filled_in_place(rt):
    t = BY_NAME["Q6_K"]
    raw = random_weights(t, 512 * 6, np.random.default_rng(0))
    w = gpu.upload(raw, t.id, 512, 6)
    x = _acts(512, 2, 0)
    out = rt.to_device(np.full((2, 6), np.nan, np.float32))
    assert gpu.matmul(w, gpu.quantize_act_gpu(rt.to_device(x)), out=out) is out
    _assert_same(rt.to_host(out), R.dot_reference(raw, t.id, 512, 6, quantize_act(x)), "out=")


# ---------------------------------------------------------------------------------------------
# the batched float products (F32 routers, BF16/F16 GDN gates): fmt, and fmm kept beside it to be
# measured against it (gpu.FMM). Each output is fmv's chain, so T tokens must give each token's
# single-vector bits: checked on ragged shapes (n_out not a multiple of the tile, n_in not a
# multiple of 32 or of a lane's 32 x 8, fewer than 32 elements: lanes that add nothing).

FLOAT_TYPES = [t for t in TYPES if not t.quantized]
FMT_TILES = [(r, c) for r in gpu.FMT_SIDES for c in gpu.FMT_SIDES]


def _check_float(rt, t, n_in, n_out, tokens, seed):
    raw = random_weights(t, n_in * n_out, np.random.default_rng(seed))
    w = gpu.upload(raw, t.id, n_in, n_out)
    x = _acts(n_in, max(tokens), seed + 1)
    if n_in >= 8:  # a token of exact zeros (+0 and -0): a lane's sum of signed zeros keeps its sign
        x[0, : n_in // 2], x[0, n_in // 2 :] = 0.0, -0.0
    step = max(1, (1 << 24) // (n_out * n_in))  # the reference's products in pieces of <= 64 MB
    ref = np.concatenate([R.dot_reference(raw, t.id, n_in, n_out, x[a : a + step]) for a in range(0, len(x), step)])
    x_dev = rt.to_device(x)
    for n in tokens:
        got = rt.to_host(gpu.matmul(w, x_dev[:n]))
        _assert_same(got, ref[:n], f"{t.name} [{n_in} x {n_out}] {gpu.FMM} T={n}")


@pytest.mark.parametrize("tile", FMT_TILES, ids=lambda rc: f"{rc[0]}x{rc[1]}")
@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_products_every_fmt_tile(rt, t, tile, monkeypatch):
    # every compiled warp tile, forced (gpu.py picks one per shape and device), on rows of 100
    # elements (lanes of 4 and 3 steps: the U-step loop and the step-by-step tail) and of 2080
    # (65 steps a lane), 13 rows (ragged for every R), token counts ragged for every C
    monkeypatch.setattr(gpu, "fmt_tile", lambda n_out, n_tok, n_sm: tile)
    monkeypatch.setattr(gpu, "_plans", {})
    monkeypatch.setattr(gpu, "FMM", "tiles")
    _check_float(rt, t, 100, 13, (2, 3, 9, 17), seed=t.id)
    _check_float(rt, t, 2080, 13, (5,), seed=t.id + 1)


@pytest.mark.parametrize("kernel", gpu.FMM_KERNELS)
@pytest.mark.parametrize("t", FLOAT_TYPES, ids=lambda t: t.name)
def test_float_products_on_ragged_shapes(rt, t, kernel, monkeypatch):
    # the plan gpu.py makes: T = 1 .. 70 (fmm, kept for measuring, a subset), then wider ragged
    # rows, 300 tokens (fmm's 64-token launches, several of fmt's token tiles), then the plans for
    # the card's 132 multiprocessors on the emulation as well (its small tiles for few rows or
    # tokens). (The emulation's cost is the fold's shuffles: a fiber switch each, per output.)
    monkeypatch.setattr(gpu, "_plans", {})
    monkeypatch.setattr(gpu, "FMM", kernel)
    sweep = tuple(range(1, 71)) if kernel == "tiles" else (1, 2, 3, 8, 9, 63, 64, 65, 70)
    _check_float(rt, t, 352, 3, sweep, seed=t.id)
    _check_float(rt, t, 352, 37, (2, 9, 65, 70), seed=t.id + 1)
    _check_float(rt, t, 352, 9, (300,), seed=t.id + 3)
    if not _on_device(rt):
        monkeypatch.setattr(rt, "n_sm", 132)
        monkeypatch.setattr(gpu, "_plans", {})
    for n_in, n_out, tokens in ((20, 5, (2, 7, 65)), (2080, 1, (2, 7, 65)), (2080, 35, (2, 65)), (100, 256, (7,))):
        _check_float(rt, t, n_in, n_out, tokens, seed=t.id + n_in + n_out)
    if _on_device(rt):  # the model's shapes: routers, the shared expert's gate, the GDN gates
        for n_out, tokens in ((256, (3, 256)), (1, (3, 256, 4096)), (32, (3, 256, 4096))):
            _check_float(rt, t, 2048, n_out, tokens, seed=t.id + n_out)


def test_a_step_retakes_the_tiers_stream_where_another_is_current():
    """CupyRuntime.retake_stream, which a device step calls first: the tier's stream made current
    again where another one is (2026-12-05, an H100: the card's greedy --spec tests found the legacy
    stream current at the run's first token, so none of its verifies could be captured), nothing
    done where it is current already or where no tier made one. (A stand-in for CuPy's streams.)"""
    current = [0]

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def use(self):
            current[0] = self.ptr

    class Cuda:
        @staticmethod
        def get_current_stream():
            return Stream(current[0])

    rt = object.__new__(gpu.CupyRuntime)  # (no device: only its stream bookkeeping runs)
    rt.cp = type("FakeCupy", (), {"cuda": Cuda})
    assert rt.retake_stream() is False and current == [0]  # no tier stream yet: nothing to retake
    rt.stream = Stream(0x51)
    assert rt.retake_stream() is True and current == [0x51]  # the legacy stream was current
    assert rt.retake_stream() is False and current == [0x51]  # current already
    current[0] = 0x77  # another thread's or a library's stream
    assert rt.retake_stream() is True and current == [0x51]


def test_fmm_kernel_choice_is_checked():
    with pytest.raises(ValueError, match="'4x4' is not one of tiles, 8x8"):
        gpu.use_fmm("4x4")


# ---------------------------------------------------------------------------------------------
# refusals


def test_bad_inputs_are_refused_with_the_reason(rt):
    t = BY_NAME["Q8_0"]
    raw = random_weights(t, 256 * 4, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"Q8_0 \[256 x 5\] is 1360 bytes, got 1088"):
        gpu.upload(raw, t.id, 256, 5)
    with pytest.raises(ValueError, match="unknown GGML type 99"):
        gpu.upload(raw, 99, 256, 4)
    w = gpu.upload(raw, t.id, 256, 4, name="blk.3.ffn_up")
    x = _acts(256, 1, 0)[0]
    with pytest.raises(TypeError, match=r"host ActQ \[256\] \(quantize on the device"):
        gpu.matvec(w, quantize_act(x))
    with pytest.raises(TypeError, match=r"blk\.3\.ffn_up .*GpuActQ of shape \[T, 256\]"):
        gpu.matmul(w, gpu.quantize_act_gpu(rt.to_device(_acts(512, 2, 0))))
    with pytest.raises(TypeError, match="single vector"):
        gpu.matvec(w, gpu.quantize_act_gpu(rt.to_device(_acts(256, 2, 0))))
    f16 = BY_NAME["F16"]
    wf = gpu.upload(random_weights(f16, 256 * 4, np.random.default_rng(0)), f16.id, 256, 4)
    with pytest.raises(TypeError, match="F16 weights take contiguous device f32 activations"):
        gpu.matmul(wf, gpu.quantize_act_gpu(rt.to_device(_acts(256, 2, 0))))
    with pytest.raises(ValueError, match=r"out must be a contiguous device f32 \[4\]"):
        gpu.matvec(w, gpu.quantize_act_gpu(rt.to_device(x)), out=rt.to_device(np.zeros(5, np.float32)))
    with pytest.raises(ValueError, match="rest must be a contiguous device uint8"):
        gpu.GpuWeight(t.id, 256, 4, rest=w.rest[:-1], scales=w.scales)


def test_the_emulation_reports_a_misaligned_access():
    # The emulation is only worth its bits if it catches what would fault on the device.
    if _EMU_WHY:
        pytest.skip(f"no GPU emulation: {_EMU_WHY}")
    rt = EmuRuntime()
    before = gpu.use_runtime(rt)
    try:
        t = BY_NAME["Q8_0"]
        w = gpu.upload(random_weights(t, 256 * 4, np.random.default_rng(0)), t.id, 256, 4)
        a = gpu.quantize_act_gpu(rt.to_device(_acts(256, 1, 0)[0]))
        rt.ptr = lambda arr: 0  # let a misaligned plane past gpu.py's own check
        buf = rt.empty(w.rest.size + 4, np.uint8)
        buf[4:] = w.rest
        bad = gpu.GpuWeight(t.id, 256, 4, rest=buf[4:], scales=w.scales)
        with pytest.raises(RuntimeError, match="16-byte access at .* not aligned"):
            gpu.matvec(bad, a)
    finally:
        gpu.use_runtime(before)


@pytest.mark.parametrize("name", ["Q5_0", "Q4_K", "IQ2_XS"])
def test_mmt_keeps_mm_bits_on_long_rows_and_many_tiles(rt, name, monkeypatch):
    """mmt takes fold's leaves in tree order, a leaf's act-blocks over several staged steps: rows of
    80 act-blocks (qwen4exp's 2560: 3 chunks, a step of 8 entries ends inside a leaf, leaves 16-31
    one act-block short) and 320 (10240: a leaf spans two steps), more block tiles than the grid
    (its blocks take several in turn: rows and tokens both ragged), against the reference's bits."""
    t = BY_NAME[name]
    _take_batched(monkeypatch, "mmt", {name})
    monkeypatch.setattr(gpu, "MVF_TOKENS", 1)  # (3 tokens would take the few-row kernel, mvf: 2-8 rows by default)
    # more block tiles than the grid's 16 a multiprocessor, and no more: the host reference of
    # 16 x n_sm x MT_ROWS rows (135171 x 2560 on a card, 69 tokens) took ~4 minutes of the suite's shard
    most = 2 * gpu.MT_TOKS + 5
    token_tiles = -(-most // gpu.MT_TOKS)
    rows = (16 * rt.n_sm // token_tiles + 1) * gpu.MT_ROWS + 3
    assert -(-rows // gpu.MT_ROWS) * token_tiles > gpu._grid(rt, 10**9, 1, 16)
    for n_in, n_out, tokens in ((2560, rows, (17, most)), (10240, 9, (3,))):
        assert gpu._quant_plan(t.id, n_in, n_out, max(tokens))[1] == f"mmt<{t.id}>"
        _check_products(rt, t, n_in, n_out, tokens, seed=t.id * 13 + n_in)


def test_mmt_takes_the_products_with_tiles_for_every_multiprocessor(rt, monkeypatch):
    """By default (every type in MMT_TYPES) a chunk's product takes mmt from MMT_MIN_TILES block tiles a
    multiprocessor, mmq below (a grid of few tiles leaves the card waiting on its staging loads), and
    only for rows of MMT_MIN_BLOCKS act-blocks or more (a tile walks fold's 32 leaves whatever the row)."""
    t = BY_NAME["Q5_0"]
    monkeypatch.setattr(gpu, "MMA_TYPES", frozenset({"Q5_0"}))
    monkeypatch.setattr(gpu, "MMT_TYPES", frozenset({"Q5_0"}))
    monkeypatch.setattr(gpu, "MMT_MIN_TILES", 4)
    monkeypatch.setattr(gpu, "MMT_MIN_BLOCKS", 32)
    monkeypatch.setattr(gpu, "_plans", {})
    need = 4 * rt.n_sm  # tiles: row blocks x token blocks
    assert gpu._quant_plan(t.id, 2560, need * gpu.MT_ROWS, gpu.MT_TOKS)[1] == f"mmt<{t.id}>"
    assert gpu._quant_plan(t.id, 2560, need * gpu.MT_ROWS, 9 * gpu.MT_TOKS)[1] == f"mmt<{t.id}>"
    assert gpu._quant_plan(t.id, 2560, (need - 1) * gpu.MT_ROWS, gpu.MT_TOKS)[1] == f"mmq<{t.id}>"
    assert gpu._quant_plan(t.id, 2560, gpu.MT_ROWS, need * gpu.MT_TOKS)[1] == f"mmt<{t.id}>"
    assert gpu._quant_plan(t.id, 32 * 32, need * gpu.MT_ROWS, gpu.MT_TOKS)[1] == f"mmt<{t.id}>"
    assert gpu._quant_plan(t.id, 31 * 32, need * gpu.MT_ROWS, gpu.MT_TOKS)[1] == f"mmq<{t.id}>"
    assert gpu._quant_plan(t.id, 320, need * gpu.MT_ROWS, 9 * gpu.MT_TOKS)[1] == f"mmq<{t.id}>"
    monkeypatch.setattr(gpu, "MMT_TYPES", frozenset())
    monkeypatch.setattr(gpu, "_plans", {})
    assert gpu._quant_plan(t.id, 2560, need * gpu.MT_ROWS, gpu.MT_TOKS)[1] == f"mmq<{t.id}>"


# --- the dense prompt products through cuBLAS (gpu.gemm_products): weights and activations as f16
# pairs (hi, lo), f32 accumulation. Not the reference's bits (mm's), so held to float32's rounding.


def _split(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) of f32 values as gpu_kernels.cu's f16_split: hi = f16(v), lo = f16((v - hi) 2^11)."""
    v = np.asarray(v, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        hi = v.astype(np.float16)
        lo = ((v - hi.astype(np.float32)) * np.float32(2048)).astype(np.float16)
    return hi, lo


def _deq_h(rt, t, raw: np.ndarray, n_in: int, n_out: int, r0: int, rows: int) -> np.ndarray:
    w = gpu.upload(raw, t.id, n_in, n_out)
    wh = rt.to_device(np.full(2 * rows * n_in, 0xFFFF, np.uint16))  # (NaN: a part left unwritten shows)
    m = gpu._module(t.name)
    rt.launch(m.mod, f"deq_h<{t.id}>", 3, 256, (w.rest, w.scales if w.scales is not None else w.rest, wh, np.int64(r0),
                                                np.int32(rows), np.int32(n_in // 32)))
    return rt.to_host(wh).reshape(rows, 2 * n_in)


@pytest.mark.parametrize("t", [t for t in TYPES if t.quantized], ids=lambda t: t.name)
def test_deq_h_splits_each_weight_into_two_f16(rt, t):
    """deq_h<T>: rows r0 .. r0 + rows - 1 of the weight, each row its lo parts then its hi parts, of
    v = wf * f32(ws[h] q) [+ wm * f32(mn[h])] in f32 (numpy here, the same operations); hi + lo / 2^11
    is the exact value (IntForm.values) within 2^-21 of it."""
    n_in, n_out = _small_shape(t)[0], 9
    raw = random_weights(t, n_in * n_out, np.random.default_rng(50 + t.id))
    form = R.decompose(raw, t.id, n_in * n_out)
    v = form.wf[:, None, None] * (form.ws[:, :, None] * form.q.reshape(-1, 2, 16).astype(np.int32)).astype(np.float32)
    if form.mn is not None:
        v = v + form.wm[:, None, None] * form.mn[:, :, None].astype(np.float32)
    hi, lo = (p.reshape(n_out, n_in)[2:8] for p in _split(v.astype(np.float32)))
    want = np.concatenate([lo, hi], axis=1).view(np.uint16)
    got = _deq_h(rt, t, raw, n_in, n_out, 2, 6)  # rows 2 .. 7: a slab inside the weight
    assert np.array_equal(got, want), f"{t.name}: first difference at {np.argwhere(got != want)[0]}"
    exact = form.values().reshape(n_out, n_in)[2:8]
    pair = hi.astype(np.float64) + lo.astype(np.float64) / 2048
    assert np.all(np.abs(pair - exact) <= np.abs(exact) * 2.0**-21 + 2.0**-40)


@pytest.mark.parametrize("wide", [False, True])
def test_to_h_splits_the_actq_values_over_256(rt, wide):
    """to_h: x = d q (ActQ; wide: d (256 q_hi + q_lo)) / 256 as (hi, lo), each row its hi parts then
    its lo parts: blocks of every scale, a zero block, one past f16's range unscaled."""
    from strata.engine.kernels.actq import quantize_act16

    x = _acts(320, 3, 11)
    x[1, :32] *= np.float32(4e4)
    xd = rt.to_device(x)
    act = gpu.quantize_act16_gpu(xd) if wide else gpu.quantize_act_gpu(xd)
    a = act.planes if wide else act
    y = rt.to_device(np.zeros(2 * x.size, np.uint16))
    rt.launch(gpu._module("actq").mod, "to_h", 2, 256, (a.q, a.d, y, np.int64(3), np.int32(10), np.int32(wide)))
    if wide:
        p = quantize_act16(x).planes
        v = np.repeat(p.d[0::2], 32, axis=1) * (256 * p.q[0::2].astype(np.int32) + p.q[1::2]).astype(np.float32)
    else:
        q = quantize_act(x)
        v = np.repeat(q.d, 32, axis=1) * q.q.astype(np.float32)
    hi, lo = _split(v.astype(np.float32) * np.float32(1 / 256))
    assert np.array_equal(rt.to_host(y).reshape(3, 640), np.concatenate([hi, lo], axis=1).view(np.uint16))


@pytest.mark.parametrize("name", ["Q5_0", "Q8_0", "IQ4_NL", "Q4_K", "Q5_1", "IQ2_XS"])
def test_gemm_products_are_the_int8_product_within_float32_rounding(rt, name):
    """gemm_products: the weight in slabs of f16 pairs (a ragged last one), the ActQ's values as f16
    pairs, two GEMMs: the exact product of the token path's int8 activations within float32's
    rounding (2^-16 of sum |w x|: f32 sums of 2 n_in terms; one f16 GEMM alone is 2^-11 away), also
    for inputs past f16's range (the scale); every column written."""
    t = BY_NAME[name]
    n_in, n_out, T = {32: 32 * 12, 64: 64 * 6, 256: 256 * 2}[t.block_size], 200, 5
    rng = np.random.default_rng(t.id)
    raw = random_weights(t, n_in * n_out, rng)
    w = gpu.upload(raw, t.id, n_in, n_out)
    x = _acts(n_in, T, t.id)
    x[3] *= np.float32(3e4)  # past 65504: f16 holds it only scaled
    q = quantize_act(x)
    xv = np.repeat(q.d, 32, axis=1).astype(np.float64) * q.q
    wv = R.decompose(raw, t.id, n_in * n_out).values().reshape(n_out, n_in)
    exact, bound = xv @ wv.T, np.abs(xv) @ np.abs(wv).T
    xh = rt.to_device(np.zeros(2 * T * n_in, np.uint16))
    wh = rt.to_device(np.zeros(128 * n_in + 5, np.uint16))  # slabs of 64 rows: 64, 64, 64, 8
    out = rt.to_device(np.full((T, n_out), np.nan, np.float32))
    gpu.gemm_products(w, gpu.quantize_act_gpu(rt.to_device(x)), out, xh, wh)
    got = rt.to_host(out).astype(np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - exact)
    assert np.all(err <= 2.0**-16 * bound + 1e-30), f"{name}: worst {np.max(err / np.maximum(bound, 1e-30)):.3g} of sum |w x|"


def test_gemm_products_refuse_short_buffers(rt):
    t = BY_NAME["Q8_0"]
    w = gpu.upload(random_weights(t, 64 * 80, np.random.default_rng(0)), t.id, 64, 80)
    act = gpu.quantize_act_gpu(rt.to_device(np.ones((3, 64), np.float32)))
    out = rt.to_device(np.zeros((3, 80), np.float32))
    with pytest.raises(ValueError, match="short of 384"):
        gpu.gemm_products(w, act, out, rt.to_device(np.zeros(300, np.uint16)), rt.to_device(np.zeros(128 * 64, np.uint16)))
    with pytest.raises(ValueError, match="fewer than 64 rows"):
        gpu.gemm_products(w, act, out, rt.to_device(np.zeros(384, np.uint16)), rt.to_device(np.zeros(127 * 64, np.uint16)))
