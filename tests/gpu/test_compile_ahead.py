"""engine/tier/compile_ahead.py: a GPU tier's first start compiles the modules this card has not
compiled yet side by side, each in a process of its own, and marks them; a later start finds them
marked and compiles nothing ahead. The bookkeeping runs here with a thread pool and a stand-in
compile in order; the spawned processes run for real with builtins as the compile; the last test compiles
real modules on the card (marked gpu)."""

from __future__ import annotations

import os
import pytest

from strata.engine.kernels import gpu
from strata.engine.tier import compile_ahead as ca

CARD = "cupy 0 nvrtc 0 sm 90 (the test)"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kernel_cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.delenv("STRATA_COMPILE_AHEAD", raising=False)
    return tmp_path / "kernel_cache"


class SerialPool:
    """A pool of n workers as `ahead` uses one, its jobs run here in order."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, jobs, chunksize=1):
        return [fn(j) for j in jobs]


class Recorder:
    """A stand-in compile: records the keys, fails those in `fail`."""

    def __init__(self, fail=()):
        self.keys, self.fail = [], set(fail)

    def __call__(self, key: str) -> None:
        self.keys.append(key)
        if key in self.fail:
            raise RuntimeError(f"nvrtc said no to {key}")


def test_a_first_start_compiles_every_module_side_by_side_and_marks_it(cache):
    rec, lines = Recorder(), []
    a = ca.ahead(["actq", "F16", "Q4_K", ca.DEVICE_STEP, "Q6_K"], CARD, lines.append, processes=4, pool=SerialPool, compile=rec)
    assert sorted(a.compiled) == sorted(["actq", "F16", "Q4_K", ca.DEVICE_STEP, "Q6_K"]) and not a.failed and not a.cached
    assert a.processes == 4
    # the block types' modules (the slowest) are handed out first, actq's (the quickest) last
    assert set(rec.keys[:2]) == {"Q4_K", "Q6_K"} and rec.keys[2] == ca.DEVICE_STEP and rec.keys[-1] == "actq"
    assert all(ca.marker(k, cache, CARD).exists() for k in a.compiled)
    assert "compiling 5 GPU kernel modules for this card in 4 processes" in lines[0] and str(cache) in lines[0]
    assert "5 modules compiled in" in lines[-1]


def test_a_later_start_finds_them_marked_and_compiles_nothing(cache):
    ca.ahead(["Q4_K", "Q6_K", "actq"], CARD, processes=4, pool=SerialPool, compile=Recorder())
    rec, lines = Recorder(), []
    a = ca.ahead(["Q4_K", "Q6_K", "actq"], CARD, lines.append, processes=4, pool=SerialPool, compile=rec)
    assert sorted(a.cached) == ["Q4_K", "Q6_K", "actq"] and not a.compiled and rec.keys == [] and lines == []


def test_another_card_or_another_source_is_compiled_again(cache, monkeypatch):
    ca.ahead(["Q4_K", "Q6_K"], CARD, processes=2, pool=SerialPool, compile=Recorder())
    rec = Recorder()
    a = ca.ahead(["Q4_K", "Q6_K"], CARD.replace("sm 90", "sm 100"), processes=2, pool=SerialPool, compile=rec)
    assert sorted(a.compiled) == ["Q4_K", "Q6_K"]
    before = ca.marker("Q4_K", cache, CARD)
    monkeypatch.setattr(gpu, "OPTIONS", gpu.OPTIONS + ("-DSTRATA_MV_STEP=2048",))  # a benchmark's knob
    assert ca.marker("Q4_K", cache, CARD) != before
    monkeypatch.setattr(ca, "module_source", lambda key: (gpu.SOURCE, ["mv<12, 1>"]))  # other kernels asked for
    assert ca.marker("Q4_K", cache, CARD) != before


def test_a_module_that_fails_in_its_process_is_left_to_the_startup_unmarked(cache):
    lines = []
    a = ca.ahead(["Q4_K", "Q6_K", "IQ3_XXS"], CARD, lines.append, processes=3, pool=SerialPool, compile=Recorder(fail={"Q6_K"}))
    assert sorted(a.compiled) == ["IQ3_XXS", "Q4_K"] and list(a.failed) == ["Q6_K"]
    assert "RuntimeError: nvrtc said no to Q6_K" in a.failed["Q6_K"]
    assert not ca.marker("Q6_K", cache, CARD).exists() and ca.marker("Q4_K", cache, CARD).exists()
    assert any("Q6_K: failed in its process" in l and "the startup compiles it itself" in l for l in lines)


def test_a_pool_that_cannot_start_costs_nothing_but_time(cache):
    def broken(n):
        raise OSError("no processes today")

    lines = []
    a = ca.ahead(["Q4_K", "Q6_K"], CARD, lines.append, processes=2, pool=broken, compile=Recorder())
    assert sorted(a.failed) == ["Q4_K", "Q6_K"] and not a.compiled
    assert "compiling in parallel failed (OSError: no processes today)" in lines[-1]


def test_one_missing_module_or_one_process_compiles_nothing_ahead(cache, monkeypatch):
    rec = Recorder()
    assert ca.ahead(["Q4_K"], CARD, processes=8, pool=SerialPool, compile=rec).compiled == [] and rec.keys == []
    assert ca.ahead(["Q4_K", "Q6_K"], CARD, processes=1, pool=SerialPool, compile=rec).why_not == "one process"
    monkeypatch.setenv("STRATA_COMPILE_AHEAD", "0")
    assert ca.ahead(["Q4_K", "Q6_K"], CARD, pool=SerialPool, compile=rec).why_not == "STRATA_COMPILE_AHEAD=0"
    assert rec.keys == []
    monkeypatch.setenv("STRATA_COMPILE_AHEAD", "many")
    with pytest.raises(ValueError, match="STRATA_COMPILE_AHEAD='many': expected 0 \\(off\\) or a number of processes"):
        ca.ahead(["Q4_K", "Q6_K"], CARD, pool=SerialPool, compile=rec)


def test_nothing_ahead_without_a_disk_cache_or_off_cupy(cache, monkeypatch):
    rec = Recorder()
    assert ca.ahead(["Q4_K", "Q6_K"], None, processes=2, pool=SerialPool, compile=rec).why_not == "not on CuPy's runtime"
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    assert "CUPY_CACHE_IN_MEMORY" in ca.ahead(["Q4_K", "Q6_K"], CARD, processes=2, pool=SerialPool, compile=rec).why_not
    assert rec.keys == []
    monkeypatch.delenv("CUPY_CACHE_DIR")
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY")
    assert ca.cache_dir() == ca.Path.home() / ".cupy" / "kernel_cache"  # CuPy's own default


def test_what_the_startup_compiled_itself_is_marked_too(cache):
    cache.mkdir(parents=True)
    ca.mark_loaded(["Q4_K", "actq"], CARD)
    assert ca.marker("Q4_K", cache, CARD).exists() and ca.marker("actq", cache, CARD).exists()
    a = ca.ahead(["Q4_K", "actq", "Q6_K"], CARD, processes=2, pool=SerialPool, compile=Recorder())
    assert sorted(a.cached) == ["Q4_K", "actq"] and a.compiled == []  # one missing: the startup's own
    ca.mark_loaded(["Q6_K"], None)  # off CuPy: nothing to mark
    assert not ca.marker("Q6_K", cache, CARD).exists()


def test_the_spawned_processes_run_the_compile_and_write_the_markers(cache):
    # real spawned processes (the default pool): `len` stands in for a compile that succeeds, `int`
    # for one that fails (int("Q4_K") raises); both are importable by reference in a child
    a = ca.ahead(["Q4_K", "Q6_K"], CARD, processes=2, compile=len)
    assert sorted(a.compiled) == ["Q4_K", "Q6_K"] and a.processes == 2
    assert ca.marker("Q4_K", cache, CARD).exists() and ca.marker("Q6_K", cache, CARD).exists()
    b = ca.ahead(["IQ3_XXS", "IQ2_XXS"], CARD, processes=2, compile=int)
    assert sorted(b.failed) == ["IQ2_XXS", "IQ3_XXS"] and "ValueError: invalid literal for int()" in b.failed["IQ2_XXS"]
    assert not ca.marker("IQ3_XXS", cache, CARD).exists()


@pytest.mark.gpu
def test_on_the_card_the_processes_fill_cupys_cache_and_a_later_start_loads_it(cache):
    ok, why = gpu.available()
    if not ok:
        pytest.skip(f"no GPU: {why}")
    rt = gpu.runtime()
    card = ca.card_of_runtime(rt)
    assert card is not None and "sm " in card
    keys = ["F16", "actq"]
    a = ca.ahead(keys, card, processes=2)
    assert sorted(a.compiled) == sorted(keys), a.failed
    files = [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith("strata-module-")]
    assert len(files) >= 2, f"CuPy's cache at {cache} holds {files}: the processes did not compile into it"
    again = ca.ahead(keys, card, processes=2)
    assert sorted(again.cached) == sorted(keys) and again.compiled == []
    # this process then loads the modules from that cache (no new cache file: nothing compiled again)
    for k in keys:
        gpu._modules.pop(k, None)
        ca.compile_one(k)
    after = [p for p in cache.rglob("*") if p.is_file() and not p.name.startswith("strata-module-")]
    assert sorted(after) == sorted(files)
    assert os.environ["CUPY_CACHE_DIR"] == str(cache)
