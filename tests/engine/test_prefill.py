"""The batched prompt path (B1, `--prefill CHUNK`) against the token-by-token path (`--prefill off`), the
KV cache kinds (`--kv f32|f16|int8`), `--max-context`, and the session memory --stats reports
against what engine/budget.py predicts.

Models: engine_fixture's qwen35moe (F32), and synth's `tiny` qwen4exp (QSA at layers 3 and 7, PLE,
hyper-connections) with every tensor dequantized to F32. With F32 weights the two paths differ only
by float32 rounding (the chunked delta rule, attention's matrix products): at every position, over
chunks of 7, 32, 64 and 100 tokens, max |prefill - token path| / max |token path| is

    --kv        f32      f16      int8
    qwen35moe   4.5e-6   7.3e-6   3.0e-5
    qwen4exp    9.6e-7   1.6e-6   2.8e-5

REL_TOL bounds f32 and f16 at 2e-5; int8 gets 2e-4, because there a K or V value that float
rounding moves across an int8 rounding boundary changes by a whole step (1/127 of its block's
largest value), not by a rounding.

With block-quantized weights the activations are themselves quantized (ActQ, 1/127 of a block's
largest value), and a float32 rounding difference can move one across a rounding boundary: the paths
then differ by ActQ's own resolution (about 1% of the logits on the tiny random models, as Q8_0 and
F32 experts of the same values do in test_engine_generate). There the blocks whose arithmetic does
not change with the batch (the MoE, expert by expert, with its router; the residual's norms) are
checked BIT-identical to the token path given the same input, each routed expert read once per
chunk, and the greedy continuation identical.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import engine_fixture as F
from strata.engine import budget as B
from strata.engine.cli import main
from strata.engine.generate import generate
from strata.engine.kernels import cpu, panel
from strata.engine.kvcache import KV_TYPES, KVCache, dequantize_int8, quantize_int8, kv_bytes_per_token
from strata.engine.model import ContextFull, Model
from strata.engine.pack_reader import Pack
from strata.engine.sampling import Sampler, SamplerParams
from strata.engine.weights import Input
from strata.tools import pack as tools_pack

REL_TOL = {"f32": 2e-5, "f16": 2e-5, "int8": 2e-4}
N_PROMPT = 157  # prime: no chunk size below divides it
N_GREEDY = 8
CHUNKS = (7, 32, 64, 100)  # 64 = the delta rule's own sub-chunk; 100 > 64 splits inside a chunk


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py



@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from strata.tools.synth import PRESETS, synth

    tmp = tmp_path_factory.mktemp("prefill")
    (tmp / "src").mkdir()
    (tmp / "f32").mkdir()
    shards = [F.dequantized_copy(p, tmp / "f32" / p.name) for p in synth("qwen4exp", "tiny", tmp / "src" / "tiny.gguf")]
    tools_pack.convert(shards[:1], tmp / "q4-pack", compress_ratio=PRESETS["tiny"].compress_ratio)
    return {"qwen35moe": Model(Pack.open(F.make_pack(tmp))), "qwen4exp": Model(Pack.open(tmp / "q4-pack"))}


def prompt_for(model, n=N_PROMPT, seed=3):
    return np.random.default_rng(seed).integers(3, model.geometry.n_vocab, n).tolist()


def run(model, prompt, prefill, kv="f32", n=N_GREEDY):
    rows = np.empty((len(prompt) + n, model.geometry.n_vocab), np.float32)
    s = model.new_session(len(prompt) + n, kv)
    out = generate(model, s, prompt, Sampler(model.geometry.n_vocab, SamplerParams(temperature=0)), n,
                   on_logits=lambda pos, logits: rows.__setitem__(pos, logits), prefill=prefill)
    return rows[: out.positions], out


@pytest.fixture(scope="module")
def token_path(models):
    return {(arch, kv): run(m, prompt_for(m), 1, kv) for arch, m in models.items() for kv in KV_TYPES}


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_prefill_equals_the_token_path(models, token_path, arch, chunk):
    model = models[arch]
    g = model.geometry
    if g.has_qsa:  # the prompt is long enough that QSA leaves blocks out: selection, not dense attention
        assert N_PROMPT // g.idx_compress_ratio > g.idx_top_k // g.idx_compress_ratio
    for kv in KV_TYPES if chunk == 32 else ("f32",):
        want, ref = token_path[arch, kv]
        got, out = run(model, prompt_for(model), chunk, kv)
        assert out.positions == ref.positions == N_PROMPT + N_GREEDY - 1
        rel = np.abs(got - want).max(axis=1) / np.abs(want).max()
        assert rel.max() < REL_TOL[kv], f"--kv {kv}: position {rel.argmax()} differs by {rel.max():.2e} (relative)"
        assert out.tokens.tolist() == ref.tokens.tolist()


def test_forward_returns_the_last_positions_and_refuses_past_the_context(models):
    model = models["qwen35moe"]
    prompt = prompt_for(model, 20)
    s = model.new_session(20)
    assert model.forward(s, prompt[:10], 0).shape == (0, model.geometry.n_vocab)
    rows = model.forward(s, prompt[10:], 3)
    t = model.new_session(20)
    for tok in prompt[:-1]:
        model.step(t, tok)
    assert rows.shape == (3, model.geometry.n_vocab) and s.pos == 20
    assert np.abs(rows[-1] - model.step(t, prompt[-1])).max() < REL_TOL["f32"] * np.abs(rows[-1]).max()
    with pytest.raises(ContextFull, match="position 21: the session's context is 20"):
        model.forward(s, prompt[:2])
    with pytest.raises(ValueError, match="n_logits 3 outside 0..2"):
        model.forward(model.new_session(4), prompt[:2], 3)


def test_a_batch_of_sequences_gives_each_its_own_logits(models):
    """Model.forward_batch: three sequences at once, prompts in chunks of 16 beside each other's
    single decode tokens, every step one forward: each sequence's logits are bit-identical to its
    run alone (rows never mix: the row-wise work is per row, the sequence work per sequence)."""
    for arch, model in models.items():
        V = model.geometry.n_vocab
        rng = np.random.default_rng(1)
        prompts = [rng.integers(3, V, n).tolist() for n in (40, 7, 75)]

        def alone(p):
            s, rows = model.new_session(100), []
            for a in range(0, len(p), 16):
                rows.append(model.forward(s, p[a : a + 16], 1)[-1].copy())
            for _ in range(6):
                rows.append(model.step(s, int(np.argmax(rows[-1]))).copy())
            return np.array(rows)

        want = [alone(p) for p in prompts]
        sessions, fed, got, widths = [model.new_session(100) for _ in prompts], [0, 0, 0], [[], [], []], []
        while any(len(g) < len(w) for g, w in zip(got, want)):
            live = [i for i in range(3) if len(got[i]) < len(want[i])]
            feeds = []
            for i in live:
                if fed[i] < len(prompts[i]):
                    feeds.append(prompts[i][fed[i] : fed[i] + 16])
                    fed[i] += len(feeds[-1])
                else:
                    feeds.append([int(np.argmax(got[i][-1]))])
            widths.append([len(f) for f in feeds])
            for i, rows in zip(live, model.forward_batch([sessions[i] for i in live], feeds, [1] * len(live))):
                got[i].append(rows[-1].copy())
        assert any(len(w) == 3 and min(w) == 1 and max(w) > 1 for w in widths)  # chunks beside decode tokens
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(np.array(g), w), f"{arch}: sequence {i} differs batched"
    with pytest.raises(ValueError, match="a session appears twice"):
        s = model.new_session(10)
        model.forward_batch([s, s], [[1], [2]], [1, 1])


# --- block-quantized weights ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def q8(tmp_path_factory):
    return Model(Pack.open(F.make_pack(tmp_path_factory.mktemp("q8"), types={"experts": "Q8_0", "dense": "Q8_0"})))


def test_quantized_blocks_are_bit_identical_and_greedy_agrees(q8, monkeypatch):
    """MoE expert by expert (each expert's rows gathered from the chunk's ActQ), the router and the
    residual's norms: bit-identical to one token at a time, given the same inputs."""
    g, be = q8.geometry, q8.backend
    X = np.random.default_rng(0).standard_normal((40, g.n_embd)).astype(np.float32)
    for moe in q8.moes:
        counts_one, counts_many = np.zeros(g.n_expert, np.int64), np.zeros(g.n_expert, np.int64)
        one = np.array([moe.forward(be, Input(x[None].copy()), counts_one)[0].copy() for x in X])
        assert np.array_equal(moe.forward(be, Input(X.copy()), counts_many), one)
        assert np.array_equal(counts_one, counts_many)
    # one read of each routed expert's weights for the whole chunk: one grouped call per matrix
    # (gate, up, down), each naming every routed expert once and giving it its own tokens
    moe, calls = q8.moes[2], []
    grouped = cpu.matmul_grouped

    def spy(raw, type_id, n_in, n_out, offsets, act, starts, out=None):
        calls.append((np.array(offsets), np.array(starts), act))
        return grouped(raw, type_id, n_in, n_out, offsets, act, starts, out)

    monkeypatch.setattr(cpu, "matmul_grouped", spy)
    x = Input(X.copy())
    top, _ = moe.route(be, x)
    moe.forward(be, x)
    monkeypatch.undo()
    routed = np.unique(top)
    assert len(calls) == 3 and len(routed) < top.size
    sizes = (moe.gu.nbytes((g.n_embd, g.n_ff_exp)),) * 2 + (moe.d.nbytes((g.n_ff_exp, g.n_embd)),)
    for (offsets, starts, _), size in zip(calls, sizes):
        assert np.array_equal(offsets, routed * size)
    act = x.form(moe.gu)
    for which in range(2):  # gate, up: expert routed[i] on the tokens routed to it, in order
        _, starts, got = calls[which]
        for i, e in enumerate(routed):
            tokens = np.flatnonzero((top == e).any(axis=1))
            assert np.array_equal(got.q[starts[i] : starts[i + 1]], act.q[tokens]), f"expert {e}: wrong tokens"
    r = q8.residual
    x, _ = r.enter(be, X, 1, ffn=True)
    assert np.array_equal(x.x, np.array([r.enter(be, h[None], 1, ffn=True)[0].x[0].copy() for h in X]))
    prompt = prompt_for(q8)
    want, ref = run(q8, prompt, 1)
    for chunk in (7, 64):
        got, out = run(q8, prompt, chunk)
        assert out.tokens.tolist() == ref.tokens.tolist()


def test_a_decode_steps_routed_gate_and_up_are_one_grouped_call(q8, monkeypatch):
    """One token's routed experts: gate and up of all of them in one grouped call (one parallel
    region), then down in one; the same bits as a call per matrix."""
    from strata.engine import moe as moe_module

    g, be, moe = q8.geometry, q8.backend, q8.moes[2]
    x = np.random.default_rng(1).standard_normal((1, g.n_embd)).astype(np.float32)
    monkeypatch.setattr(moe_module, "FUSE_ROWS", 0)  # the call per matrix
    apart = moe.forward(be, Input(x.copy())).copy()
    monkeypatch.undo()
    calls, grouped = [], cpu.matmul_grouped

    def spy(raw, type_id, n_in, n_out, offsets, act, starts, out=None):
        calls.append(len(offsets))
        return grouped(raw, type_id, n_in, n_out, offsets, act, starts, out)

    monkeypatch.setattr(cpu, "matmul_grouped", spy)
    together = moe.forward(be, Input(x.copy()))
    assert calls == [2 * g.n_expert_used, g.n_expert_used], "gate + up of every routed expert, then down"
    assert np.array_equal(together, apart)


# --- the KV cache -----------------------------------------------------------------------------------


def test_int8_kv_is_the_budgets_layout_and_rounds_to_half_a_step():
    x = np.random.default_rng(1).standard_normal((5, 2, 64)).astype(np.float32) * np.float32(3)
    x[0, 1, 32:] = 0  # an all-zero block
    q, d = quantize_int8(x)
    assert q.dtype == np.int8 and d.shape == (5, 2, 2) and d.dtype == np.float32
    err = np.abs(dequantize_int8(q, d) - x).reshape(5, 2, 2, 32)
    assert (err <= d[..., None] / 2 * (1 + 1e-6)).all() and d[0, 1, 1] == 0 and not q[0, 1, 32:].any()
    # amax / 127: the largest element of each block is exactly +-127
    assert (np.abs(q.reshape(5, 2, 2, 32)).max(axis=-1)[d > 0] == 127).all()
    g = F.geometry()
    for kind in KV_TYPES:
        c = KVCache(kind, 33, g.n_head_kv, g.head_dim)
        assert c.nbytes == 33 * kv_bytes_per_token(g, kind)
        c.write(4, x[:, :, :32], x[:, :, 32:])
        k, v = c.read(slice(4, 9))
        tol = {"f32": 0, "f16": 2**-11, "int8": 1 / 254}[kind] * np.abs(x).max()
        assert k.shape == (2, 5, 32) and np.abs(k - x[:, :, :32].transpose(1, 0, 2)).max() <= tol
        assert np.abs(v - x[:, :, 32:].transpose(1, 0, 2)).max() <= tol
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple of the 32-element KV block"):
        KVCache("int8", 8, 2, 48)
    with pytest.raises(ValueError, match="--kv 'q4'"):
        KVCache("q4", 8, 2, 32)


@pytest.mark.parametrize("kv", KV_TYPES)
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen4exp"])
def test_session_memory_is_what_strata_budget_predicts(models, arch, kv):
    model = models[arch]
    p = model.pack
    s = model.new_session(777, kv)
    plan = B.plan_budget(p.index, p.experts, p.geometry, B.BudgetOptions(max_context=777, kv=kv))
    planned = {i.key: i.bytes for i in plan.items if i.key.startswith("session.")}
    measured = s.memory()
    scratch = measured.pop("scratch")
    assert measured == planned
    assert scratch < 0.01 * sum(planned.values())  # what no plan item names is negligible
    if arch == "qwen4exp":
        assert {"session.indexer_keys", "session.ple_state"} <= planned.keys()


# --- the command line -------------------------------------------------------------------------------


def test_cli_max_context_prefill_and_stats(models, tmp_path, capsys):
    pack_dir = models["qwen35moe"].pack.dir
    ids = " ".join(map(str, prompt_for(models["qwen35moe"], 40)))
    gen = lambda *a: main(["generate", "--pack", str(pack_dir), "--pool-workers", "1", "--prompt-ids", ids, *a])
    assert gen("-n", "8", "--max-context", "45") == 1
    assert "the prompt (40 tokens) + -n 8 = 48 tokens do not fit in --ctx-size 45" in capsys.readouterr().err
    assert gen("-n", "1", "--prefill", "none") == 1
    assert "--prefill 'none': expected auto, off or a chunk size" in capsys.readouterr().err
    assert gen("-n", "1", "--kv", "q4") == 1
    assert "--kv 'q4': expected one of f16, int8, f32" in capsys.readouterr().err
    dumps = {}
    for prefill in ("off", "16"):
        dumps[prefill] = tmp_path / f"{prefill}.npy"
        assert gen("-n", "4", "--temp", "0", "--kv", "int8", "--prefill", prefill, "--stats",
                   "--dump-logits", str(dumps[prefill])) == 0
        err = capsys.readouterr().err
        assert ("chunks of 16" if prefill == "16" else "token by token") in err
        plan = B.plan_budget(models["qwen35moe"].pack.index, models["qwen35moe"].pack.experts,
                             models["qwen35moe"].geometry, B.BudgetOptions(max_context=44, kv="int8"))
        kv_line = next(line for line in err.splitlines() if line.startswith("KV cache (int8, 44 tokens)"))
        assert kv_line.split()[-2:] == [str(plan.item("session.kv").bytes)] * 2
    a, b = np.load(dumps["off"]), np.load(dumps["16"])
    assert a.shape == b.shape == (43, models["qwen35moe"].geometry.n_vocab)  # every fed position
    assert gen("-n", "1", "--device", "cpu", "--stats") == 0  # auto on the CPU alone: 1024-token chunks (memory allowing)
    assert f"chunks of {B.PREFILL_AUTO_CHUNK_CPU}" in capsys.readouterr().err
    assert np.abs(a - b).max() < REL_TOL["int8"] * np.abs(a).max()


# --- --prefill auto ---------------------------------------------------------------------------------


def _prompt_makes_kernels(model, prompt_path: bool) -> set:
    """The CPU kernels two prompts (40 and 100 tokens) make after `model.warm_up(prompt_path)` in a
    process that forgot every kernel (the disk cache keeps them)."""
    kinds = (cpu._KERNELS, cpu._GROUPED, cpu._PANEL)
    made = lambda: {(i, key, len(k.signatures)) for i, d in enumerate(kinds) for key, k in d.items()}  # noqa: E731
    saved = [dict(d) for d in kinds]
    try:
        for d in kinds:
            d.clear()
        model.warm_up(prompt_path=prompt_path)
        warm = made()
        for T in (40, 100):
            model.forward(model.new_session(T + 1, "f16"), prompt_for(model, T), n_logits=1)
        return made() - warm
    finally:
        for d, old in zip(kinds, saved):
            d.clear()
            d.update(old)


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen35moe"])
def test_warm_up_makes_every_kernel_a_prompt_then_runs(models, arch):
    # The prompt path's kernels compile (or load from the disk cache) in Model.warm_up, not inside
    # the first prompt.
    assert _prompt_makes_kernels(models[arch], prompt_path=True) == set()


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen35moe"])
def test_without_the_prompt_chunks_a_prompt_makes_kernels(models, arch):
    # The control of the test above: warmed up without its prompt chunks, the same prompts make
    # kernels of their own (so an empty set above is the warm-up's doing).
    # Where they make none: panel.py's many-token kernels are taken only on AVX512-VNNI hosts, and
    # the qwen4exp fixture is all F32 (no grouped block kernels), so on an AVX2 host its prompt runs
    # the token path's row kernels (found 2026-12-02 on an AMD EPYC with AVX2: the control failed).
    if arch == "qwen4exp" and not panel.AVAILABLE:
        pytest.skip("this host has no AVX512-VNNI: the all-F32 qwen4exp fixture's prompt takes the token path's "
                    f"kernels, so there is nothing for the warm-up to make")
    assert _prompt_makes_kernels(models[arch], prompt_path=False) != set()


def test_auto_chunk_is_one_rule_and_its_memory_model_covers_the_real_peak(models):
    g = models["qwen4exp"].geometry
    assert B.auto_prefill_chunk() == B.PREFILL_AUTO_CHUNK == 256  # strata-budget's (device) plan
    need = B.prefill_host_bytes(g, 256, 4096) * B.PREFILL_MEMORY_SHARE
    assert B.auto_prefill_chunk(need, g=g, max_context=4096) == 256
    assert B.auto_prefill_chunk(need - 1, g=g, max_context=4096) == 128
    assert B.auto_prefill_chunk(1, g=g, max_context=4096) == 1
    # on the CPU alone auto starts from 1024 tokens, halved by the same rule
    cpu = B.PREFILL_AUTO_CHUNK_CPU
    assert cpu == 1024 and B.auto_prefill_chunk(start=cpu) == cpu
    assert B.auto_prefill_chunk(B.prefill_host_bytes(g, cpu, 4096) * B.PREFILL_MEMORY_SHARE, g=g, max_context=4096, start=cpu) == cpu
    assert B.auto_prefill_chunk(need, g=g, max_context=4096, start=cpu) == 256  # halved twice
    # the estimate is an upper bound of what a chunk really allocates at its peak (numpy's buffers)
    model = models["qwen4exp"]
    prompt = prompt_for(model, 200)
    s = model.new_session(200, "f16")
    model.forward(s, prompt[:100], 0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        model.forward(s, prompt[100:164], 64)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert 0 < peak <= B.prefill_host_bytes(g, 64, 200)
