"""Speculative decoding benchmark (engine/speculative.py): what verifying 1 + N tokens costs against one
token step, and the decode speed-up of --spec N against --spec 0 in the same process.

    python benchmarks/spec.py [--pack DIR] [--threads 1] [--prompt 32] [--tokens 48] [--rounds 3]
                              [--mtp-preset demo | --no-mtp] [--work DIR] [--cost-only] [--drafts 1,2,3]
                              [--device-step [--emulate]]

1. The trunk (default: the seed-4l qwen4exp pack of benchmarks/decode.py, made under .cache/bench/
   unless --pack names one): after a prompt, per round, one token step and one verify forward of
   T = 1 + N rows (N = 1, 2, 3; random draft tokens), interleaved; the median and best of each, and
   verify / step. Then greedy decoding of --tokens tokens: --spec 0, and --spec N (--drafts; 2 always)
   with drafters that are right with probability 0.43 (the published MTP acceptance on this model),
   0.7 and 1 (the oracle), interleaved round by round; the speed-up of each run is its decode tok/s
   over the same round's --spec 0 run, reported as median and best over the rounds, with the
   acceptance the run actually had. Every spec run's tokens are checked equal to --spec 0's. A
   second table splits each run's decode time: its forwards' median (a verify in the run, against
   --spec 0's token step), its first two forwards (eager, then captured on the device step: a
   session's warm-up) and the host's work between forwards. On the device step the runs are made
   again as strata generate makes them, run ahead of the host (--spec 0's token steps, --spec N's
   verifies: Model.verify_ahead), each against the round's --spec 0 run ahead. On the CPU a third table splits the token step and a verify
   of 1 + 2 rows into parts (the MoE blocks, the LM head, the other dense products, the rest).
2. The real MTP head (qwen4exp has no MTP layout in llama.cpp's converter): a qwen35moe synth of
   --mtp-preset carrying the block (strata-pack synth --mtp, under --work): a draft step's cost
   against a token step, and --spec 2 with the head against --spec 0. The synthetic weights are
   random, so the head's drafts are almost never right: this measures its cost, not its acceptance.

--device-step: the same on the GPU tier's device step (--gpu-step device) with every expert resident
(--expert-cache all): the trunk is seed-4l qwen35moe (benchmarks/decode.py synthesizes it) unless
--pack names one; the verify forward, its snapshots and the rollback run on the device; the MTP
head drafts on the CPU (engine/speculative.py: the tier places none of its weights), so its part
measures that head beside the device's trunk. --emulate: the host emulation of the kernels
(tests/gpu_emu.py), a smoke run on a tiny pack (--pack).

Target (issue 17): >= 1.25x at acceptance 0.43 and N = 2. With acceptance a per draft and N drafts a
verification yields (1 - a^(N+1)) / (1 - a) tokens (1.62 at a = 0.43, N = 2), so the target needs
the verify forward of 3 rows to cost at most 1.29 token steps. The benchmark prints what the
bandwidth floor makes of that ratio (each forward reading its weights once, the rows' routed experts
those of independent routes): on seed-4l qwen35moe 1.26 for 3 rows (its 497 MiB head read once, ~29
distinct experts a layer where a token step reads 10), so the target needs both forwards at the floor.

On a shared machine the numbers move run to run: rounds are interleaved and the report gives median
and best.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

TARGET = 1.25
HELD = (0.43, 0.7, 1.0)


def expected_tokens(a: float, n: int) -> float:
    """Tokens one verification yields with acceptance a per draft (independent) and n drafts."""
    return float(sum(a**i for i in range(n + 1)))


def verify_cost(model, n_prompt: int, rounds: int, rng, launches: dict | None = None) -> dict:
    """{T: seconds of each round's forward of T rows}: T = 1 the token step, T = 1 + N a verify. On
    the device step both pick greedily there (as decoding does: only ids come back), and "eager" is
    the token step run without its CUDA graph, "verify eager" a verify of 1+2 without its graph
    (DeviceBackend.verify_graphs off): what capture wins each. `launches` (the device step): filled
    with {T: the kernels launched through the runtime by round 0's forward of T rows}, which a
    captured graph replays as its kernel nodes (CuPy's own elementwise kernels not counted)."""
    from strata.engine.speculative import Snapshot

    V, be = model.geometry.n_vocab, model.backend
    rt = getattr(be, "rt", None)
    counted = [0]
    if launches is not None and rt is not None:
        launch = rt.launch

        def counting(*x, **kw):
            counted[0] += 1
            return launch(*x, **kw)
    if hasattr(be, "verify_graphs"):  # the captured verify (STRATA_VERIFY_GRAPHS's default; on whatever it says)
        be.verify_graphs = True
    ban = np.zeros(0, np.int32) if model.picks else None
    s = model.new_session(n_prompt + (rounds + 2) * 14 + 4)
    model.forward(s, rng.integers(3, V, n_prompt), n_logits=1)
    snaps = [Snapshot(s, be) for _ in range(3)]
    out: dict = {T: [] for T in (1, 2, 3, 4)}
    eager = None
    if model.picks:
        out["eager"], eager = [], model.new_session(n_prompt + rounds + 3)
        model.forward(eager, rng.integers(3, V, n_prompt), n_logits=1)
    if hasattr(be, "verify_graphs"):
        out["verify eager"] = []
    # rounds 0 and 1 warm up: the verify's row counts compile on first use, and on the device step
    # the first run of each kind is eager, the second captured, later ones replayed (verify_step)
    for r in range(rounds + 2):
        for T in out:
            tokens = rng.integers(3, V, 4)
            if r == 0 and launches is not None and rt is not None:
                counted[0] = 0
                rt.launch = counting
            t0 = time.perf_counter()
            if T == "eager":
                be.graphs = False
                try:
                    t0 = time.perf_counter()
                    model.step_pick(eager, int(tokens[0]), ban)
                finally:
                    be.graphs = True
            elif T == "verify eager":  # a verify of 1+2 not captured (what verify_step's graphs win)
                be.verify_graphs = False
                try:
                    t0 = time.perf_counter()
                    model.forward(s, tokens[:3], n_logits=3, saved=snaps[:2], pick=ban)
                finally:
                    be.verify_graphs = True
            elif T == 1:
                model.step(s, int(tokens[0])) if ban is None else model.step_pick(s, int(tokens[0]), ban)
            else:
                model.forward(s, tokens[:T], n_logits=T, saved=snaps[: T - 1], pick=ban)
            if r >= 2:
                out[T].append(time.perf_counter() - t0)
            if r == 0 and launches is not None and rt is not None:
                del rt.launch
                launches[T] = counted[0]
    return out


def parts_table(model, n_prompt: int, rounds: int, rng) -> list[str]:
    """Where a verify of 1+2 rows spends its time against a token step, part by part (the CPU path):
    wall time inside the MoE blocks (router, routed experts, shared expert), the LM head, the other
    dense products (one input's together, and alone) and the rest (attention, the delta rule, norms,
    the host's work), each the median over `rounds` interleaved rounds. A part is timed at its
    outermost call (the MoE's own products count as the MoE's)."""
    from strata.engine import backend as B, moe as M
    from strata.engine.speculative import Snapshot

    V, head, acc, depth = model.geometry.n_vocab, model.head, {}, [0]
    patched = []

    def wrap(cls, name, label):
        f = getattr(cls, name)
        patched.append((cls, name, f))

        def timed(self, *args, **kw):
            if depth[0]:
                return f(self, *args, **kw)
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return f(self, *args, **kw)
            finally:
                depth[0] -= 1
                key = label(args[0]) if callable(label) else label
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

        setattr(cls, name, timed)

    s = model.new_session(n_prompt + 6 * (rounds + 2) + 4)
    model.forward(s, rng.integers(3, V, n_prompt), n_logits=1)
    snaps = [Snapshot(s, model.backend) for _ in range(2)]
    runs = {"token step": lambda: model.step(s, int(rng.integers(3, V))),
            "verify 1+2": lambda: model.forward(s, rng.integers(3, V, 3), n_logits=3, saved=snaps)}
    got: dict = {name: {} for name in runs}
    wrap(M.MoE, "forward", "MoE (router, experts, shared)")
    wrap(B.CpuBackend, "linear", lambda w: "LM head" if w is head else "other dense, alone")
    wrap(B.CpuBackend, "linears", "other dense, one input's")
    try:
        for r in range(rounds + 2):
            for name, fn in runs.items():
                acc.clear()
                t0 = time.perf_counter()
                fn()
                wall = time.perf_counter() - t0
                if r >= 2:  # (two warm-up rounds)
                    parts = dict(acc, rest=wall - sum(acc.values()), forward=wall)
                    for k, v in parts.items():
                        got[name].setdefault(k, []).append(v)
    finally:
        for cls, name, f in patched:
            setattr(cls, name, f)
    keys = sorted(got["verify 1+2"], key=lambda k: (k in ("rest", "forward"), k == "forward", k))
    lines = [f"a forward's parts (ms, medians of {rounds} interleaved rounds):",
             f"{'part':>30} {'token step':>10} {'verify 1+2':>10} {'ratio':>6}"]
    for k in keys:
        a, b = (statistics.median(got[n].get(k, [0.0])) * 1e3 for n in runs)
        lines.append(f"{k:>30} {a:10.1f} {b:10.1f} {b / a if a else float('nan'):5.2f}x")
    return lines


def floor_ratio(model, T: int) -> float:
    """A forward of T rows against the token step at the bandwidth floor: each reads its weights once
    (decode.py's bytes_per_token), the T rows' routed experts those of T independent routes of k of
    n_expert (E (1 - (1 - k/E)^T) distinct ones a layer, where one row reads k)."""
    from decode import bytes_per_token

    g = model.geometry
    per = bytes_per_token(model)
    experts = sum(v for (c, _), v in per.items() if c == "experts")
    rest = sum(v for (c, _), v in per.items() if c != "experts")
    E, k = g.n_expert, g.n_expert_used
    distinct = E * (1 - (1 - k / E) ** T) / k
    return (rest + experts * distinct) / (rest + experts)


def timed(run) -> list:
    """`run`'s forwards timed as drive calls them: -> the list their wall seconds go to, in order
    (the first is the prompt's: it fits one chunk here)."""
    times, forward = [], run.forward

    def f(model, tokens, n_logits):
        t0 = time.perf_counter()
        out = forward(model, tokens, n_logits)
        times.append(time.perf_counter() - t0)
        return out

    run.forward = f
    return times


def split(gen, times: list) -> tuple:
    """A run's decode time in parts, ms: (its forwards after the prompt, their median, the first two
    of them together (a session's first forward of a kind runs eagerly, its second is captured on
    the device step), the rest of the decode time a forward: the host's work between them)."""
    fw = times[1:]
    return (len(fw), statistics.median(fw) * 1e3, sum(fw[:2]) * 1e3, (gen.decode_s - sum(fw)) / max(len(fw), 1) * 1e3)


def decode_runs(model, prompt, n_tokens: int, rounds: int, configs, ahead: bool = False) -> tuple[list, dict, dict]:
    """Interleaved greedy runs: per round --spec 0, then each (N, p) config. -> (the --spec 0 runs'
    Generations, {(N, p): [(speed-up against the round's --spec 0, acceptance, tokens/verification)]},
    {0 or (N, p): [`split` of each round's run]}). `ahead` (the device step): every run as strata
    generate makes it, its session discarded, so its steps or verifies run ahead of the host where
    they can (drive's `ahead`: Run.take_ahead, SpecRun.take_ahead); no `split` then (the forwards
    run inside the run-ahead, not through run.forward)."""
    from strata.engine.generate import Run, drive
    from strata.engine.sampling import Sampler, SamplerParams
    from strata.engine.speculative import ReferenceDrafter, SpecRun

    V, greedy = model.geometry.n_vocab, SamplerParams(temperature=0)
    ctx = len(prompt) + n_tokens
    plains, res, parts = [], {c: [] for c in configs}, {c: [] for c in [0, *configs]}
    reference = None
    for r in range(rounds):
        run = Run(model.new_session(ctx), prompt, Sampler(V, greedy), n_tokens, prefill=64)
        times = timed(run)
        plain = drive(model, run, ahead)
        plains.append(plain)
        if not ahead:
            parts[0].append(split(plain, times))
        if reference is None:
            reference = np.concatenate([plain.prompt, plain.tokens])
        for n, p in configs:
            run = SpecRun(model, model.new_session(ctx), prompt, Sampler(V, greedy), n_tokens,
                          drafter=ReferenceDrafter(reference, V, p, seed=r), n_draft=n, prefill=64)
            times = timed(run)
            out = drive(model, run, ahead)
            if out.tokens.tolist() != plain.tokens.tolist():
                raise SystemExit(f"--spec {n} (right with p {p}) gave other tokens than --spec 0: a bug")
            st = run.stats
            res[(n, p)].append((out.decode_tps / plain.decode_tps, st.accepted.sum() / max(st.judged.sum(), 1),
                                st.tokens_per_verification()))
            if not ahead:
                parts[(n, p)].append(split(out, times))
    return plains, res, parts


def device_tier(model, max_context: int, spec: int = 0, draft: bool = False):
    """The GPU tier's device step on `model`, every expert resident (--gpu-step device --expert-cache all);
    `draft`: with `spec`, the MTP head placed on the device too (Model.draft_head)."""
    from strata.engine.tier import GpuTier, TierOptions

    g = model.geometry
    o = TierOptions(max_context=max_context, kv="f32", prefill_chunk=64, step="device", expert_cache=g.n_layer * g.n_expert,
                    spec=spec, draft=draft)
    return GpuTier.start(model, o)


def mtp_part(preset: str, work: Path, n_prompt: int, n_tokens: int, rounds: int, device: bool = False) -> list[str]:
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack
    from strata.tools import pack, synth

    out = work / f"{preset}-qwen35moe-mtp-pack"
    if not (out / "manifest.txt").is_file():
        work.mkdir(parents=True, exist_ok=True)
        print(f"synthesizing {preset} qwen35moe with an MTP block into {work} (once) ...", flush=True)
        ggufs = synth.synth("qwen35moe", preset, work / f"{preset}-qwen35moe-mtp.gguf", force=True, mtp=True)
        pack.convert(ggufs[:1], out)
    model = Model(Pack.open(out))
    tier = device_tier(model, n_prompt + max(n_tokens, (rounds + 1) * 10 + 4), spec=2, draft=True) if device else None
    try:
        return _mtp_lines(model, preset, n_prompt, n_tokens, rounds, device)
    finally:
        if tier is not None:
            tier.stop()


def _mtp_lines(model, preset: str, n_prompt: int, n_tokens: int, rounds: int, device: bool) -> list[str]:
    from strata.engine.generate import drive, generate
    from strata.engine.mtp import MTPHead
    from strata.engine.sampling import Sampler, SamplerParams
    from strata.engine.speculative import MTPDrafter, SpecRun

    model.warm_up()
    V, E = model.geometry.n_vocab, model.geometry.n_embd
    rng = np.random.default_rng(1)
    cost = verify_cost(model, n_prompt, rounds, rng)
    # on the device step the tier's head (engine/tier/draft.py), as speculative_generate drafts there
    head = model.draft_head if device else MTPHead(model.pack, model.backend)
    if device:  # its draft steps captured and replayed as the trunk's verifies are here (verify_cost)
        head.backend.verify_graphs = True

    ban = np.zeros(0, np.int32)

    def one_draft(head, pick: bool = False) -> float:
        """The median seconds of a greedy draft of `head` as MTPDrafter makes one (its own state, a
        chain fed its own y): the logits, then on the host their top probability (a float64 softmax)
        and their argmax; with `pick`, both made on the device (MTPHead.pick)."""
        state = head.new_state(n_prompt + rounds + 4)
        x, times = h, []
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            if pick:
                head.pick(state, x, int(rng.integers(3, V)), i, ban)
            else:
                logits = head.forward(state, x, np.array([int(rng.integers(3, V))]), i)
                _ = 1.0 / float(np.exp(logits.astype(np.float64) - float(logits.max())).sum()), int(logits.argmax())
            times.append(time.perf_counter() - t0)
            x = head.y.x
        # (the first compiles what the trunk's warm-up did not; on the device the second is captured)
        return statistics.median(times[1:])

    h = rng.standard_normal((1, E)).astype(np.float32)
    draft = one_draft(head, pick=head.picks)
    step = statistics.median(cost[1])
    # on the device step: the logits brought down (the rule on the host), and the head on the CPU
    # beside it: how drafting was before the pick and before the tier placed the head
    before = f" (logits down {one_draft(head) * 1e3:.1f} ms, on the CPU {one_draft(MTPHead(model.pack)) * 1e3:.1f} ms)" \
        if device else ""
    lines = [f"MTP head ({preset} qwen35moe synth with --mtp, {model.geometry.n_layer} layers, vocab {V}"
             f"{', trunk and head on the device step' if device else ''}): "
             f"token step {step * 1e3:.1f} ms, one draft {draft * 1e3:.1f} ms{before} "
             f"({draft / step:.2f} steps), verify 1+2 rows "
             f"{statistics.median(cost[3]) * 1e3:.1f} ms ({statistics.median(cost[3]) / step:.2f} steps)"]
    prompt = rng.integers(3, V, n_prompt).tolist()
    greedy = SamplerParams(temperature=0)
    ratios, acc = [], []
    for _ in range(rounds):
        plain = generate(model, model.new_session(n_prompt + n_tokens), prompt, Sampler(V, greedy), n_tokens, prefill=64)
        s = model.new_session(n_prompt + n_tokens)
        run = SpecRun(model, s, prompt, Sampler(V, greedy), n_tokens, prefill=64, n_draft=2,
                      drafter=MTPDrafter(head, n_prompt + n_tokens, "f16", Sampler(V, greedy), min_p=0.0))
        res = drive(model, run)
        if res.tokens.tolist() != plain.tokens.tolist():
            raise SystemExit("--spec 2 with the MTP head gave other tokens than --spec 0: a bug")
        ratios.append(res.decode_tps / plain.decode_tps)
        acc.append(run.stats.accepted.sum() / max(run.stats.judged.sum(), 1))
    lines.append(f"  --spec 2 --spec-min-p 0 with the head: {statistics.median(ratios):.2f}x median, "
                 f"{max(ratios):.2f}x best of --spec 0's tok/s; acceptance {statistics.median(acc):.3f} "
                 "(random weights: the head cannot know the trunk)")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path, help="a qwen4exp (or qwen35moe) pack; default: seed-4l qwen4exp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mtp-preset", default="demo")
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--cost-only", action="store_true", help="the forward costs only (part 1's first table)")
    ap.add_argument("--drafts", default="1,2,3", help="the N of the decode runs, comma-separated (default 1,2,3)")
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--device-step", action="store_true", help="on the GPU tier's device step, every expert resident "
                    "(default pack: seed-4l qwen35moe)")
    ap.add_argument("--emulate", action="store_true", help="with --device-step: the host emulation of the kernels "
                    "(tests/gpu_emu.py; a smoke run on a tiny --pack)")
    a = ap.parse_args(argv)

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    cpu.set_threads(a.threads)
    if a.device_step:
        from strata.engine.kernels import gpu

        if a.emulate:
            sys.path.insert(0, str(REPO / "tests"))
            from gpu_emu import EmuRuntime

            gpu.use_runtime(EmuRuntime())
        elif not gpu.available()[0]:
            print(f"spec benchmark: --device-step needs a GPU ({gpu.available()[1]}); --emulate for a smoke run",
                  file=sys.stderr)
            return 1
    if a.pack is None:
        from decode import ensure_pack

        a.pack = ensure_pack("qwen35moe" if a.device_step else "qwen4exp")
    model = Model(Pack.open(a.pack))
    tier = device_tier(model, a.prompt + max(a.tokens, (max(a.rounds, 5) + 2) * 14 + 4)) if a.device_step else None
    try:
        rc = _measure(a, model, tier)
    finally:
        if tier is not None:  # one tier at a time: the MTP part starts its own
            tier.stop()
    if rc == 0 and not a.cost_only and not a.no_mtp:
        for line in mtp_part(a.mtp_preset, a.work, a.prompt, a.tokens, a.rounds, device=a.device_step):
            print(line)
    return rc


def _measure(a, model, tier) -> int:
    model.warm_up()
    if tier is None:  # the rows' experts and embeddings from memory, not the disk (decode.py's pretouch)
        from decode import pretouch

        print(f"read every expert byte, the PLE table and the embeddings once: {pretouch(model):.1f} s", file=sys.stderr)
    g = model.geometry
    where = "; the device step, every expert resident" + (" (EMULATED)" if a.emulate else "") if tier else ""
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.node()}, {platform.processor() or platform.machine()}, "
          f"{a.threads} thread(s); {a.pack.name}: {g.arch}, {g.n_layer} layers, {g.n_expert} experts (top-{g.n_expert_used}), "
          f"vocab {g.n_vocab}{where}")
    rng = np.random.default_rng(0)
    launches: dict = {}
    cost = verify_cost(model, a.prompt, max(a.rounds, 5), rng, launches)
    step = statistics.median(cost[1])
    print("forward cost (median / best ms, and median against the token step" +
          ("; kernels launched by its eager run" if launches else "") + "):")
    for T, ts in cost.items():
        name = "token step" if T == 1 else "step, eager" if T == "eager" else "1+2, eager" if T == "verify eager" \
            else f"verify 1+{T - 1}"
        print(f"  {name:>11}  {statistics.median(ts) * 1e3:8.1f} / "
              f"{min(ts) * 1e3:8.1f} ms  {statistics.median(ts) / step:5.2f}x" +
              (f"  {launches[T]:5d} launches" if T in launches else ""))
    floors = {T: floor_ratio(model, T) for T in (2, 3, 4)}
    print("at the bandwidth floor (every weight read once a forward, the rows' routes independent): " +
          ", ".join(f"verify 1+{T - 1} {r:.2f}x" for T, r in floors.items()) + " a token step; with both at the "
          f"floor, --spec 2 at acceptance 0.43 (1.61 tokens a verify) gives {expected_tokens(0.43, 2) / floors[3]:.2f}x")
    if tier is None:
        print("\n".join(parts_table(model, a.prompt, max(a.rounds, 5), rng)))
    if a.cost_only:
        return 0
    prompt = rng.integers(3, g.n_vocab, a.prompt).tolist()
    configs = [(n, p) for p in HELD for n in sorted({int(x) for x in a.drafts.split(",")} | {2})]
    plains, res, parts = decode_runs(model, prompt, a.tokens, a.rounds, configs)
    print(f"--spec 0: {statistics.median([p.decode_tps for p in plains]):.2f} tok/s median over {a.rounds} rounds "
          f"({a.tokens} tokens after a {a.prompt}-token prompt)")
    _speedups(res)
    if tier is not None:
        # as strata generate runs: --spec 0's token steps one ahead of the host, --spec N's verifies
        # ahead (model.verify_ahead: judged, rolled back and drafted on the device), each against
        # the round's --spec 0 run ahead
        plains_ahead, res_ahead, _ = decode_runs(model, prompt, a.tokens, a.rounds, configs, ahead=True)
        print(f"run ahead of the host, as strata generate runs (--spec 0's steps, --spec N's verifies): --spec 0 "
              f"{statistics.median([p.decode_tps for p in plains_ahead]):.2f} tok/s median")
        _speedups(res_ahead)
    print("where a run's decode time went (medians over the rounds): its forwards after the prompt, their "
          "median, the first two together, the rest a forward (the host between them); ms")
    print(f"{'run':>14} {'forwards':>8} {'median':>7} {'first two':>9} {'rest':>6}")
    for c, rows in parts.items():
        name = "--spec 0" if c == 0 else f"N {c[0]}, p {c[1]:.2f}"
        print(f"{name:>14} " + " ".join(f"{statistics.median([r[i] for r in rows]):{w}.{d}f}"
                                       for i, w, d in ((0, 8, 0), (1, 7, 3), (2, 9, 2), (3, 6, 3))))
    at = statistics.median([r[0] for r in res[(2, 0.43)]])
    print(f"target >= {TARGET}x at acceptance 0.43, N = 2: {'MET' if at >= TARGET else 'MISSED'} ({at:.2f}x median)")
    if tier is not None:
        at = statistics.median([r[0] for r in res_ahead[(2, 0.43)]])
        print(f"run ahead: target >= {TARGET}x at acceptance 0.43, N = 2: {'MET' if at >= TARGET else 'MISSED'} "
              f"({at:.2f}x median against --spec 0 run ahead)")
    return 0


def _speedups(res: dict) -> None:
    print(f"{'N':>2} {'right p':>8} {'kept/judged':>11} {'tok/verify':>10} {'expected':>8} {'speed-up median':>15} {'best':>6}")
    for (n, p), rows in res.items():
        sp = [r[0] for r in rows]
        print(f"{n:>2} {p:>8.2f} {statistics.median([r[1] for r in rows]):>11.3f} "
              f"{statistics.median([r[2] for r in rows]):>10.2f} {expected_tokens(p, n):>8.2f} "
              f"{statistics.median(sp):>14.2f}x {max(sp):>5.2f}x")


if __name__ == "__main__":
    sys.exit(main())
