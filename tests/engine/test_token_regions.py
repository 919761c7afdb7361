"""The decode step's products of one input share one parallel region (backend `linears`).

At 8 threads each region's wake-up and barrier cost more than many of the token path's small
products (docs/performance.md, "Decode at 8 threads"): the number of regions per token is a cost
of its own, so it is pinned here per block kind, beside the bits (each product equal to its own
`linear`)."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_blocks import random_weights
from kernel_paths import cpu_path

from strata.engine.backend import CpuBackend
from strata.engine.kernels import cpu, rowdot
from strata.engine.weights import Input, Weight
from strata.index_format.ggml_types import BY_NAME


def _weight(name: str, type_name: str, n_in: int, n_out: int, seed: int) -> Weight:
    t = BY_NAME[type_name]
    return Weight(name, (n_in, n_out), t.id, random_weights(t, n_in * n_out, np.random.default_rng(seed)))


def _regions(fn) -> int:
    """Parallel regions fn() starts: the kernels' launches that cpu._launch sends to the pool."""
    launch, n = cpu._launch, [0]

    def counted(n_out, work):
        parallel, chunks = launch(n_out, work)
        n[0] += parallel
        return parallel, chunks

    cpu._launch = counted
    try:
        fn()
    finally:
        cpu._launch = launch
    return n[0]


# (block, its weights of one input: name, type, n_out): the released qwen4exp mix of tools/synth.py
BLOCKS = {
    "GDN qkv (wide) + gate + beta + alpha (BF16)": [("blk.0.attn_qkv.weight", "Q5_0", 96), ("blk.0.attn_gate.weight", "Q4_0", 64),
                                                    ("blk.0.ssm_beta.weight", "BF16", 8), ("blk.0.ssm_alpha.weight", "BF16", 8)],
    "QSA q/k/v (wide) + indexer q/k (BF16)": [("blk.3.attn_q.weight", "IQ4_NL", 96), ("blk.3.attn_k.weight", "Q8_0", 32),
                                              ("blk.3.attn_v.weight", "Q8_0", 32), ("blk.3.indexer.q_proj.weight", "BF16", 64),
                                              ("blk.3.indexer.k_proj.weight", "BF16", 16)],
    "shared expert up + gate (IQ4_XS)": [("blk.0.ffn_up_shexp.weight", "IQ4_XS", 40), ("blk.0.ffn_gate_shexp.weight", "IQ4_XS", 40)],
}


@pytest.mark.parametrize("block", list(BLOCKS))
def test_a_token_s_products_of_one_input_are_one_parallel_region(block):
    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX512-VNNI, AVX512BW and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
    n_in = 512
    ws = [_weight(name, t, n_in, n_out, seed) for seed, (name, t, n_out) in enumerate(BLOCKS[block])]
    x = np.random.default_rng(7).standard_normal((1, n_in)).astype(np.float32)
    be = CpuBackend()
    with cpu_path(parallel=True):
        want = [be.linear(w, Input(x)) for w in ws]
        got = []
        n = _regions(lambda: got.extend(be.linears(ws, Input(x), [None] * len(ws))))
    assert n == 1, f"{block}: {n} parallel regions for one token, expected 1"
    for w, g, r in zip(ws, got, want):
        assert np.array_equal(g.view(np.uint32), r.view(np.uint32)), f"{block}: {w.name} differs from its own linear"
