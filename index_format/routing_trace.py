"""Routing trace v1 (`strata-profile --trace OUT`): the experts each token chose, layer by layer.

A profile keeps only counts; a trace keeps the order, so later cache-policy work (eviction,
prefetch, per-prompt adaptation) can be replayed offline against the exact routing of a run.

Layout (little-endian; docs/index-format.md, "Routing trace"):

    offset  size        field
    0       8           magic            b"STRATART"
    8       4           version          u32 = 1
    12      4           n_layer          u32, 1..65536
    16      4           n_expert         u32, 1..65536
    20      4           top_k            u32, 1..n_expert
    24      8           n_tokens         u64
    32      68          pack_fingerprint ASCII "pk1-" + 64 lowercase hex
    100     2*T*L*K     ids              u16 [n_tokens, n_layer, top_k], each row in the router's order
    100+2TLK 4          crc32            CRC-32 of the ids, continued over the 100 header bytes

Within one (token, layer) row the ids are distinct (top-k picks k different experts), each below
n_expert. `TraceWriter` streams rows to a temp file and renames it only when closed, so a trace on
disk is always complete.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _binary as B
from ._text import MAX_I64
from .errors import BinaryFormatError
from .expert_profile import MAX_IDS, ExpertProfile

MAGIC = b"STRATART"
VERSION = 1
ID = np.dtype("<u2")
HEADER = B.fields(("magic", "magic"), ("version", "u32"), ("n_layer", "u32"), ("n_expert", "u32"), ("top_k", "u32"),
                  ("n_tokens", "u64"), ("pack_fingerprint", "fingerprint"), magic=MAGIC)
HEADER_BYTES = B.header_size(HEADER)
OFFSETS = B.offsets(HEADER)


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """`ids` uint16 [n_tokens, n_layer, top_k]: token t's experts at layer l, in the router's order."""

    pack_fingerprint: str
    n_expert: int
    ids: np.ndarray

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids)
        if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"routing trace ids: expected an integer array [tokens, layers, top_k], got {ids.dtype} {ids.shape}")
        object.__setattr__(self, "ids", ids)
        r = B.Reader("<RoutingTrace>", b"", "a routing trace")
        try:
            _check_header(r, self._header())
            _check_ids(r, self.n_expert, ids)  # before the cast to u16, which would wrap
        except BinaryFormatError as e:
            raise ValueError(str(e)) from None
        ids = np.ascontiguousarray(ids, ID)
        ids.setflags(write=False)
        object.__setattr__(self, "ids", ids)

    @property
    def n_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def n_layer(self) -> int:
        return self.ids.shape[1]

    @property
    def top_k(self) -> int:
        return self.ids.shape[2]

    def _header(self) -> dict[str, object]:
        return {"n_layer": self.n_layer, "n_expert": self.n_expert, "top_k": self.top_k,
                "n_tokens": self.n_tokens, "pack_fingerprint": self.pack_fingerprint}

    def to_profile(self) -> ExpertProfile:
        """The counts this trace implies: every layer routes exactly n_tokens * top_k uses."""
        flat = self.ids.astype(np.int64) + (np.arange(self.n_layer, dtype=np.int64) * self.n_expert)[None, :, None]
        counts = np.bincount(flat.ravel(), minlength=self.n_layer * self.n_expert).reshape(self.n_layer, self.n_expert)
        return ExpertProfile.from_counts(self.pack_fingerprint, counts, tokens=self.n_tokens, top_k=self.top_k)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RoutingTrace):
            return NotImplemented
        return (self.pack_fingerprint, self.n_expert) == (other.pack_fingerprint, other.n_expert) and \
            self.ids.shape == other.ids.shape and np.array_equal(self.ids, other.ids)

    __hash__ = None


def _check_header(r: B.Reader, h: dict) -> None:
    o = OFFSETS
    why = B.fingerprint_problem(h["pack_fingerprint"])
    if why:
        raise r.error(o["pack_fingerprint"], "pack_fingerprint", h["pack_fingerprint"], why)
    for field in ("n_layer", "n_expert"):
        if not 1 <= h[field] <= MAX_IDS:
            raise r.error(o[field], field, h[field], f"1..{MAX_IDS} (ids are u16)")
    if not 1 <= h["top_k"] <= h["n_expert"]:
        raise r.error(o["top_k"], "top_k", h["top_k"], f"1..n_expert = {h['n_expert']}")
    row = h["n_layer"] * h["top_k"] * ID.itemsize
    if h["n_tokens"] > (MAX_I64 - HEADER_BYTES - B.CRC_BYTES) // row:
        raise r.error(o["n_tokens"], "n_tokens", h["n_tokens"], "a file size that fits int64")


def _check_ids(r: B.Reader, n_expert: int, ids: np.ndarray) -> None:
    """Every id below n_expert; the ids of one (token, layer) row distinct."""
    flat = ids.reshape(-1, ids.shape[-1])
    big = np.flatnonzero((flat.ravel() < 0) | (flat.ravel() >= n_expert))
    if len(big):
        i = int(big[0])
        raise r.error(HEADER_BYTES + 2 * i, "ids", int(flat.ravel()[i]), f"an expert id in 0..{n_expert - 1}",
                      _where(i, ids.shape))
    s = np.sort(flat, axis=1)
    dup = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
    if len(dup):
        row = int(dup[0])
        k = flat.shape[1]
        vals = flat[row]
        j = next(j for j in range(1, k) if vals[j] in vals[:j])
        i = row * k + j
        raise r.error(HEADER_BYTES + 2 * i, "ids", int(vals[j]), f"an expert not already chosen in this row {vals[:j].tolist()}",
                      _where(i, ids.shape) + ": top-k picks distinct experts")


def _where(i: int, shape: tuple[int, ...]) -> str:
    _, L, K = shape
    return f"token {i // (L * K)}, layer {i // K % L}, choice {i % K}"


# --- the file -------------------------------------------------------------------------------------


def read_trace(path: str | os.PathLike, *, pack_fingerprint: str | None = None) -> RoutingTrace:
    """Read and check all of `path`; with `pack_fingerprint`, a trace of another pack is refused."""
    data = Path(path).read_bytes()
    r = B.Reader(path, data, "a Strata routing trace")
    h = r.header(HEADER, MAGIC, (VERSION,))
    _check_header(r, h)
    n = h["n_tokens"] * h["n_layer"] * h["top_k"]
    r.expect_size(HEADER_BYTES + ID.itemsize * n + B.CRC_BYTES, "ids",
                  f"the {HEADER_BYTES}-byte header, n_tokens * n_layer * top_k = {n} u16 ids and a 4-byte CRC")
    r.check_crc(HEADER_BYTES)
    ids = np.frombuffer(data, ID, count=n, offset=HEADER_BYTES).reshape(h["n_tokens"], h["n_layer"], h["top_k"])
    _check_ids(r, h["n_expert"], ids)
    if pack_fingerprint is not None and h["pack_fingerprint"] != pack_fingerprint:
        raise r.error(OFFSETS["pack_fingerprint"], "pack_fingerprint", h["pack_fingerprint"],
                      f"{pack_fingerprint} (this pack's)", "the trace was recorded on another pack")
    return RoutingTrace(h["pack_fingerprint"], h["n_expert"], ids)


def write_trace(path: str | os.PathLike, trace: RoutingTrace) -> None:
    with TraceWriter(path, pack_fingerprint=trace.pack_fingerprint, n_layer=trace.n_layer,
                     n_expert=trace.n_expert, top_k=trace.top_k) as w:
        w.append(trace.ids)


class TraceWriter(B.StreamingFile):
    """Streams (token, layer, top_k) rows to `<path>.tmp-<pid>`; `close()` writes the header's
    token count and the CRC and renames the file into place. Leaving a `with` block by an exception
    removes the temp file: a trace on disk is always whole."""

    def __init__(self, path: str | os.PathLike, *, pack_fingerprint: str, n_layer: int, n_expert: int, top_k: int):
        self.path = os.fspath(path)
        self._h = {"n_layer": n_layer, "n_expert": n_expert, "top_k": top_k, "n_tokens": 0,
                   "pack_fingerprint": pack_fingerprint}
        _check_header(B.Reader(self.path, b"", "a routing trace"), self._h)
        self._open_temp(self.path)
        self._f.write(b"\0" * HEADER_BYTES)  # the real header is known at close
        self._crc = 0

    def append(self, ids: np.ndarray) -> None:
        """ids [n_layer, top_k] (one token) or [T, n_layer, top_k]."""
        a = np.asarray(ids)
        L, K = self._h["n_layer"], self._h["top_k"]
        a = a.reshape(1, *a.shape) if a.ndim == 2 else a
        if a.ndim != 3 or a.shape[1:] != (L, K) or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"{self.path}: trace rows must be integer [tokens, {L}, {K}], got {a.dtype} {list(a.shape)}")
        _check_ids(B.Reader(self.path, b"", "a routing trace"), self._h["n_expert"], a)
        data = np.ascontiguousarray(a, ID).tobytes()
        self._f.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._h["n_tokens"] += a.shape[0]

    def close(self) -> None:
        header = B.pack_header(HEADER, MAGIC, dict(self._h, version=VERSION))
        self._f.write(zlib.crc32(header, self._crc).to_bytes(4, "little"))
        self._f.seek(0)
        self._f.write(header)
        self._commit()

