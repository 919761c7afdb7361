"""Before/after of the token path's latest change in one process: `Model.step` without it (before)
and with it (after), rounds interleaved, same token ids, wall-clock and CPU time per token, and the
per-stage table of each. The change compared: a token's products of one input (cpu.TokenProducts,
rowdot.many_kernel) take their row chunks from a shared queue where prange's static split gave each
thread the same count of rows; the GDN token's conv taps loop over the channels innermost
(kernels/delta.token_prep); a token's routed experts in rank order from the layer's kept buffers
(moe.MoE._token_products) instead of through its Groups. Before: both kernels as they were, built
here from their old source without the disk cache (the queue's kernels have the same cache tags),
and the Groups path. Earlier comparisons: QSA's and PLE's products planned, `git show
8ef7370:benchmarks/decode_ab.py`; a call site's products planned once and numba's C thread
getter, `git show a755775:benchmarks/decode_ab.py`; a token's host passes on the CPU, `git show
65516bc:benchmarks/decode_ab.py`; the grouped calls' kept plans, the router in the shared expert's
region, `git show e876792:benchmarks/decode_ab.py`; one region per input whatever form each reads,
`git show 9567b85:benchmarks/decode_ab.py`; the one-token Q4_K/Q6_K kernels and the first
one-region products, `git show 6c4cd39:benchmarks/decode_ab.py`; rowdot.py's first types and
delta.py, `git show 2f692b5:benchmarks/decode_ab.py`.

    python benchmarks/decode_ab.py [--arch qwen4exp|qwen35moe] [--threads 1] [--rounds 5] [--tokens 32] [--preset seed-4l]

(--preset tiny: kernels of a few microseconds, so a token step is nearly all the Python between them.)

On a shared host the CPU time (this process, all threads) is the steadier figure: it is the time
the step ran, not the time it waited for a core. Uses decode.py's model, timers and report.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import numpy as np

import decode as D

F32 = np.float32


# rowdot's many-products kernel as it was: each prange iteration one chunk of rows (the static split)
OLD_MANY_SRC = """
def kernel({params}xq, xd, s16, wq, wd, ws, fx, n_chunks):
{prologue}
    {sizes}
    total = {total}
    for c in prange(n_chunks):
{chunk_init}
        for o in range(c * total // n_chunks, (c + 1) * total // n_chunks):
            if True:
{body}
"""


def _old_token_prep():
    from numba import njit

    from strata.engine.kernels.jit import JIT

    @njit(**JIT)
    def token_prep(state, w, x, c, th, beta, bt, alpha, dt_bias, ad, z, zt):
        # delta.token_prep as it was: a channel's taps innermost
        K, C = w.shape
        for i in range(C):
            acc = w[0, i] * state[0, i]
            for j in range(1, K - 1):
                acc += w[j, i] * state[j, i]
            acc += w[K - 1, i] * x[i]
            for j in range(K - 2):
                state[j, i] = state[j + 1, i]
            state[K - 2, i] = x[i]
            c[i] = acc
            th[i] = acc * F32(0.5)
        for h in range(beta.size):
            bt[h] = beta[h] * F32(0.5)
            ad[h] = alpha[h] + dt_bias[h]
        for i in range(z.size):
            zt[i] = z[i] * F32(0.5)

    return token_prep


_OLD = {}


def _old_many(kernel):
    """The static-split kernel of the products `kernel` (a rowdot.many_kernel) makes, built once."""
    from strata.engine.kernels import rowdot

    if kernel not in _OLD:
        key = next(k for k, v in rowdot._MANY.items() if v is kernel)
        src, cached = rowdot._MANY_SRC, rowdot.cached
        rowdot._MANY_SRC, rowdot.cached = OLD_MANY_SRC, lambda d, tag, also=(): d  # no disk cache: same tags
        try:
            _OLD[kernel] = rowdot._many_kernel(*key)
        finally:
            rowdot._MANY_SRC, rowdot.cached = src, cached
    return _OLD[kernel]


@contextlib.contextmanager
def before():
    """The token path as it was: the static split of a token's products, the taps innermost, the
    routed experts through the token's Groups."""
    from strata.engine.kernels import cpu, delta
    from strata.engine.moe import MoE

    if "prep" not in _OLD:
        _OLD["prep"] = _old_token_prep()
    call, prep = cpu.TokenProducts.__call__, delta.token_prep

    def old_call(self, *a):
        if self.one:
            return call(self, *a)
        k = self.kernel
        self.kernel = _old_many(k)
        try:
            return call(self, *a)
        finally:
            self.kernel = k

    routed = MoE._token_products
    cpu.TokenProducts.__call__, delta.token_prep, MoE._token_products = old_call, _OLD["prep"], lambda self, x, top: None
    try:
        yield
    finally:
        cpu.TokenProducts.__call__, delta.token_prep, MoE._token_products = call, prep, routed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen4exp", choices=("qwen4exp", "qwen35moe"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--preset", default=D.PRESET, help="synthetic model preset (tools/synth.py)")
    args = ap.parse_args(argv)

    from strata.engine.kernels import cpu
    from strata.engine.model import Model
    from strata.engine.pack_reader import Pack

    cpu.set_threads(args.threads)
    model = Model(Pack.open(D.ensure_pack(args.arch, args.preset)))
    with before():
        model.warm_up(prompt_path=False)
    model.warm_up(prompt_path=False)
    D.pretouch(model)
    # the new kernels must not move a bit: every logit of every step, both ways
    ids = np.random.default_rng(99).integers(0, model.geometry.n_vocab, args.prompt + args.tokens).tolist()
    logits = {}
    for name, ctx in (("before", before), ("after", contextlib.nullcontext)):
        with ctx():
            s = model.new_session(len(ids))
            logits[name] = np.stack([model.step(s, tok).copy() for tok in ids])
    same = np.array_equal(logits["before"].view(np.uint32), logits["after"].view(np.uint32))
    print(f"logits of {len(ids)} token steps, before vs after: {'identical to the bit' if same else 'DIFFERENT'}", flush=True)
    if not same:
        return 1
    bw = max(D.read_bandwidth(args.threads).values())
    for name, ctx in (("before", before), ("after", contextlib.nullcontext)):
        with ctx():
            timers = D.instrument(model)
            steps = D.decode(model, args.prompt, args.tokens, timers)
            print(f"--- {name} (instrumented pass)\n" + D.report(model, timers, steps, bw, args.threads, args.preset) + "\n")
            D.uninstrument(timers)
    rows, res = [], {"before": ([], []), "after": ([], [])}
    for r in range(args.rounds):
        for name, ctx in (("before", before), ("after", contextlib.nullcontext)):
            with ctx():
                steps, cpu_s = D.plain_decode(model, args.prompt, args.tokens, seed=r)
            res[name][0].append(1e3 * sum(steps) / args.tokens)
            res[name][1].append(1e3 * cpu_s / args.tokens)
        b, a = res["before"], res["after"]
        rows.append([r + 1, f"{b[0][-1]:.1f}", f"{a[0][-1]:.1f}", f"{b[0][-1] / a[0][-1]:.2f}x", f"{b[1][-1]:.1f}", f"{a[1][-1]:.1f}",
                     f"{b[1][-1] / a[1][-1]:.2f}x"])
    med = {k: (float(np.median(v[0])), float(np.median(v[1]))) for k, v in res.items()}
    rows.append(["median", f"{med['before'][0]:.1f}", f"{med['after'][0]:.1f}", f"{med['before'][0] / med['after'][0]:.2f}x",
                 f"{med['before'][1]:.1f}", f"{med['after'][1]:.1f}", f"{med['before'][1] / med['after'][1]:.2f}x"])
    from tabulate import tabulate

    print(f"{D.machine()}; {args.threads} threads, {args.tokens} token steps after {args.prompt} prompt tokens per round, interleaved")
    print(tabulate(rows, headers=["round", "before ms/token", "after ms/token", "speed-up", "before CPU ms/token",
                                  "after CPU ms/token", "CPU speed-up"], tablefmt="github"))
    print(per_step(model, args.prompt, 2 * args.tokens))
    return 0


def per_step(model, prompt_len: int, n_tokens: int) -> str:
    """Before and after alternated token step by token step (two sessions, the same ids, the order
    swapped every step): a load that comes and goes on a shared host hits both alike, where a round
    of 32 steps of one then the other can catch it in one only (2026-12-01: five 1-thread rounds
    gave 0.82-0.97x, the same trees alternated per step 1.00x)."""
    ids = np.random.default_rng(7).integers(0, model.geometry.n_vocab, prompt_len + n_tokens).tolist()
    modes = {"before": before, "after": contextlib.nullcontext}
    sessions = {k: model.new_session(len(ids)) for k in modes}
    wall, cpu_s = {k: [] for k in modes}, {k: [] for k in modes}
    for i, tok in enumerate(ids):
        for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
            with modes[name]():
                c0, t0 = time.process_time(), time.perf_counter()
                model.step(sessions[name], tok)
                if i >= prompt_len:
                    wall[name].append(time.perf_counter() - t0)
                    cpu_s[name].append(time.process_time() - c0)
    b, a = (float(np.median(wall[k])) for k in ("before", "after"))
    bc, ac = (float(np.median(cpu_s[k])) for k in ("before", "after"))
    return (f"alternated per step, {n_tokens} steps each: median before {1e3 * b:.1f} ms, after {1e3 * a:.1f} ms = {b / a:.2f}x; "
            f"CPU {1e3 * bc:.1f} -> {1e3 * ac:.1f} ms = {bc / ac:.2f}x")


if __name__ == "__main__":
    sys.path.insert(0, str(D.REPO / "benchmarks"))
    sys.exit(main())
