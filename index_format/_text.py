"""Shared mechanics of the flat files: strict lines, canonical integers, names, atomic writes.

Every Strata flat file is ASCII, one record per line, fields separated by one space, every line
ended by a newline. Each value has exactly one spelling (no sign, no leading zero, lowercase hex),
so write -> read -> write is byte-identical and the files can be hashed (manifest.pack_fingerprint).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from .errors import FormatError, Phrase

MAX_I64 = 2**63 - 1  # every size and offset must fit the engine's int64
_UINT = re.compile(r"0|[1-9][0-9]*")
_NOT_PRINTABLE = re.compile(r"[^\x20-\x7e\n]")
_NAME = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no space


def read_lines(path: str | os.PathLike) -> list[Line]:
    """All lines of `path`, each checked to be printable ASCII and newline-terminated."""
    return split_lines(path, Path(path).read_bytes())


def split_lines(path: str | os.PathLike, data: bytes) -> list[Line]:
    """The lines of `data` (the content of `path`); writers check their own output through this too."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise FormatError(path, line, None, data[e.start : e.start + 1], "ASCII text") from None
    bad = _NOT_PRINTABLE.search(text)
    if bad:
        line = text.count("\n", 0, bad.start()) + 1
        raise FormatError(
            path, line, None, bad.group(), "printable ASCII and newline line ends only", "CR, tab and control characters are refused"
        )
    parts = text.split("\n")
    if parts[-1]:
        # A writer ends every line; a last line without one is a file cut short mid-line.
        raise FormatError(path, len(parts), None, Phrase("no newline at the end of the file"), "every line ended by a newline", "truncated file?")
    return [Line(path, i + 1, t) for i, t in enumerate(parts[:-1])]


class Line:
    """One line of a flat file, with the helpers that turn its fields into checked values."""

    __slots__ = ("path", "no", "text")

    def __init__(self, path: str | os.PathLike, no: int, text: str):
        self.path, self.no, self.text = path, no, text

    def error(self, field: str | None, found: object, expected: object, hint: str | None = None) -> FormatError:
        return FormatError(self.path, self.no, field, found, expected, hint)

    def exact(self, expected: str, field: str = "header") -> None:
        if self.text != expected:
            raise self.error(field, self.text, repr(expected))

    def split(self, names: Sequence[str], n_optional: int = 0) -> list[str]:
        """The line's fields; their number must be len(names), or down to len(names) - n_optional."""
        fields = self.text.split(" ")
        if "" in fields:
            raise self.error(None, self.text, "fields separated by single spaces, no leading or trailing space")
        lo, hi = len(names) - n_optional, len(names)
        if not lo <= len(fields) <= hi:
            want = f"{hi}" if lo == hi else f"{lo} or {hi}"
            raise self.error(None, Phrase(f"{len(fields)} fields"), f"{want} fields: {' '.join(names)}")
        return fields

    def uint(self, token: str, field: str, lo: int = 0, hi: int = MAX_I64) -> int:
        """A canonical decimal integer in [lo, hi]."""
        if not _UINT.fullmatch(token):
            raise self.error(field, token, "a decimal integer without sign or leading zeros")
        # int() of a 5000-digit token raises ValueError (Python's digit limit), so long ones stop here.
        value = int(token) if len(token) <= 20 else None
        if value is None or not lo <= value <= hi:
            raise self.error(field, token if value is None else value, lo if lo == hi else f"an integer in {lo}..{hi}")
        return value

    def name(self, token: str, field: str) -> str:
        if not _NAME.fullmatch(token):
            raise self.error(field, token, "a non-empty name of printable ASCII without spaces")
        return token

    def file_name(self, token: str, field: str) -> str:
        problem = file_name_problem(token)
        if problem:
            raise self.error(field, token, problem)
        return token


def file_name_problem(name: object) -> str | None:
    """Why `name` is not a bare file name, or None. Files are looked up beside the pack or GGUF."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", "..") or "/" in name or "\\" in name:
        return "a bare file name (printable ASCII, no spaces, no path separators)"
    return None


def name_problem(name: object) -> str | None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return "a non-empty name of printable ASCII without spaces"
    return None


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `<path>.tmp-<pid>` and rename it over `path`: readers see all of it or none."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="ascii", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def line_at(path: str | os.PathLike, lines: list[Line], index: int, expected: str) -> Line:
    """lines[index], or an error saying the file ended before the line `expected` describes."""
    if index < len(lines):
        return lines[index]
    raise FormatError(path, index + 1, None, Phrase("the end of the file"), expected, "truncated file?")
