"""Speculative decoding (engine/speculative.py, `strata generate --spec N`): draft, verify in one
forward, keep the agreeing prefix, roll the states back.

- The trunk's forward gives its head input (the final post-norm hidden state) per position when
  asked, and the logits do not move when it is asked.
- Greedy output with --spec 1, 2, 3 is --spec 0's token for token on both architectures' tiny
  models, with a drafter that is always right, one always wrong, one right half the time (every
  rollback length runs) and, on qwen35moe, the pack's MTP block; after the run every state of the
  session (Gated DeltaNet conv and S, QSA's count, keys and pooled blocks, the KV cache, PLE's
  window and ring, the routing counts) holds the bits of the --spec 0 session's.
- Speculative sampling keeps the target distribution: Sampler.judge's tokens against p by a
  chi-square test on a 6-token vocabulary (fixed seeds), for a drafter that names its token and one
  that draws it from its own distribution q.
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import engine_fixture as F
from strata.engine.generate import drive, generate
from strata.engine.model import Model
from strata.engine.mtp import MTPHead
from strata.engine.pack_reader import Pack
from strata.engine.qsa import QSACache
from strata.engine.sampling import Sampler, SamplerParams
from strata.engine.speculative import MTPDrafter, ReferenceDrafter, SpecRun
from strata.tools import pack as tools_pack

GREEDY = SamplerParams(temperature=0)
N_PROMPT, N_NEW = 40, 30

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from strata.tools.synth import PRESETS, synth

    tmp = tmp_path_factory.mktemp("spec")
    src = synth("qwen4exp", "tiny", tmp / "tiny.gguf")  # QSA, PLE, hyper-connections; its own quantized types
    tools_pack.convert(src[:1], tmp / "q4-pack", compress_ratio=PRESETS["tiny"].compress_ratio)
    return {"qwen35moe": Model(Pack.open(F.make_pack(tmp, n_mtp_layer=1, mtp_shared_head_norm=1))),
            "qwen4exp": Model(Pack.open(tmp / "q4-pack"))}


def prompt_for(model, n=N_PROMPT, seed=3):
    return np.random.default_rng(seed).integers(3, model.geometry.n_vocab, n).tolist()


def plain(model, prompt, n=N_NEW, prefill=7, params=GREEDY):
    s = model.new_session(len(prompt) + n, "f32")
    return generate(model, s, prompt, Sampler(model.geometry.n_vocab, params), n, prefill=prefill), s


def drafter_for(model, kind, reference, n_ctx):
    V = model.geometry.n_vocab
    if kind == "mtp":
        return MTPDrafter(MTPHead(model.pack, model.backend), n_ctx, "f32", Sampler(V, GREEDY), min_p=0.0)
    return ReferenceDrafter(reference, V, {"oracle": 1.0, "wrong": 0.0, "half": 0.5}[kind], seed=1)


def spec(model, prompt, drafter, n_draft, n=N_NEW, prefill=7, params=GREEDY):
    s = model.new_session(len(prompt) + n, "f32")
    run = SpecRun(model, s, prompt, Sampler(model.geometry.n_vocab, params), n, drafter=drafter, n_draft=n_draft,
                  prefill=prefill)
    return drive(model, run), s, run.stats


# --- the trunk's head input ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_forward_gives_the_head_input_per_position_and_the_same_logits(models, arch):
    m = models[arch]
    prompt = prompt_for(m, 12)
    a, b = m.new_session(13), m.new_session(13)
    plain_rows = m.forward(a, prompt, n_logits=3)
    hidden = np.full((5, m.geometry.n_embd), np.nan, np.float32)
    rows = m.forward(b, prompt, n_logits=3, hidden=hidden)
    assert np.array_equal(rows, plain_rows)  # asking for it moves nothing
    # it is what the LM head multiplies: hidden W^T gives the logits, up to float rounding with an F32
    # head (qwen35moe's), up to the activations' int8 quantization (1/127 of a block's largest
    # value, ~1% of the logits) with the tiny qwen4exp's block-quantized head
    head = m.pack.weight("output.weight")
    W = head.f32().reshape(m.geometry.n_vocab, m.geometry.n_embd).astype(np.float64)
    tol = 2e-2 if head.type.quantized else 1e-5
    ref = hidden[-3:].astype(np.float64) @ W.T
    assert np.abs(ref - rows).max() < tol * np.abs(ref).max()
    shifted = hidden[-4:-1].astype(np.float64) @ W.T  # not vacuous: the rows one position early are far
    assert np.abs(shifted - rows).max() > 10 * tol * np.abs(ref).max()
    # and the token step gives the same row
    h1 = np.empty((1, m.geometry.n_embd), np.float32)
    step_logits = m.step(b, 7, h1).copy()
    m.step(a, 7)
    assert np.array_equal(step_logits, a.logits) and np.isfinite(h1).all()


def test_the_mtp_head_takes_several_pairs_at_once(models):
    """The MTP drafter catches the head up on the verified positions in one pass: T pairs at once
    give the draft logits and y of T pairs one at a time (F32 weights: up to float rounding, the
    attention's tiles against one query)."""
    m = models["qwen35moe"]
    head = MTPHead(m.pack, m.backend)
    rng = np.random.default_rng(4)
    h = rng.standard_normal((6, m.geometry.n_embd)).astype(np.float32) * 3
    tokens = rng.integers(0, m.geometry.n_vocab, 6)
    one = head.new_state(8)
    for p in range(6):
        logits = head.step(one, h[p], int(tokens[p]), p).copy()
    y = head.hidden.copy()
    many = head.new_state(8)
    assert head.forward(many, h[:4], tokens[:4], 0, logits=False) is None
    batched = head.forward(many, h[4:], tokens[4:], 4)
    assert np.abs(batched - logits).max() < 1e-5 * np.abs(logits).max()
    assert np.abs(head.hidden - y).max() < 1e-5 * np.abs(y).max()
    wrong = head.forward(head.new_state(8), h[4:], tokens[4:], 0)  # not vacuous: without the first four
    assert np.abs(wrong - logits).max() > 1e-3 * np.abs(logits).max()


def test_the_head_drafts_several_chains_in_one_forward_with_each_ones_bits(models):
    """strata serve's requests drafting together: one pair each of three chains (each head KV cache
    caught up on its own rows, at its own position) in one forward give each chain the draft logits,
    the y and the KV entries it gets alone, bit for bit."""
    m = models["qwen35moe"]
    head, E, V = MTPHead(m.pack), m.geometry.n_embd, m.geometry.n_vocab
    rng = np.random.default_rng(6)
    lengths = [5, 2, 9]
    hs = [rng.standard_normal((n + 1, E)).astype(np.float32) * 3 for n in lengths]
    toks = [rng.integers(0, V, n + 1) for n in lengths]

    def caught_up():
        states = []
        for n, h, t in zip(lengths, hs, toks):
            st = head.new_state(16)
            head.forward(st, h[:n], t[:n], 0, logits=False)
            states.append(st)
        return states

    alone, together = caught_up(), caught_up()
    want = [(head.forward(st, h[n:], t[n:], n).copy(), head.hidden.copy()) for st, n, h, t in zip(alone, lengths, hs, toks)]
    logits, y = head.forward_rows(together, np.stack([h[n] for n, h in zip(lengths, hs)]),
                                  [int(t[n]) for n, t in zip(lengths, toks)], lengths)
    assert logits.shape == (3, V) and y.shape == (3, E)
    for i, (wl, wy) in enumerate(want):
        assert np.array_equal(logits[i], wl) and np.array_equal(y[i], wy), f"chain {i}"
        n = lengths[i] + 1
        assert all(np.array_equal(a, b) for a, b in zip(alone[i].read(slice(0, n)), together[i].read(slice(0, n))))


def three_requests(model, tok, plan, drafter, **spec):
    """The (prompt, tokens) of `plan` as greedy requests through a --batch 3 scheduler at once, its
    drafters made by `drafter(job, sampler)` -> (the jobs, none failed; the scheduler, closed)."""
    from strata.engine.scheduler import ConversationCache, Job, Scheduler, run_and_wait

    sch = Scheduler(model, tok, max_context=96, kv="f32", chunk=8, max_queue=8, cache=ConversationCache(0, 0),
                    batch=3, drafter=drafter, **spec)
    try:
        jobs = [Job(p, k, GREEDY, ignore_eos=True) for p, k in plan]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda j: run_and_wait(sch, j, 60), jobs))
    finally:
        sch.close()
    assert all(j.error is None for j in jobs)
    return jobs, sch


def test_a_drafter_that_fails_fails_its_request_not_the_server(models):
    """A drafter raising in the worker thread (where a request's feed drafts) fails that request with
    its error; the request beside it gets its tokens and the server takes the next one. (Before, the
    error killed the worker and every request waited for ever.)"""
    from strata.engine.scheduler import ConversationCache, Job, Scheduler, run_and_wait
    from strata.engine.tokenizer import Tokenizer

    m = models["qwen35moe"]
    tok = Tokenizer.load(m.pack.dir / "tokenizer.txt")
    good, bad = [5, 9, 33, 70], [100, 7, 8]

    class Failing(ReferenceDrafter):
        def draft(self, history, n_known, n):
            raise RuntimeError("the drafter broke")

    def drafter(job, sampler):
        reference = list(job.prompt) + [3] * 20
        return (Failing if job.prompt == bad else ReferenceDrafter)(reference, m.geometry.n_vocab, 0.5, seed=1)

    sch = Scheduler(m, tok, max_context=64, kv="f32", chunk=8, max_queue=8, cache=ConversationCache(0, 0), batch=2,
                    spec=2, batch_mtp=True, drafter=drafter)
    try:
        jobs = [Job(p, 6, GREEDY, ignore_eos=True) for p in (good, bad)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda j: run_and_wait(sch, j, 60), jobs))
        after = run_and_wait(sch, Job(good, 6, GREEDY, ignore_eos=True), 60)
    finally:
        sch.close()
    assert isinstance(jobs[1].error, RuntimeError) and "the drafter broke" in str(jobs[1].error)
    want = plain(m, good, n=6)[0].tokens.tolist()
    assert jobs[0].error is None and jobs[0].result.tokens.tolist() == want
    assert after.error is None and after.result.tokens.tolist() == want


def test_requests_drafting_together_draft_what_they_draft_alone(models):
    """strata serve --spec 2 --batch 3 with the MTP drafter on the host: the requests' chains go
    through the head together (one forward a chain position for every request still drafting), and
    each request's drafts are the ones it drafts alone, its tokens --spec 0's."""
    from strata.engine.tokenizer import Tokenizer

    m = models["qwen35moe"]
    tok = Tokenizer.load(m.pack.dir / "tokenizer.txt")
    rng = np.random.default_rng(8)
    plan = [(rng.integers(3, 256, n).tolist(), k) for n, k in ((9, 12), (30, 10), (4, 14))]

    def serve(spec, together):
        head, logs, rows = MTPHead(m.pack), {}, []
        forward_rows = head.forward_rows
        head.forward_rows = lambda states, *a: (rows.append(len(states)), forward_rows(states, *a))[1]

        class Logged(MTPDrafter):
            def _pick(self, logits, hist, n_known, i):
                got = super()._pick(logits, hist, n_known, i)
                self.log.append((n_known, i, None if got is None else got[0]))
                return got

        Logged.together = together

        def drafter(job, sampler):
            d = Logged(head, 96, "f32", sampler.fork(sampler.seed + 1), 0.0)
            d.log = logs.setdefault(tuple(job.prompt), [])
            return d

        jobs, _ = three_requests(m, tok, plan, drafter, spec=spec, spec_min_p=0.0, batch_mtp=spec > 0)
        return [j.result.tokens.tolist() for j in jobs], logs, rows

    plain_tokens, _, _ = serve(0, True)
    alone_tokens, alone, alone_rows = serve(2, False)
    tokens, together, rows = serve(2, True)
    assert tokens == alone_tokens == plain_tokens
    assert len(together) == 3 and all(len(v) > 6 for v in together.values()) and together == alone
    assert max(rows) >= 2 and alone_rows == []  # (alone: each chain through MTPHead.forward, a pair a call)
    assert len(rows) < sum(len(v) for v in together.values())  # fewer forwards than drafts


# --- greedy: --spec N is --spec 0 ---------------------------------------------------------------------


def assert_same_states(a, b):
    """Every state of sessions a and b at their common position, bit for bit."""
    assert a.pos == b.pos
    n = a.pos
    for l, (x, y) in enumerate(zip(a.states, b.states)):
        if isinstance(x, dict):
            for k in x:
                assert np.array_equal(x[k], y[k]), f"layer {l}: Gated DeltaNet {k} differs"
        elif isinstance(x, QSACache):
            assert x.n == y.n == n
            r = x.ratio
            assert np.array_equal(x.idx_keys[:n], y.idx_keys[:n]), f"layer {l}: QSA indexer keys differ"
            assert np.array_equal(x.idx_blocks[: n // r], y.idx_blocks[: n // r]), f"layer {l}: pooled keys differ"
            assert all(np.array_equal(p, q) for p, q in zip(x.kv.read(slice(0, n)), y.kv.read(slice(0, n))))
        else:
            assert all(np.array_equal(p, q) for p, q in zip(x.read(slice(0, n)), y.read(slice(0, n)))), f"layer {l}: KV"
    for l in a.ple_states:
        p, q = a.ple_states[l], b.ple_states[l]
        assert p.t == q.t and np.array_equal(p.window, q.window) and np.array_equal(p.ring, q.ring), f"PLE {l}"
    assert np.array_equal(a.routing, b.routing), "routing counts differ"


CASES = [(arch, kind) for arch in ("qwen35moe", "qwen4exp") for kind in ("oracle", "wrong", "half")] + \
    [("qwen35moe", "mtp")]  # qwen4exp has no MTP layout in llama.cpp's converter (strata-pack refuses one)


@pytest.mark.parametrize("n_draft", [1, 2, 3])
@pytest.mark.parametrize("arch,kind", CASES)
def test_greedy_output_and_states_are_those_of_plain_decoding(models, arch, kind, n_draft):
    m = models[arch]
    prompt = prompt_for(m)
    ref, ref_session = plain(m, prompt)
    drafter = drafter_for(m, kind, np.concatenate([ref.prompt, ref.tokens]), N_PROMPT + N_NEW)
    out, session, st = spec(m, prompt, drafter, n_draft)
    assert out.tokens.tolist() == ref.tokens.tolist()
    assert out.positions == ref.positions and out.stop == ref.stop
    assert_same_states(session, ref_session)
    assert st.verifications > 0 and st.drafted[0] > 0  # drafts were made and judged
    if kind == "oracle":
        assert (st.accepted == st.drafted).all()
    elif kind in ("wrong", "mtp"):  # mtp: the random head's drafts (its acceptance is whatever it is)
        assert kind == "mtp" or st.accepted.sum() == 0
    else:
        assert 0 < st.accepted.sum() < st.drafted.sum()  # both ends of the rollback


def test_the_token_path_prompt_and_a_stop_inside_the_drafts(models):
    """--prefill off; and a stop token among kept drafts ends the run there, fed positions included."""
    m = models["qwen35moe"]
    prompt = prompt_for(m, seed=5)
    ref, _ = plain(m, prompt, prefill=1)
    full = np.concatenate([ref.prompt, ref.tokens])
    out, _, _ = spec(m, prompt, drafter_for(m, "oracle", full, N_PROMPT + N_NEW), 3, prefill=1)
    assert out.tokens.tolist() == ref.tokens.tolist()
    stop = int(ref.tokens[10])
    first = ref.tokens.tolist().index(stop)
    s = m.new_session(N_PROMPT + N_NEW, "f32")
    run = SpecRun(m, s, prompt, Sampler(m.geometry.n_vocab, GREEDY), N_NEW, stop_ids={stop},
                  drafter=drafter_for(m, "oracle", full, N_PROMPT + N_NEW), n_draft=3, prefill=7)
    out = drive(m, run)
    assert out.stop == "eos" and out.tokens.tolist() == ref.tokens[: first + 1].tolist()
    assert s.pos == out.positions == N_PROMPT + first  # the stop token is not fed


@pytest.mark.parametrize("arch,kind", [("qwen35moe", "mtp"), ("qwen35moe", "half"), ("qwen4exp", "half")])
def test_a_sampled_run_leaves_the_session_of_its_tokens(models, arch, kind):
    """Sampling (temperature 0.9, the MTP drafter drawing its drafts from q): whatever was kept, the
    session afterwards holds the bits of a --spec 0 session teacher-forced through the same tokens."""
    m = models[arch]
    prompt = prompt_for(m, seed=8)
    params = SamplerParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    ref, _ = plain(m, prompt, params=params)
    V = m.geometry.n_vocab
    if kind == "mtp":
        drafter = MTPDrafter(MTPHead(m.pack, m.backend), N_PROMPT + N_NEW, "f32", Sampler(V, params).fork(4), 0.0)
    else:
        drafter = drafter_for(m, kind, np.concatenate([ref.prompt, ref.tokens]), N_PROMPT + N_NEW)
    out, session, st = spec(m, prompt, drafter, 2, params=params)
    assert len(out.tokens) == N_NEW and st.verifications > 0
    # the same tokens as --spec 0 feeds them: the prompt in chunks of 7, then token steps
    forced = m.new_session(N_PROMPT + N_NEW, "f32")
    generate(m, forced, prompt, Sampler(V, GREEDY), 0, prefill=7)
    for t in out.fed[N_PROMPT:]:
        m.step(forced, int(t))
    assert_same_states(session, forced)


def test_a_spec_run_needs_a_draft_count(models):
    m = models["qwen35moe"]
    with pytest.raises(ValueError, match="--spec 0"):
        SpecRun(m, m.new_session(50), [1, 2], Sampler(m.geometry.n_vocab, GREEDY), 5,
                drafter=ReferenceDrafter([1, 2, 3], m.geometry.n_vocab, 1.0), n_draft=0)


# --- sampling: the target distribution is kept ------------------------------------------------------


CHI2_999_DF5 = 20.515  # the chi-square distribution's 0.999 quantile, 5 degrees of freedom (6 tokens)
TRIALS = 20000


def chi2(counts: np.ndarray, p: np.ndarray) -> float:
    e = p * counts.sum()
    live = e > 0
    assert counts[~live].sum() == 0, "a token of probability 0 came out"
    return float(((counts[live] - e[live]) ** 2 / e[live]).sum())


@pytest.mark.parametrize("draw_from_q", [False, True], ids=["named-draft", "drawn-from-q"])
def test_speculative_sampling_keeps_the_target_distribution(draw_from_q):
    V = 6
    params = SamplerParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    target = np.array([2.0, 1.2, 0.3, -0.5, 1.9, -3.0], np.float32)
    s = Sampler(V, params)
    p = s.distribution(target).copy()
    rng = np.random.default_rng(5)
    q = np.array([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])  # far from p: most drafts are rejected and resampled
    counts, kept, naive = np.zeros(V, np.int64), 0, np.zeros(V, np.int64)
    for _ in range(TRIALS):
        d = int(rng.choice(V, p=q))
        token, k = s.judge(target, [], d, q if draw_from_q else None)
        counts[token] += 1
        kept += k
        naive[d] += 1
    assert chi2(counts, p) < CHI2_999_DF5, (counts, p)
    assert 0.1 * TRIALS < kept < 0.9 * TRIALS  # both branches ran
    assert chi2(naive, p) > 100 * CHI2_999_DF5  # not vacuous: taking every draft is far from p


def test_speculative_sampling_with_the_filters_never_leaves_their_support():
    """top-k 3: p is 0 outside three tokens; drafts outside them are always rejected, and the
    resampled tokens follow p."""
    V = 6
    s = Sampler(V, SamplerParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=2))
    target = np.array([2.0, 1.2, 0.3, -0.5, 1.9, -3.0], np.float32)
    p = s.distribution(target).copy()
    assert (p > 0).sum() == 3
    rng = np.random.default_rng(9)
    counts = np.zeros(V, np.int64)
    for _ in range(TRIALS):
        token, kept = s.judge(target, [], int(rng.integers(V)), None)
        counts[token] += 1
    assert chi2(counts, p) < 13.816  # 0.999 quantile, 2 degrees of freedom (3 live tokens)


def test_greedy_judging_keeps_the_argmax_only():
    s = Sampler(4, GREEDY)
    logits = np.array([0.0, 3.0, 1.0, 2.9], np.float32)
    assert s.judge(logits, [], 1) == (1, True)
    assert s.judge(logits, [], 3) == (1, False)


# --- strata generate --spec ------------------------------------------------------------------------


def generate_cli(pack_dir, *args):
    from strata.engine.cli import main

    return main(["generate", "--pack", str(pack_dir), "--pool-workers", "1", "--prompt-ids", "5 77 140 3 200 41 9",
                 "-n", "20", "--temp", "0", "--kv", "f32", *args])


@pytest.mark.parametrize("drafter", ["oracle", "right:0.5", "mtp"])
def test_generate_spec_prints_the_text_of_spec_0_and_the_table(models, capsys, drafter):
    pack_dir = models["qwen35moe"].pack.dir
    assert generate_cli(pack_dir) == 0
    plain = capsys.readouterr().out
    assert generate_cli(pack_dir, "--spec", "2", "--spec-drafter", drafter, "--spec-min-p", "0", "--stats") == 0
    out, err = capsys.readouterr()
    assert out == plain
    table = err[err.index("speculative decoding: --spec 2"):].splitlines()
    assert table[1].split() == ["draft", "position", "drafted", "judged", "accepted", "acceptance"]
    first, second = table[3].split(), table[4].split()
    assert first[0] == "1" and second[0] == "2" and int(first[1]) >= int(second[1]) > 0
    # every first draft is judged; a second one only after its first was kept
    assert first[1] == first[2] and int(second[2]) <= int(first[3])
    if drafter == "oracle":
        assert first[4] == second[4] == "1.000"
    assert "tokens per verification" in table[5]
    speed = [line.split() for line in table if line.startswith("--spec")]
    assert [s[:3] for s in speed] == [["--spec", "0", "20"], ["--spec", "2", "20"]]
    assert speed[1][-1].endswith("x") and "(same tokens)" in err


@pytest.mark.bad_input("before-load")
@pytest.mark.parametrize("args, code, message", [
    (["--spec", "-1"], 2, "--spec -1: expected a count of draft tokens >= 0"),
    (["--spec", "2", "--spec-min-p", "1.5"], 2, "--spec-min-p 1.5: expected a probability 0..1"),
    (["--spec", "2", "--spec-drafter", "right:2"], 2, "--spec-drafter 'right:2': expected mtp, oracle, wrong or right:P"),
    (["--spec", "2", "--spec-drafter", "psychic"], 2, "--spec-drafter 'psychic'"),
])
def test_bad_spec_flags_are_refused(models, capsys, args, code, message):
    assert generate_cli(models["qwen35moe"].pack.dir, *args) == code
    assert message in capsys.readouterr().err


@pytest.mark.bad_input("before-load")
def test_spec_with_the_mtp_drafter_on_a_pack_without_one_says_what_to_do(models, capsys):
    pack_dir = models["qwen4exp"].pack.dir
    assert generate_cli(pack_dir, "--spec", "2") == 1
    err = capsys.readouterr().err
    assert f"--spec 2 drafts with the pack's MTP block and {pack_dir} has none" in err
    assert "--spec-drafter" in err and "Traceback" not in err


def test_the_memory_check_counts_what_spec_allocates(models):
    """spec_host_bytes (engine/budget.py: strata generate's and serve's memory checks, strata-budget's
    spec.* lines) is what a SpecRun allocates: its snapshots and, drafting with the MTP head, the
    head's KV cache and the head-input rows (the prompt chunk's or 1 + N), measured from the arrays
    (the PLE token windows aside: a few ints, in no plan item)."""
    from strata.engine.budget import spec_host_bytes

    def run_of(m, drafter, n_draft, chunk):
        s = m.new_session(50, "f16")
        run = SpecRun(m, s, [1, 2], Sampler(m.geometry.n_vocab, GREEDY), 4, drafter=drafter, n_draft=n_draft,
                      prefill=chunk)
        return run, sum(sn.nbytes - sum(p.window.nbytes for p in sn.ple_states.values()) for sn in run.snaps)

    for arch, m in models.items():
        _, snaps = run_of(m, ReferenceDrafter([1, 2, 3], m.geometry.n_vocab, 1.0), 3, 7)
        assert spec_host_bytes(m.geometry, 50, "f16", 3, False, 7) == snaps, arch
    m = models["qwen35moe"]
    for chunk in (7, 1):  # the head-input rows: the chunk's, or 1 + N when that is more
        drafter = MTPDrafter(MTPHead(m.pack), 50, "f16", Sampler(m.geometry.n_vocab, GREEDY), 0.0)
        run, snaps = run_of(m, drafter, 2, chunk)
        assert run.hidden.shape[0] == max(chunk, 3)
        assert spec_host_bytes(m.geometry, 50, "f16", 2, True, chunk) == snaps + drafter.state.nbytes + run.hidden.nbytes


# --- strata serve --spec ---------------------------------------------------------------------------


@pytest.mark.parametrize("batch_mtp", [False, True])
def test_serve_spec_gives_every_request_the_text_of_spec_0(models, batch_mtp):
    """Requests through a --spec 2 scheduler (the MTP head drafting, two at a time, a second turn
    resumed from the conversation cache) get --spec 0's greedy tokens and text, verified per request
    or with --batch-mtp (the head's inputs then come from the one forward of both requests)."""
    from strata.engine.scheduler import ConversationCache, Job, Scheduler, run_and_wait
    from strata.engine.tokenizer import Tokenizer

    m = models["qwen35moe"]
    tok = Tokenizer.load(m.pack.dir / "tokenizer.txt")
    rng = np.random.default_rng(2)
    plan = [(rng.integers(3, 256, n).tolist(), k) for n, k in ((9, 12), (30, 8), (4, 15))]

    def serve(spec):
        sch = Scheduler(m, tok, max_context=96, kv="f32", chunk=8, max_queue=8, cache=ConversationCache(4, 64 << 20),
                        batch=2, spec=spec, spec_min_p=0.0, batch_mtp=batch_mtp and spec > 0)
        try:
            jobs = [Job(p, k, GREEDY, ignore_eos=True) for p, k in plan]
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                list(pool.map(lambda j: run_and_wait(sch, j, 60), jobs))
            again = run_and_wait(sch, Job(jobs[0].result.fed.tolist() + [7, 8], 6, GREEDY, ignore_eos=True), 60)
            return jobs + [again], sch
        finally:
            sch.close()

    (want, _), (got, sch) = serve(0), serve(2)
    assert got[-1].resumed > 0  # the second turn started from the parked session
    assert sch._head is not None and sch._head.routing.sum() > 0  # the head drafted
    if batch_mtp:  # two requests' chains verified in one forward, at least once
        assert sch.counters.verify_forwards < sch.spec_stats.verifications
    for w, g in zip(want, got):
        assert g.error is None and g.result.tokens.tolist() == w.result.tokens.tolist() and g.text == w.text


def test_batch_mtp_gives_the_mtp_head_the_inputs_it_gets_per_request(models):
    """The drafts do not change the output, so the text alone cannot show a head input taken from the
    wrong rows of the one forward: every request's drafts (the random head's, which depend on its
    input bits) must be the ones it makes with per-request verification."""
    from strata.engine.speculative import Drafter
    from strata.engine.tokenizer import Tokenizer

    m = models["qwen35moe"]
    tok = Tokenizer.load(m.pack.dir / "tokenizer.txt")
    rng = np.random.default_rng(4)
    plan = [(rng.integers(3, 256, n).tolist(), k) for n, k in ((9, 12), (30, 10), (4, 14))]

    class Recording(Drafter):
        needs_hidden = True

        def __init__(self, inner, log):
            self.inner, self.log = inner, log

        def draft(self, history, n_known, n):
            d, q = self.inner.draft(history, n_known, n)
            self.log.append((n_known, tuple(d)))
            return d, q

        def observe(self, hidden, pos0, history):
            self.inner.observe(hidden, pos0, history)

    def drafts(batch_mtp):
        head, logs = MTPHead(m.pack), {}

        def drafter(job, sampler):
            inner = MTPDrafter(head, 96, "f32", sampler.fork(sampler.seed + 1), 0.0)
            return Recording(inner, logs.setdefault(tuple(job.prompt), []))

        _, sch = three_requests(m, tok, plan, drafter, spec=2, batch_mtp=batch_mtp)
        return logs, sch

    (per_slot, _), (batched, sch) = drafts(False), drafts(True)
    assert sch.counters.verify_forwards < sch.spec_stats.verifications  # chains shared a forward
    assert len(per_slot) == 3 and all(len(v) > 3 for v in per_slot.values())
    assert batched == per_slot


# --- strata serve --spec N --batch-mtp: every request's verify rows in one forward ------------------


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_a_verifys_snapshots_are_the_states_after_each_row(models, arch, monkeypatch):
    """A verify forward of 3 rows (its Gated DeltaNet rows through be.delta_rule_rows, one pass that
    also fills the snapshots) against the same rows as token steps: every row's logits, the
    snapshot after rows 0 and 1 and the state after the last are the steps' to the bit."""
    from strata.engine.backend import CpuBackend
    from strata.engine.speculative import Snapshot

    m = models[arch]
    prompt, feed = prompt_for(m, 9, 1), prompt_for(m, 3, 7)
    verified, stepped = m.new_session(20), m.new_session(20)
    for s in (verified, stepped):
        m.forward(s, prompt)
    calls = []
    rows = CpuBackend.delta_rule_rows
    monkeypatch.setattr(CpuBackend, "delta_rule_rows", staticmethod(lambda *a: calls.append(len(a[1])) or rows(*a)))
    snaps = [Snapshot(verified) for _ in range(2)]
    logits = m.forward(verified, feed, 3, saved=snaps)
    assert calls and set(calls) == {3}, calls  # the GDN layers took the rows in one call each
    for i, tok in enumerate(feed):
        assert np.array_equal(m.step(stepped, int(tok)), logits[i]), f"row {i}: logits"
        snap = snaps[i] if i < 2 else verified
        for l, (x, y) in enumerate(zip(snap.states, stepped.states)):
            if isinstance(x, dict):
                assert all(np.array_equal(x[k], y[k]) for k in x), f"row {i}, layer {l}"
    assert sum(isinstance(x, dict) for x in stepped.states) > 0  # not vacuous: the model has GDN layers


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_one_forward_of_several_sessions_gives_each_its_own_bits(models, arch):
    """forward_batch with per-session `hidden` and `saved`: a verifying session (3 rows, snapshots),
    a prompt chunk asking for its head input and a plain token give the logits, head inputs,
    snapshots and states that each gets from its own forward."""
    from strata.engine.speculative import Snapshot

    m = models[arch]
    E, prompts = m.geometry.n_embd, [prompt_for(m, n, seed) for n, seed in ((9, 1), (5, 2), (7, 3))]
    feeds = [prompt_for(m, 3, 4), prompt_for(m, 4, 5), prompt_for(m, 1, 6)]

    def sessions():
        out = [m.new_session(20) for _ in prompts]
        for s, p in zip(out, prompts):
            m.forward(s, p)
        return out

    alone, together = sessions(), sessions()
    snaps = [[Snapshot(s) for _ in range(3)] for s in (alone[0], together[0])]
    h_alone = [np.full((len(f), E), np.nan, np.float32) for f in feeds[:2]]
    h_tog = [np.full((len(f), E), np.nan, np.float32) for f in feeds[:2]]
    want = [m.forward(alone[0], feeds[0], 3, hidden=h_alone[0], saved=snaps[0]),
            m.forward(alone[1], feeds[1], 2, hidden=h_alone[1]), m.forward(alone[2], feeds[2], 1)]
    got = m.forward_batch(together, feeds, [3, 2, 1], hidden=[h_tog[0], h_tog[1], None], saved=[snaps[1], None, None])
    for w, g in zip(want, got):
        assert np.array_equal(w, g)
    assert all(np.array_equal(a, b) for a, b in zip(h_alone, h_tog))
    for a, b in zip(snaps[0], snaps[1]):  # every row's snapshot: the state after that row
        assert np.array_equal(a.routing, b.routing)
        for x, y in zip(a.states, b.states):
            assert x is None or all(np.array_equal(x[k], y[k]) for k in x)
    assert not np.array_equal(snaps[1][0].routing, snaps[1][2].routing)  # not vacuous: the rows differ
    for a, b in zip(alone, together):
        assert_same_states(a, b)


SERVE_JOBS = [(9, 12, "oracle"), (30, 8, "wrong"), (4, 15, "half"), (17, 10, "most"), (6, 5, "oracle")]
P_RIGHT = {"oracle": 1.0, "wrong": 0.0, "half": 0.5, "most": 0.8}


def serve_jobs(m, jobs, *, batch, spec, batch_mtp=False, refs=None, cache_slots=8):
    """Jobs (prompt, max tokens, drafter kind) through a scheduler, submitted at once: `batch` run
    together, the rest join as those leave (their lengths differ). -> (jobs, scheduler)."""
    from strata.engine.scheduler import ConversationCache, Job, Scheduler, run_and_wait
    from strata.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(m.pack.dir / "tokenizer.txt")
    kinds = {tuple(p): k for p, _, k in jobs}

    def drafter(job, sampler):
        key = tuple(job.prompt)
        return ReferenceDrafter(refs[key], m.geometry.n_vocab, P_RIGHT[kinds[key]], seed=len(key))

    sch = Scheduler(m, tok, max_context=64, kv="f32", chunk=8, max_queue=8,
                    cache=ConversationCache(cache_slots, 256 << 20), batch=batch, spec=spec, batch_mtp=batch_mtp,
                    drafter=drafter if spec else None)
    try:
        out = [Job(p, k, GREEDY, ignore_eos=True) for p, k, _ in jobs]
        with concurrent.futures.ThreadPoolExecutor(len(out)) as pool:
            list(pool.map(lambda j: run_and_wait(sch, j, 120), out))
    finally:
        sch.close()
    return out, sch


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_serve_batch_mtp_gives_every_request_its_tokens_and_states_alone(models, arch):
    """--spec 2 --batch-mtp, three slots, five requests (oracle, wrong, right half the time, right
    0.8 of the time: every acceptance length), joining and leaving between steps: each request's
    greedy tokens and its parked session's states are those of its --spec 0 run alone; per-slot
    verification gives them too; the batched server verified several chains per forward."""
    m = models[arch]
    rng = np.random.default_rng(5)
    jobs = [(rng.integers(3, m.geometry.n_vocab, n).tolist(), k, kind) for n, k, kind in SERVE_JOBS]
    alone = [plain(m, p, n=k, prefill=8) for p, k, _ in jobs]
    refs = {tuple(p): np.concatenate([r.prompt, r.tokens]) for (p, _, _), (r, _) in zip(jobs, alone)}
    batched, sch = serve_jobs(m, jobs, batch=3, spec=2, batch_mtp=True, refs=refs)
    per_slot, sch1 = serve_jobs(m, jobs, batch=3, spec=2, refs=refs)
    for j, j1, (r, s) in zip(batched, per_slot, alone):
        assert j.error is None and j1.error is None
        assert j.result.tokens.tolist() == r.tokens.tolist() == j1.result.tokens.tolist()
        fed = tuple(j.result.fed.tolist())
        assert_same_states(sch.cache._parked[fed][0], s)
    st = sch.spec_stats
    assert 0 < st.accepted.sum() < st.drafted.sum() and st.accepted[1] > 0  # kept and rejected drafts, both positions
    assert st.verifications == sch1.spec_stats.verifications
    # batched: fewer forwards than chains verified (several slots in one); per slot: one each
    assert sch.counters.verify_forwards < st.verifications and sch1.counters.verify_forwards == st.verifications


def test_serve_metrics_count_drafts_by_position(models):
    """/metrics with --spec 2: an oracle request and an always wrong one, 12 tokens each. By hand: the
    first token comes from the prompt; the oracle's verifications give 3, 3, 3, then 2 (one draft:
    one token is left), so 4 chains, 11 tokens, drafts 4 and 3 at positions 1 and 2, all kept; the
    wrong drafter's give 1 each for tokens 2..11 (10 chains, the second draft made while 2 tokens are
    left: 9) and the last is a plain step."""
    from strata.engine.serve import Metrics, _prometheus

    m = models["qwen4exp"]
    rng = np.random.default_rng(8)
    jobs = [(rng.integers(3, m.geometry.n_vocab, 10).tolist(), 12, kind) for kind in ("oracle", "wrong")]
    refs = {tuple(p): np.concatenate([r.prompt, r.tokens]) for (p, _, _), (r, _) in
            ((job, plain(m, job[0], n=12, prefill=8)) for job in jobs)}
    _, sch = serve_jobs(m, jobs, batch=1, spec=2, batch_mtp=True, refs=refs)  # one after the other
    text = _prometheus(Metrics(), sch)
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert lines['strata_spec_drafted_total{position="1"}'] == "14"
    assert lines['strata_spec_drafted_total{position="2"}'] == "12"
    assert lines['strata_spec_accepted_total{position="1"}'] == "4"
    assert lines['strata_spec_accepted_total{position="2"}'] == "3"
    assert lines["strata_spec_verifications_total"] == "14" == lines["strata_spec_verify_forwards_total"]
    assert lines["strata_spec_verified_tokens_total"] == "21"
    assert float(lines["strata_spec_tokens_per_verification"]) == 1.5
    assert "strata_spec_drafted_total" not in _prometheus(Metrics(), serve_jobs(m, jobs[:1], batch=1, spec=0)[1])


def test_serve_passes_spec_and_batch_mtp_to_the_scheduler(models, monkeypatch, capsys):
    """strata serve --spec 2 --batch 3 --batch-mtp builds its scheduler with them (a stand-in that
    records its arguments and stops the server before it listens)."""
    from strata.engine import scheduler
    from strata.engine.cli import main

    seen = {}

    def stand_in(*args, **kw):
        seen.update(kw)
        raise ValueError("stand-in scheduler: stop here")

    monkeypatch.setattr(scheduler, "Scheduler", stand_in)
    pack = str(models["qwen35moe"].pack.dir)
    assert main(["serve", "--pack", pack, "--port", "0", "--spec", "2", "--batch", "3", "--batch-mtp"]) == 1
    assert "stand-in scheduler: stop here" in capsys.readouterr().err
    assert (seen["spec"], seen["batch"], seen["batch_mtp"]) == (2, 3, True)
    assert main(["serve", "--pack", pack, "--port", "0", "--spec", "2"]) == 1
    assert seen["batch_mtp"] is False


def test_batch_mtp_without_spec_is_refused(models):
    from strata.engine.scheduler import ConversationCache, Scheduler
    from strata.engine.tokenizer import Tokenizer

    m = models["qwen4exp"]
    with pytest.raises(ValueError, match="--batch-mtp verifies the requests' drafts in one forward: it needs --spec N"):
        Scheduler(m, Tokenizer.load(m.pack.dir / "tokenizer.txt"), max_context=8, kv="f32", chunk=8, max_queue=1,
                  cache=ConversationCache(0, 0), batch=2, batch_mtp=True)


@pytest.mark.bad_input("before-load")
@pytest.mark.parametrize("args, code, message", [
    (["--spec", "2"], 1, "--spec 2 drafts with the pack's MTP block and"),
    (["--spec", "-3"], 2, "strata serve: error: --spec -3: expected a count of draft tokens >= 0"),
    (["--batch-mtp", "--batch", "4"], 2, "strata serve: error: --batch-mtp verifies the requests' drafts in one "
     "forward: give --spec N (N >= 1) too"),
])
def test_serve_spec_is_refused_before_the_load(models, capsys, args, code, message):
    from strata.engine.cli import main

    assert main(["serve", "--pack", str(models["qwen4exp"].pack.dir), "--port", "0", *args]) == code
    assert message in capsys.readouterr().err
