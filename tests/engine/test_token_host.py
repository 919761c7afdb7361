"""A token's host passes on the CPU (no products): the fused forms of the decode step's small steps,
bit for bit the backend hooks they replace.

A Gated DeltaNet token (model.GatedDeltaNet._token, kernels/delta.py's token passes) and a
hyper-connection's gates between its products (hyper.lowrank_gates) replace a run of backend hooks
on the CPU backend only (CpuBackend.owns); the hooks one by one are the reference: the prompt path
and the device step still take them. So each test runs the same inputs through a backend that owns
none of them (`_Hooks`) and through CpuBackend, and compares outputs and every state to the bit.
The inputs carry what a reordered or fused f32 step would show: saturating sigmoids and tanh,
zeros, subnormals and magnitudes over many decades.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine import hyper
from strata.engine.backend import CpuBackend
from strata.engine.batch import Seq
from strata.engine.weights import Input

F32 = np.float32


class _Hooks(CpuBackend):
    """The CPU backend taking every hook one by one (no fused host form): the reference."""

    def owns(self, *hooks: str) -> bool:
        return False


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def spread(rng, shape, scale=3.0) -> np.ndarray:
    """Normal values times `scale`, each element times 10^-3..10^1, and the edge values first."""
    x = (rng.standard_normal(shape) * scale * 10.0 ** rng.uniform(-3, 1, shape)).astype(F32)
    flat = x.reshape(-1)
    edge = [0.0, -0.0, 90.0, -90.0, 1e-40, -3e-39][: flat.size]
    flat[: len(edge)] = edge
    return x


def test_owns_is_false_for_a_backend_that_overrides_a_hook():
    class Other(CpuBackend):
        def sigmoid(self, x, *, exp_form=False):
            return super().sigmoid(x, exp_form=exp_form)

    assert CpuBackend().owns("sigmoid", "rmsnorm")
    assert not Other().owns("sigmoid") and Other().owns("rmsnorm")
    assert not _Hooks().owns("rmsnorm")


@pytest.mark.parametrize("inject", [True, False])
def test_lowrank_gates_are_the_reference(inject):
    rng = np.random.default_rng(3)
    R, hc = 320, 4
    d, inj = spread(rng, (1, R), 2.0), spread(rng, (1, hc), 2.0) if inject else None
    if inj is not None:  # (spread's first values, then an exp that overflows and a tiny one)
        inj[0, 2:] = [-200.0, 1e-38]
    want_a, want_w = hyper.lowrank_gates_reference(d, inj, hc)
    a, ex = np.empty((1, R), F32), np.empty((1, R), F32)
    w, exw = (np.empty((1, hc), F32), np.empty((1, hc), F32)) if inject else (None, None)
    hyper.lowrank_gates(d.copy(), None if inj is None else inj.copy(), F32(hc), a, w, ex, exw)
    assert same_bits(a, want_a)
    if inject:
        assert same_bits(w, want_w)


def test_the_norm_and_its_actq_at_the_production_width():
    # hyper.grouped_rmsnorm_q's sums and factor (np.add.reduce, then the mean's float64 division in
    # the kernel) against grouped_rmsnorm (np.mean), one token of 4 streams of 2560
    from strata.engine.kernels.actq import quantize_act

    rng = np.random.default_rng(11)
    x = spread(rng, (1, 4 * 2560))
    x[0, 2560:5120] *= F32(1e-3)  # a stream of another magnitude
    gain = rng.uniform(0.5, 1.5, 4 * 2560).astype(F32)
    out, act = hyper.grouped_rmsnorm_q(x, gain, 2560, 1e-6)
    assert same_bits(out, hyper.grouped_rmsnorm(x, gain, 2560, 1e-6))
    ref = quantize_act(out)
    assert all(np.array_equal(getattr(act, k), getattr(ref, k)) for k in ("q", "d", "s16"))


@pytest.fixture(scope="module", params=["qwen4exp", "qwen35moe"])
def tiny(request, tmp_path_factory):
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack
    from strata.tools import pack
    from strata.tools.synth import PRESETS, synth

    arch = request.param
    tmp = tmp_path_factory.mktemp(f"token-host-{arch}")
    shards = synth(arch, "tiny", tmp / "tiny.gguf")
    if arch == "qwen4exp":
        pack.convert(shards[:1], tmp / "pack", ple_gguf=shards[-1], compress_ratio=PRESETS["tiny"].compress_ratio)
    else:
        pack.convert(shards, tmp / "pack")
    return Model(Pack.open(tmp / "pack"))


def test_a_gdn_token_is_the_hooks_one_by_one(tiny):
    # one layer, 6 tokens, inputs from small to saturating: output, conv state and S every token
    l = next(i for i, m in enumerate(tiny.mixers) if hasattr(m, "_token"))
    m = tiny.mixers[l]
    rng = np.random.default_rng(5)
    states = {name: m.new_state(be, 16, "f32") for name, be in (("ref", _Hooks()), ("fused", CpuBackend()))}
    for name in states:  # a nonzero history
        states[name]["conv"][...] = spread(np.random.default_rng(1), states[name]["conv"].shape)
        states[name]["S"][...] = spread(np.random.default_rng(2), states[name]["S"].shape, 0.1)
    for t, scale in enumerate((1.0, 0.01, 30.0, 1.0, 300.0, 1e-4)):
        x = spread(rng, (1, m.E), scale)
        got = {}
        for name, be in (("ref", _Hooks()), ("fused", CpuBackend())):
            got[name] = m.forward(be, [Seq(states[name], 0, 1, t, None)], Input(x.copy())).copy()
        assert same_bits(got["fused"], got["ref"]), f"token {t}: the layer's output differs"
        for k in ("conv", "S"):
            assert same_bits(states["fused"][k], states["ref"][k]), f"token {t}: the {k} state differs"


def test_a_token_step_is_the_hooks_one_by_one(tiny):
    # the whole step (every GDN layer and, on qwen4exp, every mix) on two sessions: logits and
    # the recurrent states after every token
    sess = {}
    for name, be in (("ref", _Hooks()), ("fused", CpuBackend())):
        tiny.backend = be
        s = tiny.new_session(16)
        logits = [tiny.step(s, t).copy() for t in (5, 77, 3, 400, 9, 9, 120)]
        sess[name] = (s, logits)
    tiny.backend = CpuBackend()
    (a, la), (b, lb) = sess["fused"], sess["ref"]
    for i, (x, y) in enumerate(zip(la, lb)):
        assert same_bits(x, y), f"the logits of token {i} differ"
    for l, (sa, sb) in enumerate(zip(a.states, b.states)):
        if isinstance(sa, dict):
            for k in sa:
                assert same_bits(sa[k], sb[k]), f"layer {l}: the {k} state differs"
    assert same_bits(a.stream, b.stream)


def test_a_token_s_routed_experts_in_rank_order_are_products_over_its_groups(tiny):
    # MoE._token_products (one token's experts in rank order, the layer's kept buffers) against
    # MoE.products over the token's Groups (experts by id), every layer, several tokens; then a
    # whole MoE.forward of a token against the same sum made from Groups' order
    from strata.engine.moe import Groups

    rng = np.random.default_rng(11)
    for moe in tiny.moes:
        for _ in range(3):
            x = Input(spread(rng, (1, moe.E), 1.0))
            top = rng.choice(tiny.geometry.n_expert, moe.k, replace=False).astype(np.int64)[None]
            got = moe._token_products(x, top[0])
            assert got is not None
            grp = Groups(top)
            want = moe.products(x, grp.experts, grp.rows, grp.starts)
            for j in range(moe.k):  # rank j's row, and where Groups put it
                assert same_bits(got[j], want[grp.slot[0, j]]), f"layer {moe.layer}, rank {j}"
        x = Input(spread(rng, (1, moe.E), 1.0))
        be = CpuBackend()
        y = moe.forward(be, x).copy()
        top, weights = moe.route(be, x)
        grp = Groups(top)
        part = moe.products(x, grp.experts, grp.rows, grp.starts)
        ref = np.empty_like(y)
        be.combine(part, grp.slot, weights, ref)
        if moe.shared:
            s_gate, gate, up, _ = moe.shared
            sh = [be.linear(w, x) for w in (up, gate, s_gate)]
            be.shared_add_(ref, *moe._shared_out(be, sh))
        assert same_bits(y, ref), f"layer {moe.layer}: the token's MoE output differs"
