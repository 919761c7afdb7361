"""Sampling on the device step (dev_sample, DeviceBackend._sample): the token the host's Sampler picks
from the same logits with the same seed, only the token coming back.

Each test runs on CUDA (marked gpu: scripts/gpu_suite.sh) and on the host emulation (tests/gpu_emu.py).
Where the two can differ by float rounding (engine/tier/device_kernels.cu says where: exp, the top-p
mass's sum, the draw's running sum), the picked token differs only when the uniform lands within that
rounding (~1e-7 of the mass) of a boundary between two tokens: about one draw in millions. The tests
count such draws and allow at most NEAR_TIES of them.
"""

from __future__ import annotations

import zlib

import engine_fixture as F
import numpy as np
import pytest
from test_device_step import CTX, device_tier, tokens

from strata.engine.kernels.actq import NonFiniteActivation
from strata.engine.model import Model
from strata.engine.pack_reader import Pack
from strata.engine.sampling import Sampler, SamplerParams
from strata.engine.tier.device import DeviceBackend

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

V = 3000
NEAR_TIES = 1  # of the draws below, at most this many may differ by a rounding near-tie (module docstring)

OFF = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
PENALTIES = dict(repeat_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25, repeat_last_n=24)
SETTINGS = {
    "temperature alone": {**OFF, "temperature": 0.8},
    "hot": {**OFF, "temperature": 1.7},
    "top-k alone": {**OFF, "top_k": 40},
    "top-k above the block's threads": {**OFF, "top_k": 1500},  # (dev_sample's select then counts every logit)
    "top-p alone": {**OFF, "top_p": 0.9},
    "min-p alone": {**OFF, "min_p": 0.1},
    "penalties alone": {**OFF, **PENALTIES},
    "llama.cpp defaults": {},
    "all of them": {"temperature": 0.7, "top_k": 60, "top_p": 0.8, "min_p": 0.02, **PENALTIES},
    "greedy with penalties": {"temperature": 0.0, **PENALTIES},
    "top-k 1 with penalties": {"top_k": 1, **PENALTIES},
}


def rows(rng, kind: str) -> np.ndarray:
    if kind == "ties":  # values on a coarse grid: many logits tied, at the top-k threshold too
        return (np.round(rng.standard_normal(V) * 8) / 2).astype(np.float32)
    scale = {"peaked": 6.0, "normal": 4.0, "flat": 0.3}[kind]
    return (rng.standard_normal(V) * scale).astype(np.float32)


@pytest.fixture
def be(rt):
    return DeviceBackend(rt, None)


def picks(be, rt, params: SamplerParams, xs: list[np.ndarray], history: list[int], banned=()):
    """(host tokens, device tokens, rows whose filtered logits differ, rows handed back) of a run over the rows xs:
    each token joins the history (the host's, so one near-tie does not change the rest of the run's
    inputs). The filtered logits (penalised, the filters' drops as -inf) are compared bit for bit:
    the device's work buffer against the host sampler's (a draw rarely lands on the one token a
    wrong threshold or penalty moves, so the tokens alone would miss it)."""
    host, dev = Sampler(V, params, banned), Sampler(V, params, banned)
    row = np.empty(V, np.float32)
    hist = list(history)
    want, got, differ, handed = [], [], 0, 0
    for x in xs:
        want.append(host.sample(x, np.array(hist)))
        be._logits = rt.to_device(x[None])
        got.append(be._sample(dev.device_draw(np.array(hist), row)))
        hist.append(want[-1])
        if be._sampling[14][3]:
            handed += 1
            continue  # (handed back: the host filtered, the device's work stopped at top-k)
        work = rt.to_host(be._sampling[8])
        differ += not np.array_equal(work.view(np.int32), host._work.view(np.int32))
    return want, got, differ, handed


@pytest.mark.parametrize("name", SETTINGS)
def test_the_device_picks_the_host_samplers_token_with_the_same_seed(be, rt, name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    params = SamplerParams(seed=int(rng.integers(1 << 30)), **SETTINGS[name])
    xs = [rows(rng, kind) for kind in ("peaked", "normal", "ties", "normal", "flat", "peaked", "ties", "normal")]
    # a history with repeats (the frequency penalty counts more than one) holding some of each
    # row's most likely tokens (the penalties move the draw)
    history = rng.integers(0, 60, 20).tolist() + [int(i) for x in xs for i in np.argsort(-x)[:2]] + [3, 3, 3]
    want, got, rows_differ, handed = picks(be, rt, params, xs, history[-28:], banned=[int(np.argmax(xs[0])), 7])
    differ = sum(w != g for w, g in zip(want, got))
    assert differ + rows_differ <= NEAR_TIES, f"{name}: host {want}, device {got}, {rows_differ} filtered rows differ"
    # the flat row's top-p set is wider than the device's 512 (the host's: the test below)
    assert handed <= (1 if name == "top-p alone" else 0), handed
    assert int(np.argmax(xs[0])) not in got and 7 not in got


def test_the_penalty_window_follows_a_new_history(be, rt):
    """The device's window is its own ring, appended per pick; a history that is not its
    continuation (another run, the same sampler) is uploaded again."""
    rng = np.random.default_rng(3)
    params = SamplerParams(temperature=0, repeat_penalty=50.0, repeat_last_n=4, seed=1)
    host, dev = Sampler(V, params), Sampler(V, params)
    row = np.empty(V, np.float32)
    x = rows(rng, "normal")
    order = np.argsort(-x, kind="stable")
    # the greedy pick of a penalised row: the best token not in the last 4 of the history
    for hist in ([], [int(order[0])], [int(order[0]), int(order[1])], [5, int(order[0])], list(order[:4]), list(order[:5])):
        want = host.sample(x, np.array(hist, np.int64))
        be._logits = rt.to_device(x[None])
        got = be._sample(dev.device_draw(np.array(hist, np.int64), row))
        assert got == want, (hist, got, want)
    assert want == int(order[0])  # (order[0] left the 4-token window)


def test_a_wide_top_p_set_is_sampled_on_the_host_with_the_same_draw(be, rt, monkeypatch):
    """Where the top-p set reaches beyond the 512 most probable tokens (a flat row, top-k off) the
    device hands the pick back: the logits come down and the host samples them with its draw."""
    rng = np.random.default_rng(4)
    params = SamplerParams(temperature=0.9, top_k=0, top_p=0.95, min_p=0.0, seed=11)
    handed = []
    sample_drawn = Sampler.sample_drawn
    monkeypatch.setattr(Sampler, "sample_drawn", lambda self, *a: handed.append(1) or sample_drawn(self, *a))
    xs = [rows(rng, "flat") for _ in range(3)] + [rows(rng, "peaked")]
    want, got, _, n = picks(be, rt, params, xs, [1, 2, 3])
    assert got == want
    assert len(handed) == n == 3  # the flat rows, not the peaked one


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_logit_is_refused_as_the_host_refuses_it(be, rt, bad):
    x = rows(np.random.default_rng(5), "normal")
    x[100] = bad
    params = SamplerParams(seed=2, **PENALTIES)
    with pytest.raises(NonFiniteActivation):
        Sampler(V, params).sample(x, np.array([1, 2]))
    be._logits = rt.to_device(x[None])
    with pytest.raises(NonFiniteActivation, match="refusing to sample"):
        be._sample(Sampler(V, params).device_draw(np.array([1, 2]), np.empty(V, np.float32)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device-sample")
    return Model(Pack.open(F.make_pack(tmp, types={"experts": "Q8_0", "dense": "Q8_0"})))


def test_sampled_generation_on_the_device_step_is_the_hosts(model, rt):
    """strata generate --temp 0.8 --seed S (with penalties and a banned id) on the device step: Run ->
    Model.step_sample -> dev_sample, only the token back. The same tokens as the host sampler on the
    same device logits brought down (on_logits makes the run sample on the host). Against the CPU
    engine: its logits are the device's within float32 rounding only (test_device_step.py: up to
    FLIP_TOL of the largest on this fixture), so the same draw r can pick another token where r lies
    within the two distributions' distance of a token boundary; the runs agree up to their first
    difference, and there, if any, r must lie that close to a boundary of the CPU's distribution
    (an inverse-CDF pick with one r moves only where the CDFs differ, by at most their L1 distance)."""
    from strata.engine.generate import generate

    toks = tokens(model, 6, seed=21)
    nv, n_new = model.geometry.n_vocab, 8
    p = SamplerParams(temperature=0.8, seed=1234, **PENALTIES)
    rows = {}

    def keep(name):
        return lambda pos, row: rows.setdefault(name, {}).__setitem__(pos, row.copy())

    got = {"cpu": generate(model, model.new_session(CTX, "f32"), toks, Sampler(nv, p, banned=[5]), n_new,
                           on_logits=keep("cpu")).tokens.tolist()}
    with device_tier(model) as tier:
        assert model.picks
        be = model.backend
        launched, launch = [], be.rt.launch
        be.rt.launch = lambda mod, name, *a, **k: (launched.append(name), launch(mod, name, *a, **k))
        try:
            for on_device in (True, False):
                s = tier.take_session(CTX, "f32")
                got[on_device] = generate(model, s, toks, Sampler(nv, p, banned=[5]), n_new,
                                          on_logits=None if on_device else keep("device")).tokens.tolist()
        finally:
            be.rt.launch = launch
    assert launched.count("dev_sample") == n_new  # every token of the on-device run (the first from the prompt's last step)
    assert got[True] == got[False] and len(got[True]) == n_new and 5 not in got[True]
    j = next((i for i, (a, b) in enumerate(zip(got["cpu"], got[True])) if a != b), None)
    if j is None:
        return
    pos = len(toks) - 1 + j  # the position whose logits drew token j
    history = np.array(toks + got[True][:j])
    cpu, dev = (Sampler(nv, p, banned=[5]).distribution(rows[k][pos], history) for k in ("cpu", "device"))
    r = np.random.Generator(np.random.PCG64(p.seed)).random(j + 1)[j]  # the run's j-th draw
    lo, hi = sorted((got["cpu"][j], got[True][j]))
    gap = np.abs(np.cumsum(cpu)[lo:hi] - r).min()
    assert gap <= np.abs(cpu - dev).sum(), (j, gap, np.abs(cpu - dev).sum())


def test_min_p_keeps_what_the_host_keeps_at_its_threshold(be, rt):
    """min-p's threshold is top + log(min_p) in f64 rounded once to f32 (numpy compares the f32
    logits with a Python float that way): logits at it and an ulp either side, for thresholds where
    adding in f32 would round elsewhere, are kept or dropped as on the host."""
    rng = np.random.default_rng(6)
    found = 0
    for min_p in rng.uniform(0.01, 0.5, 400):
        top = np.float32(rng.uniform(-3, 8))
        thr = np.float32(float(top) + np.log(min_p))
        if thr == np.float32(top + np.float32(np.log(min_p))):
            continue  # (f32 addition would round the same: no check of the rounding here)
        x = np.full(V, -30.0, np.float32)
        x[0] = top
        x[1:4] = [np.nextafter(thr, -np.inf), thr, np.nextafter(thr, np.inf)]
        x[4:8] = x[1:4].mean()  # (a few more near it)
        _, _, differ, _ = picks(be, rt, SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=float(min_p), seed=found), [x], [])
        assert differ == 0, (min_p, top, thr)
        found += 1
        if found == 6:
            break
    assert found == 6


def test_the_sampled_pick_allocates_nothing_per_token(be, rt):
    """After a sampler's first pick (its buffers, the staging's pinned mirrors), the picks of a run
    allocate no device or pinned memory: the uniform and a changed window go up through fixed
    buffers, the 16 bytes come back into a fixed pinned one (so a captured step could replay it)."""
    from test_gpu_tier import counting

    rng = np.random.default_rng(8)
    params = SamplerParams(seed=3, **PENALTIES)
    dev = Sampler(V, params, banned=[1])
    row = np.empty(V, np.float32)
    be._logits = rt.to_device(rows(rng, "normal")[None])
    hist = [4, 5, 6]
    hist.append(be._sample(dev.device_draw(np.array(hist), row)))
    with counting(rt) as counts:
        for i in range(6):
            if i == 3:
                hist = [9, 9]  # another history: the window goes up again, into the same buffer
            hist.append(be._sample(dev.device_draw(np.array(hist), row)))
    assert counts == [0, 0], counts
