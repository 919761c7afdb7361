"""The decode loop (S11): feed -> layers -> head -> sample -> feed.

The prompt is TEACHER-FORCED through the same loop: at every position the next token is the
prompt's when there is one, and the sampler's otherwise, so the first generated token comes from
the last prompt position with no special case. (The seed's first version sampled only on decode
positions and read an empty `produced` vector at the first one; one loop removes the distinction
that needed the special case.)

Prefill (B1) is only HOW the loop feeds positions whose next token is already known: with a chunk
of C > 1 tokens, each turn feeds up to C of them in one batch (`Model.forward`), with C = 1
(--prefill off) one at a time (6.9). A generated token is always fed alone: its successor is not
known until it has been sampled. The loop is a `Run`, stepped feed by feed, so that strata serve can
step several runs in one forward.

S12: the loop allocates nothing per token that it keeps: the token history is an array sized once
for the session's context, the session owns the logits and state, the sampler its scratch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np

from .model import Model, Session
from .sampling import Sampler


@dataclass
class Generation:
    """What a run produced and how long it took (the clock excludes loading)."""

    prompt: np.ndarray  # int64 [n_prompt]
    tokens: np.ndarray  # int64 [n_generated], the sampled tokens, the stop token included
    positions: int  # positions fed to the model (rows of logits produced)
    prefill_s: float  # feeding the prompt, up to the logits of its last position
    decode_s: float  # everything after: sampling and feeding the generated tokens
    stop: str  # "eos" (a stop token was sampled), "length" (-n reached), "context" (max_context reached) or
    # "stopped" (on_token asked to stop: a stop string, a client gone)

    @property
    def fed(self) -> np.ndarray:
        """The tokens the session holds now, in order: the prompt and every sampled token but the last
        (a parked session covers exactly these)."""
        return np.concatenate([self.prompt, self.tokens])[: self.positions]

    @property
    def prefill_tps(self) -> float:
        return len(self.prompt) / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second after the prompt (each one sampled, all but the last fed)."""
        return len(self.tokens) / self.decode_s if self.decode_s > 0 and len(self.tokens) else float("nan")


class Run:
    """One generation, one feed at a time: `feed()` says which tokens to feed next (and how many of
    their logits rows are wanted), `take(rows)` consumes those rows (sampling, the callbacks, the
    stop rules) and says whether the run is over. `generate` drives one Run; strata serve's worker
    drives several together, one forward for all of them (engine/scheduler.py). The arguments are
    `generate`'s."""

    def __init__(self, session: Session, prompt: Sequence[int], sampler: Sampler, max_new_tokens: int, *,
                 stop_ids: Collection[int] = (), on_token: Callable[[int], None] | None = None,
                 on_logits: Callable[[int, np.ndarray], None] | None = None, prefill: int = 1, start: int = 0):
        n_prompt = len(prompt)
        if n_prompt == 0:
            raise ValueError("generate: the prompt is empty; at least one token is needed to predict the next")
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens {max_new_tokens}, expected >= 0")
        if prefill < 0:
            raise ValueError(f"generate: prefill chunk {prefill}, expected >= 0 (0 or 1: token by token)")
        if not 0 <= start < n_prompt:
            raise ValueError(f"generate: start {start}, expected 0..{n_prompt - 1} (at least one prompt token to feed)")
        if session.pos != start:
            raise ValueError(f"generate: the session is at position {session.pos}, expected {start} (the prompt tokens "
                             "it holds)")
        if n_prompt > session.max_context:
            raise ValueError(f"generate: the prompt has {n_prompt} tokens, the context holds {session.max_context} "
                             "(raise --ctx-size)")
        self.session, self.sampler, self.max_new = session, sampler, max_new_tokens
        self.stop_ids, self.on_token, self.on_logits = stop_ids, on_token, on_logits
        self.chunk, self.n_prompt = max(prefill, 1), n_prompt
        self.history = np.empty(n_prompt + max_new_tokens, np.int64)
        self.history[:n_prompt] = prompt
        self.n_tokens, self.fed, self.stop = n_prompt, start, "length"
        self.done = False
        self.started = self.prefilled = self.ended = None

    def feed(self) -> tuple[np.ndarray, int]:
        """(the tokens to feed next, int64 [n]; how many of their last logits rows `take` needs)."""
        if self.started is None:
            self.started = time.perf_counter()
        n = min(self.chunk, self.n_tokens - self.fed)  # positions whose next token is known (teacher forcing)
        return self.history[self.fed : self.fed + n], (n if self.on_logits is not None else 1)

    def take(self, rows: np.ndarray | int) -> bool:
        """The logits rows of the last `feed` (its last n_logits positions; one row may come as the
        session's logits buffer itself, [n_vocab]), or the token already picked from them (`forward`
        on the device step); True when the run is over."""
        n = min(self.chunk, self.n_tokens - self.fed)
        if isinstance(rows, int):  # Model.step_pick's / step_sample's token: only after the prompt, never with on_logits
            self.fed += n
            if self.prefilled is None:
                self.prefilled = time.perf_counter()
            if self.n_tokens - self.n_prompt == self.max_new:
                return self._end()
            return self._add(rows)
        if self.on_logits is not None:
            for i in range(n):
                self.on_logits(self.fed + i, rows if rows.ndim == 1 else rows[i])
        logits = rows if rows.ndim == 1 else rows[-1]
        self.fed += n
        if self.fed < self.n_tokens:
            return False  # teacher forcing: the prompt says what comes next
        if self.prefilled is None:
            self.prefilled = time.perf_counter()
        if self.n_tokens - self.n_prompt == self.max_new:
            return self._end()  # only when asked for no tokens: otherwise the checks below stop first
        return self._add(self.sampler.sample(logits, self.history[: self.n_tokens]))

    def _add(self, token: int) -> bool:
        """A chosen token into the history, through the callbacks and the stop rules (self.fed
        positions fed); True when the run is over."""
        self.history[self.n_tokens] = token
        self.n_tokens += 1
        if self.on_token is not None and self.on_token(token):
            self.stop = "stopped"
            return self._end()
        if token in self.stop_ids:
            self.stop = "eos"
            return self._end()
        if self.n_tokens - self.n_prompt == self.max_new:
            return self._end()  # the last sampled token is never fed: nothing would read its logits
        if self.fed == self.session.max_context:
            self.stop = "context"
            return self._end()
        return False

    def forward(self, model: Model, tokens: np.ndarray, n_logits: int) -> np.ndarray:
        """The model's forward of `feed`'s tokens for this run (its session alone), the rows `take` wants."""
        if tokens.size == 1:  # the decode step: the session's logits buffer, nothing allocated (S12)
            if self.on_logits is None and model.picks and self.fed + 1 >= self.n_tokens:
                # on the device step the pick is made there, only the token comes back: greedy
                # (dev_argmax), else the sampler's chain with its own uniform draw (dev_sample)
                banned = self.sampler.pick
                if banned is not None:
                    return model.step_pick(self.session, int(tokens[0]), banned)
                return model.step_sample(self.session, int(tokens[0]), self.sampler, self.history[: self.n_tokens])
            return model.step(self.session, int(tokens[0]))
        return model.forward(self.session, tokens, n_logits)

    def take_ahead(self, model: Model, tokens: np.ndarray) -> bool:
        """The rest of a greedy run on the device step, one step ahead (Model.decode_ahead): each token
        taken (streamed, the stop rules) while the device runs the step that feeds it. False, having
        fed nothing, where it does not apply (the prompt not yet fed, logits asked for, a sampler
        that is not greedy: penalties and the draws follow the history, a backend or session that
        cannot). Only for a session discarded afterwards: a stop token or string leaves it spent."""
        banned = self.sampler.pick
        if tokens.size != 1 or self.fed + 1 < self.n_tokens or self.on_logits is not None or banned is None \
                or not model.picks or not model.runs_ahead(self.session):
            return False
        n = min(self.max_new - (self.n_tokens - self.n_prompt), self.session.max_context - self.fed)
        picked = model.decode_ahead(self.session, int(tokens[0]), banned, n)
        try:
            for token in picked:
                if self.take(token):
                    break
        finally:
            picked.close()  # (stopped early: the step queued past the last token is dropped)
        return self.done

    def batch_args(self, tokens: np.ndarray) -> tuple[np.ndarray | None, list | None]:
        """What this run's feed asks of a forward beside the logits, as Model.forward_batch's per-session
        `hidden` and `saved` entries: a plain run nothing (engine/speculative.py's SpecRun more)."""
        return None, None

    def cancel(self) -> None:
        """End the run where it is (its caller went away): stop "stopped"."""
        if not self.done:
            self.stop = "stopped"
            self._end()
            if self.started is None:
                self.started = self.ended

    def close(self) -> None:
        """Give back what the run holds beside its session (strata serve, once the request is over): a
        plain run holds nothing."""

    def _end(self) -> bool:
        self.done, self.ended = True, time.perf_counter()
        return True

    def result(self) -> Generation:
        h, n = self.history, self.n_prompt
        prefilled = self.prefilled if self.prefilled is not None else self.ended
        return Generation(h[:n].copy(), h[n : self.n_tokens].copy(), self.fed, prefilled - self.started,
                          self.ended - prefilled, self.stop)


def generate(model: Model, session: Session, prompt: Sequence[int], sampler: Sampler, max_new_tokens: int, *,
             stop_ids: Collection[int] = (), on_token: Callable[[int], None] | None = None,
             on_logits: Callable[[int, np.ndarray], None] | None = None, prefill: int = 1,
             start: int = 0, ahead: bool = False) -> Generation:
    """Run `prompt` then up to `max_new_tokens` sampled tokens through `session`.

    on_token(id) is called for each sampled token as it is chosen (streaming); when it returns True
    the generation ends there (stop "stopped"; that token is not fed). on_logits(pos, logits) for each
    fed position with the f32 logits it produced (a view, valid until the next step).
    `prefill`: the prompt path's chunk in tokens (1 or 0: token by token). `start`: how many of the
    prompt's tokens the session holds already (a resumed conversation: session.pos == start); only
    the rest is fed. `ahead`: the session is discarded afterwards, so a greedy run on the device step
    may run one step ahead of the host (Run.take_ahead; a stop token leaves the session spent)."""
    return drive(model, Run(session, prompt, sampler, max_new_tokens, stop_ids=stop_ids, on_token=on_token,
                            on_logits=on_logits, prefill=prefill, start=start), ahead)


def drive(model: Model, run: Run, ahead: bool = False) -> Generation:
    """One run to its end, alone: feed, its forward, take (a Run or engine/speculative.py's SpecRun);
    `ahead`: `generate`'s."""
    while True:
        tokens, n_logits = run.feed()
        if ahead and run.take_ahead(model, tokens):
            return run.result()
        if run.take(run.forward(model, tokens, n_logits)):
            return run.result()
