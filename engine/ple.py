"""qwen4exp PLE: hashed n-gram embeddings injected into the hc streams of one layer, one token at a time.

transformers' `Qwen4ExpTextNGramEmbedding` + `Qwen4ExpTextPLELayer` (ground truth), with the weights as
llama.cpp's converter stores them (docs/gguf-layout.md, docs/qwen4exp.md). For token t_p:

    context   c_s = t_{p-s}, s = 0..N-1 (N = ngram_size), except that walking back from p, an EOS at
              p-s or later (p-s <= e < p) turns c_s and every older one into EOS (a new document starts
              after an EOS); before the first token the history is EOS too
    hash      for order n = 2..N: h_n = XOR_{s<n} (c_s * m_s) in wrapping int64 (two's complement, as
              torch multiplies int64); head i of order n: row_i = off_i + (h_n mod P_i), mod with the
              sign of the divisor (torch.remainder), P_i the head's prime. Never through floats: the
              products exceed 2^53, and a negative h_n is NOT h_n mod 2^64 modulo P_i
    embed     e = concat_i table[row_i]                          [Pe] = Pn rows of Pd
    gate      K = gnorm(ple_key e), Q = gnorm(S)                 [hc, E] (gnorm: per E group, gain 1+w)
              g_c = K_c . Q_c / sqrt(E);  g_c = sign(g_c) sqrt(max(|g_c|, 1e-6))
              G_c = sigmoid(g_c) * ple_value e                   [hc, E]
    conv      X = gnorm(G); y = silu(sum_j w[:, j] X_{p - (Pk-1-j)*N})  depthwise, dilation N, zeros before 0
    output    S += G + y                                         (before the layer's attention hyper-connection)

Shapes: E = n_embd, hc = streams, HE = hc*E, Pe = ple embed dim, Pn = heads, Pd = row dim, Pk = conv kernel,
N = ngram_size, L = (Pk-1)*N conv history, T = tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import numpy as np

from strata.index_format.geometry import ModelGeometry
from strata.index_format.ggml_types import ggml_type

from .hyper import Tensor, as_f32, as_linear, sigmoid, take
from .batch import seqs_of
from .kernels.jit import cached_njit
from .pack_reader import PackError

F32 = np.float32
MASK64 = (1 << 64) - 1


# ---------------------------------------------------------------------------------------------
# the table


class TableRows:
    """Rows of the PLE table from its raw bytes (a mapped GGUF shard slice): F32, F16 or BF16 -> f32, exactly."""

    def __init__(self, raw: np.ndarray, type_id: int, row_dim: int, n_rows: int, *, where: str = "PLE table"):
        t = ggml_type(type_id, where=where)
        if t.name not in ("F32", "F16", "BF16"):
            raise PackError(f"{where}: type {t.name} is not supported for the PLE table (F32, F16 or BF16)")
        need = n_rows * t.row_bytes(row_dim)
        if raw.dtype != np.uint8 or raw.ndim != 1 or raw.size != need:
            raise PackError(f"{where}: raw buffer {raw.dtype}[{raw.size}], expected uint8[{need}] "
                                 f"({n_rows} rows of {row_dim} {t.name})")
        self.where, self.kind, self.n_rows, self.row_dim = where, t.name, n_rows, row_dim
        elem = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[t.name]
        self._rows = raw.view(elem).reshape(n_rows, row_dim)

    def __call__(self, row_ids: np.ndarray) -> np.ndarray:
        if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= self.n_rows):
            raise PackError(f"{self.where}: row id outside 0..{self.n_rows - 1}: {row_ids.min()}..{row_ids.max()}")
        r = self._rows[row_ids]
        if self.kind == "BF16":  # bf16 is the top half of an f32
            return (r.astype(np.uint32) << 16).view(F32)
        return r.astype(F32)


# ---------------------------------------------------------------------------------------------
# the hash


class NGramHash:
    """Row ids of the Pn n-gram heads for a token and its N-1 predecessors (transformers' int64 semantics)."""

    def __init__(self, multipliers: Sequence[int], head_offsets: Sequence[int], head_vocab_sizes: Sequence[int],
                 *, ngram_size: int, heads_per_ngram: int, eos_token_id: int, n_rows: int):
        N, Pn = ngram_size, (ngram_size - 1) * heads_per_ngram
        if len(multipliers) != N:
            raise PackError(f"PLE: {len(multipliers)} hash multipliers, expected ngram_size = {N}")
        if len(head_offsets) != Pn or len(head_vocab_sizes) != Pn:
            raise PackError(f"PLE: {len(head_offsets)} head offsets / {len(head_vocab_sizes)} head sizes, "
                                 f"expected (ngram_size - 1) * heads_per_ngram = {Pn}")
        for name, vals in (("multiplier", multipliers), ("head offset", head_offsets), ("head size", head_vocab_sizes)):
            bad = [int(v) for v in vals if not 0 <= int(v) <= MASK64 or isinstance(v, float)]
            if bad:
                raise PackError(f"PLE: {name} {bad[0]!r} is not a uint64 integer (read it as UINT64, never as a float)")
        if any(s <= 0 for s in head_vocab_sizes) or max(o + s for o, s in zip(head_offsets, head_vocab_sizes)) > n_rows:
            raise PackError(f"PLE: heads reach row {max(o + s for o, s in zip(head_offsets, head_vocab_sizes))}, "
                                 f"the table has {n_rows}")
        self.ngram_size, self.n_heads, self.heads_per_ngram, self.eos = N, Pn, heads_per_ngram, int(eos_token_id)
        # the checkpoint's int64 buffers, as their uint64 bits; multiplying wraps mod 2^64 like torch
        self.mult = np.array([int(m) for m in multipliers], dtype=np.uint64).view(np.int64)
        self.offsets = np.array([int(o) for o in head_offsets], dtype=np.int64)
        self.sizes = np.array([int(s) for s in head_vocab_sizes], dtype=np.int64)
        self.order = 1 + np.arange(Pn) // heads_per_ngram  # index into the prefix XORs: order n -> n - 1

    def contexts(self, window: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Row i: [t_p, t_{p-1}, ..] (N entries) for token i of `tokens` int64 [T], with the EOS rule
        -> int64 [T, N]; window = the N-1 raw tokens before tokens[0], oldest first."""
        N = self.ngram_size
        seq = np.concatenate([window, tokens])  # token i of the chunk at seq[N - 1 + i]
        T = tokens.size
        c = np.empty((T, N), np.int64)
        c[:, 0] = tokens
        reset = np.zeros(T, bool)
        for s in range(1, N):
            prev = seq[N - 1 - s : N - 1 - s + T]
            reset |= prev == self.eos  # an EOS at p-s or later: c_s and every older entry are EOS
            c[:, s] = np.where(reset, self.eos, prev)
        return c

    def rows(self, ctx: np.ndarray) -> np.ndarray:
        """ctx int64[..., N] -> row ids int64[..., Pn]."""
        prods = ctx * self.mult  # numpy int64 arrays wrap mod 2^64 (two's complement), as torch's product
        h = np.bitwise_xor.accumulate(prods, axis=-1)[..., self.order]
        return np.remainder(h, self.sizes) + self.offsets  # sign of the divisor, like torch.remainder


# ---------------------------------------------------------------------------------------------
# state and layer


def ple_state_bytes(g: ModelGeometry) -> int:
    """One PLE layer's conv ring, f32 [(kernel - 1) * ngram, hc * E] (PLEState.ring); the token window
    is scratch beside the hash, in no plan item."""
    return (g.ple_conv_kernel - 1) * g.ple_ngram_size * g.hc * g.n_embd * 4


class PLEState:
    """A PLE layer's state across tokens, allocated once (S12): the last N-1 raw tokens (EOS at start) and
    the last L = (Pk-1)*N conv inputs in a ring (zeros at start)."""

    def __init__(self, *, ngram_size: int, eos_token_id: int, conv_kernel: int, channels: int):
        self.window = np.full(ngram_size - 1, eos_token_id, np.int64)
        self.ring = np.zeros(((conv_kernel - 1) * ngram_size, channels), F32)
        self.t = 0  # tokens seen; the conv input of token t sits in ring[t % L]
        self._eos = eos_token_id

    @classmethod
    def for_geometry(cls, g: ModelGeometry) -> "PLEState":
        return cls(ngram_size=g.ple_ngram_size, eos_token_id=g.ple_eos_token_id, conv_kernel=g.ple_conv_kernel,
                   channels=g.hc * g.n_embd)

    @property
    def nbytes(self) -> int:
        return self.window.nbytes + self.ring.nbytes

    def copy_to(self, dst: "PLEState") -> None:
        """dst <- this state (speculative decoding's snapshot of a verified row, and its restore)."""
        dst.window[:] = self.window
        self.copy_ring_to(dst)

    def copy_ring_to(self, dst: "PLEState") -> None:
        dst.ring[:] = self.ring
        dst.t = self.t

    def reset(self) -> None:
        self.window[:] = self._eos
        self.ring[:] = 0
        self.t = 0


class PLELayer:
    """The PLE of layer `layer`: `forward` adds its output to the hc streams of T tokens (T = 1: the decode step)."""

    def __init__(self, layer: int, t: Mapping[str, Tensor], g: ModelGeometry, table_rows: Callable[[np.ndarray], np.ndarray]):
        if layer not in g.ple_layers:
            raise PackError(f"layer {layer} is not a PLE layer (PLE layers: {list(g.ple_layers)})")
        b, E, HE, Pe = f"blk.{layer}", g.n_embd, g.hc * g.n_embd, g.ple_embed_dim
        k = list(g.ple_layers).index(layer)
        N = g.ple_ngram_size
        # one multiplier set per PLE layer when the file carries several, else the one set
        mult = g.ple_multipliers[k * N:(k + 1) * N] if len(g.ple_multipliers) > N else g.ple_multipliers
        Pn = g.ple_n_heads
        offs = g.ple_head_offsets[k * Pn:(k + 1) * Pn] if len(g.ple_head_offsets) > Pn else g.ple_head_offsets
        sizes = g.ple_head_vocab_sizes[k * Pn:(k + 1) * Pn] if len(g.ple_head_vocab_sizes) > Pn else g.ple_head_vocab_sizes
        self.hash = NGramHash(mult, offs, sizes, ngram_size=N, heads_per_ngram=g.ple_heads_per_ngram,
                              eos_token_id=g.ple_eos_token_id, n_rows=g.ple_table_rows)
        self.layer, self.E, self.hc, self.Pe, self.eps = layer, E, g.hc, Pe, g.rms_eps
        self.Pd, self.Pk, self.dil = g.ple_row_dim, g.ple_conv_kernel, N  # dilation = ngram_size (not stored)
        self.key = as_linear(take(t, f"{b}.ple_key.weight"), f"{b}.ple_key.weight", Pe, HE)
        self.value = as_linear(take(t, f"{b}.ple_value.weight"), f"{b}.ple_value.weight", Pe, E)
        self.norm_key = as_f32(take(t, f"{b}.ple_norm_key.weight"), f"{b}.ple_norm_key.weight", (HE,))
        self.norm_query = as_f32(take(t, f"{b}.ple_norm_query.weight"), f"{b}.ple_norm_query.weight", (HE,))
        self.norm_conv = as_f32(take(t, f"{b}.ple_norm_conv.weight"), f"{b}.ple_norm_conv.weight", (HE,))
        self.conv = as_f32(take(t, f"{b}.ple_conv1d.weight"), f"{b}.ple_conv1d.weight", (HE, self.Pk))
        self.conv_taps = np.ascontiguousarray(self.conv.T)  # [Pk, HE]: a tap's weights contiguous
        self.table_rows = table_rows

    def _embed(self, rows: np.ndarray) -> np.ndarray:
        """rows int64[T, Pn] -> e f32[T, Pe] (the heads' rows side by side, head order)."""
        e = self.table_rows(rows.reshape(-1))
        if e.shape != (rows.size, self.Pd):
            raise ValueError(f"layer {self.layer}: table_rows gave {e.shape}, expected ({rows.size}, {self.Pd})")
        return e.reshape(rows.shape[0], self.Pe)

    def _gated(self, be, streams: np.ndarray, e: np.ndarray) -> np.ndarray:
        """streams [T, HE], e [T, Pe] -> G [T, HE]."""
        T, hc, E, sc = streams.shape[0], self.hc, self.E, be.scratch
        # the products into the step's buffers: a token's product without an out went the unplanned way
        K = be.rmsnorm(be.linear(self.key, e, sc("ple.k", (T, hc * E))), self.norm_key, self.eps, group=E, f32_sums=True)
        K = K.reshape(T, hc, E)
        Q = be.rmsnorm(streams, self.norm_query, self.eps, group=E, f32_sums=True).reshape(T, hc, E)
        g = (K * Q).sum(axis=-1, dtype=F32) / F32(math.sqrt(E))
        g = np.sign(g) * np.sqrt(np.maximum(np.abs(g), F32(1e-6)))
        V = be.linear(self.value, e, sc("ple.v", (T, E)))
        return (be.sigmoid(g, exp_form=True)[:, :, None] * V[:, None, :]).reshape(T, hc * E)

    def step_rows(self, token: int, state: PLEState) -> np.ndarray:
        """The device token step's rows, made before the step from its input token: e f32 [1, Pe], the
        window and the ring's count advanced as `forward` advances them (forward with `e` does
        neither), so that the step itself reads nothing of the host's (a captured step replays it)."""
        tokens = np.array([token], np.int64)
        ctx = self.hash.contexts(state.window, tokens)
        state.window[:] = np.concatenate([state.window, tokens])[1:]
        state.t += 1
        return self._embed(self.hash.rows(ctx))

    def forward(self, be, streams: np.ndarray, tokens: np.ndarray, states, e=None) -> None:
        """In place: streams f32[T, HE] += PLE outputs for tokens int64[T]. `states`: one PLEState (every
        row its sequence's) or a list of Seq (engine/batch.py) with theirs; each advances by its rows.
        The n-gram windows and the conv run per sequence, the products and norms over all rows.

        `e`: the device token step's rows, staged from `step_rows` (one token of one sequence): the
        conv then reads and writes the ring at the device's position (DeviceBackend.ple_conv_step)."""
        if e is not None:
            state = seqs_of(states, 1)[0].state
            G = self._gated(be, streams, e)
            X = be.rmsnorm(G, self.norm_conv, self.eps, group=self.E, f32_sums=True)
            be.ple_output(streams, G, be.ple_conv_step(state.ring, X, self.conv_taps, self.dil))
            return
        T, HE = streams.shape
        if HE != self.hc * self.E or tokens.shape != (T,):
            raise ValueError(f"layer {self.layer}: PLE got streams {streams.shape} and tokens {tokens.shape}, "
                             f"expected [T, {self.hc * self.E}] and [T]")
        seqs = seqs_of(states, T)
        ctx = []
        for r in seqs:
            ctx.append(self.hash.contexts(r.state.window, tokens[r.a : r.b]))
            r.state.window[:] = np.concatenate([r.state.window, tokens[r.a : r.b]])[r.n :]
            if r.saved is not None:  # the window now, the ring once the conv below has advanced it
                r.saved.window[:] = r.state.window
        rows = self.hash.rows(ctx[0] if len(ctx) == 1 else np.concatenate(ctx))
        # gathered where the backend computes when the table is there (the device step's), else the
        # rows of the host's table in one copy to it
        e = be.ple_rows(rows.reshape(-1), self.Pd)
        e = be.upload(self._embed(rows)) if e is None else e.reshape(T, self.Pe)
        G = self._gated(be, streams, e)
        X = be.rmsnorm(G, self.norm_conv, self.eps, group=self.E, f32_sums=True)
        y = self._conv(be, X, seqs[0].state) if len(seqs) == 1 else \
            np.concatenate([self._conv(be, X[r.a : r.b], r.state, r.saved) for r in seqs])
        be.ple_output(streams, G, y)

    def _conv(self, be, X: np.ndarray, state: PLEState, saved: PLEState | None = None) -> np.ndarray:
        """Depthwise causal conv of X [T, HE], dilation N, over the ring's history; advances the ring
        (and copies it into `saved` when given)."""
        L, T = state.ring.shape[0], X.shape[0]
        y = be.empty(X.shape)
        be.ple_conv(state.ring, state.t, X, self.conv_taps, self.dil, y)
        keep = min(T, L)
        slots = (state.t + T - keep + np.arange(keep)) % L
        state.ring[slots] = X[T - keep:]
        state.t += T
        if saved is not None:
            state.copy_ring_to(saved)
        return y


def output_reference(streams: np.ndarray, G: np.ndarray, y: np.ndarray) -> None:
    """streams += G + silu(y), in place (PLE's output, `_add_output`'s numbers)."""
    streams += G + y * sigmoid(y)


def add_output(streams: np.ndarray, G: np.ndarray, y: np.ndarray) -> None:
    """output_reference, in place."""
    _add_output(streams, G, y, np.exp(np.negative(y)))  # numpy's exp: the one transcendental step


@cached_njit("ple-output")
def _add_output(streams, G, y, ex):
    # output_reference from ex = exp(-y) (numpy's exp: the one transcendental step) in one pass,
    # where numpy made six over [T, hc E]: sigmoid(y) = 1 / (ex + 1), then the same f32 products
    # and sums in the same order (no FMA: fastmath off)
    for t in range(streams.shape[0]):
        for i in range(streams.shape[1]):
            streams[t, i] += G[t, i] + y[t, i] * (F32(1) / (ex[t, i] + F32(1)))


def conv_reference(ring: np.ndarray, t0: int, X: np.ndarray, w: np.ndarray, dil: int) -> np.ndarray:
    """The conv of `PLELayer._conv`, as numpy: y[t] = 0 + sum over taps j, in order, of w[:, j] times
    the input (Pk-1-j) * dil tokens back (ring: the last L inputs, token i at ring[i % L], t0 seen)."""
    L, T, Pk = ring.shape[0], X.shape[0], w.shape[1]
    hist = np.concatenate([ring[(t0 + np.arange(L)) % L], X])  # oldest first, [L + T, HE]
    y = np.zeros_like(X)
    for j in range(Pk):  # tap j reads the input (Pk-1-j)*N tokens back
        y += w[:, j] * hist[L - (Pk - 1 - j) * dil : L - (Pk - 1 - j) * dil + T]
    return y


def conv_taps(ring: np.ndarray, t0: int, X: np.ndarray, taps: np.ndarray, dil: int, y: np.ndarray) -> None:
    """conv_reference into y."""
    _conv_taps(ring, t0, X, taps, dil, y)


@cached_njit("ple-conv")
def _conv_taps(ring, t0, X, taps, dil, y):
    # conv_reference reading the ring in place, without its [L + T, HE] history copy and the
    # product temporaries: each element the same f32 products added in the same order from 0
    # (no FMA: fastmath off). taps = w.T, [Pk, HE].
    L = ring.shape[0]
    T, HE = X.shape
    Pk = taps.shape[0]
    for t in range(T):
        y[t] = F32(0)
        for j in range(Pk):
            back = t - (Pk - 1 - j) * dil  # the token read, relative to this chunk
            src = X[back] if back >= 0 else ring[(t0 + L + back) % L]
            for c in range(HE):
                y[t, c] += taps[j, c] * src[c]
