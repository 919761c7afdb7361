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

The hit path (S10) is all-or-nothing: the tier becomes the model's backend (engine/backend.py) only
when the slots, the fill, the hit buffers and the exchange buffers are all in place; otherwise
every expert is a CPU miss and the log says why.

The rooms, one job each:
    memory.py    free/used device memory as the plan counts it, the stage arenas, mem_mark
    dense.py     W x of the placed dense weights (the LM head among them)
    slots.py     the expert slot storage and its one fill
    hits.py      the routed experts the slots hold, beside the CPU's misses (the MoE's expert server)
    staging.py   a prompt chunk's non-resident experts streamed to the device (two slots, double-buffered)
    backend.py   the CPU backend with those plugged in (the host-driven step, --gpu-step host)
    device.py    the device step (--gpu-step device): the blocks on device arrays, its kernels in device_kernels.cu
    draft.py     the MTP draft head on the device step (--spec N): its experts in slots of their own
    verify_ahead.py  a greedy verify run ahead of the host (--spec N): judged and rolled back on the device
    compile_ahead.py a first start's kernel modules compiled side by side, into CuPy's disk cache
    startup.py   the seven stages, one method each (this module)

S12: nothing is allocated on the device or in pinned memory once started; every buffer of the
token path is a view carved at startup (tests/gpu/test_gpu_tier.py counts the allocations).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from strata.index_format.expert_profile import ExpertProfile
from strata.index_format.geometry import tensor_specs
from strata.index_format.manifest import pack_fingerprint

from .. import budget as B
from ..backend import CpuBackend
from ..budget import Budget, BudgetOptions, ExpertCacheTooBig, plan_budget
from ..expert_plan import MiB, check_profile, fill_policy_line, plan_fill, prefill_mib
from ..kernels import cpu, gpu
from ..kernels.engine_form import placed_bytes
from ..model import Model, Session
from . import compile_ahead
from .backend import TierBackend
from .device import DEVICE_ATTN_TILE_BYTES, DeviceBackend, DeviceExperts
from .dense import Dense
from .hits import HitPath, HitStats
from .memory import Carver, DeviceMemory, MemMark
from .slots import ExpertSlots
from .staging import REGISTER_SHARE, LayerStream, Staging, auto_layer_tokens, auto_min_tokens, host_memory_bytes, registry_line


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
    # where the blocks compute: "host" (the host drives them; only the products run on the device:
    # engine/tier/backend.py) or "device" (the whole forward on the device: engine/tier/device.py)
    step: str = "host"
    # a prompt chunk's non-resident expert routed at least this many of its tokens is streamed to the
    # device (engine/tier/staging.py); None: auto (staging.auto_min_tokens); 0: never (off)
    stream_min_tokens: int | None = None
    # the device step streams a layer's non-resident experts whole for a prompt chunk of at least
    # this many tokens (staging.LayerStream, where its plan items fit); None: auto (staging.auto_layer_tokens
    # at the rate measured at startup); 0: never. --stream-min-tokens off turns it off too
    stream_layer_tokens: int | None = None
    # ... and page-locks the GGUF pages it streams (cudaHostRegister, up to staging.REGISTER_SHARE of
    # the host's memory), DMAing them with no host copy; False: every layer through pinned pieces
    stream_register: bool = True
    # --spec N: the verifier's buffers are placed at stage 7 (the logits of 1 + N rows; with the
    # device step, the N per-row snapshots of the states, `GpuTier.snapshots`)
    spec: int = 0
    # with spec and an MTP block: the head drafts on the device (its weights at stage 1, its experts,
    # KV cache and rope table at stage 7: engine/tier/draft.py; the device step only)
    draft: bool = False
    # strata serve --batch B: the device step places B sessions (each with its --spec snapshots and
    # draft KV cache), which the server lends to its requests (engine/tier/sessions.py)
    batch: int = 1


PROMPT_PIECES = (512, 1024, 2048, 4096)  # GpuTier.prompt_piece's candidates (llama.cpp's default batch is 2048)


@dataclass
class GpuTier:
    model: Model
    plan: Budget
    marks: list[MemMark]
    slots: ExpertSlots
    stats: HitStats
    hit_path: HitPath
    lines: list[str] = field(default_factory=list)
    session: Session | None = None  # the device step's first session, allocated at stage 1 as planned
    snapshots: list = field(default_factory=list)  # its verify snapshots, allocated at stage 7 (--spec N, device step)
    # every session the device step placed (--batch B: B, the first one `session`) and each one's snapshots
    sessions: list = field(default_factory=list)
    snapshot_sets: list = field(default_factory=list)
    memory: DeviceMemory | None = None  # free device memory as the tier counts it (--vram-budget-mib included)

    def prompt_piece(self, chunk: int) -> int:
        """--prefill auto's piece of the prompt a forward takes on the device step: the chunk the
        buffers are planned for (256), or up to PROMPT_PIECES' largest (4096) where the memory free
        now holds what the larger piece's temporaries add (prefill_mib's 680 KiB a token, the seed's
        figure for the chunk buffers) and the reserve's headroom stays. A piece past the buffers runs
        through them (the dense products in rows, the experts in runs; a layer streamed whole once
        for the piece, not once per 256 tokens: on the H200, seed-4l qwen4exp with every expert in
        host memory ran a 4096-token forward at 16.8K tok/s, where 256-token forwards copy every
        layer again each, ~1.5K tok/s). The host-driven step: the chunk."""
        o = self.plan.options
        if not o.device_step or chunk <= 0 or self.memory is None:
            return chunk
        free = self.memory.free()
        headroom = (self.plan.reserve.headroom_mib if self.plan.reserve is not None else o.vram_reserve_mib) * MiB
        # the attention's scores at the full context, and their masked copy: query tiles of at most
        # DEVICE_ATTN_TILE_BYTES (DeviceBackend.attention), so a larger piece adds up to 2 GiB here
        attn = lambda n: 2 * min(DEVICE_ATTN_TILE_BYTES, 4 * self.model.geometry.n_head * n * o.max_context)  # noqa: E731
        piece = chunk
        for n in PROMPT_PIECES:
            more = (prefill_mib(n) - prefill_mib(chunk)) * MiB + attn(n) - attn(chunk)
            if chunk < n <= o.max_context and free - more >= headroom:
                piece = n
        return piece

    def take_session(self, max_context: int, kv: str) -> Session:
        """The session the plan counted (the device step's, made at stage 1) the first time it fits
        the request, else a new one."""
        s, self.session = self.session, None
        if s is not None and s.max_context == max_context and s.kv == kv and s.pos == 0:
            return s
        return self.model.new_session(max_context, kv)

    @classmethod
    def start(cls, model: Model, o: TierOptions, log: Callable[[str], None] = lambda _: None) -> GpuTier:
        """S6's stages in S7's order; returns the running tier (the model's backend is the tier's)."""
        s = _Startup(model, o, log)
        s.weights()
        s.open_cache()
        s.fill()
        s.hit_path()
        s.cache_graphs()
        s.head_prompt()
        s.verifier()
        return cls(model, s.plan, s.marks, s.slots, s.stats, s.hits, s.bind(), s.session, s.snapshots, memory=s.mem,
                   sessions=s.sessions, snapshot_sets=s.snapshot_sets)

    def stop(self) -> None:
        """Unbind from the model (it runs on the CPU again) and give the device memory back."""
        for w in self.model.pack.weights.values():
            w.device = None
        self.model.backend = CpuBackend()
        self.model.draft_head = None
        if self.hit_path is not None and self.hit_path.layers is not None:
            self.hit_path.layers.close()  # (its worker's copies land in buffers given back below)
        self.slots.weights.clear()
        self.slots.arena = self.hit_path = None
        gc.collect()
        gpu.runtime().release()


class _Startup:
    """The seven stages, one method each, in order; each allocates its plan items and marks."""

    def __init__(self, model: Model, o: TierOptions, log: Callable[[str], None]):
        self.rt, self.model, self.o, self.log = gpu.runtime(), model, o, log
        pack, g = model.pack, model.geometry
        self.g, self.lines, self.marks = g, [], []
        if o.profile is not None:
            check_profile(o.profile, pack_fingerprint=pack_fingerprint(pack.dir), n_layer=g.n_layer, n_expert=g.n_expert,
                          top_k=g.n_expert_used)
        if o.step not in ("host", "device"):
            raise GpuTierError(f"--gpu-step {o.step!r}: expected host or device")
        rt = self.rt
        rt.use_stream()
        # memory a previous tier or test left would hide this one's: what is cached in the pool, and
        # what only the cycle collector frees (2026-12-05, an H100: after a test whose tier had
        # captured the draft head's steps, each with a graph pool of its own, 298 MiB came free between
        # two marks of the next startup, so a stage "used" -298 MiB)
        gc.collect()
        rt.release()
        bopts = BudgetOptions(max_context=o.max_context, kv=o.kv, vram_reserve_mib=o.vram_reserve_mib,
                              prefill_chunk=o.prefill_chunk, expert_cache=o.expert_cache,
                              profile_pairs=o.profile.pairs if o.profile is not None else None,
                              device_step=o.step == "device", stream_experts=o.stream_min_tokens != 0,
                              stream_layers=o.stream_layer_tokens != 0, spec=o.spec, draft_device=o.draft, batch=o.batch,
                              cublas_held=getattr(rt, "cublas_held", lambda: False)())
        # every kernel the run will launch, compiled now (not inside the first token's time) and
        # before the baseline: a module's code and tables are the context's memory, not the plan's
        self.mats = [pack.weight(s.name) for s in tensor_specs(g) if s.multiplied and s.name in pack.weights]
        # the MTP head's matrices, where it drafts on the device (placed with the trunk's, stage 1)
        self.draft_mats = [pack.weight(n) for n in B.draft_matrices(g)] if B.draft_on_device(g, bopts) else []
        types = {w.type.name for w in self.mats + self.draft_mats} | \
            {t.name for l in range(g.n_layer + (1 if self.draft_mats else 0)) for t in pack.expert_types(l)}
        # a first start compiles them side by side in processes of their own (compile_ahead.py says why)
        keys = sorted(types | {"actq"})
        # (and where drafts are verified on the one-row kernel's NT rows, gpu.MVT_TOKENS, the dense
        # block types' few-row products: gpu.ROWS)
        rows = o.spec and gpu.MVT_TOKENS > 1
        keys += sorted({w.type.name + gpu.ROWS for w in self.mats + self.draft_mats if w.type.quantized}) if rows else []
        card = compile_ahead.card_of_runtime(rt)
        compile_ahead.ahead(keys + ([compile_ahead.DEVICE_STEP] if o.step == "device" else []), card,
                            lambda text: self.say(f"gpu tier: {text}"))
        for name in keys:
            gpu.compile_module(name)
        compile_ahead.mark_loaded(keys, card)
        self.mem = DeviceMemory(rt, o.vram_budget_mib)
        self.free0 = self.mem.free()
        ple = pack.ple if g.ple_layers else None
        self.plan = plan_budget(pack.index, pack.experts, g, bopts, free_bytes=self.free0,
                                ple_table_bytes=None if ple is None else ple.nbytes,
                                ple_table_type=None if ple is None else ple.type_id)
        self.say(f"gpu tier: {self.free0 / MiB:.0f} MiB free at start"
                 + (f" (--vram-budget-mib {o.vram_budget_mib})" if o.vram_budget_mib is not None else ""))
        self.n_slots = 0
        self.device = DeviceBackend(rt, None) if o.step == "device" else None
        if self.device is not None:
            compile_ahead.mark_loaded([compile_ahead.DEVICE_STEP], card)
        self.session, self.sessions = None, []

    def say(self, text: str) -> None:
        self.lines.append(text)
        self.log(text)

    def mark(self, stage: str) -> None:
        # the plan's figure, with the slots the cache really opened with (sized from measured free memory)
        plan = self.plan
        predicted = plan.used_after(stage)
        if B.STAGES.index(stage) >= B.STAGES.index(B.OPEN_CACHE):
            predicted += self.n_slots * plan.slot_bytes - plan.device_bytes(B.OPEN_CACHE)
        m = MemMark(stage, self.mem.free(), self.mem.used(), predicted, self.mem.card_used())
        self.marks.append(m)
        self.say(m.line(len(self.marks)))

    def arena(self, items: list[B.Item], name: str) -> Carver:
        n = sum(i.bytes for i in items if i.where == B.DEVICE)
        return Carver(self.rt, self.rt.empty((n,), np.uint8) if n else None, name)

    def weights(self) -> None:
        """1. The weights (the LM head among them: S7, before the cache is sized) and the session (host
        memory, or the device step's first session on the device)."""
        plan = self.plan
        if plan.device_bytes(B.WEIGHTS) > self.free0:
            raise GpuTierError(f"the dense weights need {plan.device_bytes(B.WEIGHTS) / MiB:.1f} MiB of device memory, "
                               f"{self.free0 / MiB:.1f} MiB are free: use --device cpu or a larger card")
        # the device step's sessions are the model's own allocations (their states are device arrays), not the arena's
        weights = self.arena([i for i in plan.items if i.stage == B.WEIGHTS and not i.key.startswith(("session.", "serve."))],
                             "the dense weights")
        self.placed = []
        for w in self.mats + self.draft_mats:  # (the head's: weights.drafter, B.draft_on_device)
            at = weights.take(placed_bytes(w.type_id, w.n_in, w.n_out))
            self.placed.append((w, gpu.place(w.raw, w.type_id, w.n_in, w.n_out, weights.arena, at, w.name)))
        if self.device is not None and self.plan.places("weights.ple_table"):
            self._place_ple(weights)
        for note in self.plan.notes:  # (where the PLE table went, and so whether greedy decoding runs ahead)
            self.say(note)
        if self.device is not None:  # (after the PLE table: a session's PLE state asks whether it is placed)
            self.sessions = [Session(self.model, self.o.max_context, self.o.kv, backend=self.device)
                             for _ in range(self.o.batch)]  # (serve.batch: the --batch - 1 beside the first)
            self.session = self.sessions[0]
        if self.device is not None:  # the rope tables' planned bytes (weights.rope: DeviceBackend._rope_table)
            n = self.plan.item("weights.rope").bytes
            self.device.rope_arena = self.rt.view(weights.arena, weights.take(n), (n,), np.uint8)
        if self.device is not None and self.plan.places("weights.embedding"):
            # the embedding in its GGUF blocks (budget: weights.embedding): the run-ahead gathers the
            # next token's row on the device from the device's pick (DeviceBackend.embed_picked)
            e = self.model.embd
            table = self.rt.view(weights.arena, weights.take(e.raw.nbytes), (e.raw.nbytes,), np.uint8)
            self.rt.copy_in(table, np.ascontiguousarray(e.raw).view(np.uint8).reshape(-1))
            self.device.embd_table = (table, e.type.id, e.type.row_bytes(e.n_in), e.n_out)
        self.rt.synchronize()
        self.mark(B.WEIGHTS)

    def _place_ple(self, weights: Carver) -> None:
        """The PLE table in its GGUF bytes (budget: weights.ple_table, placed by budget.ple_on_device's
        rule) and DevicePLE's constants and buffers beside it: the run-ahead hashes the next token's
        n-grams and gathers their rows on the device (dev_ple_rows)."""
        from .device import DevicePLE

        t, raw = self.model.pack.ple, self.model.pack.ple_table()
        table = weights.array((raw.nbytes,), np.uint8)
        self.rt.copy_in(table, np.ascontiguousarray(raw).view(np.uint8).reshape(-1))
        layers = list(self.g.ple_layers)
        self.device.ple = DevicePLE([self.model.ple[l].hash for l in layers], layers, table, t.type_id, t.row_dim, t.rows,
                                    weights.array, self.rt.copy_in)

    def open_cache(self) -> None:
        """2. The expert cache, sized from the free memory measured now (S7)."""
        plan, o = self.plan, self.o
        free_open = self.mem.free()
        sp = plan.slots_for(free_open)
        if sp.problems:  # S7: refused with both numbers, never handed back smaller
            raise (ExpertCacheTooBig if o.expert_cache is not None else GpuTierError)("; ".join(sp.problems))
        n_slots = sp.slots
        if o.expert_cache is not None and n_slots > plan.n_pairs:
            raise ExpertCacheTooBig(f"--expert-cache {n_slots}: the model has {plan.n_pairs} (layer, expert) pairs, "
                                    f"so at most {plan.n_pairs} slots hold anything")
        if sp.auto_line:
            self.say(sp.auto_line)
        else:
            self.say(f"expert cache {n_slots} slots (--expert-cache): {n_slots * plan.slot_bytes / MiB:.1f} MiB of "
                     f"{(free_open - sp.reserve.bytes) / MiB:.1f} MiB free beside the {sp.reserve.bytes / MiB:.0f} MiB reserve")
        if sp.reserve.adapted:
            self.say(f"small card: the reserve shrinks from {sp.reserve.asked_mib} to {sp.reserve.headroom_mib} MiB")
        self.slot_arena = self.rt.empty((n_slots * plan.slot_bytes,), np.uint8) if n_slots else None
        self.n_slots = n_slots
        self.mark(B.OPEN_CACHE)

    def fill(self) -> None:
        """3. The profile fill (S9), once, through one pinned slot of staging."""
        plan, g, o, n_slots = self.plan, self.g, self.o, self.n_slots
        staging = self.rt.pinned(plan.item("fill.staging").bytes) if n_slots else None
        self.slots = slots = ExpertSlots(self.rt, self.model, self.slot_arena, n_slots, plan.slot_bytes, staging)
        self.say(f"expert cache fill: {fill_policy_line(o.profile) if n_slots < plan.n_pairs else 'every pair (one slot per expert)'}")
        if n_slots >= plan.n_pairs:
            slots.fill([list(range(g.n_expert))] * g.n_layer)
        elif o.profile is not None and n_slots:
            fill = plan_fill(o.profile, n_slots, g.n_layer)
            slots.fill(fill)
            self.say("expert cache fill: " + " ".join(f"L{l}:{len(f)}" for l, f in enumerate(fill))
                     + f" ({sum(map(len, fill))} slots)")
        self.rt.synchronize()
        self.mark(B.FILL)

    def hit_path(self) -> None:
        """4. The hit path's device buffers and pinned exchange."""
        self.stats = HitStats.empty(self.g.n_layer)
        buffers = self.arena([self.plan.item("hits.buffers")], "the hit buffers")
        exchange = self.rt.pinned(self.plan.item("hits.exchange").bytes)
        self.hits = HitPath(self.rt, self.g, self.slots, buffers, exchange, self.stats)
        if self.device is not None:
            self.device.experts = DeviceExperts(self.rt, self.hits, self.device)
        self.mark(B.HIT_PATH)

    def cache_graphs(self) -> None:
        """5. The slot table (host: slots.map) and the dense path's staging."""
        self.staging = self.arena([self.plan.item("dense.staging")], "the dense staging")
        self.mark(B.CACHE_GRAPHS)

    def head_prompt(self) -> None:
        """6. The head's logits and the prompt path's chunk buffers."""
        rt, g, plan, o = self.rt, self.g, self.plan, self.o
        head_dev = rt.empty((g.n_vocab,), np.float32)
        head_host = rt.pinned(plan.item("head.logits_host").bytes).view(np.float32)
        prompt = self.arena([plan.item("prompt.chunk")], "the prompt chunk buffers")
        gemm = plan.item("prompt.gemm")
        if gemm.bytes and self.device is not None:
            shapes = sorted({(gw.n_in, gw.n_out) for _, gw in self.placed if gw.type.quantized})
            self.device.gemm_slab(self.arena([gemm], "the dense GEMM slab").arena.view(np.uint16), shapes,
                                  min(o.max_context, 4096))
        self.dense = dense = Dense(rt, g, self.staging, self.model.head, head_dev, head_host, prompt)
        if dense.rows:  # the prompt path's experts borrow its output rows: a chunk's matrices run one at a time
            self.hits.prompt = rt.view(dense.py.reshape(-1).view(np.uint8), 0, (dense.py.size * 4,), np.uint8)
        staging = plan.item("stream.staging")
        if staging.bytes:
            arena = self.arena([staging], "the streamed experts' staging").arena
            pinned = rt.pinned(plan.item("stream.pinned").bytes)
            if dense.rows:
                st = Staging(rt, self.model.pack, arena, pinned, plan.slot_bytes, g.n_embd, g.n_ff_exp,
                             o.stream_min_tokens or 0)
                how = "--stream-min-tokens"
                if o.stream_min_tokens is None:
                    rate = st.widen_rate()
                    st.min_tokens = auto_min_tokens(plan.slot_bytes, g.n_embd, g.n_ff_exp, cpu.get_threads(), rate)
                    how = f"auto: the host widens an expert at {rate / 1e9:.2f} GB/s, {cpu.get_threads()} CPU threads"
                self.hits.staging, n = st, st.min_tokens
                self.say(f"prompt path: a chunk's non-resident expert routed {n} or more of its tokens is streamed "
                         f"to the device ({how}; {staging.count} staging slots of {plan.slot_bytes / MiB:.1f} MiB)")
        layers = plan.item("stream.layers")
        if layers.bytes:  # (planned only for the device step with a prompt path)
            self.hits.layers = ls = LayerStream(
                rt, self.model.pack, self.device._launch, self.arena([layers], "the layer stream's buffers").arena,
                self.arena([plan.item("stream.raw")], "the layer stream's device piece").arena,
                rt.pinned(plan.item("stream.layer_pinned").bytes), plan.slot_bytes,
                B.layer_piece_bytes(plan.max_blob), cpu.get_threads(), o.stream_layer_tokens or 0, self.stats,
                register_cap=int(REGISTER_SHARE * host_memory_bytes()) if o.stream_register else 0)
            how = "as set"
            if o.stream_layer_tokens is None:
                rate = ls.rate()
                nbytes = sum(t.nbytes for t in self.model.pack.expert_tensors(0))
                ls.min_tokens = auto_layer_tokens(nbytes, rate, g.n_embd, g.n_ff_exp, g.n_expert_used, cpu.get_threads())
                how = f"auto: a layer's {nbytes / MiB:.0f} MiB stream at {rate / 1e9:.2f} GB/s, {cpu.get_threads()} CPU threads"
            self.say(f"prompt path: a chunk of {ls.min_tokens} or more tokens streams each layer's non-resident experts "
                     f"whole and widens them on the device ({how}; {layers.count} layer buffers of {layers.each / MiB:.0f} MiB)")
            self.say(registry_line(ls.registry))
        self.mark(B.HEAD_PROMPT)

    def verifier(self) -> None:
        """7. The verifier and the drafter's binding: none without --spec / --mtp. With --spec N the
        verify's logits (1 + N rows) and, with the device step, its N snapshots of the session's
        states (engine/speculative.py Snapshot), device arrays a verify copies into and a rollback
        copies from."""
        self.snapshots, self.snapshot_sets = [], []
        if self.o.spec and self.device is not None:
            from ..speculative import Snapshot

            self.device.verify_logits = self.rt.empty((self.o.spec + 1, self.model.geometry.n_vocab), np.float32)
            self.snapshot_sets = [[Snapshot(s, self.device) for _ in range(self.o.spec)] for s in self.sessions]
            self.snapshots = self.snapshot_sets[0]
        self.draft_head = None
        if B.draft_on_device(self.g, self.plan.options):
            from .draft import place_draft_head

            g, o = self.g, self.o
            # draft.bind's experts in one arena (its KV cache and rope table are allocations of their own)
            arena = self.arena([B.Item("draft.experts", "", g.n_expert * self.plan.slot_bytes, B.VERIFIER)],
                               "the draft head's experts")
            self.draft_head = place_draft_head(self.rt, self.model, self.device, arena, self.plan.slot_bytes,
                                               self.slots.staging, o.max_context, o.kv, o.prefill_chunk, o.batch)
            self.say(f"draft head: the MTP block on the device ({g.n_expert} experts in slots of their own, "
                     f"{self.plan.options.draft_bind_bytes / MiB:.0f} MiB with its KV cache and rope table; "
                     f"its matrices {self.plan.options.drafter_bytes / MiB:.0f} MiB with the weights)")
        self.rt.synchronize()
        self.mark(B.VERIFIER)
        low = B.low_memory_warning(self.mem.free())
        if low:
            self.say(low)

    def bind(self) -> list[str]:
        """All or nothing (S10): the tier becomes the model's backend only now, with the slots filled
        and every buffer in place. Returns the startup's lines."""
        for w, dev in self.placed:
            w.device = dev
        self.model.backend = self.device if self.device is not None else TierBackend(self.dense, self.hits)
        self.model.draft_head = self.draft_head
        self.say(f"hit path: ready, GPU hits beside CPU misses ({self.slots.map.used} of {self.n_slots} slots filled)"
                 if self.n_slots else "hit path: ready, but with no expert slots every expert is a CPU miss"
                 + (" (a prompt chunk's streamed ones aside)" if self.hits.staging is not None else ""))
        return self.lines
