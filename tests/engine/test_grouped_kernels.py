"""cpu.matmul_grouped (the routed experts of a prompt chunk in one call per matrix) against
cpu.matmul of each matrix on its own rows, and the numpy reference, bit for bit: groups of one
row, empty groups, uneven groups, matrices in any order inside the bytes, serial and parallel.

Each block type compiles its grouped kernels (serial and parallel) once, then the disk cache
serves them; shapes stay small except one expert shape."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from kernel_blocks import random_weights
from kernel_paths import KERNELS, cpu_path

from strata.engine.kernels import cpu
from strata.engine.kernels import reference as R
from strata.engine.kernels.actq import ActQ, quantize_act
from strata.index_format.ggml_types import BY_NAME, TYPES

# the expert types of the shipped mixes (seed-4l: IQ2_XS/IQ2_XXS/IQ3_XXS gate/up, IQ4_NL/Q2_0 down)
# and two with their own scale layouts: Q4_K (a min term), Q8_0 (the plain one)
EXPERT_TYPES = ["Q8_0", "Q4_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ4_NL", "Q2_0"]
SIZES = [3, 0, 1, 7, 1, 2, 0, 12, 1]  # tokens per group: one-row, empty and uneven groups


def _case(t, n_in: int, n_out: int, sizes, seed: int):
    """(raw holding len(sizes) + 2 matrices, offsets of the groups' matrices in shuffled order,
    activations [N, n_in] as the kernel takes them, starts)."""
    rng = np.random.default_rng(seed)
    size = t.nbytes((n_in, n_out))
    raw = random_weights(t, n_in * n_out * (len(sizes) + 2), rng)
    offsets = rng.permutation(len(sizes) + 2)[: len(sizes)] * size
    starts = np.concatenate(([0], np.cumsum(sizes)))
    x = (rng.standard_normal((starts[-1], n_in)) * rng.uniform(0.1, 10, (starts[-1], 1))).astype(np.float32)
    return raw, offsets, (quantize_act(x) if t.quantized else x), starts


def _rows(act, a: int, b: int):
    return ActQ(act.q[a:b], act.d[a:b], act.s16[a:b]) if isinstance(act, ActQ) else act[a:b]


def _per_group(t, raw, offsets, act, starts, n_in: int, n_out: int, multiply) -> np.ndarray:
    size = t.nbytes((n_in, n_out))
    want = np.full((starts[-1], n_out), np.nan, np.float32)
    for g, off in enumerate(offsets):
        if starts[g] < starts[g + 1]:
            want[starts[g] : starts[g + 1]] = multiply(raw[off : off + size], t.id, n_in, n_out, _rows(act, starts[g], starts[g + 1]))
    return want


def _need_iq(rowdot, name: str) -> None:
    if name in rowdot.IQTYPES and not rowdot.IQ_AVAILABLE:
        pytest.skip(f"rowdot.py's IQ2/IQ3 kernels need AVX512-VBMI and AVX512VL, or AVX2 (and STRATA_ROWDOT_IQ_AVX2 not 0); this host's features: {sorted(cpu.simd._X86) or 'none'}")


def _same(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{what}: {len(bad)} outputs differ, first {tuple(bad[0])}: {got[tuple(bad[0])]!r} vs {want[tuple(bad[0])]!r}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", EXPERT_TYPES)
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_grouped_equals_matmul_per_group_bit_for_bit(name, parallel, kernel):
    t = BY_NAME[name]
    # 15 act-blocks (the 8-, 4- and 1-block steps) where the block allows it; 45 rows: one whole
    # row tile and a partial one
    n_in, n_out = (32 * 15 if t.block_size == 32 else 64 * 7 if t.block_size == 64 else 256 * 3), cpu.GROUP_TILE + 13
    raw, offsets, act, starts = _case(t, n_in, n_out, SIZES, t.id)
    with cpu_path(parallel, kernel=kernel):
        got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
    with cpu_path(kernel="rows"):  # the row kernels: one check of the two against each other
        _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, cpu.matmul), f"{name} grouped vs matmul")
    _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, R.dot_reference), f"{name} grouped vs reference")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name,n_in,n_out", [("IQ2_XS", 2560, 640), ("IQ4_NL", 640, 2560)])
def test_expert_shapes_with_many_small_groups(name, n_in, n_out, kernel):
    """Production shapes, 40 experts of 0-12 tokens and one of 60 (the uneven routing of a chunk):
    the items are spread over the threads by cost, which must not change a bit."""
    t = BY_NAME[name]
    sizes = np.random.default_rng(5).integers(0, 13, 40)
    sizes[3] = 60
    raw, offsets, act, starts = _case(t, n_in, n_out, sizes, 7)
    with cpu_path(True, kernel=kernel):
        got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
    with cpu_path(True, kernel="rows"):
        _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, cpu.matmul), f"{name} grouped vs matmul")


@pytest.mark.parametrize("name", ["IQ4_NL", "Q2_0"])
def test_raw_types_take_the_panel_from_one_token_per_expert(name, monkeypatch):
    # a serving step routes ~1 token to each expert; the grouped row kernel decodes each row into
    # scratch first, the raw panel (panel.RAW: IQ4_NL and Q2_0, the seed-4l down projections, 640
    # long: Q2_0's 10 blocks of 64 are 20 act-blocks in pairs) does not
    from strata.engine.kernels import panel

    if not panel.RAW:
        pytest.skip("no AVX512-VNNI and F16C: no raw panels here")
    taken = []
    monkeypatch.setattr(cpu, "_panel", lambda *a, f=cpu._panel: taken.append("panel") or f(*a))
    monkeypatch.setattr(cpu, "_grouped", lambda *a, f=cpu._grouped: taken.append("rows") or f(*a))
    t, n_in, n_out = BY_NAME[name], 640, cpu.GROUP_TILE + 13
    for sizes, kernel in (([1] * 6, "panel"), ([0, 1, 1, 0, 1], "panel"), ([2, 1, 2], "panel"), ([3, 4, 1, 2], "panel")):
        raw, offsets, act, starts = _case(t, n_in, n_out, sizes, 3)
        got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
        assert taken[-1] == kernel, sizes
        _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, R.dot_reference), f"{name} groups {sizes}")


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "Q4_0", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "Q2_0"])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_one_token_per_expert_reads_the_rows_in_place(name, parallel):
    """A decode step's routed experts (one token each, some experts idle) of a type with a one-token
    kernel take rowdot.py's grouped form: the reference's bits, every expert on its own token."""
    from strata.engine.kernels import rowdot

    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
    _need_iq(rowdot, name)
    t = BY_NAME[name]
    n_in, n_out = {256: 256 * 5, 64: 64 * 13, 32: 32 * 25}[t.block_size], cpu.GROUP_TILE + 13
    raw, offsets, act, starts = _case(t, n_in, n_out, [1, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1], t.id + 40)
    with cpu_path(parallel):
        got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
    assert rowdot._GROUPED[name, parallel].signatures, "the one-token grouped kernel was not taken"
    _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, R.dot_reference), f"{name} one token per expert vs reference")


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ3_XXS", "Q4_K"])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
def test_one_token_experts_read_in_place_beside_experts_of_more(name, parallel, monkeypatch):
    """A serving step's routed experts: 8 streams x 10 of 512 experts give most experts 1 token
    and a few 2. The one-token experts (the IQ types: up to rowdot.FEW_MAX tokens) take rowdot.py's
    grouped form, the others the grouped row kernel, in the same call: every token's row is the
    reference's bits, whichever kernel ran."""
    from strata.engine.kernels import rowdot

    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
    _need_iq(rowdot, name)
    taken = []
    monkeypatch.setattr(rowdot, "matmul_grouped_one", lambda *a, f=rowdot.matmul_grouped_one: taken.append("in place") or f(*a))
    monkeypatch.setattr(cpu, "_grouped", lambda *a, f=cpu._grouped: taken.append("rows") or f(*a))
    t = BY_NAME[name]
    n_in, n_out = 256 * 5, cpu.GROUP_TILE + 13
    raw, offsets, act, starts = _case(t, n_in, n_out, [2, 0, 1, 1, 6, 0, 1, 3, 1], t.id + 50)
    with cpu_path(parallel):
        got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
    assert taken == ["in place", "rows"], taken
    _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, R.dot_reference), f"{name} mixed groups vs reference")


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ3_XXS"])
@pytest.mark.parametrize("parallel", [False, True], ids=["serial", "parallel"])
@pytest.mark.parametrize("n_in", [256, 256 * 5, 2560], ids=lambda n: f"{n // 256}-superblocks")
def test_few_token_iq_experts_fetch_each_grid_word_once_for_all_their_tokens(name, parallel, n_in, monkeypatch):
    """Experts of 2-4 tokens of an IQ type (a serving step's shared experts) take rowdot.py's
    few-token rows, beside one-token experts, in one region; a group of 5 keeps the grouped row
    kernel. Super-block counts 1 (a loop turn with 3 idle slots), 5 and 10; 45 rows (a whole and
    a partial row tile). Every token's row is the reference's bits and matmul's of its expert alone."""
    from strata.engine.kernels import rowdot

    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
    _need_iq(rowdot, name)
    taken = []
    monkeypatch.setattr(cpu, "_grouped", lambda *a, f=cpu._grouped: taken.append("rows") or f(*a))
    t, n_out = BY_NAME[name], cpu.GROUP_TILE + 13
    for sizes in ([2, 3, 0, 4, 1, 2], [4, 1, 5, 3]):
        raw, offsets, act, starts = _case(t, n_in, n_out, sizes, t.id + n_in + len(sizes))
        with cpu_path(parallel):
            got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
        assert taken == (["rows"] if 5 in sizes else []), (sizes, taken)
        assert rowdot._GROUPED[name, parallel, True].signatures, "the few-token kernel was not taken"
        taken.clear()
        _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, R.dot_reference), f"{name} groups {sizes} vs reference")
        with cpu_path(False, kernel="rows"):
            _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, cpu.matmul), f"{name} groups {sizes} vs matmul")


def test_a_group_of_more_tokens_than_a_tile_equals_the_reference():
    """One expert with more tokens than a tile of activations (cpu._TILE_BYTES), among small ones:
    its rows meet the tokens tile by tile."""
    t, n_in, n_out = BY_NAME["IQ2_XS"], 2560, 9
    sizes = [3, 2 * (cpu._TILE_BYTES // n_in) + 7, 1]
    raw, offsets, act, starts = _case(t, n_in, n_out, sizes, 8)
    with cpu_path(True, kernel="rows"):
        got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
    _same(got, _per_group(t, raw, offsets, act, starts, n_in, n_out, R.dot_reference), "grouped vs reference")


def test_float_weights_go_group_by_group():
    t = BY_NAME["BF16"]
    raw, offsets, x, starts = _case(t, 64, 9, SIZES, 3)
    got = cpu.matmul_grouped(raw, t.id, 64, 9, offsets, x, starts)
    _same(got, _per_group(t, raw, offsets, x, starts, 64, 9, cpu.matmul), "BF16 grouped vs matmul")


def test_out_buffer_is_filled_in_place():
    t = BY_NAME["Q8_0"]
    raw, offsets, act, starts = _case(t, 64, 5, [2, 1], 4)
    out = np.zeros((3, 5), np.float32)
    assert cpu.matmul_grouped(raw, t.id, 64, 5, offsets, act, starts, out) is out
    _same(out, _per_group(t, raw, offsets, act, starts, 64, 5, cpu.matmul), "out")


def test_bad_groups_are_refused_with_the_reason():
    t = BY_NAME["Q8_0"]
    raw, offsets, act, starts = _case(t, 64, 5, [2, 1], 4)
    size = t.nbytes((64, 5))
    with pytest.raises(ValueError, match=r"matrix 1 at byte \d+ \(\d+ bytes\) is outside"):
        cpu.matmul_grouped(raw, t.id, 64, 5, [0, raw.size - size + 1], act, starts)
    with pytest.raises(ValueError, match="starts end at 2, the activations have 3 rows"):
        cpu.matmul_grouped(raw, t.id, 64, 5, offsets, act, [0, 1, 2])
    with pytest.raises(ValueError, match="never decrease"):
        cpu.matmul_grouped(raw, t.id, 64, 5, offsets, act, [0, 2, 1])
    with pytest.raises(TypeError, match="starts must be a 1-D integer array of 3"):
        cpu.matmul_grouped(raw, t.id, 64, 5, offsets, act, [0, 3])
    with pytest.raises(TypeError, match="ActQ"):
        cpu.matmul_grouped(raw, t.id, 64, 5, offsets, np.zeros((3, 64), np.float32), starts)
    with pytest.raises(ValueError, match="out must be contiguous f32"):
        cpu.matmul_grouped(raw, t.id, 64, 5, offsets, act, starts, np.zeros((3, 4), np.float32))


def test_no_fused_multiply_add_in_the_grouped_kernels(monkeypatch):
    # as test_kernels_cpu's check: an FMA would round differently from the specification
    t = BY_NAME["Q4_K"]
    raw, offsets, act, starts = _case(t, 256, 5, [2, 1], 6)
    for parallel in (False, True):
        kernel = cpu._grouped_kernel(t.name, *cpu._DECODERS[t.name], parallel)
        kernel._cache.disable()  # compile here: numba shows no machine code for a disk-cache load
        monkeypatch.setitem(cpu._GROUPED, (t.name, parallel), kernel)
        with cpu_path(parallel, kernel="rows"):
            cpu.matmul_grouped(raw, t.id, 256, 5, offsets, act, starts)
        asm = "\n".join(kernel.inspect_asm().values())
        assert "vmulss" in asm or "vmulps" in asm, "no f32 multiply found: the check itself is broken"
        assert not re.search(r"\bv?f(n)?m(add|sub)\d", asm), "FMA instruction in the grouped kernel"


def test_a_repeated_layout_makes_its_plan_once_with_the_same_bits(monkeypatch):
    # the decode step's grouped calls repeat one layout every token (k experts of one token each):
    # the work items and chunks are made once, and a kept plan gives what a fresh one gives
    t = BY_NAME["IQ4_NL"]
    made, chunked = [], []
    monkeypatch.setattr(cpu, "_tiles", lambda *a, f=cpu._tiles: made.append(1) or f(*a))
    monkeypatch.setattr(cpu, "_balance", lambda *a, f=cpu._balance: chunked.append(1) or f(*a))
    monkeypatch.setattr(cpu, "_PLANS", {}, raising=False)
    n_in, n_out = 32 * 4, cpu.GROUP_TILE + 5
    outs = []
    for seed in (11, 12, 13):  # new experts and activations each "token", the layout the same
        raw, offsets, act, starts = _case(t, n_in, n_out, [1] * 6, seed)
        with cpu_path(parallel=True):
            outs.append(cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts))
        _same(outs[-1], _per_group(t, raw, offsets, act, starts, n_in, n_out, R.dot_reference), f"token {seed}")
    assert len(made) == 1, f"{len(made)} plans made for 3 calls of one layout, expected 1"
    n_chunked = len(chunked)
    with cpu_path(parallel=False):  # another launch (the serial kernel): its own chunks
        got = cpu.matmul_grouped(raw, t.id, n_in, n_out, offsets, act, starts)
    assert len(chunked) > n_chunked, "the serial call reused the parallel call's chunks"
    _same(got, outs[-1], "serial vs parallel")


def test_a_prompt_chunk_s_layout_is_not_kept(monkeypatch):
    t = BY_NAME["Q8_0"]
    monkeypatch.setattr(cpu, "_PLANS", {})
    raw, offsets, act, starts = _case(t, 64, 5, [cpu.PLAN_ROWS, 1], 3)
    got = cpu.matmul_grouped(raw, t.id, 64, 5, offsets, act, starts)
    assert cpu._PLANS == {}, "a layout of more than PLAN_ROWS rows was kept"
    _same(got, _per_group(t, raw, offsets, act, starts, 64, 5, R.dot_reference), "a chunk's layout")


def test_gpu_grouped_kernel_by_shape(monkeypatch):
    """gpu.grouped_kernel (the GPU prompt path's grouped products; pure Python): by default
    (STRATA_GROUPED=shape) down products take mmqw, gate/up mmqk below GROUPED_MMQX_PAIRS pairs an
    expert and mmqx from it; a type an explicit STRATA_MMQK / STRATA_MMQW / STRATA_MMAX set names takes
    that family whatever the shape (mmqk first); the choice by type alone (STRATA_GROUPED=types) is
    the one before it."""
    from strata.engine.kernels import gpu
    from strata.index_format.ggml_types import ggml_type

    every = frozenset(t.name for t in TYPES if t.quantized)
    q4, q8 = ggml_type("Q4_K").id, ggml_type("Q8_0").id
    if gpu.GROUPED == "shape" and not any(os.environ.get(v) for v in ("STRATA_MMQK", "STRATA_MMQW", "STRATA_MMAX")):
        assert gpu.SHAPE_TYPES == every and not (gpu.MMQK_TYPES | gpu.MMQW_TYPES | gpu.MMAX_TYPES)  # the defaults
    for name, value in (("SHAPE_TYPES", every), ("MMQK_TYPES", frozenset()), ("MMQW_TYPES", frozenset()), ("MMAX_TYPES", frozenset()),
                        ("GROUPED_MMQX_PAIRS", 40.0)):
        monkeypatch.setattr(gpu, name, value)
    for t in TYPES:
        if t.quantized:
            assert gpu.grouped_kernel(t.id, down=True, pairs=5.0) == "mmqw"
            assert gpu.grouped_kernel(t.id, down=True, pairs=80.0) == "mmqw"
            assert gpu.grouped_kernel(t.id, down=False, pairs=5.0) == "mmqk"
            assert gpu.grouped_kernel(t.id, down=False, pairs=39.9) == "mmqk"
            assert gpu.grouped_kernel(t.id, down=False, pairs=40.0) == "mmqx"
            assert gpu.grouped_kernel(t.id, down=False, pairs=80.0) == "mmqx"
    assert gpu.grouped_kernel(q4) == "mmqk"  # (no shape given: gate/up at few pairs)
    monkeypatch.setattr(gpu, "GROUPED_MMQX_PAIRS", 64.0)
    assert gpu.grouped_kernel(q4, pairs=40.0) == "mmqk" and gpu.grouped_kernel(q4, pairs=64.0) == "mmqx"
    # an explicit set forces its family for the types it names, whatever the shape
    monkeypatch.setattr(gpu, "MMAX_TYPES", frozenset({"Q8_0"}))
    assert [gpu.grouped_kernel(q8, d, p) for d, p in ((False, 5.0), (True, 5.0))] == ["mmqx", "mmqx"]
    assert gpu.grouped_kernel(q4, True, 5.0) == "mmqw" and gpu.grouped_kernel(q4, False, 5.0) == "mmqk"
    monkeypatch.setattr(gpu, "MMQW_TYPES", frozenset({"Q8_0", "Q4_K"}))
    assert gpu.grouped_kernel(q8, False, 80.0) == "mmqw" and gpu.grouped_kernel(q4, False, 80.0) == "mmqw"
    monkeypatch.setattr(gpu, "MMQK_TYPES", frozenset({"Q4_K"}))
    assert gpu.grouped_kernel(q4, True, 80.0) == "mmqk" and gpu.grouped_kernel(q8, True, 80.0) == "mmqw"
    # the choice by type alone: no shape types, the sets' old defaults
    monkeypatch.setattr(gpu, "SHAPE_TYPES", frozenset())
    monkeypatch.setattr(gpu, "MMQK_TYPES", every)
    monkeypatch.setattr(gpu, "MMQW_TYPES", frozenset())
    assert all(gpu.grouped_kernel(t.id, d, p) == "mmqk" for t in TYPES if t.quantized for d in (False, True) for p in (5.0, 80.0))
    monkeypatch.setattr(gpu, "MMQK_TYPES", frozenset())
    assert gpu.grouped_kernel(q8, True, 80.0) == "mmqx" and gpu.grouped_kernel(q4, False, 80.0) == "mmx"


def test_gpu_grouped_env_settings(tmp_path):
    """STRATA_GROUPED / STRATA_MMQK / STRATA_GROUPED_MMQX_PAIRS as a process reads them."""
    import subprocess
    import sys

    code = ("from strata.engine.kernels import gpu; "
            "print(gpu.GROUPED, sorted(gpu.MMQK_TYPES)[:1], sorted(gpu.MMAX_TYPES), len(gpu.SHAPE_TYPES) > 0, gpu.GROUPED_MMQX_PAIRS)")

    def run(**env):
        e = {k: v for k, v in os.environ.items() if k not in ("STRATA_GROUPED", "STRATA_MMQK", "STRATA_MMAX", "STRATA_MMQW", "STRATA_GROUPED_MMQX_PAIRS")}
        r = subprocess.run([sys.executable, "-c", code], env={**e, **env}, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert run() == ["shape", "[]", "[]", "True", "40.0"]
    assert run(STRATA_GROUPED="types") == ["types", "['IQ1_M']", "['Q8_0']", "False", "40.0"]
    assert run(STRATA_MMQK="Q4_K", STRATA_GROUPED_MMQX_PAIRS="64") == ["shape", "['Q4_K']", "[]", "True", "64.0"]
