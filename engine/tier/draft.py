"""The MTP draft head on the device step (--spec N with the MTP drafter, --gpu-step device).

The head (engine/mtp.py) is one full-attention MoE block and the LM head. On the CPU a draft reads
the LM head's matrix with the host's bandwidth (seed-4l: 248320 x 2560 weights, some 0.5 GB, tens
of milliseconds at tens of GB/s) beside a trunk whose token step takes ~1 ms on the card, so every
draft cost many of the steps it was meant to save. With the device step it runs on the card:

    - its matrices are placed with the trunk's weights at stage 1 (budget: weights.drafter);
    - at stage 7 (budget: draft.bind) its routed experts all go into slots of their own (one per
      expert, the trunk's slot layout, so the token path's kernels read them: the head's layer is
      row n_layer of a slot table of n_layer + 1 rows), its KV cache and rope table are made, and
      it gets a backend of its own (DeviceBackend.companion: its own position and scratch, so a
      draft moves nothing the trunk's captured steps read);
    - the trunk's rows it reads and the draft logits cross to the host, where the drafter decides
      (the top probability against --spec-min-p, the pick).

The head's routed experts never miss (all resident), so its MoE takes the token path's launches with
no host part; a catch-up over many rows (after the prompt) takes the prompt path's grouped launches,
in pieces of the prompt chunk the tier planned buffers for (it borrows them: the trunk's chunk has
finished with them by then, on the same stream).
"""

from __future__ import annotations

import numpy as np

from ..mtp import MTPHead
from .device import DeviceBackend, DeviceExperts
from .hits import HitStats
from .memory import Carver
from .slots import ExpertSlots


class DraftHits:
    """What DeviceExperts reads of a hit path, for the head's one MoE layer: the slots (all of its
    experts resident), its own counts, the trunk's prompt buffers (borrowed, see the module)."""

    layers = None  # (no layer stream: every expert is resident)
    staging = None

    def __init__(self, slots: ExpertSlots, prompt):
        self.slots, self.prompt = slots, prompt
        self.stats = HitStats.empty(slots.n_layer)

    @staticmethod
    def routed(moe, x, experts: np.ndarray, rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """A chunk the borrowed buffers cannot hold (none planned: --prefill 0): on the CPU, the
        experts read in place from the GGUF (MoE.products: the same bits)."""
        return moe.products(x, experts, rows, starts)


def place_draft_head(rt, model, device: DeviceBackend, arena: Carver, slot_bytes: int, staging, max_context: int,
                     kv: str, piece: int, batch: int = 1) -> MTPHead:
    """Stage 7's part for the head: its experts into `arena` (n_expert slots), its backend, its KV
    caches (one a request of strata serve's --batch, handed to the drafters: MTPHead.new_state) and
    its rope table, all as planned. `piece`: the most rows a forward of the head takes at once (the
    prompt chunk; 0: all)."""
    g = model.geometry
    X = g.n_expert
    slots = ExpertSlots(rt, model, arena.array((X * slot_bytes,), np.uint8), X, slot_bytes, staging, n_layer=g.n_layer + 1)
    slots.fill([[] for _ in range(g.n_layer)] + [list(range(X))])
    be = device.companion()
    be.experts = DeviceExperts(rt, DraftHits(slots, device.experts.hits.prompt), be)
    be._ctx = max_context  # (its rope table holds the whole context from the start: made below, not at a draft)
    head = MTPHead(model.pack, be)
    head.piece = piece
    head.spares = [head.attn.new_state(be, max_context, kv) for _ in range(batch)]
    head.kept = batch
    be._rope_table(head.attn.rope, max_context)
    return head
