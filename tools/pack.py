"""strata-pack's library: GGUF(s) -> a pack directory, and the checks behind `strata-pack verify`.

A pack (docs/index-format.md) is a directory:

    pool.bin            the dense tensors, 64-byte aligned; a BF16 source stored as F32 (lossless, S3)
    index.txt           where each dense tensor lies in pool.bin (v3, S5)
    native_experts.txt  where each layer's experts lie IN the GGUF (absolute offsets; never copied)
    ple_table.txt       where the PLE n-gram table lies in its shard (qwen4exp with PLE only)
    geometry.txt        ModelGeometry, the numbers every kernel depends on (S2)
    tokenizer.txt       the byte-level BPE vocabulary and merges
    sources.txt         the absolute path of each source GGUF at pack time (the default place to look)
    manifest.txt        every source GGUF's role, size and fingerprint, every pack file's; written LAST

The pack is built in `.NAME.tmp-<pid>` beside its destination and renamed into place, so a directory
with a manifest is always a whole pack; an interrupted run removes its temp directory.
Library code: nothing here prints or reads argv; progress and warnings go through callbacks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.index_format.geometry import (
    EXPERT, PLE_TABLE, GeometryError, ModelGeometry, TensorSpec, check_tensor_shapes, read_geometry, same_shape,
    tensor_specs, write_geometry,
)
from strata.index_format.ggml_types import BY_ID
from strata.index_format.manifest import Manifest, PackFile, SourceFile, fingerprint_file, full_sha256, read_manifest, write_manifest
from strata.index_format.native_experts import NativeExperts, blob_bytes_for, read_native_experts, write_native_experts
from strata.index_format.pack_index import PackIndex, read_index, write_index
from strata.index_format.pack_sources import SHA256, read_source_hashes, read_sources, write_source_hashes, write_sources
from strata.index_format.ple_table import PleTable, read_ple_table, write_ple_table
from strata.index_format.tokenizer_flat import FlatTokenizer, read_tokenizer, write_tokenizer
from strata.tools.gguf_io import GGUFError, GGUFFile, TensorInfo, read_gguf, shard_names
from strata.tools.gguf_meta import check_mtp_pairing, geometry_from_gguf

POOL, INDEX, EXPERTS, PLE, GEOMETRY, TOKENIZER, SOURCES, MANIFEST = (
    "pool.bin", "index.txt", "native_experts.txt", "ple_table.txt", "geometry.txt", "tokenizer.txt",
    "sources.txt", "manifest.txt",
)  # fmt: skip
_CHUNK = 16 << 20  # source bytes per read: big tensors (token_embd is 1.3 GB in BF16) are streamed
_BF16 = BY_ID[30]
PLE_TABLE_NAME = "per_layer_token_embd.weight"
_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}


class PackError(ValueError):
    """Input the packer refuses, or an operation it will not do; the message says what to do."""


# --- sources --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sources:
    """The GGUF files of one model: `files` is (role, file), the main file first."""

    files: tuple[tuple[str, GGUFFile], ...]
    tensors: dict[str, TensorInfo]  # every tensor of every file; names are unique across files

    @property
    def main(self) -> GGUFFile:
        return self.files[0][1]

    @property
    def mtp(self) -> GGUFFile | None:
        """The separate MTP-only GGUF (`--mtp`), if one was given."""
        return next((f for role, f in self.files if role == "mtp"), None)


def open_sources(ggufs: Sequence[str | os.PathLike], ple_gguf: str | os.PathLike | None = None,
                 mtp_gguf: str | os.PathLike | None = None) -> Sources:
    """Read the headers of a model's GGUF shards (given any of them), of its PLE shard and of its
    separate MTP-only GGUF (whose blk.* tensors join the model's; its copies of the trunk's
    token_embd, output and output_norm are not read)."""
    if not ggufs:
        raise PackError("no GGUF given")
    for p in map(Path, ggufs):
        if p.is_dir():  # was reported as "no such file"
            what = " (it is a pack: strata-pack verify checks one)" if (p / MANIFEST).is_file() else ""
            raise PackError(f"{p}: a directory{what}; expected the model's GGUF file (any shard of a split one)")
    shards = _shard_set([Path(p) for p in ggufs])
    files = [("main" if i == 0 else "shard", read_gguf(p)) for i, p in enumerate(shards)]
    _check_split(files)
    if ple_gguf is not None:
        files = _add_ple(files, Path(ple_gguf))
    if mtp_gguf is not None:
        files = _add_mtp(files, Path(mtp_gguf))
    tensors: dict[str, TensorInfo] = {}
    for role, f in files:
        for name, t in (mtp_block_tensors(f) if role == "mtp" else f.tensors).items():
            if name in tensors and role == "mtp":
                raise PackError(f"--mtp {f.path.name}: holds trunk tensor {name} (also in {tensors[name].file.name}); "
                                "expected an MTP-only GGUF (llama.cpp's convert_hf_to_gguf.py --mtp), whose only "
                                "block is the MTP block")
            if name in tensors:
                raise PackError(f"tensor {name} is in both {tensors[name].file.name} and {f.path.name}; "
                                "each tensor must be in exactly one shard")
            tensors[name] = t
    # The file holding the PLE table is the `ple` source, whether given by --ple-gguf or a split shard.
    table = tensors.get(PLE_TABLE_NAME)
    roles = [("ple" if i and table is not None and f.path == table.file else role, f) for i, (role, f) in enumerate(files)]
    return Sources(tuple(roles), tensors)


def _shard_set(paths: list[Path]) -> list[Path]:
    for p in paths:
        if not p.is_file():
            raise PackError(f"{p}: no such file")
    sets = {tuple(q.resolve() for q in shard_names(p)): p for p in paths}
    if len(sets) > 1:
        a, b = list(sets.values())[:2]
        raise PackError(f"{a.name} and {b.name} are not shards of one model; give one model's shards "
                        "(any one of them finds the rest), and its PLE shard with --ple-gguf")
    shards = shard_names(paths[0])
    for i, s in enumerate(shards):
        if not s.is_file():
            raise PackError(f"{s}: missing; {paths[0].name} is one of {len(shards)} shards and all are needed "
                            f"(shard {i + 1} of {len(shards)})")
    return shards


def _check_split(files: list[tuple[str, GGUFFile]]) -> None:
    """Every shard says it belongs to a split of len(files) (gguf-split's split.* keys)."""
    n = len(files)
    total = 0
    for i, (_, f) in enumerate(files):
        count, no = f.get("split.count", 1 if n == 1 else None), f.get("split.no", 0 if n == 1 else None)
        if count != n:
            hint = ("its name does not say which shard it is: name the shards -0000K-of-0000N.gguf"
                    if n == 1 else "a shard of another split, or a renamed file?")
            raise PackError(f"{f.path.name}: split.count is {_short(count)}, expected {n} ({hint})")
        if no != i:
            raise PackError(f"{f.path.name}: split.no is {_short(no)}, expected {i} (shard {i + 1} of {n} by its name)")
        total += len(f.tensors)
    want = files[0][1].get("split.tensors.count")
    if want is not None and want != total:
        raise PackError(f"{files[0][1].path.name}: split.tensors.count is {want}, the {n} shard(s) hold {total} tensors")


def _add_ple(files: list[tuple[str, GGUFFile]], path: Path) -> list[tuple[str, GGUFFile]]:
    if not path.is_file():
        raise PackError(f"--ple-gguf {path}: no such file")
    same = [f for _, f in files if f.path.resolve() == path.resolve()]
    ple = same[0] if same else read_gguf(path)
    if PLE_TABLE_NAME not in ple.tensors:
        raise PackError(f"--ple-gguf {path.name} holds no {PLE_TABLE_NAME} (not the PLE shard)")
    # Also a shard of the split (given both ways, as the engine's --native/--ple-gguf are): one file.
    return files if same else list(files) + [("ple", ple)]


def _add_mtp(files: list[tuple[str, GGUFFile]], path: Path) -> list[tuple[str, GGUFFile]]:
    if not path.is_file():
        raise PackError(f"--mtp {path}: no such file")
    if any(f.path.resolve() == path.resolve() for _, f in files):
        raise PackError(f"--mtp {path.name}: the main GGUF itself (an MTP block in the main GGUF is packed without "
                        "--mtp); --mtp takes the separate MTP-only GGUF")
    mtp = read_gguf(path)
    check_mtp_pairing(files[0][1], mtp)  # before its tensors join the main GGUF's
    clash = next((f for _, f in files if f.path.name == path.name), None)
    if clash is not None:
        # the pack records its sources by file name (manifest.txt, native_experts.txt's shard field)
        raise PackError(f"--mtp {path}: the same file name as {clash.path}; the pack names its source GGUFs by file "
                        "name, so rename one (llama.cpp's converter names the MTP-only GGUF mtp-NAME.gguf)")
    return list(files) + [("mtp", mtp)]


def mtp_block_tensors(f: GGUFFile) -> dict[str, TensorInfo]:
    """What an MTP-only GGUF contributes: its blk.* tensors. Its token_embd, output and output_norm
    are copies of the trunk's (the converter's mtp_only keeps them), read from the main GGUF."""
    return {n: t for n, t in f.tensors.items() if n.startswith("blk.")}


# --- the plan: everything checked, nothing written ------------------------------------------------


@dataclass(frozen=True)
class PackPlan:
    sources: Sources
    geometry: ModelGeometry
    warnings: tuple[str, ...]
    index: PackIndex
    experts: NativeExperts
    ple: PleTable | None
    tokenizer: FlatTokenizer

    @property
    def pool_bytes(self) -> int:
        return self.index.pool_bytes


def plan_pack(sources: Sources, *, compress_ratio: int | None = None) -> PackPlan:
    """Check the model against the geometry contract and lay the pack out (reads headers only)."""
    main = sources.main
    reading = geometry_from_gguf(main, sources.tensors, compress_ratio=compress_ratio, mtp=sources.mtp)
    g = reading.geometry
    check_tensor_shapes(g, {n: t.shape for n, t in sources.tensors.items()}, source=main.path.name)
    specs = tensor_specs(g)
    dense = [(s.name, sources.tensors[s.name].type_id, s.shape) for s in specs if s.in_pool]
    index = PackIndex.build(main.path.name, dense)
    tokenizer = tokenizer_from_gguf(main)
    if len(tokenizer.tokens) != g.n_vocab:
        # More tokens: an id past the embedding's rows would read beyond token_embd. Fewer: the model
        # samples ids the tokenizer cannot decode (a run died later at "token id 509 outside the
        # vocabulary"). llama.cpp's GGUFs pad the token list to the embedding's rows; refuse, never clamp.
        raise PackError(f"{main.path.name}: tokenizer.ggml.tokens has {len(tokenizer.tokens)} tokens, "
                        f"token_embd.weight has {g.n_vocab} rows; expected one token per row")
    return PackPlan(sources, g, reading.warnings, index, _experts(sources, g, specs),
                    _ple_table(sources, specs), tokenizer)


def _shard_field(sources: Sources, t: TensorInfo) -> str | None:
    return None if t.file == sources.main.path else t.file.name


def _experts(sources: Sources, g: ModelGeometry, specs: list[TensorSpec]) -> NativeExperts:
    layers = sorted({s.layer for s in specs if s.category == EXPERT})
    rows = []
    for l in layers:
        gate, up, down = (sources.tensors[f"blk.{l}.ffn_{r}_exps.weight"] for r in ("gate", "up", "down"))
        if gate.type_id != up.type_id:
            raise PackError(f"layer {l}: {gate.name} is {BY_ID[gate.type_id].name} ({gate.type_id}) but {up.name} is "
                            f"{BY_ID[up.type_id].name} ({up.type_id}); gate and up must share a type (one gu_type per layer)")
        if not gate.file == up.file == down.file:
            raise PackError(f"layer {l}: its expert tensors are split over {gate.file.name}, {up.file.name} and "
                            f"{down.file.name}; native_experts.txt references one file per layer")
        blob = blob_bytes_for(gate.type_id, down.type_id, g.n_embd, g.n_ff_exp)
        rows.append((l, gate.type_id, down.type_id, blob, gate.offset, up.offset, down.offset, _shard_field(sources, gate)))
    return NativeExperts.build(sources.main.path.name, g.n_expert, rows)


def _ple_table(sources: Sources, specs: list[TensorSpec]) -> PleTable | None:
    spec = next((s for s in specs if s.category == PLE_TABLE), None)
    if spec is None:
        return None
    t = sources.tensors[spec.name]
    return PleTable(sources.main.path.name, t.name, t.type_id, t.shape[0], t.shape[1], t.offset, t.nbytes,
                    _shard_field(sources, t))


def tokenizer_from_gguf(f: GGUFFile) -> FlatTokenizer:
    """The GGUF's tokenizer.ggml.* keys as a FlatTokenizer; a bad key is named with what it holds."""
    where = f"{f.path.name}: metadata"
    model = f.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise PackError(f"{where} tokenizer.ggml.model is {model!r}, expected 'gpt2' (byte-level BPE, the one "
                        "tokenizer Strata implements)")
    # Tokens are GPT-2 byte-level unicode strings ("Ġthe"); their UTF-8 bytes are stored as given.
    tokens = tuple(t.encode("utf-8") for t in _list(f, "tokenizer.ggml.tokens", str))
    types = tuple(_list(f, "tokenizer.ggml.token_type", int))
    merges = tuple(_merge(where, i, m) for i, m in enumerate(_list(f, "tokenizer.ggml.merges", str)))
    special = {}
    for name, key in _SPECIAL_KEYS.items():
        v = f.get(f"tokenizer.ggml.{key}")
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(tokens):
                raise PackError(f"{where} tokenizer.ggml.{key} is {v!r}, expected a token id in 0..{len(tokens) - 1}")
            special[name] = v
    add_bos = f.get("tokenizer.ggml.add_bos_token", False)
    if not isinstance(add_bos, bool):
        raise PackError(f"{where} tokenizer.ggml.add_bos_token is {add_bos!r}, expected a bool")
    template = f.get("tokenizer.chat_template") or None
    try:
        return FlatTokenizer("gpt2", f.get("tokenizer.ggml.pre", "default"), tokens, types, merges, special,
                             add_bos, template)
    except ValueError as e:
        raise PackError(f"{where} tokenizer.ggml.*: {e}") from None


def _list(f: GGUFFile, key: str, kind: type) -> list:
    v = f.get(key)
    if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
        raise PackError(f"{f.path.name}: metadata {key} is {_short(v)}, expected an array of {kind.__name__}")
    return v


def _merge(where: str, i: int, text: str) -> tuple[bytes, bytes]:
    parts = text.split(" ")
    if len(parts) != 2 or not all(parts):
        raise PackError(f"{where} tokenizer.ggml.merges[{i}] is {text!r}, expected two tokens separated by one space")
    return parts[0].encode("utf-8"), parts[1].encode("utf-8")


def _short(v: object) -> str:
    text = repr(v) if v is not None else "missing"
    return text if len(text) <= 60 else text[:56] + "...'"


# --- geometry.txt <-> ModelGeometry ----------------------------------------------------------------

# --- writing --------------------------------------------------------------------------------------


def temp_dir_for(out: Path) -> Path:
    return out.parent / f".{out.name}.tmp-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def recover_leftovers(out: Path) -> list[str]:
    """Undo what a killed run left beside `out`, and say what was done. `--force` moves the old pack to
    `.NAME.old-PID` before renaming the new one into place: a kill between the two renames left the
    old pack there, out of sight, and nothing recovered or removed it. Now the next run restores it
    when `out` is missing (the state before the killed run), or removes it when `out` is whole; a
    `.NAME.tmp-PID` of a dead process (a partial pack) is removed. Live processes' files are left alone."""
    notes = []
    for p in sorted(out.parent.glob(f".{out.name}.old-*")) + sorted(out.parent.glob(f".{out.name}.tmp-*")):
        pid = p.name.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)) or not p.is_dir():
            continue
        if ".old-" in p.name and not out.exists() and (p / MANIFEST).is_file():
            os.rename(p, out)
            notes.append(f"restored {out} from {p.name}, where a --force run (pid {pid}) killed between its two "
                         "renames had left the old pack")
        else:
            shutil.rmtree(p)
            what = "the old pack" if ".old-" in p.name else "a partial pack"
            notes.append(f"removed {p}: {what} left by a killed run (pid {pid})")
    return notes


def check_destination(out: Path, force: bool) -> None:
    """Refuse to replace an existing pack without force, and anything that is not a pack even with it."""
    up = out.parent
    while not up.exists() and up != up.parent:
        up = up.parent
    if not up.is_dir():  # was a bare "[Errno 17] File exists" from mkdir
        raise PackError(f"-o {out}: {up} is a file, not a directory; choose another -o")
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise PackError(f"{out} exists; pass --force to replace it (the old pack stays until the new one is complete)")
    if not out.is_dir() or out.is_symlink():
        raise PackError(f"{out} exists and is not a directory; refusing to replace it even with --force")
    if any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise PackError(f"{out} exists and is not a pack (no {MANIFEST}); refusing to replace it even with --force: "
                        "remove it yourself or choose another -o")


def write_pack(plan: PackPlan, out: str | os.PathLike, *, force: bool = False,
               progress: Callable[[int], None] | None = None, hash_sources: bool = False) -> Path:
    """Write the pack into a temp directory beside `out`, then rename it into place.

    On any failure or interrupt the temp directory is removed and an old pack at `out` is untouched.
    """
    from strata.engine.arguments import check_free_space

    out = Path(out)
    check_destination(out, force)
    check_free_space("-o", out, plan.pool_bytes)  # pool.bin is nearly all of a pack; refused before writing
    tmp = temp_dir_for(out)
    if tmp.exists():
        shutil.rmtree(tmp)  # named with our own pid: left by a killed run, never in use by another
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        _write_files(plan, tmp, progress, hash_sources)
        _swap_into_place(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_files(plan: PackPlan, d: Path, progress, hash_sources: bool = False) -> None:
    pool_sha = write_pool(plan, d / POOL, progress)
    write_index(d / INDEX, plan.index)
    g = plan.geometry
    write_native_experts(d / EXPERTS, plan.experts, n_embd=g.n_embd, n_ff=g.n_ff_exp)
    if plan.ple is not None:
        write_ple_table(d / PLE, plan.ple)
    write_geometry(d / GEOMETRY, g)
    write_tokenizer(d / TOKENIZER, plan.tokenizer)
    write_sources(d / SOURCES, {f.path.name: str(f.path.absolute()) for _, f in plan.sources.files})
    if hash_sources:  # opt-in: reads every byte of every GGUF (minutes for a large model)
        write_source_hashes(d / SHA256, {f.path.name: full_sha256(f.path) for _, f in plan.sources.files})
    names = [INDEX, EXPERTS] + ([PLE] if plan.ple is not None else []) + [GEOMETRY, TOKENIZER, SOURCES]
    names += [SHA256] if hash_sources else []
    files = [PackFile(POOL, (d / POOL).stat().st_size, pool_sha)]
    files += [PackFile(n, (d / n).stat().st_size, fingerprint_file(d / n)) for n in names]
    # LAST: a directory without a manifest is never taken for a pack.
    write_manifest(d / MANIFEST, Manifest(source_records(plan.sources), files))


def source_records(sources: Sources) -> list[SourceFile]:
    return [SourceFile(role, f.file_size, fingerprint_file(f.path), f.path.name) for role, f in sources.files]


def write_pool(plan: PackPlan, path: Path, progress=None) -> str:
    """Copy every dense tensor to its index offset (BF16 widened to F32); returns 'sha256-<hex>'."""
    h = hashlib.sha256()
    handles: dict[Path, object] = {}
    maps: dict[Path, np.ndarray] = {}
    try:
        with open(path, "wb") as out:
            for entry in plan.index.tensors:
                info = plan.sources.tensors[entry.name]
                _check_finite(info, maps)
                pad = b"\0" * (entry.offset - out.tell())
                out.write(pad)
                h.update(pad)
                if info.file not in handles:
                    handles[info.file] = open(info.file, "rb")
                for chunk in _pack_chunks(handles[info.file], info):
                    out.write(chunk)
                    h.update(chunk)
                    if progress:
                        progress(len(chunk))
            pad = b"\0" * (plan.index.pool_bytes - out.tell())
            out.write(pad)
            h.update(pad)
    finally:
        for f in handles.values():
            f.close()
    return "sha256-" + h.hexdigest()


def _check_finite(info: TensorInfo, maps: dict[Path, np.ndarray]) -> None:
    """A dense tensor holding a NaN/inf (an F32 norm, an fp16 block scale) is refused at convert: it
    passed every check before and a run died later naming no tensor. (The experts are not read at
    convert, so not scanned; `strata-pack verify --full` scans them.)"""
    from strata.engine.weight_scan import layer_of
    from strata.engine.kernels.engine_form import first_non_finite

    if info.file not in maps:
        maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
    hit = first_non_finite(maps[info.file][info.offset : info.offset + info.nbytes], info.type_id)
    if hit is not None:
        raise PackError(f"{info.file.name}: tensor {layer_of(info.name)} {BY_ID[info.type_id].name}: {hit[1]} is "
                        f"{hit[2]}, expected finite values (the GGUF is damaged; no quantizer writes one)")


def _pack_chunks(src, info: TensorInfo) -> Iterable[bytes]:
    """The tensor's bytes in pack form: as is, or BF16 -> F32 (the 16 bits on top, 16 zero bits below)."""
    src.seek(info.offset)
    left = info.nbytes
    while left:
        data = src.read(min(_CHUNK, left))
        if not data:
            raise GGUFError(f"{info.file}: tensor {info.name} ends early (file truncated while packing?)")
        left -= len(data)
        if info.type_id == _BF16.id:
            data = (np.frombuffer(data, dtype="<u2").astype("<u4") << 16).tobytes()
        yield data


def _swap_into_place(tmp: Path, out: Path, force: bool) -> None:
    if not out.exists():
        os.rename(tmp, out)
        return
    check_destination(out, force)  # again: something may have appeared while we were writing
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old)


def convert(ggufs: Sequence[str | os.PathLike], out: str | os.PathLike, *, ple_gguf=None, mtp_gguf=None, force: bool = False,
            compress_ratio: int | None = None, on_warning: Callable[[str], None] | None = None,
            progress_factory: Callable[[int], Callable[[int], None]] | None = None, hash_sources: bool = False) -> PackPlan:
    """Open, check, plan and write in one call. `progress_factory(total_bytes)` returns the progress callback."""
    for note in recover_leftovers(Path(out)):
        if on_warning:
            on_warning(note)
    check_destination(Path(out), force)  # before reading gigabytes of headers
    plan = plan_pack(open_sources(ggufs, ple_gguf, mtp_gguf), compress_ratio=compress_ratio)
    warnings = list(plan.warnings)
    if plan.tokenizer.chat_template is None:
        warnings.append("the GGUF has no tokenizer.chat_template: strata generate --chat is refused for this pack "
                        "(prompts must come already formatted)")
    for w in warnings:
        if on_warning:
            on_warning(w)
    write_pack(plan, out, force=force, progress=progress_factory(plan.pool_bytes) if progress_factory else None,
               hash_sources=hash_sources)
    return plan


# --- reading a pack back: summary and verify ------------------------------------------------------


@dataclass(frozen=True)
class Pack:
    """A pack's indexes, read with the strict readers and checked against its geometry."""

    dir: Path
    manifest: Manifest
    geometry: ModelGeometry
    index: PackIndex
    experts: NativeExperts
    ple: PleTable | None
    tokenizer: FlatTokenizer
    source_paths: dict[str, str]  # name -> absolute path at pack time (sources.txt)


def read_pack(pack_dir: str | os.PathLike) -> Pack:
    from strata.engine.pack_reader import check_mtp_packed, check_pack_dir

    d = check_pack_dir(pack_dir)  # a missing path, a file, a GGUF: says what it is and what a pack is
    manifest = read_manifest(d / MANIFEST)
    g = read_geometry(d / GEOMETRY)
    pool = d / POOL
    index = read_index(d / INDEX)
    if pool.exists() and pool.stat().st_size != index.pool_bytes:
        # blamed on pool.bin, the file that changed (the index's pool field was once named instead)
        raise PackError(f"{pool}: {pool.stat().st_size} bytes, expected {index.pool_bytes} (the pool {INDEX} "
                        "describes): pool.bin was truncated or replaced; rebuild the pack")
    check_mtp_packed(d / INDEX, index, g)
    _check_index_against_geometry(d / INDEX, index, g)
    experts = read_native_experts(d / EXPERTS, n_embd=g.n_embd, n_ff=g.n_ff_exp, n_expert=g.n_expert,
                                  layers=sorted({s.layer for s in tensor_specs(g) if s.category == EXPERT}))
    ple = read_ple_table(d / PLE, row_dim=g.ple_row_dim, rows=g.ple_table_rows) if g.ple_layers else None
    if ple is None and (d / PLE).exists():
        raise PackError(f"{d / PLE}: present, but geometry.txt has no PLE layers")
    return Pack(d, manifest, g, index, experts, ple, read_tokenizer(d / TOKENIZER), read_sources(d / SOURCES))


def _check_index_against_geometry(path: Path, index: PackIndex, g: ModelGeometry) -> None:
    want = [(s.name, s.shape) for s in tensor_specs(g) if s.in_pool]
    have = [(t.name, t.shape) for t in index.tensors]
    bad = next(((w, h) for w, h in zip(want, have) if w[0] != h[0] or not same_shape(w[1], h[1])), None)
    if bad or len(want) != len(have):
        detail = (f"{bad[1][0]} {list(bad[1][1])} where the geometry requires {bad[0][0]} {list(bad[0][1])}"
                  if bad else f"{len(have)} tensors, the geometry requires {len(want)}")
        raise GeometryError(f"{path}: {detail}")


@dataclass
class VerifyReport:
    checks: list[tuple[str, str]] = field(default_factory=list)  # (what, result): the OK table
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_pack(pack_dir: str | os.PathLike, *, gguf_dir: str | os.PathLike | None = None,
                full: bool = False, full_sources: bool = False) -> VerifyReport:
    """Re-read a pack and its GGUFs; every disagreement becomes a problem (nothing is fixed)."""
    rep = VerifyReport()
    try:
        pack = read_pack(pack_dir)
    except (ValueError, OSError) as e:
        rep.problems.append(str(e))
        return rep
    rep.checks.append(("indexes", f"{len(pack.index.tensors)} dense tensors, {len(pack.experts.layers)} expert layers, "
                                  f"{len(pack.tokenizer.tokens)} tokens ({pack.geometry.arch})"))
    _verify_files(pack, full, rep)
    _scan_pool(pack, rep)
    found = _locate_sources(pack, gguf_dir, rep)
    if found is not None:
        _verify_against_ggufs(pack, found, rep)
        if full:
            _scan_experts(pack, found, rep)
        if full_sources:
            _hash_sources(pack, found, rep)
    return rep


def _hash_sources(pack: Pack, paths: dict[str, Path], rep: VerifyReport) -> None:
    """--full-sources: every byte of every source GGUF, against sources.sha256 when the pack has one
    (convert --hash-sources). The sampled fingerprint misses a change between its samples, and the
    experts are read from these files in place."""
    recorded = read_source_hashes(pack.dir / SHA256) if (pack.dir / SHA256).is_file() else {}
    for s in pack.manifest.sources:
        got = full_sha256(paths[s.name])
        want = recorded.get(s.name)
        if want is None:
            rep.checks.append((f"source {s.role} {s.name} sha256", f"{got.removeprefix('sha256-')} (no hash recorded at "
                               "pack time: compare with the publisher's, or convert --hash-sources)"))
        elif got != want:
            rep.problems.append(f"source {s.role} {s.name} changed since packing ({paths[s.name]}): sha256 recorded "
                                f"{want}, found {got} (its sampled fingerprint matched: bytes between the samples changed)")
        else:
            rep.checks.append((f"source {s.role} {s.name} sha256", "matches the hash recorded at pack time"))


def _scan_pool(pack: Pack, rep: VerifyReport) -> None:
    """Every dense tensor's values and fp16 block scales are finite (a read of pool.bin)."""
    from strata.engine.kernels.engine_form import first_non_finite
    from strata.engine.weight_scan import layer_of

    path = pack.dir / POOL
    if not path.is_file() or path.stat().st_size != pack.index.pool_bytes or not pack.index.pool_bytes:
        return  # reported by _verify_files
    pool = np.memmap(path, dtype=np.uint8, mode="r")
    n_before = len(rep.problems)
    for t in pack.index.tensors:
        hit = first_non_finite(pool[t.offset : t.offset + t.nbytes], t.pack_type)
        if hit is not None:
            rep.problems.append(f"{path}: tensor {layer_of(t.name)} {t.pack.name}: {hit[1]} is {hit[2]}, expected "
                                "finite values (rebuild the pack from an undamaged GGUF)")
    if len(rep.problems) == n_before:
        rep.checks.append(("finite weights", f"{len(pack.index.tensors)} dense tensors: no NaN/inf value or block scale"
                           " (--full scans the experts too)"))


def _scan_experts(pack: Pack, paths: dict[str, Path], rep: VerifyReport) -> None:
    """--full: every expert's fp16 block scales (or values) are finite, read in place in the GGUFs."""
    from strata.engine.kernels.engine_form import first_non_finite
    from strata.index_format.native_experts import expert_bytes

    g, n_before = pack.geometry, len(rep.problems)
    maps: dict[str, np.ndarray] = {}
    for e in pack.experts.layers:
        name = e.shard or pack.experts.gguf
        if name not in maps:
            maps[name] = np.memmap(paths[name], dtype=np.uint8, mode="r")
        gu, d = BY_ID[e.gu_type], BY_ID[e.d_type]
        gate_bytes, _, down_bytes = expert_bytes(gu, d, g.n_embd, g.n_ff_exp)
        for role, off, t, each in (("gate", e.gate_off, gu, gate_bytes), ("up", e.up_off, gu, gate_bytes),
                                   ("down", e.down_off, d, down_bytes)):
            hit = first_non_finite(maps[name][off : off + g.n_expert * each], t.id)
            if hit is not None:
                rep.problems.append(f"{paths[name]}: tensor blk.{e.layer}.ffn_{role}_exps.weight (layer {e.layer}, "
                                    f"expert {hit[0] // (each // t.type_size)}) {t.name}: {hit[1]} of the tensor is "
                                    f"{hit[2]}, expected finite values")
    if len(rep.problems) == n_before:
        rep.checks.append(("finite experts", f"{len(pack.experts.layers)} expert layers: no NaN/inf block scale or value"))


def _verify_files(pack: Pack, full: bool, rep: VerifyReport) -> None:
    n_before = len(rep.problems)
    listed = {f.name for f in pack.manifest.files}
    required = {POOL, INDEX, EXPERTS, GEOMETRY, TOKENIZER, SOURCES} | ({PLE} if pack.ple else set())
    for name in sorted(required - listed):
        rep.problems.append(f"{pack.dir / MANIFEST}: pack file {name} is not listed")
    for f in pack.manifest.files:
        path = pack.dir / f.name
        if not path.is_file():
            rep.problems.append(f"{path}: missing (listed in {MANIFEST})")
        elif path.stat().st_size != f.size:
            rep.problems.append(f"{path}: size recorded {f.size}, found {path.stat().st_size}")
        elif f.name == POOL and not full:
            rep.checks.append((POOL, f"{f.size} bytes (size only; --full hashes it)"))
        else:
            # pool.bin is recorded with its full sha256; the small files are hashed whole by fp1.
            got = full_sha256(path) if f.fingerprint.startswith("sha256-") else fingerprint_file(path)
            if got != f.fingerprint:
                rep.problems.append(f"{path}: fingerprint recorded {f.fingerprint}, found {got}")
            elif f.name == POOL:
                rep.checks.append((POOL, f"{f.size} bytes, sha256 matches"))
    if len(rep.problems) == n_before:
        rep.checks.append(("pack files", f"{len(pack.manifest.files)} files: sizes and fingerprints match"))


def _locate_sources(pack: Pack, gguf_dir, rep: VerifyReport) -> dict[str, Path] | None:
    """name -> path of every source, unchanged since packing; None when any is missing or changed."""
    found: dict[str, Path] = {}
    for s in pack.manifest.sources:
        what = f"source {s.role} {s.name}"
        if gguf_dir is None and s.name not in pack.source_paths:
            rep.problems.append(f"{what}: {SOURCES} does not record where it was (pass --gguf-dir DIR)")
            continue
        path = Path(gguf_dir) / s.name if gguf_dir is not None else Path(pack.source_paths[s.name])
        if not path.is_file():
            rep.problems.append(f"{what}: not found at {path} (pass --gguf-dir DIR where the GGUFs are now)")
            continue
        size = path.stat().st_size
        if size != s.size:
            rep.problems.append(f"{what} changed since packing ({path}): size recorded {s.size}, found {size}")
            continue
        fp = fingerprint_file(path)
        if fp != s.fingerprint:
            rep.problems.append(f"{what} changed since packing ({path}): fingerprint recorded {s.fingerprint}, found {fp}")
            continue
        rep.checks.append((what, f"{path}: size and fingerprint match"))
        found[s.name] = path
    return found if len(found) == len(pack.manifest.sources) else None


def _verify_against_ggufs(pack: Pack, paths: dict[str, Path], rep: VerifyReport) -> None:
    try:
        files = {name: read_gguf(p) for name, p in paths.items()}
    except (ValueError, OSError) as e:
        rep.problems.append(str(e))
        return
    main = pack.experts.gguf
    mtp = next((files[s.name] for s in pack.manifest.sources if s.role == "mtp"), None)
    tensors = {n: t for f in files.values() if f is not mtp for n, t in f.tensors.items()}
    tensors |= mtp_block_tensors(mtp) if mtp is not None else {}
    _verify_geometry(pack, files[main], tensors, rep, mtp)
    n_before = len(rep.problems)
    for e in pack.experts.layers:
        for role, off, type_id in (("gate", e.gate_off, e.gu_type), ("up", e.up_off, e.gu_type), ("down", e.down_off, e.d_type)):
            name = f"blk.{e.layer}.ffn_{role}_exps.weight"
            _expect_tensor(rep, tensors.get(name), name, e.shard or main, off, type_id)
    if pack.ple is not None:
        t = pack.ple
        _expect_tensor(rep, tensors.get(t.name), t.name, t.file, t.offset, t.type_id, (t.row_dim, t.rows))
    for entry in pack.index.tensors:
        t = tensors.get(entry.name)
        if t is None or t.type_id != entry.src_type or not same_shape(t.shape, entry.shape):
            found = "missing" if t is None else f"type {t.type_id} shape {list(t.shape)}"
            rep.problems.append(f"{INDEX}: {entry.name} is type {entry.src_type} shape {list(entry.shape)}, "
                                f"the GGUFs hold {found}")
    if len(rep.problems) == n_before:
        rep.checks.append(("GGUF offsets", f"{len(pack.experts.layers)} expert layers"
                           + (", the PLE table" if pack.ple else "") + f" and {len(pack.index.tensors)} dense tensors match"))


def _verify_geometry(pack: Pack, main: GGUFFile, tensors: dict[str, TensorInfo], rep: VerifyReport,
                     mtp: GGUFFile | None = None) -> None:
    """geometry.txt against the geometry derived again from the GGUF: a pack edited and re-fingerprinted
    (n_expert_used 4 -> 2) once passed verify, which never looked at the GGUF's metadata."""
    g = pack.geometry
    try:
        derived = geometry_from_gguf(main, tensors, compress_ratio=g.idx_compress_ratio or None, mtp=mtp).geometry
    except ValueError as e:
        rep.problems.append(f"{main.path.name}: the geometry cannot be derived again: {e}")
        return
    if not g.n_ctx_train:  # packs made before geometry.txt recorded the trained context
        derived = dataclasses.replace(derived, n_ctx_train=0)
    diff = [f.name for f in dataclasses.fields(g) if getattr(g, f.name) != getattr(derived, f.name)]
    for name in diff:
        rep.problems.append(f"{pack.dir / GEOMETRY}: {name} is {getattr(g, name)!r}, the GGUF {main.path.name} gives "
                            f"{getattr(derived, name)!r} (edited since packing; rebuild the pack)")
    if not diff:
        rep.checks.append(("geometry", f"{GEOMETRY} equals the geometry derived again from {main.path.name}"))


def _expect_tensor(rep: VerifyReport, t: TensorInfo | None, name: str, file: str, offset: int, type_id: int,
                   shape: tuple[int, ...] | None = None) -> None:
    if t is None:
        rep.problems.append(f"{name}: recorded in {file} at {offset}, but no source GGUF holds it now")
    elif (t.file.name, t.offset, t.type_id) != (file, offset, type_id) or (shape is not None and not same_shape(t.shape, shape)):
        rep.problems.append(f"{name}: recorded at {file} offset {offset} type {type_id}, "
                            f"found at {t.file.name} offset {t.offset} type {t.type_id} shape {list(t.shape)}")


# --- the summary ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackSummary:
    """What a pack holds, in bytes, by source type, by budget category, and per expert layer."""

    by_type: list[tuple[str, int, str, int, int]]  # src type, count, pack type, pack bytes, engine bytes
    by_category: list[tuple[str, int, int, int, int]]  # category, count, pack bytes, engine bytes, scale-plane bytes
    pool_bytes: int
    engine_bytes: int
    scale_plane_bytes: int  # f32 planes the engine form holds in place of the fp16 scales
    widened_bytes: int  # of which the widening adds (2 bytes per scale)
    bf16_pack_bytes: int  # BF16 sources: F32 in the pack ...
    bf16_engine_bytes: int  # ... re-rounded to 16 bits in the engine
    expert_layers: list[tuple[int, str, str, int, int, str]]  # layer, gu, d, blob, layer bytes, file
    expert_bytes: int
    ple: PleTable | None


def summarize(pack: Pack) -> PackSummary:
    cats = {s.name: s.category for s in tensor_specs(pack.geometry)}
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    planes = widened = bf_pack = bf_engine = 0
    pack_type: dict[str, str] = {}
    for t in pack.index.tensors:
        n_blocks = t.nbytes // t.pack.type_size
        plane = 4 * t.engine.n_scales * (n_blocks if t.engine_type == t.pack_type else 0)
        planes, widened = planes + plane, widened + plane // 2
        if t.src_type == _BF16.id:
            bf_pack, bf_engine = bf_pack + t.nbytes, bf_engine + t.engine_nbytes
        row = by_type[t.src.name]
        row[0], row[1], row[2] = row[0] + 1, row[1] + t.nbytes, row[2] + t.engine_nbytes
        pack_type[t.src.name] = t.pack.name
        c = by_cat[cats[t.name]]
        c[0], c[1], c[2], c[3] = c[0] + 1, c[1] + t.nbytes, c[2] + t.engine_nbytes, c[3] + plane
    n = pack.experts.n_expert
    layers = [(e.layer, BY_ID[e.gu_type].name, BY_ID[e.d_type].name, e.blob_bytes, n * e.blob_bytes,
               e.shard or pack.experts.gguf) for e in pack.experts.layers]
    return PackSummary(
        [(k, v[0], pack_type[k], v[1], v[2]) for k, v in sorted(by_type.items())],
        [(k, *v) for k, v in sorted(by_cat.items())],
        pack.index.pool_bytes, sum(t.engine_nbytes for t in pack.index.tensors), planes, widened, bf_pack, bf_engine,
        layers, pack.experts.total, pack.ple,
    )
