"""The geometry contract (S2): derived layer kinds, semantic shape checks, clear errors."""

import dataclasses

import pytest

from strata.index_format.geometry import (
    EXPERT, GeometryError, ModelGeometry, check_compress_ratios, check_tensor_shapes, tensor_specs,
)


def production(**over) -> ModelGeometry:
    """BRIEF section 2's numbers (seed 6.2), PLE left out."""
    v = dict(
        arch="qwen4exp", n_vocab=248320, n_embd=2560, n_layer=48, full_attention_interval=4, rms_eps=1e-6,
        n_head=24, n_head_kv=2, head_dim=256, n_rot=64, rope_freq_base=1e7, rope_sections=(11, 11, 10, 0),
        ssm_d_conv=4, ssm_d_state=128, ssm_n_k_heads=16, ssm_n_v_heads=48, ssm_d_inner=6144,
        n_expert=512, n_expert_used=10, n_ff_exp=640, n_ff_shexp=640, hc=4, hc_lowrank=320,
        idx_n_heads=4, idx_head_dim=128, idx_top_k=2048, idx_compress_ratio=64,
    )
    v.update(over)
    return ModelGeometry(**v)


def test_production_numbers_are_derived_not_stored():
    g = production()
    assert g.full_attention_layers == tuple(range(3, 48, 4))
    assert len(g.linear_attention_layers) == 36
    assert g.ssm_conv_channels == 10240 and g.ssm_d_inner == 6144 and g.ssm_head_v_dim == 128
    specs = {s.name: s for s in tensor_specs(g)}
    # ONE shared indexer key head (round 194: sized from the 4 query heads it was 4x too big)
    assert specs["blk.3.indexer.k_proj.weight"].shape == (2560, 128)
    assert specs["blk.3.indexer.q_proj.weight"].shape == (2560, 4 * 128)
    assert g.idx_key_store_dim == 128
    assert specs["blk.0.ssm_conv1d.weight"].shape == (4, 10240)
    assert "blk.0.indexer.k_proj.weight" not in specs and "blk.3.attn_qkv.weight" not in specs
    assert specs["blk.7.ffn_gate_exps.weight"].shape == (2560, 640, 512)
    assert specs["blk.7.ffn_down_exps.weight"].category == EXPERT


def test_qwen35moe_has_norms_not_hyper_connections():
    g = production(arch="qwen35moe", hc=0, hc_lowrank=0, idx_n_heads=0, idx_head_dim=0, idx_top_k=0,
                   idx_compress_ratio=0, n_layer=8)
    names = {s.name for s in tensor_specs(g)}
    assert "output_norm.weight" in names and "blk.0.attn_norm.weight" in names
    assert not any("hc_" in n or "indexer" in n for n in names)


@pytest.mark.parametrize("field,value,match", [
    ("arch", "llama", "not supported"),
    ("n_head_kv", 5, "not a multiple"),
    ("ssm_n_v_heads", 40, "not a multiple of ssm_n_k_heads"),
    ("idx_top_k", 2000, "not a multiple of idx_compress_ratio"),
    ("n_expert_used", 600, "n_expert_used 600 > n_expert 512"),
    ("n_rot", 300, "n_rot 300"),
])
def test_impossible_geometry_is_refused(field, value, match):
    with pytest.raises(GeometryError, match=match):
        production(**{field: value})


def test_compress_ratio_array_is_checked_against_derived_kinds():
    g = production(compress_ratios=tuple(64 if l % 4 == 3 else 0 for l in range(48)))
    assert check_compress_ratios(g) == []
    zeros = production(compress_ratios=(0,) * 48)
    (msg,) = check_compress_ratios(zeros)
    assert "all zeros" in msg and "[3, 7," in msg
    shifted = production(compress_ratios=tuple(64 if l % 4 == 0 else 0 for l in range(48)))
    (msg,) = check_compress_ratios(shifted)
    assert "disagrees" in msg and "layers [0, 3, 4, 7" in msg


def test_shape_mismatch_names_tensor_found_and_required():
    g = production(n_layer=4)
    found = {s.name: s.shape for s in tensor_specs(g)}
    check_tensor_shapes(g, found, source="m.gguf")
    # the round-194 error: the key store sized from the query heads
    found["blk.3.indexer.k_proj.weight"] = (2560, 512)
    with pytest.raises(GeometryError, match=r"m.gguf: tensor blk.3.indexer.k_proj.weight has shape \[2560, 512\], the geometry requires \[2560, 128\]"):
        check_tensor_shapes(g, found, source="m.gguf")
    found = {s.name: s.shape for s in tensor_specs(g)}
    del found["blk.1.ssm_a"]
    with pytest.raises(GeometryError, match=r"tensor blk.1.ssm_a is missing \(required shape \[48\]\)"):
        check_tensor_shapes(g, found, source="m.gguf")
    found = {s.name: s.shape for s in tensor_specs(g)} | {"blk.0.mystery.weight": (3,)}
    with pytest.raises(GeometryError, match="does not know: \\['blk.0.mystery.weight'\\]"):
        check_tensor_shapes(g, found, source="m.gguf")


def test_values_round_trip_and_unknown_fields_are_refused():
    g = production(compress_ratios=(0,) * 48)
    assert ModelGeometry.from_values(g.to_values()) == g
    with pytest.raises(GeometryError, match="unknown geometry field"):
        ModelGeometry.from_values(g.to_values() | {"n_experts": 3})
    v = g.to_values()
    del v["n_embd"]
    with pytest.raises(GeometryError, match=r"missing geometry field\(s\) \['n_embd'\]"):
        ModelGeometry.from_values(v)
    assert dataclasses.is_dataclass(g)


def test_recurrent_layers_array_must_match_derived_kinds():
    from strata.index_format.geometry import check_layer_arrays

    ok = production(recurrent_layers=tuple(0 if l % 4 == 3 else 1 for l in range(48)))
    assert check_layer_arrays(ok) == []
    bad = production(recurrent_layers=(1,) * 48)
    with pytest.raises(GeometryError, match=r"recurrent_layers disagrees .* at layers \[3, 7,"):
        check_layer_arrays(bad)
