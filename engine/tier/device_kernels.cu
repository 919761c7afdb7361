// The device step's kernels (engine/tier/device.py): the fused row operations of the blocks, each
// one launch where the array-module form took several (a norm was eight CuPy launches, the delta
// rule's token step six per token, the MoE's combine thirty). Loaded by gpu.py's runtime as a CuPy
// RawModule; the same source compiles on the host against tests/gpu_emu.h (STRATA_EMU), so the
// tests run them without a GPU: no #include, every warp-collective reached by all 32 lanes (a
// warp's loop bounds are the same for its lanes).
//
// Numbers: these follow engine/ops.py's formulas (the order of the sums differs: a warp adds
// lane by lane, then folds), so the device step is the CPU engine's within float32 rounding, not
// bit for bit (tests/gpu/test_device_step.py states the tolerance). No FMA contraction: gpu.py
// compiles with --fmad=false and the emulation with -ffp-contract=off.

typedef long long i64;

#define FULL 0xffffffffu
#ifndef STRATA_SMEM
#define STRATA_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// Vector accesses need their natural alignment on the device; the host emulation checks it.
#ifndef STRATA_ALIGNED
#define STRATA_ALIGNED(p, n) (p)
#endif

#ifndef STRATA_EMU
// ActQ's operations as gpu_kernels.cu has them (the emulation's header provides the same): IEEE
// division whatever the compiler's flags; round half to even, saturating, NaN -> 0
__device__ __forceinline__ float f32_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ int f32_rint(float a) {
    int r;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(a));
    return r;
}
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}

// ops.sigmoid's default form: (tanh(x / 2) + 1) / 2
__device__ __forceinline__ float sigmoid_t(float x) { return (tanhf(x * 0.5f) + 1.0f) * 0.5f; }

// The scale of one row of n at xr for dev_rmsnorm and dev_rmsnorm_q: 1 / sqrt(mean of squares + eps)
// (or of the sum of squares, l2), the sums in f64 or, f32_sums, in f32; red: a double per warp of
// shared memory. Every thread of the block calls it; the caller syncs before red is written again.
__device__ __forceinline__ float norm_scale(const float* xr, int n, float eps, int f32_sums, int l2, double* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (f32_sums) {
        float s = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i] * xr[i];
        s = warp_sum(s);
        if (lane == 0) red[warp] = (double)s;  // (exact: a float widened)
        __syncthreads();
        float t = 0.0f;
        for (int w = 0; w < nw; w++) t += (float)red[w];
        return 1.0f / sqrtf(t / (float)n + eps);
    }
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += (double)xr[i] * (double)xr[i];
    s = warp_sum_d(s);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < nw; w++) t += red[w];
    return (float)(1.0 / sqrt((l2 ? t : t / (double)n) + (double)eps));
}

// RMSNorm of `rows` rows of n (row r at x + r * xs), then * gain (row r reads gain[(r % gp) n ..]:
// gp = 1 for a gain of the row's length, more when the norm's groups split a longer axis whose
// gain it is, as hyper-connections and PLE normalise each stream of hc * E); with act 1 or 2 the result
// is multiplied by sigmoid(z) or z sigmoid(z) (z, out: contiguous [rows, n]; out may be x). The
// mean of squares in f64 (ops.rmsnorm's default) or in f32 (f32_sums). l2: ops.l2norm_ instead,
// x / sqrt(sum of squares + eps) in f64, no gain.
extern "C" __global__ void dev_rmsnorm(const float* x, i64 xs, const float* gain, int gp, const float* z, float* out,
                                       int rows, int n, float eps, int f32_sums, int act, int l2) {
    // A block per row (DeviceBackend.norm_launch sizes it to the row: a few elements a thread).
    // It was a warp per row: one token's 3072-long norm then took ~13 us of one warp's serial
    // loads (2026-12-02, the H200's per-kernel floor: 14 norms, 0.18 ms of a 1.0 ms step).
    STRATA_SMEM(smem);
    double* red = reinterpret_cast<double*>(smem);  // a partial sum per warp
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + (i64)r * xs;
        const float scale = norm_scale(xr, n, eps, f32_sums, l2, red);
        __syncthreads();  // every thread has read red before the next row writes it
        float* orow = out + (i64)r * n;
        const float* gr = gain + (i64)(r % gp) * n;
        const float* zr = z ? z + (i64)r * n : 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            float y = xr[i] * scale;
            if (!l2) y = y * gr[i];
            if (act) {
                const float s = sigmoid_t(zr[i]);
                y = y * (act == 2 ? zr[i] * s : s);
            }
            orow[i] = y;
        }
    }
}

// One 32-element ActQ block, lane j holding y = element j (all 32 lanes call it): the actq kernel
// of gpu_kernels.cu's operations, to q [32] at qb, d[b], s16[2 b], s16[2 b + 1]
__device__ __forceinline__ void actq_block(float y, signed char* qb, float* d, int* s16, i64 b) {
    const int lane = threadIdx.x & 31;
    unsigned amax = __float_as_uint(y) & 0x7fffffffu;
    for (int o = 16; o > 0; o >>= 1) amax = max(amax, __shfl_xor_sync(FULL, amax, o));
    const float db = f32_div(__uint_as_float(amax), 127.0f);
    int qi = 0;
    if (__float_as_uint(db) != 0u) qi = min(max(f32_rint(f32_div(y, db)), -127), 127);
    qb[lane] = (signed char)qi;
    int sq = qi;
    for (int o = 8; o > 0; o >>= 1) sq += __shfl_xor_sync(FULL, sq, o);  // stays inside each 16-lane half
    if (lane == 0) d[b] = db;
    if ((lane & 15) == 0) s16[2 * b + (lane >> 4)] = sq;
}

// one row of dev_rmsnorm_q (below)
__device__ __forceinline__ void rmsnorm_q_row(int r, const float* x, i64 xs, const float* gain, int gp, const float* z,
                                              int act, float* out, signed char* q, float* d, int* s16, int n, float eps,
                                              int f32_sums, double* red) {
    const int lane = threadIdx.x & 31;
    const float* xr = x + (i64)r * xs;
    const float scale = norm_scale(xr, n, eps, f32_sums, 0, red);
    __syncthreads();  // every thread has read red before the next row writes it
    const float* gr = gain + (i64)(r % gp) * n;
    const float* zr = z ? z + (i64)r * n : 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float y = xr[i] * scale;  // (dev_rmsnorm's operations in its order)
        y = y * gr[i];
        if (act) {
            const float sg = sigmoid_t(zr[i]);
            y = y * (act == 2 ? zr[i] * sg : sg);
        }
        const i64 at = (i64)r * n + i;
        out[at] = y;
        actq_block(y, q + (at - lane), d, s16, at >> 5);
    }
}

// dev_rmsnorm (not l2) that also writes its output's ActQ: the actq kernel of
// engine/kernels/gpu_kernels.cu (actq.py's bits) on each 32-element block as the block is written,
// so a norm that only feeds products is one launch where it was two (the layers' input norms: 2
// a layer, a Gated DeltaNet's gated norm before its out projection; 21 ActQ launches a qwen35moe
// token, most of them right after a norm). x, gain, gp, z, act, rows, n, eps, f32_sums: as
// dev_rmsnorm; out [rows, n], q i8 [rows, n], d f32 [rows, n / 32],
// s16 i32 [rows, n / 16], all contiguous; n a multiple of 32 (the loop's stride is a whole number of
// warps, so a warp's 32 elements are one block and its lanes go round the loop together).
//   amax = max |y|;  d = amax / 127;  q = d == 0 ? 0 : clamp(rint(y / d), +-127);  s16[h] = sum of q over half h
extern "C" __global__ void dev_rmsnorm_q(const float* x, i64 xs, const float* gain, int gp, const float* z, int act,
                                         float* out, signed char* q, float* d, int* s16, int rows, int n, float eps,
                                         int f32_sums) {
    STRATA_SMEM(smem);
    double* red = reinterpret_cast<double*>(smem);  // a partial sum per warp
    for (int r = blockIdx.x; r < rows; r += gridDim.x)
        rmsnorm_q_row(r, x, xs, gain, gp, z, act, out, q, d, s16, n, eps, f32_sums, red);
}

// The residual add before a layer's input norm and that norm with its ActQ, in one launch:
// x += y (the array add `H += Y` the block's leave made, a launch of its own), then dev_rmsnorm_q
// of x (gain [n], f64 sums, no gate). x, y contiguous [rows, n]. A thread adds the elements it
// then reads (norm_scale and the output loop go round the row with the same stride), so no sync.
extern "C" __global__ void dev_add_rmsnorm_q(float* x, const float* y, const float* gain, float* out, signed char* q,
                                             float* d, int* s16, int rows, int n, float eps) {
    STRATA_SMEM(smem);
    double* red = reinterpret_cast<double*>(smem);  // a partial sum per warp
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        float* xr = x + (i64)r * n;
        for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] = xr[i] + y[(i64)r * n + i];
        rmsnorm_q_row(r, x, n, gain, 1, 0, 0, out, q, d, s16, n, eps, 0, red);
    }
}

// The gated delta rule (ops.delta_rule's recurrence) for T tokens in one launch. S f32 [nv, dv, dk]:
// each value row (h, j) of S evolves alone, so a warp holds DELTA_R rows of one head in registers
// through all T tokens: S <- S exp(g);  kv = S . k;  S <- S + k beta (v - kv);  out = S . q   (key
// head h % nk). q, k: token t's [nk, dk] at q + t qs (k + t ks); v: token t's [nv, dv] at v + t vs;
// g, beta [T, nv] contiguous; out [T, nv, dv] contiguous. dk at most 256 (lanes past dk hold zeros).
// Each row's operations are the one-row form's, in its order. (The one-row form was latency-bound:
// two dependent warp sums a token and a row, its state in local memory through a loop bound only
// known at run time: ~600 us for a 256-token chunk's 4096 rows on the H200, 2026-12-02; the rows
// of a head share k and q, and their sums interleave.)
#define DELTA_R 4
// Token t's inputs of a dev_delta warp: key and query lanes (zeros past dk), its value rows, gate and beta.
__device__ __forceinline__ void delta_load(int t, const float* q, i64 qs, const float* k, i64 ks, const float* v, i64 vs,
                                           const float* g, const float* beta, int nv, int h, int kh, int j0, int dv,
                                           int dk, int lane, const bool (&in)[8], float (&kk)[8], float (&qq)[8],
                                           float (&vv)[DELTA_R], float& gt, float& bt) {
    const float* kt = k + (i64)t * ks + (i64)kh * dk;
    const float* qt = q + (i64)t * qs + (i64)kh * dk;
#pragma unroll
    for (int a = 0; a < 8; a++) {
        kk[a] = in[a] ? kt[lane + 32 * a] : 0.0f;
        qq[a] = in[a] ? qt[lane + 32 * a] : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < DELTA_R; r++) vv[r] = v[(i64)t * vs + (i64)h * dv + min(j0 + r, dv - 1)];
    gt = g[(i64)t * nv + h];
    bt = beta[(i64)t * nv + h];
}

// dev_delta's lane's part of head h's state rows j0 .. j0 + DELTA_R - 1 into dst (S, or a snapshot like it)
__device__ __forceinline__ void delta_store(float* dst, const float (&s)[DELTA_R][8], const bool (&in)[8], int h, int j0,
                                            int dv, int dk, int lane) {
#pragma unroll
    for (int r = 0; r < DELTA_R; r++)
        if (j0 + r < dv)
#pragma unroll
            for (int a = 0; a < 8; a++)
                if (in[a]) dst[((i64)h * dv + j0 + r) * dk + lane + 32 * a] = s[r][a];
}

// (Software-pipelined: token t + 1's inputs are loaded into registers before token t's update, so
// their global-memory latency overlaps its arithmetic instead of starting each token; the values and
// every operation on them are as before: the same bits.)
// snaps: null, or per token the address of an array like S that takes the state after that token
// (0: none): a verify's rows (DeviceBackend.gdn_rows), each row's snapshot written as its step ends.
extern "C" __global__ void dev_delta(float* S, const float* q, i64 qs, const float* k, i64 ks, const float* v, i64 vs,
                                     const float* g, const float* beta, float* out, int T, int nv, int nk, int dv,
                                     int dk, const i64* snaps) {
    const int lane = threadIdx.x & 31;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    const int per_head = (dv + DELTA_R - 1) / DELTA_R;
    for (int grp = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); grp < nv * per_head; grp += nw) {
        const int h = grp / per_head, j0 = (grp - h * per_head) * DELTA_R, kh = h % nk;
        float s[DELTA_R][8];
        bool in[8];
#pragma unroll
        for (int a = 0; a < 8; a++) in[a] = lane + 32 * a < dk;
#pragma unroll
        for (int r = 0; r < DELTA_R; r++) {
            const float* Sr = S + ((i64)h * dv + min(j0 + r, dv - 1)) * dk;  // (a row past dv: never written)
#pragma unroll
            for (int a = 0; a < 8; a++) s[r][a] = in[a] ? Sr[lane + 32 * a] : 0.0f;
        }
        float kk[8], qq[8], vv[DELTA_R], gt = 0.0f, bt = 0.0f;  // token t's inputs, loaded an iteration ahead
        if (T > 0) delta_load(0, q, qs, k, ks, v, vs, g, beta, nv, h, kh, j0, dv, dk, lane, in, kk, qq, vv, gt, bt);
        for (int t = 0; t < T; t++) {
            float kn[8], qn[8], vn[DELTA_R], gn = 0.0f, bn = 0.0f;  // token t + 1's, in flight during t's update
#pragma unroll
            for (int a = 0; a < 8; a++) kn[a] = qn[a] = 0.0f;
#pragma unroll
            for (int r = 0; r < DELTA_R; r++) vn[r] = 0.0f;
            if (t + 1 < T) delta_load(t + 1, q, qs, k, ks, v, vs, g, beta, nv, h, kh, j0, dv, dk, lane, in, kn, qn, vn, gn, bn);
            const float decay = expf(gt);
            float kv[DELTA_R], o[DELTA_R];
#pragma unroll
            for (int r = 0; r < DELTA_R; r++) {
                kv[r] = 0.0f;
#pragma unroll
                for (int a = 0; a < 8; a++) {
                    s[r][a] = s[r][a] * decay;
                    if (in[a]) kv[r] += s[r][a] * kk[a];
                }
            }
#pragma unroll
            for (int w = 16; w > 0; w >>= 1)
#pragma unroll
                for (int r = 0; r < DELTA_R; r++) kv[r] += __shfl_xor_sync(FULL, kv[r], w);  // warp_sum's tree
#pragma unroll
            for (int r = 0; r < DELTA_R; r++) {
                const float delta = (vv[r] - kv[r]) * bt;
                o[r] = 0.0f;
#pragma unroll
                for (int a = 0; a < 8; a++) {
                    if (in[a]) {
                        s[r][a] = s[r][a] + kk[a] * delta;
                        o[r] += s[r][a] * qq[a];
                    }
                }
            }
#pragma unroll
            for (int w = 16; w > 0; w >>= 1)
#pragma unroll
                for (int r = 0; r < DELTA_R; r++) o[r] += __shfl_xor_sync(FULL, o[r], w);
            if (lane == 0)
#pragma unroll
                for (int r = 0; r < DELTA_R; r++)
                    if (j0 + r < dv) out[((i64)t * nv + h) * dv + j0 + r] = o[r];
            if (snaps != nullptr && snaps[t] != 0) delta_store(reinterpret_cast<float*>(snaps[t]), s, in, h, j0, dv, dk, lane);
#pragma unroll
            for (int a = 0; a < 8; a++) kk[a] = kn[a], qq[a] = qn[a];
#pragma unroll
            for (int r = 0; r < DELTA_R; r++) vv[r] = vn[r];
            gt = gn, bt = bn;
        }
        delta_store(S, s, in, h, j0, dv, dk, lane);
    }
}

// ops.conv_many: the causal depthwise conv of T inputs (row t at x + t xs) over the K - 1 before
// them (state [K-1, C]), then SiLU, into out [T, C]; the state advances to the last K - 1 inputs.
// conv_out: output (t, c), tap j reading the input K - 1 - j steps back; conv_advance: channel c's
// state once its outputs are made (history rows T .. T + K - 2, history = state then x; row T + r
// is read before row r is written, and T + r > r, so no row is read after it was overwritten).
__device__ __forceinline__ void conv_out(int c, int t, const float* state, const float* w, const float* x, i64 xs,
                                         float* out, int K, int C) {
    float acc = 0.0f;
    for (int j = 0; j < K; j++) {
        const int i = t + j - (K - 1);
        const float src = i >= 0 ? x[(i64)i * xs + c] : state[(i64)(K - 1 + i) * C + c];
        acc = j == 0 ? w[c] * src : acc + w[(i64)j * C + c] * src;
    }
    out[(i64)t * C + c] = acc * sigmoid_t(acc);
}

__device__ __forceinline__ void conv_advance(int c, float* state, const float* x, i64 xs, int T, int K, int C) {
    for (int r = 0; r < K - 1; r++) {
        const int src = T + r;
        state[(i64)r * C + c] = src < K - 1 ? state[(i64)src * C + c] : x[(i64)(src - (K - 1)) * xs + c];
    }
}

// (dev_gates_conv's token step: a thread per channel)
__device__ __forceinline__ void conv_channel(int c, float* state, const float* w, const float* x, i64 xs, float* out,
                                             int T, int K, int C) {
    for (int t = 0; t < T; t++) conv_out(c, t, state, w, x, xs, out, K, C);
    conv_advance(c, state, x, xs, T, K, C);
}

// dev_conv: a thread per channel and CONV_T tokens (a thread per channel alone left a 256-token
// chunk's ~10K channels on too few threads, ~170 us on the H200, 2026-12-02). Only a channel's
// first thread reads the state (CONV_T >= K - 1), and it alone then advances it.
#define CONV_T 16
extern "C" __global__ void dev_conv(float* state, const float* w, const float* x, i64 xs, float* out, int T, int K,
                                    int C) {
    const int parts = (T + CONV_T - 1) / CONV_T;
    for (i64 it = blockIdx.x * (i64)blockDim.x + threadIdx.x; it < (i64)C * parts; it += (i64)gridDim.x * blockDim.x) {
        const int c = (int)(it % C), part = (int)(it / C);
        for (int t = part * CONV_T; t < min(T, (part + 1) * CONV_T); t++) conv_out(c, t, state, w, x, xs, out, K, C);
        if (!part) conv_advance(c, state, x, xs, T, K, C);
    }
}

// dev_conv over a verify's T rows (T <= CONV_T: a thread a channel), and the state after each row
// into its snapshot (snaps[t]: the address of an array like state, 0: none): the K - 1 history rows
// t + 1 .. t + K - 1 (history = state then x), written before the state advances.
extern "C" __global__ void dev_conv_rows(float* state, const float* w, const float* x, i64 xs, float* out, int T, int K,
                                         int C, const i64* snaps) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
        for (int t = 0; t < T; t++) {
            conv_out(c, t, state, w, x, xs, out, K, C);
            if (snaps[t] == 0) continue;
            float* sn = reinterpret_cast<float*>(snaps[t]);
            for (int r = 0; r < K - 1; r++) {
                const int src = t + 1 + r;
                sn[(i64)r * C + c] = src < K - 1 ? state[(i64)src * C + c] : x[(i64)(src - (K - 1)) * xs + c];
            }
        }
        conv_advance(c, state, x, xs, T, K, C);
    }
}

// (l2_row: one warp l2-normalises the n values at xr in place, then scales them by qscale when
// `scaled`: the float64 sum of squares, its warp fold, y = x (1 / sqrt(sum + eps)) [* qscale])
__device__ __forceinline__ void l2_row(float* xr, int n, int lane, float eps, float qscale, bool scaled) {
    double s = 0.0;
    for (int i = lane; i < n; i += 32) s += (double)xr[i] * (double)xr[i];
    s = warp_sum_d(s);
    const float scale = (float)(1.0 / sqrt(s + (double)eps));
    for (int i = lane; i < n; i += 32) {
        float y = xr[i] * scale;
        if (scaled) y = y * qscale;
        xr[i] = y;
    }
}

// dev_l2_qk over T rows of a Gated DeltaNet conv output (row t at x + t xs): each row's nk query
// heads then nk key heads (dk each) l2-normalised, the queries then scaled; dev_l2_qk's arithmetic
// on each head (its bits).
extern "C" __global__ void dev_l2_qk_rows(float* x, int T, i64 xs, int nk, int dk, float eps, float qscale) {
    const int lane = threadIdx.x & 31;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    for (int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); r < T * 2 * nk; r += nw) {
        const int t = r / (2 * nk), hd = r - t * 2 * nk;
        l2_row(x + (i64)t * xs + (i64)hd * dk, dk, lane, eps, qscale, hd < nk);
    }
}

// moe.combine_reference: out[t] = sum over ranks j, from 0, of w[t, j] part[slot[t, j]] (f32).
extern "C" __global__ void dev_combine(const float* part, const i64* slot, const float* w, float* out, int T, int k,
                                       int E) {
    const i64 n = (i64)T * E;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const int t = (int)(i / E), e = (int)(i - (i64)t * E);
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += w[t * k + j] * part[slot[t * k + j] * E + e];
        out[i] = acc;
    }
}

// Elementwise, n values: ops.sigmoid (exp_form: 1 / (1 + exp(-x)), else the tanh form) into out;
// ops.gate_: x *= sigmoid(z), or z sigmoid(z) with silu; ops.softplus: log(1 + exp(x)), stable.
extern "C" __global__ void dev_sigmoid(const float* x, float* out, i64 n, int exp_form) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        out[i] = exp_form ? 1.0f / (expf(-x[i]) + 1.0f) : sigmoid_t(x[i]);
}

extern "C" __global__ void dev_gate(float* x, const float* z, i64 n, int silu) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float s = sigmoid_t(z[i]);
        x[i] = x[i] * (silu ? z[i] * s : s);
    }
}

// qwen4exp's hyper-connection and PLE passes (engine/hyper.py, engine/ple.py), each one launch where
// the array-module form took several (mix_tail was 3 + hc + 2, once per block and layer), the same
// f32 steps in the same order as their CPU kernels, sigmoid as 1 / (exp(-x) + 1):
// dev_mix_tail: out[t, e] = f32(f64(sum over streams c from 0 of sigmoid(u[t, c E + e]) sn[..]) / hc)
// (hyper._mix_tail); dev_inject: streams[t, c E + e] += w[t, c] y[t, e] (hyper._inject);
// dev_ple_output: streams += G + y sigmoid(y) (ple._add_output). All contiguous.
extern "C" __global__ void dev_mix_tail(const float* u, const float* sn, float* out, int T, int hc, int E) {
    const i64 n = (i64)T * E;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / E, e = i - t * E;
        float acc = 0.0f;
        for (int c = 0; c < hc; c++) {
            const i64 j = t * hc * E + (i64)c * E + e;
            acc += (1.0f / (expf(-u[j]) + 1.0f)) * sn[j];
        }
        out[i] = (float)((double)acc / (double)hc);
    }
}

extern "C" __global__ void dev_inject(float* streams, const float* y, const float* w, int T, int hc, int E) {
    const i64 n = (i64)T * hc * E;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / ((i64)hc * E), r = i - t * hc * E, c = r / E, e = r - c * E;
        streams[i] += w[t * hc + c] * y[t * E + e];
    }
}

extern "C" __global__ void dev_ple_output(float* streams, const float* G, const float* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        streams[i] += G[i] + y[i] * (1.0f / (expf(-y[i]) + 1.0f));
}

extern "C" __global__ void dev_softplus(const float* x, float* out, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float v = x[i];
        out[i] = v > 0.0f ? v + log1pf(expf(-v)) : log1pf(expf(v));
    }
}

// Fused forms of operation sequences the blocks make one after the other (engine/backend.py's
// gdn_gates, qk_l2norm_, shared_add_): each the same float operations in the same order as the
// separate kernels and array expressions it replaces, so the bits do not move; one launch instead
// of three or four (a decode step's kernels are short: their number is its time).

// A Gated DeltaNet layer's gates, [T, nv] (n = T nv): beta_out = sigmoid(beta) (dev_sigmoid's
// form), decay = a * softplus(alpha + dt_bias) (dev_softplus's form; a, dt_bias [nv]).
__device__ __forceinline__ void gdn_gate(i64 i, const float* beta, const float* alpha, const float* a, const float* dtb,
                                         float* beta_out, float* decay, int nv) {
    const int h = (int)(i % nv);
    beta_out[i] = sigmoid_t(beta[i]);
    const float v = alpha[i] + dtb[h];
    const float sp = v > 0.0f ? v + log1pf(expf(-v)) : log1pf(expf(v));
    decay[i] = a[h] * sp;
}

extern "C" __global__ void dev_gdn_gates(const float* beta, const float* alpha, const float* a, const float* dtb,
                                         float* beta_out, float* decay, i64 n, int nv) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        gdn_gate(i, beta, alpha, a, dtb, beta_out, decay, nv);
}

// dev_conv and dev_gdn_gates in one launch (a Gated DeltaNet layer's one sequence, its token step
// among them: two independent pieces of work, one launch where there were two): index i < C is
// the conv's channel i, C + i the gates' value i; each the separate kernel's operations.
extern "C" __global__ void dev_gates_conv(const float* beta, const float* alpha, const float* a, const float* dtb,
                                          float* beta_out, float* decay, i64 n, int nv, float* state, const float* w,
                                          const float* x, i64 xs, float* out, int T, int K, int C) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < C + n; i += (i64)gridDim.x * blockDim.x) {
        if (i < C)
            conv_channel((int)i, state, w, x, xs, out, T, K, C);
        else
            gdn_gate(i - C, beta, alpha, a, dtb, beta_out, decay, nv);
    }
}

// The queries and keys of one token's Gated DeltaNet conv output, in place: `rows` contiguous rows
// of n (the nq query heads, then the key heads), each l2-normalised as dev_rmsnorm's l2 form does
// it, the first nq then multiplied by `qscale` (the array expression q *= scale). One warp per row.
extern "C" __global__ void dev_l2_qk(float* x, int nq, int rows, int n, float eps, float qscale) {
    const int lane = threadIdx.x & 31;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    for (int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); r < rows; r += nw)
        l2_row(x + (i64)r * n, n, lane, eps, qscale, r < nq);
}

// The shared expert's gated output into the routed sum, [T, E] (n = T E): y *= sigmoid(g[t]),
// then out += y (g [T]: the gate's one output per token).
extern "C" __global__ void dev_shared_add(float* out, float* y, const float* g, i64 n, int E) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const float yy = y[i] * sigmoid_t(g[i / E]);
        y[i] = yy;
        out[i] = out[i] + yy;
    }
}

// NeoX RoPE in place on `rows` rows of a head (row r at x + r xs, row r of token r / heads): the
// first 2 half elements rotate by the token's cos/sin [T, half] (ops.Rope.apply_).
// dev_rope of one token's heads at the device position p = *pos: cos and sin read from the rope's
// table [C, half] (row p: rope.cos_sin at p, made once by the host: DeviceBackend._rope_table), so a
// captured step replays at every position with nothing staged per token
extern "C" __global__ void dev_rope_at(float* x, i64 xs, const float* cs, const float* sn, const int* pos, int rows, int heads,
                                       int half) {
    const i64 n = (i64)rows * half, p = *pos;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(i / half), j = (int)(i - (i64)r * half), t = r / heads;
        float* xr = x + (i64)r * xs;
        const float c = cs[(p + t) * half + j], s = sn[(p + t) * half + j];
        const float x1 = xr[j], x2 = xr[half + j];
        xr[j] = x1 * c - x2 * s;
        xr[half + j] = x2 * c + x1 * s;
    }
}

extern "C" __global__ void dev_rope(float* x, i64 xs, const float* cs, const float* sn, int rows, int heads, int half) {
    const i64 n = (i64)rows * half;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const int r = (int)(i / half), j = (int)(i - (i64)r * half), t = r / heads;
        float* xr = x + (i64)r * xs;
        const float c = cs[(i64)t * half + j], s = sn[(i64)t * half + j];
        const float x1 = xr[j], x2 = xr[half + j];
        xr[j] = x1 * c - x2 * s;
        xr[half + j] = x2 * c + x1 * s;
    }
}

// ---------------------------------------------------------------------------------------------
// The routed experts of one token on the device (DeviceExperts.token)

// engine/ops.py's portable exp and silu, operation for operation (its comment says why: a hit made
// here and a miss made by the CPU must give an expert's hidden activation with the same bits)
__device__ __forceinline__ float exp_p(float x) {
    const float C = 87.0f;
    if (x < -C) x = -C;
    if (x > C) x = C;
    const float n = floorf(x * 1.4426950408889634f + 0.5f);
    const float r = (x - n * 0.693359375f) - n * -2.1219444005469057e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * __uint_as_float((unsigned)((int)n + 127) << 23);
}

// h = up * silu(gate) for the k experts whose slot is not -1 (a miss's h is the CPU's): gu f32
// [2k, F] (gate rows, then up rows), h f32 [k, F]
extern "C" __global__ void dev_hidden(const float* gu, const int* slot, float* h, int k, int F) {
    const i64 n = (i64)k * F;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const int j = (int)(i / F);
        if (slot[j] < 0) continue;
        const float z = gu[i];
        h[i] = gu[n + i] * (z / (1.0f + exp_p(-z)));
    }
}

// dev_hidden and the ActQ of h (the downs' input) in one launch: a warp per 32-element block of
// h (F a multiple of 32, so a block lies in one expert's row), each block quantized as it is
// written, the actq kernel's bits (actq_block); a miss's rows are skipped (the CPU's). q i8 [k, F],
// d f32 [k, F / 32], s16 i32 [k, F / 16].
extern "C" __global__ void dev_hidden_q(const float* gu, const int* slot, float* h, signed char* q, float* d, int* s16,
                                        int k, int F) {
    const int lane = threadIdx.x & 31;
    const i64 n = (i64)k * F, nb = n >> 5, nw = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nb; b += nw) {
        const i64 i = 32 * b + lane;
        if (slot[(int)(i / F)] < 0) continue;  // (the same for the warp's lanes)
        const float z = gu[i];
        const float y = gu[n + i] * (z / (1.0f + exp_p(-z)));
        h[i] = y;
        actq_block(y, q + 32 * b, d, s16, b);
    }
}

// dev_gate (x *= sigmoid(z), or z sigmoid(z) with silu) and the ActQ of x (the next product's
// input) in one launch: the shared expert's up * silu(gate) before its down, gated attention's
// output gate before its out projection (each was a gate and an actq launch; the attention's, a
// dev_sigmoid, an array multiply and an actq). x contiguous [rows, n], n a multiple of 32 (a
// warp's 32-element block lies in one row); row r of z at z + r zs (a strided view: qg[:, :, D:]);
// q i8, d f32 [total / 32], s16 i32 [total / 16]: x's ActQ, actq_block's bits. A warp per block.
extern "C" __global__ void dev_gate_q(float* x, const float* z, i64 zs, int n, int silu, signed char* q, float* d,
                                      int* s16, i64 total) {
    const int lane = threadIdx.x & 31;
    const i64 nb = total >> 5, nw = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nb; b += nw) {
        const i64 i = 32 * b + lane, r = i / n;
        const float zz = z[r * zs + (i - r * n)];
        const float s = sigmoid_t(zz);
        const float y = x[i] * (silu ? zz * s : s);
        x[i] = y;
        actq_block(y, q + 32 * b, d, s16, b);
    }
}

// A hyper-connection mix's gates (hyper.lowrank_gates_reference) in one launch: a = silu(d / hc)
// with its ActQ (the up product's input; n = T R values, a multiple of 32: a warp a 32-element
// block, actq_block's bits) and w = 2 sigmoid(inj / hc) (nw = T hc values; 0: output_hc, no inject),
// sigmoid as dev_sigmoid's exp form, 1 / (exp(-x) + 1): the steps the array-module form made in 7
// launches (2 dev_sigmoid, 4 elementwise, an actq).
extern "C" __global__ void dev_hc_gates_q(const float* d, const float* inj, float* a, float* w, signed char* q, float* qd,
                                          int* s16, i64 n, i64 nw, float hc) {
    const int lane = threadIdx.x & 31;
    const i64 nb = n >> 5, warps = ((i64)gridDim.x * blockDim.x) >> 5;
    for (i64 b = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < nb; b += warps) {
        const i64 i = 32 * b + lane;
        const float x = d[i] / hc;
        const float y = x * (1.0f / (expf(-x) + 1.0f));
        a[i] = y;
        actq_block(y, q + 32 * b, qd, s16, b);
    }
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < nw; i += (i64)gridDim.x * blockDim.x)
        w[i] = 2.0f * (1.0f / (expf(-(inj[i] / hc)) + 1.0f));
}

// The router's top-k of one token (moe.route_topk's rule): softmax of the logits [X] in float64
// (p = exp(l - max) / sum), the k largest (ties: the lower expert id), their probabilities
// renormalised to sum to 1. -> ids [k], w f32 [k] (the combine's f32 weights), and slot[j] =
// table[ids[j]] (the layer's row of the slot table: the slot holding the expert, or -1).
// A block of blockDim >= X threads (a logit each, X <= 1024), k <= 32, dynamic shared memory
// 512 + 4 blockDim + 8 (blockDim / 32) k bytes (DeviceExperts.route sizes the launch).
//
// It was one warp making k rounds of a scan over its 32 logits a lane, each round a serial chain
// of compares, two shuffles per fold step and a float64 exp on every lane, into `double pj[32]`
// indexed by the round (local memory), after 16 float64 exps in a row a lane for the sum: ~20 us
// a layer on the H200 (2026-12-02, the per-kernel floor), one warp of one SM doing it all in
// series. Now every step is wide: the max and the sum a logit a thread (one float64 exp each, in
// parallel); each warp ranks its own 32 logits (32 independent shared-memory reads a lane), its
// best k go to a candidate list, and each candidate up to the edge (below) is ranked among the nw
// k candidates by a warp's ballots: its place in ids. The order is total (logit descending, then id
// ascending: distinct ids), so the ranks are distinct and exactly the host's selection. The sum
// over the logits folds in another order than before (the float64 weights may differ in the
// last bits; w is their f32 rounding).
__device__ __forceinline__ void route_block(const float* logits, int X, int k, const int* table, int* ids, float* w,
                                            int* slot) {
    STRATA_SMEM(smem);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nw = blockDim.x >> 5, C = nw * k;
    double* red = reinterpret_cast<double*>(smem);  // [32] a partial max, then a partial sum, per warp
    double* pj = red + 32;                           // [32] the chosen experts' probabilities, by rank
    float* lv = reinterpret_cast<float*>(pj + 32);   // [blockDim] the logits (-inf past X)
    float* cl = lv + blockDim.x;                     // [nw k] each warp's best k: logit,
    int* ci = reinterpret_cast<int*>(cl + C);        //   and id (0x7fffffff: none, after every real one)
    const float inf = __uint_as_float(0x7f800000u);
    const bool valid = t < X;
    const float l = valid ? logits[t] : -inf;
    lv[t] = l;
    if (lane < k) cl[warp * k + lane] = -inf, ci[warp * k + lane] = 0x7fffffff;
    float m = l;
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    if (lane == 0) red[warp] = (double)m;  // (exact: a float widened)
    __syncthreads();
    m = -inf;
    for (int v = 0; v < nw; v++) m = fmaxf(m, (float)red[v]);
    // this logit's rank among its warp's (the logits before it in the order)
    int r = 0;
    for (int j = 0; j < 32; j++) {
        const int i = 32 * warp + j;
        const float o = lv[i];
        r += i < X && (o > l || (o == l && i < t));
    }
    __syncthreads();  // every thread has read red's maxima
    const double s = warp_sum_d(valid ? exp((double)(l - m)) : 0.0);
    if (lane == 0) red[warp] = s;
    if (valid && r < k) cl[warp * k + r] = l, ci[warp * k + r] = t;
    __syncthreads();
    double sum = 0.0;
    for (int v = 0; v < nw; v++) sum += red[v];
    // The edge: the first in the order of the warps' k-th candidates (lanes < nw read one each, a
    // warp fold; a warp of fewer than k logits has the empty entry there, last in the order). The
    // k logits of its warp up to it precede everything after it, so only candidates up to it can
    // make the k. (Each candidate ranked by one thread over all nw k candidates, C compares in a
    // serial chain on a few warps, was most of ~11 us a layer at X = 512 on the H200, 2026-12-02.)
    float ev = lane < nw ? cl[lane * k + k - 1] : -inf;
    int ei = lane < nw ? ci[lane * k + k - 1] : 0x7fffffff;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL, ev, o);
        const int oi = __shfl_xor_sync(FULL, ei, o);
        if (ov > ev || (ov == ev && oi < ei)) ev = ov, ei = oi;
    }
    // each warp ranks the candidates c = warp, warp + nw, ... up to the edge: lane j of a round
    // compares candidate j0 + j with it, a ballot counts those before it
    for (int c = warp; c < C; c += nw) {
        const float cv = cl[c];
        const int cid = ci[c];
        if (cid == 0x7fffffff || cv < ev || (cv == ev && cid > ei)) continue;  // (the same for the whole warp)
        int rank = 0;
        for (int j0 = 0; j0 < C; j0 += 32) {
            const int j = j0 + lane;
            const float o = j < C ? cl[j] : -inf;
            const int oi = j < C ? ci[j] : 0x7fffffff;
            rank += __popc(__ballot_sync(FULL, o > cv || (o == cv && oi < cid)));
        }
        if (lane == 0 && rank < k) {
            ids[rank] = cid;
            slot[rank] = table[cid];
            pj[rank] = exp((double)(cv - m)) / sum;
        }
    }
    __syncthreads();
    if (t < k) {
        double top = 0.0;  // in rank order, as moe.route_topk's renormalisation
        for (int j = 0; j < k; j++) top += pj[j];
        w[t] = (float)(pj[t] / top);
    }
}

extern "C" __global__ void dev_route(const float* logits, int X, int k, const int* table, int* ids, float* w, int* slot) {
    route_block(logits, X, k, table, ids, w, slot);
}

// A verify's rows (DeviceExperts.rows: one-token sequences whose experts are all resident): block
// b routes row b of logits [rows, X] as dev_route routes a token (its bits), its ids at ids + b
// ids_stride (the row's line of the rows' ids, per layer), its w and slots at b k.
extern "C" __global__ void dev_route_n(const float* logits, int X, int k, const int* table, int* ids, int ids_stride,
                                       float* w, int* slot) {
    const i64 b = blockIdx.x;
    route_block(logits + b * X, X, k, table, ids + b * ids_stride, w + b * k, slot + b * k);
}

// (route_one: one warp routing one token by the same rule, the warp form dev_route had, for the
// chunk's rows: dev_route_rows, a block a token; slot may be null, where nothing is looked up)
__device__ __forceinline__ void route_one(const float* logits, int X, int k, const int* table, int* ids, float* w,
                                          int* slot) {
    // Lane l holds logits l + 32 c in registers (X <= 1024; DeviceExperts.token routes larger
    // routers on the host): the k rounds of the top-k scan registers instead of re-reading the
    // logits. The sums keep their order (lane by lane, c ascending, then the warp fold).
    const int lane = threadIdx.x & 31;
    const float inf = __uint_as_float(0x7f800000u);
    float lv[32];
#pragma unroll
    for (int c = 0; c < 32; c++) lv[c] = lane + 32 * c < X ? logits[lane + 32 * c] : -inf;
    float m = -inf;
#pragma unroll
    for (int c = 0; c < 32; c++) m = fmaxf(m, lv[c]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    double sum = 0.0;
#pragma unroll
    for (int c = 0; c < 32; c++)
        if (lane + 32 * c < X) sum += exp((double)(lv[c] - m));
    sum = warp_sum_d(sum);
    double top = 0.0;
    double pj[32];  // k <= 32
    int prev = -1;
    float prev_l = inf;
    for (int j = 0; j < k; j++) {
        // the best below (prev_l, prev) in the order (logit descending, id ascending)
        float bl = -inf;
        int bi = 0x7fffffff;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            const int i = lane + 32 * c;
            const float l = lv[c];
            const bool below = l < prev_l || (l == prev_l && i > prev);
            if (i < X && below && (l > bl || (l == bl && i < bi))) bl = l, bi = i;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ol = __shfl_xor_sync(FULL, bl, o);
            const int oi = __shfl_xor_sync(FULL, bi, o);
            if (ol > bl || (ol == bl && oi < bi)) bl = ol, bi = oi;
        }
        prev_l = bl, prev = bi;
        pj[j] = exp((double)(bl - m)) / sum;
        top += pj[j];
        if (lane == 0) {
            ids[j] = bi;
            if (slot) slot[j] = table[bi];
        }
    }
    if (lane == 0)
        for (int j = 0; j < k; j++) w[j] = (float)(pj[j] / top);
}

// dev_route for each of T tokens (a prompt chunk): block t's first warp routes logits row t [X]
// into ids [t k, t k + k) and w [t k, t k + k) (the same rule: the same experts and weights).
extern "C" __global__ void dev_route_rows(const float* logits, int X, int k, int* ids, float* w) {
    if (threadIdx.x >= 32) return;
    const i64 t = blockIdx.x;
    route_one(logits + t * X, X, k, nullptr, ids + t * k, w + t * k, nullptr);
}

// engine/moe.py's Groups of a chunk's routing on the device, and the tiles of its grouped products
// (gpu_kernels.cu mmx) on the slots of a layer whose experts are all resident. ids [N]: pair i is
// (token i / k, rank i % k). -> tok [N]: the token of grouped pair p (Groups.rows: expert by expert,
// pairs in order within one); pos i64 [N]: where pair i sits (Groups.slot, what dev_combine reads);
// tiles (i64 rows of 5: rest plane address, scale plane address, first pair, pairs, output base):
// gate tiles_gu[0, M), up tiles_gu[M, 2M) (base N: the up rows follow the gate rows), down
// tiles_d[0, M); tiles of up to `tile` pairs, expert by expert, and n = 0 (mmx skips them) from
// the last one to M. A slot is slot_bytes at arena + table[e] slot_bytes: gate, up (gu_bytes each,
// their scales gu_sc into each), down (scales d_sc into it): engine/tier/slots.py's layout.
// cnt, start: scratch int [X]; tstart int [X + 1]; hist int [(blockDim / 32) X]. One block:
// deterministic (no atomics), the same output for any block size.
//
// A stable counting sort, linear in the pairs: warp w of the nw takes the pairs of its own
// contiguous segment (the segments in pair order), 32 at a time: __match_any_sync gives each lane
// the lanes of its expert, the lowest of them adds their count to the warp's row of hist. Then a
// thread per expert turns its column into exclusive sums over the warps (so hist[w][e] is the
// pairs of e in the segments before w) and the experts' exclusive sums give start and tstart; the
// warps walk their segments again, pair i of expert e going to start[e] + hist[w][e] + the lanes
// of e below it, the lowest advancing hist[w][e]. So the pairs of an expert keep their order: the
// same tok, pos and tiles as the version before it, which had a warp per expert read all N ids
// (X N / 32 reads in all: 5.1 ms a layer for a 4096-token chunk's 40960 pairs of 512 experts on the
// H200, 2026-12-02; this one reads them twice).
extern "C" __global__ void dev_group(const int* ids, int N, int k, int X, const int* table, const unsigned char* arena,
                                     const unsigned char* stage, i64 slot_bytes, i64 gu_bytes, i64 gu_sc, i64 d_sc, int tile, int M, int* tok,
                                     i64* pos, i64* tiles_gu, i64* tiles_d, int* cnt, int* start, int* tstart, int* hist,
                                     int smem_ids) {
    if (blockIdx.x) return;
    STRATA_SMEM(smem);
    int* const s_ids = reinterpret_cast<int*>(smem);
    const bool in_smem = N <= smem_ids;  // (the launch's shared memory holds smem_ids ints)
    for (int i = threadIdx.x; in_smem && i < N; i += blockDim.x) s_ids[i] = ids[i];
    for (int i = threadIdx.x; i < (int)(blockDim.x >> 5) * X; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    const int* src = in_smem ? s_ids : ids;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const unsigned below = (1u << lane) - 1u;
    const int seg = ((N + nw - 1) / nw + 31) & ~31;  // pairs a warp's segment (whole steps of 32)
    const int lo = min(N, warp * seg), hi = min(N, lo + seg);
    int* const row = hist + (i64)warp * X;
    for (int i0 = lo; i0 < hi; i0 += 32) {  // each warp's count of each expert in its segment
        const int i = i0 + lane;
        const int e = i < hi ? src[i] : -1;  // (-1: no pair; those lanes match only each other)
        const unsigned m = __match_any_sync(FULL, e);
        if (e >= 0 && !(m & below)) row[e] += __popc(m);
        __syncwarp();
    }
    __syncthreads();
    for (int e = threadIdx.x; e < X; e += blockDim.x) {  // hist[w][e]: e's pairs in the segments before w
        int s = 0;
        for (int w = 0; w < nw; w++) {
            const int c = hist[(i64)w * X + e];
            hist[(i64)w * X + e] = s;
            s += c;
        }
        cnt[e] = s;
    }
    __syncthreads();
    if (warp == 0) {  // exclusive prefix sums of the pairs and the tiles: lane l takes X / 32 experts in a row
        const int per = (X + 31) / 32, e0 = min(X, lane * per), e1 = min(X, e0 + per);
        int s = 0, ts = 0;
        for (int e = e0; e < e1; e++) s += cnt[e], ts += (cnt[e] + tile - 1) / tile;
        int si = s, tsi = ts;  // inclusive over the lanes
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(FULL, si, o), b = __shfl_up_sync(FULL, tsi, o);
            if (lane >= o) si += a, tsi += b;
        }
        s = si - s, ts = tsi - ts;
        for (int e = e0; e < e1; e++) {
            start[e] = s, tstart[e] = ts;
            s += cnt[e];
            ts += (cnt[e] + tile - 1) / tile;
        }
        if (lane == 31) tstart[X] = tsi;
    }
    __syncthreads();
    for (int i0 = lo; i0 < hi; i0 += 32) {  // each pair to its place: the warps' segments in order, lanes in order
        const int i = i0 + lane;
        const int e = i < hi ? src[i] : -1;
        const unsigned m = __match_any_sync(FULL, e);
        const int at = e >= 0 ? start[e] + row[e] + __popc(m & below) : 0;
        __syncwarp();  // (every lane has read row[e] before the lowest lane of e advances it)
        if (e >= 0) {
            tok[at] = i / k;
            pos[i] = at;
            if (!(m & below)) row[e] += __popc(m);
        }
        __syncwarp();
    }
    for (int e = warp; e < X; e += nw) {  // the tiles: a warp an expert, a lane a tile
        const int c = cnt[e];
        if (!c) continue;
        // a slot of the cache, or (table[e] = -1 - s) slot s of a layer streamed whole (LayerStream)
        const i64 base = table[e] >= 0 ? (i64)arena + (i64)table[e] * slot_bytes : (i64)stage + (i64)(-1 - table[e]) * slot_bytes;
        for (int t = lane; t * tile < c; t += 32) {
            const i64 first = start[e] + (i64)t * tile, n = min(tile, c - t * tile), r = tstart[e] + t;
            i64* g = tiles_gu + 5 * r;
            i64* u = tiles_gu + 5 * (M + r);
            i64* d = tiles_d + 5 * r;
            g[0] = base, g[1] = base + gu_sc, g[2] = first, g[3] = n, g[4] = 0;
            u[0] = base + gu_bytes, u[1] = base + gu_bytes + gu_sc, u[2] = first, u[3] = n, u[4] = N;
            d[0] = base + 2 * gu_bytes, d[1] = base + 2 * gu_bytes + d_sc, d[2] = first, d[3] = n, d[4] = 0;
        }
    }
    for (int r = tstart[X] + threadIdx.x; r < M; r += blockDim.x) {
        tiles_gu[5 * r + 3] = 0;
        tiles_gu[5 * (M + r) + 3] = 0;
        tiles_d[5 * r + 3] = 0;
    }
}

// moe.combine_reference for one token whose rows come from two places: rank j's row is hit[j]
// where its slot is held (computed here) and miss[j] otherwise (the CPU's, copied up): out[e] =
// sum over ranks j, from +0 in rank order, of w[j] row_j[e] (the CPU's _combine's order).
extern "C" __global__ void dev_combine_slots(const float* hit, const float* miss, const int* slot, const float* w,
                                             float* out, int k, int E) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += w[j] * (slot[j] >= 0 ? hit : miss)[(i64)j * E + e];
        out[e] = acc;
    }
}

// dev_combine_slots of `rows` tokens in one launch (a verify's rows: DeviceExperts.rows): token t's
// k products at hit + t k E, its slots and weights at t k, its sum into out + t E. Each sum the
// same operations in the same order as dev_combine_slots: its bits. With y (not null), then
// dev_shared_add on the sums (the rows' shared experts' y [rows, E] and gate logits g [rows, 1],
// made before the routed sums: MoE.forward), as dev_combine_shared does for one token: the two
// launches' operations in their order, so their bits.
extern "C" __global__ void dev_combine_n(const float* hit, const float* miss, const int* slot, const float* w,
                                         float* out, int k, int E, int rows, float* y, const float* g) {
    const i64 n = (i64)rows * E;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / E, e = i - t * E;
        const float* wt = w + t * k;
        const int* st = slot + t * k;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += wt[j] * (st[j] >= 0 ? hit : miss)[(t * k + j) * E + e];
        if (y) {
            const float yy = y[i] * sigmoid_t(g[t]);
            y[i] = yy;
            acc = acc + yy;
        }
        out[i] = acc;
    }
}

// dev_combine_slots, then dev_shared_add on its output, in one launch (one token whose shared
// expert's y [E] and gate logit g [1] are made before the routed sum: MoE.forward): the sum's
// value, y *= sigmoid(g), out = sum + y. The same operations in the same order: the two launches' bits.
extern "C" __global__ void dev_combine_shared(const float* hit, const float* miss, const int* slot, const float* w,
                                              float* out, int k, int E, float* y, const float* g) {
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc += w[j] * (slot[j] >= 0 ? hit : miss)[(i64)j * E + e];
        const float yy = y[e] * sigmoid_t(g[0]);
        y[e] = yy;
        out[e] = acc + yy;
    }
}

// ---------------------------------------------------------------------------------------------
// One token's attention against its cache, with the position read from device memory (`pos`, an
// int32 the host writes before the step): the same launches serve every position, so a token step
// can be captured once as a CUDA graph and replayed (DeviceBackend.token_step).

// binary16 <-> float32 by integer manipulation, round to nearest even (the conversion CuPy's and
// numpy's astype(float16) make): the same bits on a card and under the emulation
__device__ __forceinline__ unsigned short f32_f16(float f) {
    const unsigned x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (unsigned short)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));  // inf, NaN
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to 65520 or more: inf
    if (ax < 0x38800000u) {  // below 2^-14: an f16 subnormal (unit 2^-24) or zero
        const unsigned e = ax >> 23;
        if (e < 102u) return (unsigned short)sign;
        const unsigned m = (ax & 0x7fffffu) | 0x800000u, s = 126u - e;
        unsigned q = m >> s;
        const unsigned rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
        if (rem > half || (rem == half && (q & 1u))) q++;
        return (unsigned short)(sign | q);
    }
    const unsigned mant = ax & 0x7fffffu;
    unsigned q = (((ax >> 23) - 112u) << 10) | (mant >> 13);
    const unsigned rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;  // a carry into the exponent is right
    return (unsigned short)(sign | q);
}

__device__ __forceinline__ float f16_to_f32(unsigned h) {
    const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    const float v = (float)m * 5.9604644775390625e-8f;  // m 2^-24: exact
    return sign ? -v : v;
}

// the cache element i of a kind (0 f32, 1 f16, 2 int8 with a scale per 32)
__device__ __forceinline__ float kv_at(const void* S, const float* scale, int kind, i64 i) {
    if (kind == 0) return reinterpret_cast<const float*>(S)[i];
    if (kind == 1) return f16_to_f32(reinterpret_cast<const unsigned short*>(S)[i]);
    return (float)reinterpret_cast<const signed char*>(S)[i] * scale[i >> 5];
}

// k, v f32 [Hkv, D] into the caches at position *pos (DeviceKVCache's layout [Hkv, ctx, D]; int8:
// d = amax / 127 per 32 elements, q = rint(x / d), 0 where d = 0, its scales [Hkv, ctx, D / 32]).
// A warp per 32 elements.
// (kv_put: lane `lane` of 32-element block b of head h's key (which 0) or value (1), x, stored at
// position p in the cache's kind; a whole warp calls it: int8's scale is the warp's max)
__device__ __forceinline__ void kv_put(float x, void* K, void* V, float* Ks, float* Vs, int which, int h, int b, int lane,
                                       int p, int ctx, int D, int nb, int kind) {
    const i64 at = ((i64)h * ctx + p) * D + 32 * b + lane;
    void* S = which ? V : K;
    if (kind == 0) {
        reinterpret_cast<float*>(S)[at] = x;
    } else if (kind == 1) {
        reinterpret_cast<unsigned short*>(S)[at] = f32_f16(x);
    } else {
        float a = fabsf(x);
        for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(FULL, a, o));
        const float d = a / 127.0f;
        reinterpret_cast<signed char*>(S)[at] = d > 0.0f ? (signed char)(int)rintf(x / d) : (signed char)0;
        if (lane == 0) (which ? Vs : Ks)[((i64)h * ctx + p) * nb + b] = d;
    }
}

extern "C" __global__ void dev_kv_write(const float* k, const float* v, void* K, void* V, float* Ks, float* Vs,
                                        const int* pos, int Hkv, int ctx, int D, int kind) {
    const int lane = threadIdx.x & 31, nb = D >> 5, p = *pos;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    for (int w = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); w < 2 * Hkv * nb; w += nw) {
        const int which = w / (Hkv * nb), h = (w % (Hkv * nb)) / nb, b = w % nb;
        kv_put((which ? v : k)[(i64)h * D + 32 * b + lane], K, V, Ks, Vs, which, h, b, lane, p, ctx, D, nb, kind);
    }
}

// dev_kv_write of a verify's T rows (row t's k and v at k + t Hkv D, v + t Hkv D, at position
// pos[t]), every row's in one launch: each value written as dev_kv_write writes it.
extern "C" __global__ void dev_kv_write_rows(const float* k, const float* v, void* K, void* V, float* Ks, float* Vs,
                                             const int* pos, int T, int Hkv, int ctx, int D, int kind) {
    const int lane = threadIdx.x & 31, nb = D >> 5;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    for (int w = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); w < T * 2 * Hkv * nb; w += nw) {
        const int t = w / (2 * Hkv * nb), wr = w - t * 2 * Hkv * nb, p = pos[t];
        const int which = wr / (Hkv * nb), h = (wr % (Hkv * nb)) / nb, b = wr % nb;
        kv_put((which ? v : k)[((i64)t * Hkv + h) * D + 32 * b + lane], K, V, Ks, Vs, which, h, b, lane, p, ctx, D, nb,
               kind);
    }
}

// Softmax attention of one token's queries q [H, D] over the cached keys and values 0 .. *pos
// (head h reads KV head h / (H / Hkv)) -> out [H, D]. A warp per head: lane i scores keys i, i +
// 32, ... (into sc [H, ctx]), the warp takes their max and sum, then lane j sums dimensions j, j +
// 32, ... of p V. Scores, max and the weights in f32, as the array form (DeviceBackend.attention).
extern "C" __global__ void dev_attn_one(const float* q, const void* K, const void* V, const float* Ks, const float* Vs,
                                        const int* pos, float* sc, float* out, int H, int Hkv, int ctx, int D,
                                        float scale, int kind) {
    const int lane = threadIdx.x & 31, n = *pos + 1;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    for (int h = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); h < H; h += nw) {
        const int kv = h / (H / Hkv);
        const float* qh = q + (i64)h * D;
        float* s = sc + (i64)h * ctx;
        float m = -__uint_as_float(0x7f800000u);
        for (int i = lane; i < n; i += 32) {
            const i64 row = ((i64)kv * ctx + i) * D;
            float acc = 0.0f;
            for (int d = 0; d < D; d++) acc += qh[d] * kv_at(K, Ks, kind, row + d);
            acc = acc * scale;
            s[i] = acc;
            m = fmaxf(m, acc);
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
        float sum = 0.0f;
        for (int i = lane; i < n; i += 32) {
            const float e = expf(s[i] - m);
            s[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        __syncwarp();
        for (int d = lane; d < D; d += 32) {
            float acc = 0.0f;
            for (int i = 0; i < n; i++) acc += (s[i] / sum) * kv_at(V, Vs, kind, ((i64)kv * ctx + i) * D + d);
            out[(i64)h * D + d] = acc;
        }
        __syncwarp();
    }
}

// The same attention with the keys split among warps (flash-decode): dev_attn_one is a warp per
// head, each lane scoring whole keys one after another, so its time grew with the context (~4 us a
// position on the H200 at 24 heads, docs/performance.md). Here a warp takes (head h, split s) of a
// head's ns = min(S, ceil(n / L)) splits of the n = *pos + 1 keys, each split ceil(n / ns) keys in
// order (L: the fewest keys a split takes); lane j holds dimensions P j .. P j + P - 1 (P = D / 32).
// The running max m, sum l and the weighted values o (lane j's dimensions) are kept as in a flash-
// attention pass; -> part [h, s] = (m, l, o[D]). dev_attn_merge then joins a head's splits: M = max
// m_s, out = sum o_s e^(m_s - M) / sum l_s e^(m_s - M). The splits past ns write nothing and are not
// read. Parts: [H, S, D + 2].
// Why so: the splits were L = 32 keys fixed by the context (ctx / 8192 keys at the least), one key
// scored at a time by the whole warp: ~4 us a key on the H200 (131 us at position 320 of a 328-token
// context, the largest kernel of the token step after the LM head; a 262144-token context would have
// given a head one warp up to 8192 positions). Now the splits follow the position read on the
// device (the same graph replays at every position), KEYS keys are scored per round with all their
// rows' loads in flight at once, and an f16 row comes in as one 16-byte load a lane (D = 256).
// (attn_split: the kernel's work over n keys, key i at position toks[i], or at i where toks is null:
// dev_attn_split takes positions 0 .. *pos, dev_attn_split_sel QSA's selection)
#define KEYS 4

// lane's P consecutive elements of the cache row whose first element is `at` into r[0 .. P) (zeros past)
__device__ __forceinline__ void kv_lane(const void* S, const float* scale, int kind, i64 at, int P, float* r) {
    if (kind == 1 && P == 8) {  // f16, D = 256: one 16-byte load
        const uint4 u = *reinterpret_cast<const uint4*>(STRATA_ALIGNED(reinterpret_cast<const unsigned short*>(S) + at, 16));
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int t = 0; t < 8; t++) r[t] = f16_to_f32((w[t >> 1] >> (16 * (t & 1))) & 0xffffu);
        return;
    }
#pragma unroll
    for (int t = 0; t < 8; t++) r[t] = t < P ? kv_at(S, scale, kind, at + t) : 0.0f;
}

__device__ __forceinline__ void attn_split(const float* q, const void* K, const void* V, const float* Ks, const float* Vs,
                                           const int* toks, int n, float* part, int H, int Hkv, int ctx, int D, int L,
                                           int S, float scale, int kind) {
    const int lane = threadIdx.x & 31, P = D >> 5;
    const int ns = min(S, (n + L - 1) / L), per = (n + ns - 1) / max(ns, 1);
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    const float inf = __uint_as_float(0x7f800000u);
    for (int w = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); w < H * ns; w += nw) {
        const int h = w / ns, sp = w % ns, kv = h / (H / Hkv);
        const int i0 = sp * per, i1 = min(i0 + per, n);
        float qr[8], o[8];
#pragma unroll
        for (int t = 0; t < 8; t++) {
            qr[t] = t < P ? q[(i64)h * D + P * lane + t] : 0.0f;
            o[t] = 0.0f;
        }
        float m = -inf, l = 0.0f;
        for (int i = i0; i < i1; i += KEYS) {
            float kr[KEYS][8], vr[KEYS][8], sc[KEYS];
#pragma unroll
            for (int j = 0; j < KEYS; j++) {
                const int key = i + j < i1 ? i + j : i;  // (past the split: key i again, weighted 0 below)
                const i64 row = ((i64)kv * ctx + (toks ? toks[key] : key)) * D + P * lane;
                kv_lane(K, Ks, kind, row, P, kr[j]);
                kv_lane(V, Vs, kind, row, P, vr[j]);
            }
#pragma unroll
            for (int j = 0; j < KEYS; j++) {
                float acc = 0.0f;
#pragma unroll
                for (int t = 0; t < 8; t++)
                    if (t < P) acc += qr[t] * kr[j][t];
                sc[j] = acc;
            }
#pragma unroll
            for (int j = 0; j < KEYS; j++) sc[j] = warp_sum(sc[j]) * scale;
            float mn = m;
#pragma unroll
            for (int j = 0; j < KEYS; j++)
                if (i + j < i1) mn = fmaxf(mn, sc[j]);
            const float c = expf(m - mn);  // (m = -inf at the first key: c = 0)
            float e[KEYS];
#pragma unroll
            for (int j = 0; j < KEYS; j++) e[j] = i + j < i1 ? expf(sc[j] - mn) : 0.0f;
            l = l * c;
#pragma unroll
            for (int j = 0; j < KEYS; j++) l += e[j];
#pragma unroll
            for (int t = 0; t < 8; t++) {
                float a = o[t] * c;
#pragma unroll
                for (int j = 0; j < KEYS; j++) a += e[j] * vr[j][t];
                o[t] = a;
            }
            m = mn;
        }
        float* pp = part + ((i64)h * S + sp) * (D + 2);
#pragma unroll
        for (int t = 0; t < 8; t++)
            if (t < P) pp[2 + P * lane + t] = o[t];
        if (lane == 0) pp[0] = m, pp[1] = l;
    }
}

extern "C" __global__ void dev_attn_split(const float* q, const void* K, const void* V, const float* Ks, const float* Vs,
                                          const int* pos, float* part, int H, int Hkv, int ctx, int D, int L, int S,
                                          float scale, int kind) {
    attn_split(q, K, V, Ks, Vs, nullptr, *pos + 1, part, H, Hkv, ctx, D, L, S, scale, kind);
}

// dev_attn_split of a verify's T rows, one after another in one launch: row t's queries at q + t H D
// over positions 0 .. pos[t] (every row's keys written first: dev_kv_write_rows; a row reads none
// past its own), its splits into part + t H S (D + 2). Each row's work is dev_attn_split's: its bits.
extern "C" __global__ void dev_attn_split_rows(const float* q, const void* K, const void* V, const float* Ks,
                                               const float* Vs, const int* pos, float* part, int T, int H, int Hkv,
                                               int ctx, int D, int L, int S, float scale, int kind) {
    for (int t = 0; t < T; t++)
        attn_split(q + (i64)t * H * D, K, V, Ks, Vs, nullptr, pos[t] + 1, part + (i64)t * H * S * (D + 2), H, Hkv, ctx,
                   D, L, S, scale, kind);
}

// QSA's attention over its selection toks[0 .. *count) (dev_qsa_select) split among warps as
// dev_attn_split splits positions; dev_attn_merge_sel joins the splits. dev_attn_sel, a warp a head
// with each lane scoring whole keys one after another, took 38 us at 5 selected tokens on the H200
// and grew with the selection (up to block_topk r + r - 1 tokens): the token step's floor, timed at
// ~290 positions, was 1.3 ms above its parts, timed on a new session at position 4.
extern "C" __global__ void dev_attn_split_sel(const float* q, const void* K, const void* V, const float* Ks,
                                              const float* Vs, const int* toks, const int* count, float* part, int H,
                                              int Hkv, int ctx, int D, int L, int S, float scale, int kind) {
    attn_split(q, K, V, Ks, Vs, toks, *count, part, H, Hkv, ctx, D, L, S, scale, kind);
}

// (attn_merge: dev_attn_merge's work over n keys in splits of L)
__device__ __forceinline__ void attn_merge(const float* part, int n, float* out, int H, int D, int L, int S) {
    const int ns = min(S, (n + L - 1) / L);  // (attn_split's splits)
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (i64)H * D; i += (i64)gridDim.x * blockDim.x) {
        const int h = (int)(i / D), d = (int)(i % D);
        const float* ph = part + (i64)h * S * (D + 2);
        float M = ph[0];
        for (int s = 1; s < ns; s++) M = fmaxf(M, ph[(i64)s * (D + 2)]);
        float l = 0.0f, o = 0.0f;
        for (int s = 0; s < ns; s++) {
            const float c = expf(ph[(i64)s * (D + 2)] - M);
            l += ph[(i64)s * (D + 2) + 1] * c;
            o += ph[(i64)s * (D + 2) + 2 + d] * c;
        }
        out[i] = o / l;
    }
}

extern "C" __global__ void dev_attn_merge(const float* part, const int* pos, float* out, int H, int D, int L, int S) {
    attn_merge(part, *pos + 1, out, H, D, L, S);
}

// dev_attn_merge of dev_attn_split_rows' T rows: row t's into out + t H D.
extern "C" __global__ void dev_attn_merge_rows(const float* part, const int* pos, float* out, int T, int H, int D, int L,
                                               int S) {
    for (int t = 0; t < T; t++) attn_merge(part + (i64)t * H * S * (D + 2), pos[t] + 1, out + (i64)t * H * D, H, D, L, S);
}

extern "C" __global__ void dev_attn_merge_sel(const float* part, const int* count, float* out, int H, int D, int L, int S) {
    attn_merge(part, *count, out, H, D, L, S);
}

// ---------------------------------------------------------------------------------------------
// The greedy pick of a token step (engine/sampling.py's rule at temperature 0 without penalties):
// out[0] = the lowest index of the largest of x[0..n), the nb `banned` ids counting as -inf (numpy's
// argmax of the sampler's work array); out[1] = 1 when a value is NaN (the host then refuses to
// sample, as the sampler does); out[2] = the largest value's bits (the host refuses +-inf too).
// Only these 12 bytes go back to the host instead of the vocabulary's logits.
//
// Many blocks of whole warps (dynamic shared memory: 3 words per warp + 1): each block's best of a
// grid-strided share into part[3 b ..] (value bits, index, NaN seen), then the block that arrives
// last (a ticket from `count`, which it sets back to 0 for the next launch or graph replay) joins the
// parts into out. It was one block of 1024 threads: 243 dependent rounds of loads over a 248320-word
// vocabulary on one SM, ~0.15 ms of a ~1 ms token step on the H200 (the pick runs inside the
// run-ahead step's graph). best_of is a total order on (value, index) (the largest value, the lowest
// index among equal ones; NaN counted apart), so any split and any join order give the same pick.
__device__ __forceinline__ void best_of(float& bv, int& bi, float ov, int oi) {
    if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
}

// a warp's best (value, lowest index) by best_of's order, in every lane
__device__ __forceinline__ void warp_best(float& bv, int& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL, bv, o);
        const int oi = __shfl_xor_sync(FULL, bi, o);
        best_of(bv, bi, ov, oi);
    }
}

__device__ __forceinline__ bool argmax_grid(unsigned char* smem, const float* x, int n, const int* banned, int nb, int* part,
                                            int* count, int* out, int bx, int gx);

extern "C" __global__ void dev_argmax(const float* x, int n, const int* banned, int nb, int* part, int* count, int* out) {
    STRATA_SMEM(smem);
    argmax_grid(smem, x, n, banned, nb, part, count, out, blockIdx.x, gridDim.x);
}

// dev_argmax over each of `rows` logits rows x [rows, n] in one launch (a verify's 1 + N picks):
// row r takes blocks r gx .. r gx + gx - 1 of the grid, its own parts (part + 3 gx r), ticket
// (count + r) and out + 3 r, so each row's pick is dev_argmax's on that row alone, the same bits.
// (One launch a row cost a verify of 1 + 2 rows 27 us of device time against one pick's 10, the
// rows' launches one after another, an H200 under ncu, 2026-12-06.)
extern "C" __global__ void dev_argmax_rows(const float* x, int n, int gx, const int* banned, int nb, int* part, int* count,
                                           int* out) {
    STRATA_SMEM(smem);
    const int r = blockIdx.x / gx;
    argmax_grid(smem, x + (i64)r * n, n, banned, nb, part + 3 * gx * r, count + r, out + 3 * r, blockIdx.x % gx, gx);
}

// dev_argmax's pick (its grid and shared memory), then in the same launch, by the block that joins
// the parts, what the next step of the run-ahead needs from it, so that a run-ahead token is one
// graph replay and the pick's copy down (DeviceBackend.token_step with wait False): the position
// *pos advanced (to `last` at most: a replay past the session's context, a GPU-floor measurement's,
// writes no key past it) and the picked token's embedding row gathered into `row` (dev_embd_row's
// bits; defined below it)
extern "C" __global__ void dev_pick_next(const float* x, int n, const int* banned, int nb, int* part, int* count, int* out,
                                         int* pos, int last, const unsigned char* table, i64 row_bytes, int rows, int type,
                                         int E, float* row);

// a block's best by best_of's order, NaN seen or not, in thread 0 (sv, si, sn: a word per warp)
__device__ __forceinline__ void block_best(float& bv, int& bi, int& nan, float* sv, int* si, int* sn) {
    const float inf = __uint_as_float(0x7f800000u);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_best(bv, bi);
    for (int o = 16; o > 0; o >>= 1) nan |= __shfl_xor_sync(FULL, nan, o);
    if (lane == 0) sv[w] = bv, si[w] = bi, sn[w] = nan;
    __syncthreads();
    if (w == 0) {
        bv = lane < nw ? sv[lane] : -inf;
        bi = lane < nw ? si[lane] : 0x7fffffff;
        nan = lane < nw ? sn[lane] : 0;
        warp_best(bv, bi);
        for (int o = 16; o > 0; o >>= 1) nan |= __shfl_xor_sync(FULL, nan, o);
    }
    __syncthreads();  // (sv, si, sn are read again by the join)
}

// -> true in every thread of the block that joined the parts (out written there)
// (bx of gx: this block's place among the gx blocks that take x)
__device__ __forceinline__ bool argmax_grid(unsigned char* smem, const float* x, int n, const int* banned, int nb, int* part,
                                            int* count, int* out, int bx, int gx) {
    float* sv = reinterpret_cast<float*>(smem);
    int* si = reinterpret_cast<int*>(smem) + 32;
    int* sn = reinterpret_cast<int*>(smem) + 64;
    int* last = reinterpret_cast<int*>(smem) + 96;
    const float inf = __uint_as_float(0x7f800000u);
    float bv = -inf;
    int bi = 0x7fffffff, nan = 0;
    for (int i = bx * blockDim.x + threadIdx.x; i < n; i += gx * blockDim.x) {
        bool ban = false;
        for (int j = 0; j < nb; j++) ban |= banned[j] == i;
        if (ban) continue;  // (a banned NaN too: the sampler sets banned logits to -inf first)
        const float v = x[i];
        if (v != v)
            nan = 1;
        else
            best_of(bv, bi, v, i);
    }
    block_best(bv, bi, nan, sv, si, sn);
    if (threadIdx.x == 0) {
        volatile int* p = part + 3 * bx;
        p[0] = (int)__float_as_uint(bv), p[1] = bi, p[2] = nan;
        __threadfence();  // (this block's part is visible before its ticket is)
        last[0] = atomicAdd(count, 1) == gx - 1;
    }
    __syncthreads();
    if (!last[0]) return false;
    __threadfence();
    bv = -inf, bi = 0x7fffffff, nan = 0;
    for (int b = threadIdx.x; b < gx; b += blockDim.x) {
        const volatile int* p = part + 3 * b;
        best_of(bv, bi, __uint_as_float((unsigned)p[0]), p[1]);
        nan |= p[2];
    }
    block_best(bv, bi, nan, sv, si, sn);
    if (threadIdx.x == 0) {
        out[0] = bi;
        out[1] = nan;
        out[2] = (int)__float_as_uint(bv);
        *count = 0;  // (every block has taken its ticket: the next launch starts from 0)
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// The sampled pick of a token step: engine/sampling.py's Sampler.sample on the device, the same
// chain in the same order and float types (banned -> penalties -> top-k -> top-p -> min-p ->
// temperature -> the inverse-CDF draw), with the host's uniform `sp[0]` (one Sampler._rng.random()
// per token, staged with the step's inputs) so a seed picks the same token as on the host. One block;
// dynamic shared memory: dev_sample_smem(blockDim.x) bytes.
//   sp (f64): [r, temperature, top_p, min_p, log(min_p), repeat_penalty, frequency_penalty,
//              presence_penalty]; top_k as on the host (0: off); N: repeat_last_n, 0 when the
//   penalties are off. hist [N + 1]: the last N history ids as a ring (id of history index h at
//   h % N) and hist[N] = the history's length; the picked token is appended there, so the host
//   uploads the window only when its history is not the one the device holds.
//   work, prob: [n] f32 scratch; pen: [N] f32 scratch.
//   out: [token, 1 when a logit is NaN, the largest penalised logit's bits (the host refuses NaN and
//   +-inf as Sampler._filter does), 1 when the top-p set is not within the 512 most probable: the
//   host then samples the logits itself with the same r (Sampler._top_p sorts beyond its first
//   512 too; the device does not sort the whole vocabulary)].
// Where the device's float results can differ from the host's: expf (the device's, and numpy's own
// SIMD exp on the host, are each within an ulp or two, not correctly rounded), the top-p mass
// (numpy sums f32 pairwise, the device in f64) and the draw's running sum (f64 in chunks here, one
// sequential f64 cumsum there): the picked token differs only when r lands within such rounding of
// a boundary between two tokens (counted in tests/gpu/test_device_sample.py).
#define SAMPLE_HEAD 512  // Sampler's _TOP_P_FIRST_TRY

__device__ __forceinline__ unsigned okey(float f) {  // float order as unsigned order (no NaN here)
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float okey_f(unsigned k) { return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

// block reductions, every thread gets the result; sd: 33 doubles of shared memory (deterministic order)
__device__ double block_sum_d(double v, double* sd) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    if (lane == 0) sd[w] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int i = 0; i < nw; i++) s += sd[i];
        sd[32] = s;
    }
    __syncthreads();
    const double r = sd[32];
    __syncthreads();
    return r;
}
// op 0: sum, 1: min, 2: max
__device__ int block_int(int v, int op, int* si) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const int u = __shfl_xor_sync(FULL, v, o);
        v = op == 0 ? v + u : op == 1 ? min(v, u) : max(v, u);
    }
    if (lane == 0) si[w] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = si[0];
        for (int i = 1; i < nw; i++) s = op == 0 ? s + si[i] : op == 1 ? min(s, si[i]) : max(s, si[i]);
        si[32] = s;
    }
    __syncthreads();
    const int r = si[32];
    __syncthreads();
    return r;
}

// A draft's top probability (engine/speculative.py MTPDrafter: drafting stops below --spec-min-p):
// out[0] = 1 / sum_i exp(x[i] - max x) in double, the softmax's largest value at temperature 1 over
// every logit, banned or not, as the host computes it from the logits in float64 (only 8 bytes come
// down, not the vocabulary's logits, and the host sums nothing). Grid-strided like dev_argmax: each
// block's max and its sum of exp(x - its max) into part[2 b ..], the block that arrives last (a
// ticket from `count`, set back to 0) joins them in block order, S = sum_b s_b exp(m_b - M): the
// same terms as the host's up to their rounding and order (a relative ~1e-16: a draft whose
// probability is that close to --spec-min-p may stop on one side and not the other; the output is
// the verification's either way). A NaN logit makes out NaN (the pick refuses it: dev_argmax).
// Dynamic shared memory: 33 doubles (block_sum_d's), 32 floats, 1 int.
extern "C" __global__ void dev_top_prob(const float* x, int n, double* part, int* count, double* out) {
    STRATA_SMEM(smem);
    double* ss = reinterpret_cast<double*>(smem);
    float* sm = reinterpret_cast<float*>(smem + 33 * sizeof(double));
    int* last = reinterpret_cast<int*>(smem + 33 * sizeof(double) + 32 * sizeof(float));
    const float ninf = __uint_as_float(0xff800000u);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int stride = gridDim.x * blockDim.x;
    float m = ninf;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) m = fmaxf(m, x[i]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
    if (lane == 0) sm[w] = m;
    __syncthreads();
    m = ninf;
    for (int j = 0; j < nw; j++) m = fmaxf(m, sm[j]);  // (every thread: the block's max)
    double s = 0.0;
    if (m > ninf)
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) s += exp((double)x[i] - (double)m);
    const double t = block_sum_d(s, ss);
    if (threadIdx.x == 0) {
        volatile double* p = part + 2 * blockIdx.x;
        p[0] = (double)m, p[1] = t;
        __threadfence();  // (this block's part is visible before its ticket is)
        last[0] = atomicAdd(count, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last[0] || threadIdx.x != 0) return;
    __threadfence();
    const volatile double* p = part;
    double M = (double)ninf, S = 0.0;
    for (int b = 0; b < (int)gridDim.x; b++) M = fmax(M, p[2 * b]);
    for (int b = 0; b < (int)gridDim.x; b++)
        if (p[2 * b + 1] != 0.0) S += p[2 * b + 1] * exp(p[2 * b] - M);
    out[0] = 1.0 / S;
    *count = 0;  // (every block has taken its ticket: the next launch starts from 0)
}

// The k-th largest (1-based, counting equal values) of a[0..n) as an okey: a radix select, 8 bits a
// pass from the top; exact, as numpy's partition's k-th value is. Only keys >= lo are counted (lo at
// most the answer: the ones below it are below the answer, so no pass picks another bin).
// hist: 256 + 2 ints of shared memory.
__device__ unsigned kth_largest(const float* a, int n, int k, int* hist, unsigned lo) {
    unsigned prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned key = okey(a[i]);
            if (key >= lo && (key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int b = 255;
            for (; b > 0 && hist[b] < k; b--) k -= hist[b];
            hist[256] = (int)(prefix | ((unsigned)b << shift));
            hist[257] = k;
        }
        __syncthreads();
        prefix = (unsigned)hist[256];
        k = hist[257];
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// kth_largest of a vocabulary's values: first the k-th largest of the threads' own maxima (k <=
// blockDim.x; k of the values are at least it), so the select counts the few values above that
// bound, not the whole vocabulary (a shared-memory atomic per logit, most of them into the same
// few bins of the first pass, serialise). tm: blockDim.x floats of shared memory.
__device__ unsigned kth_largest_bounded(const float* a, int n, int k, int* hist, float* tm) {
    unsigned mk = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mk = max(mk, okey(a[i]));
    tm[threadIdx.x] = okey_f(mk == 0 ? okey(-__uint_as_float(0x7f800000u)) : mk);  // (no values: -inf)
    __syncthreads();
    const unsigned lo = k <= (int)blockDim.x ? kth_largest(tm, blockDim.x, k, hist, 0u) : 0u;
    return kth_largest(a, n, k, hist, lo);
}

extern "C" __global__ void dev_sample(const float* x, int n, const int* banned, int nb, float* work, float* prob, int* hist,
                                      int N, float* pen, const double* sp, int top_k, int* out) {
    STRATA_SMEM(smem);
    double* sd = reinterpret_cast<double*>(smem);                 // 33 doubles
    double* part = sd + 34;                                       // blockDim.x doubles
    int* si = reinterpret_cast<int*>(part + blockDim.x);          // 33 ints
    int* hi = si + 34;                                            // 258 ints
    float* cand = reinterpret_cast<float*>(hi + 258);             // SAMPLE_HEAD floats
    const float inf = __uint_as_float(0x7f800000u);
    const int tid = threadIdx.x, nt = blockDim.x;
    const double temperature = sp[1], top_p = sp[2], min_p = sp[3];
    const bool greedy = temperature <= 0.0 || top_k == 1;
    for (int i = tid; i < n; i += nt) work[i] = x[i];
    __syncthreads();
    for (int j = tid; j < nb; j += nt) work[banned[j]] = -inf;
    __syncthreads();
    // penalties over the last min(N, length) ids: every occurrence of an id writes the same value,
    // made from the logit before any write (Sampler._penalise's take, then put)
    const int len = N > 0 ? hist[N] : 0, m = min(N, len);
    if (m > 0) {
        const float rp = (float)sp[5];  // numpy: f32 logits with a Python float compute in f32
        for (int j = tid; j < m; j += nt) {
            const int id = hist[j];
            int c = 0;
            for (int q = 0; q < m; q++) c += hist[q] == id;
            const float l = work[id];
            const float v = l > 0.0f ? l / rp : l * rp;
            // counts * frequency + presence is f64 (int32 times a Python float), subtracted in f64
            pen[j] = (float)((double)v - ((double)c * sp[6] + sp[7]));
        }
        __syncthreads();
        for (int j = tid; j < m; j += nt) work[hist[j]] = pen[j];
        __syncthreads();
    }
    // the largest logit (NaN reported) and, greedy, the lowest id holding it
    float bv = -inf;
    int bi = 0x7fffffff, nan = 0;
    for (int i = tid; i < n; i += nt) {
        const float v = work[i];
        if (v != v)
            nan = 1;
        else
            best_of(bv, bi, v, i);
    }
    warp_best(bv, bi);
    if ((tid & 31) == 0) cand[tid >> 5] = bv, hi[tid >> 5] = bi;
    __syncthreads();
    if (tid == 0) {
        for (int w = 1; w < (nt >> 5); w++) best_of(bv, bi, cand[w], hi[w]);
        cand[32] = bv, hi[32] = bi;
    }
    __syncthreads();
    const float top = cand[32];
    const int best = hi[32];
    nan = block_int(nan, 2, si);
    if (nan || !(top > -inf && top < inf)) {
        if (tid == 0) out[0] = -1, out[1] = nan, out[2] = (int)__float_as_uint(top), out[3] = 0;
        return;  // (uniform: every thread read the same shared values)
    }
    int token = best;
    if (!greedy) {
        if (top_k > 0 && top_k < n) {  // drop below the k-th largest; every token tied with it stays
            const float t = okey_f(kth_largest_bounded(work, n, top_k, hi, reinterpret_cast<float*>(part)));
            for (int i = tid; i < n; i += nt)
                if (work[i] < t) work[i] = -inf;
            __syncthreads();
        }
        if (top_p < 1.0) {
            // the temperature-1 probabilities, unnormalised (f32, as Sampler._probabilities)
            double s = 0.0;
            int live = 0;
            for (int i = tid; i < n; i += nt) {
                const float p = expf(work[i] - top);
                prob[i] = p;
                s += (double)p;
                live += p > 0.0f;
            }
            const double need = top_p * (double)(float)block_sum_d(s, sd);  // numpy sums the f32 probs in f32
            live = block_int(live, 0, si);
            const int head = min(live, SAMPLE_HEAD);
            // the `head` largest probabilities, sorted down; only their values matter (ties are equal)
            const float t = okey_f(kth_largest_bounded(prob, n, head, hi, reinterpret_cast<float*>(part)));
            if (tid == 0) hi[0] = 0;
            __syncthreads();
            for (int i = tid; i < n; i += nt)
                if (prob[i] > t) cand[atomicAdd(&hi[0], 1)] = prob[i];
            __syncthreads();
            const int gt = hi[0];
            int S = 1;
            while (S < head) S <<= 1;
            for (int i = gt + tid; i < S; i += nt) cand[i] = i < head ? t : -1.0f;
            __syncthreads();
            for (int size = 2; size <= S; size <<= 1)  // bitonic sort, descending
                for (int stride = size >> 1; stride > 0; stride >>= 1) {
                    for (int q = tid; q < S / 2; q += nt) {
                        const int i = 2 * q - (q & (stride - 1)), j = i + stride;
                        const float a = cand[i], b = cand[j];
                        if ((i & size) == 0 ? a < b : a > b) cand[i] = b, cand[j] = a;
                    }
                    __syncthreads();
                }
            if (tid == 0) {  // Sampler._mass_cutoff: the first running mass (f64, in order) >= need
                double cum = 0.0;
                int i = 0;
                for (; i < head; i++) {
                    cum += (double)cand[i];
                    if (cum >= need) break;
                }
                hi[0] = i < head ? 1 : head < live ? 2 : 0;
                cand[SAMPLE_HEAD - 1] = i < head ? cand[i] : 0.0f;  // (cand[i] read before the write)
            }
            __syncthreads();
            const int found = hi[0];
            const float cut = cand[SAMPLE_HEAD - 1];
            __syncthreads();
            if (found == 2) {  // the set reaches beyond the 512 most probable: the host samples
                if (tid == 0) out[0] = -1, out[1] = 0, out[2] = (int)__float_as_uint(top), out[3] = 1;
                return;
            }
            if (found == 1)
                for (int i = tid; i < n; i += nt)
                    if (prob[i] < cut) work[i] = -inf;
            __syncthreads();
        }
        if (min_p > 0.0) {  // logit >= top + log(min_p), the threshold rounded to f32 as numpy compares
            const float thr = (float)((double)top + sp[4]);
            for (int i = tid; i < n; i += nt)
                if (work[i] < thr) work[i] = -inf;
            __syncthreads();
        }
        // the weights exp((work - top) / T) in f32, then the inverse CDF in f64: each thread sums a
        // contiguous chunk, the chunks' running totals in order, then the first index whose running
        // mass exceeds r * total (numpy's searchsorted side="right")
        const float T = (float)temperature;
        const int C = (n + nt - 1) / nt, a = min(tid * C, n), b = min(a + C, n);
        double s = 0.0;
        int last = -1;
        for (int i = a; i < b; i++) {
            const float d = work[i] - top;
            const float w = expf(temperature != 1.0 ? d / T : d);
            prob[i] = w;
            s += (double)w;
            if (w > 0.0f) last = i;
        }
        part[tid] = s;
        __syncthreads();
        if (tid == 0) {
            double run = 0.0;
            for (int q = 0; q < nt; q++) {
                const double c = part[q];
                part[q] = run;
                run += c;
            }
            sd[33] = run;
        }
        __syncthreads();
        const double u = sp[0] * sd[33];
        double run = part[tid];
        int first = 0x7fffffff;
        for (int i = a; i < b; i++) {
            run += (double)prob[i];
            if (run > u) {
                first = i;
                break;
            }
        }
        first = block_int(first, 1, si);
        last = block_int(last, 2, si);
        // u < total always, but r * total can round up to it: the draw is then the last live token
        token = first < n ? first : last;
    }
    if (tid == 0) {
        out[0] = token, out[1] = 0, out[2] = (int)__float_as_uint(top), out[3] = 0;
        if (N > 0) hist[len % N] = token, hist[N] = len + 1;
    }
}

// ---------------------------------------------------------------------------------------------
// The next token step's embedding row, gathered on the device from the token a pick left in device
// memory (tok[0]: dev_argmax's / dev_sample's out[0]), so the host queues step t+1 before token t
// comes back (DeviceBackend.embed_picked, the run-ahead). `table`: the embedding's GGUF bytes as
// they are in the file (row_bytes a row, rows rows); `type`: the GGML type id. Each element is the
// reference decoder's (engine/kernels/reference.py: dequantize) bit for bit: the same f32
// products and sums in the same order (no FMA: --fmad=false), so the row is what Model._embd_row
// stages for the plain step. Bytes are read one at a time (a block's halves and words need not be
// aligned). A token outside 0..rows-1 (only a refused pick leaves one) reads row 0: that step's
// result is never used (the pick's refusal raises first).

__device__ __forceinline__ unsigned embd_u16(const unsigned char* p) { return (unsigned)p[0] | ((unsigned)p[1] << 8); }
__device__ __forceinline__ float embd_h(const unsigned char* p) { return f16_to_f32(embd_u16(p)); }

__device__ __forceinline__ float embd_elem(const unsigned char* R, int type, int i) {
    if (type == 0) return __uint_as_float(embd_u16(R + 4 * i) | (embd_u16(R + 4 * i + 2) << 16));  // F32
    if (type == 1) return embd_h(R + 2 * i);  // F16
    if (type == 30) return __uint_as_float(embd_u16(R + 2 * i) << 16);  // BF16
    const int j = i & 31;
    if (type == 8) {  // Q8_0  | d | qs i8 x32 |  w = q * d
        const unsigned char* B = R + 34 * (i >> 5);
        return (float)(signed char)B[2 + j] * embd_h(B);
    }
    if (type == 2 || type == 3 || type == 6 || type == 7) {  // Q4_0 Q4_1 Q5_0 Q5_1: low nibbles, then high
        const int size = type == 2 ? 18 : type == 3 ? 20 : type == 6 ? 22 : 24;
        const unsigned char* B = R + size * (i >> 5);
        const bool has_m = type == 3 || type == 7, five = type >= 6;
        const unsigned char* qs = B + (has_m ? 4 : 2) + (five ? 4 : 0);
        int q = (qs[j & 15] >> (j < 16 ? 0 : 4)) & 15;
        if (five) q |= ((B[(has_m ? 4 : 2) + (j >> 3)] >> (j & 7)) & 1) << 4;  // bit j of qh
        const float d = embd_h(B);
        if (has_m) return d * (float)q + embd_h(B + 2);  // w = d * q + m
        return d * (float)(q - (five ? 16 : 8));  // w = d * (q - 8 | 16)
    }
    const int k = i & 255;
    if (type == 12 || type == 13) {  // Q4_K Q5_K  w = (d * sc) * q - dmin * m, 8 sub-blocks of 32
        const bool five = type == 13;
        const unsigned char* B = R + (five ? 176 : 144) * (i >> 8);
        const unsigned char* S = B + 4;
        const int s = k >> 5, l = k & 31;
        int sc, mn;
        if (s < 4) sc = S[s] & 63, mn = S[s + 4] & 63;
        else sc = (S[s + 4] & 15) | ((S[s - 4] >> 6) << 4), mn = (S[s + 4] >> 4) | ((S[s] >> 6) << 4);
        const unsigned char* qs = B + (five ? 48 : 16);
        int q = (qs[32 * (s >> 1) + l] >> (4 * (s & 1))) & 15;
        if (five) q |= ((B[16 + l] >> s) & 1) << 4;
        return (embd_h(B) * (float)sc) * (float)q - embd_h(B + 2) * (float)mn;
    }
    if (type == 14) {  // Q6_K  | ql x128 | qh x64 | scales i8 x16 | d |  w = (d * sc) * q
        const unsigned char* B = R + 210 * (i >> 8);
        const int n = k >> 7, jj = (k >> 5) & 3, l = k & 31;
        const int lo = (B[64 * n + 32 * (jj & 1) + l] >> (4 * (jj >> 1))) & 15;
        const int hi = (B[128 + 32 * n + l] >> (2 * jj)) & 3;
        const int sc = (signed char)B[192 + (k >> 4)];
        return (embd_h(B + 208) * (float)sc) * (float)((lo | (hi << 4)) - 32);
    }
    return 0.0f;  // (DeviceBackend.embed_picked refuses other types before launching)
}

extern "C" __global__ void dev_embd_row(const unsigned char* table, i64 row_bytes, int rows, int type, int n, const int* tok,
                                        float* out) {
    int t = tok[0];
    if (t < 0 || t >= rows) t = 0;
    const unsigned char* R = table + (i64)t * row_bytes;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = embd_elem(R, type, i);
}

// A prompt chunk's T embedding rows from the table on the device (DeviceBackend.embed_rows): dev_embd_row's
// elements, row t of out [T, n] from tok[t]. The host decoded them one token at a time and copied them up
// (7 ms of a 256-token qwen4exp chunk that took 81 ms, 2026-12-03); the ids were checked on the host.
extern "C" __global__ void dev_embd_rows(const unsigned char* table, i64 row_bytes, const int* tok, int T, int type, int n,
                                         float* out) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (i64)T * n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / n;
        out[i] = embd_elem(table + (i64)tok[t] * row_bytes, type, (int)(i - t * n));
    }
}

extern "C" __global__ void dev_pick_next(const float* x, int n, const int* banned, int nb, int* part, int* count, int* out,
                                         int* pos, int last, const unsigned char* table, i64 row_bytes, int rows, int type,
                                         int E, float* row) {
    STRATA_SMEM(smem);
    if (!argmax_grid(smem, x, n, banned, nb, part, count, out, blockIdx.x, gridDim.x)) return;
    int* tok = reinterpret_cast<int*>(smem) + 97;  // (past argmax_grid's 3 x 32 + 1)
    if (threadIdx.x == 0) {
        tok[0] = out[0];  // (the thread that wrote it)
        const int p = *pos;
        *pos = p < last ? p + 1 : last;
    }
    __syncthreads();
    int t = tok[0];
    if (t < 0 || t >= rows) t = 0;
    const unsigned char* R = table + (i64)t * row_bytes;
    for (int i = threadIdx.x; i < E; i += blockDim.x) row[i] = embd_elem(R, type, i);
}

// ---------------------------------------------------------------------------------------------
// qwen4exp's token step at the device position (DeviceBackend.qsa_token, ple_conv_step): what the
// host did inside a step with the position as a Python int (a slice of the raw keys, the block a
// token completes, the ring's slot, the number of complete blocks, the selection), made here from
// *pos, so that one captured step replays at every position

// PLE's depthwise causal conv of one token at p = *pos (ple.conv_taps with T = 1: each tap's
// product added from 0 in tap order, its bits), then the ring's slot p % L takes X. ring [L, HE]
// (token i at slot i % L), X and y [HE], taps [Pk, HE]. Tap 0 reads the input L tokens back, which
// is that same slot: the thread of a channel reads it before it writes it.
extern "C" __global__ void dev_ple_conv(float* ring, const int* pos, const float* X, const float* taps, int dil, float* y,
                                        int L, int HE, int Pk) {
    const int p = *pos;
    for (i64 c = blockIdx.x * (i64)blockDim.x + threadIdx.x; c < HE; c += (i64)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < Pk; j++) {
            const int back = (Pk - 1 - j) * dil;  // tokens back (<= L)
            const float src = back == 0 ? X[c] : ring[(i64)((p + L - back) % L) * HE + c];
            acc += taps[(i64)j * HE + c] * src;
        }
        y[c] = acc;
        ring[(i64)(p % L) * HE + c] = X[c];
    }
}

// One element of a PLE table row (engine/ple.py TableRows for F32, F16 and BF16; model.py _BlockRows,
// the reference decoder, for a block type): embd_elem's types, and IQ4_NL, the type the released
// table falls back to on its short rows (a 64- or 160-element row is no whole 256-element IQ3_XXS
// block): | d f16 | qs u8 x16 |, Q4_0's nibble order, w = d * kvalues_iq4nl[nibble] (the 16 int8
// values packed in two words, so no table is indexed per thread).
__device__ __forceinline__ float ple_elem(const unsigned char* R, int type, int i) {
    if (type != 20) return embd_elem(R, type, i);
    const unsigned char* B = R + 18 * (i >> 5);
    const int j = i & 31, q = (B[2 + (j & 15)] >> (j < 16 ? 0 : 4)) & 15;
    const unsigned long long kv = q < 8 ? 0xf6eaddcfbfad9881ull : 0x7159453526190d01ull;
    return embd_h(B) * (float)(signed char)(unsigned char)(kv >> (8 * (q & 7)));
}

// A prompt chunk's PLE rows from the table on the device (DeviceBackend.ple_rows): out [K, Pd], row k the
// table's row ids[k] (made by the host's hash, checked there), ple_elem's values, the reference decoder's.
extern "C" __global__ void dev_ple_gather(const unsigned char* table, i64 row_bytes, const i64* ids, int K, int type, int Pd,
                                          float* out) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (i64)K * Pd; i += (i64)gridDim.x * blockDim.x) {
        const i64 k = i / Pd;
        out[i] = ple_elem(table + ids[k] * row_bytes, type, (int)(i - k * Pd));
    }
}

// PLE's depthwise causal conv of a chunk of T tokens, the first at position t0 (ple.conv_taps, its
// bits: each tap's f32 product added from 0 in tap order, no FMA): y[t, c] = sum_j taps[j, c] times
// the input (Pk-1-j) dil tokens back, from X [T, HE] or, before the chunk, from the ring [L, HE]
// (token i at slot i % L; back >= -L, so the slot's index stays >= 0). The ring is not written here:
// the host moves the chunk's last L inputs into it afterwards. A Python loop of T Pk array ops had
// taken 46 ms of a 256-token qwen4exp chunk's 81 (2026-12-03).
extern "C" __global__ void dev_ple_conv_rows(const float* ring, i64 t0, const float* X, const float* taps, int dil, float* y,
                                             int L, int HE, int Pk, int T) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < (i64)T * HE; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / HE, c = i - t * HE;
        float acc = 0.0f;
        for (int j = 0; j < Pk; j++) {
            const i64 back = t - (i64)(Pk - 1 - j) * dil;
            const float src = back >= 0 ? X[back * HE + c] : ring[((t0 + L + back) % L) * HE + c];
            acc += taps[(i64)j * HE + c] * src;
        }
        y[i] = acc;
    }
}

// PLE's rows for the run-ahead's next token step, made from the token the pick left in device memory
// (tok[0]: dev_pick_next's out[0]), so that no host hashing sits between two steps (DeviceBackend.
// ple_next; engine/ple.py NGramHash and PLEState.window, step for step):
//   context  c_0 = t; walking back through win (the N-1 raw tokens before t, oldest first, EOS at
//            the start), an EOS at p-s or later makes c_s and every older entry EOS
//   hash     head i of PLE layer l, order o = 2 + i / hpn: h = XOR_{s<o} c_s * mult[l, s], the
//            products WRAPPING mod 2^64 (as torch's int64 product: done in unsigned, where
//            overflow is defined, then read back as signed), row = off[l, i] + h mod size[l, i]
//            with the divisor's sign (torch.remainder: C's % takes the dividend's, so a negative
//            remainder is moved up by the divisor). Integers only: the products exceed 2^53.
//   gather   rows[l, i Pd + j] = the table's row's element j (ple_elem), the PLE layers' staged
//            buffers [nl, Pn Pd]; ids [nl, Pn] = the row ids (tests compare them with the host's)
//   window   win advanced in place: its oldest token out, t in (PLEState.window's rule)
// One block: thread 0 reads and advances the window (no other thread touches it, so no block
// can read it after it moved); a token's rows are Pe floats a PLE layer (2560 on seed-4l).
// smem: 8 (N + nl Pn) bytes.
extern "C" __global__ void dev_ple_rows(const int* tok, i64* win, int N, i64 eos, const i64* mult, const i64* off,
                                        const i64* size, int nl, int Pn, int hpn, const unsigned char* table, i64 row_bytes,
                                        i64 n_rows, int type, int Pd, float* rows, i64* ids) {
    STRATA_SMEM(smem);
    i64* c = reinterpret_cast<i64*>(smem);
    i64* row = c + N;
    if (threadIdx.x == 0) {
        const i64 t = tok[0];
        c[0] = t;
        bool reset = false;
        for (int s = 1; s < N; s++) {
            const i64 prev = win[N - 1 - s];
            reset |= prev == eos;
            c[s] = reset ? eos : prev;
        }
        for (int s = 0; s + 1 < N - 1; s++) win[s] = win[s + 1];
        if (N > 1) win[N - 2] = t;
    }
    __syncthreads();
    for (int k = threadIdx.x; k < nl * Pn; k += blockDim.x) {
        const int l = k / Pn, i = k - l * Pn, o = 2 + i / hpn;
        unsigned long long h = 0;
        for (int s = 0; s < o; s++) h ^= (unsigned long long)c[s] * (unsigned long long)mult[(i64)l * N + s];
        const i64 P = size[k];
        i64 r = (i64)h % P;
        if (r != 0 && ((r < 0) != (P < 0))) r += P;
        r += off[k];
        row[k] = r;
        ids[k] = r;
    }
    __syncthreads();
    const i64 per = (i64)Pn * Pd;
    for (i64 e = threadIdx.x; e < nl * per; e += blockDim.x) {
        const i64 k = e / Pd;
        const int j = (int)(e - k * Pd);
        i64 r = row[k];
        if (r < 0 || r >= n_rows) r = 0;  // (cannot happen: NGramHash checks offset + size <= rows)
        rows[e] = ple_elem(table + r * row_bytes, type, j);
    }
}

// QSA's indexer key of one token at p = *pos (QSALayer._append for one token): ik [Id] into row p
// of the raw keys [C, Id], then block b = p / r pooled from its r rows into blocks [b]: kb =
// rope_{b r}(rmsnorm(mean of the rows)). The block in progress is pooled at EVERY token: its rows
// past p hold an older token's key or zeros, but no selection reads block b before it is complete
// (select reads the (p + 1) / r complete blocks), and at the token that completes it the key is
// made from its r rows, as the host path makes it then. The mean: the rows added in order from the
// first, then divided by r in f32 (numpy's mean over axis 0, dtype f32); the norm: dev_rmsnorm's
// f32 sums and order (x scale, then gain); the rope: cs, sn the rope's table [C, half], row b r
// (DeviceBackend._rope_table), dims past 2 half unrotated. blocks holds nb = C / r: a block the context
// cannot complete (C not a multiple of r) has no row and is not pooled (reading its r rows ran past
// the keys and wrote past the blocks: a heap corruption on the emulation). One block; smem: 32
// doubles, then Id floats.
extern "C" __global__ void dev_qsa_key(const float* ik, float* keys, float* blocks, int nb, const int* pos, int r, int Id,
                                       const float* gain, float eps, const float* cs, const float* sn, int half) {
    STRATA_SMEM(smem);
    double* red = reinterpret_cast<double*>(smem);
    float* kb = reinterpret_cast<float*>(smem + 32 * sizeof(double));
    const int p = *pos, b = p / r;
    for (int i = threadIdx.x; i < Id; i += blockDim.x) keys[(i64)p * Id + i] = ik[i];
    if (b >= nb) return;  // (the whole block returns: no barrier is left waiting)
    __syncthreads();
    for (int i = threadIdx.x; i < Id; i += blockDim.x) {
        float s = keys[(i64)b * r * Id + i];
        for (int j = 1; j < r; j++) s += keys[((i64)b * r + j) * Id + i];
        kb[i] = s / (float)r;
    }
    __syncthreads();
    const float scale = norm_scale(kb, Id, eps, 1, 0, red);
    __syncthreads();
    for (int i = threadIdx.x; i < Id; i += blockDim.x) kb[i] = kb[i] * scale * gain[i];
    __syncthreads();
    float* out = blocks + (i64)b * Id;
    const i64 at = (i64)b * r * half;  // the rope table's row of the block's first position
    for (int i = threadIdx.x; i < Id; i += blockDim.x) {
        if (i < half) {
            out[i] = kb[i] * cs[at + i] - kb[half + i] * sn[at + i];
        } else if (i < 2 * half) {
            out[i] = kb[i] * cs[at + i - half] + kb[i - half] * sn[at + i - half];
        } else {
            out[i] = kb[i];
        }
    }
}

// QSA's block scores of one token's indexer queries iq [Ih, Id] at p = *pos (QSALayer.select):
// s_b = (sum over heads h, from the first, of relu(iq_h . kb)) / rs (rs = f32 sqrt(Id)) for the
// n = (p + 1) / r complete blocks -> scores [n]. A warp a block, lane j summing dimensions j, j +
// 32, ... A NaN dot stays NaN (np.maximum's rule, which fmaxf would drop).
__device__ __forceinline__ float qsa_score(const float* iq, const float* kb, int Ih, int Id, float rs, int lane) {
    float s = 0.0f;
    for (int h = 0; h < Ih; h++) {
        float dot = 0.0f;
        for (int d = lane; d < Id; d += 32) dot += iq[(i64)h * Id + d] * kb[d];
        dot = warp_sum(dot);
        s += (dot > 0.0f || dot != dot) ? dot : 0.0f;
    }
    return s / rs;
}

extern "C" __global__ void dev_qsa_scores(const float* iq, const float* blocks, const int* pos, int r, int Ih, int Id,
                                          float rs, float* scores) {
    const int lane = threadIdx.x & 31, n = (*pos + 1) / r;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    for (int b = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); b < n; b += nw) {
        const float s = qsa_score(iq, blocks + (i64)b * Id, Ih, Id, rs, lane);
        if (lane == 0) scores[b] = s;
    }
}

// torch.topk's choice among ties, as engine/qsa.py reproduces it (its comment says why): libstdc++'s
// std::partial_sort (k 64 <= n) or std::nth_element over (score, index) pairs with comp(x, y) =
// x > y, step for step as qsa.py's port (_adjust_heap, _heap_select, _insertion_sort,
// _median_to_first, _introselect), so the same set whatever the ties. One thread: the algorithms
// are sequential, and n is the context over the block size (a few thousand blocks at most).
__device__ void tk_swap(float* v, int* ix, int a, int b) {
    const float t = v[a];
    v[a] = v[b];
    v[b] = t;
    const int u = ix[a];
    ix[a] = ix[b];
    ix[b] = u;
}

__device__ void tk_adjust_heap(float* v, int* ix, int first, int hole, int n, float val, int vi) {
    const int top = hole;
    int child = hole;
    while (child < (n - 1) / 2) {
        child = 2 * (child + 1);
        if (v[first + child] > v[first + child - 1]) child--;
        v[first + hole] = v[first + child];
        ix[first + hole] = ix[first + child];
        hole = child;
    }
    if ((n & 1) == 0 && child == (n - 2) / 2) {
        child = 2 * (child + 1);
        v[first + hole] = v[first + child - 1];
        ix[first + hole] = ix[first + child - 1];
        hole = child - 1;
    }
    int parent = (hole - 1) / 2;  // __push_heap (hole > top >= 0 whenever parent is used)
    while (hole > top && v[first + parent] > val) {
        v[first + hole] = v[first + parent];
        ix[first + hole] = ix[first + parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    v[first + hole] = val;
    ix[first + hole] = vi;
}

__device__ void tk_heap_select(float* v, int* ix, int first, int middle, int last) {
    const int n = middle - first;
    if (n >= 2) {  // __make_heap
        for (int parent = (n - 2) / 2;; parent--) {
            tk_adjust_heap(v, ix, first, parent, n, v[first + parent], ix[first + parent]);
            if (parent == 0) break;
        }
    }
    for (int i = middle; i < last; i++) {
        if (v[i] > v[first]) {  // __pop_heap(first, middle, i)
            const float val = v[i];
            const int vi = ix[i];
            v[i] = v[first];
            ix[i] = ix[first];
            tk_adjust_heap(v, ix, first, 0, n, val, vi);
        }
    }
}

__device__ void tk_insertion_sort(float* v, int* ix, int first, int last) {
    for (int i = first + 1; i < last; i++) {
        const float val = v[i];
        const int vi = ix[i];
        if (val > v[first]) {
            for (int j = i; j > first; j--) {
                v[j] = v[j - 1];
                ix[j] = ix[j - 1];
            }
            v[first] = val;
            ix[first] = vi;
        } else {
            int j = i;
            while (val > v[j - 1]) {
                v[j] = v[j - 1];
                ix[j] = ix[j - 1];
                j--;
            }
            v[j] = val;
            ix[j] = vi;
        }
    }
}

__device__ void tk_median_to_first(float* v, int* ix, int r, int a, int b, int c) {
    if (v[a] > v[b]) {
        if (v[b] > v[c]) tk_swap(v, ix, r, b);
        else if (v[a] > v[c]) tk_swap(v, ix, r, c);
        else tk_swap(v, ix, r, a);
    } else if (v[a] > v[c]) {
        tk_swap(v, ix, r, a);
    } else if (v[b] > v[c]) {
        tk_swap(v, ix, r, c);
    } else {
        tk_swap(v, ix, r, b);
    }
}

__device__ void tk_introselect(float* v, int* ix, int first, int nth, int last, int depth) {
    while (last - first > 3) {
        if (depth == 0) {
            tk_heap_select(v, ix, first, nth + 1, last);
            tk_swap(v, ix, first, nth);
            return;
        }
        depth--;
        tk_median_to_first(v, ix, first, first + 1, first + (last - first) / 2, last - 1);
        int lo = first + 1, hi = last;  // __unguarded_partition around v[first]
        while (true) {
            while (v[lo] > v[first]) lo++;
            hi--;
            while (v[first] > v[hi]) hi--;
            if (!(lo < hi)) break;
            tk_swap(v, ix, lo, hi);
            lo++;
        }
        if (lo <= nth) first = lo;
        else last = lo;
    }
    tk_insertion_sort(v, ix, first, last);
}

// torch.topk's set of the top min(kmax, n) of n scores (the rule above; v f32 [n], ix i32 [n]: its
// scratch) -> k, the set's block ids in ix[0 .. k), in the algorithms' order. One thread.
__device__ int qsa_topk(const float* scores, int n, int kmax, float* v, int* ix) {
    const int k = kmax < n ? kmax : n;
    for (int i = 0; i < n; i++) {
        v[i] = scores[i];
        ix[i] = i;
    }
    if (k * 64 <= n) {
        tk_heap_select(v, ix, 0, k, n);
    } else {
        int depth = 0;
        for (int w = n; w > 1; w >>= 1) depth++;  // libstdc++'s __lg
        tk_introselect(v, ix, 0, k - 1, n, 2 * depth);
    }
    return k;
}

// One token's QSA selection at p = *pos (QSALayer.select): the top min(kmax, n) of the n = (p + 1)
// / r complete blocks' scores by torch.topk's rule (qsa_topk), in ascending block order, each
// block's r tokens, then the tail n r .. p -> toks, *count tokens. Thread 0 of one block.
extern "C" __global__ void dev_qsa_select(const float* scores, const int* pos, int r, int kmax, float* v, int* ix,
                                          int* toks, int* count) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int p = *pos, n = (p + 1) / r;
    int m = 0;
    if (n > 0) {
        const int k = qsa_topk(scores, n, kmax, v, ix);
        for (int i = 1; i < k; i++) {  // the set ascending (qsa.torch_topk_set sorts it)
            const int b = ix[i];
            int j = i;
            while (j > 0 && ix[j - 1] > b) {
                ix[j] = ix[j - 1];
                j--;
            }
            ix[j] = b;
        }
        for (int i = 0; i < k; i++)
            for (int j = 0; j < r; j++) toks[m++] = ix[i] * r + j;
    }
    for (int t = n * r; t <= p; t++) toks[m++] = t;
    *count = m;
}

// A prompt chunk's QSA scores, its T queries iq [T, Ih, Id] at positions p0 .. p0 + T - 1
// (QSALayer._attend past the budget): row t = dev_qsa_scores at p = p0 + t (qsa_score: the same
// operations in the same order), so a chunk's query selects what the token step at its position selects. scores
// [T, nbm]; row t's first (p0 + t + 1) / r entries written. A warp a (query, block).
extern "C" __global__ void dev_qsa_scores_rows(const float* iq, const float* blocks, int p0, int T, int r, int Ih, int Id,
                                               float rs, float* scores, int nbm) {
    const int lane = threadIdx.x & 31;
    const i64 nw = (gridDim.x * (i64)blockDim.x) >> 5;
    for (i64 w = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5; w < (i64)T * nbm; w += nw) {
        const int t = (int)(w / nbm), b = (int)(w - (i64)t * nbm);
        if (b >= (p0 + t + 1) / r) continue;  // (the whole warp: w is the warp's)
        const float s = qsa_score(iq + (i64)t * Ih * Id, blocks + (i64)b * Id, Ih, Id, rs, lane);
        if (lane == 0) scores[w] = s;
    }
}

// A prompt chunk's QSA selections as the attention's mask: row t of mask [T, W] (W = p0 + T keys)
// is 1 at the tokens query t attends (dev_qsa_select's set at p = p0 + t: the top blocks' r tokens
// and the tail), else 0. One query a block: thread 0 selects (v, ix [T, nbm]: each query's own
// scratch), every thread clears and marks. Before, the host brought each query's scores down and
// selected there: one round trip a query and QSA layer past the 2048-token budget. smem: 16 bytes.
extern "C" __global__ void dev_qsa_select_rows(const float* scores, int nbm, int p0, int T, int r, int kmax, float* v, int* ix,
                                               unsigned char* mask, int W) {
    STRATA_SMEM(smem);
    int& k_sh = *reinterpret_cast<int*>(smem);
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        unsigned char* row = mask + (i64)t * W;
        const int p = p0 + t, n = (p + 1) / r;
        if (threadIdx.x == 0) k_sh = n > 0 ? qsa_topk(scores + (i64)t * nbm, n, kmax, v + (i64)t * nbm, ix + (i64)t * nbm) : 0;
        for (int i = threadIdx.x; i < W; i += blockDim.x) row[i] = (i >= n * r && i <= p) ? 1 : 0;  // the tail
        __syncthreads();
        const int* sel = ix + (i64)t * nbm;
        for (int i = threadIdx.x; i < k_sh * r; i += blockDim.x) row[sel[i / r] * r + i % r] = 1;
        __syncthreads();  // (k_sh is the next query's after this)
    }
}

// Softmax attention of one token's queries q [H, D] over the cached tokens toks[0 .. *count) (QSA's
// selection, dev_qsa_select) -> out [H, D]: dev_attn_one's operations in its order, the key and
// value rows read at the selected positions. sc [H, M], M >= *count.
extern "C" __global__ void dev_attn_sel(const float* q, const void* K, const void* V, const float* Ks, const float* Vs,
                                        const int* toks, const int* count, float* sc, int M, float* out, int H, int Hkv,
                                        int ctx, int D, float scale, int kind) {
    const int lane = threadIdx.x & 31, n = *count;
    const int nw = (int)((gridDim.x * blockDim.x) >> 5);
    for (int h = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); h < H; h += nw) {
        const int kv = h / (H / Hkv);
        const float* qh = q + (i64)h * D;
        float* s = sc + (i64)h * M;
        float m = -__uint_as_float(0x7f800000u);
        for (int i = lane; i < n; i += 32) {
            const i64 row = ((i64)kv * ctx + toks[i]) * D;
            float acc = 0.0f;
            for (int d = 0; d < D; d++) acc += qh[d] * kv_at(K, Ks, kind, row + d);
            acc = acc * scale;
            s[i] = acc;
            m = fmaxf(m, acc);
        }
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, o));
        float sum = 0.0f;
        for (int i = lane; i < n; i += 32) {
            const float e = expf(s[i] - m);
            s[i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        __syncwarp();
        for (int d = lane; d < D; d += 32) {
            float acc = 0.0f;
            for (int i = 0; i < n; i++) acc += (s[i] / sum) * kv_at(V, Vs, kind, ((i64)kv * ctx + toks[i]) * D + d);
            out[(i64)h * D + d] = acc;
        }
        __syncwarp();
    }
}

// An f16's bits as the f32 of the same value (exact; integer operations only, so the emulation and
// the card agree whatever their float modes): numpy's astype from float16, subnormals included.
__device__ __forceinline__ float f16_bits_f32(unsigned h) {
    const unsigned s = (h & 0x8000u) << 16, e = (h >> 10) & 31u;
    unsigned m = h & 0x3ffu, bits;
    if (e == 31u) {
        bits = s | 0x7f800000u | (m << 13);
    } else if (e) {
        bits = s | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0u) {
        bits = s;
    } else {  // subnormal: m 2^-24, normalized
        unsigned sh = 0;
        while (!(m & 0x400u)) m <<= 1, sh++;
        bits = s | ((113u - sh) << 23) | ((m & 0x3ffu) << 13);
    }
    return __uint_as_float(bits);
}

// engine_form.widen on the device, for n_exp whole experts of one expert tensor (a layer streamed
// whole: LayerStream, engine/tier/staging.py): raw holds their GGUF blocks as the file has them (nbe
// blocks an expert, type_size bytes a block); expert e0 + j's engine form goes to its slot of the
// layer buffer, dst + (e0 + j) slot_bytes + off: the rest bytes in block order, then at sc_off the
// fp16 scales as f32. col[c] says where byte c of a block goes: >= 0, that column of the block's
// rest; -1 - k, the low byte of scale k (the thread reads both bytes); below -65536, nowhere (a
// scale's high byte). A thread a byte, so the reads are coalesced. A scale that is not finite is
// not a tensor (the host's widen refuses it too): *bad gets the lowest (expert << 32 | block).
extern "C" __global__ void dev_widen(const unsigned char* raw, int n_exp, i64 nbe, int type_size, int rest_bytes,
                                     int n_scales, const int* col, unsigned char* dst, int e0, i64 slot_bytes, i64 off,
                                     i64 sc_off, unsigned long long* bad) {
    const i64 n = (i64)n_exp * nbe * type_size;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 blk = i / type_size, j = blk / nbe, b = blk - j * nbe;
        const int m = col[(int)(i - blk * type_size)];
        unsigned char* slot = dst + (e0 + j) * slot_bytes + off;
        if (m >= 0) {
            slot[b * rest_bytes + m] = raw[i];
        } else if (m >= -n_scales) {
            const unsigned h = (unsigned)raw[i] | ((unsigned)raw[i + 1] << 8);
            reinterpret_cast<float*>(slot + sc_off)[b * n_scales + (-1 - m)] = f16_bits_f32(h);
            if (((h >> 10) & 31u) == 31u) atomicMin(bad, ((unsigned long long)(e0 + j) << 32) | (unsigned long long)b);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// speculative decoding's verify run ahead of the host (engine/tier/verify_ahead.py): the judge, the
// rollback and the next chain made on the device, so that the next verify is queued before the
// host reads this one's picks (as the token step's run-ahead queues its next step: dev_pick_next)

// After a verify of T = 1 + N rows at posv[0].. whose picks are picks [T, 3] (dev_argmax's
// [token, NaN seen, max bits] a row) and whose ids are tok [T] (the last known token, then the N
// drafts): k, the drafts kept, is the longest prefix of them equal to the picks (greedy judging:
// engine/speculative.py's rule); rec gets [k, the verify's first position, picks]; the rows 0..k
// stay fed, so the next verify starts at P' = posv[0] + k + 1 (`last` at most: a replay past the
// context writes no key past it), its first id the pick of row k and its drafts the reference
// drafter's at P' + 1.. (ReferenceDrafter's rule: the reference's token where right[j], else that
// token + 1 mod V; 0 past the reference, which the host never reads). posv[0..T) <- P' + i.
// One thread: a few dozen ints (the verify's T <= 9).
extern "C" __global__ void dev_spec_judge(const int* picks, int* tok, int T, int* posv, int last, const int* ref,
                                          const unsigned char* right, int L, int V, int* rec) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int N = T - 1, P = posv[0];
    int k = 0;
    while (k < N && picks[3 * k] == tok[k + 1]) k++;
    rec[0] = k;
    rec[1] = P;
    for (int i = 0; i < 3 * T; i++) rec[2 + i] = picks[i];
    int np = P + k + 1;
    if (np > last) np = last;
    for (int i = 0; i < T; i++) posv[i] = np + i;
    tok[0] = picks[3 * k];
    for (int i = 1; i < T; i++) {
        const int j = np + i;
        tok[i] = j < L ? (right[j] ? ref[j] : (ref[j] + 1) % V) : 0;
    }
}

// The rollback of dev_spec_judge's verify, chosen on the device: where k < N (a draft refused)
// every state array j (a Gated DeltaNet layer's conv and S: 4-byte words) takes its copy after row
// k, src[k J + j] (the verify wrote it: Snapshot); with every draft kept the state is already the
// one after row N. src, dst: device addresses; words[j]: array j's length.
extern "C" __global__ void dev_spec_restore(const int* rec, int N, const i64* src, const i64* dst, const i64* words, int J) {
    const int k = rec[0];
    if (k >= N) return;
    for (int j = 0; j < J; j++) {
        const float* s = reinterpret_cast<const float*>(src[(i64)k * J + j]);
        float* d = reinterpret_cast<float*>(dst[j]);
        for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < words[j]; i += (i64)gridDim.x * blockDim.x) d[i] = s[i];
    }
}
