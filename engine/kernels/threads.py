"""How many CPU threads the kernels should use now: the cores other processes leave free.

Why this exists: the kernels' parallel regions split a product evenly over the threads and wait
for the slowest, and Numba's OpenMP workers spin for milliseconds after each region. On a 2-core
host with one other busy process, 2 threads decoded the demo model at 1.5-4.9 tok/s where 1
thread gave 27-28 (2026-12-01, measured interleaved): every region waited for a worker that the
scheduler had parked behind the other process. A user who never passes --pool-workers must not
pay that, and the load on a shared machine changes while a model runs.

So without an explicit cap the thread count follows the machine: `Governor.threads()` is asked
at every kernel launch; at most every INTERVAL_S it reads /proc/stat for the CPUs this process may
run on (its affinity mask) and subtracts this process's own CPU time, which leaves what OTHER
processes used over the interval; the threads are the cores left, rounded with a small margin so
that a third of a core's worth of background noise does not halve a busy run:

    threads = clamp(floor(n_cpus - others + MARGIN), 1, n_cpus)

The kernels give the same bits for any thread count (docs/kernels.md), so a change between two
launches changes only speed. Where /proc/stat cannot be read (not Linux), every CPU is used, as
before.
"""

from __future__ import annotations

import math
import os
import time

INTERVAL_S = 0.25  # how often the share is re-measured: ~20 us of /proc reading each time
MARGIN = 0.3  # of a core: background noise below this still leaves the core counted as free


def _affinity() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _busy_seconds(cpus: list[int]) -> float | None:
    """CPU seconds spent not idle on `cpus` since boot, by every process; None without /proc/stat."""
    want = {f"cpu{c}" for c in cpus}
    busy = 0
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if not line.startswith(b"cpu") or line.startswith(b"cpu "):
                    continue
                fields = line.split()
                if fields[0].decode() in want:
                    v = [int(x) for x in fields[1:8]]  # user nice system idle iowait irq softirq
                    busy += sum(v) - v[3] - v[4]
    except (OSError, ValueError, IndexError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class Governor:
    """The thread count for kernels launched now, within 1..limit."""

    def __init__(self, limit: int, clock=time.monotonic, busy=_busy_seconds, own=_own_seconds, cpus=None):
        self.limit = limit
        self.cpus = _affinity() if cpus is None else cpus
        self._clock, self._busy, self._own = clock, busy, own
        self.current = min(limit, len(self.cpus))
        self._mark = None  # (wall, busy, own) at the last measurement
        self._measure()

    def threads(self) -> int:
        if self._mark is not None and self._clock() - self._mark[0] >= INTERVAL_S:
            self._measure()
        return self.current

    def settle(self, seconds: float = 0.1) -> int:
        """Measure over `seconds` now (at startup, before any kernel has run, instead of waiting
        for the first interval to pass while the load runs at a guess)."""
        if self._mark is not None:
            time.sleep(seconds)
            self._measure()
        return self.current

    def _measure(self) -> None:
        now, busy, own = self._clock(), self._busy(self.cpus), self._own()
        if busy is None:
            self._mark = None  # nothing to measure with: stay at every CPU
            return
        if self._mark is not None:
            wall = now - self._mark[0]
            others = max(0.0, (busy - self._mark[1]) - (own - self._mark[2])) / wall if wall > 0 else 0.0
            free = len(self.cpus) - others
            self.current = max(1, min(self.limit, len(self.cpus), math.floor(free + MARGIN)))
        self._mark = (now, busy, own)
