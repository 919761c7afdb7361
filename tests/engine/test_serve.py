"""`strata serve`: the OpenAI API through the real `openai` client, errors through plain httpx, the
queue, disconnects, SIGTERM, and the conversation cache (a resumed session gives a cold one's logits).

The servers run in this process on 127.0.0.1 with an ephemeral port (a socket bound here and handed
to uvicorn), over the tiny synthetic pack; one test starts `strata serve` as a process for SIGTERM.
Exact settings (--kv f32, prefill off) make the server's greedy output comparable token for token
with `strata generate --temp 0` under the same flags.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import pwd
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn

import engine_fixture as F
from strata.engine.cli import main
from strata.engine.generate import generate
from strata.engine.model import Model
from strata.engine.pack_reader import Pack
from strata.engine.sampling import Sampler, SamplerParams
from strata.engine.scheduler import ConversationCache, Job, Scheduler, StopText, run_and_wait, session_bytes
from strata.engine.serve import ServeConfig, make_app
from strata.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CTX = 256
EXACT = ("--kv", "f32", "--prefill", "off", "-c", str(CTX))
NAME = "tiny"
GREEDY = SamplerParams(temperature=0)


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    return F.make_pack(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def engine(pack_dir):
    model = Model(Pack.open(pack_dir))
    return model, Tokenizer.load(pack_dir / "tokenizer.txt")


class Running:
    """A server on 127.0.0.1 in a thread: `url`, `scheduler`; `stop()` shuts it down as SIGTERM would."""

    def __init__(self, engine, *, max_queue=8, slots=4, api_key=None, check=lambda: None, tier=None, graceful=5,
                 batch=1, chunk=1):
        model, tok = engine
        self.scheduler = Scheduler(model, tok, max_context=CTX, kv="f32", chunk=chunk, max_queue=max_queue,
                                   cache=ConversationCache(slots, 64 << 20), check=check, batch=batch)
        app = make_app(self.scheduler, tok, ServeConfig(model_name=NAME, max_context=CTX, api_key=api_key), tier)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start in 30 s"
            time.sleep(0.02)

    def client(self, key="none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server(engine):
    s = Running(engine)
    yield s
    s.stop()


def cli_generate(pack_dir, capsys, *args) -> str:
    assert main(["generate", str(pack_dir), "-t", "1", "--temp", "0", *EXACT, *args]) == 0
    return capsys.readouterr().out.removesuffix("\n")


# --- the API through the openai client ---------------------------------------------------------------


def test_completion_greedy_equals_strata_generate(server, pack_dir, capsys):
    want = cli_generate(pack_dir, capsys, "-p", "hello world", "-n", "12", "--ignore-eos")
    r = server.client().completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(Tokenizer.load(pack_dir / "tokenizer.txt").encode("hello world"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 12, n_prompt + 12)
    # streamed, the pieces join to the same text, the last chunk carries the finish reason
    chunks = list(server.client().completions.create(model=NAME, prompt="hello world", max_tokens=12, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_greedy_equals_strata_generate_chat(server, pack_dir, capsys):
    want = cli_generate(pack_dir, capsys, "--chat", "--system", "be brief", "-p", "hi there", "-n", "10")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    stream = server.client().chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                     stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_prompt_as_token_ids_and_seeded_sampling(server, pack_dir, capsys):
    ids = [5, 77, 140, 3]
    want = cli_generate(pack_dir, capsys, "--prompt-ids", "5 77 140 3", "-n", "6", "--ignore-eos")
    r = server.client().completions.create(model=NAME, prompt=ids, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.usage.prompt_tokens == 4
    # a seed makes a sampled reply repeatable; top_k / min_p are accepted as vLLM spells them
    kw = dict(model=NAME, prompt=ids, max_tokens=8, temperature=1.5, seed=7, extra_body={"top_k": 50, "min_p": 0.01})
    assert server.client().completions.create(**kw).choices[0].text == server.client().completions.create(**kw).choices[0].text


def test_stop_strings_cut_the_text(server):
    c = server.client()
    full = c.completions.create(model=NAME, prompt=[9, 8, 7], max_tokens=16, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:7]
    assert stop and full.find(stop) >= 0
    r = c.completions.create(model=NAME, prompt=[9, 8, 7], max_tokens=16, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[: full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=NAME, prompt=[9, 8, 7], max_tokens=16, temperature=0, stop=stop,
                                    stream=True, extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == full[: full.find(stop)]


def test_stop_text_holds_back_a_partial_stop():
    s = StopText(["END"])
    assert s.push("abcE") == "abc"  # "E" may begin END
    assert s.push("N") == ""
    assert s.push("Dxyz") == "" and s.stopped and s.text == "abc"
    s = StopText(["END"])
    assert s.push("xE") == "x" and s.push("Q") == "EQ" and s.flush() == "" and not s.stopped


def test_models_health_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    m = server.metrics()
    for name in ("strata_tokens_generated_total", "strata_queue_depth", "strata_conversation_cache_hits_total",
                 "strata_conversation_cache_misses_total"):
        assert name in m
    assert any(k.startswith("strata_requests_total") for k in m)


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, param", [
    ("completions", b'{"prompt": "hi", "max_tokens": ', None),  # malformed JSON
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "n": 2}, "n"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, "model"),
    ("completions", {"prompt": [1, 2, 320]}, "prompt[2]"),
    ("completions", {"prompt": [1] * CTX}, "prompt"),  # fills the context: nothing left to generate
    ("completions", {"prompt": "hi", "max_tokens": CTX}, "max_tokens"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", [1, 2], None),
    ("completions", b'{"prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate: JSON, but no text
    ("chat/completions", b'{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "\\udc00"}]}',
     "messages[1].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ("completions", {"prompt": "hi", "echo": True}, "echo"),
    ("completions", {"prompt": "hi", "stream": "maybe"}, "stream"),
])
def test_bad_requests_get_400_naming_the_field(server, path, body, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/{path}", timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if param is not None:
        assert param.split("[")[0] in err["message"]


def test_api_key(engine):
    s = Running(engine, api_key="sekrit")
    try:
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model=NAME, prompt="hi", max_tokens=1)
        assert s.client("sekrit").completions.create(model=NAME, prompt="hi", max_tokens=1,
                                                   extra_body={"ignore_eos": True}).usage.completion_tokens == 1
        assert httpx.get(f"{s.url}/health").status_code == 200  # a health check needs no key
    finally:
        s.stop()


class Gate:
    """The worker's per-token check, held closed so a request stays running while a test looks."""

    def __init__(self):
        self.open, self.reached = threading.Event(), threading.Event()

    def __call__(self):
        self.reached.set()
        assert self.open.wait(30)


def test_full_queue_gets_503_with_retry_after(engine):
    gate = Gate()
    s = Running(engine, max_queue=1, check=gate)
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=60)
            assert gate.reached.wait(30)  # running, held at its first token
            second = pool.submit(httpx.post, f"{s.url}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 10
            while s.scheduler.queue_depth < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            third = httpx.post(f"{s.url}/v1/completions", json=body, timeout=10)
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["code"] == "server_busy"
            assert s.metrics()["strata_queue_depth"] == 1
            gate.open.set()
            assert first.result().status_code == 200 and second.result().status_code == 200
        assert s.scheduler.idle and s.scheduler.counters.requests_rejected == 1
    finally:
        gate.open.set()
        s.stop()


def test_a_client_that_disconnects_frees_the_worker(engine):
    gate = Gate()
    s = Running(engine, check=gate)
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            assert gate.reached.wait(30)
        # the connection is closed while the worker is held at its first token
        time.sleep(0.3)
        gate.open.set()
        deadline = time.monotonic() + 20
        while not s.scheduler.idle:
            assert time.monotonic() < deadline, "the worker kept running for a client that left"
            time.sleep(0.02)
        c = s.scheduler.counters
        assert c.requests_cancelled == 1 and c.tokens_generated < 200
        # and the server still answers
        # ignore_eos: the request samples at the default temperature, and the tiny model's EOS
        # came up as its second token in one CI run (1 completion token, finish_reason "stop")
        r = s.client().completions.create(model=NAME, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 2
    finally:
        gate.open.set()
        s.stop()


def test_a_client_that_gives_up_on_a_plain_request_frees_the_worker(engine):
    gate = Gate()
    s = Running(engine, check=gate)
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{s.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        deadline = time.monotonic() + 10  # the worker is held at its first token until the server notices
        while not s.scheduler.jobs_running()[0].cancelled:
            assert time.monotonic() < deadline, "the server did not notice that its client left"
            time.sleep(0.02)
        gate.open.set()
        deadline = time.monotonic() + 20
        while not s.scheduler.idle:
            assert time.monotonic() < deadline, "the worker kept running for a client that left"
            time.sleep(0.02)
        assert s.scheduler.counters.requests_cancelled == 1 and s.scheduler.counters.tokens_generated < 200
    finally:
        gate.open.set()
        s.stop()


def test_shutdown_cancels_a_reply_that_outlasts_the_graceful_timeout(engine):
    """The shutdown SIGTERM starts: a reply still running when uvicorn's graceful timeout ends is
    cancelled, the worker stops at its next token and the server's thread ends."""
    gate = Gate()
    s = Running(engine, check=gate, graceful=0.5)
    try:
        body = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reply = pool.submit(lambda: httpx.post(f"{s.url}/v1/completions", json=body, timeout=30).text)
            assert gate.reached.wait(30)
            s.server.should_exit = True  # what uvicorn's SIGTERM handler does
            job = s.scheduler.jobs_running()[0]
            deadline = time.monotonic() + 10
            while not job.cancelled:
                assert time.monotonic() < deadline, "the running reply was not cancelled at shutdown"
                time.sleep(0.02)
            gate.open.set()
            s.thread.join(30)
            assert not s.thread.is_alive()
            try:  # the reply is cut: the connection closes without the stream's end
                assert "data: [DONE]" not in reply.result()
            except httpx.RemoteProtocolError:
                pass
        c = s.scheduler.counters
        assert c.requests_cancelled == 1 and c.tokens_generated < 200 and s.scheduler.idle
    finally:
        gate.open.set()


@pytest.mark.parametrize("batch", [1, 3])
def test_a_mixed_burst_leaves_nothing_behind(engine, batch):
    """160 requests from 8 threads: good ones (streamed or not), bad ones of every kind, some past the
    queue; afterwards the queue is empty and the counters add up to what was sent."""
    s = Running(engine, max_queue=3, batch=batch)
    rng = random.Random(0)
    good = [{"prompt": "abc", "max_tokens": 2}, {"prompt": [4, 5, 6], "max_tokens": 3, "stream": True},
            {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 2}]
    bad = [b'{"prompt": ', {"prompt": "a", "max_tokens": -1}, {"prompt": "a", "model": "x"}, {"prompt": [1] * 400},
           {"prompt": "a", "temperature": "hot"}, {"messages": [{"role": 3}]}]
    plan = [rng.choice(good if rng.random() < 0.6 else bad) for _ in range(160)]

    def send(body):
        path = "chat/completions" if isinstance(body, dict) and "messages" in body else "completions"
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(f"{s.url}/v1/{path}", timeout=60, **kw)
        if r.status_code == 200 and isinstance(body, dict) and body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        return r.status_code

    try:
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(send, plan))
        assert time.monotonic() - t0 < 120
        assert set(codes) <= {200, 400, 503}, codes
        assert codes.count(400) == sum(body in bad for body in plan)
        m = s.metrics()
        assert s.scheduler.idle and m["strata_queue_depth"] == 0 and m["strata_requests_running"] == 0
        for code in (200, 400, 503):
            assert m.get(f'strata_requests_total{{code="{code}"}}', 0) == codes.count(code)
        c = s.scheduler.counters
        assert c.requests_done == codes.count(200) and c.requests_rejected == codes.count(503)
        assert c.requests_failed == 0 and c.requests_cancelled == 0
    finally:
        s.stop()


# --- batch slots -------------------------------------------------------------------------------------


def test_batch_slots_give_each_request_what_it_gets_alone(engine, monkeypatch):
    """Six greedy requests (prompts of 3 to 40 tokens in chunks of 8, 5 to 14 tokens each) through
    --batch 3 at once: each one's text and tokens are exactly those it gets alone (--batch 1, one
    after another), while the worker really fed several requests in one forward, a prompt chunk
    beside others' decode tokens among them."""
    model, tok = engine
    rng = np.random.default_rng(7)
    plan = [(rng.integers(3, 256, n).tolist(), m) for n, m in ((3, 9), (40, 5), (17, 14), (8, 8), (25, 11), (5, 6))]

    def jobs():
        return [Job(p, m, GREEDY, ignore_eos=True) for p, m in plan]

    alone = Scheduler(model, tok, max_context=CTX, kv="f32", chunk=8, max_queue=8, cache=ConversationCache(0, 0))
    try:
        want = [run_and_wait(alone, j, 60) for j in jobs()]
    finally:
        alone.close()
    widths, real = [], model.forward_batch

    def spy(sessions, tokens, n_logits):
        widths.append([len(t) for t in tokens])
        return real(sessions, tokens, n_logits)

    monkeypatch.setattr(model, "forward_batch", spy)
    batched = Scheduler(model, tok, max_context=CTX, kv="f32", chunk=8, max_queue=8, cache=ConversationCache(0, 0),
                        batch=3)
    try:
        got = jobs()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda j: run_and_wait(batched, j, 60), got))
        assert batched.idle and batched.counters.requests_done == 6 and batched.counters.requests_failed == 0
    finally:
        batched.close()
    for w, g in zip(want, got):
        assert g.error is None and g.finish == w.finish == "length"
        assert g.result.tokens.tolist() == w.result.tokens.tolist() and g.text == w.text
    assert max(len(w) for w in widths) == 3  # three requests in one forward
    assert any(len(w) > 1 and max(w) > 1 and min(w) == 1 for w in widths)  # a prompt chunk beside decode tokens


# --- the conversation cache --------------------------------------------------------------------------


def test_a_resumed_session_gives_a_cold_sessions_logits(engine):
    model, _ = engine
    first, more = [5, 77, 140, 3, 9], [11, 12, 13]
    cache = ConversationCache(2, 64 << 20)
    s = model.new_session(CTX, "f32")
    g = generate(model, s, first, Sampler(320, GREEDY), 4)
    cache.park(g.fed.tolist(), s)
    prompt = g.fed.tolist() + more
    hot = []
    session, start = cache.take(prompt, CTX, "f32")
    assert start == len(g.fed) and len(cache) == 0 and cache.hits == 1 and cache.tokens_saved == start
    warm = generate(model, session, prompt, Sampler(320, GREEDY), 5, start=start, on_logits=lambda p, l: hot.append((p, l.copy())))
    cold_rows = {}
    cold = generate(model, model.new_session(CTX, "f32"), prompt, Sampler(320, GREEDY), 5,
                    on_logits=lambda p, l: cold_rows.__setitem__(p, l.copy()))
    assert [p for p, _ in hot] == list(range(start, warm.positions))  # only the new tokens were fed
    for p, row in hot:
        assert np.array_equal(row, cold_rows[p]), p
    assert np.array_equal(warm.tokens, cold.tokens)


def test_cache_lookup_and_eviction(engine):
    model, _ = engine
    one = session_bytes(model.new_session(CTX, "f32"))

    def parked(n):
        s = model.new_session(CTX, "f32")
        s.pos = n  # the lookup reads only the position and the key
        return s

    cache = ConversationCache(2, 64 << 20)
    cache.park([1, 2], parked(2))
    cache.park([1, 2, 3, 4], parked(4))
    assert cache.take([1, 2], CTX, "f32") is None  # equal, not longer: nothing left to feed
    assert cache.take([1, 2, 3, 4, 5], CTX, "f32")[1] == 4  # the longest prefix wins
    assert cache.take([1, 2, 3], CTX, "f16") is None  # another KV type: a miss
    cache.park([7], parked(1))
    cache.park([8], parked(1))  # two slots: [1, 2] (least recently used) goes
    assert cache.take([1, 2, 9], CTX, "f32") is None and cache.evictions == 1
    small = ConversationCache(5, one + one // 2)  # the bytes cap: one session fits
    small.park([1], parked(1))
    small.park([2], parked(1))
    assert len(small) == 1 and small.bytes == one and small.take([2, 3], CTX, "f32") is not None


def test_a_second_turn_resumes_and_matches_a_cold_server(engine, server):
    """Turn 2's prompt extends turn 1's (its prompt and reply, as token ids: the tiny model's byte
    tokens are often not UTF-8, so its text would not re-encode to the same ids): only the new
    tokens are fed, and the reply is a cold server's."""
    model, tok = engine
    turn1 = [21, 22, 23, 24, 25, 26]
    reply = generate(model, model.new_session(CTX, "f32"), turn1, Sampler(320, GREEDY), 6, stop_ids=tok.stop_ids)
    r1 = server.client().completions.create(model=NAME, prompt=turn1, max_tokens=6, temperature=0)
    assert r1.usage.completion_tokens == len(reply.tokens)
    turn2 = turn1 + reply.tokens.tolist() + [30, 31, 32]
    before = server.metrics()
    r2 = server.client().completions.create(model=NAME, prompt=turn2, max_tokens=6, temperature=0)
    after = server.metrics()
    delta = lambda name: after[name] - before[name]  # noqa: E731
    # the last sampled token of turn 1 was never fed: the parked session holds one token less
    assert delta("strata_conversation_cache_hits_total") == 1
    assert delta("strata_conversation_cache_tokens_saved_total") == len(turn1) + len(reply.tokens) - 1
    assert delta("strata_prompt_tokens_fed_total") == 4 and delta("strata_conversation_cache_misses_total") == 0
    cold = Scheduler(model, tok, max_context=CTX, kv="f32", chunk=1, max_queue=0, cache=ConversationCache(0, 0))
    try:
        job = run_and_wait(cold, Job(prompt=turn2, max_tokens=6, params=GREEDY), timeout=60)
        assert job.resumed == 0 and job.text == r2.choices[0].text
    finally:
        cold.close()


# --- the command -------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--batch", "0"], "--batch 0: expected at least 1"),
    (["--port", "70000"], "--port 70000: expected 0..65535"),
    (["--conversation-cache-mib", "-1"], "--conversation-cache-mib -1"),
    (["--kv", "q4"], "--kv 'q4'"),
])
def test_serve_refuses_bad_flags_before_loading(pack_dir, capsys, args, message):
    assert main(["serve", str(pack_dir), *args]) == 1
    assert message in capsys.readouterr().err


def test_serve_refuses_an_unknown_gpu_step_before_loading(pack_dir, capsys):
    assert main(["serve", str(pack_dir), "--gpu-step", "card"]) == 2
    assert "--gpu-step 'card': expected host or device" in capsys.readouterr().err


def test_sigterm_stops_the_server_cleanly(pack_dir):
    """A real `strata serve` process: a streaming request in flight, then SIGTERM: the process exits 0."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    code = "import sys; from strata.engine.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", str(pack_dir), "--port", str(port), "-t", "1",
                             "-c", str(CTX), "--prefill", "off"], cwd=pack_dir.parent, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "strata serve did not come up in 120 s"
            time.sleep(0.2)
        body = {"prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert proc.wait(60) == 0
        # the graceful timeout (10 s) is long enough for 100 tiny tokens: the reply was finished
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_on_the_gpu_tier_the_replies_are_the_cpus_and_metrics_count_hits(pack_dir, server, rt):
    """The GPU tier (CUDA, or its host emulation) bound to a model of its own: a request runs on the
    worker thread, gives the all-CPU server's text, and /metrics reports the expert hits."""
    from strata.engine.tier import GpuTier, TierOptions

    model = Model(Pack.open(pack_dir))
    tier = GpuTier.start(model, TierOptions(max_context=CTX, kv="f32", prefill_chunk=16, expert_cache=None))
    try:
        s = Running((model, Tokenizer.load(pack_dir / "tokenizer.txt")), tier=tier)
        try:
            kw = dict(model=NAME, prompt=[7, 8, 9, 10], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
            assert s.client().completions.create(**kw).choices[0].text == server.client().completions.create(**kw).choices[0].text
            m = s.metrics()
            assert m["strata_gpu_expert_hits_total"] > 0
            total = m["strata_gpu_expert_hits_total"] + m["strata_gpu_expert_misses_total"]
            assert abs(m["strata_gpu_expert_hit_rate"] - m["strata_gpu_expert_hits_total"] / total) < 1e-6
        finally:
            s.stop()
    finally:
        tier.stop()


# --- strata chat -------------------------------------------------------------------------------------


def test_chat_keeps_the_conversation(pack_dir, engine, capsys, monkeypatch):
    """Two turns typed, then end of input (Ctrl-D): reply 1 is `strata generate --chat`'s, reply 2 the
    one a cold run of the whole two-turn conversation gives; exit 0."""
    model, tok = engine
    want1 = cli_generate(pack_dir, capsys, "--chat", "--system", "be brief", "-p", "hi", "-n", "5", "--ignore-eos")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nmore\n"))
    assert main(["chat", str(pack_dir), "-t", "1", "--temp", "0", *EXACT, "-n", "5", "--system", "be brief",
                 "--stats"]) == 0
    out, err = capsys.readouterr()
    reply1, reply2 = out.split("\n")[:2]
    # the tiny model never samples a stop token in 5 greedy tokens here: reply 1 is generate's whole output
    assert reply1 == want1
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": reply1}, {"role": "user", "content": "more"}]
    ids = tok.encode(tok.apply_chat_template(turns, add_generation_prompt=True))
    cold = Scheduler(model, tok, max_context=CTX, kv="f32", chunk=1, max_queue=0, cache=ConversationCache(0, 0))
    try:
        assert reply2 == run_and_wait(cold, Job(prompt=ids, max_tokens=5, params=GREEDY), timeout=60).text
    finally:
        cold.close()
    assert err.count("strata chat: prompt ") == 2 and f"prompt {len(ids)} tokens" in err


def test_chat_with_spec_replies_as_without(tmp_path_factory, pack_dir, capsys, monkeypatch):
    """strata chat --spec 2 (the pack's MTP block drafting, every draft kept to try: --spec-min-p 0):
    two greedy turns reply as --spec 0's; a pack without the block is refused before the load."""
    mtp = F.make_pack(tmp_path_factory.mktemp("chat-mtp"), n_mtp_layer=1, mtp_shared_head_norm=1)
    replies = []
    for spec in ("0", "2"):
        monkeypatch.setattr("sys.stdin", io.StringIO("hi\nmore\n"))
        assert main(["chat", str(mtp), "-t", "1", "--temp", "0", *EXACT, "-n", "6", "--ignore-eos", "--spec", spec,
                     "--spec-min-p", "0", "--stats"]) == 0
        out, err = capsys.readouterr()
        replies.append(out)
        assert err.count("reply 6 tokens") == 2, err
        drafting = re.findall(r"--spec 2: (\d+) of (\d+) drafts kept, (\d+) verifications", err)
        if spec == "2":  # (six tokens a turn: the first from the prompt, five from verifications of 1 + 2 rows)
            assert len(drafting) == 2 and int(drafting[-1][1]) > 0 and int(drafting[-1][2]) >= 4, err
        else:
            assert drafting == [], err
    assert replies[0] == replies[1] and len(replies[0].split("\n")) >= 3
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", str(pack_dir), "-t", "1", *EXACT, "--spec", "2"]) == 1
    assert "--spec 2 drafts with the pack's MTP block" in capsys.readouterr().err


def test_chat_refuses_a_conversation_past_the_context(pack_dir, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("x" * 300 + "\n"))
    assert main(["chat", str(pack_dir), "-t", "1", *EXACT]) == 1
    assert f"the context holds {CTX}: start again with a larger --ctx-size" in capsys.readouterr().err


def test_chat_ignore_eos_replies_exactly_n_tokens(pack_dir, capsys, monkeypatch):
    """--ignore-eos bans the stop tokens as generate's does: the seeded reply that ends by itself after
    308 tokens runs to -n 400 (the end token never printed)."""
    args = ["chat", str(pack_dir), "-t", "1", "-c", "8192", "--prefill", "off", "--stats", "--seed", "4", "-n", "400"]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(args) == 0
    assert "reply 308 tokens" in capsys.readouterr().err  # the reply's own end, without the option
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main([*args, "--ignore-eos"]) == 0
    out, err = capsys.readouterr()
    assert "reply 400 tokens" in err and "<|im_end|>" not in out


def test_chat_ctrl_c_stops_a_reply_and_ctrl_d_exits(pack_dir):
    """A real `strata chat` process: Ctrl-C (SIGINT) in the middle of a long reply stops that reply
    and the chat goes on; the end of input (Ctrl-D) then exits 0."""
    # SIGINT as a terminal leaves it: a suite started in the background of a non-interactive shell runs
    # with SIGINT ignored, which its children inherit, and Python then installs no handler (2026-12-03:
    # the reply ran all its 8000 tokens and this test failed, for that reason alone)
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from strata.engine.cli import main; sys.exit(main())")
    # --ignore-eos -n 8000: a reply of 8000 tokens (~20 s here) unless stopped. With the fixture's
    # model sampling its end token, a reply ended by itself within 0.3-1.2 s (--seed 4: 308 tokens),
    # at times before the signal arrived on a loaded 2-core host; the Ctrl-C then met the next prompt
    # and the chat exited without "reply stopped" (2026-12-02: in three full runs of the suite)
    proc = subprocess.Popen([sys.executable, "-c", code, "chat", str(pack_dir), "-t", "1", "-c", "8192", "-n", "8000",
                             "--prefill", "off", "--stats", "--ignore-eos"], cwd=pack_dir.parent, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.stdin.write(b"hello\n")
        proc.stdin.flush()
        assert proc.stdout.read(1)  # the reply has begun (its 8000 tokens take far longer than the signal)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        out, err = proc.communicate(b"", timeout=60)  # stdin closed: Ctrl-D at the next prompt
        assert proc.returncode == 0, err.decode()
        err = err.decode()
        assert "strata chat: reply stopped" in err
        replied = re.search(r"reply (\d+) tokens", err)
        assert replied and int(replied.group(1)) < 8000  # stopped before -n
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- several servers behind nginx (docs/serve.md's configuration, as written there) --------------------


def _documented_nginx(a: str, b: str, listen: str) -> str:
    """docs/serve.md's nginx block with the two servers at a and b and nginx on `listen`."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    block = re.search(r"## Several servers behind a load balancer.*?```nginx\n(.*?)```", text, re.S).group(1)
    for old, new in (("10.0.0.11:8080", a), ("10.0.0.12:8080", b), ("listen 80;", f"listen {listen};")):
        assert old in block, f"docs/serve.md's nginx block no longer has {old!r}: update this test"
        block = block.replace(old, new)
    return block


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed here: docs/serve.md's configuration "
                                                          "is tested where it is (apt-get install nginx)")
def test_the_documented_nginx_config_spreads_requests_and_retries_a_full_server(engine, tmp_path):
    hold = threading.Event()
    hold.set()
    full = Running(engine, max_queue=0, check=lambda: hold.wait(30))  # batch 1, no queue: one request fills it
    other = Running(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};" if os.geteuid() == 0 else ""  # workers: not `nobody`
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"""{user}
worker_processes 1;
pid {tmp_path}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp_path}/body;
    proxy_temp_path {tmp_path}/proxy;
{_documented_nginx(full.url.removeprefix("http://"), other.url.removeprefix("http://"), f"127.0.0.1:{port}")}
}}
""")
    proc = subprocess.Popen([shutil.which("nginx"), "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(conf),
                             "-g", "daemon off;"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, f"nginx exited: {proc.stdout.read().decode()}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "nginx did not listen in 20 s"
                time.sleep(0.05)
        lb = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        # through nginx, plain and streamed (server-sent events unbuffered), each server's greedy text
        want = other.client().completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0).choices[0].text
        for _ in range(2):  # both servers in turn
            assert lb.completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0).choices[0].text == want
            chunks = list(lb.completions.create(model=NAME, prompt="hello", max_tokens=6, temperature=0, stream=True))
            assert "".join(c.choices[0].text for c in chunks) == want and len(chunks) > 2
        for s in (full, other):
            assert s.metrics().get('strata_requests_total{code="200"}', 0) >= 2, "nginx did not spread the requests"
        # one server full (a request straight to it, held running): every request through nginx still
        # gets its reply, the full server's 503 retried on the other
        hold.clear()
        body = {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, f"{full.url}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 10
            while full.scheduler.idle:
                assert time.monotonic() < deadline, "the held request did not start"
                time.sleep(0.01)
            for _ in range(4):
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
            assert full.scheduler.counters.requests_rejected >= 1, "nginx never tried the full server"
            hold.set()
            assert held.result().status_code == 200
    finally:
        hold.set()
        proc.terminate()
        proc.wait(10)
        full.stop()
        other.stop()


def test_the_worker_thread_first_sets_itself_up_on_the_backend():
    """The scheduler's worker runs the model on a thread of its own, and CuPy's current stream is per
    thread: the worker first asks the backend to set the thread up (the GPU tier's: its stream).
    Before, the worker ran on the legacy default stream, which waits for every blocking stream and
    where no token step or verify can be captured."""
    import types

    seen = []
    backend = types.SimpleNamespace(enter_thread=lambda: seen.append(threading.current_thread().name))
    sch = Scheduler(types.SimpleNamespace(backend=backend), None, max_context=8, kv="f32", chunk=0, max_queue=1,
                    cache=ConversationCache(0, 0))
    sch.close()
    assert seen == ["strata-worker"]
