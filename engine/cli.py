"""`strata`: the engine's command line.

Thin on purpose (STYLE: library code never reads argv or prints): each subcommand parses its flags,
calls into the engine, and formats the result. Generated text goes to stdout as it is produced;
--stats, warnings and errors go to stderr, so stdout is only the model's text.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Strata engine: run a packed MoE model (dense weights and hot experts on the GPU, the rest on the CPU).",
)

# What the user can fix (bad flags, a bad or moved pack); anything else is a bug and keeps its traceback.
_INPUT_ERRORS = (ValueError, OSError, NotImplementedError)
DEVICES = ("cpu", "gpu", "auto")


def _fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"strata generate: error: {message}", err=True)
    return typer.Exit(code)


@app.command()
def generate(
    pack: Path = typer.Option(..., "--pack", help="the pack directory (strata-pack convert)"),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="prompt text"),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", "-f", help="read the prompt text from a file"),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help='token ids, e.g. "1 2 3" (no tokenizer)'),
    n: int = typer.Option(128, "-n", "--n-predict", help="tokens to generate at most (stops earlier at EOS)"),
    temp: float = typer.Option(0.8, "--temp", help="temperature; 0 is greedy"),
    top_k: int = typer.Option(40, "--top-k", help="keep the k most likely tokens; 0 is off"),
    top_p: float = typer.Option(0.95, "--top-p", help="nucleus sampling mass; 1 is off"),
    min_p: float = typer.Option(0.05, "--min-p", help="drop tokens below min_p * p_max; 0 is off"),
    repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", help="penalise the last 64 tokens; 1 is off"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampling seed (printed by --stats when not given)"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the model's chat template (one user turn)"),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="KV cache size in tokens (default: prompt + n)"),
    pool_workers: Optional[int] = typer.Option(None, "--pool-workers", help="hard cap on CPU threads"),
    device: str = typer.Option("auto", "--device", help="cpu, gpu or auto (auto: the GPU tier when there is one)"),
    native: Optional[Path] = typer.Option(None, "--native", help="the main GGUF, when it moved since packing"),
    ple_gguf: Optional[Path] = typer.Option(None, "--ple-gguf", help="the PLE GGUF shard, when it moved since packing"),
    dump_logits: Optional[Path] = typer.Option(None, "--dump-logits", help="write float32 logits of every position to OUT.npy"),
    stats: bool = typer.Option(False, "--stats", help="print load time, tokens/s and expert routing counts to stderr"),
) -> None:
    """Generate text from a pack, streaming it to stdout."""
    if sum(s is not None for s in (prompt, prompt_file, prompt_ids)) != 1:
        raise _fail("give exactly one of --prompt, --prompt-file, --prompt-ids", 2)
    if device not in DEVICES:
        raise _fail(f"--device {device!r}: expected one of {', '.join(DEVICES)}", 2)
    if device == "gpu":
        raise _fail("--device gpu: the GPU expert tier is not built yet; run with --device cpu (or auto, which "
                    "uses the CPU until it exists)", 2)
    if n < 0:
        raise _fail(f"-n {n}: expected >= 0", 2)
    try:
        _run(**locals())
    except KeyboardInterrupt:
        typer.echo("\nstrata generate: interrupted", err=True)
        raise typer.Exit(130) from None
    except _INPUT_ERRORS as e:
        raise _fail(str(e)) from None


def _run(pack, prompt, prompt_file, prompt_ids, n, temp, top_k, top_p, min_p, repeat_penalty, seed, chat,
         max_context, pool_workers, device, native, ple_gguf, dump_logits, stats) -> None:
    from strata.engine.generate import generate as run_generation
    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack import Pack
    from strata.engine.sampling import Sampler, SamplerParams
    from strata.engine.tokenizer import Tokenizer

    params = SamplerParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                           repeat_penalty=repeat_penalty, seed=seed)  # bad values refused before loading
    if pool_workers is not None:
        cpu.set_threads(pool_workers)
    t0 = time.perf_counter()
    p = Pack.open(pack, native=native, ple_gguf=ple_gguf)
    for w in p.warnings:
        typer.echo(f"strata generate: warning: {w}", err=True)
    model = Model(p)
    model.warm_up()
    tok = Tokenizer.load(p.tokenizer_path)
    load_s = time.perf_counter() - t0
    ids = _prompt_ids(tok, prompt, prompt_file, prompt_ids, chat, p.geometry.n_vocab)
    ctx = max_context if max_context is not None else len(ids) + n
    if ctx < len(ids):
        raise ValueError(f"--max-context {ctx} is shorter than the prompt ({len(ids)} tokens)")
    session = model.new_session(ctx)
    sampler = Sampler(p.geometry.n_vocab, params)
    stream = tok.stream()
    logits = _LogitsRecorder(len(ids) + n, p.geometry.n_vocab) if dump_logits else None

    def emit(token: int) -> None:
        sys.stdout.write(stream.push(token))
        sys.stdout.flush()

    result = run_generation(model, session, ids, sampler, n, stop_ids=tok.stop_ids, on_token=emit,
                            on_logits=logits.record if logits else None)
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    if logits:
        logits.save(dump_logits, result.positions)
    if stats:
        typer.echo(format_stats(p, load_s, result, session.routing, sampler.seed, cpu.get_threads(), device), err=True)


def _prompt_ids(tok, prompt, prompt_file, prompt_ids, chat, n_vocab) -> list[int]:
    if prompt_ids is not None:
        if chat:
            raise ValueError("--chat needs prompt text (--prompt or --prompt-file), not --prompt-ids")
        return parse_ids(prompt_ids, n_vocab)
    text = prompt if prompt is not None else Path(prompt_file).read_text(encoding="utf-8")
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text)
    if not ids:
        raise ValueError("the prompt is empty (no tokens)")
    return ids


def parse_ids(text: str, n_vocab: int) -> list[int]:
    """'1 2 3' -> [1, 2, 3]; each an id of the vocabulary."""
    ids = []
    for i, word in enumerate(text.split()):
        if not word.isdigit() or int(word) >= n_vocab:
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


def format_stats(pack, load_s: float, result, routing, seed: int, threads: int, device: str) -> str:
    from tabulate import tabulate

    g = pack.geometry
    lines = [
        f"load     {load_s:.3f} s  (kernels compiled; {g.arch}, {g.n_layer} layers; pool {pack.pool_bytes} B in pack form, "
        f"{pack.engine_bytes} B in engine form; f32 scale planes on the GPU tier would add {pack.widened_bytes} B)",
        f"prefill  {len(result.prompt)} tokens in {result.prefill_s:.3f} s -> {result.prefill_tps:.2f} tok/s",
        f"decode   {len(result.tokens)} tokens in {result.decode_s:.3f} s -> {result.decode_tps:.2f} tok/s "
        f"(stop: {result.stop})",
        f"device   cpu ({device}), {threads} threads; sampling seed {seed}",
        "expert routing counts per layer (token-expert pairs over all fed positions):",
    ]
    rows = []
    for layer, counts in enumerate(routing):
        top = counts.argsort(kind="stable")[::-1][:8]
        rows.append((layer, int(counts.sum()), int((counts > 0).sum()),
                     " ".join(f"{int(e)}:{int(counts[e])}" for e in top if counts[e])))
    lines.append(tabulate(rows, headers=["layer", "pairs", "experts used", "most routed (expert:count)"],
                          tablefmt="simple", disable_numparse=True))
    return "\n".join(lines)


@app.command()
def version() -> None:
    """Print the Strata version."""
    from strata import __version__

    typer.echo(__version__)


def run_app(typer_app: typer.Typer, argv: list[str] | None, prog_name: str) -> int:
    """Run a typer app and return its exit status (click exits; every CLI here returns a code)."""
    try:
        typer_app(args=argv, prog_name=prog_name)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_app(app, argv, "strata")


if __name__ == "__main__":
    sys.exit(main())
