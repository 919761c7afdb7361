"""Pin the CPU kernel a test takes, whatever the size of its call (imported by the kernel tests):
serial or parallel (cpu.SERIAL_BELOW) and on how many threads, and the row kernels of cpu.py or
panel.py's many-token ones (cpu.PANEL_FROM, PANEL_FROM_FLOAT)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from strata.engine.kernels import cpu, panel, simd

KERNELS = ["rows", "panel"]


@contextmanager
def cpu_path(parallel: bool | None = None, threads: int | None = None, kernel: str = "rows"):
    """parallel: True forces the pool (on `threads`, 2 unless told), False the calling thread,
    None leaves the size rule. kernel: "rows" or "panel" (skipped, with the reason, on a host
    without AVX512-VNNI, where matmul never takes it)."""
    if kernel == "panel" and not panel.AVAILABLE:
        pytest.skip(f"panel.py's kernel needs AVX512-VNNI; this host's features: {sorted(simd._X86) or 'none'}")
    saved = (cpu.SERIAL_BELOW, cpu.PANEL_FROM, cpu.PANEL_FROM_FLOAT, cpu.PANEL_FROM_RAW, cpu.GROUPED_FROM_RAW,
             cpu.ROWDOT_ROWS_MAX, cpu.threads_cap())
    if parallel is not None:
        cpu.SERIAL_BELOW = 0 if parallel else 1 << 62
        cpu.set_threads(min(threads or 2, cpu.numba.config.NUMBA_NUM_THREADS))
    cpu.PANEL_FROM = cpu.PANEL_FROM_FLOAT = cpu.PANEL_FROM_RAW = cpu.GROUPED_FROM_RAW = 0 if kernel == "panel" else 1 << 62
    cpu.ROWDOT_ROWS_MAX = 1  # 2-4 tokens of the rowdot types would take rowdot.matmul, neither kernel asked for
    try:
        yield
    finally:
        (cpu.SERIAL_BELOW, cpu.PANEL_FROM, cpu.PANEL_FROM_FLOAT, cpu.PANEL_FROM_RAW, cpu.GROUPED_FROM_RAW,
         cpu.ROWDOT_ROWS_MAX) = saved[:6]
        cpu.set_threads(saved[6])
