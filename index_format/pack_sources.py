"""`sources.txt`: where each source GGUF of a pack was when the pack was made.

    # strata pack sources v1
    <file name> <percent-encoded absolute path>

manifest.txt names each source by its bare file name (a pack must stay valid when the GGUFs move);
this file is only the default place to look for them (`strata-pack verify`, and the engine when
`--native` / `--ple-gguf` are not given). A path is percent-encoded UTF-8 so any path fits one
ASCII field; its last component must be the name, so a stale line cannot point at another file.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import quote, unquote_to_bytes

from ._text import Line, file_name_problem, line_at, read_lines, split_lines, write_atomic
from .errors import FormatError, Phrase

HEADER = "# strata pack sources v1"
_PCT = re.compile(r"(?:[A-Za-z0-9_.~-]|%[0-9A-F]{2})+")
_PATH_TEXT = "a percent-encoded UTF-8 absolute path (unreserved characters as is, %XX uppercase)"


def _encode(path: str) -> str:
    return quote(path.encode("utf-8"), safe="")


def _path_problem(name: str, path: object) -> str | None:
    if not isinstance(path, str) or not os.path.isabs(path):
        return "an absolute path"
    if os.path.basename(path) != name:
        return f"a path whose last component is {name}"
    return None


def format_sources(paths: Mapping[str, str]) -> str:
    lines = [HEADER] + [f"{name} {_encode(path)}" for name, path in paths.items()]
    return "\n".join(lines) + "\n"


def write_sources(path: str | os.PathLike, paths: Mapping[str, str]) -> None:
    """Write name -> absolute path atomically, after checking the reader accepts the text."""
    for name, p in paths.items():
        why = file_name_problem(name) or _path_problem(name, p)
        if why:
            raise ValueError(f"source {name!r} at {p!r}: expected {why}")
    text = format_sources(paths)
    _parse(path, split_lines(path, text.encode("ascii")))
    write_atomic(path, text)


def read_sources(path: str | os.PathLike) -> dict[str, str]:
    """name -> absolute path, in file order; every line checked."""
    return _parse(path, read_lines(path))


def _parse(path: str | os.PathLike, lines: list[Line]) -> dict[str, str]:
    line_at(path, lines, 0, repr(HEADER)).exact(HEADER)
    out: dict[str, str] = {}
    for line in lines[1:]:
        name, token = line.split(("name", "path"))
        line.file_name(name, "name")
        if name in out:
            raise line.error("name", name, "a name not used on an earlier line")
        out[name] = _decode(line, name, token)
    if not out:
        raise FormatError(path, 2, None, Phrase("the end of the file"), "one line per source GGUF", "truncated file?")
    return out


def _decode(line: Line, name: str, token: str) -> str:
    try:
        text = unquote_to_bytes(token).decode("utf-8") if _PCT.fullmatch(token) else None
    except UnicodeDecodeError:
        text = None
    if text is None or _encode(text) != token:
        raise line.error("path", token, _PATH_TEXT)
    why = _path_problem(name, text)
    if why:
        raise line.error("path", text, why)
    return text


# --- sources.sha256: the full hash of each source, recorded only when asked -----------------------------
#
# `sha256sum` format ("<64 hex>  <name>"), so `sha256sum -c sources.sha256` run beside the GGUFs checks
# them too. Written by `strata-pack convert --hash-sources` (hashing a 40 GB GGUF reads all 40 GB,
# minutes; the default convert reads only the sampled fingerprint) and read by `verify --full-sources`.

SHA256 = "sources.sha256"
_SHA_LINE = re.compile(r"([0-9a-f]{64})  (\S+)")


def format_source_hashes(hashes: Mapping[str, str]) -> str:
    """name -> 'sha256-<hex>' as sha256sum lines."""
    return "".join(f"{h.removeprefix('sha256-')}  {name}\n" for name, h in hashes.items())


def write_source_hashes(path: str | os.PathLike, hashes: Mapping[str, str]) -> None:
    text = format_source_hashes(hashes)
    _parse_hashes(path, text)
    write_atomic(path, text)


def read_source_hashes(path: str | os.PathLike) -> dict[str, str]:
    """name -> 'sha256-<hex>'; every line checked."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise FormatError(path, None, None, "non-ASCII bytes", "sha256sum lines: <64 lowercase hex>  <file name>") from None
    return _parse_hashes(path, text)


def _parse_hashes(path, text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    lines = text.split("\n")
    if lines[-1] != "":
        raise FormatError(path, len(lines), None, Phrase("no newline at the end"), "a final newline", "truncated file?")
    for i, line in enumerate(lines[:-1], 1):
        m = _SHA_LINE.fullmatch(line)
        if m is None:
            raise FormatError(path, i, None, line, "<64 lowercase hex>  <file name> (sha256sum's format)")
        name = m.group(2)
        why = file_name_problem(name)
        if why:
            raise FormatError(path, i, "name", name, why)
        if name in out:
            raise FormatError(path, i, "name", name, "a name not used on an earlier line")
        out[name] = "sha256-" + m.group(1)
    if not out:
        raise FormatError(path, None, None, Phrase("no line"), "one line per source GGUF")
    return out
