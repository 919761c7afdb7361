"""The expert-profile builder (`strata-profile`): run the engine over calibration text, count routing.

The profile decides, once and for the whole run, which experts live on the GPU (S9), so how it is
measured is part of the plan:

- Documents. The prompts file holds one document per PARAGRAPH: blocks of lines separated by one
  or more blank (or whitespace-only) lines; a paragraph's own line breaks are kept. Paragraphs rather
  than lines, so code, lists and poems stay whole; a file of one-line prompts separated by blank
  lines works too. Each document is tokenized with the pack's tokenizer and run as its own sequence
  (a fresh session), as a user's prompts are; one longer than the context is cut into consecutive
  windows of `ctx` tokens, each its own sequence.
- Held-out split (deterministic, by document): with fraction f and n documents, h = round(n * f)
  documents (at least 1, at most n - 1) are held out, evenly spaced through the file (document
  floor((j + 1/2) * n / h) for j = 0..h-1), so the two parts come from the same mix of text even
  when the file is ordered by topic. The held-out documents are run and counted apart: the profile
  holds the in-sample counts only, and the held-out counts score its hit rate on text it was not
  built from (published measurements on this model family found a static hot list far weaker on
  held-out text than in-sample).
- Token budget (`max_tokens`): the in-sample part gets max_tokens - h_b tokens and the held-out
  part h_b = round(max_tokens * f) (at least 1 when f > 0), each taken from its documents in file
  order, the last document taken cut short; both parts are therefore represented however small
  the budget.
- Counting. Every position of every document is fed (no logits are needed, so the prompt path
  computes no LM head) and the engine's own per-session routing counts (`Session.routing`, what
  `strata generate --stats` prints) are summed: tokens counted = positions fed, and every layer
  routes exactly tokens * top_k uses. The batched prompt path (chunk > 1) and token by token
  (chunk 1) run the same model: with F32 weights they count identically (tests/tools/test_profile.py).
  With block-quantized weights each path quantizes its own activations (ActQ), so a float32
  rounding difference can flip a router near-tie: on the quantized tiny qwen4exp 26 of 7200 routed
  uses moved between the paths, far below what changes a hit rate.
- Trace (`--trace`): the experts each in-sample position chose, layer by layer, in the router's
  order, streamed in document order; so `RoutingTrace.to_profile()` of it equals the profile.
  It is observed by wrapping each MoE block's router from outside (`RoutingObserver`) and checked
  against the session's own counts after every window: a router call the wrapper missed fails the
  run instead of writing a trace that disagrees with the profile.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata.engine.expert_plan import expected_hit_rate
from strata.engine.model import Model, Session
from strata.index_format.expert_profile import ExpertProfile
from strata.index_format.routing_trace import TraceWriter

SLOT_PERCENTS = (1, 2, 5, 10, 20, 30, 50, 60, 80, 100)  # slots as % of all (layer, expert) pairs


class ProfileInputError(ValueError):
    """Calibration input that cannot make a profile (no text, too few documents, a bad budget)."""


# --- the calibration text ----------------------------------------------------------------------------


def read_documents(path: str | os.PathLike) -> list[str]:
    """The documents of a prompts file: its paragraphs (blank-line separated), in file order."""
    from strata.engine.arguments import read_text

    text = read_text("--prompts", Path(path))
    docs, lines = [], []
    for line in text.splitlines():
        if line.strip():
            lines.append(line)
        elif lines:
            docs.append("\n".join(lines))
            lines = []
    if lines:
        docs.append("\n".join(lines))
    if not docs:
        raise ProfileInputError(f"{path}: no text (expected documents: paragraphs separated by blank lines)")
    return docs


def held_out_documents(n_docs: int, fraction: float) -> list[int]:
    """The held-out document numbers (0-based), evenly spaced; [] for fraction 0."""
    if not 0 <= fraction < 1:
        raise ProfileInputError(f"--held-out {fraction}: expected a fraction in [0, 1)")
    if fraction == 0:
        return []
    if n_docs < 2:
        raise ProfileInputError(f"--held-out {fraction}: the prompts file has {n_docs} document, and at least 2 are "
                                "needed to hold one out (separate documents by a blank line, or pass --held-out 0)")
    h = min(max(round(n_docs * fraction), 1), n_docs - 1)
    return [(2 * j + 1) * n_docs // (2 * h) for j in range(h)]


def token_budgets(max_tokens: int | None, fraction: float) -> tuple[int | None, int | None]:
    """(in-sample tokens, held-out tokens) at most; None = all."""
    if max_tokens is None:
        return None, None
    if max_tokens < 1:
        raise ProfileInputError(f"--max-tokens {max_tokens}: expected at least 1")
    held = max(round(max_tokens * fraction), 1) if fraction > 0 else 0
    if max_tokens - held < 1:
        raise ProfileInputError(f"--max-tokens {max_tokens} leaves no in-sample token beside {held} held out "
                                f"(--held-out {fraction}): give at least {held + 1}")
    return max_tokens - held, held


def take(docs: Sequence[Sequence[int]], budget: int | None) -> list[np.ndarray]:
    """The documents' token ids in order, cut after `budget` tokens in all (None: all of them)."""
    out, left = [], budget
    for ids in docs:
        if left == 0:
            break
        piece = np.asarray(ids[:left] if left is not None else ids, np.int64)
        if piece.size:
            out.append(piece)
            left = None if left is None else left - piece.size
    return out


@dataclass(frozen=True)
class Calibration:
    """What will be run: token ids per document (after the budget), and which documents they are."""

    in_sample: list[np.ndarray]
    held_out: list[np.ndarray]
    in_docs: list[int]  # document numbers, 0-based, file order
    held_docs: list[int]

    @property
    def tokens(self) -> tuple[int, int]:
        return sum(d.size for d in self.in_sample), sum(d.size for d in self.held_out)


def check_options(n_docs: int, held_out: float, max_tokens: int | None, ctx: int) -> None:
    """Everything about a run that can be refused before the model loads (a load can take minutes)."""
    if ctx < 1:
        raise ProfileInputError(f"--ctx-size {ctx}: expected at least 1")
    held_out_documents(n_docs, held_out)
    token_budgets(max_tokens, held_out)


def plan_calibration(doc_ids: Sequence[Sequence[int]], held_out: float, max_tokens: int | None = None) -> Calibration:
    """Split tokenized documents into the in-sample and held-out parts and apply the token budget."""
    held = set(held_out_documents(len(doc_ids), held_out))
    in_budget, held_budget = token_budgets(max_tokens, held_out)
    in_docs = [i for i in range(len(doc_ids)) if i not in held]
    held_docs = sorted(held)
    c = Calibration(take([doc_ids[i] for i in in_docs], in_budget), take([doc_ids[i] for i in held_docs], held_budget),
                    in_docs, held_docs)
    n_in, n_held = c.tokens
    if n_in == 0 or (held and n_held == 0):
        raise ProfileInputError(f"the documents encode to {n_in} in-sample and {n_held} held-out tokens; "
                                "both parts need at least one")
    return c


# --- running the engine ------------------------------------------------------------------------------


class RoutingObserver:
    """Records the experts every fed position chose, layer by layer, while active (a `with` block).

    Wraps each MoE block's `route` (T tokens: one, or a chunk) from outside, per instance, so the
    engine's code is untouched and nothing is wrapped after the block ends."""

    def __init__(self, model: Model):
        self.moes = model.moes
        self.k = model.geometry.n_expert_used
        self._rows: list[list[np.ndarray]] = [[] for _ in self.moes]

    def _wrap(self, route: Callable, layer: int) -> Callable:
        def observed(*args, **kwargs):
            top, weights = route(*args, **kwargs)
            self._rows[layer].append(np.array(top, np.int64).reshape(-1, self.k))  # a copy
            return top, weights

        return observed

    def __enter__(self) -> "RoutingObserver":
        for layer, moe in enumerate(self.moes):
            moe.route = self._wrap(moe.route, layer)
        return self

    def __exit__(self, *exc) -> None:
        for moe in self.moes:
            del moe.route  # the class's method shows through again

    def take(self) -> np.ndarray:
        """int64 [T, n_layer, top_k]: the positions fed since the last take, in order."""
        per_layer = [np.concatenate(r) if r else np.empty((0, self.k), np.int64) for r in self._rows]
        sizes = {len(p) for p in per_layer}
        if len(sizes) != 1:
            raise RuntimeError(f"routing observer: layers saw different numbers of positions {sorted(sizes)}")
        self._rows = [[] for _ in self.moes]
        return np.stack(per_layer, axis=1)


def run_window(model: Model, ids: np.ndarray, *, kv: str, chunk: int) -> Session:
    """Feed `ids` as one sequence (a fresh session) and return the session (its `routing` counts)."""
    s = model.new_session(len(ids), kv)
    step = max(chunk, 1)
    for a in range(0, len(ids), step):
        piece = ids[a : a + step]
        if len(piece) == 1:
            model.step(s, int(piece[0]))  # as generate() feeds a lone position: the decode path
        else:
            model.forward(s, piece, 0)  # no logits: only the routing is wanted
    return s


def windows(ids: np.ndarray, ctx: int) -> list[np.ndarray]:
    """A document as consecutive windows of at most ctx tokens."""
    return [ids[a : a + ctx] for a in range(0, len(ids), ctx)]


def count_routing(model: Model, docs: Sequence[np.ndarray], *, ctx: int, kv: str, chunk: int,
                  progress: Callable[[int], None] | None = None,
                  trace: TraceWriter | None = None) -> tuple[np.ndarray, int]:
    """(int64 [n_layer, n_expert] routing counts, tokens fed) over every position of `docs`.
    With `trace`, each position's experts are appended to it in order."""
    g = model.geometry
    counts = np.zeros((g.n_layer, g.n_expert), np.int64)
    tokens = 0
    observer = RoutingObserver(model) if trace is not None else None
    for doc in docs:
        for ids in windows(doc, ctx):
            if observer is None:
                s = run_window(model, ids, kv=kv, chunk=chunk)
            else:
                with observer:
                    s = run_window(model, ids, kv=kv, chunk=chunk)
                _trace_rows(trace, observer.take(), s.routing)
            counts += s.routing
            tokens += len(ids)
            if progress is not None:
                progress(len(ids))
    return counts, tokens


def _trace_rows(trace: TraceWriter, rows: np.ndarray, routing: np.ndarray) -> None:
    L, X = routing.shape
    seen = np.bincount((rows + np.arange(L)[None, :, None] * X).ravel(), minlength=L * X).reshape(L, X)
    if not np.array_equal(seen, routing):
        layer = int(np.flatnonzero((seen != routing).any(axis=1))[0])
        raise RuntimeError(f"routing trace: at layer {layer} the observed router calls count {seen[layer].tolist()}, "
                           f"the session counted {routing[layer].tolist()} (a router call bypassed the observer)")
    trace.append(rows)


@dataclass(frozen=True)
class ProfileResult:
    profile: ExpertProfile  # in-sample counts: what is written
    held_out: ExpertProfile | None  # the held-out documents' counts, for scoring only


def build_profile(model: Model, pack_fingerprint: str, calib: Calibration, *, ctx: int, kv: str,
                  chunk: int, progress: Callable[[int], None] | None = None,
                  trace: TraceWriter | None = None) -> ProfileResult:
    """Run the in-sample documents (traced when `trace` is given), then the held-out ones."""
    g = model.geometry

    def profile_of(docs, tr):
        counts, tokens = count_routing(model, docs, ctx=ctx, kv=kv, chunk=chunk, progress=progress, trace=tr)
        return ExpertProfile.from_counts(pack_fingerprint, counts, tokens=tokens, top_k=g.n_expert_used)

    profile = profile_of(calib.in_sample, trace)
    held = profile_of(calib.held_out, None) if calib.held_out else None
    return ProfileResult(profile, held)


# --- the report --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HitRateRow:
    percent: int  # slots as % of all (layer, expert) pairs
    slots: int
    in_sample: float  # expected hit rate, 0..1
    held_out: float | None


def slots_for(percent: float, n_pairs: int) -> int:
    """The fewest slots holding at least `percent` % of the n_pairs experts."""
    return math.ceil(percent * n_pairs / 100 - 1e-9)


def hit_rate_table(profile: ExpertProfile, held_out: ExpertProfile | None,
                   percents: Sequence[int] = SLOT_PERCENTS) -> list[HitRateRow]:
    """Expected hit rate at each slot share: in-sample, and on the held-out counts when given."""
    n_pairs = profile.n_layer * profile.n_expert
    rows = []
    for p in percents:
        k = slots_for(p, n_pairs)
        rows.append(HitRateRow(p, k, expected_hit_rate(profile, k),
                               expected_hit_rate(profile, k, held_out) if held_out is not None else None))
    return rows
