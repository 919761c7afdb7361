"""Shared mechanics of Strata's binary files: a fixed little-endian header, a payload, a CRC-32 trailer.

    header   fixed fields, little-endian, at fixed offsets (each file's module lists them)
    payload  fixed-size records
    crc32    u32: CRC-32 (zlib, IEEE) of the payload, continued over the header

The CRC runs over the payload FIRST so that a streaming writer (the routing trace) can hash the
records as they arrive and the header, whose counts are known only at the end, last; no second pass.
Readers check every field against every other field and the file's size before the CRC (so a cut
or a foreign file is named as such), then the CRC (so any changed byte is refused), then the records.
Errors are `BinaryFormatError`s naming the file, the byte offset, the field, what was found and
what was expected.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import BinaryFormatError, Phrase

FINGERPRINT_BYTES = 68  # "pk1-" + 64 lowercase hex: manifest.pack_fingerprint
_PACK_FINGERPRINT = re.compile(r"pk1-[0-9a-f]{64}")
CRC_BYTES = 4
_KINDS = {"u32": "<I", "u64": "<Q"}


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "magic", "u32", "u64" or "fingerprint"
    size: int


def fields(*spec: tuple[str, str], magic: bytes) -> tuple[Field, ...]:
    sizes = {"magic": len(magic), "u32": 4, "u64": 8, "fingerprint": FINGERPRINT_BYTES}
    return tuple(Field(name, kind, sizes[kind]) for name, kind in spec)


def offsets(layout: Sequence[Field]) -> dict[str, int]:
    out, at = {}, 0
    for f in layout:
        out[f.name] = at
        at += f.size
    return out


def header_size(layout: Sequence[Field]) -> int:
    return sum(f.size for f in layout)


def pack_header(layout: Sequence[Field], magic: bytes, values: dict[str, object]) -> bytes:
    parts = []
    for f in layout:
        if f.kind == "magic":
            parts.append(magic)
        elif f.kind == "fingerprint":
            parts.append(str(values[f.name]).encode("ascii"))
        else:
            parts.append(struct.pack(_KINDS[f.kind], values[f.name]))
    return b"".join(parts)


def fingerprint_problem(fp: object) -> str | None:
    if not isinstance(fp, str) or not _PACK_FINGERPRINT.fullmatch(fp):
        return "a pack fingerprint: 'pk1-' and 64 lowercase hex digits (manifest.pack_fingerprint)"
    return None


def crc32(payload_parts: Iterable[bytes], header: bytes) -> int:
    crc = 0
    for part in payload_parts:
        crc = zlib.crc32(part, crc)
    return zlib.crc32(header, crc)


class Reader:
    """The bytes of one file and its header fields, each read with its offset for the error."""

    def __init__(self, path: str | os.PathLike, data: bytes, what: str):
        self.path, self.data, self.what = os.fspath(path), data, what

    def error(self, offset: int, field: str | None, found: object, expected: object, hint: str | None = None):
        return BinaryFormatError(self.path, offset, field, found, expected, hint)

    def header(self, layout: Sequence[Field], magic: bytes, versions: tuple[int, ...]) -> dict[str, object]:
        """Read and type every header field; magic and version are checked here, the rest by the caller."""
        at, out = 0, {}
        for f in layout:
            if at + f.size > len(self.data):
                raise self.error(len(self.data), f.name, Phrase("the end of the file"),
                                 f"{header_size(layout)} header bytes of {self.what}", "truncated file?")
            raw = self.data[at : at + f.size]
            out[f.name] = self._field(f, raw, at, magic)
            if f.name == "version" and out[f.name] not in versions:
                raise self.error(at, "version", out[f.name], " or ".join(map(str, versions)),
                                 "a file written by another Strata version")
            at += f.size
        return out

    def _field(self, f: Field, raw: bytes, at: int, magic: bytes) -> object:
        if f.kind == "magic":
            if raw != magic:
                raise self.error(at, "magic", raw, repr(magic), f"not {self.what}")
            return raw
        if f.kind == "fingerprint":
            text = raw.decode("ascii", "replace")
            why = fingerprint_problem(text)
            if why:
                raise self.error(at, f.name, text, why)
            return text
        return struct.unpack(_KINDS[f.kind], raw)[0]

    def expect_size(self, size: int, field: str, explain: str) -> None:
        """The file must be exactly `size` bytes (header counts x record size + CRC)."""
        n = len(self.data)
        if n < size:
            raise self.error(n, field, Phrase("the end of the file"), f"{size} bytes ({explain})", "truncated file?")
        if n > size:
            raise self.error(size, None, Phrase(f"{n - size} more bytes"), f"the end of the file at {size} ({explain})",
                             "trailing bytes: two files concatenated, or a writer that did not finish?")

    def check_crc(self, header_bytes: int) -> None:
        end = len(self.data) - CRC_BYTES
        stored = struct.unpack("<I", self.data[end:])[0]
        want = crc32([self.data[header_bytes:end]], self.data[:header_bytes])
        if stored != want:
            raise self.error(end, "crc32", f"0x{stored:08x}", f"0x{want:08x}, the CRC-32 of the payload and header",
                             "the file changed after it was written (a corrupted byte?)")


def write_atomic(path: str | os.PathLike, parts: Iterable[bytes]) -> None:
    """Write to `<path>.tmp-<pid>` and rename over `path`: readers see all of it or none of it."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class StreamingFile:
    """A binary file written in a stream to `<path>.tmp-<pid>` and renamed into place only when
    complete (close), or removed (abort, or an exception inside `with`): a reader never sees half a
    file. Subclasses write through `self._f` and finish their own close() with `_commit()`."""

    def _open_temp(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._tmp = f"{self.path}.tmp-{os.getpid()}"
        self._f = open(self._tmp, "wb")

    def _commit(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        try:
            self._f.close()  # may fail again (the unflushed tail on a full disk): the temp goes anyway
        except OSError:
            pass
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            try:
                self.close()
            except BaseException:
                self.abort()  # a commit that fails (a full disk at fsync) leaves no temp file either
                raise
        else:
            self.abort()
