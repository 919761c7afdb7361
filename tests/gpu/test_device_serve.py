"""strata serve on the device step (engine/scheduler.py over engine/tier/sessions.py).

Each test runs on CUDA (marked gpu: scripts/gpu_suite.sh) and on the host emulation (tests/gpu_emu.py).
What must hold, with --gpu-step device:
    - the tier places --batch sessions (and with --spec each one's snapshots and a draft KV cache),
      as its plan says, and the server's requests run in those only: none is made while serving;
    - every request's greedy tokens are the ones it gets alone on the device step, with --batch 2,
      and with --spec 2 --batch-mtp (each slot drafting on the device head, verified in one forward);
    - a finished session parks in host memory (a CPU session's arrays, a copy), and a next turn
      resumed from it gives the tokens a cold run of the whole conversation gives;
    - the copy walks every array of a session that its memory() counts (qwen35moe and qwen4exp).
The --spec 2 case once died on a card (2026-12-06, an H100) where its emulation passed: the two
requests' pick buffers were made again at each turn under their captured drafts
(DeviceBackend.pick_rows_ready, now a set per banned list; test_device_spec.py's replayed-pick test
shows it in the emulation with a recording stand-in for the graphs).
"""

from __future__ import annotations

import io
import re
import threading

import engine_fixture as F
import numpy as np
import pytest

from gpu_emu import EmuRuntime

from strata.engine import budget as B
from strata.engine.backend import CpuBackend
from strata.engine.generate import generate
from strata.engine.kernels import gpu
from strata.engine.kvcache import KVCache
from strata.engine.model import Model, Session
from strata.engine.pack_reader import Pack
from strata.engine.qsa import QSACache
from strata.engine.sampling import Sampler, SamplerParams
from strata.engine.scheduler import ConversationCache, Job, Scheduler
from strata.engine.tier import GpuTier, TierOptions
from strata.engine.tier.device import DeviceBackend, DeviceKVCache
from strata.engine.tier.sessions import DeviceSessions, session_pairs
from strata.engine.tokenizer import Tokenizer

GREEDY = SamplerParams(temperature=0)
CTX, N_NEW = 48, 6

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    # two layers, a Gated DeltaNet and an attention one, and an MTP block (the emulation runs a
    # launch's every thread on the host: a layer costs seconds a test)
    return F.make_pack(tmp_path_factory.mktemp("device-serve"), types={"experts": "Q8_0", "dense": "Q8_0"}, n_layer=2,
                       full_attention_interval=2, recurrent_layers=(1, 0), n_mtp_layer=1, mtp_shared_head_norm=1)


@pytest.fixture(scope="module")
def model(pack_dir):
    return Model(Pack.open(pack_dir))


def tier_of(model, batch, spec=0):
    return GpuTier.start(model, TierOptions(max_context=CTX, kv="f32", prefill_chunk=8, step="device", spec=spec,
                                            draft=bool(spec), batch=batch))


def run_jobs(scheduler, prompts) -> list[Job]:
    jobs = [Job(prompt=p, max_tokens=N_NEW, params=GREEDY, ignore_eos=True) for p in prompts]
    done, ended = [], threading.Event()
    for j in jobs:
        j.on_done = lambda j: (done.append(j), len(done) == len(jobs) and ended.set())
        scheduler.submit(j)
    # (the emulation takes ~40 s; on a card a wait past this is the hang seen there, not a slow run)
    assert ended.wait(600 if isinstance(gpu.runtime(), EmuRuntime) else 120), "the jobs did not end"
    for j in jobs:
        assert j.error is None, repr(j.error)
    return jobs


def alone(model, prompt) -> list[int]:
    """A prompt's greedy tokens on the device step, in a session of its own (plain decoding)."""
    return generate(model, model.new_session(CTX, "f32"), prompt, Sampler(model.geometry.n_vocab, GREEDY), N_NEW,
                    prefill=8).tokens.tolist()


def test_the_tier_places_batch_sessions_as_planned(model, rt):
    """--batch 2 --spec 2 on the device step: two sessions at stage 1 (the second is serve.batch, on
    the device), two snapshots each and a draft KV cache each at stage 7; every mark is the plan's."""
    g = model.geometry
    tier = tier_of(model, batch=2, spec=2)
    try:
        plan, marks = tier.plan, tier.marks
        assert len(tier.sessions) == 2 and tier.session is tier.sessions[0]
        assert [len(s) for s in tier.snapshot_sets] == [2, 2] and tier.snapshots is tier.snapshot_sets[0]
        assert len(model.draft_head.spares) == 2 and model.draft_head.kept == 2
        one = B.session_device_bytes(g, CTX, "f32")
        assert one == sum(tier.sessions[1].memory().values()) - tier.sessions[1].memory()["scratch"]
        item = plan.item("serve.batch")
        assert item.where == B.DEVICE and item.stage == B.WEIGHTS and item.bytes == one
        assert plan.item("verify.snapshots").bytes == 2 * 2 * B.snapshot_state_bytes(g)
        assert plan.item("draft.bind").bytes == g.n_expert * plan.slot_bytes + 2 * CTX * B.kv_bytes_per_token(g, "f32") \
            + 2 * CTX * (g.n_rot // 2) * 4 + (g.n_vocab + g.n_embd) * 4
        for n, m in enumerate(marks, 1):
            if isinstance(rt, EmuRuntime):
                assert m.used == m.predicted, m.line(n)
            else:
                assert abs(m.used - m.predicted) <= max(0.01 * m.card_used, 2 * 2**20 * n), m.line(n)
    finally:
        tier.stop()


@pytest.mark.parametrize("spec", [0, 2])
def test_serve_on_the_device_step_gives_each_request_its_tokens_alone(model, pack_dir, rt, spec, monkeypatch):
    """Two requests together (--batch 2; with --spec 2, drafting on the device head and --batch-mtp),
    then each one's next turn, resumed from its session parked in host memory, and a new one in a
    session the others used: every request's tokens are the device step's alone (the next turns: a
    cold run of the whole conversation), and no session is made while serving."""
    V = model.geometry.n_vocab
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, V, 9).tolist(), rng.integers(3, V, 4).tolist()]
    cold = rng.integers(3, V, 6).tolist()  # (a new conversation in a session another request used)
    tier = tier_of(model, batch=2, spec=spec)
    try:
        want = [alone(model, p) for p in prompts]
        sessions = DeviceSessions(tier.model.backend.rt, model, tier.sessions, tier.snapshot_sets)
        cache = ConversationCache(4, 64 << 20)
        server = Scheduler(model, Tokenizer.load(pack_dir / "tokenizer.txt"), max_context=CTX, kv="f32", chunk=8,
                           max_queue=4, cache=cache, batch=2, spec=spec, spec_min_p=0.0, batch_mtp=bool(spec),
                           sessions=sessions)
        made = []
        monkeypatch.setattr(model, "new_session", lambda *a: made.append(a) or pytest.fail("a session made"))
        try:
            first = run_jobs(server, prompts)
            assert [j.result.tokens.tolist() for j in first] == want
            assert sessions.free == 2 and len(cache) == 2
            for s, _ in cache._parked.values():  # parked in host memory: a CPU session's stores
                assert type(s.states[1]) is KVCache and not isinstance(s.states[1], DeviceKVCache)
            nxt = [p + w + [7, 11] for p, w in zip(prompts, want)] + [cold]
            second = run_jobs(server, nxt)
        finally:
            server.close()
        assert made == [] and sessions.free == 2
        assert [j.resumed for j in second] == [len(p) + N_NEW - 1 for p in prompts] + [0]
        if spec:
            assert server.counters.verify_forwards > 0 and server.spec_stats.drafted[0] > 0
            assert len(model.draft_head.spares) == 2  # (each request's draft KV cache given back)
        monkeypatch.undo()
        assert [j.result.tokens.tolist() for j in second] == [alone(model, p) for p in nxt]
    finally:
        tier.stop()


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory):
    return Model(Pack.open(F.tiny_qwen4exp(tmp_path_factory.mktemp("device-serve-q4"))))


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_a_session_copy_takes_every_array_its_memory_counts(model, qwen4exp, rt, arch):
    """A parked copy holds every state a session has: the arrays the copy walks are the bytes
    Session.memory() counts (the budget's session items and the PLE windows) and the routing counts,
    for a device session and a host one, whose arrays pair one to one."""
    m = model if arch == "qwen35moe" else qwen4exp
    dev = Session(m, 32, "int8", backend=DeviceBackend(rt, None))
    host = Session(m, 32, "int8", backend=CpuBackend())
    dev.pos = 5
    pairs = session_pairs(host, dev)
    assert host.pos == 5
    for s in (dev, host):
        counted = sum(s.memory().values()) + s.routing.nbytes
        assert sum(b.nbytes for _, b, _ in pairs) == counted
    assert all(a is not b for a, b, _ in pairs)
    # a KV cache's keys and values (and int8's scales) count for the 5 positions fed; the rest whole
    kv = [st.kv if isinstance(st, QSACache) else st for st in dev.states if isinstance(st, (KVCache, QSACache))]
    kv_ids = {id(getattr(c, a)) for c in kv for a in ("k", "v", "k_scale", "v_scale")}
    assert len(kv_ids) == 4 * len(kv) > 0
    assert {id(b) for _, b, n in pairs if n is not None} == kv_ids and {n for _, _, n in pairs} == {None, 5}
    walked = {id(b) for _, b, _ in pairs}
    if arch == "qwen4exp":  # (QSA's stores and PLE's ring and window among them)
        qsa = [st for st in dev.states if isinstance(st, QSACache)]
        assert qsa and m.ple
        assert all(id(a) in walked for st in qsa for a in (st.kv.k, st.kv.k_scale, st.idx_keys, st.idx_blocks))
        assert all(id(p.ring) in walked and id(p.window) in walked for p in dev.ple_states.values())


def test_a_failed_clear_or_copy_gives_the_session_back(model, rt):
    """A borrowed session whose copy up fails (a parked state of the wrong shape) or whose clearing
    fails goes back to the pool: the request fails, the server keeps its sessions."""
    placed = Session(model, 16, "f32", backend=DeviceBackend(rt, None))
    sessions = DeviceSessions(rt, model, [placed])
    bad = Session(model, 16, "f32", backend=CpuBackend())
    bad.stream = np.zeros((1, bad.stream.shape[1] + 1), np.float32)
    with pytest.raises(ValueError, match="session copy"):
        sessions.resume(bad)
    assert sessions.free == 1
    s = sessions.take(16, "f32")
    assert s is placed and sessions.free == 0
    sessions.park(s)
    assert sessions.free == 1
    sessions._blank = bad  # (a blank of other shapes: the clearing fails)
    with pytest.raises(ValueError, match="session copy"):
        sessions.take(16, "f32")
    assert sessions.free == 1
    with pytest.raises(ValueError, match="not lent"):
        sessions.give(placed)


def test_strata_serve_gpu_step_device_answers_as_it_does_alone(model, pack_dir, rt, capsys, monkeypatch):
    """The command: `strata serve --device gpu --gpu-step device --batch 2` starts the tier with two
    placed sessions, and its answers (through the HTTP app, uvicorn's loop replaced by a client of the
    app) are the device step's alone, with --spec 2 --batch-mtp too (the pack's MTP head drafting)."""
    from fastapi.testclient import TestClient

    from strata.engine import cli

    monkeypatch.setattr(gpu, "available", lambda: (True, "the test's runtime"))  # (the emulation has no CuPy device)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(3, model.geometry.n_vocab, 7).tolist(), rng.integers(3, model.geometry.n_vocab, 5).tolist()]
    got = {}

    class Server:  # uvicorn.Server's part that _serve uses: run() until stopped
        def __init__(self, config):
            self.app = config.app

        def run(self):
            with TestClient(self.app) as client:
                got["texts"] = [client.post("/v1/completions", json={
                    "prompt": p, "max_tokens": N_NEW, "temperature": 0, "ignore_eos": True}).json() for p in prompts]
            got["free"] = got["sessions"].free

    def sessions_of(served, tier):
        got["sessions"] = cli_sessions(served, tier)
        return got["sessions"]

    cli_sessions = cli.serve_sessions
    monkeypatch.setattr(cli, "serve_sessions", sessions_of)
    monkeypatch.setattr(cli, "QuietSignalServer", Server)
    common = ["serve", str(pack_dir), "--device", "gpu", "--gpu-step", "device", "--batch", "2", "--kv", "f32",
              "--prefill", "8", "-c", str(CTX), "-t", "1"]
    tok = Tokenizer.load(pack_dir / "tokenizer.txt")
    tier = tier_of(model, batch=1)
    try:
        want = [tok.decode(alone(model, p)) for p in prompts]
    finally:
        tier.stop()
    for spec in ([], ["--spec", "2", "--batch-mtp"]):  # (greedy: the drafts change no token)
        rc = cli.main(common + spec)
        err = capsys.readouterr().err
        assert rc == 0, err
        assert "the GPU tier, --gpu-step device" in err, err
        assert isinstance(got["sessions"], DeviceSessions) and got["free"] == 2
        assert [r["choices"][0]["text"] for r in got["texts"]] == want, spec


def test_strata_chat_on_the_device_step_replies_as_generate_does(pack_dir, rt, capsys, monkeypatch):
    """strata chat --device gpu --gpu-step device: its first reply is `strata generate --chat`'s on the
    same step, and the next turn runs (the first parked in host memory between them); with --spec 2
    its replies are the same."""
    from strata.engine import cli

    monkeypatch.setattr(gpu, "available", lambda: (True, "the test's runtime"))  # (the emulation has no CuPy device)
    common = ["--device", "gpu", "--gpu-step", "device", "-t", "1", "--temp", "0", "--kv", "f32", "--prefill", "8",
              "-c", "96", "-n", "5", "--ignore-eos"]
    assert cli.main(["generate", str(pack_dir), *common, "--chat", "-p", "hi"]) == 0
    want = capsys.readouterr().out.removesuffix("\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nmore\n"))
    rc = cli.main(["chat", str(pack_dir), *common, "--stats"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.split("\n")[0] == want and err.count("reply 5 tokens") == 2, err
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nmore\n"))
    rc = cli.main(["chat", str(pack_dir), *common, "--spec", "2", "--stats"])
    spec_out, err = capsys.readouterr()
    assert rc == 0, err
    assert spec_out == out and "verifications" in err, err  # (greedy: the drafts change no token)
