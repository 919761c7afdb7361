"""The one table of GGML tensor types Strata knows.

Every size is written as the sum of the block's fields, in the order the block stores them
(ggml/src/ggml-common.h), so the layout explains itself; `_check_table()` pins each sum at
import, as ggml-common.h pins its structs with static_assert.

`fp16_fields` lists the (byte offset, count) of every IEEE half inside a block: the scales
and mins. The engine form (S3) widens exactly these to f32 planes and keeps the remaining bytes
as they are; a budget that assumed 4 bytes per scale instead of reading this table made the plane
arithmetic disagree with the pack for a whole round (seed, 6.3).

Type 42 (Q2_0, QK 64) is in llama.cpp but not in PyPI's gguf 0.19.0, which is why this table,
and not gguf's enum, is what the project reads.
"""

from __future__ import annotations

from dataclasses import dataclass

QK_K = 256


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_size: int  # elements per block
    type_size: int  # bytes per block
    fp16_fields: tuple[tuple[int, int], ...] = ()  # (byte offset in block, number of halves)
    quantized: bool = True

    @property
    def n_scales(self) -> int:
        """fp16 values per block that the engine form widens to f32."""
        return sum(n for _, n in self.fp16_fields)

    @property
    def rest_bytes(self) -> int:
        """Bytes per block left after the fp16 fields are moved to the scale plane."""
        return self.type_size - 2 * self.n_scales

    @property
    def engine_block_bytes(self) -> int:
        """Bytes per block in the engine form: f32 scale plane share + the remaining bytes."""
        return self.rest_bytes + 4 * self.n_scales

    def row_bytes(self, n_elements: int) -> int:
        if n_elements % self.block_size:
            raise ValueError(
                f"{self.name}: a row of {n_elements} elements is not a whole number of "
                f"{self.block_size}-element blocks"
            )
        return n_elements // self.block_size * self.type_size

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of a tensor of `shape` (GGUF order: shape[0] is the contiguous row length)."""
        rows = 1
        for d in shape[1:]:
            rows *= d
        return self.row_bytes(shape[0]) * rows


def _t(id, name, block_size, type_size, fp16_fields=(), quantized=True):
    return GGMLType(id, name, block_size, type_size, tuple(fp16_fields), quantized)


H = 2  # sizeof(ggml_half)

# fmt: off
TYPES: tuple[GGMLType, ...] = (
    _t(0,  "F32",  1, 4, quantized=False),
    _t(1,  "F16",  1, 2, quantized=False),
    _t(30, "BF16", 1, 2, quantized=False),
    #                      d    qs
    _t(2,  "Q4_0", 32,     H + 32 // 2,                              [(0, 1)]),
    #                      d    m    qs
    _t(3,  "Q4_1", 32,     H + H + 32 // 2,                          [(0, 2)]),
    #                      d    qh   qs
    _t(6,  "Q5_0", 32,     H + 4 + 32 // 2,                          [(0, 1)]),
    #                      d    m    qh   qs
    _t(7,  "Q5_1", 32,     H + H + 4 + 32 // 2,                      [(0, 2)]),
    #                      d    qs
    _t(8,  "Q8_0", 32,     H + 32,                                   [(0, 1)]),
    #                      scales       qs          d    dmin
    _t(10, "Q2_K", QK_K,   QK_K // 16 + QK_K // 4 + H + H,           [(QK_K // 16 + QK_K // 4, 2)]),
    #                      hmask       qs          scales d
    _t(11, "Q3_K", QK_K,   QK_K // 8 + QK_K // 4 + 12 + H,           [(QK_K // 8 + QK_K // 4 + 12, 1)]),
    #                      d    dmin scales qs
    _t(12, "Q4_K", QK_K,   H + H + 12 + QK_K // 2,                   [(0, 2)]),
    #                      d    dmin scales qh          qs
    _t(13, "Q5_K", QK_K,   H + H + 12 + QK_K // 8 + QK_K // 2,       [(0, 2)]),
    #                      ql          qh          scales(i8)  d
    _t(14, "Q6_K", QK_K,   QK_K // 2 + QK_K // 4 + QK_K // 16 + H,   [(QK_K // 2 + QK_K // 4 + QK_K // 16, 1)]),
    #                      d    qs (u16 x QK_K/8)
    _t(16, "IQ2_XXS", QK_K, H + QK_K // 4,                           [(0, 1)]),
    #                      d    qs (u16 x QK_K/8) scales
    _t(17, "IQ2_XS", QK_K, H + QK_K // 4 + QK_K // 32,               [(0, 1)]),
    #                      d    qs(grid+signs, 3*QK_K/8)
    _t(18, "IQ3_XXS", QK_K, H + QK_K // 4 + QK_K // 8,               [(0, 1)]),
    #                      d    qs          qh (u16 x QK_K/32)
    _t(19, "IQ1_S", QK_K,  H + QK_K // 8 + QK_K // 16,               [(0, 1)]),
    #                      d    qs
    _t(20, "IQ4_NL", 32,   H + 32 // 2,                              [(0, 1)]),
    #                      d    qs          qh          signs       scales
    _t(21, "IQ3_S", QK_K,  H + QK_K // 4 + QK_K // 32 + QK_K // 8 + QK_K // 64, [(0, 1)]),
    #                      d    qs(grid+signs) qh       scales
    _t(22, "IQ2_S", QK_K,  H + QK_K // 4 + QK_K // 32 + QK_K // 32, [(0, 1)]),
    #                      d    scales_h scales_l   qs
    _t(23, "IQ4_XS", QK_K, H + 2 + QK_K // 64 + QK_K // 2,           [(0, 1)]),
    # IQ1_M has no plain half: its fp16 scale is spread over the top nibbles of `scales`,
    # so there is nothing to widen in place; the kernels assemble it exactly.
    #                      qs          qh          scales
    _t(29, "IQ1_M", QK_K,  QK_K // 8 + QK_K // 16 + QK_K // 32),
    #                      d    qs (2 bits each)
    _t(42, "Q2_0", 64,     H + 64 // 4,                              [(0, 1)]),
)
# fmt: on

BY_ID: dict[int, GGMLType] = {t.id: t for t in TYPES}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in TYPES}

# Pinned from ggml-common.h's static_asserts (block bytes), so a slip in a sum above is caught at
# import rather than as a wrong offset in a pack.
_EXPECTED_TYPE_SIZE = {
    "F32": 4, "F16": 2, "BF16": 2, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34,
    "Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ2_XXS": 66, "IQ2_XS": 74,
    "IQ3_XXS": 98, "IQ1_S": 50, "IQ4_NL": 18, "IQ3_S": 110, "IQ2_S": 82, "IQ4_XS": 136,
    "IQ1_M": 56, "Q2_0": 18,
}


def _check_table() -> None:
    if set(_EXPECTED_TYPE_SIZE) != set(BY_NAME) or len(BY_ID) != len(TYPES):
        raise AssertionError("ggml_types: names or ids duplicated or missing")
    for t in TYPES:
        if t.type_size != _EXPECTED_TYPE_SIZE[t.name]:
            raise AssertionError(f"ggml_types: {t.name} block is {t.type_size} B, ggml says {_EXPECTED_TYPE_SIZE[t.name]}")
        for off, n in t.fp16_fields:
            if off < 0 or off + 2 * n > t.type_size:
                raise AssertionError(f"ggml_types: {t.name} fp16 field at {off} x{n} outside the block")


_check_table()


class UnknownGGMLType(ValueError):
    pass


def ggml_type(key: int | str, *, where: str = "") -> GGMLType:
    """Look a type up by id or name; an unknown one is refused with the number/name and `where`."""
    t = BY_ID.get(key) if isinstance(key, int) else BY_NAME.get(key)
    if t is None:
        known = ", ".join(f"{x.name}={x.id}" for x in TYPES)
        raise UnknownGGMLType(f"{where + ': ' if where else ''}unknown GGML type {key!r} (Strata knows {known})")
    return t
