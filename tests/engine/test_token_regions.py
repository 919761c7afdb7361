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
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")
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


class _OneByOne(CpuBackend):
    """The backend with `linears` as one `linear` per weight: what the blocks computed before their
    products of one input shared a region."""

    def linears(self, ws, x, outs):
        return [self.linear(w, x, out) for w, out in zip(ws, outs)]


def _need_rowdot():
    if not rowdot.AVAILABLE:
        pytest.skip(f"rowdot.py needs AVX2 (or AVX512-VNNI) and F16C; this host's features: {sorted(cpu.simd._X86) or 'none'}")


def test_a_hyper_connection_s_down_and_inject_are_one_region():
    # both read the normed streams: one region for a token, where they took two (and up, which
    # needs down's result, its own)
    from strata.engine.hyper import HyperConnection

    _need_rowdot()
    hc, E, R = 4, 64, 32
    rng = np.random.default_rng(5)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    h = HyperConnection("blk.0.hc_attn", 1 + 0.1 * w(hc * E), w(R, hc * E), w(hc * E, R), w(hc, hc * E), hc=hc, n_embd=E,
                        lowrank=R, eps=1e-6)  # fmt: skip
    streams = w(1, hc * E)
    with cpu_path(parallel=True):
        want = [a.x if hasattr(a, "x") else a for a in h.mix(_OneByOne(), streams.copy())]
        got = []
        n = _regions(lambda: got.extend(h.mix(CpuBackend(), streams.copy())))
    assert n == 2, f"{n} parallel regions for a mix of one token, expected 2 (down + inject, then up)"
    for name, g, r in zip(("block input", "injection weights"), (got[0].x, got[1]), want):
        assert np.array_equal(g.view(np.uint32), r.view(np.uint32)), f"{name} differs from the products one by one"


@pytest.fixture(scope="module")
def tiny_qwen4exp(tmp_path_factory):
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack
    from strata.tools import pack
    from strata.tools.synth import PRESETS, synth

    tmp = tmp_path_factory.mktemp("regions")
    shards = synth("qwen4exp", "tiny", tmp / "tiny.gguf")
    pack.convert(shards[:1], tmp / "pack", ple_gguf=shards[-1], compress_ratio=PRESETS["tiny"].compress_ratio)
    return Model(Pack.open(tmp / "pack"))


def test_a_token_s_router_shares_the_shared_expert_s_region(tiny_qwen4exp):
    # the router and the shared expert's up, gate and gate logit read the same x: one region for
    # a token, where the router took one of its own; the layer's output is the same bits
    _need_rowdot()
    moe = tiny_qwen4exp.moes[0]
    assert moe.shared, "the tiny qwen4exp has no shared expert: nothing to test"
    x = np.random.default_rng(9).standard_normal((1, moe.E)).astype(np.float32)
    from strata.engine.moe import Groups

    with cpu_path(parallel=True):
        want = moe.forward(_OneByOne(), Input(x)).copy()
        grp = Groups(moe.route(CpuBackend(), Input(x))[0])
        routed = _regions(lambda: moe.products(Input(x), grp.experts, grp.rows, grp.starts))
        got = []
        n = _regions(lambda: got.append(moe.forward(CpuBackend(), Input(x)).copy()))
    # the routed experts' regions, then one for the router and the shared up/gate/gate logit and
    # one for the shared down (the gate logit alone, one output, runs serial either way)
    assert n == routed + 2, f"{n} parallel regions for one token's MoE, expected {routed} (routed experts) + 2"
    assert np.array_equal(got[0].view(np.uint32), want.view(np.uint32)), "the MoE output differs from the products one by one"


def test_every_dense_product_of_a_token_goes_through_its_call_site_s_plan(tiny_qwen4exp, monkeypatch):
    # A product called without an out buffer took the unplanned way (cpu.matvec / matvec_many,
    # every argument checked at every call): QSA's five products and its out projection and PLE's
    # key and value did, ~0.5 ms of the `tiny` token's 4.9 (2026-12-04). After the first tokens, a
    # token's dense products are all planned; only the routed experts' grouped calls stay as they are.
    _need_rowdot()
    m = tiny_qwen4exp
    assert m.ple and any(hasattr(mx, "qsa") for mx in m.mixers), "the tiny qwen4exp lost its PLE or QSA layers: nothing to test"
    s = m.new_session(16)
    for t in (1, 2, 3):
        m.step(s, t)
    calls = []
    for name in ("matvec", "matvec_many", "matmul"):
        f = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, _f=f, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])
    for t in (4, 5):
        m.step(s, t)
    assert calls == [], f"a token's dense products that skipped their plan: {calls}"


@pytest.mark.parametrize("block", list(BLOCKS) + ["one product (Q8_0)", "one product (Q5_0, wide)", "one product (Q6_K)"])
def test_a_call_site_s_kept_plan_gives_the_products_bits_at_every_token(block):
    # the token path's products of one row go through a plan made at the call site's first token
    # (cpu.TokenProducts: the matrices checked once): each out must be bit for bit what the
    # unplanned call gives (outs None), at the first token and the next ones, in one region, into
    # the outs given, whether the caller reuses its outs (the step's scratch) or makes new ones (the logits)
    _need_rowdot()
    n_in = 512
    specs = BLOCKS.get(block) or [{"one product (Q8_0)": ("blk.0.ffn_down_shexp.weight", "Q8_0", 40),
                                   "one product (Q5_0, wide)": ("blk.0.attn_qkv.weight", "Q5_0", 48),
                                   "one product (Q6_K)": ("output.weight", "Q6_K", 24)}[block]]
    ws = [_weight(name, t, n_in, n_out, seed) for seed, (name, t, n_out) in enumerate(specs)]
    be = CpuBackend()
    kept = [np.full((1, w.n_out), np.nan, np.float32) for w in ws]
    rng = np.random.default_rng(11)
    with cpu_path(parallel=True):
        for token in range(4):
            x = rng.standard_normal((1, n_in)).astype(np.float32)
            want = be.linears(ws, Input(x), [None] * len(ws)) if len(ws) > 1 else [be.linear(ws[0], Input(x))]
            outs = kept if token % 2 else [np.full((1, w.n_out), np.nan, np.float32) for w in ws]
            got = []
            run = (lambda: got.extend(be.linears(ws, Input(x), outs))) if len(ws) > 1 else (lambda: got.append(be.linear(ws[0], Input(x), outs[0])))
            n = _regions(run)
            assert len(be._plans) == 1 and None not in be._plans.values(), f"{block}: no plan was kept for the call site"
            assert n == 1, f"{block}, token {token}: {n} parallel regions, expected 1"
            for w, g, r, o in zip(ws, got, want, outs):
                assert g is o, f"{block}: {w.name}'s result is not in the out it was given"
                assert np.array_equal(g.view(np.uint32), r.view(np.uint32)), f"{block}, token {token}: {w.name} differs from the unplanned product"


def test_a_plan_checks_its_arguments_and_refuses_what_it_cannot_launch():
    _need_rowdot()
    from strata.engine.kernels.actq import quantize_act

    q8, bf = BY_NAME["Q8_0"], BY_NAME["BF16"]
    raw = random_weights(q8, 512 * 8, np.random.default_rng(1))
    raw_bf = random_weights(bf, 512 * 8, np.random.default_rng(2))
    plan = cpu.TokenProducts.make([(raw, q8.id, 512, 8)], ["q"])
    x = quantize_act(np.ones((1, 512), np.float32))
    with pytest.raises(TypeError, match=r"activations must be one ActQ \[512\]"):
        plan(quantize_act(np.ones((1, 256), np.float32)), None, None, [np.empty(8, np.float32)])
    with pytest.raises(ValueError, match=r"out must be contiguous f32 of 8 values"):
        plan(x, None, None, [np.empty(9, np.float32)])
    with pytest.raises(ValueError, match=r"out must be contiguous f32 of 8 values"):
        plan(x, None, None, [np.empty(16, np.float32)[::2]])
    # a float matrix alone takes matvec's float kernel, not a plan; inputs of two sizes are two calls
    assert cpu.TokenProducts.make([(raw_bf, bf.id, 512, 8)], ["f"]) is None
    assert cpu.TokenProducts.make([(raw, q8.id, 512, 8), (raw[:2176], q8.id, 256, 8)], ["q", "q"]) is None
    with pytest.raises(ValueError, match=r"TokenProducts\(Q8_0\): Q8_0 \[512 x 8\] is 4352 bytes, got 2176"):
        cpu.TokenProducts.make([(raw[:2176], q8.id, 512, 8)], ["q"])
