// Host emulation of the CUDA features engine/kernels/gpu_kernels.cu uses, so its kernels can be
// run and checked bit for bit on a machine without a GPU (tests/gpu_emu.py builds and drives it).
//
// Every CUDA thread of a block is a fiber (ucontext) on one host thread; __syncwarp,
// __syncthreads and the shuffles are barriers between fibers. The schedule is deterministic, and a
// barrier that some threads never reach is reported as a deadlock instead of hanging.
// Float intrinsics are plain IEEE single operations: build with -ffp-contract=off (no FMA) on a
// target whose float arithmetic is SSE (x86-64), which rounds each operation to nearest even.

#pragma once
#include <ucontext.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#define STRATA_EMU 1
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct uint2 {
    unsigned int x, y;
};
struct uint4 {
    unsigned int x, y, z, w;
};

namespace emu {

struct Dim3 {
    unsigned x, y, z;
};

struct Fiber {
    ucontext_t ctx;
    bool done;
};

struct Bar {
    int count = 0;
    long gen = 0;
};

inline std::vector<Fiber> fibers;
inline std::vector<std::vector<char>> stacks;
inline std::vector<Bar> warp_bars;
inline std::vector<uint64_t> xbuf;  // 32 shuffle slots per warp
inline std::vector<uint32_t> mbuf;  // 3 mma fragment words per thread
inline Bar block_bar;
inline ucontext_t sched;
inline int cur = 0;  // the running fiber = threadIdx.x
inline long events = 0;
inline unsigned block = 0, grid = 0, bdim = 0;
inline unsigned char* smem_ptr = nullptr;
inline void (*body)(void*, void**) = nullptr;
inline void* body_fn = nullptr;
inline void** body_params = nullptr;

inline char fault[256] = "";  // the first misaligned access of a launch

template <class P>
inline P aligned(P p, unsigned n, int line) {
    if (reinterpret_cast<uintptr_t>(p) % n && !fault[0])
        snprintf(fault, sizeof fault, "thread %d of block %u: %u-byte access at %p, not aligned (gpu_kernels.cu line %d)", cur, block, n,
                 (const void*)p, line);
    return p;
}

inline Dim3 thread_idx() { return {(unsigned)cur, 0, 0}; }
inline Dim3 block_idx() { return {block, 0, 0}; }
inline Dim3 block_dim() { return {bdim, 1, 1}; }
inline Dim3 grid_dim() { return {grid, 1, 1}; }

inline void yield() { swapcontext(&fibers[cur].ctx, &sched); }

inline void wait(Bar& b, int n) {
    const long gen = b.gen;
    events++;
    if (++b.count == n) {
        b.count = 0;
        b.gen++;
    } else {
        while (b.gen == gen) yield();
    }
}

inline void entry() {
    body(body_fn, body_params);
    fibers[cur].done = true;
    events++;
}  // returns to `sched` through uc_link

// Runs one block of `threads` fibers to completion; false on a deadlock (message in err).
inline bool run_block(int threads, char* err, int errlen) {
    const size_t stack = 64 * 1024;
    fibers.assign(threads, Fiber{});
    if ((int)stacks.size() < threads) stacks.resize(threads, std::vector<char>(stack));
    warp_bars.assign(threads / 32, Bar{});
    xbuf.assign(threads, 0);
    mbuf.assign(3 * threads, 0);
    block_bar = Bar{};
    for (int i = 0; i < threads; i++) {
        getcontext(&fibers[i].ctx);
        fibers[i].ctx.uc_stack.ss_sp = stacks[i].data();
        fibers[i].ctx.uc_stack.ss_size = stack;
        fibers[i].ctx.uc_link = &sched;
        makecontext(&fibers[i].ctx, entry, 0);
    }
    for (;;) {
        const long before = events;
        bool live = false;
        for (int i = 0; i < threads; i++) {
            if (fibers[i].done) continue;
            live = true;
            cur = i;
            swapcontext(&sched, &fibers[i].ctx);
        }
        if (!live) return true;
        if (events == before) {
            int waiting = 0;
            for (auto& f : fibers) waiting += !f.done;
            snprintf(err, errlen, "deadlock in block %u: %d of %d threads wait at a barrier the others never reach", block, waiting, threads);
            return false;
        }
    }
}

template <class T>
inline T shfl(T v, int src_of_lane_fn_kind, int d) {
    const int lane = cur & 31, w = cur >> 5;
    uint64_t* buf = &xbuf[32 * w];
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(T));
    buf[lane] = bits;
    wait(warp_bars[w], 32);
    const int src = src_of_lane_fn_kind == 0 ? lane + d : src_of_lane_fn_kind == 1 ? (lane ^ d) : lane - d;
    const uint64_t r = src >= 0 && src < 32 ? buf[src] : bits;
    wait(warp_bars[w], 32);
    T out;
    memcpy(&out, &r, sizeof(T));
    return out;
}

}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::block_idx())
#define blockDim (emu::block_dim())
#define gridDim (emu::grid_dim())
#define STRATA_SMEM(name) unsigned char* name = emu::smem_ptr
#define STRATA_ALIGNED(p, n) (emu::aligned((p), (n), __LINE__))

inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::warp_bars[emu::cur >> 5], 32); }
inline void __syncthreads() { emu::wait(emu::block_bar, (int)emu::bdim); }
template <class T>
inline T __shfl_down_sync(unsigned, T v, int d) { return emu::shfl(v, 0, d); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int d) { return emu::shfl(v, 1, d); }
template <class T>
inline T __shfl_up_sync(unsigned, T v, int d) { return emu::shfl(v, 2, d); }
inline unsigned __ballot_sync(unsigned, int pred) {  // every lane's predicate, bit `lane`
    unsigned m = 0;
    for (int d = 0; d < 32; d++) m |= (unsigned)(__shfl_xor_sync(0xffffffffu, pred ? 1 : 0, d) & 1) << ((emu::cur & 31) ^ d);
    return m;
}

inline unsigned __match_any_sync(unsigned, int v) {  // the lanes whose v is this lane's, bit `lane`
    unsigned m = 0;
    for (int d = 0; d < 32; d++) m |= (unsigned)(__shfl_xor_sync(0xffffffffu, v, d) == v) << ((emu::cur & 31) ^ d);
    return m;
}

template <class T>
inline T __ldg(const T* p) { return *p; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned s) {
    return (unsigned)((((uint64_t)hi << 32) | lo) >> (s & 31));
}

inline unsigned __vsub4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 32; i += 8) r |= ((((a >> i) & 255u) - ((b >> i) & 255u)) & 255u) << i;
    return r;
}
inline unsigned __vadd4(unsigned a, unsigned b) {
    unsigned r = 0;
    for (int i = 0; i < 32; i += 8) r |= ((((a >> i) & 255u) + ((b >> i) & 255u)) & 255u) << i;
    return r;
}
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = (uint64_t)x | ((uint64_t)y << 32);
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 255u) << (8 * i);
    return r;
}
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 32; i += 8) c += (int)(int8_t)(a >> i) * (int)(int8_t)(b >> i);
    return c;
}

// mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 with a zero accumulator, a warp-collective: every
// lane puts its fragment words in, then each takes its four sums. Written from the PTX ISA's
// layout as "which lane holds an element" (gpu_kernels.cu's mma_s8 says what a lane loads):
//   A[r][k]: lane 4 (r % 8) + k / 4, register a(r / 8), byte k % 4;  B[k][n]: lane 4 n + k / 4, byte k % 4;
//   D[r][n]: lane 4 (r % 8) + n / 2, register d(2 (r / 8) + n % 2).
inline void mma_s8(unsigned a0, unsigned a1, unsigned b, int* d) {
    const int lane = emu::cur & 31, w = emu::cur >> 5;
    uint32_t* buf = &emu::mbuf[96 * w];
    buf[3 * lane] = a0, buf[3 * lane + 1] = a1, buf[3 * lane + 2] = b;
    emu::wait(emu::warp_bars[w], 32);
    for (int i = 0; i < 4; i++) {
        const int r = 8 * (i >> 1) + (lane >> 2), n = 2 * (lane & 3) + (i & 1);
        int s = 0;
        for (int k = 0; k < 16; k++) {
            const uint32_t aw = buf[3 * (4 * (r % 8) + k / 4) + r / 8], bw = buf[3 * (4 * n + k / 4) + 2];
            s += (int)(int8_t)(aw >> (8 * (k % 4))) * (int)(int8_t)(bw >> (8 * (k % 4)));
        }
        d[i] = s;
    }
    emu::wait(emu::warp_bars[w], 32);
}

// the kernels' f32 operations (PTX mul.rn / add.rn / div.rn / cvt on the device)
inline float f32_mul(float a, float b) { return a * b; }
inline float f32_add(float a, float b) { return a + b; }
inline float f32_div(float a, float b) { return a / b; }
inline float i32_f32(int i) { return (float)i; }
inline int f32_rint(float f) {  // cvt.rni.s32.f32 saturates out-of-range values and gives 0 for NaN
    if (f != f) return 0;
    if (f >= 2147483648.0f) return INT_MAX;
    if (f <= -2147483648.0f) return INT_MIN;
    return (int)std::nearbyint(f);  // default rounding mode: to nearest, ties to even
}
inline float f16_f32(unsigned h) {  // exact, by integer manipulation
    const unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3ffu;
    unsigned bits;
    if (e == 31u) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e != 0u) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m == 0u) {
        bits = sign;
    } else {  // subnormal: m * 2^-24, top set bit p -> exponent p - 24
        const unsigned p = 31u - (unsigned)__builtin_clz(m);
        bits = sign | ((p + 103u) << 23) | ((m << (23u - p)) & 0x7fffffu);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
inline unsigned f16_bits(float f) {  // cvt.rn.f16.f32: round to nearest even, by integer manipulation
    unsigned x;
    memcpy(&x, &f, 4);
    const unsigned sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return sign | 0x7e00u;  // NaN
    if (ax >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up (the half-way past 65504) -> inf
    unsigned r, rem, half;
    if (ax >= 0x38800000u) {  // a normal f16: drop 13 of the mantissa's bits
        r = ((((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu));
        rem = ax & 0x1fffu, half = 0x1000u;
    } else if (ax >= 0x33000000u) {  // a subnormal f16: m 2^(e - 150) in units of 2^-24
        const unsigned e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u, s = 126u - e;  // s in 14 .. 24
        r = m >> s;
        rem = m & ((1u << s) - 1u), half = 1u << (s - 1u);
    } else {
        return sign;  // below 2^-25: rounds to zero
    }
    if (rem > half || (rem == half && (r & 1u))) r++;  // a carry into the exponent is right, up to inf
    return sign | r;
}
// cp.async as a synchronous copy: the emulation cannot see a missing wait (the device tests can)
inline void cp_async16(void* dst, const void* src, unsigned n) {
    memcpy(dst, src, n);
    memset(static_cast<char*>(dst) + n, 0, 16 - n);
}
inline void cp_async_commit() {}
template <int N>
inline void cp_async_wait() {}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
// (blocks run one after another, each to its end: every write is visible to the blocks after it)
inline void __threadfence() {}
// (a fiber runs until it reaches a barrier: a read-modify-write between two is atomic)
inline int atomicAdd(int* p, int v) {
    const int old = *p;
    *p = old + v;
    return old;
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    const unsigned long long old = *p;
    if (v < old) *p = v;
    return old;
}

// ---------------------------------------------------------------------------------------------
// kernel registry and launch (the generated translation unit lists the instantiations)

struct EmuEntry {
    const char* name;
    void* fn;
    void (*call)(void*, void**);
};

template <class... A, size_t... I>
void emu_call_impl(void* fn, void** p, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(fn)(*static_cast<A*>(p[I])...);
}

template <class... A>
void emu_call(void* fn, void** p) {
    emu_call_impl<A...>(fn, p, std::index_sequence_for<A...>{});
}

template <class... A>
EmuEntry emu_entry(const char* name, void (*fn)(A...)) {
    return {name, reinterpret_cast<void*>(fn), &emu_call<A...>};
}

const EmuEntry* emu_table(int* n);  // defined by the generated translation unit

extern "C" int emu_launch(const char* name, int grid, int block, int smem, void** params, char* err, int errlen) {
    int n = 0;
    const EmuEntry* table = emu_table(&n);
    const EmuEntry* e = nullptr;
    for (int i = 0; i < n; i++)
        if (strcmp(table[i].name, name) == 0) e = &table[i];
    if (!e) {
        snprintf(err, errlen, "no kernel named %s in this emulation build", name);
        return 1;
    }
    if (block <= 0 || block % 32 || block > 1024 || grid <= 0) {
        snprintf(err, errlen, "bad launch of %s: grid %d, block %d", name, grid, block);
        return 1;
    }
    std::vector<uint64_t> shared((size_t)smem / 8 + 2);
    emu::smem_ptr = reinterpret_cast<unsigned char*>(shared.data());
    emu::body = e->call;
    emu::body_fn = e->fn;
    emu::body_params = params;
    emu::grid = (unsigned)grid;
    emu::fault[0] = 0;
    emu::bdim = (unsigned)block;
    for (int b = 0; b < grid; b++) {
        emu::block = (unsigned)b;
        memset(shared.data(), 0xa5, shared.size() * 8);  // stale shared memory is garbage, not zeros
        if (!emu::run_block(block, err, errlen)) return 2;
        if (emu::fault[0]) {
            snprintf(err, errlen, "%s", emu::fault);
            return 3;
        }
    }
    return 0;
}
