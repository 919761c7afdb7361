"""`expert-profile.bin` v1: how often each (layer, expert) pair was routed, ranked, tied to one pack.

The profile IS the expert cache's policy (S9): the engine fills the GPU slots from it once at startup
and admits nothing afterwards, so a profile that silently belonged to another pack, or whose counts
were cut short, would decide the whole run's hit rate without anyone noticing. Every field is
therefore checked against the others, and the file carries the pack's fingerprint and a CRC.

Layout (little-endian; docs/index-format.md, "expert-profile.bin"):

    offset  size  field
    0       8     magic            b"STRATAEP"
    8       4     version          u32 = 1
    12      4     n_layer          u32, 1..65536
    16      4     n_expert         u32, 1..65536
    20      4     top_k            u32, 1..n_expert (experts routed per token and layer)
    24      8     tokens           u64, >= 1: tokens counted
    32      8     n_records        u64, 1..n_layer * n_expert
    40      68    pack_fingerprint ASCII "pk1-" + 64 lowercase hex (manifest.pack_fingerprint)
    108     12*n  records          (layer u16, expert u16, count u64), ranked
    108+12n 4     crc32            CRC-32 of the records, continued over the 108 header bytes
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _binary as B
from ._text import MAX_I64
from .errors import BinaryFormatError

MAGIC = b"STRATAEP"
VERSION = 1
MAX_IDS = 1 << 16  # layer and expert ids are u16
RECORD = np.dtype([("layer", "<u2"), ("expert", "<u2"), ("count", "<u8")])  # packed: 12 bytes
HEADER = B.fields(("magic", "magic"), ("version", "u32"), ("n_layer", "u32"), ("n_expert", "u32"), ("top_k", "u32"),
                  ("tokens", "u64"), ("n_records", "u64"), ("pack_fingerprint", "fingerprint"), magic=MAGIC)
HEADER_BYTES = B.header_size(HEADER)
OFFSETS = B.offsets(HEADER)
RANK_ORDER = "count descending, then layer ascending, then expert ascending"


def rank(layer: np.ndarray, expert: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Indices that put pairs in the file's order: count desc, layer asc, expert asc (a total order)."""
    return np.lexsort((np.asarray(expert, np.int64), np.asarray(layer, np.int64), -np.asarray(count, np.int64)))


@dataclass(frozen=True, eq=False)
class ExpertProfile:
    """Routing counts of one pack's experts; `records` (RECORD dtype) hold the routed pairs, ranked."""

    pack_fingerprint: str
    n_layer: int
    n_expert: int
    top_k: int
    tokens: int
    records: np.ndarray

    def __post_init__(self) -> None:
        recs = np.ascontiguousarray(np.asarray(self.records, dtype=RECORD))
        recs.setflags(write=False)
        object.__setattr__(self, "records", recs)
        # One set of rules: the object is checked by the reader's own checks.
        r = B.Reader("<ExpertProfile>", b"", "an expert profile")
        try:
            _check_values(r, self._header(), recs)
        except BinaryFormatError as e:
            raise ValueError(str(e)) from None

    def _header(self) -> dict[str, object]:
        return {"pack_fingerprint": self.pack_fingerprint, "n_layer": self.n_layer, "n_expert": self.n_expert,
                "top_k": self.top_k, "tokens": self.tokens, "n_records": len(self.records)}

    @classmethod
    def from_counts(cls, pack_fingerprint: str, counts: np.ndarray, *, tokens: int, top_k: int) -> "ExpertProfile":
        """From a [n_layer, n_expert] matrix of routing counts; pairs never routed are left out."""
        c = np.asarray(counts)
        if c.ndim != 2 or not np.issubdtype(c.dtype, np.integer) or (c < 0).any():
            raise ValueError(f"routing counts: expected a 2-D matrix of non-negative integers, got {c.dtype} {c.shape}")
        layer, expert = np.nonzero(c)
        count = c[layer, expert].astype(np.int64)
        order = rank(layer, expert, count)
        recs = np.empty(len(order), RECORD)
        recs["layer"], recs["expert"], recs["count"] = layer[order], expert[order], count[order]
        return cls(pack_fingerprint, int(c.shape[0]), int(c.shape[1]), int(top_k), int(tokens), recs)

    @property
    def pairs(self) -> int:
        """Routed (layer, expert) pairs: the most slots the profile can fill (S8 caps slots at it)."""
        return len(self.records)

    def count_matrix(self) -> np.ndarray:
        """int64 [n_layer, n_expert]: the counts, 0 for pairs never routed."""
        m = np.zeros((self.n_layer, self.n_expert), np.int64)
        m[self.records["layer"], self.records["expert"]] = self.records["count"]
        return m

    def layer_totals(self) -> list[int]:
        """Routed uses counted per layer (Python ints: no overflow); tokens * top_k for a full count."""
        return _layer_totals(self.records, self.n_layer)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertProfile):
            return NotImplemented
        head = ("pack_fingerprint", "n_layer", "n_expert", "top_k", "tokens")
        return all(getattr(self, k) == getattr(other, k) for k in head) and np.array_equal(self.records, other.records)

    __hash__ = None


def _layer_totals(recs: np.ndarray, n_layer: int) -> list[int]:
    totals = [0] * n_layer
    for layer, count in zip(recs["layer"].tolist(), recs["count"].tolist()):
        totals[layer] += count
    return totals


# --- the file -------------------------------------------------------------------------------------


def _format(p: ExpertProfile) -> bytes:
    header = B.pack_header(HEADER, MAGIC, dict(p._header(), version=VERSION))
    payload = p.records.tobytes()
    return header + payload + B.crc32([payload], header).to_bytes(4, "little")


def write_expert_profile(path: str | os.PathLike, profile: ExpertProfile) -> None:
    """Write atomically (temp name, then rename); the bytes are the ones the reader accepted."""
    data = _format(profile)
    _parse(path, data)
    B.write_atomic(path, [data])


def read_expert_profile(path: str | os.PathLike, *, pack_fingerprint: str | None = None,
                        n_layer: int | None = None, n_expert: int | None = None,
                        top_k: int | None = None) -> ExpertProfile:
    """Read and check all of `path`. With `pack_fingerprint` (and the geometry's counts) given, a
    profile made for another pack is refused, naming both fingerprints."""
    p = _parse(path, Path(path).read_bytes())
    want = {"pack_fingerprint": pack_fingerprint, "n_layer": n_layer, "n_expert": n_expert, "top_k": top_k}
    for field, value in want.items():
        if value is not None and getattr(p, field) != value:
            hint = ("the profile was made for another pack; build one for this pack with strata-profile"
                    if field == "pack_fingerprint" else "the profile describes another model")
            raise BinaryFormatError(path, OFFSETS[field], field, getattr(p, field), f"{value} (this pack's)", hint)
    return p


def _parse(path: str | os.PathLike, data: bytes) -> ExpertProfile:
    r = B.Reader(path, data, "a Strata expert profile (expert-profile.bin)")
    h = r.header(HEADER, MAGIC, (VERSION,))
    _check_header(r, h)
    n = h["n_records"]
    r.expect_size(HEADER_BYTES + RECORD.itemsize * n + B.CRC_BYTES, "records",
                  f"the {HEADER_BYTES}-byte header, {n} records of {RECORD.itemsize} bytes and a 4-byte CRC")
    r.check_crc(HEADER_BYTES)
    recs = np.frombuffer(data, RECORD, count=n, offset=HEADER_BYTES)
    _check_records(r, h, recs)
    return ExpertProfile(h["pack_fingerprint"], h["n_layer"], h["n_expert"], h["top_k"], h["tokens"], recs)


def _check_values(r: B.Reader, h: dict, recs: np.ndarray) -> None:
    for field, value in h.items():
        if field != "pack_fingerprint" and (type(value) is not int or value < 0):
            raise r.error(OFFSETS[field], field, value, "a non-negative int")
    why = B.fingerprint_problem(h["pack_fingerprint"])
    if why:
        raise r.error(OFFSETS["pack_fingerprint"], "pack_fingerprint", h["pack_fingerprint"], why)
    _check_header(r, h)
    _check_records(r, h, recs)


def _check_header(r: B.Reader, h: dict) -> None:
    o = OFFSETS
    for field in ("n_layer", "n_expert"):
        if not 1 <= h[field] <= MAX_IDS:
            raise r.error(o[field], field, h[field], f"1..{MAX_IDS} (ids are u16)")
    if not 1 <= h["top_k"] <= h["n_expert"]:
        raise r.error(o["top_k"], "top_k", h["top_k"], f"1..n_expert = {h['n_expert']}")
    if not 1 <= h["tokens"] <= MAX_I64 // h["top_k"]:
        raise r.error(o["tokens"], "tokens", h["tokens"], f"1..{MAX_I64 // h['top_k']} (tokens * top_k fits int64)")
    pairs = h["n_layer"] * h["n_expert"]
    if not 1 <= h["n_records"] <= pairs:
        raise r.error(o["n_records"], "n_records", h["n_records"], f"1..n_layer * n_expert = {pairs}",
                      "each (layer, expert) pair at most once, and a profile routes something")


def _check_records(r: B.Reader, h: dict, recs: np.ndarray) -> None:
    at = lambda i, field: HEADER_BYTES + RECORD.itemsize * i + {"layer": 0, "expert": 2, "count": 4}[field]
    most = h["tokens"] * h["top_k"]
    for field, lo, hi in (("layer", 0, h["n_layer"] - 1), ("expert", 0, h["n_expert"] - 1), ("count", 1, most)):
        v = recs[field]
        bad = np.flatnonzero((v < lo) | (v > hi))
        if len(bad):
            i = int(bad[0])
            hint = "tokens * top_k: no pair is routed more often than every token" if field == "count" else None
            raise r.error(at(i, field), field, int(v[i]), f"{lo}..{hi} (record {i})", hint)
    _check_rank(r, recs, at)
    totals = _layer_totals(recs, h["n_layer"])
    over = [l for l, t in enumerate(totals) if t > most]
    if over:
        l = over[0]
        raise r.error(OFFSETS["tokens"], "tokens", h["tokens"], f"at least {-(-totals[l] // h['top_k'])}",
                      f"layer {l}'s counts sum to {totals[l]}, more than tokens * top_k = {most} routed uses")


def _check_rank(r: B.Reader, recs: np.ndarray, at) -> None:
    c, l, e = (recs[f].astype(np.int64) for f in ("count", "layer", "expert"))
    ok = (c[1:] < c[:-1]) | ((c[1:] == c[:-1]) & ((l[1:] > l[:-1]) | ((l[1:] == l[:-1]) & (e[1:] > e[:-1]))))
    bad = np.flatnonzero(~ok)
    if not len(bad):
        return
    i = int(bad[0]) + 1
    if c[i] != c[i - 1]:
        field, want = "count", f"at most {c[i - 1]}, the previous record's count"
    elif l[i] != l[i - 1]:
        field, want = "layer", f"at least {l[i - 1]}, the previous record's layer (equal counts)"
    else:
        field, want = "expert", f"more than {e[i - 1]}, the previous record's expert (same layer and count)"
    found = {"count": c, "layer": l, "expert": e}[field][i]
    raise r.error(at(i, field), field, int(found), want,
                  f"record {i}: records are ranked {RANK_ORDER}, each pair once")
