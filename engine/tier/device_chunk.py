"""A prompt chunk's routed experts on the device step: grouped launches in place of one per expert.

A layer whose experts are all resident runs wholly on the device (`forward`: routing, grouping,
products, combine; nothing comes down). Otherwise MoE.forward routes the chunk (its router logits
come down once: moe.route_topk's float64 rule on the host) and asks the expert server for the rows
of every (token, rank) pair, expert by expert (MoE.routed). Here (`routed`), with the chunk's
activations left on the device:

    - the tables of the layer (for each resident expert's tile of up to gpu.MAX_TOKENS pairs: its
      slot's weight addresses; each pair's token and the row MoE.routed wants it in) go up in ONE copy;
    - gate and up of every resident expert are ONE launch (gpu.grouped_products, by shape: mmqk or mmqx; each row the
      batched kernel's bits on that expert alone, which are the CPU's), h = up silu(gate) ONE launch
      (dev_hidden: the portable SiLU the CPU's hidden_ uses), its ActQ one, the downs ONE launch (mmqw) that
      writes each row where MoE.routed wants it;
    - the experts neither resident nor streamed: x comes down once (only then), the CPU computes them
      in one grouped call (MoE.products) while the device computes the above, their rows go up once;
    - a streamed expert (routed at least staging.min_tokens of the chunk, staging.py) is copied to
      the staging area and multiplied by gpu.matmul on its gathered rows (the same arithmetic).

So every routed row has the CPU's bits wherever its expert ran, and the chunk's logits are
bit-identical across --expert-cache sizes (tests/gpu/test_device_prompt.py). Where the prompt path's
buffers cannot hold the chunk's rows, or the experts are of a float type, the caller keeps the
host-driven hit path (hits.py)."""

from __future__ import annotations

import time

import numpy as np

from .. import budget as B
from ..kernels import gpu
from ..kernels.engine_form import align, placed_bytes, planes
from ..weights import Input
from .hits import _select
from .memory import Carver

F32 = np.float32


def chunk_bytes(E: int, F: int, n: int) -> int:
    """The prompt path's buffer bytes a chunk of n device pairs takes here (gate and up, h and its
    ActQ), its tables aside (`DeviceChunk.fits` adds them)."""
    return 2 * align(n * F * 4) + align(n * F * 4) + B.actq_placed_bytes(F, n)


GROUP_SMEM_IDS = 8192  # dev_group's ids in shared memory (32 KiB), when a chunk's pairs fit
GROUP_THREADS = 1024  # dev_group's block: its warps' counts of each expert are its scratch (GROUP_THREADS / 32 x X ints)


def group_scratch(X: int) -> int:
    """dev_group's scratch ints for X experts: cnt, start [X], tstart [X + 1] and hist [warps x X]."""
    return 3 * X + 1 + GROUP_THREADS // 32 * X


class DeviceChunk:
    """The device step's chunk path (module docstring). `be`: the DeviceBackend (its launches and
    quantizer); `hits`: the tier's HitPath (slots, staging, stats, the prompt path's buffers)."""

    def __init__(self, rt, hits, be):
        self.rt, self.hits, self.be = rt, hits, be

    def fits(self, moe, n_pairs: int) -> bool:
        """Whether the chunk path takes this layer's chunk of n_pairs (token, rank) pairs."""
        hp = self.hits
        if not (moe.gu.quantized and moe.d.quantized) or hp.prompt is None:
            return False
        tiles = 2 * (n_pairs + moe.router.n_out)  # at most: one per expert and one per MAX_TOKENS pairs
        # the tiles, the pairs' tokens, positions (i64), rows and zeros, dev_group's scratch, the marker
        table = align(3 * 5 * 8 * tiles) + 5 * align(4 * n_pairs) + align(4 * group_scratch(moe.router.n_out)) + align(8)
        return chunk_bytes(moe.E, moe.F, n_pairs) + table <= hp.prompt.size

    def forward(self, moe, x: Input, table, stage=None):
        """MoE.forward's routed sum for the chunk x of a layer whose experts are all resident, wholly
        on the device -> (device f32 [T, E], device ids int32 [T, k]: the routing, for the counts the
        forward owes), or None where the chunk path does not take it. table: the layer's row of the
        slot table on the device (DeviceExperts._table), or a table whose entry -1 - s is slot s of
        `stage` (a layer streamed whole: staging.LayerStream; the same slot layout). The router's product (the device linear),
        each token's top-k (dev_route_rows: dev_route's rule, moe.route_topk's experts and f32
        weights), the grouping and the tiles (dev_group: Groups' order), gate and up in one launch,
        h and its ActQ, the downs in one launch (rows in Groups' order) and dev_combine: no copy
        and no wait on the host."""
        T, k, X, E, F = x.x.shape[0], moe.k, moe.router.n_out, moe.E, moe.F
        N = T * k
        if not self.fits(moe, N):
            return None
        be, rt, xp, hp = self.be, self.rt, self.be.xp, self.hits
        logits = be.linear(moe.router, x, moe._router_out(be, x))
        moe.logits = logits  # as MoE.route keeps it (diagnostics)
        ids, w = xp.empty((T, k), np.int32), xp.empty((T, k), F32)
        rt.launch(be._mod, "dev_route_rows", T, 32, (logits, np.int32(X), np.int32(k), ids, w))
        M = -(-N // gpu.MAX_TOKENS) + min(X, N)  # the most tiles N pairs can make
        buf = Carver(rt, hp.prompt, "the prompt path's chunk buffers")
        gu = buf.array((2 * N, F), F32)
        h = buf.array((N, F), F32)
        q = buf.actq(F, N)
        hq = gpu.GpuActQ(q.q, q.d, q.s16, buf.array((1,), np.uint64))  # the quantizer's non-finite marker (unread)
        t_gu, t_d = buf.array((2 * M, 5), np.int64), buf.array((M, 5), np.int64)
        tok, pos = buf.array((N,), np.int32), buf.array((N,), np.int64)
        scratch = buf.array((group_scratch(X),), np.int32)
        gu_t, d_t = moe.gu.id, moe.d.id
        slots = hp.slots
        gu_bytes = placed_bytes(gu_t, E, F)
        arena = slots.arena if slots.arena is not None else stage  # (no cache: no arena, every entry a stage slot)
        rt.launch(be._mod, "dev_group", 1, GROUP_THREADS,
                  (ids, np.int32(N), np.int32(k), np.int32(X), table, arena, arena if stage is None else stage,
                   np.int64(slots.slot_bytes),
                   np.int64(gu_bytes), np.int64(align(planes(gu_t, E, F)[0])), np.int64(align(planes(d_t, F, E)[0])),
                   np.int32(gpu.MAX_TOKENS), np.int32(M), tok, pos, t_gu, t_d, scratch[:X], scratch[X : 2 * X],
                   scratch[2 * X : 3 * X + 1], scratch[3 * X + 1 :], np.int32(GROUP_SMEM_IDS)), smem=4 * GROUP_SMEM_IDS)
        act = x.form(moe.gu, False, quantize=be._quantize)
        xq = gpu.GpuActQ(act.q, act.d, act.s16, None)
        pairs = N / min(X, N)  # the mean pairs an expert where every expert that can be is routed (the kernel's choice)
        gpu.grouped_products(gu_t, E, F, t_gu, 2 * M, xq, tok, None, gu, pairs=pairs)
        self._hidden(gu, tok, h, hq, 0, N, F)  # (dev_hidden skips a row whose "slot" is < 0: no token is)
        part = be.scratch("moe.part", (N, E))
        gpu.grouped_products(d_t, F, E, t_d, M, hq, None, None, part, down=True, pairs=pairs)
        out = be.scratch("moe.out", (T, E))
        be._launch("dev_combine", T * E, (part, pos, w, out, np.int32(T), np.int32(k), np.int32(E)))
        return out, ids

    def routed(self, moe, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray):
        """MoE.routed's rows (device f32 [len(rows), E], in its order) for the chunk x (device)."""
        hp, rt, be, st, layer = self.hits, self.rt, self.be, self.hits.stats, moe.layer
        E, F, N = moe.E, moe.F, rows.size
        slots = np.array([hp.slots.lookup(layer, int(e)) for e in experts], np.int64)
        counts = np.diff(starts)[: experts.size]
        stream = np.zeros(experts.size, bool)
        if hp.staging is not None:
            stream = (slots < 0) & (counts >= hp.staging.min_tokens)
        res_g, str_g = np.flatnonzero(slots >= 0), np.flatnonzero(stream)
        cpu_g = np.flatnonzero((slots < 0) & ~stream)
        st.chunk_resident[layer] += res_g.size
        st.chunk_streamed[layer] += str_g.size
        st.chunk_cpu[layer] += cpu_g.size
        # the device's pairs in compact order: the resident experts' first, then the streamed ones'
        dev_g = np.concatenate([res_g, str_g])
        dev_i, dev_s = _select(starts, dev_g)
        cpu_i, cpu_s = _select(starts, cpu_g)
        n, n_res = dev_i.size, int(dev_s[res_g.size])
        part = be.scratch("moe.part", (N, E))
        xh = rt.to_host(x.x) if cpu_g.size else None  # the CPU's rows: x comes down once, before the device's work is queued
        if n:
            buf = Carver(rt, hp.prompt, "the prompt path's chunk buffers")
            # gate and up: [gate of the resident pairs; their up; gate of the streamed pairs; their up]
            gu = buf.array((2 * n, F), F32)
            h = buf.array((n, F), F32)
            q = buf.actq(F, n)
            hq = gpu.GpuActQ(q.q, q.d, q.s16, buf.array((1,), np.uint64))  # the quantizer's non-finite marker (unread)
            w = [hp.slots.weights[int(slots[g])] for g in res_g]
            firsts, cnt = dev_s[: res_g.size], np.diff(dev_s[: res_g.size + 1])
            t_gu = gpu.tile_rows([a[0] for a in w] + [a[1] for a in w], np.concatenate([firsts, firsts]),
                                 np.concatenate([cnt, cnt]), [0] * len(w) + [n_res] * len(w))
            t_d = gpu.tile_rows([a[2] for a in w], firsts, cnt, [0] * len(w))
            ints = np.concatenate([rows[dev_i], dev_i, np.zeros(n, np.int64)]).astype(np.int32)
            table = self._upload(buf, [t_gu, t_d, ints])  # ONE copy up
            dev_t_gu, dev_t_d, dev_ints = table
            xrow, orow, zero = dev_ints[:n], dev_ints[n : 2 * n], dev_ints[2 * n :]
            act = x.form(moe.gu, False, quantize=be._quantize)
            xq = gpu.GpuActQ(act.q, act.d, act.s16, None)
            if n_res:
                pairs = n_res / res_g.size  # the mean pairs a resident expert (the kernel's choice)
                gpu.grouped_products(moe.gu.id, E, F, dev_t_gu, len(t_gu), xq, xrow, None, gu, pairs=pairs)
                self._hidden(gu[: 2 * n_res], zero, h[:n_res], hq, 0, n_res, F)
                gpu.grouped_products(moe.d.id, F, E, dev_t_d, len(t_d), hq, None, orow, part, down=True, pairs=pairs)
        t0 = time.perf_counter()
        if cpu_g.size:  # the rest on the CPU in one grouped call while the device runs the resident experts
            part[be.xp.asarray(cpu_i)] = rt.to_device(moe.products(Input(xh), experts[cpu_g], rows[cpu_i], cpu_s))
        st.cpu_s += time.perf_counter() - t0
        if str_g.size:
            self._streamed(moe, xq, experts, str_g, dev_s[res_g.size :], rows[dev_i], dev_i, gu, h, hq, zero, n, n_res, part)
        return part

    def _streamed(self, moe, xq, experts, str_g, s, tok, dev_i, gu, h, hq, zero, n, n_res, part) -> None:
        """The streamed experts: each one's gate and up copied to a staging buffer and multiplied on its
        gathered rows (gpu.matmul: the batched kernel mmx / mmqx runs per tile, so the same bits), then h and
        its ActQ for all of their rows, then each one's down copied and multiplied, its rows scattered
        to where MoE.routed wants them."""
        hp, layer, F = self.hits, moe.layer, moe.F
        for j, g in enumerate(str_g):
            a, b = int(s[j]), int(s[j + 1])
            wg, wu, stage = hp._weights(layer, int(experts[g]), -1, down=False)
            t = self.be.xp.asarray(tok[a:b])
            x = gpu.GpuActQ(xq.q[t], xq.d[t], xq.s16[t], None)
            gpu.matmul(wg, x, out=gu[n_res + a : n_res + b])
            gpu.matmul(wu, x, out=gu[n + a : n + b])
            hp.staging.done(stage)
        self._hidden(gu[2 * n_res :], zero, h[n_res:], hq, n_res, n - n_res, F)
        for j, g in enumerate(str_g):
            a, b = int(s[j]), int(s[j + 1])
            wd, stage = hp._weights(layer, int(experts[g]), -1, down=True)
            y = gpu.matmul(wd, gpu.GpuActQ(hq.q[a:b], hq.d[a:b], hq.s16[a:b], None))
            hp.staging.done(stage)
            part[self.be.xp.asarray(dev_i[a:b])] = y

    def _hidden(self, gu, zero, h, hq, a: int, m: int, F: int) -> None:
        """h = up silu(gate) of m rows (gu: their gate rows then their up rows; dev_hidden, the CPU's
        hidden_ bits), then its ActQ into rows a .. a + m - 1 of hq (the device quantizer: the host's bits)."""
        if m == 0:
            return
        self.be._launch("dev_hidden", m * F, (gu, zero, h, np.int32(m), np.int32(F)))
        gpu.quantize_act_gpu(h, out=gpu.GpuActQ(hq.q[a : a + m], hq.d[a : a + m], hq.s16[a : a + m], hq.bad), check=False)

    def _upload(self, buf: Carver, parts: list[np.ndarray]) -> list:
        """Host arrays -> device views of one buffer filled by ONE copy."""
        at, offs = 0, []
        for p in parts:
            offs.append(at)
            at += align(p.nbytes)
        host = np.zeros(at, np.uint8)
        for p, o in zip(parts, offs):
            host[o : o + p.nbytes] = np.ascontiguousarray(p).reshape(-1).view(np.uint8)
        dev = buf.array((at,), np.uint8)
        self.rt.copy_in(dev, host)
        return [self.rt.view(dev, o, p.shape, p.dtype) for p, o in zip(parts, offs)]
