"""Speculative decoding on the device step (engine/speculative.py over engine/tier/device.py).

Each test runs on CUDA (marked gpu: scripts/gpu_suite.sh) and on the host emulation (tests/gpu_emu.py).
What must hold, with --gpu-step device and every expert resident:
    - the verify forward's rows (T = 1 + N) have the bits the device's one-token step gives them;
    - greedy output with --spec 1 and 2 is --spec 0's, for a drafter always right, one always wrong
      and the pack's MTP head, and after the run every state of the session is the --spec 0
      session's, bit for bit (the rollback restores them);
    - the snapshots are device arrays, and a rollback copies them on the device: nothing of the
      states comes down to the host; greedy verification picks each row's token on the device
      (DeviceBackend.pick_rows): only the ids come down, never a logits row.
"""

from __future__ import annotations

import collections
import contextlib
import re
import types

import engine_fixture as F
import numpy as np
import pytest

from gpu_emu import EmuRuntime

from strata.engine import budget as B
from strata.engine.expert_plan import MiB
from strata.engine.generate import drive, generate
from strata.engine.model import Model
from strata.engine.mtp import MTPHead
from strata.engine.pack_reader import Pack
from strata.engine.qsa import QSACache
from strata.engine.sampling import Sampler, SamplerParams
from strata.engine.speculative import MTPDrafter, ReferenceDrafter, SpecRun, Snapshot, roll_back
from strata.engine.tier import GpuTier, TierOptions
from strata.engine.tier.device import DeviceBackend

GREEDY = SamplerParams(temperature=0)
N_PROMPT, N_NEW = 9, 8
CTX = N_PROMPT + N_NEW

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device-spec")
    # two layers, a Gated DeltaNet and an attention one: the emulation runs a launch's every thread
    # on the host (about 50 ms a product), so a layer costs seconds a test
    return Model(Pack.open(F.make_pack(tmp, types={"experts": "Q8_0", "dense": "Q8_0"}, n_layer=2, full_attention_interval=2,
                                       recurrent_layers=(1, 0), n_mtp_layer=1, mtp_shared_head_norm=1)))


@contextlib.contextmanager
def device_tier(model, spec=0, expert_cache=None, draft=False):
    tier = GpuTier.start(model, TierOptions(max_context=CTX, kv="f32", prefill_chunk=8, step="device", expert_cache=expert_cache,
                                            spec=spec, draft=draft))
    try:
        assert isinstance(model.backend, DeviceBackend)
        yield tier
    finally:
        tier.stop()


def prompt_for(model, seed=3):
    return np.random.default_rng(seed).integers(3, model.geometry.n_vocab, N_PROMPT).tolist()


def host_states(be, s):
    """Every state of session s on the host, for comparing: GDN conv and S, the KV cache up to pos,
    the routing counts."""
    out = []
    for st in s.states:
        if isinstance(st, dict):
            out += [be.host(st["conv"]), be.host(st["S"])]
        elif isinstance(st, QSACache):  # qwen4exp: its KV cache, indexer keys, pooled keys, count
            nb = s.pos // st.ratio
            out += [be.host(a) for a in st.kv.read(slice(0, s.pos))]
            out += [be.host(st.idx_keys)[: s.pos], be.host(st.idx_blocks)[:nb], np.array([st.n])]
        else:
            out += [be.host(a) for a in st.read(slice(0, s.pos))]
    return out + [s.routing.copy()]


def stepped_and_verifying(model, prompt, toks, kv="f32"):
    """Two sessions fed `prompt` on the model's tier: `a` then steps through toks (its logits: what
    each row of a verify of toks must give), `b` gets a snapshot per draft -> (a, b, the logits, the snapshots)."""
    a, b = model.new_session(CTX, kv), model.new_session(CTX, kv)
    model.forward(a, prompt, n_logits=0)
    model.forward(b, prompt, n_logits=0)
    steps = np.stack([model.step(a, t).copy() for t in toks])
    return a, b, steps, [Snapshot(b, model.backend) for _ in toks[:-1]]


@pytest.mark.parametrize("few", ["mv", "mvf", "mmq"])
@pytest.mark.parametrize("cache", ["all", "a third"])
def test_the_verify_rows_have_the_bits_of_the_device_token_step(model, rt, cache, few, monkeypatch):
    """Every expert resident: each layer's rows in one set of launches (DeviceExperts._rows_resident);
    a third: row by row, each row's misses on the CPU (DeviceExperts.token). `few`: the kernel of
    the rows' dense products: "mv", the default (the one-row kernel's NT rows, mv<T, KPL, 0, NT>, on
    matrices of few rows, gpu.MVT_TOKENS; mvf on the others), "mvf" (the few-row kernel alone,
    gpu.MVF_TOKENS) or "mmq" (the batched one, neither). With either of the first two one input's
    products of one type go in one launch (mvm or mvfm, fmvm over the rows: DeviceBackend.linears),
    with the bits of a launch each."""
    from strata.engine.kernels import gpu

    monkeypatch.setattr(gpu, "MVF_TOKENS", 1 if few == "mmq" else 8)
    monkeypatch.setattr(gpu, "MVT_TOKENS", 4 if few == "mv" else 1)
    # (a card's multiprocessors at least: the emulation's one would make this model's matrices ones
    # of many rows, which mvf takes: gpu._few_weight_rows)
    monkeypatch.setattr(rt, "n_sm", max(rt.n_sm, 132))
    gpu._plans.clear()  # (launch plans are kept per shape: made again under this setting)
    prompt = prompt_for(model)
    toks = [5, 77, 140]
    g = model.geometry
    with device_tier(model, expert_cache=None if cache == "all" else g.n_layer * g.n_expert // 3) as tier:
        be = model.backend
        a, b, steps, snaps = stepped_and_verifying(model, prompt, toks)
        launched, launch, products, rt_launch = [], be._launch, [], rt.launch
        be._launch = lambda name, *a: (launched.append(name), launch(name, *a))
        rt.launch = lambda mod, name, *a, **k: (products.append(name), rt_launch(mod, name, *a, **k))[1]
        try:
            rows = model.forward(b, toks, n_logits=3, saved=snaps)
        finally:
            del be._launch, rt.launch
        # each Gated DeltaNet layer's rows in three launches, their snapshots written by them
        L, n_gdn = model.geometry.n_layer, sum(isinstance(st, dict) for st in b.states)
        assert n_gdn and launched.count("dev_conv_rows") == launched.count("dev_l2_qk_rows") == n_gdn
        assert "dev_conv" not in launched and "dev_l2_qk" not in launched
        # each attention layer's rows in three launches (their keys, then each row's split attention)
        n_attn = L - n_gdn
        assert launched.count("dev_kv_write_rows") == launched.count("dev_attn_split_rows") == n_attn
        assert "dev_kv_write" not in launched and "dev_attn_split" not in launched
        # the rows' MoE by the token path's launches on the device, every row of a layer in each
        # (routing included: dev_route_n, a block a row), not routed on the host (whose rows
        # dev_combine sums): no routing comes down
        if cache == "all":
            assert launched.count("dev_route_n") == launched.count("dev_combine_n") == L, launched
            assert "dev_route" not in launched and "dev_combine" not in launched
            assert "dev_shared_add" not in launched  # (the shared expert's add in the routed sum's launch)
        else:
            assert tier.stats.hits.sum() > 0 and tier.stats.misses.sum() > 0  # both paths ran
            assert launched.count("dev_route") + len(toks) * launched.count("dev_route_n") == len(toks) * L
            assert "dev_combine" not in launched
        assert np.array_equal(rows, steps), f"max |diff| {np.abs(rows - steps).max()}"
        for x, y in zip(host_states(be, b), host_states(be, a)):
            assert np.array_equal(x, y)
        # which kernel took the rows' dense products (3 rows: mv<T, KPL, 0, 3>, the wide form's
        # mv<T, KPL, 1, 3>, grouped mvm<T, KPL, 3> on matrices of few rows, mvf on the others;
        # the rows' experts stay mvx's one-row products)
        params = {n: n[n.index("<") + 1 : -1].split(", ") for n in products if n.startswith(("mv<", "mvm<"))}
        three = {n for n, v in params.items() if v[3 if n.startswith("mv<") else 2 :][:1] == ["3"]}
        assert bool(three) == (few == "mv"), products
        if few != "mv":  # (with "mv", mvf takes the matrices of many rows: the head, in the emulation most)
            assert bool([n for n in products if n.startswith("mvf")]) == (few == "mvf"), products
        assert ("mmq" in " ".join(products)) == (few == "mmq"), products
        # one launch each: a Gated DeltaNet layer's z, beta and alpha (Q8_0 here; its qkv reads the
        # wide form, actq.WIDE_ROLES, as attention's q/k/v do: a launch each, as in the token step),
        # the shared expert's up and gate, the router and the shared gate's logit (F32)
        grouped = sum(n.startswith(("mvfm", "fmvm")) or n.startswith("mvm<") and n in three for n in products)
        assert grouped == (n_gdn + 2 * L if few != "mmq" else 0), " ".join(products)
    gpu._plans.clear()


@pytest.mark.parametrize("kv", ["f32", "int8"])
def test_a_verify_queues_its_rows_with_nothing_crossing_to_the_host(model, rt, kv):
    """Everything a verify's rows do is queued on the device, nothing copied or waited for until the
    head's rows are made (a captured verify cannot wait mid-way; before, each row waited in each
    layer for its routing counts): the counts each row's snapshot keeps are settled after the
    forward, each row's position is read from the device. Its rows and snapshots are still exact.
    After it only the logits come down by a copy of their own (the rows' routing ids by one queued
    before that copy's wait)."""
    prompt = prompt_for(model, seed=5)
    with device_tier(model):
        be = model.backend
        toks = [12, 40, 301]
        a, b, steps, snaps = stepped_and_verifying(model, prompt, toks, kv)  # (int8: the cache's scales too)
        # (an asynchronous copy queues, and is captured; the emulation's makes its copy through copy_in)
        names = ("to_host", "to_device", "copy_out", "copy_in", "synchronize", "copy_in_async")
        crossed, inside, kept, downs = [], [False], {n: getattr(rt, n) for n in names}, []

        def watching(n):
            def call(*x, **kw):
                if n == "to_host":
                    downs.append(tuple(x[0].shape))
                if n == "copy_in_async":
                    was, inside[0] = inside[0], False
                    try:
                        return kept[n](*x, **kw)
                    finally:
                        inside[0] = was
                if inside[0]:
                    crossed.append(n)
                return kept[n](*x, **kw)
            return call

        for n in names:
            setattr(rt, n, watching(n))
        verify_step = be.verify_step

        def watched(session, pos, T, run, *x, **kw):
            def inner():
                inside[0] = True
                try:
                    run()
                finally:
                    inside[0] = False
            return verify_step(session, pos, T, inner, *x, **kw)

        be.verify_step = watched
        try:
            rows = model.forward(b, toks, n_logits=3, saved=snaps)
        finally:
            del be.verify_step
            for n in names:
                delattr(rt, n)
        assert crossed == [], f"the verify's rows crossed to the host: {crossed}"
        # after it only the logits rows come down by a copy of their own: the rows' routing ids by
        # one queued before that copy's wait (settle read them by a copy and wait of their own)
        assert downs == [(3, model.geometry.n_vocab)], downs
        assert np.array_equal(rows, steps)
        # the rollback to the first row's snapshot: the session fed the first token alone
        roll_back(b, snaps[0], N_PROMPT + 1)
        c = model.new_session(CTX, kv)
        model.forward(c, prompt + toks[:1], n_logits=0)
        for x, y in zip(host_states(be, b), host_states(be, c)):
            assert np.array_equal(x, y)


def test_two_sessions_verified_in_one_forward_have_their_token_steps_bits(model, rt):
    """strata serve --batch-mtp on the device step: two sessions' rows in one forward (each row a
    one-token sequence of its session, every layer's rows routed and combined in one set of
    launches): each row's logits and each session's states are its own token steps'."""
    with device_tier(model):
        be = model.backend
        prompts = [prompt_for(model, seed=7), prompt_for(model, seed=8)[:6]]
        toks = [[4, 61], [250, 18, 90]]
        refs, sessions, steps, snaps = [], [], [], []
        for p, t in zip(prompts, toks):
            a, b = model.new_session(CTX), model.new_session(CTX)
            model.forward(a, p, n_logits=0)
            model.forward(b, p, n_logits=0)
            steps.append(np.stack([model.step(a, x).copy() for x in t]))
            refs.append(a)
            sessions.append(b)
            snaps.append([Snapshot(b, be) for _ in t[:-1]])
        rows = model.forward_batch(sessions, toks, [len(t) for t in toks], saved=snaps)
        for got, want, a, b in zip(rows, steps, refs, sessions):
            assert np.array_equal(got, want), f"max |diff| {np.abs(got - want).max()}"
            for x, y in zip(host_states(be, b), host_states(be, a)):
                assert np.array_equal(x, y)


def test_a_rollback_copies_the_snapshot_on_the_device(model, rt):
    """The snapshots are the runtime's arrays and a rollback brings nothing down: the session after
    rolling back to the first verified row is the session fed that row alone."""
    prompt = prompt_for(model, seed=4)
    with device_tier(model):
        be = model.backend
        a, b = model.new_session(CTX), model.new_session(CTX)
        model.forward(a, prompt + [9], n_logits=0)
        model.forward(b, prompt, n_logits=0)
        made = getattr(rt, "allocations", None)  # (the emulation counts the runtime's allocations)
        snaps = [Snapshot(b, be), Snapshot(b, be)]
        gdn = [l for l, st in enumerate(b.states) if isinstance(st, dict)]
        assert gdn and all(rt.is_array(snaps[0].states[l]["S"]) for l in gdn)
        if made is not None:  # each snapshot's conv and S of every GDN layer: the runtime's arrays
            assert rt.allocations - made == 2 * 2 * len(gdn)
        model.forward(b, [9, 31, 200], n_logits=3, saved=snaps)
        down, to_host, copy_out, copy_out_async = [], rt.to_host, rt.copy_out, rt.copy_out_async
        rt.to_host = lambda x: (down.append(x.nbytes), to_host(x))[1]
        rt.copy_out = lambda h, d: (down.append(h.nbytes), copy_out(h, d))[1]
        rt.copy_out_async = lambda h, d: (down.append(h.nbytes), copy_out_async(h, d))[1]
        try:
            roll_back(b, snaps[0], N_PROMPT + 1)
        finally:
            del rt.to_host, rt.copy_out, rt.copy_out_async
        assert down == [], f"a rollback brought {down} bytes down"
        assert b.pos == a.pos
        for x, y in zip(host_states(be, b), host_states(be, a)):
            assert np.array_equal(x, y)


REFERENCE: dict = {}  # runtime type -> (--spec 0's Generation, its session's position and states)


@pytest.mark.parametrize("graphs", ["graphs", "eager"])
@pytest.mark.parametrize("n_draft", [1, 2])
@pytest.mark.parametrize("kind", ["oracle", "wrong", "mtp"])
def test_greedy_spec_on_the_device_step_is_plain_decoding(model, rt, kind, n_draft, graphs):
    """With `graphs` each kind of verify is captured at its second run and replayed from its third
    (on the card: the emulation captures nothing, and runs both eagerly)."""
    prompt = prompt_for(model)
    V = model.geometry.n_vocab
    with device_tier(model, spec=n_draft) as tier:
        be = model.backend
        be.verify_graphs = graphs == "graphs"
        if type(rt) not in REFERENCE:  # --spec 0's run, once per runtime (the emulation takes seconds a token)
            ref_session = tier.take_session(CTX, "f32")  # (its own stream: a plain step is captured there)
            ref = generate(model, ref_session, prompt, Sampler(V, GREEDY), N_NEW, prefill=8)
            REFERENCE[type(rt)] = ref, ref_session.pos, host_states(be, ref_session)
        ref, ref_pos, ref_states = REFERENCE[type(rt)]
        if kind == "mtp":
            drafter = MTPDrafter(MTPHead(model.pack), CTX, "f32", Sampler(V, GREEDY), min_p=0.0)
        else:
            drafter = ReferenceDrafter(np.concatenate([ref.prompt, ref.tokens]), V, {"oracle": 1.0, "wrong": 0.0}[kind])
        s = tier.take_session(CTX, "f32")
        # the snapshots the tier placed at its startup (strata generate --spec N --gpu-step device hands them so)
        run = SpecRun(model, s, prompt, Sampler(V, GREEDY), N_NEW, drafter=drafter, n_draft=n_draft, prefill=8,
                      snapshots=tier.snapshots)
        assert run.snaps == tier.snapshots
        # each verification picks its rows' tokens on the device: ids come down, not logits rows
        picks, picked_rows, to_host, down, forward, verifying = [], be.picked_rows, rt.to_host, [], model.forward, [False]
        be.picked_rows = lambda n, banned: (picks.append(n), picked_rows(n, banned))[1]
        rt.to_host = lambda x: (verifying[0] and down.append(x.shape), to_host(x))[1]

        rows = []  # each verification's row count (its kind, with a drafter that asks the same of the head)

        def verify_aware(s, tokens, n_logits=1, **kw):  # what comes down while a verification runs
            verifying[0] = kw.get("saved") is not None
            if verifying[0]:
                rows.append(len(tokens))
            try:
                return forward(s, tokens, n_logits, **kw)
            finally:
                verifying[0] = False

        model.forward = verify_aware
        try:
            out = drive(model, run)
        finally:
            del be.picked_rows, rt.to_host, model.forward
        st = run.stats
        # (nothing comes down by a copy and wait of its own: the picks, the hidden rows the MTP head
        # reads and the rows' routing ids by copies queued before the verify's one wait)
        assert len(picks) == st.verifications and not down, down
        assert out.tokens.tolist() == ref.tokens.tolist()
        assert st.verifications > 0 and st.drafted[0] > 0
        if kind == "oracle":
            assert (st.accepted == st.drafted).all()
        elif kind == "wrong":
            assert st.accepted.sum() == 0
        assert s.pos == ref_pos
        for x, y in zip(host_states(be, s), ref_states):
            assert np.array_equal(x, y)
        if graphs == "graphs" and not isinstance(rt, EmuRuntime):
            # every verification of a wrong drafter has 1 + N rows: captured at the second, replayed after
            # (2026-12-05, an H100: none was, the output and states right; what capture needs, said)
            assert any("segments" in g for g in be._vgraphs.values()), (
                f"no verify was captured: stream capturable {rt.capturable()} (retaken {be.stream_retaken}), slot map static {be.experts.static()}, "
                f"kinds {[(k[1:4], sorted(g)) for k, g in be._vgraphs.items() if g]}")
            if kind != "mtp":  # each kind (here: its row count) eager, then captured, then replayed; the last
                # verifications have fewer rows where fewer tokens are left to draft (2026-12-05, an H100: the
                # wrong drafter's 6 verifications were 5 of 3 rows and 1 of 2, 3 replays)
                kinds = collections.Counter(rows)
                assert sum(g.get("replays", 0) for g in be._vgraphs.values()) == sum(max(0, n - 2) for n in kinds.values()), kinds


@pytest.mark.parametrize("kind, n_draft", [("oracle", 2), ("wrong", 1), ("right", 2)])
def test_greedy_spec_with_each_verify_run_ahead_is_plain_decoding(model, rt, kind, n_draft):
    """A greedy run whose verifies run ahead of the host (SpecRun.take_ahead, Model.verify_ahead: the
    judge, the rollback and the next chain on the device, each verify queued before the last one is
    read) gives --spec 0's tokens; near the context's end it stops queuing and the plain loop ends
    the run, so the session ends where --spec 0's does with its every state, bit for bit. The
    acceptance counts are the host's rule on the same drafts: the reference drafter right with
    probability 0.5 by position drafts the same chain on the device and on the host."""
    prompt = prompt_for(model)
    V = model.geometry.n_vocab
    with device_tier(model, spec=n_draft) as tier:
        be = model.backend
        if type(rt) not in REFERENCE:
            ref_session = tier.take_session(CTX, "f32")
            ref = generate(model, ref_session, prompt, Sampler(V, GREEDY), N_NEW, prefill=8)
            REFERENCE[type(rt)] = ref, ref_session.pos, host_states(be, ref_session)
        ref, ref_pos, ref_states = REFERENCE[type(rt)]
        reference = np.concatenate([ref.prompt, ref.tokens])
        p = {"oracle": 1.0, "wrong": 0.0, "right": 0.5}[kind]
        stats = []
        for ahead in (False, True):  # the plain loop's verifies, then the same run with them ahead
            s = tier.take_session(CTX, "f32")
            run = SpecRun(model, s, prompt, Sampler(V, GREEDY), N_NEW, drafter=ReferenceDrafter(reference, V, p, seed=3),
                          n_draft=n_draft, prefill=8, snapshots=tier.snapshots)
            queued, queue = [], be.ahead_verify.queue
            be.ahead_verify.queue = lambda T: (queued.append(T), queue(T))[1]
            try:
                out = drive(model, run, ahead)
            finally:
                del be.ahead_verify.queue
            assert out.tokens.tolist() == ref.tokens.tolist()
            assert s.spent is None and s.pos == ref_pos
            for x, y in zip(host_states(be, s), ref_states):
                assert np.array_equal(x, y)
            st = run.stats
            stats.append((st.verifications, st.accepted.tolist(), st.drafted.tolist()))
            if ahead:  # (CTX leaves room for two or three verifies ahead, then the plain loop's)
                assert len(queued) >= 2 and set(queued) == {n_draft + 1}, queued
            else:
                assert not queued
            assert st.ahead == len(queued) <= st.verifications
        _, accepted, drafted = stats[1]
        if kind == "oracle":
            assert accepted == drafted and sum(accepted) > 0
        elif kind == "wrong":
            assert sum(accepted) == 0 < sum(drafted)
        else:
            assert 0 < sum(accepted) < sum(drafted)
        assert stats[0] == stats[1], stats


def test_a_stop_inside_a_verify_run_ahead_leaves_the_session_spent(model, rt):
    """A stop token read from a verify's record while the next verify is queued: the run ends there
    with the plain loop's tokens, the queued verify is dropped (waited for, its hits taken back, its
    routing never counted) and the session is spent (its states moved past the stop), as a token
    step's run-ahead leaves it (Model.decode_ahead)."""
    prompt = prompt_for(model)
    V = model.geometry.n_vocab
    with device_tier(model, spec=2) as tier:
        be = model.backend
        plain_session = tier.take_session(CTX, "f32")
        ref = generate(model, plain_session, prompt, Sampler(V, GREEDY), N_NEW, prefill=8)
        toks = ref.tokens.tolist()
        # a token first met in the first verify's record (tokens 1..3; token 0 comes from the prompt)
        at = next(i for i in (1, 2, 3) if toks[i] not in toks[:i])
        stopped = generate(model, tier.take_session(CTX, "f32"), prompt, Sampler(V, GREEDY), N_NEW, prefill=8,
                           stop_ids={toks[at]})
        reference = np.concatenate([ref.prompt, ref.tokens])
        counted = []  # the hits each run added: the plain loop's, then the one run ahead
        for ahead in (False, True):
            hits = tier.stats.hits.sum()
            s = tier.take_session(CTX, "f32")
            run = SpecRun(model, s, prompt, Sampler(V, GREEDY), N_NEW, drafter=ReferenceDrafter(reference, V, 1.0),
                          n_draft=2, prefill=8, snapshots=tier.snapshots, stop_ids={toks[at]})
            dropped, drop = [], be.ahead_verify.drop
            be.ahead_verify.drop = lambda pending: (dropped.append(pending[5]), drop(pending))[1]
            try:
                out = drive(model, run, ahead)
            finally:
                del be.ahead_verify.drop
            counted.append(tier.stats.hits.sum() - hits)
            assert out.tokens.tolist() == stopped.tokens.tolist() and out.stop == stopped.stop
        assert dropped == [3] and run.stats.ahead == 1
        assert s.spent and "ahead" in s.spent
        with pytest.raises(ValueError, match="cannot take more tokens"):
            model.step(s, 1)
        assert counted[0] == counted[1] > 0, counted  # (the dropped verify's hits taken back)


def test_the_verifier_is_planned_and_placed_at_startup(model, rt):
    """--spec 2 on the device step: stage 7 places the verify's logits rows and its two snapshots of
    the states on the device, as the plan says (the routing counts' part on the host)."""
    with device_tier(model, spec=2) as tier:
        plan, marks, snaps = tier.plan, tier.marks, tier.snapshots
        logits = model.backend.verify_logits
    item = plan.item("verify.snapshots")
    assert item.where == B.DEVICE and item.stage == B.VERIFIER and item.bytes == 2 * B.snapshot_state_bytes(model.geometry) > 0
    assert plan.item("spec.snapshots").where == B.HOST
    assert plan.item("spec.snapshots").bytes == 2 * model.geometry.n_layer * model.geometry.n_expert * 8
    assert len(snaps) == 2 and logits.shape == (3, model.geometry.n_vocab)
    assert sum(a.nbytes for sn in snaps for st in sn.states if st for a in st.values()) == item.bytes
    assert marks[-1].stage == B.VERIFIER and marks[-1].predicted - marks[-2].predicted == \
        item.bytes + plan.item("verify.logits").bytes
    for n, m in enumerate(marks, 1):
        if isinstance(rt, EmuRuntime):
            assert m.used == m.predicted, m.line(n)
        else:
            assert abs(m.used - m.predicted) <= max(0.01 * m.card_used, 2 * MiB * n), m.line(n)


@pytest.mark.parametrize("graphs", ["graphs", "eager"])
def test_the_mtp_head_drafts_on_the_device(model, rt, graphs):
    """--spec with the MTP drafter on the device step: the tier places the head as planned (its
    matrices with the weights, its experts in slots of their own, its KV cache and rope table at
    stage 7), its draft logits are the CPU head's within float32 rounding (the device's attention
    sums in another order; its products and norms have the CPU's bits), and greedy --spec 2
    drafting with it gives --spec 0's tokens. With `graphs` its draft steps are captured at the
    second and replayed from the third (on the card; the emulation runs them eagerly)."""
    g, V, E = model.geometry, model.geometry.n_vocab, model.geometry.n_embd
    cpu_head = MTPHead(model.pack)
    rng = np.random.default_rng(11)
    h = rng.standard_normal((N_PROMPT, E)).astype(np.float32)
    toks = rng.integers(3, V, N_PROMPT + 3)
    want = [cpu_head.forward(cpu_head.new_state(CTX), h, toks[:N_PROMPT], 0).copy()]
    with device_tier(model, spec=2, draft=True) as tier:
        plan, marks, head = tier.plan, tier.marks, model.draft_head
        assert head is not None and head.backend is not model.backend and head.backend.experts is not model.backend.experts
        names = B.draft_matrices(g)
        assert names and all(model.pack.weight(n).device is not None for n in names)
        dense = plan.item("weights.drafter")
        assert dense.where == B.DEVICE and dense.stage == B.WEIGHTS and dense.bytes == plan.options.drafter_bytes > 0
        bind = plan.item("draft.bind")
        assert bind.stage == B.VERIFIER and bind.bytes == g.n_expert * plan.slot_bytes + CTX * B.kv_bytes_per_token(g, "f32") \
            + 2 * CTX * (g.n_rot // 2) * 4 + (V + E) * 4  # (experts, KV, its rope table's cos and sin, logits and y rows)
        assert "spec.mtp_kv" not in {i.key for i in plan.items}  # (its KV is in draft.bind, on the device)
        assert marks[-1].predicted - marks[-2].predicted == bind.bytes + plan.item("verify.snapshots").bytes \
            + plan.item("verify.logits").bytes
        for n, m in enumerate(marks, 1):
            if isinstance(rt, EmuRuntime):
                assert m.used == m.predicted, m.line(n)
            else:
                assert abs(m.used - m.predicted) <= max(0.01 * m.card_used, 2 * MiB * n), m.line(n)
        head.backend.verify_graphs = graphs == "graphs"
        state = head.new_state(CTX, "f32")  # (the one made at startup)
        got = [head.forward(state, h, toks[:N_PROMPT], 0).copy()]
        cpu_state = cpu_head.new_state(CTX)
        cpu_head.forward(cpu_state, h, toks[:N_PROMPT], 0)
        for i in range(3):  # a chain: each draft's y feeds the next, as MTPDrafter does
            got.append(head.forward(state, head.y.x, toks[N_PROMPT + i : N_PROMPT + i + 1], N_PROMPT + i).copy())
            want.append(cpu_head.forward(cpu_state, cpu_head.y.x, toks[N_PROMPT + i : N_PROMPT + i + 1], N_PROMPT + i).copy())
        assert head.routing.sum() == (N_PROMPT + 3) * g.n_expert_used  # (its counts settled after each forward)
        if graphs == "graphs" and not isinstance(rt, EmuRuntime):
            # the catch-up's last piece (N_PROMPT - chunk = 1 row, with logits) is a draft step's kind: eager,
            # then the chain's first step captured, its second and third replayed
            assert [v.get("replays") for v in head.backend._vgraphs.values()] == [2]
        for a, b in zip(got, want):
            assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max(), np.abs(a - b).max()
            assert a.argmax() == b.argmax()
        # greedy --spec 2 drafting with the device's head: --spec 0's tokens
        prompt = prompt_for(model)
        ref = generate(model, model.new_session(CTX, "f32"), prompt, Sampler(V, GREEDY), N_NEW, prefill=8)
        from strata.engine.speculative import speculative_generate

        before = head.routing.sum()
        out, st, _ = speculative_generate(model, model.new_session(CTX, "f32"), prompt, Sampler(V, GREEDY), N_NEW,
                                          n_draft=2, drafter="mtp", min_p=0.0, kv="f32", prefill=8,
                                          snapshots=tier.snapshots)
        assert out.tokens.tolist() == ref.tokens.tolist()
        assert st.verifications > 0 and st.drafted[0] > 0
        assert head.routing.sum() > before  # (the tier's head drafted, not one on the CPU)


@pytest.mark.parametrize("graphs", ["graphs", "eager"])
def test_the_device_heads_draft_pick_is_the_hosts_rule_on_its_logits(model, rt, graphs):
    """MTPHead.pick (a greedy draft on the device step): the token MTPDrafter's host rule takes from
    the head's logits (their argmax, the banned ids never) and their top probability at temperature
    1 (its float64 softmax, within 1e-12: another order of the same sum), over a chain of three
    drafts; the head's y (the next draft's input) has the logits step's bits, and its routing counts
    are the logits step's. Only the pick, the probability and the routing ids come down, each by a
    copy queued before the one wait."""
    g = model.geometry
    V, E = g.n_vocab, g.n_embd
    rng = np.random.default_rng(12)
    h = rng.standard_normal((N_PROMPT, E)).astype(np.float32)
    toks = rng.integers(3, V, N_PROMPT + 3)
    with device_tier(model, spec=2, draft=True):
        head = model.draft_head
        be = head.backend
        be.verify_graphs = graphs == "graphs"
        assert head.picks
        a, b = head.new_state(CTX, "f32"), head.new_state(CTX, "f32")  # (one to read the logits of, one to pick on)
        for st in (a, b):
            head.forward(st, h[:-1], toks[: N_PROMPT - 1], 0, logits=False)
        x, banned = h[-1:], None
        for i in range(3):
            pos, tok = N_PROMPT - 1 + i, int(toks[N_PROMPT - 1 + i])
            before = head.routing.copy()
            logits = head.forward(a, x, np.array([tok]), pos).copy()
            routed = head.routing - before
            y = be.host(head.y.x).copy()
            if banned is None:  # the first draft's own argmax banned: the pick must take the next best
                banned = np.array([int(logits.argmax())], np.int32)
            down, to_host = [], rt.to_host
            rt.to_host = lambda d: (down.append(d.shape), to_host(d))[1]
            before = head.routing.copy()
            try:
                d, top = head.pick(b, x, tok, pos, banned)
            finally:
                del rt.to_host
            # nothing comes down by a copy of its own: the picks, the probability and the routing ids
            # each by a copy queued before the one wait (the logits stay on the device)
            assert not down, down
            assert np.array_equal(head.routing - before, routed) and routed.sum() == g.n_expert_used
            ref = logits.copy()
            ref[banned] = -np.inf
            assert d == int(ref.argmax()), (i, d, int(ref.argmax()))
            want = 1.0 / float(np.exp(logits.astype(np.float64) - float(logits.max())).sum())
            assert abs(top - want) <= 1e-12 * want, (i, top, want)
            assert np.array_equal(be.host(head.y.x), y)
            x = y


def test_generate_drafts_with_the_device_head(model, rt, capsys, monkeypatch):
    """strata generate --spec 2 --gpu-step device: the startup places the MTP head (its line says so)
    and the greedy output is --spec 0's; with --spec-drafter oracle no head is placed and the verifies
    run ahead of the host (--stats says how many; the MTP head's chain is drafted between them)."""
    from strata.engine.cli import main
    from strata.engine.kernels import gpu

    monkeypatch.setattr(gpu, "available", lambda: (True, "the test's runtime"))  # (the emulation has no CuPy device)
    ids = " ".join(map(str, prompt_for(model, seed=8)))
    common = ["generate", "--pack", str(model.pack.dir), "--prompt-ids", ids, "-n", "5", "--temp", "0", "--kv", "f32",
              "--device", "gpu", "--gpu-step", "device", "--prefill", "8", "--ctx-size", str(CTX)]
    out = {}
    oracle = "--spec 2 --spec-drafter oracle --stats"
    for spec in (["--spec", "0"], ["--spec", "2", "--spec-min-p", "0", "--stats"], oracle.split()):
        rc = main(common + spec)
        o = capsys.readouterr()
        assert rc == 0, o.err
        out[" ".join(spec)] = o
    drafted = out["--spec 2 --spec-min-p 0 --stats"]
    assert "draft head: the MTP block on the device" in drafted.err, drafted.err
    assert "drafter mtp" in drafted.err and re.search(r"verifications [1-9]", drafted.err), drafted.err
    assert drafted.out == out["--spec 0"].out == out[oracle].out
    assert "draft head: the MTP block" not in out[oracle].err
    assert re.search(r"verifications [1-9]\d* \([1-9]\d* run ahead of the host\)", out[oracle].err), out[oracle].err
    assert "run ahead" not in drafted.err


@pytest.fixture(scope="module")
def qwen4exp(tmp_path_factory):
    return Model(Pack.open(F.tiny_qwen4exp(tmp_path_factory.mktemp("device-spec-q4"))))


def test_qwen4exp_verify_rows_have_the_bits_of_the_device_token_step(qwen4exp, rt):
    """qwen4exp's verify (QSA's block selection and PLE's hashes need the host between its rows, so
    it runs eagerly: verify_step's `capturable`): each row's logits and the states after it are the
    device token step's, the rows' positions read from the verify's position buffer where a row
    takes it (attention's rope) and staged per row where QSA takes the step's own."""
    model = qwen4exp
    prompt = np.random.default_rng(6).integers(3, model.geometry.n_vocab, N_PROMPT).tolist()
    toks = [7, 91, 33]
    with device_tier(model):
        be = model.backend
        a, b, steps, snaps = stepped_and_verifying(model, prompt, toks)
        rows = model.forward(b, toks, n_logits=3, saved=snaps)
        assert np.array_equal(rows, steps), f"max |diff| {np.abs(rows - steps).max()}"
        assert not be._vgraphs or all("segments" not in g for g in be._vgraphs.values())  # (eagerly)
        for x, y in zip(host_states(be, b), host_states(be, a)):
            assert np.array_equal(x, y)


@pytest.mark.parametrize("kind", ["oracle", "wrong"])
def test_qwen4exp_greedy_spec_on_the_device_step_is_plain_decoding(qwen4exp, rt, kind):
    """qwen4exp on the device step: --spec 2's greedy output is --spec 0's and every state after the
    run (the QSA caches, Gated DeltaNet states, routing counts) is the --spec 0 session's: the
    rollbacks of QSA's caches (truncated to the position) and of the PLE states (the snapshot's
    copies) run, with a drafter always right and one always wrong."""
    model = qwen4exp
    V = model.geometry.n_vocab
    prompt = np.random.default_rng(9).integers(3, V, N_PROMPT).tolist()
    with device_tier(model, spec=2) as tier:
        be = model.backend
        ref_session = tier.take_session(CTX, "f32")
        ref = generate(model, ref_session, prompt, Sampler(V, GREEDY), N_NEW, prefill=8)
        ref_states = host_states(be, ref_session)
        drafter = ReferenceDrafter(np.concatenate([ref.prompt, ref.tokens]), V, {"oracle": 1.0, "wrong": 0.0}[kind])
        s = tier.take_session(CTX, "f32")
        run = SpecRun(model, s, prompt, Sampler(V, GREEDY), N_NEW, drafter=drafter, n_draft=2, prefill=8,
                      snapshots=tier.snapshots)
        out = drive(model, run)
        st = run.stats
        assert out.tokens.tolist() == ref.tokens.tolist()
        assert st.verifications > 0
        if kind == "oracle":
            assert (st.accepted == st.drafted).all()
        else:
            assert st.accepted.sum() == 0
        assert s.pos == ref_session.pos
        for x, y in zip(host_states(be, s), ref_states):
            assert np.array_equal(x, y)
        for l, ps in s.ple_states.items():  # the PLE windows and counts
            assert ps.t == ref_session.ple_states[l].t
            assert np.array_equal(np.asarray(ps.window), np.asarray(ref_session.ple_states[l].window))


class _StandInGraphs(EmuRuntime):
    """The emulation with a stand-in for stream capture: a capture's launches run as they are queued
    (the emulation has no graphs) and a replay runs nothing, counted. It tests verify_step's
    bookkeeping (which run is eager, which captured, which replayed; which records it keeps), not
    what a graph computes: that is the card's (the greedy tests with graphs on)."""

    replays = 0

    def begin_capture(self):
        pass

    def end_capture(self):
        return types.SimpleNamespace(launch=None)  # (a graph: what `_replay` tells from a host cut)

    def replay(self, graph):
        self.replays += 1

    def capturable(self):
        return True

    def graph_pool(self):
        return object()

    def allocating_from(self, pool):
        return contextlib.nullcontext()


@contextlib.contextmanager
def stand_in_graphs(model, spec=2):
    """The tier (--spec `spec`) on the stand-in graphs' runtime, the verify's capture on -> (that
    runtime, the tier)."""
    from strata.engine.kernels import gpu

    rt = _StandInGraphs()
    before = gpu.use_runtime(rt)
    try:
        with device_tier(model, spec=spec) as tier:
            model.backend.verify_graphs = True
            yield rt, tier
    finally:
        gpu.use_runtime(before)


def test_verify_step_captures_each_kind_once_and_keeps_live_sessions_only(model):
    import gc

    from strata.engine.kernels import gpu
    from strata.engine.tier import device as D

    rt = _StandInGraphs()
    before = gpu.use_runtime(rt)
    try:
        with device_tier(model):
            be = model.backend
            be.verify_graphs = True
            ran = []
            s = model.new_session(CTX)
            for i in range(4):  # eager (its pool), captured (its graph then run once), then replayed twice
                be.verify_step(s, 2 * i, 2, lambda i=i: ran.append(i), ("kind a",))
            assert ran == [0, 1] and rt.replays == 3
            be.verify_step(s, 9, 3, lambda: ran.append("b"), ("kind b",))  # another kind: eagerly first
            assert ran == [0, 1, "b"]
            be.verify_graphs = False  # off: eagerly, the captured one left alone
            be.verify_step(s, 11, 2, lambda: ran.append("off"), ("kind a",))
            assert ran[-1] == "off" and rt.replays == 3
            be.verify_graphs = True
            others = [model.new_session(CTX) for _ in range(D.VERIFY_SESSIONS)]
            for o in others[:-1]:
                be.verify_step(o, 0, 2, lambda: None, ("kind a",))
            assert len({k[0] for k in be._vgraphs}) == D.VERIFY_SESSIONS  # s and the others so far
            be.verify_step(others[-1], 0, 2, lambda: None, ("kind a",))  # one too many: s's go
            assert id(s) not in {k[0] for k in be._vgraphs} and len({k[0] for k in be._vgraphs}) == D.VERIFY_SESSIONS
            # a session that is gone (not the oldest): its records go, and the oldest's stay
            gone, oldest = id(others[1]), id(others[0])
            del others[1], o
            gc.collect()
            # (a new kind of a live session: a new session might take the gone one's address)
            be.verify_step(others[-1], 1, 2, lambda: None, ("kind c",))
            held = {k[0] for k in be._vgraphs}
            assert gone not in held and oldest in held
    finally:
        gpu.use_runtime(before)


def test_a_rollbacks_copies_are_run_then_captured_then_replayed(model):
    """roll_back on the device step copies a snapshot's states through DeviceBackend.copy_arrays: the
    first rollback from a snapshot copies eagerly, the second is captured and its graph launched (the
    stand-in runs the copies as they are queued), later ones replay that one graph (stand-in graphs:
    the bookkeeping; the card's greedy tests roll back through real ones). With the capture off every
    copy is made."""
    with stand_in_graphs(model) as (rt, tier):
        be = model.backend
        s = model.new_session(CTX)
        snap = tier.snapshots[0]
        gdn = [(st, sv) for st, sv in zip(s.states, snap.states) if sv is not None]
        assert gdn, "the test model has a Gated DeltaNet layer"
        for i in range(4):
            for _, sv in gdn:
                for a in sv.values():
                    a[...] = i + 1
            s.pos = 3
            roll_back(s, snap, 2)
            copied = all(bool((st[k] == i + 1).all()) for st, sv in gdn for k in sv)
            # eager; captured (the stand-in ran its copies) and its graph launched; then replayed
            # (the stand-in's replay copies nothing)
            assert copied == (i < 2) and rt.replays == i, (i, copied, rt.replays)
        be.verify_graphs = False
        for _, sv in gdn:
            for a in sv.values():
                a[...] = 7
        s.pos = 3
        roll_back(s, snap, 2)
        assert all(bool((st[k] == 7).all()) for st, sv in gdn for k in sv) and rt.replays == 3


def _rows_log(R, snaps, T, L):
    from strata.engine.batch import Seq

    return [(l, j, Seq(R[l], j, j + 1, j, snaps[j][l] if j < len(snaps) else None)) for l in range(L) for j in range(T)]


def test_a_verifys_counts_settled_a_row_at_once_are_the_entry_by_entry_ones():
    """DeviceExperts settles a verify's rows' routing counts one add a row (`_rows_plan`, kept for a
    replayed verify's entries) and a token step's one add a session (`_routing_plan`): the same
    counts and snapshot copies as entry by entry (each row's counts, then its snapshot's copy);
    counts that are no row of an [n_layer, n_expert] array go entry by entry."""
    from strata.engine.batch import Seq, keep
    from strata.engine.tier.device import ByIdentity, DeviceExperts as D

    L, E, T, k = 4, 16, 3, 3
    rng = np.random.default_rng(1)
    ex = types.SimpleNamespace(_rows_plans=ByIdentity(16), _routing_plans=ByIdentity(16), _row_of=D._row_of)
    ex._routing_plan = lambda log: D._routing_plan(ex, log)
    R, R2 = np.zeros((L, E), np.int64), np.zeros((L, E), np.int64)
    snaps, snaps2 = [np.zeros((L, E), np.int64) for _ in range(T - 1)], [np.zeros((L, E), np.int64) for _ in range(T - 1)]
    log, log2 = _rows_log(R, snaps, T, L), _rows_log(R2, snaps2, T, L)
    for _ in range(2):  # the second time from the kept plan
        ids = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in range(L)]) for _ in range(T)]).astype(np.int32)
        plan = D._rows_plan(ex, log)
        assert plan is not None and [row for row, *_ in plan] == list(range(T))
        for row, counts, layers, saved in plan:
            counts[layers[:, None], ids[row, layers]] += 1
            if saved is not None:
                saved[layers] = counts[layers]
        for layer, row, r in log2:
            r.state[ids[row, layer]] += 1
            keep(r)
    assert len(ex._rows_plans) == 1 and np.array_equal(R, R2) and R.sum() == 2 * T * L * k
    assert all(np.array_equal(a, b) for a, b in zip(snaps, snaps2))
    alone = [(0, 0, Seq(np.zeros(E, np.int64), 0, 1, 0, None))]
    assert D._rows_plan(ex, alone) is None  # (not a row of a 2-D array)
    # the token step's: one session's layers in one add
    step_log = [(l, (R[l],), 0, 0, True) for l in range(L)]
    before = R.copy()
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(L)]).astype(np.int32)
    D._add_routing(ex, step_log, ids)
    for l in range(L):
        before[l][ids[l]] += 1
    assert np.array_equal(R, before) and len(ex._routing_plans) == 1
    twice = [(0, (R[0],), 0, 0, True), (0, (R[0],), 0, 0, True)]  # a layer twice: one add would count it once
    assert D._routing_plan(ex, twice) is None
    D._add_routing(ex, twice, ids)
    before[0][ids[0]] += 2
    assert np.array_equal(R, before)


def test_repeated_verifies_of_one_kind_are_captured_once_and_replayed(model):
    """Model.forward's verify names its kind by what its graph would hold (the row count, the head's
    rows, the snapshots, the buffers' addresses): greedy verifies of 1 + 2 rows with the tier's
    snapshots, one after another, are one kind, eager, then captured, then replayed (stand-in
    graphs: bookkeeping only, the card runs real ones)."""
    with stand_in_graphs(model) as (_, tier):
        be = model.backend
        s = model.new_session(CTX)
        model.forward(s, prompt_for(model)[:5], n_logits=0)  # (three verifies of 3 rows after it fit CTX)
        ban = np.zeros(0, np.int32)
        for toks in ([5, 9, 13], [21, 34, 55], [89, 144, 233]):
            model.forward(s, toks, n_logits=3, saved=tier.snapshots, pick=ban)
        kinds = [g for k, g in be._vgraphs.items() if k[0] == id(s)]
        assert len(kinds) == 1 and kinds[0].get("replays") == 1, [(k[1:3], g and g.get("replays")) for k, g in be._vgraphs.items()]


def test_the_device_heads_draft_steps_are_captured_once_and_replayed(model):
    """A draft step of the device's head (one pair, MTPHead._device_step) goes through verify_step on
    the head's own backend: the first of a kind eager, the second captured, the rest replayed (stand-in
    graphs: the bookkeeping; the card's greedy tests run real ones); nothing of it lands in the
    trunk's graphs, and each replay still counts the head's routing (the ids a graph writes)."""
    from strata.engine.kernels import gpu

    rt = _StandInGraphs()
    before = gpu.use_runtime(rt)
    try:
        with device_tier(model, spec=2, draft=True):
            head, trunk = model.draft_head, model.backend
            hb = head.backend
            hb.verify_graphs = True
            state = head.new_state(CTX, "f32")
            E, V = model.geometry.n_embd, model.geometry.n_vocab
            head.forward(state, np.ones((1, E), np.float32), np.array([5]), 0, logits=False)  # (a kind of its own)
            for i in range(4):  # drafts: eager, captured, replayed twice
                head.forward(state, head.y.x, np.array([7 + i]), 1 + i)
            kinds = {k[1:]: g for k, g in hb._vgraphs.items()}
            assert set(kinds) == {("mtp", False), ("mtp", True)}
            # (the capture runs its graph once, then two replays)
            assert "segments" not in kinds[("mtp", False)] and kinds[("mtp", True)]["replays"] == 2 and rt.replays == 3
            assert not trunk._vgraphs
            assert head.routing.sum() == 5 * model.geometry.n_expert_used  # (replays counted too)
            assert V == head.logits.size
    finally:
        gpu.use_runtime(before)


class _RecordingGraphs(EmuRuntime):
    """The emulation with a recording stand-in for stream capture: a capture's launches and copies
    down are recorded with the arrays they were given (not run), and a replay runs them again on
    those arrays, as a CUDA graph keeps the addresses it was captured with. Only for work queued
    through launches and copies (a numpy assignment under capture is not recorded)."""

    def __init__(self):
        super().__init__()
        self._rec = None

    def begin_capture(self):
        self._rec = []

    def end_capture(self):
        rec, self._rec = self._rec, None
        return rec

    def launch(self, mod, name, grid, block, args, smem=0):
        if self._rec is not None:
            self._rec.append(lambda: EmuRuntime.launch(self, mod, name, grid, block, args, smem))
        else:
            super().launch(mod, name, grid, block, args, smem)

    def copy_out_async(self, host, dev):
        if self._rec is not None:
            self._rec.append(lambda: self.copy_out(host, dev))
        else:
            self.copy_out(host, dev)

    def replay(self, graph):
        for op in graph:
            op()


def test_a_replayed_pick_reads_the_buffers_of_its_own_banned_ids(model):
    """A verify's or a draft's greedy picks (DeviceBackend.queue_pick_rows), captured for one list of
    banned ids, still read right after another list's picks ran between capture and replay: serve's
    requests each have their own list and take turns. (2026-12-06, an H100: the pick buffers were
    made again for each other list, so a replayed draft wrote into the freed set while the picks were
    read from one no launch had written: "logits row 0 of 1 contain NaN", and serve's worker died.)"""
    from strata.engine.kernels import gpu

    rt = _RecordingGraphs()
    before = gpu.use_runtime(rt)
    try:
        with device_tier(model, spec=2):
            be, V = model.backend, model.geometry.n_vocab
            rows = np.random.default_rng(4).standard_normal((3, V)).astype(np.float32)
            logits = rt.to_device(rows)
            top = rows.argmax(1)
            a = np.array(sorted(set(top.tolist())), np.int32)  # each row's largest banned: another pick
            b = np.zeros(0, np.int32)
            masked = rows.copy()
            masked[:, a] = -np.inf
            want_a = masked.argmax(1)
            assert not np.array_equal(want_a, top)
            be.pick_rows_ready(3, a)
            rt.begin_capture()
            be.queue_pick_rows(logits, a)
            graph = rt.end_capture()
            assert list(be.pick_rows(logits, b)) == list(top)  # another request's picks between
            for _ in range(2):
                rt.replay(graph)
                assert list(be.picked_rows(3, a)) == list(want_a)
                assert list(be.pick_rows(logits, b.copy())) == list(top)  # (equal ids, another array)
    finally:
        gpu.use_runtime(before)


def test_each_device_step_first_makes_the_tiers_stream_current(model):
    """A token step and a verify each ask the runtime for the tier's stream first (retake_stream;
    2026-12-05, an H100: the greedy tests found the legacy stream current at a run's first token, so
    nothing could be captured), and the backend counts the times it had to (`stream_retaken`)."""
    from strata.engine.kernels import gpu

    class Elsewhere(_StandInGraphs):  # another stream is current before every second call
        asked = 0

        def retake_stream(self):
            self.asked += 1
            return self.asked % 2 == 0

    rt = Elsewhere()
    before = gpu.use_runtime(rt)
    try:
        with device_tier(model, spec=2) as tier:
            be = model.backend
            s = model.new_session(CTX)
            model.forward(s, prompt_for(model)[:5], n_logits=0)
            asked = rt.asked
            model.step(s, 7)
            model.forward(s, [5, 9, 13], n_logits=3, saved=tier.snapshots, pick=np.zeros(0, np.int32))
            assert rt.asked - asked == 2  # (one each)
            assert be.stream_retaken == rt.asked // 2
    finally:
        gpu.use_runtime(before)


@pytest.mark.parametrize("case", ["all kept", "first refused", "second refused", "past the reference", "at the context's end"])
def test_the_judge_on_the_device_is_the_hosts_greedy_rule(rt, case):
    """dev_spec_judge (a verify run ahead, engine/tier/verify_ahead.py) against the rule written here:
    k is the longest prefix of drafts equal to the picks; the record is [k, P, picks]; the next verify
    starts at P + k + 1 (`last` at most), its first id the pick of row k, its drafts the reference
    drafter's by position. Then dev_spec_restore copies the snapshot after row k into the states
    where k < N, and nothing where every draft was kept."""
    from strata.engine.tier.device import KERNELS, _NAMES

    mod = rt.compile(_NAMES, KERNELS)
    N, V, P = 3, 1000, 20
    T = N + 1
    rng = np.random.default_rng(len(case))
    ref = rng.integers(0, V, 40).astype(np.int32)
    right = (rng.random(40) < 0.5).astype(np.uint8)
    L = {"past the reference": 25}.get(case, 40)
    last = {"at the context's end": P + 1}.get(case, 100)
    drafts = rng.integers(0, V, N).astype(np.int32)
    picks = np.zeros((T, 3), np.int32)
    picks[:, 0] = rng.integers(0, V, T)
    kept = {"all kept": N, "first refused": 0, "second refused": 1}.get(case, 2)
    picks[:kept, 0] = drafts[:kept]
    if kept < N:
        picks[kept, 0] = (drafts[kept] + 1) % V
    picks[:, 2] = rng.integers(0, 1 << 20, T)  # (the max's bits: carried to the record as they are)
    tok = rt.to_device(np.concatenate([[7], drafts]).astype(np.int32))
    posv = rt.to_device((P + np.arange(16)).astype(np.int32))
    rec = rt.to_device(np.full(2 + 3 * T, -9, np.int32))
    rt.launch(mod, "dev_spec_judge", 1, 32, (rt.to_device(picks), tok, np.int32(T), posv, np.int32(last),
                                             rt.to_device(ref[:L].copy()), rt.to_device(right[:L].copy()), np.int32(L),
                                             np.int32(V), rec))
    got = rt.to_host(rec)
    assert got[0] == kept and got[1] == P and np.array_equal(got[2:].reshape(T, 3), picks)
    start = min(P + kept + 1, last)
    assert np.array_equal(rt.to_host(posv)[:T], start + np.arange(T))
    want = [picks[kept, 0]] + [(ref[j] if right[j] else (ref[j] + 1) % V) if j < L else 0 for j in range(start + 1, start + T)]
    assert rt.to_host(tok).tolist() == want
    # the rollback: two states of other lengths, each snapshot's values its own
    sizes = (37, 300)
    states = [rt.to_device(np.full(n, -1.0, np.float32)) for n in sizes]
    snaps = [[rt.to_device(np.full(n, float(10 * i + j), np.float32)) for j, n in enumerate(sizes)] for i in range(N)]
    src = rt.to_device(np.array([[rt.ptr(a) for a in row] for row in snaps], np.int64).reshape(-1))
    dst = rt.to_device(np.array([rt.ptr(a) for a in states], np.int64))
    rt.launch(mod, "dev_spec_restore", 2, 128, (rec, np.int32(N), src, dst, rt.to_device(np.array(sizes, np.int64)),
                                                 np.int32(len(sizes))))
    for j, a in enumerate(states):
        assert (rt.to_host(a) == (-1.0 if kept == N else float(10 * kept + j))).all()
