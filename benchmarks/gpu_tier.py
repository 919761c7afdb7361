"""GPU tier benchmark: decode tokens/s and hit rate of the GPU tier at several expert-cache sizes,
against the all-CPU engine in the same run, on the `seed-4l` synthetic model (issue 6, item 9).

    python benchmarks/gpu_tier.py [--arch qwen4exp] [--threads 8] [--prompt 64] [--tokens 32]
                                  [--md OUT.md] [--preset seed-4l] [--emulate]   (tiny + emulation: a smoke run)
                                  [--stream-min-tokens auto,off,8]  (prompt tok/s with streaming at each setting)

Calibration: --calib tokens of the repository's docs (*.md) through the pack's tokenizer; the first 3/4
build the routing profile (the batched path, as strata-profile does), the last 1/4 is held out and
gives the prompt. Configurations, each a fresh GPU tier on the same model:

    cpu        the all-CPU engine (no tier)
    cache 0    the tier with no expert slots: dense matrices on the GPU, every expert a CPU miss
    ~10/30/60% --expert-cache auto under a --vram-budget-mib that holds about that share of the pairs
    all        one slot per (layer, expert) pair

Per configuration: the prompt through the batched path, then --tokens decode steps timed, fed the
CPU run's greedy tokens; the hit rate measured on those steps beside the profile's expected hit
rate (in-sample and on the held-out text), the MoE time split, and whether every logit equals the
CPU run's bit for bit (the host-driven step), or how far it is (the device step, --gpu-step device).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
SHARES = (0.10, 0.30, 0.60)


def calibration_ids(tokenizer, n_vocab: int) -> list[int]:
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md")))
    text += "\n\n" + (REPO / "README.md").read_text(encoding="utf-8")
    return [t for t in tokenizer.encode(text) if t < n_vocab]


def routing_counts(model, ids: list[int], chunk: int = 256) -> np.ndarray:
    s = model.new_session(len(ids), "f16")
    for a in range(0, len(ids), chunk):
        model.forward(s, ids[a : a + chunk], n_logits=0)
    return s.routing.copy()


def run_decode(model, prompt: list[int], n: int, tier=None, feed=None, split: list | None = None) -> tuple[float, float, np.ndarray]:
    """(prefill seconds, decode seconds, logits of every decoded position): greedy, the prompt batched first.
    `feed`: the tokens to feed instead of each step's own argmax (the CPU run's greedy tokens), so
    that a configuration whose logits differ by rounding (the device step) is compared position by
    position on the same text: fed its own argmax, one near-tie flipped early makes every later
    position another text (2026-12-01: max |diff| 28.9 from one flip, every op within 1e-3).
    `split`: filled with the prompt's expert-chunks resident / streamed / on the CPU and the MiB streamed."""
    s = model.new_session(len(prompt) + n + 1, "f16")
    logits = np.empty((n + 1, model.geometry.n_vocab), np.float32)
    t0 = time.perf_counter()
    logits[0] = model.forward(s, prompt, n_logits=1)[0]
    prefill_s = time.perf_counter() - t0
    if tier is not None:
        st = tier.stats
        if split is not None:
            split[:] = [int(st.chunk_resident.sum()), int(st.chunk_streamed.sum()), int(st.chunk_cpu.sum()),
                        st.streamed_bytes / 2**20]
        st.reset()  # the token path's hits only
    t0 = time.perf_counter()
    for i in range(n):
        logits[i + 1] = model.step(s, int(np.argmax(logits[i])) if feed is None else int(feed[i]))
    return prefill_s, time.perf_counter() - t0, logits


def long_prompt(model, text_ids: list[int], n: int, name: str, piece: int = 1024) -> None:
    """An n-token prompt fed in `piece`-token forwards (the text repeated past its end), each timed to
    the device's completion: the time per 1K tokens at the prompt's start against its end is what
    attention and QSA over the growing context cost."""
    ids = (text_ids * (n // len(text_ids) + 1))[:n]
    s = model.new_session(n + 1, "f16")
    sync = getattr(getattr(model.backend, "rt", None), "synchronize", lambda: None)
    times = []
    t_all = time.perf_counter()
    for a in range(0, n, piece):
        t0 = time.perf_counter()
        model.forward(s, ids[a : a + piece], n_logits=1 if a + piece >= n else 0)
        sync()
        times.append((a, min(piece, n - a), time.perf_counter() - t0))
        m, t = times[-1][1:]  # (each piece as it ends: a run cut short still shows how far it got)
        print(f"    tokens {a:>6}-{a + m:<6} {1e3 * t * 1024 / m:9.1f} ms per 1K tokens ({m / t:9.1f} tok/s)", flush=True)
    wall = time.perf_counter() - t_all
    print(f"  {name}: a {n}-token prompt in {piece}-token pieces: {wall:.2f} s, {n / wall:.1f} tok/s", flush=True)
    if len(times) > 1:
        first, last = times[0], times[-1]
        print(f"  {name}: per 1K tokens, last piece / first piece = "
              f"{(last[2] / last[1]) / (first[2] / first[1]):.2f}x", flush=True)


def prompt_kernels(model, prompt: list[int]) -> None:
    """Where one prompt's device time goes, by kernel: every launch of gpu.py's runtime bracketed by
    CUDA events (a wait after each, so the figures are each kernel's own device time, and the wall
    time of this run is not the prompt's speed), beside the wall time of the same prompt unprofiled."""
    from strata.engine.kernels import gpu

    rt = gpu.runtime()
    s = model.new_session(len(prompt) + 1, "f16")
    rt.synchronize()
    t0 = time.perf_counter()
    model.forward(s, prompt, n_logits=1)
    rt.synchronize()
    wall = time.perf_counter() - t0
    launch, by = rt.launch, {}
    start, stop = rt.events(2)

    def timed(mod, name, *a, **k):
        start.record()
        launch(mod, name, *a, **k)
        stop.record()
        n, t = by.get(name, (0, 0.0))
        by[name] = (n + 1, t + rt.elapsed(start, stop))

    rt.launch = timed
    try:
        s = model.new_session(len(prompt) + 1, "f16")
        model.forward(s, prompt, n_logits=1)
    finally:
        rt.launch = launch
    total = sum(t for _, t in by.values())
    print(f"prompt kernels ({len(prompt)} tokens): wall {1e3 * wall:.2f} ms unprofiled; kernels {1e3 * total:.2f} ms "
          f"in {sum(n for n, _ in by.values())} launches (each timed alone); the rest is host work and copies")
    for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"    {name:<28} x{n:<5} {1e3 * t:9.3f} ms  {1e6 * t / n:9.1f} us each", flush=True)


def run_pick(model, prompt: list[int], n: int, prof=None, picks: list | None = None, marks: list | None = None) -> float:
    """Seconds of n greedy decode steps picked where the logits are (Model.step_pick: on the device
    step only the token comes back, as `strata generate` decodes greedily), after the prompt;
    `picks` receives the tokens, `marks` the perf_counter after each (`steady`)."""
    s = model.new_session(len(prompt) + n + 1, "f16")
    tok = int(np.argmax(model.forward(s, prompt, n_logits=1)[0]))
    banned = np.zeros(0, np.int32)
    if prof is not None:  # --cprofile: the decode steps only
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(n):
        tok = model.step_pick(s, tok, banned)
        if picks is not None:
            picks.append(tok)
        if marks is not None:
            marks.append(time.perf_counter())
    t = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    return t


# A new session's first token step runs eagerly and its second is captured as a CUDA graph
# (DeviceBackend.token_step); the replays start at the third. The capture costs several steps' time,
# so a short run's tok/s understates the steady rate: both are printed.
WARM_STEPS = 2


def steady(marks: list) -> float | None:
    """Tokens per second after the first WARM_STEPS steps (from `marks`), or None for a short run."""
    if len(marks) < WARM_STEPS + 4:
        return None
    return (len(marks) - WARM_STEPS) / (marks[-1] - marks[WARM_STEPS - 1])


def run_ahead(model, prompt: list[int], n: int, picks: list, marks: list | None = None,
              busy: list | None = None, prof=None) -> float | None:
    """Seconds of `run_pick`'s n greedy steps run one step ahead of the host (Model.decode_ahead: step
    t + 1 queued, its embedding row gathered on the device, before token t is read; as `strata
    generate --gpu-step device` decodes greedily), or None where the session cannot run ahead;
    `picks` receives the tokens, `marks` the perf_counter as each arrives, `busy` the main thread's
    CPU time then, less its time waiting for the picks (a CUDA wait may spin): where it keeps pace
    with `marks`, the host, not the device, sets the rate; `prof` (cProfile) profiles the loop."""
    s = model.new_session(len(prompt) + n + 1, "f16")
    if not model.runs_ahead(s):
        return None
    tok = int(np.argmax(model.forward(s, prompt, n_logits=1)[0]))
    be = model.backend
    waited = [0.0]  # the main thread's CPU time inside the picks' waits (a CUDA wait may spin: not host work)
    wait = be.wait_picked

    def timed_wait(pending):
        t = time.thread_time()
        try:
            return wait(pending)
        finally:
            waited[0] += time.thread_time() - t

    be.wait_picked = timed_wait
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    try:
        for tok in model.decode_ahead(s, tok, np.zeros(0, np.int32), n):
            picks.append(tok)
            if marks is not None:
                marks.append(time.perf_counter())
            if busy is not None:
                busy.append(time.thread_time() - waited[0])
    finally:
        del be.wait_picked
    t = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    return t


LLAMA_PLACEMENTS = {"cpu": "-ngl 0", "cache 0": "-ngl 99 -ot exps=CPU", "auto ~60%": "-ngl 99 -ncmoe {half}",
                    "all": "-ngl 99"}


def llama_bench(binary: str, gguf: Path, placement: str, threads: int, prompt: int, tokens: int) -> tuple[float, float] | str:
    """llama-bench on the same GGUF: (prompt tok/s, decode tok/s), or why it was not measured."""
    import json
    import subprocess

    cmd = [binary, "-m", str(gguf), *placement.split(), "-fa", "1", "-t", str(threads), "-p", str(prompt), "-n", str(tokens),
           "-r", "3", "-o", "json"]
    import os

    # -ngl 0 on a CUDA build still sends a prompt's large products to the GPU: the CPU row hides it
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if placement.split()[:2] == ["-ngl", "0"] else None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
        rows = json.loads(p.stdout)
        pp = [r["avg_ts"] for r in rows if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0]
        tg = [r["avg_ts"] for r in rows if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0]
        return pp[0], tg[0]
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError, IndexError) as e:
        return f"not measured ({type(e).__name__}: {str(e)[:120]})"


def hbm_floor_s(model) -> float:
    """Seconds per token to read, once, what an all-resident token step reads on the card (the dense
    weights, k experts per layer, the LM head) at the H200's 4.8 TB/s."""
    from decode import bytes_per_token

    return sum(v for (k, _), v in bytes_per_token(model).items() if k != "other") / 4.8e12


def budget_for(model, slots: int, chunk: int, reserve_mib: int) -> int:
    """--vram-budget-mib that leaves room for `slots` slots beside the weights and the reserve."""
    from strata.engine import budget as B
    from strata.engine.budget import BudgetOptions, plan_budget
    from strata.engine.expert_plan import MiB, prefill_mib

    p = model.pack
    plan = plan_budget(p.index, p.experts, p.geometry, BudgetOptions(max_context=4096, prefill_chunk=chunk,
                                                                       vram_reserve_mib=reserve_mib))
    need = plan.device_bytes(B.WEIGHTS) + (reserve_mib + prefill_mib(chunk)) * MiB + slots * plan.slot_bytes
    return -(-need // MiB) + 4  # + cudaMalloc's granularity on the weights' arena


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen4exp", choices=("qwen4exp", "qwen35moe"))
    ap.add_argument("--preset", default="seed-4l")
    ap.add_argument("--threads", type=int, default=8, help="CPU threads (--pool-workers) for the misses and the CPU run")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens from the held-out text")
    ap.add_argument("--tokens", type=int, default=32, help="greedy decode steps timed")
    ap.add_argument("--calib", type=int, default=2048, help="calibration tokens (3/4 profiled, 1/4 held out)")
    ap.add_argument("--chunk", type=int, default=256, help="prompt chunk (tokens a batched forward takes at once)")
    ap.add_argument("--long-prompt", type=int, default=0, metavar="N",
                    help="also feed each configuration an N-token prompt in --long-piece pieces (the text repeated "
                         "as needed) and print the time per 1K tokens as the prompt grows")
    ap.add_argument("--long-piece", type=int, default=1024, metavar="N",
                    help="the tokens of each forward of --long-prompt (default 1024; `strata generate --prefill auto` "
                         "on the device step feeds up to 4096, so --chunk 4096 --long-piece 4096 times what it does)")
    ap.add_argument("--reserve-mib", type=int, default=700)
    ap.add_argument("--md", type=Path, help="also write the table here (markdown)")
    ap.add_argument("--cprofile", metavar="CONFIG", help="print where the decode time of CONFIG (e.g. all) goes")
    ap.add_argument("--prompt-kernels", metavar="CONFIG", help="time every launch of CONFIG's prompt on the device, by kernel")
    ap.add_argument("--cprofile-prompt", metavar="CONFIG", help="print where the prompt time of CONFIG goes")
    ap.add_argument("--only", help="comma-separated configurations to run (default: all of them)")
    ap.add_argument("--emulate", action="store_true", help="the host emulation of the kernels (tests/gpu_emu.py)")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama-bench (built with CUDA) to run on the same GGUF, each "
                    "configuration beside its llama.cpp placement (cpu -ngl 0, cache 0 -ot exps=CPU, auto ~60%% "
                    "-ncmoe n_layer/2, all -ngl 99), same threads, in this run")
    ap.add_argument("--floor-pos", type=int, default=3, help="the position where the GPU floor's parts (and "
                    "--floor-kernels) are timed: a new session's first P - 3 tokens fed as a prompt, then 3 token steps "
                    "(eager, capture, replay); default 3")
    ap.add_argument("--floor-kernels", action="store_true", help="also time every launch of the all-resident device "
                    "step alone (a profile of the GPU floor by kernel)")
    ap.add_argument("--stream-layer-tokens", default="auto", help="comma-separated: auto, off or N (the device step "
                    "streams a layer's non-resident experts whole for a prompt chunk of N+ tokens); each configuration runs with each")
    ap.add_argument("--stream-register", default="on", help="comma-separated: on, off (the layer stream DMAs from the "
                    "GGUF's pages registered with the driver, or copies them through pinned pieces); each configuration runs with each")
    ap.add_argument("--after", metavar="PATH", help="wait until PATH exists before the timed runs (a llama.cpp build "
                    "in the background of the same call, ../shared/peer/build_llama_cuda.sh: BUILD/done, would share the "
                    "CPU cores; the load and the profile run beside it)")
    ap.add_argument("--stream-min-tokens", default="auto", help="comma-separated: auto, off or N (a prompt chunk's "
                    "non-resident expert routed N+ tokens is streamed to the device); each configuration runs with each")
    ap.add_argument("--gpu-step", default="host", help="comma-separated: host (the host-driven step), device (the "
                    "whole forward on the device, engine/tier/device.py); each configuration runs with each")
    args = ap.parse_args(argv)

    from decode import ensure_pack
    from tabulate import tabulate

    from strata.engine.expert_plan import expected_hit_rate
    from strata.engine.tier import GpuTier, TierOptions
    from strata.engine.kernels import cpu, gpu
    from strata.engine.model import Model
    from strata.engine.ops import reuse_freed_memory, single_blas_thread
    from strata.engine.pack_reader import Pack
    from strata.engine.tokenizer import Tokenizer
    from strata.index_format.expert_profile import ExpertProfile
    from strata.index_format.manifest import pack_fingerprint

    if args.emulate:
        sys.path.insert(0, str(REPO / "tests"))
        from gpu_emu import EmuRuntime

        gpu.use_runtime(EmuRuntime())
    else:
        ok, why = gpu.available()
        if not ok:
            print(f"gpu_tier benchmark: no GPU ({why})", file=sys.stderr)
            return 1
    cpu.set_threads(args.threads)
    single_blas_thread()  # as `strata generate` does
    reuse_freed_memory()
    pack_dir = ensure_pack(args.arch, args.preset)
    t0 = time.perf_counter()
    model = Model(Pack.open(pack_dir))
    model.warm_up()
    g = model.geometry
    print(f"loaded {pack_dir} in {time.perf_counter() - t0:.1f} s", flush=True)

    text_ids = calibration_ids(Tokenizer.load(model.pack.tokenizer_path), g.n_vocab)
    ids = text_ids[: args.calib]
    cut = len(ids) * 3 // 4
    fp = pack_fingerprint(pack_dir)
    t0 = time.perf_counter()
    profile = ExpertProfile.from_counts(fp, routing_counts(model, ids[:cut]), tokens=cut, top_k=g.n_expert_used)
    held = ExpertProfile.from_counts(fp, routing_counts(model, ids[cut:]), tokens=len(ids) - cut, top_k=g.n_expert_used)
    print(f"profile: {cut} calibration tokens, {len(ids) - cut} held out, {profile.pairs} pairs routed "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    # the held-out text, then the text past the calibration tokens (none of it profiled)
    prompt = text_ids[cut : cut + args.prompt]
    pairs = g.n_layer * g.n_expert
    chunk = args.chunk

    if args.after:
        t0 = time.perf_counter()
        while not Path(args.after).exists():
            time.sleep(2)
        print(f"waited {time.perf_counter() - t0:.0f} s for {args.after}", flush=True)
    cpu_p, cpu_s, want = run_decode(model, prompt, args.tokens)
    rows = [("cpu", "-", "-", "-", "-", "-", f"{len(prompt) / cpu_p:.1f}", "-", f"{args.tokens / cpu_s:.2f}", "1.00x", "-", "-", "yes")]
    print(f"cpu: {args.tokens / cpu_s:.2f} tok/s", flush=True)
    configs = [("cache 0", {"expert_cache": 0})]
    configs += [(f"auto ~{s:.0%}", {"vram_budget_mib": budget_for(model, round(s * pairs), chunk, args.reserve_mib)})
                for s in SHARES]
    configs.append(("all", {"expert_cache": pairs}))
    if args.only:
        configs = [c for c in configs if c[0].split()[0] in args.only.split(",") or c[0] in args.only.split(",")]
    steps = args.gpu_step.split(",")
    if len(steps) > 1 or steps != ["host"]:  # the same configurations, once per step, side by side
        configs = [(f"{name} [{step}]", {**opts, "step": step}) for name, opts in configs for step in steps]
    streams = args.stream_min_tokens.split(",")
    if streams != ["auto"]:  # prompt tok/s with streaming on and off, side by side
        value = {m: None if m == "auto" else 0 if m == "off" else int(m) for m in streams}
        configs = [(f"{name} [stream {m}]", {**opts, "stream_min_tokens": value[m]}) for name, opts in configs for m in streams]
    layers = args.stream_layer_tokens.split(",")
    if layers != ["auto"]:  # the device step's layers streamed whole, on and off, side by side
        value = {m: None if m == "auto" else 0 if m == "off" else int(m) for m in layers}
        configs = [(f"{name} [layers {m}]", {**opts, "stream_layer_tokens": value[m]}) for name, opts in configs for m in layers]
    registers = args.stream_register.split(",")
    if registers != ["on"]:  # the layer stream from registered pages, and through pinned pieces, side by side
        configs = [(f"{name} [register {m}]", {**opts, "stream_register": m == "on"}) for name, opts in configs for m in registers]
    for name, opts in configs:
        cprofiled = args.cprofile in (name, name.split(" [")[0])  # ('all' names 'all [device]' too)
        o = TierOptions(max_context=max(args.prompt + args.tokens, args.long_prompt) + 1, kv="f16", prefill_chunk=chunk, profile=profile,
                        vram_reserve_mib=args.reserve_mib, **opts)
        tier = GpuTier.start(model, o)
        for line in tier.lines:
            print(f"  {name}: {line}", flush=True)
        # untimed first: on a fresh machine one configuration's first prompt compiled a kernel
        # variant no earlier configuration had needed (2026-11-30, auto ~60%: 7.1 prefill tok/s,
        # then 216 and 221 in two more runs)
        run_decode(model, prompt, 1, tier)
        import cProfile
        import pstats

        prof = cProfile.Profile()
        picks = getattr(model, "picks", False)
        if cprofiled and not picks:
            prof.enable()
        if args.cprofile_prompt in (name, name.split(" [")[0]):
            prof_p = cProfile.Profile()
            s = model.new_session(len(prompt) + 1, "f16")
            prof_p.enable()
            model.forward(s, prompt, n_logits=1)
            prof_p.disable()
            pstats.Stats(prof_p).sort_stats("tottime").print_stats(30)
            del s
        if args.prompt_kernels in (name, name.split(" [")[0]):  # ('all' names 'all [device]' too)
            prompt_kernels(model, prompt)
        prompt_split = ["-"] * 4
        pre, secs, got = run_decode(model, prompt, args.tokens, tier, feed=want.argmax(axis=1), split=prompt_split)
        if cprofiled and not picks:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        picked = None
        if picks:  # greedy picked on the device: only the token comes back (what --cprofile profiles then)
            plain, ahead_picks = [], []
            plain_marks, ahead_marks = [], []
            picked = args.tokens / run_pick(model, prompt, args.tokens, picks=plain, marks=plain_marks)
            if cprofiled:
                run_pick(model, prompt, args.tokens, prof)
                pstats.Stats(prof).sort_stats("tottime").print_stats(30)
            st = steady(plain_marks)
            print(f"  {name}: decode with the greedy pick on the device {picked:.2f} tok/s"
                  + (f"; {st:.2f} tok/s after the first {WARM_STEPS} steps (eager, capture)" if st else ""), flush=True)
            be = model.backend
            if getattr(be, "graphs", False):  # the same steps eager (no CUDA graph): what the capture saves
                eager_picks, eager_marks = [], []
                be.graphs = False
                try:
                    eager = args.tokens / run_pick(model, prompt, args.tokens, picks=eager_picks, marks=eager_marks)
                finally:
                    be.graphs = True
                same = "the same tokens" if eager_picks == plain else "TOKENS DIFFER from the captured steps'"
                st_eager = steady(eager_marks)
                print(f"  {name}: decode with the greedy pick on the device, eager (graphs off) {eager:.2f} tok/s; "
                      f"captured {picked:.2f} tok/s = {picked / eager:.2f}x ({same})"
                      + (f"; after the first {WARM_STEPS} steps {st_eager:.2f} vs {st:.2f} tok/s = {st / st_eager:.2f}x"
                         if st and st_eager else ""), flush=True)
            ahead_busy = []
            ahead = run_ahead(model, prompt, args.tokens, ahead_picks, ahead_marks, ahead_busy)
            st_ahead = steady(ahead_marks)
            if st_ahead:  # the host's CPU time a step against the step's wall time, after the warm steps
                k = WARM_STEPS - 1
                wall_ms = 1e3 * (ahead_marks[-1] - ahead_marks[k]) / (len(ahead_marks) - 1 - k)
                busy_ms = 1e3 * (ahead_busy[-1] - ahead_busy[k]) / (len(ahead_busy) - 1 - k)
                print(f"  {name}: one step ahead, after the first {WARM_STEPS} steps: {wall_ms:.3f} ms a token, "
                      f"the host's main thread busy {busy_ms:.3f} ms of it (CPU time outside the picks' waits)", flush=True)
            if cprofiled and ahead:
                prof = cProfile.Profile()
                run_ahead(model, prompt, args.tokens, [], prof=prof)
                print(f"  {name}: where the host's time goes one step ahead (cProfile, {args.tokens} tokens)")
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            same = "the plain loop's tokens" if ahead_picks == plain else "TOKENS DIFFER from the plain loop's"
            print(f"  {name}: decode with the greedy pick on the device, one step ahead of the host "
                  + (f"{args.tokens / ahead:.2f} tok/s ({args.tokens / ahead / picked:.2f}x the plain loop's tok/s; {same})"
                     + (f"; {st_ahead:.2f} tok/s after the first {WARM_STEPS} steps" if st_ahead else "")
                     if ahead else "(not run: the session cannot run ahead here)"), flush=True)
        if args.long_prompt:
            long_prompt(model, text_ids, args.long_prompt, name, args.long_piece)
        floor = getattr(model.backend, "gpu_floor", lambda: None)()  # the captured step alone (device step, all resident)
        if floor:
            hbm = hbm_floor_s(model)
            print(f"  {name}: GPU floor {1e3 * floor:.2f} ms per token -> {1 / floor:.2f} tok/s of GPU work "
                  f"(the token step's CUDA graph replayed back to back, no host work); HBM floor {1e3 * hbm:.3f} ms "
                  f"per token -> {1 / hbm:.0f} tok/s (bytes read / 4.8 TB/s)", flush=True)
            be = model.backend
            P = max(3, args.floor_pos)
            feed = (prompt * (P // len(prompt) + 2))[: P + 2]
            s = model.new_session(P + 8, "f16")
            if P > 3:
                model.forward(s, feed[: P - 3], n_logits=1)
            for t in feed[P - 3 : P]:
                model.step(s, t)  # eager, captured, replayed: a new session's graph
            # the parts are timed on this new session at position P: its whole graph there too, since
            # attention's work grows with the position (the floor above is the decode session's, past
            # the prompt: qwen4exp: 3.96 ms there against parts of 2.64 ms here on the H200)
            near = be.gpu_floor()
            if near:
                print(f"  {name}: GPU floor {1e3 * near:.2f} ms per token at position {P} of a new session (where the "
                      f"parts below are timed)", flush=True)
            be.floor_next = True
            model.step(s, feed[P])
            if be.floor:
                parts = be.floor
                total = sum(sec for _, sec in parts)
                layers = [sec for label, sec in parts if isinstance(label, int)]
                print(f"  {name}: GPU floor pre+post+head {1e3 * (total - sum(layers)):.2f} ms per token, all parts "
                      f"{1e3 * total:.2f} ms -> {1 / total:.2f} tok/s of GPU work (each part replayed apart)", flush=True)
                print("  " + "  ".join(f"{label}: {1e3 * sec:.3f} ms" for label, sec in parts), flush=True)
            if args.floor_kernels:  # every launch replayed alone: where a step's GPU time goes, by kernel
                be.floor_next = "kernels"
                model.step(s, feed[P + 1])
                by = {}
                for label, sec in be.floor or []:
                    kernel = label[1] if isinstance(label, tuple) else "-"  # (the first part: before any launch)
                    n, t = by.get(kernel, (0, 0.0))
                    by[kernel] = (n + 1, t + sec)
                total = sum(t for _, t in by.values())
                print(f"  {name}: GPU floor by kernel ({sum(n for n, _ in by.values())} parts, each replayed alone, "
                      f"{1e3 * total:.3f} ms in all; '-': array-module work before a layer's first launch)")
                for kernel, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
                    print(f"    {kernel:<28} x{n:<4} {1e3 * t:8.3f} ms  {1e6 * t / n:8.1f} us each", flush=True)
        st, n = tier.stats, tier.slots.slots
        worst = max(tier.marks, key=lambda m: m.error)
        if opts.get("step") == "device":  # its hits are not timed apart (they run inside the step's graphs): no zeros
            split = f"- / {st.cpu_s:.2f} / -"
        else:
            split = f"{st.gpu_s:.2f} / {st.cpu_s:.2f} / {st.wait_s:.2f}" if st.events else f"- / {st.cpu_s:.2f} / {st.wait_s:.2f}"
        rows.append((name, n, f"{n / pairs:.0%}", opts.get("vram_budget_mib", "-"),
                     f"{expected_hit_rate(profile, n):.1%} / {expected_hit_rate(profile, n, held):.1%}",
                     f"{st.hit_rate:.1%}", f"{len(prompt) / pre:.1f}",
                     "{} / {} / {}, {:.1f} MiB".format(*prompt_split) if prompt_split[0] != "-" else "-",
                     f"{args.tokens / secs:.2f}" + (f" ({picked:.2f} picked)" if picked else ""), f"{cpu_s / secs:.2f}x", split,
                     f"{100 * worst.error:.2f}% ({(worst.used - worst.predicted) / 2**20:+.1f} MiB)",
                     "yes" if np.array_equal(got, want) else
                     f"{'within' if opts.get('step') == 'device' else 'NO:'} max |diff| {np.abs(got - want).max():.3g} "
                     f"({(np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)).max():.1e} relative), greedy "
                     f"{'same' if (got.argmax(1) == want.argmax(1)).all() else 'differs at %d of %d' % ((got.argmax(1) != want.argmax(1)).sum(), len(got))}"))
        print(f"{name}: {rows[-1]}", flush=True)
        tier.stop()
        del tier
        gc.collect()
    if args.llama_bench:
        from decode import source_gguf

        gguf = source_gguf(args.arch, args.preset)
        for _ in range(60):  # a build started in the background with this run (../shared/peer/build_llama_cuda.sh)
            if Path(args.llama_bench).exists():
                break
            time.sleep(5)
        peer = [("config", "llama.cpp placement", f"prompt tok/s llama.cpp (pp{len(prompt)})", "Strata", "ratio",
                 "decode tok/s llama.cpp (tg)", "Strata", "ratio")]
        for row in rows:
            key = next((k for k in LLAMA_PLACEMENTS if row[0] == k or row[0].startswith(k + " [")), None)
            if key is None:
                continue
            placement = LLAMA_PLACEMENTS[key].format(half=g.n_layer // 2)
            got = llama_bench(args.llama_bench, gguf, placement, args.threads, len(prompt), args.tokens)
            ours = max(float(x.strip("()")) for x in row[8].split() if x.strip("()").replace(".", "").isdigit())
            pre = float(row[6])
            if isinstance(got, str):
                peer.append((row[0], placement, got, f"{pre:.1f}", "-", "-", f"{ours:.2f}", "-"))
            else:
                peer.append((row[0], placement, f"{got[0]:.1f}", f"{pre:.1f}", f"{pre / got[0]:.2f}x", f"{got[1]:.2f}",
                             f"{ours:.2f}", f"{ours / got[1]:.2f}x"))
            print(f"llama.cpp {placement}: {peer[-1]}", flush=True)
        print(f"\nside by side with llama.cpp (llama-bench -fa 1 -p {len(prompt)} -n {args.tokens} -r 3, same GGUF, same "
              "threads; Strata's prompt: the same length, one batched forward; its decode: the better of the logits "
              "brought down and the pick on the device)\n"
              + tabulate(peer[1:], headers=peer[0], tablefmt="github", disable_numparse=True), flush=True)
    headers = ["config", "slots", "of pairs", "--vram-budget-mib", "expected hit rate (in-sample / held-out)",
               "hit rate", "prefill tok/s", "prompt expert-chunks resident / streamed / CPU, streamed", "decode tok/s", "decode vs cpu", "MoE s: GPU / CPU misses / wait",
               "worst mem_mark vs budget (% of card used)", "logits == cpu"]
    table = tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)
    head = (f"{args.preset} {args.arch}, {pairs} pairs, prompt {len(prompt)} tokens (held-out text), {args.tokens} "
            f"greedy decode steps, {args.threads} CPU threads, device {gpu.available()[1] if not args.emulate else 'emulated'}")
    print(head + "\n\n" + table)
    if args.md:
        args.md.write_text(head + "\n\n" + table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
