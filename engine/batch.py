"""A batch's rows by sequence: which rows of a block's [T, n] input belong to which sequence.

A forward takes the rows of one or more sequences at once: a prompt chunk (one sequence, T rows),
the decode step (one sequence, one row), or `strata serve --batch N`'s step (one row of each
decoding request, and a prompt chunk beside them). The rows of a sequence are consecutive; its
block state and position travel with them as a `Seq`. The row-wise work (every matrix product, the
norms, the MoE's router and grouped experts, the hyper-connections) runs over all T rows at once;
the work along a sequence (convolutions, the delta rule, attention and its caches, PLE) runs per
`Seq` on its rows, with its state. Rows never mix across sequences, so a request's numbers are the
same whatever runs beside it (tests/engine/test_serve.py checks greedy output alone and batched).
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Seq(NamedTuple):
    """Rows [a, b) of a batch: one sequence's tokens at positions pos .. pos + b - a - 1, and this
    block's state of that sequence (a KV cache, the recurrent states, ...). `saved`: where a block
    copies that state once it has advanced it by these rows (`keep`), or None: speculative
    decoding's verify forward runs each row as its own Seq and keeps every row's state, to roll back
    to the last accepted one (engine/speculative.py)."""

    state: Any
    a: int
    b: int
    pos: int
    saved: Any = None

    @property
    def n(self) -> int:
        return self.b - self.a


def copy_state(src, dst) -> None:
    """dst <- src for a block's state: an array (a host array, or the device step's, copied where it
    lives: a rollback on the device brings nothing to the host), a dict of arrays (Gated DeltaNet's
    conv and S), or an object with `copy_to` (PLEState)."""
    if isinstance(src, dict):
        for k, v in src.items():
            copy_state(v, dst[k])
    elif hasattr(src, "copy_to"):
        src.copy_to(dst)
    else:  # (a CuPy array is no np.ndarray: it had gone to `copy_to`, which it has not)
        dst[...] = src


def keep(r: Seq) -> None:
    """After a block advanced r.state by r's rows: a copy into r.saved, when one is asked for."""
    if r.saved is not None:
        copy_state(r.state, r.saved)


def seqs_of(state_or_seqs, T: int, pos: int = 0) -> list[Seq]:
    """`state_or_seqs` as a list of Seq: a list of Seq as is, one state as the one sequence of all T rows."""
    if isinstance(state_or_seqs, list):
        return state_or_seqs
    return [Seq(state_or_seqs, 0, T, pos)]
