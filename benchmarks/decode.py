"""Decode benchmark: tokens/s of `Model.step` on the `seed-4l` synthetic model (production per-layer
geometry, 4 layers, every expert on the CPU), against the memory-bandwidth floor of the same run.

    python benchmarks/decode.py [--arch qwen4exp] [--threads 2] [--prompt 8] [--tokens 32] [--no-pretouch]
                                [--preset seed-4l] [--rounds 3]   (--preset tiny: a quick smoke run)
    python benchmarks/decode.py --threads 8 --sweep 1,2,4,8   # each stage at each thread count (`sweep`)

The model is made once under .cache/bench/ (tools/synth.py, then strata-pack) and reused.

Floor: decode is a stream of weight reads. Bytes a token must read = every dense weight the token
path multiplies (engine form: BF16 as 16 bits, block types as stored) + the routed experts (top-k per
layer, each expert's gate + up + down) + the LM head + one embedding row and the PLE rows; the KV
cache is left out (a few KB at these contexts). Floor speed = read bandwidth / those bytes, the
bandwidth measured in this process (an int64 sum over 1 GiB split over 1..--threads numba
threads, best of 3 each; the best thread count counts, since on a busy host one thread can beat
two). Target: >= 40% of floor.

llama.cpp (benchmarks/llama_peer.py: STRATA_LLAMA_PYTHON, or this python if it imports llama_cpp)
decodes the same GGUF with the same threads, in --rounds rounds interleaved with Strata's plain
token steps (no timers) on the same token ids: the ratio is Strata's tok/s over llama.cpp's, both
measured here and now. Without llama.cpp the report says it was not measured (no typed-in figure).

On a host with more cores, pin the run (`taskset -c 0,1 python benchmarks/decode.py`) so that
"2 threads" means 2 cores; on a host whose cores other work keeps busy, numba's parallel regions
wait for descheduled threads and the numbers measure the contention, not the engine.

Time per token per layer and component comes from wrapping the model's own objects (the mixers'
and MoE blocks' `forward`, the MoE's `route` and `routed`, the residual's enter/leave/final, the PLE
layer, the backend's product for the head) with timers; nothing in engine/ is changed. Nested
timers are attributed to the innermost: MoE "shared" is the MoE forward less its routing (top-k) and
routed experts. With a shared expert a token's router product is made in the shared expert's parallel
region, so its time and bytes are in that row ("shared experts + router product"), not "routing".
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / ".cache" / "bench"
PRESET = "seed-4l"  # --preset tiny makes a quick smoke run of this script
TARGET = 0.40


# --------------------------------------------------------------------------------------- the model


def ensure_pack(arch: str, preset_name: str = PRESET) -> Path:
    """The `preset_name` model of `arch`, synthesized and packed under .cache/bench/ unless already there."""
    from strata.tools import pack, synth

    preset = synth.get_preset(preset_name)
    out = BENCH / f"{preset_name}-{arch}-pack"
    if (out / "manifest.txt").is_file():
        return out
    BENCH.mkdir(parents=True, exist_ok=True)
    n_files = len(synth.plan_model(arch, preset_name).shards)
    ggufs = synth.output_paths(BENCH / f"{preset_name}-{arch}.gguf", n_files)
    if not all(p.is_file() for p in ggufs):
        print(f"synthesizing {preset_name} {arch} into {BENCH} (once) ...", flush=True)
        ggufs = synth.synth(arch, preset_name, BENCH / f"{preset_name}-{arch}.gguf", force=True)
    ple = ggufs[-1] if arch == "qwen4exp" else None
    pack.convert(ggufs[:1], out, ple_gguf=ple, compress_ratio=preset.compress_ratio)
    return out


def pretouch(model) -> float:
    """Read every expert byte, the PLE table and the token embeddings once, so the run measures
    memory, not the disk. (A token step reads one embedding row, of a 437 MB table for seed-4l: an
    untouched row is a page fault, and after page-cache pressure a disk read, where llama.cpp maps
    its file populated. A cProfile of 32 seed-4l steps once put 3.2 ms a token in the row's decode.)"""
    t0 = time.perf_counter()
    pack, g = model.pack, model.geometry
    for l in range(g.n_layer):
        for e in range(g.n_expert):
            for part in pack.expert(l, e):
                np.bitwise_xor.reduce(part)
    if pack.ple is not None:
        np.bitwise_xor.reduce(pack.ple_table())
    np.bitwise_xor.reduce(model.embd.raw)
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------- bandwidth


def read_bandwidth(threads: int, n_bytes: int = 1 << 30, repeat: int = 3) -> dict[int, float]:
    """Bytes/s of an int64 sum over n_bytes, split over 1..threads numba threads -> {threads: B/s}.

    The chunk sum is its own serial function: written inline in the prange body, numba does not
    vectorize it and the "bandwidth" is the adder's (3.7 GB/s here, against 28 GB/s vectorized)."""
    import numba
    from numba import njit, prange

    @njit(nogil=True)
    def _chunk(a):
        acc = 0
        for j in range(a.size):
            acc += a[j]
        return acc

    @njit(parallel=True, nogil=True)
    def _sum(a, n_chunks):
        per = a.size // n_chunks
        out = np.zeros(n_chunks, np.int64)
        for c in prange(n_chunks):
            out[c] = _chunk(a[c * per : (c + 1) * per])
        return out.sum()

    buf = np.ones(n_bytes // 8, np.int64)  # written once: every page resident, none the shared zero page
    before = numba.get_num_threads()
    out = {}
    try:
        for t in range(1, threads + 1):
            numba.set_num_threads(t)
            _sum(buf, 64)
            best = np.inf
            for _ in range(repeat):
                t0 = time.perf_counter()
                _sum(buf, 64)
                best = min(best, time.perf_counter() - t0)
            out[t] = n_bytes / best
    finally:
        numba.set_num_threads(before)
    return out


# --------------------------------------------------------------------------------------- timers


class Timers:
    def __init__(self):
        self.sec = defaultdict(float)
        self.patched = []  # (object, attribute, the value before), to take the timers off again

    def patch(self, obj, name: str, value) -> None:
        self.patched.append((obj, name, obj.__dict__.get(name, _UNSET)))
        setattr(obj, name, value)

    def wrap(self, key, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sec[key] += time.perf_counter() - t0
        return timed

    def reset(self):
        self.sec.clear()


_UNSET = object()


def uninstrument(t: Timers) -> None:
    """The model as it was before `instrument` (the side-by-side rounds run without timers)."""
    for obj, name, before in reversed(t.patched):
        if before is _UNSET:
            delattr(obj, name)
        else:
            setattr(obj, name, before)
    t.patched.clear()


def instrument(model) -> Timers:
    """Timers around every block of the token path; keys are (component, layer)."""
    be = model.backend
    if getattr(be, "token_step", None) is not None and getattr(be, "graphs", False):
        # a captured step's blocks run once, inside the capture, and every later token replays the
        # graph: host timers would time the capture, then print plausible zeros
        raise SystemExit("stage timers time the host's calls of each block; the device step replays its token step as "
                         "a CUDA graph, so they would read zeros: set model.backend.graphs = False to time the eager "
                         "step, or use the GPU floor's per-part times (benchmarks/gpu_tier.py)")
    t = Timers()
    r = model.residual

    for l, m in enumerate(model.mixers):
        t.patch(m, "forward", t.wrap(("mixer", l), m.forward))
    for l, moe in enumerate(model.moes):
        t.patch(moe, "forward", t.wrap(("moe", l), moe.forward))
        t.patch(moe, "route", t.wrap(("router", l), moe.route))
        t.patch(moe, "routed", t.wrap(("experts", l), moe.routed))
        t.patch(moe, "_token_products", t.wrap(("experts", l), moe._token_products))  # (a token's, on the CPU)
    for l, p in model.ple.items():
        t.patch(p, "forward", t.wrap(("ple", l), p.forward))
    enter, leave = r.enter, r.leave

    def timed_enter(be, h, l, ffn):
        t0 = time.perf_counter()
        x = enter(be, h, l, ffn)
        t.sec[("residual", l)] += time.perf_counter() - t0
        return x

    def timed_leave(be, h, l, ffn, y, ctx):
        t0 = time.perf_counter()
        leave(be, h, l, ffn, y, ctx)
        t.sec[("residual", l)] += time.perf_counter() - t0

    t.patch(r, "enter", timed_enter)
    t.patch(r, "leave", timed_leave)
    t.patch(r, "final", t.wrap(("residual", None), r.final))
    linear, head = model.backend.linear, model.head

    def timed_linear(w, x, out=None):  # the LM head's product, through the backend
        if w is not head:
            return linear(w, x, out)
        t0 = time.perf_counter()
        y = linear(w, x, out)
        t.sec[("head", None)] += time.perf_counter() - t0
        return y

    t.patch(model.backend, "linear", timed_linear)
    return t


# --------------------------------------------------------------------------------------- bytes


def bytes_per_token(model) -> dict[tuple[str, int | None], int]:
    """Bytes the token path reads, keyed like the timers: (component, layer)."""
    g, pack = model.geometry, model.pack
    out = defaultdict(int)
    for name, w in pack.weights.items():
        if name == "token_embd.weight":
            out[("other", None)] += w.type.row_bytes(w.n_in)  # one row per token
            continue
        if name == "output.weight":
            out[("head", None)] += w.raw.nbytes
            continue
        if not name.startswith("blk."):
            out[("residual", None)] += w.raw.nbytes  # the final hc mixer
            continue
        l = int(name.split(".")[1])
        if ".hc_" in name:
            key = "residual"
        elif ".ple_" in name:
            key = "ple"
        elif name.endswith("ffn_gate_inp.weight"):
            # with a shared expert, a token's router product runs in the shared expert's parallel region
            # (MoE._router_and_shared), outside `route`'s timer: its bytes go where its time is
            key = "shared" if model.moes[l].shared else "router"
        elif "shexp" in name:
            key = "shared"
        else:
            key = "mixer"
        out[(key, l)] += w.raw.nbytes
    for l in range(g.n_layer):
        gate, up, down = pack.expert(l, 0)
        out[("experts", l)] += g.n_expert_used * (gate.nbytes + up.nbytes + down.nbytes)
    if pack.ple is not None:
        for l in model.ple:
            out[("ple", l)] += g.ple_n_heads * pack.ple.row_bytes
    return out


# --------------------------------------------------------------------------------------- the run


def decode(model, prompt_len: int, n_tokens: int, timers: Timers) -> list[float]:
    """Teacher-force a prompt, then greedy-decode n_tokens; seconds of each decode step."""
    rng = np.random.default_rng(0)
    s = model.new_session(prompt_len + n_tokens)
    logits = None
    for tok in rng.integers(0, model.geometry.n_vocab, size=prompt_len).tolist():
        logits = model.step(s, tok)
    timers.reset()
    steps = []
    for _ in range(n_tokens):
        tok = int(np.argmax(logits))
        t0 = time.perf_counter()
        logits = model.step(s, tok)
        steps.append(time.perf_counter() - t0)
    return steps


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} logical CPUs, load average {load}"


def _kind(g):
    return lambda l: "QSA" if g.is_full_attention(l) else "GDN"


def per_token_seconds(model, timers: Timers, steps: list[float]) -> dict:
    """Seconds per token by (component, layer), innermost attribution, the rest as ("other", None)."""
    g, n = model.geometry, len(steps)
    sec = {k: v / n for k, v in timers.sec.items()}  # per token
    for l in range(g.n_layer):  # innermost attribution: MoE "shared" = forward - router - experts
        sec[("shared", l)] = sec.pop(("moe", l), 0.0) - sec.get(("router", l), 0.0) - sec.get(("experts", l), 0.0)
    sec[("other", None)] = sum(steps) / n - sum(sec.values())  # embedding row, loop overhead
    return sec


def stage_groups(g) -> dict[str, list]:
    """The report's rows: a name and the (component, layer) keys it sums."""
    kind = _kind(g)
    return {
        "GDN mixers": [("mixer", l) for l in range(g.n_layer) if kind(l) == "GDN"],
        "QSA / attention mixers": [("mixer", l) for l in range(g.n_layer) if kind(l) == "QSA"],
        "routed experts (MoE)": [("experts", l) for l in range(g.n_layer)],
        "shared experts + router product": [("shared", l) for l in range(g.n_layer)],
        "routing (top-k; the router product without a shared expert)": [("router", l) for l in range(g.n_layer)],
        "hyper-connections (mix, inject, final)": [("residual", l) for l in [*range(g.n_layer), None]],
        "PLE": [("ple", l) for l in range(g.n_layer)],
        "LM head": [("head", None)],
        "embedding row + loop overhead": [("other", None)],
    }


def sweep(model, threads: list[int], prompt_len: int, n_tokens: int, rounds: int = 2, run=None, what: str = "") -> str:
    """Each stage's ms/token at each thread count, in one process (the same model, the same tokens),
    the counts alternating for `rounds` rounds (the best round counts), and a fit of each stage to
    Amdahl's law, t(n) = serial + parallel / n, by least squares over the counts: "serial" is what
    more threads do not take away (the Python between the regions, each region's wake-up and
    barrier, a bound of memory), "parallel" what they divide. Where the 8-thread row misses the fit,
    the stage scales worse than its parallel share says (a region too small to split).

    run(timers) -> [seconds of each timed step]: another workload (benchmarks/prefill.py's prompt
    chunks), `what` naming its unit; by default n_tokens token steps after a prompt_len prompt."""
    from tabulate import tabulate

    from strata.engine.kernels import cpu

    g = model.geometry
    groups = stage_groups(g)
    best: dict[int, dict[str, float]] = {}
    timers = instrument(model)
    try:
        for _ in range(rounds):
            for n in threads:
                cpu.set_threads(n)
                steps = run(timers) if run else decode(model, prompt_len, n_tokens, timers)
                sec = per_token_seconds(model, timers, steps)
                got = {name: sum(sec.get(k, 0.0) for k in keys) for name, keys in groups.items()}
                got["total"] = sum(steps) / len(steps)
                if n not in best or got["total"] < best[n]["total"]:
                    best[n] = got
    finally:
        uninstrument(timers)
    inv = np.array([1.0 / n for n in threads])
    A = np.stack([np.ones_like(inv), inv], axis=1)
    rows = []
    for name in [*groups, "total"]:
        ms = np.array([1e3 * best[n][name] for n in threads])
        if not ms.any():
            continue
        if len(threads) < 2:  # one count: its times alone, nothing to fit
            rows.append([name, f"{ms[0]:.2f}"])
            continue
        (serial, par), *_ = np.linalg.lstsq(A, ms, rcond=None)
        fit_last = serial + par / threads[-1]
        rows.append([name, *[f"{x:.2f}" for x in ms], f"{ms[0] / ms[-1]:.2f}x", f"{serial:.2f}", f"{par:.2f}",
                     f"{ms[-1] / fit_last:.2f}"])
    what = what or f"{n_tokens} token steps after a {prompt_len}-token prompt per run; ms/token"
    head = (f"thread sweep: {what}, counts "
            f"{', '.join(map(str, threads))} alternating over {rounds} rounds, best round. "
            f"Fit: t(n) = serial + parallel / n (ms), least squares; last / fit: the last count's time over the fit's")
    hdr = ["stage", *[f"{n} thr" for n in threads]]
    if len(threads) > 1:
        hdr += [f"{threads[0]} / {threads[-1]}", "serial", "parallel", "last / fit"]
    return head + "\n" + tabulate(rows, headers=hdr, tablefmt="github", disable_numparse=True)


def report(model, timers: Timers, steps: list[float], bw: float, threads: int, preset: str) -> str:
    from tabulate import tabulate

    g = model.geometry
    n = len(steps)
    total = sum(steps)
    sec = per_token_seconds(model, timers, steps)
    nbytes = bytes_per_token(model)
    per_token = sum(nbytes.values())
    floor = bw / per_token
    kind = _kind(g)

    comps = ("residual", "ple", "mixer", "router", "experts", "shared")
    rows = []
    for l in range(g.n_layer):
        ms = [1e3 * sec.get((c, l), 0.0) for c in comps]
        mb = sum(nbytes.get((c, l), 0) for c in comps)
        t = sum(ms) / 1e3
        rows.append([l, kind(l), *[f"{x:.2f}" for x in ms], f"{sum(ms):.2f}", f"{mb / 1e6:.1f}", f"{mb / t / 1e9:.2f}"])
    layer_table = tabulate(rows, headers=["layer", "kind", "hc mix/inject", "PLE", "mixer", "routing", "routed experts",
                                          "shared expert + router", "layer ms", "MB read", "GB/s"], tablefmt="github")

    groups = stage_groups(g)
    rows = []
    for name, keys in groups.items():
        t = sum(sec.get(k, 0.0) for k in keys)
        b = sum(nbytes.get(k, 0) for k in keys)
        if not t and not b:
            continue
        rate = b / t if t > 0 else 0.0
        rows.append([name, f"{1e3 * t:.2f}", f"{100 * t * n / total:.0f}%", f"{b / 1e6:.1f}", f"{rate / 1e9:.2f}",
                     f"{100 * rate / bw:.0f}%" if b else "-"])
    rows.append(["total", f"{1e3 * total / n:.2f}", "100%", f"{per_token / 1e6:.1f}",
                 f"{per_token * n / total / 1e9:.2f}", f"{100 * per_token * n / total / bw:.0f}%"])
    group_table = tabulate(rows, headers=["where", "ms/token", "share", "MB/token", "GB/s", "of read bw"], tablefmt="github")

    tok_s = n / total
    lines = [
        f"machine: {machine()}",
        f"model: {preset} {g.arch} ({g.n_layer} layers, {g.n_expert} experts top-{g.n_expert_used}, n_embd {g.n_embd}, "
        f"vocab {g.n_vocab}), all experts on the CPU, {threads} threads",
        f"read bandwidth (int64 sum over 1 GiB, best of 1..{threads} threads): {bw / 1e9:.2f} GB/s",
        f"bytes per token: {per_token / 1e6:.1f} MB (LM head {nbytes[('head', None)] / 1e6:.1f} MB, routed experts "
        f"{sum(nbytes[('experts', l)] for l in range(g.n_layer)) / 1e6:.1f} MB)",
        f"floor: {1e3 / floor:.2f} ms/token = {floor:.2f} tok/s",
        f"decode: {n} tokens, {1e3 * total / n:.2f} ms/token (median {1e3 * float(np.median(steps)):.2f}) = "
        f"{tok_s:.2f} tok/s = {100 * tok_s / floor:.0f}% of floor (target >= {TARGET:.0%}: "
        f"{'met' if tok_s / floor >= TARGET else 'NOT met'})",
        "",
        group_table,
        "",
        layer_table,
    ]
    return "\n".join(lines)


def source_gguf(arch: str, preset_name: str = PRESET) -> Path:
    """The first file of the GGUF the benchmark's pack was made from (llama.cpp finds the other shards)."""
    from strata.tools import synth

    n_files = len(synth.plan_model(arch, preset_name).shards)
    return synth.output_paths(BENCH / f"{preset_name}-{arch}.gguf", n_files)[0]


def plain_decode(model, prompt_len: int, n_tokens: int, seed: int) -> tuple[list[float], float]:
    """Seconds of each of n_tokens token steps after a prompt_len prompt, the token ids drawn as the
    llama.cpp worker draws them (the same ids: teacher-forced, no sampling, no timers), and this
    process's CPU seconds (all its threads) over those steps."""
    ids = np.random.default_rng(seed).integers(0, model.geometry.n_vocab, prompt_len + n_tokens).tolist()
    s = model.new_session(prompt_len + n_tokens)
    for tok in ids[:prompt_len]:
        model.step(s, tok)
    steps = []
    c0 = time.process_time()
    for tok in ids[prompt_len:]:
        t0 = time.perf_counter()
        model.step(s, tok)
        steps.append(time.perf_counter() - t0)
    return steps, time.process_time() - c0


def side_by_side(model, gguf: Path, threads: int, prompt_len: int, n_tokens: int, rounds: int) -> str:
    """Strata and llama.cpp decoding the same tokens of the same GGUF, rounds interleaved."""
    from tabulate import tabulate

    import llama_peer

    python, how = llama_peer.find_python()
    if python is None:
        return f"llama.cpp: not measured ({how})"
    peer = llama_peer.Peer(python, gguf, threads, prompt_len + n_tokens + 8)
    try:
        if peer.n_vocab != model.geometry.n_vocab:
            return f"llama.cpp: not measured (its vocabulary is {peer.n_vocab}, the pack's {model.geometry.n_vocab})"
        peer.decode(prompt_len, 4, 999)  # llama.cpp's first evals allocate its buffers
        rows, ours, theirs, cpu_ours, cpu_theirs = [], [], [], [], []
        for r in range(rounds):
            steps, cpu_a = plain_decode(model, prompt_len, n_tokens, seed=r)
            peer_steps, cpu_b = peer.decode_cpu(prompt_len, n_tokens, seed=r)
            a, b = n_tokens / sum(steps), n_tokens / sum(peer_steps)
            ours.append(a)
            theirs.append(b)
            cpu_ours.append(1e3 * cpu_a / n_tokens)
            cpu_theirs.append(1e3 * cpu_b / n_tokens)
            rows.append([r + 1, f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}x", f"{cpu_ours[-1]:.1f}", f"{cpu_theirs[-1]:.1f}",
                         f"{cpu_theirs[-1] / cpu_ours[-1]:.2f}x"])
    finally:
        peer.close()
    co, ct = np.median(cpu_ours), np.median(cpu_theirs)
    rows.append(["median", f"{np.median(ours):.2f}", f"{np.median(theirs):.2f}", f"{np.median(ours) / np.median(theirs):.2f}x",
                 f"{co:.1f}", f"{ct:.1f}", f"{ct / co:.2f}x"])
    head = (f"llama.cpp side by side ({how}): {gguf.name}, {threads} threads, {n_tokens} token steps after a "
            f"{prompt_len}-token prompt per round, rounds interleaved. CPU ms/token: each process's CPU time over "
            "the timed steps, all its threads (on a shared host the time it ran, not the time it waited for a "
            "core; with more than one thread it counts the workers' spin-waits too)")
    return head + "\n" + tabulate(rows, headers=["round", "Strata tok/s", "llama.cpp tok/s", "Strata / llama.cpp",
                                                 "Strata CPU ms/token", "llama.cpp CPU ms/token", "CPU-time ratio"],
                                  tablefmt="github")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen4exp", choices=("qwen4exp", "qwen35moe"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--preset", default=PRESET, help="synthetic model preset (tools/synth.py)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens fed before timing")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--no-pretouch", action="store_true", help="do not read the expert bytes once before timing")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of Strata and llama.cpp side by side (0: none)")
    ap.add_argument("--sweep", default="", help="thread counts, e.g. 1,2,4,8: each stage's time at each count in this "
                    "process and its serial and parallel parts, instead of the report")
    args = ap.parse_args(argv)

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    cpu.set_threads(args.threads)
    pack_dir = ensure_pack(args.arch, args.preset)
    t0 = time.perf_counter()
    model = Model(Pack.open(pack_dir))
    model.warm_up()
    print(f"loaded {pack_dir} and compiled the kernels in {time.perf_counter() - t0:.1f} s", flush=True)
    if not args.no_pretouch:
        print(f"read every expert byte, the PLE table and the embeddings once in {pretouch(model):.1f} s (page cache warm)", flush=True)
    if args.sweep:
        counts = [int(x) for x in args.sweep.split(",")]
        print(machine())
        print(sweep(model, counts, args.prompt, args.tokens))
        return 0
    rates = read_bandwidth(args.threads)
    print("read bandwidth by threads: " + ", ".join(f"{t}: {r / 1e9:.2f} GB/s" for t, r in rates.items()), flush=True)
    bw = max(rates.values())  # the floor is what the allowed threads CAN read; on a busy host one may beat two
    timers = instrument(model)
    steps = decode(model, args.prompt, args.tokens, timers)
    print(report(model, timers, steps, bw, args.threads, args.preset))
    if args.rounds:
        uninstrument(timers)
        print()
        print(side_by_side(model, source_gguf(args.arch, args.preset), args.threads, args.prompt, args.tokens, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
