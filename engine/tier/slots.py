"""The expert slots: the slot storage on the device (plan item cache.slots), which (layer, expert) sits
in which slot (expert_plan.SlotMap), and the one fill from the profile."""

from __future__ import annotations

import numpy as np

from ..expert_plan import SlotMap
from ..kernels import gpu
from ..kernels.engine_form import placed_bytes


class ExpertSlots:
    """The slot storage (plan item cache.slots): slot s holds one expert's gate, up and down in
    engine form at s * slot_bytes. `map` says which (layer, expert) sits where (host, S9)."""

    def __init__(self, rt, model, arena, slots: int, slot_bytes: int, staging: np.ndarray | None, n_layer: int | None = None):
        """`n_layer`: the layers the map has rows for (default the trunk's; the MTP draft head's slots
        take one more, its layer n_layer: engine/tier/draft.py)."""
        g = model.geometry
        self.rt, self.pack, self.arena, self.slot_bytes, self.staging = rt, model.pack, arena, slot_bytes, staging
        self.E, self.F, self.n_expert = g.n_embd, g.n_ff_exp, g.n_expert
        self.n_layer = g.n_layer if n_layer is None else n_layer
        self.map = SlotMap(slots, self.n_layer, g.n_expert)
        self.weights: list[tuple | None] = [None] * slots

    @property
    def slots(self) -> int:
        return self.map.slots

    def fill(self, fill: list[list[int]]) -> None:
        """The one fill (S9): the plan's pairs, layer by layer; frozen afterwards (decode admits nothing)."""
        self.map = SlotMap.from_fill(fill, self.map.slots, self.n_expert)
        for layer in range(self.n_layer):
            for e in np.flatnonzero(self.map.table[layer] >= 0):
                self._load(layer, int(e), self.map.slot(layer, int(e)))

    def lookup(self, layer: int, e: int) -> int:
        """The slot of (layer, e), or -1: a miss. Without a profile the first routes fill free slots
        (compulsory misses: this token computes it on the CPU, the next ones on the GPU)."""
        s = self.map.slot(layer, e)
        if s >= 0 or self.map.frozen or self.map.used == self.map.slots:
            return s if s >= 0 else -1
        s = self.map.admit(layer, e)
        self._load(layer, e, s)
        return -1

    def _load(self, layer: int, e: int, s: int) -> None:
        gu, d = self.pack.expert_types(layer)
        gate, up, down = self.pack.expert(layer, e)
        at, E, F = s * self.slot_bytes, self.E, self.F
        name = f"blk.{layer} expert {e}"
        wg = gpu.place(gate, gu.id, E, F, self.arena, at, f"{name} gate", self.staging)
        at += placed_bytes(gu.id, E, F)
        wu = gpu.place(up, gu.id, E, F, self.arena, at, f"{name} up", self.staging)
        at += placed_bytes(gu.id, E, F)
        wd = gpu.place(down, d.id, F, E, self.arena, at, f"{name} down", self.staging)
        self.weights[s] = (wg, wu, wd)
