"""The dense path on the device: W x for every weight the tier placed, the host's activations uploaded
once per vector into the plan's staging, the product on the device, the result copied back."""

from __future__ import annotations

import numpy as np

from .. import budget as B
from ..backend import _row
from ..kernels import gpu
from ..kernels.actq import QA, ActQ, ActQ16, quantize_act, quantize_act16
from ..weights import Input, Weight
from .memory import Carver, act_rows, upload_act

F32 = np.float32


class Dense:
    """W x for every placed weight: the host's activations uploaded once per vector into the staging
    (plan item dense.staging), the product on the device, the result copied back. The LM head writes
    into head.logits and comes back through the pinned logits buffer."""

    def __init__(self, rt, g, staging: Carver, head: Weight, head_dev, head_host: np.ndarray, prompt: Carver | None):
        n_in, n_out = B.dense_dims(g)
        self.rt, self.head = rt, head
        self.xf = staging.array((n_in,), np.float32)
        self.xq = staging.actq(n_in)
        self.xw = staging.actq(n_in, 2)  # the wide form's two planes (actq.ActQ16) of one input
        self.y = staging.array((n_out,), np.float32)
        self.head_dev, self.head_host = head_dev, head_host
        self._held: dict[str, tuple] = {}  # "f"/"q": (the Input, its version) whose values the staging holds
        self._views: dict[tuple, object] = {}  # staging views by width, carved once (a device view costs microseconds)
        # the prompt path: rows of input (f32 and ActQ) and output, as many as prompt.chunk holds
        self.rows = 0
        if prompt is not None and prompt.size:
            self.rows = max(prompt.size - 5 * 256, 0) // B.prompt_row_bytes(g)  # 5 planes, each aligned
            self.pf = prompt.array((self.rows, n_in), np.float32)
            self.pq = prompt.actq(n_in, self.rows)
            self.py = prompt.array((self.rows * max(n_out, g.n_vocab),), np.float32)

    def _form(self, w: Weight, x):
        """The activations W reads (the host's ActQ for block types, f32 otherwise), and the Input they came from."""
        src = x if isinstance(x, Input) else None
        if w.type.quantized:
            make = quantize_act16 if w.wide else quantize_act
            act = x.form(w.type, w.wide) if src is not None else (x if isinstance(x, (ActQ, ActQ16)) else make(x, where=f"weight {w.name}"))
        else:
            act = x.form(w.type, w.wide) if src is not None else x
        return act, src

    def _stage_vector(self, w: Weight, x):
        act, src = self._form(w, x)
        if (not act.one) if isinstance(act, ActQ16) else (act.q if isinstance(act, ActQ) else act).ndim == 2:
            act = _row(act)  # the decode step's one row
        kind = ("w" if isinstance(act, ActQ16) else "q") if w.type.quantized else "f"
        key = None if src is None else (src, src.version)
        held = self._held.get(kind)
        n = w.n_in
        dev = self._view(kind, n)
        if kind in "qw":
            if key is None or held is None or held[0] is not key[0] or held[1] != key[1]:
                upload_act(self.rt, dev.planes if kind == "w" else dev, act.planes if kind == "w" else act)
        else:
            if key is None or held is None or held[0] is not key[0] or held[1] != key[1]:
                self.rt.copy_in(dev, np.ascontiguousarray(act, dtype=F32).reshape(n))
        self._held[kind] = key
        return dev

    def _view(self, kind: str, n: int):
        v = self._views.get((kind, n))
        if v is None:
            if kind == "q":
                v = gpu.GpuActQ(self.xq.q[:n], self.xq.d[: n // QA], self.xq.s16[: n // 16], None)
            elif kind == "w":
                v = gpu.GpuActQ16(act_rows(self.xw, 2, n), True)
            else:
                v = self.xf[:n] if kind == "f" else self.y[:n]
            self._views[(kind, n)] = v
        return v

    def matvec(self, w: Weight, x, out: np.ndarray | None = None) -> np.ndarray:
        dev = self._stage_vector(w, x)
        if out is None:
            out = np.empty(w.n_out, F32)
        if w is self.head:
            gpu.matvec_into(w.device, dev, self.head_dev)
            self.rt.copy_out(self.head_host, self.head_dev)
            out[...] = self.head_host
        else:
            y = self._view("y", w.n_out)
            gpu.matvec_into(w.device, dev, y)
            self.rt.copy_out(out, y)
        return out

    def matmul(self, w: Weight, X, out: np.ndarray | None = None) -> np.ndarray:
        """T rows, through the prompt path's buffers as many rows at a time as they hold (token by
        token through the staging when there are none: --prefill off plans no chunk buffers)."""
        act, _ = self._form(w, X)
        wide = isinstance(act, ActQ16)
        T = act.rows if wide else (act.q if isinstance(act, ActQ) else act).shape[0]
        if out is None:
            out = np.empty((T, w.n_out), F32)
        # the wide form: r rows take 2r rows of the buffers for their planes' products and r more for the result
        step = self.rows // 3 if wide else self.rows
        if step == 0:
            for t in range(T):
                if wide:
                    row = act.row(t)
                else:
                    row = ActQ(act.q[t], act.d[t], act.s16[t]) if isinstance(act, ActQ) else np.ascontiguousarray(act[t])
                self.matvec(w, row, out[t])
            return out
        n = w.n_in
        for a in range(0, T, step):
            r = min(T, a + step) - a
            if wide:
                p = act.planes
                dev = act_rows(self.pq, 2 * r, n)
                upload_act(self.rt, dev, ActQ(p.q[2 * a : 2 * (a + r)], p.d[2 * a : 2 * (a + r)], p.s16[2 * a : 2 * (a + r)]))
                y2 = self.rt.view(self.py.view(np.uint8), 0, (2 * r, w.n_out), np.float32)
                gpu.matmul(w.device, dev, out=y2)
                y = self.rt.view(self.py.view(np.uint8), 4 * 2 * r * w.n_out, (r, w.n_out), np.float32)
                gpu.combine16(y2, y)
                self.rt.copy_out(out[a : a + r], y)
                continue
            if isinstance(act, ActQ):
                dev = act_rows(self.pq, r, n)
                upload_act(self.rt, dev, ActQ(act.q[a : a + r], act.d[a : a + r], act.s16[a : a + r]))
            else:
                dev = self.rt.view(self.pf.reshape(-1).view(np.uint8), 0, (r, n), np.float32)
                self.rt.copy_in(dev, np.ascontiguousarray(act[a : a + r], dtype=F32))
            y = self.rt.view(self.py.view(np.uint8), 0, (r, w.n_out), np.float32)
            gpu.matmul(w.device, dev, out=y)
            self.rt.copy_out(out[a : a + r], y)
        return out
