"""strata serve's sessions on the device step: the ones the GPU tier placed, lent to requests.

With --gpu-step device a session's states (KV cache, Gated DeltaNet and conv states, QSA's stores,
PLE's conv ring, the residual stream) are device arrays. The plan places --batch of them at startup
(budget: session.* and serve.batch), each with its --spec snapshots (verify.snapshots), and the
server never holds more at once: a request borrows one (`take`, its states cleared first) and gives
it back when it ends. Its captured graphs (the token step's, a verify's) read the session's arrays
where they are, so a lent session replays them as its first borrower made them.

The conversation cache parks a finished session in HOST memory, as on the CPU: `park` copies its
states down into a host session of the same shapes (a CPU Session: the budget's
serve.conversation_cache, host memory) and gives the device one back; `resume` copies a parked one
up into a borrowed device session. The card so holds --batch sessions whatever the cache keeps, and
the expert cache keeps the rest of it. A KV cache is copied for the positions fed only (a turn of a
long context's conversation moves its tokens' keys, not the context's); the other states whole.
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import numpy as np

from ..backend import CpuBackend
from ..kvcache import KVCache
from ..model import Session
from ..ple import PLEState
from ..qsa import QSACache

_SCALARS = (int, float, bool, str, type(None), np.integer, np.floating)


def _pairs(dst, src, out: list, fed: int | None) -> None:
    """(dst array, src array, positions) for every array of one state object in two sessions of the
    same shapes, and src's plain values set on dst (QSA's key count, PLE's token count). A state
    class is walked by its attributes, so a state that gains an array is copied with no change here.
    `positions`: a KV cache's arrays ([heads, context, ...]) hold `fed` positions that count, the
    rest are written before any step reads them; None: the whole array counts."""
    if isinstance(src, dict):  # a Gated DeltaNet layer's {"S", "conv"}
        if dst.keys() != src.keys():
            raise ValueError(f"session copy: states with keys {sorted(dst)} and {sorted(src)}")
        out += [(dst[k], src[k], None) for k in src]
        return
    if not isinstance(src, (KVCache, QSACache, PLEState)):
        raise TypeError(f"session copy: a state of type {type(src).__name__}, expected a KV cache, a QSA cache, a "
                        "PLE state or a Gated DeltaNet layer's dict")
    for name, v in vars(src).items():
        if isinstance(v, (KVCache, QSACache, PLEState)):
            _pairs(getattr(dst, name), v, out, fed)
        elif hasattr(v, "shape") and hasattr(v, "dtype") and not isinstance(v, ModuleType):  # a host or device array
            out.append((getattr(dst, name), v, fed if isinstance(src, KVCache) else None))
        elif isinstance(v, _SCALARS):
            setattr(dst, name, v)
        # (anything else is the class's own: the array module a device state computes with, which
        # has `shape` and `dtype` too)


def session_pairs(dst: Session, src: Session) -> list:
    """Every (dst array, src array, positions: `_pairs`) of two sessions of the same context and KV
    kind, after setting dst's position and plain values to src's."""
    if (dst.max_context, dst.kv) != (src.max_context, src.kv):
        raise ValueError(f"session copy: context {src.max_context} --kv {src.kv} into context {dst.max_context} "
                         f"--kv {dst.kv}")
    dst.pos, dst.spent = src.pos, src.spent
    out = [(dst.stream, src.stream, None), (dst.routing, src.routing, None)]
    for a, b in zip(dst.states, src.states, strict=True):
        _pairs(a, b, out, src.pos)
    for l, st in src.ple_states.items():
        _pairs(dst.ple_states[l], st, out, src.pos)
    for a, b, _ in out:
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"session copy: {b.dtype}{list(b.shape)} into {a.dtype}{list(a.shape)}")
    return out


class DeviceSessions:
    """The device step's placed sessions (GpuTier.sessions) and their snapshots (GpuTier.snapshot_sets),
    for engine/scheduler.py: the interface of its `HostSessions`."""

    def __init__(self, rt, model, sessions: list, snapshot_sets: list | None = None):
        if not sessions:
            raise ValueError("the device step's server needs the sessions its GPU tier placed (none were)")
        self.rt, self.model = rt, model
        sets = snapshot_sets or [None] * len(sessions)
        self._free = list(zip(sessions, sets))
        self._lent: dict[int, tuple] = {}
        self._blank: Session | None = None  # a fresh host session: what `take` clears a session to
        self._zero: list[bool] | None = None  # which of its arrays are all zeros (those are cleared on the device)

    @property
    def free(self) -> int:
        return len(self._free)

    def _borrow(self, max_context: int, kv: str) -> Session:
        for i, (s, snaps) in enumerate(self._free):
            if s.max_context == max_context and s.kv == kv:
                del self._free[i]
                self._lent[id(s)] = (s, snaps)
                return s
        lent = len(self._lent)
        raise RuntimeError(f"no placed session free for context {max_context} --kv {kv}: {lent} lent, "
                           f"{len(self._free)} free (the GPU tier places --batch sessions; a server holds no more)")

    def take(self, max_context: int, kv: str) -> Session:
        """A placed session, cleared to a new session's states."""
        s = self._borrow(max_context, kv)
        with self._given_back_on_failure(s):
            if self._blank is None or (self._blank.max_context, self._blank.kv) != (max_context, kv):
                self._blank = Session(self.model, max_context, kv, backend=CpuBackend())
                self._zero = [not np.any(b) for _, b, _ in session_pairs(self._blank, self._blank)]
            for (d, b, _), zero in zip(session_pairs(s, self._blank), self._zero, strict=True):
                if zero:  # (on the device: a fill there, nothing copied up; every position, whoever wrote it)
                    d.fill(0)
                else:
                    self._up(d, b, None)
        return s

    def snapshots(self, session: Session) -> list | None:
        """The lent session's --spec snapshots, placed with it."""
        return self._lent[id(session)][1]

    def give(self, session: Session) -> None:
        """A lent session back (its request is over and not parked)."""
        got = self._lent.pop(id(session), None)
        if got is None or got[0] is not session:
            raise ValueError("a session given back that was not lent")
        self._free.append(got)

    def park(self, session: Session) -> Session:
        """A host copy of the lent session for the conversation cache; the device one is given back."""
        host = Session(self.model, session.max_context, session.kv, backend=CpuBackend())
        try:
            for h, d, n in session_pairs(host, session):
                if not self.rt.is_array(d):
                    np.copyto(h, d)
                elif n is None:
                    self.rt.copy_out(h, d)
                elif n:  # (the fed positions only: a strided view, so through a contiguous copy)
                    h[:, :n] = self.rt.to_host(d[:, :n])
        finally:  # (a failed copy loses the parked copy, never the placed session)
            self.give(session)
        return host

    def resume(self, parked: Session) -> Session:
        """A placed session holding a parked one's states."""
        s = self._borrow(parked.max_context, parked.kv)
        with self._given_back_on_failure(s):
            for d, h, n in session_pairs(s, parked):
                self._up(d, h, n)
        return s

    @contextlib.contextmanager
    def _given_back_on_failure(self, session: Session):
        """A borrowed session whose clearing or copy failed goes back (the request fails, the server
        keeps its --batch sessions)."""
        try:
            yield
        except BaseException:
            self.give(session)
            raise

    def _up(self, d, h, n: int | None) -> None:
        if not self.rt.is_array(d):
            np.copyto(d, h)
        elif n is None:
            self.rt.copy_in(d, np.ascontiguousarray(h))
        elif n:  # the fed positions: up into a contiguous buffer, then into the strided view on the device
            tmp = self.rt.empty((d.shape[0], n, *d.shape[2:]), d.dtype)
            self.rt.copy_in(tmp, np.ascontiguousarray(h[:, :n]))
            d[:, :n] = tmp
