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
    block's state of that sequence (a KV cache, the recurrent states, ...)."""

    state: Any
    a: int
    b: int
    pos: int

    @property
    def n(self) -> int:
        return self.b - self.a


def seqs_of(state_or_seqs, T: int, pos: int = 0) -> list[Seq]:
    """`state_or_seqs` as a list of Seq: a list of Seq as is, one state as the one sequence of all T rows."""
    if isinstance(state_or_seqs, list):
        return state_or_seqs
    return [Seq(state_or_seqs, 0, T, pos)]
