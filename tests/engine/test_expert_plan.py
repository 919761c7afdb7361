"""The slot count (S8) and the profile fill (S9): the seed's formula by independent arithmetic, the
fill's optimality by brute force, and the #369 regression (a full layer ending the whole fill).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.expert_plan import (
    FILL_COMPULSORY,
    FILL_PROFILE,
    ProfileMismatch,
    SlotMap,
    auto_line,
    auto_slots,
    check_profile,
    expected_hit_rate,
    fill_policy_line,
    hit_rate_curve,
    layer_shares,
    plan_fill,
    prefill_mib,
)
from strata.index_format.expert_profile import ExpertProfile

FP = "pk1-" + "ab" * 32
MIB = 1024 * 1024
SOME = settings(max_examples=60, deadline=None)


def profile(counts, tokens=None, top_k=1) -> ExpertProfile:
    m = np.array(counts)
    tokens = tokens if tokens is not None else int(m.sum(axis=1).max())
    return ExpertProfile.from_counts(FP, m, tokens=tokens, top_k=top_k)


# --- S8 -----------------------------------------------------------------------------------------------


def test_prefill_mib_is_the_seeds_integer_formula():
    assert prefill_mib(0) == 0
    assert prefill_mib(256) == 160 + 170  # 256 * 680 = 174080; / 1024 = 170
    assert prefill_mib(1024) == 160 + 680
    assert prefill_mib(100) == 160 + 66  # 68000 / 1024 = 66.4, integer division
    assert prefill_mib(256, borrowed=True) == 0
    with pytest.raises(ValueError):
        prefill_mib(-1)


def test_auto_slots_by_hand():
    # 10 GiB free, 700 MiB + prefill(256) 330 MiB, a 150 MiB draft head, the seed's layer-0 blob
    free, blob = 10 * 1024 * MIB, 1_868_800
    reserve = (700 + 330) * MIB + 150 * MIB
    assert auto_slots(free, 700, 256, 150 * MIB, blob, None) == (10_737_418_240 - reserve) // blob == 5_083
    assert auto_slots(free, 700, 256, 150 * MIB, blob, 1000) == 1000  # capped at the profile's pairs
    assert auto_slots(free, 700, 0, 0, blob, None) == (10_737_418_240 - 700 * MIB) // blob
    assert auto_slots(free, 700, 256, 0, blob, None, prefill_borrowed=True) == (10_737_418_240 - 700 * MIB) // blob
    assert auto_slots(600 * MIB, 700, 256, 0, blob, None) == 0  # never below 0
    assert auto_slots(700 * MIB + blob - 1, 700, 0, 0, blob, None) == 0
    assert auto_slots(700 * MIB + blob, 700, 0, 0, blob, None) == 1


def test_auto_line_exact():
    line = auto_line(10 * 1024 * MIB, 1600, 256, 150 * MIB, 4321)
    assert line == "expert cache auto: 10.00 GiB free, 1930 MiB reserved (+150 MiB for the draft head) -> 4321 slots"
    assert auto_line(3 * 1024 * MIB // 2, 700, 0, MIB // 2, 7) == \
        "expert cache auto: 1.50 GiB free, 700 MiB reserved (+0.5 MiB for the draft head) -> 7 slots"


def test_fill_policy_lines_exact():
    assert fill_policy_line(profile([[1, 2]])) == FILL_PROFILE == "PROFILE, ranked by routing frequency, no eviction."
    assert fill_policy_line(None) == FILL_COMPULSORY == "compulsory-miss (fills with whatever the run routes first)"


# --- S9: the fill ---------------------------------------------------------------------------------------


def best_by_brute_force(m: np.ndarray, slots: int) -> Fraction:
    """The best expected hit rate over EVERY way to share `slots` among layers (each layer's hottest)."""
    L = m.shape[0]
    totals = [int(r.sum()) for r in m]
    hottest = [sorted(r.tolist(), reverse=True) for r in m]
    routed = [int((r > 0).sum()) for r in m]
    best = Fraction(0)
    for share in itertools.product(*(range(n + 1) for n in routed)):
        if sum(share) <= slots:
            h = sum(Fraction(sum(hottest[l][: share[l]]), totals[l]) for l in range(L) if totals[l]) / L
            best = max(best, h)
    return best


def hit_of(m: np.ndarray, fill: list[list[int]]) -> Fraction:
    return sum(Fraction(int(sum(m[l, e] for e in es)), int(m[l].sum())) for l, es in enumerate(fill) if m[l].sum()) / m.shape[0]


@SOME
@given(data=st.data())
def test_fill_is_optimal_by_brute_force(data):
    L, X = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    m = np.array(data.draw(st.lists(st.integers(0, 50), min_size=L * X, max_size=L * X))).reshape(L, X)
    m[:, 0] += 1  # every layer routes something (a profile from a run always does)
    scale = data.draw(st.lists(st.sampled_from([1, 3, 100]), min_size=L, max_size=L))
    m = m * np.array(scale)[:, None]  # layers counted over different totals (merged profiles)
    p = ExpertProfile.from_counts(FP, m, tokens=int(m.sum(axis=1).max()), top_k=1)
    slots = data.draw(st.integers(0, L * X + 1))
    fill = plan_fill(p, slots, L)
    assert sum(map(len, fill)) == min(slots, p.pairs)
    for l, es in enumerate(fill):  # each layer holds its hottest experts, hottest first
        assert [m[l, e] for e in es] == sorted(m[l], reverse=True)[: len(es)]
    assert hit_of(m, fill) == best_by_brute_force(m, slots)
    assert expected_hit_rate(p, slots) == pytest.approx(float(best_by_brute_force(m, slots)), abs=1e-12)
    assert [len(es) for es in fill] == layer_shares(p, slots)


def buggy_fill_369(p: ExpertProfile, shares: list[int]) -> list[list[int]]:
    """The seed's fill before #369: one full layer ended the whole fill."""
    placed = [[] for _ in range(p.n_layer)]
    for layer, expert in zip(p.records["layer"].tolist(), p.records["expert"].tolist()):
        if len(placed[layer]) == shares[layer]:
            break
        placed[layer].append(expert)
    return placed


def every_layer_got_its_share(fill, shares) -> bool:
    return [len(es) for es in fill] == shares


def hot_layer_profile() -> ExpertProfile:
    # layer 0 counted 100x the others: its pairs head the ranking
    rng = np.random.default_rng(11)
    base = rng.integers(1, 50, size=(6, 16))
    base[0] *= 100
    return ExpertProfile.from_counts(FP, base, tokens=int(base.sum(axis=1).max()), top_k=1)


def test_full_layer_skips_only_its_own_pairs_369():
    p = hot_layer_profile()
    shares = layer_shares(p, 24)
    assert all(s > 0 for s in shares) and sum(shares) == 24
    fill = plan_fill(p, 24, 6)
    assert every_layer_got_its_share(fill, shares) and all(fill)  # no layer left empty
    # the same check catches the seed's bug: layer 0 fills first, and its being full ended the fill
    bug = buggy_fill_369(p, shares)
    assert not every_layer_got_its_share(bug, shares) and sum(1 for es in bug if not es) == 5


def test_shares_normalise_per_layer_and_beat_raw_counts():
    p = hot_layer_profile()
    m = p.count_matrix()
    # ranking raw counts would hand the 100x layer all 16 of its experts before any other layer's hottest
    raw = np.argsort(-m, axis=None, kind="stable")[:24]
    raw_fill = [[int(i % 16) for i in raw if i // 16 == l] for l in range(6)]
    assert len(raw_fill[0]) == 16
    assert hit_of(m, plan_fill(p, 24, 6)) > hit_of(m, raw_fill)


def test_expected_hit_rate_by_hand_and_held_out():
    # layer 0 routed experts 0..2 as 6, 3, 1; layer 1 as 5, 5, 0 (10 uses each)
    p = profile([[6, 3, 1], [5, 5, 0]], tokens=10)
    curve = hit_rate_curve(p)
    # ranking by share: (0,0) 0.6, (0,1) .3, (1,0) .5, (1,1) .5 -> .6 .5 .5 .3 .1
    assert np.allclose(curve, [0, 0.3, 0.55, 0.8, 0.95, 1.0])
    assert expected_hit_rate(p, 3) == pytest.approx(0.8) and expected_hit_rate(p, 99) == pytest.approx(1.0)
    held = profile([[1, 1, 8], [0, 10, 0]], tokens=10)
    # the 3-slot plan from p holds (0,0), (1,0), (1,1): on `held` that serves 1/10 and 10/10
    assert hit_rate_curve(p, evaluate_on=held)[3] == pytest.approx((0.1 + 1.0) / 2)
    with pytest.raises(ProfileMismatch):
        hit_rate_curve(p, evaluate_on=ExpertProfile.from_counts("pk1-" + "cd" * 32, np.array([[1, 1, 1], [1, 1, 1]]), tokens=3, top_k=1))


def test_curve_is_concave_and_nested():
    p = hot_layer_profile()
    c = hit_rate_curve(p)
    steps = np.diff(c)
    assert (steps >= 0).all() and (np.diff(steps) <= 1e-15).all() and c[-1] == pytest.approx(1.0)
    for s in range(0, p.pairs, 7):  # a plan with more slots keeps every pair of a smaller one
        small, big = plan_fill(p, s, 6), plan_fill(p, s + 7, 6)
        assert all(set(a) <= set(b) for a, b in zip(small, big))


def test_profile_for_another_pack_refused_naming_both():
    p = profile([[1, 2]])
    other = "pk1-" + "cd" * 32
    with pytest.raises(ProfileMismatch) as e:
        check_profile(p, pack_fingerprint=other, n_layer=1, n_expert=2, top_k=1)
    assert FP in str(e.value) and other in str(e.value)
    with pytest.raises(ProfileMismatch, match=r"\(1, 2, 1\), this model has \(2, 2, 1\)"):
        check_profile(p, pack_fingerprint=FP, n_layer=2, n_expert=2, top_k=1)
    check_profile(p, pack_fingerprint=FP, n_layer=1, n_expert=2, top_k=1)
    with pytest.raises(ProfileMismatch):
        plan_fill(p, 1, 3)


# --- the slot table -------------------------------------------------------------------------------------


def test_slot_map_from_the_fill_is_frozen():
    p = hot_layer_profile()
    fill = plan_fill(p, 10, 6)
    m = SlotMap.from_fill(fill, 10, 16)
    placed = [(l, e) for l, es in enumerate(fill) for e in es]
    assert sorted(m.slot(l, e) for l, e in placed) == list(range(10))
    missing = next((l, e) for l in range(6) for e in range(16) if (l, e) not in placed)
    assert m.admit(*missing) is None and m.slot(*missing) == -1  # decode admits nothing (S9)
    assert m.admit(*placed[0]) == m.slot(*placed[0])
    assert int((m.table >= 0).sum()) == 10


def test_compulsory_miss_admits_first_come_never_evicts():
    m = SlotMap(3, 2, 4)
    assert [m.admit(1, 2), m.admit(0, 0), m.admit(1, 2), m.admit(0, 3)] == [0, 1, 0, 2]
    assert m.admit(1, 1) is None and m.slot(1, 1) == -1  # full: a miss, and nothing is evicted
    assert [m.slot(1, 2), m.slot(0, 0), m.slot(0, 3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="placed twice"):
        SlotMap.from_fill([[1, 1]], 2, 4)
