"""The staging area: a prompt chunk's experts that no slot holds, streamed to the device.

A prompt chunk routes many tokens to some experts. Where one that is not resident gets at least
`min_tokens` of them, the hit path (hits.py) copies its blocks from the mapped GGUF (the pages the
CPU would read) into one of two device slots here and computes it with the hits' kernels, so its
rows have the hits' bits, which are the CPU's. Below the threshold the CPU computes it beside the
device in the misses' one grouped call.

Double-buffered: buffer b's blocks are widened to engine form into pinned host slot b (host work)
and copied to device slot b on a second stream while the current stream runs the products of the
other buffer's expert. Markers (CUDA events) order the two: a copy into device slot b waits for the
products that read its previous expert (`free[b]`), the products wait for their copy (`copied[b]`),
and the host writes pinned slot b again only once its previous copy is done. Both buffers, device
and pinned, are plan items (engine/budget.py: stream.staging and stream.pinned).

The device step also streams a layer's non-resident experts whole (LayerStream, at the end of this
file): raw GGUF blocks through pinned pieces, widened on the device, the next layer's copy beside
this layer's compute (docs/gpu-tier.md, "A prompt chunk's layers streamed whole").
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from ..budget import LAYER_BUFFERS, LAYER_COL_INTS, LAYER_PIECES, STAGING_BUFFERS, layer_raw_bytes
from ..kernels import gpu
from ..kernels.engine_form import WIDEN_SKIP, align, placed_bytes, planes, widen_columns

# --stream-min-tokens auto, a rough model until the card measures it (docs/gpu-tier.md): streaming
# an expert costs its bytes once per chunk, at the slower of the bus and the host's widening of its
# blocks into the pinned slot (measured at startup: numpy, one thread, ~1.3 GB/s for seed-4l's
# IQ2_XS/IQ4_NL experts on the 2-core dev machine, 0.71 GB/s on the H200's host; 2.5-2.9 GB/s here
# since widen writes straight into the slot with each type's column runs found once: still far
# below a 25 GB/s pinned copy, so the host, not the bus, is the cost: it took ~1.8 ms an expert
# before, what the CPU takes for ~15 of its tokens on one thread); the CPU costs about 3 E F
# multiply-adds per token routed to it. So
# streaming pays from
#   T >= bytes_per_mac * threads * cpu_rate / min(bus_rate, widen_rate)
# tokens, and the default takes twice that: a partly measured model should err towards the CPU,
# whose time is known. (The widening also runs on the thread that computes the CPU's experts.)
STREAM_BUS_BYTES_S = 25e9  # a pinned host->device copy over PCIe 4.0/5.0 x16, of the order measured
# int8 multiply-adds per second of one CPU thread in the grouped expert kernels: seed-4l's IQ2_XS/IQ4_NL
# expert on this 2-core machine did 21-40 G per thread at 4-16 tokens (1 thread), 12-49 G at 2 threads
STREAM_CPU_MACS_S = 30e9


def auto_min_tokens(slot_bytes: int, n_embd: int, n_ff: int, threads: int, widen_bytes_s: float = STREAM_BUS_BYTES_S) -> int:
    """--stream-min-tokens auto: the tokens from which streaming an expert beats the CPU (x2, above)."""
    bytes_per_mac = slot_bytes / (3 * n_embd * n_ff)
    rate = min(STREAM_BUS_BYTES_S, widen_bytes_s)
    return max(1, 2 * math.ceil(bytes_per_mac * threads * STREAM_CPU_MACS_S / rate))


class Staging:
    """Two device slots and two pinned host slots (plan items stream.staging, stream.pinned)."""

    def __init__(self, rt, pack, arena, pinned, slot_bytes: int, n_embd: int, n_ff: int, min_tokens: int):
        if arena is None or arena.size < STAGING_BUFFERS * slot_bytes or pinned.size < STAGING_BUFFERS * slot_bytes:
            raise RuntimeError("the staging area's plan items do not hold two slots: engine/budget.py and "
                               "engine/tier/ disagree")
        self.rt, self.pack, self.arena, self.pinned, self.slot = rt, pack, arena, pinned, slot_bytes
        self.E, self.F, self.min_tokens = n_embd, n_ff, min_tokens
        self.stream = rt.copy_stream()
        self.copied = [rt.marker() for _ in range(STAGING_BUFFERS)]  # buffer b's last copy is done
        self.free = [rt.marker() for _ in range(STAGING_BUFFERS)]  # the products reading buffer b ran
        self.used = [False] * STAGING_BUFFERS
        self.turn = 0

    def load(self, layer: int, e: int, down: bool) -> tuple[int, list, int]:
        """Expert e of `layer` into the next buffer: its gate and up, or its down. -> (buffer, the
        GpuWeights, bytes copied). The current stream's later work waits for the copy; call
        `done(buffer)` once the products that read it are queued."""
        rt, b = self.rt, self.turn
        self.turn = (b + 1) % STAGING_BUFFERS
        if self.used[b]:
            rt.host_wait(self.copied[b])  # pinned slot b is still being read by its previous copy until then
            rt.stream_wait(self.stream, self.free[b])  # device slot b is read by its previous expert's products
        gu, d = self.pack.expert_types(layer)
        gate, up, dn = self.pack.expert(layer, e)
        E, F, name = self.E, self.F, f"blk.{layer} expert {e} (streamed)"
        mats = [(dn, d.id, F, E, "down")] if down else [(gate, gu.id, E, F, "gate"), (up, gu.id, E, F, "up")]
        at, out = b * self.slot, []
        for raw, t, n_in, n_out, what in mats:
            n = placed_bytes(t, n_in, n_out)
            out.append(gpu.place(raw, t, n_in, n_out, self.arena, at, f"{name} {what}", self.pinned[at : at + n],
                                 stream=self.stream))
            at += n
        rt.mark_on(self.copied[b], self.stream)
        rt.stream_wait(None, self.copied[b])  # the products queued from now on read the copied blocks
        self.used[b] = True
        return b, out, at - b * self.slot

    def widen_rate(self, layer: int = 0, reps: int = 3) -> float:
        """Bytes per second the host widens an expert into a pinned slot (the best of `reps` loads of
        expert 0 of `layer`, its copies waited for); leaves the buffers as new."""
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            n = self.load(layer, 0, down=False)[2] + self.load(layer, 0, down=True)[2]
            best = min(best, time.perf_counter() - t0)
        self.rt.synchronize()
        self.used, self.turn = [False] * STAGING_BUFFERS, 0
        return n / max(best, 1e-9)

    def done(self, b: int) -> None:
        """The products reading buffer b are queued: its next copy waits for them."""
        self.rt.mark_on(self.free[b])


# --- a layer streamed whole ----------------------------------------------------------------------
#
# Per expert (Staging above), a 256-token chunk of seed-4l qwen4exp streamed nothing: its 512 experts
# get ~5 tokens each, and an expert copied alone costs its widening on the host plus a handful of
# launches. The CPU computed all of them (cprofile on the H200, 2026-12-04: 0.47 of the chunk's
# 0.58 s in the grouped CPU kernel; 610 tok/s against llama.cpp's 786 with -ot exps=CPU, which
# copies every expert of a layer to the card for a batch of 32 or more tokens). So a large enough
# chunk takes the layer's non-resident experts whole, as llama.cpp does, but as raw GGUF bytes
# copied through pinned pieces and widened ON THE DEVICE (dev_widen: the host only copies memory,
# on several threads), the copy of the next layer beside this layer's compute.

# int8 multiply-adds per second of one CPU thread on a chunk's experts at a few tokens each (the H200's
# host, 2026-12-04: seed-4l qwen4exp's 256-token chunk, 10240 pairs of 3 x 2560 x 640 in 0.47 s at 8
# threads: 13 G a thread; the per-expert model's 30 G above is what 4-16 tokens an expert reach)
LAYER_CPU_MACS_S = 13e9


def auto_layer_tokens(layer_bytes: int, rate: float, n_embd: int, n_ff: int, k: int, threads: int) -> int:
    """The chunk tokens from which streaming a whole layer (layer_bytes at `rate`) beats the CPU
    computing its k pairs a token (3 n_embd n_ff multiply-adds each, LAYER_CPU_MACS_S a thread)."""
    per_token = k * 3 * n_embd * n_ff / (threads * LAYER_CPU_MACS_S)
    return max(1, math.ceil(layer_bytes / max(rate, 1.0) / per_token))


# The share of the host's memory that the layer stream may keep registered (page-locked) with the
# driver. A registered page cannot be evicted; the rest of the GGUF streams through the pinned pieces.
REGISTER_SHARE = 0.5
PAGE = 4096


def host_memory_bytes() -> int:
    """The host's physical memory (what REGISTER_SHARE is a share of)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class HostRegistry:
    """Pages of the mapped GGUF registered with the driver (cudaHostRegister, read-only), so the
    layer stream DMAs a tensor's blocks straight from the page cache: no host copy, at the bus's
    rate (the H200's host: 55 GB/s registered against 19-21 GB/s through the pinned pieces,
    benchmarks/stream_bus.py). A tensor is registered at its first stream, its whole page range
    less the pages already registered: neighbouring tensors share a page, and CUDA refuses to
    register a page twice. So one tensor's bytes can span two registrations, and `spans` cuts a
    copy at their boundaries (one DMA may not cross them). Up to `cap` bytes stay registered,
    until close(); a tensor past the cap, or one the driver refuses, is copied as before."""

    def __init__(self, rt, cap: int, page: int = PAGE):
        self.rt, self.cap, self.page = rt, cap, page
        self.regs: list[tuple[int, int]] = []  # [lo, hi) addresses, sorted, disjoint
        self.bytes = 0
        self.refused: str | None = None  # why the driver refused a registration (then none is tried again)

    def cover(self, a: np.ndarray) -> bool:
        """Register what of `a`'s pages is not registered yet -> whether all of them are now."""
        lo = a.ctypes.data // self.page * self.page
        hi = -(-(a.ctypes.data + a.nbytes) // self.page) * self.page
        gaps, at = [], lo
        for r0, r1 in self.regs:
            if r1 <= at or r0 >= hi:
                continue
            if r0 > at:
                gaps.append((at, r0))
            at = max(at, r1)
        if at < hi:
            gaps.append((at, hi))
        if not gaps:
            return True
        if self.refused is not None or self.bytes + sum(g1 - g0 for g0, g1 in gaps) > self.cap:
            return False
        for g0, g1 in gaps:
            try:
                self.rt.register_host(g0, g1 - g0)
            except Exception as e:  # noqa: BLE001 - the driver's refusal (no read-only registration here, a locked-memory limit): copy instead
                self.refused = f"{type(e).__name__}: {e}"
                return False
            self.regs.append((g0, g1))
            self.bytes += g1 - g0
        self.regs.sort()
        return True

    def spans(self, a: np.ndarray) -> list[tuple[int, int]]:
        """(start, end) byte offsets into `a` (covered) with no registration boundary inside one."""
        base, end = a.ctypes.data, a.ctypes.data + a.nbytes
        cuts = sorted({x for r in self.regs for x in r if base < x < end})
        edges = [base, *cuts, end]
        return [(x0 - base, x1 - base) for x0, x1 in zip(edges, edges[1:])]

    def close(self) -> None:
        for r0, _ in self.regs:
            self.rt.unregister_host(r0)
        self.regs.clear()
        self.bytes = 0


def registry_line(reg: HostRegistry | None) -> str:
    """The startup's line on how the layer stream reads the GGUF (after rate() streamed layer 0)."""
    if reg is None:
        return "prompt path: the layers stream through pinned pieces (the GGUF's pages are not registered: as set)"
    if reg.refused is not None:
        return (f"prompt path: the layers stream through pinned pieces: the driver refused to register the GGUF's "
                f"pages ({reg.refused})")
    return (f"prompt path: a streamed layer's GGUF pages are registered (page-locked) at its first stream and DMA'd "
            f"with no host copy, up to {reg.cap / 2**30:.1f} GiB ({REGISTER_SHARE:.0%} of the host's memory); "
            f"{reg.bytes / 2**30:.2f} GiB so far; past that, through pinned pieces")


class LayerStream:
    """A layer's non-resident experts copied whole to one of two layer buffers (plan items
    stream.layers, stream.raw, stream.layer_pinned), in the cache's slot layout with expert e at
    slot e, so DeviceChunk.forward computes them with the grouped kernels as if resident (a table
    entry -1 - e: dev_group), and their rows have the resident experts' bits, which are the CPU's.

    `start(layer)` queues the layer's copy on a worker thread: the raw blocks of each run of
    non-resident experts are copied from the mapped GGUF into a pinned piece by `threads` threads,
    DMA'd to the device on the copy stream, and widened there into the layer buffer (dev_widen);
    the first widen into a buffer waits for the products that read its previous layer (`done`).
    `wait(layer)` -> the buffer (the current stream waits for its copy)."""

    def __init__(self, rt, pack, launch, layers, raw, pinned, slot_bytes: int, piece: int, threads: int,
                 min_tokens: int = 0, stats=None, register_cap: int = 0):
        from concurrent.futures import ThreadPoolExecutor

        n_expert = pack.geometry.n_expert
        per = n_expert * slot_bytes
        if layers.size < LAYER_BUFFERS * per or pinned.size < LAYER_PIECES * piece or raw.size < layer_raw_bytes(piece):
            raise RuntimeError("the layer stream's plan items do not hold its buffers: engine/budget.py and "
                               "engine/tier/ disagree")
        self.rt, self.pack, self.launch, self.slot, self.X = rt, pack, launch, slot_bytes, n_expert
        self.bufs = [rt.view(layers, b * per, (per,), np.uint8) for b in range(LAYER_BUFFERS)]
        self.piece = piece
        self.pieces = [pinned[p * piece : (p + 1) * piece] for p in range(LAYER_PIECES)]
        self.raw = rt.view(raw, 0, (piece,), np.uint8)
        at = align(piece)
        self.cols = rt.view(raw, at, (2, LAYER_COL_INTS), np.int32)  # dev_widen's col: gate/up's type, down's
        self.bad = rt.view(raw, at + align(8 * LAYER_COL_INTS), (1,), np.uint64)
        self.min_tokens = min_tokens
        self.stream = rt.copy_stream()
        self.free = [rt.marker() for _ in range(LAYER_BUFFERS)]  # the products reading buffer b are done
        self.used = [False] * LAYER_BUFFERS
        self.dma = [rt.marker() for _ in range(LAYER_PIECES)]  # piece p's last DMA is done
        self.ready = rt.marker()
        self.jobs = ThreadPoolExecutor(1, thread_name_prefix="strata-layer-stream")
        self.copiers = ThreadPoolExecutor(max(1, threads), thread_name_prefix="strata-layer-copy")
        self.threads = max(1, threads)
        self.pending: dict[int, tuple] = {}  # layer -> (buffer, future)
        self.turn = 0
        self.stats = stats  # HitStats: streamed_bytes counts the raw bytes copied (--stats)
        # register_cap > 0: a tensor's pages registered at its first stream (HostRegistry), its DMA
        # straight from the mapping; 0: every tensor through the pinned pieces
        self.registry = HostRegistry(rt, register_cap) if register_cap > 0 else None

    def takes(self, layer: int, row: np.ndarray, tokens: int) -> bool:
        """Whether a chunk of `tokens` streams this layer: some expert is not resident, the chunk is long enough."""
        return bool((row < 0).any()) and tokens >= self.min_tokens and layer < self.pack.geometry.n_layer

    def start(self, layer: int, row: np.ndarray) -> None:
        """Queue the copy of `layer`'s non-resident experts (row: its slot table row; -1: not resident)."""
        if layer in self.pending:
            return
        b = self.turn
        self.turn = (b + 1) % LAYER_BUFFERS
        for old, (ob, _) in list(self.pending.items()):
            if ob == b:  # (a layer queued but never waited for: its buffer is taken over)
                self.pending.pop(old)[1].result()
        wait = self.used[b]
        self.used[b] = True
        self.pending[layer] = (b, self.jobs.submit(self._copy, layer, np.flatnonzero(row < 0), b, wait))

    def wait(self, layer: int):
        """-> the device buffer holding `layer`'s non-resident experts (slot e: expert e), once copied;
        the current stream's later work reads it."""
        b, fut = self.pending.pop(layer)
        n, direct = fut.result()  # (raises what the copy raised: a refused scale names its tensor)
        if self.stats is not None:
            self.stats.streamed_bytes += n
            self.stats.registered_bytes += direct
        self.rt.stream_wait(None, self.ready)
        return b, self.bufs[b]

    def done(self, b: int) -> None:
        """The products reading buffer b are queued: its next copy waits for them."""
        self.rt.mark_on(self.free[b])

    def _copy(self, layer: int, experts: np.ndarray, b: int, wait: bool) -> int:
        rt, pack = self.rt, self.pack
        g = pack.geometry
        gu_t, d_t = pack.expert_types(layer)
        gate, up, down = pack.expert_tensors(layer)
        gu_bytes = placed_bytes(gu_t.id, g.n_embd, g.n_ff_exp)
        with rt.on(self.stream):
            if wait:
                rt.stream_wait(self.stream, self.free[b])
            rt.copy_in(self.cols, np.stack([_cols(gu_t), _cols(d_t)]))
            rt.copy_in(self.bad, np.full(1, np.iinfo(np.uint64).max, np.uint64))
            k = copied = direct_bytes = 0
            for tensor, t, col, off, (n_in, n_out) in (
                    (gate, gu_t, self.cols[0], 0, (g.n_embd, g.n_ff_exp)),
                    (up, gu_t, self.cols[0], gu_bytes, (g.n_embd, g.n_ff_exp)),
                    (down, d_t, self.cols[1], 2 * gu_bytes, (g.n_ff_exp, g.n_embd))):
                each = tensor.nbytes // g.n_expert
                per_piece = self.piece // each  # (>= 1: a piece holds the largest expert, budget.layer_piece_bytes)
                sc_off = align(planes(t.id, n_in, n_out)[0])
                direct = self.registry is not None and self.registry.cover(tensor)
                for e0, e1 in _runs(experts, per_piece):
                    n = (e1 - e0) * each
                    src = tensor[e0 * each : e1 * each]
                    if direct:  # (the previous piece's widen has read self.raw: the same stream)
                        for a0, a1 in self.registry.spans(src):
                            rt.copy_in_async(self.raw[a0:a1], src[a0:a1], self.stream)
                        direct_bytes += n
                    else:
                        p = k % LAYER_PIECES
                        k += 1
                        rt.host_wait(self.dma[p])  # piece p's previous DMA has read it
                        self._memcpy(src, self.pieces[p][:n])
                        rt.copy_in_async(self.raw[:n], self.pieces[p][:n], self.stream)
                        rt.mark_on(self.dma[p], self.stream)
                    self.launch("dev_widen", n, (self.raw, np.int32(e1 - e0), np.int64(each // t.type_size),
                                                 np.int32(t.type_size), np.int32(t.rest_bytes), np.int32(t.n_scales),
                                                 col, self.bufs[b], np.int32(e0), np.int64(self.slot), np.int64(off),
                                                 np.int64(sc_off), self.bad))
                    copied += n
            rt.mark_on(self.ready, self.stream)
            bad = rt.to_host(self.bad)[0]  # (waits for the stream: the layer is on the device)
        if bad != np.iinfo(np.uint64).max:
            e, blk = int(bad >> np.uint64(32)), int(bad & np.uint64(0xFFFFFFFF))
            raise ValueError(f"blk.{layer} expert {e} (streamed): block {blk} of a gate/up/down tensor has a non-finite "
                             "fp16 scale (expected a finite scale: the GGUF's bytes are not a tensor)")
        return copied, direct_bytes

    def rate(self, layer: int = 0) -> float:
        """Bytes per second a whole layer streams at (every expert of `layer` copied once, waited
        for); leaves the buffers as new. The startup's measure for auto's threshold."""
        row = np.full(self.X, -1, np.int64)
        stats, self.stats = self.stats, None
        if self.registry is not None:  # (registering is a first stream's cost, not each one's)
            for tensor in self.pack.expert_tensors(layer):
                self.registry.cover(tensor)
        t0 = time.perf_counter()
        self.start(layer, row)
        n = self.pending[layer][1].result()[0]
        b, _ = self.wait(layer)
        self.rt.synchronize()
        dt = time.perf_counter() - t0
        self.done(b)
        self.stats, self.used, self.turn = stats, [False] * LAYER_BUFFERS, 0
        return n / max(dt, 1e-9)

    def _memcpy(self, src: np.ndarray, dst: np.ndarray) -> None:
        """src -> dst on the copy threads (numpy's copy releases the GIL: one thread reads ~5-10 GB/s)."""
        n = src.nbytes
        step = max(1 << 20, -(-n // self.threads))
        list(self.copiers.map(lambda a: np.copyto(dst[a : a + step], src[a : a + step]), range(0, n, step)))

    def close(self) -> None:
        """Wait for the copies still queued (a layer copied ahead that no forward waited for: one
        that raised on the way) and end the worker threads."""
        for _, fut in self.pending.values():
            fut.exception()  # (waits; what it raised has no one left to tell)
        self.pending.clear()
        self.jobs.shutdown()
        self.copiers.shutdown()
        if self.registry is not None:
            self.registry.close()  # (no DMA still reads its pages: each _copy waited for its stream)


def _cols(t) -> np.ndarray:
    out = np.full(LAYER_COL_INTS, WIDEN_SKIP, np.int32)
    out[: t.type_size] = widen_columns(t)
    return out


def _runs(experts: np.ndarray, most: int):
    """(first, end) of each run of consecutive ids in `experts` (sorted), at most `most` long."""
    if experts.size == 0:
        return
    cut = np.flatnonzero(np.diff(experts) != 1) + 1
    for run in np.split(experts, cut):
        for a in range(0, run.size, most):
            yield int(run[a]), int(run[min(run.size, a + most) - 1]) + 1
