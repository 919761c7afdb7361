"""Conformance with llama.cpp's own toolchain: its converter, its quantizer, its logits.

Tiny models of BOTH architectures (tests/reference/hf_models.py, made wide enough for 256-element
blocks as in test_quantized_reference.py) are converted to F32 by llama.cpp's converter and
quantized by llama.cpp's `llama_model_quantize` in every type a released mix uses
(tests/reference/llama_cpp_ref.py MIXES). Each file is then
- packed and run by Strata (teacher-forced prompt, every position's logits),
- run by llama.cpp (the same file, the same tokens, one batch),
- and both are compared with transformers in float64 holding that file's dequantized weights
  (tests/reference/quantized.py; float activations: the exact model of the file).
Error = ||logits - reference|| / ||reference|| over all positions of N_PROMPTS prompts. Asserted
per file: Strata's error is at most MAX_RATIO x llama.cpp's. The table is printed (-s) and recorded in
docs/conformance.md.

Runs where llama_cpp is reachable (STRATA_LLAMA_PYTHON, or importable here: see llama_cpp_ref);
elsewhere every test skips, saying why.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference import convert, hf_models, llama_cpp_ref  # noqa: E402
from reference.float64 import float64_casts, float64_model  # noqa: E402
from reference.quantized import load_dequantized, place_tensors  # noqa: E402

from strata.engine.kernels import cpu  # noqa: E402
from strata.engine.model import Model  # noqa: E402
from strata.engine.pack_reader import Pack  # noqa: E402
from strata.tools.gguf_io import read_gguf  # noqa: E402

pytestmark = pytest.mark.reference

PYTHON, WHERE = llama_cpp_ref.llama_python()
if PYTHON is None:
    pytest.skip(WHERE, allow_module_level=True)

MODEL_SEED = 0
PROMPT_SEED = 3
N_PROMPTS, PROMPT_LENGTH = 6, 16  # several prompts: one prompt's error is one draw of a chaotic quantity
# No worse than llama.cpp on any file. With 8-bit activations for the types llama.cpp reads as
# Q8_0 the two engines were level within noise (0.97-1.06x); with the wide form (actq.ActQ16) for
# their query/key projections every file measured 0.55-0.86x (docs/conformance.md).
MAX_RATIO = 1.0
# Wide enough for 256-element blocks (test_quantized_reference.py's models), and with NO discrete
# choice left: every expert is used (top-4 of 4) and qwen4exp's QSA budget (64 tokens) covers the
# prompt. BRIEF section 5 asks for top-k gaps clearly above the noise; here the noise is 8-bit
# activation quantization (~1e-2 of the router logits), and over 24 positions x 4 layers no top-4
# boundary stays clear of it: with top-4 of 16, each file had 3 to 13 (layer, position) pairs
# routed differently from the reference, and a single flipped expert set moved one engine's error
# by 2-5x at that position, so the ratio measured which engine flipped, not its arithmetic. The
# top-k and QSA selections themselves are held to float32 noise by test_quantized_reference.py.
# Four experts, not 16: with all 16 used, zeroing one moved qwen4exp's logits by only 1.7%.
CHOICE_FREE = dict(num_experts=4, num_experts_per_tok=4)
WIDE = dict(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=96, num_hidden_layers=4)
OVERRIDES = {"qwen35moe": dict(WIDE, **CHOICE_FREE),
             "qwen4exp": dict(WIDE, **CHOICE_FREE, hc_lowrank=32, indexer_budget=64)}
ARCHS = ("qwen35moe", "qwen4exp")
RESULTS: dict[tuple[str, str], dict] = {}


def _modeling(arch: str):
    if arch == "qwen35moe":
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mod
    else:
        from transformers.models.qwen4_exp import modeling_qwen4_exp as mod
    return mod


@contextlib.contextmanager
def _one_thread():
    before_cpu, before_torch = cpu.get_threads(), torch.get_num_threads()
    cpu.set_threads(1)
    try:
        yield
    finally:
        cpu.set_threads(before_cpu)
        torch.set_num_threads(before_torch)


def _prompts() -> np.ndarray:
    return np.random.default_rng(PROMPT_SEED).integers(3, hf_models.VOCAB_SIZE, size=(N_PROMPTS, PROMPT_LENGTH))


def _strata(gguf, out, arch, prompts) -> np.ndarray:
    from strata.tools import pack as tools_pack

    ratio = hf_models.tiny_config(arch, **OVERRIDES[arch]).get("indexer_compress_ratio")
    tools_pack.convert([gguf], out, compress_ratio=ratio)
    model = Model(Pack.open(out))
    logits = np.empty(prompts.shape + (model.geometry.n_vocab,), np.float32)
    with _one_thread():
        for i, prompt in enumerate(prompts):
            s = model.new_session(len(prompt))
            for pos, tok in enumerate(prompt):
                logits[i, pos] = model.step(s, int(tok))
    return logits


def _reference(arch, gguf, prompts) -> np.ndarray:
    """transformers in float64 with `gguf`'s dequantized weights, float activations."""
    ckpt = convert.reference_checkpoint(arch, seed=MODEL_SEED, **OVERRIDES[arch])
    f32 = convert.reference_gguf(arch, "f32", seed=MODEL_SEED, split_ple=False, **OVERRIDES[arch])[0]
    ref = hf_models.load_model(ckpt)
    params = {k: v.detach().numpy() for k, v in ref.named_parameters()}
    names = sorted(n for n, t in read_gguf(gguf).tensors.items() if t.type_id != 0)  # all but F32
    mod = _modeling(arch)
    with _one_thread(), float64_casts(mod):
        torch.set_num_threads(1)
        float64_model(ref, mod)
        load_dequantized(ref, place_tensors(params, f32, names), gguf)
        with torch.no_grad():
            out = []
            for p in prompts:  # one at a time: batch rows of a float64 reference must not interact
                ids = torch.tensor(p)[None]
                out.append(ref(ids, attention_mask=torch.ones_like(ids)).logits[0].numpy())
            return np.stack(out)


def _err(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x.astype(np.float64) - ref) / np.linalg.norm(ref))


CASES = [(arch, mix) for arch in ARCHS for mix in llama_cpp_ref.MIXES]


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{m}" for a, m in CASES])
def case(request, tmp_path_factory):
    arch, mix = request.param
    gguf = llama_cpp_ref.quantized_gguf(arch, mix, seed=MODEL_SEED, **OVERRIDES[arch])
    prompts = _prompts()
    ours = _strata(gguf, tmp_path_factory.mktemp(f"{arch}-{mix}") / "pack", arch, prompts)
    theirs = llama_cpp_ref.logits(gguf, prompts)
    ref = _reference(arch, gguf, prompts)
    types = sorted({t.type_id for t in read_gguf(gguf).tensors.values()})
    r = dict(arch=arch, mix=mix, ours=_err(ours, ref), llama=_err(theirs, ref), types=types)
    RESULTS[(arch, mix)] = r
    return r


def test_our_error_is_no_worse_than_llama_cpps(case):
    ratio = case["ours"] / case["llama"]
    print(f"\n{case['arch']} {case['mix']}: strata {case['ours']:.3e}, llama.cpp {case['llama']:.3e}, ratio {ratio:.2f}")
    assert case["ours"] <= MAX_RATIO * case["llama"], (
        f"{case['arch']} {case['mix']}: Strata's error {case['ours']:.3e} is {ratio:.2f}x llama.cpp's {case['llama']:.3e}")


def test_no_discrete_choice_is_left_to_the_noise(case):
    """Every expert is used and the QSA budget covers the prompt (see CHOICE_FREE)."""
    cfg = hf_models.tiny_config(case["arch"], **OVERRIDES[case["arch"]])
    assert cfg["num_experts_per_tok"] == cfg["num_experts"]
    if case["arch"] == "qwen4exp":
        assert cfg["indexer_budget"] >= PROMPT_LENGTH


@pytest.mark.parametrize("arch", ARCHS)
def test_every_component_moves_the_logits(arch):
    """BRIEF section 5 on the choice-free models (QSA selection excepted: the budget covers the prompt)."""
    torch.set_num_threads(1)
    model = hf_models.load_model(convert.reference_checkpoint(arch, seed=MODEL_SEED, **OVERRIDES[arch]))
    ids = torch.tensor(_prompts()[:1])
    effects = hf_models.ablation_effects(model, ids)
    effects.pop("qsa_selection", None)
    weak = {k: round(v, 4) for k, v in effects.items() if v < 0.03}
    assert not weak, f"components whose removal moves the logits by < 3%: {weak} (all: {effects})"


def test_zz_table():
    """The table for docs/conformance.md (runs last: the cases above fill RESULTS)."""
    from strata.index_format.ggml_types import BY_ID

    if not RESULTS:
        pytest.skip("no case ran")
    print(f"\nllama.cpp from {WHERE}; error = ||logits - float64 reference|| / ||reference|| over "
          f"{N_PROMPTS} prompts x {PROMPT_LENGTH} positions\n")
    print("| arch | file | tensor types | Strata | llama.cpp | ratio |\n|---|---|---|---|---|---|")
    for (arch, mix), r in RESULTS.items():
        types = ", ".join(BY_ID[t].name for t in r["types"])
        print(f"| {arch} | {mix} | {types} | {r['ours']:.2e} | {r['llama']:.2e} | {r['ours'] / r['llama']:.2f} |")
