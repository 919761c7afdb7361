"""The GPU engine's memory plan, from the pack alone: every buffer, its bytes, and the startup stage
that allocates it (S6), plus the expert slots that fit beside them (S8).

THE PLAN IS THE ALLOCATION. The GPU engine allocates every device and pinned-host buffer FROM these
items (`Budget.item(key)`: one allocation of `bytes`, or `count` equal ones), never from its own
arithmetic, so `strata-budget`'s prediction equals what the engine allocates by construction (B3)
and mem_mark can print the plan's figure beside the measured one at every stage. A kernel that needs
a buffer not listed here, or a larger one, changes this module first; the engine refuses to
allocate what the plan does not name. (Seed round 194: a term sized from the 4 indexer QUERY heads
instead of the ONE shared key head made a store 4x too big, which no total-based check caught
because it TIGHTENED the budget; so each term here is written from the geometry's meaning, and the
tests compare terms, not totals.)

Stages, in startup order (S6, seed 6.4), and what each allocates:

 1. the weights, the session and the drafter: the dense matrices in engine form (S3: fp16 block
    scales widened to f32 planes, BF16 re-rounded to 16 bits), the LM head included (S7: THE HEAD
    BEFORE THE CACHE: loaded after it, it ate the reserve and a request stalled), the drafter's
    weights; the session (KV cache, Gated DeltaNet recurrent and conv states, the QSA indexer key
    store and pooled blocks, PLE state, the residual stream) is listed as host memory: this GPU tier
    runs the mixers' elementwise work, attention and the delta rule on the host, where it keeps
    their state, and gives the card the matrices and the expert hits (docs/gpu-tier.md).
 2. opening the expert cache: the slot storage, sized from the free memory measured NOW (S7: after
    the weights and the session, so it is what this process really has left).
 3. the profile fill: a pinned staging buffer of one slot (host).
 4. the hit path: the GPU hits' buffers for one token and layer, and their pinned exchange buffers.
 5. the expert cache and the graphs: the slot table (host) and the dense path's staging.
 6. the head and the prompt path: the logits, the prompt path's chunk buffers, and the staging area
    of the experts a prompt chunk streams (two slots on the device, two pinned on the host).
 7. the verifier and the drafter's binding: the draft head's binding and the verifier's logits.

Stages 3..7 come out of the reserve (S8), which therefore names the chunk buffers and the draft
head's binding on top of --vram-reserve-mib. Host items (the embedding table and the PLE table,
mapped from pool.bin and the GGUF; the routed experts, mapped from the GGUF; pinned buffers) are
listed with where="host" and never counted against the card.

The session's terms come from the modules that allocate the memory: the KV cache's bytes per token
from engine/kvcache.py, the QSA indexer's stores from engine/qsa.py, the Gated DeltaNet states and
the residual stream from engine/model.py, the PLE ring from engine/ple.py, the attention tile from
engine/ops.py; this module adds them up. The CPU forward never imports this planner (a test in
tests/test_layering.py enforces it): only the GPU tier and the CLI do.

Legend: E = n_embd, C = max context (tokens), H/Hkv/D = attention heads/KV heads/head dim,
Ih/Id = indexer query heads/key dim (ONE key head is cached), r = indexer compress ratio,
nk/nv/dk/dv = GDN key heads/value heads/key dim/value dim, Ch = GDN conv channels, K = d_conv,
X = experts, k = experts per token, F/Fs = expert/shared-expert n_ff, hc = hyper-connection streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod

from strata.index_format import geometry as G
from strata.index_format.geometry import ModelGeometry, tensor_specs
from strata.index_format.native_experts import NativeExperts
from strata.index_format.pack_index import PackIndex, TensorEntry

from .expert_plan import MiB, auto_line, auto_slots, prefill_mib
from .kernels import gpu
from .kernels.engine_form import PLANE_ALIGN, align, placed_bytes
from .kvcache import KV_TYPES, kv_bytes_per_token
from .model import EMBD_ROWS_BYTES, conv_state_bytes, gdn_state_bytes, stream_elems
from .ple import ple_state_bytes
from .ops import ATTN_TILE_BYTES
from .qsa import indexer_key_bytes, pooled_block_bytes

STAGES = (
    "the weights, the session and the drafter",
    "opening the expert cache",
    "the profile fill",
    "the hit path",
    "the expert cache and the graphs",
    "the head and the prompt path",
    "the verifier and the drafter's binding",
)
WEIGHTS, OPEN_CACHE, FILL, HIT_PATH, CACHE_GRAPHS, HEAD_PROMPT, VERIFIER = STAGES
DEVICE, HOST = "device", "host"

F32, I32, F64 = 4, 4, 8
DEFAULT_RESERVE_MIB = 700
PREFILL_AUTO_CHUNK = 256  # `--prefill auto` beside the GPU tier: the 256-token chunk the seed lends the prompt path (#496)
# `--prefill auto` on the CPU alone (no device buffers to plan): each routed expert's rows are
# decoded once per chunk, and at 512 experts x 10 per token that decode was half the routed
# experts' time at 512-token chunks (~10 tokens per expert). 4096 tokens of seed-4l at 2 threads
# took 14.8 s in 512-token chunks, 13.6 s in 1024 and 15.0 s in 2048, where the dense products'
# activations (T x 2560 bytes, re-read for every 16 rows) and the elementwise passes over [T, ...]
# arrays outgrow the caches (docs/performance.md). llama.cpp's default logical batch is 2048, its micro-batch 512.
PREFILL_AUTO_CHUNK_CPU = 1024
PREFILL_MEMORY_SHARE = 4  # auto: the CPU prompt path's buffers take at most 1/4 of the available memory
LOW_MIB = 256  # the serve check's LOW line (S7)


# Dense categories in the order the report lists them; EMBEDDING and PLE_TABLE stay on the host.
_CATEGORIES = (
    (G.ATTENTION, "attention weights"),
    (G.LINEAR_ATTENTION, "linear attention weights"),
    (G.INDEXER, "QSA indexer weights"),
    (G.HYPER_CONNECTION, "hyper-connection weights"),
    (G.SHARED_EXPERT, "shared expert weights"),
    (G.ROUTER, "router weights"),
    (G.NORM, "norm weights"),
    (G.PLE, "PLE projection weights"),
    (G.HEAD, "LM head (loaded before the cache is sized)"),
)


class BudgetError(ValueError):
    """Options the plan cannot be made for (an int8 KV head dim that is not whole blocks, ...)."""


class ExpertCacheTooBig(ValueError):
    """An explicit --expert-cache N that does not fit: refused with both numbers, never shrunk (S7)."""


@dataclass(frozen=True)
class Item:
    """One allocation (or `count` equal ones of bytes // count each), the stage that makes it, and where."""

    key: str
    name: str
    bytes: int
    stage: str
    where: str = DEVICE
    count: int = 1

    @property
    def each(self) -> int:
        return self.bytes // self.count if self.count else 0


@dataclass(frozen=True)
class BudgetOptions:
    max_context: int
    kv: str = "f16"
    vram_reserve_mib: int = DEFAULT_RESERVE_MIB
    prefill_chunk: int = PREFILL_AUTO_CHUNK  # 0: no batched prompt path
    prefill_borrowed: bool = False  # the prompt path borrows its buffers from the cache: nothing reserved
    expert_cache: int | None = None  # None: auto (S8)
    profile_pairs: int | None = None  # the profile's routed pairs: auto never exceeds them
    drafter_bytes: int = 0  # the MTP draft head's weights (0 without --mtp)
    draft_bind_bytes: int = 0  # its binding to the head, after the cache (0 without --mtp)
    # --spec N with the MTP drafter on the device step: the head drafts on the card, so its matrices
    # (drafter_bytes) and its experts, KV cache, rope table and logits (draft_bind_bytes) are planned
    # there; plan_budget sets both figures from the pack (`draft_bytes`)
    draft_device: bool = False
    spec: int = 0  # draft tokens verified at once (0: no verifier)
    batch: int = 1  # strata serve --batch: sessions running at once (each sized for max_context)
    cache_slots: int = 0  # strata serve --conversation-cache-slots: parked sessions at most
    cache_mib: int = 0  # strata serve --conversation-cache-mib: their host memory at most
    device_step: bool = False  # --gpu-step device: the sessions' states and the blocks' parameters live on the card
    stream_experts: bool = True  # a prompt chunk's non-resident experts may be streamed (--stream-min-tokens off: False)
    stream_layers: bool = True  # ... and the device step's layers whole (TierOptions.stream_layer_tokens 0: False)
    cublas_held: bool = False  # this process made cuBLAS ready already (an earlier tier): its memory is not new

    def __post_init__(self) -> None:
        if self.max_context < 1:
            raise BudgetError(f"--ctx-size {self.max_context}: expected at least 1")
        if self.kv not in KV_TYPES:
            raise BudgetError(f"--kv {self.kv!r}: expected one of {', '.join(KV_TYPES)}")
        if self.batch < 1:
            raise BudgetError(f"--batch {self.batch}: expected at least 1")
        for name in ("vram_reserve_mib", "prefill_chunk", "drafter_bytes", "draft_bind_bytes", "spec", "cache_slots",
                     "cache_mib"):
            if getattr(self, name) < 0:
                raise BudgetError(f"{name} {getattr(self, name)}: expected >= 0")
        if self.expert_cache is not None and self.expert_cache < 0:
            raise BudgetError(f"--expert-cache {self.expert_cache}: expected auto or >= 0")


# --- the terms, one function each ----------------------------------------------------------------


def actq_bytes(n: int) -> int:
    """An ActQ of n activations (engine/kernels/actq.py): int8 q [n], f32 d [n/32], int32 s16 [n/16]."""
    return n + n // 32 * F32 + n // 16 * I32


def actq_placed_bytes(n: int, rows: int = 1) -> int:
    """An ActQ of `rows` x n activations placed in an arena: q int8, d f32 [n/32], s16 i32 [n/16],
    each plane on its own PLANE_ALIGN boundary (engine/tier/ carves them so)."""
    return align(rows * n) + align(rows * n // 32 * F32) + align(rows * n // 16 * I32)


def dense_dims(g: ModelGeometry) -> tuple[int, int]:
    """(widest input, widest output but the LM head's) of the matrices the GPU tier multiplies."""
    mats = [s for s in tensor_specs(g) if s.multiplied]
    widest_in = max(_round_up(s.shape[0], 32) for s in mats)
    widest_out = max(prod(s.shape[1:]) for s in mats if s.category != G.HEAD)
    return widest_in, widest_out


def dense_staging_bytes(g: ModelGeometry) -> int:
    """The token path's device staging for the dense matrices, reused by every one of them (S12):
    one input as f32, as ActQ and as the wide form's two planes [widest input], one output f32
    [widest output]; the LM head writes into head.logits."""
    n_in, n_out = dense_dims(g)
    return align(n_in * F32) + actq_placed_bytes(n_in) + actq_placed_bytes(n_in, 2) + align(n_out * F32)


def prompt_row_bytes(g: ModelGeometry) -> int:
    """One token row of the prompt path's device buffers (carved from prompt.chunk): its input as
    f32 and ActQ, its output (the LM head's included); a chunk's matrices go through in as many rows
    at a time as the planned chunk buffers hold."""
    n_in, n_out = dense_dims(g)
    return n_in * F32 + actq_bytes(n_in) + max(n_out, g.n_vocab) * F32


def prefill_host_bytes(g: ModelGeometry, chunk: int, max_context: int) -> int:
    """The CPU prompt path's working set for one chunk of T tokens (host memory, at its peak), logits
    of every position included: the layer that needs most, plus what lives across layers.

    across layers  streams [T, hc*E], embeddings and block input [T, E] + its ActQ, PLE [T, Pe + 4 hc*E]
                   and hyper-connection mixing [T, 2 hc*E + R]; the logits [T, V]
    GDN            projections [T, Ch + 2 nv dv + 2 nv], conv [T, 2 Ch], q/k per value head [T, 2 nv dk],
                   v, out, gated norm [T, 3 nv dv] + ActQ; one 64-token sub-chunk's [nv, 64, 3*64 + 2(dk+dv)]
    attention      q|gate, q, o, gate [T, 5 H D], k, v [T, 2 Hkv D], the prefix read back as f32
                   [2, Hkv, C, D], a tile of scores (<= ATTN_TILE_BYTES, twice: scores and their exp);
                   QSA: indexer queries and keys [T, Ih Id + Id], the selection mask [T, C] (bytes)
    MoE            router logits [T, X] f32 and probabilities f64 (twice), routed outputs [T, k, E],
                   the sum [T, E], shared expert [T, 3 Fs] + ActQ, one expert's gate/up [T, 2 F] + ActQ
    """
    T, C, E, X = chunk, max_context, g.n_embd, g.n_expert
    S = stream_elems(g)
    nv, dk, dv, Ch = g.ssm_n_v_heads, g.ssm_d_state, g.ssm_head_v_dim, g.ssm_conv_channels
    across = T * (S + 2 * E + g.n_vocab) * F32 + actq_bytes(T * E)
    if g.ple_layers:
        across += T * (g.ple_embed_dim + 4 * S) * F32
    if g.hc:
        across += T * (2 * S + g.hc_lowrank) * F32
    gdn = 0
    if g.linear_attention_layers:
        gdn = (T * (Ch + 2 * nv * dv + 2 * nv + 2 * Ch + 2 * nv * dk + 3 * nv * dv) * F32 + actq_bytes(T * nv * dv)
               + nv * 64 * (3 * 64 + 2 * (dk + dv)) * F32)
    H, Hkv, D = g.n_head, g.n_head_kv, g.head_dim
    scores = min(T * H * C * F32, ATTN_TILE_BYTES)
    attn = T * (5 * H * D + 2 * Hkv * D) * F32 + 2 * Hkv * C * D * F32 + 2 * scores + actq_bytes(T * H * D)
    if g.has_qsa:
        attn += T * (g.idx_n_heads * g.idx_head_dim + g.idx_head_dim) * F32 + T * C
    F, Fs, k = g.n_ff_exp, g.n_ff_shexp, g.n_expert_used
    moe = (T * X * (F32 + 2 * F64) + T * (k + 1) * E * F32 + T * 3 * Fs * F32 + actq_bytes(T * _round_up(Fs, 32))
           + T * 2 * F * F32 + actq_bytes(T * F))
    return across + max(gdn, attn) + moe


def auto_prefill_chunk(available_bytes: int | None = None, *, g: ModelGeometry | None = None, max_context: int = 1,
                       start: int = PREFILL_AUTO_CHUNK) -> int:
    """`--prefill auto`, the one rule both the engine and strata-budget use: `start` (PREFILL_AUTO_CHUNK
    beside the GPU tier, PREFILL_AUTO_CHUNK_CPU on the CPU alone), halved while the CPU prompt path's
    working set for it (`prefill_host_bytes`, logits of every position included) would exceed
    1/PREFILL_MEMORY_SHARE of `available_bytes`; down to 1 (token by token). Without
    `available_bytes` (strata-budget plans the device, not the host): `start`."""
    chunk = start
    if available_bytes is None:
        return chunk
    if g is None:
        raise BudgetError("auto_prefill_chunk: the geometry is needed to size the chunk from the available memory")
    while chunk > 1 and prefill_host_bytes(g, chunk, max_context) * PREFILL_MEMORY_SHARE > available_bytes:
        chunk //= 2
    return chunk


def hit_path_bytes(g: ModelGeometry) -> int:
    """The GPU hits of one token and layer, each buffer on its own PLANE_ALIGN boundary: x as ActQ
    and as f32 [E] (experts of a float type), gate and up f32 [k, F], ActQ of h [k, F] (one row per
    hit), outputs f32 [k, E]."""
    E, F, k = g.n_embd, _round_up(g.n_ff_exp, 32), g.n_expert_used
    return (actq_placed_bytes(E) + align(E * F32) + 2 * align(k * F * F32) + actq_placed_bytes(F, k)
            + align(k * E * F32))


def hit_exchange_bytes(g: ModelGeometry) -> int:
    """Pinned host buffers the hits' results land in: gate and up f32 [k, F] (the host makes
    silu(gate) * up and its ActQ, as the CPU misses do: B2), outputs f32 [k, E]."""
    k = g.n_expert_used
    return k * (2 * g.n_ff_exp + g.n_embd) * F32


STAGING_BUFFERS = 2  # double-buffered: one expert's copy is in flight while the other's products run


def _staging_items(o: BudgetOptions, slot: int) -> list[Item]:
    """The staging area of a prompt chunk's streamed experts (engine/tier/staging.py): two slots on
    the device and two pinned host slots the widened blocks are copied through (a slot holds any
    layer's expert in engine form). None without a prompt path or with streaming off."""
    on = o.stream_experts and o.prefill_chunk > 0
    n = STAGING_BUFFERS if on else 0
    why = "" if on else (" (no --prefill chunk)" if o.stream_experts else " (--stream-min-tokens off)")
    return [Item("stream.staging", f"streamed experts' staging ({n} slots){why}", n * slot, HEAD_PROMPT, count=n),
            Item("stream.pinned", f"streamed experts' copy buffers ({n} slots, pinned){why}", n * slot, HEAD_PROMPT,
                 HOST, count=n)]


# A prompt chunk's layer streamed whole (engine/tier/staging.py LayerStream): two layer buffers of
# n_expert slots, the raw pieces the host copies into (pinned) and the device piece they land in.
LAYER_BUFFERS = 2  # this layer's experts are read while the next layer's are written
LAYER_PIECES = 3  # pinned: the host fills one while another is DMA'd
LAYER_PIECE_BYTES = 32 * MiB
LAYER_COL_INTS = 512  # dev_widen's col of one block type (every GGML block is smaller)


def layer_piece_bytes(blob_bytes: int) -> int:
    """A pinned piece: 32 MiB, or the largest expert's GGUF bytes where that is more (a piece holds
    whole expert matrices)."""
    return max(LAYER_PIECE_BYTES, _round_up(blob_bytes, MiB))


def layer_raw_bytes(piece: int) -> int:
    """stream.raw: the device piece the DMA lands in, the two block types' col and the bad marker."""
    return align(piece) + align(2 * LAYER_COL_INTS * I32) + align(8)


def _layer_sizes(slot: int, blob: int, n_expert: int) -> tuple[int, int, int]:
    """The layer stream's bytes: its two layer buffers and its device piece (device), its pinned pieces (host)."""
    piece = layer_piece_bytes(blob)
    return LAYER_BUFFERS * n_expert * slot, layer_raw_bytes(piece), LAYER_PIECES * piece


def _layer_items(slot: int, blob: int, n_expert: int, why_not: str | None) -> list[Item]:
    """The layer stream's items; `why_not`: the reason they are not placed (their bytes then 0)."""
    sizes = (0, 0, 0) if why_not else _layer_sizes(slot, blob, n_expert)
    tail = f" ({why_not})" if why_not else ""
    return [Item("stream.layers", f"a layer streamed whole: its experts in engine form ({LAYER_BUFFERS} layers of "
                 f"{n_expert} slots){tail}", sizes[0], HEAD_PROMPT, count=LAYER_BUFFERS),
            Item("stream.raw", f"a layer streamed whole: the device piece its GGUF bytes land in{tail}", sizes[1], HEAD_PROMPT),
            Item("stream.layer_pinned", f"a layer streamed whole: the pieces the host copies its GGUF bytes into "
                 f"({LAYER_PIECES}, pinned){tail}", sizes[2], HEAD_PROMPT, HOST, count=LAYER_PIECES)]


def _layer_why_not(o: BudgetOptions, n_pairs: int, slots: int | None, left: int | None, want: int) -> str | None:
    """Why a prompt chunk cannot stream a layer whole, or None: it can."""
    if not o.device_step:
        return "the host-driven step"
    if o.prefill_chunk == 0:
        return "no --prefill chunk"
    if not o.stream_experts:
        return "--stream-min-tokens off"
    if not o.stream_layers:
        return "--stream-layer-tokens off"
    if slots is not None and slots >= n_pairs:
        return "every pair is resident"
    if left is not None and left < want:
        return (f"{want / MiB:.0f} MiB do not fit beside the cache and the reserve ({max(left, 0) / MiB:.0f} MiB "
                "left): a smaller --expert-cache leaves room")
    return None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# --- weights in engine form -----------------------------------------------------------------------


def widening_bytes(t: TensorEntry) -> int:
    """Bytes the engine form adds to a tensor: 2 per fp16 block scale widened to f32 (S3)."""
    if t.engine_type != t.pack_type:  # BF16 stored as F32: re-rounded, no block scales
        return 0
    return t.nbytes // t.pack.type_size * t.pack.n_scales * 2


def expert_slot_bytes(experts: NativeExperts, g: ModelGeometry) -> tuple[int, int]:
    """(largest expert in engine form, largest in the GGUF): a slot holds any layer's expert, with
    its fp16 scales widened like every weight the kernels read, so every slot is the largest. Each
    of its six planes starts on a PLANE_ALIGN boundary (no padding at production widths)."""
    engine = native = 0
    E, F = g.n_embd, g.n_ff_exp
    for e in experts.layers:
        engine = max(engine, 2 * placed_bytes(e.gu_type, E, F) + placed_bytes(e.d_type, F, E))
        native = max(native, e.blob_bytes)
    return engine, native


def dense_padding_bytes(t: TensorEntry) -> int:
    """What placing a matrix's planes on PLANE_ALIGN boundaries adds to its engine form."""
    return placed_bytes(t.engine_type, t.shape[0], prod(t.shape[1:])) - t.engine_nbytes


def draft_on_device(g: ModelGeometry, o: BudgetOptions) -> bool:
    """Whether the MTP head drafts on the device: asked (--spec N with the MTP drafter), the device
    step, and a model with an MTP block."""
    return o.draft_device and o.device_step and o.spec > 0 and g.n_mtp_layer > 0


def draft_matrices(g: ModelGeometry) -> list[str]:
    """The MTP block's matrices the device multiplies when the head drafts there: every 2-D dense
    tensor of the block but its own embedding table (rows gathered on the host, as the trunk's)."""
    return [s.name for s in tensor_specs(g) if s.category == G.MTP and len(s.shape) == 2
            and not s.name.endswith("nextn.embed_tokens.weight")]


def draft_bytes(index: PackIndex, experts: NativeExperts, g: ModelGeometry, o: BudgetOptions, slot: int) -> tuple[int, int]:
    """(the head's matrices in engine form, placed at stage 1; what stage 7 binds to it: its routed
    experts, each in a slot of its own (slot bytes, the trunk's layout), its KV caches (o.kv,
    o.max_context tokens, one a request: strata serve --batch B drafts for B), the rope table its positions read, its
    logits row and hidden row)."""
    names = set(draft_matrices(g))
    dense = sum(placed_bytes(t.engine_type, t.shape[0], prod(t.shape[1:])) for t in index.tensors if t.name in names)
    bind = (experts.n_expert * slot + o.batch * o.max_context * kv_bytes_per_token(g, o.kv)
            + 2 * o.max_context * (g.n_rot // 2) * F32 + (g.n_vocab + g.n_embd) * F32)  # (the rope: two arrays of its own)
    return dense, bind


def _weight_items(index: PackIndex, experts: NativeExperts, g: ModelGeometry, ple_table_bytes: int | None,
                  placed: frozenset[str] = frozenset()) -> list[Item]:
    """`placed`: the MTP block's matrices the draft head places (weights.drafter), not host items."""
    specs = {s.name: s for s in tensor_specs(g)}
    by_cat: dict[str, int] = {}
    widened = padding = host_embd = host_small = host_mtp = 0
    for t in index.tensors:
        spec = specs.get(t.name)
        if spec is None:
            raise BudgetError(f"index.txt: tensor {t.name} is not in the {g.arch} geometry (read the pack with read_pack)")
        if spec.category == G.EMBEDDING:
            host_embd += t.nbytes  # rows dequantized on the host from the mapped pool: pack form
            continue
        if spec.category == G.MTP:
            if t.name not in placed:  # the draft block: on the host unless the head drafts on the device
                host_mtp += t.engine_nbytes
            continue
        if not spec.multiplied:
            host_small += t.engine_nbytes  # read as f32 by the host's elementwise work
            continue
        w = widening_bytes(t)
        by_cat[spec.category] = by_cat.get(spec.category, 0) + t.engine_nbytes - w
        widened += w
        padding += dense_padding_bytes(t)
    items = [Item(f"weights.{c}", label, by_cat[c], WEIGHTS)
             for c, label in _CATEGORIES if c in by_cat]
    items.append(Item("weights.widened_scales", "widened scales (fp16 -> f32 planes)", widened, WEIGHTS))
    items.append(Item("weights.alignment", f"plane alignment (each plane on a {PLANE_ALIGN}-byte boundary)", padding, WEIGHTS))
    items.append(Item("host.embedding", "embedding table (mapped pool.bin)", host_embd, WEIGHTS, HOST))
    items.append(Item("host.small", "norm gains, conv kernels, ssm_a/dt (f32 on the host)", host_small, WEIGHTS, HOST))
    if g.n_mtp_layer:
        items.append(Item("host.mtp", "MTP draft block's dense weights (read by --spec drafting)" if not placed else
                          "MTP draft block's norm gains and embedding (the head's matrices are on the device)",
                          host_mtp, WEIGHTS, HOST))
    if g.ple_layers:
        items.append(Item("host.ple_table", "PLE table (read through the page cache)",
                          ple_table_bytes or 0, WEIGHTS, HOST))
    # the CPU misses read the experts in place from the GGUF, never copied (S5)
    items.append(Item("host.experts", f"routed experts ({len(experts.layers)} layers x {experts.n_expert}, mapped GGUF)",
                      experts.total, WEIGHTS, HOST))
    return items


def _session_items(g: ModelGeometry, o: BudgetOptions) -> list[Item]:
    """The session lives where its mixers compute. With the host-driven GPU step (and on the CPU)
    that is the host (attention, the delta rule, QSA's selection and PLE run there; the GPU tier
    takes the matrices and the expert hits), so these are host items, listed for the memory the run
    takes, never counted against the card. With the device step (engine/tier/device.py) the states
    are device arrays: counted against the card, before the expert cache is sized."""
    C, nf, nl = o.max_context, len(g.full_attention_layers), len(g.linear_attention_layers)
    where = DEVICE if o.device_step else HOST
    items = [Item("session.kv", f"KV cache ({o.kv}, {C} tokens)", nf * C * kv_bytes_per_token(g, o.kv), WEIGHTS, where, count=nf),
             Item("session.gdn_state", "GDN recurrent state (f32)", nl * gdn_state_bytes(g), WEIGHTS, where, count=nl),
             Item("session.conv_state", "GDN conv state (f32)", nl * conv_state_bytes(g), WEIGHTS, where, count=nl)]
    if g.has_qsa:
        items += [Item("session.indexer_keys", "QSA indexer key store (one key head, f32)",
                       nf * indexer_key_bytes(g, C), WEIGHTS, where, count=nf),
                  Item("session.indexer_blocks", "QSA pooled block keys (f32)", nf * pooled_block_bytes(g, C), WEIGHTS, where,
                       count=nf)]
    if g.ple_layers:
        n = len(g.ple_layers)
        items.append(Item("session.ple_state", "PLE conv state (f32)", n * ple_state_bytes(g), WEIGHTS, where, count=n))
    items.append(Item("session.stream", "residual stream (f32)", stream_elems(g) * F32, WEIGHTS, where))
    if o.device_step:  # Model._embd_row: the token step's decoded embedding rows, kept up to a cap
        rows = min(g.n_vocab, max(1, EMBD_ROWS_BYTES // (F32 * g.n_embd)))
        items.append(Item("host.embedding_rows", f"decoded embedding rows kept for the token step (at most {rows})",
                          rows * g.n_embd * F32, WEIGHTS, HOST, count=rows))
    return items


def _serve_items(g: ModelGeometry, o: BudgetOptions) -> list[Item]:
    """strata serve's other sessions: the --batch - 1 running beside the first, where the first
    lives (the device step: on the card, placed at startup beside it, engine/tier/sessions.py), and
    the conversation cache's parked ones, in host memory whatever the step (the device step copies a
    finished session down to park it), at most the slots' sessions and at most its MiB (the cache
    evicts to stay under both: engine/scheduler.py ConversationCache)."""
    one = session_host_bytes(g, o.max_context, o.kv)
    items = []
    if o.batch > 1:
        on = session_device_bytes(g, o.max_context, o.kv) if o.device_step else one
        items.append(Item("serve.batch", f"the other --batch sessions ({o.batch - 1} x {on} B)", (o.batch - 1) * on,
                          WEIGHTS, DEVICE if o.device_step else HOST, count=o.batch - 1))
    if o.cache_slots and o.cache_mib:
        parked = min(o.cache_slots, (o.cache_mib << 20) // one)  # a session larger than the cap is never parked
        items.append(Item("serve.conversation_cache", f"conversation cache, at most ({parked} parked sessions, "
                          f"--conversation-cache-slots {o.cache_slots}, --conversation-cache-mib {o.cache_mib})",
                          parked * one, WEIGHTS, HOST, count=parked))
    return items


def snapshot_bytes(g: ModelGeometry) -> int:
    """One verified row's snapshot (engine/speculative.py `Snapshot`), what a rollback restores: every
    Gated DeltaNet layer's S and conv, every PLE conv ring, the routing counts (i64 [layers, experts])."""
    return snapshot_state_bytes(g) + g.n_layer * g.n_expert * 8


def snapshot_state_bytes(g: ModelGeometry) -> int:
    """The part of a snapshot that lives where the session's states do (on the device with the device
    step): every Gated DeltaNet layer's S and conv, every PLE conv ring; the routing counts stay on the host."""
    n_gdn = len(g.linear_attention_layers)
    return n_gdn * (gdn_state_bytes(g) + conv_state_bytes(g)) + len(g.ple_layers) * ple_state_bytes(g)


def spec_host_bytes(g: ModelGeometry, max_context: int, kv: str, n_draft: int, mtp: bool, chunk: int = 0) -> int:
    """Host memory --spec adds to one session's (a request's, in strata serve): `_spec_items` with one request."""
    o = BudgetOptions(max_context=max_context, kv=kv, spec=n_draft, prefill_chunk=chunk)
    return sum(i.bytes for i in _spec_items(g, o, mtp))


def _spec_items(g: ModelGeometry, o: BudgetOptions, mtp: bool) -> list[Item]:
    """--spec N, per request (strata serve --batch B: B of each), host memory: a verify keeps the
    state after each of its N draft rows to roll back to (N snapshots, made once per request); the
    MTP head drafting keeps its own KV cache (one full-attention layer of the session's kind and
    context) and the trunk's head input of the rows it feeds (f32, the prompt chunk or 1 + N rows).
    The drafting runs on the CPU whatever the step (engine/speculative.py): host items. With the
    device step the snapshots' states are on the device (`verify.snapshots`, stage 7): only their
    routing counts are here."""
    if not o.spec:
        return []
    B, C, N = o.batch, o.max_context, o.spec
    each = f" per request, x {B}" if B > 1 else ""
    if o.device_step:  # the states' part is on the device (verify.snapshots); the routing counts here
        snap = g.n_layer * g.n_expert * 8
        items = [Item("spec.snapshots", f"verify snapshots' routing counts ({N} x {snap} B{each}; their states are "
                      "on the device)", B * N * snap, WEIGHTS, HOST, count=B * N)]
    else:
        snap = snapshot_bytes(g)
        items = [Item("spec.snapshots", f"verify snapshots ({N} x {snap} B: GDN S and conv, PLE, routing{each})",
                      B * N * snap, WEIGHTS, HOST, count=B * N)]
    if mtp:
        rows = max(o.prefill_chunk, N + 1)
        if not draft_on_device(g, o):  # (drafting on the device: its KV is in draft.bind)
            items.append(Item("spec.mtp_kv", f"MTP head KV cache ({o.kv}, {C} tokens{each})",
                              B * C * kv_bytes_per_token(g, o.kv), WEIGHTS, HOST, count=B))
        items.append(Item("spec.head_input", f"MTP head input rows (f32, {rows} rows{each})", B * rows * g.n_embd * F32,
                          WEIGHTS, HOST, count=B))
    return items


def session_host_bytes(g: ModelGeometry, max_context: int, kv: str) -> int:
    """All of a session's host state for `max_context` tokens (the KV cache dominates)."""
    return sum(i.bytes for i in _session_items(g, BudgetOptions(max_context=max_context, kv=kv)))


def session_device_bytes(g: ModelGeometry, max_context: int, kv: str) -> int:
    """A session's states on the card with the device step: the same arrays (the decoded embedding
    rows the token step keeps on the host are the model's, not a session's)."""
    items = _session_items(g, BudgetOptions(max_context=max_context, kv=kv, device_step=True))
    return sum(i.bytes for i in items if i.where == DEVICE)


# --- the reserve and the slots -------------------------------------------------------------------


@dataclass(frozen=True)
class Reserve:
    """S8's reserve as used: `headroom_mib` (--vram-reserve-mib, or less on a small card) + the
    prompt path's chunk buffers + the draft head's binding."""

    asked_mib: int
    headroom_mib: int
    prefill_mib: int
    draft_bind_bytes: int

    @property
    def bytes(self) -> int:
        return (self.headroom_mib + self.prefill_mib) * MiB + self.draft_bind_bytes

    @property
    def adapted(self) -> bool:
        return self.headroom_mib != self.asked_mib


def adapt_reserve(free_at_open: int, o: BudgetOptions, slot_bytes: int, after_cache_bytes: int, max_slots: int) -> Reserve:
    """The reserve adapts on small cards (S7, seed #496).

    Seed: a cache too small to lend the prompt path a 256-token chunk's buffers made it allocate its
    own on top, more than the reserve, so on a small card the reserve shrinks to what leaves exactly
    that cache. Here: when the asked reserve would leave fewer slots than that cache (whole slots,
    and never more than `max_slots`, the pairs there are to hold), the headroom shrinks to what
    leaves exactly that many, but never below what the allocations after the cache need beyond the
    chunk buffers and the draft binding, so the prompt path keeps its chunk buffers. Below ~550 MiB
    free the card then ends under the LOW line, and `low_memory_warning` says so plainly.
    """
    pf = prefill_mib(o.prefill_chunk, borrowed=o.prefill_borrowed)
    asked = Reserve(o.vram_reserve_mib, o.vram_reserve_mib, pf, o.draft_bind_bytes)
    want = min(-(-prefill_mib(PREFILL_AUTO_CHUNK) * MiB // slot_bytes), max_slots)
    if o.prefill_chunk == 0 or (free_at_open - asked.bytes) // slot_bytes >= want:
        return asked  # no prompt path to lend to, or a card large enough
    floor_mib = -(-max(after_cache_bytes - pf * MiB - o.draft_bind_bytes, 0) // MiB)
    fit_mib = (free_at_open - want * slot_bytes - pf * MiB - o.draft_bind_bytes) // MiB
    return Reserve(o.vram_reserve_mib, max(floor_mib, min(o.vram_reserve_mib, fit_mib)), pf, o.draft_bind_bytes)


def low_memory_warning(final_free: int) -> str | None:
    """The serve check's line when less than 256 MiB is left after startup (S7), else None."""
    if final_free >= LOW_MIB * MiB:
        return None
    fix = "lower --ctx-size or --expert-cache, or use --kv int8"
    if final_free < 0:
        return f"LOW: the plan needs {-final_free / MiB:.1f} MiB more device memory than there is: {fix}"
    return (f"LOW: {final_free // MiB} MiB of device memory free after startup (below {LOW_MIB} MiB): "
            f"the driver may page and a request stall; {fix}")


def check_explicit_slots(n: int, free_at_open: int, reserve: int, slot_bytes: int) -> None:
    """--expert-cache N that does not fit is refused with both numbers, never handed back smaller (S7)."""
    room = free_at_open - reserve
    if n * slot_bytes > room:
        raise ExpertCacheTooBig(
            f"--expert-cache {n}: {n} slots of {slot_bytes} B need {n * slot_bytes / MiB:.1f} MiB, but "
            f"{room / MiB:.1f} MiB are free beside the reserve ({free_at_open / MiB:.1f} MiB free at the cache, "
            f"{reserve / MiB:.1f} MiB reserved): at most {max(room // slot_bytes, 0)} slots fit")


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    items: tuple[Item, ...]
    options: BudgetOptions
    slot_bytes: int  # one slot: the largest expert in engine form
    max_blob: int  # the largest expert as the GGUF stores it
    n_pairs: int  # (layer, expert) pairs: more slots than this hold nothing
    free_bytes: int | None  # free device memory before the engine allocates (None: slots not planned)
    reserve: Reserve | None
    slots: int | None
    auto_line: str | None  # S8's log line (auto only)
    warnings: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()  # what makes the engine refuse to start
    notes: tuple[str, ...] = ()  # choices the plan made that change how the engine runs (the PLE table's place)
    _by_key: dict = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_key", {i.key: i for i in self.items})

    def places(self, key: str) -> bool:
        """Whether the plan holds an item `key` (an optional one: weights.embedding, weights.ple_table)."""
        return key in self._by_key

    def item(self, key: str) -> Item:
        """The allocation the engine makes for `key`; a buffer the plan does not name is a bug."""
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"the budget has no item {key!r} (known: {', '.join(self._by_key)}); "
                           "add it to engine/budget.py before allocating it") from None

    def device_bytes(self, stage: str | None = None) -> int:
        return sum(i.bytes for i in self.items if i.where == DEVICE and (stage is None or i.stage == stage))

    def host_bytes(self) -> int:
        return sum(i.bytes for i in self.items if i.where == HOST)

    def used_after(self, stage: str) -> int:
        """Device bytes the engine holds once `stage` is done: what mem_mark prints as predicted."""
        upto = STAGES[: STAGES.index(stage) + 1]
        return sum(self.device_bytes(s) for s in upto)

    def after_cache_bytes(self) -> int:
        """Device bytes allocated after the cache opens (stages 3..7): they come out of the reserve."""
        return sum(self.device_bytes(s) for s in STAGES[STAGES.index(FILL):])

    def slots_for(self, measured_free_at_open: int) -> SlotPlan:
        """S8 at the free memory the engine MEASURES once stage 1 is allocated (S7: the cache is
        sized from what this process really has left, not from the prediction)."""
        return plan_slots(measured_free_at_open, self.options, self.slot_bytes, self.n_pairs, self.after_cache_bytes())

    @property
    def free_at_open(self) -> int | None:
        return None if self.free_bytes is None else self.free_bytes - self.device_bytes(WEIGHTS)

    @property
    def final_free(self) -> int | None:
        return None if self.free_bytes is None else self.free_bytes - self.device_bytes()


def rope_table_bytes(g: ModelGeometry, max_context: int) -> int:
    """The device step's rope table (weights.rope): cos and sin, f32 [C, n_rot / 2] each, one for the
    model (its attention layers' ropes share n_rot, base and angle kind), so that no position input
    but the position itself goes up per token."""
    return align(2 * max_context * (g.n_rot // 2) * F32)


def embedding_on_device(g: ModelGeometry, device_step: bool, ple_on_device: bool = False) -> bool:
    """Whether the GPU tier places the embedding in its blocks on the device (weights.embedding): with
    the device step, for the run-ahead (Model.decode_ahead); for a model with PLE only beside its
    table (`ple_on_device`): without it the token step needs the host (DeviceBackend.needs_token),
    so nothing would gather from the embedding. (QSA's token step runs wholly on the device.)"""
    return device_step and (ple_on_device or not g.ple_layers)


# the PLE table's GGML types dev_ple_rows decodes (engine/tier/device.py PLE_ROW_TYPES; a test pins
# the two equal): F32, F16, BF16 (TableRows), the embedding's block types and IQ4_NL, the released
# table's fallback type on its short rows
PLE_TABLE_DEVICE_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 20, 30})


def ple_table_device_bytes(g: ModelGeometry, table_bytes: int) -> int:
    """weights.ple_table: the PLE table in its GGUF bytes and what dev_ple_rows hashes with, as
    engine/tier/device.py DevicePLE carves them: per PLE layer (nl) the N multipliers, the Pn head
    offsets and sizes (int64), the token window (int64 [N - 1]), the rows every PLE layer's token
    step reads (f32 [nl, Pe]) and their row ids (int64 [nl, Pn])."""
    nl, N, Pn = len(g.ple_layers), g.ple_ngram_size, g.ple_n_heads
    return (align(table_bytes) + align(8 * nl * N) + 2 * align(8 * nl * Pn) + align(8 * max(N - 1, 1))
            + align(F32 * nl * Pn * g.ple_row_dim) + align(8 * nl * Pn))


def ple_on_device(free_at_open: int | None, extra: int, o: BudgetOptions, slot: int, n_pairs: int,
                  after_bytes: int) -> str | None:
    """THE PLE TABLE TAKES ONLY MEMORY NOTHING ELSE WOULD USE. Placed (with the embedding the run-ahead
    gathers from: `extra` bytes in all) only where the plan is otherwise the same with them: the same
    expert slots, the same reserve, no refusal and no LOW line that was not there. Why: the
    run-ahead hides the host's ~0.4 ms between two token steps (qwen35moe on the H200); that counts
    where the step is the GPU's (every expert resident: seed-4l qwen4exp's floor 1.37 ms against
    508 tok/s picked), while a slot the table would take is an expert computed on the CPU instead,
    milliseconds a token where misses dominate. The real table is tens of GB (25.8 GB BF16 for
    the release): it takes the card only where it is left over. -> None where placed, else why not."""
    if free_at_open is None:
        return "no free device memory given to plan it against"
    without = plan_slots(free_at_open, o, slot, n_pairs, after_bytes)
    with_ = plan_slots(free_at_open - extra, o, slot, n_pairs, after_bytes)
    if with_.problems or with_.slots != without.slots or with_.reserve != without.reserve:
        return (f"{extra / MiB:.1f} MiB with the embedding would leave {with_.slots} expert slots (not "
                f"{without.slots}) or a smaller reserve: slots come first")
    left = free_at_open - extra - with_.slots * slot - after_bytes
    if low_memory_warning(left) and not low_memory_warning(left + extra):
        return f"{extra / MiB:.1f} MiB with the embedding would leave less than {LOW_MIB} MiB free"
    return None


def plan_budget(index: PackIndex, experts: NativeExperts, g: ModelGeometry, options: BudgetOptions, *,
                free_bytes: int | None = None, ple_table_bytes: int | None = None,
                ple_table_type: int | None = None) -> Budget:
    """Everything the GPU engine will allocate for this pack and these options, stage by stage.

    `free_bytes`: device memory free before the engine allocates anything (cudaMemGetInfo at start,
    or a card of N MiB as --vram-budget-mib counts it); without it the slots are not planned.
    `ple_table_bytes`, `ple_table_type`: the pack's PLE table (qwen4exp), which the device step places
    on the card by `ple_on_device`'s rule (weights.ple_table; `notes` says where it went and why).
    """
    o = options
    slot, blob = expert_slot_bytes(experts, g)
    # the trunk's pairs: the expert cache (SlotMap) holds the trunk's layers; the MTP block's experts
    # are in native_experts.txt too (read in place) but not cached yet
    n_pairs = sum(e.layer < g.n_layer for e in experts.layers) * experts.n_expert
    placed = frozenset()
    if draft_on_device(g, o):  # the head's matrices at stage 1, the rest bound to it at stage 7 (from the reserve)
        dense, bind = draft_bytes(index, experts, g, o, slot)
        o = replace(o, drafter_bytes=dense, draft_bind_bytes=bind)
        placed = frozenset(draft_matrices(g))
    before = _weight_items(index, experts, g, ple_table_bytes, placed)
    if o.drafter_bytes:
        before.append(Item("weights.drafter", "drafter (MTP head) matrices, engine form", o.drafter_bytes, WEIGHTS))
    if o.device_step:  # the token step's rope at the device position (DeviceBackend._rope_table)
        before.append(Item("weights.rope", f"rope cos and sin at every position (f32, {o.max_context} x {g.n_rot // 2} x 2; "
                           "the device step reads them at its position)", rope_table_bytes(g, o.max_context), WEIGHTS))
    before += _session_items(g, o) + _serve_items(g, o) + _spec_items(g, o, bool(g.n_mtp_layer))
    after = _after_cache_items(g, o, slot)
    after_bytes = sum(i.bytes for i in after if i.where == DEVICE)
    embd = sum(align(t.nbytes) for t in index.tensors if t.name == "token_embd.weight")
    ple, notes = False, []
    if o.device_step and g.ple_layers:
        ple_bytes = ple_table_device_bytes(g, ple_table_bytes or 0)
        free_at_open = None if free_bytes is None else free_bytes - sum(i.bytes for i in before if i.where == DEVICE)
        why = ("the pack's table was not given" if ple_table_bytes is None else
               f"its type {ple_table_type} has no device decoder" if ple_table_type not in PLE_TABLE_DEVICE_TYPES else
               ple_on_device(free_at_open, ple_bytes + embd, o, slot, n_pairs, after_bytes))
        ple = why is None
        notes.append(f"PLE table on the device ({ple_bytes / MiB:.1f} MiB): the token step hashes the next token's "
                     "n-grams there, so greedy decoding runs a step ahead" if ple else
                     f"PLE table on the host ({why}): each token step's rows are hashed on the host, no run-ahead")
        if ple:
            before.append(Item("weights.ple_table", "PLE table in its GGUF bytes, its hash constants and rows (the "
                               "run-ahead hashes and gathers the next token's rows on the device)", ple_bytes, WEIGHTS))
    if embedding_on_device(g, o.device_step, ple):  # the run-ahead gathers the next step's row there
        before.append(Item("weights.embedding", "embedding table in its blocks (the device step's run-ahead gathers rows)",
                           embd, WEIGHTS))
    layers_want = sum(_layer_sizes(slot, blob, experts.n_expert)[:2])  # (its device items)
    if free_bytes is None:
        after += _layer_items(slot, blob, experts.n_expert, _layer_why_not(o, n_pairs, None, None, layers_want))
        items = before + [Item("cache.slots", "expert slots (give the free memory to plan them)", 0, OPEN_CACHE, count=0)] + after
        return Budget(tuple(items), o, slot, blob, n_pairs, None, None, None, None, notes=tuple(notes))
    free_at_open = free_bytes - sum(i.bytes for i in before if i.where == DEVICE)
    sp = plan_slots(free_at_open, o, slot, n_pairs, after_bytes)
    # the layer stream takes what the cache and the reserve leave (never memory auto would give the
    # cache: a slot serves every token, the stream only long prompts)
    left = free_at_open - sp.slots * slot - after_bytes - sp.reserve.headroom_mib * MiB
    why = _layer_why_not(o, n_pairs, sp.slots, left, layers_want)
    after = after + _layer_items(slot, blob, experts.n_expert, why)
    if why and "fit" in why:
        notes.append(f"a prompt chunk streams no layer's experts whole: {why}; a long prompt's non-resident experts "
                     "then run on the CPU, or stream one by one")
    items = before + [Item("cache.slots", f"expert slots ({sp.slots} x {slot} B, engine form)", sp.slots * slot,
                           OPEN_CACHE, count=sp.slots)] + after
    warnings = _warnings(free_at_open, sp.reserve, after_bytes, sp.slots * slot)
    return Budget(tuple(items), o, slot, blob, n_pairs, free_bytes, sp.reserve, sp.slots, sp.auto_line,
                  tuple(warnings), sp.problems, tuple(notes))


@dataclass(frozen=True)
class SlotPlan:
    reserve: Reserve
    slots: int
    auto_line: str | None  # S8's log line (auto only)
    problems: tuple[str, ...]  # why the engine must refuse to start


def plan_slots(free_at_open: int, o: BudgetOptions, slot_bytes: int, n_pairs: int, after_cache_bytes: int) -> SlotPlan:
    """S8 (and S7's refusals) at `free_at_open`, the device memory free once stage 1 is allocated.

    The engine calls this (through `Budget.slots_for`) with what cudaMemGetInfo says at that moment;
    `plan_budget` with its prediction of it. Without a profile, slots still stop at one per pair."""
    problems = []
    if free_at_open < 0:
        problems.append(f"the weights and the session need {-free_at_open / MiB:.1f} MiB more than the card has free: "
                        "lower --ctx-size, use --kv int8, or use a larger card")
    pf = prefill_mib(o.prefill_chunk, borrowed=o.prefill_borrowed)
    if o.expert_cache is not None:
        # an explicit N is checked against the reserve as asked; adapting is for auto only
        reserve = Reserve(o.vram_reserve_mib, o.vram_reserve_mib, pf, o.draft_bind_bytes)
        try:
            check_explicit_slots(o.expert_cache, free_at_open, reserve.bytes, slot_bytes)
        except ExpertCacheTooBig as e:
            problems.append(str(e))
        return SlotPlan(reserve, o.expert_cache, None, tuple(problems))
    pairs = n_pairs if o.profile_pairs is None else min(o.profile_pairs, n_pairs)
    reserve = adapt_reserve(free_at_open, o, slot_bytes, after_cache_bytes, pairs)
    slots = auto_slots(free_at_open, reserve.headroom_mib, o.prefill_chunk, o.draft_bind_bytes, slot_bytes, pairs,
                       prefill_borrowed=o.prefill_borrowed)
    line = auto_line(max(free_at_open, 0), reserve.headroom_mib, o.prefill_chunk, o.draft_bind_bytes, slots,
                     prefill_borrowed=o.prefill_borrowed)
    return SlotPlan(reserve, slots, line, tuple(problems))


def _warnings(free_at_open: int, reserve: Reserve, after_bytes: int, cache_bytes: int) -> list[str]:
    out = []
    if reserve.adapted:
        out.append(f"small card: the reserve shrinks from {reserve.asked_mib} to {reserve.headroom_mib} MiB of headroom "
                   "so the cache still gets the slots a 256-token prompt chunk's buffers take, or every pair")
    if after_bytes > reserve.bytes:
        out.append(f"the allocations after the cache ({after_bytes / MiB:.1f} MiB) exceed the reserve "
                   f"({reserve.bytes / MiB:.1f} MiB): raise --vram-reserve-mib")
    low = low_memory_warning(free_at_open - cache_bytes - after_bytes)
    if low:
        out.append(low)
    return out


CUBLAS_BYTES = 64 * MiB


def gemm_on(o: BudgetOptions) -> bool:
    """Whether the device step's prompt multiplies its dense products through cuBLAS (gpu.gemm_products),
    with a weight slab of gpu.GEMM_SLAB_BYTES placed at stage 6."""
    return o.device_step and o.prefill_chunk > 0 and gpu.GEMM_FROM > 0


def _after_cache_items(g: ModelGeometry, o: BudgetOptions, slot: int) -> list[Item]:
    pf = prefill_mib(o.prefill_chunk, borrowed=o.prefill_borrowed)
    chunk = (f"prompt path chunk buffers ({o.prefill_chunk}-token chunk)" if pf else
             "prompt path chunk buffers (borrowed from the cache)" if o.prefill_chunk else "prompt path chunk buffers (no --prefill chunk)")
    return [
        Item("fill.staging", "profile fill staging (one slot, pinned)", slot, FILL, HOST),
        Item("hits.buffers", "GPU hit buffers (one token and layer)", hit_path_bytes(g), HIT_PATH),
        Item("hits.exchange", "hit/miss exchange (pinned)", hit_exchange_bytes(g), HIT_PATH, HOST),
        Item("cache.table", "slot table (i32 [layers, experts], read by the host)", g.n_layer * g.n_expert * I32, CACHE_GRAPHS, HOST),
        Item("dense.staging", "dense-path staging (an input as f32 and ActQ, an output)", dense_staging_bytes(g), CACHE_GRAPHS),
        Item("head.logits", "logits (f32)", g.n_vocab * F32, HEAD_PROMPT),
        Item("head.logits_host", "logits download (pinned)", g.n_vocab * F32, HEAD_PROMPT, HOST),
        Item("prompt.chunk", chunk, pf * MiB, HEAD_PROMPT),
        Item("prompt.gemm", "dense prompt products' f16 weight slab (cuBLAS)" + ("" if gemm_on(o) else
             " (the host-driven step, no --prefill chunk, or STRATA_GEMM=off)"), gpu.GEMM_SLAB_BYTES if gemm_on(o) else 0, HEAD_PROMPT),
        # not ours: what cuBLAS allocates for its handle, its workspace and the kernels it loads, as
        # the stage-6 mark measured it beside the budget on the H200 (2026-12-03: +64 MiB)
        Item("prompt.cublas", "cuBLAS's handle, workspace and loaded kernels (measured)" + (
             " (not used)" if not gemm_on(o) else " (held already by this process)" if o.cublas_held else ""),
             CUBLAS_BYTES if gemm_on(o) and not o.cublas_held else 0, HEAD_PROMPT),
        *_staging_items(o, slot),
        Item("draft.bind", ("MTP draft head on the device: its experts in slots of their own, its KV cache, rope table "
                            "and logits" if draft_on_device(g, o) else "draft head binding" +
                            ("" if o.draft_bind_bytes else " (no --mtp)")), o.draft_bind_bytes, VERIFIER),
        Item("verify.logits", f"verifier logits ({o.spec + 1} positions)" if o.spec else "verifier logits (no --spec)",
             (o.spec + 1) * g.n_vocab * F32 if o.spec else 0, VERIFIER),
        # the device step keeps a verify's per-row snapshots beside the session's states, so the
        # rollback is a copy on the device (engine/speculative.py); the host-driven step, on the host
        Item("verify.snapshots", f"verify snapshots on the device ({o.spec} x {snapshot_state_bytes(g)} B: GDN S and "
             f"conv, PLE{f'; x {o.batch} requests' if o.batch > 1 else ''})" if o.spec and o.device_step else
             "verify snapshots on the device (no --spec or the host-driven step)",
             o.batch * o.spec * snapshot_state_bytes(g) if o.device_step else 0, VERIFIER, count=max(o.batch * o.spec, 1)),
    ]

