"""The staging area: a prompt chunk's experts that no slot holds, streamed to the device.

A prompt chunk routes many tokens to some experts. Where one that is not resident gets at least
`min_tokens` of them, the hit path (hits.py) copies its blocks from the mapped GGUF (the pages the
CPU would read) into one of two device slots here and computes it with the hits' kernels, so its
rows have the hits' bits, which are the CPU's. Below the threshold the CPU computes it beside the
device in the misses' one grouped call.

Double-buffered: buffer b's blocks are widened to engine form into pinned host slot b (host work)
and copied to device slot b on a second stream while the current stream runs the products of the
other buffer's expert. Markers (CUDA events) order the two: a copy into device slot b waits for the
products that read its previous expert (`free[b]`), the products wait for their copy (`copied[b]`),
and the host writes pinned slot b again only once its previous copy is done. Both buffers, device
and pinned, are plan items (engine/budget.py: stream.staging and stream.pinned).
"""

from __future__ import annotations

import math
import time

from ..budget import STAGING_BUFFERS
from ..kernels import gpu
from ..kernels.engine_form import placed_bytes

# --stream-min-tokens auto, a rough model until the card measures it (docs/gpu-tier.md): streaming
# an expert costs its bytes once per chunk, at the slower of the bus and the host's widening of its
# blocks into the pinned slot (measured at startup: numpy, one thread, ~1.3 GB/s for seed-4l's
# IQ2_XS/IQ4_NL experts on the 2-core dev machine, 0.71 GB/s on the H200's host; 2.5-2.9 GB/s here
# since widen writes straight into the slot with each type's column runs found once: still far
# below a 25 GB/s pinned copy, so the host, not the bus, is the cost: it took ~1.8 ms an expert
# before, what the CPU takes for ~15 of its tokens on one thread); the CPU costs about 3 E F
# multiply-adds per token routed to it. So
# streaming pays from
#   T >= bytes_per_mac * threads * cpu_rate / min(bus_rate, widen_rate)
# tokens, and the default takes twice that: a partly measured model should err towards the CPU,
# whose time is known. (The widening also runs on the thread that computes the CPU's experts.)
STREAM_BUS_BYTES_S = 25e9  # a pinned host->device copy over PCIe 4.0/5.0 x16, of the order measured
# int8 multiply-adds per second of one CPU thread in the grouped expert kernels: seed-4l's IQ2_XS/IQ4_NL
# expert on this 2-core machine did 21-40 G per thread at 4-16 tokens (1 thread), 12-49 G at 2 threads
STREAM_CPU_MACS_S = 30e9


def auto_min_tokens(slot_bytes: int, n_embd: int, n_ff: int, threads: int, widen_bytes_s: float = STREAM_BUS_BYTES_S) -> int:
    """--stream-min-tokens auto: the tokens from which streaming an expert beats the CPU (x2, above)."""
    bytes_per_mac = slot_bytes / (3 * n_embd * n_ff)
    rate = min(STREAM_BUS_BYTES_S, widen_bytes_s)
    return max(1, 2 * math.ceil(bytes_per_mac * threads * STREAM_CPU_MACS_S / rate))


class Staging:
    """Two device slots and two pinned host slots (plan items stream.staging, stream.pinned)."""

    def __init__(self, rt, pack, arena, pinned, slot_bytes: int, n_embd: int, n_ff: int, min_tokens: int):
        if arena is None or arena.size < STAGING_BUFFERS * slot_bytes or pinned.size < STAGING_BUFFERS * slot_bytes:
            raise RuntimeError("the staging area's plan items do not hold two slots: engine/budget.py and "
                               "engine/tier/ disagree")
        self.rt, self.pack, self.arena, self.pinned, self.slot = rt, pack, arena, pinned, slot_bytes
        self.E, self.F, self.min_tokens = n_embd, n_ff, min_tokens
        self.stream = rt.copy_stream()
        self.copied = [rt.marker() for _ in range(STAGING_BUFFERS)]  # buffer b's last copy is done
        self.free = [rt.marker() for _ in range(STAGING_BUFFERS)]  # the products reading buffer b ran
        self.used = [False] * STAGING_BUFFERS
        self.turn = 0

    def load(self, layer: int, e: int, down: bool) -> tuple[int, list, int]:
        """Expert e of `layer` into the next buffer: its gate and up, or its down. -> (buffer, the
        GpuWeights, bytes copied). The current stream's later work waits for the copy; call
        `done(buffer)` once the products that read it are queued."""
        rt, b = self.rt, self.turn
        self.turn = (b + 1) % STAGING_BUFFERS
        if self.used[b]:
            rt.host_wait(self.copied[b])  # pinned slot b is still being read by its previous copy until then
            rt.stream_wait(self.stream, self.free[b])  # device slot b is read by its previous expert's products
        gu, d = self.pack.expert_types(layer)
        gate, up, dn = self.pack.expert(layer, e)
        E, F, name = self.E, self.F, f"blk.{layer} expert {e} (streamed)"
        mats = [(dn, d.id, F, E, "down")] if down else [(gate, gu.id, E, F, "gate"), (up, gu.id, E, F, "up")]
        at, out = b * self.slot, []
        for raw, t, n_in, n_out, what in mats:
            n = placed_bytes(t, n_in, n_out)
            out.append(gpu.place(raw, t, n_in, n_out, self.arena, at, f"{name} {what}", self.pinned[at : at + n],
                                 stream=self.stream))
            at += n
        rt.mark_on(self.copied[b], self.stream)
        rt.stream_wait(None, self.copied[b])  # the products queued from now on read the copied blocks
        self.used[b] = True
        return b, out, at - b * self.slot

    def widen_rate(self, layer: int = 0, reps: int = 3) -> float:
        """Bytes per second the host widens an expert into a pinned slot (the best of `reps` loads of
        expert 0 of `layer`, its copies waited for); leaves the buffers as new."""
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            n = self.load(layer, 0, down=False)[2] + self.load(layer, 0, down=True)[2]
            best = min(best, time.perf_counter() - t0)
        self.rt.synchronize()
        self.used, self.turn = [False] * STAGING_BUFFERS, 0
        return n / max(best, 1e-9)

    def done(self, b: int) -> None:
        """The products reading buffer b are queued: its next copy waits for them."""
        self.rt.mark_on(self.free[b])
