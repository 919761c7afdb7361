"""Describe GGUF files (metadata and tensor table) with the converter's own vendored reader.

Runs tests/reference/_dump_gguf.py in a subprocess (see convert.converter_dir) and reads its
JSON output. Test support only: the engine never parses JSON or GGUF.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple, Sequence

from .convert import ConverterError, converter_dir, converter_env

_DUMPER = Path(__file__).with_name("_dump_gguf.py")


class Meta(NamedTuple):
    type: str     # GGUF value type name: "UINT32", "STRING", "ARRAY[UINT64]", ...
    value: Any    # str, int, float, bool, or a list of them (arrays)


class Tensor(NamedTuple):
    shape: tuple[int, ...]  # GGUF order: shape[0] is ne0, the contiguous row length
    ggml_type: int          # GGML type id (0 F32, 1 F16, 30 BF16, 42 Q2_0, ...)
    offset: int             # absolute byte offset of the data in its file
    n_bytes: int
    file: int               # index into describe()["files"]


def describe(gguf_paths: Path | str | Sequence[Path | str]) -> dict[str, Any]:
    """{"files": [path...], "metadata": {key: Meta} of the first file,
    "file_metadata": [{key: Meta} per file], "tensors": {name: Tensor} over all files,
    "tensor_order": [name...] in file order}."""
    if isinstance(gguf_paths, (str, Path)):
        gguf_paths = [gguf_paths]
    paths = [str(Path(p)) for p in gguf_paths]
    conv = converter_dir()
    with tempfile.TemporaryDirectory(prefix="gguf-dump-") as tmp:
        out = Path(tmp) / "dump.json"
        proc = subprocess.run([sys.executable, str(_DUMPER), str(conv), str(out), *paths],
                              capture_output=True, text=True, env=converter_env(conv))
        if proc.returncode != 0:
            raise ConverterError(f"reading {paths} with the vendored gguf-py failed:\n{proc.stderr[-3000:]}")
        raw = json.loads(out.read_text(encoding="utf-8"))
    file_meta, tensors, order = [], {}, []
    for i, f in enumerate(raw["files"]):
        file_meta.append({k: Meta(t, v) for k, (t, v) in f["metadata"].items()})
        for name in f["tensor_order"]:
            shape, ggml_type, offset, n_bytes = f["tensors"][name]
            if name in tensors:
                raise ConverterError(f"tensor {name} appears in both {paths[tensors[name].file]} and {paths[i]}")
            tensors[name] = Tensor(tuple(shape), ggml_type, offset, n_bytes, i)
            order.append(name)
    return {"files": paths, "metadata": file_meta[0], "file_metadata": file_meta,
            "tensors": tensors, "tensor_order": order}
