"""The small operations of one token's forward pass, in float32, following transformers 5.23.0's
modeling_qwen3_5_moe.py (the ground truth for every number; BRIEF section 2).

Legend: E = n_embd, D = attention head dim, n_rot = rotary dims per head, nk / nv = GDN key / value
heads, dk / dv = their dims, K = conv kernel, C = conv channels = 2 nk dk + nv dv.

The GGUF has already folded what it can: zero-centred RMSNorm gains are stored as (1 + w), so
`rmsnorm` multiplies by the stored gain; ssm_a is -exp(A_log); conv weights are squeezed; the GDN
value heads are TILED (GGUF v-head p is served by key head p % nk; docs/gguf-layout.md section 4),
and this module computes in that order, so ssm_out's tiled input columns match without reordering.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from numba import njit, prange

from .kernels import cpu, delta
from .kernels.jit import JIT, cached, cached_njit, cached_row_kernel

F32 = np.float32
L2NORM_EPS = 1e-6  # transformers' l2norm default, NOT rms_norm_eps


# --- host threads ---------------------------------------------------------------------------------


_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def in_threads(fn, jobs: list[tuple]) -> None:
    """fn(*job) for every job, on cpu.get_threads() threads (the caller's among them), jobs taken in
    turn as threads free up; returns when all are done, raising the first job's error.

    For the prompt path's numpy work between kernel calls (the delta rule, attention): BLAS on one
    thread and the large ufuncs release the GIL, so jobs on disjoint data run side by side on the
    cores the kernels use. Python threads wait on a lock when idle, not spinning as OpenBLAS's do
    (single_blas_thread). A job must not depend on which thread runs it: its results are then the
    same bits for any thread count.

    Only for jobs of many milliseconds: Numba's OpenMP workers spin for ~6-10 ms after each parallel
    kernel (libgomp's default), and a helper thread started in that time shares its core with one.
    Splitting the ~1 ms row-wise steps (norms, sigmoids, ActQ) this way made a chunk 10-20 ms slower."""
    global _pool, _pool_size
    n = min(cpu.get_threads(), len(jobs))
    if n <= 1:
        for job in jobs:
            fn(*job)
        return
    if _pool_size < n - 1:
        if _pool is not None:
            _pool.shutdown(wait=False)
        _pool, _pool_size = ThreadPoolExecutor(n - 1, thread_name_prefix="strata-host"), n - 1
    todo = iter(jobs)
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                job = next(todo, None)
            if job is None:
                return
            fn(*job)

    helpers = [_pool.submit(drain) for _ in range(n - 1)]
    try:
        drain()
    finally:
        errors = [f.exception() for f in helpers]  # waits: no job may still write after we return
    for e in errors:
        if e is not None:
            raise e


# --- elementwise ------------------------------------------------------------------------------------


def rmsnorm(x: np.ndarray, gain: np.ndarray, eps: float, out: np.ndarray | None = None, *, group: int | None = None,
            f32_sums: bool = False) -> np.ndarray:
    """out = x / sqrt(mean(x^2) + eps) * gain over every `group`-long slice of the last axis (the whole
    axis by default); gain as stored (the folded 1 + w), of the last axis' length or of `group`.

    Two precisions, on purpose. The default sums the squares in float64 (the closest f32 result to
    transformers in float64, our ground truth). `f32_sums` takes numpy's f32 mean, as transformers
    computes it in float32: the qwen4exp components (hyper-connections, PLE, QSA's norms) were
    matched to that rounding step for step, because QSA's block selection is discrete and a
    different rounding of the indexer's norms can flip a near-tie (tests/engine/test_qwen4exp_components.py)."""
    n = x.shape[-1]
    group = n if group is None else group
    g = x.reshape(*x.shape[:-1], n // group, group)
    if f32_sums:
        sq = np.square(g)  # the squares, then (g r) gain: one buffer for every step
        r = 1.0 / np.sqrt(np.mean(sq, axis=-1, keepdims=True, dtype=F32) + F32(eps))
        out = sq if out is None else out.reshape(g.shape)
        np.multiply(g, r, out=out)
    else:
        ms = np.einsum("...i,...i->...", g, g, dtype=np.float64) / group
        out = np.empty(g.shape, F32) if out is None else out.reshape(g.shape)
        np.multiply(g, (1.0 / np.sqrt(ms + eps)).astype(F32)[..., None], out=out)
    out = out.reshape(x.shape)
    out *= gain
    return out


def l2norm_(x: np.ndarray) -> np.ndarray:
    """In place over the last axis: x / sqrt(sum(x^2) + 1e-6) (transformers' l2norm of GDN q and k)."""
    ss = np.einsum("...i,...i->...", x, x, dtype=np.float64)
    x *= (1.0 / np.sqrt(ss + L2NORM_EPS)).astype(F32)[..., None]
    return x


def silu_(x: np.ndarray) -> np.ndarray:
    """In place: x * sigmoid(x)."""
    return gate_(x, x)


def gate_(x: np.ndarray, z: np.ndarray, silu: bool = False) -> np.ndarray:
    """In place: x *= sigmoid(z), or x *= silu(z) = z sigmoid(z) when `silu`; x contiguous, z of its
    shape. `gate_reference`'s numbers: numpy's tanh (the one transcendental step, as `sigmoid`
    takes it), then one Numba pass for the rest, where numpy made three more over the array."""
    if not x.flags.c_contiguous or z.shape != x.shape:
        raise ValueError(f"gate_: x must be contiguous and z of its shape, got {x.shape} (contiguous "
                         f"{x.flags.c_contiguous}) and {z.shape}")
    t = np.multiply(z, 0.5)
    np.tanh(t, out=t)
    _gate(x.reshape(-1), z.reshape(-1), t.reshape(-1), silu)
    return x


def gate_reference(x: np.ndarray, z: np.ndarray, silu: bool = False) -> np.ndarray:
    """gate_ in numpy: the sigmoid as `sigmoid` makes it, then the products."""
    s = sigmoid(z)
    if silu:
        s = z * s
    x *= s
    return x


@cached_njit("gate")
def _gate(x, z, t, silu):
    # t = tanh(z / 2): sigmoid(z) = (t + 1) / 2 in `sigmoid`'s steps, then the products in
    # gate_reference's order (no FMA: fastmath off), so the same bits
    for i in range(x.size):
        s = (t[i] + F32(1)) * F32(0.5)
        if silu:
            s = z[i] * s
        x[i] = x[i] * s


# --- the routed experts' SiLU: the same bits on the CPU and on the device -------------------------
#
# An expert's hidden activation h = up silu(gate) is made by whichever computes that expert: the CPU
# for a miss, the device for a hit (the device step keeps a token's hits on the card). Logits must be
# bit-identical whichever expert is resident, so both must make h with the same bits, and a library
# exp or tanh is not the same function on numpy and CUDA. So this exp is written out in basic
# float32 operations (each correctly rounded on both, no FMA: fastmath off here, --fmad=false there),
# in one order, mirrored step for step by `silu_p` in engine/tier/device_kernels.cu:
#     x clamped to [-87, 87] (exp cannot overflow or go subnormal)
#     n = floor(x log2(e) + 1/2);  r = (x - n ln2_hi) - n ln2_lo   (Cody-Waite: n ln2_hi is exact)
#     exp(x) = 2^n p(r), p the degree-7 Taylor polynomial by Horner (|r| <= ln2 / 2)
#     silu(z) = z / (1 + exp(-z));  h = up * silu(gate)
# tests/engine/test_host_kernels.py checks it against float64 and the device kernel against it.

EXP_CLAMP = F32(87.0)
LOG2E = F32(1.4426950408889634)
LN2_HI = F32(0.693359375)  # 9 significant bits: n ln2_hi is exact for |n| < 2^15
LN2_LO = F32(-2.1219444005469057e-4)
EXP_POLY = tuple(F32(1.0 / math.factorial(i)) for i in range(7, -1, -1))  # 1/7!, ..., 1/1!, 1/0!
POW2 = np.array([2.0 ** i for i in range(-127, 128)], F32)  # 2^n at n + 127 (n = -127 is 0: not reached)


def exp_p_reference(x: np.ndarray) -> np.ndarray:
    """The portable float32 exp above, in numpy, for an array: f32 -> f32."""
    x = np.minimum(np.maximum(np.asarray(x, F32), -EXP_CLAMP), EXP_CLAMP)
    n = np.floor(x * LOG2E + F32(0.5))
    r = (x - n * LN2_HI) - n * LN2_LO
    p = np.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    return p * POW2[n.astype(np.int64) + 127]


@njit(**JIT)
def _exp_p(x):
    if x < -EXP_CLAMP:
        x = -EXP_CLAMP
    if x > EXP_CLAMP:
        x = EXP_CLAMP
    n = np.floor(x * LOG2E + F32(0.5))
    r = (x - n * LN2_HI) - n * LN2_LO
    p = EXP_POLY[0]
    p = p * r + EXP_POLY[1]
    p = p * r + EXP_POLY[2]
    p = p * r + EXP_POLY[3]
    p = p * r + EXP_POLY[4]
    p = p * r + EXP_POLY[5]
    p = p * r + EXP_POLY[6]
    p = p * r + EXP_POLY[7]
    return p * POW2[np.int64(n) + 127]


def silu_mul_(up: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """In place: up *= silu(gate) with the portable exp -> up (an expert's hidden activation)."""
    if not (up.flags.c_contiguous and gate.flags.c_contiguous and up.shape == gate.shape and up.dtype == F32 == gate.dtype):
        raise ValueError(f"silu_mul_: up and gate must be contiguous f32 of one shape, got {up.dtype}{up.shape} "
                         f"and {gate.dtype}{gate.shape}")
    _silu_mul(up.reshape(-1), gate.reshape(-1))
    return up


def silu_mul_reference(up: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """silu_mul_ in numpy (a new array)."""
    g = np.asarray(gate, F32)
    return np.asarray(up, F32) * (g / (F32(1) + exp_p_reference(-g)))


@cached_njit("silu-mul")
def _silu_mul(up, gate):
    for i in range(up.size):
        z = gate[i]
        up[i] = up[i] * (z / (F32(1) + _exp_p(-z)))


def sigmoid(x: np.ndarray, *, exp_form: bool = False) -> np.ndarray:
    """sigmoid(x) in a new buffer. Two forms, on purpose: 0.5 * (1 + tanh(x / 2)) by default, which
    cannot overflow for large |x| (the gates of qwen35moe's blocks, `gate_`'s numbers); with
    `exp_form`, 1 / (1 + exp(-x)), torch.sigmoid's formula, which the qwen4exp components
    (hyper-connections, PLE, QSA's output gate) were matched to step for step (`rmsnorm`'s f32_sums
    says why). Each form's steps run in one buffer, in that expression's order."""
    if exp_form:
        out = np.negative(x)
        np.exp(out, out=out)
        out += 1.0
        return np.divide(1.0, out, out=out)
    t = np.multiply(x, 0.5)
    np.tanh(t, out=t)
    t += 1.0
    t *= 0.5
    return t


def softplus(x: np.ndarray) -> np.ndarray:
    """log(1 + exp(x)), stable for large |x|."""
    return np.logaddexp(0, x).astype(x.dtype, copy=False)


# --- rotary embedding -------------------------------------------------------------------------------


class Rope:
    """NeoX-style rotary embedding on the first n_rot dims of each head (partial rotary): dims
    [0, half) and [half, n_rot) rotate as pairs (i, i + half).

    Qwen3.5's M-RoPE gives each frequency a temporal, height or width position (interleaved
    sections); for text the three positions are equal, so it is plain RoPE.

    Two angle precisions, on purpose. By default the angles are computed in float64 per position
    (position * inv_freq loses nothing), then rounded once to f32: the closest to transformers in
    float64. `f32_angles` computes inv_freq and position * inv_freq in f32 as transformers does in
    float32: QSA (qwen4exp) rotates its indexer queries and pooled block keys with it, and the block
    selection is discrete, so it reproduces that rounding (`rmsnorm`'s f32_sums says why)."""

    def __init__(self, n_rot: int, base: float, *, f32_angles: bool = False):
        if n_rot <= 0 or n_rot % 2:
            raise ValueError(f"rope: n_rot {n_rot} must be even and > 0")
        self.n_rot, self.half, self.f32_angles = n_rot, n_rot // 2, f32_angles
        if f32_angles:
            # torch computes base ** (arange/n) in f32, correctly rounded: pow in f64 then round matches it
            e = np.arange(0, n_rot, 2, dtype=F32) / F32(n_rot)
            self.inv_freq = F32(1.0) / (np.float64(base) ** e.astype(np.float64)).astype(F32)
        else:
            self.inv_freq = 1.0 / (float(base) ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """f32 [T, half] each, for int positions [T]."""
        if self.f32_angles:
            angle = positions.astype(F32)[:, None] * self.inv_freq
            return np.cos(angle), np.sin(angle)
        angle = positions.astype(np.float64)[:, None] * self.inv_freq
        return np.cos(angle).astype(F32), np.sin(angle).astype(F32)

    def apply_(self, x: np.ndarray, positions: np.ndarray) -> None:
        """x [T, heads, D] in place (D >= n_rot), row t at positions[t]."""
        c, s = self.cos_sin(positions)
        c, s = c[:, None, :], s[:, None, :]
        h = self.half
        x1 = x[..., :h].copy()
        x2 = x[..., h : 2 * h]
        x[..., :h] = x1 * c - x2 * s
        x[..., h : 2 * h] = x2 * c + x1 * s


# --- Gated DeltaNet ---------------------------------------------------------------------------------


def conv_many(state: np.ndarray, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Causal depthwise conv of T inputs over the last K - 1 before them, then SiLU -> f32 [T, C].

    state f32 [K-1, C]: the previous inputs, oldest first (zeros at the start), advanced by T; w f32
    [K, C] (the GGUF's (K, C) ssm_conv1d, as stored); x f32 [T, C]. torch's conv1d is a
    cross-correlation with K-1 zeros of left padding, so tap j multiplies the input K-1-j steps back.
    The token path is T = 1 of the same code, so both paths compute the conv identically."""
    K, T = w.shape[0], x.shape[0]
    out = np.empty(x.shape, F32)
    _conv_taps(state, w, x, out)
    if T >= K - 1:
        state[:] = x[T - (K - 1) :]
    else:
        state[:] = np.concatenate([state[T:], x])
    return silu_(out)


def conv_taps_reference(state: np.ndarray, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The conv before SiLU, as numpy: out = w[0] h[t] + w[1] h[t+1] + ... over h = state then x."""
    T = x.shape[0]
    hist = np.concatenate([state, x])  # [K-1+T, C]
    out = w[0] * hist[:T]
    for j in range(1, w.shape[0]):
        out += w[j] * hist[j : j + T]
    return out


@cached_row_kernel("conv-taps", rows=2)
def _conv_taps(state, w, x, out):
    # conv_taps_reference with no [K-1+T, C] history copy and no product temporaries: each
    # element the same f32 products added in the same order (no FMA: fastmath off)
    K, C = w.shape
    T = x.shape[0]
    for t in prange(T):
        for j in range(K):
            i = t + j - (K - 1)  # the input tap j reads: state row K-1+i when i < 0
            src = x[i] if i >= 0 else state[K - 1 + i]
            if j == 0:
                for c in range(C):
                    out[t, c] = w[0, c] * src[c]
            else:
                for c in range(C):
                    out[t, c] += w[j, c] * src[c]


def _delta_rule(S, q, k, v, g, beta, out):
    """One token of the gated delta rule, in place on the state; v heads in GGUF (tiled) order.

    S f32 [nv, dv, dk] (the transpose of transformers' [dk, dv] per head, so each value row is
    contiguous); q, k f32 [nk, dk], l2-normalised, q already scaled by dk^-0.5; v f32 [nv, dv];
    g f32 [nv] (log decay); beta f32 [nv]; out f32 [nv, dv]. Per v-head h, key head h % nk:
        S <- S * exp(g);  kv = S^T k;  S <- S + k (beta (v - kv))^T;  out = S^T q
    computed one value row at a time (each row of S is independent), in one pass over S."""
    nv, dv, dk = S.shape
    nk = q.shape[0]
    for h in prange(nv):
        kh = h % nk
        decay = np.float32(math.exp(g[h]))
        for j in range(dv):
            kv = np.float32(0.0)
            for i in range(dk):
                S[h, j, i] = S[h, j, i] * decay
                kv += S[h, j, i] * k[kh, i]
            delta = (v[h, j] - kv) * beta[h]
            o = np.float32(0.0)
            for i in range(dk):
                S[h, j, i] = S[h, j, i] + k[kh, i] * delta
                o += S[h, j, i] * q[kh, i]
            out[h, j] = o


# A parallel launch costs tens of microseconds (far more on a loaded machine); a small state
# (the tiny test models) is done before the threads would wake.
# Two dispatchers of one function: numba's own cache=True would give them ONE cache entry (whichever
# compiled first is loaded by both), so each gets its own tag through jit.cached.
_delta_rule_serial = cached(njit(**JIT)(_delta_rule), "delta-rule-serial")
_delta_rule_parallel = cached(njit(parallel=True, **JIT)(_delta_rule), "delta-rule-parallel")
PARALLEL_MIN_STATE = 1 << 18  # f32 elements of S per layer (production: 48 * 128 * 128 = 786,432)


def delta_rule_step(S, q, k, v, g, beta, out) -> None:
    """One token of the gated delta rule (see _delta_rule), threaded when the state is large (by
    size alone, like cpu._launch: a change of thread count must not compile the other variant)."""
    if S.size >= PARALLEL_MIN_STATE:
        cpu.use_threads()
        delta.delta_rule_parallel(S, q, k, v, g, beta, out)  # _delta_rule's bits, 8 rows at a time
    else:
        delta.delta_rule_serial(S, q, k, v, g, beta, out)


def delta_rule_rows(S, q, k, v, g, beta, out, saved) -> None:
    """T tokens of one sequence as T token steps (`delta_rule_step`'s bits for each), in one pass over
    S (kernels/delta._rule_rows): q, k f32 [T, nk, dk]; v, out f32 [T, nv, dv]; g, beta f32 [T, nv];
    saved: per token an array like S that takes the state after that token, or None."""
    keep = np.full(len(saved), -1, np.int64)  # token t's snapshot: snaps[keep[t]], or none at -1
    snaps = []
    for t, a in enumerate(saved):
        if a is not None:
            keep[t] = len(snaps)
            snaps.append(a)
    kernel = delta.rule_rows_serial
    if S.size >= PARALLEL_MIN_STATE:  # (as delta_rule_step)
        cpu.use_threads()
        kernel = delta.rule_rows_parallel
    kernel(S, q, k, v, g, beta, out, keep, tuple(snaps) or (S,))  # (no snapshot: a tuple of one, never written)


def delta_rule(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
               out: np.ndarray | None = None) -> np.ndarray:
    """T tokens of the gated delta rule, S f32 [nv, dv, dk] updated in place -> f32 [T, nv, dv] (`out`
    when given). One token takes the recurrence (`delta_rule_step`: one pass over S, the decode
    path's cost); more take the chunked form (`chunk_delta_rule`: matrix products over sub-chunks),
    which differs from the recurrence by float rounding only (tests/engine/test_prefill.py bounds it)."""
    if q.shape[0] == 1:
        out = np.empty(v.shape, F32) if out is None else out
        delta_rule_step(S, q[0], k[0], v[0], g[0], beta[0], out[0])
        return out
    o = chunk_delta_rule(S, q, k, v, g, beta)
    if out is None:
        return o
    out[...] = o
    return out


GDN_CHUNK = 64  # transformers' chunk_size for chunk_gated_delta_rule
# At most this many Python threads take the chunked delta rule's heads. While its forward
# substitution was ~2 small numpy calls per token per job, each holding the GIL for its dispatch,
# more jobs only queued more such calls: on the H200's host (16 cores) a 512-token seed-4l prompt's
# three GDN layers spent 581 / 294 / 229 / 388 ms in the rule at 1 / 2 / 4 / 8 jobs, so the cap was 4.
# The substitution is now one GIL-free kernel call per sub-chunk (kernels/delta.substitute), and one
# layer's rule at 8 threads took 57.6 ms with 4 jobs, 44.5 ms with 8 (benchmarks/delta_rule.py,
# 2026-12-04, docs/performance.md); 16 was not measured. The bits do not depend on the split (each
# head takes the same calls).
DELTA_JOBS = max(1, int(os.environ.get("STRATA_DELTA_JOBS", "8")))


def single_blas_thread() -> None:
    """Run numpy's BLAS (the prompt path's delta rule and attention) on one thread, for the process.

    OpenBLAS's threads spin-wait on each other: beside the kernels' Numba threads and another busy
    process on 2 cores, one 256-token chunk of the delta rule took 18 s instead of 0.05 s. The BLAS
    work is small beside the kernels', which keep the --pool-workers threads."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")


# glibc's malloc gives a freed block above M_MMAP_THRESHOLD back to the OS at once and trims the
# heap's top beyond M_TRIM_THRESHOLD. The prompt path allocates and frees hundreds of MB of numpy
# temporaries per chunk, so every chunk faulted them in again: 4096 tokens of seed-4l in 1024-token
# chunks spent 2.3 s of system time in 13.5 s (180-230K page faults). Kept in the process (mmap
# only above 32 MiB, glibc's largest threshold; no trimming) that fell to 0.5 s and the prompt ran
# 12% faster (302 -> 340 tok/s, back-to-back runs); the token path did not change (measured).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def reuse_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for the next allocation instead of returning it to the
    OS, for the process. The heap then stays at its peak (the prompt path's working set, which
    --prefill auto bounds). False where there is no glibc: nothing changes."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def chunk_delta_rule(S: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """T tokens of the gated delta rule in chunked form (transformers' torch_chunk_gated_delta_rule), f32.

    The same recurrence as `delta_rule_step` token by token, regrouped into matrix products over
    GDN_CHUNK-token sub-chunks (the WY / UT transform), so it differs from it only by float rounding.
    S f32 [nv, dv, dk] in place; q, k f32 [T, nk, dk] (l2-normalised, q scaled by dk^-1/2); v f32
    [T, nv, dv]; g, beta f32 [T, nv]; v-head h reads key head h % nk (GGUF tiling). Returns [T, nv, dv].
    Per sub-chunk, c_i = cumulative log decay, A_ij = exp(c_i - c_j) for j <= i (0 above):
        (I + strictly_lower(beta_i k_i.k_j A_ij)) [u | w] = [beta v | beta k exp(c)]     forward substitution
        v_new = u - w S;   o = (q exp(c)) S + tril(q_i.k_j A_ij) v_new
        S     = S exp(c_last) + (k exp(c_last - c))^T v_new          (S here [dk, dv], transformers' orientation)
    The heads are independent: they go to the kernels' threads in contiguous ranges (`in_threads`),
    each range through the very numpy calls all heads would take, so the split changes no bit.
    """
    T, nv, dv = v.shape
    nk = q.shape[1]
    heads = np.arange(nv) % nk
    Q = np.ascontiguousarray(q[:, heads].transpose(1, 0, 2))  # [nv, T, dk]
    K = np.ascontiguousarray(k[:, heads].transpose(1, 0, 2))
    V = v.transpose(1, 0, 2)  # [nv, T, dv]
    B = beta.T[:, :, None]  # [nv, T, 1]
    G = np.ascontiguousarray(g.T)  # [nv, T]
    St = np.ascontiguousarray(S.transpose(0, 2, 1))  # [nv, dk, dv]
    out = np.empty((nv, T, dv), F32)
    parts = min(cpu.get_threads(), nv, DELTA_JOBS)
    cuts = [nv * i // parts for i in range(parts + 1)]
    in_threads(_delta_heads, [tuple(a[h0:h1] for a in (St, Q, K, V, B, G, out)) for h0, h1 in zip(cuts, cuts[1:])])
    S[...] = St.transpose(0, 2, 1)
    return np.ascontiguousarray(out.transpose(1, 0, 2))  # [T, nv, dv]: the gate works in place on it


def _delta_heads(St, Q, K, V, B, G, out) -> None:
    """chunk_delta_rule's sub-chunk loop for a range of heads (every array sliced to them), St in place."""
    nv, T, dk = Q.shape
    dv = V.shape[-1]
    X = np.empty((nv, GDN_CHUNK, dv + dk), F32)  # [u | w], solved in place
    row = np.empty(dv + dk, F32)
    for a in range(0, T, GDN_CHUNK):
        b = min(a + GDN_CHUNK, T)
        n = b - a
        q_, k_, B_ = Q[:, a:b], K[:, a:b], B[:, a:b]
        kb = k_ * B_
        c = np.cumsum(G[:, a:b], axis=1, dtype=F32)  # [nv, n]
        ec = np.exp(c)[:, :, None]
        lower = np.tril(np.ones((n, n), bool))
        A = np.exp(np.where(lower, c[:, :, None] - c[:, None, :], -np.inf)).astype(F32)  # [nv, n, n]
        L = kb @ k_.transpose(0, 2, 1)
        L *= A  # the substitution reads only its strictly lower part: no tril needed
        Xn = X[:, :n]
        np.multiply(V[:, a:b], B_, out=Xn[..., :dv])
        np.multiply(kb, ec, out=Xn[..., dv:])
        delta.substitute(L, Xn, row)  # GIL-free: the heads' threads run it side by side
        v_new = Xn[..., dv:] @ St
        np.subtract(Xn[..., :dv], v_new, out=v_new)
        o = out[:, a:b]
        np.matmul(q_ * ec, St, out=o)
        P = q_ @ k_.transpose(0, 2, 1)
        P *= A
        o += P @ v_new
        last = c[:, -1:]
        St *= np.exp(last)[:, :, None]
        St += (k_ * np.exp(last - c)[:, :, None]).transpose(0, 2, 1) @ v_new


def gated_rmsnorm_(o: np.ndarray, gain: np.ndarray, z: np.ndarray, eps: float, silu: bool) -> np.ndarray:
    """In place per head: o / sqrt(mean(o^2) + eps) * gain * act(z); o, z [nv, dv], gain [dv] stored as
    is; act = SiLU (qwen35moe) or sigmoid (qwen4exp as released: the GGUF does not say which)."""
    rmsnorm(o, gain, eps, out=o)
    return gate_(o, z, silu=silu)


# --- attention --------------------------------------------------------------------------------------


def softmax_(x: np.ndarray) -> np.ndarray:
    """In place over the last axis."""
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x /= x.sum(axis=-1, keepdims=True)
    return x


# The prompt path's attention scores are computed in query tiles of at most this: small enough that
# a tile's scores stay in the cache for the mask and softmax passes over them (1024 queries x 4096
# keys of seed-4l: 574 ms in 64 MiB tiles, 478 ms in 4 MiB, with the key ranges below).
ATTN_TILE_BYTES = 4 << 20


def attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, scale: float, visible: np.ndarray | None = None,
              tile_bytes: int = ATTN_TILE_BYTES) -> np.ndarray:
    """Softmax attention of T query tokens -> f32 [T, H, D], grouped by KV head (query head h reads KV
    head h // (H / Hkv), transformers' repeat_kv).

    q f32 [T, H, D]; K, V f32 [Hkv, n, D]; visible bool [T, n]: which keys each query attends (the
    causal mask, or QSA's selection); None: every query sees every key (one token over its cache).
    One query with every key visible is one batched product per KV head. Otherwise queries go in
    tiles whose scores fit in `tile_bytes`, so a long context never makes a [T, H, n] matrix at once;
    the (KV head, tile) pairs go to the kernels' threads (`in_threads`), one tile's scores per thread
    at a time. A tile reads only the keys from its first visible one to its last: a causal chunk's
    later tiles see more of the chunk than its earlier ones, and computing every tile over all n keys
    (then masking) did up to twice the work (a 1024-token chunk at the start of a prompt: 150 ms ->
    66 ms with 4 MiB tiles, docs/engine.md)."""
    T, H, D = q.shape
    Hkv, n = K.shape[:2]
    G = H // Hkv
    out = np.empty((T, H, D), F32)
    if T == 1 and visible is None:
        scores = np.matmul(q.reshape(Hkv, G, D), K.transpose(0, 2, 1))  # [Hkv, G, n]
        scores *= F32(scale)
        softmax_(scores)
        np.matmul(scores, V, out=out.reshape(Hkv, G, D))
        return out
    tile = max(1, tile_bytes // (G * n * 4))
    hidden = None if visible is None else ~visible
    jobs = []
    for a in range(0, T, tile):
        b = min(a + tile, T)
        if visible is None:
            lo, hi = 0, n
        else:
            seen = np.flatnonzero(visible[a:b].any(axis=0))
            lo, hi = (int(seen[0]), int(seen[-1]) + 1) if seen.size else (0, n)  # none: softmax of -inf, as before
        jobs += [(j, a, b, lo, hi) for j in range(Hkv)]

    def one(j: int, a: int, b: int, lo: int, hi: int) -> None:
        m = hi - lo
        sc = (q[a:b, j * G : (j + 1) * G].reshape(-1, D) @ K[j, lo:hi].T).reshape(b - a, G, m)
        sc *= F32(scale)
        if hidden is not None:
            np.copyto(sc, -np.inf, where=hidden[a:b, None, lo:hi])
        softmax_(sc)
        out[a:b, j * G : (j + 1) * G] = (sc.reshape(-1, m) @ V[j, lo:hi]).reshape(b - a, G, D)

    in_threads(one, jobs)
    return out


def causal_mask(pos0: int, T: int, n: int) -> np.ndarray:
    """bool [T, n]: query t (at position pos0 + t) sees keys 0 .. pos0 + t."""
    return np.arange(n)[None, :] <= (pos0 + np.arange(T))[:, None]
