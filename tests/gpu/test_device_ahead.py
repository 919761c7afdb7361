"""The device step one step ahead of the host (Model.decode_ahead, DeviceBackend.embed_picked): step
t + 1 is queued, its embedding row gathered on the device from the device's pick of token t, before
token t is read. What must hold: the row is the reference decoder's bit for bit; the tokens, the
states and the counts are the plain loop's (Model.step_pick one token at a time) and the CPU engine's
greedy tokens; a run stopped early leaves its session spent (refused), with the plain loop's counts;
strata generate's loop uses it; no allocation per token after warm-up (on a card)."""

from __future__ import annotations

import engine_fixture as F
import numpy as np
import pytest
from gpu_emu import EmuRuntime
from test_device_step import CTX, device_tier, qwen4exp, tokens  # noqa: F401 (qwen4exp: a fixture)

from strata.engine.model import Model
from strata.engine.pack_reader import Pack
from strata.engine.tier.device import EMBD_ROW_TYPES, DeviceBackend

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

# every embedding type dev_embd_row decodes, the packs' Q4_K, Q6_K, Q8_0 among them
EMBD_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
BANNED = np.array([5], np.int32)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device-ahead")
    return Model(Pack.open(F.make_pack(tmp, types={"experts": "Q8_0", "dense": "Q8_0"})))


@pytest.mark.parametrize("type_name", EMBD_TYPES)
def test_dev_embd_row_is_the_reference_decoders_row_bit_for_bit(rt, type_name):
    """The run-ahead's embedding row, gathered on the device from the token in device memory: the
    bits of Model._embd_row (reference.dequantize of the row's bytes), for random blocks of every
    field (kernel_blocks: subnormal scales too), at the first, a middle and the last row."""
    from kernel_blocks import random_weights

    from strata.engine.kernels.reference import dequantize
    from strata.index_format.ggml_types import BY_NAME

    t = BY_NAME[type_name]
    assert t.id in EMBD_ROW_TYPES
    n, rows = 512, 5  # two super-blocks a row
    raw = random_weights(t, n * rows, np.random.default_rng(t.id))
    be = DeviceBackend(rt, None)
    be.embd_table = (rt.to_device(raw), t.id, t.row_bytes(n), rows)
    for token in (0, 2, rows - 1):
        be._pick = (rt.to_device(np.array([token, 0, 0], np.int32)),)
        got = rt.to_host(be.embed_picked((1, n)))
        want = dequantize(raw[token * t.row_bytes(n) : (token + 1) * t.row_bytes(n)], t.id, n).reshape(1, n)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (type_name, token)


def cpu_greedy(model, toks, n):
    s = model.new_session(CTX)
    work = model.forward(s, toks[:-1], n_logits=0) if len(toks) > 1 else None
    out, t = [], toks[-1]
    for _ in range(n):
        work = model.step(s, t).copy()
        work[BANNED] = -np.inf
        t = int(work.argmax())
        out.append(t)
    return out


def counts(tier, s):
    return s.routing.copy(), tier.stats.hits.copy(), tier.stats.misses.copy()


def plain_loop(model, tier, toks, n):
    """toks[:-1] as a prompt, then n greedy picks one at a time (Model.step_pick) -> (the session, the
    tokens, what the picks added to the routing, hit and miss counts)."""
    s = tier.take_session(CTX, "f32")
    model.forward(s, toks[:-1], n_logits=0)
    before = counts(tier, s)
    got, t = [], toks[-1]
    for _ in range(n):
        t = model.step_pick(s, t, BANNED)
        got.append(t)
    return s, got, [a - b for a, b in zip(counts(tier, s), before)]


def test_run_ahead_gives_the_plain_loops_tokens_states_and_counts(model, rt, monkeypatch):
    toks, n = tokens(model, 6, seed=21), 6
    want = cpu_greedy(model, toks, n)
    with device_tier(model, expert_cache=model.geometry.n_layer * model.geometry.n_expert // 3) as tier:
        be = model.backend
        plain, got, plain_counts = plain_loop(model, tier, toks, n)
        ahead = tier.take_session(CTX, "f32")
        model.forward(ahead, toks[:-1], n_logits=0)
        assert model.runs_ahead(ahead)
        gathered, embed = [], be.embed_picked
        monkeypatch.setattr(be, "embed_picked", lambda shape: (gathered.append(shape), embed(shape))[1])
        before = counts(tier, ahead)
        launched, launch, staged, stage = {}, rt.launch, [], be._stage

        def counted(mod, name, *a, **k):
            launched[name] = launched.get(name, 0) + 1
            launch(mod, name, *a, **k)

        rt.launch = counted
        monkeypatch.setattr(be, "_stage", lambda dev, values: (staged.append(dev), stage(dev, values)))
        down, copy_out_async = [], rt.copy_out_async
        rt.copy_out_async = lambda h, d: (down.append(h.nbytes), copy_out_async(h, d))[1]
        try:
            got_ahead = list(model.decode_ahead(ahead, toks[-1], BANNED, n))
        finally:
            del rt.launch, rt.copy_out_async  # (the runtime's own methods again)
        ahead_counts = [a - b for a, b in zip(counts(tier, ahead), before)]
        assert got_ahead == got == want
        assert len(gathered) == n - 1  # every step after the first took its row from the device's pick
        # each step's pick, position advance and next row in one launch at its end (dev_pick_next),
        # nothing of theirs outside it; only the first step's row and position went up. (On a card
        # the launches are the eager first step's and the capture's: the replays launch nothing here.)
        emu = isinstance(rt, EmuRuntime)
        assert launched["dev_pick_next"] == (n if emu else 2) and "dev_argmax" not in launched
        assert "dev_embd_row" not in launched
        # and one copy down a step: the routing ids with the pick behind them (DeviceExperts.
        # queue_with_pick), no pick of its own (12 bytes) nor the ids alone
        g = model.geometry
        ids = 4 * g.n_layer * g.n_expert_used
        assert down.count(ids + 12) == n and 12 not in down and ids not in down, down
        assert "dev_rope" not in launched and launched["dev_rope_at"] > 0
        assert len(staged) == 2 and staged[1] is be._pos and int(rt.to_host(be._pos)[0]) == ahead.pos
        assert ahead.pos == plain.pos and not ahead.spent  # the last token never fed, as the plain loop
        for a, b in zip(ahead_counts, plain_counts):
            assert np.array_equal(a, b)
        assert plain_counts[1].sum() > 0 and plain_counts[2].sum() > 0  # hits and misses both counted
        # the states are the plain loop's: the next step of each gives the same bits
        assert np.array_equal(model.step(ahead, got[-1]).copy(), model.step(plain, got[-1]).copy())


def test_a_run_ahead_stopped_early_leaves_its_session_spent_with_the_plain_counts(model, rt):
    toks, k = tokens(model, 5, seed=22), 3
    with device_tier(model) as tier:
        plain, got, plain_counts = plain_loop(model, tier, toks, k)
        s = tier.take_session(CTX, "f32")
        model.forward(s, toks[:-1], n_logits=0)
        before = counts(tier, s)
        picked = model.decode_ahead(s, toks[-1], BANNED, 20)
        got_ahead = [next(picked) for _ in range(k)]
        picked.close()  # a stop token: the step queued for token k + 1 is past the last
        ahead_counts = [a - b for a, b in zip(counts(tier, s), before)]
        assert got_ahead == got
        assert s.spent and s.pos == plain.pos
        for a, b in zip(ahead_counts, plain_counts):
            assert np.array_equal(a, b)
        with pytest.raises(ValueError, match="cannot take more tokens: it ran one step ahead"):
            model.step(s, 0)


@pytest.mark.slow  # three emulated runs of a tier: ~1 min on the CI's 2 cores (decode_ahead's exactness: the test above)
def test_generate_runs_ahead_on_the_device_with_the_plain_tokens(model, rt, monkeypatch):
    """strata generate's loop (generate(ahead=True)): a greedy run on the device step runs ahead, and
    gives the plain loop's tokens whether it ends at its length or at a stop token."""
    from strata.engine.generate import generate
    from strata.engine.sampling import Sampler, SamplerParams

    toks, n = tokens(model, 4, seed=11), 8
    V = model.geometry.n_vocab
    with device_tier(model) as tier:
        be = model.backend
        gathered, embed = [], be.embed_picked
        monkeypatch.setattr(be, "embed_picked", lambda shape: (gathered.append(shape), embed(shape))[1])

        def run(ahead, **kw):
            sampler = Sampler(V, SamplerParams(temperature=0), banned=[5])
            return generate(model, tier.take_session(CTX, "f32"), toks, sampler, n, prefill=4, ahead=ahead, **kw)

        plain, got = run(False), run(True)
        # n tokens: the first from the prompt's chunk, n - 1 from the run ahead, whose first step's row
        # is the host's (the token it feeds is the one the chunk's logits gave), the other n - 2 gathered
        assert len(gathered) == n - 2 and got.tokens.tolist() == plain.tokens.tolist()
        assert got.stop == plain.stop == "length" and got.positions == plain.positions
        stop = int(plain.tokens[3])  # a stop token in the middle: the run ends there, one step queued past it
        streamed = []
        got = run(True, stop_ids=[stop], on_token=streamed.append)
        want = plain.tokens[: plain.tokens.tolist().index(stop) + 1].tolist()
        assert got.stop == "eos" and got.tokens.tolist() == streamed == want  # streamed token by token


def test_what_cannot_run_ahead_is_refused(rt):
    """PLE hashes the step's input token on the host where its table is not on the device (a PLE
    state made then sets needs_token), an embedding type dev_embd_row does not decode, no table on
    the device: no run-ahead. A PLE state made with the table on the device (DeviceBackend.ple)
    leaves it free to."""
    from types import SimpleNamespace

    class Static:
        static = staticmethod(lambda: True)

    be = DeviceBackend(rt, None)
    be.experts = Static()
    assert not be.can_run_ahead(None)  # no table placed
    be.embd_table = (None, 12, 144, 1)
    assert be.can_run_ahead(None)
    be.needs_token = True
    assert not be.can_run_ahead(None)
    be.needs_token, be.embd_table = False, (None, 16, 66, 1)  # IQ2_XXS
    assert not be.can_run_ahead(None)
    be.embd_table = (None, 12, 144, 1)
    g = SimpleNamespace(ple_ngram_size=3, ple_eos_token_id=7, ple_conv_kernel=4, hc=2, n_embd=32)
    be.ple_state(g)  # (qwen4exp's session: its PLE table on the host)
    assert be.needs_token and not be.can_run_ahead(None)
    be.ple = "the table on the device"
    be.ple_state(g)
    assert not be.needs_token and be.can_run_ahead(None)


@pytest.mark.parametrize("arch", ["qwen35moe", pytest.param("qwen4exp", marks=pytest.mark.slow)])
def test_run_ahead_allocates_nothing_per_token_after_warm_up(request, rt, arch):
    """After a first run ahead (its pinned picks, events and second routing copy made once), a run
    ahead replays the graph with no device or pinned allocation per token (the row is gathered into
    the fixed row buffer, the picks land in the two fixed pinned buffers; qwen4exp's PLE rows are
    gathered into their fixed buffers, its first step's staged there)."""
    if isinstance(rt, EmuRuntime):
        pytest.skip("the emulation has no CUDA graphs: its steps are eager, whose temporaries the pool serves")
    from test_gpu_tier import counting

    model = request.getfixturevalue("model" if arch == "qwen35moe" else "qwen4exp")
    toks = tokens(model, 4, seed=12)
    with device_tier(model) as tier:
        s = tier.take_session(CTX, "f32")
        model.forward(s, toks, n_logits=0)
        got = list(model.decode_ahead(s, toks[-1], BANNED, 4))
        with counting(rt) as n:
            got = list(model.decode_ahead(s, got[-1], BANNED, CTX - s.pos))
        assert model.backend._graph is not None and len(got) > 20
    assert n == [0, 0], f"{len(got)} token steps ahead allocated {n[0]} device and {n[1]} pinned buffers"


# --- qwen4exp: PLE's n-gram rows hashed and gathered on the device (dev_ple_rows)

# the PLE table's types dev_ple_rows decodes: TableRows' F32, F16 and BF16, the released table's
# IQ4_NL (its short rows' fallback), and block types of the reference decoder
PLE_TYPES = ["F32", "F16", "BF16", "IQ4_NL", "Q8_0", "Q5_0", "Q4_K"]


def ple_hashes(N: int, hpn: int, nl: int, eos: int, rng):
    """nl NGramHash of full-range uint64 multipliers (products wrap mod 2^64, h is negative about half
    the time: the production multipliers are below 2^63 / vocab, where neither happens) -> (hashes,
    table rows)."""
    from strata.engine.ple import NGramHash

    Pn = (N - 1) * hpn
    sizes = [1009, 1013, 1019, 1021, 1031, 1033][:Pn]
    offsets = np.cumsum([0] + sizes[:-1]).tolist()
    rows = sum(sizes) + 5
    hashes = [NGramHash([int(m) | 1 for m in rng.integers(0, 2**64, N, dtype=np.uint64)], offsets, sizes, ngram_size=N,
                        heads_per_ngram=hpn, eos_token_id=eos, n_rows=rows) for _ in range(nl)]
    return hashes, rows


def ple_tokens(eos: int, n: int, rng) -> list[int]:
    """EOS at the start, in the middle, twice in a row and at the end; small ids and ids near 2^31
    (int32, as a pick is) whose products with the multipliers wrap."""
    big = rng.integers(2**30, 2**31 - 1, n).tolist()
    small = rng.integers(0, 600, n).tolist()
    toks = [eos, small[0], big[0], eos, big[1], small[1], small[2], eos, eos, big[2], small[3], 0, 2**31 - 1]
    toks += [big[i] if i % 3 else small[i] for i in range(3, n)]
    return toks + [eos]


@pytest.mark.parametrize("type_name", PLE_TYPES)
def test_dev_ple_rows_are_the_hosts_hash_and_table_rows(rt, type_name):
    """dev_ple_rows, token after token from a pick in device memory: each PLE layer's row ids are
    NGramHash's (contexts with the EOS rule over PLEState.window, wrapping int64 products, the
    remainder with the divisor's sign) and its rows the host table's (TableRows; a block type's,
    the reference decoder's) bit for bit, and the device window is PLEState.window after each
    token. Tokens with EOS at the start, inside and twice in a row, and ids near 2^31."""
    from kernel_blocks import random_weights

    from strata.engine.kernels.reference import dequantize
    from strata.engine.ple import PLEState, TableRows
    from strata.engine.tier.device import PLE_ROW_TYPES, DevicePLE
    from strata.index_format.ggml_types import BY_NAME

    t = BY_NAME[type_name]
    assert t.id in PLE_ROW_TYPES
    rng = np.random.default_rng(t.id)
    N, hpn, nl, eos, Pd = 4, 2, 2, 511, 256 if type_name == "Q4_K" else 64
    hashes, n_rows = ple_hashes(N, hpn, nl, eos, rng)
    raw = random_weights(t, Pd * n_rows, rng)
    host_rows = TableRows(raw, t.id, Pd, n_rows) if not t.quantized else \
        (lambda ids: dequantize(raw.reshape(n_rows, -1)[ids].reshape(-1), t.id, ids.size * Pd).reshape(ids.size, Pd))
    be = DeviceBackend(rt, None)
    dev = DevicePLE(hashes, [3, 7], rt.to_device(raw), t.id, Pd, n_rows, rt.empty, rt.copy_in)
    state = PLEState(ngram_size=N, eos_token_id=eos, conv_kernel=2, channels=1)
    rt.copy_in(dev.window, state.window)
    tok = rt.to_device(np.zeros(3, np.int32))
    wrapped = negative = 0
    for token in ple_tokens(eos, 40, rng):
        rt.copy_in(tok, np.array([token, 0, 0], np.int32))
        dev.launch(be, tok)
        ctx = hashes[0].contexts(state.window, np.array([token], np.int64))
        state.window[:] = np.concatenate([state.window, [token]])[1:]
        for k, h in enumerate(hashes):
            ids = h.rows(ctx)[0]
            assert np.array_equal(rt.to_host(dev.ids)[k], ids), (token, k)
            want = host_rows(ids).reshape(1, -1)
            assert np.array_equal(rt.to_host(dev.rows)[k].view(np.uint32), want.view(np.uint32)), (token, k)
            prods = [int(c) * (int(m) % 2**64) for c, m in zip(ctx[0], h.mult)]
            wrapped += any(p >= 2**63 for p in prods)
            x = 0
            for p in prods[:2]:
                x ^= p % 2**64
            negative += x >= 2**63
        assert np.array_equal(rt.to_host(dev.window), state.window), token
    assert wrapped and negative  # the int64 rules were exercised, not only the small-number path


def test_a_plain_steps_ple_rows_go_up_into_the_device_tables_buffers_with_one_pinned_mirror(rt):
    """With the table on the device, stage_ple (a plain step's host rows) writes the buffers dev_ple_rows
    writes for the run-ahead (one capture reads both), and restaging them token after token makes no
    pinned buffer after the first (a new view per token had made a pinned mirror per token)."""
    from strata.engine.tier.device import DevicePLE

    rng = np.random.default_rng(5)
    hashes, n_rows = ple_hashes(3, 2, 2, 9, rng)
    be = DeviceBackend(rt, None)
    be.ple = DevicePLE(hashes, [1, 4], rt.to_device(np.zeros(n_rows * 64 * 4, np.uint8)), 0, 64, n_rows, rt.empty,
                       rt.copy_in)
    before = rt.pinned_allocations if isinstance(rt, EmuRuntime) else None
    for i in range(4):
        e = rng.standard_normal((1, 4 * 64)).astype(np.float32)
        dev = be.stage_ple(4, e)
        rt.synchronize()
        assert be.ple_picked()[4] is dev
        assert np.array_equal(rt.to_host(be.ple.rows)[1], e), i
    if before is not None:
        assert rt.pinned_allocations - before == 1


def with_eos(model, monkeypatch, eos: int) -> None:
    """`model`'s PLE end-of-document id made `eos` (its hashes, the geometry its states are made from)."""
    import dataclasses

    for ple in model.ple.values():
        monkeypatch.setattr(ple.hash, "eos", eos)
    monkeypatch.setattr(model, "geometry", dataclasses.replace(model.geometry, ple_eos_token_id=eos))


def eos_inside(model, monkeypatch, prompt: list[int], n: int) -> tuple[int, list[int]]:
    """A PLE end-of-document id that the CPU engine's greedy run from `prompt` picks in the middle of
    its n tokens with that id as the EOS (the id changes the hashes from the first position: it is
    the history before it), so the device's hash meets an EOS pick and EOS-reset windows after it
    -> (eos, the CPU's tokens)."""
    tried = set()
    for _ in range(24):
        got = cpu_greedy(model, prompt, n)
        for e in got[1 : n - 2]:
            if e in tried:
                continue
            tried.add(e)
            with_eos(model, monkeypatch, e)
            picks = cpu_greedy(model, prompt, n)
            if e in picks[1 : n - 2] and e not in prompt:
                return e, picks
    raise AssertionError(f"no token of the CPU's greedy runs is picked again in the middle with it as the EOS ({tried})")


@pytest.mark.slow  # the emulated qwen4exp token step: ~7 s at --expert-cache 0 on 2 shared cores (~3 min in all)
def test_qwen4exp_runs_ahead_with_the_plain_loops_tokens_and_states(qwen4exp, rt, monkeypatch):
    """qwen4exp with its PLE table on the device (the plan placed it: room beside the slots) runs a
    step ahead: each step's PLE rows after the first hashed and gathered on the device from the pick
    (dev_ple_rows, right after dev_pick_next), none by the host. The tokens are the plain loop's
    (step_pick), with an EOS picked in the middle; afterwards the sessions are the same: a plain step
    gives the same logits bit for bit, so does a prompt chunk appended after it, and a second run
    ahead (its window staged again from the host's) gives the plain loop's tokens again; the host's
    PLE windows and counts are the plain loop's throughout."""
    from strata.engine.ple import PLELayer

    model, n = qwen4exp, 6
    prompt = tokens(model, 3, seed=31)
    eos, want = eos_inside(model, monkeypatch, prompt, n)
    with device_tier(model, expert_cache=0) as tier:
        be = model.backend
        assert be.ple is not None and any(line.startswith("PLE table on the device") for line in tier.lines), tier.lines
        plain = tier.take_session(CTX, "f32")
        model.forward(plain, prompt[:-1], n_logits=0)
        got = []
        for _ in range(n):
            got.append(model.step_pick(plain, got[-1] if got else prompt[-1], BANNED))
        assert eos in got[1:-2], (eos, got, want)  # (the device picks the CPU's tokens: an EOS in the middle)
        ahead = tier.take_session(CTX, "f32")
        model.forward(ahead, prompt[:-1], n_logits=0)
        assert model.runs_ahead(ahead)
        hashed, step_rows = [], PLELayer.step_rows
        monkeypatch.setattr(PLELayer, "step_rows", lambda self, *a: (hashed.append(a[0]), step_rows(self, *a))[1])
        launched, launch = {}, rt.launch

        def counted(mod, name, *a, **k):
            launched[name] = launched.get(name, 0) + 1
            launch(mod, name, *a, **k)

        rt.launch = counted
        try:
            got_ahead = list(model.decode_ahead(ahead, prompt[-1], BANNED, n))
        finally:
            del rt.launch  # (the runtime's own method again)
        assert got_ahead == got
        # the host hashed the first step's token alone; every step after it took the device's rows
        assert hashed == [prompt[-1]] * len(model.ple)
        emu = isinstance(rt, EmuRuntime)
        assert launched["dev_ple_rows"] == launched["dev_pick_next"] == (n if emu else 2)

        def same_ple(a, b):
            for l in model.ple:
                assert np.array_equal(a.ple_states[l].window, b.ple_states[l].window), l
                assert a.ple_states[l].t == b.ple_states[l].t == a.pos == b.pos, l

        same_ple(ahead, plain)
        # a plain step after the run ahead, then a prompt chunk appended (serve, chat): the same bits
        assert np.array_equal(model.step(ahead, got[-1]).copy(), model.step(plain, got[-1]).copy())
        chunk = [eos, prompt[0]]
        assert np.array_equal(model.forward(ahead, chunk, n_logits=2), model.forward(plain, chunk, n_logits=2))
        same_ple(ahead, plain)
        # and a second run ahead after them: the device's window is the host's again
        more = list(model.decode_ahead(ahead, eos, BANNED, 3))
        t = eos
        for want_t in more:
            t = model.step_pick(plain, t, BANNED)
            assert t == want_t
        same_ple(ahead, plain)
        assert np.array_equal(model.step(ahead, t).copy(), model.step(plain, t).copy())


@pytest.mark.parametrize("where", ["no room", "no table type"])
def test_qwen4exp_without_its_table_on_the_device_keeps_the_host_hash(qwen4exp, rt, monkeypatch, where):
    """Where the plan does not place the PLE table (it would cost expert slots, or no device decoder
    takes its type), the startup says so, the host hashes every step's rows and no session runs ahead."""
    from strata.engine import budget as B

    if where == "no room":
        monkeypatch.setattr(B, "ple_on_device", lambda *a: "it would cost expert slots")
    else:
        monkeypatch.setattr(B, "PLE_TABLE_DEVICE_TYPES", frozenset())
    with device_tier(qwen4exp) as tier:
        be = qwen4exp.backend
        assert be.ple is None and be.embd_table is None
        assert any(line.startswith("PLE table on the host (") for line in tier.lines), tier.lines
        assert not tier.plan.places("weights.ple_table") and not tier.plan.places("weights.embedding")
        s = tier.take_session(CTX, "f32")
        assert be.needs_token and not qwen4exp.runs_ahead(s)
        with pytest.raises(ValueError, match="cannot run ahead"):
            next(qwen4exp.decode_ahead(s, 3, BANNED, 2))
