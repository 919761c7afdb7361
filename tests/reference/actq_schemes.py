"""Strata's and llama.cpp's activation quantization, emulated inside the float64 reference.

Used to find where the two engines' errors differ (docs/conformance.md, "The error gap"): the
float64 transformers model holding a llama.cpp-quantized file's weights reads the input of every
block-type matmul through one of two schemes, restated here from their sources:

  strata  8-bit ActQ (docs/kernels.md section 2): per 32 elements d = amax / 127 in f32, q = rint(x / d)
          (what Strata did for every block type before the wide form; "int16" below is the wide form)
  llama   what ggml's CPU backend quantizes the activations to for the weight's type (vec_dot_type):
          Q8_K for the K and IQ types (per 256: iscale = -127 / the signed max, q = nearest_int,
          d = 1 / iscale), Q8_0 for the others (per 32: q = roundf(x * (1 / d)), d stored as fp16),
          BF16 activations for BF16 weights; F32 and F16 weights read f32 activations in both

usage (from tests/): python -m reference.actq_schemes ARCH MIX [N_PROMPTS [PROMPT_SEED]]
prints, over N_PROMPTS random 16-token prompts of test_conformance_llama.py's models, each
scheme's error against the float-activation reference and how often Strata's is the smaller.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch

F32 = np.float32
# weight types whose activations ggml quantizes to Q8_K (ggml-cpu type_traits_cpu vec_dot_type)
Q8_K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
              "IQ3_XXS", "IQ3_S", "IQ4_XS"}


def strata(x: np.ndarray) -> np.ndarray:
    b = x.reshape(len(x), -1, 32)
    d = np.abs(b).max(axis=2) / F32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, :, None] == 0, 0, np.rint(b / d[:, :, None]))
    return (q * d[:, :, None].astype(np.float64)).reshape(x.shape)


def strata16(x: np.ndarray) -> np.ndarray:
    """The fine form (docs/kernels.md section 2): d per 16 elements, else as strata."""
    b = x.reshape(len(x), -1, 16)
    d = np.abs(b).max(axis=2) / F32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, :, None] == 0, 0, np.rint(b / d[:, :, None]))
    return (q * d[:, :, None].astype(np.float64)).reshape(x.shape)


def int16_32(x: np.ndarray) -> np.ndarray:
    """The wide form as built (actq.ActQ16, for actq.WIDE): 16-bit activations per 32, d = amax /
    32639 (the 2026-12-01 emulation table used 32767: the same to 0.4% of a step)."""
    b = x.reshape(len(x), -1, 32)
    d = np.abs(b).max(axis=2) / F32(32639)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, :, None] == 0, 0, np.rint(b / d[:, :, None]))
    return (q * d[:, :, None].astype(np.float64)).reshape(x.shape)


def residual(x: np.ndarray) -> np.ndarray:
    """A candidate: strata's int8 per 32, then its residual x - q d as int8 per 32 (d2 = amax|r| / 127)."""
    b = x.reshape(len(x), -1, 32)
    d = np.abs(b).max(axis=2) / F32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, :, None] == 0, 0, np.rint(b / d[:, :, None])).astype(F32)
        r = b - q * d[:, :, None]
        d2 = np.abs(r).max(axis=2) / F32(127)
        q2 = np.where(d2[:, :, None] == 0, 0, np.rint(r / d2[:, :, None]))
    return (q * d[:, :, None].astype(np.float64) + q2 * d2[:, :, None].astype(np.float64)).reshape(x.shape)


def strata8(x: np.ndarray) -> np.ndarray:
    """A candidate: d per 8 elements."""
    b = x.reshape(len(x), -1, 8)
    d = np.abs(b).max(axis=2) / F32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, :, None] == 0, 0, np.rint(b / d[:, :, None]))
    return (q * d[:, :, None].astype(np.float64)).reshape(x.shape)


def q8_0(x: np.ndarray) -> np.ndarray:
    b = x.reshape(len(x), -1, 32)
    d = np.abs(b).max(axis=2) / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, F32(0), F32(1) / d)
    t = b * inv[:, :, None]
    q = np.sign(t) * np.floor(np.abs(t) + F32(0.5))  # roundf: half away from zero
    return (q * d.astype(np.float16).astype(np.float64)[:, :, None]).reshape(x.shape)


def q8_k(x: np.ndarray) -> np.ndarray:
    b = x.reshape(len(x), -1, 256)
    top = np.take_along_axis(b, np.abs(b).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(top == 0, F32(0), F32(-127) / top)
    q = np.minimum(np.rint(iscale[:, :, None] * b), 127)
    d = np.where(top == 0, F32(0), F32(1) / iscale)
    return (q * d.astype(np.float64)[:, :, None]).reshape(x.shape)


def bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(F32).view(np.uint32).astype(np.uint64)
    return ((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)).view(F32).astype(np.float64)


def scheme_for(which: str, type_name: str):
    """The activation function of `which` ('strata' or 'llama') for a weight of `type_name`."""
    if type_name in ("F32", "F16"):
        return None
    if type_name == "BF16":
        return bf16 if which == "llama" else None
    if which == "strata":
        return strata
    if which in ("strata16", "int16", "residual", "strata8"):  # finer only where llama.cpp reads Q8_0 (per 32)
        fine = {"strata16": strata16, "int16": int16_32, "residual": residual, "strata8": strata8}[which]
        return strata if type_name in Q8_K_TYPES else fine
    return q8_k if type_name in Q8_K_TYPES else q8_0


@contextlib.contextmanager
def activations(model, types: dict[str, str], cols: dict[str, np.ndarray | None], which: str | None):
    """While active, each listed parameter's matmul reads its input through `which`'s scheme, its
    blocks running over the GGUF's column order (`cols`, as in quantized.ActQInputs)."""
    by_storage = {model.get_parameter(p).untyped_storage().data_ptr(): p for p in types}
    real = torch.nn.functional.linear

    def linear(x, w, b=None):
        p = by_storage.get(w.untyped_storage().data_ptr())
        fn = scheme_for(which, types[p]) if p is not None and which else None
        if fn is not None:
            n, c = x.shape[-1], cols.get(p)
            x32 = x.detach().numpy().reshape(-1, n).astype(F32)
            y = fn(x32 if c is None else x32[:, c])
            if c is not None:
                y[:, c] = y.copy()
            x = torch.from_numpy(y.reshape(x.shape))
        return real(x, w, b)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = real


def main(argv: list[str]) -> int:
    import test_conformance_llama as T
    from strata.index_format.ggml_types import BY_ID
    from strata.tools.gguf_io import read_gguf

    from . import convert, hf_models, llama_cpp_ref
    from .float64 import float64_casts, float64_model
    from .quantized import load_dequantized, place_tensors

    arch, mix, n = argv[0], argv[1], int(argv[2]) if len(argv) > 2 else 20
    over = T.OVERRIDES[arch]
    gguf = llama_cpp_ref.quantized_gguf(arch, mix, seed=T.MODEL_SEED, **over)
    f32 = convert.reference_gguf(arch, "f32", seed=T.MODEL_SEED, split_ple=False, **over)[0]
    ref = hf_models.load_model(convert.reference_checkpoint(arch, seed=T.MODEL_SEED, **over))
    params = {k: v.detach().numpy() for k, v in ref.named_parameters()}
    f = read_gguf(gguf)
    names = sorted(k for k, t in f.tensors.items() if t.type_id != 0)
    mod = T._modeling(arch)
    torch.set_num_threads(1)
    seed = int(argv[3]) if len(argv) > 3 else 100  # test_conformance_llama.PROMPT_SEED (3): the suite's prompts
    prompts = np.random.default_rng(seed).integers(3, hf_models.VOCAB_SIZE, size=(n, T.PROMPT_LENGTH))
    err = {"strata": [], "llama": [], "strata16": [], "int16": [], "residual": [], "strata8": []}
    with float64_casts(mod), torch.no_grad():
        float64_model(ref, mod)
        placements = place_tensors(params, f32, names)
        load_dequantized(ref, placements, gguf)
        types = {pl.param: BY_ID[f.tensors[k].type_id].name for k, pl in placements.items()}
        cols = {pl.param: pl.cols for pl in placements.values()}
        for p in prompts:
            ids = torch.tensor(p)[None]
            out = {}
            for which in (None, *err):
                with activations(ref, types, cols, which):
                    out[which] = ref(ids, attention_mask=torch.ones_like(ids)).logits[0].numpy()
            for which in err:
                err[which].append(float(np.sum((out[which] - out[None]) ** 2)))
    ll = np.array(err["llama"])
    for which in ("strata", "strata16", "strata8", "residual", "int16"):
        s = np.array(err[which])
        print(f"{arch} {mix}, {n} prompts: pooled error ratio {which} / llama {np.sqrt(s.sum() / ll.sum()):.3f}, "
              f"{which}'s smaller in {(s < ll).sum()}/{n}, worst prompt ratio {np.sqrt(s / ll).max():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
