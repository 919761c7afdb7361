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
