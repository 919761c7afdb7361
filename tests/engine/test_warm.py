"""Loading a model's kernels: a first start says it compiles and compiles the prompt path in a second
process (engine/warm.py); a warm start says nothing."""

from __future__ import annotations

import pytest

import engine_fixture as F
from strata.engine import warm
from strata.engine.kernels import jit
from strata.engine.model import Model
from strata.engine.pack_reader import Pack

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return F.make_pack(tmp_path_factory.mktemp("warm"))


def _missing_kernel(model, monkeypatch, tag="Q8_0-par-f00"):
    """Make the token step's warm-up meet one kernel that is not in the disk cache (as on a fresh
    install, without compiling everything in a fresh cache directory: minutes)."""
    real = model.warm_up_token

    def token():
        for fn in list(jit._listeners):
            fn(tag, "/the/cache")
        real()

    monkeypatch.setattr(model, "warm_up_token", token)


def test_a_warm_start_says_nothing(pack_dir):
    model = Model(Pack.open(pack_dir))
    model.warm_up()  # everything compiled or loaded once
    lines = []
    assert warm.warm_up(model, True, warm.helper_argv(pack_dir, None, None), lines.append) == 0
    assert lines == []


def test_a_first_start_says_it_compiles_and_runs_the_prompt_path_in_a_second_process(pack_dir, monkeypatch):
    model = Model(Pack.open(pack_dir))
    _missing_kernel(model, monkeypatch)
    lines = []
    assert warm.warm_up(model, True, warm.helper_argv(pack_dir, None, None), lines.append) == 1
    assert lines[0].startswith("compiling the kernels for this machine's CPU (first start only") and "/the/cache" in lines[0]
    assert lines[1] == "  the prompt path's kernels compile in a second process meanwhile"
    assert lines[2].startswith("  compiling Q8_0-par (")
    assert lines[-1].startswith("compiled 1 kernels here in")
    assert not any("exited with" in line for line in lines), lines  # the second process succeeded


def test_a_second_process_that_fails_costs_only_time(pack_dir, tmp_path, monkeypatch):
    model = Model(Pack.open(pack_dir))
    _missing_kernel(model, monkeypatch)
    lines = []
    warm.warm_up(model, True, warm.helper_argv(tmp_path / "no-such-pack", None, None), lines.append)
    failed = [line for line in lines if "the second process exited with 1" in line]
    assert failed and failed[0].endswith("; compiling its kernels here"), lines


def test_without_the_prompt_path_no_second_process_starts(pack_dir, monkeypatch):
    model = Model(Pack.open(pack_dir))
    _missing_kernel(model, monkeypatch)
    started = []
    monkeypatch.setattr(warm, "_start_helper", lambda argv: started.append(argv))
    lines = []
    warm.warm_up(model, False, warm.helper_argv(pack_dir, None, None), lines.append)
    assert started == [] and not any("second process" in line for line in lines)
