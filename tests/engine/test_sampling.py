"""The decode-loop sampler: each filter keeps exactly the set its definition gives, draws follow the
filtered distribution, seeds reproduce, and a step after warm-up allocates no vocabulary-sized array.

Expected sets and distributions are computed here from the definitions (sorted cumulative mass,
p >= min_p * p_max, llama.cpp's penalty rule), never read back from the sampler.
"""

import math
import tracemalloc

import numpy as np
import pytest

from strata.engine.sampling import Sampler, SamplerParams

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)  # no filter: the distribution is softmax(logits / T)


def _logits(probs, order, n_vocab=None):
    """Logits over n_vocab tokens (the rest far below) placing probs[i] at token order[i]."""
    n_vocab = n_vocab or len(order)
    out = np.full(n_vocab, -60.0, np.float32)
    out[np.asarray(order)] = np.log(np.asarray(probs, np.float64)).astype(np.float32)
    return out


def _support(dist, tol=0.0):
    return set(np.flatnonzero(dist > tol).tolist())


def _softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


# -- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplerParams(temperature=0.0), SamplerParams(top_k=1, temperature=1.5)])
def test_greedy_is_argmax(params):
    rng = np.random.default_rng(3)
    s = Sampler(1000, params)
    for _ in range(20):
        logits = rng.standard_normal(1000).astype(np.float32)
        assert s.sample(logits) == int(np.argmax(logits))


def test_greedy_picks_the_lowest_id_on_ties():
    logits = np.zeros(50, np.float32)
    logits[[7, 30]] = 2.0
    assert Sampler(50, SamplerParams(temperature=0)).sample(logits) == 7


# -- seeds ----------------------------------------------------------------------------------------


def _run(seed, n=200):
    s = Sampler(64, SamplerParams(seed=seed, **OFF))
    logits = np.linspace(-1, 1, 64).astype(np.float32)
    return [s.sample(logits) for _ in range(n)]


def test_seeded_runs_reproduce_and_seeds_differ():
    assert _run(11) == _run(11)
    assert _run(11) != _run(12)


def test_unseeded_sampler_reports_the_seed_that_reproduces_it():
    first = Sampler(64, SamplerParams(**OFF))
    logits = np.linspace(-1, 1, 64).astype(np.float32)
    a = [first.sample(logits) for _ in range(100)]
    assert a == _run(first.seed, 100)


# -- filters: exact sets --------------------------------------------------------------------------

PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]  # no cumulative sum near the cut points used below
ORDER = [17, 3, 40, 8, 29, 0]  # tokens, in the order of PROBS, scattered over the vocabulary


def _top_p_set(probs, order, p):
    ranked = sorted(zip(probs, order), reverse=True)
    total = sum(probs)
    kept, mass = set(), 0.0
    for prob, token in ranked:
        kept.add(token)
        mass += prob
        if mass >= p * total:
            return kept
    return kept


@pytest.mark.parametrize("top_p, expected_n", [(0.3, 1), (0.5, 2), (0.75, 3), (0.85, 4), (0.93, 5), (0.99, 6)])
def test_top_p_keeps_the_smallest_head_reaching_the_mass(top_p, expected_n):
    s = Sampler(64, SamplerParams(temperature=1.0, top_k=0, top_p=top_p, min_p=0.0))
    dist = s.distribution(_logits(PROBS, ORDER, 64))
    expected = _top_p_set(PROBS, ORDER, top_p)
    assert len(expected) == expected_n
    assert _support(dist, 1e-12) == expected
    np.testing.assert_allclose(dist[sorted(expected)], _renorm(PROBS, ORDER, expected), rtol=1e-5)


def _renorm(probs, order, kept):
    sel = {t: p for p, t in zip(probs, order) if t in kept}
    total = sum(sel.values())
    return [sel[t] / total for t in sorted(kept)]


@pytest.mark.parametrize("min_p", [0.05, 0.12, 0.2, 0.5, 0.9])
def test_min_p_keeps_tokens_at_least_min_p_times_the_max(min_p):
    s = Sampler(64, SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=min_p))
    dist = s.distribution(_logits(PROBS, ORDER, 64))
    expected = {t for p, t in zip(PROBS, ORDER) if p >= min_p * max(PROBS)}
    assert _support(dist, 1e-12) == expected


@pytest.mark.parametrize("k", [2, 3, 5])
def test_top_k_keeps_the_k_most_likely(k):
    s = Sampler(64, SamplerParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0))
    dist = s.distribution(_logits(PROBS, ORDER, 64))
    assert _support(dist, 1e-12) == set(ORDER[:k])


def test_filters_compose_in_llama_cpp_order_with_temperature_last():
    # top-k 5 then top-p 0.75 (of the temperature-1 mass) -> 3 tokens; T = 0.5 only reshapes them.
    params = SamplerParams(temperature=0.5, top_k=5, top_p=0.75, min_p=0.0)
    dist = Sampler(64, params).distribution(_logits(PROBS, ORDER, 64))
    head = PROBS[:5]
    kept = _top_p_set(head, ORDER[:5], 0.75)
    assert kept == set(ORDER[:3])
    expected = _softmax(np.log(PROBS[:3]) / 0.5)
    np.testing.assert_allclose(dist[ORDER[:3]], expected, rtol=1e-5)
    assert dist.sum() == pytest.approx(1.0)


def test_random_distributions_match_the_definitions():
    rng = np.random.default_rng(5)
    checked = 0
    for _ in range(200):
        n = 300
        logits = (rng.standard_normal(n) * rng.uniform(0.5, 4)).astype(np.float32)
        probs = _softmax(logits)
        top_p, min_p = rng.uniform(0.2, 0.99), rng.uniform(0.0, 0.3)
        ranked = np.sort(probs)[::-1]
        cum = np.cumsum(ranked)
        if np.min(np.abs(cum - top_p)) < 1e-5 or np.min(np.abs(probs - min_p * probs.max())) < 1e-6:
            continue  # a boundary within float32 noise: either answer is right
        cut = ranked[np.searchsorted(cum, top_p)]
        expected = set(np.flatnonzero((probs >= cut) & (probs >= min_p * probs.max())).tolist())
        s = Sampler(n, SamplerParams(temperature=0.9, top_k=0, top_p=top_p, min_p=min_p))
        assert _support(s.distribution(logits)) == expected
        checked += 1
    assert checked > 150


def test_top_p_over_a_flat_vocabulary_larger_than_the_first_sorted_head():
    # A nearly flat vocabulary: the 512 most likely hold ~26% of the mass, so top-p 0.5 must look further.
    n = 2000
    logits = np.zeros(n, np.float32)
    logits[:1000] = 0.001 + 0.01 * np.arange(1000, 0, -1, dtype=np.float32) / 1000  # strictly decreasing
    probs = _softmax(logits)
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    expected = set(order[: int(np.searchsorted(cum, 0.5)) + 1].tolist())
    dist = Sampler(n, SamplerParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)).distribution(logits)
    assert _support(dist) == expected
    assert 900 < len(expected) <= 1000


# -- penalties ------------------------------------------------------------------------------------


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 1.0, -0.5, 0.0, 3.0], np.float32)
    history = [5, 0, 1, 1, 4]  # token 1 twice: penalised once, not squared
    s = Sampler(6, SamplerParams(temperature=1.0, repeat_penalty=2.0, repeat_last_n=4, **OFF))
    dist = s.distribution(logits, history)
    # window = last 4 = [0, 1, 1, 4]; token 5 is outside it; 0 * 2 stays 0
    expected = _softmax([1.0, -4.0, 1.0, -0.5, 0.0, 3.0])
    np.testing.assert_allclose(dist, expected, rtol=1e-6)


def test_repeat_penalty_makes_a_repeated_negative_best_token_lose():
    logits = np.array([-1.0, -1.2, -3.0], np.float32)
    s = Sampler(3, SamplerParams(temperature=0, repeat_penalty=1.5))
    assert s.sample(logits, []) == 0
    # -1.0 * 1.5 = -1.5 < -1.2. Dividing instead (-0.67) would keep token 0 on top.
    assert s.sample(logits, [0]) == 1


def test_frequency_and_presence_penalties_follow_counts_in_the_window():
    logits = np.zeros(4, np.float32)
    s = Sampler(4, SamplerParams(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=8, **OFF))
    dist = s.distribution(logits, [2, 2, 2, 3])
    expected = _softmax([0.0, 0.0, -(3 * 0.5 + 0.25), -(1 * 0.5 + 0.25)])
    np.testing.assert_allclose(dist, expected, rtol=1e-6)


def test_penalty_state_does_not_leak_between_calls():
    logits = np.zeros(4, np.float32)
    s = Sampler(4, SamplerParams(temperature=1.0, frequency_penalty=1.0, repeat_last_n=8, **OFF))
    s.distribution(logits, [1, 1, 1])
    np.testing.assert_allclose(s.distribution(logits, [1]), _softmax([0, -1, 0, 0]), rtol=1e-6)


# -- draws ----------------------------------------------------------------------------------------


def test_draw_frequencies_match_the_filtered_distribution():
    rng = np.random.default_rng(9)
    n, draws, T = 40, 40000, 0.7
    logits = rng.standard_normal(n).astype(np.float32)
    s = Sampler(n, SamplerParams(temperature=T, top_k=8, top_p=1.0, min_p=0.0, seed=123))
    counts = np.bincount([s.sample(logits) for _ in range(draws)], minlength=n)
    top8 = np.argsort(-logits)[:8]
    expected = np.zeros(n)
    expected[top8] = _softmax(logits[top8] / T)
    assert set(np.flatnonzero(counts).tolist()) <= set(top8.tolist())
    chi2 = float(np.sum((counts[top8] - draws * expected[top8]) ** 2 / (draws * expected[top8])))
    # 7 degrees of freedom: the 99.99th percentile is about 29.9; a wrong temperature gives hundreds.
    assert chi2 < 30, chi2


def test_a_token_with_all_the_mass_is_always_drawn():
    logits = np.full(100, -1e4, np.float32)
    logits[42] = 0.0
    s = Sampler(100, SamplerParams(temperature=1.0, seed=0, **OFF))
    assert {s.sample(logits) for _ in range(200)} == {42}


# -- no allocation per token (S12) ---------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplerParams(seed=1, repeat_penalty=1.1),
        SamplerParams(seed=1, top_k=0, top_p=0.999, min_p=0.0, frequency_penalty=0.2),
        SamplerParams(seed=1, temperature=0.0, repeat_penalty=1.3),
    ],
)
def test_a_step_allocates_no_vocabulary_sized_array(params):
    n = 200_000
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(n) * 3).astype(np.float32)
    history = rng.integers(0, n, 100).tolist()
    s = Sampler(n, params)
    s.sample(logits, history)  # warm-up
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for _ in range(32):
            s.sample(logits, history)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # The smallest vocabulary-sized array (a bool mask) is n bytes; window temporaries are ~1 kB.
    assert peak < n // 8, f"a step made a temporary of {peak} bytes (vocabulary {n})"


# -- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -0.1), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", math.nan),
     ("repeat_penalty", 0.0), ("repeat_last_n", 2.5), ("seed", -3), ("top_k", True)],
)
def test_bad_settings_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"sampler setting {field}"):
        SamplerParams(**{field: value})


def test_bad_logits_are_refused():
    s = Sampler(8, SamplerParams(temperature=0))
    with pytest.raises(ValueError, match="float32 array of shape"):
        s.sample(np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="float32 array of shape"):
        s.sample(np.zeros(9, np.float32))
    bad = np.zeros(8, np.float32)
    bad[3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        s.sample(bad)


def test_history_ids_outside_the_vocabulary_are_refused():
    s = Sampler(8, SamplerParams(repeat_penalty=1.2))
    with pytest.raises(ValueError, match="token id 8 outside"):
        s.sample(np.zeros(8, np.float32), [1, 8])
