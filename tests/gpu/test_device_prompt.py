"""The device step's prompt chunk: its routed experts on the device (engine/tier/device.py
DeviceExperts.routed), grouped kernels in place of a launch per expert.

Each test runs on CUDA (marked gpu: scripts/gpu_suite.sh) and on the host emulation (tests/gpu_emu.py).
What must hold: every grouped product row is the batched kernel's (gpu.matmul's, the CPU's) on its
expert alone, bit for bit; the chunk's routed rows are the host-driven hit path's bit for bit
whether the experts are resident, missing or streamed, whatever the chunk size.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from gpu_emu import EmuRuntime

import strata.engine.kernels.gpu as gpu
from strata.index_format.ggml_types import TYPES

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _grouped_kernel(monkeypatch, kernel: str, name: str) -> None:
    """grouped_products takes `kernel` ("mmx", "mmqx", "mmqx-1warp": one warp a block, "mmqw", "mmqk") for
    type `name`; the launch plans are dropped, so they are made again for it."""
    kind = kernel.split("-")[0]
    monkeypatch.setattr(gpu, "MMAX_TYPES", frozenset({name}) if kind == "mmqx" else frozenset())
    monkeypatch.setattr(gpu, "MMQW_TYPES", frozenset({name}) if kind == "mmqw" else frozenset())
    monkeypatch.setattr(gpu, "MMQK_TYPES", frozenset({name}) if kind == "mmqk" else frozenset())
    monkeypatch.setattr(gpu, "SHAPE_TYPES", frozenset())  # (the choice by shape: test_grouped_choice_by_shape_*)
    monkeypatch.setattr(gpu, "MMQX_WARPS", 1 if kernel.endswith("1warp") else 4)
    monkeypatch.setattr(gpu, "_plans", {})


# (n_in, pairs a group): a ragged last 16-row group (37 rows), a partial chunk after a whole one
# (nb 40 or 44: mmqw decodes each chunk again for each n-tile) and a single chunk (nb 24 or 11: decoded
# once for every n-tile); groups of 1 pair, one n-tile short, whole and one past, and one of
# MAX_TOKENS + 6 (two tiles, the second ragged)
_GROUPED_IN = {32: (32 * 44, 32 * 11), 64: (64 * 20, 64 * 6), 256: (256 * 5, 256 * 3)}
_GROUPED_COUNTS = [1, 5, 8, 9, 17, gpu.MAX_TOKENS + 6]


@pytest.mark.parametrize("kernel", ["mmx", "mmqx", "mmqw", "mmqk"])
@pytest.mark.parametrize("t", [t for t in TYPES if t.quantized], ids=lambda t: t.name)
def test_grouped_kernels_every_type_on_ragged_tiles(rt, t, kernel, monkeypatch):
    """Every block type through each grouped kernel (gpu.grouped_kernel, chosen per type): each
    group's rows (gathered from shuffled activation rows) are the reference's bits on its expert alone."""
    from kernel_blocks import random_weights
    from strata.engine.kernels import reference as R
    from strata.engine.kernels.actq import quantize_act

    _grouped_kernel(monkeypatch, kernel, t.name)
    rng = np.random.default_rng(t.id)
    F, counts = 37, _GROUPED_COUNTS
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    n = sum(counts)
    for E in _GROUPED_IN[t.block_size]:
        assert gpu._grouped_plan(t.id, E, F, gpu.MAX_TOKENS)[1] == f"{kernel}<{t.id}>"
        raws = [random_weights(t, E * F, rng) for _ in counts]
        ws = [gpu.upload(r, t.id, E, F) for r in raws]
        tok = rng.permutation(n).astype(np.int32)  # pair p reads activation row tok[p]
        xh = rng.standard_normal((n, E)).astype(np.float32) * rng.uniform(0.1, 10, (n, 1)).astype(np.float32)
        tiles = gpu.tile_rows(ws, firsts, counts, [0] * len(counts))
        out = rt.to_device(np.full((n, F), 5.0, np.float32))
        gpu.grouped_products(t.id, E, F, rt.to_device(tiles), len(tiles), gpu.quantize_act_gpu(rt.to_device(xh)), rt.to_device(tok), None, out)
        got = rt.to_host(out)
        for g, (r, a, c) in enumerate(zip(raws, firsts, counts)):
            ref = R.dot_reference(r, t.id, E, F, quantize_act(xh[tok[a : a + c]]))
            same = got[a : a + c].view(np.uint32) == ref.view(np.uint32)
            if not same.all():
                p, o = (int(v) for v in np.argwhere(~same)[0])
                pytest.fail(f"{t.name} {kernel} n_in {E}: group {g} ({c} pairs), pair {p} row {o}: {got[a + p, o]!r} vs reference {ref[p, o]!r}")


# (down, mean pairs an expert) -> the kernel the choice by shape takes (gpu.grouped_kernel)
_SHAPE_CASES = [(False, 5.0, "mmqk"), (False, 80.0, "mmqx"), (True, 5.0, "mmqw"), (True, 80.0, "mmqw")]


@pytest.mark.parametrize("t", [t for t in TYPES if t.quantized], ids=lambda t: t.name)
def test_grouped_choice_by_shape_is_mmqk_bits_on_ragged_tiles(rt, t, monkeypatch):
    """STRATA_GROUPED=shape (the default): whichever kernel the shape and pairs an expert choose (mmqk for
    gate/up at few pairs, mmqx at many, mmqw for down), every block type's grouped rows on ragged tiles are
    mmqk's bits (the kernel chosen by type before it), and the reference's."""
    from kernel_blocks import random_weights
    from strata.engine.kernels import reference as R
    from strata.engine.kernels.actq import quantize_act

    rng = np.random.default_rng(100 + t.id)
    F, counts = 37, _GROUPED_COUNTS
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    n = sum(counts)
    for E in _GROUPED_IN[t.block_size]:
        raws = [random_weights(t, E * F, rng) for _ in counts]
        ws = [gpu.upload(r, t.id, E, F) for r in raws]
        tok = rng.permutation(n).astype(np.int32)
        xh = rng.standard_normal((n, E)).astype(np.float32) * rng.uniform(0.1, 10, (n, 1)).astype(np.float32)
        x = gpu.quantize_act_gpu(rt.to_device(xh))
        host_tiles = gpu.tile_rows(ws, firsts, counts, [0] * len(counts))
        tiles, n_tiles = rt.to_device(host_tiles), len(host_tiles)

        def run(down, pairs):
            out = rt.to_device(np.full((n, F), 5.0, np.float32))
            gpu.grouped_products(t.id, E, F, tiles, n_tiles, x, rt.to_device(tok), None, out, down=down, pairs=pairs)
            return rt.to_host(out)

        _grouped_kernel(monkeypatch, "mmqk", t.name)
        base = run(False, 0.0)
        for g, (r, a, c) in enumerate(zip(raws, firsts, counts)):
            ref = R.dot_reference(r, t.id, E, F, quantize_act(xh[tok[a : a + c]]))
            assert np.array_equal(base[a : a + c].view(np.uint32), ref.view(np.uint32)), f"{t.name} mmqk n_in {E}: group {g}"
        monkeypatch.setattr(gpu, "MMQK_TYPES", frozenset())
        monkeypatch.setattr(gpu, "SHAPE_TYPES", frozenset({t.name}))
        for down, pairs, kernel in _SHAPE_CASES:
            assert gpu._grouped_plan(t.id, E, F, gpu.MAX_TOKENS, down, pairs)[1] == f"{kernel}<{t.id}>"
            got = run(down, pairs)
            same = got.view(np.uint32) == base.view(np.uint32)
            if not same.all():
                p, o = (int(v) for v in np.argwhere(~same)[0])
                pytest.fail(f"{t.name} by shape ({kernel}, down={down}, {pairs} pairs) n_in {E}: pair {p} row {o}: {got[p, o]!r} vs mmqk {base[p, o]!r}")


@pytest.mark.parametrize("kernel", ["mmx", "mmqx", "mmqx-1warp", "mmqw", "mmqk"])
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K"])
def test_grouped_products_are_each_experts_matmul(rt, name, kernel, monkeypatch):
    """mmx / mmqx / mmqw (gpu.grouped_kernel): the products of several experts on their own rows of a
    chunk in one launch (a group of more than MAX_TOKENS pairs spans tiles; rows gathered by xrow,
    scattered by orow), each row the bits of gpu.matmul on that expert's rows alone, and of the reference."""
    from kernel_blocks import random_weights
    from strata.engine.kernels import reference as R
    from strata.engine.kernels.actq import quantize_act
    from strata.index_format.ggml_types import ggml_type

    rng = np.random.default_rng(11)
    t = ggml_type(name)
    _grouped_kernel(monkeypatch, kernel, name)
    assert gpu._grouped_plan(t.id, 256, 126, gpu.MAX_TOKENS)[1] == f"{kernel.split('-')[0]}<{t.id}>"
    # F: not whole 16-row groups (mmqx) nor a multiple of 4 (rows a warp step takes in some launch
    # plans); E: 8 act-blocks, a partial chunk
    E, F, T = 256, 126, 9
    raws = [random_weights(t, E * F, rng) for _ in range(3)]
    ws = [gpu.upload(r, t.id, E, F) for r in raws]
    counts = [gpu.MAX_TOKENS + 3, 2, 21]  # the first group spans two tiles (the second of 3 pairs)
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    n = sum(counts)
    tok = rng.integers(0, T, n).astype(np.int32)  # the pair's token (repeats: the same token twice)
    xh = rng.standard_normal((T, E)).astype(np.float32)
    x = gpu.quantize_act_gpu(rt.to_device(xh))
    # gather: out row = pair
    tiles = gpu.tile_rows(ws, firsts, counts, [0, 0, 0])
    assert len(tiles) == 4
    out = rt.to_device(np.full((n, F), 5.0, np.float32))
    gpu.grouped_products(t.id, E, F, rt.to_device(tiles), len(tiles), x, rt.to_device(tok), None, out)
    got = rt.to_host(out)
    # scatter: pair p (input row p) into row perm[p] of a bigger output, the rest untouched
    perm = rng.permutation(n + 4)[:n].astype(np.int32)
    big = rt.to_device(np.full((n + 4, F), 5.0, np.float32))
    xsh = rng.standard_normal((n, E)).astype(np.float32)
    xs = gpu.quantize_act_gpu(rt.to_device(xsh))
    gpu.grouped_products(t.id, E, F, rt.to_device(tiles), len(tiles), xs, None, rt.to_device(perm), big)
    got_big = rt.to_host(big)
    assert (np.delete(got_big, perm, axis=0) == 5.0).all()
    for r, a, c in zip(raws, firsts, counts):
        rows = tok[a : a + c]
        ref = R.dot_reference(r, t.id, E, F, quantize_act(xh[rows]))
        assert np.array_equal(got[a : a + c].view(np.int32), ref.view(np.int32)), f"{name} group at {a}: gathered rows"
        ref_s = R.dot_reference(r, t.id, E, F, quantize_act(xsh[a : a + c]))
        assert np.array_equal(got_big[perm[a : a + c]].view(np.int32), ref_s.view(np.int32)), f"{name} group at {a}: scattered rows"
    for w, a, c in zip(ws, firsts, counts):
        rows = tok[a : a + c]
        want = rt.to_host(gpu.matmul(w, gpu.GpuActQ(x.q[rows], x.d[rows], x.s16[rows], None)))
        assert np.array_equal(got[a : a + c].view(np.int32), want.view(np.int32))
        want_s = rt.to_host(gpu.matmul(w, gpu.GpuActQ(xs.q[a : a + c], xs.d[a : a + c], xs.s16[a : a + c], None)))
        assert np.array_equal(got_big[perm[a : a + c]].view(np.int32), want_s.view(np.int32))


def _launch_dev_group(rt, mod, ids, N, k, X, table, arena, sizes, tile, M, tok, pos, t_gu, t_d, smem_ids, threads=1024,
                      stage=None):
    """dev_group as DeviceChunk.forward launches it (its scratch filled with garbage first)."""
    sb, gub, gsc, dsc = sizes
    scratch = rt.to_device(np.full(3 * X + 1 + threads // 32 * X, 12345, np.int32))
    rt.launch(mod, "dev_group", 1, threads, (ids, np.int32(N), np.int32(k), np.int32(X), rt.to_device(table), arena,
                                             arena if stage is None else stage, np.int64(sb), np.int64(gub), np.int64(gsc), np.int64(dsc), np.int32(tile),
                                             np.int32(M), tok, pos, t_gu, t_d, scratch[:X], scratch[X : 2 * X],
                                             scratch[2 * X : 3 * X + 1], scratch[3 * X + 1 :], np.int32(smem_ids)),
              smem=4 * smem_ids)  # (smem_ids 0: the ids read from global memory)


@pytest.mark.parametrize("case", ["small", "skewed", "past-smem", "many-experts", "256-threads", "streamed"])
def test_dev_group_is_groups_on_random_routings(rt, case):
    """dev_group (a stable counting sort: each warp's segment counted, then placed) on random routings
    against the host's grouping (moe.Groups): tok, pos and the tiles, bit for bit. Past GROUP_SMEM_IDS
    pairs (8192) the ids are read from global memory; a block of 256 threads (8 segments) must give the
    same output as 1024. "streamed": half the experts' entries are -1 - s, slot s of a layer streamed
    whole (staging.LayerStream), whose tiles must address that buffer, not the cache's arena."""
    from strata.engine.moe import Groups
    from strata.engine.tier.device import KERNELS, _NAMES
    from strata.engine.tier.device_chunk import GROUP_SMEM_IDS

    mod = rt.compile(_NAMES, KERNELS)
    T, X, k, threads = {"small": (7, 16, 3, 1024), "skewed": (300, 40, 6, 1024), "past-smem": (1100, 64, 8, 1024),
                        "many-experts": (96, 512, 10, 1024), "256-threads": (700, 48, 5, 256),
                        "streamed": (200, 64, 8, 1024)}[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    if case == "skewed":  # most pairs on a few experts (tiles of MAX_TOKENS and a ragged last one)
        p = rng.dirichlet(np.full(X, 0.1))
    else:
        p = np.full(X, 1.0 / X)
    top = np.stack([rng.choice(X, k, replace=False, p=p) for _ in range(T)]).astype(np.int32)
    N, tile = T * k, gpu.MAX_TOKENS
    M = -(-N // tile) + min(X, N)
    assert (N > GROUP_SMEM_IDS) == (case == "past-smem")
    table = rng.permutation(X).astype(np.int32)
    if case == "streamed":
        table[rng.permutation(X)[: X // 2]] = -1 - rng.permutation(X)[: X // 2].astype(np.int32)
    arena, stage = rt.to_device(np.zeros(64, np.uint8)), rt.to_device(np.zeros(64, np.uint8))
    sizes = (1000, 300, 100, 50)
    tok, pos = rt.to_device(np.full(N, -1, np.int32)), rt.to_device(np.full(N, -1, np.int64))
    t_gu, t_d = rt.to_device(np.full((2 * M, 5), 7, np.int64)), rt.to_device(np.full((M, 5), 7, np.int64))
    _launch_dev_group(rt, mod, rt.to_device(top.reshape(-1)), N, k, X, table, arena, sizes, tile, M, tok, pos, t_gu, t_d,
                      GROUP_SMEM_IDS, threads, stage=stage)
    grp = Groups(top)
    assert np.array_equal(rt.to_host(tok), grp.rows)
    assert np.array_equal(rt.to_host(pos).reshape(T, k), grp.slot)
    base, (sb, gub, gsc, dsc) = rt.ptr(arena), sizes
    want_g, want_u, want_d = [], [], []
    for g, e in enumerate(grp.experts):
        a, b = int(grp.starts[g]), int(grp.starts[g + 1])
        s_ = base + int(table[e]) * sb if table[e] >= 0 else rt.ptr(stage) + (-1 - int(table[e])) * sb
        for f in range(a, b, tile):
            n = min(tile, b - f)
            want_g.append((s_, s_ + gsc, f, n, 0))
            want_u.append((s_ + gub, s_ + gub + gsc, f, n, N))
            want_d.append((s_ + 2 * gub, s_ + 2 * gub + dsc, f, n, 0))
    got_gu, got_d, used = rt.to_host(t_gu), rt.to_host(t_d), len(want_g)
    assert np.array_equal(got_gu[:used], np.array(want_g)) and np.array_equal(got_gu[M : M + used], np.array(want_u))
    assert np.array_equal(got_d[:used], np.array(want_d))
    assert (got_gu[used:M, 3] == 0).all() and (got_gu[M + used :, 3] == 0).all() and (got_d[used:, 3] == 0).all()


@pytest.mark.parametrize("smem_ids", [8192, 0])
def test_dev_route_rows_and_dev_group_are_route_topk_and_groups(rt, smem_ids):
    """A chunk's routing on the device: each token's experts and f32 weights are moe.route_topk's
    (ties included: to the lower id), the grouped order and each pair's place are Groups', and the
    tiles cover each expert's pairs in MAX_TOKENS pieces on its slot's planes (unused ones empty);
    dev_group with its ids in shared memory and without."""
    from strata.engine.moe import Groups, route_topk
    from strata.engine.tier.device import KERNELS, _NAMES

    mod = rt.compile(_NAMES, KERNELS)
    rng = np.random.default_rng(3)
    T, X, k = 150, 24, 4
    logits = rng.standard_normal((T, X)).astype(np.float32)
    logits[:, 5] = logits[:, 9]  # ties: the lower id first
    logits[:100, 2] += 3.0  # expert 2 takes more than a tile of pairs
    ids, w = rt.to_device(np.zeros((T, k), np.int32)), rt.to_device(np.zeros((T, k), np.float32))
    rt.launch(mod, "dev_route_rows", T, 32, (rt.to_device(logits), np.int32(X), np.int32(k), ids, w))
    top, weights = route_topk(logits, k)
    assert np.array_equal(rt.to_host(ids), top)
    assert np.array_equal(rt.to_host(w).view(np.int32), weights.astype(np.float32).view(np.int32))
    N, M, tile = T * k, -(-T * k // gpu.MAX_TOKENS) + X, gpu.MAX_TOKENS
    table = rng.permutation(X).astype(np.int32)  # expert e in slot table[e]
    arena = rt.to_device(np.zeros(64, np.uint8))
    sb, gub, gsc, dsc = 1000, 300, 100, 50
    tok, pos = rt.to_device(np.full(N, -1, np.int32)), rt.to_device(np.full(N, -1, np.int64))
    t_gu, t_d = rt.to_device(np.full((2 * M, 5), 7, np.int64)), rt.to_device(np.full((M, 5), 7, np.int64))
    _launch_dev_group(rt, mod, ids, N, k, X, table, arena, (sb, gub, gsc, dsc), tile, M, tok, pos, t_gu, t_d, smem_ids)
    grp = Groups(top)
    assert np.array_equal(rt.to_host(tok), grp.rows)
    assert np.array_equal(rt.to_host(pos).reshape(T, k), grp.slot)
    base = rt.ptr(arena)
    want_g, want_u, want_d = [], [], []
    for g, e in enumerate(grp.experts):
        a, b = int(grp.starts[g]), int(grp.starts[g + 1])
        s_ = base + int(table[e]) * sb if table[e] >= 0 else rt.ptr(stage) + (-1 - int(table[e])) * sb
        for f in range(a, b, tile):
            n = min(tile, b - f)
            want_g.append((s_, s_ + gsc, f, n, 0))
            want_u.append((s_ + gub, s_ + gub + gsc, f, n, N))
            want_d.append((s_ + 2 * gub, s_ + 2 * gub + dsc, f, n, 0))
    got_gu, got_d = rt.to_host(t_gu), rt.to_host(t_d)
    used = len(want_g)
    assert any(r[3] == tile for r in want_g) and used < M
    assert np.array_equal(got_gu[:used], np.array(want_g)) and np.array_equal(got_gu[M : M + used], np.array(want_u))
    assert np.array_equal(got_d[:used], np.array(want_d))
    assert (got_gu[used:M, 3] == 0).all() and (got_gu[M + used :, 3] == 0).all() and (got_d[used:, 3] == 0).all()


# --- the chunk path against the host-driven hit path, through the model

CTX = 40


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import engine_fixture as F

    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    return Model(Pack.open(F.make_pack(tmp_path_factory.mktemp("device-prompt"), types={"experts": "Q8_0", "dense": "Q8_0"})))


def _host_tables(be) -> None:
    """The chunk's embedding and PLE rows decoded on the host and its PLE conv by engine/ple.py's
    conv_reference, as before the device gathered and convolved them (dev_embd_rows,
    dev_ple_gather, dev_ple_conv_rows), on this backend only."""
    from strata.engine.ple import conv_reference

    def conv(ring, t0, X, taps, dil, y):
        y[...] = be.upload(conv_reference(be.host(ring), t0, be.host(X), np.ascontiguousarray(taps.T), dil))

    be.embed_rows = lambda ids, n: None
    be.ple_rows = lambda ids, row_dim: None
    be.ple_conv = conv


def prompt_logits(model, rt, toks, chunk: int, host_path: bool, seen: dict | None = None, **opts):
    """The logits of every prompt position, the prompt fed in chunks of `chunk` (the last one
    shorter where it does not divide), then two decode steps; and (launched kernel names, stats).
    `seen["tables"]`, `seen["embd"]`: whether the PLE table, the embedding table was on the device."""
    from strata.engine.tier import GpuTier, TierOptions

    o = {"max_context": CTX, "kv": "f32", "prefill_chunk": 16, "step": "device", **opts}
    tier = GpuTier.start(model, TierOptions(**o))
    try:
        if host_path:
            model.backend.experts.chunk = None  # the hit path's host-driven chunk (hits.py), as before
            _host_tables(model.backend)
        s = tier.take_session(CTX, "f32")
        if seen is not None:
            seen["tables"], seen["embd"] = model.backend.ple is not None, model.backend.embd_table is not None
        launched, launch = [], rt.launch
        rt.launch = lambda mod, name, *a, **k: (launched.append(name), launch(mod, name, *a, **k))
        try:
            rows = [np.array(model.forward(s, toks[a : a + chunk], n_logits=len(toks[a : a + chunk])))
                    for a in range(0, len(toks) - 2, chunk)]
            rows += [model.step(s, t).copy()[None] for t in toks[len(toks) - 2 :]]
        finally:
            del rt.launch
        st = tier.stats
        return np.concatenate(rows), launched, (int(st.chunk_resident.sum()), int(st.chunk_streamed.sum()), int(st.chunk_cpu.sum()))
    finally:
        tier.stop()


@pytest.mark.parametrize("cache,stream", [("all", 0), ("none", 2), ("third", 2)])
def test_the_chunk_path_has_the_host_paths_bits(model, rt, cache, stream):
    """The device step's prompt chunk in grouped launches gives the host-driven hit path's logits bit
    for bit: every expert resident (routed on the device), none resident (some streamed), a third
    resident (the CPU's rows and streamed ones beside the device's); chunks of 4 over 11 prompt
    tokens (the last chunk of 3)."""
    g = model.geometry
    size = {"all": None, "third": g.n_layer * g.n_expert // 3, "none": 0}[cache]
    toks = np.random.default_rng(5).integers(3, g.n_vocab, 13).tolist()
    opts = {"expert_cache": size, "stream_min_tokens": stream, "stream_layer_tokens": 0}  # (layers whole: the next test)
    want, old, _ = prompt_logits(model, rt, toks, 4, True, **opts)
    seen = {}
    got, new, (res, strm, cpu) = prompt_logits(model, rt, toks, 4, False, seen, **opts)
    assert seen["embd"] and "dev_embd_rows" in new and "dev_embd_rows" not in old  # (the chunk's rows gathered there)
    grouped = lambda names: any(n.startswith(("mmx<", "mmqx<", "mmqw<", "mmqk<")) for n in names)  # noqa: E731 (gpu.grouped_kernel picks which)
    assert not grouped(old)
    if cache != "none":
        assert res > 0 and grouped(new), (res, set(new))
    # a layer whose experts are all resident routes and groups on the device, the others on the host
    assert ("dev_group" in new) == (cache == "all") and "dev_group" not in old
    if cache == "third":
        assert cpu > 0  # both sides ran
    if stream:
        assert strm > 0
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max()}"


@pytest.mark.parametrize("cache", ["none", "third", "none-runs", "none-pinned", "none-capped"])
def test_a_layer_streamed_whole_has_the_host_paths_bits(model, rt, cache, monkeypatch):
    """A chunk that streams its layers' non-resident experts whole (staging.LayerStream: the GGUF's
    blocks copied raw, widened on the device, the grouped kernels reading them as if resident) gives
    the host-driven hit path's logits bit for bit, with nothing on the CPU; three chunks of 4, so the
    next layer's copy is queued while a layer computes and a buffer is reused every other layer. "runs": the prompt buffers hold 2 tokens' pairs only, so a layer
    copied once is computed in runs of tokens. --stats counts the streamed experts apart from the
    resident ones (without a profile the streamed experts then fill free slots: "third").
    The GGUF's pages are registered and DMA'd from (the default), or copied through the pinned
    pieces ("pinned": stream_register off), or both in one forward ("capped": the registration's
    cap holds layer 0's tensors only)."""
    from strata.engine.tier import startup, staging
    from strata.engine.tier.device_chunk import DeviceChunk

    g = model.geometry
    size = {"third": g.n_layer * g.n_expert // 3}.get(cache, 0)
    toks = np.random.default_rng(5).integers(3, g.n_vocab, 13).tolist()
    want, _, _ = prompt_logits(model, rt, toks, 4, True, expert_cache=size, stream_layer_tokens=0)
    calls, seen = [], []
    if cache.endswith("runs"):
        fits, forward = DeviceChunk.fits, DeviceChunk.forward
        monkeypatch.setattr(DeviceChunk, "fits", lambda self, moe, n: n <= 2 * g.n_expert_used and fits(self, moe, n))
        monkeypatch.setattr(DeviceChunk, "forward", lambda self, moe, x, *a: (calls.append(x.x.shape[0]), forward(self, moe, x, *a))[1])
    if cache.endswith("capped"):  # the cap: layer 0's three tensors and the pages at their ends
        layer0 = sum(t.nbytes + 2 * staging.PAGE for t in model.pack.expert_tensors(0))
        monkeypatch.setattr(startup, "host_memory_bytes", lambda: int(layer0 / staging.REGISTER_SHARE) + 1)
    close = staging.LayerStream.close
    monkeypatch.setattr(staging.LayerStream, "close", lambda self: (
        seen.append((self.stats.registered_bytes, self.stats.streamed_bytes, self.registry and self.registry.bytes)),
        close(self))[1])
    got, new, (res, strm, cpu) = prompt_logits(model, rt, toks, 4, False, expert_cache=size, stream_layer_tokens=1,
                                               stream_register=not cache.endswith("pinned"))
    if calls:
        assert calls and set(calls) == {2}, str(calls)  # (every 4-token chunk in two runs)
    assert "dev_widen" in new and "dev_group" in new, sorted(set(new))
    assert cpu == 0 and strm > 0 and (res > 0) == (cache == "third"), (res, strm, cpu)
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max()}"
    (direct, streamed, registered), = seen
    if hasattr(rt, "registered"):  # (the emulation's record: stop unregistered every page)
        assert rt.registered == []
    if cache.endswith("pinned"):
        assert direct == 0 and registered is None
    elif cache.endswith("capped"):
        assert 0 < direct < streamed, (direct, streamed)  # layer 0 from its pages, the others through pieces
    else:
        assert direct == streamed > 0 and registered > 0, (direct, streamed, registered)


def test_a_layer_stream_refuses_a_non_finite_scale_naming_where(model, rt, monkeypatch):
    """A streamed layer whose GGUF bytes hold a non-finite fp16 scale stops the forward with an error
    naming the layer, the expert and the block (dev_widen marks it), as the host's widen does."""
    from strata.engine.tier import GpuTier, TierOptions

    g = model.geometry
    tensors = model.pack.expert_tensors

    def bad(layer):
        gate, up, down = (t.copy() for t in tensors(layer))
        if layer == 0:  # Q8_0: each 34-byte block starts with its fp16 scale
            each = gate.nbytes // g.n_expert
            gate[3 * each + 34 : 3 * each + 36] = np.array([0x7C00], np.uint16).view(np.uint8)  # expert 3, block 1: +inf
        return gate, up, down

    monkeypatch.setattr(model.pack, "expert_tensors", bad)
    tier = GpuTier.start(model, TierOptions(max_context=CTX, kv="f32", prefill_chunk=16, step="device", expert_cache=0,
                                            stream_layer_tokens=1))
    try:
        s = tier.take_session(CTX, "f32")
        with pytest.raises(ValueError, match=r"blk\.0 expert 3 \(streamed\): block 1 .*non-finite fp16 scale"):
            model.forward(s, [5, 6, 7, 8], n_logits=1)
    finally:
        tier.stop()


@pytest.mark.parametrize("t", [t for t in TYPES if t.quantized], ids=lambda t: t.name)
def test_dev_widen_is_engine_forms_widen(rt, t):
    """dev_widen (a layer streamed whole: the GGUF's blocks of a run of experts -> each one's engine
    form in its slot) writes engine_form.widen's rest and f32 scales bit for bit, every block type,
    subnormal and signed fp16 scales included; only the run's slots are written; a non-finite scale
    marks its expert and block."""
    from kernel_blocks import random_weights
    from strata.engine.kernels.engine_form import align, widen, widen_columns
    from strata.engine.tier.device import KERNELS, _NAMES

    mod = rt.compile(_NAMES, KERNELS)
    rng = np.random.default_rng(t.id)
    nbe, n_exp, e0 = 3, 3, 2  # three experts of 3 blocks each, into slots 2, 3, 4 of 6
    raw = random_weights(t, nbe * n_exp * t.block_size, rng).reshape(n_exp * nbe, t.type_size)
    if t.n_scales:  # an f16 subnormal, a negative scale and a zero in the first field of three blocks
        off = t.fp16_fields[0][0]
        for blk, h in ((0, 0x0003), (4, 0x8401), (7, 0x0000)):
            raw[blk, off : off + 2] = np.array([h], np.uint16).view(np.uint8)
    rest_b, sc_b = nbe * t.rest_bytes, nbe * t.n_scales * 4
    slot, off, sc_off = 4096, 256, align(rest_b)
    assert off + sc_off + sc_b <= slot
    cols = np.full(512, -(1 << 20), np.int32)
    cols[: t.type_size] = widen_columns(t)
    dst = rt.to_device(np.full(6 * slot, 0xAB, np.uint8))
    bad = rt.to_device(np.full(1, np.iinfo(np.uint64).max, np.uint64))

    def run(blocks):
        rt.launch(mod, "dev_widen", 4, 128, (rt.to_device(blocks.reshape(-1)), np.int32(n_exp), np.int64(nbe),
                                             np.int32(t.type_size), np.int32(t.rest_bytes), np.int32(t.n_scales),
                                             rt.to_device(cols), dst, np.int32(e0), np.int64(slot), np.int64(off),
                                             np.int64(sc_off), bad))

    run(raw)
    got = rt.to_host(dst).reshape(6, slot)
    for j in range(n_exp):
        scales, rest = widen(raw[j * nbe : (j + 1) * nbe].reshape(-1), t.id)
        s_ = got[e0 + j, off:]
        assert np.array_equal(s_[:rest_b], rest.reshape(-1)), f"expert {j} rest"
        assert np.array_equal(s_[sc_off : sc_off + sc_b].view(np.uint32), scales.reshape(-1).view(np.uint32)), f"expert {j} scales"
    untouched = np.ones((6, slot), bool)
    for j in range(n_exp):
        untouched[e0 + j, off : off + rest_b] = False
        untouched[e0 + j, off + sc_off : off + sc_off + sc_b] = False
    assert (got[untouched] == 0xAB).all()
    assert rt.to_host(bad)[0] == np.iinfo(np.uint64).max
    if t.n_scales:
        f = t.fp16_fields[0][0]
        raw[5, f : f + 2] = np.array([0x7C00], np.uint16).view(np.uint8)  # +inf: expert 1 (slot 3), block 2
        raw[8, f : f + 2] = np.array([0xFE00], np.uint16).view(np.uint8)  # NaN: expert 2 (slot 4), block 2
        run(raw)
        assert rt.to_host(bad)[0] == (3 << 32) | 2


def test_a_chunk_past_the_prompt_buffers_runs_on_the_device_in_runs_of_experts(model, rt, monkeypatch):
    """A chunk whose pairs the prompt buffers do not hold (here: fits capped at half a 4-token
    chunk's pairs) is computed on the device in runs of experts that fit, with the host path's bits
    and nothing on the CPU. Before, such a chunk went to the host path, which found no room either
    and computed every expert on the CPU (a 4096-token forward beside 256-token buffers, H200)."""
    from strata.engine.tier.device_chunk import DeviceChunk

    g = model.geometry
    toks = np.random.default_rng(7).integers(3, g.n_vocab, 13).tolist()
    want, _, _ = prompt_logits(model, rt, toks, 4, True)
    limit = 4 * g.n_expert_used // 2  # each expert's pairs (<= 4, one a token) fit; a whole chunk's do not
    fits, routed = DeviceChunk.fits, DeviceChunk.routed
    calls = []
    monkeypatch.setattr(DeviceChunk, "fits", lambda self, moe, n: n <= limit and fits(self, moe, n))
    monkeypatch.setattr(DeviceChunk, "routed", lambda self, moe, x, e, r, s: (calls.append(r.size), routed(self, moe, x, e, r, s))[1])
    got, new, (res, strm, cpu) = prompt_logits(model, rt, toks, 4, False)
    assert cpu == 0 and strm == 0 and res > 0, (res, strm, cpu, calls, sorted(set(new)))
    assert any(n.startswith(("mmx<", "mmqx<", "mmqw<", "mmqk<")) for n in new), (calls, sorted(set(new)))
    assert calls and max(calls) <= limit and len(calls) > g.n_layer * 3  # several runs a layer and chunk
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max()}"


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory):
    import engine_fixture as F

    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    return Model(Pack.open(F.tiny_qwen4exp(tmp_path_factory.mktemp("device-prompt-q4"))))


@pytest.mark.slow  # the emulated products of the tiny qwen4exp: ~25 s a token step on the CI's 2 cores
@pytest.mark.parametrize("cache", ["all", "third", "third-layers"])
def test_the_qwen4exp_chunk_path_has_the_host_paths_bits(qwen4exp, rt, cache):
    """qwen4exp's prompt on the device step: a chunk of 3 then one of 2 (then two steps), the same
    logits bit for bit as the host-driven hit path, every expert resident (routed on the device), a
    third (routed on the host, misses on the CPU), or a third with the other experts of each layer
    streamed whole (staging.LayerStream: routed on the device, nothing on the CPU)."""
    if cache == "all" and isinstance(rt, EmuRuntime):
        pytest.skip("run on the card: ~260 s emulated on CI's 2 cores (the all-resident chunk path is emulated by "
                    "the qwen35moe test, qwen4exp's chunk by the 'third' case)")
    g = qwen4exp.geometry
    size = None if cache == "all" else g.n_layer * g.n_expert // 3
    layers = cache.endswith("layers")
    toks = np.random.default_rng(5).integers(3, g.n_vocab, 7).tolist()
    want, old, _ = prompt_logits(qwen4exp, rt, toks, 3, True, expert_cache=size, stream_min_tokens=0)
    seen = {}
    opts = {"stream_layer_tokens": 1} if layers else {"stream_min_tokens": 0}
    got, new, (res, strm, cpu) = prompt_logits(qwen4exp, rt, toks, 3, False, seen, expert_cache=size, **opts)
    tables = seen["tables"]
    assert any(n.startswith(("mmx<", "mmqx<", "mmqw<", "mmqk<")) for n in new)  # (gpu.grouped_kernel picks which)
    assert ("dev_group" in new) == (cache != "third") and ("dev_widen" in new) == layers
    if cache == "third":
        assert res > 0 and cpu > 0
    if layers:
        assert strm > 0 and cpu == 0
    # the chunk's PLE conv on the device; its embedding and PLE rows gathered there where the tables
    # are on the device (the budget places them with every expert resident)
    assert "dev_ple_conv_rows" in new and "dev_ple_conv_rows" not in old
    assert ("dev_embd_rows" in new) == ("dev_ple_gather" in new) == tables
    assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max()}"


# --- what a chunk gathers and convolves on the device (qwen4exp's prompt: the embedding, PLE)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_a_chunks_embedding_rows_are_gathered_on_the_device_bit_for_bit(rt, type_name):
    """DeviceBackend.embed_rows (dev_embd_rows): a chunk's rows are the reference decoder's of each
    token's bytes, bit for bit, tokens out of order and repeated, the first and the last row; an id
    past the table is refused, not read; without the table on the device the host decodes them."""
    from kernel_blocks import random_weights

    from strata.engine.kernels.reference import dequantize
    from strata.engine.tier.device import EMBD_ROW_TYPES, DeviceBackend
    from strata.index_format.ggml_types import BY_NAME

    t = BY_NAME[type_name]
    assert t.id in EMBD_ROW_TYPES
    n, rows, rb = 512, 7, t.row_bytes(512)
    raw = random_weights(t, n * rows, np.random.default_rng(t.id))
    be = DeviceBackend(rt, None)
    assert be.embed_rows(np.array([1], np.int64), n) is None  # (no table: the host's decode)
    be.embd_table = (rt.to_device(raw), t.id, rb, rows)
    ids = np.array([6, 0, 3, 3, 1, 6, 2], np.int64)
    got = rt.to_host(be.embed_rows(ids, n))
    want = np.concatenate([dequantize(raw[i * rb : (i + 1) * rb], t.id, n)[None] for i in ids])
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), type_name
    with pytest.raises(IndexError, match="7 rows"):
        be.embed_rows(np.array([2, 7], np.int64), n)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "IQ4_NL", "Q8_0", "Q5_0", "Q4_K"])
def test_a_chunks_ple_rows_are_gathered_on_the_device_bit_for_bit(rt, type_name):
    """DeviceBackend.ple_rows (dev_ple_gather): the rows of a chunk's hashed ids are the host table's
    (TableRows; a block type's, the reference decoder's) bit for bit; an id past the table and a
    row size other than the table's are refused; without the table on the device, None."""
    from kernel_blocks import random_weights
    from test_device_ahead import ple_hashes

    from strata.engine.kernels.reference import dequantize
    from strata.engine.ple import TableRows
    from strata.engine.tier.device import DeviceBackend, DevicePLE
    from strata.index_format.ggml_types import BY_NAME

    t = BY_NAME[type_name]
    rng = np.random.default_rng(t.id)
    Pd = 256 if type_name == "Q4_K" else 64
    hashes, n_rows = ple_hashes(4, 2, 2, 511, rng)
    raw = random_weights(t, Pd * n_rows, rng)
    host_rows = TableRows(raw, t.id, Pd, n_rows) if not t.quantized else \
        (lambda ids: dequantize(raw.reshape(n_rows, -1)[ids].reshape(-1), t.id, ids.size * Pd).reshape(ids.size, Pd))
    be = DeviceBackend(rt, None)
    assert be.ple_rows(np.array([1], np.int64), Pd) is None
    be.ple = DevicePLE(hashes, [3, 7], rt.to_device(raw), t.id, Pd, n_rows, rt.empty, rt.copy_in)
    ids = np.concatenate([[0, n_rows - 1, 5, 5], rng.integers(0, n_rows, 20)]).astype(np.int64)
    got = rt.to_host(be.ple_rows(ids, Pd))
    want = host_rows(ids)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), type_name
    with pytest.raises(IndexError, match=f"has {n_rows}"):
        be.ple_rows(np.array([n_rows], np.int64), Pd)
    with pytest.raises(ValueError, match="rows of"):
        be.ple_rows(ids, Pd * 2)


@pytest.mark.parametrize("T,t0", [(1, 0), (3, 0), (5, 2), (12, 7), (20, 1000003)])
def test_a_chunks_ple_conv_is_the_references_bits(rt, T, t0):
    """DeviceBackend.ple_conv (dev_ple_conv_rows), a chunk of T tokens after t0 seen: engine/ple.py's
    conv_reference bit for bit (each tap's f32 product added from 0 in tap order), chunks shorter
    and longer than the ring (L = 8), the ring's slots wrapping at a large t0; the ring is read, not
    written (PLELayer._conv moves the inputs in afterwards)."""
    from strata.engine.ple import conv_reference
    from strata.engine.tier.device import DeviceBackend

    rng = np.random.default_rng(T)
    Pk, dil, HE = 3, 4, 96  # L = (Pk - 1) dil
    L = (Pk - 1) * dil
    ring = rng.standard_normal((L, HE)).astype(np.float32)
    X = rng.standard_normal((T, HE)).astype(np.float32)
    w = rng.standard_normal((HE, Pk)).astype(np.float32)
    be = DeviceBackend(rt, None)
    launched, launch = [], rt.launch
    rt.launch = lambda mod, name, *a, **k: (launched.append(name), launch(mod, name, *a, **k))
    try:
        ring_d, y = rt.to_device(ring), rt.empty((T, HE), np.float32)
        be.ple_conv(ring_d, t0, rt.to_device(X), np.ascontiguousarray(w.T), dil, y)
    finally:
        del rt.launch
    assert launched == ["dev_ple_conv_rows"]
    want = conv_reference(ring, t0, X, w, dil)
    assert np.array_equal(rt.to_host(y).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(rt.to_host(ring_d), ring)


def test_the_device_steps_prompt_piece_follows_the_free_memory(model, rt):
    """--prefill auto on the device step (GpuTier.prompt_piece): the longest piece of PROMPT_PIECES
    (up to the context) whose temporaries, at prefill_mib's 680 KiB a token beyond the planned chunk's
    and its attention's scores and their masked copy at the full context (f32 [H, piece, context],
    in tiles of at most 1 GiB), fit the memory free now beside the reserve's headroom; the planned
    chunk on a card without that room, and always on the host-driven step."""
    from strata.engine.expert_plan import MiB, prefill_mib
    from strata.engine.tier import GpuTier, TierOptions

    H = model.geometry.n_head
    attn = lambda n, ctx=5000: 2 * min(1 << 30, 4 * H * n * ctx)  # noqa: E731

    def piece(chunk=16, ctx=5000, **opts):
        o = {"max_context": ctx, "kv": "f32", "prefill_chunk": chunk, "step": "device", "expert_cache": 0,
             "stream_layer_tokens": 0, **opts}
        tier = GpuTier.start(model, TierOptions(**o))
        try:
            return tier.prompt_piece(chunk), tier.memory.used(), tier.plan.reserve.headroom_mib * MiB
        finally:
            tier.stop()

    assert piece()[0] == 4096
    big, used, headroom = piece()  # (the second start: cuBLAS's memory was the first one's)
    assert big == 4096
    assert piece(ctx=1500)[0] == 1024  # (never past the context)
    assert piece(step="host")[0] == 16
    room = (prefill_mib(1024) - prefill_mib(16)) * MiB + attn(1024) - attn(16)  # what a 1024-token piece adds
    # a card whose free memory after the start is the reserve's headroom and a 1024-token piece's
    # temporaries, not a 2048-token one's
    mib = -(-(used + headroom + room) // MiB) + 1
    assert piece(vram_budget_mib=mib)[0] == 1024
    less = (prefill_mib(1024) - prefill_mib(512)) * MiB + attn(1024) - attn(512)
    assert piece(vram_budget_mib=mib - less // MiB - 1)[0] == 512


def test_the_host_registry_registers_each_page_once_within_its_cap():
    """HostRegistry (the layer stream's registered GGUF pages): neighbours that share a page are
    registered without registering it twice (CUDA refuses that: the emulation's register_host
    keeps the rule), a copy is cut where registrations meet, the cap is kept (a tensor past it is
    refused, not registered in part), a driver's refusal turns registration off, and close()
    unregisters everything."""
    from gpu_emu import EmuRuntime
    from strata.engine.tier.staging import PAGE, HostRegistry

    rt = EmuRuntime()
    buf = np.zeros(16 * PAGE + 4096, np.uint8)
    mem = buf[-buf.ctypes.data % PAGE:][: 16 * PAGE]  # page-aligned
    a, b, c = mem[100 : 3 * PAGE + 7], mem[3 * PAGE + 7 : 5 * PAGE], mem[9 * PAGE : 12 * PAGE]  # a, b share page 3
    reg = HostRegistry(rt, cap=7 * PAGE)
    assert reg.cover(a) and reg.bytes == 4 * PAGE
    assert reg.cover(b) and reg.bytes == 5 * PAGE  # page 4 only: page 3 is a's
    assert reg.cover(a) and reg.bytes == 5 * PAGE  # (nothing new)
    assert reg.spans(a) == [(0, a.nbytes)]
    assert reg.spans(b) == [(0, PAGE - 7), (PAGE - 7, b.nbytes)]  # cut where a's registration ends
    ab = mem[100 : 5 * PAGE]
    assert reg.spans(ab) == [(0, 4 * PAGE - 100), (4 * PAGE - 100, ab.nbytes)]
    assert not reg.cover(c) and reg.bytes == 5 * PAGE  # 3 more pages pass the cap of 7: none registered
    assert reg.refused is None
    reg.cap = 16 * PAGE
    assert reg.cover(c) and reg.bytes == 8 * PAGE
    assert sorted(rt.registered) == [(mem.ctypes.data, mem.ctypes.data + 4 * PAGE),
                                     (mem.ctypes.data + 4 * PAGE, mem.ctypes.data + 5 * PAGE),
                                     (mem.ctypes.data + 9 * PAGE, mem.ctypes.data + 12 * PAGE)]
    reg.close()
    assert rt.registered == [] and reg.bytes == 0

    rt.registered.append((mem.ctypes.data, mem.ctypes.data + PAGE))  # (someone else holds page 0)
    reg = HostRegistry(rt, cap=16 * PAGE)
    assert not reg.cover(a) and "AlreadyRegistered" in reg.refused
    assert not reg.cover(c)  # (refused once: never tried again)
    assert rt.registered == [(mem.ctypes.data, mem.ctypes.data + PAGE)]


@pytest.mark.parametrize("masked", [False, True])
def test_a_chunks_attention_in_query_tiles_is_the_whole_chunks(rt, monkeypatch, masked):
    """DeviceBackend.attention in tiles of queries (DEVICE_ATTN_TILE_BYTES: a long context's scores
    in bounded pieces) gives each query the whole chunk's output and ops.attention's within float32
    rounding, with a causal mask and without. Not bit for bit: a product of fewer rows sums in
    another order (numpy's BLAS: 3.6e-7 here; cuBLAS picks its kernel by shape too)."""
    import types

    from strata.engine import ops
    from strata.engine.tier import device

    rng = np.random.default_rng(3)
    T, H, Hkv, D, n = 37, 8, 2, 64, 101
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    K, V = (rng.standard_normal((Hkv, n, D)).astype(np.float32) for _ in range(2))
    vis = ops.causal_mask(n - T, T, n) if masked else None
    be = types.SimpleNamespace(xp=rt.xp, rt=rt, upload=rt.to_device)
    be.attention = lambda *a: device.DeviceBackend.attention(be, *a)
    dev = lambda a: None if a is None else rt.to_device(a)  # noqa: E731
    whole = rt.to_host(be.attention(dev(q), dev(K), dev(V), 0.125, dev(vis)))
    monkeypatch.setattr(device, "DEVICE_ATTN_TILE_BYTES", 4 * H * n * 5)  # tiles of 5 queries: 8 of them, the last of 2
    tiled = rt.to_host(be.attention(dev(q), dev(K), dev(V), 0.125, dev(vis)))
    assert np.allclose(tiled, whole, rtol=1e-5, atol=1e-6), np.abs(tiled - whole).max()
    assert not np.allclose(tiled[5:], whole[:-5], rtol=1e-5, atol=1e-6)  # (rows in their places)
    want = ops.attention(q, K, V, 0.125, vis)
    assert np.allclose(whole, want, rtol=1e-5, atol=1e-5), np.abs(whole - want).max()


def test_generate_takes_the_layer_streams_flags(model, rt, tmp_path, capsys, monkeypatch):
    """strata generate --stream-layer-tokens N|off and --pin-gguf/--no-pin-gguf reach the device
    step's layer stream (the startup lines say what it does), and the output is the same with each;
    a bad value is refused naming the flag."""
    from strata.engine.cli import main
    from strata.engine.kernels import gpu

    monkeypatch.setattr(gpu, "available", lambda: (True, "the test's runtime"))  # (the emulation has no CuPy device)
    ids = " ".join(map(str, np.random.default_rng(5).integers(3, model.geometry.n_vocab, 9).tolist()))
    common = ["generate", "--pack", str(model.pack.dir), "--prompt-ids", ids, "-n", "2", "--temp", "0", "--kv", "f32",
              "--device", "gpu", "--gpu-step", "device", "--expert-cache", "0", "--prefill", "4"]
    outs = {}
    for flags in (["--stream-layer-tokens", "1", "--stats"], ["--stream-layer-tokens", "2", "--no-pin-gguf", "--stats"],
                  ["--stream-layer-tokens", "off"]):
        dump = tmp_path / f"{len(outs)}.npy"
        rc = main(common + flags + ["--dump-logits", str(dump)])
        err = capsys.readouterr().err
        assert rc == 0, err
        outs[" ".join(flags)] = (np.load(dump), err)
    err = outs["--stream-layer-tokens 1 --stats"][1]
    assert "a chunk of 1 or more tokens streams each layer's non-resident experts whole" in err
    assert "GGUF pages are registered (page-locked)" in err, err
    # --stats: every byte streamed came from the registered pages; through the pieces, none did
    got = re.search(r"streamed (\d+) B \(([\d.]+) MiB\) to the device, ([\d.]+) MiB of it straight from registered", err)
    assert got and int(got[1]) > 0 and got[2] == got[3], err
    assert "a chunk of 1 or more tokens streams a layer's non-resident ones whole" in err
    err = outs["--stream-layer-tokens 2 --no-pin-gguf --stats"][1]
    assert "a chunk of 2 or more tokens streams" in err and "the layers stream through pinned pieces" in err, err
    assert re.search(r"MiB\) to the device, 0\.0 MiB of it straight from registered", err), err
    assert "streams each layer" not in outs["--stream-layer-tokens off"][1]
    logits = [o[0] for o in outs.values()]
    assert all(np.array_equal(x, logits[0]) for x in logits[1:])
    for bad in ("0", "many"):
        assert main(common + ["--stream-layer-tokens", bad]) in (1, 2)
        assert f"--stream-layer-tokens {bad!r}: expected auto, off or a number of tokens >= 1" in capsys.readouterr().err
