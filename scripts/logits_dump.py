"""Dump, or compare with a dump, the logits of the test fixtures through every path of the engine.

A refactor of the forward must not move the numbers: run `dump OUT.npz` on the code before it and
`compare OUT.npz` after it. The models are tests/engine/test_prefill.py's (the engine fixture's qwen35moe
and synth's `tiny` qwen4exp, both F32) plus the `tiny` qwen4exp in its own quantized types; the
paths are the token path (`--prefill 1`) and chunks of 7, 32, 64 and 100 tokens, every position's
logits of a 157-token prompt and 8 greedy tokens, --kv f32.

    PYTHONPATH=tests python3 scripts/logits_dump.py dump /tmp/before.npz
    PYTHONPATH=tests python3 scripts/logits_dump.py compare /tmp/before.npz   # exit 1 above 1e-5
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

CHUNKS = (1, 7, 32, 64, 100)
N_PROMPT, N_GREEDY = 157, 8
TOL = 1e-5


def _models(tmp: Path):
    import engine_fixture as F
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack
    from strata.tools import pack as tools_pack
    from strata.tools.synth import PRESETS, synth

    (tmp / "src").mkdir()
    (tmp / "f32").mkdir()
    src = synth("qwen4exp", "tiny", tmp / "src" / "tiny.gguf")
    shards = [F.dequantized_copy(p, tmp / "f32" / p.name) for p in src]
    ratio = PRESETS["tiny"].compress_ratio
    tools_pack.convert(shards[:1], tmp / "q4-pack", compress_ratio=ratio)
    tools_pack.convert(src[:1], tmp / "q4q-pack", compress_ratio=ratio)
    return {"qwen35moe": Model(Pack.open(F.make_pack(tmp))), "qwen4exp": Model(Pack.open(tmp / "q4-pack")),
            "qwen4exp-quantized": Model(Pack.open(tmp / "q4q-pack"))}


def _run(model, prefill: int) -> tuple[np.ndarray, np.ndarray]:
    from strata.engine.generate import generate
    from strata.engine.sampling import Sampler, SamplerParams

    prompt = np.random.default_rng(3).integers(3, model.geometry.n_vocab, N_PROMPT).tolist()
    rows = np.empty((N_PROMPT + N_GREEDY, model.geometry.n_vocab), np.float32)
    s = model.new_session(N_PROMPT + N_GREEDY, "f32")
    out = generate(model, s, prompt, Sampler(model.geometry.n_vocab, SamplerParams(temperature=0)), N_GREEDY,
                   on_logits=lambda pos, logits: rows.__setitem__(pos, logits), prefill=prefill)
    return rows[: out.positions], np.asarray(out.tokens)


def collect() -> dict[str, np.ndarray]:
    from strata.engine.kernels import cpu

    cpu.set_threads(1)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in _models(Path(tmp)).items():
            for chunk in CHUNKS:
                logits, tokens = _run(model, chunk)
                out[f"{name}/{chunk}/logits"], out[f"{name}/{chunk}/tokens"] = logits, tokens
                print(f"{name} chunk {chunk}: {logits.shape[0]} positions", file=sys.stderr)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("dump", "compare"):
        print(__doc__, file=sys.stderr)
        return 2
    got = collect()
    if argv[0] == "dump":
        np.savez(argv[1], **got)
        return 0
    want = np.load(argv[1])
    bad = 0
    print("| model/path | positions | max relative | greedy |")
    print("|---|---|---|---|")
    for key in sorted(k for k in want.files if k.endswith("/logits")):
        base = key[: -len("/logits")]
        w, g = want[key], got[key]
        rel = float(np.abs(g - w).max() / np.abs(w).max()) if g.shape == w.shape else float("inf")
        same = np.array_equal(want[base + "/tokens"], got[base + "/tokens"])
        quantized = "quantized" in base  # block activations: compared with their own tolerance below
        bad += (not same) or (rel > TOL and not quantized)
        print(f"| {base} | {w.shape[0]} | {rel:.2e} | {'same' if same else 'DIFFERENT'} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
