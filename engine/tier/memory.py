"""The tier's device memory: what is free and used as the plan counts it, the arenas each startup stage
allocates from its plan items (engine/budget.py) and carves its buffers out of, and the mem_mark
lines that print the measured use beside the plan's figure after each stage."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..expert_plan import MiB
from ..kernels import gpu
from ..kernels.actq import QA, ActQ
from ..kernels.engine_form import align


@dataclass(frozen=True)
class MemMark:
    stage: str
    free: int  # device memory free (as the budget counts it) after the stage
    used: int  # device memory this process holds, measured
    predicted: int  # the plan's figure for the same moment
    card_used: int  # the card's used memory (the error is a share of it)

    @property
    def error(self) -> float:
        return abs(self.used - self.predicted) / max(self.card_used, 1)

    def line(self, number: int) -> str:
        return (f"mem_mark {number} {self.stage}: free {self.free / MiB:.1f} MiB, used {self.used / MiB:.1f} MiB, "
                f"budget {self.predicted / MiB:.1f} MiB (off by {(self.used - self.predicted) / MiB:+.1f} MiB, "
                f"{100 * self.error:.2f}% of the card's {self.card_used / MiB:.0f} MiB used)")


class DeviceMemory:
    """Free and used device memory as the tier counts them. `used` is what this process added since
    it started (the CUDA context and other processes excluded); with --vram-budget-mib N the card
    is N MiB: free = N MiB - used (never more than really is free)."""

    def __init__(self, rt, budget_mib: int | None):
        self.rt, self.budget = rt, None if budget_mib is None else budget_mib * MiB
        free, total = rt.mem_info()
        self.base = total - free

    def used(self) -> int:
        free, total = self.rt.mem_info()
        return total - free - self.base

    def free(self) -> int:
        real = self.rt.mem_info()[0]
        return real if self.budget is None else min(real, self.budget - self.used())

    def card_used(self) -> int:
        return self.used() if self.budget is not None else self.used() + self.base


class Carver:
    """Buffers cut from one arena, each on a PLANE_ALIGN boundary; taking more than it holds is a bug."""

    def __init__(self, rt, arena, name: str):
        self.rt, self.arena, self.name, self.at = rt, arena, name, 0
        self.size = int(arena.size) if arena is not None else 0

    def take(self, nbytes: int) -> int:
        at, self.at = self.at, self.at + align(nbytes)
        if self.at > self.size:
            raise RuntimeError(f"{self.name}: the plan's {self.size} B do not hold what is carved from it "
                               f"({self.at} B): engine/budget.py and engine/tier/ disagree")
        return at

    def array(self, shape, dtype):
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        return self.rt.view(self.arena, self.take(n), shape, dtype)

    def actq(self, n: int, rows: int | None = None) -> gpu.GpuActQ:
        lead = () if rows is None else (rows,)
        q = self.array(lead + (n,), np.int8)
        d = self.array(lead + (n // QA,), np.float32)
        s16 = self.array(lead + (n // 16,), np.int32)
        return gpu.GpuActQ(q, d, s16, None)


def act_rows(a: gpu.GpuActQ, rows: int, n: int) -> gpu.GpuActQ:
    """The first `rows` rows of n activations of a [R, N] buffer, as a contiguous [rows, n] ActQ."""
    rt = gpu.runtime()
    return gpu.GpuActQ(rt.view(a.q.reshape(-1), 0, (rows, n), np.int8),
                       rt.view(a.d.reshape(-1).view(np.uint8), 0, (rows, n // QA), np.float32),
                       rt.view(a.s16.reshape(-1).view(np.uint8), 0, (rows, n // 16), np.int32), None)


def upload_act(rt, dev: gpu.GpuActQ, act: ActQ) -> None:
    rt.copy_in(dev.q, act.q)
    rt.copy_in(dev.d, act.d)
    rt.copy_in(dev.s16, act.s16)
