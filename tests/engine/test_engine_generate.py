"""The decode loop (S11), its stopping rules, the token path's allocations (S12), and expert serving
through a block type, on the synthetic qwen35moe of engine_fixture.py.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import engine_fixture as F
from strata.engine.generate import generate
from strata.engine.model import ContextFull, Model
from strata.engine.pack_reader import Pack
from strata.engine.sampling import Sampler, SamplerParams

PROMPT = [5, 77, 140, 3, 200, 41, 9]
GREEDY = SamplerParams(temperature=0)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Model:
    return Model(Pack.open(F.make_pack(tmp_path_factory.mktemp("gen"))))


def run(model, n, *, ctx=None, params=GREEDY, stop_ids=(), prompt=PROMPT):
    rows = {}
    s = model.new_session(ctx or len(prompt) + n)
    out = generate(model, s, prompt, Sampler(model.geometry.n_vocab, params), n, stop_ids=stop_ids,
                   on_logits=lambda pos, logits: rows.__setitem__(pos, logits.copy()))
    return out, rows


def test_prompt_and_generated_positions_are_one_loop(model):
    out, rows = run(model, 6)
    # by hand: feed the prompt, then each argmax; the first generated token is the argmax at the
    # LAST prompt position, and every fed position produced exactly the logits recorded
    s = model.new_session(32)
    fed, want = list(PROMPT), []
    for pos in range(len(PROMPT) + 5):
        logits = model.step(s, fed[pos]).copy()
        assert np.array_equal(logits, rows[pos]), pos
        if pos >= len(PROMPT) - 1:
            want.append(int(logits.argmax()))
            fed.append(want[-1])
    assert out.tokens.tolist() == want
    assert out.prompt.tolist() == PROMPT
    assert out.positions == len(PROMPT) + 5 == len(rows)  # the last sampled token is never fed
    assert out.stop == "length"


def test_stops_at_a_stop_token_and_includes_it(model):
    free, _ = run(model, 8)
    stop = int(free.tokens[3])
    first = free.tokens.tolist().index(stop)
    out, _ = run(model, 8, stop_ids={stop})
    assert out.stop == "eos"
    assert out.tokens.tolist() == free.tokens[: first + 1].tolist()


def test_zero_tokens_feeds_the_prompt_only(model):
    out, rows = run(model, 0)
    assert out.tokens.size == 0 and out.positions == len(PROMPT) == len(rows)


def test_a_full_context_stops_generation(model):
    out, _ = run(model, 10, ctx=len(PROMPT) + 2)
    # positions n-1, n and n+1 each yield a token; the third cannot be fed
    assert (out.stop, len(out.tokens), out.positions) == ("context", 3, len(PROMPT) + 2)
    s = model.new_session(1)
    model.step(s, 1)
    with pytest.raises(ContextFull, match="position 1: the session's context is 1"):
        model.step(s, 1)


def test_bad_calls_are_refused(model):
    with pytest.raises(ValueError, match="prompt is empty"):
        run(model, 3, prompt=[])
    with pytest.raises(ValueError, match="prompt has 7 tokens, the context holds 4"):
        run(model, 3, ctx=4)
    with pytest.raises(ValueError, match="token id 320 outside the vocabulary"):
        model.step(model.new_session(4), 320)


def test_a_seed_reproduces_a_sampled_run(model):
    params = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a, _ = run(model, 12, params=params)
    b, _ = run(model, 12, params=params)
    assert a.tokens.tolist() == b.tokens.tolist()


NUMPY_DATA = tracemalloc.DomainFilter(True, 389047)  # numpy traces array buffers in its own domain


def test_the_token_path_keeps_no_allocation(model):
    """S12: after warm-up, 32 decode steps leave the live numpy buffers exactly as they were (nothing
    made per token is kept: no logits row, no grown cache, no history copy), and every step returns
    the session's one logits buffer. Only numpy's buffers are counted: Python's own free lists
    (tuples, scalars) keep freed objects and read as slow growth, which is not the token path's."""
    n_warm, n_steps = 32, 32
    s = model.new_session(len(PROMPT) + n_warm + n_steps + 1)
    sampler = Sampler(model.geometry.n_vocab, SamplerParams(temperature=0.8, seed=7))
    live = []
    seen = np.zeros(2, np.int64)  # [tokens sampled, steps that returned s.logits]: counters that do not grow

    def on_token(_token):
        if seen[0] in (n_warm, n_warm + n_steps):
            traces = tracemalloc.take_snapshot().filter_traces([NUMPY_DATA]).traces
            live.append(sum(t.size for t in traces))
        seen[0] += 1

    def on_logits(_pos, logits):
        seen[1] += logits is s.logits

    tracemalloc.start()
    try:
        out = generate(model, s, PROMPT, sampler, n_warm + n_steps + 1, on_token=on_token, on_logits=on_logits)
    finally:
        tracemalloc.stop()
    assert live[1] == live[0], f"live numpy buffers grew {live[1] - live[0]} B over {n_steps} decode steps"
    assert seen[1] == out.positions



def _prefill_with_routing(model, prompt):
    """Logits and the routed expert sets of every layer at each prompt position."""
    s = model.new_session(len(prompt))
    logits, routes = [], []
    for token in prompt:
        before = s.routing.copy()  # per-layer expert counts: the experts this position routed to are the ones that grew
        logits.append(model.step(s, token).copy())
        routes.append([frozenset(np.flatnonzero(s.routing[l] > before[l]).tolist()) for l in range(len(model.moes))])
    return np.array(logits), routes


def test_quantized_experts_are_served_by_their_own_offsets(tmp_path):
    """Q8_0 experts (ActQ activations) against the same dequantized values as F32 experts: where the
    routing agrees they differ only by the activation rounding (about 1-3%); one expert read at
    another's offset would change the MoE output by its whole size."""
    q = F.make_pack(tmp_path, "q", types={"experts": "Q8_0"})
    f32_gguf = F.dequantized_copy(tmp_path / "q.gguf", tmp_path / "f.gguf")
    from strata.tools import pack as tools_pack

    tools_pack.convert([f32_gguf], tmp_path / "f-pack")
    prompt = list(range(3, 200, 7))  # teacher-forced only: both runs see the same tokens
    (a, ra), (b, rb) = (_prefill_with_routing(Model(Pack.open(d)), prompt) for d in (q, tmp_path / "f-pack"))
    # the rounding can flip a near-tie in a router; such a position is legitimately different
    same = [i for i in range(len(prompt)) if ra[i] == rb[i]]
    assert len(same) >= 0.8 * len(prompt)
    rel = np.abs(a[same] - b[same]).max() / np.abs(b[same]).max()
    assert rel < 0.06, rel
