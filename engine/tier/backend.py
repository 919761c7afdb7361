"""The tier as a backend (engine/backend.py): the CPU backend with the device plugged in."""

from __future__ import annotations

import numpy as np

from ..backend import CpuBackend
from ..kernels.actq import ActQ, ActQ16
from ..weights import Input, Weight
from .dense import Dense
from .hits import HitPath


class TierBackend(CpuBackend):
    """The CPU backend with the tier plugged in (engine/backend.py): W x of every weight placed on
    the device runs there (`Dense`), and the routed experts go through the hit path; the blocks and
    everything else are the CPU's."""

    name = "gpu tier"

    def __init__(self, dense: Dense, experts: HitPath):
        super().__init__()
        self.dense, self.experts = dense, experts

    def enter_thread(self) -> None:
        self.dense.rt.enter_thread()

    def linear(self, w: Weight, x, out: np.ndarray | None = None) -> np.ndarray:
        if w.device is None:
            return super().linear(w, x, out)
        act = x.form(w.type, w.wide) if isinstance(x, Input) else x
        if (act.rows if isinstance(act, ActQ16) else (act.q if isinstance(act, ActQ) else act).shape[0]) == 1:
            row = self.dense.matvec(w, x, None if out is None else out.reshape(-1))
            return row.reshape(1, -1)
        return self.dense.matmul(w, x, out)
