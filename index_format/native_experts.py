"""`native_experts.txt` v3: where each MoE layer's experts lie in the GGUF, referenced in place (S5).

    # strata native experts v3: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard]
    # (n_expert N, total BYTES; absolute offsets in <gguf name>, or in the named shard beside it)
    layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard]

An expert's size varies by layer (seed: layer 0 IQ2_XS + IQ4_NL = 1,868,800 B, layer 1 IQ2_XXS + Q2_0
= 1,305,600 B), so blob_bytes is per line and, given the geometry, checked against the types.
`offset` is the layer's start in the concatenation of all layers' experts (the expert cache's
numbering), a running sum; total in the header closes the sum, so a truncated file is refused.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._text import MAX_I64, Line, file_name_problem, line_at, read_lines, split_lines, write_atomic
from .errors import FormatError, Phrase
from .ggml_types import BY_ID, TYPES, GGMLType

HEADER = "# strata native experts v3: layer gu_type d_type offset blob_bytes gate_off up_off down_off [shard]"
_COUNTS = re.compile(r"# \(n_expert (\S+), total (\S+); absolute offsets in (\S+), or in the named shard beside it\)")
_COUNTS_TEXT = "'# (n_expert N, total BYTES; absolute offsets in <gguf name>, or in the named shard beside it)'"
FIELDS = ("layer", "gu_type", "d_type", "offset", "blob_bytes", "gate_off", "up_off", "down_off", "shard")
ROLES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# The GGUF spec makes general.alignment a multiple of 8 (default 32); tensor data starts aligned.
GGUF_ALIGN = 8
_KNOWN = ", ".join(f"{t.name}={t.id}" for t in TYPES)

Problem = tuple[str, object, object, "str | None"]  # field, found, expected, hint


def expert_bytes(gu: GGMLType, d: GGMLType, n_embd: int, n_ff: int) -> tuple[int, int, int]:
    """Bytes of one expert's (gate, up, down).

    gate, up: [n_embd -> n_ff], n_ff rows of n_embd elements; down: [n_ff -> n_embd], n_embd rows of n_ff.
    Raises ValueError when a row is not whole blocks of its type.
    """
    g = gu.row_bytes(n_embd) * n_ff
    return g, g, d.row_bytes(n_ff) * n_embd


def blob_bytes_for(gu_type: int, d_type: int, n_embd: int, n_ff: int) -> int:
    """Bytes of one expert (gate + up + down) for GGML type ids `gu_type`, `d_type`."""
    return sum(expert_bytes(BY_ID[gu_type], BY_ID[d_type], n_embd, n_ff))


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's experts: byte offsets are absolute in `shard`, or in the main GGUF when None."""

    layer: int
    gu_type: int
    d_type: int
    offset: int
    blob_bytes: int
    gate_off: int
    up_off: int
    down_off: int
    shard: str | None = None

    def __post_init__(self) -> None:
        for field in FIELDS[:-1]:
            value = getattr(self, field)
            if type(value) is not int or not 0 <= value <= MAX_I64:
                raise ValueError(f"layer {self.layer!r}, field {field}: found {value!r}, expected an int in 0..{MAX_I64}")
        if self.shard is not None and file_name_problem(self.shard):
            raise ValueError(f"layer {self.layer}, field shard: found {self.shard!r}, expected {file_name_problem(self.shard)}")

    def tokens(self) -> list[str]:
        values = [getattr(self, f) for f in FIELDS[:-1]]
        return [str(v) for v in values] + ([self.shard] if self.shard is not None else [])

    def ranges(self, n_expert: int, n_embd: int, n_ff: int) -> dict[str, tuple[int, int]]:
        """[start, end) in the shard of the layer's ffn_gate_exps, ffn_up_exps and ffn_down_exps data."""
        sizes = expert_bytes(BY_ID[self.gu_type], BY_ID[self.d_type], n_embd, n_ff)
        offs = (self.gate_off, self.up_off, self.down_off)
        return {role: (off, off + n_expert * size) for role, off, size in zip(ROLES, offs, sizes)}


@dataclass(frozen=True)
class NativeExperts:
    """All MoE layers' experts in `gguf` (the main file's name) and the shards beside it."""

    gguf: str
    n_expert: int
    layers: tuple[ExpertLayer, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not all(isinstance(e, ExpertLayer) for e in self.layers):
            raise ValueError("NativeExperts.layers: expected ExpertLayer items")
        try:
            # One set of rules: the in-memory object is checked by formatting and parsing it.
            _parse("<NativeExperts>", split_lines("<NativeExperts>", _format(self).encode("ascii")), _Geometry())
        except (FormatError, UnicodeEncodeError) as e:
            raise ValueError(str(e)) from None

    @property
    def total(self) -> int:
        return sum(self.n_expert * e.blob_bytes for e in self.layers)

    def shard_of(self, layer: int) -> str:
        """The file name holding `layer`'s experts: its shard, or the main GGUF."""
        for e in self.layers:
            if e.layer == layer:
                return e.shard if e.shard is not None else self.gguf
        raise KeyError(f"layer {layer} has no experts in native_experts.txt")

    @classmethod
    def build(cls, gguf: str, n_expert: int, rows: Iterable[Sequence]) -> NativeExperts:
        """From rows (layer, gu_type, d_type, blob_bytes, gate_off, up_off, down_off, shard), offsets summed."""
        layers, offset = [], 0
        for layer, gu, d, blob, gate, up, down, shard in rows:
            layers.append(ExpertLayer(layer, gu, d, offset, blob, gate, up, down, shard))
            offset += n_expert * blob
        return cls(gguf, n_expert, tuple(layers))


@dataclass(frozen=True)
class _Geometry:
    """What the caller knows of the model; each given value becomes a check."""

    n_embd: int | None = None
    n_ff: int | None = None
    n_expert: int | None = None
    layers: tuple[int, ...] | None = None


class _Checker:
    """The cross-line rules: increasing layers, running offsets, ranges disjoint within a shard."""

    def __init__(self, gguf: str, n_expert: int, geo: _Geometry):
        self.gguf, self.n_expert, self.geo = gguf, n_expert, geo
        self.count, self.prev_layer, self.offset = 0, -1, 0
        self.taken: dict[str, list[tuple[int, int, str]]] = {}  # shard -> [start, end), what

    def add(self, e: ExpertLayer) -> Problem | None:
        problem = self._layer(e) or self._types(e) or self._offsets(e) or self._shard(e)
        if problem is None and self.geo.n_embd is not None:
            problem = self._geometry(e) or self._disjoint(e)
        self.count += 1
        self.prev_layer = e.layer
        self.offset += self.n_expert * e.blob_bytes
        return problem

    def _layer(self, e: ExpertLayer) -> Problem | None:
        if e.layer <= self.prev_layer:
            return "layer", e.layer, f"more than {self.prev_layer}", "one line per MoE layer, in increasing order"
        want = self.geo.layers
        if want is not None and (self.count >= len(want) or e.layer != want[self.count]):
            exp = want[self.count] if self.count < len(want) else "no more lines"
            return "layer", e.layer, exp, f"the model's MoE layers are {_short(want)}"
        return None

    def _types(self, e: ExpertLayer) -> Problem | None:
        for field in ("gu_type", "d_type"):
            if getattr(e, field) not in BY_ID:
                return field, getattr(e, field), "a GGML type id Strata knows", _KNOWN
        return None

    def _offsets(self, e: ExpertLayer) -> Problem | None:
        if e.offset != self.offset:
            return "offset", e.offset, self.offset, "the sum of n_expert * blob_bytes over the lines above"
        if e.blob_bytes < 1:
            return "blob_bytes", e.blob_bytes, "at least 1", None
        if self.offset + self.n_expert * e.blob_bytes > MAX_I64:
            return "blob_bytes", e.blob_bytes, f"a running total at most {MAX_I64}", None
        for field in ("gate_off", "up_off", "down_off"):
            if getattr(e, field) % GGUF_ALIGN:
                return field, getattr(e, field), f"a multiple of {GGUF_ALIGN}", "GGUF tensor data is aligned"
        return None

    def _shard(self, e: ExpertLayer) -> Problem | None:
        if e.shard is None:
            return None
        why = file_name_problem(e.shard)
        if why:
            return "shard", e.shard, why, None
        if e.shard == self.gguf:
            return "shard", e.shard, "no shard field for the main GGUF", "the main file is the one in the header"
        return None

    def _geometry(self, e: ExpertLayer) -> Problem | None:
        gu, d, n_embd, n_ff = BY_ID[e.gu_type], BY_ID[e.d_type], self.geo.n_embd, self.geo.n_ff
        for field, t, row in (("gu_type", gu, n_embd), ("d_type", d, n_ff)):
            if row % t.block_size:
                return field, t.id, f"a type whose {t.block_size}-element blocks divide rows of {row}", t.name
        want = sum(expert_bytes(gu, d, n_embd, n_ff))
        if e.blob_bytes != want:
            hint = f"gate+up+down of one expert: {gu.name} [{n_embd} -> {n_ff}] x2 + {d.name} [{n_ff} -> {n_embd}]"
            return "blob_bytes", e.blob_bytes, want, hint
        return None

    def _disjoint(self, e: ExpertLayer) -> Problem | None:
        shard = e.shard if e.shard is not None else self.gguf
        taken = self.taken.setdefault(shard, [])
        for (role, (start, end)), field in zip(e.ranges(self.n_expert, self.geo.n_embd, self.geo.n_ff).items(), FIELDS[5:8]):
            for s, t, what in taken:
                if start < t and s < end:
                    return field, start, f"a range not overlapping {what} [{s}, {t})", f"{role} would be [{start}, {end}) in {shard}"
            taken.append((start, end, f"{role} of layer {e.layer}"))
        return None


def _short(layers: Sequence[int]) -> str:
    if layers and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}..{layers[-1]}"
    return " ".join(map(str, layers))


# --- the file -------------------------------------------------------------------------------------


def _format(ne: NativeExperts) -> str:
    lines = [HEADER, f"# (n_expert {ne.n_expert}, total {ne.total}; absolute offsets in {ne.gguf}, or in the named shard beside it)"]
    lines += [" ".join(e.tokens()) for e in ne.layers]
    return "\n".join(lines) + "\n"


def write_native_experts(path: str | os.PathLike, ne: NativeExperts, *, n_embd: int | None = None, n_ff: int | None = None) -> None:
    """Write `ne` atomically, after checking the reader accepts it (with the geometry, when given)."""
    text = _format(ne)
    _parse(path, split_lines(path, text.encode("ascii")), _geometry(n_embd, n_ff, None, None))
    write_atomic(path, text)


def read_native_experts(
    path: str | os.PathLike,
    *,
    n_embd: int | None = None,
    n_ff: int | None = None,
    n_expert: int | None = None,
    layers: Iterable[int] | None = None,
) -> NativeExperts:
    """Read and check all of `path`.

    With n_embd and n_ff, every blob_bytes must be what its types imply and the gate/up/down ranges
    must not overlap within a file; with n_expert, the header must agree; with `layers` (the
    model's MoE layers), the lines must be exactly those layers.
    """
    return NativeExperts(*_parse(path, read_lines(path), _geometry(n_embd, n_ff, n_expert, layers)))


def _geometry(n_embd, n_ff, n_expert, layers) -> _Geometry:
    if (n_embd is None) != (n_ff is None):
        raise TypeError("give n_embd and n_ff together (blob_bytes depends on both)")
    for name, value in (("n_embd", n_embd), ("n_ff", n_ff), ("n_expert", n_expert)):
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{name}: found {value!r}, expected a positive int")
    return _Geometry(n_embd, n_ff, n_expert, None if layers is None else tuple(layers))


def _parse(path: str | os.PathLike, lines: list[Line], geo: _Geometry) -> tuple[str, int, tuple[ExpertLayer, ...]]:
    """(gguf, n_expert, layers) of a file that passes every check; raises FormatError at the first problem."""
    line_at(path, lines, 0, repr(HEADER)).exact(HEADER)
    counts = line_at(path, lines, 1, _COUNTS_TEXT)
    n_expert, total, gguf = _parse_counts(counts, geo)
    checker, layers = _Checker(gguf, n_expert, geo), []
    for line in lines[2:]:
        e = _parse_layer(line)
        problem = checker.add(e)
        if problem:
            raise line.error(*problem)
        layers.append(e)
    if not layers:
        raise FormatError(path, 3, None, Phrase("the end of the file"), "one line per MoE layer", "truncated file?")
    if total != checker.offset:
        raise counts.error("total", total, checker.offset, "the sum of n_expert * blob_bytes over all lines; truncated or edited?")
    if geo.layers is not None and len(layers) != len(geo.layers):
        missing = geo.layers[len(layers)]
        raise FormatError(path, len(lines) + 1, "layer", Phrase("the end of the file"), f"a line for layer {missing}", "truncated file?")
    return gguf, n_expert, tuple(layers)


def _parse_counts(line: Line, geo: _Geometry) -> tuple[int, int, str]:
    m = _COUNTS.fullmatch(line.text)
    if not m:
        raise line.error("header", line.text, _COUNTS_TEXT)
    n_expert = line.uint(m.group(1), "n_expert", lo=1)
    if geo.n_expert is not None and n_expert != geo.n_expert:
        raise line.error("n_expert", n_expert, geo.n_expert, "the model's expert count")
    return n_expert, line.uint(m.group(2), "total"), line.file_name(m.group(3), "gguf")


def _parse_layer(line: Line) -> ExpertLayer:
    tokens = line.split(FIELDS, n_optional=1)
    values = [line.uint(t, f) for f, t in zip(FIELDS, tokens[:8])]
    return ExpertLayer(*values, tokens[8] if len(tokens) == 9 else None)
