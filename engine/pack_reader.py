"""The weight table (S3): a pack opened, checked against its geometry, and served in engine form.

WeightTable answers "where are the bytes"; ModelGeometry answers "is this the tensor I think it is".
`Pack.open` reads every index with the strict readers (index_format/), builds the geometry from
geometry.txt, checks every pool tensor's name and shape against `tensor_specs` at LOAD time, maps
pool.bin read-only, and maps the GGUF files the experts (and the PLE table) are read from IN PLACE,
each refused unless its size and fingerprint are the ones the manifest recorded: a GGUF changed
after packing would decode, through the recorded offsets, to plausible garbage.

Engine form: a BF16 source stored as F32 in the pack is re-rounded to 16 bits (exact: the value came
from 16 bits; anything else is refused). Block scales stay fp16 on the CPU tier (the kernels read
them through an exact table); `widened_bytes` is what the GPU tier's f32 scale planes add.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.index_format.geometry import (
    EXPERT, ModelGeometry, check_layer_arrays, check_tensor_shapes, mtp_notes, read_geometry, tensor_specs,
)
from strata.index_format.ggml_types import BY_ID, GGMLType
from strata.index_format.manifest import Manifest, SourceFile, fingerprint_file, full_sha256, read_manifest
from strata.index_format.native_experts import ExpertLayer, NativeExperts, expert_bytes, read_native_experts
from strata.index_format.pack_index import PackIndex, TensorEntry, read_index
from strata.index_format.pack_sources import read_sources
from strata.index_format.ple_table import PleTable, read_ple_table

from .kernels.engine_form import rebf16, widened_bytes
from .weights import Weight

POOL, INDEX, EXPERTS, PLE, GEOMETRY, TOKENIZER, SOURCES, MANIFEST = (
    "pool.bin", "index.txt", "native_experts.txt", "ple_table.txt", "geometry.txt", "tokenizer.txt",
    "sources.txt", "manifest.txt",
)  # fmt: skip
_BF16 = 30


class PackError(ValueError):
    """A pack, or a GGUF it reads from, that the engine refuses; the message says what to do."""


@dataclass(frozen=True)
class _ExpertLayer:
    """One layer's experts in a mapped file: per-expert byte strides of gate, up and down."""

    data: np.ndarray  # the whole mapped file, uint8
    gate_off: int
    up_off: int
    down_off: int
    gu: GGMLType
    d: GGMLType
    gate_bytes: int  # = up bytes
    down_bytes: int


class Pack:
    """An opened pack. Build with `Pack.open(pack_dir, native=None, ple_gguf=None)`."""

    def __init__(self, d: Path, manifest: Manifest, geometry: ModelGeometry, warnings: list[str], index: PackIndex,
                 experts: NativeExperts, ple: PleTable | None, pool: np.ndarray, files: dict[str, tuple[Path, np.ndarray]]):
        self.dir = d
        self.manifest = manifest
        self.geometry = geometry
        self.warnings = warnings  # disagreements the geometry reports and the engine tolerates (compress ratios)
        self.index = index
        self.experts = experts
        self.ple = ple
        self.tokenizer_path = d / TOKENIZER
        self.source_paths = {name: path for name, (path, _) in files.items()}
        # every file mapped, and its (size, mtime, inode) at open: bus_guard names one that shrinks,
        # check_unchanged one rewritten in place
        self.mapped = [(d / POOL, pool)] + [(path, data) for path, data in files.values()]
        self._stamps = {path: _stamp(path) for path, _ in self.mapped}
        self.weights = {t.name: _engine_weight(t, pool) for t in index.tensors}
        g = geometry
        self._layers = {e.layer: _expert_layer(e, experts.gguf, files, g) for e in experts.layers}
        self._ple_data = _ple_data(ple, files) if ple is not None else None

    # --- opening ---------------------------------------------------------------------------------

    @classmethod
    def open(cls, pack_dir: str | os.PathLike, native: str | os.PathLike | None = None,
             ple_gguf: str | os.PathLike | None = None) -> Pack:
        """Read and check everything, map pool.bin and the GGUF files the experts live in.

        native: the main GGUF where it is now, when it moved since packing (other shards are looked
        for beside it); ple_gguf: the PLE shard where it is now."""
        d = check_pack_dir(pack_dir)
        manifest = read_manifest(d / MANIFEST)
        _check_pack_files(d, manifest)
        g = read_geometry(d / GEOMETRY)
        warnings = check_layer_arrays(g) + mtp_notes(g)
        pool_size = (d / POOL).stat().st_size
        index = read_index(d / INDEX, pool_size=pool_size)
        in_gguf = {s.name for s in tensor_specs(g) if not s.in_pool}  # experts, PLE table: read in place
        check_mtp_packed(d / INDEX, index, g)
        check_tensor_shapes(g, {t.name: t.shape for t in index.tensors}, source=str(d / INDEX), ignore=in_gguf)
        experts = read_native_experts(d / EXPERTS, n_embd=g.n_embd, n_ff=g.n_ff_exp, n_expert=g.n_expert,
                                      layers=sorted({s.layer for s in tensor_specs(g) if s.category == EXPERT}))
        ple = read_ple_table(d / PLE, row_dim=g.ple_row_dim, rows=g.ple_table_rows) if g.ple_layers else None
        if ple is None and (d / PLE).exists():
            raise PackError(f"{d / PLE}: present, but {GEOMETRY} has no PLE layers (a pack mixed from two models?)")
        pool = np.memmap(d / POOL, dtype=np.uint8, mode="r").view(np.ndarray) if pool_size else np.zeros(0, np.uint8)
        needed = {e.shard or experts.gguf for e in experts.layers} | ({ple.file} if ple else set())
        recorded = read_sources(d / SOURCES) if (d / SOURCES).is_file() else {}
        paths = _locate_sources(manifest, recorded, needed, experts.gguf, native, ple_gguf)
        files = {name: (path, _map(path)) for name, path in paths.items()}
        return cls(d, manifest, g, warnings, index, experts, ple, pool, files)

    def check_unchanged(self) -> None:
        """Refuse to go on when a mapped file changed since open (cheap: one stat per file, so the
        commands call it between tokens): a rewrite in place at the same size does not fault, the
        engine would just decode the new bytes through the old offsets."""
        for path, was in self._stamps.items():
            now = _stamp(path)
            if now != was:
                raise PackError(f"{path}: changed while the engine was running (size, mtime, inode were {was}, "
                                f"now {now}); a file the pack maps must not change until the run ends")

    # --- what the model reads --------------------------------------------------------------------

    def weight(self, name: str) -> Weight:
        try:
            return self.weights[name]
        except KeyError:
            raise PackError(f"{self.dir / INDEX}: no tensor {name}") from None

    def expert(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert e of `layer`: (gate, up, down) raw bytes, uint8 views of the mapped GGUF (never copies).

        gate, up: n_ff rows of n_embd elements; down: n_embd rows of n_ff elements."""
        x = self._layers[layer]
        if not 0 <= e < self.geometry.n_expert:
            raise IndexError(f"expert {e} of layer {layer}: the model has {self.geometry.n_expert}")
        gb, db = x.gate_bytes, x.down_bytes
        return (x.data[x.gate_off + e * gb : x.gate_off + (e + 1) * gb],
                x.data[x.up_off + e * gb : x.up_off + (e + 1) * gb],
                x.data[x.down_off + e * db : x.down_off + (e + 1) * db])

    def expert_tensors(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate, up, down) of ALL `layer`'s experts: each its whole 3-D tensor's raw bytes, expert e's
        matrix at byte e * (its size), uint8 views of the mapped GGUF (never copies): what the
        grouped kernel (cpu.matmul_grouped) reads the routed experts of a prompt chunk from."""
        x = self._layers[layer]
        n, gb, db = self.geometry.n_expert, x.gate_bytes, x.down_bytes
        return (x.data[x.gate_off : x.gate_off + n * gb], x.data[x.up_off : x.up_off + n * gb],
                x.data[x.down_off : x.down_off + n * db])

    def expert_gate_up(self, layer: int) -> tuple[np.ndarray, int, int]:
        """(bytes, gate at, up at): the mapped bytes from the first of `layer`'s gate and up tensors to
        the end of the other, and where each starts in them, so that one grouped call reads both
        (moe.MoE.products at decode)."""
        x = self._layers[layer]
        lo = min(x.gate_off, x.up_off)
        end = max(x.gate_off, x.up_off) + self.geometry.n_expert * x.gate_bytes
        return x.data[lo:end], x.gate_off - lo, x.up_off - lo

    def expert_types(self, layer: int) -> tuple[GGMLType, GGMLType]:
        """(gate/up type, down type) of `layer`'s experts: they vary by layer."""
        x = self._layers[layer]
        return x.gu, x.d

    def ple_table(self) -> np.ndarray:
        """The whole PLE n-gram table's raw bytes (rows of ple.row_bytes), a view of the mapped shard."""
        if self.ple is None:
            raise PackError(f"{self.dir}: this model has no PLE table")
        return self._ple_data[self.ple.offset : self.ple.offset + self.ple.nbytes]

    # --- sizes (S3: budgets read the real widths) ------------------------------------------------

    @property
    def pool_bytes(self) -> int:
        return self.index.pool_bytes

    @property
    def engine_bytes(self) -> int:
        """The dense tensors as the CPU tier holds them (BF16 re-rounded; fp16 scales as stored)."""
        return sum(w.raw.nbytes for w in self.weights.values())

    @property
    def widened_bytes(self) -> int:
        """What widening every fp16 block scale to f32 adds (the GPU tier's engine form)."""
        return sum(widened_bytes(t.engine_type, t.shape) for t in self.index.tensors)


def check_pack_dir(pack_dir: str | os.PathLike) -> Path:
    """`pack_dir` if it looks like a pack (a directory with a manifest), else a message saying what it
    is and what a pack is (a missing path and a GGUF were once both called "a conversion that did
    not finish")."""
    d = Path(pack_dir)
    what = ("a pack is the directory strata-pack convert writes (manifest.txt, pool.bin, index.txt, ...); "
            "make one with: strata-pack convert MODEL.gguf -o PACK")
    if not d.exists():
        raise PackError(f"{d}: no such directory; {what}")
    if not d.is_dir():
        kind = "a GGUF file" if d.suffix.lower() == ".gguf" else "a file"
        raise PackError(f"{d}: {kind}, not a pack directory; {what}")
    if not (d / MANIFEST).is_file():
        raise PackError(f"{d}: no {MANIFEST}, so not a pack (a conversion that did not finish leaves none: "
                        "run strata-pack convert again); " + what)
    return d


def check_mtp_packed(path: Path, index: PackIndex, g: ModelGeometry) -> None:
    """Refuse a pack whose geometry has an MTP block that index.txt does not hold: packs made before
    Strata packed the block left it in the GGUF (and recorded no mtp_* fields); the tensor count
    check would only say the numbers differ."""
    if g.n_mtp_layer and not any(t.name.startswith(f"blk.{g.n_layer}.") for t in index.tensors):
        raise PackError(f"{path}: the model has an MTP block (layer {g.n_layer}) but the pack does not hold it: "
                        "packs made before Strata packed the MTP block left it in the GGUF; convert the GGUF again")


def read_pack_geometry(pack_dir: str | os.PathLike) -> ModelGeometry:
    """The geometry of a pack, nothing mapped or checked beyond it: what the commands check their
    flags against (vocabulary, context, memory) before the load."""
    return read_geometry(check_pack_dir(pack_dir) / GEOMETRY)


# --- helpers ---------------------------------------------------------------------------------------


def _check_pack_files(d: Path, manifest: Manifest) -> None:
    """The pack's own files against the manifest: all present, sizes equal, small files hashed whole.

    pool.bin is checked by size only (its full sha256 would read gigabytes at every start;
    `strata-pack verify --full` hashes it)."""
    listed = {f.name: f for f in manifest.files}
    for name in (POOL, INDEX, EXPERTS, GEOMETRY, TOKENIZER):
        if name not in listed:
            raise PackError(f"{d / MANIFEST}: pack file {name} is not listed (not a complete pack: rebuild it)")
    for f in manifest.files:
        path = d / f.name
        if not path.is_file():
            raise PackError(f"{path}: missing (listed in {MANIFEST}); rebuild the pack")
        size = path.stat().st_size
        if size != f.size:
            raise PackError(f"{path}: size recorded {f.size}, found {size} (changed since packing; rebuild the pack)")
        if f.name != POOL:
            found = _fingerprint(path, f.fingerprint)
            if found != f.fingerprint:
                raise PackError(f"{path}: fingerprint recorded {f.fingerprint}, found {found} "
                                "(edited since packing; rebuild the pack)")


def _fingerprint(path: Path, like: str) -> str:
    return full_sha256(path) if like.startswith("sha256-") else fingerprint_file(path)


def _locate_sources(manifest: Manifest, recorded: dict[str, str], needed: set[str], main_name: str,
                    native, ple_gguf) -> dict[str, Path]:
    """name -> path of every source file the engine reads from, each checked against the manifest."""
    by_name = {s.name: s for s in manifest.sources}
    main = manifest.source("main")[0]
    if main.name != main_name:
        raise PackError(f"{MANIFEST} names the main GGUF {main.name}, {EXPERTS} names {main_name}: "
                        "the pack's files disagree (rebuild the pack)")
    out = {}
    for name in sorted(needed):
        if name not in by_name:
            raise PackError(f"{EXPERTS} / {PLE} read from {name}, which {MANIFEST} does not list (rebuild the pack)")
        s = by_name[name]
        out[name] = _check_source(s, _candidates(s, recorded, main, native, ple_gguf))
    return out


def _candidates(s: SourceFile, recorded: dict[str, str], main: SourceFile, native, ple_gguf) -> list[Path]:
    # An explicit override is the only place looked at; otherwise beside the main file, then sources.txt.
    if s.role == "main" and native is not None:
        return [Path(native)]
    if s.role == "ple" and ple_gguf is not None:
        return [Path(ple_gguf)]
    out = []
    if native is not None:
        out.append(Path(native).parent / s.name)
    if s.name in recorded:
        out.append(Path(recorded[s.name]))
    if main.name in recorded:
        out.append(Path(recorded[main.name]).parent / s.name)
    return list(dict.fromkeys(out))


_FLAG = {"main": "--native PATH", "ple": "--ple-gguf PATH", "shard": "--native PATH (shards are looked for beside it)",
         "mtp": "--native PATH (the MTP GGUF is looked for beside it)"}


def _check_source(s: SourceFile, candidates: list[Path]) -> Path:
    what = f"{s.role} GGUF {s.name}"
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        looked = ", ".join(str(p) for p in candidates) or "nowhere (sources.txt does not record it)"
        raise PackError(f"{what}: not found (looked at {looked}); pass {_FLAG[s.role]} where it is now")
    size = path.stat().st_size
    if size != s.size:
        raise PackError(f"{what} at {path} is not the file this pack was made from: size recorded {s.size}, "
                        f"found {size}")
    found = _fingerprint(path, s.fingerprint)
    if found != s.fingerprint:
        raise PackError(f"{what} at {path} is not the file this pack was made from: fingerprint recorded "
                        f"{s.fingerprint}, found {found}")
    return path


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


def _map(path: Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)


def _engine_weight(t: TensorEntry, pool: np.ndarray) -> Weight:
    raw = pool[t.offset : t.offset + t.nbytes]
    if t.src_type == _BF16:
        # S3: stored as F32 (lossless); held as the 16 bits it came from, exactly (rebf16 refuses otherwise).
        raw = rebf16(raw.view(np.float32), name=t.name).view(np.uint8)
    return Weight(t.name, t.shape, t.engine_type, raw)


def _expert_layer(e: ExpertLayer, main: str, files: dict[str, tuple[Path, np.ndarray]], g: ModelGeometry) -> _ExpertLayer:
    path, data = files[e.shard or main]
    gu, d = BY_ID[e.gu_type], BY_ID[e.d_type]
    gate_bytes, _, down_bytes = expert_bytes(gu, d, g.n_embd, g.n_ff_exp)
    for role, end in e.ranges(g.n_expert, g.n_embd, g.n_ff_exp).items():
        if end[1] > data.size:
            raise PackError(f"{path}: layer {e.layer} {role} ends at byte {end[1]}, the file has {data.size} "
                            "(truncated, or not the file the pack was made from)")
    return _ExpertLayer(data, e.gate_off, e.up_off, e.down_off, gu, d, gate_bytes, down_bytes)


def _ple_data(ple: PleTable, files: dict[str, tuple[Path, np.ndarray]]) -> np.ndarray:
    path, data = files[ple.file]
    if ple.offset + ple.nbytes > data.size:
        raise PackError(f"{path}: the PLE table ends at byte {ple.offset + ple.nbytes}, the file has {data.size} "
                        "(truncated, or not the file the pack was made from)")
    return data
