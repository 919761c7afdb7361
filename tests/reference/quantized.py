"""transformers in float64 as the reference of a QUANTIZED GGUF: the same dequantized weights and
the same ActQ activations as the engine (issue 4, item 4, second half).

Weights. `place_tensors` finds, for every GGUF tensor, where its values live in the transformers
model: each GGUF row (ne0 values) is looked up by its sorted values among the rows of every
parameter (a row-wise permutation such as the v-head tiling, or a split such as the indexer q/k or
gate/up, keeps rows whole), then its column order is matched (ssm_out's input columns are tiled).
This inverts the converter's transformations without restating them, and is exact: it is computed
on the F32 conversion, whose values are the checkpoint's own, and every placement is verified value
for value. `load_dequantized` then writes the quantized file's dequantized values (gguf-py's
decoders) into those places. Tensors the mixes never quantize (norms with their +1, ssm_a, conv)
keep the checkpoint's values, which are exactly what the F32 conversion stores.

Activations. Inside `ActQInputs`, `torch.nn.functional.linear` (nn.Linear and the eager experts
both call it) quantizes its input when the weight is a block type, as the engine does: the float64
input rounded to f32, then per 32 elements d = amax / 127 and q = rint(x / d) in f32 (the ActQ
specification, engine/kernels/actq.py, restated here), dequantized exactly as q * d in float64;
for the weights that read the wide form (actq.reads_wide) d = amax / 32639 (16-bit q).
The 32-blocks run over the input in the GGUF's column order, as the engine's do: ssm_out reads the
GDN heads tiled, transformers' out_proj grouped, and blocks over the other order have other scales
(a 5e-2 disagreement in the logits when this was missed).

Rounding ties. x / d near k + 1/2 is decided by float32 noise: the engine's x and the reference's
differ by ~1e-6 relative, and over ~10^5 rounded activations some fall on the other side. Such a
flip moves a matmul output by ~1e-3, far above the tolerance, so where (and only where) the
reference's own x / d is within `tie_tol` of the boundary, the reference takes the engine's
decision (recorded by `EngineActQ`, matched by content: the engine activation nearest to the
reference's, required to agree to 1e-3). Every other element must round as the engine did; a
disagreement outside a tie is counted as a violation (the test asserts there are none). In the
wide form a quantum is 257 times finer (32639 / 127), so the same float32 noise spans 257 times
as many quanta: its ties are those within 257 tie_tol, counted apart (wide_ties, wide_elements).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from strata.index_format.ggml_types import BY_ID
from strata.tools.gguf_io import read_gguf, shard_names

from . import requant

F32 = np.float32
QA = 32


# --------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class Placement:
    """Where a GGUF tensor's values are in the transformers model: GGUF row r is row rows[r] of
    `param` viewed as [-1, ne0]; GGUF column j is column cols[j] (None: the same order)."""

    param: str
    rows: np.ndarray
    cols: np.ndarray | None


def _row_keys(rows: np.ndarray) -> list[bytes]:
    return [r.tobytes() for r in np.sort(rows, axis=1)]


def place_tensors(params: dict[str, np.ndarray], f32_gguf: Path, names: list[str]) -> dict[str, Placement]:
    """Placements of the GGUF tensors `names` (read from the F32 conversion `f32_gguf`, any shard)
    among `params` (transformers name -> float32 values, as in the checkpoint)."""
    widths = {}
    tensors = {}
    for shard in shard_names(Path(f32_gguf)):
        f = read_gguf(shard)
        for name in names:
            if name in f.tensors:
                info = f.tensors[name]
                tensors[name] = f.tensor_bytes(name).view(F32).reshape(-1, info.shape[0])
                widths.setdefault(info.shape[0], set()).add(name)
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise ValueError(f"{f32_gguf}: no tensors {missing}")
    index: dict[bytes, tuple[str, int] | None] = {}
    for pname, p in params.items():
        if p.ndim < 2 or p.shape[-1] not in widths:
            continue
        for i, k in enumerate(_row_keys(p.reshape(-1, p.shape[-1]))):
            index[k] = None if k in index else (pname, i)  # None: two rows alike, ambiguous
    return {name: _place(name, g, index, params) for name, g in tensors.items()}


def _place(name: str, g: np.ndarray, index: dict, params: dict[str, np.ndarray]) -> Placement:
    found = [index.get(k) for k in _row_keys(g)]
    if any(f is None for f in found):
        bad = next(i for i, f in enumerate(found) if f is None)
        raise ValueError(f"GGUF tensor {name}: row {bad} is in no transformers parameter (or in two)")
    owners = {p for p, _ in found}
    if len(owners) != 1:
        raise ValueError(f"GGUF tensor {name}: rows from several parameters {sorted(owners)}")
    pname = owners.pop()
    rows = np.array([i for _, i in found], np.int64)
    h = params[pname].reshape(-1, g.shape[1])[rows]
    cols = None
    if not np.array_equal(h, g):
        by_col = {c.tobytes(): j for j, c in enumerate(np.ascontiguousarray(h.T))}
        if len(by_col) != h.shape[1]:
            raise ValueError(f"GGUF tensor {name}: columns of {pname} repeat; cannot match them")
        cols = np.array([by_col.get(c.tobytes(), -1) for c in np.ascontiguousarray(g.T)], np.int64)
        if (cols < 0).any() or not np.array_equal(h[:, cols], g):
            raise ValueError(f"GGUF tensor {name}: not a row/column permutation of {pname}")
    return Placement(pname, rows, cols)


def load_dequantized(model, placements: dict[str, Placement], quant_gguf: Path) -> dict[str, np.ndarray | None]:
    """Write the dequantized values of `quant_gguf`'s tensors into the (float64) model at their
    placements. Returns the parameters now holding a BLOCK type (their matmuls read ActQ
    activations), each with its GGUF column order (None: the same as transformers'). A parameter
    fed by block and non-block tensors alike, or in two column orders, is refused."""
    kinds: dict[str, set[bool]] = {}
    orders: dict[str, set[bytes | None]] = {}
    for shard in shard_names(Path(quant_gguf)):
        f = read_gguf(shard)
        for name, pl in placements.items():
            if name not in f.tensors:
                continue
            info = f.tensors[name]
            t = BY_ID[info.type_id]
            n = int(np.prod(info.shape))
            values = requant.dequantize(t.name, f.tensor_bytes(name), n).reshape(-1, info.shape[0])
            p = model.get_parameter(pl.param)
            view = p.data.view(-1, info.shape[0])
            cols = pl.cols if pl.cols is not None else np.arange(info.shape[0])
            with torch.no_grad():
                view[torch.from_numpy(pl.rows)[:, None], torch.from_numpy(cols)[None, :]] = torch.from_numpy(
                    values.astype(np.float64))
            kinds.setdefault(pl.param, set()).add(t.quantized)
            orders.setdefault(pl.param, set()).add(None if pl.cols is None else pl.cols.tobytes())
    mixed = sorted(p for p in kinds if len(kinds[p]) > 1 or len(orders[p]) > 1)
    if mixed:
        raise ValueError(f"{quant_gguf}: parameters {mixed} hold block-type and float tensors, or two column orders")
    cols = {pl.param: pl.cols for pl in placements.values()}
    return {p: cols[p] for p, k in kinds.items() if k == {True}}


# --------------------------------------------------------------------------------------- ActQ


def wide_params(placements: dict[str, Placement], quant_gguf: Path) -> set[str]:
    """The parameters whose block-type tensors read the wide form (actq.reads_wide: the type and
    the tensor's role). A parameter fed by tensors of both forms is refused."""
    from strata.engine.kernels.actq import reads_wide

    forms: dict[str, set[bool]] = {}
    for shard in shard_names(Path(quant_gguf)):
        f = read_gguf(shard)
        for name, pl in placements.items():
            if name in f.tensors and BY_ID[f.tensors[name].type_id].quantized:
                forms.setdefault(pl.param, set()).add(reads_wide(BY_ID[f.tensors[name].type_id].name, name))
    mixed = sorted(p for p, w in forms.items() if len(w) > 1)
    if mixed:
        raise ValueError(f"{quant_gguf}: parameters {mixed} hold tensors that read two activation forms")
    return {p for p, w in forms.items() if w == {True}}


def actq_reference(x32: np.ndarray, wide: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """f32 rows [R, n] -> (q int32 [R, n], d f32 [R, n/32], x / d f32 [R, n]): the ActQ rule
    (wide: the 16-bit form, bound 32639)."""
    bound = 32639 if wide else 127
    b = x32.reshape(len(x32), -1, QA)
    d = np.abs(b).max(axis=2) / F32(bound)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(d[:, :, None] == 0, F32(0), b / d[:, :, None])
    q = np.clip(np.rint(t), -bound, bound).astype(np.int32)
    return q.reshape(x32.shape), d, t.reshape(x32.shape)


class EngineActQ:
    """While active, records every activation vector the engine quantizes with its q: engine/weights.py's
    quantize_act (Input.form, through which every product's activations go) and the hyper-connections'
    fused norm (engine/hyper.py grouped_rmsnorm_q, which quantizes its output as it writes it)."""

    def __init__(self):
        self.rows: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def _keep(self, x, a, wide: bool = False) -> None:
        n = x.shape[-1]
        if wide:  # the 16-bit q = 256 hi + lo of each row (planes rows 2t, 2t + 1)
            q = a.planes.q[0::2].astype(np.int32) * 256 + a.planes.q[1::2]
        else:
            q = a.q
        self.rows.setdefault((n, wide), []).append((np.array(x, F32).reshape(-1, n), q.reshape(-1, n).astype(np.int32)))

    @contextlib.contextmanager
    def recording(self):
        from strata.engine import hyper, weights

        real, real16, real_norm = weights.quantize_act, weights.quantize_act16, hyper.grouped_rmsnorm_q

        def record(x, where="quantize_act"):
            a = real(x, where)
            self._keep(x, a)
            return a

        def record16(x, where="quantize_act16"):
            a = real16(x, where)
            self._keep(x, a, wide=True)
            return a

        def record_norm(x, gain, group, eps):
            out, a = real_norm(x, gain, group, eps)
            self._keep(out, a)
            return out, a

        weights.quantize_act, weights.quantize_act16, hyper.grouped_rmsnorm_q = record, record16, record_norm
        try:
            yield self
        finally:
            weights.quantize_act, weights.quantize_act16, hyper.grouped_rmsnorm_q = real, real16, real_norm

    def table(self) -> dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]]:
        """(n, wide) -> (x f32 [N, n], q int32 [N, n]) of everything recorded."""
        return {n: (np.concatenate([x for x, _ in v]), np.concatenate([q for _, q in v])) for n, v in self.rows.items()}


@dataclass
class TieStats:
    rows: int = 0  # activation vectors quantized by the reference
    elements: int = 0
    ties: int = 0  # elements where the engine's decision was taken (within tie_tol of the boundary)
    wide_elements: int = 0  # of the wide form (actq.ActQ16), whose ties are counted apart:
    wide_ties: int = 0  # within 257 tie_tol (a quantum 257 times finer: the same noise, more quanta)
    max_tie: float = 0.0  # the largest such distance from the boundary, in quanta
    max_noise: float = 0.0  # max |engine x - reference x| / amax over matched vectors
    violations: list[str] = field(default_factory=list)


class ActQInputs:
    """While active, block-type matmuls of the model read ActQ activations (module docstring)."""

    def __init__(self, model, quantized: dict[str, np.ndarray | None], engine: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]],
                 tie_tol: float, wide: set[str] = frozenset()):
        # storage -> the GGUF column order: ActQ's 32-blocks run over the input in the ENGINE's order
        # (ssm_out reads the GDN heads tiled, transformers grouped: other blocks, other scales);
        # and whether the parameter reads the wide form (wide_params)
        self.storages = {model.get_parameter(p).untyped_storage().data_ptr(): (c, p in wide) for p, c in quantized.items()}
        self.engine = {n: (x.astype(np.float64), q, (x.astype(np.float64) ** 2).sum(1)) for n, (x, q) in engine.items()}
        self.tie_tol = tie_tol
        self.stats = TieStats()

    @contextlib.contextmanager
    def active(self):
        real = torch.nn.functional.linear

        def linear(x, w, b=None):
            ptr = w.untyped_storage().data_ptr()
            if ptr in self.storages:
                x = self.quantize(x, *self.storages[ptr])
            return real(x, w, b)

        torch.nn.functional.linear = linear
        try:
            yield self.stats
        finally:
            torch.nn.functional.linear = real

    def quantize(self, x: torch.Tensor, cols: np.ndarray | None, wide: bool = False) -> torch.Tensor:
        n = x.shape[-1]
        x32 = x.detach().numpy().reshape(-1, n).astype(F32)
        if cols is not None:
            x32 = x32[:, cols]  # GGUF column j is transformers' column cols[j]
        q, d, t = actq_reference(x32, wide)
        q = self._settle_ties(x32, q, t, n, wide)
        out = (q.reshape(len(q), -1, QA) * d[:, :, None].astype(np.float64)).reshape(len(q), n)
        if cols is not None:
            out[:, cols] = out.copy()
        return torch.from_numpy(out.reshape(x.shape))

    def _settle_ties(self, x32: np.ndarray, q: np.ndarray, t: np.ndarray, n: int, wide: bool = False) -> np.ndarray:
        s = self.stats
        s.rows += len(x32)
        s.elements += x32.size
        s.wide_elements += x32.size if wide else 0
        tie_tol = self.tie_tol * (32639 / 127 if wide else 1)
        if (n, wide) not in self.engine:
            s.violations.append(f"the engine quantized no activation of width {n} in the {'wide' if wide else '8-bit'} form")
            return q
        ex, eq, e2 = self.engine[n, wide]
        xr = x32.astype(np.float64)
        match = ((xr**2).sum(1)[:, None] - 2 * xr @ ex.T + e2[None, :]).argmin(axis=1)
        amax = np.maximum(np.abs(xr).max(axis=1), 1e-30)
        noise = np.abs(ex[match] - xr).max(axis=1) / amax
        s.max_noise = max(s.max_noise, float(noise.max()))
        for r in np.flatnonzero(noise > 1e-3):
            s.violations.append(f"width {n}: no engine activation within 1e-3 of the reference's (nearest {noise[r]:.2e})")
        theirs = eq[match].astype(np.int32)
        differ = np.argwhere(q != theirs)
        if len(differ):
            r, j = differ[:, 0], differ[:, 1]
            dist = np.abs(t[r, j].astype(np.float64) - (q[r, j] + theirs[r, j]) / 2)
            tie = (np.abs(q[r, j] - theirs[r, j]) == 1) & (dist <= tie_tol)
            if wide:
                s.wide_ties += int(tie.sum())
            else:
                s.ties += int(tie.sum())
                s.max_tie = max(s.max_tie, float(dist[tie].max(initial=0)))
            for k in np.flatnonzero(~tie)[:5]:
                s.violations.append(f"width {n}: element {j[k]} rounds to {q[r[k], j[k]]} here, {theirs[r[k], j[k]]} in "
                                    f"the engine, {dist[k]:.3e} quanta from the boundary (not a tie)")
            q = q.copy()
            q[r[tie], j[tie]] = theirs[r[tie], j[tie]]
        return q
