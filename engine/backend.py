"""The backend seam: what the blocks call to compute, chosen at load.

A block (engine/model.py's mixers and residuals, engine/moe.py, engine/qsa.py, engine/hyper.py,
engine/ple.py) is written once over a batch of T token rows (T = 1 is the decode step) and never
asks where it runs. It calls its backend for

    linear(w, x, out)        W x for T rows: the matvec kernel for one row, the panel kernels for more
    attention, delta_rule,   the sequence operations, each choosing its one-token or T-token form
    conv, rope_, attend_one  itself (below the blocks, from T)
    rmsnorm, sigmoid, ...    the elementwise and fused row operations (route, combine, mix_tail,
                             inject, ple_conv, ple_output, topk_set: each a kernel beside its
                             reference in the block's module)
    zeros, empty, kv_cache,  the per-sequence states and buffers, allocated where this backend computes
    qsa_cache, ple_state
    param, upload, host      a block's parameters, host values brought in, and values brought back
    scratch(key, shape)      the decode step's buffers, made once and reused
    experts                  who computes which routed experts (None: every expert on the CPU);
                             engine/moe.py owns the split and asks it

What a block does with plain numpy is host bookkeeping only: positions, token ids, which rows
belong to which sequence.

`CpuBackend` is numpy + the Numba kernels (engine/kernels/cpu.py). The GPU tier (engine/tier/)
is a CpuBackend whose `linear` runs the weights it placed on the device and whose `experts` serves
the GPU-resident experts; everything else stays the CPU's (docs/gpu-tier.md).
"""

from __future__ import annotations

import numpy as np

from . import hyper, moe, ops, ple, qsa
from .kvcache import KVCache
from .kernels.actq import ActQ, ActQ16
from .kernels import cpu
from .weights import Input, Weight

F32 = np.float32


class Scratch:
    """The decode step's buffers, by key: one buffer per (key, shape, dtype), made on first use and
    returned again after (the token path allocates nothing after warm-up). Keys name a block kind's
    buffer, not a layer's: layers run one after another and a block's scratch is consumed before the
    next block of its kind runs, so every layer of a kind shares one.

    Only single-row (T = 1) shapes are kept. A prompt chunk's buffers are made per chunk as before:
    the prompt path's memory model (strata-budget's prefill_host_bytes) counts them at their peak
    and glibc keeps freed memory for the next chunk (ops.reuse_freed_memory); kept, they would hold
    hundreds of MB after the prompt for nothing."""

    def __init__(self):
        self._bufs: dict[tuple, np.ndarray] = {}

    def __call__(self, key: str, shape: tuple[int, ...], dtype=F32) -> np.ndarray:
        if not shape or shape[0] != 1:
            return np.empty(shape, dtype)
        k = (key, shape, dtype)  # (np.dtype(dtype) here cost ~0.5 us of ~130 calls a token)
        buf = self._bufs.get(k)
        if buf is None:
            buf = self._bufs[k] = np.empty(shape, dtype)
        return buf


def _row(act):
    """Row 0 of a one-row activation (an ActQ or f32 [1, n]) as the matvec kernels take it."""
    if isinstance(act, ActQ):
        return ActQ(act.q[0], act.d[0], act.s16[0])
    if isinstance(act, ActQ16):
        return act.row(0)
    return act[0]


def _one_row(x) -> bool:
    """Whether x is an Input of one row: the token path's products, which go through kept plans."""
    return type(x) is Input and x.x.ndim == 2 and x.x.shape[0] == 1


_OWNS: dict[tuple, bool] = {}  # (backend class, hooks) -> CpuBackend.owns
_UNPLANNED = object()
PLANS_MAX = 4096  # a backend's kept plans (cpu.TokenProducts): a few per layer of the largest models


class CpuBackend:
    """numpy and the Numba kernels."""

    name = "cpu"
    xp = np
    experts = None  # engine/moe.py computes every routed expert on the CPU
    # a one-token sequence of a batch (a verify row) attends by `attend_one`, not `attention`: for a
    # backend whose two forms sum in another order (the device step), so a row has the token step's bits
    rows_attend_one = False

    def __init__(self):
        self.scratch = Scratch()
        self._plans: dict[tuple, cpu.TokenProducts | None] = {}  # the token path's products (_products)

    def enter_thread(self) -> None:
        """A thread that runs this backend's work from now (strata serve's worker) starts here: the
        GPU tier's backends put its device work on the tier's stream; the CPU's need nothing."""

    def owns(self, *hooks: str) -> bool:
        """Whether every hook named is this class's as CpuBackend defines it (none overridden). A
        block may replace a token's run of such hooks by a fused host form (a few Numba passes in
        the step's buffers) only then: a backend that computes one of them elsewhere (the device
        step, whose arrays the emulation keeps in numpy too) gets every call as before."""
        # kept per class: checked at every call it cost ~4-8 us a GDN layer (11 hooks). So a hook
        # patched onto a class after its first token is not seen: subclass, or patch `owns` itself
        key = (type(self), hooks)
        got = _OWNS.get(key)
        if got is None:
            got = _OWNS[key] = all(getattr(type(self), h) is getattr(CpuBackend, h) for h in hooks)
        return got

    # --- matrix products -------------------------------------------------------------------------

    def linear(self, w: Weight, x, out: np.ndarray | None = None) -> np.ndarray:
        """Y = X W^T -> f32 [T, n_out]; x an Input of T rows (or f32 [T, n_in] / an ActQ of T rows).
        One row takes the matvec kernel (the decode step's), more the panel kernels: both give each
        row the same bits (tests/engine/test_kernels_cpu.py), so the choice changes speed, not numbers."""
        if isinstance(x, np.ndarray):
            x = Input(x)  # Input.form is the one place activations are quantized (engine/weights.py)
        if out is not None and _one_row(x):  # the token path
            plan = self._products((w,))
            if plan is not None:
                self._launch(plan, x, (out,))
                return out
        act = x.form(w.type, w.wide) if isinstance(x, Input) else x
        T = act.rows if isinstance(act, ActQ16) else (act.q if isinstance(act, ActQ) else act).shape[0]
        if out is None:
            out = np.empty((T, w.n_out), F32)
        if T == 1:
            cpu.matvec(w.raw, w.type.id, w.n_in, w.n_out, _row(act), out.reshape(-1))
        else:
            cpu.matmul(w.raw, w.type.id, w.n_in, w.n_out, act, out)
        return out

    def linears(self, ws, x, outs) -> list[np.ndarray]:
        """[linear(w, x, out) for w, out in zip(ws, outs)] (an out may be None): several products of one input. One row
        on the CPU goes through cpu.matvec_many (all the matrices' rows in one parallel region,
        the same bits; a wide weight reads its own form of the same input, so a GDN layer's qkv and
        gate still share one region); a weight the backend places elsewhere (the tier's `linear`)
        goes one by one."""
        if isinstance(x, np.ndarray):
            x = Input(x)
        if _one_row(x) and all(o is not None for o in outs) and all(w.device is None for w in ws):  # the token path
            plan = self._products(ws)
            if plan is not None:
                self._launch(plan, x, outs)
                return list(outs)
        acts = [x.form(w.type, w.wide) if isinstance(x, Input) else x for w in ws]  # a wide weight reads its own form
        one = all(a.rows == 1 if isinstance(a, ActQ16) else (a.q if isinstance(a, ActQ) else a).shape[0] == 1 for a in acts)
        if not one or any(getattr(w, "device", None) is not None for w in ws):
            return [self.linear(w, x, out) for w, out in zip(ws, outs)]
        outs = [np.empty((1, w.n_out), F32) if out is None else out for w, out in zip(ws, outs)]
        rows = {}  # one row object per form: matvec_many fuses products whose forms are the same object
        forms = [rows.setdefault(id(a), _row(a)) for a in acts]
        cpu.matvec_many([(w.raw, w.type.id, w.n_in, w.n_out, out.reshape(-1)) for w, out in zip(ws, outs)], forms)
        return outs

    def _products(self, ws) -> cpu.TokenProducts | None:
        """The plan of one call site of the token path (these weights, one row), made at its first
        token (cpu.TokenProducts; None: the products go as before)."""
        plans = self.__dict__.setdefault("_plans", {})  # (a subclass may not run __init__: DeviceBackend)
        key = tuple(ws)
        plan = plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            if len(plans) >= PLANS_MAX:  # more call sites than any model has: keep the memory bounded
                plans.clear()
            kinds = ["w" if w.wide else "q" if w.type.quantized else "f" for w in ws]
            plan = plans[key] = cpu.TokenProducts.make([(w.raw, w.type.id, w.n_in, w.n_out) for w in ws], kinds)
        return plan

    @staticmethod
    def _launch(plan: cpu.TokenProducts, x: Input, outs) -> None:
        plan(None if plan.t8 is None else x.form(plan.t8), None if plan.t16 is None else x.form(plan.t16, True),
             x.x if plan.floats else None, outs)  # fmt: skip

    # --- the sequence and elementwise operations (engine/ops.py) ---------------------------------

    def boundary(self, what) -> None:
        """Where the forward is (a layer's index before it, "head" before the LM head): nothing here;
        the device step cuts its captured step there to time each part (DeviceBackend.gpu_floor)."""

    # --- where arrays live ---------------------------------------------------------------------------
    # A block's own parameters (norm gains, conv taps, decay constants) are numpy arrays made at load;
    # `param` gives the copy this backend computes with, `upload` brings host values (an embedding
    # row) to it, `host` brings its values back (logits). All three are the array itself on the CPU;
    # the device step (engine/tier/device.py) keeps its copies on the GPU.

    @staticmethod
    def param(a: np.ndarray) -> np.ndarray:
        return a

    @staticmethod
    def upload(a: np.ndarray) -> np.ndarray:
        return a

    @staticmethod
    def host(a: np.ndarray) -> np.ndarray:
        return a

    # A table's rows gathered where the backend computes, when the table lives there (the device
    # step's embedding and PLE table on the GPU); None: the host decodes them and `upload`s them.
    @staticmethod
    def embed_rows(ids: np.ndarray, n: int) -> None:
        return None

    @staticmethod
    def ple_rows(ids: np.ndarray, row_dim: int) -> None:
        return None

    @staticmethod
    def qsa_select_rows(layer, cache, iq: np.ndarray, p0: int) -> None:
        """A prompt chunk's QSA selections as a mask, made where the backend computes (the device
        step); None: QSALayer selects query by query."""
        return None

    # --- the per-sequence states ------------------------------------------------------------------

    @staticmethod
    def zeros(shape, dtype=F32) -> np.ndarray:
        return np.zeros(shape, dtype)

    @staticmethod
    def empty(shape, dtype=F32) -> np.ndarray:
        return np.empty(shape, dtype)

    kv_cache = staticmethod(KVCache)
    qsa_cache = staticmethod(qsa.QSACache.for_geometry)
    ple_state = staticmethod(ple.PLEState.for_geometry)

    attention = staticmethod(ops.attention)
    delta_rule = staticmethod(ops.delta_rule)
    conv = staticmethod(ops.conv_many)
    rmsnorm = staticmethod(ops.rmsnorm)
    l2norm_ = staticmethod(ops.l2norm_)
    sigmoid = staticmethod(ops.sigmoid)
    softplus = staticmethod(ops.softplus)
    gate_ = staticmethod(ops.gate_)
    causal_mask = staticmethod(ops.causal_mask)
    gated_rmsnorm_ = staticmethod(ops.gated_rmsnorm_)
    route = staticmethod(moe.route_topk)
    combine = staticmethod(moe.combine)
    mix_tail = staticmethod(hyper.mix_tail)
    inject = staticmethod(hyper.inject)
    ple_conv = staticmethod(ple.conv_taps)
    ple_output = staticmethod(ple.add_output)
    topk_set = staticmethod(qsa.torch_topk_set)

    def norm_input(self, x: np.ndarray, gain: np.ndarray, eps: float, out: np.ndarray) -> Input:
        """rmsnorm of x into `out` as the Input of the products that read it (a layer's input norm):
        a backend may make the ActQ with the norm (DeviceBackend: one launch)."""
        return Input(self.rmsnorm(x, gain, eps, out))

    def add_norm_input(self, H: np.ndarray, Y: np.ndarray, gain: np.ndarray, eps: float, out: np.ndarray) -> Input:
        """H += Y (a block's output into the residual stream), then norm_input of H into `out`: a
        backend may make the two in one launch (DeviceBackend)."""
        H += Y
        return self.norm_input(H, gain, eps, out)

    def gated_norm_input(self, o: np.ndarray, gain: np.ndarray, z: np.ndarray, eps: float, silu: bool) -> Input:
        """gated_rmsnorm_ of o [T, heads, n] in place, as the Input [T, heads n] of the product that
        reads it (a Gated DeltaNet's out projection); a backend may make the ActQ with the norm."""
        self.gated_rmsnorm_(o, gain, z, eps, silu)
        return Input(o.reshape(o.shape[0], -1))

    def gate_input(self, x: np.ndarray, z: np.ndarray, silu: bool, w: Weight) -> Input:
        """x *= silu(z) (`gate_`) or, without silu, x *= sigmoid(z), in place, as the Input [T, n] of
        the product w that reads it (the shared expert's down, gated attention's out projection;
        z may be a strided view of x's shape); a backend may make w's ActQ in the same launch."""
        if silu:
            self.gate_(x, z, silu=True)
        else:
            x *= self.sigmoid(z)
        return Input(x.reshape(x.shape[0], -1))

    def lowrank_gates_input(self, d: np.ndarray, inj: np.ndarray | None, hc: int, w: Weight) -> tuple:
        """A hyper-connection mix's gates (hyper.lowrank_gates_reference) of down's and inject's
        outputs d [T, R] and inj [T, hc] (None: output_hc) -> (silu(d / hc) as the Input of the
        product w that reads it, 2 sigmoid(inj / hc) or None); d and inj may be overwritten. A
        token on a backend that owns `sigmoid`: the host's fused passes into the step's buffers
        (their numpy steps were 12 calls and 5 temporaries a mix); a backend may make w's ActQ in
        the same launch."""
        T, R = d.shape
        if T == 1 and self.owns("sigmoid"):
            sc = self.scratch
            a, wt = sc("hc.a", (1, R)), None if inj is None else sc("hc.w", (1, hc))
            hyper.lowrank_gates(d, inj, F32(hc), a, wt, sc("hc.ex", (1, R)), None if inj is None else sc("hc.exw", (1, hc)))
            return Input(a), wt
        d /= F32(hc)
        a = d * self.sigmoid(d, exp_form=True)  # silu
        return Input(a), None if inj is None else 2 * self.sigmoid(inj / F32(hc), exp_form=True)

    @staticmethod
    def rmsnorm_q(x: np.ndarray, gain: np.ndarray, group: int, eps: float):
        """rmsnorm with f32 sums of rows [T, n] and its ActQ in one pass (hyper.grouped_rmsnorm_q,
        looked up at each call so that a recorder of the engine's activations sees it)."""
        return hyper.grouped_rmsnorm_q(x, gain, group, eps)

    @staticmethod
    def rope_(rope: ops.Rope, x: np.ndarray, positions: np.ndarray) -> None:
        rope.apply_(x, positions)

    # --- several operations in one: the device step makes each one launch (engine/tier/device.py);
    # here they are the same operations one after the other, so the CPU's bits stay its own

    def gdn_gates(self, beta: np.ndarray, alpha: np.ndarray, a: np.ndarray, dt_bias: np.ndarray):
        """A Gated DeltaNet layer's gates from its beta and alpha products [T, nv]:
        (sigmoid(beta), a softplus(alpha + dt_bias))."""
        return self.sigmoid(beta), self.param(a) * self.softplus(alpha + self.param(dt_bias))

    def gates_conv(self, beta, alpha, a, dt_bias, state, w, x):
        """gdn_gates, then conv of one sequence's rows x over its state -> ((beta, decay), conv
        output): a backend may make the two in one launch (the device step)."""
        return self.gdn_gates(beta, alpha, a, dt_bias), self.conv(state, w, x)

    # T tokens of one sequence (q, k [T, nk, dk], v, out [T, nv, dv], g, beta [T, nv]) through the
    # delta rule's token step, one after another, the state after token t copied into saved[t] (None:
    # not kept), in one pass over the state: speculative decoding's verify rows on the CPU
    delta_rule_rows = staticmethod(ops.delta_rule_rows)

    def qk_l2norm_(self, c: np.ndarray, n: int, nk: int, dk: int, scale: float):
        """The queries and keys of a Gated DeltaNet layer's conv output c [n, C] (its first nk dk
        columns, then the next nk dk), each head l2-normalised in place, the queries then scaled ->
        (q, k) [n, nk, dk] views of c."""
        q = self.l2norm_(c[:, : nk * dk].reshape(n, nk, dk))
        q *= F32(scale)
        k = self.l2norm_(c[:, nk * dk : 2 * nk * dk].reshape(n, nk, dk))
        return q, k

    def shared_add_(self, out: np.ndarray, y: np.ndarray, g: np.ndarray) -> np.ndarray:
        """The shared expert's gated output added to the routed sum: out += y sigmoid(g), g [T, 1]."""
        y *= self.sigmoid(g)
        out += y
        return out

    def attend_one(self, cache: KVCache, pos: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
        """The decode step's attention (one token of one sequence): its key and value k, v [1, Hkv, D]
        cached at pos, then its queries q [1, H, D] over positions 0..pos -> f32 [1, H, D]."""
        cache.write(pos, k, v)
        K, V = cache.read(slice(0, pos + 1))
        return self.attention(q, K, V, scale, None)
