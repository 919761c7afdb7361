"""The GPU engine's memory plan (engine/budget.py) and strata-budget.

Numbers are checked against arithmetic written out here from the block layouts (bytes per block over
elements per block, as ggml-common.h defines them) and the geometry, on a seed-4l plan (the
production widths, 4 layers) built from tools/synth.py's type plan without writing any file, and
against the seed's figures where it gives them. Terms are compared one by one, not as totals: an
error that tightens a budget passes every total-based check (seed round 194).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from strata.engine import budget as B
from strata.engine.budget import Budget, BudgetOptions, plan_budget
from strata.engine.kvcache import KV_TYPES, kv_bytes_per_token
from strata.engine.qsa import indexer_key_bytes, pooled_block_bytes
from strata.engine.kernels.engine_form import placed_bytes
from strata.index_format import geometry as G
from strata.index_format.geometry import tensor_specs
from strata.index_format.native_experts import NativeExperts, blob_bytes_for
from strata.index_format.pack_index import PackIndex

MIB, GIB = 1 << 20, 1 << 30


# --- a seed-4l plan, no files ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def seed4l():
    from strata.tools.synth import plan_model

    plan = plan_model("qwen4exp", "seed-4l")
    g = plan.geometry
    types = {t.name: t.ggml for t in plan.tensors}
    index = PackIndex.build("m.gguf", [(s.name, types[s.name].id, s.shape) for s in tensor_specs(g) if s.in_pool])
    rows, off = [], 0
    for l in range(g.n_layer):
        gu, d = types[f"blk.{l}.ffn_gate_exps.weight"], types[f"blk.{l}.ffn_down_exps.weight"]
        size = blob_bytes_for(gu.id, d.id, g.n_embd, g.n_ff_exp) * g.n_expert
        rows.append((l, gu.id, d.id, size // g.n_expert, off, off + size, off + 2 * size, None))
        off += 3 * size
    return index, NativeExperts.build("m.gguf", g.n_expert, rows), g


def tiny_qwen35moe(mtp: bool = False):
    """synth's tiny qwen35moe as a pack would index it, no files -> (index, experts, geometry); `mtp`:
    with the MTP block (its experts are layer n_layer's)."""
    from strata.tools.synth import plan_model

    p = plan_model("qwen35moe", "tiny", mtp=mtp)
    g = p.geometry
    types = {t.name: t.ggml for t in p.tensors}
    index = PackIndex.build("m.gguf", [(s.name, types[s.name].id, s.shape) for s in tensor_specs(g) if s.in_pool])
    rows = [(l, types[f"blk.{l}.ffn_gate_exps.weight"].id, types[f"blk.{l}.ffn_down_exps.weight"].id,
             blob_bytes_for(types[f"blk.{l}.ffn_gate_exps.weight"].id, types[f"blk.{l}.ffn_down_exps.weight"].id,
                            g.n_embd, g.n_ff_exp), 8 * 10**9 * l, 8 * 10**9 * l + 10**9, 8 * 10**9 * l + 2 * 10**9, None)
            for l in range(g.n_layer + (1 if mtp else 0))]
    return index, NativeExperts.build("m.gguf", g.n_expert, rows), g


def plan(seed4l, free=None, **opts) -> Budget:
    index, experts, g = seed4l
    return plan_budget(index, experts, g, BudgetOptions(**{"max_context": 32768, **opts}), free_bytes=free)


def test_dense_weights_by_category_by_hand(seed4l):
    b = plan(seed4l)
    # the one QSA layer (3): attn_q IQ4_NL [2560, 2*24*256], attn_k/attn_v Q8_0 [2560, 2*256], attn_output Q5_0 [6144, 2560]
    q, kv, o = 2560 * 12288, 2560 * 512, 6144 * 2560
    assert b.item("weights.attention").bytes == q // 32 * 18 + 2 * (kv // 32 * 34) + o // 32 * 22 == 31_293_440
    # the indexer's q_proj [2560, 4*128] and k_proj [2560, 128] are BF16: 2 bytes in the engine (F32 in the pack)
    assert b.item("weights.indexer").bytes == (2560 * 512 + 2560 * 128) * 2
    # LM head Q8_0 [2560, 248320]: 34 bytes per 32 as the GGUF holds it, plus a 2-byte wider scale per block
    head_blocks = 2560 * 248320 // 32
    assert b.item("weights.head").bytes == head_blocks * 34 == 675_430_400
    assert b.item("weights.head").stage == B.WEIGHTS  # S7: THE HEAD BEFORE THE CACHE is sized
    # routers: BF16 ffn_gate_inp [2560, 512] + ffn_gate_inp_shexp [2560, 1], per layer
    assert b.item("weights.router").bytes == 4 * (2560 * 512 + 2560) * 2
    # the embedding stays on the host, rows read from the mapped pool in pack form: Q5_0, 22 bytes per 32
    assert b.item("host.embedding").bytes == 2560 * 248320 // 32 * 22 and b.item("host.embedding").where == B.HOST
    # ... which widened (24 per 32) is the seed's 0.444 GiB embedding (seed 6.3)
    assert round(2560 * 248320 // 32 * 24 / GIB, 3) == 0.444


def test_widened_scales_are_two_bytes_per_fp16_scale(seed4l):
    index, _, g = seed4l
    b = plan(seed4l)
    # every fp16-scaled block in the pool gets 2 more bytes; the BF16 sources (F32 in the pack) none; the
    # embedding stays on the host unwidened. Counted from the tensors' types and shapes here:
    per_block_scales = {"Q4_0": 1, "Q5_0": 1, "Q8_0": 1, "IQ4_NL": 1, "IQ4_XS": 1, "Q2_0": 1, "IQ3_XXS": 1,
                        "IQ2_XS": 1, "IQ2_XXS": 1, "F32": 0, "F16": 0, "BF16": 0}
    elems_per_block = {"Q2_0": 64, "IQ4_XS": 256, "IQ3_XXS": 256, "IQ2_XS": 256, "IQ2_XXS": 256}
    want = 0
    for t in index.tensors:
        if t.name == "token_embd.weight" or t.src.name == "BF16":
            continue
        want += int(np.prod(t.shape)) // elems_per_block.get(t.src.name, 32 if per_block_scales[t.src.name] else 1) \
            * per_block_scales[t.src.name] * 2
    assert b.item("weights.widened_scales").bytes == want
    # and the engine form the index records (engine_nbytes) is exactly the dense items plus the widening
    # plus the alignment of the placed planes; the vectors and conv kernels stay on the host
    dense = sum(i.bytes for i in b.items if i.key.startswith("weights.") and i.key != "weights.alignment")
    small = [t for t in index.tensors if len(t.shape) == 1 or t.name.endswith("conv1d.weight")]
    assert small and b.item("host.small").bytes == sum(t.engine_nbytes for t in small)
    assert b.item("host.small").where == B.HOST
    assert dense + b.item("host.small").bytes == sum(t.engine_nbytes for t in index.tensors if t.name != "token_embd.weight")
    assert 0 <= b.item("weights.alignment").bytes < 256 * 2 * (len(index.tensors) - len(small))


def test_expert_slot_is_the_largest_expert_in_engine_form(seed4l):
    _, experts, g = seed4l
    # the seed's two layers: IQ2_XS + IQ4_NL = 1,868,800 B, IQ2_XXS + Q2_0 = 1,305,600 B
    assert [e.blob_bytes for e in experts.layers[:2]] == [1_868_800, 1_305_600]
    # layer 2: IQ3_XXS gate/up (98 B per 256 -> 100 widened) + IQ4_NL down (18 per 32 -> 20)
    native = 2 * 2560 * 640 // 256 * 98 + 640 * 2560 // 32 * 18
    engine = 2 * 2560 * 640 // 256 * 100 + 640 * 2560 // 32 * 20
    b = plan(seed4l)
    assert (b.slot_bytes, b.max_blob) == (engine, native) == (2_304_000, 2_176_000)


def production_geometry(seed4l):
    _, _, g = seed4l
    return dataclasses.replace(g, n_layer=48)  # 12 QSA layers at 3, 7, ..., 47 (BRIEF section 2)


def test_kv_cache_at_the_seeds_production_settings(seed4l):
    g = production_geometry(seed4l)
    assert len(g.full_attention_layers) == 12
    C = 262144
    # f16: K and V, 2 KV heads x 256, 2 bytes; int8: 1 byte + an f32 scale per 32 elements of a head
    assert 12 * C * kv_bytes_per_token(g, "f16") == 12 * C * 2 * 2 * 256 * 2 == 6 * GIB
    assert 12 * C * kv_bytes_per_token(g, "int8") == 12 * C * 2 * 2 * (256 + 8 * 4) == 3_623_878_656
    with pytest.raises(ValueError, match="head_dim 48 is not a multiple"):
        kv_bytes_per_token(dataclasses.replace(g, head_dim=48, n_rot=16), "int8")


def test_indexer_key_store_is_one_key_head_round_194(seed4l):
    index, experts, g4 = seed4l
    C = 32768
    b = plan(seed4l, max_context=C)
    one_head = C * 128 * 4  # indexer.k_proj is [2560, 128]: ONE shared key head per token, f32
    four_heads = C * g4.idx_n_heads * 128 * 4  # round 194: sized from the 4 QUERY heads
    assert g4.idx_n_heads == 4 and b.item("session.indexer_keys").bytes == one_head != four_heads
    # the term follows the key dim, never the query head count
    for heads in (1, 8):
        g = dataclasses.replace(g4, idx_n_heads=heads)
        assert indexer_key_bytes(g, C) == one_head
    # the CPU engine's cache (engine/qsa.py) holds the same single head
    from strata.engine.qsa import QSACache

    cpu = QSACache.for_geometry(g4, C)
    assert cpu.idx_keys.nbytes == indexer_key_bytes(g4, C)
    for kv in KV_TYPES:  # the CPU KV cache is the plan's, kind by kind (engine/kvcache.py)
        assert QSACache.for_geometry(g4, C, kv).kv.nbytes == C * kv_bytes_per_token(g4, kv)
    assert cpu.idx_blocks.nbytes + C // 64 * 4 == pooled_block_bytes(g4, C)  # + one f32 score per block


def test_session_states_match_the_cpu_engines(seed4l):
    _, _, g = seed4l
    from strata.engine.ple import PLEState

    from strata.engine.model import conv_state_bytes, gdn_state_bytes
    from strata.engine.ple import ple_state_bytes

    assert PLEState.for_geometry(g).ring.nbytes == ple_state_bytes(g)
    assert gdn_state_bytes(g) == 48 * 128 * 128 * 4  # S [nv, dv, dk] f32
    assert conv_state_bytes(g) == 3 * 10240 * 4  # the last d_conv - 1 inputs of 2*128*16 + 128*48 channels


def test_stages_and_slots_by_hand(seed4l):
    free = 4 * GIB
    b = plan(seed4l, free=free, kv="int8")
    stage1 = sum(i.bytes for i in b.items if i.stage == B.WEIGHTS and i.where == B.DEVICE)
    assert b.free_at_open == free - stage1
    want = (free - stage1 - (700 + 330) * MIB) // 2_304_000  # S8: (free - reserve) / max_blob
    assert 0 < want < 2048 and b.slots == want
    assert b.item("cache.slots").bytes == want * 2_304_000 and b.item("cache.slots").count == want
    assert b.auto_line == (f"expert cache auto: {(free - stage1) / GIB:.2f} GiB free, 1030 MiB reserved "
                           f"(+0 MiB for the draft head) -> {want} slots")
    used = [b.used_after(s) for s in B.STAGES]
    assert used == sorted(used) and used[-1] == b.device_bytes() and used[0] == stage1
    assert b.final_free == free - b.device_bytes() and not b.problems
    # everything after the cache comes out of the reserve
    after = sum(i.bytes for i in b.items if i.where == B.DEVICE and B.STAGES.index(i.stage) >= 2)
    assert after <= b.reserve.bytes
    # the engine sizes the cache from what it MEASURES at that point, through the same arithmetic
    assert b.slots_for(b.free_at_open).slots == want
    assert b.slots_for(b.free_at_open - 10 * 2_304_000).slots == want - 10
    assert b.item("session.kv").each == 32768 * 2 * 2 * (256 + 32)  # one QSA layer, int8
    # a big card holds every pair, and a profile caps the slots at its pairs (S8)
    assert plan(seed4l, free=64 * GIB).slots == 4 * 512
    assert plan(seed4l, free=64 * GIB, profile_pairs=77).slots == 77


def test_prompt_chunk_and_draft_head_in_the_reserve(seed4l):
    b = plan(seed4l, free=64 * GIB, prefill_chunk=512, draft_bind_bytes=150 * MIB, spec=4)
    assert b.item("prompt.chunk").bytes == (160 + 512 * 680 // 1024) * MIB
    assert b.reserve.bytes == (700 + 500) * MIB + 150 * MIB
    assert b.item("draft.bind").bytes == 150 * MIB and b.item("verify.logits").bytes == 5 * 248320 * 4
    none = plan(seed4l, free=64 * GIB, prefill_chunk=0)
    assert none.item("prompt.chunk").bytes == 0 and none.item("draft.bind").bytes == 0
    assert none.item("verify.logits").bytes == 0 and none.reserve.bytes == 700 * MIB


def test_the_dense_gemm_slab_and_cublas_are_planned_for_the_device_steps_prompt(seed4l, monkeypatch):
    """The device step's prompt multiplies its dense products through cuBLAS (gpu.gemm_products):
    its weight slab and what cuBLAS allocates are stage-6 items; none for the host-driven step,
    without a prompt path, or with STRATA_GEMM=off (gpu.GEMM_FROM 0)."""
    from strata.engine.kernels import gpu

    b = plan(seed4l, free=64 * GIB, device_step=True)
    assert b.item("prompt.gemm").bytes == gpu.GEMM_SLAB_BYTES and b.item("prompt.gemm").stage == B.HEAD_PROMPT
    assert b.item("prompt.cublas").bytes == B.CUBLAS_BYTES > 0
    off = plan(seed4l, free=64 * GIB, device_step=True, prefill_chunk=0)
    assert off.item("prompt.gemm").bytes == off.item("prompt.cublas").bytes == 0
    assert plan(seed4l, free=64 * GIB).item("prompt.gemm").bytes == 0  # the host-driven step
    held = plan(seed4l, free=64 * GIB, device_step=True, cublas_held=True)  # (an earlier tier of the process made it)
    assert held.item("prompt.cublas").bytes == 0 and held.item("prompt.gemm").bytes == gpu.GEMM_SLAB_BYTES
    monkeypatch.setattr(gpu, "GEMM_FROM", 0)
    assert plan(seed4l, free=64 * GIB, device_step=True).item("prompt.cublas").bytes == 0


def test_the_streamed_experts_staging_is_two_slots_on_the_device_and_two_pinned(seed4l):
    b = plan(seed4l, free=64 * GIB)
    dev, pinned = b.item("stream.staging"), b.item("stream.pinned")
    assert (dev.bytes, dev.count, dev.stage, dev.where) == (2 * 2_304_000, 2, B.HEAD_PROMPT, B.DEVICE)
    assert (pinned.bytes, pinned.count, pinned.stage, pinned.where) == (2 * 2_304_000, 2, B.HEAD_PROMPT, B.HOST)
    # in the stage's figure and out of the reserve, beside the chunk buffers
    assert b.used_after(B.HEAD_PROMPT) - b.used_after(B.CACHE_GRAPHS) == \
        b.item("head.logits").bytes + b.item("prompt.chunk").bytes + 2 * 2_304_000
    for off in (plan(seed4l, free=64 * GIB, stream_experts=False), plan(seed4l, free=64 * GIB, prefill_chunk=0)):
        assert off.item("stream.staging").bytes == 0 and off.item("stream.pinned").bytes == 0
        assert b.device_bytes() - off.device_bytes() == 2 * 2_304_000 + b.item("prompt.chunk").bytes - off.item("prompt.chunk").bytes


def test_explicit_slots_that_do_not_fit_are_refused_with_both_numbers(seed4l):
    ok = plan(seed4l, free=8 * GIB, expert_cache=100)
    assert ok.slots == 100 and not ok.problems
    big = plan(seed4l, free=4 * GIB, expert_cache=2000)
    assert big.slots == 2000 and len(big.problems) == 1
    room = big.free_at_open - 1030 * MIB
    text = big.problems[0]
    assert f"{2000 * 2_304_000 / MIB:.1f} MiB" in text and f"{room / MIB:.1f} MiB" in text
    assert f"at most {room // 2_304_000} slots fit" in text
    with pytest.raises(B.ExpertCacheTooBig):
        B.check_explicit_slots(2000, big.free_at_open, 1030 * MIB, 2_304_000)


def test_reserve_adapts_on_a_small_card():
    o = BudgetOptions(max_context=4096)
    slot, after = 2 * MIB, 360 * MIB  # after the cache: the 330 MiB chunk buffers and 30 MiB more
    lend = 165  # slots a 256-token chunk's 330 MiB of buffers take
    big = B.adapt_reserve(4 * GIB, o, slot, after, 10_000)
    assert not big.adapted and big.bytes == 1030 * MIB
    # 1.2 GiB at the cache: 700 + 330 MiB leave 98 slots, fewer than the 165 the prompt path would borrow
    free = 1229 * MIB
    r = B.adapt_reserve(free, o, slot, after, 10_000)
    assert r.adapted and r.headroom_mib == 1229 - 330 - 330 and (free - r.bytes) // slot == lend
    # never below what the allocations after the cache need beyond the chunk buffers (30 MiB)
    tiny = B.adapt_reserve(500 * MIB, o, slot, after, 10_000)
    assert tiny.headroom_mib == 30 and tiny.prefill_mib == 330
    # a model with fewer pairs than that: the cache only needs to hold them all
    assert not B.adapt_reserve(free, o, slot, after, 50).adapted  # 99 slots fit already
    few = B.adapt_reserve(1060 * MIB, o, slot, after, 50)  # 15 fit: cut the headroom to hold 50
    assert few.headroom_mib == 1060 - 100 - 330 and (1060 * MIB - few.bytes) // slot == 50
    # no prompt path: nothing to lend to
    assert not B.adapt_reserve(free, dataclasses.replace(o, prefill_chunk=0), slot, after, 10_000).adapted


def test_low_warning_below_256_mib():
    assert B.low_memory_warning(256 * MIB) is None
    assert B.low_memory_warning(256 * MIB - 1).startswith("LOW: 255 MiB of device memory free")
    assert B.low_memory_warning(5 * MIB).startswith("LOW: 5 MiB")
    assert B.low_memory_warning(-3 * MIB).startswith("LOW: the plan needs 3.0 MiB more")


def test_small_card_plan_warns(seed4l):
    b0 = plan(seed4l, free=0)
    stage1 = -b0.free_at_open
    b = plan(seed4l, free=stage1 + 900 * MIB)
    assert b.reserve.adapted and b.slots == -(-330 * MIB // 2_304_000)
    assert any("small card" in w for w in b.warnings) and any(w.startswith("LOW") for w in b.warnings)
    assert plan(seed4l, free=stage1 - MIB).problems  # the weights and session alone do not fit


def test_qwen35moe_has_no_qsa_hc_or_ple_terms(seed4l):
    index, experts, g = tiny_qwen35moe()
    b = plan_budget(index, experts, g, BudgetOptions(max_context=64))
    keys = {i.key for i in b.items}
    assert not keys & {"session.indexer_keys", "session.ple_state", "weights.hyper_connection", "host.ple_table"}
    assert b.item("session.stream").bytes == g.n_embd * 4 and b.slots is None


# --- strata-budget on a real (tiny) pack ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    from strata.tools.pack import convert
    from strata.tools.synth import get_preset, synth

    d = tmp_path_factory.mktemp("tiny")
    shards = synth("qwen4exp", "tiny", d / "m.gguf", seed=1)
    convert([shards[0]], d / "pack", compress_ratio=get_preset("tiny").compress_ratio)
    return d / "pack"


def make_profile(pack: Path, path: Path, fingerprint: str | None = None) -> None:
    from strata.index_format.expert_profile import write_expert_profile
    from strata.index_format.manifest import pack_fingerprint
    from strata.index_format.routing_trace import RoutingTrace

    rng = np.random.default_rng(4)
    ids = np.array([rng.choice(16, 4, replace=False, p=np.arange(16, 0, -1) / 136) for _ in range(50 * 8)]).reshape(50, 8, 4)
    write_expert_profile(path, RoutingTrace(fingerprint or pack_fingerprint(pack), 16, ids).to_profile())


def test_cli_reports_the_plan_with_a_profile_and_plots(tiny_pack, tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs the plot extra (pip install 'strata[plot]')")
    from strata.engine.expert_plan import expected_hit_rate
    from strata.index_format.expert_profile import read_expert_profile
    from strata.tools.budget_cli import main

    prof = tmp_path / "expert-profile.bin"
    make_profile(tiny_pack, prof)
    png = tmp_path / "hit.png"
    code = main([str(tiny_pack), "--free-mib", "1100", "--max-context", "512", "--kv", "int8",
                 "--expert-profile", str(prof), "--plot", str(png)])
    out = capsys.readouterr()
    assert code == 0, out.err
    p = read_expert_profile(prof)
    assert "PROFILE, ranked by routing frequency, no eviction." in out.out
    line = next(l for l in out.out.splitlines() if l.startswith("expert cache auto:"))
    slots = int(line.split("-> ")[1].split()[0])
    assert line.endswith(f"-> {slots} slots") and slots == min(p.pairs, 128)
    assert f"expected hit rate at {slots} slots: {100 * expected_hit_rate(p, slots):.1f}%" in out.out
    for name in ("QSA indexer key store", "KV cache (int8, 512 tokens)", "embedding table", "widened scales"):
        assert name in out.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert not list(tmp_path.glob("*.tmp-*"))


def test_cli_refuses_a_profile_of_another_pack(tiny_pack, tmp_path, capsys):
    from strata.index_format.manifest import pack_fingerprint
    from strata.tools.budget_cli import main

    other = "pk1-" + "0" * 64
    make_profile(tiny_pack, tmp_path / "p.bin", fingerprint=other)
    assert main([str(tiny_pack), "--expert-profile", str(tmp_path / "p.bin")]) == 1
    err = capsys.readouterr().err
    assert other in err and pack_fingerprint(tiny_pack) in err


def test_cli_refusals(tiny_pack, tmp_path, capsys, monkeypatch):
    from strata.tools.budget_cli import main

    assert main([str(tiny_pack), "--free-mib", "400", "--expert-cache", "100000"]) == 1
    err = capsys.readouterr().err
    assert "--expert-cache 100000" in err and "would refuse to start" in err
    assert main([str(tiny_pack), "--vram-gib", "1", "--free-mib", "5"]) == 2
    assert main([str(tiny_pack), "--kv", "int4"]) == 1
    assert "--kv 'int4'" in capsys.readouterr().err
    prof = tmp_path / "p.bin"
    make_profile(tiny_pack, prof)
    import builtins

    real = builtins.__import__
    monkeypatch.setattr(builtins, "__import__",
                        lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name)) if name == "matplotlib" else real(name, *a, **k))
    assert main([str(tiny_pack), "--expert-profile", str(prof), "--plot", str(tmp_path / "x.png")]) == 2
    assert "pip install 'strata[plot]'" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_cli_plans_the_streamed_experts_staging_unless_streaming_is_off(tiny_pack, capsys):
    from strata.tools.budget_cli import main

    assert main([str(tiny_pack), "--free-mib", "4000"]) == 0
    on = capsys.readouterr().out
    assert main([str(tiny_pack), "--free-mib", "4000", "--stream-min-tokens", "off"]) == 0
    off = capsys.readouterr().out
    line = [l for l in on.splitlines() if "streamed experts' staging (2 slots)" in l]
    assert len(line) == 1 and line[0].split()[-1] != "0", on
    assert [l.split()[-1] for l in off.splitlines() if "streamed experts' staging" in l] == ["0"], off
    assert main([str(tiny_pack), "--stream-min-tokens", "0"]) == 1
    assert "--stream-min-tokens '0': expected auto, off or a number of tokens >= 1" in capsys.readouterr().err


def test_cli_without_free_memory_lists_the_fixed_items(tiny_pack, capsys):
    from strata.tools.budget_cli import main

    assert main([str(tiny_pack)]) == 0
    out = capsys.readouterr().out
    assert "slots: not planned (give --vram-budget-mib or --free-mib)" in out and "compulsory-miss" not in out


def test_strata_serves_other_sessions_are_host_items(seed4l):
    """--batch N: N - 1 more sessions beside the first; the conversation cache: at most its slots'
    sessions and at most its MiB (it evicts to stay under both), each session what the CPU engine
    measures (test_prefill.py: Session.memory equals session_host_bytes' items)."""
    _, _, g = seed4l
    one = B.session_host_bytes(g, 32768, "f16")
    b = plan(seed4l, batch=3, cache_slots=8, cache_mib=256)
    assert b.item("serve.batch").bytes == 2 * one and b.item("serve.batch").where == B.HOST
    # by hand: KV 32768 x 2 x 2 heads x 256 x 2 B = 67108864 (one QSA layer), GDN 3 x 48 x 128 x 128 x 4 =
    # 9437184, conv 3 x 3 x 10240 x 4 = 368640, indexer keys 32768 x 128 x 4 = 16777216, pooled blocks
    # 512 x 128 x 4 + 512 x 4 = 264192, PLE 9 x 10240 x 4 = 368640, stream 4 x 2560 x 4 = 40960
    # the MiB cap binds: 256 MiB hold 2 sessions of 32K f16 tokens (90 MiB each), not 8
    assert one == 67108864 + 9437184 + 368640 + 16777216 + 264192 + 368640 + 40960 and b.item("serve.conversation_cache").bytes == 2 * one
    roomy = plan(seed4l, batch=1, cache_slots=2, cache_mib=1 << 20)
    assert roomy.item("serve.conversation_cache").bytes == 2 * one
    keys = {i.key for i in plan(seed4l).items}
    assert not keys & {"serve.batch", "serve.conversation_cache"}  # strata generate's plan has neither
    assert b.host_bytes() - plan(seed4l).host_bytes() == 2 * one + b.item("serve.conversation_cache").bytes
    with pytest.raises(B.BudgetError, match="--batch 0"):
        plan(seed4l, batch=0)


def test_the_device_steps_serve_sessions_are_on_the_card_and_parked_ones_on_the_host(seed4l):
    """--gpu-step device --batch 3: the two sessions beside the first are device items (the same
    arrays, less the host's decoded embedding rows), placed with it at stage 1; the parked ones are
    host items as on the CPU (a finished session is copied down to park); with --spec 2, each of the
    three requests has its two snapshots of the states on the device."""
    _, _, g = seed4l
    host_one = B.session_host_bytes(g, 32768, "f16")
    one = B.session_device_bytes(g, 32768, "f16")
    # the same arrays: KV, GDN, conv, indexer keys, pooled blocks, PLE, stream (by hand above)
    assert one == 67108864 + 9437184 + 368640 + 16777216 + 264192 + 368640 + 40960 == host_one
    b = plan(seed4l, batch=3, cache_slots=8, cache_mib=256, device_step=True, spec=2)
    batch, parked = b.item("serve.batch"), b.item("serve.conversation_cache")
    assert (batch.bytes, batch.where, batch.stage, batch.count) == (2 * one, B.DEVICE, B.WEIGHTS, 2)
    assert (parked.bytes, parked.where) == (2 * host_one, B.HOST)
    snaps = b.item("verify.snapshots")
    assert (snaps.bytes, snaps.count) == (3 * 2 * B.snapshot_state_bytes(g), 6)
    alone = plan(seed4l, device_step=True, spec=2)
    assert b.device_bytes(B.WEIGHTS) - alone.device_bytes(B.WEIGHTS) == 2 * one


def test_spec_snapshots_and_the_mtp_heads_kv_are_host_items_per_request(seed4l):
    """--spec N: N snapshots per request (what a rollback restores: 3 GDN layers' S [48, 128, 128] and
    conv [3, 10240], one PLE ring [9, 4 x 2560], f32, and the routing counts i64 [4, 512]); a pack
    with an MTP block adds per request the head's KV (one attention layer's, the session's kind) and
    its input rows (f32 [max(chunk, 1 + N), 2560]). The sizes measured against a SpecRun's arrays:
    tests/engine/test_speculative.py."""
    _, _, g = seed4l
    snap = 3 * (48 * 128 * 128 * 4 + 3 * 10240 * 4) + 9 * 4 * 2560 * 4 + 4 * 512 * 8
    b = plan(seed4l, spec=2, batch=3, prefill_chunk=256)
    item = b.item("spec.snapshots")
    assert item.bytes == 3 * 2 * snap and item.count == 6 and item.where == B.HOST
    assert b.host_bytes() - plan(seed4l, batch=3, prefill_chunk=256).host_bytes() == 6 * snap  # no MTP block here
    assert "spec.snapshots" not in {i.key for i in plan(seed4l).items}
    assert B.spec_host_bytes(g, 4096, "f16", 2, True, 0) == 2 * snap + 4096 * kv_bytes_per_token(g, "f16") + 3 * 2560 * 4
    assert B.spec_host_bytes(g, 4096, "f16", 2, False, 0) == 2 * snap  # a reference drafter: no head


def test_a_pack_with_an_mtp_block_plans_the_heads_kv_per_request():
    index, experts, g = tiny_qwen35moe()
    o = BudgetOptions(max_context=512, kv="f16", spec=2, batch=3, prefill_chunk=64)
    assert "spec.mtp_kv" not in {i.key for i in plan_budget(index, experts, g, o).items}  # no MTP block
    b = plan_budget(index, experts, dataclasses.replace(g, n_mtp_layer=1), o)
    assert b.item("spec.mtp_kv").bytes == 3 * 512 * kv_bytes_per_token(g, "f16") and b.item("spec.mtp_kv").count == 3
    assert b.item("spec.head_input").bytes == 3 * 64 * g.n_embd * 4


def test_cli_plans_a_servers_sessions(tiny_pack, capsys):
    from strata.tools.budget_cli import main

    assert main([str(tiny_pack), "--batch", "4", "--conversation-cache-slots", "8"]) == 0
    out = capsys.readouterr().out
    assert "the other --batch sessions (3 x" in out and "conversation cache, at most (8 parked sessions" in out
    assert main([str(tiny_pack), "--batch", "0"]) == 1
    assert "--batch 0: expected at least 1" in capsys.readouterr().err
    assert main([str(tiny_pack), "--batch", "2", "--spec", "3"]) == 0
    assert "verify snapshots (3 x" in capsys.readouterr().out
    assert main([str(tiny_pack), "--spec", "-1"]) == 1
    assert "--spec -1: expected at least 0" in capsys.readouterr().err


def test_the_device_steps_rope_table_is_planned_with_the_weights(seed4l):
    """weights.rope: the device step's cos and sin at every position of the context (f32 [C, n_rot / 2]
    each, one table for the model's ropes), read at the device position so that a token stages no
    rope row; placed with the weights (startup carves it from their arena), only with the device step."""
    _, _, g = seed4l
    b = plan(seed4l, device_step=True)
    item = b.item("weights.rope")
    assert item.bytes == B.rope_table_bytes(g, 32768) >= 2 * 32768 * (g.n_rot // 2) * 4 > 0
    assert item.stage == B.WEIGHTS and item.where == B.DEVICE
    assert "weights.rope" not in [i.key for i in plan(seed4l).items]


def test_the_ple_table_goes_on_the_device_only_into_memory_no_slot_would_use(seed4l):
    """weights.ple_table (the PLE table in its bytes, its hash constants and rows: the run-ahead hashes
    the next token's n-grams on the device) and the embedding the run-ahead gathers from are placed
    with the device step only where the plan is otherwise the same: every slot auto gives without
    them (to the byte), an explicit --expert-cache N that still fits; else both stay on the host, and
    the plan's note says which and why (the startup prints it)."""
    from strata.engine.tier.device import PLE_ROW_TYPES

    index, experts, g = seed4l
    table = 24 * MIB  # about seed-4l's IQ4_NL table

    def ple_plan(free, type_id=20, **opts):
        return plan_budget(index, experts, g, BudgetOptions(max_context=32768, device_step=True, **opts), free_bytes=free,
                           ple_table_bytes=table, ple_table_type=type_id)

    assert B.PLE_TABLE_DEVICE_TYPES == PLE_ROW_TYPES
    big = ple_plan(64 * GIB)
    item = big.item("weights.ple_table")
    nl, Pn, Pd = len(g.ple_layers), g.ple_n_heads, g.ple_row_dim
    assert item.bytes == B.ple_table_device_bytes(g, table) >= table + 4 * nl * Pn * Pd + 8 * nl * (g.ple_ngram_size + 3 * Pn)
    assert (item.stage, item.where) == (B.WEIGHTS, B.DEVICE) and big.places("weights.embedding")
    assert big.slots == big.n_pairs and big.notes[0].startswith("PLE table on the device")
    # the edge: all the pairs' slots and the reserve, then exactly the table and the embedding
    host = ple_plan(64 * GIB, type_id=16)  # (IQ2_XXS: no device decoder)
    assert not host.places("weights.ple_table") and not host.places("weights.embedding")
    assert host.notes[0].startswith("PLE table on the host (its type 16 has no device decoder)")
    extra = item.bytes + big.item("weights.embedding").bytes
    edge = host.device_bytes(B.WEIGHTS) + host.reserve.bytes + host.n_pairs * host.slot_bytes + extra
    assert ple_plan(edge).places("weights.ple_table") and ple_plan(edge).slots == host.n_pairs
    short = ple_plan(edge - 1)
    assert not short.places("weights.ple_table") and not short.places("weights.embedding")
    assert short.slots == host.n_pairs and short.notes[0].startswith("PLE table on the host (") and "slots" in short.notes[0]
    small = ple_plan(4 * GIB)  # fewer slots than pairs: the table would take some
    assert not small.places("weights.ple_table") and small.slots == ple_plan(4 * GIB, type_id=16).slots < small.n_pairs
    # an explicit --expert-cache N: placed where N still fits beside it and the reserve
    n = 100
    fits = host.device_bytes(B.WEIGHTS) + host.reserve.bytes + n * host.slot_bytes + extra
    assert ple_plan(fits, expert_cache=n).places("weights.ple_table")
    tight = ple_plan(fits - 1, expert_cache=n)
    assert not tight.places("weights.ple_table") and not tight.problems and tight.slots == n
    # not without the free memory, the table's bytes, or the device step
    assert ple_plan(None).notes[0].startswith("PLE table on the host (no free device memory")
    assert not ple_plan(None).places("weights.ple_table")
    none = plan_budget(index, experts, g, BudgetOptions(max_context=32768, device_step=True), free_bytes=64 * GIB)
    assert not none.places("weights.ple_table") and "not given" in none.notes[0]
    assert not plan(seed4l, free=64 * GIB).places("weights.ple_table") and not plan(seed4l, free=64 * GIB).notes


def test_a_layer_streamed_whole_takes_what_the_cache_and_the_reserve_leave(seed4l):
    """The device step's layer stream (engine/tier/staging.py LayerStream): two layers of 512 slots on
    the device, the device piece the GGUF's bytes land in (32 MiB, the two block types' byte maps of
    512 ints, the bad-scale marker) and three pinned 32 MiB pieces, at stage 6; planned only from
    what the cache and the reserve leave, so auto's slots are the same with it, and a card where it
    does not fit beside the cache says so in the notes."""
    lay_b, raw_b, pin_b = 2 * 512 * 2_304_000, 32 * MIB + 2 * 512 * 4 + 256, 3 * 32 * MIB
    b = plan(seed4l, free=8 * GIB, device_step=True, expert_cache=0)
    lay, raw, pin = b.item("stream.layers"), b.item("stream.raw"), b.item("stream.layer_pinned")
    assert (lay.bytes, lay.count, lay.stage, lay.where) == (lay_b, 2, B.HEAD_PROMPT, B.DEVICE)
    assert (raw.bytes, raw.stage, raw.where) == (raw_b, B.HEAD_PROMPT, B.DEVICE)
    assert (pin.bytes, pin.count, pin.stage, pin.where) == (pin_b, 3, B.HEAD_PROMPT, B.HOST)
    off = plan(seed4l, free=8 * GIB, device_step=True, expert_cache=0, stream_experts=False)
    assert b.device_bytes() - off.device_bytes() == lay_b + raw_b + 2 * 2_304_000  # (and the per-expert staging)
    auto = plan(seed4l, free=5 * GIB, device_step=True)  # auto: the cache takes all but the reserve
    assert 0 < auto.slots == plan(seed4l, free=5 * GIB, device_step=True, stream_experts=False).slots < auto.n_pairs
    assert auto.item("stream.layers").bytes == 0 and "do not fit beside the cache" in auto.item("stream.layers").name
    assert any("streams no layer's experts whole" in n for n in auto.notes)
    for none in (plan(seed4l, free=8 * GIB, expert_cache=0),  # the host-driven step
                 plan(seed4l, free=8 * GIB, device_step=True, expert_cache=0, prefill_chunk=0),
                 plan(seed4l, free=64 * GIB, device_step=True)):  # every pair resident
        assert none.item("stream.layers").bytes == none.item("stream.raw").bytes == none.item("stream.layer_pinned").bytes == 0
    assert "every pair is resident" in plan(seed4l, free=64 * GIB, device_step=True).item("stream.layers").name


def test_cli_plans_the_device_step_with_its_layer_stream(tiny_pack, capsys):
    """strata-budget --gpu-step device: the device step's items (its session on the card, the prompt's
    cuBLAS slab, the layer stream where it fits beside the cache) in the table; host (the default)
    plans none of them, and another step is refused."""
    from strata.tools.budget_cli import main

    assert main([str(tiny_pack), "--free-mib", "4000", "--expert-cache", "0", "--gpu-step", "device"]) == 0
    dev = capsys.readouterr().out
    assert main([str(tiny_pack), "--free-mib", "4000", "--expert-cache", "0"]) == 0
    host = capsys.readouterr().out
    row = lambda out, name: next(l for l in out.splitlines() if name in l)  # noqa: E731
    assert "(the host-driven step)" in row(host, "a layer streamed whole: its experts")
    assert "(" not in row(dev, "a layer streamed whole: its experts").split("slots)")[1]  # placed: no reason given
    assert "dense prompt products' f16 weight slab" in dev and "(the host-driven step" in row(host, "f16 weight slab")
    assert main([str(tiny_pack), "--gpu-step", "gpu"]) == 1
    assert "--gpu-step 'gpu': expected host or device" in capsys.readouterr().err
    # --stream-layer-tokens off: strata generate's layer stream off, so none of its buffers
    assert main([str(tiny_pack), "--free-mib", "4000", "--expert-cache", "0", "--gpu-step", "device",
                 "--stream-layer-tokens", "off"]) == 0
    assert "(--stream-layer-tokens off)" in row(capsys.readouterr().out, "a layer streamed whole: its experts")
    assert main([str(tiny_pack), "--gpu-step", "device", "--stream-layer-tokens", "0"]) == 1
    assert "--stream-layer-tokens '0': expected auto, off or a number of tokens >= 1" in capsys.readouterr().err


def test_the_mtp_head_drafting_on_the_device_is_planned_there():
    """--spec N with the MTP drafter on the device step (draft_device): the head's matrices are a stage-1
    item (weights.drafter, engine form, placed with the trunk's), its experts (a slot each), KV cache,
    rope table and rows are draft.bind at stage 7, which the reserve keeps free when the cache is sized;
    its KV is then no host item, and host.mtp keeps only what stays on the host (norm gains). Without
    the device step, or with a reference drafter, nothing of the head is on the card."""
    index, experts, g = tiny_qwen35moe(mtp=True)
    o = BudgetOptions(max_context=512, kv="f16", spec=2, prefill_chunk=64, device_step=True, draft_device=True)
    b = plan_budget(index, experts, g, o, free_bytes=8 * GIB)
    mats = B.draft_matrices(g)
    assert f"blk.{g.n_layer}.nextn.eh_proj.weight" in mats and f"blk.{g.n_layer}.attn_q.weight" in mats
    assert not any(n.endswith("norm.weight") for n in mats)
    by_name = {t.name: t for t in index.tensors}
    dense = sum(placed_bytes(by_name[n].engine_type, by_name[n].shape[0], by_name[n].shape[1]) for n in mats)
    assert b.item("weights.drafter").bytes == dense > 0 and b.item("weights.drafter").stage == B.WEIGHTS
    bind = b.item("draft.bind")
    assert bind.where == B.DEVICE and bind.stage == B.VERIFIER
    assert bind.bytes == g.n_expert * b.slot_bytes + 512 * kv_bytes_per_token(g, "f16") + 2 * 512 * (g.n_rot // 2) * 4 \
        + (g.n_vocab + g.n_embd) * 4
    assert b.reserve.draft_bind_bytes == bind.bytes  # (kept free when the cache is sized)
    keys = {i.key for i in b.items}
    assert "spec.mtp_kv" not in keys and "spec.head_input" in keys
    norms = sum(by_name[s.name].engine_nbytes for s in tensor_specs(g) if s.category == G.MTP and s.name not in mats)
    assert b.item("host.mtp").bytes == norms
    for off in (dataclasses.replace(o, device_step=False), dataclasses.replace(o, draft_device=False)):
        c = plan_budget(index, experts, g, off, free_bytes=8 * GIB)
        assert "weights.drafter" not in {i.key for i in c.items} and c.item("draft.bind").bytes == 0
        assert c.item("spec.mtp_kv").bytes == 512 * kv_bytes_per_token(g, "f16")
