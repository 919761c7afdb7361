"""numpy's own inner loops called from a Numba kernel (engine/kernels/nploops.py): numpy's bits, or
no loop at all (0) where the ufunc's table is not what nploops reads."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from strata.engine.kernels import nploops

F32 = np.float32


@njit(nogil=True)
def _call(fn, x, out):
    nploops.unary_loop(fn, x, out)


def _exp(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return np.exp(x)


def test_the_exp_loop_is_found_on_this_numpy():
    # where it is 0 the token's mixes fall back to numpy calls between kernels (slower, the same bits)
    assert nploops.EXP, f"np.exp's float32 loop could not be read from numpy {np.__version__}"


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 333, 8204])
def test_a_kernel_calling_numpy_s_exp_loop_gets_np_exp_s_bits(n):
    x = nploops._probe()[:n].copy()
    rng = np.random.default_rng(n)
    x[: n // 2] = (rng.standard_normal(n // 2) * 40).astype(F32)  # (the probe's specials stay in the rest)
    out = np.full_like(x, 7.0)
    _call(nploops.EXP, x, out)
    assert np.array_equal(out.view(np.uint32), _exp(x).view(np.uint32))
    y = x.reshape(1, -1).copy()  # in place, a [1, n] row as the kernels pass it
    _call(nploops.EXP, y, y)
    assert np.array_equal(y.reshape(-1).view(np.uint32), _exp(x).view(np.uint32))


def test_a_loop_that_does_not_pass_its_check_or_is_not_there_is_zero():
    assert nploops.unary_loop_address(np.exp, "f->f", lambda call: False) == 0
    assert nploops.unary_loop_address(np.exp, "q->q", lambda call: True) == 0  # no such loop
    assert nploops.unary_loop_address(np.add, "ff->f", lambda call: True) == 0  # not a unary ufunc
    # np.tanh's loop is found, and checked against np.exp it fails
    assert nploops.unary_loop_address(np.tanh, "f->f", nploops._exp_matches) == 0
    assert nploops.unary_loop_address(np.tanh, "f->f", lambda call: True) != 0


def test_the_kernels_take_only_contiguous_float32():
    from numba.core.errors import TypingError

    x = np.zeros(8, np.float64)
    with pytest.raises(TypingError):
        _call(nploops.EXP, x, x)
    y = np.zeros((4, 4), F32)[:, ::2]
    with pytest.raises(TypingError):
        _call(nploops.EXP, y, y)
