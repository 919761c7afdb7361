"""`strata-profile`: routing counts -> expert-profile.bin, which decides the GPU-resident experts.

Thin on purpose: it checks the inputs and the outputs' places before the model loads, runs
tools/profile.py over the calibration text (a progress bar on stderr), writes the profile (and the
trace) atomically, and prints the expected hit rate in-sample and on the held-out documents to
stdout. Problems go to stderr with a non-zero exit status and leave no file behind.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from strata.engine.cli import (CONTEXT_SETTINGS, ctx_option, device_option, expert_cache_option, model_argument, model_option,
                               native_option, ple_gguf_option,
                               resolve_pack, run_app, threads_option, version_option, vram_budget_option,
                               vram_reserve_option)

app = typer.Typer(add_completion=False, context_settings=CONTEXT_SETTINGS, help=__doc__.splitlines()[0].strip("`"))

WHO = "strata-profile"
_INPUT_ERRORS = (ValueError, OSError, NotImplementedError)
CAUTION = ("In-sample figures alone mislead: they score the hot list on the very text it was ranked from. "
           "Published measurements on this model family found a static hot list far weaker on held-out text; "
           "plan with the held-out column.")


def _fail(message: str, code: int = 1) -> typer.Exit:
    for line in str(message).splitlines() or [""]:
        typer.echo(f"{WHO}: error: {line}", err=True)
    return typer.Exit(code)


@app.command()
def profile(
    pack_arg: Optional[Path] = model_argument(),
    pack: Optional[Path] = model_option(),
    prompts: Path = typer.Option(..., "--prompts", help="calibration text, UTF-8: one document per paragraph "
                                 "(paragraphs are separated by blank lines)"),
    out: Path = typer.Option(..., "-o", "--output", help="the profile to write (expert-profile.bin)"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="run at most N tokens in all (default: "
                                             "every document), split between the two parts by --held-out"),
    held_out: float = typer.Option(0.2, "--held-out", help="fraction of the documents kept aside to score the "
                                   "profile on text it was not built from; 0 = none"),
    ctx: int = ctx_option(4096, "--ctx", "context in tokens: a longer document is run as consecutive windows of N "
                          "tokens, each its own sequence"),
    prefill: str = typer.Option("auto", "--prefill", help="chunk of the batched prompt path: auto, CHUNK or off "
                                "(token by token); the counts are the same model's either way"),
    kv: str = typer.Option("f16", "--kv", help="KV cache type, as the engine will run: f16, int8 or f32"),
    pool_workers: Optional[int] = threads_option(),
    device: str = device_option(),
    expert_cache: str = expert_cache_option(),
    vram_budget_mib: Optional[int] = vram_budget_option(),
    vram_reserve_mib: int = vram_reserve_option(),
    trace: Optional[Path] = typer.Option(None, "--trace", help="also write the per-token routing trace of the "
                                         "in-sample tokens (a flat binary for cache-policy replay)"),
    native: Optional[Path] = native_option(),
    ple_gguf: Optional[Path] = ple_gguf_option(),
    version: bool = version_option(),
) -> None:
    """Count expert routing over calibration text; write the profile and print its expected hit rate."""
    from strata.engine.cli import check_context, engine_options, gpu_options
    from strata.engine.pack_reader import check_pack_dir, read_pack_geometry
    from strata.tools import profile as P

    try:
        pack = resolve_pack(pack_arg, pack)
        option = engine_options(kv, prefill)
        gpu_options(device, expert_cache, vram_budget_mib, vram_reserve_mib)
        tier = dict(device=device, expert_cache=expert_cache, vram_budget_mib=vram_budget_mib, vram_reserve_mib=vram_reserve_mib)
        check_pack_dir(pack)  # says what it found and what a pack is
        docs = P.read_documents(prompts)
        P.check_options(len(docs), held_out, max_tokens, ctx)
        check_context(WHO, read_pack_geometry(pack), kv, ctx, "--ctx-size")
        _check_outputs(out, trace)
        _run(pack, docs, out, max_tokens, held_out, ctx, option, kv, pool_workers, trace, native, ple_gguf, tier)
    except KeyboardInterrupt:
        typer.echo(f"\n{WHO}: interrupted; nothing written", err=True)
        raise typer.Exit(130) from None
    except _INPUT_ERRORS as e:
        from strata.engine.arguments import no_space

        raise _fail(no_space(e, [out, trace]) or str(e)) from None


def _check_outputs(out: Path, trace: Path | None) -> None:
    """Each output's directory takes a file now, so a long run cannot end in an unwritable path."""
    if trace is not None and os.path.abspath(trace) == os.path.abspath(out):
        raise ValueError(f"--trace {trace} is the profile's path too: give two files")
    for flag, path in (("-o", out), ("--trace", trace)):
        if path is None:
            continue
        if path.is_dir():
            raise ValueError(f"{flag} {path}: a directory; expected a file name")
        probe = path.with_name(f".{path.name}.probe-{os.getpid()}")
        try:
            probe.open("wb").close()
        except OSError as e:
            raise ValueError(f"{flag} {path}: cannot write there ({e.strerror})") from None
        probe.unlink()


def _run(pack_dir, docs, out, max_tokens, held_out, ctx, option, kv, pool_workers, trace_path, native, ple_gguf, tier) -> None:
    from tqdm import tqdm

    from strata.engine.cli import load_model, naming_non_finite, prefill_chunk, start_tier
    from strata.engine.tokenizer import Tokenizer
    from strata.index_format.expert_profile import write_expert_profile
    from strata.index_format.manifest import pack_fingerprint
    from strata.index_format.routing_trace import TraceWriter
    from strata.tools import profile as P

    pack, model, _ = load_model(pack_dir, native, ple_gguf, pool_workers, WHO, option)
    g = pack.geometry
    tok = Tokenizer.load(pack.tokenizer_path)
    calib = P.plan_calibration([tok.encode(d) for d in docs], held_out, max_tokens)
    chunk = prefill_chunk(option, g, ctx, tier["device"])
    # on a GPU the tier computes the same routing faster; without a profile its slots fill as routed
    start_tier(model, max_context=ctx, kv=kv, chunk=chunk, who=WHO, **tier)
    fingerprint = pack_fingerprint(pack.dir)
    n_in, n_held = calib.tokens
    typer.echo(f"{WHO}: {len(docs)} documents -> {len(calib.in_docs)} in-sample ({n_in} tokens run), "
               f"{len(calib.held_docs)} held out ({n_held} tokens run); --ctx-size {ctx}, --kv {kv}, "
               f"{f'chunks of {chunk}' if chunk > 1 else 'token by token'}", err=True)
    writer = None
    if trace_path is not None:
        writer = TraceWriter(trace_path, pack_fingerprint=fingerprint, n_layer=g.n_layer, n_expert=g.n_expert,
                             top_k=g.n_expert_used)
    # the trace commits once the profile is written, and is removed on any exception (StreamingFile)
    # the trace commits when its block ends (or is removed), then the profile is written; if that
    # fails the trace goes too: all or nothing (a full disk once left the profile AND the trace's temp)
    with writer if writer is not None else contextlib.nullcontext(), naming_non_finite(pack):
        with tqdm(total=n_in + n_held, unit="tok", desc="profile", file=sys.stderr, disable=None) as bar:
            progress = lambda k: (pack.check_unchanged(), bar.update(k))  # a mapped file rewritten: stop
            result = P.build_profile(model, fingerprint, calib, ctx=ctx, kv=kv, chunk=chunk, progress=progress,
                                     trace=writer)
    try:
        write_expert_profile(out, result.profile)
    except BaseException:
        if trace_path is not None:
            Path(trace_path).unlink(missing_ok=True)
        raise
    if writer is not None:
        typer.echo(f"{WHO}: wrote the routing trace of {n_in} tokens to {trace_path}", err=True)
    typer.echo(format_report(result, out, g))


def format_report(result, out: Path, g) -> str:
    """The profile written, then the expected hit rate at slot shares, in-sample beside held-out."""
    from tabulate import tabulate

    from strata.tools.profile import hit_rate_table

    p, h = result.profile, result.held_out
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"
    rows = [(f"{r.percent}%", r.slots, pct(r.in_sample), pct(r.held_out)) for r in hit_rate_table(p, h)]
    held = f"held out: {h.tokens} tokens" if h is not None else "no held-out text (--held-out 0)"
    lines = [
        f"{WHO}: wrote {out}: {p.tokens} tokens counted (in-sample), {p.pairs} of {g.n_layer} x {g.n_expert} "
        f"(layer, expert) pairs routed, top_k {p.top_k}; pack {p.pack_fingerprint}",
        f"expected hit rate (% of routed expert uses served by GPU slots; {held}):",
        tabulate(rows, headers=["slots (% of experts)", "slots", "in-sample %", "held-out %"], tablefmt="simple",
                 disable_numparse=True, colalign=("right", "right", "right", "right")),
        CAUTION,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, WHO)


if __name__ == "__main__":
    sys.exit(main())
