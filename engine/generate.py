"""The decode loop (S11): feed -> layers -> head -> sample -> feed.

The prompt is TEACHER-FORCED through the same loop: at every position the next token is the
prompt's when there is one, and the sampler's otherwise, so the first generated token comes from
the last prompt position with no special case. (The seed's first version sampled only on decode
positions and read an empty `produced` vector at the first one; one loop removes the distinction
that needed the special case.)

Prefill (B1) is only HOW the loop feeds positions whose next token is already known: with a chunk
of C > 1 tokens, each turn feeds up to C of them in one batch (`Model.forward`, the prompt path),
with C = 1 (--prefill off) one at a time, the seed's decode path (6.9). A generated token is always
fed alone: its successor is not known until it has been sampled.

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


def generate(model: Model, session: Session, prompt: Sequence[int], sampler: Sampler, max_new_tokens: int, *,
             stop_ids: Collection[int] = (), on_token: Callable[[int], None] | None = None,
             on_logits: Callable[[int, np.ndarray], None] | None = None, prefill: int = 1,
             start: int = 0) -> Generation:
    """Run `prompt` then up to `max_new_tokens` sampled tokens through `session`.

    on_token(id) is called for each sampled token as it is chosen (streaming); when it returns True
    the generation ends there (stop "stopped"; that token is not fed). on_logits(pos, logits) for each
    fed position with the f32 logits it produced (a view, valid until the next step).
    `prefill`: the prompt path's chunk in tokens (1 or 0: token by token). `start`: how many of the
    prompt's tokens the session holds already (a resumed conversation: session.pos == start); only
    the rest is fed."""
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
    chunk = max(prefill, 1)
    history = np.empty(n_prompt + max_new_tokens, np.int64)
    history[:n_prompt] = prompt
    n_tokens, fed, stop = n_prompt, start, "length"
    start = time.perf_counter()
    prefilled = None
    while True:
        n = min(chunk, n_tokens - fed)  # positions whose next token is known (teacher forcing)
        if n == 1:  # the decode path: the session's logits buffer, nothing allocated (S12)
            logits = model.step(session, int(history[fed]))
            if on_logits is not None:
                on_logits(fed, logits)
        else:
            rows = model.forward(session, history[fed : fed + n], n if on_logits is not None else 1)
            logits = rows[-1]
            if on_logits is not None:
                for i in range(n):
                    on_logits(fed + i, rows[i])
        fed += n
        if fed < n_tokens:
            continue  # teacher forcing: the prompt says what comes next
        if prefilled is None:
            prefilled = time.perf_counter()
        if n_tokens - n_prompt == max_new_tokens:
            break  # only when asked for no tokens: otherwise the check below stops first
        token = sampler.sample(logits, history[:n_tokens])
        history[n_tokens] = token
        n_tokens += 1
        if on_token is not None and on_token(token):
            stop = "stopped"
            break
        if token in stop_ids:
            stop = "eos"
            break
        if n_tokens - n_prompt == max_new_tokens:
            break  # the last sampled token is never fed: nothing would read its logits
        if fed == session.max_context:
            stop = "context"
            break
    end = time.perf_counter()
    return Generation(history[:n_prompt].copy(), history[n_prompt:n_tokens].copy(), fed,
                      prefilled - start, end - prefilled, stop)
