"""Where a verify's time goes on the device step: its captured graph's device time against the token
step's, beside their wall times; and a draft step of the MTP head on the device against the CPU's.

    python3 benchmarks/verify_profile.py                 # the demo qwen35moe with --mtp, synthesized once
    python3 benchmarks/verify_profile.py --pack PACK     # a qwen35moe pack (with an MTP block: the draft rows)

On an H100 (2026-12-05, seed-4l) a captured verify of 1 + 2 rows cost 3.9 ms where the token step
took 1.1; this profile's per-kernel table put it on the rows' dense products (mmq), which now take
the few-row kernel (STRATA_MVF_TOKENS=1 puts them back): 1.66 token steps. Its split of one forward
says where the wall beyond the graph's device time goes (before the graph, after it), and its host
table which functions make it (cProfile over many forwards: a token step, a verify of 1 + 2 rows,
and one followed by the rollback of a rejected draft): on the H100 the verify's routing counts
settled entry by entry, its rows decoded on the host and a rollback's copies one call each, all
cut since. Its last table runs verifies ahead of the host as strata generate does (Model.verify_ahead), with
a drafter always right and one always wrong: the wall a verify there against that graph's device
time (its judge and rollback inside it). Needs a CUDA GPU. Ratios only against this run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def _pack(work: Path, preset: str) -> Path:
    from strata.tools import pack, synth

    out = work / f"{preset}-qwen35moe-mtp-pack"
    if not (out / "manifest.txt").is_file():
        work.mkdir(parents=True, exist_ok=True)
        print(f"synthesizing {preset} qwen35moe with an MTP block into {work} (once) ...", file=sys.stderr, flush=True)
        ggufs = synth.synth("qwen35moe", preset, work / f"{preset}-qwen35moe-mtp.gguf", force=True, mtp=True)
        pack.convert(ggufs[:1], out)
    return out


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def split_table(be, rt, cp, step, verify, rounds: int) -> str:
    """One captured forward split in time, CUDA events on the stream at its start, around its graph's
    replay and after it returned (medians of `rounds`): before the graph (the host's work and the
    staged rows, with the device idle or copying), the graph in place, after it (the copies down, the
    host's wait and its work after). A graph replayed back to back (`graph ms`) can run faster than
    in place, where the device waits for the host between forwards."""
    replay = be._replay
    marks: list = []

    def timed_replay(segments):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        replay(segments)
        e1.record()
        marks.append((e0, e1))

    be._replay = timed_replay
    rows = []
    try:
        for name, fn in (("token step", step), ("verify 1+2", lambda: verify(3))):
            got = []
            for _ in range(rounds):
                marks.clear()
                rt.synchronize()
                a, b = cp.cuda.Event(), cp.cuda.Event()
                t0 = time.perf_counter()
                a.record()
                fn()
                b.record()
                wall = (time.perf_counter() - t0) * 1e3
                b.synchronize()
                if len(marks) != 1:  # (not one replayed graph: an eager or a cut step)
                    return f"split: {name} replayed {len(marks)} graphs, not one"
                g0, g1 = marks[0]
                got.append((wall, cp.cuda.get_elapsed_time(a, g0), cp.cuda.get_elapsed_time(g0, g1),
                            cp.cuda.get_elapsed_time(g1, b)))
            rows.append((name, *(statistics.median(x[i] for x in got) for i in range(4))))
    finally:
        be._replay = replay
    lines = ["", "one forward split by CUDA events (ms, medians): before its graph, the graph in place, after it",
             f"{'forward':>14} {'wall':>7} {'before':>7} {'graph':>7} {'after':>7}"]
    lines += [f"{n:>14} {w:7.3f} {x:7.3f} {g:7.3f} {y:7.3f}" for n, w, x, g, y in rows]
    return "\n".join(lines)


def host_table(fns, rounds: int, top: int) -> str:
    """The host's own time in each forward (cProfile over `rounds` replayed forwards of each; tottime,
    us a forward): which Python functions and which CuPy / driver calls the wall beyond the graph is
    made of. cProfile adds ~1 us a Python call: a ranking, not a budget."""
    import cProfile
    import pstats

    cols, names = [], []
    for name, fn in fns:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(rounds):
            fn()
        prof.disable()
        st = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
        per = {}
        for (f, line, func), (_, nc, tt, _, _) in st.items():
            key = f"{Path(f).name}:{line}({func})" if f != "~" else func
            per[key] = (tt / rounds * 1e6, nc / rounds)
        cols.append(per)
        names.append(name)
    keys = sorted(set().union(*cols), key=lambda k: -max(c.get(k, (0, 0))[0] for c in cols))[:top]
    lines = ["", f"host time by function (cProfile tottime, us a forward, calls a forward; {rounds} forwards each)",
             f"{'function':>56}" + "".join(f" {n + ' us':>15} {'n':>5}" for n in names)]
    for k in keys:
        lines.append(f"{k[-56:]:>56}" + "".join(f" {c.get(k, (0, 0))[0]:15.1f} {c.get(k, (0, 0))[1]:5.1f}" for c in cols))
    lines.append(f"{'all':>56}" + "".join(f" {sum(v[0] for v in c.values()):15.1f} {'':>5}" for c in cols))
    return "\n".join(lines)


def kernel_table(be, rt, cp, step, verify, top: int) -> str:
    """Each kernel's device time in an eager token step and an eager verify of 1 + 2 rows: a CUDA
    event before and after every launch (rt.launch, cuBLAS's gemm_f16), summed by kernel name, the
    medians of 5 runs. What the launches leave out (CuPy's own element-wise kernels, the gaps the
    host leaves between launches) is the forward's device time (events around it) less their sum."""
    launch, gemm = rt.launch, getattr(rt, "gemm_f16", None)
    got: list = []

    def timed(name, fn):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        fn()
        e1.record()
        got.append((name, e0, e1))

    rt.launch = lambda mod, name, *args, **kw: timed(name, lambda: launch(mod, name, *args, **kw))
    if gemm is not None:
        rt.gemm_f16 = lambda *args, **kw: timed("cublas gemm_f16", lambda: gemm(*args, **kw))
    graphs, vgraphs, held = be.graphs, be.verify_graphs, (be._graph, be._warm)
    be.graphs = be.verify_graphs = False
    be._graph = be._warm = None  # (a captured token step replays whatever `graphs` says: put it aside)
    tables = []
    try:
        for fn in (step, lambda: verify(3)):
            runs = []
            for _ in range(6):
                got.clear()
                rt.synchronize()
                w0, w1 = cp.cuda.Event(), cp.cuda.Event()
                w0.record()
                fn()
                w1.record()
                w1.synchronize()
                by: dict = {}
                for name, e0, e1 in got:
                    t, n = by.get(name, (0.0, 0))
                    by[name] = (t + cp.cuda.get_elapsed_time(e0, e1) * 1e3, n + 1)
                runs.append((cp.cuda.get_elapsed_time(w0, w1) * 1e3, by))
            tables.append(runs[1:])  # (the first: its temporaries allocated)
    finally:
        rt.launch = launch
        if gemm is not None:
            rt.gemm_f16 = gemm
        be.graphs, be.verify_graphs = graphs, vgraphs
        be._graph, be._warm = held

    def med(runs, name):
        return statistics.median(r[1].get(name, (0.0, 0))[0] for r in runs), runs[0][1].get(name, (0.0, 0))[1]

    names = sorted({n for runs in tables for r in runs for n in r[1]}, key=lambda n: -med(tables[1], n)[0])
    lines = ["", "eager, each launch between CUDA events (us of device time, launches; medians of 5)",
             f"{'kernel':>28} {'step us':>8} {'n':>4} {'verify 1+2 us':>13} {'n':>4}"]
    sums = [0.0, 0.0]
    for name in names:
        (ts, ns), (tv, nv) = med(tables[0], name), med(tables[1], name)
        sums[0] += ts
        sums[1] += tv
        if len(lines) < top + 3:
            lines.append(f"{name[:28]:>28} {ts:8.1f} {ns:4d} {tv:13.1f} {nv:4d}")
    walls = [statistics.median(r[0] for r in runs) for runs in tables]
    lines.append(f"{'all launches':>28} {sums[0]:8.1f} {'':>4} {sums[1]:13.1f}")
    lines.append(f"{'forward (events around it)':>28} {walls[0]:8.1f} {'':>4} {walls[1]:13.1f}")
    return "\n".join(lines)


def ahead_table(model, ctx: int, rng, n_tokens: int, graph_ms, n_prompt: int = 32) -> str:
    """Verifies of 1 + 2 rows run ahead of the host as strata generate runs them (Model.verify_ahead:
    each queued before the last one's record is read; its judge, rollback and next ids on the device)
    with a drafter always right (the greedy continuation made first) and one always wrong (every
    verify rolls back): the wall a verify in that loop against its captured graph replayed back to
    back. Where the wall is above the graph, the device waited (for the host, or between graphs)."""
    from strata.engine.speculative import ReferenceDrafter, Snapshot

    be, V = model.backend, model.geometry.n_vocab
    ban = np.zeros(0, np.int32)
    prompt = rng.integers(3, V, n_prompt)
    s0 = model.new_session(ctx)
    model.forward(s0, prompt[:-1], n_logits=1)
    tok, ref = int(prompt[-1]), [int(t) for t in prompt]
    for _ in range(n_tokens + 4):
        tok = model.step_pick(s0, tok, ban)
        ref.append(tok)
    lines = ["", f"verifies of 1 + 2 rows run ahead ({n_tokens} tokens after a {n_prompt}-token prompt; ms)",
             f"{'drafter':>14} {'verifies':>8} {'tok/verify':>10} {'wall/verify':>11} {'ahead graph':>11}"]
    for name, p in (("always right", 1.0), ("always wrong", 0.0)):
        s = model.new_session(ctx)
        model.forward(s, prompt[:-1], n_logits=1)
        drafter = ReferenceDrafter(ref, V, p)
        drafts, _ = drafter.draft(ref, n_prompt, 2)
        snaps = [Snapshot(s, be) for _ in range(2)]
        tokens = np.array([ref[n_prompt - 1], *drafts], np.int64)
        got, n, t0 = [], 0, time.perf_counter()
        for k, picked in model.verify_ahead(s, tokens, ban, drafter, snaps, n_tokens):
            got.extend(int(t) for t in picked)
            n += 1
        wall = (time.perf_counter() - t0) * 1e3
        if got[:n_tokens] != ref[n_prompt: n_prompt + n_tokens]:
            raise SystemExit(f"verify_profile: the run ahead ({name}) gave other tokens than the greedy steps: a bug")
        g = [v for key, v in be._vgraphs.items() if v and key[0] == id(s) and key[1] == "ahead" and "segments" in v]
        dev = graph_ms(g[0]["segments"]) if g else float("nan")
        lines.append(f"{name:>14} {n:8d} {len(got) / n:10.2f} {wall / n:11.3f} {dev:11.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path)
    ap.add_argument("--preset", default="demo", help="without --pack: the synth preset (default demo)")
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "bench")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--kernels", type=int, default=14, help="the per-kernel table's rows (0: none)")
    ap.add_argument("--host", type=int, default=24, help="the host-time table's rows (0: none)")
    ap.add_argument("--ahead", type=int, default=120, help="tokens of the run-ahead table's runs (0: none)")
    a = ap.parse_args(argv)

    from strata.engine.kernels import cpu, gpu

    ok, why = gpu.available()
    if not ok:
        print(f"verify_profile: needs a CUDA GPU ({why})", file=sys.stderr)
        return 1
    from strata.engine.model import Model
    from strata.engine.mtp import MTPHead
    from strata.engine.pack_reader import Pack
    from strata.engine.speculative import Snapshot, roll_back
    from strata.engine.tier import GpuTier, TierOptions

    cpu.set_threads(a.threads)
    model = Model(Pack.open(a.pack or _pack(a.work, a.preset)))
    g, ctx = model.geometry, 1024
    tier = GpuTier.start(model, TierOptions(max_context=ctx, kv="f32", prefill_chunk=64, step="device",
                                            expert_cache=g.n_layer * g.n_expert, spec=3, draft=True))
    try:
        model.warm_up()
        be, rng, V = model.backend, np.random.default_rng(0), g.n_vocab
        rt, cp = be.rt, getattr(be.rt, "cp", None)
        be.verify_graphs = True
        s = model.new_session(ctx)
        model.forward(s, rng.integers(3, V, 32), n_logits=1)
        snaps, ban = [Snapshot(s, be) for _ in range(3)], np.zeros(0, np.int32)

        def verify(T):
            model.forward(s, rng.integers(3, V, T), n_logits=T, saved=snaps[: T - 1], pick=ban)

        def step():
            model.step_pick(s, int(rng.integers(3, V)), ban)

        for _ in range(3):  # eager, captured, replayed
            step(), verify(2), verify(3)

        def graph_ms(segments, n=20) -> float:
            if cp is None:  # (the emulation: no graphs, no events)
                return float("nan")
            rt.synchronize()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            for _ in range(n):
                be._replay(segments)
            e1.record()
            e1.synchronize()
            return cp.cuda.get_elapsed_time(e0, e1) / n

        rows = [("token step", _median_ms(step, a.rounds), graph_ms(be._graph[1]) if be._graph else float("nan"))]
        for T in (2, 3):
            wall = _median_ms(lambda T=T: verify(T), a.rounds)
            got = [v for k, v in be._vgraphs.items() if v and k[1] == T and "segments" in v]
            rows.append((f"verify 1+{T - 1}", wall, graph_ms(got[0]["segments"]) if got else float("nan")))
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {a.pack or a.preset}: {g.n_layer} layers, "
              f"{g.n_expert} experts, vocab {V}; STRATA_MVF_TOKENS={gpu.MVF_TOKENS}, STRATA_MVT_TOKENS={gpu.MVT_TOKENS}")
        print(f"{'forward':>14} {'wall ms':>8} {'graph ms':>9} {'wall/step':>9}")
        for name, wall, dev in rows:
            print(f"{name:>14} {wall:8.3f} {dev:9.3f} {wall / rows[0][1]:8.2f}x")
        if cp is not None:
            print(split_table(be, rt, cp, step, verify, a.rounds))
        if a.host:
            def verify_back():  # a verify of 1+2 rows whose first draft is rejected: the rollback of --spec
                verify(3)
                roll_back(s, snaps[0], s.pos - 2)

            print(host_table([("step", step), ("verify 1+2", lambda: verify(3)), ("+ roll back", verify_back)],
                             max(a.rounds, 50), a.host))
        if cp is not None and a.kernels:
            print(kernel_table(be, rt, cp, step, verify, a.kernels))
        if a.ahead and model.verifies_ahead(s):  # (last: its sessions take the device step's graphs)
            print(ahead_table(model, ctx, rng, a.ahead, graph_ms))
        if model.draft_head is not None:
            E = g.n_embd
            model.draft_head.backend.verify_graphs = True
            # a draft step's logits (no host rule after them), and on the device the pick made there
            # (MTPHead.pick: the argmax and the top probability, no logits down)
            for name, head, pick in (("device", model.draft_head, False), ("device pick", model.draft_head, True),
                                     ("CPU", MTPHead(model.pack), False)):
                st = head.new_state(ctx, "f32")
                head.forward(st, rng.standard_normal((8, E)).astype(np.float32), rng.integers(3, V, 8), 0)
                at = [8]

                def draft(head=head, st=st, at=at, pick=pick):
                    if pick:
                        head.pick(st, head.y.x, int(rng.integers(3, V)), at[0], ban)
                    else:
                        head.forward(st, head.y.x, np.array([int(rng.integers(3, V))]), at[0])
                    at[0] += 1

                for _ in range(3):
                    draft()
                ms = _median_ms(draft, a.rounds)
                print(f"{'draft, ' + name:>14} {ms:8.3f} {'':>9} {ms / rows[0][1]:8.2f}x")
    finally:
        tier.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
