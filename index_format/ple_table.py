"""`ple_table.txt` v1: where the PLE n-gram table lies in its GGUF shard, referenced in place (S16).

    # strata ple table v1: name type ne0 ne1 offset nbytes [shard]
    # (absolute offset in <gguf name>, or in the named shard beside it)
    name type ne0 ne1 offset nbytes [shard]

The table (per_layer_token_embd.weight, [row_dim, rows] in GGUF order) is far too big to copy into
the pool, so, like the experts, it stays in the GGUF and is served by offset: row r of it is the
`row_bytes` bytes at offset + r * row_bytes. nbytes is redundant with type and shape, so a single
changed number cannot make a line that still reads as valid.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ._text import MAX_I64, Line, file_name_problem, line_at, name_problem, read_lines, split_lines, write_atomic
from .errors import Phrase
from .ggml_types import BY_ID, TYPES, GGMLType

HEADER = "# strata ple table v1: name type ne0 ne1 offset nbytes [shard]"
_WHERE = re.compile(r"# \(absolute offset in (\S+), or in the named shard beside it\)")
_WHERE_TEXT = "'# (absolute offset in <gguf name>, or in the named shard beside it)'"
FIELDS = ("name", "type", "ne0", "ne1", "offset", "nbytes", "shard")
GGUF_ALIGN = 8  # GGUF tensor data starts at a multiple of general.alignment, itself a multiple of 8
_KNOWN = ", ".join(f"{t.name}={t.id}" for t in TYPES)


@dataclass(frozen=True)
class PleTable:
    """The table in `shard` (a file beside `gguf`), or in `gguf` itself when shard is None."""

    gguf: str
    name: str
    type_id: int
    row_dim: int  # ne0: elements per row
    rows: int  # ne1
    offset: int  # absolute, in the file that holds it
    nbytes: int
    shard: str | None = None

    def __post_init__(self) -> None:
        problem = _problem(vars(self))
        if problem:
            field, found, expected, hint = problem
            text = f"PleTable, field {field}: found {found!r}, expected {expected}"
            raise ValueError(f"{text} ({hint})" if hint else text)

    @property
    def type(self) -> GGMLType:
        return BY_ID[self.type_id]

    @property
    def row_bytes(self) -> int:
        return self.type.row_bytes(self.row_dim)

    @property
    def file(self) -> str:
        """The name of the file holding the table."""
        return self.shard if self.shard is not None else self.gguf


_LINE_FIELD = {"type_id": "type", "row_dim": "ne0", "rows": "ne1", "offset": "offset", "nbytes": "nbytes"}


def _problem(v: dict) -> tuple[str, object, object, str | None] | None:
    """The first way the fields (PleTable's, by attribute name) are wrong, with the file's field name."""
    for field in ("gguf", "shard"):
        if (v[field] is not None or field == "gguf") and file_name_problem(v[field]):
            return field, v[field], file_name_problem(v[field]), None
    if v["shard"] == v["gguf"]:
        return "shard", v["shard"], "no shard field for the main GGUF", "the main file is the one in the header"
    if name_problem(v["name"]):
        return "name", v["name"], name_problem(v["name"]), None
    for attr, field in _LINE_FIELD.items():
        if type(v[attr]) is not int or not 0 <= v[attr] <= MAX_I64:
            return field, v[attr], f"an int in 0..{MAX_I64}", None
    t = BY_ID.get(v["type_id"])
    if t is None:
        return "type", v["type_id"], "a GGML type id Strata knows", _KNOWN
    for attr in ("row_dim", "rows"):
        if v[attr] < 1:
            return _LINE_FIELD[attr], v[attr], "at least 1", None
    if v["row_dim"] % t.block_size:
        return "ne0", v["row_dim"], f"a multiple of {t.block_size}", f"{t.name} rows are whole blocks"
    want = t.nbytes((v["row_dim"], v["rows"]))
    if v["nbytes"] != want:
        return "nbytes", v["nbytes"], want, f"{t.name} of shape ({v['row_dim']}, {v['rows']})"
    if v["offset"] % GGUF_ALIGN:
        return "offset", v["offset"], f"a multiple of {GGUF_ALIGN}", "GGUF tensor data is aligned"
    if v["offset"] + v["nbytes"] > MAX_I64:
        return "nbytes", v["nbytes"], f"offset + nbytes at most {MAX_I64}", None
    return None


def format_ple_table(t: PleTable) -> str:
    values = [t.name, t.type_id, t.row_dim, t.rows, t.offset, t.nbytes] + ([t.shard] if t.shard is not None else [])
    lines = [HEADER, f"# (absolute offset in {t.gguf}, or in the named shard beside it)", " ".join(map(str, values))]
    return "\n".join(lines) + "\n"


def write_ple_table(path: str | os.PathLike, t: PleTable) -> None:
    """Write `t` atomically, after checking that the reader accepts the text."""
    text = format_ple_table(t)
    _parse(path, split_lines(path, text.encode("ascii")), None, None)
    write_atomic(path, text)


def read_ple_table(path: str | os.PathLike, *, row_dim: int | None = None, rows: int | None = None) -> PleTable:
    """Read and check all of `path`; `row_dim` and `rows` (from the geometry), when given, must match."""
    return _parse(path, read_lines(path), row_dim, rows)


def _parse(path: str | os.PathLike, lines: list[Line], row_dim: int | None, rows: int | None) -> PleTable:
    line_at(path, lines, 0, repr(HEADER)).exact(HEADER)
    where = line_at(path, lines, 1, _WHERE_TEXT)
    m = _WHERE.fullmatch(where.text)
    if not m:
        raise where.error("header", where.text, _WHERE_TEXT)
    gguf = where.file_name(m.group(1), "gguf")
    line = line_at(path, lines, 2, "the table's line: " + " ".join(FIELDS))
    if len(lines) > 3:
        raise lines[3].error(None, lines[3].text, Phrase("the end of the file"), "one table line only")
    tokens = line.split(FIELDS, n_optional=1)
    name = line.name(tokens[0], "name")
    values = [line.uint(tok, field) for field, tok in zip(FIELDS[1:6], tokens[1:6])]
    shard = line.file_name(tokens[6], "shard") if len(tokens) == 7 else None
    for field, got, want in (("ne0", values[1], row_dim), ("ne1", values[2], rows)):
        if want is not None and got != want:
            raise line.error(field, got, want, "the geometry's PLE table shape (geometry.txt)")
    v = dict(zip(("gguf", "name", "type_id", "row_dim", "rows", "offset", "nbytes", "shard"), (gguf, name, *values, shard)))
    problem = _problem(v)
    if problem:
        raise (where if problem[0] == "gguf" else line).error(*problem)
    return PleTable(**v)
