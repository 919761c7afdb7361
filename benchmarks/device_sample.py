"""The device step's sampled pick: dev_sample on the device (only the token comes back) against the
logits row brought down and sampled by the host Sampler (what the device step did before), per
token, on synthetic logits rows of a real vocabulary (151,936 ids, Qwen3's).

    python benchmarks/device_sample.py [--vocab 151936] [--tokens 200] [--emulate]  (--emulate: a smoke
                                       run of the host emulation, tests/gpu_emu.py, at a small vocabulary)

Settings: llama.cpp's defaults (temp 0.8, top-k 40, top-p 0.95, min-p 0.05), the same with penalties,
temperature alone (top-k/p and min-p off: the whole vocabulary in the draw) and greedy (dev_argmax,
for scale). Each row is a fresh normal draw scaled to look like a model's logits. Prints one line per
setting: ms per token on the device path, on the host path, and whether every token agreed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--emulate", action="store_true", help="the host emulation of the kernels (a smoke run)")
    a = ap.parse_args(argv)
    from strata.engine.kernels import gpu
    from strata.engine.sampling import Sampler, SamplerParams
    from strata.engine.tier.device import DeviceBackend

    if a.emulate:
        sys.path.insert(0, str(REPO / "tests"))
        from gpu_emu import EmuRuntime

        rt = EmuRuntime()
        V, n = min(a.vocab, 4096), min(a.tokens, 10)
    else:
        ok, why = gpu.available()
        if not ok:
            print(f"device_sample: no GPU ({why}); --emulate runs the host emulation", file=sys.stderr)
            return 2
        rt, V, n = gpu.CupyRuntime(), a.vocab, a.tokens
    gpu.use_runtime(rt)
    be = DeviceBackend(rt, None)
    rng = np.random.default_rng(0)
    xs = [(rng.standard_normal(V) * 3).astype(np.float32) for _ in range(8)]
    dev_rows = [rt.to_device(x[None]) for x in xs]
    penalties = dict(repeat_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1)
    settings = {"defaults": SamplerParams(seed=1), "defaults + penalties": SamplerParams(seed=1, **penalties),
                "temp 0.8 alone": SamplerParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=1),
                "greedy": SamplerParams(temperature=0, seed=1)}
    print(f"vocabulary {V}, {n} tokens a setting, {'emulation' if a.emulate else 'CUDA'}")
    for name, p in settings.items():
        times, tokens = {}, {}
        start = list(rng.integers(0, V, 64))
        for where in ("device", "host"):
            sampler = Sampler(V, p)
            host_row = np.empty(V, np.float32)
            pinned = rt.pinned(V * 4).view(np.float32).reshape(1, V)
            hist = list(start)
            got = []
            for i in range(n + 2):  # (the first two: buffers and kernel loads, not timed)
                if i == 2:
                    rt.synchronize()
                    t0 = time.perf_counter()
                be._logits = dev_rows[i % len(dev_rows)]
                if where == "device" and sampler.pick is not None:
                    got.append(be._greedy(sampler.pick))
                elif where == "device":
                    got.append(be._sample(sampler.device_draw(np.array(hist), host_row)))
                else:
                    rt.copy_out(pinned, be._logits)
                    got.append(sampler.sample(pinned[0], np.array(hist)))
                hist.append(got[-1])
            times[where] = (time.perf_counter() - t0) / n
            tokens[where] = got
        same = tokens["device"] == tokens["host"]
        print(f"{name:22s} device {times['device'] * 1e3:7.3f} ms/token   host (logits down + Sampler) "
              f"{times['host'] * 1e3:7.3f} ms/token   same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
