"""Which stored weight is not a finite number: tensor, layer and expert named.

A NaN or inf in a weight (an F32 norm, an fp16 block scale) passes every size, offset and
fingerprint check; a run then stops at "non-finite activation ... at index (0,)" naming nothing the
user can act on. `strata-pack verify` scans with this (the dense tensors always, the experts with
--full), and the commands scan when a run meets a non-finite value, to say where it came from.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from .kernels.engine_form import first_non_finite

_LAYER = re.compile(r"^blk\.(\d+)\.")


def layer_of(name: str) -> str:
    """'blk.3.attn_norm.weight' -> 'blk.3.attn_norm.weight (layer 3)'."""
    m = _LAYER.match(name)
    return f"{name} (layer {m.group(1)})" if m else name


def non_finite_weights(pack, *, experts: bool = True) -> Iterator[str]:
    """One line per tensor holding a NaN/inf (its first one): dense tensors in engine form, then, with
    `experts`, every expert layer's gate, up and down (expert e's bytes are the e-th of n_expert)."""
    for name, w in pack.weights.items():
        hit = first_non_finite(w.raw, w.type.id)
        if hit is not None:
            yield f"{layer_of(name)}: {hit[1]} is {hit[2]} (expected finite weights)"
    if not experts:
        return
    g = pack.geometry
    for layer in sorted({e.layer for e in pack.experts.layers}):
        gu, d = pack.expert_types(layer)
        for role, raw, t in zip(("gate", "up", "down"), pack.expert_tensors(layer), (gu, gu, d)):
            hit = first_non_finite(raw, t.id)
            if hit is not None:
                per_expert = raw.size // g.n_expert // t.type_size  # blocks (or elements) of one expert
                name = f"blk.{layer}.ffn_{role}_exps.weight"
                yield (f"{name} (layer {layer}, expert {hit[0] // per_expert}): {hit[1]} of the tensor is {hit[2]} "
                       "(expected finite weights)")


def explain(pack) -> str:
    """What to append to a non-finite value met in a run: the weights that hold one, or that none does."""
    found = list(non_finite_weights(pack))
    if not found:
        return "no stored weight is NaN/inf: the engine produced it (a bug: please report it with the pack)"
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return "the pack's weights hold non-finite values: " + "; ".join(found[:3]) + more
