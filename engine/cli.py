"""`strata`: the engine's command line.

Thin on purpose (STYLE: library code never reads argv or prints): each subcommand parses its flags,
calls into the engine, and formats the result. Generated text goes to stdout as it is produced;
--stats, warnings and errors go to stderr, so stdout is only the model's text.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

# llama.cpp's habit: -h is --help, on every command of every Strata CLI.
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    context_settings=CONTEXT_SETTINGS,
    help="Strata engine: run a packed MoE model (dense weights and hot experts on the GPU, the rest on the CPU).",
)

# What the user can fix (bad flags, a bad or moved pack); anything else is a bug and keeps its traceback.
_INPUT_ERRORS = (ValueError, OSError, NotImplementedError)
DEVICES = ("cpu", "gpu", "auto")


# The flags every Strata command spells the same way (one definition each): the model, the
# threads, the context, the version. llama.cpp's spellings first (-m, -t, -c), Strata's older
# spellings kept as aliases of the same option.
def model_argument():
    return typer.Argument(None, metavar="PACK", show_default=False,
                          help="the pack directory (strata-pack convert makes one from a GGUF); or give it with -m")


def model_option():
    return typer.Option(None, "-m", "--model", "--pack", metavar="PACK", show_default=False,
                        help="the pack directory (same as the PACK argument)")


def threads_option():
    return typer.Option(None, "-t", "--threads", "--pool-workers", metavar="N", show_default=False,
                        help="CPU threads (default: the cores other processes leave free, re-measured as it runs; generate --stats prints it)")


def ctx_option(default, seed_spelling: str, help: str):
    """-c/--ctx-size on every command; `seed_spelling` (--max-context, --ctx) is the same option's
    older name there, still accepted."""
    return typer.Option(default, "-c", "--ctx-size", seed_spelling, metavar="N", help=help)


def _print_version(value: bool) -> None:
    if value:
        from strata import __version__

        typer.echo(__version__)
        raise typer.Exit(0)


def version_option():
    return typer.Option(False, "--version", is_eager=True, callback=_print_version, help="print the version and exit")


def resolve_pack(positional: Path | None, option: Path | None) -> Path:
    """The pack from PACK or -m PACK (one of them, or both the same); a GGUF is refused with the
    command that packs it (the engine reads packs only: the tools own GGUF parsing)."""
    if positional is None and option is None:
        raise ValueError("no model: give the pack directory as PACK or -m PACK")
    if positional is not None and option is not None and Path(positional) != Path(option):
        raise ValueError(f"two models: PACK {positional} and -m {option}; give one")
    pack = Path(positional if positional is not None else option)
    if pack.suffix.lower() == ".gguf" or pack.is_file():
        name = pack.name.split("-00001-of-")[0].removesuffix(".gguf") or "model"
        raise ValueError(f"-m {pack}: a GGUF file, not a pack directory; a pack is the directory strata-pack convert "
                         f"writes. Pack it once (dense weights copied, experts referenced in place): strata-pack "
                         f"convert {pack} -o packs/{name}, then run with -m packs/{name}")
    return pack


# The GPU tier's flags, shared by generate, perplexity and strata-profile (one definition each).
def device_option():
    return typer.Option("auto", "--device", help="cpu, gpu or auto (auto: the GPU tier when CuPy sees a GPU, "
                        "else the CPU; stderr says which and why)")


def expert_cache_option():
    return typer.Option("auto", "--expert-cache", help="GPU expert slots: auto (what fits beside the reserve) "
                        "or N (refused when it does not fit)")


def expert_profile_option():
    return typer.Option(None, "--expert-profile", help="expert-profile.bin (strata-profile): which experts the slots hold")


def native_option():
    return typer.Option(None, "--native", help="the main GGUF, when it moved since packing")


def ple_gguf_option():
    return typer.Option(None, "--ple-gguf", help="the PLE GGUF shard, when it moved since packing")


def vram_budget_option():
    return typer.Option(None, "--vram-budget-mib", help="behave as on a card of N MiB")


def vram_reserve_option():
    return typer.Option(700, "--vram-reserve-mib", help="device memory kept free beside the slots")


def gpu_step_option():
    return typer.Option("host", "--gpu-step", help="with the GPU tier, where the blocks compute: host (the host drives "
                        "every block, the device runs the products) or device (the whole forward on the device, "
                        "states included)")


def stream_min_tokens_option():
    return typer.Option("auto", "--stream-min-tokens", help="with the GPU tier, a prompt chunk's expert that no slot "
                        "holds is copied to the device and computed there when the chunk routes at least N of its "
                        "tokens to it, else on the CPU: N, auto (from a rough CPU-against-copy model) or off")


def stream_layer_tokens_option():
    return typer.Option("auto", "--stream-layer-tokens", help="with --gpu-step device, a prompt piece of at least N "
                        "tokens copies each layer's experts that no slot holds whole, the next layer's beside this "
                        "one's work: N, auto (from the copy rate measured at startup) or off")


def pin_gguf_option():
    return typer.Option(True, "--pin-gguf/--no-pin-gguf", help="with --gpu-step device, a streamed layer is copied "
                        "straight from the GGUF's pages, page-locked in RAM at their first copy (up to half the "
                        "host's memory, until exit); --no-pin-gguf copies through pinned buffers and locks none")


def _fail(message: str, code: int = 1, who: str = "strata generate") -> typer.Exit:
    typer.echo(f"{who}: error: {message}", err=True)
    return typer.Exit(code)


def check_gpu_step(gpu_step: str, who: str = "strata generate") -> None:
    """--gpu-step's values (generate, serve, chat), refused before the load."""
    if gpu_step not in ("host", "device"):
        raise _fail(f"--gpu-step {gpu_step!r}: expected host or device", 2, who)


@app.command()
def generate(
    pack_arg: Optional[Path] = model_argument(),
    pack: Optional[Path] = model_option(),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="prompt text"),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f", help="read the prompt text from a file"),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help='token ids, e.g. "1 2 3" (no tokenizer)'),
    n: int = typer.Option(128, "-n", "--n-predict", help="tokens to generate at most (stops earlier at a stop token); "
                          "-1: until a stop token or the context is full"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="never sample a stop token: generate exactly -n tokens"),
    temp: float = typer.Option(0.8, "--temp", help="temperature, as llama.cpp; 0 is greedy"),
    top_k: int = typer.Option(40, "--top-k", help="keep the k most likely tokens; 0 is off"),
    top_p: float = typer.Option(0.95, "--top-p", help="nucleus sampling mass; 1 is off"),
    min_p: float = typer.Option(0.05, "--min-p", help="drop tokens below min_p * p_max; 0 is off"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="penalise the last 64 tokens; 1 is off"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed (printed by --stats when not given)"),
    chat: bool = typer.Option(False, "--chat", help="render the prompt as one user turn with the pack's own chat "
                              "template, as transformers' apply_chat_template does"),
    system: Optional[str] = typer.Option(None, "--system", help="with --chat: a system turn before the user's"),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", show_default=False,
                                         help="with --chat: the template's enable_thinking (default: the template's own)"),
    max_context: Optional[int] = ctx_option(None, "--max-context", "the context (KV cache size) in tokens; default: "
                                            "prompt + n, or 4096 with -n -1; a prompt + n beyond it is refused"),
    kv: str = typer.Option("f16", "--kv", help="KV cache type: f16, int8 (an f32 scale per 32 values) or f32 (exact)"),
    prefill: str = typer.Option("auto", "--prefill", help="the prompt in chunks of CHUNK tokens (the batched prompt "
                                "path), auto (1024 on the CPU alone, 256 beside the GPU tier; less when memory is "
                                "short) or off (token by token)"),
    pool_workers: Optional[int] = threads_option(),
    device: str = device_option(),
    expert_cache: str = expert_cache_option(),
    expert_profile: Optional[Path] = expert_profile_option(),
    vram_budget_mib: Optional[int] = vram_budget_option(),
    vram_reserve_mib: int = vram_reserve_option(),
    gpu_step: str = gpu_step_option(),
    stream_min_tokens: str = stream_min_tokens_option(),
    stream_layer_tokens: str = stream_layer_tokens_option(),
    pin_gguf: bool = pin_gguf_option(),
    native: Optional[Path] = native_option(),
    ple_gguf: Optional[Path] = ple_gguf_option(),
    dump_logits: Optional[Path] = typer.Option(None, "--dump-logits", help="write float32 logits of every position to OUT.npy"),
    stats: bool = typer.Option(False, "--stats", help="print load time, tokens/s, session memory and expert routing "
                               "counts to stderr; with --spec also acceptance per draft position and the speed-up "
                               "against a --spec 0 run of the same prompt made first in the same process"),
    spec: int = typer.Option(0, "--spec", help="speculative decoding: draft up to N tokens per step and verify them "
                             "in one forward of the model (the output is the same); 0 is plain decoding"),
    spec_min_p: float = typer.Option(0.75, "--spec-min-p", help="with --spec: stop drafting when the draft's top "
                                     "probability is below P (llama.cpp's --draft-p-min)"),
    spec_drafter: str = typer.Option("mtp", "--spec-drafter", help="with --spec: mtp (the pack's MTP block), or for "
                                     "measuring, drafts from a --spec 0 run made first: oracle (always right), "
                                     "wrong (never), right:P (right with probability P)"),
) -> None:
    """Generate text from a pack, streaming it to stdout (stop tokens are not printed)."""
    if sum(s is not None for s in (prompt, prompt_file, prompt_ids)) != 1:
        raise _fail("give exactly one of --prompt, --prompt-file, --prompt-ids", 2)
    if device not in DEVICES:
        raise _fail(f"--device {device!r}: expected one of {', '.join(DEVICES)}", 2)
    if n < -1:
        raise _fail(f"-n {n}: expected -1 (until a stop token or the context is full) or a count >= 0", 2)
    if (system is not None or think is not None) and not chat:
        raise _fail("--system and --think/--no-think shape the chat template's turns: give --chat too", 2)
    spec_options(spec, spec_min_p, spec_drafter)
    check_gpu_step(gpu_step)
    try:
        pack = resolve_pack(pack_arg, pack)
        del pack_arg
        engine_options(kv, prefill)
        gpu_options(device, expert_cache, vram_budget_mib, vram_reserve_mib)
        stream_option(stream_min_tokens)
        layer_stream_option(stream_layer_tokens)
        _run(**locals())
    except KeyboardInterrupt:
        typer.echo("\nstrata generate: interrupted", err=True)
        raise typer.Exit(130) from None
    except _INPUT_ERRORS as e:
        from strata.engine.arguments import no_space

        raise _fail(no_space(e, [dump_logits]) or str(e)) from None


def spec_options(spec: int, min_p: float, drafter: str, who: str = "strata generate") -> None:
    """--spec, --spec-min-p and --spec-drafter, checked before the load (usage errors: exit 2)."""
    from strata.engine.speculative import parse_drafter

    if spec < 0:
        raise _fail(f"--spec {spec}: expected a count of draft tokens >= 0 (0 is plain decoding)", 2, who)
    if not 0 <= min_p <= 1:
        raise _fail(f"--spec-min-p {min_p}: expected a probability 0..1", 2, who)
    try:
        parse_drafter(drafter)
    except ValueError as e:
        raise _fail(str(e), 2, who) from None


def sampler_options(temp: float, top_k: int, top_p: float, min_p: float, repeat_penalty: float, seed: int | None):
    """The sampler's flags checked by name (finite ranges) -> SamplerParams, before anything loads."""
    from strata.engine.arguments import finite
    from strata.engine.sampling import SamplerParams

    finite("--temp", temp, lo=0, note="0 is greedy")
    finite("--top-p", top_p, lo=0, hi=1, lo_open=True, note="1 is off")
    finite("--min-p", min_p, lo=0, hi=1, note="0 is off")
    finite("--repeat-penalty", repeat_penalty, lo=0, lo_open=True, note="1 is off")
    if top_k < 0:
        raise ValueError(f"--top-k {top_k}: expected >= 0 (0 is off)")
    if seed is not None and seed < 0:
        raise ValueError(f"--seed {seed}: expected >= 0")
    return SamplerParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty, seed=seed)


def engine_options(kv: str, prefill: str) -> int | None:
    """Checks --kv and parses --prefill (None = auto, 0 = off) before anything loads."""
    from strata.engine.arguments import parse_prefill
    from strata.engine.kvcache import KV_TYPES

    if kv not in KV_TYPES:
        raise ValueError(f"--kv {kv!r}: expected one of {', '.join(KV_TYPES)}")
    return parse_prefill(prefill)


def gpu_options(device: str, expert_cache: str, vram_budget_mib: int | None, vram_reserve_mib: int) -> int | None:
    """Checks the GPU tier's flags before anything loads; --expert-cache -> None (auto) or N."""
    if device not in DEVICES:
        raise ValueError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "gpu":
        from strata.engine.kernels import gpu

        ok, why = gpu.available()
        if not ok:  # said before the load (10-36 s on a real model), not after it
            raise ValueError(f"--device gpu: {why}; run with --device cpu (or auto)")
    if vram_budget_mib is not None and vram_budget_mib < 1:
        raise ValueError(f"--vram-budget-mib {vram_budget_mib}: expected a card size in MiB, >= 1")
    if vram_reserve_mib < 0:
        raise ValueError(f"--vram-reserve-mib {vram_reserve_mib}: expected >= 0")
    if expert_cache == "auto":
        return None
    from strata.engine.arguments import is_count

    if not is_count(expert_cache):
        raise ValueError(f"--expert-cache {expert_cache!r}: expected auto or a number of slots (ASCII digits)")
    return int(expert_cache)


def tier_options(device, expert_cache, expert_profile, vram_budget_mib, vram_reserve_mib, gpu_step, stream_min_tokens,
                 stream_layer_tokens, pin_gguf) -> dict:
    """strata serve's and chat's GPU tier flags, checked, as start_tier's keywords."""
    gpu_options(device, expert_cache, vram_budget_mib, vram_reserve_mib)
    return dict(device=device, expert_cache=expert_cache, expert_profile=expert_profile, vram_budget_mib=vram_budget_mib,
                vram_reserve_mib=vram_reserve_mib, step=gpu_step, stream_min_tokens=stream_option(stream_min_tokens),
                stream_layer_tokens=layer_stream_option(stream_layer_tokens), stream_register=pin_gguf)


def stream_option(value: str) -> int | None:
    from strata.engine.arguments import parse_stream_min_tokens

    return parse_stream_min_tokens(value)


def layer_stream_option(value: str) -> int | None:
    from strata.engine.arguments import parse_stream_layer_tokens

    return parse_stream_layer_tokens(value)


def check_context(who: str, g, kv: str, ctx: int, flag: str, extra_bytes: int = 0, extra_what: str = "",
                  shown: str | None = None) -> None:
    """A context size before the load: beyond the model's trained context, a warning; a session (and
    `extra_bytes`) larger than the host memory available now, refused with both numbers (a huge
    --max-context once loaded the model and then died in a MemoryError traceback)."""
    from strata.engine.arguments import fits_memory
    from strata.engine.budget import session_host_bytes

    if ctx < 1:
        raise ValueError(f"{flag} {ctx}: expected at least 1")
    if g.n_ctx_train and ctx > g.n_ctx_train:
        typer.echo(f"{who}: warning: {flag} {ctx} is beyond the model's trained context ({g.n_ctx_train} tokens); "
                   "past it the model runs on positions it never saw", err=True)
    need = session_host_bytes(g, ctx, kv) + extra_bytes
    fits_memory(flag, shown or f"{flag} {ctx}", need, available_host_bytes(), f"the session's KV cache and state{extra_what}")


def start_tier(model, device: str, *, max_context: int, kv: str, chunk: int, expert_cache: str = "auto",
               expert_profile=None, vram_budget_mib=None, vram_reserve_mib: int = 700, who: str, step: str = "host",
               stream_min_tokens: int | None = None, spec: int = 0, stream_layer_tokens: int | None = None,
               stream_register: bool = True, draft: bool = False, batch: int = 1):
    """The GPU tier for --device gpu, or auto when CuPy sees a GPU (without one, auto is the CPU,
    not an error, and stderr says so and why); None on the CPU. Its startup lines (each stage's
    memory) go to stderr. `spec`: --spec N, whose verifier the device step places at startup;
    `draft`: with it, the MTP head drafts on the device (the device step and a pack with the block).
    `batch`: strata serve's --batch, the sessions the device step places."""
    from strata.engine.tier import GpuTier, TierOptions
    from strata.engine.kernels import gpu

    ok, why = (False, "--device cpu") if device == "cpu" else gpu.available()
    if device == "auto":
        where = f"CUDA GPU {why}; running the GPU tier" if ok else f"no CUDA GPU ({why}); running on the CPU"
        typer.echo(f"{who}: --device auto: {where}", err=True)
    if not ok:
        if device == "gpu":
            raise ValueError(f"--device gpu: {why}; run with --device cpu (or auto)")
        if step == "device":
            typer.echo(f"{who}: note: --gpu-step device places the GPU tier's blocks; on the CPU every block runs "
                       "on the CPU", err=True)
        if expert_profile is not None or expert_cache != "auto" or vram_budget_mib is not None:
            typer.echo(f"{who}: note: no GPU tier ({why}): --expert-cache, --expert-profile and --vram-budget-mib "
                       "have nothing to size; every expert runs on the CPU", err=True)
        return None
    profile = None
    if expert_profile is not None:
        from strata.index_format.expert_profile import read_expert_profile

        profile = read_expert_profile(expert_profile)
    o = TierOptions(max_context=max_context, kv=kv, prefill_chunk=chunk,
                    expert_cache=gpu_options(device, expert_cache, vram_budget_mib, vram_reserve_mib), profile=profile,
                    vram_budget_mib=vram_budget_mib, vram_reserve_mib=vram_reserve_mib, step=step,
                    stream_min_tokens=stream_min_tokens, spec=spec if step == "device" else 0, draft=draft,
                    stream_layer_tokens=stream_layer_tokens, stream_register=stream_register, batch=batch)
    tier = GpuTier.start(model, o, log=lambda line: typer.echo(f"{who}: {line}", err=True))
    if step == "device":  # its kernels compile at first use: in the load, not in the first tokens
        model.warm_up(prompt_path=chunk > 0)
    return tier


def serve_sessions(model, tier):
    """Where strata serve's requests get their sessions: with the device step the ones its tier placed
    (lent, parked in host memory by a copy), else new ones (None: the scheduler's default)."""
    if tier is None or not tier.sessions:
        return None
    from strata.engine.kernels import gpu
    from strata.engine.tier.sessions import DeviceSessions

    return DeviceSessions(gpu.runtime(), model, tier.sessions, tier.snapshot_sets)


@contextlib.contextmanager
def stopping(tier):
    """A command's GPU tier (or None), stopped when the command ends, however it ends: that
    unregisters the GGUF pages its layer stream page-locked (cudaHostRegister). Left registered
    after the pack's mapping is gone, a later mapping at the same addresses is "registered" to the
    driver: a second command in one process (the tests; a library user) had a weight's copy at its
    startup refused (cudaErrorInvalidValue, 2026-12-04), and a copy inside the stale range would
    read the old pages."""
    try:
        yield tier
    finally:
        if tier is not None:
            tier.stop()


def prefill_chunk(option: int | None, geometry, max_context: int, device: str) -> int:
    """The chunk --prefill asked for; auto: budget.auto_prefill_chunk from the memory available now,
    starting from the GPU tier's 256-token chunk when --device gives one (its device buffers are
    planned for it), else from the CPU's 1024."""
    from strata.engine.budget import PREFILL_AUTO_CHUNK, PREFILL_AUTO_CHUNK_CPU, auto_prefill_chunk
    from strata.engine.kernels import gpu

    if option is not None:
        return option
    start = PREFILL_AUTO_CHUNK if device != "cpu" and gpu.available()[0] else PREFILL_AUTO_CHUNK_CPU
    return auto_prefill_chunk(available_host_bytes(), g=geometry, max_context=max_context, start=start)


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where there is none (auto then takes its start)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def load_model(pack, native, ple_gguf, pool_workers, who: str, prefill: int | None):
    """Open the pack (warnings to stderr), build the model and compile its kernels, the prompt path's
    too unless `prefill` (engine_options' parse of --prefill) is off; (pack, model, seconds)."""
    from strata.engine import bus_guard
    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.ops import reuse_freed_memory, single_blas_thread
    from strata.engine.pack_reader import Pack
    from strata.engine.warm import helper_argv, warm_up

    try:
        cpu.set_threads(pool_workers)
    except ValueError as e:
        raise ValueError(f"--threads {pool_workers}: {e}") from None
    if pool_workers is None:
        cpu.governor().settle()  # the cores other processes leave free (kernels/threads.py)
    single_blas_thread()
    reuse_freed_memory()
    t0 = time.perf_counter()
    p = Pack.open(pack, native=native, ple_gguf=ple_gguf)
    bus_guard.install(p.mapped, who)  # a mapped file truncated under the run: a message, not a silent SIGBUS
    for w in p.warnings:
        typer.echo(f"{who}: warning: {w}", err=True)
    model = Model(p)
    with naming_non_finite(p):
        warm_up(model, prefill != 0, helper_argv(pack, native, ple_gguf), lambda line: typer.echo(f"{who}: {line}", err=True))
    return p, model, time.perf_counter() - t0


@contextlib.contextmanager
def naming_non_finite(pack):
    """A NaN/inf met in a run names the weight it came from: tensor, layer and expert (a scan of the
    pack, on this failure path only)."""
    from strata.engine.kernels.actq import NonFiniteActivation
    from strata.engine.weight_scan import explain

    try:
        yield
    except NonFiniteActivation as e:
        raise ValueError(f"{e}; {explain(pack)}") from None


def _run(pack, prompt, prompt_file, prompt_ids, n, ignore_eos, temp, top_k, top_p, min_p, repeat_penalty, seed, chat,
         system, think, max_context, kv, prefill, pool_workers, device, expert_cache, expert_profile, vram_budget_mib,
         vram_reserve_mib, gpu_step, stream_min_tokens, stream_layer_tokens, pin_gguf, native, ple_gguf, dump_logits,
         stats, spec, spec_min_p, spec_drafter) -> None:
    from strata.engine.arguments import check_free_space, writable_file
    from strata.engine.generate import generate as run_generation
    from strata.engine.kernels import cpu
    from strata.engine.pack_reader import read_pack_geometry
    from strata.engine.sampling import Sampler
    from strata.engine.tokenizer import Tokenizer

    # every flag, the prompt and the sizes are checked before the load (seconds to minutes)
    params = sampler_options(temp, top_k, top_p, min_p, repeat_penalty, seed)
    option = engine_options(kv, prefill)
    g = read_pack_geometry(pack)
    tok = Tokenizer.load(Path(pack) / "tokenizer.txt")
    ids = _prompt_ids(tok, prompt, prompt_file, prompt_ids, chat, g.n_vocab, system, think)
    if spec and spec_drafter == "mtp" and not g.n_mtp_layer:
        raise ValueError(f"--spec {spec} drafts with the pack's MTP block and {pack} has none (convert the GGUF with "
                         "its MTP block, or the MTP-only GGUF with strata-pack convert --mtp PATH); --spec-drafter "
                         "oracle, wrong or right:P draft from a --spec 0 run instead, for measuring")
    ctx, n_new = context_and_count(len(ids), n, max_context)
    flag = "--ctx-size" if max_context is not None or n == -1 else "-n"
    shown = f"--ctx-size {ctx}" if flag == "--ctx-size" else f"-n {n} (+ {len(ids)} prompt tokens = {ctx})"
    dump = (len(ids) + n_new) * g.n_vocab * 4 if dump_logits else 0
    if spec:  # the snapshots, the head's KV and, when one runs first, the --spec 0 run's session
        from strata.engine.budget import PREFILL_AUTO_CHUNK_CPU, session_host_bytes, spec_host_bytes

        plain = session_host_bytes(g, ctx, kv) if stats or spec_drafter != "mtp" else 0
        chunk = option if option is not None else PREFILL_AUTO_CHUNK_CPU  # auto: at most the CPU's start
        dump += spec_host_bytes(g, ctx, kv, spec, spec_drafter == "mtp", chunk) + plain
    what = (" and --dump-logits' buffer" if dump_logits else "") + (" and --spec's state" if spec else "")
    check_context("strata generate", g, kv, ctx, flag, dump, what, shown)
    if dump_logits:
        writable_file("--dump-logits", dump_logits)
        check_free_space("--dump-logits", dump_logits, dump + 128)  # + the .npy header
    p, model, load_s = load_model(pack, native, ple_gguf, pool_workers, "strata generate", option)
    chunk = prefill_chunk(option, p.geometry, ctx, device)
    tier = start_tier(model, device, max_context=ctx, kv=kv, chunk=chunk, expert_cache=expert_cache,
                      expert_profile=expert_profile, vram_budget_mib=vram_budget_mib, vram_reserve_mib=vram_reserve_mib,
                      who="strata generate", step=gpu_step, stream_min_tokens=stream_option(stream_min_tokens),
                      spec=spec, stream_layer_tokens=layer_stream_option(stream_layer_tokens), stream_register=pin_gguf,
                      draft=bool(spec) and spec_drafter == "mtp")
    with stopping(tier):
        if tier is not None and option is None:  # --prefill auto: the device step takes longer pieces where memory allows
            piece = tier.prompt_piece(chunk)
            if piece != chunk:
                typer.echo(f"strata generate: the prompt in pieces of {piece} tokens (its {chunk}-token buffers take a "
                           f"piece in runs; the device memory free holds the longer piece's temporaries)", err=True)
                chunk = piece
        session = tier.take_session(ctx, kv) if tier is not None else model.new_session(ctx, kv)
        # --ignore-eos bans the stop tokens (llama.cpp's rule), so exactly n tokens come out
        sampler = Sampler(p.geometry.n_vocab, params, banned=tok.stop_ids if ignore_eos else ())
        stream = tok.stream()
        logits = _LogitsRecorder(len(ids) + n_new, p.geometry.n_vocab) if dump_logits else None

        def emit(token: int) -> None:
            p.check_unchanged()
            if token in tok.stop_ids:
                return  # a stop token ends the answer; its text (<|im_end|>) is not part of it
            sys.stdout.write(stream.push(token))
            sys.stdout.flush()

        with naming_non_finite(p):
            if spec:
                from strata.engine.speculative import speculative_generate

                result, spec_stats, plain = speculative_generate(
                    model, session, ids, sampler, n_new, n_draft=spec, drafter=spec_drafter, min_p=spec_min_p, kv=kv,
                    measure=stats, stop_ids=tok.stop_ids, on_token=emit, on_logits=logits.record if logits else None,
                    prefill=chunk, snapshots=tier.snapshots if tier is not None else None, ahead=True)
            else:
                result = run_generation(model, session, ids, sampler, n_new, stop_ids=tok.stop_ids, on_token=emit,
                                        on_logits=logits.record if logits else None, prefill=chunk, ahead=True)
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
        if logits:
            logits.save(dump_logits, result.positions)
        if stats:
            typer.echo(format_stats(p, load_s, result, session, sampler.seed, cpu.get_threads(), device, chunk, tier), err=True)
            if spec:
                typer.echo(format_spec_stats(spec_stats, spec, spec_drafter, spec_min_p, result, plain), err=True)


def format_spec_stats(st, n_draft: int, drafter: str, min_p: float, result, plain) -> str:
    """--stats with --spec: acceptance per draft position, tokens per verification, the speed-up."""
    from tabulate import tabulate

    # acceptance at a position: of the drafts judged there (every earlier draft of their chain kept)
    rows = [(i + 1, int(d), int(j), int(a), f"{a / j:.3f}" if j else "-")
            for i, (d, j, a) in enumerate(zip(st.drafted, st.judged, st.accepted))]
    lines = [f"speculative decoding: --spec {n_draft}, drafter {drafter}" +
             (f", --spec-min-p {min_p}" if drafter == "mtp" else ""),
             tabulate(rows, headers=["draft position", "drafted", "judged", "accepted", "acceptance"], tablefmt="simple",
                      disable_numparse=True),
             f"verifications {st.verifications}" + (f" ({st.ahead} run ahead of the host)" if st.ahead else "") +
             f", {st.tokens_per_verification():.2f} tokens per verification "
             f"(accepted / drafted {st.acceptance():.3f}); {st.steps} token steps without a draft; "
             f"drafting {st.draft_s:.3f} s, verifying {st.verify_s:.3f} s"]
    if plain is not None:
        same = "same tokens" if plain.tokens.tolist() == result.tokens.tolist() else "tokens differ (sampling)"
        lines.append(tabulate([("--spec 0", len(plain.tokens), f"{plain.decode_s:.3f}", f"{plain.decode_tps:.2f}", "1.00x"),
                               (f"--spec {n_draft}", len(result.tokens), f"{result.decode_s:.3f}",
                                f"{result.decode_tps:.2f}", f"{result.decode_tps / plain.decode_tps:.2f}x")],
                              headers=["decode (same run)", "tokens", "seconds", "tok/s", "speed-up"],
                              tablefmt="simple", disable_numparse=True) + f"\n({same})")
    return "\n".join(lines)


DEFAULT_CONTEXT = 4096  # -n -1 without -c: llama.cpp's default context


def context_and_count(n_prompt: int, n: int, max_context: int | None) -> tuple[int, int]:
    """(KV cache size, tokens to generate at most) for -n and -c. With -n -1 the count is one more
    than fits, so generation stops on the context check (--stats then says "context", not "length")."""
    if n == -1:
        ctx = max_context if max_context is not None else max(DEFAULT_CONTEXT, n_prompt + 1)
        if ctx <= n_prompt:
            raise ValueError(f"--ctx-size {ctx} leaves no room after the prompt ({n_prompt} tokens)")
        return ctx, ctx - n_prompt + 2
    ctx = max_context if max_context is not None else n_prompt + n
    if ctx < n_prompt:
        raise ValueError(f"--ctx-size {ctx} is shorter than the prompt ({n_prompt} tokens)")
    if n_prompt + n > ctx:
        raise ValueError(f"the prompt ({n_prompt} tokens) + -n {n} = {n_prompt + n} tokens do not fit in "
                         f"--ctx-size {ctx}: raise --ctx-size or lower -n")
    return ctx, n


def _prompt_ids(tok, prompt, prompt_file, prompt_ids, chat, n_vocab, system=None, think=None) -> list[int]:
    from strata.engine.arguments import read_text

    if prompt_ids is not None:
        if chat:
            raise ValueError("--chat needs prompt text (--prompt or --prompt-file), not --prompt-ids")
        return parse_ids(prompt_ids, n_vocab)
    text = prompt if prompt is not None else read_text("--prompt-file", prompt_file)
    if chat:
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
        extra = {} if think is None else {"enable_thinking": think}
        text = tok.apply_chat_template(messages, add_generation_prompt=True, **extra)
    ids = tok.encode(text)
    if not ids:
        raise ValueError("the prompt is empty (no tokens)")
    return ids


def parse_ids(text: str, n_vocab: int) -> list[int]:
    """'1 2 3' -> [1, 2, 3]; each an id of the vocabulary (ASCII digits: '٣' is str.isdigit() and int('٣') == 3)."""
    from strata.engine.arguments import is_count

    ids = []
    for i, word in enumerate(text.split()):
        if not is_count(word) or int(word) >= n_vocab:
            raise ValueError(f"--prompt-ids: item {i + 1} is {word!r}, expected a token id in 0..{n_vocab - 1}")
        ids.append(int(word))
    if not ids:
        raise ValueError("--prompt-ids is empty")
    return ids


class _LogitsRecorder:
    """Every fed position's logits, kept in one buffer made up front (positions x vocab, float32)."""

    def __init__(self, max_positions: int, n_vocab: int):
        import numpy as np

        self.rows = np.empty((max_positions, n_vocab), np.float32)

    def record(self, pos: int, logits) -> None:
        self.rows[pos] = logits

    def save(self, path: Path, positions: int) -> None:
        import numpy as np

        # written to a temp name and renamed: a reader never sees half a file
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                np.save(f, self.rows[:positions])
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def format_stats(pack, load_s: float, result, session, seed: int, threads: int, device: str, chunk: int, tier=None) -> str:
    from tabulate import tabulate

    from strata.engine.kernels import cpu

    cpu_auto = cpu.threads_cap() is None

    g = pack.geometry
    how = f"chunks of {chunk}" if chunk > 1 else "token by token"
    lines = [
        f"load     {load_s:.3f} s  (kernels compiled; {g.arch}, {g.n_layer} layers; pool {pack.pool_bytes} B in pack form, "
        f"{pack.engine_bytes} B in engine form; f32 scale planes on the GPU tier add {pack.widened_bytes} B)",
        f"prefill  {len(result.prompt)} tokens in {result.prefill_s:.3f} s -> {result.prefill_tps:.2f} tok/s ({how})",
        f"decode   {len(result.tokens)} tokens in {result.decode_s:.3f} s -> {result.decode_tps:.2f} tok/s "
        f"(stop: {result.stop})",
        f"device   {'gpu tier' if tier else 'cpu'} (--device {device}), {threads} CPU threads"
        f"{' (auto: the cores other processes leave free)' if cpu_auto else ''}; sampling seed {seed}",
        memory_table(pack, session),
        "expert routing counts per layer (token-expert pairs over all fed positions):",
    ]
    rows = []
    for layer, counts in enumerate(session.routing):
        top = counts.argsort(kind="stable")[::-1][:8]
        rows.append((layer, int(counts.sum()), int((counts > 0).sum()),
                     " ".join(f"{int(e)}:{int(counts[e])}" for e in top if counts[e])))
    lines.append(tabulate(rows, headers=["layer", "pairs", "experts used", "most routed (expert:count)"],
                          tablefmt="simple", disable_numparse=True))
    if tier is not None:
        lines.append(hit_table(tier))
    return "\n".join(lines)


def hit_table(tier) -> str:
    """--stats on the GPU tier: the token path's hits and misses per layer, and where its MoE time went."""
    from tabulate import tabulate

    st = tier.stats
    rows = [(l, int(h), int(m), f"{h / (h + m):.1%}" if h + m else "-") for l, (h, m) in enumerate(zip(st.hits, st.misses))]
    h, m = int(st.hits.sum()), int(st.misses.sum())
    rows.append(("total", h, m, f"{st.hit_rate:.1%}" if h + m else "-"))
    gpu_s = f"{st.gpu_s:.3f} s" if st.events else "not measured (no CUDA events)"
    text = (f"expert cache: {tier.slots.slots} slots, {tier.slots.map.used} filled; token-path hits (GPU) and misses (CPU):\n"
            + tabulate(rows, headers=["layer", "hits", "misses", "hit rate"], tablefmt="simple", disable_numparse=True)
            + f"\nMoE time split: GPU work {gpu_s}, CPU misses {st.cpu_s:.3f} s, waiting for the GPU {st.wait_s:.3f} s")
    if not (st.chunk_resident.sum() + st.chunk_streamed.sum() + st.chunk_cpu.sum()):
        return text
    rows = [(l, int(r), int(s), int(c)) for l, (r, s, c) in enumerate(zip(st.chunk_resident, st.chunk_streamed, st.chunk_cpu))]
    rows.append(("total", int(st.chunk_resident.sum()), int(st.chunk_streamed.sum()), int(st.chunk_cpu.sum())))
    staging = tier.hit_path.staging if tier.hit_path is not None else None
    layers = tier.hit_path.layers if tier.hit_path is not None else None
    how = (f"streamed when a chunk routes {staging.min_tokens} or more tokens to it" if staging is not None
           else "none streamed (--stream-min-tokens off, or no prompt path)")
    if layers is not None:
        how += f"; a chunk of {layers.min_tokens} or more tokens streams a layer's non-resident ones whole"
    return (text + f"\nprompt path: expert-chunks (an expert a chunk routes tokens to) resident, streamed to the device "
            f"({how}), on the CPU:\n"
            + tabulate(rows, headers=["layer", "resident", "streamed", "cpu"], tablefmt="simple", disable_numparse=True)
            + f"\nstreamed {st.streamed_bytes} B ({st.streamed_bytes / 2**20:.1f} MiB) to the device"
            + (f", {st.registered_bytes / 2**20:.1f} MiB of it straight from registered GGUF pages" if layers is not None else ""))


def memory_table(pack, session) -> str:
    """The session's state as measured, beside what strata-budget predicts for the same options (the prediction is the allocation)."""
    from tabulate import tabulate

    from strata.engine.budget import BudgetOptions, plan_budget

    plan = plan_budget(pack.index, pack.experts, pack.geometry, BudgetOptions(max_context=session.max_context, kv=session.kv))
    measured = session.memory()
    rows = [(i.name, measured.get(i.key, 0), i.bytes) for i in plan.items if i.key.startswith("session.")]
    rows.append(("scratch (QSA top-k indices, PLE token windows)", measured["scratch"], "not planned"))
    title = f"session memory (--kv {session.kv}, --ctx-size {session.max_context}), bytes:"
    return title + "\n" + tabulate(rows, headers=["item", "engine", "strata-budget"], tablefmt="simple",
                                    disable_numparse=True, colalign=("left", "right", "right"))


@app.command()
def perplexity(
    pack_arg: Optional[Path] = model_argument(),
    pack: Optional[Path] = model_option(),
    file: Path = typer.Option(..., "--file", "-f", help="the text to score (UTF-8)"),
    ctx: int = ctx_option(512, "--ctx", "window length in tokens; the second half of each window is scored"),
    max_windows: Optional[int] = typer.Option(None, "--windows", help="score at most this many windows (default: all)"),
    save_logits: Optional[Path] = typer.Option(None, "--save-logits", help="save this model's distributions to BASE.bin "
                                               "(the base for --kl-base)"),
    kl_base: Optional[Path] = typer.Option(None, "--kl-base", help="report KL divergence and top-1 agreement against "
                                           "BASE.bin (saved with --save-logits from the same text and -c)"),
    kv: str = typer.Option("f16", "--kv", help="KV cache type: f16, int8 or f32"),
    prefill: str = typer.Option("auto", "--prefill", help="chunk of the batched prompt path: auto, CHUNK or off"),
    pool_workers: Optional[int] = threads_option(),
    device: str = device_option(),
    expert_cache: str = expert_cache_option(),
    expert_profile: Optional[Path] = expert_profile_option(),
    vram_budget_mib: Optional[int] = vram_budget_option(),
    vram_reserve_mib: int = vram_reserve_option(),
    native: Optional[Path] = native_option(),
    ple_gguf: Optional[Path] = ple_gguf_option(),
) -> None:
    """Perplexity of a pack over a text file (llama.cpp's windows), and KL divergence against a base model."""
    who = "strata perplexity"
    if max_windows is not None and max_windows < 1:
        raise _fail(f"--windows {max_windows}: expected >= 1", 2, who)
    try:
        pack = resolve_pack(pack_arg, pack)
        option = engine_options(kv, prefill)
        gpu_options(device, expert_cache, vram_budget_mib, vram_reserve_mib)
        tier = dict(device=device, expert_cache=expert_cache, expert_profile=expert_profile, vram_budget_mib=vram_budget_mib,
                    vram_reserve_mib=vram_reserve_mib)
        _perplexity(pack, file, ctx, max_windows, save_logits, kl_base, kv, option, pool_workers, native, ple_gguf, who, tier)
    except KeyboardInterrupt:
        typer.echo(f"\n{who}: interrupted", err=True)
        raise typer.Exit(130) from None
    except _INPUT_ERRORS as e:
        from strata.engine.arguments import no_space

        raise _fail(no_space(e, [save_logits]) or str(e), 1, who) from None


def _perplexity(pack, file, ctx, max_windows, save_logits, kl_base, kv, option, pool_workers, native, ple_gguf, who, tier):
    from tqdm import tqdm

    from strata.engine import perplexity as P
    from strata.engine.tokenizer import Tokenizer
    from strata.index_format.kl_base import KLBaseWriter, read_kl_base
    from strata.index_format.manifest import pack_fingerprint

    from strata.engine.arguments import check_free_space, read_text, writable_file
    from strata.engine.pack_reader import read_pack_geometry
    from strata.index_format.kl_base import HEADER_BYTES, TOKEN, record_dtype

    # the text, the flags and the output are checked before the load (seconds to minutes)
    if kl_base is not None and not Path(kl_base).is_file():
        raise ValueError(f"--kl-base {kl_base}: {'a directory' if Path(kl_base).is_dir() else 'no such file'}; "
                         "expected a file saved by strata perplexity --save-logits")
    base = read_kl_base(kl_base) if kl_base is not None else None
    g = read_pack_geometry(pack)
    ids = Tokenizer.load(Path(pack) / "tokenizer.txt").encode(read_text("--file", file))
    wins = P.windows(ids, ctx)[:max_windows]
    check_context(who, g, kv, ctx, "--ctx-size")
    if save_logits is not None:
        writable_file("--save-logits", save_logits)
        scored = len(wins) * (ctx - 1 - P.first_scored(ctx))
        check_free_space("--save-logits", save_logits,
                         HEADER_BYTES + wins.size * TOKEN.itemsize + scored * record_dtype(g.n_vocab).itemsize + 4)
    p, model, _ = load_model(pack, native, ple_gguf, pool_workers, who, option)
    chunk = prefill_chunk(option, p.geometry, ctx, tier["device"])
    with stopping(start_tier(model, max_context=ctx, kv=kv, chunk=chunk, who=who, **tier)):  # the same logits, faster
        first = P.first_scored(ctx)
        total = len(wins) * (ctx - 1 - first)
        typer.echo(f"{who}: {len(ids)} tokens -> {len(wins)} windows of {ctx}, scoring positions {first + 1}..{ctx - 1} "
                   f"of each ({total} tokens); --kv {kv}, {f'chunks of {chunk}' if chunk > 1 else 'token by token'}", err=True)
        writer = None
        if save_logits is not None:
            writer = KLBaseWriter(save_logits, tokens=wins, first=first, n_vocab=p.geometry.n_vocab,
                                  pack_fingerprint=pack_fingerprint(p.dir))
        # the writer commits on success and removes its temp file on any exception (StreamingFile)
        with writer if writer is not None else contextlib.nullcontext(), naming_non_finite(p):
            with tqdm(total=total, unit="tok", desc="perplexity", file=sys.stderr, disable=None) as bar:
                scores = P.score(model, wins, kv=kv, chunk=chunk, base=base, save=writer.append if writer else None,
                                 progress=lambda k: (p.check_unchanged(), bar.update(k)))
        if writer is not None:
            typer.echo(f"{who}: saved the distributions of {total} positions to {save_logits}", err=True)
        typer.echo(format_perplexity(P.summarize(scores), kl_base))


def format_perplexity(s, kl_base) -> str:
    lines = [f"PPL = {s.ppl:.4f} +/- {s.ppl_err:.4f}  ({s.n} tokens scored)"]
    k = s.kl
    if k is not None:
        e = lambda x: f"{x:.4e}"  # KL values span 1e-8 (a KV type) to 1 (a broken quantization)
        lines += [
            f"KL divergence against {kl_base} (base PPL = {k['base_ppl']:.4f} +/- {k['base_ppl_err']:.4f}):",
            f"  mean ln(PPL/PPL_base)  {e(k['ln_ratio'])} +/- {e(k['ln_ratio_err'])}",
            f"  mean KLD               {e(k['mean'])} +/- {e(k['err'])}",
            f"  median KLD             {e(k['median'])}",
            f"  90% / 95% / 99% KLD    {e(k['p90'])} / {e(k['p95'])} / {e(k['p99'])}",
            f"  maximum KLD            {e(k['max'])}",
            f"  same top-1 token       {100 * k['same_top1']:.3f} +/- {100 * k['same_top1_err']:.3f} %",
        ]
    return "\n".join(lines)


@app.command()
def serve(
    pack_arg: Optional[Path] = model_argument(),
    pack: Optional[Path] = model_option(),
    host: str = typer.Option("127.0.0.1", "--host", help="the address to listen on (loopback unless given; 0.0.0.0: "
                             "every interface, put --api-key on it)"),
    port: int = typer.Option(8080, "--port", help="the TCP port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", metavar="KEY", help="refuse (401) a request without the "
                                          "header Authorization: Bearer KEY"),
    max_queue: int = typer.Option(16, "--max-queue", metavar="Q", help="requests waiting beside the running ones; "
                                  "more get 503 with Retry-After"),
    batch: int = typer.Option(1, "--batch", metavar="N", help="requests decoding together, one forward per step for "
                              "all of them (each request's output is what it gets alone)"),
    cache_slots: int = typer.Option(8, "--conversation-cache-slots", metavar="N", help="finished sessions parked in "
                                    "host memory so a prompt that extends one feeds only its new tokens; 0 is off"),
    cache_mib: int = typer.Option(2048, "--conversation-cache-mib", metavar="M", help="host memory the parked "
                                  "sessions may take, in MiB (least recently used evicted first)"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="the model id clients name (default: the pack "
                                             "directory's name)"),
    max_context: int = ctx_option(4096, "--max-context", "the context (KV cache size) of every request, prompt and "
                                  "reply together"),
    kv: str = typer.Option("f16", "--kv", help="KV cache type: f16, int8 (an f32 scale per 32 values) or f32 (exact)"),
    prefill: str = typer.Option("auto", "--prefill", help="the prompt in chunks of CHUNK tokens, auto or off (token "
                                "by token)"),
    pool_workers: Optional[int] = threads_option(),
    device: str = device_option(),
    expert_cache: str = expert_cache_option(),
    expert_profile: Optional[Path] = expert_profile_option(),
    vram_budget_mib: Optional[int] = vram_budget_option(),
    vram_reserve_mib: int = vram_reserve_option(),
    gpu_step: str = gpu_step_option(),
    stream_min_tokens: str = stream_min_tokens_option(),
    stream_layer_tokens: str = stream_layer_tokens_option(),
    pin_gguf: bool = pin_gguf_option(),
    native: Optional[Path] = native_option(),
    ple_gguf: Optional[Path] = ple_gguf_option(),
    spec: int = typer.Option(0, "--spec", help="speculative decoding: each request drafts up to N tokens with the "
                             "pack's MTP block and verifies them in one forward of its own (the output is the same; "
                             "requests then step one after another, not in one batch, unless --batch-mtp); 0 is plain "
                             "decoding"),
    spec_min_p: float = typer.Option(0.75, "--spec-min-p", help="with --spec: stop drafting when the draft's top "
                                     "probability is below P"),
    batch_mtp: bool = typer.Option(False, "--batch-mtp", help="with --spec: verify every request's drafts in one "
                                   "forward per step (the --batch requests together; the output is the same)"),
) -> None:
    """Serve a pack over an OpenAI-compatible HTTP API (chat and completions, streaming or not)."""
    who = "strata serve"
    spec_options(spec, spec_min_p, "mtp", who)
    if batch_mtp and not spec:
        raise _fail("--batch-mtp verifies the requests' drafts in one forward: give --spec N (N >= 1) too, or drop "
                    "--batch-mtp", 2, who)
    check_gpu_step(gpu_step, who)
    try:
        pack = resolve_pack(pack_arg, pack)
        # (the device step: each request in a session its tier placed)
        tier = tier_options(device, expert_cache, expert_profile, vram_budget_mib, vram_reserve_mib, gpu_step,
                            stream_min_tokens, stream_layer_tokens, pin_gguf)
        _serve(pack, host, port, api_key, max_queue, batch, cache_slots, cache_mib, model_name, max_context, kv, prefill,
               pool_workers, native, ple_gguf, who, tier, spec, spec_min_p, batch_mtp)
    except KeyboardInterrupt:
        typer.echo(f"\n{who}: interrupted", err=True)
        raise typer.Exit(130) from None
    except _INPUT_ERRORS as e:
        raise _fail(str(e), 1, who) from None


def _serve(pack, host, port, api_key, max_queue, batch, cache_slots, cache_mib, model_name, max_context, kv, prefill,
           pool_workers, native, ple_gguf, who, tier_flags, spec=0, spec_min_p=0.75, batch_mtp=False) -> None:
    from strata.engine.pack_reader import read_pack_geometry
    from strata.engine.tokenizer import Tokenizer

    # every flag is checked before the load (seconds to minutes)
    if batch < 1:
        raise ValueError(f"--batch {batch}: expected at least 1 (requests decoding together)")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: expected 0..65535")
    if max_queue < 0:
        raise ValueError(f"--max-queue {max_queue}: expected >= 0")
    if cache_slots < 0:
        raise ValueError(f"--conversation-cache-slots {cache_slots}: expected >= 0 (0 is off)")
    if cache_mib < 0:
        raise ValueError(f"--conversation-cache-mib {cache_mib}: expected >= 0")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key is empty")
    option = engine_options(kv, prefill)
    g = read_pack_geometry(pack)
    tok = Tokenizer.load(Path(pack) / "tokenizer.txt")
    from strata.engine.budget import session_host_bytes

    if spec and not g.n_mtp_layer:
        raise ValueError(f"--spec {spec} drafts with the pack's MTP block and {pack} has none (convert the GGUF with "
                         "its MTP block, or the MTP-only GGUF with strata-pack convert --mtp PATH)")
    from strata.engine.budget import PREFILL_AUTO_CHUNK_CPU, spec_host_bytes

    # --batch N holds N sessions at once, each sized for the whole context (with --spec, its snapshots and head KV)
    chunk = option if option is not None else PREFILL_AUTO_CHUNK_CPU  # auto: at most the CPU's start
    extra = (batch - 1) * session_host_bytes(g, max_context, kv) + \
        (batch * spec_host_bytes(g, max_context, kv, spec, True, chunk) if spec else 0)
    check_context(who, g, kv, max_context, "--ctx-size", extra_bytes=extra,
                  extra_what=f" for each of --batch {batch} requests" if batch > 1 else "")
    import uvicorn

    from strata.engine.scheduler import ConversationCache, Scheduler
    from strata.engine.serve import ServeConfig, make_app

    p, model, load_s = load_model(pack, native, ple_gguf, pool_workers, who, option)
    chunk = prefill_chunk(option, p.geometry, max_context, tier_flags["device"])
    # the tier is bound to the model, not to a session: every request and parked session runs on it
    tier = start_tier(model, max_context=max_context, kv=kv, chunk=chunk, who=who, spec=spec, draft=bool(spec),
                      batch=batch, **tier_flags)
    cache = ConversationCache(cache_slots, cache_mib << 20)
    scheduler = Scheduler(model, tok, max_context=max_context, kv=kv, chunk=chunk, max_queue=max_queue, cache=cache,
                          check=p.check_unchanged, batch=batch, spec=spec, spec_min_p=spec_min_p, batch_mtp=batch_mtp,
                          sessions=serve_sessions(model, tier))
    name = model_name or Path(pack).resolve().name
    where = "the CPU" if tier is None else "the GPU tier" + (", --gpu-step device" if tier.sessions else "")
    app_ = make_app(scheduler, tok, ServeConfig(model_name=name, max_context=max_context, api_key=api_key), tier)
    typer.echo(f"{who}: {name} loaded in {load_s:.1f} s; serving http://{host}:{port}/v1 (context {max_context}, "
               f"--kv {kv}, {where}, "
               f"{'one request at a time' if batch == 1 else f'up to {batch} requests together'}, {max_queue} queued at most)",
               err=True)
    server = QuietSignalServer(uvicorn.Config(app_, host=host, port=port, log_level="warning", access_log=False,
                                              timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    with stopping(tier):
        try:
            server.run()
        except SystemExit:
            # uvicorn exits (status 1) when it cannot bind: say which address instead of its bare log line
            raise ValueError(f"--host {host} --port {port}: cannot listen there (in use, or not an address of this "
                             "machine)") from None
    typer.echo(f"{who}: stopped", err=True)


GRACEFUL_SHUTDOWN_S = 10  # on SIGTERM, in-flight responses get this long to finish, then are cancelled


def _quiet_signal_server():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises the SIGTERM it caught once it has shut down, which made a clean stop exit 143;
        a server stopped by SIGTERM or Ctrl-C has finished its work, so it exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    self._captured_signals.clear()

    return _Server


def QuietSignalServer(config):
    return _quiet_signal_server()(config)


@app.command()
def chat(
    pack_arg: Optional[Path] = model_argument(),
    pack: Optional[Path] = model_option(),
    system: Optional[str] = typer.Option(None, "--system", help="a system turn before the conversation"),
    think: Optional[bool] = typer.Option(None, "--think/--no-think", show_default=False,
                                         help="the template's enable_thinking (default: the template's own)"),
    n: int = typer.Option(1024, "-n", "--n-predict", help="tokens per reply at most"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="never sample a stop token: each reply is exactly -n "
                                    "tokens (or what the context has left)"),
    temp: float = typer.Option(0.8, "--temp", help="temperature, as llama.cpp; 0 is greedy"),
    top_k: int = typer.Option(40, "--top-k", help="keep the k most likely tokens; 0 is off"),
    top_p: float = typer.Option(0.95, "--top-p", help="nucleus sampling mass; 1 is off"),
    min_p: float = typer.Option(0.05, "--min-p", help="drop tokens below min_p * p_max; 0 is off"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="penalise the last 64 tokens; 1 is off"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed"),
    max_context: int = ctx_option(4096, "--max-context", "the context of the whole conversation, in tokens"),
    kv: str = typer.Option("f16", "--kv", help="KV cache type: f16, int8 or f32 (exact)"),
    prefill: str = typer.Option("auto", "--prefill", help="the prompt in chunks of CHUNK tokens, auto or off"),
    pool_workers: Optional[int] = threads_option(),
    device: str = device_option(),
    expert_cache: str = expert_cache_option(),
    expert_profile: Optional[Path] = expert_profile_option(),
    vram_budget_mib: Optional[int] = vram_budget_option(),
    vram_reserve_mib: int = vram_reserve_option(),
    gpu_step: str = gpu_step_option(),
    stream_min_tokens: str = stream_min_tokens_option(),
    stream_layer_tokens: str = stream_layer_tokens_option(),
    pin_gguf: bool = pin_gguf_option(),
    native: Optional[Path] = native_option(),
    ple_gguf: Optional[Path] = ple_gguf_option(),
    spec: int = typer.Option(0, "--spec", help="speculative decoding: each reply drafts up to N tokens per step with "
                             "the pack's MTP block and verifies them in one forward (the reply is the same); 0 is plain "
                             "decoding"),
    spec_min_p: float = typer.Option(0.75, "--spec-min-p", help="with --spec: stop drafting when the draft's top "
                                     "probability is below P"),
    stats: bool = typer.Option(False, "--stats", help="after each reply, print to stderr the prompt tokens fed, "
                               "those taken from the conversation cache, and the reply's speed; with --spec also "
                               "the drafts kept and tokens per verification so far"),
) -> None:
    """Chat in the terminal: each line you type is a user turn; Ctrl-C stops a reply, Ctrl-D exits."""
    who = "strata chat"
    if n < 1:
        raise _fail(f"-n {n}: expected >= 1", 2, who)
    spec_options(spec, spec_min_p, "mtp", who)
    check_gpu_step(gpu_step, who)
    try:
        pack = resolve_pack(pack_arg, pack)
        params = sampler_options(temp, top_k, top_p, min_p, repeat_penalty, seed)
        tier = tier_options(device, expert_cache, expert_profile, vram_budget_mib, vram_reserve_mib, gpu_step,
                            stream_min_tokens, stream_layer_tokens, pin_gguf)
        _chat(pack, system, think, n, ignore_eos, params, max_context, kv, prefill, pool_workers, stats, who,
              native, ple_gguf, tier, spec, spec_min_p)
    except KeyboardInterrupt:
        typer.echo("", err=True)  # Ctrl-C at the prompt: leave as Ctrl-D does
    except _INPUT_ERRORS as e:
        raise _fail(str(e), 1, who) from None


def _chat(pack, system, think, n, ignore_eos, params, max_context, kv, prefill, pool_workers, stats, who, native=None,
          ple_gguf=None, tier_flags=None, spec=0, spec_min_p=0.75) -> None:
    from strata.engine.budget import PREFILL_AUTO_CHUNK_CPU, session_host_bytes, spec_host_bytes
    from strata.engine.pack_reader import read_pack_geometry
    from strata.engine.tokenizer import Tokenizer

    tier_flags = tier_flags or dict(device="cpu")
    option = engine_options(kv, prefill)
    g = read_pack_geometry(pack)
    tok = Tokenizer.load(Path(pack) / "tokenizer.txt")
    if spec and not g.n_mtp_layer:
        raise ValueError(f"--spec {spec} drafts with the pack's MTP block and {pack} has none (convert the GGUF with "
                         "its MTP block, or the MTP-only GGUF with strata-pack convert --mtp PATH)")
    # with --spec, its snapshots and head; with the device step, the parked turn is a host copy beside it
    chunk = option if option is not None else PREFILL_AUTO_CHUNK_CPU  # auto: at most the CPU's start
    extra = spec_host_bytes(g, max_context, kv, spec, True, chunk) if spec else 0
    if tier_flags["device"] != "cpu" and tier_flags.get("step") == "device":
        extra += session_host_bytes(g, max_context, kv)
    check_context(who, g, kv, max_context, "--ctx-size", extra_bytes=extra, extra_what=" and --spec's state" if spec else "")
    p, model, _ = load_model(pack, native, ple_gguf, pool_workers, who, option)
    chunk = prefill_chunk(option, p.geometry, max_context, tier_flags["device"])
    tier = start_tier(model, max_context=max_context, kv=kv, chunk=chunk, who=who, spec=spec, draft=bool(spec),
                      **tier_flags)
    with stopping(tier):
        _converse(model, tok, p, tier, system, think, n, ignore_eos, params, max_context, kv, chunk, stats, who, spec,
                  spec_min_p)


def _converse(model, tok, p, tier, system, think, n, ignore_eos, params, max_context, kv, chunk, stats, who, spec,
              spec_min_p) -> None:
    from strata.engine.scheduler import ConversationCache, Job, Scheduler

    # one parked session: turn n+1 extends turn n, so it feeds only its own new tokens
    scheduler = Scheduler(model, tok, max_context=max_context, kv=kv, chunk=chunk, max_queue=0,
                          cache=ConversationCache(1, 1 << 62), check=p.check_unchanged, spec=spec,
                          spec_min_p=spec_min_p, sessions=serve_sessions(model, tier))
    messages = [{"role": "system", "content": system}] if system is not None else []
    extra = {} if think is None else {"enable_thinking": think}
    typer.echo(f"{who}: type a message and Enter; Ctrl-C stops a reply, Ctrl-D exits", err=True)
    try:
        while True:
            typer.echo("> ", nl=False, err=True)
            line = sys.stdin.readline()
            if not line:  # Ctrl-D
                typer.echo("", err=True)
                return
            turn = messages + [{"role": "user", "content": line.rstrip("\n")}]
            ids = tok.encode(tok.apply_chat_template(turn, add_generation_prompt=True, **extra))
            if len(ids) >= max_context:
                raise ValueError(f"the conversation has {len(ids)} tokens, the context holds {max_context}: "
                                 "start again with a larger --ctx-size")
            job = Job(prompt=ids, max_tokens=min(n, max_context - len(ids)), params=params, ignore_eos=ignore_eos,
                      on_text=lambda text: (sys.stdout.write(text), sys.stdout.flush()))
            t0 = time.perf_counter()
            done = _reply(scheduler, job)
            sys.stdout.write("\n")
            sys.stdout.flush()
            if job.error is not None:
                raise job.error
            messages = turn + [{"role": "assistant", "content": job.text}]
            if stats and done.result is not None:
                r = done.result
                st = scheduler.spec_stats  # (--spec: the conversation's drafting so far)
                drafting = "" if st is None else (
                    f"; --spec {spec}: {int(st.accepted.sum())} of {int(st.drafted.sum())} drafts kept, "
                    f"{st.verifications} verifications, {st.tokens_per_verification():.2f} tokens each")
                typer.echo(f"{who}: prompt {len(ids)} tokens, {job.resumed} from the conversation cache, "
                           f"{len(ids) - job.resumed} fed; reply {len(r.tokens)} tokens in "
                           f"{time.perf_counter() - t0:.2f} s{drafting}", err=True)
    finally:
        scheduler.close()


def _reply(scheduler, job):
    """Run one reply; Ctrl-C cancels it (the worker stops at its next token) and the chat goes on;
    SIGTERM cancels it and ends the chat."""
    finished = threading.Event()
    previous = job.on_done
    job.on_done = lambda j: (previous(j), finished.set())
    scheduler.submit(job)
    while True:
        try:
            finished.wait()
            return job
        except KeyboardInterrupt as e:
            job.cancel()
            if isinstance(e, Terminated):
                finished.wait()
                raise
            typer.echo("\nstrata chat: reply stopped", err=True)


@app.callback()
def _strata(version: bool = version_option()) -> None:
    """Strata engine: run a packed MoE model (dense weights and hot experts on the GPU, the rest on the CPU)."""


@app.command()
def version() -> None:
    """Print the Strata version."""
    from strata import __version__

    typer.echo(__version__)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the program is: every path that cleans up after Ctrl-C (temp
    files, a half-built pack) cleans up after these too. They once killed the process on the spot
    and left `*.tmp-PID` files behind."""


_TERMINATING = (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,)


@contextlib.contextmanager
def _termination_as_interrupt():
    received = []

    def handler(signum, frame):
        received.append(signum)
        raise Terminated(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield received  # only the main thread may set handlers (a test runner's worker): left as they are
        return
    before = {s: signal.signal(s, handler) for s in _TERMINATING}
    try:
        yield received
    finally:
        for s, h in before.items():
            signal.signal(s, h)


def run_app(typer_app: typer.Typer, argv: list[str] | None, prog_name: str) -> int:
    """Run a typer app and return its exit status (click exits; every CLI here returns a code).
    SIGTERM/SIGHUP unwind like Ctrl-C (cleanup runs) and exit with 128 + the signal's number."""
    with _termination_as_interrupt() as received:
        try:
            typer_app(args=argv, prog_name=prog_name)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except KeyboardInterrupt:  # a command without its own handler
            code = 130
        else:
            code = 0
    return 128 + received[0] if received else code


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, "strata")


if __name__ == "__main__":
    sys.exit(main())
