"""The sampler of the decode loop (S11: feed -> layers -> head -> SAMPLE -> feed).

The chain is llama.cpp's default one, in llama.cpp's order, so `--temp`/`--top-p`/... mean what
llama.cpp users expect:

    penalties -> top-k -> top-p -> min-p -> temperature -> draw

Temperature comes LAST, as in llama.cpp's `common_params_sampling::samplers`: top-p and min-p see the
temperature-1 distribution and temperature only reshapes what survived. (transformers' `generate`
scales by temperature first; the two differ whenever a filter is active and T != 1.)

- penalties (llama.cpp semantics) over the last `repeat_last_n` tokens of the history: a token seen
  there has its logit divided by `repeat_penalty` when positive and multiplied when <= 0, then
  `count * frequency_penalty + presence_penalty` subtracted.
- top-k keeps the tokens whose logit is >= the k-th largest (all tokens tied with it are kept, where
  llama.cpp's partial sort keeps an arbitrary k of them).
- top-p keeps the smallest set of most probable tokens whose mass reaches `top_p` (ties with its
  least probable member kept too).
- min-p keeps tokens with p >= min_p * p_max, tested on logits as llama.cpp does.
- temperature <= 0 (or top_k == 1) is greedy: the argmax of the penalised logits, lowest id on ties.

`Sampler.distribution` returns the filtered distribution a draw uses (for tests and for judging
drafted tokens), without drawing.

On the device step (engine/tier/device.py) the same chain runs where the logits are (`dev_sample`,
through `device_draw`): the host draws the uniform here, from the same stream, so a seed picks the
same token there as here (up to a draw that lands within float rounding of a token boundary: the
device's exp and sums round differently from numpy's).

S12, the token path allocates nothing: every vocabulary-sized buffer is created once in the Sampler
and each step works in it in place (thresholds come from an in-place partition of a scratch copy, the
filters are masks), so a step makes at most a few window-sized (repeat_last_n) temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .kernels.actq import NonFiniteActivation

_TOP_P_FIRST_TRY = 512  # like llama.cpp's adaptive top-p: sort the head first, all only if it is too flat


@dataclass(frozen=True)
class SamplerParams:
    """Sampling settings; defaults are llama.cpp's (`--temp 0.8 --top-k 40 --top-p 0.95 --min-p 0.05`)."""

    temperature: float = 0.8
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1.0: off
    min_p: float = 0.05  # 0.0: off
    repeat_penalty: float = 1.0  # 1.0: off
    repeat_last_n: int = 64  # 0: penalties off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None  # None: fresh entropy, reported by Sampler.seed so the run can be repeated

    def __post_init__(self):
        for name in ("top_k", "repeat_last_n", "seed"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)) and not (name == "seed" and value is None):
                raise ValueError(f"sampler setting {name}: found {value!r}, expected an integer")
        checks = [
            # finite: T = inf once turned every filtered logit into -inf / inf = NaN and drew token 0
            ("temperature", 0 <= self.temperature < math.inf, "finite and >= 0 (0 is greedy)"),
            ("top_k", self.top_k >= 0, ">= 0 (0 is off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1] (1 is off)"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1] (0 is off)"),
            ("repeat_penalty", 0 < self.repeat_penalty < math.inf, "finite and > 0 (1 is off)"),
            ("repeat_last_n", self.repeat_last_n >= 0, ">= 0 (0 is off)"),
            ("frequency_penalty", math.isfinite(self.frequency_penalty), "a finite number (0 is off)"),
            ("presence_penalty", math.isfinite(self.presence_penalty), "a finite number (0 is off)"),
            ("seed", self.seed is None or self.seed >= 0, ">= 0, or None for fresh entropy"),
        ]
        for name, ok, expected in checks:
            # NaN fails every comparison, so it lands here too.
            if not ok:
                raise ValueError(f"sampler setting {name}: found {getattr(self, name)!r}, expected {expected}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        no_op = self.repeat_penalty == 1 and self.frequency_penalty == 0 and self.presence_penalty == 0
        return self.repeat_last_n > 0 and not no_op


class Sampler:
    """Created once per generation; `sample(logits, history)` picks the next token id.

    V = n_vocab. Scratch: `_work` (V f32, the logits being filtered), `_scratch` (V f32, thresholds
    and probabilities), `_sorted` (V f64, probabilities reordered by partition), `_cdf` (V f64, the
    running mass), `_mask` (V bool), `_counts` (V i32, window counts, all zero between calls).
    """

    def __init__(self, n_vocab: int, params: SamplerParams | None = None, banned: Sequence[int] = ()):
        """`banned`: token ids never drawn (their logits count as -inf), as llama.cpp's --ignore-eos
        bans the end-of-generation tokens so a run produces exactly the tokens asked for."""
        if not isinstance(n_vocab, int) or n_vocab < 1:
            raise ValueError(f"sampler n_vocab: found {n_vocab!r}, expected an integer >= 1")
        self.n_vocab = n_vocab
        self._banned = np.array(sorted(banned), np.int64) if len(banned) else None
        self._pick = None  # `pick`'s int32 copy of the banned ids, made once
        self._device = None  # device_draw's DeviceDraw, made once and reused
        self.params = params or SamplerParams()
        self.seed = self.params.seed if self.params.seed is not None else int(np.random.SeedSequence().entropy)
        self._rng = np.random.Generator(np.random.PCG64(self.seed))
        self._work = np.empty(n_vocab, np.float32)
        self._scratch = np.empty(n_vocab, np.float32)
        self._sorted = np.empty(n_vocab, np.float64)
        self._cdf = np.empty(n_vocab, np.float64)
        self._mask = np.empty(n_vocab, np.bool_)
        self._counts = np.zeros(n_vocab, np.int32)
        n = self.params.repeat_last_n
        self._window = np.empty(n, np.int64)
        self._window_logits = np.empty(n, np.float32)
        self._window_counts = np.empty(n, np.int32)

    @property
    def pick(self) -> np.ndarray | None:
        """The banned ids (int32) when the next token is the greedy pick of the logits alone (greedy,
        no penalties): Model.step_pick can then pick it where the logits are (the device step) and
        bring back only the token. None otherwise (Model.step_sample: `device_draw`)."""
        if not self.params.greedy or self.params.penalised:
            return None
        if self._pick is None:
            self._pick = np.zeros(0, np.int32) if self._banned is None else self._banned.astype(np.int32)
        return self._pick

    def device_draw(self, history: Sequence[int] | np.ndarray, row: np.ndarray) -> "DeviceDraw":
        """This token's pick to be made where the logits are (Model.step_sample on the device step,
        DeviceBackend._sample): the draw `sample` would make, taken from the same random stream now
        (None when greedy: no draw), so the same seed picks the same token as `sample` on the host.
        `row`: the host f32 [V] the logits come down into when the device hands the pick back."""
        d = self._device
        if d is None:
            d = self._device = DeviceDraw(self)
        d.history, d.row = history, row
        d.r = None if self.params.greedy else self._rng.random()
        return d

    def device_settings(self) -> tuple[np.ndarray, int, int]:
        """dev_sample's settings: (f64 [r (0 here), temperature, top_p, min_p, log(min_p),
        repeat_penalty, frequency_penalty, presence_penalty], top_k, the penalty window: repeat_last_n,
        0 when the penalties are off)."""
        p = self.params
        log_min_p = math.log(p.min_p) if p.min_p > 0 else 0.0
        sp = np.array([0.0, p.temperature, p.top_p, p.min_p, log_min_p, p.repeat_penalty, p.frequency_penalty,
                       p.presence_penalty], np.float64)
        return sp, p.top_k, p.repeat_last_n if p.penalised else 0

    @property
    def banned(self) -> np.ndarray:
        """The banned ids, int32 (empty when none)."""
        return np.zeros(0, np.int32) if self._banned is None else self._banned.astype(np.int32)

    def check_history(self, ids: np.ndarray) -> None:
        """The penalty window's ids must be in the vocabulary (as `_penalise` checks them)."""
        if ids.size:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.n_vocab:
                raise ValueError(f"sampler history: token id {lo if lo < 0 else hi} outside the vocabulary 0..{self.n_vocab - 1}")

    def sample(self, logits: np.ndarray, history: Sequence[int] | np.ndarray = ()) -> int:
        """The next token id from `logits` (V float32), penalising tokens in the tail of `history`."""
        top = self._filter(logits, history)
        if self.params.greedy:
            return int(self._work.argmax())
        return self._draw(top, self._rng.random())

    def sample_drawn(self, logits: np.ndarray, history: Sequence[int] | np.ndarray, r: float | None) -> int:
        """`sample` with its uniform already drawn (`device_draw`'s r): the host's pick where the
        device hands it back."""
        top = self._filter(logits, history)
        if self.params.greedy:
            return int(self._work.argmax())
        return self._draw(top, r)

    def _draw(self, top: float, r: float) -> int:
        """The inverse-CDF draw with the uniform r in [0, 1) over the filtered weights."""
        cdf = np.cumsum(self._weights(top), out=self._cdf)
        u = r * cdf[-1]
        i = int(np.searchsorted(cdf, u, side="right"))
        # u < total always, but u * total can round up to total: the draw is then the last live token.
        return i if i < self.n_vocab else int(np.searchsorted(cdf, cdf[-1], side="left"))

    def fork(self, seed: int) -> "Sampler":
        """A sampler of the same settings and banned tokens with its own seed (a drafter's draws)."""
        from dataclasses import replace

        banned = () if self._banned is None else self._banned.tolist()
        return Sampler(self.n_vocab, replace(self.params, seed=seed), banned)

    def judge(self, logits: np.ndarray, history, draft: int, q: np.ndarray | None = None) -> tuple[int, bool]:
        """Speculative sampling's rule for one drafted token (Leviathan et al. 2023, "Fast Inference
        from Transformers via Speculative Decoding", algorithm 1): with p the distribution `sample`
        draws from here and q the draft's (None: the drafter named the token outright, q one-hot),
        keep `draft` with probability min(1, p(draft) / q(draft)), else draw from max(0, p - q)
        renormalised. The token that comes out is distributed as p, whatever q is. Greedy: the argmax,
        kept when it is the draft. -> (token, the draft was kept)."""
        if self.params.greedy:
            token = self.sample(logits, history)
            return token, token == draft
        p = self.distribution(logits, history, out=self._cdf)
        qx = 1.0 if q is None else float(q[draft])
        if self._rng.random() * qx < p[draft]:
            return draft, True
        # the residual max(0, p - q): q one-hot takes only the draft's mass away
        if q is None:
            p[draft] = 0
        else:
            np.subtract(p, q, out=p)
            np.maximum(p, 0, out=p)
        cdf = np.cumsum(p, out=p)
        u = self._rng.random() * cdf[-1]
        i = int(np.searchsorted(cdf, u, side="right"))
        return (i if i < self.n_vocab else int(np.searchsorted(cdf, cdf[-1], side="left"))), False

    def distribution(self, logits: np.ndarray, history: Sequence[int] | np.ndarray = (), out: np.ndarray | None = None) -> np.ndarray:
        """The normalised probabilities `sample` draws from (f64, V; one-hot when greedy). No draw is made."""
        top = self._filter(logits, history)
        out = np.empty(self.n_vocab, np.float64) if out is None else out
        if self.params.greedy:
            out.fill(0)
            out[int(self._work.argmax())] = 1
            return out
        np.copyto(out, self._weights(top))
        out /= out.sum()
        return out

    def _filter(self, logits: np.ndarray, history) -> float:
        """Run the chain up to the draw on `_work`; returns the max logit after penalties."""
        self._check_logits(logits)
        work, p = self._work, self.params
        np.copyto(work, logits)
        if self._banned is not None:
            work[self._banned] = -np.inf
        if p.penalised:
            self._penalise(history)
        top = float(work.max())
        if not math.isfinite(top):
            # NaN propagates through max; a NaN or +inf logit is an upstream bug, never a token choice.
            raise NonFiniteActivation(f"sampler: logits contain {'NaN' if top != top else top} (max over the vocabulary); refusing to sample")
        if p.greedy:
            return top
        if 0 < p.top_k < self.n_vocab:
            self._top_k(p.top_k)
        if p.top_p < 1:
            self._top_p(top, p.top_p)
        if p.min_p > 0:
            # p_i >= min_p * p_max  <=>  logit_i >= max + log(min_p), the test llama.cpp makes.
            self._drop_where_below(work, top + math.log(p.min_p))
        return top

    def _check_logits(self, logits: np.ndarray) -> None:
        if not isinstance(logits, np.ndarray) or logits.dtype != np.float32 or logits.shape != (self.n_vocab,):
            found = f"{type(logits).__name__} {getattr(logits, 'dtype', '?')} {getattr(logits, 'shape', '?')}"
            raise ValueError(f"sampler logits: found {found}, expected a float32 array of shape ({self.n_vocab},)")

    def _penalise(self, history) -> None:
        p, n = self.params, min(self.params.repeat_last_n, len(history))
        if n == 0:
            return
        win = self._window[:n]
        win[:] = history[len(history) - n :]
        lo, hi = int(win.min()), int(win.max())
        if lo < 0 or hi >= self.n_vocab:
            raise ValueError(f"sampler history: token id {lo if lo < 0 else hi} outside the vocabulary 0..{self.n_vocab - 1}")
        counts, logit = self._window_counts[:n], self._window_logits[:n]
        np.add.at(self._counts, win, 1)
        np.take(self._counts, win, out=counts)
        self._counts[win] = 0
        np.take(self._work, win, out=logit)
        # Divide positive logits, multiply the others: dividing a negative one would RAISE its odds.
        penalised = np.where(logit > 0, logit / p.repeat_penalty, logit * p.repeat_penalty)
        penalised -= counts * p.frequency_penalty + p.presence_penalty
        # A token repeated in the window appears several times in `win` with the same new value.
        self._work[win] = penalised

    def _top_k(self, k: int) -> None:
        s = self._scratch
        np.copyto(s, self._work)
        s.partition(self.n_vocab - k)
        self._drop_where_below(self._work, float(s[self.n_vocab - k]))

    def _top_p(self, top: float, top_p: float) -> None:
        probs = self._probabilities(top, 1.0, self._scratch)
        need = top_p * float(probs.sum())  # probs are unnormalised (max 1)
        live = int(np.count_nonzero(probs))
        np.copyto(self._sorted, probs)
        head = min(live, _TOP_P_FIRST_TRY)
        cutoff = self._mass_cutoff(head, need)
        if cutoff is None and head < live:
            cutoff = self._mass_cutoff(live, need)
        if cutoff is not None:
            self._drop_where_below(probs, cutoff)

    def _mass_cutoff(self, m: int, need: float) -> float | None:
        """The probability of the last token of the top-p set, if the m most probable reach `need`."""
        # Partition puts the m largest of `_sorted` at its end, then they are sorted ascending in place.
        v, ranked = self.n_vocab, self._sorted
        if m < v:
            ranked.partition(v - m)
        tail = ranked[v - m :]
        tail.sort()
        cum = np.cumsum(tail[::-1], out=self._cdf[:m])
        i = int(np.searchsorted(cum, need, side="left"))
        return float(tail[m - 1 - i]) if i < m else None

    def _drop_where_below(self, values: np.ndarray, threshold: float) -> None:
        """Set the logit of every token whose entry in `values` is below `threshold` to -inf."""
        np.less(values, threshold, out=self._mask)
        np.copyto(self._work, -np.inf, where=self._mask)

    def _probabilities(self, top: float, temperature: float, out: np.ndarray) -> np.ndarray:
        """exp((work - top) / T) in `out`, unnormalised (the top token has 1); dropped tokens get 0."""
        np.subtract(self._work, top, out=out)
        if temperature != 1:
            out /= temperature
        return np.exp(out, out=out)

    def _weights(self, top: float) -> np.ndarray:
        """The unnormalised draw weights at the set temperature, in `_cdf` (f64)."""
        # Copied to f64 before summing: a cumsum (or a ufunc) that casts f32 to f64 makes a temporary.
        np.copyto(self._cdf, self._probabilities(top, self.params.temperature, self._scratch))
        return self._cdf


class DeviceDraw:
    """One token's sampled pick made on the device (Sampler.device_draw): the sampler, the history
    its penalties read, the uniform r of its draw (None: greedy) and the host row the logits come
    down into when the device hands the pick back to the host."""

    __slots__ = ("sampler", "history", "r", "row")

    def __init__(self, sampler: Sampler):
        self.sampler, self.history, self.r, self.row = sampler, (), None, None
