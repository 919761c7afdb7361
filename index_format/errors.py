"""The one error every flat-file reader raises for bad content.

A reader that half-accepts a line is how a wrong byte offset becomes a plausible weight (seed, 6.3),
so every problem is reported with enough to find and fix it by hand: the file, the 1-based line, the
field, what was there and what the format requires.
"""

from __future__ import annotations

import os

_SHOWN_CHARS = 120  # long header lines are cut in messages; the attribute keeps the whole value


class Phrase(str):
    """A `found` that describes rather than quotes (``16 fields``, ``the end of the file``)."""


def _show(value: object) -> str:
    # Raw text from the file is quoted so a stray space or tab is visible; numbers read as numbers.
    if isinstance(value, str) and not isinstance(value, Phrase):
        text = repr(value)
        return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 4] + "...'"
    return str(value)


class FormatError(ValueError):
    """Bad content in a Strata flat file.

    `str()` reads like ``pack/index.txt line 7, field offset: found 100, expected a multiple of 64``.
    `line` is 1-based (None for a whole-file problem), `field` None for a whole-line problem.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        line: int | None,
        field: str | None,
        found: object,
        expected: object,
        hint: str | None = None,
    ):
        self.path = os.fspath(path)
        self.line = line
        self.field = field
        self.found = found
        self.expected = expected
        self.hint = hint
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.path
        if self.line is not None:
            where += f" line {self.line}"
        if self.field is not None:
            where += f", field {self.field}"
        text = f"{where}: found {_show(self.found)}, expected {self.expected}"
        return f"{text} ({self.hint})" if self.hint else text

    def __str__(self) -> str:
        return self._message()

    def __reduce__(self):
        # Exceptions pickle through their args; ours has keyword-rich construction (multiprocessing).
        return (FormatError, (self.path, self.line, self.field, self.found, self.expected, self.hint))


class BinaryFormatError(FormatError):
    """Bad content in a Strata binary file (expert-profile.bin, a routing trace).

    A binary file has no lines, so the place is the byte `offset` where the bad field starts:
    ``data/expert-profile.bin at byte 108, field count: found 0, expected at least 1``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        offset: int,
        field: str | None,
        found: object,
        expected: object,
        hint: str | None = None,
    ):
        self.offset = offset
        super().__init__(path, None, field, found, expected, hint)

    def _message(self) -> str:
        where = f"{self.path} at byte {self.offset}"
        if self.field is not None:
            where += f", field {self.field}"
        text = f"{where}: found {_show(self.found)}, expected {self.expected}"
        return f"{text} ({self.hint})" if self.hint else text

    def __reduce__(self):
        return (BinaryFormatError, (self.path, self.offset, self.field, self.found, self.expected, self.hint))
