"""The kernels' default thread count follows the cores other processes leave free (kernels/threads.py)."""

from __future__ import annotations

import pytest

from strata.engine.kernels import cpu, threads


class Machine:
    """A fake clock and /proc/stat: `others` cores busy with other processes, `ours` with this one."""

    def __init__(self, n_cpus: int):
        self.cpus = list(range(n_cpus))
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.t += seconds
        self.busy += seconds * (others + ours)
        self.own += seconds * ours

    def governor(self, limit: int) -> threads.Governor:
        return threads.Governor(limit, clock=lambda: self.t, busy=lambda cpus: self.busy, own=lambda: self.own,
                                cpus=self.cpus)


@pytest.mark.parametrize("others, want", [(0.0, 2), (0.2, 2), (0.5, 1), (1.0, 1), (2.0, 1)])
def test_threads_are_the_cores_left_by_other_processes(others, want):
    m = Machine(2)
    g = m.governor(limit=2)
    assert g.threads() == 2  # nothing measured yet: every CPU
    m.run(threads.INTERVAL_S, others=others, ours=2 - others if others < 2 else 0.1)
    assert g.threads() == want


def test_the_count_follows_the_load_as_it_changes_and_never_exceeds_the_limit():
    m = Machine(4)
    g = m.governor(limit=3)
    m.run(1.0, others=0, ours=3)
    assert g.threads() == 3  # 4 free cores, capped at 3
    m.run(1.0, others=2, ours=2)
    assert g.threads() == 2
    m.run(threads.INTERVAL_S / 2, others=4, ours=0)
    assert g.threads() == 2  # not re-measured within an interval
    m.run(threads.INTERVAL_S, others=4, ours=0)
    assert g.threads() == 1  # never below one
    m.run(1.0, others=0, ours=1)
    assert g.threads() == 3


def test_without_proc_stat_every_cpu_is_used():
    g = threads.Governor(8, busy=lambda cpus: None, cpus=[0, 1, 2])
    assert g.threads() == g.settle(0) == 3


def test_a_cap_overrides_the_governor_and_none_restores_it():
    before = cpu.threads_cap()
    try:
        cpu.set_threads(1)
        assert cpu.get_threads() == 1 and cpu.threads_cap() == 1
        cpu.set_threads(None)
        assert cpu.threads_cap() is None and cpu.get_threads() == cpu.governor().threads()
    finally:
        cpu.set_threads(before)


def test_the_kernel_variant_depends_on_the_work_not_the_thread_count():
    # A change of thread count while a model runs must not compile the other variant (seconds).
    before = cpu.threads_cap()
    try:
        for n in (1, 2):
            cpu.set_threads(min(n, cpu.numba.config.NUMBA_NUM_THREADS))
            assert cpu._launch(4096, cpu.SERIAL_BELOW)[0] is True
            assert cpu._launch(4096, cpu.SERIAL_BELOW - 1)[0] is False
        cpu.set_threads(1)
        assert cpu._launch(4096, 1 << 30) == (True, 1)  # one thread: one chunk
    finally:
        cpu.set_threads(before)


def test_the_launch_s_thread_count_is_numba_s_own_setting_in_every_thread():
    # use_threads reads numba's per-thread count through its C getter (cpu._numba_threads), not the
    # public function's locks: both must agree, in the main thread and in another, where numba's
    # setting starts at its default and use_threads must apply the cap there too
    import threading

    before = cpu.threads_cap()
    top = cpu.numba.config.NUMBA_NUM_THREADS
    seen = {}

    def other():
        seen["before"] = (cpu._numba_threads(), cpu.numba.get_num_threads())
        seen["used"] = (cpu.use_threads(), cpu._numba_threads(), cpu.numba.get_num_threads())

    try:
        for n in sorted({1, top}):
            cpu.set_threads(n)
            cpu.numba.set_num_threads(top)
            assert cpu._numba_threads() == cpu.numba.get_num_threads() == top
            assert cpu.use_threads() == n and cpu._numba_threads() == cpu.numba.get_num_threads() == n
            t = threading.Thread(target=other)
            t.start()
            t.join()
            assert seen["before"][0] == seen["before"][1], f"another thread: {seen['before']}"
            assert seen["used"] == (n, n, n), f"another thread after use_threads: {seen['used']}"
    finally:
        cpu.set_threads(before)
