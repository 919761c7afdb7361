"""llama.cpp's own HF -> GGUF converter as the reference for what a real GGUF looks like.

The converter is not on PyPI as a package; it ships inside the llama-cpp-python source
distribution (vendor/llama.cpp). `converter_dir()` fetches that sdist once with pip (or takes
the local file named by STRATA_LLAMA_SDIST), checks its sha256, and extracts only
convert_hf_to_gguf.py, conversion/ and gguf-py/ into the cache (STRATA_REF_CACHE, default
<repo>/.cache/llama-cpp-ref). The converter always runs in a subprocess with its own gguf-py
first on the path: the installed PyPI gguf 0.19 knows neither arch qwen4exp nor type 42.

`reference_gguf(arch, outtype, seed)` builds a tiny checkpoint (hf_models) and converts it,
caching both under a key of (config, seed, builder version, converter version, outtype).
For qwen4exp it returns the two-shard form the release ships (main GGUF + PLE shard).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from . import hf_models

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_VENDOR_PREFIX = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/templates/")  # templates: released chat templates

OUTTYPES = ("f32", "bf16", "f16")
REPO_ROOT = Path(__file__).resolve().parents[2]
_RUNNER = Path(__file__).with_name("_run_converter.py")


class ConverterError(RuntimeError):
    """The reference converter could not be obtained or run."""


def cache_root() -> Path:
    env = os.environ.get("STRATA_REF_CACHE")
    return Path(env) if env else REPO_ROOT / ".cache" / "llama-cpp-ref"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _obtain_sdist(root: Path) -> Path:
    env = os.environ.get("STRATA_LLAMA_SDIST")
    if env:
        sdist = Path(env)
        if not sdist.is_file():
            raise ConverterError(f"STRATA_LLAMA_SDIST={env}: no such file (expected {SDIST_NAME})")
    else:
        dl = root / "sdist"
        sdist = dl / SDIST_NAME
        if not sdist.is_file():
            dl.mkdir(parents=True, exist_ok=True)
            # pip prepares the sdist's metadata after downloading; that needs only scikit-build-core
            # in an isolated env (a few seconds), not a build. --no-build-isolation would fail here.
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dl)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not sdist.is_file():
                raise ConverterError(
                    f"pip download of llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} failed (rc {proc.returncode}); "
                    f"set STRATA_LLAMA_SDIST to a local {SDIST_NAME}.\n{proc.stderr[-2000:]}")
    digest = _sha256(sdist)
    if digest != SDIST_SHA256:
        raise ConverterError(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256} ({SDIST_NAME})")
    return sdist


def converter_dir() -> Path:
    """Directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/ of llama.cpp (vendored)."""
    root = cache_root()
    target = root / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
    if (target / "convert_hf_to_gguf.py").is_file() and (target / "models" / "templates").is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # One process at a time fetches and extracts: the suite's workers (pytest -n) collect at once,
    # and one's download into sdist/ and deleting it after its extraction broke another's (its
    # collection then skipped the released templates, and the workers' test lists differed)
    with open(root / "converter.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "convert_hf_to_gguf.py").is_file() and (target / "models" / "templates").is_dir():
            return target  # another process made it while this one waited
        return _extract_converter(root, target)


def _extract_converter(root: Path, target: Path) -> Path:
    shutil.rmtree(target, ignore_errors=True)  # an extraction from before the templates were wanted
    sdist = _obtain_sdist(root)
    tmp = Path(tempfile.mkdtemp(prefix="extract-", dir=root))
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            members = []
            for m in tar.getmembers():
                if not m.name.startswith(_VENDOR_PREFIX):
                    continue
                rel = m.name[len(_VENDOR_PREFIX):]
                if any(rel == w or rel.startswith(w) for w in _WANTED) and (m.isfile() or m.isdir()):
                    m.name = rel
                    members.append(m)
            tar.extractall(tmp, members=members, filter="data")
        if not (tmp / "convert_hf_to_gguf.py").is_file() or not (tmp / "gguf-py" / "gguf").is_dir():
            raise ConverterError(f"{sdist}: no vendor/llama.cpp converter inside")
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "convert_hf_to_gguf.py").is_file():  # not a concurrent winner: real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if sdist.parent == root / "sdist":  # ours, 77 MB, never needed again once extracted
        shutil.rmtree(sdist.parent, ignore_errors=True)
    return target


def converter_env(conv: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(conv / "gguf-py"), str(conv)])
    env.pop("NO_LOCAL_GGUF", None)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _run_converter(checkpoint_dir: Path, outfile: Path, outtype: str, extra: list[str]) -> None:
    conv = converter_dir()
    cmd = [sys.executable, str(_RUNNER), str(conv), str(checkpoint_dir),
           "--outfile", str(outfile), "--outtype", outtype, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=converter_env(conv))
    if proc.returncode != 0:
        raise ConverterError(
            f"convert_hf_to_gguf.py failed on {checkpoint_dir} (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


def _gguf_tensor_count(path: Path) -> int:
    # GGUF header: magic u32, version u32, n_tensors u64, n_kv u64 (little endian)
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:4] != b"GGUF":
        raise ConverterError(f"{path}: not a GGUF file (magic {head[:4]!r})")
    return int.from_bytes(head[8:16], "little")


def _mtp_args(checkpoint_dir: Path, mtp: bool | str = True) -> list[str]:
    # The Qwen3.5 converter expects MTP tensors (asserts a non-zero MTP layer count) unless told
    # --no-mtp; a tiny checkpoint has them only when built with mtp_num_hidden_layers (hf_models).
    # mtp=False converts a checkpoint that has them without them (the trunk alone); mtp="only"
    # writes the MTP-only GGUF (the converter's --mtp: the draft block, token_embd, output_norm, output).
    cfg = json.loads((checkpoint_dir / "config.json").read_text(encoding="utf-8"))
    arch = (cfg.get("architectures") or [""])[0]
    if mtp == "only":
        return ["--mtp"]
    if arch.startswith("Qwen3_5") and (not cfg.get("mtp_num_hidden_layers") or not mtp):
        return ["--no-mtp"]
    return []


def convert_to_gguf(checkpoint_dir: str | Path, out_path: str | Path, outtype: str = "f32",
                    split_ple: bool = False, mtp: bool | str = True) -> list[Path]:
    """Convert a checkpoint with llama.cpp's converter; returns the GGUF file(s) written.

    split_ple=False: one file at out_path. split_ple=True (qwen4exp): the release's two shards,
    <stem>-00001-of-00002.gguf (everything else) and <stem>-00002-of-00002.gguf (the PLE table),
    made by the converter's own --split-max-tensors: the table is the last tensor it emits when the
    checkpoint stores the n-gram shards in its last safetensors part (hf_models does, as releases do).
    mtp=False leaves out an MTP block the checkpoint has (the converter's --no-mtp); mtp="only"
    writes the MTP-only GGUF (the converter's --mtp).
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"convert_to_gguf: outtype {outtype!r}, expected one of {OUTTYPES}")
    checkpoint_dir, out_path = Path(checkpoint_dir), Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    extra = _mtp_args(checkpoint_dir, mtp)
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_path.parent))
    try:
        single = work / out_path.name
        _run_converter(checkpoint_dir, single, outtype, extra)
        if not split_ple:
            single.replace(out_path)
            return [out_path]
        n = _gguf_tensor_count(single)
        split_base = work / "split" / out_path.name
        split_base.parent.mkdir()
        _run_converter(checkpoint_dir, split_base, outtype, [*extra, "--split-max-tensors", str(n - 1)])
        shards = sorted(split_base.parent.glob("*.gguf"))
        stem = out_path.stem
        expected = [f"{stem}-00001-of-00002.gguf", f"{stem}-00002-of-00002.gguf"]
        if [p.name for p in shards] != expected:
            raise ConverterError(f"split conversion wrote {[p.name for p in shards]}, expected {expected}")
        if _gguf_tensor_count(shards[1]) != 1:
            raise ConverterError(f"{shards[1]}: {_gguf_tensor_count(shards[1])} tensors, expected only the PLE table")
        out = []
        for p in shards:
            dest = out_path.with_name(p.name)
            p.replace(dest)
            out.append(dest)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cache_key(arch: str, seed: int, overrides: dict[str, Any], **conversion: Any) -> str:
    payload = json.dumps({
        "config": hf_models.tiny_config(arch, **overrides), "seed": seed, "conversion": conversion,
        "builder": hf_models.BUILDER_VERSION, "converter": LLAMA_CPP_PYTHON_VERSION,
        "sdist": SDIST_SHA256, "runner": _sha256(_RUNNER) if conversion else None,
    }, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def reference_checkpoint(arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A cached tiny checkpoint directory for (arch, seed, overrides)."""
    key = _cache_key(arch, seed, overrides)
    target = cache_root() / "checkpoints" / f"{arch}-s{seed}-{key}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=target.parent))
    try:
        hf_models.build_checkpoint(arch, tmp, seed=seed, **overrides)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def reference_gguf(arch: str, outtype: str = "f32", seed: int = 0, split_ple: bool | None = None,
                   mtp: bool | str = True, **overrides: Any) -> list[Path]:
    """Cached GGUF file(s) of the tiny `arch` model converted by llama.cpp's converter.

    split_ple defaults to True for a qwen4exp model with a PLE layer (the release's form:
    [main shard, PLE shard]) and False otherwise ([single file]). mtp=False converts a checkpoint
    built with an MTP block (mtp_num_hidden_layers=1) without it, as --no-mtp does; mtp="only" its
    MTP-only GGUF, as --mtp does.
    """
    cfg = hf_models.tiny_config(arch, **overrides)
    if split_ple is None:
        split_ple = bool(cfg.get("ple_layer_ids"))
    conversion = dict(outtype=outtype, split_ple=split_ple) | ({} if mtp is True else dict(mtp=mtp))
    key = _cache_key(arch, seed, overrides, **conversion)
    target = cache_root() / "gguf" / f"{arch}-{outtype}-s{seed}-{key}"
    done = target / "files.txt"
    if done.is_file():
        return [target / line for line in done.read_text(encoding="utf-8").split()]
    ckpt = reference_checkpoint(arch, seed, **overrides)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=target.parent))
    try:
        paths = convert_to_gguf(ckpt, tmp / f"tiny-{arch}-{outtype}.gguf", outtype, split_ple=split_ple, mtp=mtp)
        (tmp / "files.txt").write_text("\n".join(p.name for p in paths) + "\n", encoding="utf-8")
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [target / p.name for p in paths]


def _publish(tmp: Path, target: Path) -> None:
    # a complete directory appears under its final name in one rename; a concurrent
    # builder of the same key may have won the race, which is fine (same content)
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise
