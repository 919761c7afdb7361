// Strata GPU kernels: W x from device-resident ENGINE FORM planes (engine_form.widen), for every
// GGML block type, bit-identical to reference.dot_reference and the Numba kernels (cpu.py).
// Loaded by gpu.py as a CuPy RawModule; the same source compiles on the host against
// tests/gpu_emu.h (STRATA_EMU) so the tests check it without a GPU: no #include, only dynamic
// shared memory, every warp-collective reached by all 32 lanes.
//
// The arithmetic (docs/kernels.md, reference.py): every 32-element act-block k of a row is
//     w[16h + j] = wf * ws[h] * q[16h + j]  (+ wm * mn[h])        h = 0, 1;  j < 16
// term c_k = (wf * ad) * f32(ws0 * lo + ws1 * hi)  [+ (wm * ad) * f32(mn0 * s0 + mn1 * s1)]
//   lo, hi: exact int32 sums of q * xq over the two halves; ad, s0, s1: ActQ's d and s16.
// Lane l of the row's warp adds c_l, c_{l+32}, ... in that order to +0.0f; then the fold
// lane[l] += lane[l + w], w = 16, 8, 4, 2, 1 (__shfl_down_sync), and lane 0 has the result.
// Integer sums fit int32 for every type (largest: Q6_K, |ws * 16 * 32 * 127| * 2 < 2^25).
//
// FLOATING POINT. CuPy appends -ftz=true to every compile (cupy/cuda/compiler.py), which makes
// __fmul_rn and friends flush subnormals: ActQ of a subnormal block came out all zeros on an
// H200. So every f32 operation of the specification is inline PTX without .ftz (mul.rn.f32,
// add.rn.f32, div.rn.f32, cvt.rni): IEEE with subnormals, never contracted into an FMA, whatever
// the flags. Float comparisons are avoided (an ftz compare sees a subnormal as zero).
//
// MEMORY. A warp stages its row's bytes (rest plane, then scale plane) in shared memory with
// 16-byte cp.async copies of the aligned cover of the row, issued one row AHEAD: the next row's
// bytes are in flight while this row is computed (one row at a time left the H200 idle: the
// low-bit types ran at 16-40% of the read bandwidth). Lane l then decodes act-block l + 32 r.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

#ifndef STRATA_SMEM
#define STRATA_SMEM(name) extern __shared__ __align__(16) u8 name[]
#endif
// Vector accesses need their natural alignment on the device; the host emulation checks it here.
#ifndef STRATA_ALIGNED
#define STRATA_ALIGNED(p, n) (p)
#endif

#define FULL 0xffffffffu

// ---------------------------------------------------------------------------------------------
// f32 operations, IEEE with subnormals whatever -ftz says; async copies (the host emulation
// provides the same operations as plain IEEE float arithmetic and memcpy)

#ifndef STRATA_EMU
__device__ __forceinline__ float f32_mul(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f32_add(float a, float b) {
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float f32_div(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ int f32_rint(float a) {  // round half to even; saturates; NaN -> 0
    int r;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(a));
    return r;
}
__device__ __forceinline__ float i32_f32(int a) {
    float r;
    asm("cvt.rn.f32.s32 %0, %1;" : "=f"(r) : "r"(a));
    return r;
}
__device__ __forceinline__ float f16_f32(u32 h) {  // exact (an f16 subnormal is an f32 normal)
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"((unsigned short)h));
    return r;
}
__device__ __forceinline__ u32 f16_bits(float a) {  // round to nearest even; past the range: inf
    unsigned short r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(a));
    return r;
}
// copy n (<= 16) bytes of src to dst and zero the rest of the 16: both 16-byte aligned
__device__ __forceinline__ void cp_async16(void* dst, const void* src, u32 n) {
    u64 d;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(d) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"((u32)d), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// d = A B on the int8 tensor cores (a warp-collective; the host emulation has its own from the PTX
// ISA): m16n8k16, s8 x s8 -> s32, A 16 x 16 row-major, B 16 x 8 column-major, no accumulator.
// Lane (g, q) = (lane / 4, lane % 4) holds a0 = A[g][4q .. 4q + 3], a1 = A[g + 8][4q .. 4q + 3],
// b = B[4q .. 4q + 3][g] (four s8 a word, the first in the low byte) and gets d0, d1 = D[g][2q],
// D[g][2q + 1], d2, d3 = D[g + 8][2q], D[g + 8][2q + 1]. Exact: a sum of 16 products of s8 is below 2^18.
__device__ __forceinline__ void mma_s8(u32 a0, u32 a1, u32 b, int* d) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%7, %7, %7, %7};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0));
}
#endif

// ---------------------------------------------------------------------------------------------
// tables, filled by gpu.py from iq_tables.py (the one source) when the module is loaded

__device__ u64 g_iq2xxs[256];
__device__ u64 g_iq2xs[512];
__device__ u64 g_iq2s[1024];
__device__ u32 g_iq3xxs[256];
__device__ u32 g_iq3s[512];
__device__ u64 g_iq1s[2048];
__constant__ u32 c_kv[4];  // kvalues_iq4nl, 16 int8 in 4 words (read uniformly: constant memory)

// ---------------------------------------------------------------------------------------------
// reads from a staged image: A = the alignment the address is known to have

template <int A>
__device__ __forceinline__ u32 rd32(const u8* p) {
    if (A >= 4) return *reinterpret_cast<const u32*>(STRATA_ALIGNED(p, 4));
    const u32* w = reinterpret_cast<const u32*>(STRATA_ALIGNED(p - ((size_t)p & 3), 4));
    return __funnelshift_r(w[0], w[1], 8 * ((u32)(size_t)p & 3));
}
__device__ __forceinline__ u32 rd16(const u8* p) { return *reinterpret_cast<const u16*>(STRATA_ALIGNED(p, 2)); }
template <int A>
__device__ __forceinline__ uint2 rd64(const u8* p) {
    if (A >= 8) return *reinterpret_cast<const uint2*>(STRATA_ALIGNED(p, 8));
    return make_uint2(rd32<A>(p), rd32<A>(p + 4));
}
template <int A>
__device__ __forceinline__ void rd128(const u8* p, u32* q) {  // 16 bytes -> q[0..3]
    if (A >= 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(STRATA_ALIGNED(p, 16));
        q[0] = v.x, q[1] = v.y, q[2] = v.z, q[3] = v.w;
    } else if (A >= 4) {
#pragma unroll
        for (int i = 0; i < 4; i++) q[i] = rd32<4>(p + 4 * i);
    } else {  // 2-byte aligned (IQ4_XS): five words and funnel shifts
        const u32* w = reinterpret_cast<const u32*>(STRATA_ALIGNED(p - ((size_t)p & 3), 4));
        const u32 sh = 8 * ((u32)(size_t)p & 3);
#pragma unroll
        for (int i = 0; i < 4; i++) q[i] = __funnelshift_r(w[i], w[i + 1], sh);
    }
}

// ---------------------------------------------------------------------------------------------
// byte tricks (all carry-free: no byte of a word ever carries into its neighbour)

// bits 0..3 of x -> bytes 0..3 holding 0 or 1 (the four shifted copies of x never overlap)
__device__ __forceinline__ u32 spread4(u32 x) { return ((x & 15u) * 0x00204081u) & 0x01010101u; }

// bytes of g negated where bits 0..3 of s are set. Grid bytes are in 1..127 (gpu.py checks), so
// (g ^ 0xff) + 1 = -g never carries: no per-byte subtraction (__vsub4 is emulated on sm_90).
__device__ __forceinline__ u32 apply_signs(u32 g, u32 s) {
    const u32 b = spread4(s);
    return (g ^ (b * 0xffu)) + b;
}

// ksigns_iq2xs[i] = i | parity(i) << 7 (gpu.py checks this against iq_tables at load)
__device__ __forceinline__ u32 ksigns(u32 i) { return i | ((__popc(i) & 1u) << 7); }

// four nibble values (one per byte) -> kvalues_iq4nl of each, as int8 bytes
__device__ __forceinline__ u32 kv4(u32 x) {
    const u32 l3 = x & 0x07070707u;
    const u32 sel = (l3 & 0x7u) | ((l3 >> 4) & 0x70u) | ((l3 >> 8) & 0x700u) | ((l3 >> 12) & 0x7000u);
    const u32 lo = __byte_perm(c_kv[0], c_kv[1], sel), hi = __byte_perm(c_kv[2], c_kv[3], sel);
    const u32 m = ((x >> 3) & 0x01010101u) * 0xffu;
    return (lo & ~m) | (hi & m);
}

// IQ1 grid word (bytes -1, 0, 1) -> bytes 8 g + 1, or 8 g - 1 when neg
__device__ __forceinline__ u32 iq1_word(u32 g, bool neg) {
    const u32 v = (g << 3) & 0xf8f8f8f8u;  // 8 g per byte: f8, 00, 08
    if (!neg) return v + 0x01010101u;     // f9, 01, 09
    const u32 zero = ((g | (g >> 1)) & 0x01010101u) ^ 0x01010101u;
    return (v ^ 0x0f0f0f0fu) | (zero * 0xf0u);  // f7, ff, 07
}

// ---------------------------------------------------------------------------------------------
// The integer form of one act-block (reference.IntForm): q[0..3] = elements 0..15, q[4..7] =
// 16..31, four int8 per word in element order; for a type with an OFF, q holds the value + OFF
// (unsigned fields) and the half sums subtract OFF * s16, which is exact.

struct Blk {
    u32 q[8];
    int ws0, ws1, mn0, mn1;
    float wf, wm;
};

__device__ __forceinline__ Blk blk_init(float wf) {
    Blk b;
    b.ws0 = b.ws1 = 1;
    b.mn0 = b.mn1 = 0;
    b.wf = wf;
    b.wm = 0.0f;
    return b;
}

// ---------------------------------------------------------------------------------------------
// Block types. Ty<id>: APB act-blocks per block, REST bytes per block in the rest plane, NS f32
// scales per block in the scale plane, OFF (above), HAS_MIN, AL: the alignment of a block in the
// staged image (the largest power of two up to 16 dividing REST); the IQ grid types also name
// their grid (Tab, TAB_N entries, gtab()), which each thread block copies to shared memory: 32
// lanes looking up 32 random grid entries through L1 cost one L1 pass per distinct line.
// dec(B, j, S, tab): act-block j of the block whose rest bytes start at B; S its NS scales; tab
// the shared copy of the grid. Offsets are rest offsets (the block without its fp16 fields).
// Layouts: reference.py.

struct NoTab {
    typedef u32 Tab;
    static constexpr int TAB_N = 0;
    static __device__ __forceinline__ const Tab* gtab() { return nullptr; }
};
struct TabIQ2XXS {
    typedef u64 Tab;
    static constexpr int TAB_N = 256;
    static __device__ __forceinline__ const Tab* gtab() { return g_iq2xxs; }
};
struct TabIQ2XS {
    typedef u64 Tab;
    static constexpr int TAB_N = 512;
    static __device__ __forceinline__ const Tab* gtab() { return g_iq2xs; }
};
struct TabIQ2S {
    typedef u64 Tab;
    static constexpr int TAB_N = 1024;
    static __device__ __forceinline__ const Tab* gtab() { return g_iq2s; }
};
struct TabIQ3XXS {
    typedef u32 Tab;
    static constexpr int TAB_N = 256;
    static __device__ __forceinline__ const Tab* gtab() { return g_iq3xxs; }
};
struct TabIQ3S {
    typedef u32 Tab;
    static constexpr int TAB_N = 512;
    static __device__ __forceinline__ const Tab* gtab() { return g_iq3s; }
};
struct TabIQ1S {
    typedef u64 Tab;
    static constexpr int TAB_N = 2048;
    static __device__ __forceinline__ const Tab* gtab() { return g_iq1s; }
};

template <int T> struct Ty;

template <> struct Ty<8> : NoTab {  // Q8_0  rest: qs i8 x32
    static constexpr int APB = 1, REST = 32, NS = 1, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        rd128<AL>(B, b.q);
        rd128<AL>(B + 16, b.q + 4);
        return b;
    }
};

// 16 bytes -> 32 nibbles: element j < 16 low nibble of byte j, element 16 + j its high nibble
template <int A>
__device__ __forceinline__ void nibbles16(const u8* p, u32* q) {
    rd128<A>(p, q);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        q[4 + i] = (q[i] >> 4) & 0x0f0f0f0fu;
        q[i] &= 0x0f0f0f0fu;
    }
}

template <> struct Ty<2> : NoTab {  // Q4_0  rest: qs x16;  q = nibble - 8
    static constexpr int APB = 1, REST = 16, NS = 1, OFF = 8, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        nibbles16<AL>(B, b.q);
        return b;
    }
};

template <> struct Ty<3> : NoTab {  // Q4_1  scales d, m;  rest: qs x16;  w = d * nibble + m
    static constexpr int APB = 1, REST = 16, NS = 2, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ Blk dec(const u8* B, int, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        nibbles16<AL>(B, b.q);
        b.mn0 = b.mn1 = 1;
        b.wm = S[1];
        return b;
    }
};

template <> struct Ty<20> : NoTab {  // IQ4_NL  rest: qs x16;  q = kvalues[nibble]
    static constexpr int APB = 1, REST = 16, NS = 1, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        nibbles16<AL>(B, b.q);
#pragma unroll
        for (int i = 0; i < 8; i++) b.q[i] = kv4(b.q[i]);
        return b;
    }
};

// Q5_0 / Q5_1  rest: | qh u32 | qs x16 @4 |;  5th bit of element j = bit j of qh
template <int A>
__device__ __forceinline__ void five_bits(const u8* B, u32* q) {
    const u32 qh = rd32<A>(B);
    nibbles16<A>(B + 4, q);
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] |= spread4(qh >> (4 * i)) << 4;
}

template <> struct Ty<6> : NoTab {  // Q5_0  q = q5 - 16
    static constexpr int APB = 1, REST = 20, NS = 1, OFF = 16, AL = 4;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        five_bits<AL>(B, b.q);
        return b;
    }
};

template <> struct Ty<7> : NoTab {  // Q5_1  w = d * q5 + m
    static constexpr int APB = 1, REST = 20, NS = 2, OFF = 0, AL = 4;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ Blk dec(const u8* B, int, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        five_bits<AL>(B, b.q);
        b.mn0 = b.mn1 = 1;
        b.wm = S[1];
        return b;
    }
};

template <> struct Ty<42> : NoTab {  // Q2_0  rest: qs x16, element i = bits 2(i%4) of qs[i/4]; q = field - 1
    static constexpr int APB = 2, REST = 16, NS = 1, OFF = 1, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        const uint2 u = rd64<8>(B + 8 * j);
#pragma unroll
        for (int i = 0; i < 8; i++) {  // byte i: elements 4i .. 4i + 3
            const u32 v = ((i < 4 ? u.x : u.y) >> (8 * (i & 3))) & 0xffu;
            b.q[i] = (v | (v << 6) | (v << 12) | (v << 18)) & 0x03030303u;
        }
        return b;
    }
};

// K types: 256-element blocks, act-block j = elements 32j .. 32j + 31.

template <> struct Ty<10> : NoTab {  // Q2_K  scales d, dmin;  rest: | scales x16 | qs x64 @16 |
    static constexpr int APB = 8, REST = 80, NS = 2, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        const int n = j >> 2, m = j & 3;  // q = (qs[32n + l] >> 2m) & 3
        rd128<AL>(B + 16 + 32 * n, b.q);
        rd128<AL>(B + 32 + 32 * n, b.q + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) b.q[i] = (b.q[i] >> (2 * m)) & 0x03030303u;
        const u32 sa = B[2 * j], sb = B[2 * j + 1];  // sub-blocks 2j, 2j+1: scale | min << 4
        b.ws0 = sa & 15u;
        b.ws1 = sb & 15u;
        b.mn0 = sa >> 4;
        b.mn1 = sb >> 4;
        b.wm = -S[1];
        return b;
    }
};

template <> struct Ty<11> : NoTab {  // Q3_K  scale d;  rest: | hmask x32 | qs x64 @32 | scales x12 @96 |
    static constexpr int APB = 8, REST = 108, NS = 1, OFF = 4, AL = 4;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ int scale6(const u8* B, int s) {
        const u32 lo = (B[96 + (s & 7)] >> (4 * (s >> 3))) & 15u;
        const u32 hi = (B[104 + (s & 3)] >> (2 * (s >> 2))) & 3u;
        return (int)(lo | (hi << 4)) - 32;
    }
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        const int n = j >> 2, m = j & 3;  // q = ((qs[32n + l] >> 2m) & 3 | hmask bit j of byte l << 2) - 4
        u32 h[8];
        rd128<AL>(B, h);
        rd128<AL>(B + 16, h + 4);
        rd128<AL>(B + 32 + 32 * n, b.q);
        rd128<AL>(B + 48 + 32 * n, b.q + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) b.q[i] = ((b.q[i] >> (2 * m)) & 0x03030303u) | (((h[i] >> j) & 0x01010101u) << 2);
        b.ws0 = scale6(B, 2 * j);
        b.ws1 = scale6(B, 2 * j + 1);
        return b;
    }
};

// Q4_K / Q5_K 6-bit scale and min of sub-block j; K = the 12 scale bytes
__device__ __forceinline__ void k4_scale_min(const u8* K, int j, int& sc, int& mn) {
    if (j < 4) {
        sc = K[j] & 63;
        mn = K[j + 4] & 63;
    } else {
        sc = (K[j + 4] & 15) | ((K[j - 4] >> 6) << 4);
        mn = (K[j + 4] >> 4) | ((K[j] >> 6) << 4);
    }
}

template <> struct Ty<12> : NoTab {  // Q4_K  scales d, dmin;  rest: | scales x12 | qs x128 @12 |
    static constexpr int APB = 8, REST = 140, NS = 2, OFF = 0, AL = 4;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        const int p = 12 + 32 * (j >> 1), sh = 4 * (j & 1);  // nibble j & 1 of qs[32 (j >> 1) + l]
        rd128<AL>(B + p, b.q);
        rd128<AL>(B + p + 16, b.q + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) b.q[i] = (b.q[i] >> sh) & 0x0f0f0f0fu;
        int sc, mn;
        k4_scale_min(B, j, sc, mn);
        b.ws0 = b.ws1 = sc;
        b.mn0 = b.mn1 = mn;
        b.wm = -S[1];
        return b;
    }
};

template <> struct Ty<13> : NoTab {  // Q5_K  rest: | scales x12 | qh x32 @12 | qs x128 @44 |
    static constexpr int APB = 8, REST = 172, NS = 2, OFF = 0, AL = 4;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        const int p = 44 + 32 * (j >> 1), sh = 4 * (j & 1);  // 5th bit: bit j of qh[l]
        u32 h[8];
        rd128<AL>(B + 12, h);
        rd128<AL>(B + 28, h + 4);
        rd128<AL>(B + p, b.q);
        rd128<AL>(B + p + 16, b.q + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) b.q[i] = ((b.q[i] >> sh) & 0x0f0f0f0fu) | (((h[i] >> j) & 0x01010101u) << 4);
        int sc, mn;
        k4_scale_min(B, j, sc, mn);
        b.ws0 = b.ws1 = sc;
        b.mn0 = b.mn1 = mn;
        b.wm = -S[1];
        return b;
    }
};

template <> struct Ty<14> : NoTab {  // Q6_K  scale d;  rest: | ql x128 | qh x64 @128 | scales i8 x16 @192 |
    static constexpr int APB = 8, REST = 208, NS = 1, OFF = 32, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        const int n = j >> 2, m = j & 3;  // low: nibble m/2 of ql[64n + 32(m%2) + l]; high: bits 2m of qh[32n + l]
        const int pl = 64 * n + 32 * (m & 1), ph = 128 + 32 * n, sl = 4 * (m >> 1);
        u32 h[8];
        rd128<AL>(B + pl, b.q);
        rd128<AL>(B + pl + 16, b.q + 4);
        rd128<AL>(B + ph, h);
        rd128<AL>(B + ph + 16, h + 4);
#pragma unroll
        for (int i = 0; i < 8; i++) b.q[i] = ((b.q[i] >> sl) & 0x0f0f0f0fu) | (((h[i] >> (2 * m)) & 0x03030303u) << 4);
        b.ws0 = (int)(i8)B[192 + 2 * j];
        b.ws1 = (int)(i8)B[193 + 2 * j];
        return b;
    }
};

// IQ types: wf = d times the power of two the grid scale carries (exact), ws = 2 ls + 1.

template <> struct Ty<16> : TabIQ2XXS {  // IQ2_XXS  rest: 8 x (u32 4 grid indices, u32 4 x 7-bit signs | ls << 28)
    static constexpr int APB = 8, REST = 64, NS = 1, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab* tab) {
        Blk b = blk_init(f32_mul(S[0], 0.125f));
        const uint2 u = rd64<8>(B + 8 * j);
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const u64 gv = tab[(u.x >> (8 * g)) & 255u];
            const u32 s = ksigns((u.y >> (7 * g)) & 127u);
            b.q[2 * g] = apply_signs((u32)gv, s);
            b.q[2 * g + 1] = apply_signs((u32)(gv >> 32), s >> 4);
        }
        b.ws0 = b.ws1 = 2 * (int)(u.y >> 28) + 1;
        return b;
    }
};

template <> struct Ty<17> : TabIQ2XS {  // IQ2_XS  rest: | u16 x32 (9-bit grid index | 7-bit signs << 9) | scales x8 @64 |
    static constexpr int APB = 8, REST = 72, NS = 1, OFF = 0, AL = 8;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab* tab) {
        Blk b = blk_init(f32_mul(S[0], 0.125f));
        const uint2 u = rd64<AL>(B + 8 * j);
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const u32 w = ((g < 2 ? u.x : u.y) >> (16 * (g & 1))) & 0xffffu;
            const u64 gv = tab[w & 511u];
            const u32 s = ksigns(w >> 9);
            b.q[2 * g] = apply_signs((u32)gv, s);
            b.q[2 * g + 1] = apply_signs((u32)(gv >> 32), s >> 4);
        }
        const u32 sc = B[64 + j];  // nibble h serves half h
        b.ws0 = 2 * (int)(sc & 15u) + 1;
        b.ws1 = 2 * (int)(sc >> 4) + 1;
        return b;
    }
};

template <> struct Ty<22> : TabIQ2S {  // IQ2_S  rest: | qs x32 | signs x32 @32 | qh x8 @64 | scales x8 @72 |
    static constexpr int APB = 8, REST = 80, NS = 1, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab* tab) {
        Blk b = blk_init(f32_mul(S[0], 0.125f));
        const u32 qs = rd32<4>(B + 4 * j), sg = rd32<4>(B + 32 + 4 * j), qh = B[64 + j];
#pragma unroll
        for (int g = 0; g < 4; g++) {  // group g: index qs byte g | 2 bits of qh << 8, sign byte g
            const u64 gv = tab[((qs >> (8 * g)) & 255u) | (((qh >> (2 * g)) & 3u) << 8)];
            const u32 s = (sg >> (8 * g)) & 255u;
            b.q[2 * g] = apply_signs((u32)gv, s);
            b.q[2 * g + 1] = apply_signs((u32)(gv >> 32), s >> 4);
        }
        const u32 sc = B[72 + j];
        b.ws0 = 2 * (int)(sc & 15u) + 1;
        b.ws1 = 2 * (int)(sc >> 4) + 1;
        return b;
    }
};

template <> struct Ty<18> : TabIQ3XXS {  // IQ3_XXS  rest: | qs x64 (grid indices) | u32 x8 @64 (4 x 7-bit signs | ls << 28) |
    static constexpr int APB = 8, REST = 96, NS = 1, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab* tab) {
        Blk b = blk_init(f32_mul(S[0], 0.25f));
        const uint2 u = rd64<8>(B + 8 * j);
        const u32 aux = rd32<4>(B + 64 + 4 * j);
#pragma unroll
        for (int g = 0; g < 4; g++) {  // group g: grid entries of index bytes 2g, 2g + 1
            const u32 w = g < 2 ? u.x : u.y;
            const u32 s = ksigns((aux >> (7 * g)) & 127u);
            b.q[2 * g] = apply_signs(tab[(w >> (16 * (g & 1))) & 255u], s);
            b.q[2 * g + 1] = apply_signs(tab[(w >> (16 * (g & 1) + 8)) & 255u], s >> 4);
        }
        b.ws0 = b.ws1 = 2 * (int)(aux >> 28) + 1;
        return b;
    }
};

template <> struct Ty<21> : TabIQ3S {  // IQ3_S  rest: | qs x64 | qh x8 @64 | signs x32 @72 | scales x4 @104 |
    static constexpr int APB = 8, REST = 108, NS = 1, OFF = 0, AL = 4;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab* tab) {
        Blk b = blk_init(S[0]);
        const uint2 u = rd64<AL>(B + 8 * j);
        const u32 qh = B[64 + j], sg = rd32<AL>(B + 72 + 4 * j);
#pragma unroll
        for (int m = 0; m < 8; m++) {  // value m: index byte m | bit m of qh << 8; sign bits 4m..4m+3
            const u32 idx = (((m < 4 ? u.x : u.y) >> (8 * (m & 3))) & 255u) | (((qh >> m) & 1u) << 8);
            b.q[m] = apply_signs(tab[idx], (sg >> (4 * m)) & 15u);
        }
        const u32 s = (B[104 + (j >> 1)] >> (4 * (j & 1))) & 15u;
        b.ws0 = b.ws1 = 2 * (int)s + 1;
        return b;
    }
};

template <> struct Ty<19> : TabIQ1S {  // IQ1_S  rest: | qs x32 | qh u16 x8 @32 |
    static constexpr int APB = 8, REST = 48, NS = 1, OFF = 0, AL = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab* tab) {
        Blk b = blk_init(f32_mul(S[0], 0.125f));
        const u32 qs = rd32<4>(B + 4 * j), h = rd16(B + 32 + 2 * j);
        const bool neg = (h & 0x8000u) != 0;  // delta -1/8 or +1/8: times 8, -1 or +1
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const u64 gv = tab[((qs >> (8 * l)) & 255u) | (((h >> (3 * l)) & 7u) << 8)];
            b.q[2 * l] = iq1_word((u32)gv, neg);
            b.q[2 * l + 1] = iq1_word((u32)(gv >> 32), neg);
        }
        b.ws0 = b.ws1 = 2 * (int)((h >> 12) & 7u) + 1;
        return b;
    }
};

template <> struct Ty<29> : TabIQ1S {  // IQ1_M  no scale plane;  rest: | qs x32 | qh x16 @32 | scales u16 x4 @48 |
    static constexpr int APB = 8, REST = 56, NS = 0, OFF = 0, AL = 8;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float*, const Tab* tab) {
        const uint2 u = rd64<AL>(B + 48);
        const u64 sw = (u64)u.x | ((u64)u.y << 32);  // the fp16 d is the top nibble of each word
        const u32 dbits = (u32)(((sw >> 12) & 0xfu) | ((sw >> 24) & 0xf0u) | ((sw >> 36) & 0xf00u) | ((sw >> 48) & 0xf000u));
        Blk b = blk_init(f32_mul(f16_f32(dbits), 0.125f));
        const u32 qs = rd32<4>(B + 4 * j), qh = rd16(B + 32 + 2 * j);
#pragma unroll
        for (int l = 0; l < 4; l++) {  // group l: nibble l of qh = 3 index bits | delta sign << 3
            const u32 nib = (qh >> (4 * l)) & 15u;
            const u64 gv = tab[((qs >> (8 * l)) & 255u) | ((nib & 7u) << 8)];
            b.q[2 * l] = iq1_word((u32)gv, nib & 8u);
            b.q[2 * l + 1] = iq1_word((u32)(gv >> 32), nib & 8u);
        }
        const int sh = 16 * (j >> 1) + 6 * (j & 1);  // 3-bit scales of the two halves
        b.ws0 = 2 * (int)((sw >> sh) & 7u) + 1;
        b.ws1 = 2 * (int)((sw >> (sh + 3)) & 7u) + 1;
        return b;
    }
};

template <> struct Ty<23> : NoTab {  // IQ4_XS  rest: | scales_h u16 | scales_l x4 @2 | qs x128 @6 |
    static constexpr int APB = 8, REST = 134, NS = 1, OFF = 0, AL = 2;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ Blk dec(const u8* B, int j, const float* S, const Tab*) {
        Blk b = blk_init(S[0]);
        nibbles16<AL>(B + 6 + 16 * j, b.q);
#pragma unroll
        for (int i = 0; i < 8; i++) b.q[i] = kv4(b.q[i]);
        const u32 ls = ((B[2 + (j >> 1)] >> (4 * (j & 1))) & 15u) | (((rd16(B) >> (2 * j)) & 3u) << 4);
        b.ws0 = b.ws1 = (int)ls - 32;
        return b;
    }
};

// ---------------------------------------------------------------------------------------------
// the specified f32 arithmetic

// c_k from the exact half sums lo, hi (however they were made: __dp4a here, mma.sync in mmq)
template <int T>
__device__ __forceinline__ float scaled(int lo, int hi, int ws0, int ws1, int mn0, int mn1, float wf, float wm, float ad,
                                        int xs0, int xs1) {
    typedef Ty<T> L;
    if (L::OFF) {
        lo -= L::OFF * xs0;
        hi -= L::OFF * xs1;
    }
    float c = f32_mul(f32_mul(wf, ad), i32_f32(ws0 * lo + ws1 * hi));
    if (L::HAS_MIN) c = f32_add(c, f32_mul(f32_mul(wm, ad), i32_f32(mn0 * xs0 + mn1 * xs1)));
    return c;
}

template <int T>
__device__ __forceinline__ float term(const Blk& b, const u32* x, float ad, int xs0, int xs1) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        lo = __dp4a((int)b.q[i], (int)x[i], lo);
        hi = __dp4a((int)b.q[4 + i], (int)x[4 + i], hi);
    }
    return scaled<T>(lo, hi, b.ws0, b.ws1, b.mn0, b.mn1, b.wf, b.wm, ad, xs0, xs1);
}

// lane[l] += lane[l + w], w = 16, 8, 4, 2, 1; lane 0 holds reference.fold_lanes' result
__device__ __forceinline__ float fold(float v) {
#pragma unroll
    for (int w = 16; w; w >>= 1) v = f32_add(v, __shfl_down_sync(FULL, v, w));
    return v;
}

__device__ __forceinline__ void load_act(const i8* __restrict__ xq, i64 at, u32* x) {
    const uint4* p = reinterpret_cast<const uint4*>(STRATA_ALIGNED(xq + at, 16));
    const uint4 a = __ldg(p), b = __ldg(p + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
    x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// ---------------------------------------------------------------------------------------------
// Staging. The warp copies bytes [start, start + n) of a plane of `total` bytes into dst as
// their 16-byte aligned cover (dst[i] = plane[start - start % 16 + i]); returns start % 16.
// The last vector of the plane copies only what exists (cp.async's source size) and zero-fills.

__device__ __forceinline__ int stage(u8* dst, const u8* __restrict__ plane, i64 start, i64 n, i64 total, int lane) {
    const i64 a0 = start & ~(i64)15;
    const int nv = (int)((start + n - a0 + 15) >> 4);
    for (int i = lane; i < nv; i += 32) {
        const i64 at = a0 + 16 * (i64)i;
        const i64 left = total - at;
        cp_async16(STRATA_ALIGNED(dst + 16 * i, 16), STRATA_ALIGNED(plane + at, 16), (u32)(left < 16 ? left : 16));
    }
    return (int)(start - a0);
}

// Bytes of one staging buffer: a rest image of up to `blocks` blocks and its scale image.
template <int T>
struct Buf {
    typedef Ty<T> L;
    static __host__ __device__ constexpr int rest(int blocks) { return (blocks * L::REST + 15) / 16 * 16 + 16; }
    static __host__ __device__ constexpr int scales(int blocks) { return L::NS ? (blocks * L::NS * 4 + 15) / 16 * 16 + 16 : 0; }
    static __host__ __device__ constexpr int bytes(int blocks) { return rest(blocks) + scales(blocks); }
    static __host__ __device__ constexpr int tab() { return (L::TAB_N * (int)sizeof(typename L::Tab) + 15) / 16 * 16; }
};

// The type's grid: the block's copy at the start of shared memory when `shared` (the launch
// says so when each block has many rows to amortise the copy over; on an expert-shaped matrix
// the copy cost more than it saved), else the global table.
template <int T>
__device__ __forceinline__ const typename Ty<T>::Tab* load_tab(u8* smem, int shared) {
    typedef Ty<T> L;
    if (!L::TAB_N || !shared) return L::gtab();
    typename L::Tab* tab = reinterpret_cast<typename L::Tab*>(smem);
    for (int i = threadIdx.x; i < L::TAB_N; i += blockDim.x) tab[i] = __ldg(L::gtab() + i);
    __syncthreads();
    return tab;
}

// Rows of the longest row matvec<KPL> takes that one warp step handles: up to 4 rows of 4 KiB
// of blocks in all, so that short rows (IQ1_S: 480 bytes at 2560 elements) do not leave the
// warp's fixed per-row costs (wait, fold) exposed.
// The bytes of weight rows a matvec warp stages per step (at most 4 rows): what it has in flight
// while it computes the step before.
#ifndef STRATA_MV_STEP
#define STRATA_MV_STEP 4096
#endif

template <int T, int KPL>
struct MvRows {
    static constexpr int BLOCKS = (32 * KPL + Ty<T>::APB - 1) / Ty<T>::APB;  // of one row
    static constexpr int N = STRATA_MV_STEP / (BLOCKS * Ty<T>::REST) < 1 ? 1 : (STRATA_MV_STEP / (BLOCKS * Ty<T>::REST) > 4 ? 4 : STRATA_MV_STEP / (BLOCKS * Ty<T>::REST));
};

// ---------------------------------------------------------------------------------------------
// Matrix-vector: a warp takes `nrows` (<= MvRows::N) consecutive rows per step, steps grid-stride,
// and stages the next step's rows while it computes this step's (two buffers per warp). Lane l
// keeps the activation of its act-blocks l + 32 r (r < KPL) in registers for every row: read
// once per warp, not once per row.
//   rest u8 [n_out * nblk * REST]; scales f32 [n_out * nblk * NS]; xq i8 [nb * 32];
//   xd f32 [nb]; xs i32 [2 nb]; out f32 [n_out];  nblk = nb / APB <= 32 KPL / APB
// WIDE = 1: one row of the wide ActQ (actq.ActQ16: xq [2, nb * 32], xd [2, nb], xs [2, 2 nb], its
// hi plane then its lo plane): each row's dot with both, out = 256 dot(hi) + dot(lo)
// (actq.combine16), the row's blocks decoded once for both.
// NT > 1: NT activation rows at once (a speculative verify's 1 + N: xq [NT, nb * 32], xd [NT, nb],
// xs [NT, 2 nb], out [NT, n_out]; WIDE: row t's planes are rows 2t and 2t + 1 of [2 NT, ...]), each
// held in registers as the one row is, every weight row staged and decoded once for all NT. Row t's
// sums are the one-row kernel's on row t alone (lane l adds its act-blocks in order, then the fold;
// WIDE, the combine): mv's bits, and mvf's (with combine16's, WIDE). gpu.py gives it the products
// of few weight rows only (_mv_launch): there it beats mvf, whose warps read their blocks straight
// from global memory (an H100, 2026-12-06, 3 rows of 1024 x 2560: Q6_K 4.4 us against mvf's 5.6,
// Q8_0 3.4 against 5.0, Q8_0's wide form 3.8 against 8.6; the one-row mv 3.2-3.3). On many rows
// the registers cost it occupancy (a Q6_K head: 156 registers a thread, 331 us against mvf's 260),
// as session 38's first form of it found; the rows in shared memory instead (64-80 registers) did
// no better than mvf on the head and worse elsewhere, and were dropped.

// (mv_body: the kernel's work for thread block bx of gx; mv runs it as blockIdx.x of gridDim.x, mvx
// as one of the blocks given to one expert)
template <int T, int KPL, int WIDE, int NT = 1>
__device__ __forceinline__ void mv_body(const u8* __restrict__ rest, const float* __restrict__ scales,
                                        const i8* __restrict__ xq, const float* __restrict__ xd,
                                        const i32* __restrict__ xs, float* __restrict__ out, int n_out, int nb,
                                        int nrows, int shared_tab, int bx, int gx) {
    typedef Ty<T> L;
    typedef Buf<T> F;
    constexpr int RM = MvRows<T, KPL>::N, BLOCKS = RM * MvRows<T, KPL>::BLOCKS, NP = (WIDE ? 2 : 1) * NT;
    constexpr bool S16 = L::HAS_MIN || L::OFF != 0;
    STRATA_SMEM(smem);
    const typename L::Tab* tab = load_tab<T>(smem, shared_tab);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u8* bufs = smem + (shared_tab ? F::tab() : 0) + warp * 2 * F::bytes(BLOCKS);
    const int nblk = nb / L::APB;
    const i64 row_rest = (i64)nblk * L::REST, row_sc = (i64)nblk * L::NS * 4;
    const u8* sc_plane = reinterpret_cast<const u8*>(scales);

    u32 x[NP][KPL][8];
    float ad[NP][KPL];
    int xs0[NP][KPL], xs1[NP][KPL];
#pragma unroll
    for (int r = 0; r < KPL; r++) {
        const int k = lane + 32 * r;
#pragma unroll
        for (int p = 0; p < NP; p++) {
            xs0[p][r] = xs1[p][r] = 0;
            ad[p][r] = 0.0f;
            if (k < nb) {
                load_act(xq, 32 * ((i64)p * nb + k), x[p][r]);
                if (S16) {
                    xs0[p][r] = __ldg(xs + 2 * ((i64)p * nb + k));
                    xs1[p][r] = __ldg(xs + 2 * ((i64)p * nb + k) + 1);
                }
                ad[p][r] = __ldg(xd + (i64)(WIDE ? p & ~1 : p) * nb + k);  // (a row's wide planes have the same d)
            }
        }
    }
    auto issue = [&](u8* buf, i64 o) {  // rows o .. o + nrows - 1 (those that exist)
        const i64 n = min((i64)nrows, n_out - o);
        stage(buf, rest, o * row_rest, n * row_rest, n_out * row_rest, lane);
        if (L::NS) stage(buf + F::rest(BLOCKS), sc_plane, o * row_sc, n * row_sc, n_out * row_sc, lane);
    };
    const i64 step = (i64)gx * nw * nrows;
    i64 o = ((i64)bx * nw + warp) * nrows;
    if (o < n_out) issue(bufs, o);
    cp_async_commit();
    for (int cur = 0; o < n_out; o += step, cur ^= 1) {
        if (o + step < n_out) issue(bufs + (cur ^ 1) * F::bytes(BLOCKS), o + step);
        cp_async_commit();
        cp_async_wait<1>();  // this step's copies (the group before the one just issued) are done
        __syncwarp();
        const u8* R = bufs + cur * F::bytes(BLOCKS);
        const u8* Rb = R + ((o * row_rest) & 15);
        const float* Sb = reinterpret_cast<const float*>(R + F::rest(BLOCKS) + ((o * row_sc) & 15));
#pragma unroll
        for (int i = 0; i < RM; i++) {
            if (i < nrows && o + i < n_out) {  // the same for every lane of the warp
                float acc[NP];
#pragma unroll
                for (int p = 0; p < NP; p++) acc[p] = 0.0f;
#pragma unroll
                for (int r = 0; r < KPL; r++) {
                    const int k = lane + 32 * r;
                    if (k < nb) {
                        const int blk = i * nblk + k / L::APB;
                        const Blk b = L::dec(Rb + blk * L::REST, k % L::APB, Sb + blk * L::NS, tab);
#pragma unroll
                        for (int p = 0; p < NP; p++) acc[p] = f32_add(acc[p], term<T>(b, x[p][r], ad[p][r], xs0[p][r], xs1[p][r]));
                    }
                }
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    float v = fold(acc[WIDE ? 2 * t : t]);
                    if (WIDE) v = f32_add(f32_mul(256.0f, v), fold(acc[2 * t + 1]));
                    if (lane == 0) out[(i64)t * n_out + o + i] = v;
                }
            }
        }
        __syncwarp();  // every lane is done with this buffer before the next step refills it
    }
    cp_async_wait<0>();
}

template <int T, int KPL, int WIDE = 0, int NT = 1>
__global__ void __launch_bounds__(256) mv(const u8* __restrict__ rest, const float* __restrict__ scales,
                                          const i8* __restrict__ xq, const float* __restrict__ xd,
                                          const i32* __restrict__ xs, float* __restrict__ out, int n_out, int nb,
                                          int nrows, int shared_tab) {
    mv_body<T, KPL, WIDE, NT>(rest, scales, xq, xd, xs, out, n_out, nb, nrows, shared_tab, blockIdx.x, gridDim.x);
}

// The routed experts of one token in one launch (the device step, engine/tier/device.py): R
// products, product j on the expert in slot slot[j % k] of the slot storage (slot s at arena + s
// slot_bytes, gate then up then down in engine form: engine/tier/slots.py's layout), matrix j / k
// of it (its planes at rest_off + (j / k) mat_bytes and sc_off + (j / k) mat_bytes), each given
// `per` of the grid's blocks, into out + j n_out, by row (j % k) / x_div of x (x_div 0: row 0). So
// gate and up of every expert are one launch (R = 2k, one input row: x_div 0) and the downs
// another (R = k, row j of x: x_div 1); a verify's T rows (k = T k' slots, row t's k' after row
// t - 1's) the same two launches, gate and up by x_div k' (row t's slots read x's row t). A product
// whose slot is -1 is a miss (the CPU computes it) and is skipped. Each product is mv's on that
// weight alone: the same bits.
template <int T, int KPL>
__global__ void __launch_bounds__(256) mvx(const u8* __restrict__ arena, i64 slot_bytes, i64 mat_bytes, i64 rest_off,
                                           i64 sc_off, const int* __restrict__ slot, int k, int per,
                                           const i8* __restrict__ xq, const float* __restrict__ xd,
                                           const i32* __restrict__ xs, int x_div, float* __restrict__ out, int n_out,
                                           int nb, int nrows, int shared_tab) {
    const int j = blockIdx.x / per;
    const int s = slot[j % k];
    if (s < 0) return;  // the whole block: no barrier is left waiting
    const u8* base = arena + (i64)s * slot_bytes + (i64)(j / k) * mat_bytes;
    const i64 r = x_div ? (i64)((j % k) / x_div) : 0;
    mv_body<T, KPL, 0>(base + rest_off, reinterpret_cast<const float*>(base + sc_off), xq + r * nb * 32, xd + r * nb,
                       xs + r * 2 * nb, out + (i64)j * n_out, n_out, nb, nrows, shared_tab, blockIdx.x % per, per);
}

// Up to 4 one-row products of ONE input in one launch (the device step's linears: a Gated DeltaNet
// layer's in-projections, attention's q/k/v, the shared expert's gate and up): matrix j (rest rj,
// scales sj -> oj [nj]) takes gj of the grid's blocks, after those of the matrices before it, with
// nrj rows a warp step. Each is mv_body on that weight alone, whose rows' arithmetic does not
// depend on the grid: mv's bits. (One launch a matrix cost a graph node each, ~2.5 us on the H200
// beside a product of ~3 us, 2026-12-02.) Unused entries have gj = 0. NT > 1: NT input rows (a
// verify's), oj [NT, nj], as mv<T, KPL, 0, NT>.
template <int T, int KPL, int NT = 1>
__global__ void __launch_bounds__(256) mvm(const i8* __restrict__ xq, const float* __restrict__ xd,
                                           const i32* __restrict__ xs, int nb, int shared_tab,
                                           const u8* r0, const float* s0, float* o0, int n0, int g0, int nr0,
                                           const u8* r1, const float* s1, float* o1, int n1, int g1, int nr1,
                                           const u8* r2, const float* s2, float* o2, int n2, int g2, int nr2,
                                           const u8* r3, const float* s3, float* o3, int n3, int g3, int nr3) {
    int b = blockIdx.x;
    if (b < g0) return mv_body<T, KPL, 0, NT>(r0, s0, xq, xd, xs, o0, n0, nb, nr0, shared_tab, b, g0);
    b -= g0;
    if (b < g1) return mv_body<T, KPL, 0, NT>(r1, s1, xq, xd, xs, o1, n1, nb, nr1, shared_tab, b, g1);
    b -= g1;
    if (b < g2) return mv_body<T, KPL, 0, NT>(r2, s2, xq, xd, xs, o2, n2, nb, nr2, shared_tab, b, g2);
    b -= g2;
    if (b < g3) mv_body<T, KPL, 0, NT>(r3, s3, xq, xd, xs, o3, n3, nb, nr3, shared_tab, b, g3);
}

// ---------------------------------------------------------------------------------------------
// Few-row matrix: ntok <= MVF_TOKENS activation rows against weight rows of any length. A warp per
// weight row, grid-stride, its blocks read straight from global memory (no staging, no activation
// held in registers, so no limit on the row's length). It serves the products mv cannot hold (rows
// over 32 x 8 act-blocks): qwen4exp's hyper-connection down, 10240 elements in, took mmq's
// tensor-core tile of 16 rows x 8 tokens for its one token, 107 us a launch on the H200 for 320 rows.
// Lane l adds act-blocks l, l + 32, ... of each token in that order, then the fold: mv's and mm's bits.
//   xq i8 [ntok, nb * 32]; xd f32 [ntok, nb]; xs i32 [ntok, 2 nb]; out f32 [ntok, n_out]
#define MVF_TOKENS 8

// R weight rows a warp at once (1..4; gpu.py's _mvf_rows picks R by the rows there are to share
// out): a lane loads an act-block of each activation row once for all R, and has R rows' weight
// blocks in flight. On an H200 (benchmarks/mvf_rows.py, 2026-12-06) a 3-row product of a Q6_K LM
// head (248320 x 2560) took 380 us with R = 1, 236 with R = 4, against the 1-row mv's 176; a
// 1024-row one is fastest with R = 1 (fewer warps would share the card). A row's arithmetic is
// the same for any R: lane l adds its act-blocks in order, then the fold.
// (mvf_body: the kernel's work for thread block bx of gx, the grid copy `tab` loaded; mvf runs it as
// blockIdx.x of gridDim.x, mvfm as one of the blocks given to one matrix)
template <int T, int R>
__device__ __forceinline__ void mvf_body(const u8* __restrict__ rest, const float* __restrict__ scales,
                                         const i8* __restrict__ xq, const float* __restrict__ xd,
                                         const i32* __restrict__ xs, float* __restrict__ out, int n_out, int nb,
                                         int ntok, const typename Ty<T>::Tab* tab, int bx, int gx) {
    typedef Ty<T> L;
    constexpr bool S16 = L::HAS_MIN || L::OFF != 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int nblk = nb / L::APB;
    // (a plane starts 16-byte aligned, so a block's address has the alignment mv's staged copy gives it)
    for (i64 o0 = ((i64)bx * nw + warp) * R; o0 < n_out; o0 += (i64)gx * nw * R) {
        const u8* Rb[R];
        const float* Sb[R];
#pragma unroll
        for (int r = 0; r < R; r++) {  // a row past the end reads the last row again, its sums unused
            const i64 o = o0 + r < n_out ? o0 + r : n_out - 1;
            Rb[r] = rest + o * nblk * L::REST;
            Sb[r] = scales + o * nblk * L::NS;
        }
        float acc[R][MVF_TOKENS];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < MVF_TOKENS; t++) acc[r][t] = 0.0f;
        for (int k = lane; k < nb; k += 32) {
            const int blk = k / L::APB;
            Blk b[R];
#pragma unroll
            for (int r = 0; r < R; r++) b[r] = L::dec(Rb[r] + blk * L::REST, k % L::APB, Sb[r] + blk * L::NS, tab);
#pragma unroll
            for (int t = 0; t < MVF_TOKENS; t++) {
                if (t < ntok) {  // the same for every lane
                    const i64 at = (i64)t * nb + k;
                    u32 x[8];
                    load_act(xq, 32 * at, x);
                    const int xs0 = S16 ? __ldg(xs + 2 * at) : 0, xs1 = S16 ? __ldg(xs + 2 * at + 1) : 0;
                    const float d = __ldg(xd + at);
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r][t] = f32_add(acc[r][t], term<T>(b[r], x, d, xs0, xs1));
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
#pragma unroll
            for (int t = 0; t < MVF_TOKENS; t++) {
                if (t < ntok) {
                    const float v = fold(acc[r][t]);
                    if (lane == 0 && o0 + r < n_out) out[(i64)t * n_out + o0 + r] = v;
                }
            }
        }
    }
}

template <int T, int R>
__global__ void __launch_bounds__(256) mvf(const u8* __restrict__ rest, const float* __restrict__ scales,
                                           const i8* __restrict__ xq, const float* __restrict__ xd,
                                           const i32* __restrict__ xs, float* __restrict__ out, int n_out, int nb,
                                           int ntok, int shared_tab) {
    STRATA_SMEM(smem);
    const typename Ty<T>::Tab* tab = load_tab<T>(smem, shared_tab);
    mvf_body<T, R>(rest, scales, xq, xd, xs, out, n_out, nb, ntok, tab, blockIdx.x, gridDim.x);
}

// Up to 4 few-row products of ONE input in one launch (a verify's rows, as mvm is for one token:
// a Gated DeltaNet layer's qkv and z, attention's q/k/v, the shared expert's up and gate): matrix j
// (rest rj, scales sj -> oj [ntok, nj]) takes gj of the grid's blocks, after those of the matrices
// before it. Each is mvf_body on that weight alone, whose rows' arithmetic does not depend on the
// grid: mvf's bits. (A verify of 1 + 2 rows of the demo made 34 + 17 mvf launches where the token
// step grouped its products, ~2.5 us a graph node each, 2026-12-05.) Unused entries have gj = 0.
template <int T, int R>
__global__ void __launch_bounds__(256) mvfm(const i8* __restrict__ xq, const float* __restrict__ xd,
                                            const i32* __restrict__ xs, int nb, int ntok, int shared_tab,
                                            const u8* r0, const float* s0, float* o0, int n0, int g0,
                                            const u8* r1, const float* s1, float* o1, int n1, int g1,
                                            const u8* r2, const float* s2, float* o2, int n2, int g2,
                                            const u8* r3, const float* s3, float* o3, int n3, int g3) {
    STRATA_SMEM(smem);
    const typename Ty<T>::Tab* tab = load_tab<T>(smem, shared_tab);
    int b = blockIdx.x;
    if (b < g0) return mvf_body<T, R>(r0, s0, xq, xd, xs, o0, n0, nb, ntok, tab, b, g0);
    b -= g0;
    if (b < g1) return mvf_body<T, R>(r1, s1, xq, xd, xs, o1, n1, nb, ntok, tab, b, g1);
    b -= g1;
    if (b < g2) return mvf_body<T, R>(r2, s2, xq, xd, xs, o2, n2, nb, ntok, tab, b, g2);
    b -= g2;
    if (b < g3) mvf_body<T, R>(r3, s3, xq, xd, xs, o3, n3, nb, ntok, tab, b, g3);
}

// ---------------------------------------------------------------------------------------------
// Small-batch matrix: T tokens in one pass over the weight. One warp per row (grid-stride); the
// row is taken MM_ROUNDS x 32 act-blocks (a chunk) at a time, the next chunk (of this row or the
// next) staged while this one is computed. Each act-block is decoded once and applied to every
// token; lane l's running sums of the T tokens live in shared memory (acc[t][l]).
//   xq i8 [T, nb * 32]; xd f32 [T, nb]; xs i32 [T, 2 nb]; out f32 [T, n_out]

#define MM_ROUNDS 2

// (mm_body: the kernel's work for thread block bx of gx; token t reads activation row xrow[t] (or
// x0 + t where xrow is null) and writes output row orow[t] (or o0 + t): mm runs it on rows 0 .. ntok
// - 1 as blockIdx.x of gridDim.x, mmx on one tile of a chunk's grouped experts)
template <int T>
__device__ __forceinline__ void mm_body(const u8* __restrict__ rest, const float* __restrict__ scales,
                                        const i8* __restrict__ xq, const float* __restrict__ xd,
                                        const i32* __restrict__ xs, const int* __restrict__ xrow, i64 x0,
                                        const int* __restrict__ orow, i64 o0, float* __restrict__ out, int n_out,
                                        int nb, int ntok, int shared_tab, int bx, int gx) {
    typedef Ty<T> L;
    typedef Buf<T> F;
    constexpr int CA = 32 * MM_ROUNDS, BLOCKS = CA / L::APB;  // act-blocks and blocks per chunk
    constexpr bool S16 = L::HAS_MIN || L::OFF != 0;
    STRATA_SMEM(smem);
    const typename L::Tab* tab = load_tab<T>(smem, shared_tab);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u8* const base = smem + (shared_tab ? F::tab() : 0);
    u8* bufs = base + warp * 2 * F::bytes(BLOCKS);
    float* acc = reinterpret_cast<float*>(base + nw * 2 * F::bytes(BLOCKS)) + warp * ntok * 32 + lane;
    const int nblk = nb / L::APB, nchunk = (nb + CA - 1) / CA;
    const i64 n_in = 32 * (i64)nb, all_rest = (i64)n_out * nblk * L::REST, all_sc = (i64)n_out * nblk * L::NS * 4;
    const u8* sc_plane = reinterpret_cast<const u8*>(scales);
    const i64 step = (i64)gx * nw;

    // work item = (row o, chunk c); the chunk's first block b0 and block count
    auto issue = [&](u8* buf, i64 o, int c) {
        const int b0 = c * BLOCKS, n = min(BLOCKS, nblk - b0);
        stage(buf, rest, (o * nblk + b0) * L::REST, (i64)n * L::REST, all_rest, lane);
        if (L::NS) stage(buf + F::rest(BLOCKS), sc_plane, (o * nblk + b0) * L::NS * 4, (i64)n * L::NS * 4, all_sc, lane);
    };
    i64 o = (i64)bx * nw + warp;
    int c = 0;
    if (o < n_out) issue(bufs, o, 0);
    cp_async_commit();
    for (int cur = 0; o < n_out; cur ^= 1) {
        const bool last = c + 1 == nchunk;
        const i64 on = last ? o + step : o;
        const int cn = last ? 0 : c + 1;
        if (on < n_out) issue(bufs + (cur ^ 1) * F::bytes(BLOCKS), on, cn);
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();
        if (c == 0)
            for (int t = 0; t < ntok; t++) acc[32 * t] = 0.0f;
        const u8* R = bufs + cur * F::bytes(BLOCKS);
        const i64 first = o * nblk + c * BLOCKS;
        const u8* Rb = R + ((first * L::REST) & 15);
        const float* Sb = reinterpret_cast<const float*>(R + F::rest(BLOCKS) + ((first * L::NS * 4) & 15));
#pragma unroll
        for (int r = 0; r < MM_ROUNDS; r++) {
            const int k = c * CA + lane + 32 * r;
            if (k < nb) {
                const int blk = k / L::APB - c * BLOCKS;
                const Blk b = L::dec(Rb + blk * L::REST, k % L::APB, Sb + blk * L::NS, tab);
                for (int t = 0; t < ntok; t++) {
                    const i64 xr = xrow ? (i64)__ldg(xrow + t) : x0 + t;
                    u32 x[8];
                    load_act(xq, xr * n_in + 32 * (i64)k, x);
                    int xs0 = 0, xs1 = 0;
                    if (S16) {
                        xs0 = __ldg(xs + 2 * (xr * nb + k));
                        xs1 = __ldg(xs + 2 * (xr * nb + k) + 1);
                    }
                    acc[32 * t] = f32_add(acc[32 * t], term<T>(b, x, __ldg(xd + xr * nb + k), xs0, xs1));
                }
            }
        }
        if (last)
            for (int t = 0; t < ntok; t++) {
                const float v = fold(acc[32 * t]);
                if (lane == 0) out[(orow ? (i64)__ldg(orow + t) : o0 + t) * n_out + o] = v;
            }
        __syncwarp();
        o = on;
        c = cn;
    }
    cp_async_wait<0>();
}

template <int T>
__global__ void __launch_bounds__(256) mm(const u8* __restrict__ rest, const float* __restrict__ scales,
                                          const i8* __restrict__ xq, const float* __restrict__ xd,
                                          const i32* __restrict__ xs, float* __restrict__ out, int n_out, int nb,
                                          int ntok, int shared_tab) {
    mm_body<T>(rest, scales, xq, xd, xs, nullptr, 0, nullptr, 0, out, n_out, nb, ntok, shared_tab, blockIdx.x, gridDim.x);
}

// Tile blockIdx.x / per of a grouped launch's table (below) as its body's arguments: the weight's
// planes, pair p's activation row (xrow[p], or x0 + p) and output row (orow[p], or o0 + p), n pairs.
// False for an unused tile (n == 0): the whole block returns, so no barrier is left waiting.
struct Tile {
    const u8* rest;
    const float* scales;
    const int *xrow, *orow;
    i64 x0, o0;
    int n;
};
__device__ __forceinline__ bool grouped_tile(const i64* __restrict__ tiles, int per, const int* __restrict__ xrow,
                                             const int* __restrict__ orow, Tile& tl) {
    const i64* t = tiles + 5 * (i64)(blockIdx.x / per);
    const i64 first = t[2];
    tl.rest = reinterpret_cast<const u8*>(t[0]);
    tl.scales = reinterpret_cast<const float*>(t[1]);
    tl.xrow = xrow ? xrow + first : nullptr;
    tl.orow = orow ? orow + first : nullptr;
    tl.x0 = first;
    tl.o0 = t[4] + first;
    tl.n = (int)t[3];
    return tl.n != 0;  // an unused tile of a table sized for the most a chunk can have (dev_group)
}

// A prompt chunk's routed experts in one launch (the device step, engine/tier/device.py): tile i of
// `tiles` (i64 [n_tiles, 5]: the weight's rest plane address, its scale plane address, the first
// pair, the pairs (<= the launch's ntok), the output row base) is given `per` of the grid's blocks
// and computes pairs first .. first + n - 1 as mm does: pair p reads activation row xrow[p] (or p
// where xrow is null) and writes output row orow[p] (or base + p where orow is null). So gate and
// up of every expert a chunk routes to are one launch (xrow: the pairs' tokens; base: 0 for gate,
// the pairs for up) and their downs another (the pairs' h rows; orow: where MoE.routed wants each
// row). Each row is mm's, hence matmul's and the CPU's, on that expert alone: the same bits.
template <int T>
__global__ void __launch_bounds__(256) mmx(const i64* __restrict__ tiles, int per, const i8* __restrict__ xq,
                                           const float* __restrict__ xd, const i32* __restrict__ xs,
                                           const int* __restrict__ xrow, const int* __restrict__ orow,
                                           float* __restrict__ out, int n_out, int nb, int ntok_max, int shared_tab) {
    Tile tl;
    if (!grouped_tile(tiles, per, xrow, orow, tl)) return;
    (void)ntok_max;  // the launch's shared memory is sized for it; every tile has at most that many
    mm_body<T>(tl.rest, tl.scales, xq, xd, xs, tl.xrow, tl.x0, tl.orow, tl.o0, out, n_out, nb, tl.n, shared_tab, blockIdx.x % per, per);
}

// ---------------------------------------------------------------------------------------------
// The batched product on the int8 tensor cores (mmq, mmqx): mm's bits, with the exact half sums
// lo, hi of each (row, token, act-block) made by mma.sync instead of __dp4a. A thread block's
// item is 16 rows x 8 nw tokens (nw warps, warp w the tokens 8w .. 8w + 7, n = 8 of one mma);
// the rows are taken 32 act-blocks (a chunk) at a time:
//   1. the block decodes the chunk of its 16 rows (Ty<T>::dec from the planes in global memory,
//      any type) into shared memory: q as int8 words (the mma's A), the scales per (row, act-block);
//   2. for act-block l = 0 .. 31 of the chunk, each warp makes lo and hi of its 16 x 8 outputs (two
//      mma, B: the tokens' ActQ words read from global memory) and lane (g, q) applies scaled<T>
//      (term's f32 steps) to its four outputs (rows g, g + 8; tokens 2q, 2q + 1), adding the term
//      to partial l of each: p[.][l] is mm's lane l (act-blocks l, l + 32, ... in that order from
//      +0.0f), held in registers;
//   3. after the last chunk, each output folds its 32 partials in fold's tree (w = 16 .. 1).
// The same additions of the same terms in the same order as mm_body: the same bits, whatever the
// tile. A row or token past the edge decodes / reads as something valid and is never written.
//   xq i8 [T, nb * 32]; xd f32 [T, nb]; xs i32 [T, 2 nb]; out f32 [T, n_out]

#define MQ_ROWS 16
// words per row of the decoded chunk (32 act-blocks x 8 words) + 4: the 8 rows g a fragment load
// reads (word 8 l + q of row g) fall in 8 distinct banks, not all in one
#define MQ_RS (8 * 32 + 4)
#define MQ_SS 33  // row stride (uint4) of the per-(row, act-block) scales
// Warps of an mmq block (at most) and the blocks per multiprocessor its registers are bounded for:
// a benchmark's knobs (gpu.py compiles with STRATA_MQ_WARPS / STRATA_MQ_MINB when set). The 4 x 32
// partials are most of a thread's ~190-210 registers; (4 warps, 3 blocks) bounds it to 168, where
// sm_90 spills a few bytes in mmq and 20-80 in mmqx (Q4_K, Q6_K).
#ifndef STRATA_MQ_WARPS
#define STRATA_MQ_WARPS 4
#endif
#ifndef STRATA_MQ_MINB
#define STRATA_MQ_MINB 1
#endif

template <int T>
struct Mq {
    static __host__ __device__ constexpr int bytes() { return MQ_ROWS * MQ_RS * 4 + MQ_ROWS * MQ_SS * 16; }
};

// A (row, act-block)'s scales in one 16-byte word, read by one load: ws0 | ws1 << 16, wf, mn0 |
// mn1 << 16, wm (every type's ws and mn are within int16: int8 at most, Q6_K's)
__device__ __forceinline__ uint4 mq_pack(const Blk& b) {
    return make_uint4(((u32)b.ws0 & 0xffffu) | ((u32)b.ws1 << 16), __float_as_uint(b.wf),
                      ((u32)b.mn0 & 0xffffu) | ((u32)b.mn1 << 16), __float_as_uint(b.wm));
}
__device__ __forceinline__ int lo16(u32 v) { return (int)(v << 16) >> 16; }
__device__ __forceinline__ int hi16(u32 v) { return (int)v >> 16; }

// one level of fold's tree on 32 partials held by one thread: v[l] += v[l + W] (W a constant: with
// the level as a loop variable NVCC kept the partials in local memory)
template <int W>
__device__ __forceinline__ void fold_step(float* v) {
#pragma unroll
    for (int l = 0; l < W; l++) v[l] = f32_add(v[l], v[l + W]);
}

// The decode of one chunk (act-blocks 32c .. 32c + 31) of the 16 rows from ob into a decoded image
// (aq: q words, ssc: mq_pack), by threads tid = 0 .. nthr - 1 of whoever shares the image (mq_body:
// the block; mqw_body: one warp); entry i = 32 row + act-block, so a warp's lanes read consecutive
// act-blocks of one row. A row or act-block past the edge is zeros: never written out / never read.
// NTHR: nthr when known at compile time (mqw_body: 32, each lane 16 entries), the loop then unrolled
// UNROLL times so that many entries' loads are in flight at once: each entry's bytes come from global
// memory, and one at a time a lane would wait out a memory latency per entry. SPAN, kk0, KS: only
// act-blocks kk0 + KS j (j < SPAN) of the chunk (mqk_body: a warp's share), entry i = SPAN row + j.
template <int T, int NTHR = 0, int UNROLL = 1, int SPAN = 32, int KS = 1>
__device__ __forceinline__ void mq_decode(u32* aq, uint4* ssc, const u8* __restrict__ rest, const float* __restrict__ scales,
                                          const typename Ty<T>::Tab* tab, int ob, int c, int n_out, int nb, int tid, int nthr,
                                          int kk0 = 0) {
    typedef Ty<T> L;
    const int nblk = nb / L::APB;
    if (NTHR) nthr = NTHR;
#pragma unroll UNROLL
    for (int i = tid; i < MQ_ROWS * SPAN; i += nthr) {
        const int rr = i / SPAN, kk = kk0 + KS * (i % SPAN), o = ob + rr, k = 32 * c + kk, si = rr * MQ_SS + kk;
        uint4* dst = reinterpret_cast<uint4*>(STRATA_ALIGNED(aq + rr * MQ_RS + 8 * kk, 16));
        if (o < n_out && k < nb) {
            const i64 blk = (i64)o * nblk + k / L::APB;
            const Blk b = L::dec(rest + blk * L::REST, k % L::APB, scales + blk * L::NS, tab);
            dst[0] = make_uint4(b.q[0], b.q[1], b.q[2], b.q[3]);
            dst[1] = make_uint4(b.q[4], b.q[5], b.q[6], b.q[7]);
            ssc[si] = mq_pack(b);
        } else {
            dst[0] = dst[1] = make_uint4(0u, 0u, 0u, 0u);
            ssc[si] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// The four terms of lane (g, q) for act-block l of chunk c of a decoded image (k = 32 c + l < nb):
// lo and hi by two mma (B: token xb's ActQ words), then scaled<T> of its four outputs (rows g,
// g + 8; tokens xc0, xc1 as 2q, 2q + 1), output i = row g + 8 (i >> 1), token 2q + (i & 1).
template <int T>
__device__ __forceinline__ void mq_terms(float* cv, const u32* aq, const uint4* ssc, const i8* __restrict__ xq,
                                         const float* __restrict__ xd, const i32* __restrict__ xs, int k, int l, int nb,
                                         i64 xb, i64 xc0, i64 xc1, int g, int q) {
    typedef Ty<T> L;
    constexpr bool S16 = L::HAS_MIN || L::OFF != 0;
    const u32* a = aq + g * MQ_RS + 8 * l + q;
    const u32* x = reinterpret_cast<const u32*>(STRATA_ALIGNED(xq + xb * 32 * (i64)nb + 32 * (i64)k + 4 * q, 4));
    int lo[4], hi[4];
    mma_s8(a[0], a[8 * MQ_RS], __ldg(x), lo);
    mma_s8(a[4], a[8 * MQ_RS + 4], __ldg(x + 4), hi);
    float ad[2];
    int s0[2] = {0, 0}, s1[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const i64 xc = j ? xc1 : xc0;
        ad[j] = __ldg(xd + xc * nb + k);
        if (S16) {
            s0[j] = __ldg(xs + 2 * (xc * nb + k));
            s1[j] = __ldg(xs + 2 * (xc * nb + k) + 1);
        }
    }
    const uint4 sc[2] = {ssc[g * MQ_SS + l], ssc[(g + 8) * MQ_SS + l]};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const uint4 v = sc[i >> 1];
        const int j = i & 1;
        cv[i] = scaled<T>(lo[i], hi[i], lo16(v.x), hi16(v.x), lo16(v.z), hi16(v.z), __uint_as_float(v.y),
                          __uint_as_float(v.w), ad[j], s0[j], s1[j]);
    }
}

// One warp's 16 x 8 outputs over chunk c of a decoded image: for act-block l = 0 .. 31 lane (g, q)
// adds its four terms to partial l of each output: p[.][l] is mm's lane l.
template <int T>
__device__ __forceinline__ void mq_steps(float (&p)[4][32], const u32* aq, const uint4* ssc, const i8* __restrict__ xq,
                                         const float* __restrict__ xd, const i32* __restrict__ xs, int c, int nb,
                                         i64 xb, i64 xc0, i64 xc1, int g, int q) {
#pragma unroll
    for (int l = 0; l < 32; l++) {
        const int k = 32 * c + l;
        if (k < nb) {  // the same for every lane
            float cv[4];
            mq_terms<T>(cv, aq, ssc, xq, xd, xs, k, l, nb, xb, xc0, xc1, g, q);
#pragma unroll
            for (int i = 0; i < 4; i++) p[i][l] = f32_add(p[i][l], cv[i]);
        }
    }
}

// An n-tile's tokens as lane (g, q) sees them: its B token (g) and its output tokens (2q, 2q + 1)
// of tokens tw .. tw + 7, the last token standing in past the edge (read, never written)
struct MqTok {
    i64 xb, xc0, xc1;
};
__device__ __forceinline__ MqTok mq_tok(const int* __restrict__ xrow, i64 x0, int tw, int ntok, int g, int q) {
    const int tb = min(tw + g, ntok - 1), tc0 = min(tw + 2 * q, ntok - 1), tc1 = min(tw + 2 * q + 1, ntok - 1);
    MqTok r;
    r.xb = xrow ? (i64)__ldg(xrow + tb) : x0 + tb;
    r.xc0 = xrow ? (i64)__ldg(xrow + tc0) : x0 + tc0;
    r.xc1 = xrow ? (i64)__ldg(xrow + tc1) : x0 + tc1;
    return r;
}

__device__ __forceinline__ void mq_zero(float (&p)[4][32]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int l = 0; l < 32; l++) p[i][l] = 0.0f;
}

// each output folds its 32 partials in fold's tree and lane (g, q) writes its four
__device__ __forceinline__ void mq_store(float (&p)[4][32], const int* __restrict__ orow, i64 o0, float* __restrict__ out,
                                         int n_out, int ob, int tw, int ntok, int g, int q) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        fold_step<16>(p[i]), fold_step<8>(p[i]), fold_step<4>(p[i]), fold_step<2>(p[i]), fold_step<1>(p[i]);
        const int o = ob + g + 8 * (i >> 1), t = tw + 2 * q + (i & 1);
        if (o < n_out && t < ntok) out[(orow ? (i64)__ldg(orow + t) : o0 + t) * n_out + o] = p[i][0];
    }
}

template <int T>
__device__ __forceinline__ void mq_body(const u8* __restrict__ rest, const float* __restrict__ scales,
                                        const i8* __restrict__ xq, const float* __restrict__ xd,
                                        const i32* __restrict__ xs, const int* __restrict__ xrow, i64 x0,
                                        const int* __restrict__ orow, i64 o0, float* __restrict__ out, int n_out,
                                        int nb, int ntok, int shared_tab, int bx, int gx) {
    typedef Ty<T> L;
    STRATA_SMEM(smem);
    const typename L::Tab* tab = load_tab<T>(smem, shared_tab);
    u32* const aq = reinterpret_cast<u32*>(smem + (shared_tab ? Buf<T>::tab() : 0));
    uint4* const ssc = reinterpret_cast<uint4*>(aq + MQ_ROWS * MQ_RS);  // [16][MQ_SS]: mq_pack
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, g = lane >> 2, q = lane & 3;
    const int nchunk = (nb + 31) / 32, groups = (n_out + MQ_ROWS - 1) / MQ_ROWS;
    const i64 items = (i64)groups * ((ntok + 8 * nw - 1) / (8 * nw));

    for (i64 it = bx; it < items; it += gx) {  // the same for every thread of the block
        const int ob = (int)(it % groups) * MQ_ROWS, tw = (int)(it / groups) * 8 * nw + 8 * warp;
        const bool active = tw < ntok;  // the same for every lane of the warp
        const MqTok tk = mq_tok(xrow, x0, tw, ntok, g, q);
        float p[4][32];
        mq_zero(p);
        for (int c = 0; c < nchunk; c++) {
            __syncthreads();  // every warp is done with the chunk before
            mq_decode<T>(aq, ssc, rest, scales, tab, ob, c, n_out, nb, threadIdx.x, blockDim.x);
            __syncthreads();
            if (active) mq_steps<T>(p, aq, ssc, xq, xd, xs, c, nb, tk.xb, tk.xc0, tk.xc1, g, q);
        }
        if (active) mq_store(p, orow, o0, out, n_out, ob, tw, ntok, g, q);
    }
}

template <int T>
__global__ void __launch_bounds__(32 * STRATA_MQ_WARPS, STRATA_MQ_MINB) mmq(const u8* __restrict__ rest, const float* __restrict__ scales,
                                           const i8* __restrict__ xq, const float* __restrict__ xd,
                                           const i32* __restrict__ xs, float* __restrict__ out, int n_out, int nb,
                                           int ntok, int shared_tab) {
    mq_body<T>(rest, scales, xq, xd, xs, nullptr, 0, nullptr, 0, out, n_out, nb, ntok, shared_tab, blockIdx.x, gridDim.x);
}

// mmx's tiles (the same table and arguments) through mq_body
template <int T>
__global__ void __launch_bounds__(32 * STRATA_MQ_WARPS, STRATA_MQ_MINB) mmqx(const i64* __restrict__ tiles, int per, const i8* __restrict__ xq,
                                            const float* __restrict__ xd, const i32* __restrict__ xs,
                                            const int* __restrict__ xrow, const int* __restrict__ orow,
                                            float* __restrict__ out, int n_out, int nb, int ntok_max, int shared_tab) {
    Tile tl;
    if (!grouped_tile(tiles, per, xrow, orow, tl)) return;
    (void)ntok_max;
    mq_body<T>(tl.rest, tl.scales, xq, xd, xs, tl.xrow, tl.x0, tl.orow, tl.o0, out, n_out, nb, tl.n, shared_tab, blockIdx.x % per, per);
}

// mmqw: mmx's tiles (the same table and arguments) on the int8 tensor cores with every warp on its
// own 16 rows. Why not mmqx: a tile has the pairs one expert got in a chunk, ~5 in a 256-token
// prompt (top-10 of 512 experts), so mmqx's block item (16 rows x 8 nw tokens) had four warps decode
// and then one run the mma while three waited at the barrier (H200, 2026-12-02: 1.4-1.5x mmx's time
// on Q4_K, Q2_0, IQ3_XXS). Here a warp decodes its rows' chunk into its own image (no barrier but
// __syncwarp) and runs the tile's n-tiles of 8 tokens over it, so every resident warp does mma work;
// a single-chunk row (nb <= 32: the down projections) is decoded once for all its n-tiles, a longer
// one once per (n-tile, chunk) (the partials of one n-tile fill the registers). The arithmetic is
// mq_body's (mq_decode, mq_steps, mq_store): the same terms in the same order, mm's bits.
// Shared memory: Mq<T>::bytes() (25 KB) a warp, so a block is STRATA_MQW_WARPS = 1 warp (two would pass
// the 48 KB a launch may take without an opt-in); 8 such blocks fit a multiprocessor.
#ifndef STRATA_MQW_WARPS
#define STRATA_MQW_WARPS 1
#endif
// entries of its decode a lane has in flight (mq_decode's UNROLL; a benchmark's knob)
#ifndef STRATA_MQW_UNROLL
#define STRATA_MQW_UNROLL 4
#endif

template <int T>
__device__ __forceinline__ void mqw_body(const u8* __restrict__ rest, const float* __restrict__ scales,
                                         const i8* __restrict__ xq, const float* __restrict__ xd,
                                         const i32* __restrict__ xs, const int* __restrict__ xrow, i64 x0,
                                         const int* __restrict__ orow, i64 o0, float* __restrict__ out, int n_out,
                                         int nb, int ntok, int shared_tab, int bx, int gx) {
    typedef Ty<T> L;
    STRATA_SMEM(smem);
    const typename L::Tab* tab = load_tab<T>(smem, shared_tab);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, g = lane >> 2, q = lane & 3;
    u32* const aq = reinterpret_cast<u32*>(smem + (shared_tab ? Buf<T>::tab() : 0) + warp * Mq<T>::bytes());
    uint4* const ssc = reinterpret_cast<uint4*>(aq + MQ_ROWS * MQ_RS);
    const int nchunk = (nb + 31) / 32, groups = (n_out + MQ_ROWS - 1) / MQ_ROWS;

    for (int gi = bx * nw + warp; gi < groups; gi += gx * nw) {  // the same for every lane of the warp
        const int ob = gi * MQ_ROWS;
        for (int tw = 0; tw < ntok; tw += 8) {
            const MqTok tk = mq_tok(xrow, x0, tw, ntok, g, q);
            float p[4][32];
            mq_zero(p);
            for (int c = 0; c < nchunk; c++) {
                if (nchunk > 1 || tw == 0) {
                    __syncwarp();  // every lane is done with the image before
                    mq_decode<T, 32, STRATA_MQW_UNROLL>(aq, ssc, rest, scales, tab, ob, c, n_out, nb, lane, 32);
                    __syncwarp();
                }
                mq_steps<T>(p, aq, ssc, xq, xd, xs, c, nb, tk.xb, tk.xc0, tk.xc1, g, q);
            }
            mq_store(p, orow, o0, out, n_out, ob, tw, ntok, g, q);
        }
    }
}

template <int T>
__global__ void __launch_bounds__(32 * STRATA_MQW_WARPS) mmqw(const i64* __restrict__ tiles, int per, const i8* __restrict__ xq,
                                                             const float* __restrict__ xd, const i32* __restrict__ xs,
                                                             const int* __restrict__ xrow, const int* __restrict__ orow,
                                                             float* __restrict__ out, int n_out, int nb, int ntok_max, int shared_tab) {
    Tile tl;
    if (!grouped_tile(tiles, per, xrow, orow, tl)) return;
    (void)ntok_max;
    mqw_body<T>(tl.rest, tl.scales, xq, xd, xs, tl.xrow, tl.x0, tl.orow, tl.o0, out, n_out, nb, tl.n, shared_tab, blockIdx.x % per, per);
}

// mmqk: mmx's tiles (the same table and arguments) on the int8 tensor cores, the chunk's act-blocks
// split between a block's MQK_WARPS = 4 warps. Why: a tile's few pairs fill one n-tile of 8 tokens or
// less, so mmqx's warps (one an n-tile) waited at its barrier, and mmqw's (one a row group) each
// held 4 x 32 partials and a 25 KB image; here warp w takes act-blocks w, w + 4, .., w + 28 of each
// chunk of the block's 16 rows (interleaved: a short chunk, such as a down projection's 20 act-blocks
// or gate/up's last 16, still gives every warp its share): it decodes just those (its part of the
// image: __syncwarp, no block barrier in the loop) and keeps partials l = w + 4j of its outputs,
// 4 x 8 an n-tile, so STRATA_MQK_NT
// n-tiles (8 tokens each) are held at once over one decode. After the last chunk the warps' partials
// meet in shared memory (over the image) and each output folds its 32 in fold's tree. Partial l is
// mm's lane l (act-blocks l, l + 32, ... in that order from +0.0f): mm's bits, whatever the split.
// sm_90 (nvcc 13, -Xptxas -v): NT = 1 takes 112-124 registers, no spills: 4 blocks (16 warps) a
// multiprocessor, where mmqx had 2 of 4 warps; NT = 2 takes 150-168 (3 blocks); NT = 1 with
// STRATA_MQK_MINB = 5 fits 94-96 (5 blocks), no spills. Which is fastest is the card's call.
#define MQK_WARPS 4
#define MQK_FS 33  // floats a row of the fold scratch (an output's 32 partials + 1: reads in 32 banks)
#ifndef STRATA_MQK_NT
#define STRATA_MQK_NT 1
#endif
// blocks a multiprocessor mmqk's registers are bounded for (a benchmark's knob): unbounded, NVCC gave
// Q8_0 164 registers at NT = 1 (3 blocks) where the other types took 114-128, so 4 (<= 128
// registers, no spills for Q8_0, Q4_K, Q6_K, Q2_0, IQ3_XXS); 3 at NT = 2 (158-167, no spills; bounded to 4
// blocks it spilled 32-152 bytes)
#ifndef STRATA_MQK_MINB
#define STRATA_MQK_MINB (STRATA_MQK_NT == 1 ? 4 : 3)
#endif

template <int T>
struct Mqk {
    static __host__ __device__ constexpr int fold() { return STRATA_MQK_NT * MQ_ROWS * 8 * MQK_FS * 4; }
    static __host__ __device__ constexpr int bytes() { return Mq<T>::bytes() > fold() ? Mq<T>::bytes() : fold(); }
};

template <int T>
__device__ __forceinline__ void mqk_body(const u8* __restrict__ rest, const float* __restrict__ scales,
                                         const i8* __restrict__ xq, const float* __restrict__ xd,
                                         const i32* __restrict__ xs, const int* __restrict__ xrow, i64 x0,
                                         const int* __restrict__ orow, i64 o0, float* __restrict__ out, int n_out,
                                         int nb, int ntok, int shared_tab, int bx, int gx) {
    typedef Ty<T> L;
    constexpr int NT = STRATA_MQK_NT, SPAN = 32 / MQK_WARPS;
    STRATA_SMEM(smem);
    const typename L::Tab* tab = load_tab<T>(smem, shared_tab);
    u8* const base = smem + (shared_tab ? Buf<T>::tab() : 0);
    u32* const aq = reinterpret_cast<u32*>(base);
    uint4* const ssc = reinterpret_cast<uint4*>(aq + MQ_ROWS * MQ_RS);
    float* const fs = reinterpret_cast<float*>(base);  // [NT][16 rows x 8 tokens][MQK_FS], over the image
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int nchunk = (nb + 31) / 32, groups = (n_out + MQ_ROWS - 1) / MQ_ROWS;
    const i64 items = (i64)groups * ((ntok + 8 * NT - 1) / (8 * NT));

    for (i64 it = bx; it < items; it += gx) {  // the same for every thread of the block
        const int ob = (int)(it % groups) * MQ_ROWS, t0 = (int)(it / groups) * 8 * NT;
        MqTok tk[NT];
        float p[NT][4][SPAN];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            tk[n] = mq_tok(xrow, x0, t0 + 8 * n, ntok, g, q);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < SPAN; j++) p[n][i][j] = 0.0f;
        }
        __syncthreads();  // the previous item's fold is done with the scratch the image overlays
        for (int c = 0; c < nchunk; c++) {
            __syncwarp();  // every lane is done with the warp's part of the image
            mq_decode<T, 32, SPAN * MQ_ROWS / 32, SPAN, MQK_WARPS>(aq, ssc, rest, scales, tab, ob, c, n_out, nb, lane, 32, warp);
            __syncwarp();
#pragma unroll
            for (int j = 0; j < SPAN; j++) {
                const int l = warp + MQK_WARPS * j, k = 32 * c + l;
                if (k < nb) {  // the same for every lane
#pragma unroll
                    for (int n = 0; n < NT; n++) {
                        if (t0 + 8 * n < ntok) {  // the same for every lane
                            float cv[4];
                            mq_terms<T>(cv, aq, ssc, xq, xd, xs, k, l, nb, tk[n].xb, tk[n].xc0, tk[n].xc1, g, q);
#pragma unroll
                            for (int i = 0; i < 4; i++) p[n][i][j] = f32_add(p[n][i][j], cv[i]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with the image: the scratch takes its place
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int e = n * MQ_ROWS * 8 + (g + 8 * (i >> 1)) * 8 + 2 * q + (i & 1);  // (n-tile, row, token)
#pragma unroll
                for (int j = 0; j < SPAN; j++) fs[e * MQK_FS + warp + MQK_WARPS * j] = p[n][i][j];
            }
        __syncthreads();
        for (int e = threadIdx.x; e < NT * MQ_ROWS * 8; e += blockDim.x) {
            const int o = ob + (e >> 3) % MQ_ROWS, t = t0 + 8 * (e / (MQ_ROWS * 8)) + (e & 7);
            if (o < n_out && t < ntok) {
                float v[32];
#pragma unroll
                for (int l = 0; l < 32; l++) v[l] = fs[e * MQK_FS + l];
                fold_step<16>(v), fold_step<8>(v), fold_step<4>(v), fold_step<2>(v), fold_step<1>(v);
                out[(orow ? (i64)__ldg(orow + t) : o0 + t) * n_out + o] = v[0];
            }
        }
    }
}

template <int T>
__global__ void __launch_bounds__(32 * MQK_WARPS, STRATA_MQK_MINB) mmqk(const i64* __restrict__ tiles, int per, const i8* __restrict__ xq,
                                                       const float* __restrict__ xd, const i32* __restrict__ xs,
                                                       const int* __restrict__ xrow, const int* __restrict__ orow,
                                                       float* __restrict__ out, int n_out, int nb, int ntok_max, int shared_tab) {
    Tile tl;
    if (!grouped_tile(tiles, per, xrow, orow, tl)) return;
    (void)ntok_max;
    mqk_body<T>(tl.rest, tl.scales, xq, xd, xs, tl.xrow, tl.x0, tl.orow, tl.o0, out, n_out, nb, tl.n, shared_tab, blockIdx.x % per, per);
}

// ---------------------------------------------------------------------------------------------
// mmt: a chunk's dense product on the int8 tensor cores in block tiles of MT_ROWS rows x MT_TOKS
// tokens (warp tiles of 32 x 16), mm's bits. Why not mmq: its warp held 32 partials for each of its
// 4 outputs (mm's lanes: partial l sums act-blocks l, l + 32, ... before fold's tree), so a warp's
// item stayed 16 rows x 8 tokens, the block's decoded rows served 32 tokens, and its activations
// came from global memory at every mma (the H200, 2026-12-03: Q5_0 2560 x 10240 at 256 tokens
// ran 0.9 ms, ~15 int8 TOP/s). Here the act-blocks are taken leaf by leaf in the order of fold's
// tree: leaf i = 0 .. 31 is partial l = bitrev5(i) (its act-blocks l + 32 c, c ascending, from
// +0.0f), and a finished leaf is folded at once into a stack of pending subtrees (r[h]: the left
// subtree of height h still waiting for its right one), like a binary counter. The post-order of
// fold's tree is that leaf order, so the additions are the tree's, with the same operands: mm's
// bits, with 6 floats an output where there were 32 (the order is tested against reference.fold_lanes).
// A block stages MT_KS entries (leaf-major, c minor: entry s is leaf s / nchunk, chunk s % nchunk)
// at a time: the rows decoded into shared memory (q words, mq_pack scales) and the tokens' ActQ
// words with (d, s0, s1); its warps then run the mma and the scaled<T> terms over them.
//   xq i8 [T, nb * 32]; xd f32 [T, nb]; xs i32 [T, 2 nb]; out f32 [T, n_out]
#ifndef STRATA_MT_WR
#define STRATA_MT_WR 2  // warps along the rows (32 rows each): a benchmark's knob
#endif
#ifndef STRATA_MT_WC
#define STRATA_MT_WC 2  // warps along the tokens (16 tokens each): a benchmark's knob
#endif
#ifndef STRATA_MT_MINB
#define STRATA_MT_MINB 1  // blocks a multiprocessor mmt's registers are bounded for: a benchmark's knob
#endif
#ifndef STRATA_MT_KS
#define STRATA_MT_KS 8  // entries (act-blocks) a block stages at a time, a divisor of 32: a benchmark's knob
#endif
#define MT_KS STRATA_MT_KS
#define MT_ROWS (32 * STRATA_MT_WR)
#define MT_TOKS (16 * STRATA_MT_WC)
#define MT_RS (8 * MT_KS + 4)         // words a staged row / token: + 4 so a fragment load's 8 rows fall in distinct banks
#define MT_SS (MT_KS + 1)             // uint4 a staged row's / token's scales: + 1 for the same reason
#define MT_THREADS (32 * STRATA_MT_WR * STRATA_MT_WC)

template <int T>
struct Mt {
    static __host__ __device__ constexpr int bytes() { return (MT_ROWS + MT_TOKS) * (MT_RS * 4 + MT_SS * 16); }
};

// leaf i's act-block of chunk c: l = bitrev5(i)
__device__ __forceinline__ int mt_k(int i, int c) {
    const int l = ((i & 1) << 4) | ((i & 2) << 2) | (i & 4) | ((i & 8) >> 2) | ((i & 16) >> 4);
    return 32 * c + l;
}

// leaf i's partial p (then +0.0f again) into the stack of pending subtrees r[0..4]; after leaf 31
// r[4] holds fold's result. Five written-out steps, not a loop over the heights with a break: that
// loop (2026-12-03) put r in local memory on the card (mmt<6>: 96 registers and 320 bytes of local
// memory a thread, 256 x 8192 x 2560 Q5_0 at 458 us where this form ran 376)
template <int N>
__device__ __forceinline__ void mt_push(float (&p)[N], float (&r)[N][5], int i) {
#pragma unroll
    for (int o = 0; o < N; o++) {
        float v = p[o];
        p[o] = 0.0f;
        if (!(i & 1)) {
            r[o][0] = v;
            continue;
        }
        v = f32_add(r[o][0], v);
        if (!(i & 2)) {
            r[o][1] = v;
            continue;
        }
        v = f32_add(r[o][1], v);
        if (!(i & 4)) {
            r[o][2] = v;
            continue;
        }
        v = f32_add(r[o][2], v);
        if (!(i & 8)) {
            r[o][3] = v;
            continue;
        }
        v = f32_add(r[o][3], v);
        r[o][4] = (i & 16) ? f32_add(r[o][4], v) : v;
    }
}

template <int T>
__device__ __forceinline__ void mt_body(const u8* __restrict__ rest, const float* __restrict__ scales,
                                        const i8* __restrict__ xq, const float* __restrict__ xd,
                                        const i32* __restrict__ xs, float* __restrict__ out, int n_out, int nb,
                                        int ntok, int shared_tab, int bx, int gx) {
    typedef Ty<T> L;
    constexpr bool S16 = L::HAS_MIN || L::OFF != 0;
    STRATA_SMEM(smem);
    const typename L::Tab* tab = load_tab<T>(smem, shared_tab);
    u32* const aq = reinterpret_cast<u32*>(smem + (shared_tab ? Buf<T>::tab() : 0));  // [MT_ROWS][MT_RS]
    u32* const bq = aq + MT_ROWS * MT_RS;                                                // [MT_TOKS][MT_RS]
    uint4* const asc = reinterpret_cast<uint4*>(bq + MT_TOKS * MT_RS);                   // [MT_ROWS][MT_SS]: mq_pack
    uint4* const bsc = asc + MT_ROWS * MT_SS;                                            // [MT_TOKS][MT_SS]: d, s0, s1
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int wr = warp % STRATA_MT_WR, wc = warp / STRATA_MT_WR;
    const int nchunk = (nb + 31) / 32, steps = 32 * nchunk / MT_KS, nblk = nb / L::APB;
    const int groups = (n_out + MT_ROWS - 1) / MT_ROWS;
    const i64 items = (i64)groups * ((ntok + MT_TOKS - 1) / MT_TOKS);

    for (i64 it = bx; it < items; it += gx) {  // the same for every thread of the block
        const int ob = (int)(it % groups) * MT_ROWS, tb = (int)(it / groups) * MT_TOKS;
        float p[16], r[16][5];  // output 8 mt + 4 nt + i: m-tile mt, n-tile nt, the mma's slot i
#pragma unroll
        for (int o = 0; o < 16; o++) p[o] = 0.0f;
        for (int st = 0; st < steps; st++) {
            __syncthreads();  // every warp is done with the step before
            // (a constant trip count, unrolled: a thread's entries' loads are in flight together)
#pragma unroll
            for (int i = threadIdx.x; i < MT_ROWS * MT_KS; i += MT_THREADS) {
                const int rr = i / MT_KS, e = i % MT_KS, s = st * MT_KS + e, o = ob + rr;
                const int k = mt_k(s / nchunk, s % nchunk);
                uint4* dst = reinterpret_cast<uint4*>(STRATA_ALIGNED(aq + rr * MT_RS + 8 * e, 16));
                if (o < n_out && k < nb) {
                    const i64 blk = (i64)o * nblk + k / L::APB;
                    const Blk b = L::dec(rest + blk * L::REST, k % L::APB, scales + blk * L::NS, tab);
                    dst[0] = make_uint4(b.q[0], b.q[1], b.q[2], b.q[3]);
                    dst[1] = make_uint4(b.q[4], b.q[5], b.q[6], b.q[7]);
                    asc[rr * MT_SS + e] = mq_pack(b);
                } else {
                    dst[0] = dst[1] = make_uint4(0u, 0u, 0u, 0u);
                    asc[rr * MT_SS + e] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
#pragma unroll
            for (int i = threadIdx.x; i < MT_TOKS * MT_KS; i += MT_THREADS) {
                const int tt = i / MT_KS, e = i % MT_KS, s = st * MT_KS + e;
                const int k = mt_k(s / nchunk, s % nchunk);
                if (k < nb) {  // (an entry past nb is never read)
                    const i64 at = (i64)min(tb + tt, ntok - 1) * nb + k;  // a token past the edge: the last, never written
                    const uint4* src = reinterpret_cast<const uint4*>(STRATA_ALIGNED(xq + 32 * at, 16));
                    uint4* dst = reinterpret_cast<uint4*>(STRATA_ALIGNED(bq + tt * MT_RS + 8 * e, 16));
                    dst[0] = __ldg(src);
                    dst[1] = __ldg(src + 1);
                    bsc[tt * MT_SS + e] = make_uint4(__float_as_uint(__ldg(xd + at)), S16 ? (u32)__ldg(xs + 2 * at) : 0u,
                                                     S16 ? (u32)__ldg(xs + 2 * at + 1) : 0u, 0u);
                }
            }
            __syncthreads();
#pragma unroll
            for (int e = 0; e < MT_KS; e++) {
                const int s = st * MT_KS + e, leaf = s / nchunk, c = s - leaf * nchunk, k = mt_k(leaf, c);
                if (k < nb) {  // the same for every thread
                    int lo[2][2][4], hi[2][2][4];
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        const u32* a = aq + (32 * wr + 16 * mt + g) * MT_RS + 8 * e + q;
#pragma unroll
                        for (int nt = 0; nt < 2; nt++) {
                            const u32* b = bq + (16 * wc + 8 * nt + g) * MT_RS + 8 * e + q;
                            mma_s8(a[0], a[8 * MT_RS], b[0], lo[mt][nt]);
                            mma_s8(a[4], a[8 * MT_RS + 4], b[4], hi[mt][nt]);
                        }
                    }
                    uint4 rs[2][2], ts[2][2];  // rows 32 wr + 16 mt + g + 8 h; tokens 16 wc + 8 nt + 2 q + j
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        rs[h][0] = asc[(32 * wr + 8 * h + g) * MT_SS + e];
                        rs[h][1] = asc[(32 * wr + 16 + 8 * h + g) * MT_SS + e];
                        ts[h][0] = bsc[(16 * wc + 2 * q + h) * MT_SS + e];
                        ts[h][1] = bsc[(16 * wc + 8 + 2 * q + h) * MT_SS + e];
                    }
#pragma unroll
                    for (int mt = 0; mt < 2; mt++)
#pragma unroll
                        for (int nt = 0; nt < 2; nt++)
#pragma unroll
                            for (int i = 0; i < 4; i++) {
                                const uint4 v = rs[i >> 1][mt], x = ts[i & 1][nt];
                                const float cv = scaled<T>(lo[mt][nt][i], hi[mt][nt][i], lo16(v.x), hi16(v.x), lo16(v.z), hi16(v.z),
                                                           __uint_as_float(v.y), __uint_as_float(v.w), __uint_as_float(x.x),
                                                           (int)x.y, (int)x.z);
                                p[8 * mt + 4 * nt + i] = f32_add(p[8 * mt + 4 * nt + i], cv);
                            }
                }
                if (c == nchunk - 1) mt_push(p, r, leaf);
            }
        }
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int o = ob + 32 * wr + 16 * mt + g + 8 * (i >> 1), t = tb + 16 * wc + 8 * nt + 2 * q + (i & 1);
                    if (o < n_out && t < ntok) out[(i64)t * n_out + o] = r[8 * mt + 4 * nt + i][4];
                }
    }
}

// ---------------------------------------------------------------------------------------------
// The dense prompt products through cuBLAS (gpu.gemm_products): each value v as two f16, hi =
// f16(v) and lo = f16((v - hi) 2^11), 22 bits of it between them, so that cuBLAS's f16 GEMMs
// with f32 accumulation, hi hi (alpha 1) + [hi lo + lo hi] (alpha 2^-11, one GEMM over both
// halves of the rows), give the product of the int8 activations (ActQ, as the token path
// multiplies them) within float32 rounding (one f16 GEMM alone was 2^-11 of each term away: the
// device step's prompt then left the token path's logits by ~1e-3). v - hi is exact (Sterbenz).
// deq_h: rows r0 .. r0 + n_rows - 1 of the weight, thread i act-block i % nb of slab row i / nb,
// element 16h + j: v = wf * f32(ws[h] (q - OFF)) [+ wm * f32(mn[h])] (q, ws, mn small integers).
//   out u16 [n_rows, 64 nb]: each row its lo parts, then its hi parts

__device__ __forceinline__ u32 f16_split(float v, u32* lo) {
    const u32 hi = f16_bits(v);
    *lo = f16_bits(f32_mul(f32_add(v, -f16_f32(hi)), 2048.0f));
    return hi;
}

template <int T>
__global__ void __launch_bounds__(256) deq_h(const u8* __restrict__ rest, const float* __restrict__ scales, u16* __restrict__ out,
                                             i64 r0, int n_rows, int nb) {
    typedef Ty<T> L;
    const typename L::Tab* tab = load_tab<T>(nullptr, 0);
    const int nblk = nb / L::APB;
    const i64 n = (i64)n_rows * nb;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / nb, o = r0 + row;
        const int k = (int)(i % nb);
        const i64 blk = o * nblk + k / L::APB;
        const Blk b = L::dec(rest + blk * L::REST, k % L::APB, scales + blk * L::NS, tab);
        u32 h[16], l[16];
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const int half = j >> 4, q = (int)(i8)(b.q[j >> 2] >> (8 * (j & 3))) - L::OFF;
            float v = f32_mul(b.wf, i32_f32((half ? b.ws1 : b.ws0) * q));
            if (L::HAS_MIN) v = f32_add(v, f32_mul(b.wm, i32_f32(half ? b.mn1 : b.mn0)));
            u32 lo;
            const u32 hi = f16_split(v, &lo);
            h[j >> 1] = (j & 1) ? (h[j >> 1] | (hi << 16)) : hi;
            l[j >> 1] = (j & 1) ? (l[j >> 1] | (lo << 16)) : lo;
        }
        uint4* dl = reinterpret_cast<uint4*>(STRATA_ALIGNED(out + row * 64 * nb + 32 * k, 16));
        uint4* dh = reinterpret_cast<uint4*>(STRATA_ALIGNED(out + row * 64 * nb + 32 * (nb + k), 16));
#pragma unroll
        for (int v = 0; v < 4; v++) {
            dl[v] = make_uint4(l[4 * v], l[4 * v + 1], l[4 * v + 2], l[4 * v + 3]);
            dh[v] = make_uint4(h[4 * v], h[4 * v + 1], h[4 * v + 2], h[4 * v + 3]);
        }
    }
}

template <int T>
__global__ void __launch_bounds__(MT_THREADS, STRATA_MT_MINB) mmt(const u8* __restrict__ rest, const float* __restrict__ scales,
                                                                      const i8* __restrict__ xq, const float* __restrict__ xd,
                                                                      const i32* __restrict__ xs, float* __restrict__ out, int n_out,
                                                                      int nb, int ntok, int shared_tab) {
    mt_body<T>(rest, scales, xq, xd, xs, out, n_out, nb, ntok, shared_tab, blockIdx.x, gridDim.x);
}

// The fragment layout of mma_s8 as mq_body uses it, against a plain integer product (the tests):
//   A i8 [16, 16] row-major; Bt i8 [8, 16] (B's columns); D i32 [16, 8]; one warp
__global__ void mma_probe(const i8* __restrict__ A, const i8* __restrict__ Bt, int* __restrict__ D) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const u32* a = reinterpret_cast<const u32*>(A);
    const u32* b = reinterpret_cast<const u32*>(Bt);
    int d[4];
    mma_s8(a[4 * g + q], a[4 * (g + 8) + q], b[4 * g + q], d);
    for (int i = 0; i < 4; i++) D[(g + 8 * (i >> 1)) * 8 + 2 * q + (i & 1)] = d[i];
}

// What gpu.py checks against index_format.ggml_types (the one table) and sizes launches by:
// [APB, REST, NS, HAS_MIN, table bytes, mm buffer bytes, then for KPL = 1 .. 8: rows per mv
// step, mv buffer bytes, then mmq's shared bytes (the grid copy aside) and most warps, mmqw's warps,
// mmqk's and mmt's shared bytes].
template <int KPL, int T>
__device__ void mv_traits(int* out) {
    out[4 + 2 * KPL] = MvRows<T, KPL>::N;
    out[5 + 2 * KPL] = Buf<T>::bytes(MvRows<T, KPL>::N * MvRows<T, KPL>::BLOCKS);
}

template <int T>
__global__ void traits(int* out) {
    typedef Ty<T> L;
    if (threadIdx.x == 0) {
        out[0] = L::APB;
        out[1] = L::REST;
        out[2] = L::NS;
        out[3] = L::HAS_MIN;
        out[4] = Buf<T>::tab();
        out[5] = Buf<T>::bytes(32 * MM_ROUNDS / L::APB);
        mv_traits<1, T>(out);
        mv_traits<2, T>(out);
        mv_traits<3, T>(out);
        mv_traits<4, T>(out);
        mv_traits<5, T>(out);
        mv_traits<6, T>(out);
        mv_traits<7, T>(out);
        mv_traits<8, T>(out);
        out[22] = Mq<T>::bytes();
        out[23] = STRATA_MQ_WARPS;
        out[24] = STRATA_MQW_WARPS;
        out[25] = Mqk<T>::bytes();
        out[26] = Mt<T>::bytes();
    }
}

// ---------------------------------------------------------------------------------------------
// F32 / F16 / BF16 weights against f32 activations: lane j adds w * x of elements j, j + 32, ...
// (each product rounded to f32) in element order to +0.0f, then the same fold.
//   w [n_out * n_in] (f32, or 16-bit halves / bfloat16 bits); x f32 [T, n_in]; out f32 [T, n_out]

template <int WT>
__device__ __forceinline__ float load_w(const void* w, i64 i) {
    if (WT == 0) return __ldg(reinterpret_cast<const float*>(w) + i);
    const u32 h = __ldg(reinterpret_cast<const u16*>(w) + i);
    return WT == 1 ? f16_f32(h) : __uint_as_float(h << 16);
}

// (fmv_rows: fmv's work for thread block bx of gx; fmv runs it as blockIdx.x of gridDim.x, fmvm
// as one of the blocks given to one matrix)
template <int WT>
__device__ __forceinline__ void fmv_rows(const void* __restrict__ w, const float* __restrict__ x,
                                         float* __restrict__ out, int n_out, int n_in, int bx, int gx) {
    // A lane's loads go out 16 at a time before its (ordered) sum takes them: the adds must stay
    // one chain in element order, and with the loads interleaved in that chain a warp waited on
    // memory for each few (2026-12-02, H200: ~9 us for a 3072-long router or gate row set of a
    // token, a handful of warps on 132 multiprocessors).
    constexpr int C = 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 o = (i64)bx * nw + warp; o < n_out; o += (i64)gx * nw) {
        const i64 base = o * n_in;
        float acc = 0.0f;
        int k = lane;
        for (; k + 32 * (C - 1) < n_in; k += 32 * C) {
            float wv[C], xv[C];
#pragma unroll
            for (int c = 0; c < C; c++) wv[c] = load_w<WT>(w, base + k + 32 * c), xv[c] = __ldg(x + k + 32 * c);
#pragma unroll
            for (int c = 0; c < C; c++) acc = f32_add(acc, f32_mul(wv[c], xv[c]));
        }
        for (; k < n_in; k += 32) acc = f32_add(acc, f32_mul(load_w<WT>(w, base + k), __ldg(x + k)));
        acc = fold(acc);
        if (lane == 0) out[o] = acc;
    }
}

template <int WT>
__global__ void __launch_bounds__(256) fmv(const void* __restrict__ w, const float* __restrict__ x,
                                           float* __restrict__ out, int n_out, int n_in) {
    fmv_rows<WT>(w, x, out, n_out, n_in, blockIdx.x, gridDim.x);
}

// fmv of up to 4 matrices of one input in one launch (mvm's table: matrix j, weights wj -> oj
// [ntok, nj], takes gj blocks a token; a router and the shared expert's gate logit, a Gated
// DeltaNet's beta and alpha), for ntok rows x [ntok, n_in] (a token step's one, a verify's few:
// fmt's and fmm's bits are fmv's): each row fmv's bits.
template <int WT>
__global__ void __launch_bounds__(256) fmvm(const float* __restrict__ x, int n_in, int ntok,
                                            const void* w0, float* o0, int n0, int g0, const void* w1, float* o1, int n1, int g1,
                                            const void* w2, float* o2, int n2, int g2, const void* w3, float* o3, int n3, int g3) {
    const void* const w[4] = {w0, w1, w2, w3};
    float* const o[4] = {o0, o1, o2, o3};
    const int n[4] = {n0, n1, n2, n3}, g[4] = {g0, g1, g2, g3};
    int b = blockIdx.x;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        if (b < g[j] * ntok) {  // matrix j, token b / g[j]
            const int t = b / g[j];
            fmv_rows<WT>(w[j], x + (i64)t * n_in, o[j] + (i64)t * n[j], n[j], n_in, b % g[j], g[j]);
            return;
        }
        b -= g[j] * ntok;
    }
}

// fmm: T tokens. A warp takes a tile of FMM_R weight rows x FMM_T tokens, its FMM_R x FMM_T sums in
// registers: each weight element it loads serves FMM_T tokens and each activation element FMM_R
// rows. Every sum is still lane j's products of elements j, j + 32, ... in element order, then the
// fold: fmv's bits. (The first fmm gave a warp one row and re-read all T activation rows for each
// row, with its sums in shared memory: a 256-token chunk's 512-row router read ~1.3 GB through L2,
// ~480 us a launch, 40% of the all-resident prompt's device time on the H200, 2026-12-02.)
// Replaced by fmt below; kept (STRATA_FMM=8x8, gpu.use_fmm) to be measured against it.
#define FMM_R 8
#define FMM_T 8

template <int WT>
__global__ void __launch_bounds__(256) fmm(const void* __restrict__ w, const float* __restrict__ x,
                                           float* __restrict__ out, int n_out, int n_in, int ntok) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 row_tiles = (n_out + FMM_R - 1) / FMM_R, tiles = row_tiles * ((ntok + FMM_T - 1) / FMM_T);
    for (i64 tile = (i64)blockIdx.x * nw + warp; tile < tiles; tile += (i64)gridDim.x * nw) {
        const int o0 = (int)(tile % row_tiles) * FMM_R, t0 = (int)(tile / row_tiles) * FMM_T;
        i64 wrow[FMM_R], xrow[FMM_T];  // past the edge: the last row / token again, never written
#pragma unroll
        for (int r = 0; r < FMM_R; r++) wrow[r] = (i64)min(o0 + r, n_out - 1) * n_in;
#pragma unroll
        for (int t = 0; t < FMM_T; t++) xrow[t] = (i64)min(t0 + t, ntok - 1) * n_in;
        float acc[FMM_R][FMM_T];
#pragma unroll
        for (int r = 0; r < FMM_R; r++)
#pragma unroll
            for (int t = 0; t < FMM_T; t++) acc[r][t] = 0.0f;
        for (int k = lane; k < n_in; k += 32) {
            float wv[FMM_R], xv[FMM_T];
#pragma unroll
            for (int r = 0; r < FMM_R; r++) wv[r] = load_w<WT>(w, wrow[r] + k);
#pragma unroll
            for (int t = 0; t < FMM_T; t++) xv[t] = __ldg(x + xrow[t] + k);
#pragma unroll
            for (int r = 0; r < FMM_R; r++)
#pragma unroll
                for (int t = 0; t < FMM_T; t++) acc[r][t] = f32_add(acc[r][t], f32_mul(wv[r], xv[t]));
        }
#pragma unroll
        for (int r = 0; r < FMM_R; r++)
#pragma unroll
            for (int t = 0; t < FMM_T; t++) {
                const float v = fold(acc[r][t]);
                if (lane == 0 && o0 + r < n_out && t0 + t < ntok) out[(i64)(t0 + t) * n_out + o0 + r] = v;
            }
    }
}

// fmt: fmm's arithmetic, tiled for the whole launch (gpu.py picks it unless STRATA_FMM=8x8 asks for
// fmm). A warp takes R weight rows x C tokens, lane j the partial of elements j, j + 32, ... of each
// of its R x C outputs in element order (fmv's chain, so fmv's and fmm's bits), then the fold.
// Why it is faster than fmm (2026-12-02 on the H200, ~130 us a 64-token launch whatever the shape):
// - gpu.py takes all T tokens in one launch (fmm was launched per 64) and shrinks R and C until the
//   tiles give every multiprocessor warps: a router of 64 tokens made 256 warps, two GDN gates 32,
//   the shared expert's one-row gate 8, each a 64-step chain of load-then-add on few multiprocessors.
// - U steps' loads go out before their adds (fmv's lesson): the adds stay one chain per output in
//   element order, the loads of the next steps do not wait on them.
// - A block's 8 warps take BR row tiles x 8 / BR token tiles (BR = 2 where there are two row
//   tiles): they share both their weight rows and their activation rows through L1, 48 rows of
//   loads for 16 x 32 outputs at 8 x 8 where a column of 8 row tiles needed 72 for 64 x 8.
// Tiles past n_out / ntok repeat the last row / token (never written); whole warp tiles past the
// edge are skipped (no barrier: only the warp's own shuffles).
template <int WT> struct FloatW { typedef u16 E; };
template <> struct FloatW<0> { typedef float E; };

template <int WT>
__device__ __forceinline__ float w_f32(typename FloatW<WT>::E v) {
    if (WT == 0) return (float)v;
    return WT == 1 ? f16_f32((u32)v) : __uint_as_float((u32)v << 16);
}

template <int WT, int R, int C>
__global__ void __launch_bounds__(256, 2) fmt(const void* __restrict__ w, const float* __restrict__ x,
                                              float* __restrict__ out, int n_out, int n_in, int ntok, int br) {
    typedef typename FloatW<WT>::E E;
    constexpr int U = R + C >= 16 ? 1 : 32 / (R + C);  // steps whose loads go out together (8 x 8: 2 spilled)
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5, bc = nw / br;
    const int row_tiles = (n_out + R - 1) / R, tok_tiles = (ntok + C - 1) / C;
    const int row_groups = (row_tiles + br - 1) / br;
    const i64 groups = (i64)row_groups * ((tok_tiles + bc - 1) / bc);
    for (i64 g = blockIdx.x; g < groups; g += gridDim.x) {
        const int rt = (int)(g % row_groups) * br + warp % br, tt = (int)(g / row_groups) * bc + warp / br;
        if (rt >= row_tiles || tt >= tok_tiles) continue;  // (the whole warp)
        const int o0 = rt * R, t0 = tt * C;
        u32 wo[R], xo[C];  // element offsets from row o0 / token t0
#pragma unroll
        for (int r = 0; r < R; r++) wo[r] = (u32)(min(o0 + r, n_out - 1) - o0) * (u32)n_in;
#pragma unroll
        for (int t = 0; t < C; t++) xo[t] = (u32)(min(t0 + t, ntok - 1) - t0) * (u32)n_in;
        const E* wp = reinterpret_cast<const E*>(w) + (i64)o0 * n_in + lane;
        const float* xp = x + (i64)t0 * n_in + lane;
        float acc[R][C];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < C; t++) acc[r][t] = 0.0f;
        int k = lane;
        for (; k + 32 * (U - 1) < n_in; k += 32 * U, wp += 32 * U, xp += 32 * U) {
            float wv[U][R], xv[U][C];
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int r = 0; r < R; r++) wv[u][r] = w_f32<WT>(__ldg(wp + wo[r] + 32 * u));
#pragma unroll
                for (int t = 0; t < C; t++) xv[u][t] = __ldg(xp + xo[t] + 32 * u);
            }
#pragma unroll
            for (int u = 0; u < U; u++)
#pragma unroll
                for (int r = 0; r < R; r++)
#pragma unroll
                    for (int t = 0; t < C; t++) acc[r][t] = f32_add(acc[r][t], f32_mul(wv[u][r], xv[u][t]));
        }
        for (; k < n_in; k += 32, wp += 32, xp += 32) {
            float wv[R], xv[C];
#pragma unroll
            for (int r = 0; r < R; r++) wv[r] = w_f32<WT>(__ldg(wp + wo[r]));
#pragma unroll
            for (int t = 0; t < C; t++) xv[t] = __ldg(xp + xo[t]);
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int t = 0; t < C; t++) acc[r][t] = f32_add(acc[r][t], f32_mul(wv[r], xv[t]));
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < C; t++) {
                const float v = fold(acc[r][t]);
                if (lane == 0 && o0 + r < n_out && t0 + t < ntok) out[(i64)(t0 + t) * n_out + o0 + r] = v;
            }
    }
}

// ---------------------------------------------------------------------------------------------
// ActQ (actq.py, bit for bit): one warp per 32-element block, lane j holds x[j].
//   amax = max |x|;  d = amax / 127 (correctly rounded);  q = d == 0 ? 0 : clamp(rint(x / d), +-127)
//   s16[h] = sum of q over half h.
// The max is taken on the bit patterns of |x| (ordered like the values for non-negative floats,
// and blind to -ftz); d == 0 is a bit test. A non-finite x is not quantized silently: the lowest
// such index goes to *bad (preset to ~0).
//   x f32 [nblocks * 32]; q i8 [nblocks * 32]; d f32 [nblocks]; s16 i32 [2 nblocks]

__global__ void __launch_bounds__(256) actq(const float* __restrict__ x, i8* __restrict__ q, float* __restrict__ d,
                                            i32* __restrict__ s16, i64 nblocks, u64* __restrict__ bad) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 b = (i64)blockIdx.x * nw + warp; b < nblocks; b += (i64)gridDim.x * nw) {
        const i64 i = 32 * b + lane;
        const float v = x[i];
        const u32 a = __float_as_uint(v) & 0x7fffffffu;
        if (a >= 0x7f800000u) atomicMin(bad, (u64)i);  // inf or NaN
        u32 amax = a;
#pragma unroll
        for (int w = 16; w; w >>= 1) amax = max(amax, __shfl_xor_sync(FULL, amax, w));
        const float db = f32_div(__uint_as_float(amax), 127.0f);
        int qi = 0;
        if (__float_as_uint(db) != 0u) qi = min(max(f32_rint(f32_div(v, db)), -127), 127);
        q[i] = (i8)qi;
        int s = qi;
#pragma unroll
        for (int w = 8; w; w >>= 1) s += __shfl_xor_sync(FULL, s, w);  // stays inside each 16-lane half
        if (lane == 0) d[b] = db;
        if ((lane & 15) == 0) s16[2 * b + (lane >> 4)] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// The wide ActQ (actq.py's ActQ16, bit for bit): per 32-element block, as actq above with
//   d = amax / 32639;  q = d == 0 ? 0 : clamp(rint(x / d), +-32639);  hi = (q + 128) >> 8;  lo = q - 256 hi
// row t's hi plane to row 2t, its lo plane to row 2t + 1, each with the same d and its own half sums.
//   x f32 [T, nb * 32]; q i8 [2T, nb * 32]; d f32 [2T, nb]; s16 i32 [2T, 2 nb]; nblocks = T nb

__global__ void __launch_bounds__(256) actq16(const float* __restrict__ x, i8* __restrict__ q, float* __restrict__ d,
                                              i32* __restrict__ s16, i64 nblocks, i64 nb, u64* __restrict__ bad) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (i64 b = (i64)blockIdx.x * nw + warp; b < nblocks; b += (i64)gridDim.x * nw) {
        const i64 i = 32 * b + lane;
        const i64 bh = b + (b / nb) * nb;  // block b (row t = b / nb) in the hi row 2t; + nb: in the lo row
        const float v = x[i];
        const u32 a = __float_as_uint(v) & 0x7fffffffu;
        if (a >= 0x7f800000u) atomicMin(bad, (u64)i);  // inf or NaN
        u32 amax = a;
#pragma unroll
        for (int w = 16; w; w >>= 1) amax = max(amax, __shfl_xor_sync(FULL, amax, w));
        const float db = f32_div(__uint_as_float(amax), 32639.0f);
        int qi = 0;
        if (__float_as_uint(db) != 0u) qi = min(max(f32_rint(f32_div(v, db)), -32639), 32639);
        const int hi = (qi + 128) >> 8, lo = qi - 256 * hi;  // arithmetic shift: floor
        q[32 * bh + lane] = (i8)hi;
        q[32 * (bh + nb) + lane] = (i8)lo;
        int sh = hi, sl = lo;
#pragma unroll
        for (int w = 8; w; w >>= 1) {  // stays inside each 16-lane half
            sh += __shfl_xor_sync(FULL, sh, w);
            sl += __shfl_xor_sync(FULL, sl, w);
        }
        if (lane == 0) d[bh] = d[bh + nb] = db;
        if ((lane & 15) == 0) {
            s16[2 * bh + (lane >> 4)] = sh;
            s16[2 * (bh + nb) + (lane >> 4)] = sl;
        }
    }
}

// The dense GEMM route's activations (gpu.gemm_products): the values the token path multiplies,
// x = d q (ActQ; wide: d (256 q_hi + q_lo), the planes in rows 2t and 2t + 1), divided by 256 and
// split as deq_h splits the weights. Why / 256: f16 ends at 65504 and an unnormalized input (a
// shared expert's down reads silu(g) u) may pass it; scaled, hi reaches 2^24 (alpha 256 undoes it).
//   q i8 [T (wide: 2T), 32 nb]; d f32 [T (2T), nb]; y u16 [T, 64 nb]: each row its hi parts, then its lo parts

__global__ void __launch_bounds__(256) to_h(const i8* __restrict__ q, const float* __restrict__ d, u16* __restrict__ y,
                                            i64 T, int nb, int wide) {
    const i64 n = T * 32 * nb;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / (32 * nb), e = i - t * 32 * nb;
        float x;
        if (wide) {
            const i64 a = 2 * t * 32 * nb + e;
            x = f32_mul(d[2 * t * nb + e / 32], i32_f32(256 * (int)q[a] + (int)q[a + 32 * nb]));
        } else {
            x = f32_mul(d[t * nb + e / 32], i32_f32((int)q[i]));
        }
        u32 lo;
        const u32 hi = f16_split(f32_mul(x, 0.00390625f), &lo);
        y[t * 64 * nb + e] = (u16)hi;
        y[t * 64 * nb + 32 * nb + e] = (u16)lo;
    }
}

// A product of the wide form from its planes' products (actq.combine16):
//   out[t, j] = 256 y[2t, j] + y[2t + 1, j]   (256 y is exact: one rounding, with or without an FMA)
//   y f32 [2T, n_out]; out f32 [T, n_out]

__global__ void __launch_bounds__(256) combine16(const float* __restrict__ y, float* __restrict__ out, i64 n_out, i64 n) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        const i64 t = i / n_out, j = i - t * n_out;
        out[i] = f32_add(f32_mul(256.0f, y[2 * t * n_out + j]), y[(2 * t + 1) * n_out + j]);
    }
}
