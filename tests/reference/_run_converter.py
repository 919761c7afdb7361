"""Run llama.cpp's convert_hf_to_gguf.py with one patch; executed as a script in a subprocess.

usage: python _run_converter.py CONVERTER_DIR [convert_hf_to_gguf.py arguments...]

The patch: the converter names the BPE pre-tokenizer by hashing the token ids of a fixed test
string and refuses any hash it does not list (NotImplementedError). A tiny vocabulary trained
for tests tokenizes that string differently from the real Qwen vocabulary, so its hash can never
be listed. Our tokenizer uses the real Qwen3.5 pre-tokenizer (same regex, NFC, byte-level; see
hf_models.QWEN35_PRETOKENIZE_REGEX), so the name the converter would write for Qwen3.5,
"qwen35", is the true one; we return it instead of the hash lookup. Nothing else is changed.
"""

import runpy
import sys
from pathlib import Path

PRE_TOKENIZER = "qwen35"


def main() -> None:
    converter_dir = Path(sys.argv[1]).resolve()
    # the vendored gguf-py first: PyPI's gguf knows neither arch qwen4exp nor type 42 (Q2_0)
    sys.path[:0] = [str(converter_dir / "gguf-py"), str(converter_dir)]
    from conversion import base

    def get_vocab_base_pre(self, tokenizer) -> str:
        return PRE_TOKENIZER

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(converter_dir / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
