"""A strict GGUF v3 reader and a streaming writer.

WHY OUR OWN: PyPI's gguf 0.19.0 knows neither the `qwen4exp` architecture nor GGML type 42
(Q2_0), and its reader raises on the type enum of the very tensors we must pack. GGUF itself is a
small format (llama.cpp docs/gguf.md); reading it here, against our own type table, also lets every
error name the file, the byte offset and the tensor. This module is the ONLY GGUF parser in Strata
(the engine never parses GGUF: S4).

Layout (all little-endian):
    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x  (key: gguf-string, value_type u32, value)
    n_tensors x (name: gguf-string, n_dims u32, ne[n_dims] u64, ggml_type u32, offset u64)
    padding to general.alignment (default 32)
    tensor data; each tensor's offset is relative to the data start and aligned.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, Callable

import numpy as np

from strata.index_format.ggml_types import UnknownGGMLType, ggml_type

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class VT(IntEnum):
    """GGUF metadata value types."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
    VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q",
    VT.FLOAT64: "<d",
}
_NP = {
    VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4",
    VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.BOOL: "<u1", VT.UINT64: "<u8", VT.INT64: "<i8",
    VT.FLOAT64: "<f8",
}


class GGUFError(ValueError):
    """Bad GGUF input; the message names the file and where in it."""


@dataclass(frozen=True)
class KV:
    type: VT
    value: Any  # python scalar, str, or list (arrays); array element type in `sub_type`
    sub_type: VT | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the contiguous row length
    type_id: int
    offset: int  # ABSOLUTE byte offset of the data in the file
    nbytes: int
    file: Path


@dataclass
class GGUFFile:
    path: Path
    version: int
    kv: dict[str, KV]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kv.get(key)
        return default if kv is None else kv.value

    def require(self, key: str) -> Any:
        if key not in self.kv:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
        return self.kv[key].value

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A read-only uint8 view of one tensor's bytes, memory-mapped (never copied)."""
        t = self.tensors[name]
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))


class _Cursor:
    """Reads the header from the file in growing chunks: a header (the tokenizer arrays) can be
    tens of MB, the file tens of GB, so neither one read of everything nor one mmap we must close."""

    def __init__(self, f, path: Path, size: int):
        self.f, self.path, self.size = f, path, size
        self.buf, self.pos = b"", 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: at byte {self.pos}: {what}")

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated: needs {n} more bytes, the file has {self.size - self.pos}")
        if self.pos + n > len(self.buf):
            want = max(self.pos + n - len(self.buf), 1 << 22)
            self.f.seek(len(self.buf))
            self.buf += self.f.read(want)
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vt: VT) -> Any:
        fmt = _SCALAR[vt]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(VT.UINT64)
        raw = bytes(self.take(n))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"string is not UTF-8 ({e})") from None

    def value_type(self) -> VT:
        v = self.scalar(VT.UINT32)
        try:
            return VT(v)
        except ValueError:
            raise self.fail(f"unknown metadata value type {v} (expected 0..12)") from None

    def value(self, vt: VT) -> KV:
        if vt == VT.STRING:
            return KV(vt, self.string())
        if vt != VT.ARRAY:
            return KV(vt, self.scalar(vt))
        sub = self.value_type()
        n = self.scalar(VT.UINT64)
        if sub == VT.STRING:
            return KV(vt, [self.string() for _ in range(n)], sub)
        if sub == VT.ARRAY:
            raise self.fail("nested arrays are not supported")
        itemsize = struct.calcsize(_SCALAR[sub])
        arr = np.frombuffer(self.take(n * itemsize), dtype=_NP[sub])
        # Python ints, never floats, for integer arrays: the PLE hash multipliers exceed 2^53.
        vals = [bool(x) for x in arr] if sub == VT.BOOL else arr.tolist()
        return KV(vt, vals, sub)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse a GGUF file's header strictly; tensor data stays on disk (see tensor_bytes)."""
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise GGUFError(f"{path}: empty file, expected a GGUF header")
    with open(path, "rb") as f:
        return _parse(_Cursor(f, path, size), path, size)


def _parse(c: _Cursor, path: Path, size: int) -> GGUFFile:
    magic = bytes(c.take(4))
    if magic != GGUF_MAGIC:
        raise c.fail(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
    version = c.scalar(VT.UINT32)
    if version not in (2, 3):
        raise c.fail(f"GGUF version {version}, expected 3")
    n_tensors, n_kv = c.scalar(VT.UINT64), c.scalar(VT.UINT64)
    if n_tensors > size or n_kv > size:
        raise c.fail(f"implausible counts: {n_tensors} tensors, {n_kv} metadata keys in a {size}-byte file")
    kv: dict[str, KV] = {}
    for _ in range(n_kv):
        key = c.string()
        if key in kv:
            raise c.fail(f"duplicate metadata key {key!r}")
        kv[key] = c.value(c.value_type())
    infos = [_tensor_info(c) for _ in range(n_tensors)]
    align_kv = kv.get("general.alignment")
    alignment = int(align_kv.value) if align_kv else DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment is {alignment}, expected a power of two")
    data_offset = -(-c.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, rel in infos:
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        try:
            t = ggml_type(type_id, where=f"{path.name}: tensor {name}")
        except UnknownGGMLType as e:
            raise GGUFError(str(e)) from None
        try:
            nbytes = t.nbytes(shape)
        except ValueError as e:
            raise GGUFError(f"{path.name}: tensor {name} shape {list(shape)}: {e}") from None
        if rel % alignment:
            raise GGUFError(f"{path.name}: tensor {name} data offset {rel} is not aligned to {alignment}")
        start = data_offset + rel
        if start + nbytes > size:
            raise GGUFError(
                f"{path.name}: tensor {name} needs bytes {start}..{start + nbytes}, "
                f"but the file has {size} bytes (truncated?)"
            )
        tensors[name] = TensorInfo(name, shape, type_id, start, nbytes, path)
    _check_overlap(path, tensors)
    return GGUFFile(path, version, kv, tensors, alignment, data_offset, size)


def _tensor_info(c: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = c.string()
    n_dims = c.scalar(VT.UINT32)
    if not 1 <= n_dims <= 4:
        raise c.fail(f"tensor {name!r} has {n_dims} dims, expected 1..4")
    shape = tuple(c.scalar(VT.UINT64) for _ in range(n_dims))
    if any(d == 0 for d in shape):
        raise c.fail(f"tensor {name!r} has a zero dimension {list(shape)}")
    return name, shape, c.scalar(VT.UINT32), c.scalar(VT.UINT64)


def _check_overlap(path: Path, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (a0, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise GGUFError(f"{path.name}: tensors {an} and {bn} overlap (bytes {a0}..{a1} and {b0}..)")


# ----------------------------------------------------------------------------- writing


@dataclass
class _PendingTensor:
    name: str
    shape: tuple[int, ...]
    type_id: int
    nbytes: int
    data: Callable[[], Any]  # returns bytes / ndarray, or an iterable of chunks


@dataclass
class GGUFWriter:
    """Collects metadata and tensor producers, then streams the file in one pass.

    Tensor data is produced lazily (a callable per tensor) so that a multi-GB synthetic model is
    never held in memory. The file is written to a temp name and renamed when complete.
    """

    path: Path
    alignment: int = DEFAULT_ALIGNMENT
    kv: dict[str, KV] = field(default_factory=dict)
    tensors: list[_PendingTensor] = field(default_factory=list)

    def add(self, key: str, value: Any, vtype: VT, sub_type: VT | None = None) -> None:
        if key in self.kv:
            raise ValueError(f"metadata key {key!r} added twice")
        if vtype == VT.ARRAY and sub_type is None:
            raise ValueError(f"array key {key!r} needs an element type")
        self.kv[key] = KV(vtype, value, sub_type)

    def add_tensor(self, name: str, shape: tuple[int, ...], type_id: int, data: Callable[[], Any]) -> None:
        t = ggml_type(type_id, where=f"tensor {name}")
        self.tensors.append(_PendingTensor(name, tuple(int(d) for d in shape), type_id, t.nbytes(shape), data))

    def write(self, progress: Callable[[int], None] | None = None) -> Path:
        if "general.alignment" not in self.kv and self.alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", self.alignment, VT.UINT32)
        tmp = self.path.with_name(self.path.name + f".tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                self._write_header(f)
                for t in self.tensors:
                    self._write_data(f, t, progress)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return self.path

    def _write_header(self, f) -> None:
        out = bytearray(GGUF_MAGIC)
        out += struct.pack("<IQQ", 3, len(self.tensors), len(self.kv))
        for key, kv in self.kv.items():
            out += _pack_string(key) + struct.pack("<I", kv.type) + _pack_value(kv)
        rel = 0
        for t in self.tensors:
            out += _pack_string(t.name) + struct.pack("<I", len(t.shape))
            out += struct.pack(f"<{len(t.shape)}Q", *t.shape) + struct.pack("<IQ", t.type_id, rel)
            rel += _pad(t.nbytes, self.alignment)
        out += b"\0" * (_pad(len(out), self.alignment) - len(out))
        f.write(out)

    def _write_data(self, f, t: _PendingTensor, progress) -> None:
        produced = t.data()
        chunks = [produced] if isinstance(produced, (bytes, bytearray, memoryview, np.ndarray)) else produced
        written = 0
        for chunk in chunks:
            b = chunk.tobytes() if isinstance(chunk, np.ndarray) else bytes(chunk)
            f.write(b)
            written += len(b)
            if progress:
                progress(len(b))
        if written != t.nbytes:
            raise ValueError(f"tensor {t.name}: producer gave {written} bytes, type and shape need {t.nbytes}")
        f.write(b"\0" * (_pad(written, self.alignment) - written))


def _pad(n: int, a: int) -> int:
    return -(-n // a) * a


def _pack_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _pack_scalar(vt: VT, v: Any) -> bytes:
    return struct.pack(_SCALAR[vt], v)


def _pack_value(kv: KV) -> bytes:
    if kv.type == VT.STRING:
        return _pack_string(kv.value)
    if kv.type != VT.ARRAY:
        return _pack_scalar(kv.type, kv.value)
    head = struct.pack("<IQ", kv.sub_type, len(kv.value))
    if kv.sub_type == VT.STRING:
        return head + b"".join(_pack_string(s) for s in kv.value)
    return head + np.asarray(kv.value, dtype=_NP[kv.sub_type]).tobytes()


def shard_names(first: Path) -> list[Path]:
    """All shards of a split GGUF from any one of them (`name-00001-of-00003.gguf`)."""
    import re

    m = re.match(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", first.name)
    if not m:
        return [first]
    stem, n = m.group(1), int(m.group(3))
    return [first.with_name(f"{stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]

