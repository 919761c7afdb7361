"""The GPU tier: the dense matrices and the profiled hottest experts on the device, every other
expert a CPU miss computed beside the GPU hits, sized from measured free memory, observable at
every stage, and never different from the all-CPU result (S6-S10, S12, B2, B3).

    tier = GpuTier.start(model, TierOptions(...), log=print)   # S6's seven stages, mem_mark at each
    model.step(session, token)                                  # dense W x and expert hits on the device

What runs where. The card holds what is read most and computed most cheaply there: the dense
matrices in engine form (S3) and the expert slots. The host keeps the session and the elementwise
work (norms, RoPE, attention over the KV cache, the delta rule, QSA's selection, PLE), so the
session is host memory and the budget says so. Every W x of a placed weight goes through `Dense`:
the host's ActQ of the vector (the one quantizer, S10) is uploaded once per vector and the GPU
kernels, which are bit for bit the CPU kernels (docs/gpu-kernels.md), give the product. So a run
on the GPU tier gives the all-CPU engine's logits, bit for bit, whatever the split (B2).

THE PLAN IS THE ALLOCATION (engine/budget.py). Each stage allocates its plan items, one device
arena per stage, and carves its buffers out of it; a buffer the plan does not hold is an error,
not an allocation. mem_mark prints, after each stage, the device memory measured beside the plan's
figure (B3). S7's order: the weights (the LM head among them) and the session first, then the slots
sized from the free memory measured THEN; an explicit --expert-cache N that does not fit is refused
with both numbers; the reserve adapts on small cards; LOW is printed below 256 MiB free.

The hit path (S10) is all-or-nothing: it is bound to the MoE layers only when the slots, the fill,
the hit buffers and the exchange buffers are all in place; otherwise every expert is a CPU miss and
the log says why. Per MoE layer and token the hits' gate/up products are queued on the tier's
stream, the misses run on the CPU meanwhile (Numba, --pool-workers threads, the GIL released), then
the host makes each hit's silu(gate) * up and its ActQ exactly as for a miss, the down products
run on the device, and the parts are combined in the router's order (engine/moe.py).

S12: nothing is allocated on the device or in pinned memory once started; every buffer of the
token path is a view carved at startup (tests/test_gpu_tier.py counts the allocations).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata.index_format.expert_profile import ExpertProfile
from strata.index_format.geometry import tensor_specs
from strata.index_format.manifest import pack_fingerprint

from . import budget as B
from .budget import Budget, BudgetOptions, ExpertCacheTooBig, plan_budget
from .expert_plan import MiB, SlotMap, check_profile, fill_policy_line, plan_fill
from .kernels import gpu
from .kernels.actq import QA, ActQ, quantize_act
from .kernels.engine_form import align, placed_bytes
from .backend import CpuBackend, _row
from .model import Model
from .moe import hidden_
from .weights import Input, Weight

F32 = np.float32


class GpuTierError(ValueError):
    """The GPU tier cannot start as asked (too little memory for the weights): says what and what to
    do. A ValueError: the user fixes it with flags, as a bad flag."""


@dataclass(frozen=True)
class TierOptions:
    max_context: int
    kv: str = "f16"
    prefill_chunk: int = B.PREFILL_AUTO_CHUNK
    expert_cache: int | None = None  # None: auto (S8)
    profile: ExpertProfile | None = None
    vram_budget_mib: int | None = None  # behave as on a card of this many MiB
    vram_reserve_mib: int = B.DEFAULT_RESERVE_MIB


@dataclass(frozen=True)
class MemMark:
    stage: str
    free: int  # device memory free (as the budget counts it) after the stage
    used: int  # device memory this process holds, measured
    predicted: int  # the plan's figure for the same moment
    card_used: int  # the card's used memory (the error is a share of it)

    @property
    def error(self) -> float:
        return abs(self.used - self.predicted) / max(self.card_used, 1)

    def line(self, number: int) -> str:
        return (f"mem_mark {number} {self.stage}: free {self.free / MiB:.1f} MiB, used {self.used / MiB:.1f} MiB, "
                f"budget {self.predicted / MiB:.1f} MiB (off by {(self.used - self.predicted) / MiB:+.1f} MiB, "
                f"{100 * self.error:.2f}% of the card's {self.card_used / MiB:.0f} MiB used)")


class DeviceMemory:
    """Free and used device memory as the tier counts them. `used` is what this process added since
    it started (the CUDA context and other processes excluded); with --vram-budget-mib N the card
    is N MiB: free = N MiB - used (never more than really is free)."""

    def __init__(self, rt, budget_mib: int | None):
        self.rt, self.budget = rt, None if budget_mib is None else budget_mib * MiB
        free, total = rt.mem_info()
        self.base = total - free

    def used(self) -> int:
        free, total = self.rt.mem_info()
        return total - free - self.base

    def free(self) -> int:
        real = self.rt.mem_info()[0]
        return real if self.budget is None else min(real, self.budget - self.used())

    def card_used(self) -> int:
        return self.used() if self.budget is not None else self.used() + self.base


class Carver:
    """Buffers cut from one arena, each on a PLANE_ALIGN boundary; taking more than it holds is a bug."""

    def __init__(self, rt, arena, name: str):
        self.rt, self.arena, self.name, self.at = rt, arena, name, 0
        self.size = int(arena.size) if arena is not None else 0

    def take(self, nbytes: int) -> int:
        at, self.at = self.at, self.at + align(nbytes)
        if self.at > self.size:
            raise RuntimeError(f"{self.name}: the plan's {self.size} B do not hold what is carved from it "
                               f"({self.at} B): engine/budget.py and engine/gpu_tier.py disagree")
        return at

    def array(self, shape, dtype):
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return self.rt.view(self.arena, self.take(n), shape, dtype)

    def actq(self, n: int, rows: int | None = None) -> gpu.GpuActQ:
        lead = () if rows is None else (rows,)
        q = self.array(lead + (n,), np.int8)
        d = self.array(lead + (n // QA,), np.float32)
        s16 = self.array(lead + (n // 16,), np.int32)
        return gpu.GpuActQ(q, d, s16, None)


def _act_rows(a: gpu.GpuActQ, rows: int, n: int) -> gpu.GpuActQ:
    """The first `rows` rows of n activations of a [R, N] buffer, as a contiguous [rows, n] ActQ."""
    rt = gpu.runtime()
    return gpu.GpuActQ(rt.view(a.q.reshape(-1), 0, (rows, n), np.int8),
                       rt.view(a.d.reshape(-1).view(np.uint8), 0, (rows, n // QA), np.float32),
                       rt.view(a.s16.reshape(-1).view(np.uint8), 0, (rows, n // 16), np.int32), None)


def _upload_act(rt, dev: gpu.GpuActQ, act: ActQ) -> None:
    rt.copy_in(dev.q, act.q)
    rt.copy_in(dev.d, act.d)
    rt.copy_in(dev.s16, act.s16)


# --- the dense path ------------------------------------------------------------------------------------


class Dense:
    """W x for every placed weight: the host's activations uploaded once per vector into the staging
    (plan item dense.staging), the product on the device, the result copied back. The LM head writes
    into head.logits and comes back through the pinned logits buffer."""

    def __init__(self, rt, g, staging: Carver, head: Weight, head_dev, head_host: np.ndarray, prompt: Carver | None):
        n_in, n_out = B.dense_dims(g)
        self.rt, self.head = rt, head
        self.xf = staging.array((n_in,), np.float32)
        self.xq = staging.actq(n_in)
        self.y = staging.array((n_out,), np.float32)
        self.head_dev, self.head_host = head_dev, head_host
        self._held: dict[str, tuple] = {}  # "f"/"q": (the Input, its version) whose values the staging holds
        self._views: dict[tuple, object] = {}  # staging views by width, carved once (a device view costs microseconds)
        # the prompt path: rows of input (f32 and ActQ) and output, as many as prompt.chunk holds
        self.rows = 0
        if prompt is not None and prompt.size:
            self.rows = max(prompt.size - 5 * 256, 0) // B.prompt_row_bytes(g)  # 5 planes, each aligned
            self.pf = prompt.array((self.rows, n_in), np.float32)
            self.pq = prompt.actq(n_in, self.rows)
            self.py = prompt.array((self.rows * max(n_out, g.n_vocab),), np.float32)

    def _form(self, w: Weight, x):
        """The activations W reads (the host's ActQ for block types, f32 otherwise), and the Input they came from."""
        src = x if isinstance(x, Input) else None
        if w.type.quantized:
            act = x.form(w.type) if src is not None else (x if isinstance(x, ActQ) else quantize_act(x, where=f"weight {w.name}"))
        else:
            act = x.form(w.type) if src is not None else x
        return act, src

    def _stage_vector(self, w: Weight, x):
        act, src = self._form(w, x)
        if (act.q if isinstance(act, ActQ) else act).ndim == 2:
            act = _row(act)  # the decode step's one row
        kind = "q" if w.type.quantized else "f"
        key = None if src is None else (src, src.version)
        held = self._held.get(kind)
        n = w.n_in
        dev = self._view(kind, n)
        if kind == "q":
            if key is None or held is None or held[0] is not key[0] or held[1] != key[1]:
                _upload_act(self.rt, dev, act)
        else:
            if key is None or held is None or held[0] is not key[0] or held[1] != key[1]:
                self.rt.copy_in(dev, np.ascontiguousarray(act, dtype=F32).reshape(n))
        self._held[kind] = key
        return dev

    def _view(self, kind: str, n: int):
        v = self._views.get((kind, n))
        if v is None:
            if kind == "q":
                v = gpu.GpuActQ(self.xq.q[:n], self.xq.d[: n // QA], self.xq.s16[: n // 16], None)
            else:
                v = self.xf[:n] if kind == "f" else self.y[:n]
            self._views[(kind, n)] = v
        return v

    def matvec(self, w: Weight, x, out: np.ndarray | None = None) -> np.ndarray:
        dev = self._stage_vector(w, x)
        if out is None:
            out = np.empty(w.n_out, F32)
        if w is self.head:
            gpu.matvec_into(w.device, dev, self.head_dev)
            self.rt.copy_out(self.head_host, self.head_dev)
            out[...] = self.head_host
        else:
            y = self._view("y", w.n_out)
            gpu.matvec_into(w.device, dev, y)
            self.rt.copy_out(out, y)
        return out

    def matmul(self, w: Weight, X, out: np.ndarray | None = None) -> np.ndarray:
        """T rows, through the prompt path's buffers as many rows at a time as they hold (token by
        token through the staging when there are none: --prefill off plans no chunk buffers)."""
        act, _ = self._form(w, X)
        T = (act.q if isinstance(act, ActQ) else act).shape[0]
        if out is None:
            out = np.empty((T, w.n_out), F32)
        if self.rows == 0:
            for t in range(T):
                row = ActQ(act.q[t], act.d[t], act.s16[t]) if isinstance(act, ActQ) else np.ascontiguousarray(act[t])
                self.matvec(w, row, out[t])
            return out
        n = w.n_in
        for a in range(0, T, self.rows):
            r = min(T, a + self.rows) - a
            if isinstance(act, ActQ):
                dev = _act_rows(self.pq, r, n)
                _upload_act(self.rt, dev, ActQ(act.q[a : a + r], act.d[a : a + r], act.s16[a : a + r]))
            else:
                dev = self.rt.view(self.pf.reshape(-1).view(np.uint8), 0, (r, n), np.float32)
                self.rt.copy_in(dev, np.ascontiguousarray(act[a : a + r], dtype=F32))
            y = self.rt.view(self.py.view(np.uint8), 0, (r, w.n_out), np.float32)
            gpu.matmul(w.device, dev, out=y)
            self.rt.copy_out(out[a : a + r], y)
        return out


def _select(starts: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the row indices of `groups`, in order; their starts from 0)."""
    sizes = np.array([starts[g + 1] - starts[g] for g in groups], np.int64)
    idx = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in groups]) if len(groups) else np.zeros(0, np.int64)
    return idx.astype(np.int64), np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def _rows(act, rows: np.ndarray):
    return ActQ(act.q[rows], act.d[rows], act.s16[rows]) if isinstance(act, ActQ) else np.ascontiguousarray(act[rows])


def _slice(dev, a: int, b: int):
    return gpu.GpuActQ(dev.q[a:b], dev.d[a:b], dev.s16[a:b], None) if isinstance(dev, gpu.GpuActQ) else dev[a:b]


# --- the expert cache ----------------------------------------------------------------------------------


class ExpertSlots:
    """The slot storage (plan item cache.slots): slot s holds one expert's gate, up and down in
    engine form at s * slot_bytes. `map` says which (layer, expert) sits where (host, S9)."""

    def __init__(self, rt, model: Model, arena, slots: int, slot_bytes: int, staging: np.ndarray | None):
        g = model.geometry
        self.rt, self.pack, self.arena, self.slot_bytes, self.staging = rt, model.pack, arena, slot_bytes, staging
        self.E, self.F, self.n_expert, self.n_layer = g.n_embd, g.n_ff_exp, g.n_expert, g.n_layer
        self.map = SlotMap(slots, g.n_layer, g.n_expert)
        self.weights: list[tuple | None] = [None] * slots

    @property
    def slots(self) -> int:
        return self.map.slots

    def fill(self, fill: list[list[int]]) -> None:
        """The one fill (S9): the plan's pairs, layer by layer; frozen afterwards (decode admits nothing)."""
        self.map = SlotMap.from_fill(fill, self.map.slots, self.n_expert)
        for layer in range(self.n_layer):
            for e in np.flatnonzero(self.map.table[layer] >= 0):
                self._load(layer, int(e), self.map.slot(layer, int(e)))

    def lookup(self, layer: int, e: int) -> int:
        """The slot of (layer, e), or -1: a miss. Without a profile the first routes fill free slots
        (compulsory misses: this token computes it on the CPU, the next ones on the GPU)."""
        s = self.map.slot(layer, e)
        if s >= 0 or self.map.frozen or self.map.used == self.map.slots:
            return s if s >= 0 else -1
        s = self.map.admit(layer, e)
        self._load(layer, e, s)
        return -1

    def _load(self, layer: int, e: int, s: int) -> None:
        gu, d = self.pack.expert_types(layer)
        gate, up, down = self.pack.expert(layer, e)
        at, E, F = s * self.slot_bytes, self.E, self.F
        name = f"blk.{layer} expert {e}"
        wg = gpu.place(gate, gu.id, E, F, self.arena, at, f"{name} gate", self.staging)
        at += placed_bytes(gu.id, E, F)
        wu = gpu.place(up, gu.id, E, F, self.arena, at, f"{name} up", self.staging)
        at += placed_bytes(gu.id, E, F)
        wd = gpu.place(down, d.id, F, E, self.arena, at, f"{name} down", self.staging)
        self.weights[s] = (wg, wu, wd)


@dataclass
class HitStats:
    """Per layer hits and misses of the token path, and where its MoE time went (--stats)."""

    hits: np.ndarray
    misses: np.ndarray
    gpu_s: float = 0.0  # device time of the hits' products (CUDA events; 0 where there are none)
    cpu_s: float = 0.0  # the CPU misses, computed while the hits' products run
    wait_s: float = 0.0  # waiting for the device's results
    events: bool = False

    @classmethod
    def empty(cls, n_layer: int) -> HitStats:
        return cls(np.zeros(n_layer, np.int64), np.zeros(n_layer, np.int64))

    def reset(self) -> None:
        self.hits[:] = 0
        self.misses[:] = 0
        self.gpu_s = self.cpu_s = self.wait_s = 0.0

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
        stats.events = self.events is not None

    def routed(self, moe, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """engine/moe.py's expert server: MoE.routed's rows, the hits on the device beside the misses'
        one grouped CPU call (MoE.products). One token through the per-row buffers carved at startup,
        a chunk through the prompt path's."""
        if x.x.shape[0] == 1:
            return self._token(moe, x, experts)
        return self._chunk(moe, x, experts, rows, starts)

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
            _upload_act(rt, self.h_n[n], quantize_act(h, out=self.h_act_n[n]))
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
        """MoE.products with the hits on the device: their tokens' activations go up once, every
        hit's gate/up (then down) product is queued, the misses' grouped CPU call runs meanwhile, and
        the host makes h from the downloaded gate and up exactly as the CPU path does (B2)."""
        slots = np.array([self.slots.lookup(moe.layer, int(e)) for e in experts], np.int64)
        hit_g = np.flatnonzero(slots >= 0)
        need = self._many_bytes(moe, int(sum(starts[g + 1] - starts[g] for g in hit_g)))
        if hit_g.size == 0 or self.prompt is None or need > self.prompt.size:
            return moe.products(x, experts, rows, starts)  # nothing on the device, or no room: all CPU
        miss_g = np.flatnonzero(slots < 0)
        hit_i, hit_s = _select(starts, hit_g)
        miss_i, miss_s = _select(starts, miss_g)
        rt, E, F, n = self.rt, moe.E, moe.F, hit_i.size
        buf = Carver(rt, self.prompt, "the prompt path's hit buffers")
        xa = _rows(x.form(moe.gu), rows[hit_i])
        xdev = self._stage_many(buf, xa, E)
        gate, up = buf.array((n, F), np.float32), buf.array((n, F), np.float32)
        wts = [self.slots.weights[slots[g]] for g in hit_g]
        for i, (wg, wu, _) in enumerate(wts):
            a, b = hit_s[i], hit_s[i + 1]
            gpu.matmul(wg, _slice(xdev, a, b), out=gate[a:b])
            gpu.matmul(wu, _slice(xdev, a, b), out=up[a:b])
        out = np.empty((rows.size, E), F32)
        if miss_i.size:
            out[miss_i] = moe.products(x, experts[miss_g], rows[miss_i], miss_s)
        g = np.empty((n, F), F32)
        h = np.empty((n, F), F32)
        rt.copy_out(g, gate)
        rt.copy_out(h, up)
        hidden_(g, h)  # up silu(gate): the misses' function, the same bits
        hdev = self._stage_many(buf, Input(h).form(moe.d), F)
        y = buf.array((n, E), np.float32)
        for i, (_, _, wd) in enumerate(wts):
            a, b = hit_s[i], hit_s[i + 1]
            gpu.matmul(wd, _slice(hdev, a, b), out=y[a:b])
        hits = np.empty((n, E), F32)
        rt.copy_out(hits, y)
        out[hit_i] = hits
        return out

    @staticmethod
    def _many_bytes(moe, n: int) -> int:
        E, F = moe.E, moe.F
        return B.actq_placed_bytes(E, n) + align(n * E * 4) + 2 * align(n * F * 4) + B.actq_placed_bytes(F, n) \
            + align(n * F * 4) + align(n * E * 4)

    def _stage_many(self, buf: Carver, act, n: int):
        if isinstance(act, ActQ):
            dev = buf.actq(n, act.q.shape[0])
            _upload_act(self.rt, dev, act)
            return dev
        dev = buf.array(act.shape, np.float32)
        self.rt.copy_in(dev, np.ascontiguousarray(act, dtype=F32))
        return dev

    def _stage(self, act, qbuf: gpu.GpuActQ, fbuf, n: int):
        """Upload the host's activations: an ActQ into `qbuf`, f32 values into a row of `fbuf`."""
        if isinstance(act, ActQ):
            _upload_act(self.rt, qbuf, act)
            return qbuf
        dev = fbuf[0, :n]
        self.rt.copy_in(dev, np.ascontiguousarray(act, dtype=F32))
        return dev


# --- the backend ---------------------------------------------------------------------------------------


class TierBackend(CpuBackend):
    """The CPU backend with the tier plugged in (engine/backend.py): W x of every weight placed on
    the device runs there (`Dense`), and the routed experts go through the hit path; the blocks and
    everything else are the CPU's."""

    name = "gpu tier"

    def __init__(self, dense: Dense, experts: HitPath):
        super().__init__()
        self.dense, self.experts = dense, experts

    def linear(self, w: Weight, x, out: np.ndarray | None = None) -> np.ndarray:
        if w.device is None:
            return super().linear(w, x, out)
        act = x.form(w.type) if isinstance(x, Input) else x
        if (act.q if isinstance(act, ActQ) else act).shape[0] == 1:
            row = self.dense.matvec(w, x, None if out is None else out.reshape(-1))
            return row.reshape(1, -1)
        return self.dense.matmul(w, x, out)


# --- startup -------------------------------------------------------------------------------------------


@dataclass
class GpuTier:
    model: Model
    plan: Budget
    marks: list[MemMark]
    slots: ExpertSlots
    stats: HitStats
    hit_path: HitPath
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, model: Model, o: TierOptions, log: Callable[[str], None] = lambda _: None) -> GpuTier:
        """S6's stages in S7's order; returns the running tier (model's weights and MoE layers bound)."""
        rt = gpu.runtime()
        pack, g = model.pack, model.geometry
        lines: list[str] = []

        def say(text: str) -> None:
            lines.append(text)
            log(text)

        if o.profile is not None:
            check_profile(o.profile, pack_fingerprint=pack_fingerprint(pack.dir), n_layer=g.n_layer, n_expert=g.n_expert,
                          top_k=g.n_expert_used)
        rt.use_stream()
        rt.release()  # memory a previous tier or test left cached in the pool would hide this one's
        # every kernel the run will launch, compiled now (not inside the first token's time) and
        # before the baseline: a module's code and tables are the context's memory, not the plan's
        mats = [pack.weight(s.name) for s in tensor_specs(g) if s.multiplied and s.name in pack.weights]
        types = {w.type.name for w in mats} | {t.name for l in range(g.n_layer) for t in pack.expert_types(l)}
        for name in sorted(types | {"actq"}):
            gpu.compile_module(name)
        mem = DeviceMemory(rt, o.vram_budget_mib)
        bopts = BudgetOptions(max_context=o.max_context, kv=o.kv, vram_reserve_mib=o.vram_reserve_mib,
                              prefill_chunk=o.prefill_chunk, expert_cache=o.expert_cache,
                              profile_pairs=o.profile.pairs if o.profile is not None else None)
        free0 = mem.free()
        plan = plan_budget(pack.index, pack.experts, g, bopts, free_bytes=free0)
        say(f"gpu tier: {free0 / MiB:.0f} MiB free at start"
            + (f" (--vram-budget-mib {o.vram_budget_mib})" if o.vram_budget_mib is not None else ""))
        marks: list[MemMark] = []
        slots_now = [0]

        def mark(stage: str) -> None:
            # the plan's figure, with the slots the cache really opened with (sized from measured free memory)
            predicted = plan.used_after(stage)
            if B.STAGES.index(stage) >= B.STAGES.index(B.OPEN_CACHE):
                predicted += slots_now[0] * plan.slot_bytes - plan.device_bytes(B.OPEN_CACHE)
            m = MemMark(stage, mem.free(), mem.used(), predicted, mem.card_used())
            marks.append(m)
            say(m.line(len(marks)))

        def arena(items: list[B.Item], name: str) -> Carver:
            n = sum(i.bytes for i in items if i.where == B.DEVICE)
            return Carver(rt, rt.empty((n,), np.uint8) if n else None, name)

        # 1. the weights (the LM head among them: S7, before the cache is sized) and the session (host)
        stage1 = [i for i in plan.items if i.stage == B.WEIGHTS]
        if plan.device_bytes(B.WEIGHTS) > free0:
            raise GpuTierError(f"the dense weights need {plan.device_bytes(B.WEIGHTS) / MiB:.1f} MiB of device memory, "
                               f"{free0 / MiB:.1f} MiB are free: use --device cpu or a larger card")
        weights = arena(stage1, "the dense weights")
        placed = []
        for w in mats:
            at = weights.take(placed_bytes(w.type_id, w.n_in, w.n_out))
            placed.append((w, gpu.place(w.raw, w.type_id, w.n_in, w.n_out, weights.arena, at, w.name)))
        rt.synchronize()
        mark(B.WEIGHTS)

        # 2. the expert cache, sized from the free memory measured now (S7)
        free_open = mem.free()
        sp = plan.slots_for(free_open)
        if sp.problems:  # S7: refused with both numbers, never handed back smaller
            raise (ExpertCacheTooBig if o.expert_cache is not None else GpuTierError)("; ".join(sp.problems))
        n_slots = sp.slots
        if o.expert_cache is not None and n_slots > plan.n_pairs:
            raise ExpertCacheTooBig(f"--expert-cache {n_slots}: the model has {plan.n_pairs} (layer, expert) pairs, "
                                    f"so at most {plan.n_pairs} slots hold anything")
        if sp.auto_line:
            say(sp.auto_line)
        else:
            say(f"expert cache {n_slots} slots (--expert-cache): {n_slots * plan.slot_bytes / MiB:.1f} MiB of "
                f"{(free_open - sp.reserve.bytes) / MiB:.1f} MiB free beside the {sp.reserve.bytes / MiB:.0f} MiB reserve")
        if sp.reserve.adapted:
            say(f"small card: the reserve shrinks from {sp.reserve.asked_mib} to {sp.reserve.headroom_mib} MiB")
        slot_arena = rt.empty((n_slots * plan.slot_bytes,), np.uint8) if n_slots else None
        slots_now[0] = n_slots
        mark(B.OPEN_CACHE)

        # 3. the profile fill (S9), once, through one pinned slot of staging
        staging = rt.pinned(plan.item("fill.staging").bytes) if n_slots else None
        slots = ExpertSlots(rt, model, slot_arena, n_slots, plan.slot_bytes, staging)
        say(f"expert cache fill: {fill_policy_line(o.profile) if n_slots < plan.n_pairs else 'every pair (one slot per expert)'}")
        if n_slots >= plan.n_pairs:
            slots.fill([list(range(g.n_expert))] * g.n_layer)
        elif o.profile is not None and n_slots:
            fill = plan_fill(o.profile, n_slots, g.n_layer)
            slots.fill(fill)
            say("expert cache fill: " + " ".join(f"L{l}:{len(f)}" for l, f in enumerate(fill)) + f" ({sum(map(len, fill))} slots)")
        rt.synchronize()
        mark(B.FILL)

        # 4. the hit path
        stats = HitStats.empty(g.n_layer)
        hits = arena([plan.item("hits.buffers")], "the hit buffers")
        exchange = rt.pinned(plan.item("hits.exchange").bytes)
        hit_path = HitPath(rt, g, slots, hits, exchange, stats)
        mark(B.HIT_PATH)

        # 5. the slot table (host: slots.map) and the dense path's staging
        staging5 = arena([plan.item("dense.staging")], "the dense staging")
        mark(B.CACHE_GRAPHS)

        # 6. the head's logits and the prompt path's chunk buffers
        head_dev = rt.empty((g.n_vocab,), np.float32)
        head_host = rt.pinned(plan.item("head.logits_host").bytes).view(np.float32)
        prompt = arena([plan.item("prompt.chunk")], "the prompt chunk buffers")
        dense = Dense(rt, g, staging5, model.head, head_dev, head_host, prompt)
        if dense.rows:  # the prompt path's experts borrow its output rows: a chunk's matrices run one at a time
            hit_path.prompt = rt.view(dense.py.reshape(-1).view(np.uint8), 0, (dense.py.size * 4,), np.uint8)
        mark(B.HEAD_PROMPT)

        # 7. the verifier and the drafter's binding: none without --spec / --mtp
        mark(B.VERIFIER)
        low = B.low_memory_warning(mem.free())
        if low:
            say(low)

        for w, dev in placed:
            w.device = dev
        # all or nothing (S10): bound only now, with the slots filled and every buffer in place
        model.backend = TierBackend(dense, hit_path)
        say(f"hit path: ready, GPU hits beside CPU misses ({slots.map.used} of {n_slots} slots filled)" if n_slots else
            "hit path: ready, but with no expert slots every expert is a CPU miss")
        return cls(model, plan, marks, slots, stats, hit_path, lines)

    def stop(self) -> None:
        """Unbind from the model (it runs on the CPU again) and give the device memory back."""
        for w in self.model.pack.weights.values():
            w.device = None
        self.model.backend = CpuBackend()
        self.slots.weights.clear()
        self.slots.arena = self.hit_path = None
        gc.collect()
        gpu.runtime().release()
