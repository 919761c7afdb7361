"""`strata-pack`: GGUF -> pack conversion, pack verification, synthetic models, and the demo.

Thin on purpose: every command parses its flags, calls tools/pack.py (or tools/synth.py) and
formats the result. The summary and the verify table go to stdout (parseable); progress,
warnings and errors go to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from strata.engine.cli import CONTEXT_SETTINGS, model_argument, model_option, resolve_pack, run_app, version_option

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings=CONTEXT_SETTINGS,
    help="Convert a qwen4exp / qwen35moe GGUF into a Strata pack (dense weights copied, experts referenced in place).",
)

# What the user can fix; anything else is a bug and keeps its traceback.
_INPUT_ERRORS = (ValueError, OSError)


def _fail(command: str, message: str, code: int = 1) -> typer.Exit:
    for line in str(message).splitlines() or [""]:
        typer.echo(f"strata-pack {command}: {line}", err=True)
    return typer.Exit(code)


def _interrupted(command: str) -> typer.Exit:
    return _fail(command, "interrupted; the partial output was removed, nothing that looks like a pack was left", 130)


def _progress_factory(desc: str):
    from tqdm import tqdm

    bars = []

    def factory(total: int):
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                   disable=None, leave=False)
        bars.append(bar)
        return bar.update

    return factory, bars


def _convert(ggufs, out, ple_gguf, force, compress_ratio, command: str, hash_sources: bool = False,
             mtp_gguf=None) -> None:
    from strata.tools import pack

    factory, bars = _progress_factory("pool.bin")
    try:
        pack.convert(ggufs, out, ple_gguf=ple_gguf, mtp_gguf=mtp_gguf, force=force, compress_ratio=compress_ratio,
                     on_warning=lambda w: typer.echo(f"strata-pack {command}: warning: {w}", err=True),
                     progress_factory=factory, hash_sources=hash_sources)
    finally:
        for bar in bars:
            bar.close()
    typer.echo(f"strata-pack {command}: wrote {out}", err=True)


@app.callback()
def _strata_pack(version: bool = version_option()) -> None:
    """Convert a qwen4exp / qwen35moe GGUF into a Strata pack (dense weights copied, experts referenced in place)."""


@app.command()
def convert(
    ggufs: list[Path] = typer.Argument(..., metavar="GGUF", help="the model's GGUF (any shard of a split one finds the rest)"),
    out: Path = typer.Option(..., "-o", "--out", help="the pack directory to create"),
    ple_gguf: Optional[Path] = typer.Option(None, "--ple-gguf", help="the PLE shard (qwen4exp), when not a split shard"),
    mtp_gguf: Optional[Path] = typer.Option(None, "--mtp", help="a separate MTP-only GGUF (qwen35moe: llama.cpp's "
                                            "convert_hf_to_gguf.py --mtp) carrying the draft block of a trunk "
                                            "converted without one"),
    force: bool = typer.Option(False, "--force", help="replace an existing pack (kept until the new one is complete)"),
    compress_ratio: Optional[int] = typer.Option(
        None, "--compress-ratio", min=1, help="the QSA block size, when the GGUF's attention.compress_ratios is all zeros"
    ),
    hash_sources: bool = typer.Option(False, "--hash-sources", help="also record every source GGUF's full sha256 "
                                      "(sources.sha256; reads every byte) for verify --full-sources"),
) -> None:
    """Pack a GGUF: dense tensors into pool.bin, experts and the PLE table referenced in place."""
    try:
        _convert(ggufs, out, ple_gguf, force, compress_ratio, "convert", hash_sources, mtp_gguf)
        _print_summary(out)
    except KeyboardInterrupt:
        raise _interrupted("convert") from None
    except _INPUT_ERRORS as e:
        from strata.engine.arguments import no_space

        raise _fail("convert", no_space(e, [out]) or str(e)) from None


@app.command()
def verify(
    pack_arg: Optional[Path] = model_argument(),
    pack: Optional[Path] = model_option(),
    gguf_dir: Optional[Path] = typer.Option(
        None, "--gguf-dir", help="where the source GGUFs are now (default: where they were at pack time, sources.txt)"
    ),
    full: bool = typer.Option(False, "--full", help="also hash all of pool.bin against the manifest's sha256 and "
                              "scan the experts for NaN/inf"),
    full_sources: bool = typer.Option(False, "--full-sources", help="also hash every source GGUF in full (against "
                                      "sources.sha256 when convert --hash-sources recorded it)"),
) -> None:
    """Check a pack against itself and its GGUFs: sizes, fingerprints, every index line, expert offsets."""
    from strata.tools.pack import verify_pack

    try:
        pack_dir = resolve_pack(pack_arg, pack)
        report = verify_pack(pack_dir, gguf_dir=gguf_dir, full=full, full_sources=full_sources)
    except KeyboardInterrupt:
        raise _interrupted("verify") from None
    except _INPUT_ERRORS as e:
        raise _fail("verify", str(e)) from None
    if not report.ok:
        raise _fail("verify", "\n".join(report.problems + [f"{pack_dir}: NOT OK ({len(report.problems)} problem(s))"]))
    typer.echo(_table(report.checks, ["check", "result"]))
    typer.echo(f"{pack_dir}: OK")


@app.command()
def synth(
    arch: str = typer.Option(..., "--arch", help="qwen4exp or qwen35moe"),
    out: Path = typer.Option(..., "-o", "--out", help="the GGUF to write, NAME.gguf; a model of several files (the "
                             "qwen4exp PLE shard, a split qwen35moe) becomes NAME-00001-of-0000n.gguf, ... "
                             "(the paths are printed)"),
    preset: str = typer.Option("tiny", "--preset", help="tiny (tests), demo (the README's default) or seed-4l (production widths)"),
    seed: int = typer.Option(0, "--seed", help="random seed (same seed, same bytes)"),
    force: bool = typer.Option(False, "--force", help="overwrite existing files"),
    zero_compress_ratios: bool = typer.Option(
        False, "--zero-compress-ratios", help="qwen4exp: write attention.compress_ratios as all zeros, as llama.cpp's "
        "converter does today (the QSA block size is then lost: convert needs --compress-ratio)"),
    mtp: bool = typer.Option(False, "--mtp", help="qwen35moe: carry an MTP draft block, as llama.cpp's converter "
                             "writes a Qwen3.5-MoE checkpoint's (block_count n_layer + 1, nextn_predict_layers 1)"),
) -> None:
    """Write a synthetic random model as GGUF (no download): the demo's and the tests' source. Prints the
    files written, one a line, on stdout; the convert command for them on stderr."""
    from strata.tools.synth import get_preset, synth_command

    if seed < 0:
        raise _fail("synth", f"--seed {seed}: expected an integer >= 0", 2)
    try:
        paths = synth_command(arch, preset, out, seed, force, zero_compress_ratios, mtp)
    except KeyboardInterrupt:
        raise _interrupted("synth") from None
    except _INPUT_ERRORS as e:
        raise _fail("synth", str(e)) from None
    for path in paths:
        typer.echo(str(path))
    flag = f" --compress-ratio {get_preset(preset).compress_ratio}" if zero_compress_ratios and arch == "qwen4exp" else ""
    typer.echo(f"strata-pack synth: wrote {len(paths)} file(s); pack with: strata-pack convert {paths[0]} -o PACK{flag}",
               err=True)


DEMO_ARCH, DEMO_PRESET, DEMO_SEED = "qwen4exp", "demo", 0
# The demo's generation step: the engine on the CPU, greedy, with --stats. The model is random, so
# the text is noise; what the step shows is the whole path (pack -> engine -> tokens) working.
DEMO_GENERATE = ["--prompt", "Strata runs huge mixture-of-experts models on one machine.", "-n", "32",
                 "--temp", "0", "--device", "cpu", "--stats"]


@app.command()
def demo(
    out: Path = typer.Option(Path("packs/demo"), "-o", "--out", help="the pack directory (its sources go beside it, in <out>-src)"),
    force: bool = typer.Option(False, "--force", help="rebuild the sources and the pack"),
    generate: bool = typer.Option(True, "--generate/--no-generate", help="then generate from it with the engine on the CPU"),
) -> None:
    """Synthesize the `demo` model (qwen4exp), pack it, print the summary, generate from it on the CPU.
    No GPU, no download."""
    try:
        _demo(out, force, generate)
    except KeyboardInterrupt:
        raise _interrupted("demo") from None
    except _INPUT_ERRORS as e:
        raise _fail("demo", str(e)) from None


def _demo(out: Path, force: bool, generate: bool) -> None:
    from strata.tools.pack import MANIFEST, check_destination, verify_pack
    from strata.tools.synth import get_preset, output_paths, plan_model, synth_command

    if (out / MANIFEST).is_file() and not force:
        report = verify_pack(out)
        if not report.ok:
            raise _fail("demo", "\n".join(report.problems + [f"{out} exists but does not verify; rerun with --force to rebuild it"]))
        typer.echo(f"strata-pack demo: {out} exists and verifies; reusing it (--force rebuilds it)", err=True)
    else:
        check_destination(out, True)  # a non-pack -o is refused before 229 MB are synthesized, not after
        src = out.with_name(out.name + "-src")
        name = src / f"{DEMO_ARCH}-{DEMO_PRESET}.gguf"
        ggufs = output_paths(name, len(plan_model(DEMO_ARCH, DEMO_PRESET).shards))
        if force or not all(p.is_file() for p in ggufs):
            src.mkdir(parents=True, exist_ok=True)
            synth_command(DEMO_ARCH, DEMO_PRESET, name, DEMO_SEED, True)  # only our own demo files are replaced
        else:
            typer.echo(f"strata-pack demo: reusing the synthetic model in {src}", err=True)
        # the ratio is in the files synth writes now; passing it too lets sources an older synth wrote
        # (all zeros) still pack: the two agree, or convert says they do not
        _convert([ggufs[0]], out, None, force, get_preset(DEMO_PRESET).compress_ratio, "demo")
    _print_summary(out)
    if generate:
        from strata.engine.cli import main as engine_main

        typer.echo("\n## strata generate (CPU)")
        rc = engine_main(["generate", "--pack", str(out), *DEMO_GENERATE])
        if rc:
            raise _fail("demo", f"strata generate exited with {rc}")


# --- output ---------------------------------------------------------------------------------------


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{n} B"


def _table(rows, headers) -> str:
    from tabulate import tabulate

    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def _print_summary(pack_dir: Path) -> None:
    from strata.tools.pack import read_pack, summarize

    typer.echo(format_summary(summarize(read_pack(pack_dir)), pack_dir))


def format_summary(s, pack_dir: Path) -> str:
    """The pack summary: dense tensors by type and by budget category, pool forms, experts, PLE."""
    parts = [f"# pack {pack_dir}", "", "## dense tensors by source type (pool.bin)"]
    parts.append(_table(s.by_type, ["src_type", "tensors", "pack_type", "pack_bytes", "engine_bytes"]))
    parts += ["", "## dense tensors by budget category"]
    parts.append(_table(s.by_category, ["category", "tensors", "pack_bytes", "engine_bytes", "f32_scale_bytes"]))
    parts += ["", "## bytes: the pool in pack form and engine form, the experts in place"]
    rows = [
        ("pool.bin (pack form)", s.pool_bytes, _human(s.pool_bytes)),
        ("engine form", s.engine_bytes, _human(s.engine_bytes)),
        ("engine form: f32 scale planes", s.scale_plane_bytes, _human(s.scale_plane_bytes)),
        ("engine form: widening fp16 -> f32 adds", s.widened_bytes, _human(s.widened_bytes)),
        ("BF16 sources, F32 in the pack", s.bf16_pack_bytes, _human(s.bf16_pack_bytes)),
        ("BF16 sources, re-rounded in the engine", s.bf16_engine_bytes, _human(s.bf16_engine_bytes)),
        ("experts, in the GGUF (not in the pool)", s.expert_bytes, _human(s.expert_bytes)),
    ]
    parts.append(_table(rows, ["what", "bytes", "size"]))
    parts += ["", "## experts (referenced in place in the GGUF, never copied)"]
    parts.append(_table(s.expert_layers, ["layer", "gate_up_type", "down_type", "blob_bytes", "layer_bytes", "file"]))
    if s.ple is not None:
        p = s.ple
        parts += ["", "## PLE table (referenced in place, read through the page cache)"]
        parts.append(_table([(p.name, p.type.name, f"{p.row_dim}x{p.rows}", p.nbytes, p.offset, p.file)],
                            ["tensor", "type", "shape", "bytes", "offset", "file"]))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, "strata-pack")


if __name__ == "__main__":
    sys.exit(main())
