"""Dump GGUF metadata and tensor table to JSON with llama.cpp's vendored gguf-py reader.

usage: python _dump_gguf.py CONVERTER_DIR OUT_JSON GGUF [GGUF...]   (run in a subprocess)

The vendored reader, not PyPI's gguf 0.19: only it knows arch qwen4exp and type 42 (Q2_0).
Integers go to JSON as integers (Python ints are exact), so uint64 PLE hash multipliers above
2^53 survive; the caller must not parse them as floats.
"""

import json
import sys
from pathlib import Path


def _field(field, GGUFValueType):
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        tname = f"ARRAY[{types[-1].name}]" if len(types) > 1 else "ARRAY[]"
    else:
        tname = types[0].name
    value = field.contents()
    return [tname, value]


def main() -> None:
    converter_dir, out_json, *paths = sys.argv[1:]
    sys.path.insert(0, str(Path(converter_dir) / "gguf-py"))
    from gguf import GGUFReader, GGUFValueType

    files = []
    for path in paths:
        reader = GGUFReader(path)
        kv = {}
        for name, field in reader.fields.items():
            if name.startswith("GGUF."):  # header pseudo-fields (version, counts), not metadata
                continue
            kv[name] = _field(field, GGUFValueType)
        tensors = {
            t.name: [[int(d) for d in t.shape], int(t.tensor_type), int(t.data_offset), int(t.n_bytes)]
            for t in reader.tensors
        }
        files.append({"path": str(path), "metadata": kv, "tensors": tensors, "tensor_order": [t.name for t in reader.tensors]})
    tmp = Path(out_json + ".tmp")
    tmp.write_text(json.dumps({"files": files}), encoding="utf-8")
    tmp.replace(out_json)


if __name__ == "__main__":
    main()
