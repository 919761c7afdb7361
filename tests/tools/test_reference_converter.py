"""llama.cpp's own converter on tiny transformers models: the facts docs/gguf-layout.md states.

The expected names and shapes below are written from the config fields (the formulas of
docs/gguf-layout.md), not read from the converter; values are checked against the checkpoint.
Cold: fetches the llama-cpp-python sdist and converts (tens of seconds); warm: cached.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference import hf_models  # noqa: E402  (pytest puts tests/ on sys.path)
from reference.convert import reference_checkpoint, reference_gguf  # noqa: E402
from reference.gguf_dump import describe  # noqa: E402

pytestmark = pytest.mark.reference

F32, F16, BF16 = 0, 1, 30


def expected_layout(arch: str, cfg: dict) -> dict[str, tuple[tuple[int, ...], bool]]:
    """GGUF tensor name -> (shape in GGUF order, F32 whatever the outtype)."""
    E, V, L, I = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["full_attention_interval"]
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    X, F, Fs = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    C = 2 * nk * dk + nv * dv
    out = {"token_embd.weight": ((E, V), False), "output.weight": ((E, V), False)}
    if arch == "qwen4exp":
        hc, R = cfg["hc_count"], cfg["hc_lowrank"]
        out.update({"output_hc_norm.weight": ((hc * E,), True), "output_hc_down.weight": ((hc * E, R), False),
                    "output_hc_up.weight": ((R, hc * E), False)})
    else:
        out["output_norm.weight"] = ((E,), True)
    ple_layers = [i - 1 for i in cfg.get("ple_layer_ids", [])]
    for n in range(L):
        b = f"blk.{n}."
        out.update({
            b + "ffn_gate_inp.weight": ((E, X), True),
            b + "ffn_gate_exps.weight": ((E, F, X), False), b + "ffn_up_exps.weight": ((E, F, X), False),
            b + "ffn_down_exps.weight": ((F, E, X), False),
            b + "ffn_gate_shexp.weight": ((E, Fs), False), b + "ffn_up_shexp.weight": ((E, Fs), False),
            b + "ffn_down_shexp.weight": ((Fs, E), False), b + "ffn_gate_inp_shexp.weight": ((E, 1), True),
        })
        if arch == "qwen4exp":
            for m in ("attn", "ffn"):
                out.update({f"{b}hc_{m}_norm.weight": ((hc * E,), True), f"{b}hc_{m}_down.weight": ((hc * E, R), False),
                            f"{b}hc_{m}_up.weight": ((R, hc * E), False), f"{b}hc_{m}_inject.weight": ((hc * E, hc), False)})
        else:
            out.update({b + "attn_norm.weight": ((E,), True), b + "post_attention_norm.weight": ((E,), True)})
        if n % I != I - 1:
            out.update({
                b + "attn_qkv.weight": ((E, C), False), b + "attn_gate.weight": ((E, nv * dv), False),
                b + "ssm_conv1d.weight": ((K, C), True), b + "ssm_dt.bias": ((nv,), True), b + "ssm_a": ((nv,), True),
                b + "ssm_alpha.weight": ((E, nv), False), b + "ssm_beta.weight": ((E, nv), False),
                b + "ssm_norm.weight": ((dv,), True), b + "ssm_out.weight": ((nv * dv, E), False),
            })
        else:
            out.update({
                b + "attn_q.weight": ((E, 2 * H * D), False), b + "attn_k.weight": ((E, Hkv * D), False),
                b + "attn_v.weight": ((E, Hkv * D), False), b + "attn_output.weight": ((H * D, E), False),
                b + "attn_q_norm.weight": ((D,), True), b + "attn_k_norm.weight": ((D,), True),
            })
            if arch == "qwen4exp":
                Ih, Id = cfg["indexer_n_heads"], cfg["indexer_head_dim"]
                out.update({
                    b + "indexer.q_proj.weight": ((E, Ih * Id), False), b + "indexer.k_proj.weight": ((E, Id), False),
                    b + "indexer.q_norm.weight": ((Id,), True), b + "indexer.k_norm.weight": ((Id,), True),
                })
        if n in ple_layers:
            Pe = cfg.get("ple_embed_dim") or E
            out.update({
                b + "ple_key.weight": ((Pe, hc * E), False), b + "ple_value.weight": ((Pe, E), False),
                b + "ple_norm_key.weight": ((hc * E,), True), b + "ple_norm_query.weight": ((hc * E,), True),
                b + "ple_norm_conv.weight": ((hc * E,), True), b + "ple_conv1d.weight": ((cfg["ple_conv_kernel_size"], hc * E), False),
            })
    if ple_layers:
        n_heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
        out["per_layer_token_embd.weight"] = (((cfg.get("ple_embed_dim") or E) // n_heads, _ple_rows(cfg)), False)
    return out


def _ple_rows(cfg: dict) -> int:
    """Rows of the padded n-gram table, from the primes transformers derives (independent of the GGUF)."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import _find_nth_prime_after

    n_heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
    total = sum(_find_nth_prime_after(cfg["ngram_vocab_size_base"] - 1, h + 1) for h in range(n_heads))
    div = cfg["make_ngram_vocab_size_divisible_by"]
    return -(-total // div) * div


def _read_f32(desc: dict, name: str) -> np.ndarray:
    t = desc["tensors"][name]
    assert t.ggml_type == F32, f"{name}: type {t.ggml_type}, this helper reads F32 only"
    data = np.fromfile(desc["files"][t.file], dtype=np.float32, count=int(np.prod(t.shape)), offset=t.offset)
    return data.reshape(tuple(reversed(t.shape)))  # numpy row-major = GGUF order reversed


def _checkpoint_tensors(arch: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for part in sorted(reference_checkpoint(arch, 0).glob("*.safetensors")):
        out.update(load_file(str(part)))
    return out


@pytest.fixture(scope="module", params=hf_models.ARCHS)
def converted(request):
    arch = request.param
    return arch, hf_models.tiny_config(arch), describe(reference_gguf(arch, "f32"))


def test_arch_and_layer_kinds(converted):
    arch, cfg, desc = converted
    md = desc["metadata"]
    assert md["general.architecture"].value == arch
    L, I = cfg["num_hidden_layers"], cfg["full_attention_interval"]
    assert md[f"{arch}.block_count"].value == L
    assert md[f"{arch}.full_attention_interval"].value == I
    derived = [n % I != I - 1 for n in range(L)]
    assert md[f"{arch}.attention.recurrent_layers"].value == derived
    for n in range(L):
        has_ssm = f"blk.{n}.ssm_a" in desc["tensors"]
        has_attn = f"blk.{n}.attn_q.weight" in desc["tensors"]
        assert (has_ssm, has_attn) == (derived[n], not derived[n]), f"layer {n}"
        if arch == "qwen4exp":
            assert (f"blk.{n}.indexer.k_proj.weight" in desc["tensors"]) == (not derived[n]), f"layer {n}"


def test_every_tensor_has_the_documented_shape(converted):
    arch, cfg, desc = converted
    want = expected_layout(arch, cfg)
    got = {name: t.shape for name, t in desc["tensors"].items()}
    assert sorted(got) == sorted(want)
    bad = {n: (got[n], want[n][0]) for n in want if got[n] != want[n][0]}
    assert not bad, f"shape found vs documented: {bad}"


def test_bf16_keeps_documented_tensors_f32():
    arch = "qwen4exp"
    cfg = hf_models.tiny_config(arch)
    desc = describe(reference_gguf(arch, "bf16"))
    assert desc["metadata"]["general.file_type"].value == 32
    want = expected_layout(arch, cfg)
    wrong = {n: t.ggml_type for n, t in desc["tensors"].items() if t.ggml_type != (F32 if want[n][1] else BF16)}
    assert not wrong, f"unexpected ggml types: {wrong}"


def test_qwen4exp_ple_shard_and_hash_constants():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import _build_layer_multipliers

    cfg = hf_models.tiny_config("qwen4exp")
    paths = reference_gguf("qwen4exp", "f32")
    assert [p.name for p in paths] == ["tiny-qwen4exp-f32-00001-of-00002.gguf", "tiny-qwen4exp-f32-00002-of-00002.gguf"]
    desc = describe(paths)
    assert [n for n, t in desc["tensors"].items() if t.file == 1] == ["per_layer_token_embd.weight"]
    assert set(desc["file_metadata"][1]) == {"split.no", "split.count", "split.tensors.count"}
    assert desc["file_metadata"][1]["split.no"].value == 1
    assert desc["metadata"]["split.tensors.count"].value == len(desc["tensors"])

    md = desc["metadata"]
    (ple_id,) = cfg["ple_layer_ids"]
    assert md["qwen4exp.ple.layers"].value == [ple_id - 1]
    mult = md["qwen4exp.ple.layer_multipliers"]
    assert mult.type == "ARRAY[UINT64]"
    assert mult.value == [int(x) for x in _build_layer_multipliers(cfg["vocab_size"], cfg["ngram_size"], 0, cfg["seed"])]
    assert max(mult.value) > 2**53  # the trap: a float read would round these

    # the known converter trap (docs/gguf-layout.md section 5): QSA layers, zero ratios
    assert md["qwen4exp.attention.compress_ratios"].value == [0] * cfg["num_hidden_layers"]
    assert md["qwen4exp.attention.indexer.top_k"].value == cfg["indexer_budget"]


def test_documented_value_transformations(converted):
    arch, cfg, desc = converted
    hf = _checkpoint_tensors(arch)
    nk, nv, dk, dv = (cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                       "linear_key_head_dim", "linear_value_head_dim"))
    r = nv // nk
    # GGUF v-head p holds HF v-head (p % nk) * r + p // nk
    src = np.array([(p % nk) * r + p // nk for p in range(nv)])
    la = "model.layers.0.linear_attn."
    # torch's and numpy's exp may differ in the last bit
    np.testing.assert_allclose(_read_f32(desc, "blk.0.ssm_a"), -np.exp(hf[la + "A_log"])[src], rtol=1e-6, atol=0)
    np.testing.assert_array_equal(_read_f32(desc, "blk.0.ssm_dt.bias"), hf[la + "dt_bias"][src])
    qkv = _read_f32(desc, "blk.0.attn_qkv.weight")
    hf_qkv = hf[la + "in_proj_qkv.weight"]
    kd = nk * dk
    np.testing.assert_array_equal(qkv[:2 * kd], hf_qkv[:2 * kd])
    hf_v = hf_qkv[2 * kd:].reshape(nv, dv, -1)
    np.testing.assert_array_equal(qkv[2 * kd:].reshape(nv, dv, -1), hf_v[src])
    out = _read_f32(desc, "blk.0.ssm_out.weight")
    np.testing.assert_array_equal(out.reshape(-1, nv, dv), hf[la + "out_proj.weight"].reshape(-1, nv, dv)[:, src])
    np.testing.assert_array_equal(_read_f32(desc, "blk.0.ssm_norm.weight"), hf[la + "norm.weight"])
    full = cfg["full_attention_interval"] - 1
    sa = f"model.layers.{full}.self_attn."
    np.testing.assert_allclose(_read_f32(desc, f"blk.{full}.attn_q_norm.weight"), hf[sa + "q_norm.weight"] + 1,
                               rtol=0, atol=0)
    if arch == "qwen4exp":
        qk = hf[sa + "indexer.index_qk_proj.weight"]
        nq = cfg["indexer_n_heads"] * cfg["indexer_head_dim"]
        np.testing.assert_array_equal(_read_f32(desc, f"blk.{full}.indexer.k_proj.weight"), qk[nq:])
        np.testing.assert_array_equal(_read_f32(desc, "blk.0.hc_attn_norm.weight"),
                                      hf["model.layers.0.attn_hyper_connection.hc_norm.weight"] + 1)
        shards = [hf[f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{i}.weight"]
                  for i in range(cfg["split_ngram_parts"])]
        np.testing.assert_array_equal(_read_f32(desc, "per_layer_token_embd.weight"), np.concatenate(shards))
    else:
        np.testing.assert_array_equal(_read_f32(desc, "output_norm.weight"), hf["model.norm.weight"] + 1)


def test_checkpoint_config_mirrors_the_release():
    cfg = json.loads((reference_checkpoint("qwen4exp", 0) / "config.json").read_text(encoding="utf-8"))
    # the released config says "full_attention"; that word is what the converter then never sees
    assert cfg["layer_types"].count("full_attention") == cfg["num_hidden_layers"] // cfg["full_attention_interval"]


@pytest.mark.parametrize("arch", hf_models.ARCHS)
def test_every_component_moves_the_logits(arch):
    import torch

    model = hf_models.load_model(reference_checkpoint(arch, 0))
    # 32 tokens: 8 complete QSA blocks of 4, of which the indexer keeps 2
    ids = torch.randint(len(hf_models.SPECIAL_TOKENS), hf_models.VOCAB_SIZE, (1, 32),
                        generator=torch.Generator().manual_seed(1))
    effects = hf_models.ablation_effects(model, ids)
    weak = {k: round(v, 4) for k, v in effects.items() if v < 0.03}
    assert not weak, f"components whose removal moves the logits by < 3%: {weak} (all: {effects})"
