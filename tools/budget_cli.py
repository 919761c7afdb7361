"""`strata-budget`: what the GPU engine will allocate for a pack, stage by stage, before a 10-minute load.

Thin on purpose: it reads the pack with the strict readers, asks engine/budget.py for the plan the
GPU engine allocates from (so the prediction is the allocation), and formats it. The report goes
to stdout; problems that would make the engine refuse to start go to stderr with exit status 1.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from strata.engine.cli import CONTEXT_SETTINGS, ctx_option, model_argument, model_option, resolve_pack, run_app, version_option

app = typer.Typer(add_completion=False, context_settings=CONTEXT_SETTINGS, help=__doc__.splitlines()[0].strip("`"))

_INPUT_ERRORS = (ValueError, OSError)
MiB = 1 << 20
GiB = 1 << 30


def _fail(message: str, code: int = 1) -> typer.Exit:
    for line in str(message).splitlines() or [""]:
        typer.echo(f"strata-budget: {line}", err=True)
    return typer.Exit(code)


def _require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise _fail("--plot needs matplotlib, which is not installed: pip install 'strata[plot]' "
                    "(or run without --plot)", 2) from None
    matplotlib.use("Agg")  # files only: never open a window, never need a display
    import matplotlib.pyplot as plt

    return plt


@app.command()
def budget(
    pack_arg: Optional[Path] = model_argument(),
    pack: Optional[Path] = model_option(),
    vram_budget_mib: Optional[int] = typer.Option(None, "--vram-budget-mib", min=1,
                                                  help="a card of N MiB, as the engine's --vram-budget-mib behaves"),
    vram_gib: Optional[float] = typer.Option(None, "--vram-gib", min=0.0, hidden=True,
                                             help="a card of G GiB (--vram-budget-mib in GiB)"),
    free_mib: Optional[int] = typer.Option(None, "--free-mib", min=0,
                                           help="device memory free before the engine starts (nvidia-smi's free)"),
    vram_reserve_mib: int = typer.Option(700, "--vram-reserve-mib", min=0, help="device memory kept free beside the slots"),
    prefill: str = typer.Option("auto", "--prefill", help="the prompt path's chunk: auto (256), a token count, or off (0) for none"),
    stream_min_tokens: str = typer.Option("auto", "--stream-min-tokens", help="strata generate's: off plans no staging "
                                          "for the prompt's streamed experts; auto or N plans two slots of it"),
    gpu_step: str = typer.Option("host", "--gpu-step", help="strata generate's: host, or device (the whole forward on "
                                 "the card: its states, the prompt's cuBLAS slab, a layer's experts streamed whole)"),
    stream_layer_tokens: str = typer.Option("auto", "--stream-layer-tokens", help="strata generate's: off plans no "
                                            "buffers for a layer's experts streamed whole (the device step); auto or "
                                            "N plans two layers of them where they fit"),
    max_context: int = ctx_option(4096, "--max-context", "the context (KV cache size) in tokens"),
    kv: str = typer.Option("f16", "--kv", help="KV cache type: f16, int8 (f32 scale per 32 elements) or f32"),
    expert_cache: str = typer.Option("auto", "--expert-cache", help="GPU expert slots: auto (what fits beside the reserve) or a slot count to check"),
    expert_profile: Optional[Path] = typer.Option(None, "--expert-profile", help="expert-profile.bin (strata-profile)"),
    batch: int = typer.Option(1, "--batch", metavar="N", help="strata serve's --batch: N sessions at once"),
    cache_slots: int = typer.Option(0, "--conversation-cache-slots", metavar="N", help="strata serve's parked sessions "
                                    "(8 there); 0: none, as strata generate"),
    cache_mib: int = typer.Option(2048, "--conversation-cache-mib", metavar="M", help="strata serve's cap on them, MiB"),
    spec: int = typer.Option(0, "--spec", metavar="N", help="strata generate's and serve's --spec: N draft tokens per "
                             "verification (the rollback snapshots and the MTP head's KV, per request; with "
                             "--gpu-step device the head drafts on the device: its matrices, experts and KV there)"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write a PNG of expected hit rate against slots"),
    version: bool = version_option(),
) -> None:
    """Print the memory plan: dense weights in engine form, the session, the expert slots that fit, and with a
    profile the expected hit rate."""
    if sum(x is not None for x in (vram_budget_mib, vram_gib, free_mib)) > 1:
        raise _fail("give one of --vram-budget-mib or --free-mib, not both", 2)
    if vram_budget_mib is not None:
        vram_gib = vram_budget_mib * MiB / GiB
    if plot is not None and expert_profile is None:
        raise _fail("--plot draws the hit-rate curve of a profile: give --expert-profile too", 2)
    plt = _require_matplotlib() if plot is not None else None
    try:
        pack_dir = resolve_pack(pack_arg, pack)
        from strata.engine.arguments import finite

        # inf (or 1e308, inf once in bytes) reached int() as an OverflowError traceback; 2^30 GiB is 1 EiB
        finite("--vram-budget-mib" if vram_budget_mib is not None else "--vram-gib", vram_budget_mib if vram_budget_mib is not None else vram_gib, lo=0, hi=2**40 if vram_budget_mib is not None else 2**30)
        opts = _options(prefill, max_context, kv, expert_cache, vram_reserve_mib, batch, cache_slots, cache_mib, spec,
                        stream_min_tokens, gpu_step, stream_layer_tokens)
        _check_context(pack_dir, kv, max_context)
        free = None if vram_gib is None and free_mib is None else int(vram_gib * GiB) if vram_gib is not None else free_mib * MiB
        report = _report(pack_dir, opts, free, expert_profile)
    except _INPUT_ERRORS as e:
        raise _fail(str(e)) from None
    typer.echo(report.text)
    for w in report.budget.warnings:
        typer.echo(f"strata-budget: warning: {w}", err=True)
    if plot is not None:
        _plot(plt, report, plot)
        typer.echo(f"strata-budget: wrote {plot}", err=True)
    if report.budget.problems:
        raise _fail("\n".join([*report.budget.problems, "the engine would refuse to start with these options"]))


def _options(prefill: str, max_context: int, kv: str, expert_cache: str, reserve: int, batch: int = 1,
             cache_slots: int = 0, cache_mib: int = 0, spec: int = 0, stream: str = "auto", step: str = "host",
             layers: str = "auto"):
    from strata.engine.arguments import parse_prefill, parse_stream_layer_tokens, parse_stream_min_tokens
    from strata.engine.budget import BudgetOptions, auto_prefill_chunk

    chunk = parse_prefill(prefill)
    chunk = auto_prefill_chunk() if chunk is None else chunk  # the device plan: the 256-token chunk
    slots = None if expert_cache == "auto" else _count("--expert-cache", expert_cache)
    if step not in ("host", "device"):
        raise ValueError(f"--gpu-step {step!r}: expected host or device")
    for flag, v, lo in (("--batch", batch, 1), ("--conversation-cache-slots", cache_slots, 0),
                        ("--conversation-cache-mib", cache_mib, 0), ("--spec", spec, 0)):
        if v < lo:
            raise ValueError(f"{flag} {v}: expected at least {lo}")
    return BudgetOptions(max_context=max_context, kv=kv, vram_reserve_mib=reserve, prefill_chunk=chunk, expert_cache=slots,
                         batch=batch, cache_slots=cache_slots, cache_mib=cache_mib, spec=spec, draft_device=spec > 0,
                         stream_experts=parse_stream_min_tokens(stream) != 0, device_step=step == "device",
                         stream_layers=parse_stream_layer_tokens(layers) != 0)


def _check_context(pack_dir: Path, kv: str, max_context: int) -> None:
    """A plan whose session does not fit this host's memory is refused with both numbers (it once
    printed a 931 TiB KV cache and exited 0); beyond the trained context, a warning."""
    from strata.engine.cli import check_context
    from strata.engine.pack_reader import read_pack_geometry

    check_context("strata-budget", read_pack_geometry(pack_dir), kv, max_context, "--ctx-size")


def _count(flag: str, text: str) -> int:
    from strata.engine.arguments import is_count

    if not is_count(text):
        raise ValueError(f"{flag} {text!r}: expected auto or a non-negative integer")
    return int(text)


class _Report:
    def __init__(self, text, budget, profile, curve, pack_name):
        self.text, self.budget, self.profile, self.curve, self.pack_name = text, budget, profile, curve, pack_name


def _report(pack_dir: Path, opts, free: int | None, profile_path: Path | None) -> _Report:
    from dataclasses import replace

    from strata.engine.budget import plan_budget
    from strata.engine.expert_plan import hit_rate_curve
    from strata.index_format.expert_profile import read_expert_profile
    from strata.index_format.manifest import pack_fingerprint
    from strata.tools.pack import read_pack

    pack = read_pack(pack_dir)
    g = pack.geometry
    profile = curve = None
    if profile_path is not None:
        profile = read_expert_profile(profile_path, pack_fingerprint=pack_fingerprint(pack_dir), n_layer=g.n_layer,
                                      n_expert=g.n_expert, top_k=g.n_expert_used)
        curve = hit_rate_curve(profile)
        opts = replace(opts, profile_pairs=profile.pairs)
    b = plan_budget(pack.index, pack.experts, g, opts, free_bytes=free,
                    ple_table_bytes=pack.ple.nbytes if pack.ple is not None else None,
                    ple_table_type=pack.ple.type_id if pack.ple is not None else None)
    text = format_report(b, f"{pack_dir} ({g.arch}, {g.n_layer} layers, {g.n_expert} experts per layer)", profile, curve)
    return _Report(text, b, profile, curve, str(pack_dir))


def format_report(b, title: str, profile=None, curve=None) -> str:
    """The table of items by stage, then the reserve, the slots (the auto formula's line) and the fill policy's line."""
    from tabulate import tabulate

    from strata.engine.budget import DEVICE, STAGES
    from strata.engine.expert_plan import fill_policy_line

    o = b.options
    rows = []
    for n, stage in enumerate(STAGES, 1):
        for i in (i for i in b.items if i.stage == stage):
            rows.append((n, i.name, i.where, f"{i.bytes / MiB:.2f}", i.bytes))
        rows.append(("", f"= device after {n}: {stage}", DEVICE, f"{b.used_after(stage) / MiB:.2f}", b.used_after(stage)))
    lines = [f"strata-budget: {title}; --ctx-size {o.max_context}, --kv {o.kv}",
             tabulate(rows, headers=["stage", "item", "where", "MiB", "bytes"], tablefmt="simple",
                      disable_numparse=True, colalign=("right", "left", "left", "right", "right")),
             f"device {b.device_bytes() / GiB:.3f} GiB; host (mapped or pinned) {b.host_bytes() / GiB:.3f} GiB",
             f"slot {b.slot_bytes} B (the largest expert in engine form; {b.max_blob} B in the GGUF), "
             f"{b.n_pairs} (layer, expert) pairs"]
    lines += _slot_lines(b)
    if b.slots is not None:
        lines.append(fill_policy_line(profile))
    if profile is not None and b.slots is not None:
        k = min(b.slots, profile.pairs)
        lines.append(f"expected hit rate at {b.slots} slots: {100 * curve[k]:.1f}% of routed expert uses on the GPU "
                     f"(in-sample: the profile's own {profile.tokens} tokens; {profile.pairs} routed pairs)")
    return "\n".join(lines)


def _slot_lines(b) -> list[str]:
    if b.free_bytes is None:
        return ["slots: not planned (give --vram-budget-mib or --free-mib)"]
    r = b.reserve
    out = [f"free before start {b.free_bytes / MiB:.1f} MiB; at the cache {b.free_at_open / MiB:.1f} MiB; "
           f"reserve {r.headroom_mib} MiB headroom + {r.prefill_mib} MiB prompt chunk + "
           f"{r.draft_bind_bytes / MiB:.1f} MiB draft head = {r.bytes / MiB:.1f} MiB"]
    out.append(b.auto_line if b.auto_line else f"expert cache {b.slots} slots (asked)")
    out.append(f"free after startup {b.final_free / MiB:.1f} MiB")
    return out


def _plot(plt, report: _Report, out: Path) -> None:
    """Hit rate against slots, the planned slot count marked; written atomically."""
    curve, b = report.curve, report.budget
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    ax.plot(range(len(curve)), 100 * curve, color="C0", label="in-sample (the profile's own tokens)")
    if b.slots is not None:
        k = min(b.slots, len(curve) - 1)
        ax.axvline(b.slots, color="C3", linestyle="--", label=f"{b.slots} slots: {100 * curve[k]:.1f}%")
    ax.set(xlabel="expert slots on the GPU", ylabel="expected hit rate (% of routed expert uses)",
           title=f"{report.pack_name}: {report.profile.tokens} tokens profiled", ylim=(0, 100), xlim=(0, len(curve) - 1))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        fig.savefig(tmp, format="png")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, "strata-budget")


if __name__ == "__main__":
    sys.exit(main())
