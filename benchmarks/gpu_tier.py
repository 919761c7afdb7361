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
    ap.add_argument("--reserve-mib", type=int, default=700)
    ap.add_argument("--md", type=Path, help="also write the table here (markdown)")
    ap.add_argument("--cprofile", metavar="CONFIG", help="print where the decode time of CONFIG (e.g. all) goes")
    ap.add_argument("--only", help="comma-separated configurations to run (default: all of them)")
    ap.add_argument("--emulate", action="store_true", help="the host emulation of the kernels (tests/gpu_emu.py)")
    ap.add_argument("--stream-min-tokens", default="auto", help="comma-separated: auto, off or N (a prompt chunk's "
                    "non-resident expert routed N+ tokens is streamed to the device); each configuration runs with each")
    ap.add_argument("--gpu-step", default="host", help="comma-separated: host (the host-driven step), device (the "
                    "whole forward on the device, engine/tier/device.py; qwen35moe); each configuration runs with each")
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

    ids = calibration_ids(Tokenizer.load(model.pack.tokenizer_path), g.n_vocab)[: args.calib]
    cut = len(ids) * 3 // 4
    fp = pack_fingerprint(pack_dir)
    t0 = time.perf_counter()
    profile = ExpertProfile.from_counts(fp, routing_counts(model, ids[:cut]), tokens=cut, top_k=g.n_expert_used)
    held = ExpertProfile.from_counts(fp, routing_counts(model, ids[cut:]), tokens=len(ids) - cut, top_k=g.n_expert_used)
    print(f"profile: {cut} calibration tokens, {len(ids) - cut} held out, {profile.pairs} pairs routed "
          f"({time.perf_counter() - t0:.1f} s)", flush=True)
    prompt = ids[cut : cut + args.prompt]
    pairs = g.n_layer * g.n_expert
    chunk = 256

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
    for name, opts in configs:
        o = TierOptions(max_context=args.prompt + args.tokens + 1, kv="f16", prefill_chunk=chunk, profile=profile,
                        vram_reserve_mib=args.reserve_mib, **opts)
        tier = GpuTier.start(model, o)
        for line in tier.lines:
            print(f"  {name}: {line}", flush=True)
        # untimed first: on a fresh machine one configuration's first prompt compiled a kernel
        # variant no earlier configuration had needed (2026-11-30, auto ~60%: 7.1 prefill tok/s,
        # then 216 and 221 in two more runs)
        run_decode(model, prompt, 1, tier)
        if args.cprofile == name:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
        prompt_split = ["-"] * 4
        pre, secs, got = run_decode(model, prompt, args.tokens, tier, feed=want.argmax(axis=1), split=prompt_split)
        if args.cprofile == name:
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        floor = getattr(model.backend, "gpu_floor", lambda: None)()  # the captured step alone (device step, all resident)
        if floor:
            print(f"  {name}: GPU floor {1e3 * floor:.2f} ms per token -> {1 / floor:.2f} tok/s of GPU work "
                  "(the token step's CUDA graph replayed back to back, no host work)", flush=True)
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
                     f"{args.tokens / secs:.2f}", f"{cpu_s / secs:.2f}x", split,
                     f"{100 * worst.error:.2f}% ({(worst.used - worst.predicted) / 2**20:+.1f} MiB)",
                     "yes" if np.array_equal(got, want) else
                     f"{'within' if opts.get('step') == 'device' else 'NO:'} max |diff| {np.abs(got - want).max():.3g} "
                     f"({(np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)).max():.1e} relative), greedy "
                     f"{'same' if (got.argmax(1) == want.argmax(1)).all() else 'differs at %d of %d' % ((got.argmax(1) != want.argmax(1)).sum(), len(got))}"))
        print(f"{name}: {rows[-1]}", flush=True)
        tier.stop()
        del tier
        gc.collect()
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
