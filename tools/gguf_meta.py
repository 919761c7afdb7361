"""GGUF metadata -> ModelGeometry, the one place that knows llama.cpp's key names.

Keys are those llama.cpp's converter writes (gguf-py constants.py, conversion/qwen.py and
conversion/qwen4exp.py). What the GGUF does not store is fixed per architecture here, with the
reason, rather than guessed later in a kernel (BRIEF section 2, "Not stored in the GGUF").
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Mapping

from strata.index_format.geometry import (
    ARCHS, MTP_OPTIONAL, GeometryError, ModelGeometry, check_layer_arrays, mtp_notes,
)
from strata.tools.gguf_io import GGUFFile, TensorInfo

# Not in the GGUF, fixed by the released models (BRIEF section 2): the GDN output-gate activation
# (sigmoid for qwen4exp as released, silu for qwen35moe); norm_topk_prob is true for both.
OUTPUT_GATE_ACT = {"qwen4exp": "sigmoid", "qwen35moe": "silu"}


@dataclass(frozen=True)
class GeometryReading:
    geometry: ModelGeometry
    warnings: tuple[str, ...]  # disagreements found and resolved (reported, never silent)


def _u(f: GGUFFile, key: str) -> int:
    v = f.require(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise GeometryError(f"{f.path.name}: metadata {key} is {v!r}, expected an integer")
    return v


def _ints(f: GGUFFile, key: str, default=()) -> tuple[int, ...]:
    v = f.get(key, default)
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) for x in v):
        raise GeometryError(f"{f.path.name}: metadata {key} is {v!r}, expected an integer array")
    return tuple(int(x) for x in v)


def _mtp_layers(main: GGUFFile, k) -> int:
    """nextn_predict_layers: MTP draft blocks the converter appends after the trunk (block_count
    counts them). llama.cpp's converter exports a Qwen3.5-MoE checkpoint's MTP block by default."""
    n = main.get(k("nextn_predict_layers"), 0)
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < _u(main, k("block_count")):
        raise GeometryError(f"{main.path.name}: metadata {k('nextn_predict_layers')} is {n!r}, expected an integer "
                            f"in 0..block_count - 1")
    return n


def _trunk_recurrent_layers(main: GGUFFile, k, n_mtp: int) -> tuple[int, ...]:
    """The trunk's part of attention.recurrent_layers; the MTP blocks' entries must say full attention."""
    flags = tuple(int(bool(x)) for x in main.get(k("attention.recurrent_layers"), ()))
    if not flags or not n_mtp:
        return flags
    n_trunk = len(flags) - n_mtp
    if any(flags[n_trunk:]):
        raise GeometryError(f"{main.path.name}: attention.recurrent_layers marks MTP layer(s) "
                            f"{[l for l in range(n_trunk, len(flags)) if flags[l]]} recurrent; an MTP block is "
                            "full attention")
    return flags[:n_trunk]


def geometry_from_gguf(
    main: GGUFFile,
    tensors: Mapping[str, TensorInfo],
    *,
    compress_ratio: int | None = None,
    mtp: GGUFFile | None = None,
) -> GeometryReading:
    """Build the geometry from the main shard's metadata and the shapes of all shards' tensors.

    `compress_ratio` supplies the QSA block size when the file has lost it (see below). `mtp`: a
    separate MTP-only GGUF (llama.cpp's `convert_hf_to_gguf.py --mtp`) carrying the draft block of a
    trunk converted without one; its block's tensors must be in `tensors`.
    """
    if mtp is not None:
        return _with_mtp_gguf(main, tensors, mtp, compress_ratio)
    arch = main.require("general.architecture")
    if arch not in ARCHS:
        raise GeometryError(
            f"{main.path.name}: general.architecture is {arch!r}; Strata runs {', '.join(ARCHS)}"
        )
    k = lambda s: f"{arch}.{s}"  # noqa: E731
    n_mtp = _mtp_layers(main, k)
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise GeometryError(f"{main.path.name}: tensor token_embd.weight is missing")
    values: dict[str, object] = dict(
        arch=arch,
        n_vocab=emb.shape[1] if len(emb.shape) > 1 else 0,
        n_embd=_u(main, k("embedding_length")),
        n_layer=_u(main, k("block_count")) - n_mtp,
        full_attention_interval=_u(main, k("full_attention_interval")),
        rms_eps=float(main.require(k("attention.layer_norm_rms_epsilon"))),
        n_head=_u(main, k("attention.head_count")),
        n_head_kv=_u(main, k("attention.head_count_kv")),
        head_dim=_u(main, k("attention.key_length")),
        n_rot=_u(main, k("rope.dimension_count")),
        rope_freq_base=float(main.require(k("rope.freq_base"))),
        rope_sections=_ints(main, k("rope.dimension_sections")),
        ssm_d_conv=_u(main, k("ssm.conv_kernel")),
        ssm_d_state=_u(main, k("ssm.state_size")),
        ssm_n_k_heads=_u(main, k("ssm.group_count")),
        ssm_n_v_heads=_u(main, k("ssm.time_step_rank")),
        ssm_d_inner=_u(main, k("ssm.inner_size")),
        n_expert=_u(main, k("expert_count")),
        n_expert_used=_u(main, k("expert_used_count")),
        n_ff_exp=_u(main, k("expert_feed_forward_length")),
        n_ff_shexp=int(main.get(k("expert_shared_feed_forward_length"), 0)),
        recurrent_layers=_trunk_recurrent_layers(main, k, n_mtp),
        n_mtp_layer=n_mtp,
        **_mtp_optional(tensors, _u(main, k("block_count")) - n_mtp, n_mtp),
        n_ctx_train=_u(main, k("context_length")) if main.get(k("context_length")) is not None else 0,
    )
    warnings: list[str] = []
    value_len = main.get(k("attention.value_length"))
    if value_len is not None and value_len != values["head_dim"]:
        raise GeometryError(
            f"{main.path.name}: attention.value_length {value_len} != key_length {values['head_dim']}; "
            "Strata's attention kernels assume equal key and value head dims"
        )
    if arch == "qwen4exp":
        values.update(_qwen4exp_values(main, tensors, k, values, compress_ratio, warnings))
    g = ModelGeometry.from_values(values, source=main.path.name)
    warnings += check_layer_arrays(g) + mtp_notes(g)
    return GeometryReading(g, tuple(warnings))


def _mtp_optional(tensors: Mapping[str, TensorInfo], n_layer: int, n_mtp: int) -> dict[str, int]:
    """Which of the MTP block's optional nextn tensors the files carry (see ModelGeometry)."""
    return {field: int(bool(n_mtp) and f"blk.{n_layer}.{name}" in tensors) for field, name in MTP_OPTIONAL.items()}


# Fields an MTP-only GGUF may not agree on with its trunk: the MTP block itself.
_MTP_OWN = {"n_mtp_layer", *MTP_OPTIONAL}


def check_mtp_pairing(main: GGUFFile, mtp: GGUFFile) -> None:
    """The metadata checks of a main GGUF and a separate MTP-only GGUF (`--mtp`), made before their
    tensors are read together (a wrong pairing would otherwise surface as a clash of names)."""
    arch = main.get("general.architecture")
    if arch != "qwen35moe":
        # the release ships qwen4exp's head separately, but in no GGUF layout: llama.cpp's qwen4exp
        # converter drops the MTP block (supports_mtp_export False) and its tensor list has no nextn.*
        raise GeometryError(f"--mtp {mtp.path.name}: the main GGUF {main.path.name} is {arch}, for which no GGUF "
                            "layout of an MTP block is defined (llama.cpp's converter exports none for it); Strata "
                            "packs qwen35moe's MTP block only")
    n = main.get(f"{arch}.nextn_predict_layers")
    if n:
        raise GeometryError(f"--mtp {mtp.path.name}: the main GGUF {main.path.name} already carries an MTP block "
                            f"(nextn_predict_layers {n}); --mtp is for a trunk converted without one")
    other = mtp.get("general.architecture")
    if other != arch:
        raise GeometryError(f"--mtp {mtp.path.name}: general.architecture is {other!r}, the main GGUF's is {arch!r}; "
                            "expected the MTP-only GGUF of the same model")
    if not mtp.get(f"{arch}.nextn_predict_layers"):
        raise GeometryError(f"--mtp {mtp.path.name}: metadata {arch}.nextn_predict_layers is missing or 0, so the file "
                            "carries no MTP block (expected an MTP-only GGUF: llama.cpp's convert_hf_to_gguf.py --mtp)")


def _with_mtp_gguf(main: GGUFFile, tensors: Mapping[str, TensorInfo], mtp: GGUFFile,
                   compress_ratio: int | None) -> GeometryReading:
    """The trunk's geometry from `main`, the MTP block's from `mtp`, which must describe the same model.

    An MTP-only GGUF is written by the same converter class as the trunk (conversion/qwen.py
    _QwenMtpMixin with mtp_only): the same metadata, block_count n_layer + 1, nextn_predict_layers,
    and only token_embd, output_norm, output and blk.{n_layer}.*; so every geometry field but the
    MTP block's own must equal the trunk's. A file of another model differs in at least one of them."""
    check_mtp_pairing(main, mtp)
    trunk = geometry_from_gguf(main, tensors, compress_ratio=compress_ratio)
    g = trunk.geometry
    head = geometry_from_gguf(mtp, mtp.tensors, compress_ratio=compress_ratio).geometry
    for f in fields(ModelGeometry):
        if f.name not in _MTP_OWN and getattr(head, f.name) != getattr(g, f.name):
            raise GeometryError(f"--mtp {mtp.path.name}: its {f.name} is {getattr(head, f.name)!r}, the main GGUF "
                                f"{main.path.name} has {getattr(g, f.name)!r}: the MTP GGUF is of another model")
    values = g.to_values() | {n: getattr(head, n) for n in _MTP_OWN}
    merged = ModelGeometry.from_values(values, source=mtp.path.name)
    return GeometryReading(merged, trunk.warnings + tuple(mtp_notes(merged)))


def _qwen4exp_values(main, tensors, k, base, compress_ratio, warnings) -> dict[str, object]:
    v: dict[str, object] = dict(
        hc=_u(main, k("hyper_connection.count")),
        hc_lowrank=_u(main, k("hyper_connection.low_rank")),
        compress_ratios=_ints(main, k("attention.compress_ratios")),
    )
    n_layer, interval = base["n_layer"], base["full_attention_interval"]
    full = [l for l in range(n_layer) if l % interval == interval - 1]
    has_indexer = [l for l in full if f"blk.{l}.indexer.k_proj.weight" in tensors]
    if has_indexer and len(has_indexer) != len(full):
        raise GeometryError(
            f"{main.path.name}: QSA indexer tensors on layers {has_indexer} but full-attention layers are {full}"
        )
    if has_indexer:
        ratios = {r for r in v["compress_ratios"] if r}
        if len(ratios) > 1:
            raise GeometryError(f"{main.path.name}: attention.compress_ratios mixes block sizes {sorted(ratios)}")
        stored = ratios.pop() if ratios else None
        if compress_ratio is not None and stored is not None and compress_ratio != stored:
            raise GeometryError(
                f"--compress-ratio {compress_ratio} disagrees with the file's attention.compress_ratios ({stored})"
            )
        ratio = compress_ratio if compress_ratio is not None else stored
        if ratio is None:
            raise GeometryError(
                f"{main.path.name}: layers {full} carry QSA indexer tensors but attention.compress_ratios is "
                "all zeros, so the QSA block size is not in the file (a known converter bug: transformers "
                "renames full_attention to indexed_attention). Pass --compress-ratio N, the model's "
                "indexer_compress_ratio from its config.json."
            )
        v.update(
            idx_n_heads=_u(main, k("attention.indexer.head_count")),
            idx_head_dim=_u(main, k("attention.indexer.key_length")),
            idx_top_k=_u(main, k("attention.indexer.top_k")),
            idx_compress_ratio=ratio,
        )
    ple_layers = _ints(main, k("ple.layers"))
    if ple_layers:
        table = tensors.get("per_layer_token_embd.weight")
        if table is None:
            raise GeometryError(
                f"{main.path.name}: ple.layers is {list(ple_layers)} but no shard holds per_layer_token_embd.weight "
                "(pass the PLE shard with --ple-gguf)"
            )
        v.update(
            ple_layers=ple_layers,
            ple_ngram_size=_u(main, k("ple.ngram_size")),
            ple_heads_per_ngram=_u(main, k("ple.heads_per_ngram")),
            ple_conv_kernel=_u(main, k("ple.conv_kernel")),
            ple_eos_token_id=_u(main, k("ple.eos_token_id")),
            ple_row_dim=table.shape[0],
            ple_table_rows=table.shape[1],
            ple_multipliers=_ints(main, k("ple.layer_multipliers")),
            ple_head_offsets=_ints(main, k("ple.head_offsets")),
            ple_head_vocab_sizes=_ints(main, k("ple.head_vocab_sizes")),
        )
    return v
