"""The device step's prompt chunk: its routed experts on the device (engine/tier/device.py
DeviceExperts.routed), grouped kernels in place of a launch per expert.

Each test runs on CUDA (marked gpu: scripts/gpu_suite.sh) and on the host emulation (tests/gpu_emu.py).
What must hold: every grouped product row is the batched kernel's (gpu.matmul's, the CPU's) on its
expert alone, bit for bit; the chunk's routed rows are the host-driven hit path's bit for bit
whether the experts are resident, missing or streamed, whatever the chunk size.
"""

from __future__ import annotations

import numpy as np
import pytest

import strata.engine.kernels.gpu as gpu

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.mark.parametrize("types", [("Q8_0", "Q8_0"), ("IQ2_XS", "Q4_K")])
def test_grouped_products_are_each_experts_matmul(rt, types):
    """mmx: the products of several experts on their own rows of a chunk in one launch (a group of
    more than MAX_TOKENS pairs spans tiles; rows gathered by xrow, scattered by orow), each row the
    bits of gpu.matmul on that expert's rows alone."""
    from kernel_blocks import random_weights
    from strata.index_format.ggml_types import ggml_type

    rng = np.random.default_rng(11)
    t = ggml_type(types[1])
    E, F, T = 256, 128, 9
    ws = [gpu.upload(random_weights(t, E * F, rng), t.id, E, F) for _ in range(3)]
    counts = [gpu.MAX_TOKENS + 3, 2, 5]  # the first group spans two tiles
    firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    n = sum(counts)
    tok = rng.integers(0, T, n).astype(np.int32)  # the pair's token (repeats: the same token twice)
    x = gpu.quantize_act_gpu(rt.to_device(rng.standard_normal((T, E)).astype(np.float32)))
    # gather: out row = pair
    tiles = gpu.tile_rows(ws, firsts, counts, [0, 0, 0])
    assert len(tiles) == 4
    out = rt.to_device(np.full((n, F), 5.0, np.float32))
    gpu.grouped_products(t.id, E, F, rt.to_device(tiles), len(tiles), x, rt.to_device(tok), None, out)
    got = rt.to_host(out)
    # scatter: pair p (input row p) into row perm[p] of a bigger output, the rest untouched
    perm = rng.permutation(n + 4)[:n].astype(np.int32)
    big = rt.to_device(np.full((n + 4, F), 5.0, np.float32))
    xs = gpu.quantize_act_gpu(rt.to_device(rng.standard_normal((n, E)).astype(np.float32)))
    gpu.grouped_products(t.id, E, F, rt.to_device(tiles), len(tiles), xs, None, rt.to_device(perm), big)
    got_big = rt.to_host(big)
    assert (np.delete(got_big, perm, axis=0) == 5.0).all()
    for w, a, c in zip(ws, firsts, counts):
        rows = tok[a : a + c]
        want = rt.to_host(gpu.matmul(w, gpu.GpuActQ(x.q[rows], x.d[rows], x.s16[rows], None)))
        assert np.array_equal(got[a : a + c].view(np.int32), want.view(np.int32))
        want_s = rt.to_host(gpu.matmul(w, gpu.GpuActQ(xs.q[a : a + c], xs.d[a : a + c], xs.s16[a : a + c], None)))
        assert np.array_equal(got_big[perm[a : a + c]].view(np.int32), want_s.view(np.int32))
