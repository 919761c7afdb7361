"""The device step: the forward's blocks computing on the GPU, their states living there.

The blocks (engine/model.py, engine/moe.py) are the CPU's, unchanged: this is a backend
(engine/backend.py) whose arrays are device arrays. Every matrix product runs on the weights the
tier placed (engine/kernels/gpu.py, the activations quantized on the device by the ActQ kernel, bit
for bit the host's), every norm, gate, convolution, delta-rule step, RoPE and attention on the
device with the runtime's array module (`rt.xp`: CuPy on a card; numpy under the host emulation,
tests/gpu_emu.py), and the session's states (KV cache, Gated DeltaNet state, conv state, residual
stream) are device arrays.

A decode token needs the host only for the embedding row in and the logits out (only the token with a
greedy pick, dev_argmax), and for the misses
of a layer whose experts are not all resident (DeviceExperts: the top-k, the slot lookup, the hits'
products and the combine are on the device; the misses' ids, slots and x come down once, their rows
go up once). Every routed expert's hidden activation has the same bits wherever it is made (the
portable SiLU, engine/ops.py silu_mul_), so the logits are bit-identical across expert-cache splits.
Its attention and RoPE read the position from fixed device addresses, so `token_step` captures a
session's step once as CUDA graphs (segments cut where the host computes misses) and replays it at
every later position. A prompt chunk's experts run in grouped launches (device_chunk.py): routed on
the device where the layer's experts are all resident, else on the host with the misses on the CPU. The host-driven tier (engine/tier/backend.py) is the other choice: its blocks compute on the
host and only the products run on the device.

qwen4exp's hyper-connections, PLE and QSA compute here through the backend's hooks (the same f32
steps as the CPU's kernels); their states are device arrays. Its token step reads nothing of the
host's inside the step: PLE's rows are hashed and looked up by the host from the input token
before the step and staged to fixed addresses (`stage_ple`), its conv ring is indexed at the
device position (`ple_conv_step`), and each QSA layer writes its keys, pools its block, scores,
takes torch.topk's set and attends there (`qsa_token`); so it is captured and replayed as
qwen35moe's is. It runs ahead where the plan placed the PLE table on the device (`DevicePLE`): the
step then ends with dev_ple_rows, which hashes the pick and gathers the next step's rows there;
elsewhere the host hashes the input token (`needs_token`) and the run-ahead cannot take it.
"""

from __future__ import annotations

import os
import time
import weakref
from pathlib import Path

import numpy as np

from ..backend import CpuBackend, Scratch
from ..batch import keep, seqs_of
from ..kernels import gpu
from ..kernels.actq import NonFiniteActivation
from ..kernels.engine_form import placed_bytes
from ..kvcache import KV_BLOCK, KVCache, check_kv
from ..moe import route_topk
from ..ops import L2NORM_EPS
from ..ple import PLEState
from ..qsa import QSACache
from ..weights import Input, Weight
from .device_chunk import DeviceChunk

F32 = np.float32
KERNELS = Path(__file__).with_name("device_kernels.cu")
CONV_T = 16  # device_kernels.cu: the tokens a thread of dev_conv takes
DELTA_R = 4  # device_kernels.cu: value rows of one head a warp of dev_delta carries
_NAMES = ["dev_rmsnorm", "dev_delta", "dev_conv", "dev_combine", "dev_sigmoid", "dev_gate", "dev_softplus", "dev_rope",
          "dev_hidden", "dev_route", "dev_combine_slots", "dev_combine_shared", "dev_kv_write", "dev_attn_one", "dev_argmax",
          "dev_argmax_rows",
          "dev_gdn_gates", "dev_l2_qk", "dev_shared_add", "dev_attn_split", "dev_attn_merge", "dev_mix_tail", "dev_inject", "dev_ple_output",
          "dev_sample", "dev_route_rows", "dev_group", "dev_rmsnorm_q", "dev_hidden_q",
          "dev_gate_q", "dev_gates_conv", "dev_add_rmsnorm_q", "dev_embd_row", "dev_ple_conv", "dev_qsa_key",
          "dev_qsa_scores", "dev_qsa_select", "dev_attn_sel", "dev_attn_split_sel", "dev_attn_merge_sel",
          "dev_hc_gates_q", "dev_rope_at", "dev_pick_next", "dev_ple_rows", "dev_embd_rows", "dev_ple_gather",
          "dev_ple_conv_rows", "dev_qsa_scores_rows", "dev_qsa_select_rows", "dev_widen", "dev_route_n", "dev_combine_n",
          "dev_conv_rows", "dev_l2_qk_rows", "dev_kv_write_rows", "dev_attn_split_rows", "dev_attn_merge_rows",
          "dev_top_prob", "dev_spec_judge", "dev_spec_restore"]
# the embedding's GGML types dev_embd_row decodes (F32 F16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K BF16)
EMBD_ROW_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30})
# the PLE table's types dev_ple_rows decodes: those and IQ4_NL (budget.PLE_TABLE_DEVICE_TYPES, the same)
PLE_ROW_TYPES = EMBD_ROW_TYPES | {20}
KV_KIND = {"f32": 0, "f16": 1, "int8": 2}  # dev_kv_write's and dev_attn_one's `kind`
BLOCK = 128  # threads per block of the row kernels: four warps
DEVICE_ATTN_TILE_BYTES = 1 << 30  # a prompt chunk's attention scores at most, f32 (DeviceBackend.attention)
ATTN_SPLIT_KEYS, ATTN_SPLITS = 16, 128  # one token's attention: the fewest keys a warp's split takes, the most splits a head
# dev_argmax / dev_pick_next: at most PICK_GRID blocks of PICK_BLOCK threads, at least 4 logits a
# thread (248320 logits: 128 blocks). One block of 1024 threads took ~0.15 ms on the H200; its
# rounds of loads ran one after another on one SM. STRATA_PICK_GRID=1 times the one-block form.
PICK_BLOCK = 256
PICK_GRID = max(1, int(os.environ.get("STRATA_PICK_GRID", "128")))
# a prompt chunk past QSA's budget selects on the device (qsa_select_rows); STRATA_QSA_ROWS=0 keeps the
# host's selection query by query, to time the two
QSA_ROWS = os.environ.get("STRATA_QSA_ROWS", "1") != "0"


VERIFY_SESSIONS = 4  # sessions whose captured verify graphs DeviceBackend.verify_step keeps
COPY_GRAPHS = 64  # rollbacks' captured copies DeviceBackend.copy_arrays keeps (a session's: one a snapshot)
# Whether a verify (speculative decoding) may be captured and replayed as CUDA graphs (verify_step):
# on since tests/gpu/test_device_spec.py passed with it on a card (2026-12-05, an H100: --spec 1 and 2
# with the oracle, the wrong and the MTP drafter give --spec 0's tokens and every state bit for bit,
# graphs on and off; the device head's draft steps too). The host emulation captures nothing: only
# the card shows a replay that read a value its capture fixed. STRATA_VERIFY_GRAPHS=0 turns it off.
VERIFY_GRAPHS = os.environ.get("STRATA_VERIFY_GRAPHS", "1") not in ("", "0")


class ByIdentity:
    """Values kept by the identities of a list of objects: a replayed forward passes the same ones
    (its entries, states, snapshots' arrays), so what was worked out for them the first time (a
    plan, device addresses, a captured graph) serves again. A hit only where each object IS the
    one the value was made for: the objects are kept and compared, as an id is reused once its
    object is gone. At most `most` values (None: no bound), all dropped when full."""

    def __init__(self, most: int | None = None):
        self.most = most
        self._got: dict = {}

    def __len__(self) -> int:
        return len(self._got)

    def get(self, objs: list):
        got = self._got.get(tuple(map(id, objs)))
        if got is None or len(got[0]) != len(objs) or any(a is not b for a, b in zip(got[0], objs)):
            return None
        return got[1]

    def put(self, objs: list, value):
        if self.most is not None and len(self._got) >= self.most:
            self._got.clear()
        self._got[tuple(map(id, objs))] = (list(objs), value)
        return value


def split_geometry(most: int) -> tuple[int, int]:
    """dev_attn_split's (L, S) for at most `most` keys: a head's n keys in min(S, ceil(n / L))
    splits, L = ATTN_SPLIT_KEYS the fewest keys a split takes (a warp scores 4 at a time), S
    splits at most -> the parts [H, S, D + 2]. The splits follow n, read on the device, so the same
    graph serves every position and the result depends on n alone, not on the context's size."""
    return ATTN_SPLIT_KEYS, max(1, min(ATTN_SPLITS, -(-most // ATTN_SPLIT_KEYS)))


class DeviceScratch(Scratch):
    """Scratch (engine/backend.py) in device memory."""

    def __init__(self, xp):
        super().__init__()
        self.xp = xp

    def __call__(self, key: str, shape: tuple[int, ...], dtype=F32):
        if not shape or shape[0] != 1:
            return self.xp.empty(shape, dtype)
        k = (key, shape, np.dtype(dtype).str)
        buf = self._bufs.get(k)
        if buf is None:
            buf = self._bufs[k] = self.xp.empty(shape, dtype)
        return buf


class DeviceKVCache(KVCache):
    """engine/kvcache.py's cache with its arrays on the device: the same kinds, layout and bytes
    (strata-budget counts them on the device when the device step runs). int8 uses the same rule,
    d = amax / 127 per 32 elements, q = rint(x / d) half to even, q = 0 where d = 0."""

    def __init__(self, be, kind: str, max_context: int, n_head_kv: int, head_dim: int):
        check_kv(kind, head_dim)
        self.xp = be.xp
        self.kind, self.max_context, self.n_head_kv, self.head_dim = kind, max_context, n_head_kv, head_dim
        shape = (n_head_kv, max_context, head_dim)
        store = {"f32": np.float32, "f16": np.float16, "int8": np.int8}[kind]
        self.k = be.zeros(shape, store)
        self.v = be.zeros(shape, store)
        if kind == "int8":
            self.k_scale = be.zeros((n_head_kv, max_context, head_dim // KV_BLOCK), F32)
            self.v_scale = be.zeros((n_head_kv, max_context, head_dim // KV_BLOCK), F32)

    def write(self, pos: int, k, v) -> None:
        T = k.shape[0]
        if pos + T > self.max_context:
            raise ValueError(f"KV cache: positions {pos}..{pos + T - 1} past its {self.max_context} tokens (--ctx-size)")
        xp = self.xp
        for x, store, scale in ((k, self.k, "k_scale"), (v, self.v, "v_scale")):
            x = x.transpose(1, 0, 2)  # [Hkv, T, D]
            if self.kind == "int8":
                b = x.reshape(*x.shape[:-1], -1, KV_BLOCK)
                d = xp.abs(b).max(axis=-1) / F32(127)
                safe = xp.where(d > 0, d, F32(1))
                q = xp.where(d[..., None] > 0, xp.rint(b / safe[..., None]), F32(0))
                store[:, pos : pos + T] = q.reshape(x.shape).astype(np.int8)
                getattr(self, scale)[:, pos : pos + T] = d
            else:
                store[:, pos : pos + T] = x

    def read(self, index):
        if isinstance(index, np.ndarray) and self.xp is not np:  # QSA's selection, made on the host
            index = self.xp.asarray(index)
        if self.kind == "int8":
            def deq(q, d):
                return (q.reshape(*q.shape[:-1], -1, KV_BLOCK).astype(F32) * d[..., None]).reshape(q.shape)
            return deq(self.k[:, index], self.k_scale[:, index]), deq(self.v[:, index], self.v_scale[:, index])
        return self.k[:, index].astype(F32, copy=False), self.v[:, index].astype(F32, copy=False)


class DeviceQSACache(QSACache):
    """engine/qsa.py's QSACache with its stores on the device: the KV cache (DeviceKVCache), the raw
    indexer keys, the pooled block keys and the block scores, the bytes strata-budget plans; the
    top-k's index scratch stays on the host, where a prompt chunk's selection is made
    (DeviceBackend.topk_set; a token step selects on the device, DeviceBackend.qsa_token)."""

    def __init__(self, be, g, max_ctx: int, kv: str = "f32"):
        super().__init__(1, n_head_kv=g.n_head_kv, head_dim=g.head_dim, idx_head_dim=g.idx_head_dim,
                         compress_ratio=1, kv="f32")  # (the host stores of one token, replaced below)
        nb = max_ctx // g.idx_compress_ratio
        self.max_ctx, self.ratio = max_ctx, g.idx_compress_ratio
        self.kv = DeviceKVCache(be, kv, max_ctx, g.n_head_kv, g.head_dim)
        self.idx_keys = be.zeros((max_ctx, g.idx_head_dim))
        self.idx_blocks = be.zeros((nb, g.idx_head_dim))
        self._vbuf = be.zeros((nb,))
        self._ibuf = np.zeros(nb, np.int64)


class DevicePLEState(PLEState):
    """engine/ple.py's PLEState with its conv ring on the device (the budget's session.ple_state);
    the token window, which the host hashes, stays on the host."""

    def __init__(self, be, g):
        super().__init__(ngram_size=g.ple_ngram_size, eos_token_id=g.ple_eos_token_id, conv_kernel=1, channels=1)
        self.ring = be.zeros(((g.ple_conv_kernel - 1) * g.ple_ngram_size, g.hc * g.n_embd))


class DevicePLE:
    """The PLE table on the device (the plan's weights.ple_table, placed only where it takes memory no
    expert slot would: budget.py `ple_on_device`) and what dev_ple_rows hashes the run-ahead's next
    token with: every PLE layer's NGramHash constants, the token window (the host's PLEState.window,
    staged at a run's first step, then advanced by the kernel), and the rows every PLE layer's token
    step reads, [nl, Pe] (`stage_ple` stages the host's rows into the same buffers, so one captured
    step serves both). `carve(shape, dtype)`: a device array (the weights arena's, in the layout
    budget.py `ple_table_device_bytes` counts; or rt.empty).

    nl = PLE layers, N = ngram size, Pn = heads, Pd = row dim, Pe = Pn Pd."""

    def __init__(self, hashes: list, layers: list[int], table, type_id: int, row_dim: int, n_rows: int, carve, copy_in):
        h0 = hashes[0]
        N, Pn, nl = h0.ngram_size, h0.n_heads, len(hashes)
        if type_id not in PLE_ROW_TYPES:
            raise ValueError(f"PLE table type {type_id}: dev_ple_rows decodes {sorted(PLE_ROW_TYPES)}")
        if any((h.ngram_size, h.n_heads, h.heads_per_ngram, h.eos) != (N, Pn, h0.heads_per_ngram, h0.eos) for h in hashes):
            raise ValueError("PLE layers with different n-gram geometries: dev_ple_rows takes one")
        from strata.index_format.ggml_types import ggml_type

        self.layers, self.N, self.Pn, self.Pd, self.eos = list(layers), N, Pn, row_dim, h0.eos
        self.hpn = h0.heads_per_ngram
        self.table, self.type_id, self.n_rows = table, type_id, n_rows
        self.row_bytes = ggml_type(type_id).row_bytes(row_dim)
        arrays = {"mult": np.stack([h.mult for h in hashes]), "off": np.stack([h.offsets for h in hashes]),
                  "size": np.stack([h.sizes for h in hashes])}
        for name, host in arrays.items():
            dev = carve(host.shape, np.int64)
            copy_in(dev, np.ascontiguousarray(host, np.int64))
            setattr(self, name, dev)
        self.window = carve((max(N - 1, 1),), np.int64)
        self.rows = carve((nl, 1, Pn * row_dim), np.float32)
        # each layer's view made once: `_stage` keeps a pinned mirror per device array object, so a
        # new view per token would make a pinned buffer per token
        self._rows_of = {l: self.rows[k] for k, l in enumerate(self.layers)}
        self.ids = carve((nl, Pn), np.int64)

    def rows_of(self, layer: int):
        """The layer's rows buffer [1, Pe] (a fixed address the token step reads)."""
        return self._rows_of[layer]

    def launch(self, be, tok) -> None:
        """dev_ple_rows: the rows of the token at tok[0] into `rows`, the window advanced."""
        nl = len(self.layers)
        be.rt.launch(be._mod, "dev_ple_rows", 1, BLOCK * 2, (tok, self.window, np.int32(self.N), np.int64(self.eos), self.mult,
                                                             self.off, self.size, np.int32(nl), np.int32(self.Pn),
                                                             np.int32(self.hpn), self.table, np.int64(self.row_bytes),
                                                             np.int64(self.n_rows), np.int32(self.type_id), np.int32(self.Pd),
                                                             self.rows, self.ids), smem=8 * (self.N + nl * self.Pn))


class DeviceExperts:
    """The MoE's expert server for the device step.

    One token (`token`): the whole routed part on the device. The router's top-k (dev_route: the
    float64 softmax, ties to the lower id), the slot of each chosen expert from the slot table kept
    on the device, gate and up of every resident expert in one launch and their downs in another
    (mvx: each product the matvec's bits on that expert's slot), h = up silu(gate) (the portable
    SiLU of engine/ops.py, which a CPU miss uses too) and its ActQ in one launch (dev_hidden_q), then
    the combine in rank order. A layer whose experts are all resident needs nothing from the host. Otherwise the chosen
    ids, their slots and x come down in one synchronisation, the misses run on the CPU in one
    grouped call (MoE.products) while the device computes the hits, and the misses' rows go up in
    one copy. Each routed row is made with the same bits wherever its expert sits, so the logits are
    bit-identical across --expert-cache sizes. The routing counts (--stats) are the chosen ids,
    brought down once per forward (`settle`).

    A prompt chunk (`tokens`): a layer whose experts are all resident wholly on the device, routing
    included, and so is a layer whose other experts are streamed whole for the chunk
    (staging.LayerStream); otherwise (`routed`) routed on the host, its experts in grouped launches on the device,
    the misses on the CPU beside them (engine/tier/device_chunk.py); where neither applies, the
    tier's hit path (engine/tier/hits.py)."""

    def __init__(self, rt, hits, be):
        self.rt, self.hits, self.be = rt, hits, be
        self.quantize = be._quantize
        self._buf = None  # the token path's device buffers, made on first use (`_buffers`)
        self._table_map, self._table_rows = None, None  # the slot map the device table was uploaded from
        # per token() call (layer, the routing counts it owes, hits, misses, static): the counts are
        # settled after the forward; a captured step's static entries are applied again at each replay
        self._log: list[tuple[int, tuple, int, int, bool]] = []
        self._queued = False  # the ids' copy to the host is queued (queue_settle)
        # a prompt chunk's routed experts in grouped launches; None: the hit path's host-driven chunk
        self.chunk = DeviceChunk(rt, hits, be)
        # per `tokens` call: (layer, Seqs, device ids [T, k], which experts were streamed whole or None)
        self._chunk_log: list[tuple[int, list, object, np.ndarray | None]] = []
        # a verify's rows (`rows`): each row routes into its own line of `_ids_rows` [rows, n_layer, k],
        # so nothing waits mid-forward; (layer, row, Seq) in the order the rows ran, settled after the
        # forward (each row's counts added, then its snapshot's copy made: `settle`)
        self._rows_log: list[tuple[int, int, object]] = []
        self._ids_rows = None
        self._rows_queued = False
        self._rows_host = None  # `_ids_rows`' pinned mirror, its copy queued before a verify's wait (queue_rows_settle)
        self._rows_plans = ByIdentity(16)  # `_rows_plan`'s, by a captured verify's entries
        self._routing_plans = ByIdentity(16)  # `_routing_plan`'s, by a captured step's states

    def routed(self, moe, x: Input, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray):
        if self.chunk is not None and self.chunk.fits(moe, rows.size):  # grouped launches (device_chunk.py)
            return self.chunk.routed(moe, x, experts, rows, starts)
        runs = self._runs(moe, starts, experts.size) if self.chunk is not None else None
        if runs:
            # a chunk longer than the prompt buffers were planned for (a 4096-token forward beside
            # 256-token buffers): its experts in runs whose pairs the buffers hold, each run's rows
            # in grouped launches. Before, the whole chunk went to the host path, which found no
            # room either and computed every expert on the CPU (seed-4l qwen35moe, 4096 tokens, all
            # resident, H200 2026-12-02: 1532.7 tok/s where 12914.5 with buffers for the chunk).
            # A row's bits do not depend on the run it is in (each expert's product is its own).
            out = self.be.scratch("moe.routed_runs", (rows.size, moe.E))
            for a, b in runs:
                sa, sb = int(starts[a]), int(starts[b])
                out[sa:sb] = self.chunk.routed(moe, x, experts[a:b], rows[sa:sb], starts[a : b + 1] - sa)
            return out
        host = Input(self.rt.to_host(x.x))  # its ActQ, made on the host, has the device quantizer's bits
        return self.rt.to_device(self.hits.routed(moe, host, experts, rows, starts))

    def _runs(self, moe, starts: np.ndarray, n: int) -> list[tuple[int, int]] | None:
        """The experts 0..n of a chunk (their pairs starts[e]..starts[e + 1]) cut into runs [a, b) whose
        pairs the prompt buffers hold, greedily in order; None where one expert's pairs alone do not fit."""
        runs, a = [], 0
        while a < n:
            b = a
            while b < n and self.chunk.fits(moe, int(starts[b + 1] - starts[a])):
                b += 1
            if b == a:
                return None
            runs.append((a, b))
            a = b
        return runs

    # --- one token on the device

    def _buffers(self, moe):
        rt, k, E, F, X = self.rt, moe.k, moe.E, moe.F, moe.router.n_out
        n_layer = self.hits.slots.n_layer
        b = self._buf
        if b is None or b["shape"] != (k, E, F, X):
            # every layer's chosen experts (the counts, at `settle`), then the run-ahead's pick behind
            # them (dev_pick_next writes it there: `pick_slot`), so one copy brings both down
            idsp = rt.empty((n_layer * k + 3,), np.int32)
            b = self._buf = {
                "shape": (k, E, F, X),
                "idsp": idsp,
                "ids": idsp[: n_layer * k].reshape(n_layer, k),
                "pick": idsp[n_layer * k :],
                "w": rt.empty((1, k), F32),
                "slot": rt.empty((k,), np.int32),
                "gu": rt.empty((2 * k, F), F32),
                "h": rt.empty((k, F), F32),
                "hq": gpu.empty_act((k, F)),
                "rows": rt.empty((k, E), F32),
                "miss": rt.empty((k, E), F32),
                "out": rt.empty((1, E), F32),
                "table": rt.empty((n_layer, X), np.int32),
                "stable": rt.empty((X,), np.int32),  # a layer streamed whole: its table (`tokens`)
            }
            # what a layer that can miss exchanges with the host: pinned, so the copies are
            # asynchronous and a CUDA graph can replay them
            pin = rt.pinned(4 * (2 * k + E + k * E))
            b["ids_host"], b["slot_host"] = pin[: 4 * k].view(np.int32), pin[4 * k : 8 * k].view(np.int32)
            b["x_host"] = pin[8 * k : 8 * k + 4 * E].view(F32).reshape(1, E)
            b["miss_pinned"] = pin[8 * k + 4 * E :].view(F32).reshape(k, E)
        return b

    def _table(self, b, layer: int):
        """The layer's row of the slot table on the device, uploaded again whenever the host's map
        changed (a compulsory miss admitted an expert; after the fill the map is frozen)."""
        m = self.hits.slots.map
        if self._table_map is not m:
            self.rt.copy_in(b["table"], np.ascontiguousarray(m.table, np.int32))
            self._table_map, self._table_rows = m, m.table.copy()
        elif not m.frozen and not np.array_equal(self._table_rows[layer], m.table[layer]):
            self.rt.copy_in(b["table"][layer], np.ascontiguousarray(m.table[layer], np.int32))
            self._table_rows[layer] = m.table[layer]
        return b["table"][layer]

    # MoE.forward makes a token's router logits and shared expert output before `token` (the combine
    # adds the shared output in its launch)
    adds_shared = True

    def token(self, moe, x: Input, counts, logits=None, shared=None, row: int | None = None) -> object | None:
        """MoE.forward's routed sum for one token on the device -> device f32 [1, E], or None where
        this path does not apply (expert weights of a float type, rows longer than mv takes, more
        than 1024 experts: dev_route's block, a thread a logit): the MoE then routes on the host.
        logits: the router's product of x where the caller made it; shared: the shared expert's
        (y [1, E], gate logit [1, 1]) added to the sum (BaseBackend.shared_add_'s out += y sigmoid(s),
        y scaled in place), the routed sum and the add in one launch. `row`: row `row` of a verify
        (`rows`): its chosen ids go to its own line of `_ids_rows` and its counts are added after the
        forward, in row order, each row's snapshot copied then (`settle`). Before, a verify row
        settled its counts at once: a wait per row and layer, which no graph can hold."""
        seqs = seqs_of(counts, 1) if counts is not None else []
        if not self.fits(moe):
            return None
        be, rt, slots, layer = self.be, self.rt, self.hits.slots, moe.layer
        k, E, F = moe.k, moe.E, moe.F
        b = self._buffers(moe)
        table = self._table(b, layer)
        if logits is None:
            logits = be.linear(moe.router, x, be.scratch("moe.router", (1, moe.router.n_out)))
        ids = b["ids"][layer] if row is None else self._ids_rows[row, layer]
        self.route(logits, k, table, ids, b["w"], b["slot"])
        states = tuple(r.state for r in seqs) if row is None else ()
        if row is not None:
            self._rows_log += [(layer, row, r) for r in seqs]
        complete = bool((self._table_rows[layer] >= 0).all())
        if complete:
            self._count(layer, states, k, 0, static=True)
        else:  # which chosen experts miss: their ids, slots and x come down (pinned, asynchronous)
            rt.copy_out_async(b["ids_host"], ids)
            rt.copy_out_async(b["slot_host"], b["slot"])
            rt.copy_out_async(b["x_host"], x.x)
        held = bool((self._table_rows[layer] >= 0).any())
        if not complete:
            # the host waits for them (a cut of a captured step: no event is recorded inside a
            # graph, where the host could not wait for it), then, with any expert held, the hits
            # are queued before the CPU computes the misses, so the two run together
            be.at_host(rt.synchronize if held else lambda: (rt.synchronize(), self._misses(moe, states)))
        if held:
            # the hits, queued (a rank whose slot is -1 is skipped): they run while the CPU computes the misses
            arena, sb, gu_bytes = slots.arena, slots.slot_bytes, placed_bytes(moe.gu.id, E, F)
            act = x.form(moe.gu, False, quantize=self.quantize)
            xq = gpu.GpuActQ(act.q, act.d, act.s16, None)
            gpu.slot_products(moe.gu.id, E, F, arena, sb, 0, gu_bytes, b["slot"], k, 2 * k, xq, 0, b["gu"])
            if be.fuse_actq:  # h and its ActQ in one launch
                hq = b["hq"]
                be._launch("dev_hidden_q", k * F, (b["gu"], b["slot"], b["h"], hq.q, hq.d, hq.s16, np.int32(k), np.int32(F)))
            else:
                be._launch("dev_hidden", k * F, (b["gu"], b["slot"], b["h"], np.int32(k), np.int32(F)))
                gpu.quantize_act_gpu(b["h"], out=b["hq"], check=False)
            gpu.slot_products(moe.d.id, F, E, arena, sb, 2 * gu_bytes, 0, b["slot"], k, k, b["hq"], 1, b["rows"])
        if not complete:
            if held:
                be.at_host(lambda: self._misses(moe, states))
            rt.copy_in_async(b["miss"], b["miss_pinned"])
        y, g = shared if shared is not None else (None, None)
        if y is not None and be.fuse_many and y.shape == (1, E) and g.shape == (1, 1) and y.flags.c_contiguous:
            be._launch("dev_combine_shared", E, (b["rows"], b["miss"], b["slot"], b["w"], b["out"], np.int32(k), np.int32(E), y, g))
        else:
            be._launch("dev_combine_slots", E, (b["rows"], b["miss"], b["slot"], b["w"], b["out"], np.int32(k), np.int32(E)))
            if y is not None:
                be.shared_add_(b["out"], y, g)
        return b["out"]

    def fits(self, moe) -> bool:
        """Whether `token` takes this MoE's routed part (quantized experts, rows mv takes, k <= 32, at
        most 1024 experts)."""
        return moe.gu.quantized and moe.d.quantized and moe.k <= 32 and moe.router.n_out <= 1024 and \
            gpu.slot_products_fit(moe.gu.id, moe.E, moe.F) and gpu.slot_products_fit(moe.d.id, moe.F, moe.E)

    def rows(self, moe, x: Input, seqs: list, logits=None, shared=None) -> object | None:
        """MoE.forward's routed sum for T one-token sequences (a verify's rows) -> device f32 [T, E]:
        `token` row by row, so each row is routed, computed and combined on the device as a token
        step does it (its bits), with no round trip of the routing through the host; None where
        `token` does not apply. logits, shared: as `token` takes them, for the T rows ([T, X];
        y [T, E] and the gate logits [T, 1])."""
        if not self.fits(moe):
            return None
        T = x.x.shape[0]
        self.rows_ready(T, moe.k)
        b = self._buffers(moe)
        table = self._table(b, moe.layer)
        if bool((self._table_rows[moe.layer] >= 0).all()) and self.be.fuse_many:
            return self._rows_resident(moe, x, seqs, table, logits, shared)
        out = self.be.scratch("moe.rows", (T, moe.E))
        for i, r in enumerate(seqs):
            one = slice(i, i + 1)
            out[one] = self.token(moe, Input(x.x[one]), [r._replace(a=0, b=1)], None if logits is None else logits[one],
                                  None if shared is None else (shared[0][one], shared[1][one]), row=i)  # (token's buffer: copied)
        return out

    def _rows_resident(self, moe, x: Input, seqs: list, table, logits=None, shared=None):
        """`rows` in a layer whose experts are all resident: the T rows' launches of one token at once,
        each row's values the token path's (its bits): the router's product of the T rows (unless
        given), their routing (dev_route_n: a block a row, dev_route's rule), gate and up of all T k
        chosen experts in one mvx launch (row t's slots read x's row t), h and its ActQ in one, the
        downs in one, the combine of every row in one (dev_combine_n, with the shared experts' add
        where MoE.forward made them first). Row by row (`token` each) a verify of 3 rows made 3 x 8
        launches a layer where this makes 5 (6 with the router's)."""
        be, rt, slots, layer = self.be, self.rt, self.hits.slots, moe.layer
        k, E, F, X, T = moe.k, moe.E, moe.F, moe.router.n_out, x.x.shape[0]
        b = self._buf
        rb = b.get(("rows", T))
        if rb is None:  # fixed per row count (a captured verify keeps their addresses)
            rb = b[("rows", T)] = {"w": rt.empty((T, k), F32), "slot": rt.empty((T * k,), np.int32),
                                   "gu": rt.empty((2 * T * k, F), F32), "h": rt.empty((T * k, F), F32),
                                   "hq": gpu.empty_act((T * k, F)), "rows": rt.empty((T * k, E), F32)}
        if logits is None:
            logits = be.linear(moe.router, x, be.scratch("moe.rows_router", (T, X)))
        ids = self._ids_rows[0, layer]  # (row t's at t ids_stride from it)
        block = 32 * -(-X // 32)
        smem = 512 + 4 * block + 8 * (block // 32) * k  # (dev_route's)
        be._launch("dev_route_n", T * block, (logits, np.int32(X), np.int32(k), table, ids, np.int32(self._ids_rows.strides[0] // 4),
                                              rb["w"], rb["slot"]), block, smem)  # (a block a row)
        for i, r in enumerate(seqs):
            self._count(layer, (), k, 0, static=True)
            self._rows_log.append((layer, i, r))
        arena, sb, gu_bytes = slots.arena, slots.slot_bytes, placed_bytes(moe.gu.id, E, F)
        act = x.form(moe.gu, False, quantize=self.quantize)
        xq = gpu.GpuActQ(act.q, act.d, act.s16, None)
        gpu.slot_products(moe.gu.id, E, F, arena, sb, 0, gu_bytes, rb["slot"], T * k, 2 * T * k, xq, k, rb["gu"])
        if be.fuse_actq:
            hq = rb["hq"]
            be._launch("dev_hidden_q", T * k * F, (rb["gu"], rb["slot"], rb["h"], hq.q, hq.d, hq.s16, np.int32(T * k), np.int32(F)))
        else:
            be._launch("dev_hidden", T * k * F, (rb["gu"], rb["slot"], rb["h"], np.int32(T * k), np.int32(F)))
            gpu.quantize_act_gpu(rb["h"], out=rb["hq"], check=False)
        gpu.slot_products(moe.d.id, F, E, arena, sb, 2 * gu_bytes, 0, rb["slot"], T * k, T * k, rb["hq"], 1, rb["rows"])
        out = be.scratch("moe.rows", (T, E))
        y, g = (np.uint64(0),) * 2 if shared is None else shared  # (null: no shared expert's add)
        if shared is not None and not (y.shape == (T, E) and g.shape == (T, 1) and y.flags.c_contiguous and g.flags.c_contiguous):
            raise ValueError(f"DeviceExperts.rows: the shared expert's y {y.shape} and gate logits {g.shape} "
                             f"must be contiguous [{T}, {E}] and [{T}, 1]")
        be._launch("dev_combine_n", T * E, (rb["rows"], b["miss"], rb["slot"], rb["w"], out, np.int32(k), np.int32(E), np.int32(T), y, g))
        return out

    def rows_ready(self, T: int, k: int) -> None:
        """`_ids_rows` holding T rows of k ids a layer: made at a verify's first, eager, run (a captured
        one keeps its address), and again larger only for a forward of more rows than it holds (a
        graph made with the old one is then dropped: verify_step)."""
        got = self._ids_rows
        if got is None or got.shape[0] < T:
            self._ids_rows = self.rt.empty((max(T, 16), self.hits.slots.n_layer, k), np.int32)

    def tokens(self, moe, x: Input, counts) -> object | None:
        """MoE.forward's routed sum for a prompt chunk on the device (device_chunk.py `forward`: a
        layer whose experts are all resident routes, groups and combines there), or None: the
        MoE routes on the host and calls `routed`."""
        seqs = seqs_of(counts, x.x.shape[0]) if counts is not None else []
        if self.chunk is None or any(r.saved is not None for r in seqs) or moe.k > 32:
            return None
        b = self._buffers(moe)
        table = self._table(b, moe.layer)
        row, streamed = self._table_rows[moe.layer], None
        if (row >= 0).all():
            out = self.chunk.forward(moe, x, table)
        else:
            stream = self._stream_layer(moe, x.x.shape[0], row)
            if stream is None:
                return None
            buf, stage = stream
            table, streamed = b["stable"], row < 0
            self.rt.copy_in(table, np.where(streamed, -1 - np.arange(row.size), row).astype(np.int32))
            out = self._forward_streamed(moe, x, table, stage)
            self.hits.layers.done(buf)  # (the products reading the buffer are queued)
        if out is not None:
            self._chunk_log.append((moe.layer, seqs, out[1], streamed))
            return out[0]
        return None

    def _forward_streamed(self, moe, x: Input, table, stage):
        """DeviceChunk.forward over a layer streamed whole, in runs of tokens the prompt path's buffers
        hold where the chunk's pairs do not fit them (a 4096-token forward beside 256-token buffers):
        the layer is copied once for all of them."""
        T, chunk = x.x.shape[0], self.chunk
        n = T
        while not chunk.fits(moe, n * moe.k):
            n = -(-n // 2)
        if n == T:
            return chunk.forward(moe, x, table, stage)
        xp = self.be.xp
        out, ids = xp.empty((T, moe.E), F32), xp.empty((T, moe.k), np.int32)
        for a in range(0, T, n):
            b = min(T, a + n)
            y, i = chunk.forward(moe, Input(x.x[a:b]), table, stage)
            out[a:b], ids[a:b] = y, i
        return out, ids

    def _stream_layer(self, moe, T: int, row: np.ndarray):
        """A chunk of T tokens in a layer some of whose experts are not resident: (buffer, its device
        bytes) of the layer's non-resident experts streamed whole (staging.LayerStream), the next
        layer's copy queued behind it; or None: the layer stream is off or the chunk too short for it
        (MoE.forward then routes on the host: `routed`)."""
        ls = self.hits.layers
        if ls is None or not ls.takes(moe.layer, row, T) or not self.chunk.fits(moe, moe.k):
            return None
        ls.start(moe.layer, row)
        nxt = moe.layer + 1
        if nxt < self.hits.slots.n_layer:
            rows = self.hits.slots.map.table
            if ls.takes(nxt, rows[nxt], T):
                ls.start(nxt, rows[nxt])
        return ls.wait(moe.layer)

    def route(self, logits, k: int, table, ids, w, slot) -> None:
        """dev_route: one token's top-k of its router logits [1, X] (X <= 1024, k <= 32) -> ids [k],
        w [1, k], slot [k]. A thread a logit (the block rounded up to whole warps)."""
        X = logits.shape[-1]
        block = 32 * -(-X // 32)
        smem = 512 + 4 * block + 8 * (block // 32) * k  # red, pj (f64 [32] each), the logits, the candidates
        self.be._launch("dev_route", block, (logits, np.int32(X), np.int32(k), table, ids, w, slot), block, smem)

    def _misses(self, moe, states: tuple) -> None:
        """The host's part of a layer some of whose experts may miss, once the chosen ids, their slots
        and x are here (`token` queued their copies and waited): the misses on the CPU in one grouped
        call (MoE.products; the device computes the hits meanwhile) into the pinned rows the next
        launch copies up, a compulsory miss's expert admitted, the layer counted. A replay runs it."""
        b, layer, k = self._buf, moe.layer, moe.k
        miss = np.flatnonzero(b["slot_host"] < 0)
        if miss.size:
            t0 = time.perf_counter()
            ids = b["ids_host"][miss].astype(np.int64)
            b["miss_pinned"][miss] = moe.products(Input(b["x_host"].copy()), ids, np.zeros(miss.size, np.int64),
                                                  np.arange(miss.size + 1))
            for e in ids:  # a compulsory miss admits its expert for the next tokens (no graph is made then)
                self.hits.slots.lookup(layer, int(e))
            self.hits.stats.cpu_s += time.perf_counter() - t0
        self._count(layer, states, k - miss.size, miss.size, static=False)

    def _count(self, layer: int, states: tuple, hits: int, misses: int, static: bool) -> None:
        st = self.hits.stats
        st.hits[layer] += hits
        st.misses[layer] += misses
        self._log.append((layer, states, hits, misses, static))

    def queue_settle(self) -> None:
        """The chosen ids' copy to the host, queued before the step's last wait (token_step), so that
        `settle` reads them without a synchronisation of its own."""
        if not self._log:
            return
        b = self._buf
        if "ids_settle" not in b:
            b["ids_settle"] = self.rt.pinned(b["ids"].nbytes).view(np.int32).reshape(b["ids"].shape)
        self.rt.copy_out_async(b["ids_settle"], b["ids"])
        self._queued = True

    def queue_rows_settle(self) -> None:
        """A verify's rows' chosen ids copied to the host, queued before the forward's wait: `settle`
        then reads them without a copy and wait of its own (CuPy's get, ~46 us a verify of the
        host's time on an H200 beside a ~1.2 ms graph, 2026-12-06). Only where a wait follows."""
        if not self._rows_log:
            return
        if self._rows_host is None or self._rows_host.shape != self._ids_rows.shape:
            self._rows_host = self.rt.pinned(self._ids_rows.nbytes).view(np.int32).reshape(self._ids_rows.shape)
        self.rt.copy_out_async(self._rows_host, self._ids_rows)
        self._rows_queued = True

    def detach(self) -> tuple:
        """The run-ahead: the routing this step owes, kept aside (its log and the pinned copy of its
        chosen ids) while the next step is queued, which copies its ids into the other pinned buffer
        (`settle_detached` counts it once the step's pick is read, `forget` drops it)."""
        log, self._log = self._log, []
        if not self._queued:
            return log, None
        b, self._queued = self._buf, False
        ids = b["ids_settle"]
        if "ids_settle_2" not in b:
            b["ids_settle_2"] = self.rt.pinned(ids.nbytes).view(np.int32).reshape(ids.shape)
        b["ids_settle"], b["ids_settle_2"] = b["ids_settle_2"], ids
        return log, ids

    def pick_slot(self):
        """Where a run-ahead step's pick goes so that it comes down with the routing ids in one copy
        (`queue_with_pick`): the 3 ints behind the ids on the device; None before the first token."""
        return None if self._buf is None else self._buf["pick"]

    def queue_with_pick(self, host) -> tuple:
        """The run-ahead's one copy down: the chosen ids and the pick behind them into `host` (pinned
        int32 [ids + 3]), queued in place of `queue_settle`'s -> `detach`'s (log, ids), the ids a
        view of `host`, and the pick's view [3]."""
        b = self._buf
        self.rt.copy_out_async(host, b["idsp"])
        n = b["ids"].size
        log, self._log = self._log, []
        return (log, host[:n].reshape(b["ids"].shape)), host[n:]

    def settle_rows_kept(self, log: list, rows: list, ids, k: int) -> None:
        """A verify run ahead (engine/tier/verify_ahead.py), read: the routing counts of its rows 0..k
        (the rows kept), from its rows' chosen ids `ids` as they came down beside its record; `log`,
        `rows`: its entries, taken aside when it was queued (its hits were counted then). The same
        counts as `settle` then the rollback's copy of the snapshot after row k give."""
        if rows:
            self._count_rows(rows, ids, k)

    def _count_rows(self, log: list, ids, upto: int | None = None) -> None:
        """A verify's rows' routing counts from their chosen ids (`_rows_log` entries, in row order):
        every row, each row's snapshot then keeping the counts after it (`settle`); or with `upto`
        rows 0..upto only, no snapshot written (`settle_rows_kept`)."""
        plan = self._rows_plan(log)
        if plan is None:
            for layer, row, r in log:
                if upto is None or row <= upto:
                    r.state[ids[row, layer]] += 1  # (a row's k ids are distinct)
                    if upto is None:
                        keep(r)
            return
        for row, counts, layers, saved in plan:
            if upto is None or row <= upto:
                counts[layers[:, None], ids[row, layers]] += 1
                if saved is not None and upto is None:
                    saved[layers] = counts[layers]

    def settle_detached(self, owed: tuple) -> None:
        log, ids = owed
        if log:
            self._add_routing(log, ids if ids is not None else self.rt.to_host(self._buf["ids"]))

    def forget(self, owed: tuple) -> None:
        st = self.hits.stats
        for layer, _, hits, misses, _ in owed[0]:
            st.hits[layer] -= hits
            st.misses[layer] -= misses

    def settle(self) -> None:
        """After a forward: the routing counts its tokens owe (--stats, strata-profile), from the
        chosen ids of every layer, brought down in one copy (queued by `queue_settle` before the
        step's wait, or made now); a prompt chunk's routed on the device (`tokens`), each layer's
        ids brought down now (after the forward: its first copy waits for the forward, the rest
        do not wait), also counted as the chunk's resident expert-chunks (--stats)."""
        st = self.hits.stats
        for layer, seqs, ids_dev, streamed in self._chunk_log:
            ids = self.rt.to_host(ids_dev).astype(np.int64)
            used = np.unique(ids)
            n_str = 0 if streamed is None else int(streamed[used].sum())
            st.chunk_resident[layer] += used.size - n_str
            st.chunk_streamed[layer] += n_str
            if streamed is not None and not self.hits.slots.map.frozen:
                for e in used[streamed[used]]:  # without a profile the first routes fill free slots, as
                    self.hits.slots.lookup(layer, int(e))  # `routed` does (compulsory misses)
            for r in seqs:
                r.state[...] += np.bincount(ids[r.a : r.b].reshape(-1), minlength=r.state.size)
                keep(r)
        self._chunk_log.clear()
        if self._rows_log:
            # a verify's rows, in the order they ran: each row's counts, then its snapshot's copy
            ids_rows = self._rows_host if self._rows_queued else self.rt.to_host(self._ids_rows)
            self._rows_queued = False
            self._count_rows(self._rows_log, ids_rows)
            self._rows_log.clear()
        if not any(states for _, states, *_ in self._log):  # (a verify row's entries count its hits only)
            self._log.clear()
            self._queued = False
            return
        ids = self._buf["ids_settle"] if self._queued else self.rt.to_host(self._buf["ids"])
        self._queued = False
        self._add_routing(self._log, ids)
        self._log.clear()

    @staticmethod
    def _row_of(a, layer: int):
        """The [n_layer, n_expert] array whose row `layer` the counts `a` are (Model's `s.routing[l]`,
        a snapshot's alike), or None where they are not such a row."""
        b = a.base if isinstance(a, np.ndarray) else None
        if not (isinstance(b, np.ndarray) and b.ndim == 2 and a.ndim == 1 and 0 <= layer < b.shape[0]
                and a.shape[0] == b.shape[1] and a.strides == b.strides[1:] and a.dtype == b.dtype
                and a.__array_interface__["data"][0] == b.__array_interface__["data"][0] + layer * b.strides[0]):
            return None
        return b

    def _rows_plan(self, log: list) -> list | None:
        """`settle`'s rows as one update a row: [(row, the session's routing counts [n_layer, n_expert],
        the layers' indices, the row's snapshot's counts or None)] in row order, where every entry's
        counts are row `layer` of one such array (Model's `s.routing[l]`, the snapshot's alike); None
        where they are not (`settle` then goes entry by entry). Entry by entry a verify of 3 rows
        settled in ~220 us of the host's time on an H100 (demo qwen35moe, 8 layers, cProfile;
        2026-12-05), beside a 0.86 ms graph. Kept by the entries' identities: a replayed verify logs
        the same entries each time."""
        entries = [r for _, _, r in log]
        got = self._rows_plans.get(entries)
        if got is not None:
            return got
        plan, rows = [], {}
        for layer, row, r in log:
            rows.setdefault(row, []).append((layer, r))

        base = self._row_of
        for row in sorted(rows):
            got_rows = rows[row]
            layers = np.array([l for l, _ in got_rows], np.intp)
            counts = [base(r.state, l) for l, r in got_rows]
            saved = [None if r.saved is None else base(r.saved, l) for l, r in got_rows]
            if np.unique(layers).size != layers.size or counts[0] is None or any(c is not counts[0] for c in counts):
                return None
            if saved[0] is None and any(r.saved is not None for _, r in got_rows):
                return None
            if saved[0] is not None and any(x is not saved[0] for x in saved):
                return None
            plan.append((row, counts[0], layers, saved[0]))
        return self._rows_plans.put(entries, plan)

    def _add_routing(self, log: list, ids) -> None:
        plan = self._routing_plan(log)
        if plan is not None:  # one add for each session's layers (a replayed step logs the same entries)
            for counts, layers in plan:
                counts[layers[:, None], ids[layers]] += 1
            return
        for layer, states, *_ in log:
            chosen = ids[layer]  # a token's top-k: distinct ids, so a fancy-indexed add counts each once
            for state in states:
                state[chosen] += 1  # (np.add.at, for repeated ids, took ~10 us a layer a token)

    def _routing_plan(self, log: list) -> list | None:
        """`_add_routing`'s adds grouped: [(a session's routing counts [n_layer, n_expert], the layers'
        indices)], where every state is row `layer` of such an array and no (array, layer) comes twice;
        else None. Layer by layer the token step's adds took ~74 us of the host's time on an H100
        (demo qwen35moe, 8 layers, cProfile; 2026-12-05). Kept by the states' identities."""
        entries = [states for _, states, *_ in log]
        got = self._routing_plans.get(entries)
        if got is not None:
            return got
        groups: dict = {}
        for layer, states, *_ in log:
            for state in states:
                b = self._row_of(state, layer)
                if b is None:
                    return None
                g = groups.setdefault(id(b), (b, []))
                if layer in g[1]:
                    return None
                g[1].append(layer)
        return self._routing_plans.put(entries, [(b, np.array(layers, np.intp)) for b, layers in groups.values()])

    # --- what DeviceBackend.token_step needs to capture a step and replay it

    def static(self) -> bool:
        """No token can change the slot map (it is frozen after the fill, or full): the same launches
        serve every token, so a token step can be captured and replayed (hits and misses included:
        a layer that can miss is a cut, its host part replayed between the graph's segments)."""
        m = self.hits.slots.map
        return m.frozen or m.used == m.slots

    def all_resident(self) -> bool:
        """Every layer's every expert in a slot: a verify's rows route, compute and combine on the
        device with no host part (`_rows_resident`)."""
        return bool((self.hits.slots.map.table >= 0).all())

    def mark(self) -> int:
        return len(self._log)

    def log_since(self, mark: int) -> list:
        """The entries a replay repeats as they are: the layers that cannot miss (a layer that can
        counts itself in `_misses`, which the replay runs)."""
        return [e for e in self._log[mark:] if e[4]]

    def rows_mark(self) -> int:
        return len(self._rows_log)

    def rows_since(self, mark: int) -> list:
        """A captured verify's row entries from `mark` (len of the rows' log when it began), which
        each replay of it adds again (`replayed`: the rows' counts are settled after it)."""
        return list(self._rows_log[mark:])

    def replayed(self, log: list, rows: list = ()) -> None:
        """A captured step ran again: its entries count again (hits, and the routing at `settle`)."""
        st = self.hits.stats
        for layer, _, hits, misses, _ in log:
            st.hits[layer] += hits
            st.misses[layer] += misses
        self._log.extend(log)
        self._rows_log.extend(rows)


class DeviceBackend(CpuBackend):
    """The forward on the device (module docstring): the products on the weights the tier placed
    (their GpuWeight on Weight.device); `hits`: the tier's hit path (engine/tier/hits.py), which
    DeviceExperts serves the MoE through."""

    name = "gpu"
    rows_attend_one = True  # dev_attn_split's order is not `attention`'s: a verify row takes the token step's

    def __init__(self, rt, hits, mod=None):
        self.rt, self.xp = rt, rt.xp
        self.scratch = DeviceScratch(self.xp)
        self._params: dict[int, tuple] = {}  # id(host array) -> (host array, its device copy)
        self._heads: dict[tuple[int, int], object] = {}
        # the fused row operations (device_kernels.cu); `mod`: compiled already (a `companion`'s)
        self._mod = mod if mod is not None else rt.compile(_NAMES, source=KERNELS)
        self.experts = DeviceExperts(rt, hits, self)
        self._rope_key, self._rope_cs = None, None  # the last positions' cos and sin (rope_, T > 1)
        self._gemm_slab = None  # the f16 weight slab of the prompt's dense products through cuBLAS (`_gemm`)
        # the decode step's position lives at a fixed device address, written before a step only when
        # the device does not hold it already (`_at`; a run-ahead step advances it itself): every
        # kernel that depends on it reads it there (the KV write, attention, the ropes' table rows,
        # QSA, PLE's ring); so one token step's launches serve every position (token_step's graph)
        self._pos = None  # made at the first step (the startup's memory marks count what the budget plans)
        self._pos_at = None
        self._next_pos = None  # a picked step's next position, staged while the device runs it (`_ahead`)
        # every rope's cos and sin at every position of the context, on the device (the budget's
        # weights.rope), read at the device position by dev_rope_at and dev_qsa_key: nothing of the
        # position but itself is staged per token. (rope's angle kind, its inverse frequencies) ->
        # (cos [C, half], sin [C, half]); the ropes of one model share one table
        self._rope_tables: dict[tuple, tuple] = {}
        self.rope_arena = None  # the tier's planned bytes for the tables (startup: weights.rope), or None
        self._ctx = 1  # the longest context a token step's session has had: the tables' rows at least
        self._attn_sc: dict[tuple[int, int], object] = {}  # (H, ctx) -> dev_attn_one's scores [H, ctx]
        self.graphs = True  # token_step may capture and replay (tests turn it off to compare)
        self.split_attention = True  # one token's attention with its keys split among warps (dev_attn_split)
        # token_step's captured step: (session, its segments, pool, its MoE log, its bookkeeping, ahead):
        # `ahead` True: the run-ahead's, whose graph ends with the pick, the position's advance and
        # the next row's gather (dev_pick_next)
        self._graph = None
        self._gathered = None  # the row buffer the last run-ahead step's dev_pick_next filled (embed_picked)
        self._embd_n = None  # the token step's embedding row length (its first staged row's)
        self._segments = None  # the segments cut so far while token_step captures (at_host)
        self._warm = None  # the session whose token step ran once eagerly under the graph pool
        self._logits = None  # token_step's device logits [1, n_vocab]
        # a token step's inputs go up from pinned host bytes by asynchronous copies into fixed device
        # buffers (no allocation, no wait): id(device array) -> (its pinned mirror, the copy's event)
        self._staged: dict[int, tuple] = {}
        self._row_bufs: dict[tuple, object] = {}  # shape -> the fixed device buffer of `stage_row`
        self._pick = None  # dev_argmax's [token, NaN seen, max bits], on the device and its pinned mirror
        self._argmax_buf = None  # dev_argmax's parts [3 PICK_GRID] and ticket counter [1] (`_argmax_work`)
        self._ahead_picks = None  # the run-ahead's two pinned picks and their events (`queue_greedy`), and which is next
        # the embedding table in its GGUF blocks (startup's weights stage places it): (bytes, type id,
        # row bytes, rows); the run-ahead gathers the next step's row from it (`embed_picked`)
        self.embd_table = None
        self._sampling = None  # dev_sample's settings and buffers for one sampler (`_sample`; [8]: work)
        self._cuts = None  # gpu_floor's capture: [(label, graph)], cut at every `boundary`
        self._cut_at = None  # the label of the part being captured
        self.floor = None  # the last per-part GPU floor (`_floor_step`): [(label, seconds per step)]
        self.floor_next = False  # the session's next replayed token step is captured in parts and timed
        # (True: a part per layer and the head; "kernels": a part per launch, labelled (layer, kernel))
        # the host must know a step's input token before the step (PLE hashes it: ple_state), so the
        # run-ahead, whose next token is known only on the device, cannot take the session; unless
        # the PLE table is on the device (`ple`), where dev_ple_rows hashes the pick itself
        self.needs_token = False
        self.ple = None  # DevicePLE: the PLE table placed on the device (startup, weights.ple_table), or None
        self._qsa_bufs: dict[tuple, tuple] = {}  # (blocks, tokens selected at most, H) -> qsa_token's scratch
        self._ple_rows: dict[tuple, object] = {}  # (PLE layer, shape) -> the fixed device buffer of its staged rows
        self._books = None  # while token_step captures: the host bookkeeping a replay repeats (`bookkeep`)
        self.verify_logits = None  # --spec N: the verify's logits rows [1 + N, n_vocab], placed at the tier's stage 7
        # `verify_step`: while a verify's rows run, (their first position, rows): each row's position
        # is read from `_posv` (attention, the rope), staged before the step; its graphs by (session, T)
        self._verify_at = None
        self._posv = None
        self._vgraphs: dict = {}
        self._verify_bufs: dict = {}
        self._address_lists = ByIdentity()  # `_addresses`: arrays -> (their addresses on the device, the pinned copy)
        self._copy_graphs = ByIdentity(COPY_GRAPHS)  # `copy_arrays`: arrays -> [their copies' graph, or None before the capture]
        self.verify_graphs = VERIFY_GRAPHS  # verify_step may capture and replay (VERIFY_GRAPHS)
        self.stream_retaken = 0  # steps that found another stream current (CupyRuntime.retake_stream)
        # pick_rows' sets by banned ids: (rows, device picks [rows, 3], their pinned mirror, ids on the device,
        # dev_argmax_rows' parts [rows, 3 PICK_GRID] and ticket counters [rows])
        self._rows_picks = {}
        self._top_prob = None  # queue_top_prob's (parts, counter, result, its pinned mirror)
        self._verify_ahead = None  # `ahead_verify`: the buffers of verifies run ahead (engine/tier/verify_ahead.py)
        # a norm that feeds products makes their ActQ in the same launch (norm_input, rmsnorm_q,
        # gated_norm_input), as does a token's expert hidden activation (DeviceExperts.token); tests
        # turn it off to compare. One token's norms' ActQ buffers: (output's address, shape) -> GpuActQ
        self.fuse_actq = True
        # one token's products of one input and one type in one launch (`linears`); tests turn it
        # off to compare with a launch each
        self.fuse_many = True
        self._norm_acts: dict[tuple, object] = {}

    def companion(self) -> "DeviceBackend":
        """A backend for a second part of the model that runs between this one's steps (the MTP draft
        head, engine/tier/draft.py): its own position, rope tables, scratch, graphs and expert server
        (the caller sets `experts`), so nothing it does moves what this one's captured steps read;
        this one's compiled kernels, settings and GEMM slab (the two run one after the other on one
        stream, so the slab is never used by both at once)."""
        be = DeviceBackend(self.rt, None, mod=self._mod)
        be._gemm_slab = self._gemm_slab
        be.fuse_actq, be.fuse_many, be.split_attention = self.fuse_actq, self.fuse_many, self.split_attention
        be.graphs = False  # (its one-row steps go through verify_step, under verify_graphs: VERIFY_GRAPHS's default)
        return be

    def enter_thread(self) -> None:
        self.rt.enter_thread()

    def _launch(self, name: str, n_threads: int, args: tuple, block: int = BLOCK, smem: int = 0) -> None:
        grid = max(1, min(-(-n_threads // block), 32 * self.rt.n_sm))
        self.rt.launch(self._mod, name, grid, block, args, smem)

    def _norm(self, rows: int, n: int, args: tuple) -> None:
        """dev_rmsnorm over `rows` rows of n: a block per row, a warp per 128 of its elements
        (a few loads a thread), at most 1024 threads."""
        warps = max(1, min(32, -(-n // 128)))
        self._launch("dev_rmsnorm", 32 * warps * rows, args, 32 * warps, 8 * warps)

    @staticmethod
    def _rows(x, n: int) -> int | None:
        """The element stride between consecutive n-long rows of x when every row is contiguous and
        the rows are evenly spaced (a view like qg[:, :, :D] is), else None."""
        if x.dtype != F32 or x.shape[-1] != n or x.strides[-1] != 4:
            return None
        # an axis of length 1 has no spacing to keep: one token's [1, heads, d] view of a wider row
        # (a Gated DeltaNet's q within its conv output) is evenly spaced rows; checking that axis's
        # stride too had sent such views to the array-module fallback (a dozen launches a norm)
        dims = [(m, st) for m, st in zip(x.shape[:-1], x.strides[:-1]) if m != 1]
        if not dims:
            return n
        for (_, st0), (m1, st1) in zip(dims, dims[1:]):
            if st0 != st1 * m1:
                return None
        return dims[-1][1] // 4

    # --- where arrays live

    def param(self, a):
        if self.xp is np or not isinstance(a, np.ndarray):
            return a  # already the device's (or the emulation's, whose device arrays are numpy's)
        got = self._params.get(id(a))
        if got is None or got[0] is not a:  # the host array is held: its id cannot be reused
            got = self._params[id(a)] = (a, self.rt.to_device(np.ascontiguousarray(a)))
        return got[1]

    def upload(self, a):
        return self.rt.to_device(a)

    def host(self, a) -> np.ndarray:
        return self.rt.to_host(a)

    def zeros(self, shape, dtype=F32):
        """A state array: the runtime's allocation (so the emulation counts it as a card would)."""
        a = self.rt.empty(shape, dtype)
        a.fill(0)
        return a

    def empty(self, shape, dtype=F32):
        return self.xp.empty(shape, dtype)

    def kv_cache(self, kind: str, max_context: int, n_head_kv: int, head_dim: int) -> DeviceKVCache:
        return DeviceKVCache(self, kind, max_context, n_head_kv, head_dim)

    # QSA's and PLE's token step reads nothing of the host's inside the step: PLE's rows are staged
    # before it (Model stages them from the input token: `stage_ple`), QSA writes its keys, pools its
    # block, scores, selects and attends at the device position (`qsa_token`), the PLE conv reads
    # its ring there (`ple_conv_step`); their host counters advance by `bookkeep`, which a replay
    # repeats. So a qwen4exp session is captured like qwen35moe's (`token_step`). A prompt chunk
    # still selects on the host (not captured).

    def qsa_cache(self, g, max_ctx: int, kv: str = "f32") -> "DeviceQSACache":
        return DeviceQSACache(self, g, max_ctx, kv)

    def ple_state(self, g) -> "DevicePLEState":
        self.needs_token = self.ple is None
        return DevicePLEState(self, g)

    # --- qwen4exp's hyper-connection, PLE and QSA passes (engine/hyper.py, ple.py, qsa.py): the
    # same f32 steps in the same order as the CPU's kernels beside their references

    def rmsnorm_q(self, x, gain, group: int, eps: float):
        """hyper.grouped_rmsnorm_q on the device: the grouped norm with f32 sums and its ActQ (one
        launch, dev_rmsnorm_q, where the rows allow it)."""
        if self.fuse_actq and x.flags.c_contiguous and x.dtype == F32 and x.shape[-1] % group == 0 \
                and group % 32 == 0 and gain.shape in ((x.shape[-1],), (group,)) and x.ndim <= 2:
            out = self.scratch("rmsnorm_q.out", x.shape)  # (one token's at a fixed address: its ActQ's key)
            return out, self._norm_q(x, group, gain, group, out, eps, f32_sums=True)
        out = self.rmsnorm(x, gain, eps, group=group, f32_sums=True)
        return out, self._quantize(out, False)

    def norm_input(self, x, gain, eps: float, out) -> Input:
        """backend.norm_input: the norm and its ActQ in one launch (dev_rmsnorm_q), the ActQ the
        separate quantizer's bits; the products of the Input read it instead of quantizing again."""
        n = x.shape[-1]
        xs = self._rows(x, n) if self.fuse_actq and n % 32 == 0 else None
        if xs is None or gain.shape != (n,) or not out.flags.c_contiguous or out.shape != x.shape or out.ndim > 2:
            return Input(self.rmsnorm(x, gain, eps, out))
        return Input(out, self._norm_q(x, xs, gain, n, out, eps, f32_sums=False))

    def add_norm_input(self, H, Y, gain, eps: float, out) -> Input:
        """backend.add_norm_input: the residual add and the next norm with its ActQ in one launch
        (dev_add_rmsnorm_q); the add was an array expression, a launch of its own."""
        n = H.shape[-1]
        if not (self.fuse_actq and n % 32 == 0 and H.ndim == 2 and H.dtype == Y.dtype == F32 and H.flags.c_contiguous
                and Y.flags.c_contiguous and Y.shape == H.shape == out.shape and out.flags.c_contiguous
                and gain.shape == (n,)):
            return super().add_norm_input(H, Y, gain, eps, out)
        rows, q = H.shape[0], self._act_of(out)
        warps = max(1, min(32, -(-n // 128)))
        self._launch("dev_add_rmsnorm_q", 32 * warps * rows, (H, Y, self.param(gain), out, q.q, q.d, q.s16, np.int32(rows),
                                                               np.int32(n), F32(eps)), 32 * warps, 8 * warps)
        return Input(out, q)

    def gated_norm_input(self, o, gain, z, eps: float, silu: bool) -> Input:
        """backend.gated_norm_input: the gated norm of o [T, heads, n] in place and its ActQ in one
        launch (dev_rmsnorm_q), as the Input [T, heads n] of the out projection."""
        n, T = o.shape[-1], o.shape[0]
        if not (self.fuse_actq and n % 32 == 0 and o.dtype == F32 and o.flags.c_contiguous and z.flags.c_contiguous
                and z.shape == o.shape and gain.shape == (n,)):
            return super().gated_norm_input(o, gain, z, eps, silu)
        flat = o.reshape(T, o.size // T)
        return Input(flat, self._norm_q(o, n, gain, n, flat, eps, f32_sums=False, z=z, act=2 if silu else 1))

    def _act_of(self, out):
        """The ActQ buffer (out's shape, as _quantize(out) makes it) of a fused launch's output: one
        token's kept per output buffer (out: a scratch buffer, whose address is fixed, so a captured
        step replays it), a chunk's new, as the scratch's are."""
        shape = out.shape
        if len(shape) == 1 or shape[0] == 1:
            key = (self.rt.ptr(out), shape)
            q = self._norm_acts.get(key)
            if q is None:
                q = self._norm_acts[key] = gpu.empty_act(shape)
            return q
        return gpu.empty_act(shape)

    def gate_input(self, x, z, silu: bool, w: Weight) -> Input:
        """backend.gate_input: the gate and the ActQ of its output in one launch (dev_gate_q), where w
        reads the plain ActQ; the attention's output gate was three launches (sigmoid, multiply, actq)."""
        n, T = x.shape[-1], x.shape[0]
        zs = self._rows(z, n) if self.fuse_actq and n % 32 == 0 and w.type.quantized and not w.wide else None
        if zs is None or x.dtype != F32 or not x.flags.c_contiguous or z.shape != x.shape:
            return super().gate_input(x, z, silu, w)
        flat = x.reshape(T, x.size // T)
        q = self._act_of(flat)
        self._launch("dev_gate_q", x.size, (x, z, np.int64(zs), np.int32(n), np.int32(silu), q.q, q.d, q.s16,
                                            np.int64(x.size)))
        return Input(flat, q)

    def lowrank_gates_input(self, d, inj, hc: int, w: Weight) -> tuple:
        """backend.lowrank_gates_input in one launch (dev_hc_gates_q: both gates and the ActQ of
        silu(d / hc), where w reads the plain ActQ); the array-module form was 7 launches a mix
        (2 dev_sigmoid, 4 elementwise, an actq), 9 mixes a seed-4l token."""
        T, R = d.shape
        if not (self.fuse_actq and R % 32 == 0 and w.type.quantized and not w.wide and d.dtype == F32
                and d.flags.c_contiguous and (inj is None or (inj.dtype == F32 and inj.flags.c_contiguous))):
            return super().lowrank_gates_input(d, inj, hc, w)
        a = self.scratch("hc.a", (T, R))
        wt = None if inj is None else self.scratch("hc.w", (T, hc))
        q = self._act_of(a)
        nw = 0 if inj is None else T * hc
        self._launch("dev_hc_gates_q", max(T * R, nw), (d, a if inj is None else inj, a, a if wt is None else wt, q.q, q.d,
                                                        q.s16, np.int64(T * R), np.int64(nw), F32(hc)))
        return Input(a, q), wt

    def _norm_q(self, x, xs: int, gain, group: int, out, eps: float, f32_sums: bool, z=None, act: int = 0):
        """dev_rmsnorm_q over the rows of `group` of x (stride xs) into out and its ActQ -> GpuActQ.
        One token's ActQ lives in a buffer kept per output buffer (out: a scratch buffer, whose
        address is fixed, so a captured step replays it), a chunk's is new, as the scratch's are."""
        rows, q = x.size // group, self._act_of(out)
        warps = max(1, min(32, -(-group // 128)))
        self._launch("dev_rmsnorm_q", 32 * warps * rows, (x, np.int64(xs), self.param(gain), np.int32(gain.size // group),
                                                           x if z is None else z, np.int32(act), out, q.q, q.d, q.s16,
                                                           np.int32(rows), np.int32(group), F32(eps), np.int32(f32_sums)),
                     32 * warps, 8 * warps)
        return q

    def mix_tail(self, u, sn, out):
        """hyper.mix_tail: mean over the streams of sigmoid(u) sn, the streams summed from 0 in f32,
        divided by hc in float64 (np.mean's intp count) -> out f32 [T, E]; u is overwritten."""
        xp = self.xp
        T, E = out.shape
        hc = u.shape[1] // E
        if all(a.dtype == F32 and a.flags.c_contiguous for a in (u, sn, out)):
            self._launch("dev_mix_tail", T * E, (u, sn, out, np.int32(T), np.int32(hc), np.int32(E)))
            return out
        xp.exp(xp.negative(u, out=u), out=u)
        u += F32(1)
        xp.divide(F32(1), u, out=u)
        u *= sn
        s = u.reshape(T, hc, E)
        acc = s[:, 0].copy()
        for c in range(1, hc):
            acc += s[:, c]
        out[...] = (acc.astype(np.float64) / np.float64(hc)).astype(F32)
        return out

    def inject(self, streams, y, w) -> None:
        """hyper.inject: stream c of token t += w[t, c] y[t] (the f32 product, then the add)."""
        T, hc = w.shape
        if all(a.dtype == F32 and a.flags.c_contiguous for a in (streams, y, w)):
            self._launch("dev_inject", streams.size, (streams, y, w, np.int32(T), np.int32(hc), np.int32(y.shape[1])))
            return
        streams.reshape(T, hc, -1)[...] += w[:, :, None] * y[:, None, :]

    def ple_conv(self, ring, t0: int, X, taps, dil: int, y) -> None:
        """ple.conv_taps: y[t] = sum over taps j, from 0, of taps[j] times the input (Pk-1-j) dil
        tokens back, from the chunk or the ring (token i at ring[i % L])."""
        taps = self.param(taps)
        L, T, Pk = ring.shape[0], X.shape[0], taps.shape[0]
        if all(a.dtype == F32 and a.flags.c_contiguous for a in (ring, X, taps, y)):
            HE = X.shape[1]
            self._launch("dev_ple_conv_rows", T * HE, (ring, np.int64(t0), X, taps, np.int32(dil), y, np.int32(L),
                                                       np.int32(HE), np.int32(Pk), np.int32(T)))
            return
        y[...] = 0
        for t in range(T):
            for j in range(Pk):
                back = t - (Pk - 1 - j) * dil
                y[t] += taps[j] * (X[back] if back >= 0 else ring[(t0 + L + back) % L])

    def ple_output(self, streams, G, y) -> None:
        """ple.add_output: streams += G + y sigmoid(y), sigmoid as 1 / (exp(-y) + 1)."""
        xp = self.xp
        if all(a.dtype == F32 and a.flags.c_contiguous for a in (streams, G, y)):
            self._launch("dev_ple_output", streams.size, (streams, G, y, np.int64(streams.size)))
            return
        s = xp.exp(xp.negative(y))
        s += F32(1)
        xp.divide(F32(1), s, out=s)
        s *= y
        s += G
        streams += s

    def topk_set(self, scores, k: int, vbuf, ibuf):
        """qsa.torch_topk_set on the host: the block scores come down (torch's choice among ties is
        libstdc++'s selection, which runs on the host)."""
        from ..qsa import torch_topk_set

        s = self.rt.to_host(scores)
        return torch_topk_set(s, k, np.empty(s.size, F32), ibuf)

    # --- qwen4exp's token step at the device position (`token_step` captures and replays it)

    def bookkeep(self, fn) -> None:
        """Host bookkeeping of a token step that no device work reads (a cache's token count): run
        now, and at every replay of the step being captured (the step's Python does not run then)."""
        fn()
        if self._books is not None:
            self._books.append(fn)

    def stage_ple(self, layer: int, e: np.ndarray):
        """A token step's PLE rows of `layer` (f32 [1, Pe], made by the host from the step's input
        token before the step: PLELayer.step_rows) into the layer's fixed device buffer, which the
        step reads (copied up asynchronously, nothing allocated after the first step). With the table
        on the device, the buffer dev_ple_rows writes the run-ahead's rows into: one captured step
        reads both."""
        dev = self.ple.rows_of(layer) if self.ple is not None else self._ple_rows.get((layer, e.shape))
        if dev is None:
            dev = self._ple_rows[(layer, e.shape)] = self.rt.empty(e.shape, F32)
        self._stage(dev, e)
        return dev

    def stage_ple_window(self, window: np.ndarray) -> None:
        """The run-ahead's first step: the host's PLE token window after its input token (the host
        hashed that one: `stage_ple`) up to the device's, which dev_ple_rows then advances by each pick."""
        self._stage(self.ple.window, window)

    def ple_picked(self) -> dict:
        """The run-ahead's next step's PLE rows, {layer: [1, Pe]}: made on the device by the last step's
        dev_ple_rows from its pick (nothing to queue here)."""
        return {l: self.ple.rows_of(l) for l in self.ple.layers}

    def ple_conv_step(self, ring, X, taps, dil: int):
        """ple.conv_taps of one token X [1, HE] at the device position (dev_ple_conv: its bits), the
        ring's slot of that position then taking X -> y [1, HE] (a fixed buffer)."""
        taps = self.param(taps)
        (L, HE), Pk = ring.shape, taps.shape[0]
        X = self.xp.ascontiguousarray(X)
        y = self.scratch("ple.conv", (1, HE))
        self._launch("dev_ple_conv", HE, (ring, self._pos, X, taps, np.int32(dil), y, np.int32(L), np.int32(HE), np.int32(Pk)))
        return y

    def _block_rope(self, rope, r: int):
        """The rope's cos and sin table [C, half] (`_rope_table`): dev_qsa_key reads the row of the
        block in progress's first position, (*pos / r) r, on the device."""
        return self._rope_table(rope, self._pos_at + 1)

    def qsa_token(self, layer, cache, q, k, v, iq, ik):
        """QSALayer._attend of one token on the device, at the position `_pos` holds (cache.n): k, v
        cached (dev_kv_write), the raw indexer key written and its block pooled (dev_qsa_key: the
        block in progress at every token, so that no launch depends on whether this token
        completes it), the complete blocks scored (dev_qsa_scores), torch.topk's set of them taken
        with its tie rule and the tokens listed (dev_qsa_select), the queries attending them
        (dev_attn_sel) -> f32 [1, H, D]; cache.n advances by `bookkeep`. q [1, H, D], k, v [1, Hkv,
        D], iq [1, Ih, Id], ik [1, Id], normed and roped where the layer ropes them.

        A NaN score is not refused here as the host's selection refuses it (no value comes down
        inside the step): it comes from a NaN in the layer's input, which reaches the logits, and
        the pick refuses those."""
        xp, p = self.xp, cache.n
        kv, r, H, D, Id = cache.kv, layer.ratio, layer.H, layer.D, layer.Id
        if D % 32 or Id > 1024 or not isinstance(kv, DeviceKVCache):
            raise ValueError(f"layer {layer.layer}: the device's QSA step needs head dim a multiple of 32 (got {D}), "
                             f"indexer dim <= 1024 (got {Id}) and a device KV cache")
        self._at(p)
        q, k, v, iq, ik = (xp.ascontiguousarray(a) for a in (q, k, v, iq, ik))
        Hkv, ctx, kind = kv.n_head_kv, kv.max_context, KV_KIND[kv.kind]
        ks, vs = (kv.k_scale, kv.v_scale) if kv.kind == "int8" else (kv.k, kv.v)  # (not read)
        self._launch("dev_kv_write", 32 * 2 * Hkv * (D // 32), (k, v, kv.k, kv.v, ks, vs, self._pos, np.int32(Hkv),
                                                               np.int32(ctx), np.int32(D), np.int32(kind)))
        c, s = self._block_rope(layer.rope, r)
        threads = 32 * -(-Id // 32)
        nb = cache.idx_blocks.shape[0]
        self._launch("dev_qsa_key", threads, (ik, cache.idx_keys, cache.idx_blocks, np.int32(nb), self._pos, np.int32(r),
                                              np.int32(Id), self.param(layer.idx_k_norm), F32(layer.eps), c, s,
                                              np.int32(layer.rope.half)), threads, 8 * 32 + 4 * Id)  # (one block)
        most = min(ctx, layer.block_topk * r + r - 1)  # the blocks the budget keeps and the longest tail
        scores, ix, toks, count, sc = self._qsa_scratch(nb, most, H)
        self._launch("dev_qsa_scores", 32 * nb, (iq, cache.idx_blocks, self._pos, np.int32(r), np.int32(layer.Ih),
                                                 np.int32(Id), F32(np.sqrt(Id)), scores))
        self._launch("dev_qsa_select", 32, (scores, self._pos, np.int32(r), np.int32(layer.block_topk), cache._vbuf, ix, toks,
                                            count), 32)  # (one thread works)
        out = self.scratch("qsa.out", (1, H, D))
        if self.split_attention and D <= 256:  # the selection split among warps, as attend_one splits positions
            L, S = split_geometry(most)
            part = self._attn_sc.get((H, most, "sel"))
            if part is None:
                part = self._attn_sc[(H, most, "sel")] = self.rt.empty((H, S, D + 2), F32)
            self._launch("dev_attn_split_sel", 32 * H * S, (q, kv.k, kv.v, ks, vs, toks, count, part, np.int32(H),
                                                            np.int32(Hkv), np.int32(ctx), np.int32(D), np.int32(L),
                                                            np.int32(S), F32(D**-0.5), np.int32(kind)))
            self._launch("dev_attn_merge_sel", H * D, (part, count, out, np.int32(H), np.int32(D), np.int32(L), np.int32(S)))
        else:
            self._launch("dev_attn_sel", 32 * H, (q, kv.k, kv.v, ks, vs, toks, count, sc, np.int32(most), out, np.int32(H),
                                                  np.int32(Hkv), np.int32(ctx), np.int32(D), F32(D**-0.5), np.int32(kind)))

        def advance():
            cache.n += 1

        self.bookkeep(advance)
        return out

    def qsa_select_rows(self, layer, cache, iq, p0: int):
        """QSALayer._attend's selections for a prompt chunk's queries iq [T, Ih, Id] at positions
        p0 .. p0 + T - 1, made on the device: each query's block scores and torch.topk's set as the
        token step makes them at that position (dev_qsa_scores_rows, dev_qsa_select_rows: the same
        operations, the same sets) -> the attention's mask, bool [T, p0 + T] on the device (query t
        attends key j). Nothing comes down: the host had brought each query's scores down. As in
        qsa_token, a NaN score is not refused here as the host's selection refuses it: it comes
        from a NaN in the layer's input, which reaches the logits, and the sampler refuses those."""
        if not QSA_ROWS:
            return None
        rt, r, T = self.rt, layer.ratio, iq.shape[0]
        W = p0 + T
        nbm = max(W // r, 1)  # the last query's complete blocks, the most any query has
        iq = self.xp.ascontiguousarray(iq, dtype=F32)
        scores, v, ix = rt.empty((T, nbm), F32), rt.empty((T, nbm), F32), rt.empty((T, nbm), np.int32)
        mask = rt.empty((T, W), np.uint8)
        self._launch("dev_qsa_scores_rows", 32 * T * nbm, (iq, cache.idx_blocks, np.int32(p0), np.int32(T), np.int32(r),
                                                           np.int32(layer.Ih), np.int32(layer.Id), F32(np.sqrt(layer.Id)),
                                                           scores, np.int32(nbm)))
        self._launch("dev_qsa_select_rows", BLOCK * T, (scores, np.int32(nbm), np.int32(p0), np.int32(T), np.int32(r),
                                                         np.int32(layer.block_topk), v, ix, mask, np.int32(W)), BLOCK, 16)
        return mask.view(np.bool_)

    def _qsa_scratch(self, nb: int, most: int, H: int) -> tuple:
        """qsa_token's buffers (made at the first step, then fixed, so a captured step replays them;
        the QSA layers of a step take them in turn): scores f32 [nb], the top-k's indices i32 [nb],
        the tokens selected i32 [most] and their count, the attention's scores f32 [H, most]."""
        got = self._qsa_bufs.get((nb, most, H))
        if got is None:
            rt = self.rt
            got = self._qsa_bufs[(nb, most, H)] = (rt.empty((max(nb, 1),), F32), rt.empty((max(nb, 1),), np.int32),
                                                   rt.empty((most,), np.int32), rt.empty((1,), np.int32),
                                                   rt.empty((H, most), F32))
        return got

    def qsa_selection(self) -> np.ndarray:
        """The tokens the last qsa_token attended (ascending blocks, then the tail), brought down:
        diagnostics and tests (QSALayer.selected on the host path)."""
        if not self._qsa_bufs:
            return np.zeros(0, np.int64)
        *_, toks, count, _ = next(reversed(self._qsa_bufs.values()))
        n = int(self.rt.to_host(count)[0])
        return self.rt.to_host(toks)[:n].astype(np.int64)

    # --- the products

    def _quantize(self, x, wide: bool):
        """Input.form's quantizer on the device: the ActQ, or the wide form (actq.ActQ16) for the
        weights that read it (Weight.wide), each bit for bit the host's."""
        x = self.xp.ascontiguousarray(x)
        return gpu.quantize_act16_gpu(x, check=False) if wide else gpu.quantize_act_gpu(x, check=False)

    def linear(self, w: Weight, x, out=None):
        """Y = X W^T on the device -> device f32 [T, n_out]; `out` may be a host array (the logits),
        which then receives the values. A weight the tier did not place is multiplied by the CPU."""
        x = x if isinstance(x, Input) else Input(x)
        to_host = out is not None and not self.rt.is_array(out)
        dev_out = None if to_host else out
        vl = self.verify_logits
        if to_host and vl is not None and out.ndim == 2 and out.shape[0] <= vl.shape[0] and out.shape[1] == vl.shape[1]:
            dev_out = vl[: out.shape[0]]  # the LM head's rows for the host (a verify's): the planned buffer
        if w.device is None:
            y = self.upload(CpuBackend.linear(self, w, Input(self.rt.to_host(x.x))))
            if dev_out is not None:
                dev_out[...] = y
                y = dev_out
        else:
            act = x.form(w.type, w.wide, quantize=self._quantize)
            if x.x.ndim == 2 and gpu.gemm_takes(w.device, x.x.shape[0]):  # a prompt's dense product: cuBLAS
                y = self._gemm(w, act, x.x.shape[0], dev_out)
            else:
                if not w.type.quantized:
                    act = self.xp.ascontiguousarray(act)
                y = gpu.matmul(w.device, act, out=dev_out)
        if to_host:
            out[...] = self.rt.to_host(y)
            return out
        return y

    def gemm_slab(self, buf, shapes, most_rows: int) -> None:
        """The weight slab of the prompt's dense products through cuBLAS (the budget's prompt.gemm,
        placed at stage 6), and cuBLAS made ready now for the dense weights' (n_in, n_out) `shapes`
        at 64, 256, 1024 and 4096 rows (up to most_rows): its handle and the kernels it loads on
        first use took ~0.1 s of the first prompt and ~25 ms of the first 1024-token piece otherwise
        (2026-12-03, H200); done here, their memory is in stage 6's mark (the budget's prompt.cublas)."""
        self._gemm_slab = buf
        rows = [r for r in (64, 256, 1024, 4096) if r <= max(most_rows, 64)]
        for n_in, n_out in shapes:
            r_out = min(n_out, buf.size // (2 * n_in) // 64 * 64)
            if r_out == 0:
                continue
            w2 = buf[: 2 * r_out * n_in].view(np.float16).reshape(r_out, 2 * n_in)
            for T in rows:
                gpu.gemm_pairs(self.xp.zeros((T, 2 * n_in), np.float16), w2, self.xp.empty((T, r_out), F32))
        self.rt.synchronize()
        # the warm-up's activations and outputs go back to the driver: the memory pool kept them
        # cached, and at 4096 rows stage 6's mark read +588 MiB off the plan (H200, seed-4l,
        # 2026-12-04; +652 on the demo model), against +45 where the warm-up stopped at 256 rows
        self.rt.release()

    def _gemm(self, w: Weight, act, T: int, out):
        """gpu.gemm_products of a prompt chunk's T rows (act: their ActQ, or ActQ16 for a wide weight):
        the activations' f16 pairs from the memory pool (the prompt path's reserve, like the chunk's
        other temporaries), the weight's slab one buffer of gpu.GEMM_SLAB_BYTES kept for every product."""
        if out is None:
            out = self.xp.empty((T, w.n_out), F32)
        if self._gemm_slab is None:  # (a backend the tier's startup did not plan: tests)
            self._gemm_slab = self.xp.empty(gpu.GEMM_SLAB_BYTES // 2, np.uint16)
        gpu.gemm_products(w.device, act, out, self.xp.empty(2 * T * w.n_in, np.uint16), self._gemm_slab)
        return out

    def linears(self, ws, x, outs):
        """Several products of one input (the CPU's one parallel region for all of them,
        cpu.matvec_many): those of one type in one launch, for one token (gpu.matvec_many: each row
        matvec's bits) or a verify's few rows (gpu.matmul_many: matmul's), the rest one launch each."""
        x = x if isinstance(x, Input) else Input(x)
        ys = [None] * len(ws)
        T = x.x.shape[0] if x.x.ndim == 2 else 0
        if self.fuse_many and 0 < T <= gpu.MVF_TOKENS:
            many = gpu.matvec_many if T == 1 else gpu.matmul_many
            groups: dict[int, list[int]] = {}
            for i, (w, out) in enumerate(zip(ws, outs)):
                if w.device is not None and not w.wide and (out is None or self._plain_out(out, T, w.n_out)):
                    groups.setdefault(w.type_id, []).append(i)
            for idx in groups.values():
                for a in range(0, len(idx) - 1, gpu.MANY):
                    part = idx[a : a + gpu.MANY]
                    if len(part) < 2:
                        continue
                    act = x.form(ws[part[0]].type, False, quantize=self._quantize)
                    if not ws[part[0]].type.quantized:
                        act = self.xp.ascontiguousarray(act)
                    got = [outs[i] if outs[i] is not None else self.rt.empty((T, ws[i].n_out), F32) for i in part]
                    if many([ws[i].device for i in part], act, got):
                        for i, y in zip(part, got):
                            ys[i] = y
        return [y if y is not None else self.linear(w, x, out) for w, out, y in zip(ws, outs, ys)]

    def _plain_out(self, out, T: int, n: int) -> bool:
        # device rows the launch writes directly (a host array, the logits, goes through `linear`)
        return self.rt.is_array(out) and out.dtype == F32 and out.shape == (T, n) and out.flags.c_contiguous

    # --- the sequence and elementwise operations: engine/ops.py's formulas over device arrays

    def rmsnorm(self, x, gain, eps: float, out=None, *, group: int | None = None, f32_sums: bool = False):
        xp = self.xp
        n = x.shape[-1]
        group = n if group is None else group
        if group == n:
            xs = self._rows(x, n)
        else:  # groups splitting the last axis: rows of `group` in a contiguous array
            xs = group if x.flags.c_contiguous and x.dtype == F32 and n % group == 0 else None
        if xs is not None and gain.shape in ((n,), (group,)) and (out is None or out.flags.c_contiguous):
            out = xp.empty(x.shape, F32) if out is None else out
            rows = x.size // group
            self._norm(rows, group, (x, np.int64(xs), self.param(gain), np.int32(gain.size // group), x, out,
                         np.int32(rows), np.int32(group), F32(eps), np.int32(f32_sums), np.int32(0), np.int32(0)))
            return out
        g = x.reshape(*x.shape[:-1], n // group, group)
        if f32_sums:
            r = F32(1.0) / xp.sqrt(xp.mean(xp.square(g), axis=-1, keepdims=True, dtype=F32) + F32(eps))
        else:
            ms = xp.square(g.astype(np.float64)).sum(axis=-1) / group
            r = (1.0 / xp.sqrt(ms + eps)).astype(F32)[..., None]
        if out is None:
            out = xp.empty(g.shape, F32)
        xp.multiply(g, r, out=out.reshape(g.shape))
        out = out.reshape(x.shape)
        out *= self.param(gain)
        return out

    def l2norm_(self, x):
        xp = self.xp
        n = x.shape[-1]
        xs = self._rows(x, n)
        if xs == n:  # (in place: the kernel writes row r at r n)
            self._norm(x.size // n, n, (x, np.int64(xs), x, np.int32(1), x, x, np.int32(x.size // n), np.int32(n),
                         F32(L2NORM_EPS), np.int32(0), np.int32(0), np.int32(1)))
            return x
        ss = xp.square(x.astype(np.float64)).sum(axis=-1)
        x *= (1.0 / xp.sqrt(ss + L2NORM_EPS)).astype(F32)[..., None]
        return x

    def sigmoid(self, x, *, exp_form: bool = False):
        xp = self.xp
        if x.dtype == F32:
            x = xp.ascontiguousarray(x)
            out = xp.empty(x.shape, F32)
            self._launch("dev_sigmoid", x.size, (x, out, np.int64(x.size), np.int32(exp_form)))
            return out
        if exp_form:
            return F32(1.0) / (xp.exp(-x) + F32(1.0))
        return (xp.tanh(x * F32(0.5)) + F32(1.0)) * F32(0.5)

    def softplus(self, x):
        if x.dtype == F32 and x.flags.c_contiguous:
            out = self.xp.empty(x.shape, F32)
            self._launch("dev_softplus", x.size, (x, out, np.int64(x.size)))
            return out
        return self.xp.logaddexp(F32(0), x).astype(x.dtype, copy=False)

    def gate_(self, x, z, silu: bool = False):
        if x.dtype == F32 and x.flags.c_contiguous and z.flags.c_contiguous and z.shape == x.shape:
            self._launch("dev_gate", x.size, (x, z, np.int64(x.size), np.int32(silu)))
            return x
        s = self.sigmoid(z)
        if silu:
            s = z * s
        x *= s
        return x

    # --- backend.py's fused sequences, one launch each (the same bits: device_kernels.cu)

    def gdn_gates(self, beta, alpha, a, dt_bias):
        if not (beta.dtype == alpha.dtype == F32 and beta.flags.c_contiguous and alpha.flags.c_contiguous
                and beta.shape == alpha.shape and a.shape == dt_bias.shape == beta.shape[-1:]):
            return super().gdn_gates(beta, alpha, a, dt_bias)
        xp = self.xp
        b, d = xp.empty(beta.shape, F32), xp.empty(beta.shape, F32)
        self._launch("dev_gdn_gates", beta.size, (beta, alpha, self.param(a), self.param(dt_bias), b, d, np.int64(beta.size),
                                                  np.int32(a.size)))
        return b, d

    def gates_conv(self, beta, alpha, a, dt_bias, state, w, x):
        wd = self.param(w)
        if not (beta.dtype == alpha.dtype == F32 and beta.flags.c_contiguous and alpha.flags.c_contiguous
                and beta.shape == alpha.shape and a.shape == dt_bias.shape == beta.shape[-1:]
                and x.strides[-1] == 4 and state.flags.c_contiguous and wd.flags.c_contiguous and x.shape[0] == 1):
            # (a chunk: the two launches, dev_conv spreading its tokens over threads; here a thread per channel)
            return super().gates_conv(beta, alpha, a, dt_bias, state, w, x)
        xp, (K, C), T = self.xp, wd.shape, x.shape[0]
        b, d, out = xp.empty(beta.shape, F32), xp.empty(beta.shape, F32), xp.empty((T, C), F32)
        self._launch("dev_gates_conv", C + beta.size, (beta, alpha, self.param(a), self.param(dt_bias), b, d,
                                                       np.int64(beta.size), np.int32(a.size), state, wd, x,
                                                       np.int64(x.strides[0] // 4), out, np.int32(T), np.int32(K), np.int32(C)))
        return (b, d), out

    def qk_l2norm_(self, c, n: int, nk: int, dk: int, scale: float):
        if n != 1 or c.dtype != F32 or not c.flags.c_contiguous:  # one token: its q and k heads are 2 nk rows in a row
            return super().qk_l2norm_(c, n, nk, dk, scale)
        self._launch("dev_l2_qk", 32 * 2 * nk, (c, np.int32(nk), np.int32(2 * nk), np.int32(dk), F32(L2NORM_EPS), F32(scale)))
        return c[:, : nk * dk].reshape(n, nk, dk), c[:, nk * dk : 2 * nk * dk].reshape(n, nk, dk)

    def shared_add_(self, out, y, g):
        T, E = out.shape
        if not (out.flags.c_contiguous and y.flags.c_contiguous and g.flags.c_contiguous and y.shape == out.shape
                and g.shape == (T, 1) and out.dtype == y.dtype == g.dtype == F32):
            return super().shared_add_(out, y, g)
        self._launch("dev_shared_add", out.size, (out, y, g, np.int64(out.size), np.int32(E)))
        return out

    def gated_rmsnorm_(self, o, gain, z, eps: float, silu: bool):
        n = o.shape[-1]
        if o.flags.c_contiguous and z.flags.c_contiguous and z.shape == o.shape and gain.shape == (n,) and o.dtype == F32:
            self._norm(o.size // n, n, (o, np.int64(n), self.param(gain), np.int32(1), z, o,
                         np.int32(o.size // n), np.int32(n), F32(eps), np.int32(0), np.int32(2 if silu else 1), np.int32(0)))
            return o
        self.rmsnorm(o, gain, eps, out=o)
        return self.gate_(o, z, silu=silu)

    def causal_mask(self, pos0: int, T: int, n: int):
        xp = self.xp
        return xp.arange(n)[None, :] <= (pos0 + xp.arange(T))[:, None]

    def _stage(self, dev, values) -> None:
        """values -> the device array `dev`, through its pinned mirror by an asynchronous copy queued
        on the stream: the host does not wait for the device. The mirror is written again only once
        its previous copy has run (its event), so a queued copy never reads the next step's bytes."""
        got = self._staged.get(id(dev))
        if got is None or got[2] is not dev:
            pin = self.rt.pinned(dev.nbytes).view(dev.dtype).reshape(dev.shape)
            got = self._staged[id(dev)] = (pin, self.rt.events(1)[0] if hasattr(self.rt, "events") else None, dev)
        pin, done, _ = got
        if done is not None:
            done.synchronize()
        pin[...] = values
        self.rt.copy_in_async(dev, pin)
        if done is not None:
            done.record()

    def stage_row(self, a: np.ndarray):
        """A token step's host row (the embedding's) on the device, at a fixed address per shape
        (copied up asynchronously, nothing allocated after the first step)."""
        dev = self._row_buf(a.shape)
        self._stage(dev, a)
        self._embd_n, self._gathered = a.shape[-1], None
        return dev

    def _row_buf(self, shape: tuple):
        """The token step's embedding row buffer of `shape`: one fixed device address (the graph reads
        the row there), written by `stage_row` from the host or by `embed_picked` on the device."""
        dev = self._row_bufs.get(shape)
        if dev is None:
            dev = self._row_bufs[shape] = self.rt.empty(shape, F32)
        return dev

    def _at(self, pos: int) -> None:
        """The decode step's position at its fixed device address (read by every kernel that depends
        on it: the rope tables' row, the KV write, attention's length, QSA's block, PLE's ring slot).
        Staged only when the device does not hold it already: a run-ahead step advances it on the
        device (dev_pick_next), so there nothing goes up per token."""
        if self._pos_at == pos:
            return
        if self._pos is None:
            self._pos = self.rt.empty((1,), np.int32)
        self._stage(self._pos, pos)
        self._pos_at = pos

    def _rope_table(self, rope, need: int) -> tuple:
        """`rope`'s cos and sin at positions 0..C-1, f32 [C, half] each on the device (rope.cos_sin's
        values: the host's angles, as a staged row had them), C at least `need` and the longest
        session's context; made once (in the tier's planned bytes, weights.rope, where it placed
        them) and again only when a longer context needs more rows, which drops the captured step
        (it holds the old table's address)."""
        key = (bool(rope.f32_angles), rope.n_rot, np.asarray(rope.inv_freq).tobytes())
        got = self._rope_tables.get(key)
        if got is not None and got[0].shape[0] >= max(need, self._ctx):  # (a token step's session's whole
            return got  # context at its first, eager, step: a capture never finds the table short)
        C = max(need, self._ctx, 2 * got[0].shape[0] if got is not None else 0)
        arena, rt = self.rope_arena, self.rt
        if got is None and arena is not None:  # the planned rows (the tier's --ctx-size), when they hold C
            planned = arena.nbytes // (2 * 4 * rope.half)
            C = planned if C <= planned else C
        c, s = rope.cos_sin(np.arange(C))
        if got is None and arena is not None and arena.nbytes >= 2 * c.nbytes:
            dc, ds = rt.view(arena, 0, c.shape, F32), rt.view(arena, c.nbytes, s.shape, F32)
            self.rope_arena = None  # (one table is planned: the ropes of a model share theirs)
        else:
            dc, ds = rt.empty(c.shape, F32), rt.empty(s.shape, F32)
        rt.copy_in(dc, np.ascontiguousarray(c, F32))
        rt.copy_in(ds, np.ascontiguousarray(s, F32))
        if got is not None:
            self._graph, self._warm = None, None
            self._vgraphs.clear()
        got = self._rope_tables[key] = (dc, ds)
        return got

    def _row_pos(self, pos: int):
        """A verify's row at `pos` (`verify_step`): the device int holding pos in the verify's position
        buffer (staged before the step, so a captured verify serves every position), or None outside
        a verify."""
        v = self._verify_at
        if v is None or not 0 <= pos - v[0] < v[1]:
            return None
        return self._posv[pos - v[0] : pos - v[0] + 1]

    def rope_(self, rope, x, positions) -> None:
        positions = np.asarray(positions)
        v = self._verify_at
        if v is not None and x.ndim == 3 and 0 < positions.size <= v[1] and int(positions[0]) == v[0] \
                and np.array_equal(positions, v[0] + np.arange(positions.size)) and self._rows(x, x.shape[-1]) is not None:
            # a verify's rows at consecutive positions from its first: dev_rope_at from the position
            # buffer, rotated by the table's rows, as each row's token step rotates it (its bits)
            c, s = self._rope_table(rope, v[0] + positions.size)
            heads, h = x.shape[1], rope.half
            self._launch("dev_rope_at", positions.size * heads * h, (x, np.int64(self._rows(x, x.shape[-1])), c, s, self._posv,
                                                                     np.int32(positions.size * heads), np.int32(heads), np.int32(h)))
            return
        # the step's own position at the fixed addresses; another one (QSA's pooled block key, at its
        # block's first position) takes the general path, so it does not move the step's position
        if positions.size == 1 and x.ndim == 3 and self._rows(x, x.shape[-1]) is not None \
                and self._pos_at in (None, int(positions[0])):
            p = int(positions[0])
            self._at(p)  # nothing to do when token_step set it (and inside its capture)
            c, s = self._rope_table(rope, p + 1)
            heads, h = x.shape[1], rope.half
            self._launch("dev_rope_at", heads * h, (x, np.int64(self._rows(x, x.shape[-1])), c, s, self._pos, np.int32(heads),
                                                    np.int32(heads), np.int32(h)))
            return
        key = (id(rope), positions.tobytes())
        if self._rope_key != key:  # the layers of one step rotate at the same positions: computed once
            c, s = rope.cos_sin(positions)  # host: float64 angles, the CPU's values
            self._rope_key, self._rope_cs = key, (self.upload(np.ascontiguousarray(c)), self.upload(np.ascontiguousarray(s)))
        c, s = self._rope_cs
        h = rope.half
        T, heads = x.shape[0], x.shape[1]
        xs = self._rows(x, x.shape[-1])
        if xs is not None and x.ndim == 3:
            self._launch("dev_rope", T * heads * h, (x, np.int64(xs), c, s, np.int32(T * heads), np.int32(heads), np.int32(h)))
            return
        c, s = c[:, None, :], s[:, None, :]
        x1 = x[..., :h].copy()
        x2 = x[..., h : 2 * h]
        x[..., :h] = x1 * c - x2 * s
        x[..., h : 2 * h] = x2 * c + x1 * s

    def conv(self, state, w, x):
        """ops.conv_many on the device: the causal depthwise conv over the state then x, then SiLU."""
        xp = self.xp
        w = self.param(w)
        K, T = w.shape[0], x.shape[0]
        if x.strides[-1] == 4 and state.flags.c_contiguous and w.flags.c_contiguous and K - 1 <= CONV_T:
            C = x.shape[1]
            out = xp.empty((T, C), F32)
            self._launch("dev_conv", C * -(-T // CONV_T), (state, w, x, np.int64(x.strides[0] // 4), out, np.int32(T), np.int32(K), np.int32(C)))
            return out
        hist = xp.concatenate([state, x])  # [K-1+T, C]
        out = w[0] * hist[:T]
        for j in range(1, K):
            out += w[j] * hist[j : j + T]
        state[...] = hist[T:]
        return self.gate_(out, out.copy())  # SiLU: x sigmoid(x) (ops.silu_)

    def delta_rule(self, S, q, k, v, g, beta, out=None):
        """ops.delta_rule's recurrence, token by token, on the device (the chunked form of the prompt
        path is not here yet): per v-head h (key head h % nk)
            S <- S exp(g);  kv = S k;  S <- S + (beta (v - kv)) k^T;  out = S q"""
        xp = self.xp
        T, nv = v.shape[0], v.shape[1]
        nk = q.shape[1]
        _, dv, dk = S.shape
        out = xp.empty(v.shape, F32) if out is None else out
        if dk <= 256 and S.flags.c_contiguous and out.flags.c_contiguous \
                and q.strides[1:] == (dk * 4, 4) and k.strides[1:] == (dk * 4, 4) and v.strides[1:] == (dv * 4, 4) \
                and g.flags.c_contiguous and beta.flags.c_contiguous:
            self._launch("dev_delta", 32 * nv * -(-dv // DELTA_R), (S, q, np.int64(q.strides[0] // 4), k, np.int64(k.strides[0] // 4), v,
                         np.int64(v.strides[0] // 4), g, beta, out, np.int32(T), np.int32(nv), np.int32(nk),
                         np.int32(dv), np.int32(dk), np.int64(0)))  # (no snapshots: a null pointer)
            return out
        heads = self._heads.get((nv, nk))
        if heads is None:
            heads = self._heads[(nv, nk)] = xp.asarray(np.arange(nv) % nk)
        decay = xp.exp(g)  # [T, nv]
        for t in range(T):
            kk, qq = k[t][heads], q[t][heads]  # [nv, dk]
            S *= decay[t][:, None, None]
            kv = xp.matmul(S, kk[:, :, None])[..., 0]  # [nv, dv]
            delta = (v[t] - kv) * beta[t][:, None]
            S += delta[:, :, None] * kk[:, None, :]
            out[t] = xp.matmul(S, qq[:, :, None])[..., 0]
        return out

    def gdn_rows(self, layer, rows: list, mixed, decay, beta, o) -> bool:
        """GatedDeltaNet._rows on the device: a verify's one-token rows of one state, each as its own
        token step (its bits), in three launches for all of them: their convs with each row's conv
        state into its snapshot (dev_conv_rows), their q and k norms (dev_l2_qk_rows), their delta
        rule with each row's S into its snapshot (dev_delta's snaps). Row by row it was three
        launches a row and two snapshot copies (in a captured verify, graph nodes of ~2.5 us each on
        the H200: 5 a row in each of qwen35moe's 36 Gated DeltaNet layers). False where a shape
        does not fit the kernels: the caller goes row by row."""
        st, n = rows[0].state, len(rows)
        conv, S = st["conv"], st["S"]
        w = self.param(layer.conv_w)
        K, C = w.shape
        nk, dk, nv, dv = layer.nk, layer.dk, layer.nv, layer.dv
        a, b = rows[0].a, rows[-1].b
        x = mixed[a:b]
        if not (n <= CONV_T and K - 1 <= CONV_T and dk <= 256 and x.strides[-1] == 4 and conv.flags.c_contiguous
                and w.flags.c_contiguous and S.flags.c_contiguous and o.flags.c_contiguous and decay.flags.c_contiguous
                and beta.flags.c_contiguous and x.dtype == F32):
            return False
        snaps_conv = self._addresses([r.saved and r.saved["conv"] for r in rows])
        snaps_S = self._addresses([r.saved and r.saved["S"] for r in rows])
        c = self.xp.empty((n, C), F32)
        self._launch("dev_conv_rows", C, (conv, w, x, np.int64(x.strides[0] // 4), c, np.int32(n), np.int32(K), np.int32(C),
                                          snaps_conv))
        self._launch("dev_l2_qk_rows", 32 * n * 2 * nk, (c, np.int32(n), np.int64(C), np.int32(nk), np.int32(dk),
                                                         F32(L2NORM_EPS), F32(dk**-0.5)))
        qk = 2 * nk * dk
        self._launch("dev_delta", 32 * nv * -(-dv // DELTA_R), (S, c, np.int64(C), c[:, nk * dk :], np.int64(C), c[:, qk:],
                     np.int64(C), decay[a:b], beta[a:b], o[a:b], np.int32(n), np.int32(nv), np.int32(nk), np.int32(dv),
                     np.int32(dk), snaps_S))
        return True

    def _addresses(self, arrays: list):
        """The device addresses of `arrays` (None: 0), int64 on the device: made once per list of
        arrays (a verify's snapshots: the same each time, so a captured verify reads them there),
        copied up asynchronously from pinned memory (kept with them), so the rows wait for nothing."""
        got = self._address_lists.get(arrays)
        if got is None:
            pin = self.rt.pinned(8 * len(arrays)).view(np.int64)
            pin[...] = [0 if a is None else self.rt.ptr(a) for a in arrays]
            dev = self.rt.empty((len(arrays),), np.int64)
            self.rt.copy_in_async(dev, pin)
            got = self._address_lists.put(arrays, (dev, pin))
        return got[0]

    def attention(self, q, K, V, scale: float, visible=None):
        """Softmax attention of T queries over n keys, grouped by KV head -> f32 [T, H, D]; in tiles
        of queries whose scores [H, rows, n] hold DEVICE_ATTN_TILE_BYTES at most: a whole 4096-token
        chunk's scores at 32K keys are 12 GiB (twice that with the mask's copy), and past 2**31
        elements CuPy compiles 64-bit-index variants of every elementwise and reduction kernel on
        first use (the H200, seed-4l qwen4exp, a 32K prompt in 4096-token pieces: the piece at
        20480-24576 took 1034 ms per 1K tokens against ~100 on either side)."""
        xp = self.xp
        T, H, D = q.shape
        Hkv, n = K.shape[:2]
        rows = max(1, DEVICE_ATTN_TILE_BYTES // (4 * H * n))
        if T > rows:
            out = self.rt.empty((T, H, D), F32)
            for a in range(0, T, rows):
                out[a : a + rows] = self.attention(q[a : a + rows], K, V, scale, None if visible is None else visible[a : a + rows])
            return out
        G = H // Hkv
        qh = q.reshape(T, Hkv, G, D).transpose(1, 0, 2, 3).reshape(Hkv, T * G, D)
        scores = xp.matmul(qh, K.transpose(0, 2, 1)) * F32(scale)  # [Hkv, T G, n]
        if visible is not None:
            vis = visible if xp is np or not isinstance(visible, np.ndarray) else self.upload(visible)
            scores = scores.reshape(Hkv, T, G, n)
            scores = xp.where(vis[None, :, None, :], scores, F32(-np.inf)).reshape(Hkv, T * G, n)
        scores -= scores.max(axis=-1, keepdims=True)
        xp.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = xp.matmul(scores, V)  # [Hkv, T G, D]
        return xp.ascontiguousarray(o.reshape(Hkv, T, G, D).transpose(1, 0, 2, 3)).reshape(T, H, D)

    def attend_one(self, cache, pos: int, q, k, v, scale: float):
        """The decode step's attention on the device: k, v cached at the position `_pos` holds
        (dev_kv_write), the queries over positions 0..pos (dev_attn_one) -> device f32 [1, H, D]."""
        H, D = q.shape[-2:]
        if not isinstance(cache, DeviceKVCache) or D % 32 or not all(a.flags.c_contiguous and a.dtype == F32 for a in (q, k, v)):
            return super().attend_one(cache, pos, q, k, v, scale)
        if pos + 1 > cache.max_context:
            raise ValueError(f"KV cache: position {pos} past its {cache.max_context} tokens (--ctx-size)")
        at = self._row_pos(pos)
        if at is None:
            self._at(pos)
            at = self._pos
        Hkv, ctx, kind = cache.n_head_kv, cache.max_context, KV_KIND[cache.kind]
        ks, vs = (cache.k_scale, cache.v_scale) if cache.kind == "int8" else (cache.k, cache.v)  # (not read)
        self._launch("dev_kv_write", 32 * 2 * Hkv * (D // 32), (k, v, cache.k, cache.v, ks, vs, at, np.int32(Hkv),
                                                               np.int32(ctx), np.int32(D), np.int32(kind)))
        out = self.scratch("attn.one", (1, H, D))
        if self.split_attention and D <= 256:
            # keys split among warps (dev_attn_split, then dev_attn_merge), the splits by the position
            L, S = split_geometry(ctx)
            part = self._attn_sc.get((H, ctx, "split"))
            if part is None:
                part = self._attn_sc[(H, ctx, "split")] = self.rt.empty((H, S, D + 2), F32)
            self._launch("dev_attn_split", 32 * H * S, (q, cache.k, cache.v, ks, vs, at, part, np.int32(H), np.int32(Hkv),
                                                        np.int32(ctx), np.int32(D), np.int32(L), np.int32(S), F32(scale),
                                                        np.int32(kind)))
            self._launch("dev_attn_merge", H * D, (part, at, out, np.int32(H), np.int32(D), np.int32(L), np.int32(S)))
            return out
        sc = self._attn_sc.get((H, ctx))
        if sc is None:
            sc = self._attn_sc[(H, ctx)] = self.rt.empty((H, ctx), F32)
        self._launch("dev_attn_one", 32 * H, (q, cache.k, cache.v, ks, vs, at, sc, out, np.int32(H), np.int32(Hkv),
                                              np.int32(ctx), np.int32(D), F32(scale), np.int32(kind)))
        return out

    def attend_rows(self, cache, pos: int, q, k, v, scale: float, out) -> bool:
        """A verify's T rows of one attention layer (positions pos .. pos + T - 1, the verify's
        `_posv`), each as the token step's `attend_one` makes it (its bits), in three launches for
        all of them: every row's keys and values cached (dev_kv_write_rows), then each row's queries
        over the positions up to its own (dev_attn_split_rows, dev_attn_merge_rows) into out
        [T, H, D]. Row by row it was three launches and a copy a row. False where it does not apply
        (outside a verify, a cache or shape the split kernels do not take): the caller goes row by row."""
        T, H, D = q.shape
        at = self._verify_at
        if at is None or at[0] != pos or T > at[1] or not isinstance(cache, DeviceKVCache) or D % 32 or D > 256 \
                or not self.split_attention or not all(a.flags.c_contiguous and a.dtype == F32 for a in (q, k, v, out)):
            return False
        if pos + T > cache.max_context:
            raise ValueError(f"KV cache: position {pos + T - 1} past its {cache.max_context} tokens (--ctx-size)")
        Hkv, ctx, kind = cache.n_head_kv, cache.max_context, KV_KIND[cache.kind]
        ks, vs = (cache.k_scale, cache.v_scale) if cache.kind == "int8" else (cache.k, cache.v)  # (not read)
        self._launch("dev_kv_write_rows", 32 * T * 2 * Hkv * (D // 32), (k, v, cache.k, cache.v, ks, vs, self._posv, np.int32(T),
                                                                        np.int32(Hkv), np.int32(ctx), np.int32(D), np.int32(kind)))
        L, S = split_geometry(ctx)
        part = self._attn_sc.get((H, ctx, "split", T))
        if part is None:
            part = self._attn_sc[(H, ctx, "split", T)] = self.rt.empty((T, H, S, D + 2), F32)
        self._launch("dev_attn_split_rows", 32 * H * S, (q, cache.k, cache.v, ks, vs, self._posv, part, np.int32(T), np.int32(H),
                                                          np.int32(Hkv), np.int32(ctx), np.int32(D), np.int32(L), np.int32(S),
                                                          F32(scale), np.int32(kind)))
        self._launch("dev_attn_merge_rows", H * D, (part, self._posv, out, np.int32(T), np.int32(H), np.int32(D), np.int32(L),
                                                     np.int32(S)))
        return True

    # --- one token as one replayed graph

    def token_step(self, session, pos: int, run, out, n_vocab: int, pick: np.ndarray | None = None,
                   wait: bool = True) -> int | tuple | None:
        """One token of `session` at `pos`: run(logits) queues the layers and the head into the device
        logits [1, n_vocab]; `out` (host f32 [1, n_vocab], or None) receives them. With `pick` (the
        banned ids, int32), the greedy pick is made on the device (dev_argmax) and only the token
        comes back: returned (else None).

        On a runtime that captures (CUDA), with a slot map no token can change (`DeviceExperts.
        static`), the session's first token runs eagerly, the second is captured and every later
        one replays the capture: CUDA graph segments, cut where a layer that can miss needs the host
        (`at_host`: its misses on the CPU), that host work replayed between them. The position is
        written to its fixed address first where the device does not hold it (`_at`; the ropes read
        their tables there), so the same graphs serve every position. Otherwise every step runs
        eagerly. `wait` False (the run-ahead, a greedy pick): the pick is queued, not waited for:
        returns `queue_greedy`'s pending pick. Where the session can run ahead (`can_run_ahead`) the
        step itself ends with the pick, the device position's advance and the next token's embedding
        row gathered (dev_pick_next: one launch, inside the graph), so a token one step ahead is one
        graph replay and one copy down of the pick, nothing staged up (a graph of its own kind:
        switching between it and the plain step warms and captures again)."""
        self.stream_retaken += self.rt.retake_stream()  # (the tier's stream, where a step is captured)
        if self._logits is None or self._logits.shape[1] != n_vocab:
            self._logits = self.rt.empty((1, n_vocab), F32)
        self._ctx = max(self._ctx, session.max_context)
        self._at(pos)
        # the run-ahead (a greedy pick not waited for, its next row gathered on the device): the pick,
        # the position's advance and the next row in the step itself (dev_pick_next), so that a token
        # is one graph replay and the pick's copy down; its buffers made here, outside the graph's pool
        ahead = pick is not None and not wait and self.can_run_ahead(session) and self._embd_n is not None
        ple = ahead and bool(session.ple_states)  # (and the next token's PLE rows: dev_ple_rows)
        if ahead:
            self._pick_buffers(pick)
            body = self._pick_next_into(run, pick, session.max_context - 1, ple)
        else:
            body = run
        ex = self.experts
        g = self._graph
        if g is not None and g[0] is session and g[5] != ahead:  # the other kind of step: made again
            g = self._graph = None
            self._warm = None
        if g is not None and g[0] is session and self.floor_next and len(g[1]) == 1:
            self._floor_step(run, kernels=self.floor_next == "kernels")
            self.floor_next = False
            if ahead:  # (the floor's parts are the layers and the head)
                self._pick_next(pick, session.max_context - 1)
                if ple:
                    self._ple_next()
        elif g is not None and g[0] is session:
            self._replay(g[1])
            ex.replayed(g[3])
            for fn in g[4]:
                fn()
        elif not (self.graphs and hasattr(self.rt, "begin_capture") and ex.static()
                  and self.rt.capturable()):  # (on the legacy stream a capture raises: eagerly then)
            body(self._logits)
        elif self._warm is not session:  # first token: eagerly, its temporaries from the graph's pool
            self._pool = self.rt.graph_pool()
            with self.rt.allocating_from(self._pool):
                body(self._logits)
            self._warm = session
        else:
            with self.rt.allocating_from(self._pool):
                mark = ex.mark()
                self._segments, self._books = [], []
                self.rt.begin_capture()
                try:
                    body(self._logits)
                finally:
                    last = self.rt.end_capture()
                    segments, self._segments = self._segments + [last], None
                    books, self._books = self._books, None
                self.rt.replay(last)  # (the segments before it ran as they were cut)
            self._graph = (session, segments, self._pool, ex.log_since(mark), books, ahead)
        merged = ahead and self._pick_dev() is not self._pick[0]  # (the pick behind the ids: one copy)
        if not merged:
            ex.queue_settle()
        if out is not None:
            self.rt.copy_out(out, self._logits)
        if pick is None:
            return None
        if not wait:
            if ahead:  # the device advanced its position and gathered the next row (dev_pick_next)
                self._pos_at = min(pos + 1, session.max_context - 1)
                self._gathered = self._row_buf((1, self._embd_n))
            return self.queue_greedy(pick, picked=ahead, merged=merged)
        self._next_pos = pos + 1
        return self._greedy(pick) if isinstance(pick, np.ndarray) else self._sample(pick)

    def stage_rows(self, a: np.ndarray):
        """A verify's host rows (their embeddings, f32 [T, n]) on the device at a fixed address per
        shape, copied up asynchronously (a captured verify reads them there)."""
        dev = self._row_buf(a.shape)
        self._stage(dev, a)
        return dev

    def verify_buf(self, name: str, shape: tuple):
        """A verify's fixed device buffer `name` of `shape` (its hidden rows, its logits where the tier
        planned none): made once, so a captured verify writes there at every replay."""
        key = (name, tuple(shape))
        got = self._verify_bufs.get(key)
        if got is None:
            got = self._verify_bufs[key] = self.rt.empty(shape, F32)
        return got

    def queue_down(self, name: str, dev) -> np.ndarray:
        """verify_buf `name`'s rows copied into their pinned mirror (made once a buffer), queued ->
        the mirror, to be read after the forward's next wait (a copy and wait of its own, CuPy's get,
        cost ~46 us of the host's time a verify on an H200)."""
        key = ("down", name, dev.shape)
        got = self._verify_bufs.get(key)
        if got is None:
            got = self._verify_bufs[key] = self.rt.pinned(dev.nbytes).view(dev.dtype).reshape(dev.shape)
        self.rt.copy_out_async(got, dev)
        return got

    def stage_in(self, name: str, a: np.ndarray):
        """Host rows `a` in the fixed device buffer `name` (verify_buf's), copied up asynchronously
        -> that buffer (a captured step reads them there: the draft head's inputs)."""
        dev = self.verify_buf(name, a.shape)
        self._stage(dev, np.ascontiguousarray(a, F32))
        return dev

    def verify_step(self, session, pos: int, T: int, run, key: tuple, hold: tuple = (), capturable: bool = True,
                    stage_pos: bool = True) -> None:
        """A verify's T rows of `session` at pos.. (speculative decoding, Model._verify_rows): run()
        queues the layers and the head into fixed buffers, which the caller reads after a wait.

        Each row's position is read from the position buffer `_posv` (staged here: attention's KV
        write and length, the rope's table rows), so one capture serves every position. As in
        token_step, the first verify of a kind (`key`: the rows, what is asked of the head, the
        snapshots' and buffers' identities, whose addresses a graph keeps) runs eagerly from a pool
        of its own, the second is captured, and later ones replay it: CUDA graph segments cut where
        a layer that can miss needs the host (`at_host`). A verify that ran eagerly cost 8.9x a
        token step for 3 rows (2026-12-02, H200, seed-4l qwen35moe), most of it Python launching
        row by row and a wait per row and layer for the routing counts (now settled after the
        forward: DeviceExperts.settle). `capturable` False (a model whose rows need the host
        mid-way: QSA's block selection, PLE's hashes): eagerly always. `session`: whose graphs these
        are (a Session; the draft head's one-pair steps pass its KV cache, engine/mtp.py).
        `stage_pos` False (a verify run ahead, engine/tier/verify_ahead.py): the positions are the
        ones the last verify's judge left in `_posv` on the device; `pos` is then the host's guess,
        which only the checks read (a row within the context)."""
        ex, rt = self.experts, self.rt
        self.stream_retaken += rt.retake_stream()  # (the tier's stream, where a verify is captured)
        self._ctx = max(self._ctx, session.max_context)
        if self._posv is None or self._posv.shape[0] < T:
            if not stage_pos:
                raise ValueError(f"verify_step: {T} rows with their positions on the device, which holds none for them")
            self._posv = rt.empty((max(T, 16),), np.int32)
            self._vgraphs.clear()
        if stage_pos:
            self._stage(self._posv, pos + np.arange(self._posv.shape[0]))
        self._verify_at = (pos, T)
        try:
            full = (id(session),) + key
            g = self._vgraphs.get(full)
            if g is None:
                # the graphs of the last VERIFY_SESSIONS live sessions are kept (serve's slots take
                # turns); a session that is gone or older goes, with its graphs' pools. (A record
                # names its session weakly: it keeps no session, and its KV caches, alive.)
                for k in [k for k, v in self._vgraphs.items() if v is None or v["session"]() is None]:
                    del self._vgraphs[k]
                held = list(dict.fromkeys(k[0] for k in self._vgraphs))
                if id(session) not in held and len(held) >= VERIFY_SESSIONS:
                    for k in [k for k in self._vgraphs if k[0] == held[0]]:
                        del self._vgraphs[k]
            if g is not None and (g["session"]() is not session or g["ids_rows"] is not ex._ids_rows):
                g = self._vgraphs[full] = None  # (another session at the same id, or the rows' ids made again)
            if not (capturable and self.verify_graphs and hasattr(rt, "begin_capture") and ex.static() and rt.capturable()):
                run()
                return
            if g is not None and "segments" in g:
                g["replays"] += 1
                self._replay(g["segments"])
                ex.replayed(g["log"], g["rows_log"])
                for fn in g["books"]:
                    fn()
                return
            if g is None:  # the first of its kind: eagerly, its temporaries from its graph's pool
                pool = rt.graph_pool()
                with rt.allocating_from(pool):
                    run()
                # (`hold`: the objects whose addresses the key names, kept alive while the graph is)
                self._vgraphs[full] = {"session": weakref.ref(session), "pool": pool, "ids_rows": ex._ids_rows, "hold": hold}
                return
            with rt.allocating_from(g["pool"]):
                mark, rows_mark = ex.mark(), ex.rows_mark()
                self._segments, self._books = [], []
                rt.begin_capture()
                try:
                    run()
                finally:
                    last = rt.end_capture()
                    segments, self._segments = self._segments + [last], None
                    books, self._books = self._books, None
                rt.replay(last)
            g.update(segments=segments, log=ex.log_since(mark), rows_log=ex.rows_since(rows_mark), books=books,
                     ids_rows=ex._ids_rows, replays=0)
        finally:
            self._verify_at = None

    def copy_arrays(self, pairs: list) -> None:
        """dst <- src for each (src, dst) pair of device arrays, queued on the stream: a rollback's
        states (engine/speculative.py's roll_back: every Gated DeltaNet layer's conv and S from a
        snapshot). Where verify_step captures, the same pairs' copies are captured at their second
        use and replayed after: one graph launch for them all. One CuPy copy a pair cost ~8 us of
        the host's time each, ~150 us a rollback of the demo qwen35moe's 8 layers on an H100
        (2026-12-05, cProfile), beside a verify whose graph ran 0.86 ms."""
        rt = self.rt
        arrays = [a for pair in pairs for a in pair]
        if not (self.verify_graphs and hasattr(rt, "begin_capture") and rt.capturable()):
            for src, dst in pairs:
                dst[...] = src
            return
        self.stream_retaken += rt.retake_stream()
        got = self._copy_graphs.get(arrays)
        if got is None:  # the first use: eagerly
            for src, dst in pairs:
                dst[...] = src
            self._copy_graphs.put(arrays, [None])
            return
        if got[0] is None:  # the second: captured, then run
            rt.begin_capture()
            try:
                for src, dst in pairs:
                    dst[...] = src
            finally:
                got[0] = rt.end_capture()
        rt.replay(got[0])

    def _pick_next_into(self, run, banned: np.ndarray, last: int, ple: bool = False):
        """run, then the run-ahead's tail (`_pick_next`; with `ple`, `_ple_next`): a token step's whole work."""
        def body(logits):
            run(logits)
            self._pick_next(banned, last)
            if ple:
                self._ple_next()
        return body

    def _ple_next(self) -> None:
        """dev_ple_rows after dev_pick_next, inside the step: the picked token's PLE rows, hashed and
        gathered on the device into the buffers the next step's PLE layers read (`ple_picked`), the
        device's token window advanced. It reads the pick where dev_pick_next left it (`_pick_dev`)."""
        self.ple.launch(self, self._pick_dev())

    def _pick_next(self, banned: np.ndarray, last: int) -> None:
        """dev_pick_next: the greedy pick into the device's pick (`_argmax`'s rule and buffers), the
        device position advanced (to `last` at most) and the picked token's embedding row gathered
        into the row buffer the next step reads (`embed_picked`'s bits)."""
        _, _, _, ban = self._pick
        dev = self._pick_dev()
        table, type_id, row_bytes, rows = self.embd_table
        n = self._embd_n
        V = self._logits.shape[1]
        grid, block, part, count = self._argmax_work(V)
        self.rt.launch(self._mod, "dev_pick_next", grid, block,
                       (self._logits, np.int32(V), ban, np.int32(banned.size), part, count, dev, self._pos, np.int32(last),
                        table, np.int64(row_bytes), np.int32(rows), np.int32(type_id), np.int32(n), self._row_buf((1, n))),
                       smem=4 * (3 * 32 + 2))

    def _argmax_work(self, n: int) -> tuple:
        """dev_argmax's grid and block over n logits, its parts and its ticket counter (made once by
        `_pick_buffers`, outside any capture's pool; the counter zeroed there and set back to 0 by
        each launch's joining block)."""
        if self._argmax_buf is None:
            self._argmax_buf = (self.rt.empty((3 * PICK_GRID,), np.int32), self.zeros((1,), np.int32))
        if PICK_GRID == 1:
            return (1, 1024) + self._argmax_buf  # (the one-block form as it was, for comparison)
        return (max(1, min(PICK_GRID, -(-n // (4 * PICK_BLOCK)))), PICK_BLOCK) + self._argmax_buf

    def _pick_dev(self):
        """The device's pick of a run-ahead step: behind the routing ids (DeviceExperts.pick_slot:
        one copy down brings both) where the MoE's token path made them, else the pick's own."""
        slot = self.experts.pick_slot() if hasattr(self.experts, "pick_slot") else None
        return slot if slot is not None else self._pick[0]

    def _pick_buffers(self, banned: np.ndarray) -> None:
        """The greedy pick's device buffers for these banned ids: [token, NaN seen, max bits] and the
        banned ids on the device, with the pick's own pinned mirror (made again for other banned ids)."""
        rt = self.rt
        if self._pick is None or self._pick[2] is not banned:
            dev = rt.empty((3,), np.int32)
            ban = rt.to_device(np.ascontiguousarray(banned, np.int32)) if banned.size else rt.empty((1,), np.int32)
            self._pick = (dev, rt.pinned(12).view(np.int32), banned, ban)
            if self._graph is not None and self._graph[5]:  # (the captured run-ahead reads the old ones)
                self._graph, self._warm = None, None
        self._argmax_work(0)  # (its buffers made now: the step that launches it may be under capture)

    def _greedy(self, banned: np.ndarray) -> int:
        """dev_argmax over the step's logits -> the token (the sampler's greedy rule); a NaN or an
        infinite largest logit is refused as the sampler refuses it."""
        host = self._argmax(banned)
        self._wait_pick(host)
        return int(host[0])

    def _argmax(self, banned: np.ndarray, host=None):
        """dev_argmax over the step's logits into the device's pick, copied (queued) into `host` (a
        pinned [3] int32; default the pick's own) -> that host buffer."""
        rt = self.rt
        self._pick_buffers(banned)
        dev, own, _, ban = self._pick
        host = own if host is None else host
        V = self._logits.shape[1]
        grid, block, part, count = self._argmax_work(V)
        rt.launch(self._mod, "dev_argmax", grid, block, (self._logits, np.int32(V), ban, np.int32(banned.size), part, count,
                                                              dev), smem=4 * (3 * 32 + 1))
        rt.copy_out_async(host, dev)
        return host

    def _wait_pick(self, host) -> None:
        """A pick's wait (the next position staged first, `_ahead`): [token, NaN seen, max bits, ..]
        in `host`; a NaN or an infinite largest logit is refused as the sampler refuses it."""
        self._ahead()
        self.rt.synchronize()
        self._refuse(host)

    @staticmethod
    def _refuse(host) -> None:
        top = float(host[2:3].view(F32)[0])
        if host[1] or not np.isfinite(top):
            raise NonFiniteActivation(f"sampler: logits contain {'NaN' if host[1] else top} (max over the vocabulary); "
                                      "refusing to sample")

    def _ahead(self) -> None:
        """While the device still runs a picked step: the next position's inputs (`_at`) staged now,
        queued behind the step, so the next step starts with only its embedding row to send. The
        host's part of a step is on the critical path between two graphs (2026-12-02, H200: ~0.45 ms
        a token beside a 1.08 ms GPU floor); the position (and, before the rope tables, the ropes'
        cos and sin) was ~40 us of it.
        A next step elsewhere (another session, a rollback) stages its own position again."""
        if self._next_pos is not None:
            self._at(self._next_pos)
            self._next_pos = None

    # --- the run-ahead: step t + 1 queued before token t is read (Model.decode_ahead)

    def can_run_ahead(self, session) -> bool:
        """Whether this backend can queue `session`'s next step before its last pick comes back: the
        embedding table on the device in a type dev_embd_row decodes, no host work that needs the
        token (PLE hashes the token ids on the host, unless its table is on the device: `needs_token`,
        `ple`), and a slot map no token changes (an extra step queued past the last token must not
        admit experts)."""
        t = self.embd_table
        return t is not None and t[1] in EMBD_ROW_TYPES and not self.needs_token and self.experts.static()

    def _embd_gather(self, ids: np.ndarray):
        """(table, type id, row bytes) of the embedding on the device in a type dev_embd_rows decodes,
        `ids` (int64 [T]) checked against its rows; None where the host decodes the rows."""
        t = self.embd_table
        if t is None or t[1] not in EMBD_ROW_TYPES:
            return None
        table, type_id, row_bytes, rows = t
        if ids.size and not (0 <= ids.min() and ids.max() < rows):
            raise IndexError(f"token ids {ids.min()}..{ids.max()}: the embedding has {rows} rows")
        return table, type_id, row_bytes

    def _launch_embd(self, table, type_id: int, row_bytes: int, tok, T: int, n: int, out) -> None:
        # dev_embd_rows: rows tok [T] (device int32) of the table into out [T, n] (the reference decoder's bits)
        self._launch("dev_embd_rows", T * n, (table, np.int64(row_bytes), tok, np.int32(T), np.int32(type_id), np.int32(n), out))

    def embed_rows(self, ids: np.ndarray, n: int):
        """A prompt chunk's embedding rows [T, n], gathered on the device from the table in its blocks
        (dev_embd_rows: the reference decoder's bits), or None where the table is not on the device
        (the host decodes them, Model._forward_rows). `ids`: int64 [T], in the vocabulary (checked)."""
        t = self._embd_gather(ids)
        if t is None:
            return None
        out = self.rt.empty((ids.size, n), F32)
        self._launch_embd(*t, self.rt.to_device(np.ascontiguousarray(ids, np.int32)), ids.size, n, out)
        return out

    def verify_ids(self, T: int):
        """A verify's ids [T] int32 at their fixed device address (`verify_embed` gathers its rows from
        there; a verify run ahead's judge writes the next verify's there)."""
        key = ("ids", T)
        tok = self._verify_bufs.get(key)
        if tok is None:
            tok = self._verify_bufs[key] = self.rt.empty((T,), np.int32)
        return tok

    def verify_embed(self, ids: np.ndarray, n: int, stage: bool = True):
        """A verify's embedding rows gathered on the device inside its forward: the ids staged up to a
        fixed buffer now, and -> (the rows' fixed buffer [T, n], the launch that gathers them there),
        or None where the table is not on the device (the host decodes them: `stage_rows`). A
        captured verify replays the gather, reading the ids staged before it. Decoded on the host the
        rows of a verify of 3 cost ~0.2 ms of the host's time each verify on an H100 (demo
        qwen35moe, 2026-12-05, cProfile). `stage` False: the ids are on the device already (a verify
        run ahead: the last one's judge wrote them), `ids` only says how many."""
        t = self._embd_gather(ids)
        if t is None:
            return None
        T = ids.size
        tok = self.verify_ids(T)
        if stage:
            self._stage(tok, ids)
        out = self._row_buf((T, n))
        return out, lambda: self._launch_embd(*t, tok, T, n, out)

    def ple_rows(self, ids: np.ndarray, row_dim: int):
        """A prompt chunk's PLE rows [K, row_dim] of table rows `ids` (int64 [K], the host's hash),
        gathered on the device from the PLE table there (dev_ple_gather: the reference decoder's
        bits), or None where the table is on the host (the host decodes them and copies them up)."""
        p = self.ple
        if p is None:
            return None
        if row_dim != p.Pd:
            raise ValueError(f"PLE rows of {row_dim}: the table on the device has rows of {p.Pd}")
        if ids.size and not (0 <= ids.min() and ids.max() < p.n_rows):
            raise IndexError(f"PLE rows {ids.min()}..{ids.max()}: the table has {p.n_rows}")
        out = self.rt.empty((ids.size, row_dim), F32)
        dev = self.rt.to_device(np.ascontiguousarray(ids, np.int64))
        self._launch("dev_ple_gather", ids.size * row_dim, (p.table, np.int64(p.row_bytes), dev, np.int32(ids.size),
                                                             np.int32(p.type_id), np.int32(row_dim), out))
        return out

    def embed_picked(self, shape: tuple):
        """The next token step's embedding row, gathered on the device (dev_embd_row) from the token
        the last greedy pick left in device memory into `stage_row`'s fixed buffer (the graph reads
        it there): the reference decoder's bits, no host decode, no copy up, no wait."""
        if self._gathered is not None and self._gathered.shape == tuple(shape):
            return self._gathered  # the last step gathered it itself (dev_pick_next): nothing to queue
        table, type_id, row_bytes, rows = self.embd_table
        dev = self._row_buf(shape)
        n = shape[-1]
        self._launch("dev_embd_row", n, (table, np.int64(row_bytes), np.int32(rows), np.int32(type_id), np.int32(n),
                                         self._pick[0], dev))
        return dev

    def queue_greedy(self, banned: np.ndarray, picked: bool = False, merged: bool = False) -> tuple:
        """`_greedy`'s pick queued, not waited for -> (pinned pick, its event, the step's routing owed):
        `wait_picked` reads it. Two pinned picks in turn, so the next step's pick (queued before this
        one is read) lands in the other; the device's pick stays where `embed_picked` reads it."""
        rt = self.rt
        n = self.experts._buf["idsp"].size if merged else 3  # (merged: the routing ids, then the pick)
        if self._ahead_picks is None or self._ahead_picks[3] != n:
            ev = rt.events(2) if hasattr(rt, "events") else [None, None]
            self._ahead_picks = [[rt.pinned(4 * n).view(np.int32) for _ in range(2)], ev, 0, n]
        hosts, events, i, _ = self._ahead_picks
        self._ahead_picks[2] = 1 - i
        if merged:  # the step made its pick behind the routing ids (dev_pick_next): one copy down of both
            owed, host = self.experts.queue_with_pick(hosts[i])
        else:
            if picked:  # the step made its pick itself (dev_pick_next): only the copy down
                rt.copy_out_async(hosts[i], self._pick[0])
            else:
                self._argmax(banned, hosts[i])
            owed, host = None, hosts[i]
        if events[i] is not None:
            events[i].record()
        return host, events[i], owed if owed is not None else self.experts.detach()

    def wait_picked(self, pending: tuple) -> int:
        """A queued pick's token (`queue_greedy`), once its copy has landed (the steps queued after it
        may still run), the step's routing counted; refused as `_greedy` refuses a NaN or infinity."""
        host, done, owed = pending
        if done is None:
            self.rt.synchronize()
        else:
            done.synchronize()
        self._refuse(host)
        self.experts.settle_detached(owed)
        return int(host[0])

    def drop_picked(self, pending: tuple) -> None:
        """A queued step nobody reads (the run-ahead's step past its last token): its hit and miss
        counts taken back and its routing never counted, so --stats are the plain loop's."""
        self.rt.synchronize()
        self.experts.forget(pending[2])

    def _sample(self, draw) -> int:
        """dev_sample over the step's logits -> the token Sampler.sample picks from them with the
        uniform draw.r (engine/sampling.py's DeviceDraw): only the token (and the refusal flags) come
        back. The uniform goes up with the step's staged inputs; the penalty window lives on the
        device as a ring the kernel appends its pick to, uploaded only when the history is not the
        one it holds (a new run). Where the top-p set reaches beyond the 512 most probable tokens
        the device hands the pick back: the logits come down and the host samples them with the
        same r."""
        rt, sampler = self.rt, draw.sampler
        V = self._logits.shape[1]
        st = self._sampling
        if st is None or st[0] is not sampler or st[1] != V:
            sp, top_k, N = sampler.device_settings()
            banned = sampler.banned
            ban = rt.to_device(banned) if banned.size else rt.empty((1,), np.int32)
            mirror = np.zeros(N + 1, np.int32)
            mirror[N] = -1  # (the device's ring is not yet written)
            # work: the filtered logits the draw reads (Sampler._work's values, kept for the tests)
            st = self._sampling = (sampler, V, sp, np.int32(top_k), N, ban, np.int32(banned.size), mirror,
                                   rt.empty((V,), F32), rt.empty((V,), F32), rt.empty((max(N, 1),), F32),
                                   rt.empty((N + 1,), np.int32), rt.empty((8,), np.float64), rt.empty((4,), np.int32),
                                   rt.pinned(16).view(np.int32))
        _, _, sp, top_k, N, ban, nb, mirror, work, prob, pen, hist, spd, dev, host = st
        if N:
            h = draw.history
            L = len(h)
            m = min(N, L)
            at = np.arange(L - m, L) % N  # (window-sized, as Sampler._penalise's temporaries)
            if mirror[N] != L or not np.array_equal(mirror[at], h[L - m :]):
                win = np.asarray(h[L - m :], np.int64)
                sampler.check_history(win)
                mirror[at] = win
                mirror[N] = L
                self._stage(hist, mirror)
        sp[0] = 0.0 if draw.r is None else draw.r
        self._stage(spd, sp)
        rt.launch(self._mod, "dev_sample", 1, 1024, (self._logits, np.int32(V), ban, nb, work, prob, hist, np.int32(N), pen,
                                                      spd, top_k, dev), smem=8 * (34 + 1024) + 4 * (34 + 258 + 512))
        rt.copy_out_async(host, dev)
        self._wait_pick(host)
        if host[3]:  # the top-p set is wider than the device's sort: the host samples (the ring is resent next)
            rt.copy_out(draw.row.reshape(1, -1), self._logits)
            return sampler.sample_drawn(draw.row, draw.history, draw.r)
        token = int(host[0])
        if N:
            mirror[mirror[N] % N] = token
            mirror[N] += 1
        return token

    def pick_rows(self, logits, banned: np.ndarray) -> np.ndarray:
        """The greedy token of each row of the device logits [n, n_vocab] (a verify's): dev_argmax's on
        each row (dev_argmax_rows), `_greedy`'s rule, the banned ids never -> int64 [n]; only the
        picks come down, in one copy after one wait. A NaN or an infinite largest logit is refused as
        the sampler refuses it."""
        self.pick_rows_ready(logits.shape[0], banned)
        self.queue_pick_rows(logits, banned)
        self.rt.synchronize()
        return self.picked_rows(logits.shape[0], banned)

    def pick_rows_ready(self, n: int, banned: np.ndarray) -> None:
        """pick_rows' buffers for n rows and these banned ids (made before a verify's capture).

        One set for each list of banned ids (by the ids), kept: a captured verify or draft keeps
        the addresses of the set it was captured with. Once the set was made again whenever the
        banned array was another object; serve's requests each have their own, so with two requests
        taking turns (2026-12-06, an H100, --spec 2) a replayed draft wrote its picks into the
        other set's freed buffers while its picks were read from buffers no launch had written:
        "logits row 0 of 1 contain NaN", which killed serve's worker."""
        rt, key = self.rt, self._ban_key(banned)
        got = self._rows_picks.get(key)
        if got is None or got[0] < n:
            if got is not None:  # the graphs captured with the smaller set write into it: made again
                self._vgraphs.clear()
            rows = max(n, 8)
            ban = rt.to_device(np.frombuffer(key, np.int32).copy()) if banned.size else rt.empty((1,), np.int32)
            self._rows_picks[key] = (rows, rt.empty((rows, 3), np.int32), rt.pinned(12 * rows).view(np.int32).reshape(-1, 3), ban,
                                     rt.empty((rows, 3 * PICK_GRID), np.int32), self.zeros((rows,), np.int32))
        self._argmax_work(1)  # (the one-row pick's parts and counter, made here, before any capture: queue_pick_rows asks it for the grid)

    @staticmethod
    def _ban_key(banned: np.ndarray) -> bytes:
        return np.ascontiguousarray(banned, np.int32).tobytes()

    def queue_pick_rows(self, logits, banned: np.ndarray, down: bool = True) -> None:
        """pick_rows' launches and its copy down, queued (`picked_rows` reads them after a wait);
        `down` False: no copy down (a verify run ahead: its judge's record brings the picks)."""
        rt = self.rt
        n, V = logits.shape
        if not logits.flags.c_contiguous:  # (the launch reads row r at r V)
            raise ValueError(f"queue_pick_rows: logits {list(logits.shape)} are not contiguous rows")
        _, dev, host, ban, part, count = self._rows_picks[self._ban_key(banned)]
        grid, block, _, _ = self._argmax_work(V)
        # every row in one launch, each row dev_argmax's grid on its own parts and ticket (the same bits)
        rt.launch(self._mod, "dev_argmax_rows", grid * n, block, (logits, np.int32(V), np.int32(grid), ban, np.int32(banned.size),
                                                                   part, count, dev), smem=4 * (3 * 32 + 1))
        if down:
            rt.copy_out_async(host[:n], dev[:n])

    def picks_dev(self, banned: np.ndarray):
        """pick_rows' device picks [rows, 3] for these banned ids (pick_rows_ready made them)."""
        return self._rows_picks[self._ban_key(banned)][1]

    # --- a verify run ahead of the host (engine/tier/verify_ahead.py)

    @property
    def ahead_verify(self):
        if self._verify_ahead is None:
            from .verify_ahead import VerifyAhead

            self._verify_ahead = VerifyAhead(self)
        return self._verify_ahead

    def can_verify_ahead(self, session) -> bool:
        """Whether a greedy verify of `session` can run ahead of the host (Model.verify_ahead): the
        embedding table on the device in a type dev_embd_rows decodes (the next verify's rows are
        gathered from the ids its judge wrote), every expert resident (the rows route with no host
        part) and a slot map no token changes."""
        t = self.embd_table
        return t is not None and t[1] in EMBD_ROW_TYPES and self.experts.static() and self.experts.all_resident()

    def picked_rows(self, n: int, banned: np.ndarray) -> np.ndarray:
        """The picks of the last `queue_pick_rows` of n rows for these banned ids, after a wait."""
        host = self._rows_picks[self._ban_key(banned)][2]
        self.refuse_rows(host, n, n)
        return host[:n, 0].astype(np.int64)

    @staticmethod
    def refuse_rows(picks, upto: int, n: int) -> None:
        """`_refuse`'s rule on rows 0..upto-1 of n rows' picks [n, 3] (dev_argmax's [token, NaN seen,
        max bits] a row): a NaN or an infinite largest logit is refused as the sampler refuses it."""
        for i in range(upto):
            top = float(picks[i, 2:3].view(F32)[0])
            if picks[i, 1] or not np.isfinite(top):
                raise NonFiniteActivation(f"sampler: logits row {i} of {n} contain {'NaN' if picks[i, 1] else top} (max "
                                          "over the vocabulary); refusing to sample")

    def top_prob_ready(self) -> None:
        """dev_top_prob's buffers, made once (before a capture): its parts, counter, result and the
        result's pinned mirror."""
        if self._top_prob is None:
            rt = self.rt
            self._top_prob = (rt.empty((2 * PICK_GRID,), np.float64), self.zeros((1,), np.int32),
                              rt.empty((1,), np.float64), rt.pinned(8).view(np.float64))

    def queue_top_prob(self, row) -> None:
        """dev_top_prob over the device logits `row` [n_vocab] (a draft's top probability at
        temperature 1) and its copy down, queued: `top_prob` reads it after a wait."""
        part, count, out, host = self._top_prob
        n = row.shape[-1]
        grid = max(1, min(PICK_GRID, -(-n // (4 * PICK_BLOCK))))
        self.rt.launch(self._mod, "dev_top_prob", grid, PICK_BLOCK, (row, np.int32(n), part, count, out),
                       smem=33 * 8 + 32 * 4 + 4)
        self.rt.copy_out_async(host, out)

    def top_prob(self) -> float:
        return float(self._top_prob[3][0])

    def boundary(self, what) -> None:
        """While `_floor_step` captures: the part captured so far becomes a graph of its own (it
        runs), and the next part, named `what` (a layer, "head"), is captured."""
        if self._cuts is None:
            return
        graph = self.rt.end_capture()
        self.rt.replay(graph)
        self._cuts.append((self._cut_at, graph))
        self._cut_at = what
        self.rt.begin_capture()

    def _floor_step(self, run, reps: int = 50, kernels: bool = False) -> None:
        """This token step captured in parts (before the first layer, each layer, the head: cut at
        every `boundary`), which run as they are cut (so the step is made), then each part replayed
        `reps` times back to back with no host work between, timed with CUDA events -> self.floor.
        A measurement: those replays advance the session's states again (--gpu-floor, the
        benchmarks). Only a step with no host work inside (every expert resident) is timed so."""
        rt = self.rt
        launch = rt.launch
        if kernels:  # every launch a part of its own, named (the part before it, the kernel): a profile
            where, cut = ["pre"], self.boundary

            def cut_launch(mod, name, *args, **kwargs):
                cut((where[0], name))  # (the class's boundary: the patched one below would rename the part)
                launch(mod, name, *args, **kwargs)

            def cut_boundary(what):
                where[0] = what
                cut((what, "-"))

            rt.launch, self.boundary = cut_launch, cut_boundary
        try:
            with rt.allocating_from(self._pool):
                self._cuts, self._cut_at = [], "pre"
                rt.begin_capture()
                try:
                    run(self._logits)
                finally:
                    last = rt.end_capture()
                    cuts, self._cuts = self._cuts + [(self._cut_at, last)], None
                rt.replay(last)
        finally:
            if kernels:
                rt.launch = launch
                del self.boundary
        start, stop = rt.events(2)
        floor = []
        for label, graph in cuts:
            rt.synchronize()
            start.record()
            for _ in range(reps):
                rt.replay(graph)
            stop.record()
            floor.append((label, rt.elapsed(start, stop) / reps))
        self.floor = floor

    def at_host(self, fn) -> None:
        """Host work a token step needs mid-way (a layer's misses), after what is queued so far.
        Eagerly: now. While token_step captures: the capture so far becomes a segment, which runs,
        then fn, and the capture goes on; a replay does the same in the same order."""
        if self._segments is None:
            fn()
            return
        graph = self.rt.end_capture()
        self.rt.replay(graph)
        fn()
        self._segments += [graph, fn]
        self.rt.begin_capture()

    def _replay(self, segments: list) -> None:
        for s in segments:
            if hasattr(s, "launch"):  # a graph
                self.rt.replay(s)
            else:  # the host work of a cut
                s()

    def gpu_floor(self, reps: int = 50) -> float | None:
        """Seconds of device time per token step: the captured step replayed `reps` times back to back
        with no host work between (CUDA events around them), or None before a step was captured. A
        measurement only: each replay advances the captured session's states again."""
        if self._graph is None or len(self._graph[1]) > 1:  # (with misses the host is part of a step)
            return None
        start, stop = self.rt.events(2)
        self.rt.synchronize()
        start.record()
        for _ in range(reps):
            self.rt.replay(self._graph[1][0])
        stop.record()
        if self._graph[5]:  # a run-ahead step advanced the device position (to its context's last at most)
            self._pos_at = self._gathered = None
        return self.rt.elapsed(start, stop) / reps

    def route(self, logits, k: int):
        """The router's top-k on the host (moe.route_topk: the CPU's float64 ranking and weights), from
        the logits brought down: which experts run is decided where the misses are computed."""
        return route_topk(self.rt.to_host(logits), k)

    def combine(self, part, slot: np.ndarray, weights: np.ndarray, out):
        """moe.combine_reference on the device: out = sum over ranks j, from 0, of f32(w_j) part[slot_j]."""
        xp = self.xp
        w = self.upload(np.ascontiguousarray(weights, dtype=F32))
        sl = self.upload(np.ascontiguousarray(slot, dtype=np.int64))
        if part.flags.c_contiguous and out.flags.c_contiguous:
            T, k = slot.shape
            E = out.shape[1]
            self._launch("dev_combine", T * E, (part, sl, w, out, np.int32(T), np.int32(k), np.int32(E)))
            return out
        out[...] = 0
        for j in range(slot.shape[1]):
            out += w[:, j : j + 1] * part[sl[:, j]]
        return out
