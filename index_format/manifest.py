"""`manifest.txt`: which source GGUFs a pack was made from, the pack's own files, and their fingerprints.

    # strata pack manifest v1
    source <main|shard|ple> <size> <fingerprint> <file name>
    file <name> <size> <fingerprint>

The engine reads experts straight from the GGUF by absolute offset (native_experts.txt), so a GGUF
that changed after packing (re-quantized, re-downloaded, truncated) would decode to plausible garbage;
the fingerprint ties pack and sources together without reading 40 GB at every start.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ._text import Line, line_at, read_lines, split_lines, write_atomic
from .errors import FormatError, Phrase

HEADER = "# strata pack manifest v1"
ROLES = ("main", "shard", "ple", "mtp")  # mtp: a separate MTP-only GGUF (strata-pack convert --mtp)
SOURCE_FIELDS = ("source", "role", "size", "fingerprint", "name")
FILE_FIELDS = ("file", "name", "size", "fingerprint")
FINGERPRINTED = ("index.txt", "native_experts.txt", "geometry.txt")  # what pack_fingerprint hashes whole
_FINGERPRINT = re.compile(r"(fp1|sha256)-[0-9a-f]{64}")
_FINGERPRINT_TEXT = "fp1-<64 hex> or sha256-<64 hex>"

EDGE = 1 << 20  # the first and the last MiB: GGUF header and tensor table, and a truncated end
SAMPLE = 64 << 10
N_SAMPLES = 256
_CHUNK = 8 << 20


@dataclass(frozen=True)
class SourceFile:
    role: str
    size: int
    fingerprint: str
    name: str


@dataclass(frozen=True)
class PackFile:
    name: str
    size: int
    fingerprint: str


@dataclass(frozen=True)
class Manifest:
    sources: tuple[SourceFile, ...]
    files: tuple[PackFile, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "files", tuple(self.files))
        try:
            # One set of rules: the object is checked by formatting it and reading the text back.
            _parse("<Manifest>", split_lines("<Manifest>", format_manifest(self).encode("ascii")))
        except (ValueError, UnicodeEncodeError) as e:
            raise ValueError(str(e)) from None

    def source(self, role: str) -> tuple[SourceFile, ...]:
        return tuple(s for s in self.sources if s.role == role)


# --- fingerprints ---------------------------------------------------------------------------------


def fingerprint_file(path: str | os.PathLike) -> str:
    """'fp1-' + sha256 of a SAMPLE of the file: its size, first and last MiB, and 256 64-KiB samples.

    Sampled, not a full hash: it reads 18 MiB of a 40 GB GGUF, and still catches a changed header or
    tensor table, a truncation, or a re-quantized file; it can miss a few flipped bytes in the
    middle (full_sha256 is for that). Files of at most 2 MiB are hashed whole.
    """
    size = os.path.getsize(path)
    h = hashlib.sha256(b"strata fp1\0" + size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= 2 * EDGE:
            h.update(_read_at(f, 0, size))
        else:
            h.update(_read_at(f, 0, EDGE))
            h.update(_read_at(f, size - EDGE, EDGE))
            for i in range(N_SAMPLES):
                h.update(_read_at(f, (size - SAMPLE) * i // (N_SAMPLES - 1), SAMPLE))
    return "fp1-" + h.hexdigest()


def full_sha256(path: str | os.PathLike) -> str:
    """'sha256-' + the sha256 of every byte (for `verify --full`; a manifest may hold this form too)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256-" + h.hexdigest()


def matches_fingerprint(path: str | os.PathLike, fingerprint: str) -> bool:
    """Whether `path` has `fingerprint`, computed by the scheme the fingerprint names (fp1 or sha256)."""
    compute = full_sha256 if fingerprint.startswith("sha256-") else fingerprint_file
    return compute(path) == fingerprint


def check_file(path: str | os.PathLike, size: int, fingerprint: str) -> str | None:
    """What is wrong with `path` against a manifest line (missing, other size, other content), or None."""
    if not os.path.isfile(path):
        return f"{os.fspath(path)}: missing"
    found = os.path.getsize(path)
    if found != size:
        return f"{os.fspath(path)}: {found} bytes, the manifest says {size}"
    if not matches_fingerprint(path, fingerprint):
        return f"{os.fspath(path)}: same size, different content than when the pack was made"
    return None


def _read_at(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise OSError(f"{f.name}: {len(data)} bytes at {offset}, expected {n} (file changed while being read?)")
    return data


def pack_fingerprint(pack_dir: str | os.PathLike) -> str:
    """'pk1-' + sha256 of index.txt, native_experts.txt, geometry.txt and the sources' fingerprints.

    Ties a routing profile to a pack: same dense layout, same expert layout, same source bytes.
    Source file names are left out: renaming a GGUF does not change what it holds.
    """
    pack_dir = Path(pack_dir)
    h = hashlib.sha256(b"strata pack fingerprint v1\0")
    for name in FINGERPRINTED:
        data = (pack_dir / name).read_bytes()
        h.update(name.encode("ascii") + b"\0" + len(data).to_bytes(8, "little") + data)
    for s in read_manifest(pack_dir / "manifest.txt").sources:
        h.update(f"{s.role} {s.size} {s.fingerprint}\n".encode("ascii"))
    return "pk1-" + h.hexdigest()


# --- the file -------------------------------------------------------------------------------------


def format_manifest(m: Manifest) -> str:
    lines = [HEADER]
    lines += [f"source {s.role} {s.size} {s.fingerprint} {s.name}" for s in m.sources]
    lines += [f"file {f.name} {f.size} {f.fingerprint}" for f in m.files]
    return "\n".join(lines) + "\n"


def write_manifest(path: str | os.PathLike, m: Manifest) -> None:
    """Write `m` atomically, after checking that the reader accepts the text."""
    text = format_manifest(m)
    _parse(path, split_lines(path, text.encode("ascii")))
    write_atomic(path, text)


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Read and check all of `path`."""
    return Manifest(*_parse(path, read_lines(path)))


def _parse(path: str | os.PathLike, lines: list[Line]) -> tuple[tuple[SourceFile, ...], tuple[PackFile, ...]]:
    line_at(path, lines, 0, repr(HEADER)).exact(HEADER)
    sources: list[SourceFile] = []
    files: list[PackFile] = []
    first_seen: dict[tuple[str, str], int] = {}
    for line in lines[1:]:
        word = line.text.split(" ", 1)[0]
        if word == "source" and not files:
            entry = _parse_source(line, sources)
            _unique(line, first_seen, ("source", entry.name))
            sources.append(entry)
        elif word == "file":
            if not sources:
                raise line.error("file", line.text, "the source lines first, the main GGUF first of all")
            entry = _parse_file(line)
            _unique(line, first_seen, ("file", entry.name))
            files.append(entry)
        else:
            raise line.error(None, line.text, "'source ...' lines, then 'file ...' lines")
    if not sources:
        raise FormatError(path, 2, None, Phrase("the end of the file"), "'source main <size> <fingerprint> <gguf file name>'")
    return tuple(sources), tuple(files)


def _unique(line: Line, first_seen: dict[tuple[str, str], int], key: tuple[str, str]) -> None:
    if key in first_seen:
        raise line.error("name", key[1], f"a {key[0]} name not used on an earlier line", f"first at line {first_seen[key]}")
    first_seen[key] = line.no


def _parse_source(line: Line, earlier: Iterable[SourceFile]) -> SourceFile:
    _, role, size, fingerprint, name = line.split(SOURCE_FIELDS)
    if role not in ROLES:
        raise line.error("role", role, f"one of {', '.join(ROLES)}")
    roles = [s.role for s in earlier]
    if (role == "main") == bool(roles) or (role in ("ple", "mtp") and role in roles):
        raise line.error("role", role, "main on the first source line only, and at most one ple and one mtp")
    return SourceFile(role, line.uint(size, "size"), _fingerprint(line, fingerprint), line.file_name(name, "name"))


def _parse_file(line: Line) -> PackFile:
    _, name, size, fingerprint = line.split(FILE_FIELDS)
    if line.file_name(name, "name") == "manifest.txt":
        raise line.error("name", name, "a pack file other than the manifest", "a file cannot hold its own hash")
    return PackFile(name, line.uint(size, "size"), _fingerprint(line, fingerprint))


def _fingerprint(line: Line, token: str) -> str:
    if not _FINGERPRINT.fullmatch(token):
        raise line.error("fingerprint", token, _FINGERPRINT_TEXT)
    return token
