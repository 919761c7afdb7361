"""`tokenizer.txt`: a byte-level BPE tokenizer in a flat form the engine loads without a JSON parser (S4).

    # strata tokenizer v1
    model gpt2
    pre <pre-tokenizer name>
    tokens N
    <id> <type> <hex of the token text's UTF-8 bytes, or - when empty>     (N lines, ids 0..N-1)
    merges M
    <hex left> <hex right>                                                 (M lines, in rank order)
    special <bos|eos|pad|unk> <id>                                         (each optional, in that order)
    add_bos <0|1>
    chat_template <hex of UTF-8>                                           (optional)

Token texts are stored as hex so any byte (a space, a newline, invalid UTF-8) survives unchanged.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ._text import Line, line_at, name_problem, read_lines, split_lines, write_atomic
from .errors import Phrase

HEADER = "# strata tokenizer v1"
MODELS = ("gpt2",)  # byte-level BPE, the only kind the engine's tokenizer implements
SPECIALS = ("bos", "eos", "pad", "unk")
TOKEN_TYPES = range(1, 7)  # GGUF: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_HEX_TEXT = "lowercase hex of the bytes, two digits per byte"


@dataclass(frozen=True)
class FlatTokenizer:
    model: str
    pre: str
    tokens: tuple[bytes, ...]
    token_types: tuple[int, ...]
    merges: tuple[tuple[bytes, bytes], ...]
    special: dict[str, int] = field(default_factory=dict)
    add_bos: bool = False
    chat_template: str | None = None

    def __post_init__(self) -> None:
        for name in ("tokens", "token_types", "merges"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        object.__setattr__(self, "merges", tuple(tuple(m) for m in self.merges))
        object.__setattr__(self, "special", dict(self.special))
        problem = _problem(self)
        if problem:
            raise ValueError(f"FlatTokenizer: {problem}")


def _problem(t: FlatTokenizer) -> str | None:
    if t.model not in MODELS:
        return f"model {t.model!r}, expected one of {', '.join(MODELS)}"
    if name_problem(t.pre):
        return f"pre {t.pre!r}, expected {name_problem(t.pre)}"
    if len(t.token_types) != len(t.tokens) or not t.tokens:
        return f"{len(t.tokens)} tokens and {len(t.token_types)} token types, expected as many of each, at least 1"
    if any(type(b) is not bytes for b in t.tokens):
        return "a token that is not bytes"
    if any(type(x) is not int or x not in TOKEN_TYPES for x in t.token_types):
        return f"a token type outside {TOKEN_TYPES.start}..{TOKEN_TYPES.stop - 1}"
    if any(len(m) != 2 or type(m[0]) is not bytes or type(m[1]) is not bytes or not m[0] or not m[1] for m in t.merges):
        return "a merge that is not two non-empty bytes"
    for name, i in t.special.items():
        if name not in SPECIALS or type(i) is not int or not 0 <= i < len(t.tokens):
            return f"special {name!r} = {i!r}, expected one of {', '.join(SPECIALS)} with an id in 0..{len(t.tokens) - 1}"
    if type(t.add_bos) is not bool:
        return f"add_bos {t.add_bos!r}, expected a bool"
    if t.chat_template is not None and (not isinstance(t.chat_template, str) or not t.chat_template):
        return f"chat_template {t.chat_template!r}, expected None or a non-empty str"
    return None


def _hex(b: bytes) -> str:
    return b.hex() if b else "-"


def format_tokenizer(t: FlatTokenizer) -> str:
    lines = [HEADER, f"model {t.model}", f"pre {t.pre}", f"tokens {len(t.tokens)}"]
    lines += [f"{i} {kind} {_hex(b)}" for i, (b, kind) in enumerate(zip(t.tokens, t.token_types))]
    lines.append(f"merges {len(t.merges)}")
    lines += [f"{a.hex()} {b.hex()}" for a, b in t.merges]
    lines += [f"special {name} {t.special[name]}" for name in SPECIALS if name in t.special]
    lines.append(f"add_bos {int(t.add_bos)}")
    if t.chat_template is not None:
        lines.append(f"chat_template {t.chat_template.encode('utf-8').hex()}")
    return "\n".join(lines) + "\n"


def write_tokenizer(path: str | os.PathLike, t: FlatTokenizer) -> None:
    """Write `t` atomically, after checking that the reader accepts the text."""
    text = format_tokenizer(t)
    _parse(path, split_lines(path, text.encode("ascii")))
    write_atomic(path, text)


def read_tokenizer(path: str | os.PathLike) -> FlatTokenizer:
    """Read and check all of `path`."""
    return _parse(path, read_lines(path))


class _Cursor:
    """Walks the lines in their fixed order; a missing line is reported as the end of the file."""

    def __init__(self, path: str | os.PathLike, lines: list[Line]):
        self.path, self.lines, self.i = path, lines, 0

    def next(self, expected: str) -> Line:
        line = line_at(self.path, self.lines, self.i, expected)
        self.i += 1
        return line

    def peek_word(self) -> str | None:
        return self.lines[self.i].text.split(" ", 1)[0] if self.i < len(self.lines) else None

    def keyed(self, key: str, n_values: int = 1) -> tuple[Line, list[str]]:
        """The next line, which must be `key value...`."""
        line = self.next(f"a line '{key} ...'")
        tokens = line.split([key] + [f"{key} value"] * n_values)
        if tokens[0] != key:
            raise line.error("key", tokens[0], repr(key), "the lines of tokenizer.txt come in a fixed order")
        return line, tokens[1:]


def _parse(path: str | os.PathLike, lines: list[Line]) -> FlatTokenizer:
    cur = _Cursor(path, lines)
    cur.next(repr(HEADER)).exact(HEADER)
    line, (model,) = cur.keyed("model")
    if model not in MODELS:
        raise line.error("model", model, f"one of {', '.join(MODELS)}", "byte-level BPE")
    line, (pre,) = cur.keyed("pre")
    line.name(pre, "pre")
    line, (n,) = cur.keyed("tokens")
    n = line.uint(n, "tokens", lo=1)
    tokens, types = _parse_tokens(cur, n)
    line, (m,) = cur.keyed("merges")
    merges = tuple(_parse_merge(cur.next(f"merge line {k + 1} of {m}")) for k in range(line.uint(m, "merges")))
    special = _parse_special(cur, n)
    line, (add_bos,) = cur.keyed("add_bos")
    add_bos = bool(line.uint(add_bos, "add_bos", hi=1))
    template = _parse_template(cur) if cur.peek_word() is not None else None
    if cur.i < len(lines):
        extra = lines[cur.i]
        raise extra.error(None, extra.text, Phrase("the end of the file"), "a line after the last one the format has")
    return FlatTokenizer(model, pre, tokens, types, merges, special, add_bos, template)


def _parse_tokens(cur: _Cursor, n: int) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
    tokens, types = [], []
    for i in range(n):
        line = cur.next(f"token line {i + 1} of {n}")
        id_, kind, text = line.split(("id", "type", "bytes"))
        if line.uint(id_, "id") != i:
            raise line.error("id", int(id_), i, "token ids are dense, 0..N-1, in order")
        types.append(line.uint(kind, "type", TOKEN_TYPES.start, TOKEN_TYPES.stop - 1))
        tokens.append(b"" if text == "-" else _unhex(line, text, "bytes"))
    return tuple(tokens), tuple(types)


def _parse_merge(line: Line) -> tuple[bytes, bytes]:
    left, right = line.split(("left", "right"))
    return _unhex(line, left, "left"), _unhex(line, right, "right")


def _parse_special(cur: _Cursor, n: int) -> dict[str, int]:
    special: dict[str, int] = {}
    while cur.peek_word() == "special":
        line, (name, id_) = cur.keyed("special", 2)
        rank = SPECIALS.index(name) if name in SPECIALS else -1
        if rank < 0 or any(SPECIALS.index(k) >= rank for k in special):
            raise line.error("name", name, f"one of {', '.join(SPECIALS)}, each at most once, in that order")
        special[name] = line.uint(id_, "id", hi=n - 1)
    return special


def _parse_template(cur: _Cursor) -> str:
    line, (text,) = cur.keyed("chat_template")
    try:
        return _unhex(line, text, "chat_template").decode("utf-8")
    except UnicodeDecodeError as e:
        raise line.error("chat_template", Phrase(f"invalid UTF-8 at byte {e.start}"), "hex of UTF-8 text") from None


def _unhex(line: Line, token: str, field: str) -> bytes:
    if not _HEX.fullmatch(token):
        raise line.error(field, token, _HEX_TEXT)
    return bytes.fromhex(token)
