"""Perplexity over a token sequence, and KL divergence against a base model's saved distributions (B6).

Scoring follows llama.cpp's perplexity tool: the tokens are cut into windows of n_ctx (the tail
that does not fill a window is left out), each window is its own sequence (a fresh session), and
only its second half is scored: the logits at positions first = n_ctx // 2 .. n_ctx - 2 predict
tokens first + 1 .. n_ctx - 1, so every scored token has at least n_ctx / 2 tokens of context and
the number is comparable across --ctx only at equal context. Log-softmax in float64.

    NLL_i = -log p(t_{i+1} | t_0..t_i);  PPL = exp(mean NLL)
    uncertainty: the standard error of the mean NLL, s / sqrt(n), carried to PPL to first order:
                 PPL +- PPL * s / sqrt(n) (llama.cpp prints the same)
    KL_i  = sum_v p_base(v) (log p_base(v) - log p(v)), the base's log-probs from the 16-bit file
            (index_format/kl_base.py; a renormalised stored row is within `step` of the base's)
    top-1 = how often argmax p equals the base's argmax; +- sqrt(f (1 - f) / n)

Legend: V = vocabulary, W = windows, N = n_ctx, S = scored positions per window = N - 1 - N // 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from strata.index_format.kl_base import KLBase, dequantize_logprobs

from .kernels.actq import NonFiniteActivation
from .model import Model


class PerplexityError(ValueError):
    """A text too short for one window, or a base file that does not match this run."""


def windows(tokens, n_ctx: int) -> np.ndarray:
    """int64 [W, N]: the whole windows of n_ctx tokens (the rest is left out)."""
    if n_ctx < 2:
        raise PerplexityError(f"--ctx-size {n_ctx}: a window needs at least 2 tokens (one to predict the next)")
    tokens = np.asarray(tokens, np.int64)
    n = tokens.size // n_ctx
    if n == 0:
        raise PerplexityError(f"the text has {tokens.size} tokens, fewer than one window of --ctx-size {n_ctx}: "
                              "give a longer file or a smaller --ctx")
    return tokens[: n * n_ctx].reshape(n, n_ctx)


def first_scored(n_ctx: int) -> int:
    return n_ctx // 2


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 [n, V] from f32 logits [n, V]."""
    x = logits.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def window_logits(model: Model, tokens: np.ndarray, *, kv: str, chunk: int) -> Iterator[np.ndarray]:
    """Feed one window (a fresh session); yield the f32 logits [n, V] of its scored positions, in order.

    chunk > 1: the prompt path in chunks (no LM head before the first scored position); chunk <= 1:
    token by token (the decode path, the reference the prompt path is tested against)."""
    N = tokens.size
    first = first_scored(N)
    s = model.new_session(N, kv)
    if chunk <= 1:
        for pos in range(N - 1):
            logits = model.step(s, int(tokens[pos]))
            if pos >= first:
                yield logits[None].copy()
        return
    for a in range(0, N - 1, chunk):
        b = min(a + chunk, N - 1)  # the last token is never fed: nothing reads its logits
        scored = max(0, b - max(a, first))
        rows = model.forward(s, tokens[a:b], scored)
        if scored:
            yield rows


@dataclass
class Scores:
    """Per scored token: NLL, and against a base: KL, same top-1, the base's NLL."""

    nll: list = field(default_factory=list)
    kl: list = field(default_factory=list)
    same_top1: list = field(default_factory=list)
    base_nll: list = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v) if v else np.zeros(0) for k, v in vars(self).items()}


def score(model: Model, wins: np.ndarray, *, kv: str, chunk: int, base: KLBase | None = None,
          save: Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None = None,
          progress: Callable[[int], None] | None = None) -> Scores:
    """Score every window. `save(logprobs, top1, nll)` receives each block of scored positions (the
    KL base writer's `append`); `progress(n)` is called with the tokens done after each block."""
    if base is not None:
        _check_base(base, wins, model.geometry.n_vocab)
    first = first_scored(wins.shape[1])
    out = Scores()
    for w, toks in enumerate(wins):
        done = 0
        for logits in window_logits(model, toks, kv=kv, chunk=chunk):
            n = len(logits)
            _check_finite(logits, w, first + done)
            nxt = toks[first + done + 1 : first + done + 1 + n]
            lp = log_softmax(logits)
            nll = -lp[np.arange(n), nxt]
            top1 = logits.argmax(axis=1)
            out.nll.append(nll)
            if save is not None:
                save(lp, top1, nll)
            if base is not None:
                rec = base.records[w, done : done + n]
                lb = dequantize_logprobs(rec)
                out.kl.append((np.exp(lb) * (lb - lp)).sum(axis=1))
                out.same_top1.append(top1 == rec["top1"])
                out.base_nll.append(rec["nll"].astype(np.float64))
            done += n
            if progress is not None:
                progress(n)
    return out


def _check_finite(logits: np.ndarray, window: int, pos: int) -> None:
    # A NaN or inf logit makes every figure after it nan (PPL, KL, top-1), which once printed as a
    # result and exited 0: the model is broken, and that is the answer, not a number.
    if not np.isfinite(logits).all():
        r, v = np.argwhere(~np.isfinite(logits))[0]
        raise NonFiniteActivation(f"window {window}, position {pos + r}: the model's logit of token {v} is "
                              f"{logits[r, v]} (expected finite logits; the pack's weights or the engine are broken)")


def _check_base(base: KLBase, wins: np.ndarray, n_vocab: int) -> None:
    where = f"--kl-base {base.path}"
    if base.n_vocab != n_vocab:
        raise PerplexityError(f"{where}: saved from a model of {base.n_vocab} tokens, this one has {n_vocab}")
    if base.n_ctx != wins.shape[1]:
        raise PerplexityError(f"{where}: saved with --ctx-size {base.n_ctx}, this run has --ctx-size {wins.shape[1]}: use the same")
    if base.first != first_scored(base.n_ctx):
        raise PerplexityError(f"{where}: scores from position {base.first}, this run from {first_scored(base.n_ctx)}")
    if base.n_windows != len(wins) or not np.array_equal(base.tokens, wins):
        diff = np.argwhere(base.tokens != wins[: base.n_windows]) if base.n_windows <= len(wins) else []
        at = f" (first difference: window {diff[0][0]}, position {diff[0][1]})" if len(diff) else ""
        raise PerplexityError(f"{where}: saved from other tokens: {base.n_windows} windows, this text gives "
                              f"{len(wins)}{at}; use the same --file (and tokenizer)")


@dataclass(frozen=True)
class Summary:
    n: int
    ppl: float
    ppl_err: float
    kl: dict | None = None  # mean, err, median, p90, p95, p99, max, same_top1, same_top1_err, base_ppl, ...


def summarize(s: Scores) -> Summary:
    a = s.arrays()
    nll = a["nll"]
    n = nll.size
    if n == 0:
        raise PerplexityError("no token was scored")
    se = nll.std(ddof=1) / np.sqrt(n) if n > 1 else float("nan")
    ppl = float(np.exp(nll.mean()))
    kl = None
    if a["kl"].size:
        k, same, bn = a["kl"], a["same_top1"].astype(np.float64), a["base_nll"]
        d = nll - bn
        f = same.mean()
        kl = dict(mean=k.mean(), err=_se(k), median=np.median(k), p90=np.percentile(k, 90),
                  p95=np.percentile(k, 95), p99=np.percentile(k, 99), max=k.max(),
                  same_top1=f, same_top1_err=np.sqrt(f * (1 - f) / n),
                  base_ppl=float(np.exp(bn.mean())), base_ppl_err=float(np.exp(bn.mean())) * _se(bn),
                  ln_ratio=d.mean(), ln_ratio_err=_se(d))
    return Summary(n, ppl, ppl * se, kl)


def _se(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")
