"""The gated delta rule's token step (Gated DeltaNet decode), eight value rows at a time.

Why: each value row j of a head's state needs two dot products over dk (kv = S_j . k, then
o = S_j . q), each a chain of dependent f32 adds in order (the specification: no reordering, so no
vectorized sum). One row at a time, every add waits for the one before it: ~4 cycles per element,
2 x 128 x 128 x 48 of them per layer, 1.3 ms per GDN layer per token at 1 thread. Eight rows at
once run eight independent chains side by side: the same adds in the same order per row, so the
same bits (ops._delta_rule, the one-row form, is the reference: tests/test_host_kernels.py),
while the element-wise passes (the decay, the rank-one update) stay vectorized along the row.

    S <- S * exp(g);  kv = S^T k;  S <- S + k (beta (v - kv))^T;  out = S^T q     (per v-head)

S f32 [nv, dv, dk] (each value row contiguous); q, k f32 [nk, dk] (key head h % nk); v, out f32
[nv, dv]; g (log decay), beta f32 [nv].
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from . import simd
from .jit import JIT, cached, cached_njit

F32 = np.float32
ROWS = 8  # independent add chains per pass: enough to cover the f32 add latency on 2 pipes


@njit(inline="always", **JIT)
def _dots8(Sh, j, x):
    """Rows j .. j + 7 of Sh [dv, dk] dotted with x [dk]: eight add chains side by side, each in order."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for i in range(Sh.shape[1]):
        xi = x[i]
        a0 += Sh[j, i] * xi
        a1 += Sh[j + 1, i] * xi
        a2 += Sh[j + 2, i] * xi
        a3 += Sh[j + 3, i] * xi
        a4 += Sh[j + 4, i] * xi
        a5 += Sh[j + 5, i] * xi
        a6 += Sh[j + 6, i] * xi
        a7 += Sh[j + 7, i] * xi
    return a0, a1, a2, a3, a4, a5, a6, a7


@njit(inline="always", **JIT)
def _rows8(Sh, j, qh, kh, vh, decay, bh, oh, dl):
    """Value rows j .. j + 7 of one head's state Sh [dv, dk] through one token: qh, kh [dk] its
    key head's query and key, vh, oh [dv] its values and output, dl [8] scratch."""
    dk = Sh.shape[1]
    for r in range(ROWS):
        for i in range(dk):
            Sh[j + r, i] = Sh[j + r, i] * decay
    kv = _dots8(Sh, j, kh)
    for r in range(ROWS):
        dl[r] = (vh[j + r] - kv[r]) * bh
    for r in range(ROWS):
        d = dl[r]
        for i in range(dk):
            Sh[j + r, i] = Sh[j + r, i] + kh[i] * d
    o = _dots8(Sh, j, qh)
    for r in range(ROWS):
        oh[j + r] = o[r]


@njit(inline="always", **JIT)
def _row1(Sh, j, qh, kh, vh, decay, bh, oh):
    """Value row j alone (the rows past the last group of eight): the same steps."""
    dk = Sh.shape[1]
    kv = np.float32(0.0)
    for i in range(dk):
        Sh[j, i] = Sh[j, i] * decay
        kv += Sh[j, i] * kh[i]
    d = (vh[j] - kv) * bh
    o = np.float32(0.0)
    for i in range(dk):
        Sh[j, i] = Sh[j, i] + kh[i] * d
        o += Sh[j, i] * qh[i]
    oh[j] = o


@njit(inline="always", **JIT)
def _head(h, a):
    S, q, k, v, g, beta, out = a
    dv = S.shape[1]
    kh = h % q.shape[0]
    decay = np.float32(math.exp(g[h]))
    dl = np.empty(ROWS, F32)
    j = 0
    while j + ROWS <= dv:
        _rows8(S[h], j, q[kh], k[kh], v[h], decay, beta[h], out[h], dl)
        j += ROWS
    while j < dv:
        _row1(S[h], j, q[kh], k[kh], v[h], decay, beta[h], out[h])
        j += 1


def _rule(S, q, k, v, g, beta, out):
    simd.run_queue(S.shape[0], S.shape[0], _head, (S, q, k, v, g, beta, out))  # the heads from the token kernels' queue


def _rule_rows(S, q, k, v, g, beta, out, keep, snaps):
    # T tokens of one sequence, each as `_rule`'s token step (speculative decoding's verify rows,
    # which must have the token step's bits: the chunked form rounds otherwise), and the state
    # after token t copied into snaps[keep[t]] where keep[t] >= 0. Each value row's recurrence
    # needs only its own row, so a group of eight rows goes through all T tokens while it is in
    # L1: one pass over S where T steps and their snapshots' copies made 2T - 1 (one seed-4l layer
    # of 3 rows, 2 threads: 1.27-1.34 ms as steps and copies, 0.75-0.81 ms here).
    # q, k f32 [T, nk, dk]; v, out f32 [T, nv, dv]; g, beta f32 [T, nv]; keep i64 [T]
    nv, dv, dk = S.shape
    T, nk = q.shape[0], q.shape[1]
    for h in prange(nv):
        kh = h % nk
        decay = np.empty(T, F32)
        for t in range(T):
            decay[t] = np.float32(math.exp(g[t, h]))
        dl = np.empty(ROWS, F32)
        j = 0
        while j < dv:
            n = ROWS if j + ROWS <= dv else 1  # the rows past the last group of eight: one at a time
            for t in range(T):
                if n == ROWS:
                    _rows8(S[h], j, q[t, kh], k[t, kh], v[t, h], decay[t], beta[t, h], out[t, h], dl)
                else:
                    _row1(S[h], j, q[t, kh], k[t, kh], v[t, h], decay[t], beta[t, h], out[t, h])
                if keep[t] >= 0:
                    dst = snaps[keep[t]]
                    for r in range(j, j + n):
                        for i in range(dk):
                            dst[h, r, i] = S[h, r, i]
            j += n


rule_rows_serial = cached(njit(**JIT)(_rule_rows), "delta-rule-rows-serial")
rule_rows_parallel = cached(njit(parallel=True, **JIT)(_rule_rows), "delta-rule-rows-parallel")


# two dispatchers of one function, each with its own disk-cache entry (see ops.py's delta rule)
delta_rule_serial = cached(njit(**JIT)(_rule), "delta-rule8-serial")
delta_rule_parallel = cached(njit(parallel=True, **JIT)(_rule), "delta-rule8-parallel")


# --- a Gated DeltaNet token's host passes around the rule ---------------------------------------------
#
# One token of one sequence (engine/model.py GatedDeltaNet.forward, T = 1) made the conv, the gates,
# the q/k l2-norms and the gated output norm through ~50 numpy calls and temporaries per layer, in the
# order of ops.py's functions (gdn_gates, conv_many, qk_l2norm_, gated_rmsnorm_: the reference,
# which the prompt and the device keep). These passes make the same values in the step's buffers:
# every f32 step the same operation in the same order (no FMA: fastmath off), and the steps whose
# bits are numpy's own stay numpy calls on arrays of the reference's shapes, between the passes:
# tanh and logaddexp (numpy's SIMD functions are not libm's, which a Numba loop calls) and the
# float64 sums of squares (einsum's summation order). tests/engine/test_host_kernels.py compares
# the token's outputs and states with the reference's bit for bit.


@cached_njit("gdn-token-prep")
def token_prep(state, w, x, c, th, beta, bt, alpha, dt_bias, ad, z, zt):
    # the conv taps of ops._conv_taps for T = 1 (tap j < K - 1 reads state row j, the last tap x),
    # the state advanced by x (conv_many's shift), and what numpy's steps read: c / 2 and beta / 2
    # (tanh's inputs: sigmoid's and gate_'s), alpha + dt_bias (softplus's), z / 2 (the output gate's)
    # Tap by tap over the channels, each sum kept in c: the same f32 products and adds in the same
    # order as a channel's loop over its taps, but the inner loop runs over the channels, which
    # vectorizes (the taps' loop inside took ~70 us of a seed-4l layer's token, serial, on the H200's
    # host: the run-time K kept it scalar)
    K, C = w.shape
    for i in range(C):
        c[i] = w[0, i] * state[0, i]
    for j in range(1, K - 1):
        for i in range(C):
            c[i] += w[j, i] * state[j, i]
    for i in range(C):
        c[i] += w[K - 1, i] * x[i]
        th[i] = c[i] * F32(0.5)
    for j in range(K - 2):
        for i in range(C):
            state[j, i] = state[j + 1, i]
    for i in range(C):
        state[K - 2, i] = x[i]
    for h in range(beta.size):
        bt[h] = beta[h] * F32(0.5)
        ad[h] = alpha[h] + dt_bias[h]
    for i in range(z.size):
        zt[i] = z[i] * F32(0.5)


@cached_njit("gdn-token-gates")
def token_gates(c, th, bt, a, ad, beta, decay):
    # silu(c) = c sigmoid(c) from th = tanh(c / 2) (gate_'s steps); beta = sigmoid(beta) from
    # bt = tanh(beta / 2) (sigmoid's); decay = a softplus(alpha + dt_bias) from ad = that softplus
    for i in range(c.size):
        c[i] = c[i] * ((th[i] + F32(1)) * F32(0.5))
    for h in range(bt.size):
        beta[h] = (bt[h] + F32(1)) * F32(0.5)
        decay[h] = a[h] * ad[h]


@cached_njit("gdn-token-qk")
def token_qk(c, ssq, ssk, nk, dk, scale):
    # l2norm_ of each key head's query and key from their float64 sums of squares, the queries then
    # scaled: q = (q r) scale, k = k r, r = f32(1 / sqrt(ss + 1e-6)) in float64 (ops.l2norm_'s steps)
    for h in range(nk):
        rq = F32(1.0 / np.sqrt(ssq[h] + 1e-6))
        rk = F32(1.0 / np.sqrt(ssk[h] + 1e-6))
        for i in range(dk):
            c[h * dk + i] = (c[h * dk + i] * rq) * scale
            c[(nk + h) * dk + i] = c[(nk + h) * dk + i] * rk


@cached_njit("gdn-token-out")
def token_out(o, ms, gain, eps, z, zt, silu):
    # gated_rmsnorm_ of each value head's output row from its float64 sum of squares: r = f32(1 /
    # sqrt(ms / dv + eps)) in float64, o = (o r) gain, then the gate: s = (tanh(z / 2) + 1) / 2,
    # times z for SiLU, o = o s (rmsnorm's and gate_'s steps)
    nv, dv = o.shape
    for h in range(nv):
        r = F32(1.0 / np.sqrt(ms[h] / np.float64(dv) + eps))
        for j in range(dv):
            s = (zt[h, j] + F32(1)) * F32(0.5)
            if silu:
                s = z[h, j] * s
            o[h, j] = ((o[h, j] * r) * gain[j]) * s


# --- the chunked rule's forward substitution (the prompt path) ------------------------------------------
#
# Why a kernel: ops.chunk_delta_rule solves (I + L) X = B per sub-chunk, row by row. As numpy that was
# two small calls per row (a [1, i] x [i, dv + dk] product, a subtract) for every range of heads, each
# holding the GIL for its few microseconds of dispatch: the heads' Python threads queued on it, and on
# the H200's host (16 cores) a 512-token seed-4l prompt's delta rule took 581 / 294 / 229 / 388 ms at
# 1 / 2 / 4 / 8 jobs (2026-12-04). Here a range of heads is one call that releases the GIL for all of
# its rows. The sum is written out in one order, j ascending (numpy's BLAS chose its own order per
# CPU, so the old bits were the machine's, not the code's):
#     X[i] <- X[i] - (L[i, 0] X[0] + L[i, 1] X[1] + ... + L[i, i-1] X[i-1])


@cached_njit("delta-substitute")
def substitute(L, X, r):
    """X [h, n, w] in place: X[i] -= sum_{j < i} L[i, j] X[j] for i = 1 .. n-1 in turn, per head; reads
    only L's [h, n, n] strictly lower part; r f32 [w], the running sum."""
    nh, n, w = X.shape
    for h in range(nh):
        for i in range(1, n):
            a = L[h, i, 0]
            for c in range(w):
                r[c] = a * X[h, 0, c]
            for j in range(1, i):
                a = L[h, i, j]
                for c in range(w):
                    r[c] += a * X[h, j, c]
            for c in range(w):
                X[h, i, c] -= r[c]
