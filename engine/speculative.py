"""Speculative decoding (--spec N): draft tokens cheaply, verify them in ONE forward of the trunk, keep
the longest agreeing prefix plus one token of the trunk's own, and roll every state back to it.

    t               the last sampled token, not fed yet; it goes at position P = session.pos
    d1 .. dn        the drafter's guesses for positions P+1 .. P+n (n <= --spec; the MTP drafter stops
                    early when its top probability falls below --spec-min-p)
    verify          [t d1 .. dn] through the trunk in one forward of T = 1 + n rows -> n + 1 logits rows
    judge           row i judges d_{i+1} (Sampler.judge): greedy, kept when it is the argmax; sampling,
                    Leviathan et al.'s accept/resample rule, so the output keeps the target
                    distribution. The first rejection gives the corrected token; with every draft
                    kept, row n gives one more token
    roll back       rows 0..k stay fed (k drafts kept): session.pos = P + k + 1, and every state that is
                    not indexed by position is restored from the snapshot taken after row k

The states and how each goes back (no prompt is ever run again):

    KV cache              indexed by position: entries past pos are never read (attention reads
                          0..pos) and the next tokens overwrite them; nothing to do
    QSA                   K, V and the indexer keys by position; its count `n` truncated; a pooled
                          block completed by rejected rows is pooled again when its tokens come back
    Gated DeltaNet        conv and recurrent S: the snapshot of row k (Seq.saved, engine/batch.py)
    PLE                   the token window and the conv ring: the snapshot of row k
    routing counts        (--stats, strata-profile) the snapshot of row k: rejected rows count nothing
    the MTP head's KV     indexed by position, as the trunk's: the drafter writes its verified pairs over
                          the draft chain's

EXACT, not within rounding: the verify forward runs each row as a one-token sequence of the session
(Model.forward's `saved`): the products are row-wise and give every row the same bits for any T
(tests/engine/test_kernels_cpu.py), the sequence operations take their token-step form per row, so
a verified row has the bits the token step gives it and greedy output with --spec N is the output
of --spec 0 (tests/engine/test_speculative.py). The weights, the cost of a CPU step, are read once
for the 1 + n rows; attention's KV and the delta rule's S are read once per row, as token steps do.
On the device step (--gpu-step device) the same holds with the device's token step: a row attends
and runs its MoE by the token step's kernels, the snapshots are device arrays (the rollback copies
there) and a greedy verification brings back only each row's pick (tests/gpu/test_device_spec.py).

Drafters: `MTPDrafter` (the pack's MTP block, engine/mtp.py) is the real one. `ReferenceDrafter`s
know the continuation of a --spec 0 run and name its tokens right always ("oracle"), never
("wrong"), or with probability p per token ("right:P"): the tests run every rollback path with them,
and the benchmark holds the acceptance where it wants it (benchmarks/spec.py).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Sequence

import numpy as np

from .batch import copy_state
from .generate import Run, drive
from .model import Model, Session
from .qsa import QSACache

F32 = np.float32


# --- snapshots and the rollback ------------------------------------------------------------------


class Snapshot:
    """The state of a session after one verified row, for what is not indexed by position: per layer
    the Gated DeltaNet conv and S (None for attention layers), the PLE states, the routing counts.
    Made once per draft position (the verify forward copies into it; nothing is allocated per token).
    `backend`: where the states live (the model's): the device step's snapshots are device arrays,
    so the verify's copies and the rollback stay on the device."""

    def __init__(self, session: Session, backend=None):
        alloc = (lambda v: np.empty_like(v)) if backend is None else (lambda v: backend.zeros(v.shape, v.dtype))
        self.states = [{k: alloc(v) for k, v in st.items()} if isinstance(st, dict) else None
                       for st in session.states]
        self.ple_states = {l: copy.deepcopy(st) for l, st in session.ple_states.items()}
        self.routing = np.empty_like(session.routing)
        self.backend = backend

    @property
    def nbytes(self) -> int:
        gdn = sum(a.nbytes for st in self.states if st for a in st.values())
        return gdn + sum(p.nbytes for p in self.ple_states.values()) + self.routing.nbytes


def roll_back(session: Session, snap: Snapshot | None, pos: int) -> None:
    """The session as it was after position pos - 1: `snap` taken there (None: pos is where the
    session is, nothing to undo)."""
    if pos == session.pos:
        return
    if not 0 <= pos < session.pos or snap is None:
        raise ValueError(f"roll_back to position {pos}: the session is at {session.pos} (a snapshot is needed "
                         "to go back)")
    copy = getattr(snap.backend, "copy_arrays", None)  # the device step: the copies in one graph's replay
    pairs = []
    for st, saved in zip(session.states, snap.states):
        if saved is not None:
            if copy is not None and isinstance(saved, dict):
                pairs += [(saved[k], st[k]) for k in saved]
            else:
                copy_state(saved, st)
        elif isinstance(st, QSACache):
            st.truncate(pos)
    if pairs:
        copy(pairs)
    for l, st in session.ple_states.items():
        snap.ple_states[l].copy_to(st)
    np.copyto(session.routing, snap.routing)
    session.pos = pos


# --- drafters -------------------------------------------------------------------------------------

# strata serve's requests drafting with the MTP head on the host draft their chains together
# (draft_together); STRATA_DRAFT_TOGETHER=0 drafts each request's chain on its own, to time the two
DRAFT_TOGETHER = os.environ.get("STRATA_DRAFT_TOGETHER", "1") != "0"


class Drafter:
    """What proposes tokens. `draft(history, n_known, n)` -> (up to n token ids for positions n_known..,
    their draft distributions: one f64 [V] per token, or None where the drafter names the token
    outright). history[:n_known] are the tokens known so far, the last one not fed yet.
    `observe(hidden, pos0, history)`: the trunk's head input of the rows at pos0.. now fed for good."""

    needs_hidden = False

    def draft(self, history: np.ndarray, n_known: int, n: int) -> tuple[list[int], list]:
        raise NotImplementedError

    def observe(self, hidden: np.ndarray, pos0: int, history: np.ndarray) -> None:
        pass

    def close(self) -> None:
        """The run is over: give back what drafting held (the MTP head's KV cache)."""


class ReferenceDrafter(Drafter):
    """Drafts from a known continuation (the tokens of a --spec 0 greedy run, prompt included): the
    token drafted for position j is the reference's where right[j], else the reference's + 1 mod V
    (wrong whenever the run follows the reference); right[j] is drawn once a position, true with
    probability `p_right` (1: the oracle, 0: always wrong). A position's draft is judged once at
    most (the first refused is followed by the target's token), so each judged draft is right with
    probability p_right, independently; by position, not drawn a draft, so that the device can
    draft the same chain (chain_table: a verify run ahead, engine/tier/verify_ahead.py)."""

    def __init__(self, reference: Sequence[int], n_vocab: int, p_right: float, seed: int = 0):
        if not 0 <= p_right <= 1:
            raise ValueError(f"drafter: probability of a right token {p_right}, expected 0..1")
        self.ref, self.V, self.p = np.asarray(reference, np.int64), n_vocab, p_right
        self.right = np.random.default_rng(seed).random(self.ref.size) < p_right if 0 < p_right < 1 else \
            np.full(self.ref.size, p_right == 1)

    def draft(self, history, n_known, n):
        j = np.arange(n_known, min(n_known + n, len(self.ref)))
        out = np.where(self.right[j], self.ref[j], (self.ref[j] + 1) % self.V).tolist()
        return out, [None] * len(out)

    def chain_table(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The rule `draft` follows, as tables by position: (reference, right, V)."""
        return self.ref, self.right, self.V


class MTPDrafter(Drafter):
    """The pack's MTP block (engine/mtp.py) as a drafter. Its pair at head position q is (the trunk's
    head input at q, the token at q + 1), written once both are final; the chain's pairs (the head's
    own y, a drafted token) go after them and are overwritten by the verified pairs. The draft is the
    argmax when greedy, else drawn from `sampler`'s chain on the draft logits; drafting stops when the
    draft logits' top probability (softmax, temperature 1) is below `min_p` (llama.cpp's --draft-p-min).
    Greedy with the head on the device step, both are made there (MTPHead.pick): no logits come down."""

    needs_hidden = True

    def __init__(self, head, max_context: int, kv: str, sampler, min_p: float):
        if not 0 <= min_p <= 1:
            raise ValueError(f"--spec-min-p {min_p}: expected 0..1")
        self.head, self.sampler, self.min_p = head, sampler, min_p
        self.state = head.new_state(max_context, kv)
        self.pending = np.empty((1, head.E), F32)  # the last fed row's head input: its pair needs the next token
        self.pending_pos = -1  # its position; -1: none

    def close(self) -> None:
        self.head.give_back(self.state)

    def observe(self, hidden, pos0, history):
        rows = hidden if self.pending_pos < 0 else np.concatenate([self.pending, hidden])
        first = pos0 if self.pending_pos < 0 else self.pending_pos
        if rows.shape[0] > 1:  # every row but the last has its next token: the head's KV catches up
            self.head.forward(self.state, rows[:-1], history[first + 1 : first + rows.shape[0]], first, logits=False)
        self.pending[0] = rows[-1]
        self.pending_pos = first + rows.shape[0] - 1

    @property
    def together(self) -> bool:
        """Whether its chains may be drafted beside other drafters' (`draft_together`): the head on the
        host. On the device each draft is a captured step of its own (MTPHead._device_step)."""
        return DRAFT_TOGETHER and not self.head._device

    def draft(self, history, n_known, n):
        self._check_pending(n_known)
        banned = self.sampler.pick if self.sampler.params.greedy else None
        if banned is not None and getattr(self.head, "picks", False):  # greedy on the device: only the picks come down
            return self._draft_on_device(history, n_known - 1, n, banned)
        if self.together:
            return draft_together([(self, history, n_known, n)])[0]
        P = n_known - 1  # the last known token's position (not fed); the pending row is P - 1
        tokens, qs = [], []
        logits = self.head.forward(self.state, self.pending, history[P : P + 1], P - 1)
        self.pending_pos = -1  # its pair is in the head's KV now
        hist = np.empty(n_known + n, np.int64)
        hist[:n_known] = history[:n_known]
        for i in range(n):
            got = self._pick(logits, hist, n_known, i)
            if got is None:
                break
            tokens.append(got[0])
            qs.append(got[1])
            if i + 1 < n:
                logits = self.head.forward(self.state, self.head.y.x, np.array([got[0]]), P + i)
        return tokens, qs

    def _check_pending(self, n_known: int) -> None:
        if self.pending_pos != n_known - 2:  # (the last known token is at n_known - 1, not fed; its row before it)
            raise ValueError(f"MTP drafter: its last trunk row is at {self.pending_pos}, expected {n_known - 2}")

    def _pick(self, logits, hist: np.ndarray, n_known: int, i: int):
        """The chain's draft i from its logits -> (token, q), written into hist[n_known + i]; None where
        drafting stops: the logits' top probability (softmax, temperature 1) below --spec-min-p."""
        top = float(logits.max())
        if 1.0 / float(np.exp(logits.astype(np.float64) - top).sum()) < self.min_p:
            return None
        # q: what the draw is made from (the acceptance rule needs it); greedy, the argmax outright
        q = None if self.sampler.params.greedy else self.sampler.distribution(logits, hist[: n_known + i]).copy()
        d = int(self.sampler.sample(logits, hist[: n_known + i]))
        hist[n_known + i] = d
        return d, q

    def _draft_on_device(self, history, P: int, n: int, banned: np.ndarray) -> tuple[list[int], list]:
        """`draft` greedy with the head on the device step: each draft's argmax (the banned ids never)
        and its logits' top probability made there (MTPHead.pick), the rule the same."""
        tokens = []
        d, top = self.head.pick(self.state, self.pending, int(history[P]), P - 1, banned)
        self.pending_pos = -1  # its pair is in the head's KV now
        for i in range(n):
            if top < self.min_p:
                break
            tokens.append(d)
            if i + 1 < n:
                d, top = self.head.pick(self.state, self.head.y.x, d, P + i, banned)
        return tokens, [None] * len(tokens)


def draft_together(jobs: list) -> list[tuple[list[int], list]]:
    """Each job's `MTPDrafter.draft(history, n_known, n)` (jobs: (drafter, history, n_known, n); the
    drafters share one head on the host), the chains advanced side by side: at each chain position ONE
    forward of the head (MTPHead.forward_rows) for every chain still drafting. strata serve's B
    requests so read the head's weights (its LM head: every vocabulary row) once a position, not B
    times. Each chain's drafts and its head KV are the ones it makes alone (forward_rows' rows are
    `forward`'s), and each stops on its own (--spec-min-p, its n)."""
    out: list[tuple[list[int], list]] = [([], []) for _ in jobs]
    hists, rows = {}, []  # rows: (job, h, token, head position) of each live chain's next pair
    for k, (d, history, n_known, n) in enumerate(jobs):
        if n <= 0:
            continue
        d._check_pending(n_known)
        P = n_known - 1
        hists[k] = np.empty(n_known + n, np.int64)
        hists[k][:n_known] = history[:n_known]
        rows.append((k, d.pending[0], int(history[P]), P - 1))
        d.pending_pos = -1  # its pair goes into the head's KV now
    heads = {id(jobs[k][0].head) for k, *_ in rows}
    if len(heads) > 1:
        raise ValueError(f"draft_together: the drafters use {len(heads)} heads, expected one")
    while rows:
        head = jobs[rows[0][0]][0].head
        logits, y = head.forward_rows([jobs[k][0].state for k, *_ in rows], np.stack([r[1] for r in rows]),
                                      [r[2] for r in rows], [r[3] for r in rows])
        live = []
        for r, (k, _, _, pos) in enumerate(rows):
            d, _, n_known, n = jobs[k]
            i = len(out[k][0])
            got = d._pick(logits[r], hists[k], n_known, i)
            if got is None:
                continue
            out[k][0].append(got[0])
            out[k][1].append(got[1])
            if i + 1 < n:
                live.append((k, y[r], got[0], pos + 1))
        rows = live
    return out


# --- the statistics ----------------------------------------------------------------------------


class SpecStats:
    """Acceptance per draft position, tokens per verification, where the time went."""

    def __init__(self, n_draft: int):
        self.drafted = np.zeros(n_draft, np.int64)  # drafts made at position i (1-based i + 1)
        self.judged = np.zeros(n_draft, np.int64)  # ... that were judged (every earlier one was kept)
        self.accepted = np.zeros(n_draft, np.int64)
        self.verifications = 0
        self.ahead = 0  # of them, run ahead of the host (SpecRun.take_ahead: the time is in verify_s)
        self.produced = 0  # tokens the verifications produced (kept drafts + the trunk's own)
        self.steps = 0  # plain token steps in the decode phase (no draft made)
        self.draft_s = self.verify_s = 0.0

    def acceptance(self) -> float:
        """Kept drafts over drafts made."""
        return float(self.accepted.sum() / self.drafted.sum()) if self.drafted.sum() else float("nan")

    def tokens_per_verification(self) -> float:
        return self.produced / self.verifications if self.verifications else float("nan")


# --- the run -----------------------------------------------------------------------------------------


class SpecRun(Run):
    """A Run (engine/generate.py) that drafts up to `n_draft` tokens per step with `drafter` and
    verifies them in one forward (`forward`, then `take`); engine/generate.py's `drive` runs it.
    The prompt goes as in a Run (the MTP drafter reads every position's head input)."""

    def __init__(self, model: Model, session: Session, prompt, sampler, max_new_tokens: int, *, drafter: Drafter,
                 n_draft: int, stats: SpecStats | None = None, snapshots: list | None = None, **kw):
        """`stats`: where the counts go (strata serve's requests share one, for /metrics); None: its own.
        `snapshots`: n_draft Snapshots of this session's shapes made already (the GPU tier's, placed at
        its startup: GpuTier.snapshots); None or empty: made here."""
        super().__init__(session, prompt, sampler, max_new_tokens, **kw)
        if n_draft < 1:
            raise ValueError(f"--spec {n_draft}: a speculative run drafts at least 1 token (--spec 0 is plain decoding)")
        if snapshots and len(snapshots) != n_draft:
            raise ValueError(f"SpecRun: {len(snapshots)} snapshots given for --spec {n_draft}")
        self.drafter, self.n_draft = drafter, n_draft
        self.snaps = list(snapshots) if snapshots else [Snapshot(session, model.backend) for _ in range(n_draft)]
        rows = max(self.chunk, n_draft + 1)
        self.hidden = np.empty((rows, model.geometry.n_embd), F32) if drafter.needs_hidden else None
        self.drafts: list[int] | None = None  # the drafts being verified
        self.ready: tuple | None = None  # the next feed's drafts, made beside other runs' (draft_job)
        self.qs: list = []
        self.n_fed = 0  # rows of the last feed
        if stats is not None and stats.drafted.size != n_draft:
            raise ValueError(f"SpecRun: statistics for {stats.drafted.size} draft positions, --spec {n_draft}")
        self.stats = SpecStats(n_draft) if stats is None else stats

    def feed(self):
        if self.prefilled is None:  # the prompt, as a Run feeds it
            tokens, n_logits = super().feed()
            self.n_fed, self.drafts = tokens.size, None
            return tokens, n_logits
        n = self._n_next()
        if self.ready is not None:  # drafted beside other runs' (draft_job)
            drafts, qs = self.ready
            self.ready = None
        else:
            t0 = time.perf_counter()
            drafts, qs = self.drafter.draft(self.history, self.n_tokens, n) if n > 0 else ([], [])
            self.stats.draft_s += time.perf_counter() - t0
        tokens = np.array([self.history[self.fed], *drafts], np.int64)
        self.n_fed, self.drafts, self.qs = tokens.size, (drafts or None), qs
        return tokens, (tokens.size if drafts or self.on_logits is not None else 1)

    def close(self) -> None:
        self.drafter.close()

    def _n_next(self) -> int:
        return min(self.n_draft, self.max_new - (self.n_tokens - self.n_prompt) - 1,
                   self.session.max_context - self.fed - 1)  # no draft past -n or the context

    def draft_job(self):
        """What this run's next feed drafts, where its drafter can draft beside others' (strata serve:
        draft_together): (drafter, history, n_known, n); else None. Give the drafts to `ready`."""
        if self.prefilled is None or self.done or not getattr(self.drafter, "together", False):
            return None
        n = self._n_next()
        return (self.drafter, self.history, self.n_tokens, n) if n > 0 else None

    def take_ahead(self, model: Model, tokens: np.ndarray) -> bool:
        """The rest of the run with each verify queued on the device step before the last one is read
        (Model.verify_ahead), where it applies: greedy, no logits asked, a drafter whose chain the
        device can draft (chain_table), a full chain of drafts fed now and a session that can.
        Else False, having fed nothing. Where the verify ahead stops (the context's end near) the
        run goes on in the plain loop here; -> whether the run is done (True unless it did not apply).
        Only for a session discarded afterwards: a stop token leaves it spent (Run.take_ahead)."""
        banned = self.sampler.pick
        if self.drafts is None or len(self.drafts) != self.n_draft or self.on_logits is not None or banned is None \
                or not model.picks or not hasattr(self.drafter, "chain_table") or self.hidden is not None \
                or self.fed != self.session.pos or not model.verifies_ahead(self.session):
            return False
        st, n = self.stats, self.n_draft
        left = self.max_new - (self.n_tokens - self.n_prompt)
        t0 = time.perf_counter()
        verifies = model.verify_ahead(self.session, tokens, banned, self.drafter, self.snaps, left)
        try:
            for k, picked in verifies:
                st.verifications += 1
                st.ahead += 1
                st.drafted += 1
                st.judged[: min(k + 1, n)] += 1
                st.accepted[:k] += 1
                for token in picked:
                    self.fed += 1
                    st.produced += 1
                    if self._add(int(token)):
                        return True
        finally:
            verifies.close()
            st.verify_s += time.perf_counter() - t0
        while not self.done:  # (the context's end: the plain loop)
            tokens, n_logits = self.feed()
            self.take(self.forward(model, tokens, n_logits))
        return True

    def batch_args(self, tokens):
        """The head input of every fed row (the MTP drafter reads it) and, verifying, the snapshots."""
        return (None if self.hidden is None else self.hidden[: tokens.size]), \
            (self.snaps if self.drafts is not None else None)

    def forward(self, model, tokens, n_logits):
        h, saved = self.batch_args(tokens)
        if saved is None:
            if tokens.size == 1:
                return model.step(self.session, int(tokens[0]), h)
            return model.forward(self.session, tokens, n_logits, hidden=h)
        # greedy on the device step: each row's pick is made there and only the ids come back
        banned = self.sampler.pick if self.on_logits is None and model.picks else None
        t0 = time.perf_counter()
        rows = model.forward(self.session, tokens, n_logits, hidden=h, saved=saved, pick=banned)
        self.stats.verify_s += time.perf_counter() - t0
        return rows

    def take(self, rows) -> bool:
        P = self.fed
        if self.drafts is None:
            if self.prefilled is not None:
                self.stats.steps += 1
            done = super().take(rows)
            if not done and self.hidden is not None:
                self.drafter.observe(self.hidden[: self.n_fed], P, self.history)
            return done
        return self._verified(rows, P)

    def _verified(self, rows: np.ndarray, P: int) -> bool:
        d, n, st = self.drafts, len(self.drafts), self.stats
        st.verifications += 1
        st.drafted[:n] += 1
        done = False
        picked = rows.ndim == 1  # the greedy picks of the rows (made on the device), not their logits
        for i in range(n + 1):
            self.fed = P + i + 1  # rows 0..i fed for good
            if self.on_logits is not None:
                self.on_logits(P + i, rows[i])
            if i < n:
                st.judged[i] += 1
                if picked:  # greedy judging: the draft is kept when it is the pick
                    token, kept = int(rows[i]), int(rows[i]) == d[i]
                else:
                    token, kept = self.sampler.judge(rows[i], self.history[: self.n_tokens], d[i], self.qs[i])
            else:
                token = int(rows[n]) if picked else self.sampler.sample(rows[n], self.history[: self.n_tokens])
                kept = False
            if kept:
                st.accepted[i] += 1
            st.produced += 1
            done = self._add(token)
            if done or not kept:
                break
        kept_rows = self.fed - P
        roll_back(self.session, self.snaps[kept_rows - 1] if kept_rows <= n else None, self.fed)
        if not done and self.hidden is not None:
            self.drafter.observe(self.hidden[:kept_rows], P, self.history)
        return done


# --- a whole run, as strata generate makes it -------------------------------------------------------

DRAFTERS = "mtp, oracle, wrong or right:P"


def parse_drafter(text: str) -> tuple[str, float]:
    """--spec-drafter: "mtp" (the pack's MTP block), "oracle" / "wrong" (the --spec 0 run's next
    token, or a token that is not it), "right:P" (right with probability P, 0..1) -> (kind, P)."""
    if text in ("mtp", "oracle", "wrong"):
        return text, {"mtp": float("nan"), "oracle": 1.0, "wrong": 0.0}[text]
    kind, _, p = text.partition(":")
    try:
        value = float(p)
    except ValueError:
        value = float("nan")
    if kind != "right" or not 0 <= value <= 1:
        raise ValueError(f"--spec-drafter {text!r}: expected {DRAFTERS} (P a probability 0..1, e.g. right:0.43)")
    return "right", value


def speculative_generate(model: Model, session: Session, prompt, sampler, max_new_tokens: int, *, n_draft: int,
                         drafter: str = "mtp", min_p: float = 0.75, kv: str = "f32", measure: bool = False,
                         snapshots: list | None = None, ahead: bool = False, **kw):
    """`generate` (engine/generate.py, whose keyword arguments `kw` are) with --spec n_draft.
    -> (the Generation, SpecStats, the --spec 0 Generation or None). `snapshots`: SpecRun's.

    A --spec 0 run of the same prompt and sampler settings (its own session, the same seed, silent)
    comes first when the drafter needs its continuation (oracle, wrong, right:P) or `measure` asks
    for the speed-up measured in the same process (its session discarded: it runs ahead where it
    can, as strata generate's). `ahead`: `session` is discarded afterwards, so its verifies may run
    ahead of the host (SpecRun.take_ahead)."""
    from .generate import generate
    from .mtp import MTPHead

    kind, p = parse_drafter(drafter)
    plain = None
    if kind != "mtp" or measure:
        quiet = {k: v for k, v in kw.items() if k in ("stop_ids", "prefill")}
        plain = generate(model, model.new_session(session.max_context, kv), prompt, sampler.fork(sampler.seed),
                         max_new_tokens, ahead=True, **quiet)
    if kind == "mtp":
        d = MTPDrafter(MTPHead.of(model), session.max_context, kv, sampler.fork(sampler.seed + 1), min_p)
    else:
        d = ReferenceDrafter(np.concatenate([plain.prompt, plain.tokens]), model.geometry.n_vocab, p, seed=sampler.seed)
    run = SpecRun(model, session, prompt, sampler, max_new_tokens, drafter=d, n_draft=n_draft, snapshots=snapshots, **kw)
    return drive(model, run, ahead), run.stats, plain
