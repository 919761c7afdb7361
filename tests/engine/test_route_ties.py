"""moe.route_topk ranks equal router probabilities by the lower expert id, inside the top-k and at
its edge: the device's routing kernels (dev_route, dev_route_rows) do, and a prompt chunk routed on
the device must pick and rank the experts the host would (tests/gpu/test_device_prompt.py)."""

from __future__ import annotations

import numpy as np
import pytest

from strata.engine.kernels.actq import NonFiniteActivation
from strata.engine.moe import route_topk


def test_ties_rank_the_lower_expert_first():
    rng = np.random.default_rng(3)
    T, X, k = 150, 24, 4
    logits = rng.standard_normal((T, X)).astype(np.float32)
    logits[:, 5] = logits[:, 9]  # ties within the top-k and at its edge
    logits[:, 17] = logits[:, 3]
    logits[:40, :] = 0.5  # every expert tied: experts 0 .. k - 1
    top, w = route_topk(logits, k)
    for t in range(T):
        p = np.exp(logits[t].astype(np.float64) - logits[t].max())
        want = sorted(range(X), key=lambda i: (-p[i], i))[:k]
        assert top[t].tolist() == want, t
        assert route_topk(logits[t : t + 1], k)[0][0].tolist() == want, t  # one row: the decode step's form
    assert np.allclose(w.sum(axis=1), 1.0)


def test_non_finite_router_logits_are_named():
    logits = np.zeros((3, 8), np.float32)
    logits[1, 2] = np.nan
    # a NonFiniteActivation (the commands name the weight it came from: tests/test_bad_input.py)
    with pytest.raises(NonFiniteActivation, match="token 1: non-finite activation"):
        route_topk(logits, 2)


def test_one_row_routing_is_the_numpy_selection():
    # route_topk's one-row kernel (the decode step's) against the numpy selection it replaces
    # (route_topk_reference): the same experts, ranks and weights to the bit, on rows with ties
    # inside the k and at its edge, every expert tied, and probabilities that underflow to 0
    from strata.engine.moe import Groups, route_topk_reference

    rng = np.random.default_rng(8)
    X, k = 64, 10
    rows = rng.standard_normal((300, X)).astype(np.float32)
    rows[:60, 7] = rows[:60, 40]  # ties
    rows[60:120] = np.round(rows[60:120])  # many ties, at the edge too
    rows[120:130] = 0.25  # all tied
    rows[130:160, ::2] = -2000.0  # half of them underflow to probability 0 ...
    rows[160:170, 11:] = -2000.0  # ... and more than X - k: the edge among zeros
    for t, row in enumerate(rows):
        got, want = route_topk(row[None], k), route_topk_reference(row[None], k)
        assert got[0].tolist() == want[0].tolist(), t
        assert got[1].dtype == want[1].dtype and np.array_equal(got[1].view(np.uint64), want[1].view(np.uint64)), t
        g, r = Groups(got[0]), Groups(got[0], one_row=False)
        for name in ("experts", "rows", "starts", "slot"):
            a, b = getattr(g, name), getattr(r, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), (t, name)


def test_a_non_finite_logit_of_one_row_is_named():
    logits = np.zeros((1, 8), np.float32)
    logits[0, 2] = np.nan
    with pytest.raises(NonFiniteActivation, match="token 0: non-finite activation"):
        route_topk(logits, 2)
