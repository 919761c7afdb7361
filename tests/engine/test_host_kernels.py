"""The prompt path's host work outside the matrix kernels: each Numba kernel against the numpy
reference beside it, bit for bit (the f32 steps are the same operations in the same order, so any
difference is a bug: an FMA, a reordered sum, a wrong index), and the host threads
(ops.in_threads: the delta rule's heads, attention's tiles) changing no bit for any thread count.

The inputs carry the values where a reordering or a fused step would show: signed zeros, values
that saturate the sigmoids, subnormals, and wide magnitudes.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from strata.engine import hyper, moe, ops, ple
from strata.engine.kernels import cpu
from strata.engine.kernels.actq import quantize_act

F32 = np.float32


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal to the bit: -0.0 against 0.0, or a NaN, counts as a difference."""
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def values(rng, shape, scale=3.0) -> np.ndarray:
    x = (rng.standard_normal(shape) * scale * rng.uniform(0.01, 10, shape[:1] + (1,) * (len(shape) - 1))).astype(F32)
    flat = x.reshape(-1)
    flat[:6] = [0.0, -0.0, 90.0, -90.0, 1e-40, -3e-39]  # zeros, saturating sigmoids, subnormals
    return x


@pytest.fixture
def rng():
    return np.random.default_rng(7)


@pytest.fixture
def threads():
    before = cpu.threads_cap()
    yield cpu.set_threads
    cpu.set_threads(before)


def test_moe_combine_is_steps_rank_by_rank_sum(rng):
    T, k, E = 37, 10, 96
    part = values(rng, (T * k, E))
    order = rng.permutation(T * k)
    slot = np.empty(T * k, np.int64)
    slot[order] = np.arange(T * k)
    w = rng.random((T, k))
    w /= w.sum(axis=1, keepdims=True)
    out = np.empty((T, E), F32)
    moe._combine(part, slot.reshape(T, k), w, out)
    assert same_bits(out, moe.combine_reference(part, slot.reshape(T, k), w))


def test_hyper_inject_and_mix_tail(rng):
    T, hc, E = 9, 4, 64
    S, y, w = values(rng, (T, hc * E)), values(rng, (T, E)), (2 * rng.random((T, hc))).astype(F32)
    got, want = S.copy(), S.copy()
    hyper._inject(got, y, w)
    hyper.inject_reference(want, y, w)
    assert same_bits(got, want)
    u, sn = values(rng, (T, hc * E), 10.0), values(rng, (T, hc * E))
    x = np.empty((T, E), F32)
    with np.errstate(over="ignore"):  # exp(90): the saturated sigmoid, inf in both forms
        hyper._mix_tail(np.exp(-u), sn, x)
        assert same_bits(x, hyper.mix_tail_reference(u, sn, hc))


def test_grouped_rmsnorm_q_is_the_norm_then_actq(rng):
    x, gain = values(rng, (11, 4 * 96)), rng.uniform(0.5, 1.5, 4 * 96).astype(F32)
    out, act = hyper.grouped_rmsnorm_q(x, gain, 96, 1e-6)
    want = hyper.grouped_rmsnorm(x, gain, 96, 1e-6)
    assert same_bits(out, want)
    ref = quantize_act(want)
    for k in ("q", "d", "s16"):
        assert np.array_equal(getattr(act, k), getattr(ref, k)), k
    x[5, 7] = np.inf  # a non-finite row is refused, as quantize_act refuses it
    with pytest.raises(ValueError, match=r"non-finite activation .* index \(5, "):
        hyper.grouped_rmsnorm_q(x, gain, 96, 1e-6)


@pytest.mark.parametrize("silu", [False, True])
def test_gate_is_the_sigmoid_steps(rng, silu):
    x, z = values(rng, (13, 70)), values(rng, (13, 70), 20.0)
    got = ops.gate_(x.copy(), z, silu)
    assert same_bits(got, ops.gate_reference(x.copy(), z, silu))
    y = z.copy()
    assert same_bits(ops.silu_(y), ops.gate_reference(z.copy(), z))
    with pytest.raises(ValueError, match="contiguous"):
        ops.gate_(x.T, z.T)


def test_the_portable_exp_is_within_two_ulp_of_float64(rng):
    # the experts' SiLU uses it on the CPU and on the device (ops.silu_mul_ says why): its error is
    # the degree-7 polynomial's plus the roundings, measured against float64 over the whole range
    x = np.concatenate([rng.uniform(-87, 87, 200_000), [0.0, -0.0, 87.0, -87.0, 1e-30, -1e-30, 0.3466, -0.3466]]).astype(np.float32)
    got = ops.exp_p_reference(x).astype(np.float64)
    rel = np.abs(got / np.exp(x.astype(np.float64)) - 1)
    assert rel.max() < 2 * 2.0**-23, f"worst {rel.max():.3e} at x = {x[rel.argmax()]}"
    assert np.isfinite(ops.exp_p_reference(np.array([1e30, -1e30, 500.0], np.float32))).all()  # clamped, never inf or 0


def test_silu_mul_is_its_reference_bit_for_bit_and_silu_within_rounding(rng):
    up = values(rng, (10, 640))
    gate = values(rng, (10, 640), 30.0)
    gate[0, :4] = [0.0, -100.0, 100.0, -0.0]
    got = ops.silu_mul_(up.copy(), gate)
    assert same_bits(got, ops.silu_mul_reference(up, gate))
    g = gate.astype(np.float64)
    want = up * (g / (1 + np.exp(-g)))
    assert np.allclose(got, want, rtol=1e-6, atol=1e-30)
    with pytest.raises(ValueError, match="contiguous f32 of one shape"):
        ops.silu_mul_(up.T, gate.T)


@pytest.mark.parametrize("T", [1, 2, 3, 8])
def test_conv_many_is_the_taps_then_silu(rng, T):
    K, C = 4, 48
    w, state, x = values(rng, (K, C)), values(rng, (K - 1, C)), values(rng, (T, C))
    want = ops.conv_taps_reference(state, w, x)
    hist = np.concatenate([state, x])
    st = state.copy()
    got = ops.conv_many(st, w, x)
    assert same_bits(got, ops.gate_reference(want.copy(), want))
    assert same_bits(st, hist[T:])  # the last K-1 inputs, oldest first


@pytest.mark.parametrize("t0, T", [(0, 1), (0, 20), (5, 3), (31, 1), (31, 40)])
def test_ple_conv_and_output(rng, t0, T):
    Pk, dil, HE = 4, 3, 40
    L = (Pk - 1) * dil
    ring, X, w = values(rng, (L, HE)), values(rng, (T, HE)), values(rng, (HE, Pk))
    y = np.empty_like(X)
    ple._conv_taps(ring, t0, X, np.ascontiguousarray(w.T), dil, y)
    assert same_bits(y, ple.conv_reference(ring, t0, X, w, dil))
    S, G = values(rng, (T, HE)), values(rng, (T, HE))
    got, want = S.copy(), S.copy()
    with np.errstate(over="ignore"):  # exp(90): the saturated sigmoid, inf in both forms
        ple._add_output(got, G, y, np.exp(np.negative(y)))
        ple.output_reference(want, G, y)
    assert same_bits(got, want)


def test_delta_rule_and_attention_give_the_same_bits_on_any_thread_count(rng, threads, monkeypatch):
    T, nk, nv, dk, dv = 100, 2, 6, 16, 8  # T > GDN_CHUNK: two sub-chunks, the second partial
    q = rng.standard_normal((T, nk, dk)).astype(F32)
    k = rng.standard_normal((T, nk, dk)).astype(F32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, S0 = values(rng, (T, nv, dv)), values(rng, (nv, dv, dk), 0.1)
    g, beta = -rng.random((T, nv)).astype(F32), rng.random((T, nv)).astype(F32)
    Tq, H, Hkv, D, n = 20, 6, 2, 16, 50
    qa, K, V = values(rng, (Tq, H, D)), values(rng, (Hkv, n, D)), values(rng, (Hkv, n, D))
    visible = ops.causal_mask(n - Tq, Tq, n)
    runs = []
    # 2 threads: the most a 2-core CI gives (NUMBA_NUM_THREADS); the tiles outnumber the threads.
    # (2, 1): two threads with the delta rule's jobs capped at one (ops.DELTA_JOBS)
    for t, jobs in ((1, 4), (2, 4), (2, 1)):
        threads(t)
        monkeypatch.setattr(ops, "DELTA_JOBS", jobs)
        S = S0.copy()
        o = ops.chunk_delta_rule(S, q, k, v, g, beta)
        runs.append((o, S, ops.attention(qa, K, V, D**-0.5, visible, 2 * 3 * n * 4)))  # tiles of 2 queries
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert same_bits(a, b)
    # and the chunked rule is still the token-by-token recurrence
    S = S0.copy()
    step = np.empty((T, nv, dv), F32)
    for t in range(T):
        ops.delta_rule_step(S, q[t], k[t], v[t], g[t], beta[t], step[t])
    assert np.abs(step - runs[0][0]).max() < 1e-4 * np.abs(step).max()
    assert np.abs(S - runs[0][1]).max() < 1e-4 * np.abs(S).max()


@pytest.mark.parametrize("n", [64, 37, 1], ids=["whole-chunk", "partial-chunk", "one-row"])
def test_chunk_substitution_sums_in_its_stated_order_and_solves_the_system(rng, n):
    # kernels/delta.substitute: X[i] -= (L[i,0] X[0] + ... + L[i,i-1] X[i-1]), i ascending, per head.
    # Against that order written as numpy f32 steps (a mul, then an add: no FMA), to the bit, on a
    # strided view of a larger buffer as chunk_delta_rule passes it; and against float64's solve of
    # (I + strictly_lower(L)) X = B, so the stated order is also the right system.
    from strata.engine.kernels import delta

    h, w = 3, 24
    L = (rng.standard_normal((h, n, n)) * 0.05).astype(F32)  # the upper part and diagonal hold noise the kernel must not read
    buf = values(rng, (h, 64, w))
    B = buf[:, :n].copy()
    delta.substitute(L, buf[:, :n], np.empty(w, F32))
    want = B.copy()
    for i in range(1, n):
        r = L[:, i, 0, None] * want[:, 0]
        for j in range(1, i):
            r = r + L[:, i, j, None] * want[:, j]
        want[:, i] = want[:, i] - r
    assert same_bits(buf[:, :n], want)
    M = np.tril(L.astype(np.float64), -1) + np.eye(n)
    exact = np.linalg.solve(M, B.astype(np.float64))
    assert np.abs(buf[:, :n] - exact).max() < 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("dv", [16, 13], ids=["groups-of-8", "with-a-tail"])
def test_token_delta_rule_eight_rows_at_a_time_is_the_one_row_form(rng, dv):
    # kernels/delta.py runs eight value rows' add chains side by side; ops._delta_rule, one row
    # at a time, is the reference: the state and the output to the bit, serial and threaded
    from strata.engine.kernels import delta

    nk, nv, dk = 2, 6, 40
    q, k = rng.standard_normal((nk, dk)).astype(F32), rng.standard_normal((nk, dk)).astype(F32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, S0 = values(rng, (nv, dv)), values(rng, (nv, dv, dk), 0.1)
    g, beta = -rng.random(nv).astype(F32) * 3, rng.random(nv).astype(F32)
    for step in range(3):  # a few tokens on the same state: the state carries every step's bits
        want_S, want_o = S0.copy(), np.empty((nv, dv), F32)
        ops._delta_rule_serial(want_S, q, k, v, g, beta, want_o)
        for kernel in (delta.delta_rule_serial, delta.delta_rule_parallel):
            S, o = S0.copy(), np.empty((nv, dv), F32)
            kernel(S, q, k, v, g, beta, o)
            assert same_bits(S, want_S) and same_bits(o, want_o), (kernel, step)
        S0, v = want_S, v[::-1].copy()


@pytest.mark.parametrize("dv", [16, 13], ids=["groups-of-8", "with-a-tail"])
@pytest.mark.parametrize("kept", [(0, 1, None), (None, 0, None), (None, None, None, None), (0, 1, 2, None)],
                         ids=["verify-1+2", "one-kept", "none-kept", "verify-1+3"])
def test_a_verifys_rows_through_the_delta_rule_are_token_steps_and_their_snapshots(rng, dv, kept):
    # ops.delta_rule_rows (speculative decoding's verify rows, one pass over the state): the state,
    # each row's output and the state after each kept row are the token step's, to the bit, on the
    # serial and the threaded kernel
    from strata.engine.kernels import delta

    nk, nv, dk, T = 2, 6, 40, len(kept)
    q, k = rng.standard_normal((T, nk, dk)).astype(F32), rng.standard_normal((T, nk, dk)).astype(F32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v, S0 = values(rng, (T, nv, dv)), values(rng, (nv, dv, dk), 0.1)
    g, beta = -rng.random((T, nv)).astype(F32) * 3, rng.random((T, nv)).astype(F32)
    want_S, want_o, want_snaps = S0.copy(), np.empty((T, nv, dv), F32), {}
    for t in range(T):
        ops.delta_rule_step(want_S, q[t], k[t], v[t], g[t], beta[t], want_o[t])
        if kept[t] is not None:
            want_snaps[kept[t]] = want_S.copy()
    for parallel_min in (1 << 30, 1):  # the serial kernel, then the threaded one
        ops_min, ops.PARALLEL_MIN_STATE = ops.PARALLEL_MIN_STATE, parallel_min
        try:
            S, o = S0.copy(), np.empty((T, nv, dv), F32)
            snaps = {i: np.full_like(S0, np.nan) for i in want_snaps}
            ops.delta_rule_rows(S, q, k, v, g, beta, o, [None if i is None else snaps[i] for i in kept])
        finally:
            ops.PARALLEL_MIN_STATE = ops_min
        assert same_bits(S, want_S) and same_bits(o, want_o), parallel_min
        assert all(same_bits(snaps[i], want_snaps[i]) for i in want_snaps), parallel_min
    assert delta.rule_rows_serial.signatures and delta.rule_rows_parallel.signatures  # both ran


def test_attention_tiles_read_their_own_key_range_and_match_float64(rng, threads):
    # Each tile of queries reads keys from its first visible one to its last (ops.attention):
    # rows whose keys start late, end early, or are a single key, tiles of 1, 3 and all 13 queries
    Tq, H, Hkv, D, n = 13, 6, 2, 16, 40
    q, K, V = (rng.standard_normal(s).astype(F32) for s in ((Tq, H, D), (Hkv, n, D), (Hkv, n, D)))
    visible = rng.random((Tq, n)) < 0.4
    visible[0] = False
    visible[0, 17] = True  # one key, mid-range
    visible[1, :30] = False  # starts late
    visible[1, 35] = True
    visible[2, 8:] = False  # ends early
    visible[2, 3] = True
    visible[3] = False
    visible[3, n - 1] = True  # only the last key
    G, scale = H // Hkv, D**-0.5
    want = np.empty((Tq, H, D))
    for t in range(Tq):
        keys = np.flatnonzero(visible[t])
        for h in range(H):
            s = K[h // G, keys].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            want[t, h] = p @ V[h // G, keys].astype(np.float64) / p.sum()
    threads(2)
    for per_tile in (1, 3, Tq):
        got = ops.attention(q, K, V, scale, visible, per_tile * G * n * 4)
        assert np.abs(got - want).max() < 1e-5 * np.abs(want).max(), per_tile


_CHURN = """
import resource, sys
import numpy as np
from strata.engine import ops
done = ops.reuse_freed_memory() if sys.argv[1] == "reuse" else None
def churn():
    for mib in (3, 20, 9, 30):  # a chunk's temporaries coming and going (all below 32 MiB)
        a = np.ones(mib << 18, np.float32)
        del a
churn()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    churn()
print(done, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage's fault counts: Linux only")
def test_freed_memory_is_reused_not_faulted_in_again():
    def faults(mode):
        run = subprocess.run([sys.executable, "-c", _CHURN, mode], capture_output=True, text=True, check=True)
        done, n = run.stdout.split()
        return done, int(n)

    done, kept = faults("reuse")
    assert done == "True" and kept <= 64, (done, kept)  # the temporaries come back from the heap
    _, default = faults("default")
    assert default > 4 * max(kept, 64), default  # and glibc's default did fault them in again


def test_in_threads_runs_every_job_once_and_raises_a_jobs_error(threads):
    threads(2)
    seen = []
    ops.in_threads(lambda i: seen.append(i), [(i,) for i in range(7)])
    assert sorted(seen) == list(range(7))

    def fail(i):
        if i == 3:
            raise RuntimeError("job 3 failed")

    with pytest.raises(RuntimeError, match="job 3 failed"):
        ops.in_threads(fail, [(i,) for i in range(6)])


def test_row_kernels_give_the_same_bits_with_their_rows_across_threads(rng, threads):
    """jit.RowKernel: a prompt chunk's rows (PARALLEL_ROWS or more) go across the threads, a token's
    stay serial; each row is the same arithmetic, so both variants give the same bits, and a
    non-finite activation is reported at its first row whichever variant ran (several rows bad)."""
    from strata.engine import ops
    from strata.engine.kernels import actq
    from strata.engine.kernels.jit import PARALLEL_ROWS

    threads(2)
    T, hc, E, k = 3 * PARALLEL_ROWS + 5, 4, 64, 6
    assert T >= PARALLEL_ROWS
    x, gain = values(rng, (T, 4 * 96)), rng.uniform(0.5, 1.5, 4 * 96).astype(F32)
    part, slot, w = values(rng, (T * k, E)), rng.permutation(T * k).reshape(T, k), rng.random((T, k))
    S, y, wi = values(rng, (T, hc * E)), values(rng, (T, E)), (2 * rng.random((T, hc))).astype(F32)
    with np.errstate(over="ignore"):  # (values() holds -90: exp(90) saturates to inf, as mix_tail meets it)
        ex = np.exp(-values(rng, (T, hc * E), 1.0))
    sn = values(rng, (T, hc * E))
    state, cw, cx = values(rng, (3, 96)), values(rng, (4, 96)), values(rng, (T, 96))

    cases = {
        "quantize_rows": (actq._quantize_rows, lambda: (x, np.empty(x.shape, np.int8), np.empty((T, 12), F32),
                                                        np.empty((T, 24), np.int32), actq.QA)),
        "combine": (moe._combine, lambda: (part, slot, w, np.empty((T, E), F32))),
        "inject": (hyper._inject, lambda: (S.copy(), y, wi)),
        "mix_tail": (hyper._mix_tail, lambda: (ex, sn, np.empty((T, E), F32))),
        "conv_taps": (ops._conv_taps, lambda: (state, cw, cx, np.empty((T, 96), F32))),
    }
    for name, (kernel, make) in cases.items():
        got = []
        for variant in (kernel.parallel, kernel.serial):
            args = make()
            rc = variant(*args)
            got.append((rc, [a.copy() for a in args if isinstance(a, np.ndarray)]))
        (rc_p, par), (rc_s, ser) = got
        assert rc_p == rc_s and all(same_bits(a, b) for a, b in zip(par, ser)), name
    out, act = hyper.grouped_rmsnorm_q(x, gain, 96, 1e-6)  # (T rows: the parallel variant, by the call's rule)
    assert same_bits(out, hyper.grouped_rmsnorm(x, gain, 96, 1e-6))
    assert same_bits(act.q, actq.quantize_act(out).q)
    bad = x.copy()
    bad[30, 7], bad[20, 100], bad[45, 0] = np.inf, np.nan, -np.inf  # rows 20, 30, 45: row 20 is named
    with pytest.raises(actq.NonFiniteActivation, match=r"index \(20, 100\)"):
        actq.quantize_act(bad)
    with pytest.raises(actq.NonFiniteActivation, match=r"index \(20, 96\)"):  # (the nan's group of 96 is all nan)
        hyper.grouped_rmsnorm_q(bad, gain, 96, 1e-6)
