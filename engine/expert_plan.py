"""The GPU expert tier's plan: how many slots (S8), and which experts fill them (S9).

Pure arithmetic on the profile and the measured free memory, no GPU: the engine calls it with
what cudaMemGetInfo says once the weights and the session are allocated, and strata-budget calls
it with the free memory the plan predicts at that point, so both print the same numbers.

S8 (seed 6.6), `--expert-cache auto`:

    reserve = (vram_reserve_mib + prefill_mib) MiB + draft-head binding bytes
    prefill_mib = 160 + chunk * 680 / 1024 (integer MiB) when the prompt path has a chunk > 0 and
                  does not borrow its buffers, else 0
    slots = (free - reserve) / max_blob, capped at the profile's pair count, never below 0

Everything allocated after the cache opens comes out of the reserve; the chunk buffers and the
draft head's binding are named in it because each once pushed a card below the stall line
(WDDM pages an over-subscribed allocation instead of failing; #199: a larger CJK head ate 110-180
MiB of a 16 GB card's reserve).

S9 (seed 6.7), the profile fill, runs ONCE at startup: with `slots` pairs for `slots` slots the
cache is full when it returns, decode admits nothing, and every expert not placed is a CPU miss for
the whole run: the profile is the policy, not a hint. The share of slots each layer gets is chosen
to maximise the expected hit rate (`layer_shares`, with the proof); the fill then walks the
profile's ranking once and a layer whose share is full skips only ITS pairs. Seed #369: the fill
loop ended at the first full layer, leaving most layers empty.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from strata.index_format.expert_profile import ExpertProfile

MiB = 1 << 20
GiB = 1 << 30
PREFILL_BASE_MIB = 160  # the prompt path's fixed buffers (seed generate.cpp:2941)
PREFILL_KIB_PER_TOKEN = 680  # per token of the chunk

FILL_PROFILE = "PROFILE, ranked by routing frequency, no eviction."
FILL_COMPULSORY = "compulsory-miss (fills with whatever the run routes first)"


class ProfileMismatch(ValueError):
    """A profile made for another pack or model (it would silently decide the wrong experts)."""


# --- S8: the slot count ---------------------------------------------------------------------------


def prefill_mib(chunk: int, *, borrowed: bool = False) -> int:
    """MiB reserved for the prompt path's chunk buffers: 160 + chunk * 680 / 1024, or 0 (no chunk, or borrowed)."""
    if chunk < 0:
        raise ValueError(f"prefill chunk {chunk}: expected >= 0 (0 = no batched prompt path)")
    return PREFILL_BASE_MIB + chunk * PREFILL_KIB_PER_TOKEN // 1024 if chunk > 0 and not borrowed else 0


def reserve_bytes(reserve_mib: int, prefill_chunk: int, draft_bind_bytes: int, *, prefill_borrowed: bool = False) -> int:
    """S8's reserve: (vram_reserve_mib + prefill MiB) MiB + the draft head's binding bytes."""
    if reserve_mib < 0 or draft_bind_bytes < 0:
        raise ValueError(f"reserve {reserve_mib} MiB and draft binding {draft_bind_bytes} B: expected >= 0")
    return (reserve_mib + prefill_mib(prefill_chunk, borrowed=prefill_borrowed)) * MiB + draft_bind_bytes


def auto_slots(free_bytes: int, reserve_mib: int, prefill_chunk: int, draft_bind_bytes: int, max_blob: int,
               profile_pairs: int | None, *, prefill_borrowed: bool = False) -> int:
    """`--expert-cache auto` exactly as S8: (free - reserve) // max_blob, capped at the profile's pairs, >= 0."""
    if max_blob <= 0:
        raise ValueError(f"max_blob {max_blob}: expected the largest expert's bytes, > 0")
    reserve = reserve_bytes(reserve_mib, prefill_chunk, draft_bind_bytes, prefill_borrowed=prefill_borrowed)
    slots = (free_bytes - reserve) // max_blob  # floor division: a negative remainder gives <= -1, clamped below
    if profile_pairs is not None:
        slots = min(slots, profile_pairs)  # a slot with no profiled pair to hold is wasted memory
    return max(slots, 0)


def _mib_text(n_bytes: int) -> str:
    mib = n_bytes / MiB
    return f"{mib:.0f}" if n_bytes % MiB == 0 else f"{mib:.1f}"


def auto_line(free_bytes: int, reserve_mib: int, prefill_chunk: int, draft_bind_bytes: int, slots: int, *,
              prefill_borrowed: bool = False) -> str:
    """S8's log line: `expert cache auto: X GiB free, R MiB reserved (+Y MiB for the draft head) -> N slots`."""
    r = reserve_mib + prefill_mib(prefill_chunk, borrowed=prefill_borrowed)
    return (f"expert cache auto: {free_bytes / GiB:.2f} GiB free, {r} MiB reserved "
            f"(+{_mib_text(draft_bind_bytes)} MiB for the draft head) -> {slots} slots")


# --- S9: which experts ------------------------------------------------------------------------------


def check_profile(profile: ExpertProfile, *, pack_fingerprint: str, n_layer: int, n_expert: int, top_k: int,
                  where: str = "expert profile") -> None:
    """Refuse a profile made for another pack (naming both fingerprints) or another model."""
    if profile.pack_fingerprint != pack_fingerprint:
        raise ProfileMismatch(f"{where}: made for pack {profile.pack_fingerprint}, but this pack is {pack_fingerprint}; "
                              "build a profile for this pack with strata-profile")
    have = (profile.n_layer, profile.n_expert, profile.top_k)
    if have != (n_layer, n_expert, top_k):
        raise ProfileMismatch(f"{where}: (n_layer, n_expert, top_k) = {have}, this model has {(n_layer, n_expert, top_k)}")


def fill_policy_line(profile: ExpertProfile | None) -> str:
    """S9's log line for the fill policy in force."""
    return FILL_PROFILE if profile is not None else FILL_COMPULSORY


def _hit_order(profile: ExpertProfile) -> np.ndarray:
    """Record indices by normalised frequency count / layer total, descending; ties by layer, expert.

    With equal layer totals (every profile strata-profile writes: each layer routes tokens * top_k
    uses) this is the file's own order; otherwise exact fractions, so no float near-tie can reorder."""
    totals = profile.layer_totals()
    present = {totals[l] for l in set(profile.records["layer"].tolist())}
    if len(present) <= 1:
        return np.arange(profile.pairs)
    r = profile.records
    keys = [(-Fraction(c, totals[l]), l, e) for l, e, c in zip(r["layer"].tolist(), r["expert"].tolist(), r["count"].tolist())]
    return np.array(sorted(range(len(keys)), key=keys.__getitem__), dtype=np.int64)


def _weights(profile: ExpertProfile, on: ExpertProfile) -> np.ndarray:
    """Per record of `profile`: its pair's share of the routed uses of `on` (all layers weigh the same)."""
    totals = np.array(on.layer_totals(), dtype=np.float64)
    counts = on.count_matrix().astype(np.float64)
    l, e = profile.records["layer"].astype(np.int64), profile.records["expert"].astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        w = np.where(totals[l] > 0, counts[l, e] / totals[l], 0.0)
    return w / profile.n_layer


def layer_shares(profile: ExpertProfile, slots: int) -> list[int]:
    """How many of `slots` slots each layer gets, chosen to maximise the expected hit rate.

    Policy: the `slots` pairs of largest normalised frequency w(l, e) = count(l, e) / total(l)
    over the whole model, ties broken by layer then expert; a layer's share is how many of them it
    holds (its hottest experts, since w ranks a layer's experts by count).

    Why normalised: every layer routes the same number of uses per token (top_k), so the hit rate
    of a run is H(S) = (1 / L) * sum over layers of (uses of layer l served by S) / (uses of layer l),
    and the profile's estimate of the second factor is sum over (l, e) in S of w(l, e). Raw counts
    would favour a layer only because its profile counted more (merged or partial profiles).

    Optimality (slots of uniform size: every slot holds the largest expert blob, so any pair costs
    exactly one slot, whatever its layer): H(S) = (1 / L) * sum of w over S is a sum of independent
    non-negative weights under the single constraint |S| <= slots. Take any feasible S and the set
    T of the `slots` largest weights. If S != T there are p in T - S and q in S - T (or |S| < slots
    and p in T - S is free to add) with w(p) >= w(q); replacing q by p (or adding p) does not lower
    H. Each swap raises |S & T|, so after finitely many H(T) >= H(S): T is optimal. The sets are
    nested in `slots`, so the hit-rate curve is the running sum of the sorted weights, concave.
    (With slots of per-layer sizes this would be a knapsack; uniform slots make it greedy-exact.)
    """
    if slots < 0:
        raise ValueError(f"slots {slots}: expected >= 0")
    shares = [0] * profile.n_layer
    for i in _hit_order(profile)[:slots].tolist():
        shares[int(profile.records["layer"][i])] += 1
    return shares


def plan_fill(profile: ExpertProfile, slots: int, n_layer: int) -> list[list[int]]:
    """The ONE fill of the cache (S9): per layer, the experts placed, hottest first.

    One pass over the profile's ranking: each layer takes its hottest experts until its share
    (`layer_shares`) is full; a full layer skips only its own pairs and the walk goes on (seed #369:
    stopping at the first full layer left most layers empty). The result is exactly the optimal set.
    """
    if profile.n_layer != n_layer:
        raise ProfileMismatch(f"expert profile: {profile.n_layer} layers, the model has {n_layer}")
    shares = layer_shares(profile, slots)
    placed: list[list[int]] = [[] for _ in range(n_layer)]
    left = sum(shares)
    for layer, expert in zip(profile.records["layer"].tolist(), profile.records["expert"].tolist()):
        if left == 0:
            break  # every slot is placed: the cache is full
        if len(placed[layer]) == shares[layer]:
            continue  # THIS layer is full; the others still take their pairs
        placed[layer].append(expert)
        left -= 1
    return placed


def hit_rate_curve(profile: ExpertProfile, evaluate_on: ExpertProfile | None = None) -> np.ndarray:
    """Expected hit rate (share of routed expert uses served by the GPU) for 0..pairs slots.

    curve[k] is the hit rate of the k-slot plan made from `profile`, measured on `evaluate_on`
    (held-out routing counts of the same pack) or, by default, on `profile` itself (in-sample, an
    optimistic figure: a static hot list is weaker on text it was not built from)."""
    on = profile if evaluate_on is None else evaluate_on
    if on is not profile and (on.pack_fingerprint, on.n_layer, on.n_expert) != \
            (profile.pack_fingerprint, profile.n_layer, profile.n_expert):
        raise ProfileMismatch("hit_rate_curve: the held-out counts belong to another pack or model")
    w = _weights(profile, on)[_hit_order(profile)]
    return np.concatenate(([0.0], np.cumsum(w)))


def expected_hit_rate(profile: ExpertProfile, slots: int, evaluate_on: ExpertProfile | None = None) -> float:
    """The hit-rate curve at `slots` (slots beyond the profile's pairs add nothing)."""
    if slots < 0:
        raise ValueError(f"slots {slots}: expected >= 0")
    curve = hit_rate_curve(profile, evaluate_on)
    return float(curve[min(slots, len(curve) - 1)])


# --- the slot table the hit path reads ---------------------------------------------------------------


class SlotMap:
    """(layer, expert) -> slot, or -1 for a CPU miss. `table` int32 [n_layer, n_expert] is what the
    hit path uploads. Never evicts: filled once from a plan (then frozen: decode admits nothing), or,
    without a profile, first-come by `admit` until full (compulsory misses)."""

    def __init__(self, slots: int, n_layer: int, n_expert: int):
        if slots < 0:
            raise ValueError(f"slots {slots}: expected >= 0")
        self.slots = slots
        self.table = np.full((n_layer, n_expert), -1, np.int32)
        self.used = 0
        self.frozen = False

    @classmethod
    def from_fill(cls, fill: list[list[int]], slots: int, n_expert: int) -> "SlotMap":
        """Slots numbered layer by layer in the fill's order; frozen afterwards (S9)."""
        m = cls(slots, len(fill), n_expert)
        for layer, experts in enumerate(fill):
            for e in experts:
                if m._place(layer, e) is None:
                    raise ValueError(f"fill places {sum(map(len, fill))} experts in {slots} slots")
        m.frozen = True
        return m

    def slot(self, layer: int, expert: int) -> int:
        return int(self.table[layer, expert])

    def admit(self, layer: int, expert: int) -> int | None:
        """Compulsory-miss admission: the pair's slot, a new one while any is free, else None (a miss)."""
        s = self.slot(layer, expert)
        if s >= 0 or self.frozen:
            return s if s >= 0 else None
        return self._place(layer, expert)

    def _place(self, layer: int, expert: int) -> int | None:
        if self.table[layer, expert] >= 0:
            raise ValueError(f"layer {layer} expert {expert} is placed twice")
        if self.used == self.slots:
            return None
        self.table[layer, expert] = self.used
        self.used += 1
        return self.used - 1
