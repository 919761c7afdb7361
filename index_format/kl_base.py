"""`strata perplexity --save-logits BASE.bin` v1: a base model's next-token distributions, compactly,
for `--kl-base` to compare another model (a quantization, another KV type) against them later.

Per scored position the full log-softmax is kept, quantized to 16 bits on the position's own range,
as llama.cpp's --kl-divergence-base does (there: uint16 log-probs per token): top-K alone would
leave KL undefined for tokens outside the K. Stored log-prob i is lo + q_i * step, q_i = rint((lp_i -
lo) / step), lo = min lp, step = (max lp - lo) / 65535, so every entry is within step / 2 (plus f32
rounding of lo and step) of the true log-prob, and a renormalised row within `step` of it.

Layout (little-endian; docs/index-format.md, "kl-base.bin"):

    offset  size  field
    0       8     magic            b"STRATAKL"
    8       4     version          u32 = 1
    12      4     n_vocab          u32 >= 2
    16      4     n_ctx            u32 >= 2: tokens per window (each window is its own sequence)
    20      4     first            u32, 0..n_ctx - 2: the logits at positions first .. n_ctx - 2 of a
                                   window are scored (each predicting the token after it)
    24      4     n_windows        u32 >= 1
    28      68    pack_fingerprint the base model's pack (manifest.pack_fingerprint)
    96      4 n_windows n_ctx      tokens: i32 [n_windows, n_ctx], each in 0..n_vocab - 1
    ...     (16 + 2 n_vocab) each  records, n_windows * (n_ctx - 1 - first), window by window:
                                   top1 u32, nll f32, lo f32, step f32, q u16[n_vocab]
    end     4     crc32            of tokens and records, continued over the 96 header bytes

Record rules: top1 < n_vocab is the base's most likely token (kept exactly: quantization can tie
the top two); nll >= 0, finite: -log p(next token), exact f32; lo <= 0 and step >= 0 finite;
q[top1] = 65535 (the maximum) unless step = 0; lo + q[next] step within step + 1e-4 of -nll.
"""

from __future__ import annotations

import mmap
import os
import zlib
from dataclasses import dataclass

import numpy as np

from . import _binary as B
from .errors import BinaryFormatError

MAGIC = b"STRATAKL"
VERSION = 1
Q_MAX = 65535
HEADER = B.fields(("magic", "magic"), ("version", "u32"), ("n_vocab", "u32"), ("n_ctx", "u32"), ("first", "u32"),
                  ("n_windows", "u32"), ("pack_fingerprint", "fingerprint"), magic=MAGIC)
HEADER_BYTES = B.header_size(HEADER)
OFFSETS = B.offsets(HEADER)
TOKEN = np.dtype("<i4")
NLL_SLACK = 1e-4  # f32 rounding of lo, step and nll on top of the step / 2 quantization


def record_dtype(n_vocab: int) -> np.dtype:
    return np.dtype([("top1", "<u4"), ("nll", "<f4"), ("lo", "<f4"), ("step", "<f4"), ("q", "<u2", (n_vocab,))])


def quantize_logprobs(lp: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """lp float [n, V] (log-softmax rows) -> (lo f32 [n], step f32 [n], q u16 [n, V])."""
    lo = lp.min(axis=1).astype(np.float32)
    step = ((lp.max(axis=1) - lo) / Q_MAX).astype(np.float32)
    safe = np.where(step > 0, step, np.float32(1)).astype(np.float64)
    q = np.clip(np.rint((lp - lo.astype(np.float64)[:, None]) / safe[:, None]), 0, Q_MAX).astype(np.uint16)
    return lo, step, q


def dequantize_logprobs(records: np.ndarray) -> np.ndarray:
    """Records -> float64 [n, V] log-probs, renormalised (each within `step` of the base's)."""
    lp = records["lo"].astype(np.float64)[:, None] + records["q"] * records["step"].astype(np.float64)[:, None]
    m = lp.max(axis=1, keepdims=True)
    return lp - (m + np.log(np.exp(lp - m).sum(axis=1, keepdims=True)))


@dataclass(frozen=True, eq=False)
class KLBase:
    """A read base file: header values, tokens [n_windows, n_ctx] and records [n_windows, n_scored] (mapped)."""

    path: str
    n_vocab: int
    n_ctx: int
    first: int
    pack_fingerprint: str
    tokens: np.ndarray
    records: np.ndarray

    @property
    def n_windows(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_scored(self) -> int:
        return self.n_ctx - 1 - self.first


def _check_header(r: B.Reader, h: dict) -> None:
    o = OFFSETS
    if h["n_vocab"] < 2:
        raise r.error(o["n_vocab"], "n_vocab", h["n_vocab"], "at least 2")
    if h["n_ctx"] < 2:
        raise r.error(o["n_ctx"], "n_ctx", h["n_ctx"], "at least 2 (a window predicts its tokens after the first)")
    if h["first"] > h["n_ctx"] - 2:
        raise r.error(o["first"], "first", h["first"], f"0..n_ctx - 2 = {h['n_ctx'] - 2} (a scored position)")
    if h["n_windows"] < 1:
        raise r.error(o["n_windows"], "n_windows", h["n_windows"], "at least 1")
    why = B.fingerprint_problem(h["pack_fingerprint"])
    if why:
        raise r.error(o["pack_fingerprint"], "pack_fingerprint", h["pack_fingerprint"], why)


def _payload_bytes(h: dict) -> tuple[int, int]:
    tokens = TOKEN.itemsize * h["n_windows"] * h["n_ctx"]
    return tokens, record_dtype(h["n_vocab"]).itemsize * h["n_windows"] * (h["n_ctx"] - 1 - h["first"])


def _check_tokens(r: B.Reader, h: dict, tokens: np.ndarray) -> None:
    bad = np.flatnonzero((tokens < 0) | (tokens >= h["n_vocab"]))
    if len(bad):
        i = int(bad[0])
        w, p = divmod(i, h["n_ctx"])
        raise r.error(HEADER_BYTES + TOKEN.itemsize * i, "tokens", int(tokens.reshape(-1)[i]),
                      f"a token id in 0..{h['n_vocab'] - 1} (window {w}, position {p})")


def _check_records(r: B.Reader, h: dict, tokens: np.ndarray, recs: np.ndarray, start: int) -> None:
    """`recs` are the records of window w = start // n_scored .. in file order, from record `start`."""
    n_scored, V = h["n_ctx"] - 1 - h["first"], h["n_vocab"]
    size = record_dtype(V).itemsize
    base = HEADER_BYTES + TOKEN.itemsize * tokens.size
    at = lambda i, off: base + size * (start + i) + off
    top1, nll, lo, step = (recs[f] for f in ("top1", "nll", "lo", "step"))
    qmax = recs["q"].max(axis=1)
    idx = start + np.arange(len(recs))
    nxt = tokens[idx // n_scored, h["first"] + idx % n_scored + 1]
    stored = lo.astype(np.float64) + recs["q"][np.arange(len(recs)), nxt] * step.astype(np.float64)
    checks = (
        (top1 >= V, 0, "top1", top1, f"a token id in 0..{V - 1}"),
        (~np.isfinite(nll) | (nll < 0), 4, "nll", nll, "a finite -log p >= 0"),
        (~np.isfinite(lo) | (lo > 0), 8, "lo", lo, "a finite log-prob <= 0"),
        (~np.isfinite(step) | (step < 0), 12, "step", step, "a finite step >= 0"),
        ((step > 0) & (recs["q"][np.arange(len(recs)), np.minimum(top1, V - 1)] != Q_MAX), 16, "q", qmax,
         f"q[top1] = {Q_MAX}, the row's maximum (top1 is the most likely token)"),
        (np.abs(stored + nll) > step + NLL_SLACK, 4, "nll", nll,
         "-(lo + q[next token] * step), within step: the record's own log-prob of the next token"),
    )
    for bad, off, field, values, want in checks:
        where = np.flatnonzero(bad)
        if len(where):
            i = int(where[0])
            w, p = divmod(start + i, n_scored)
            raise r.error(at(i, off), field, values[i].item(), f"{want} (window {w}, scored position {h['first'] + p})")


def read_kl_base(path: str | os.PathLike) -> KLBase:
    """Map and check all of `path` (header, size, CRC, every token and record); records stay mapped."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    r = B.Reader(path, data, "a Strata KL base file (strata perplexity --save-logits)")
    h = r.header(HEADER, MAGIC, (VERSION,))
    _check_header(r, h)
    nt, nr = _payload_bytes(h)
    r.expect_size(HEADER_BYTES + nt + nr + B.CRC_BYTES, "records",
                  f"the {HEADER_BYTES}-byte header, {h['n_windows']} windows of {h['n_ctx']} i32 tokens, their "
                  f"scored records of {record_dtype(h['n_vocab']).itemsize} bytes and a 4-byte CRC")
    _check_crc(r, data, HEADER_BYTES + nt + nr)
    tokens = np.frombuffer(data, TOKEN, count=h["n_windows"] * h["n_ctx"], offset=HEADER_BYTES)
    _check_tokens(r, h, tokens)
    tokens = tokens.reshape(h["n_windows"], h["n_ctx"])
    n_scored = h["n_ctx"] - 1 - h["first"]
    recs = np.frombuffer(data, record_dtype(h["n_vocab"]), count=h["n_windows"] * n_scored, offset=HEADER_BYTES + nt)
    step = max(1, (64 << 20) // record_dtype(h["n_vocab"]).itemsize)  # check in pieces: bounded temporaries
    for a in range(0, len(recs), step):
        _check_records(r, h, tokens, recs[a : a + step], a)
    return KLBase(path, h["n_vocab"], h["n_ctx"], h["first"], h["pack_fingerprint"], tokens,
                  recs.reshape(h["n_windows"], n_scored))


def _check_crc(r: B.Reader, data, end: int) -> None:
    crc, view = 0, memoryview(data)
    for a in range(HEADER_BYTES, end, 64 << 20):
        crc = zlib.crc32(view[a : min(a + (64 << 20), end)], crc)
    want = zlib.crc32(view[:HEADER_BYTES], crc)
    stored = int.from_bytes(view[end : end + 4], "little")
    view.release()
    if stored != want:
        raise r.error(end, "crc32", f"0x{stored:08x}", f"0x{want:08x}, the CRC-32 of the payload and header",
                      "the file changed after it was written (a corrupted byte?)")


class KLBaseWriter(B.StreamingFile):
    """Writes `<path>.tmp-<pid>`: the header and all tokens at once, then each window's records as
    they are scored; `close()` adds the CRC and renames the file into place. Leaving a `with` block
    by an exception removes the temp file: a base file on disk is always whole."""

    def __init__(self, path: str | os.PathLike, *, tokens: np.ndarray, first: int, n_vocab: int, pack_fingerprint: str):
        self.path = os.fspath(path)
        tokens = np.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"{self.path}: tokens must be [n_windows, n_ctx], got shape {list(tokens.shape)}")
        self._h = {"n_vocab": n_vocab, "n_ctx": tokens.shape[1], "first": first, "n_windows": tokens.shape[0],
                   "pack_fingerprint": pack_fingerprint}
        r = B.Reader(self.path, b"", "a KL base file")
        _check_header(r, self._h)
        self._tokens = np.ascontiguousarray(tokens, TOKEN)
        _check_tokens(r, self._h, self._tokens.reshape(-1))
        self._dtype = record_dtype(n_vocab)
        self._written = 0
        self._open_temp(self.path)
        header = B.pack_header(HEADER, MAGIC, dict(self._h, version=VERSION))
        self._header = header
        data = self._tokens.tobytes()
        self._f.write(header + data)
        self._crc = zlib.crc32(data)

    @property
    def n_scored(self) -> int:
        return self._h["n_ctx"] - 1 - self._h["first"]

    def append(self, logprobs: np.ndarray, top1: np.ndarray, nll: np.ndarray) -> None:
        """The next scored positions (in file order): log-softmax rows [n, V], the argmax of each row
        (from the unrounded logits), and -log p(next token) of each."""
        lo, step, q = quantize_logprobs(logprobs)
        recs = np.empty(len(q), self._dtype)
        recs["top1"], recs["nll"], recs["lo"], recs["step"], recs["q"] = top1, nll, lo, step, q
        total = self._h["n_windows"] * self.n_scored
        if self._written + len(recs) > total:
            raise ValueError(f"{self.path}: {self._written + len(recs)} records, the header says {total}")
        _check_records(B.Reader(self.path, b"", "a KL base file"), self._h, self._tokens, recs, self._written)
        data = recs.tobytes()
        self._f.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self._written += len(recs)

    def close(self) -> None:
        total = self._h["n_windows"] * self.n_scored
        if self._written != total:
            self.abort()
            raise ValueError(f"{self.path}: {self._written} records written, the header promises {total}")
        self._f.write(zlib.crc32(self._header, self._crc).to_bytes(4, "little"))
        self._commit()



__all__ = ["KLBase", "KLBaseWriter", "read_kl_base", "quantize_logprobs", "dequantize_logprobs", "record_dtype",
           "BinaryFormatError"]
