"""The engine's forward pass against transformers 5.23.0 in float64 (issue 4, item 4), both architectures.

A tiny random checkpoint is built with transformers (tests/reference/hf_models.py), converted by
llama.cpp's own converter, packed by strata-pack, and run by the engine with F32 weights. The
reference is the same checkpoint in transformers with every internal float32 cast turned into
float64 (tests/reference/float64.py; `model.double()` alone still rounds inside RMSNorm, the delta
rule and the softmaxes). For prompts of 8, 64 and 300 tokens, each followed by 32 greedy tokens:

- logits at every position agree to max |engine - reference| / max |reference| < REL_TOL.
  Measured (model seed 0, prompt seed 6), prompts 8 / 64 / 300:
      qwen35moe  2.8e-6  3.0e-6  5.7e-6
      qwen4exp   7.5e-7  1.3e-6  1.7e-6
  For scale, transformers' own float32 forward is 1.0e-5 from its float64 one (qwen35moe, 64).
- the 32 greedy tokens are the reference's argmax at every generated position.
- qwen4exp: every QSA layer attends exactly the reference's tokens at every position, and the
  token budget leaves blocks out (QSA, not dense attention).
- the fixture has no near-ties (BRIEF section 5): every router top-k boundary (the k-th against the
  (k+1)-th router logit, every layer, every position), every QSA block-score boundary and every greedy
  top-1/top-2 gap is at least MARGIN times the engine/reference disagreement of those numbers, so the
  comparison tests the arithmetic, not float32 noise. Measured tightest margins: router 10.1
  (qwen35moe) and 10.5 (qwen4exp), QSA 160, greedy 410. A random model cannot clear a fixed absolute
  gap at ~3700 router decisions; the prompt seed was picked to clear this one, and the test checks it.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference import convert, hf_models  # noqa: E402
from reference.float64 import check_float64_outputs, float64_casts, float64_model  # noqa: E402

from strata.engine.generate import generate  # noqa: E402
from strata.engine.kernels import cpu  # noqa: E402
from strata.engine.model import Model, QSAAttention  # noqa: E402
from strata.engine.pack_reader import Pack  # noqa: E402
from strata.engine.sampling import Sampler, SamplerParams  # noqa: E402

pytestmark = pytest.mark.reference

MODEL_SEED = 0
PROMPT_SEED = 6
PROMPT_LENGTHS = (8, 64, 300)
N_GREEDY = 32
REL_TOL = 5e-5
MARGIN = 5.0


def _modeling(arch: str):
    if arch == "qwen35moe":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mod
    else:
        from transformers.models.qwen4_exp import modeling_qwen4_exp as mod
    return mod


def _engine_run(model: Model, prompt: np.ndarray) -> dict:
    """Greedy generation, recording at every fed position the logits, the router logits and, for
    QSA layers, the indexer's block scores and the tokens attended."""
    g = model.geometry
    n = len(prompt) + N_GREEDY
    logits = np.empty((n, g.n_vocab), np.float32)
    router = np.empty((g.n_layer, n, g.n_expert), np.float32)
    qsa = {l: m.qsa for l, m in enumerate(model.mixers) if isinstance(m, QSAAttention)}
    scores = {l: [] for l in qsa}
    selected = {l: [] for l in qsa}

    def record(pos, row):
        logits[pos] = row
        for layer, moe in enumerate(model.moes):
            router[layer, pos] = moe.logits
        for layer, q in qsa.items():
            if (pos + 1) // g.idx_compress_ratio:  # a complete block exists: the indexer scored
                scores[layer].append(q.block_scores.copy())
            selected[layer].append(sorted(q.selected.tolist()))

    out = generate(model, model.new_session(n), prompt, Sampler(g.n_vocab, SamplerParams(temperature=0)),
                   N_GREEDY, on_logits=record)  # no stop tokens: always 32 tokens to compare
    return dict(tokens=out.tokens, logits=logits[: out.positions], router=router[:, : out.positions],
                scores=scores, selected=selected, k=g.n_expert_used,
                block_topk=g.idx_top_k // g.idx_compress_ratio if g.has_qsa else 0)


@contextlib.contextmanager
def _record_qsa(ref, layers):
    """While active: every block-score vector the reference's indexers rank (Tensor.topk on a 1-D
    tensor, in layer order then query order) and each indexer's selection mask."""
    scores, masks, topk = [], {}, torch.Tensor.topk

    def recording_topk(self, *args, **kwargs):
        if self.ndim == 1:  # the router ranks 2-D [tokens, experts]; only the indexer ranks 1-D
            scores.append(self.detach().numpy().copy())
        return topk(self, *args, **kwargs)

    hooks = [ref.model.layers[l].self_attn.indexer.register_forward_hook(
        lambda _m, _i, out, l=l: masks.__setitem__(l, out[0, 0].numpy())) for l in layers]
    torch.Tensor.topk = recording_topk
    try:
        yield scores, masks
    finally:
        torch.Tensor.topk = topk
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module", params=["qwen35moe", "qwen4exp"])
def runs(request, tmp_path_factory):
    arch = request.param
    from strata.tools import pack as tools_pack

    ggufs = convert.reference_gguf(arch, "f32", seed=MODEL_SEED)
    pack_dir = tmp_path_factory.mktemp(arch) / "pack"
    # the QSA block size is not in a converted GGUF (docs/gguf-layout.md section 5): from the config
    ratio = hf_models.tiny_config(arch).get("indexer_compress_ratio")
    tools_pack.convert(ggufs[:1], pack_dir, ple_gguf=ggufs[1] if len(ggufs) > 1 else None, compress_ratio=ratio)
    before = cpu.threads_cap()
    cpu.set_threads(1)  # tiny matrices: threads cost more than they give
    try:
        model = Model(Pack.open(pack_dir))
        rng = np.random.default_rng(PROMPT_SEED)
        prompts = [rng.integers(3, hf_models.VOCAB_SIZE, size=n) for n in PROMPT_LENGTHS]
        engine = [_engine_run(model, p) for p in prompts]
    finally:
        cpu.set_threads(before)
    ref = hf_models.load_model(convert.reference_checkpoint(arch, seed=MODEL_SEED))
    mod = _modeling(arch)
    out = {}
    with float64_casts(mod):
        float64_model(ref, mod)
        hooks = check_float64_outputs(ref)
        for n, p, e in zip(PROMPT_LENGTHS, prompts, engine):
            ids = torch.tensor(np.concatenate([p, e["tokens"]]))[None]
            layers = list(e["scores"])
            with _record_qsa(ref, layers) as (scores, masks), torch.no_grad():
                o = ref(ids, attention_mask=torch.ones_like(ids), output_router_logits=True)
            positions = len(e["logits"])
            per_layer = len(scores) // max(1, len(layers))  # the indexers run one after another
            e.update(
                ref_logits=o.logits[0, :positions].numpy(),
                ref_router=np.stack([r.numpy() for r in o.router_logits])[:, :positions],
                # the reference also scores the last token, which the engine never feeds: dropped
                ref_scores={l: scores[i * per_layer : (i + 1) * per_layer][: len(e["scores"][l])]
                            for i, l in enumerate(layers)},
                ref_selected={l: [np.flatnonzero(masks[l][pos, : pos + 1]).tolist() for pos in range(positions)]
                              for l in layers},
            )
            out[n] = e
        for h in hooks:
            h.remove()
    return out


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_logits_at_every_position_match_float64(runs, n):
    r = runs[n]
    rel = np.abs(r["logits"] - r["ref_logits"]).max() / np.abs(r["ref_logits"]).max()
    assert rel < REL_TOL, f"max |engine - reference| / max |reference| = {rel:.3e} over {len(r['logits'])} positions"


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_greedy_tokens_are_the_references(runs, n):
    r = runs[n]
    ref_argmax = r["ref_logits"][n - 1 :].argmax(axis=-1)
    assert r["tokens"].tolist() == ref_argmax.tolist()


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_fixture_has_no_near_ties(runs, n):
    r = runs[n]
    k = r["k"]
    # router: the top-k SET decides the output (weights are renormalised), so the k / k+1 boundary
    ranked = np.sort(r["ref_router"], axis=-1)[..., ::-1]
    gaps = ranked[..., k - 1] - ranked[..., k]  # [L, positions]
    noise = np.abs(r["router"] - r["ref_router"]).max(axis=(1, 2))[:, None]  # per layer
    worst = np.unravel_index(np.argmin(gaps / noise), gaps.shape)
    assert (gaps >= MARGIN * noise).all(), (
        f"router near-tie at layer {worst[0]} position {worst[1]}: gap {gaps[worst]:.2e}, "
        f"layer noise {noise[worst[0], 0]:.2e}; pick another PROMPT_SEED")
    top2 = np.sort(r["ref_logits"][n - 1 :], axis=-1)[:, ::-1]
    greedy_gap = (top2[:, 0] - top2[:, 1]).min()
    logit_noise = np.abs(r["logits"] - r["ref_logits"]).max()
    assert greedy_gap >= MARGIN * logit_noise, f"greedy near-tie: gap {greedy_gap:.2e}, noise {logit_noise:.2e}"
    # QSA: the boundary between the kept blocks and the best dropped one, where some are dropped
    for layer, engine_scores in r["scores"].items():
        ref_scores = r["ref_scores"][layer]
        noise = max(np.abs(a - b).max() for a, b in zip(engine_scores, ref_scores))
        keep = r["block_topk"]
        for pos, s in enumerate(ref_scores):
            if len(s) > keep:
                ranked = np.sort(s)[::-1]
                gap = ranked[keep - 1] - ranked[keep]
                assert gap >= MARGIN * noise, (f"QSA near-tie in layer {layer} at its query {pos}: block-score gap "
                                               f"{gap:.2e}, layer noise {noise:.2e}; pick another PROMPT_SEED")


@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_qsa_attends_the_references_tokens(runs, n):
    r = runs[n]
    if not r["selected"]:
        pytest.skip("qwen35moe has no QSA layers")
    for layer, selected in r["selected"].items():
        for pos, (got, want) in enumerate(zip(selected, r["ref_selected"][layer])):
            assert got == want, f"layer {layer} position {pos}: engine attends {got}, the reference {want}"
    # the budget leaves blocks out (every context here is longer than it): QSA is not dense attention
    assert any(len(sel) < pos + 1 for by_pos in r["selected"].values() for pos, sel in enumerate(by_pos))


def test_the_reference_computes_in_float64():
    """float64_casts really removes the float32 rounding: two different algorithms for the same
    quantity (chunked and recurrent delta rule) agree to float64 precision only with it."""
    mod = _modeling("qwen35moe")
    gen = torch.Generator().manual_seed(0)
    B, T, H, D = 1, 70, 2, 8  # T spans two 64-token chunks
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for _ in range(3))
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)

    def disagreement():
        a, _ = mod.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        b, _ = mod.torch_recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        return float((a - b).abs().max())

    assert disagreement() > 1e-9  # float32 inside, as released
    with float64_casts(mod):
        assert disagreement() < 1e-12
        x = torch.randn(3, 16, generator=gen, dtype=torch.float64)
        norm = mod.Qwen3_5MoeRMSNorm(16, eps=1e-6).double()
        with torch.no_grad():
            norm.weight.normal_(generator=gen)
            got = norm(x).numpy()
        xn = x.numpy()
        want = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * (1 + norm.weight.detach().numpy())
        assert np.abs(got - want).max() < 1e-13
