"""`geometry.txt`: the model's hyperparameters as typed key/value lines, read by the engine without JSON.

    # strata geometry v1
    key kind count value...

kind is i64, u64, f64, str or bool. u64 exists because the PLE hash multipliers exceed 2^53: read as
floats they silently change (BRIEF, known traps), so integers are never floats here, on either side.
f64 values are written with float.hex(), the one spelling that round-trips every double exactly.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote, unquote_to_bytes

from ._text import Line, line_at, read_lines, split_lines, write_atomic

HEADER = "# strata geometry v1"
KINDS = ("i64", "u64", "f64", "str", "bool")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_KEY_TEXT = "a key of letters, digits, '_', '.', '-' that starts with a letter or '_'"
_I64 = re.compile(r"-?(0|[1-9][0-9]{0,18})")
_U64 = re.compile(r"0|[1-9][0-9]{0,19}")
_PCT = re.compile(r"(?:[A-Za-z0-9_.~-]|%[0-9A-F]{2})+")
_RANGES = {"i64": (-(2**63), 2**63 - 1), "u64": (0, 2**64 - 1)}
_EXPECTED = {
    "i64": f"a decimal integer in {-(2**63)}..{2**63 - 1}",
    "u64": f"a decimal integer in 0..{2**64 - 1}",
    "f64": "a finite float written as float.hex() writes it (e.g. 0x1.8000000000000p+1)",
    "str": "a non-empty percent-encoded UTF-8 string (unreserved characters as is, %XX uppercase)",
    "bool": "0 or 1",
}


@dataclass(frozen=True)
class HParam:
    """A typed value: `values` holds `count` values of `kind` (a scalar is a count of 1)."""

    kind: str
    values: tuple

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"HParam kind: found {self.kind!r}, expected one of {', '.join(KINDS)}")
        values = tuple(_coerce(self.kind, v) for v in self.values)
        if self.kind == "str" and len(values) != 1:
            raise ValueError(f"HParam str: found {len(values)} values, expected exactly 1")
        object.__setattr__(self, "values", values)

    @property
    def count(self) -> int:
        return len(self.values)

    def scalar(self) -> int | float | str | bool:
        """The one value; a ValueError when there are 0 or several."""
        if len(self.values) != 1:
            raise ValueError(f"HParam {self.kind}: found {len(self.values)} values, expected a scalar")
        return self.values[0]

    def array(self) -> tuple:
        return self.values


def _coerce(kind: str, v: object) -> object:
    """`v` as the Python type of `kind`; numpy integers are taken exactly, never through float."""
    if kind in _RANGES:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ValueError(f"HParam {kind}: found {v!r}, expected an integer")
        lo, hi = _RANGES[kind]
        if not lo <= int(v) <= hi:
            raise ValueError(f"HParam {kind}: found {v!r}, expected {_EXPECTED[kind]}")
        return int(v)
    if kind == "f64":
        if isinstance(v, numbers.Integral) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"HParam f64: found {v!r}, expected a finite float")
        return float(v)
    if kind == "str":
        if not isinstance(v, str) or not v:
            raise ValueError(f"HParam str: found {v!r}, expected a non-empty str")
        return v
    if not isinstance(v, bool):
        raise ValueError(f"HParam bool: found {v!r}, expected True or False")
    return v


def to_hparam(key: str, value: object) -> HParam:
    """A plain Python value as an HParam: int -> i64 (u64 from 2^63), float -> f64, str, bool, tuples."""
    if isinstance(value, HParam):
        return value
    if isinstance(value, (tuple, list)):
        kinds = {_kind_of(v) for v in value}
        if len(kinds) != 1 or "str" in kinds or "u64" in kinds:
            raise ValueError(
                f"geometry key {key!r}: found an array of kinds {sorted(kinds)}, expected one of i64, f64, bool "
                "(give HParam(kind, values) for u64 or empty arrays)"
            )
        return HParam(kinds.pop(), tuple(value))
    return HParam(_kind_of(value), (value,))


def _kind_of(v: object) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, numbers.Integral):
        return "u64" if int(v) >= 2**63 else "i64"
    if isinstance(v, numbers.Real):
        return "f64"
    if isinstance(v, str):
        return "str"
    raise ValueError(f"found a value {v!r} of type {type(v).__name__}, expected int, float, str, bool or a tuple")


def _format_value(kind: str, v: object) -> str:
    if kind == "f64":
        return v.hex()
    if kind == "str":
        return quote(v.encode("utf-8"), safe="")
    if kind == "bool":
        return "1" if v else "0"
    return str(v)


def format_hparams(values: Mapping[str, object]) -> str:
    params = {}
    for key, value in values.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"geometry key: found {key!r}, expected {_KEY_TEXT}")
        params[key] = to_hparam(key, value)
    lines = [HEADER]
    for key in sorted(params):  # sorted, so the same geometry always gives the same bytes (pack_fingerprint)
        p = params[key]
        lines.append(" ".join([key, p.kind, str(p.count)] + [_format_value(p.kind, v) for v in p.values]))
    return "\n".join(lines) + "\n"


def write_hparams(path: str | os.PathLike, values: Mapping[str, object]) -> None:
    """Write `values` (key -> HParam or plain value) sorted by key, atomically, after checking them."""
    text = format_hparams(values)
    _parse(path, split_lines(path, text.encode("ascii")))
    write_atomic(path, text)


def read_hparams(path: str | os.PathLike) -> dict[str, HParam]:
    """Read and check all of `path`; keys in file order."""
    return _parse(path, read_lines(path))


def _parse(path: str | os.PathLike, lines: list[Line]) -> dict[str, HParam]:
    line_at(path, lines, 0, repr(HEADER)).exact(HEADER)
    params: dict[str, HParam] = {}
    first_seen: dict[str, int] = {}
    for line in lines[1:]:
        key, param = _parse_line(line)
        if key in params:
            raise line.error("key", key, "a key not used on an earlier line", f"first at line {first_seen[key]}")
        params[key], first_seen[key] = param, line.no
    return params


def _parse_line(line: Line) -> tuple[str, HParam]:
    tokens = line.text.split(" ")
    if "" in tokens or len(tokens) < 3:
        raise line.error(None, line.text, "'key kind count value...' separated by single spaces")
    key, kind, count_token, values = tokens[0], tokens[1], tokens[2], tokens[3:]
    if not _KEY.fullmatch(key):
        raise line.error("key", key, _KEY_TEXT)
    if kind not in KINDS:
        raise line.error("kind", kind, f"one of {', '.join(KINDS)}")
    count = line.uint(count_token, "count", lo=1 if kind == "str" else 0, hi=1 if kind == "str" else 2**63 - 1)
    if count != len(values):
        raise line.error("count", count, len(values), "the number of values on the line")
    return key, HParam(kind, tuple(_parse_value(line, kind, i, t) for i, t in enumerate(values)))


def _parse_value(line: Line, kind: str, i: int, token: str) -> object:
    value = _value_or_none(kind, token)
    if value is None:
        raise line.error(f"value[{i}]", token, _EXPECTED[kind])
    return value


def _value_or_none(kind: str, token: str) -> object:
    """The value `token` spells in its one canonical form, or None."""
    if kind in _RANGES:
        if not (_I64 if kind == "i64" else _U64).fullmatch(token) or token == "-0":
            return None
        lo, hi = _RANGES[kind]
        return int(token) if lo <= int(token) <= hi else None
    if kind == "f64":
        try:
            value = float.fromhex(token)
        except ValueError:
            return None
        return value if math.isfinite(value) and value.hex() == token else None
    if kind == "str":
        if not _PCT.fullmatch(token):
            return None
        try:
            text = unquote_to_bytes(token).decode("utf-8")
        except UnicodeDecodeError:
            return None
        return text if quote(text.encode("utf-8"), safe="") == token else None
    return {"0": False, "1": True}.get(token)
