"""The hit path: the routed experts the slots hold, computed on the device beside the CPU's misses.

It is the MoE's expert server (engine/moe.py: MoE.routed asks it). Per MoE layer and token the
hits' gate/up products are queued on the tier's stream, all of the layer's misses run on the CPU
meanwhile in one grouped call (MoE.products: Numba, the GIL released), then the host makes each
hit's silu(gate) * up with moe.hidden_, the function a miss uses, and its ActQ exactly as a miss
does, the down products run on the device, and the rows go back to the MoE in its order. A prompt
chunk does the same through the prompt path's buffers, and also computes on the device the
non-resident experts it routes enough tokens to, their blocks streamed to the staging area
(staging.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .. import budget as B
from ..backend import _row
from ..kernels import gpu
from ..kernels.actq import QA, ActQ, quantize_act
from ..kernels.engine_form import align
from ..moe import hidden_
from ..weights import Input
from .memory import Carver, upload_act
from .slots import ExpertSlots

F32 = np.float32


def _select(starts: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the row indices of `groups`, in order; their starts from 0)."""
    sizes = np.array([starts[g + 1] - starts[g] for g in groups], np.int64)
    idx = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in groups]) if len(groups) else np.zeros(0, np.int64)
    return idx.astype(np.int64), np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def _rows(act, rows: np.ndarray):
    return ActQ(act.q[rows], act.d[rows], act.s16[rows]) if isinstance(act, ActQ) else np.ascontiguousarray(act[rows])


def _slice(dev, a: int, b: int):
    return gpu.GpuActQ(dev.q[a:b], dev.d[a:b], dev.s16[a:b], None) if isinstance(dev, gpu.GpuActQ) else dev[a:b]


@dataclass
class HitStats:
    """Per layer hits and misses of the token path, and where its MoE time went (--stats)."""

    hits: np.ndarray
    misses: np.ndarray
    gpu_s: float = 0.0  # device time of the hits' products (CUDA events; 0 where there are none)
    cpu_s: float = 0.0  # the CPU misses, computed while the hits' products run
    wait_s: float = 0.0  # waiting for the device's results
    events: bool = False
    # the prompt path, per layer: expert-chunks (an expert a chunk routes tokens to) computed in a
    # slot, streamed to the staging area, on the CPU; and the bytes the streaming copied (engine form)
    chunk_resident: np.ndarray | None = None
    chunk_streamed: np.ndarray | None = None
    chunk_cpu: np.ndarray | None = None
    streamed_bytes: int = 0
    registered_bytes: int = 0  # of streamed_bytes, those DMA'd straight from registered GGUF pages (the layer stream)

    def __post_init__(self) -> None:
        for name in ("chunk_resident", "chunk_streamed", "chunk_cpu"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros_like(self.hits))

    @classmethod
    def empty(cls, n_layer: int) -> HitStats:
        return cls(np.zeros(n_layer, np.int64), np.zeros(n_layer, np.int64))

    def reset(self) -> None:
        for a in (self.hits, self.misses, self.chunk_resident, self.chunk_streamed, self.chunk_cpu):
            a[:] = 0
        self.gpu_s = self.cpu_s = self.wait_s = 0.0
        self.streamed_bytes = self.registered_bytes = 0

    @property
    def hit_rate(self) -> float:
        total = int(self.hits.sum() + self.misses.sum())
        return float(self.hits.sum()) / total if total else 0.0


class HitPath:
    """One token's routed experts in one MoE layer: GPU hits beside CPU misses (S10)."""

    def __init__(self, rt, g, slots: ExpertSlots, buffers: Carver, exchange: np.ndarray, stats: HitStats):
        E, F, k = g.n_embd, g.n_ff_exp, g.n_expert_used
        Fq = -(-F // QA) * QA
        self.rt, self.slots, self.stats = rt, slots, stats
        self.x = buffers.actq(E)
        self.xf = buffers.array((1, E), np.float32)  # x itself, for experts of a float type
        gu = buffers.array((2 * k, Fq), np.float32)  # gate rows then up rows: one download for both
        self.gate, self.up = gu[:k], gu[k:]
        self.h = buffers.actq(Fq, k)
        self.out = buffers.array((k, E), np.float32)
        f = exchange.view(np.float32)
        self.gu_host = f[: 2 * k * F].reshape(2 * k, F)
        self.gate_host, self.up_host = self.gu_host[:k], self.gu_host[k:]
        self.out_host = f[2 * k * F : 2 * k * F + k * E].reshape(k, E)
        self.F, self.E = F, E
        # the hits' h on the host, quantized together (row by row, as a miss quantizes its one h) and
        # sent up in one copy per plane; scratch of the host tier, made once
        self.one_copy = Fq == F
        self.gu = gu[:, :F] if self.one_copy else None
        self.h_host = np.empty((k, F), F32)
        self.h_act = ActQ.empty((k, F))
        self.h_act_n = [ActQ(self.h_act.q[:n], self.h_act.d[:n], self.h_act.s16[:n]) for n in range(k + 1)]
        self.h_n = [gpu.GpuActQ(self.h.q[:n], self.h.d[:n], self.h.s16[:n], None) for n in range(k + 1)]
        # per-row views, carved once: the token path takes them, never slices (a device view costs microseconds)
        self.gate_rows = [self.gate[i, :F] for i in range(k)]
        self.up_rows = [self.up[i, :F] for i in range(k)]
        self.out_rows = [self.out[i] for i in range(k)]
        self.h_rows = [gpu.GpuActQ(self.h.q[i, :F], self.h.d[i, : F // QA], self.h.s16[i, : F // 16], None) for i in range(k)]
        self.hf_rows = [self.gate[i : i + 1] for i in range(k)]
        self.gate_n = [self.gate[:n, :F] for n in range(k + 1)]
        self.up_n = [self.up[:n, :F] for n in range(k + 1)]
        self.out_n = [self.out[:n] for n in range(k + 1)]
        self.events = rt.events(2) if hasattr(rt, "events") else None
        self.prompt = None  # the prompt path's buffers (bytes of prompt.chunk, lent by Dense), set at stage 6
        self.staging = None  # the prompt chunk's streamed experts (staging.py), set at stage 6 unless off
        self.layers = None  # the device step's layers streamed whole (staging.LayerStream), set at stage 6 where placed
        stats.events = self.events is not None

    def routed(self, moe, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """engine/moe.py's expert server: MoE.routed's rows, the hits on the device beside the misses'
        one grouped CPU call (MoE.products). One token through the per-row buffers carved at startup,
        a chunk through the prompt path's."""
        if x.x.shape[0] == 1:
            return self._token(moe, x, experts)
        return self._chunk(moe, x, experts, rows, starts)

    def token(self, moe, x: Input, counts, logits=None, shared=None) -> None:
        """The host-driven tier routes on the host (MoE.forward then calls `routed`)."""
        return None

    def tokens(self, moe, x: Input, counts) -> None:
        """A chunk too (MoE.forward then calls `routed`)."""
        return None

    def settle(self) -> None:
        """Nothing is owed after a forward: the routing counts were made on the host."""

    def _token(self, moe, x: Input, experts: np.ndarray) -> np.ndarray:
        rt, st, layer, F = self.rt, self.stats, moe.layer, self.F
        slots = [self.slots.lookup(layer, int(e)) for e in experts]
        hit = [j for j, s in enumerate(slots) if s >= 0]
        miss = np.array([j for j, s in enumerate(slots) if s < 0], np.int64)
        st.hits[layer] += len(hit)
        st.misses[layer] += miss.size
        out = np.empty((len(slots), moe.E), F32)
        if hit:
            xdev = self._stage(_row(x.form(moe.gu)), self.x, self.xf, moe.E)
            if self.events:
                self.events[0].record()
            for i, j in enumerate(hit):
                wg, wu, _ = self.slots.weights[slots[j]]
                gpu.matvec_into(wg, xdev, self.gate_rows[i])
                gpu.matvec_into(wu, xdev, self.up_rows[i])
        t0 = time.perf_counter()
        if miss.size:  # all of the layer's misses in one grouped call, while the device runs the hits
            out[miss] = moe.products(x, experts[miss], np.zeros(miss.size, np.int64), np.arange(miss.size + 1))
        t1 = time.perf_counter()
        st.cpu_s += t1 - t0
        if not hit:
            return out
        n = len(hit)
        if self.one_copy:
            rt.copy_out(self.gu_host, self.gu)
        else:
            rt.copy_out(self.gate_host[:n], self.gate_n[n])
            rt.copy_out(self.up_host[:n], self.up_n[n])
        t2 = time.perf_counter()
        h = hidden_(self.gate_host[:n], self.up_host[:n])  # the misses' function: the same bits
        if self.one_copy and moe.d.quantized:
            upload_act(rt, self.h_n[n], quantize_act(h, out=self.h_act_n[n]))
            for i, j in enumerate(hit):
                gpu.matvec_into(self.slots.weights[slots[j]][2], self.h_rows[i], self.out_rows[i])
        else:
            for i, j in enumerate(hit):
                hdev = self._stage(_row(Input(h[i : i + 1]).form(moe.d)), self.h_rows[i], self.hf_rows[i], F)
                gpu.matvec_into(self.slots.weights[slots[j]][2], hdev, self.out_rows[i])
        if self.events:
            self.events[1].record()
        t3 = time.perf_counter()
        rt.copy_out(self.out_host[:n], self.out_n[n])
        st.wait_s += (t2 - t1) + (time.perf_counter() - t3)
        if self.events:
            st.gpu_s += rt.elapsed(*self.events)
        out[hit] = self.out_host[:n]
        return out

    # --- the prompt path: a chunk's routed experts, hits on the GPU beside the misses' grouped CPU call

    def _chunk(self, moe, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """MoE.products with the device's experts beside the CPU's: the hits (resident) and the
        streamed (not resident, routed at least staging.min_tokens of the chunk's tokens: their
        blocks copied to the staging area) on the device, the rest on the CPU in one grouped call.
        The device rows' activations go up once, every gate/up (then down) product is queued, the
        CPU's grouped call runs meanwhile, and the host makes h from the downloaded gate and up
        exactly as the CPU path does, so every row has the CPU's bits wherever its expert ran."""
        st, layer = self.stats, moe.layer
        slots = np.array([self.slots.lookup(layer, int(e)) for e in experts], np.int64)
        counts = np.diff(starts)[: experts.size]
        stream = np.zeros(experts.size, bool)
        if self.staging is not None:
            stream = (slots < 0) & (counts >= self.staging.min_tokens)
        dev_g = np.flatnonzero((slots >= 0) | stream)
        need = self._many_bytes(moe, int(counts[dev_g].sum()))
        if stream.any() and self.prompt is not None and need > self.prompt.size:  # no room: the hits alone
            stream[:] = False
            dev_g = np.flatnonzero(slots >= 0)
            need = self._many_bytes(moe, int(counts[dev_g].sum()))
        if dev_g.size == 0 or self.prompt is None or need > self.prompt.size:
            st.chunk_cpu[layer] += experts.size
            return moe.products(x, experts, rows, starts)  # nothing on the device, or no room: all CPU
        cpu_g = np.flatnonzero((slots < 0) & ~stream)
        st.chunk_resident[layer] += int((slots >= 0).sum())
        st.chunk_streamed[layer] += int(stream.sum())
        st.chunk_cpu[layer] += cpu_g.size
        dev_i, dev_s = _select(starts, dev_g)
        cpu_i, cpu_s = _select(starts, cpu_g)
        rt, E, F, n = self.rt, moe.E, moe.F, dev_i.size
        buf = Carver(rt, self.prompt, "the prompt path's hit buffers")
        xa = _rows(x.form(moe.gu), rows[dev_i])
        xdev = self._stage_many(buf, xa, E)
        gate, up = buf.array((n, F), np.float32), buf.array((n, F), np.float32)
        # the hits first (nothing to wait for), then the streamed experts, each as its copy lands; the
        # CPU's call once as many are queued as the staging holds (loading more waits for the device)
        order = sorted(range(dev_g.size), key=lambda i: bool(stream[dev_g[i]]))
        cpu_at = int((slots[dev_g] >= 0).sum()) + B.STAGING_BUFFERS
        out = np.empty((rows.size, E), F32)
        for j, i in enumerate(order + [None]):
            if j == min(cpu_at, len(order)) and cpu_i.size:
                out[cpu_i] = moe.products(x, experts[cpu_g], rows[cpu_i], cpu_s)
            if i is None:
                break
            a, b, g = dev_s[i], dev_s[i + 1], dev_g[i]
            wg, wu, b_stage = self._weights(layer, int(experts[g]), int(slots[g]), down=False)
            gpu.matmul(wg, _slice(xdev, a, b), out=gate[a:b])
            gpu.matmul(wu, _slice(xdev, a, b), out=up[a:b])
            if b_stage is not None:
                self.staging.done(b_stage)
        g = np.empty((n, F), F32)
        h = np.empty((n, F), F32)
        rt.copy_out(g, gate)
        rt.copy_out(h, up)
        hidden_(g, h)  # up silu(gate): the misses' function, the same bits
        hdev = self._stage_many(buf, Input(h).form(moe.d), F)
        y = buf.array((n, E), np.float32)
        for i in order:
            a, b, gi = dev_s[i], dev_s[i + 1], dev_g[i]
            wd, b_stage = self._weights(layer, int(experts[gi]), int(slots[gi]), down=True)
            gpu.matmul(wd, _slice(hdev, a, b), out=y[a:b])
            if b_stage is not None:
                self.staging.done(b_stage)
        rows_dev = np.empty((n, E), F32)
        rt.copy_out(rows_dev, y)
        out[dev_i] = rows_dev
        return out

    def _weights(self, layer: int, e: int, slot: int, down: bool) -> tuple:
        """(gate, up, staging buffer) or (down, staging buffer) of expert e: its slot's (buffer
        None), or copied to the staging area now."""
        if slot >= 0:
            w = self.slots.weights[slot]
            return (w[2], None) if down else (w[0], w[1], None)
        b, ws, nbytes = self.staging.load(layer, e, down)
        self.stats.streamed_bytes += nbytes
        return (ws[0], b) if down else (ws[0], ws[1], b)

    @staticmethod
    def _many_bytes(moe, n: int) -> int:
        E, F = moe.E, moe.F
        return B.actq_placed_bytes(E, n) + align(n * E * 4) + 2 * align(n * F * 4) + B.actq_placed_bytes(F, n) \
            + align(n * F * 4) + align(n * E * 4)

    def _stage_many(self, buf: Carver, act, n: int):
        if isinstance(act, ActQ):
            dev = buf.actq(n, act.q.shape[0])
            upload_act(self.rt, dev, act)
            return dev
        dev = buf.array(act.shape, np.float32)
        self.rt.copy_in(dev, np.ascontiguousarray(act, dtype=F32))
        return dev

    def _stage(self, act, qbuf: gpu.GpuActQ, fbuf, n: int):
        """Upload the host's activations: an ActQ into `qbuf`, f32 values into a row of `fbuf`."""
        if isinstance(act, ActQ):
            upload_act(self.rt, qbuf, act)
            return qbuf
        dev = fbuf[0, :n]
        self.rt.copy_in(dev, np.ascontiguousarray(act, dtype=F32))
        return dev
