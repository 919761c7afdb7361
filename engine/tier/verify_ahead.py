"""Speculative decoding's verify run ahead of the host, on the device step (Model.verify_ahead).

A greedy verify of T = 1 + N rows (engine/speculative.py) ends with each row's pick on the device.
The plain loop then waits for the picks, judges the drafts on the host, rolls the states back
(a graph of copies), drafts the next chain and stages its ids and positions: on an H200 (seed-4l
qwen35moe, 2026-12-06) a verify's forward took 1.17 ms in the decode against 1.10 ms alone, and the
host's part between two verifies another ~0.2 ms, with the device idle through both. Here the
verify's graph ends with that work done on the device instead:

    dev_spec_judge      k, the drafts kept (the longest prefix equal to the picks); the record
                        [k, P, picks] for the host; the next verify's positions P + k + 1 + i and
                        its ids: the pick of row k, then the drafter's chain (the reference
                        drafter's rule: ReferenceDrafter.chain_table, a table by position)
    dev_spec_restore    the rollback: every Gated DeltaNet state from its snapshot after row k,
                        where a draft was refused

so the next verify is queued (a graph replay, nothing staged) before the host reads this one's
record, as the token step's run-ahead queues its next step (DeviceBackend.token_step, wait False).
The host reads each record one verify behind: the tokens, the stop rules, the routing counts of
the rows kept (rows 0..k, from the verify's routing ids copied down beside the record), and the
acceptance statistics. Two pinned records in turn, so the next verify's lands in the other.

What it does not take (the plain loop does): a sampled run (the accept/resample rule draws on the
host), a drafter without a device rule (the MTP head's chain is drafted on the host or by its own
device steps between verifies: its drafts need the verify's picks first), models whose verify is
not captured (PLE, QSA: Model._verify_rows), the hidden rows a drafter reads.
"""

from __future__ import annotations

import numpy as np

KEPT = 4  # drafters' and sessions' tables kept (a captured verify holds its own: Model.verify_ahead's `hold`)


class VerifyAhead:
    """A DeviceBackend's buffers for verifies run ahead: the drafters' tables and the rollbacks' address
    tables on the device (made once each, kept by identity: a captured verify reads them there; the
    last KEPT of each, so that a run's session and snapshots are not kept alive after it), the record
    on the device per row count, the two pinned records and their events."""

    def __init__(self, be):
        self.be, self.rt = be, be.rt
        self._chains: dict[int, tuple] = {}  # id(drafter) -> (drafter, ref [L] int32, right [L] uint8 on the device)
        self._restores: dict[tuple, tuple] = {}  # (id(session), ids of the snapshots) -> (session, snaps, src, dst, words, J)
        self._recs: dict[int, object] = {}  # T -> the device record [2 + 3 T] int32
        self._down = None  # [(pinned record, pinned routing ids) x 2, events, which is next, (T, ids shape)]

    def chain(self, drafter):
        """The drafter's chain rule on the device: (ref, right, L, V) (ReferenceDrafter.chain_table)."""
        got = self._chains.get(id(drafter))
        if got is None or got[0] is not drafter:
            ref, right, V = drafter.chain_table()
            _bound(self._chains)
            got = self._chains[id(drafter)] = (drafter, self.rt.to_device(np.ascontiguousarray(ref, np.int32)),
                                               self.rt.to_device(np.ascontiguousarray(right, np.uint8)), ref.size, V)
        return got[1:]

    def restore(self, session, snaps: list):
        """The rollback's tables of `session` from `snaps` (N Snapshots, the verify's): src [N, J] and
        dst [J] device addresses, words [J] -> (src, dst, words, J, the most words); J = 0 where no state
        needs it."""
        key = (id(session), tuple(id(x) for x in snaps))
        got = self._restores.get(key)
        if got is None or got[0] is not session:
            dst, src = [], [[] for _ in snaps]
            for l, st in enumerate(session.states):
                if not isinstance(st, dict):
                    continue
                for name, a in st.items():
                    if a.dtype.itemsize != 4 or not a.flags.c_contiguous:
                        raise ValueError(f"verify ahead: state {name} of layer {l} is {a.dtype} {a.shape}, "
                                         "expected contiguous 4-byte words")
                    dst.append(a)
                    for i, snap in enumerate(snaps):
                        src[i].append(snap.states[l][name])
            J = len(dst)
            ptr = self.rt.ptr
            table = lambda v: self.rt.to_device(np.array(v, np.int64).reshape(-1) if v else np.zeros(1, np.int64))
            _bound(self._restores)
            got = self._restores[key] = (session, tuple(snaps), table([[ptr(a) for a in row] for row in src]),
                                         table([ptr(a) for a in dst]), table([a.size for a in dst]), J,
                                         max([a.size for a in dst], default=0))
        return got[2:]

    def record(self, T: int):
        got = self._recs.get(T)
        if got is None:
            got = self._recs[T] = self.rt.empty((2 + 3 * T,), np.int32)
        return got

    def judge(self, T: int, picks, tok, drafter, session, snaps: list, last: int) -> None:
        """The verify's tail, queued inside its forward (so captured with it): dev_spec_judge, then
        dev_spec_restore. picks: the rows' device picks [>= T, 3]; tok: the verify's ids [T] on the
        device; `last`: the last first position a verify may have (its rows stay in the context)."""
        be = self.be
        ref, right, L, V = self.chain(drafter)
        rec = self.record(T)
        self.rt.launch(be._mod, "dev_spec_judge", 1, 32, (picks, tok, np.int32(T), be._posv, np.int32(last), ref, right,
                                                          np.int32(L), np.int32(V), rec))
        src, dst, words, J, most = self.restore(session, snaps)
        if J:
            be._launch("dev_spec_restore", most, (rec, np.int32(T - 1), src, dst, words, np.int32(J)))

    def queue(self, T: int) -> tuple:
        """After a verify run ahead: its record and its rows' routing ids copied down into the next
        pinned pair, an event after them, the routing it owes (DeviceExperts' logs) taken aside ->
        the pending verify `wait` reads."""
        rt, ex = self.rt, self.be.experts
        ids = ex._ids_rows
        shape = (T, None if ids is None else ids.shape)
        if self._down is None or self._down[3] != shape:
            ev = rt.events(2) if hasattr(rt, "events") else [None, None]
            pairs = [(rt.pinned(4 * (2 + 3 * T)).view(np.int32),
                      None if ids is None else rt.pinned(ids.nbytes).view(np.int32).reshape(ids.shape)) for _ in range(2)]
            self._down = [pairs, ev, 0, shape]
        pairs, events, i, _ = self._down
        self._down[2] = 1 - i
        rec, host_ids = pairs[i]
        rt.copy_out_async(rec, self.record(T))
        if host_ids is not None:
            rt.copy_out_async(host_ids, ids)
        if events[i] is not None:
            events[i].record()
        log, ex._log = ex._log, []
        rows, ex._rows_log = ex._rows_log, []
        ex._rows_queued = False
        return rec, host_ids, events[i], log, rows, T

    def wait(self, pending: tuple) -> tuple[int, int, np.ndarray]:
        """A pending verify's (k, its first position, the picks of rows 0..k as int64), once its record
        has landed (the verify queued after it may still run); the routing of rows 0..k counted.
        A NaN or an infinite largest logit in a row read is refused as the sampler refuses it."""
        rec, host_ids, done, log, rows, T = pending
        if done is None:
            self.rt.synchronize()
        else:
            done.synchronize()
        k, P = int(rec[0]), int(rec[1])
        picks = rec[2:].reshape(T, 3)
        self.be.refuse_rows(picks, k + 1, T)
        self.be.experts.settle_rows_kept(log, rows, host_ids, k)
        return k, P, picks[: k + 1, 0].astype(np.int64)

    def drop(self, pending: tuple) -> None:
        """A verify queued past the run's end, which nobody reads: waited for, its hits taken back and
        its routing never counted (the plain loop's --stats)."""
        self.rt.synchronize()
        self.be.experts.forget((pending[3],))


def _bound(kept: dict) -> None:
    """Room for one more entry among the last KEPT (the oldest goes)."""
    while len(kept) >= KEPT:
        del kept[next(iter(kept))]
