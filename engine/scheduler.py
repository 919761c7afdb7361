"""The serving machinery behind `strata serve`, with no HTTP in it: one worker thread that owns the
model, the queue of requests waiting for it, and the conversation cache of parked sessions.

The model is not thread-safe (a Session's buffers, the kernels' scratch, the thread pool), so ONE
thread runs every request; callers submit a Job and get its text through callbacks run on the
worker thread. BATCH SLOTS: up to `batch` requests run together, each step ONE forward of every
active request's next feed (engine/batch.py): a decoding request's one sampled token, a prompt's
next chunk (so a long prompt is fed chunk by chunk between the others' tokens, never stalling them
for its whole length). Every matrix is read once per step for all of them and the MoE reads each
routed expert once for all the rows routed to it, so a slot costs far less than a second run. New
requests join between steps. A request's numbers are the ones it gets alone: its rows never mix
with another's, and its feeds (its own prompt chunks, then one token at a time) do not depend on
what runs beside it (tests/engine/test_serve.py checks greedy text alone and batched).

The conversation cache: when a request ends, its Session IS the state at its position (KV cache,
Gated DeltaNet and conv states, PLE windows), so it is parked in host memory under the exact tokens
it was fed (the prompt and every sampled token but the last, which is never fed). A later prompt
that extends a parked sequence takes that session and feeds only its new tokens. Without it, a
hybrid model's recurrent layers would re-read the whole conversation at every turn.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


from .generate import Generation, Run
from .model import Model, Session
from .sampling import Sampler, SamplerParams
from .speculative import SpecStats
from .tokenizer import Tokenizer


class Busy(RuntimeError):
    """The worker is busy and the queue is full: the caller should retry later (HTTP 503)."""


class Closed(RuntimeError):
    """The scheduler is shutting down: no new work is taken."""


def session_bytes(session: Session) -> int:
    return sum(session.memory().values())


class ConversationCache:
    """Parked sessions keyed by the token sequence each holds, least recently used first; at most
    `slots` of them and `max_bytes` in all (0 slots: off)."""

    def __init__(self, slots: int, max_bytes: int):
        if slots < 0 or max_bytes < 0:
            raise ValueError(f"conversation cache: {slots} slots, {max_bytes} bytes; expected both >= 0")
        self.slots, self.max_bytes = slots, max_bytes
        self._parked: OrderedDict[tuple[int, ...], tuple[Session, int]] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.tokens_saved = self.evictions = 0

    def __len__(self) -> int:
        return len(self._parked)

    def take(self, prompt: Sequence[int], max_context: int, kv: str) -> tuple[Session, int] | None:
        """The parked session whose sequence is the longest strict prefix of `prompt` (at least one
        new token is left to feed, whose logits give the first sampled token), removed from the
        cache: (session, tokens it holds); None on a miss."""
        if self.slots == 0:
            return None
        prompt = tuple(int(t) for t in prompt)
        best = None
        for key, (s, _) in self._parked.items():
            n = len(key)
            if n < len(prompt) and prompt[:n] == key and s.max_context == max_context and s.kv == kv:
                if best is None or n > len(best):
                    best = key
        if best is None:
            self.misses += 1
            return None
        session, nbytes = self._parked.pop(best)
        self.bytes -= nbytes
        self.hits += 1
        self.tokens_saved += len(best)
        return session, len(best)

    def keeps(self, tokens: Sequence[int], session: Session, nbytes: int | None = None) -> bool:
        """Whether `park` would keep `session` (so a copy of it is worth making): it holds exactly
        `tokens`, and it is no larger than the whole cache (parking such a one would evict everything
        for nothing). `nbytes`: its session_bytes, where the caller has them."""
        return bool(self.slots) and session.pos == len(tokens) and len(tokens) > 0 and \
            (session_bytes(session) if nbytes is None else nbytes) <= self.max_bytes

    def park(self, tokens: Sequence[int], session: Session) -> None:
        """Keep `session`, which holds exactly `tokens`, evicting the least recently used ones to fit."""
        nbytes = session_bytes(session)
        if not self.keeps(tokens, session, nbytes):
            return
        key = tuple(int(t) for t in tokens)
        if key in self._parked:
            self.bytes -= self._parked.pop(key)[1]
        while self._parked and (len(self._parked) >= self.slots or self.bytes + nbytes > self.max_bytes):
            _, (_, old) = self._parked.popitem(last=False)
            self.bytes -= old
            self.evictions += 1
        self._parked[key] = (session, nbytes)
        self.bytes += nbytes


class StopText:
    """Text as it streams, cut at the first of the `stops` strings (which is not part of the text).
    `push(piece)` returns the text safe to send now: whatever might still be the start of a stop
    string is held back until the next piece settles it."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        start = self.sent  # the text sent holds no stop string, nor the start of one
        self.text += piece
        cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
            return self._take(cut)
        hold = 0
        for s in self.stops:  # the longest end of the text that begins a stop string
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return self._take(len(self.text) - hold)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


@dataclass
class Job:
    """One request: the prompt's token ids, how to sample, and where its text goes.

    on_text(delta) is called on the worker thread for each piece of text that is final;
    on_done(job) once, at the end, with `result`/`finish`/`error` set. `cancel()` (any thread) ends
    the generation at its next token."""

    prompt: list[int]
    max_tokens: int
    params: SamplerParams
    ignore_eos: bool = False
    stops: Sequence[str] = ()
    on_text: Callable[[str], None] = lambda text: None
    on_done: Callable[[Job], None] = lambda job: None
    on_token: Callable[[int], None] = lambda token: None  # each sampled token's id, before its text (benchmarks)
    text: str = ""
    result: Generation | None = None
    finish: str | None = None  # "stop" (a stop token or string) or "length"; None when cancelled or failed
    error: BaseException | None = None
    resumed: int = 0  # prompt tokens taken from the conversation cache (not fed again)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass
class Counters:
    requests_done: int = 0  # every job that ended: finished, cancelled or failed
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0  # refused as Busy
    tokens_generated: int = 0
    prompt_tokens: int = 0
    prompt_tokens_fed: int = 0  # of those, fed to the model (the rest came from the conversation cache)
    verify_forwards: int = 0  # --spec: forwards that verified drafts (--batch-mtp: one per step for every request)


@dataclass
class _Slot:
    """A running request: its job, its Run (engine/generate.py), its session and its text's state."""

    job: Job
    run: Run
    session: Session
    stream: object  # the tokenizer's incremental decoder
    stop: StopText


class HostSessions:
    """Where the requests' sessions come from and where a finished one parks, on the CPU (and the
    host-driven GPU step): a new session each, parked as it is. The device step's are the GPU tier's
    placed sessions, lent and copied down to park (engine/tier/sessions.py DeviceSessions)."""

    def __init__(self, model: Model):
        self.model = model

    def take(self, max_context: int, kv: str) -> Session:
        return self.model.new_session(max_context, kv)

    def snapshots(self, session: Session) -> list | None:
        """--spec's snapshots made for the session already (None: SpecRun makes them)."""
        return None

    def give(self, session: Session) -> None:
        """The session's request is over and it is not parked."""

    def park(self, session: Session) -> Session:
        """What the conversation cache keeps of a finished session."""
        return session

    def resume(self, parked: Session) -> Session:
        """The session a request continues from a parked one."""
        return parked


class Scheduler:
    """The one worker thread that owns `model`; `submit(job)` queues a job (Busy when `batch` running +
    `max_queue` waiting already); `close()` cancels what is left and stops the thread."""

    def __init__(self, model: Model, tok: Tokenizer, *, max_context: int, kv: str, chunk: int, max_queue: int,
                 cache: ConversationCache, check: Callable[[], None] = lambda: None, batch: int = 1, spec: int = 0,
                 spec_min_p: float = 0.75, batch_mtp: bool = False, drafter: Callable | None = None,
                 sessions=None):
        """`batch_mtp`: with `spec`, every request's verify rows (and the other requests' feeds) in one
        forward per step; without it each drafting request runs its own. `drafter(job, sampler)`: the
        Drafter of a request (default: the pack's MTP block; the tests and benchmarks pass reference
        drafters, engine/speculative.py). `sessions`: where the sessions come from and park (default:
        HostSessions; the device step's DeviceSessions)."""
        if max_queue < 0:
            raise ValueError(f"max_queue {max_queue}: expected >= 0")
        if batch < 1:
            raise ValueError(f"batch {batch}: expected >= 1 (requests decoding together)")
        if spec < 0:
            raise ValueError(f"spec {spec}: expected >= 0 draft tokens (0 is plain decoding)")
        if batch_mtp and not spec:
            raise ValueError("--batch-mtp verifies the requests' drafts in one forward: it needs --spec N (N >= 1)")
        self.model, self.tok = model, tok
        self.max_context, self.kv, self.chunk, self.max_queue, self.batch = max_context, kv, chunk, max_queue, batch
        self.cache, self.check = cache, check
        self.sessions = sessions if sessions is not None else HostSessions(model)
        # --spec N: each request drafts with the pack's MTP block (one head, a KV cache per request)
        self.spec, self.spec_min_p, self._head = spec, spec_min_p, None
        self.batch_mtp, self.drafter = batch_mtp, drafter
        self.counters = Counters()
        # every request's drafting counts in one place, for /metrics (SpecRun writes into it)
        self.spec_stats = SpecStats(spec) if spec else None
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0  # queued + running
        self._active: list[_Slot] = []
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="strata-worker", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting (not the running ones)."""
        with self._lock:
            return self._admitted - len(self._active)

    @property
    def running(self) -> int:
        with self._lock:
            return len(self._active)

    def jobs_running(self) -> list[Job]:
        """The jobs in the batch now (a copy)."""
        with self._lock:
            return [slot.job for slot in self._active]

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._admitted == 0

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._closed:
                raise Closed("the server is shutting down")
            if self._admitted >= self.batch + self.max_queue:
                self.counters.requests_rejected += 1
                raise Busy(f"{self.batch} request(s) running (--batch) and {self.max_queue} waiting (--max-queue); "
                           "retry later")
            self._admitted += 1
        self._queue.put(job)

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, cancel the waiting and the running ones, and wait for the worker."""
        with self._lock:
            self._closed = True
            for slot in self._active:
                slot.job.cancel()
        self._queue.put(None)
        self._thread.join(timeout)

    def _work(self) -> None:
        self.model.backend.enter_thread()  # (the GPU tier's stream: CuPy's current stream is per thread)
        closing = False
        while True:
            while not closing and len(self._active) < self.batch:  # new requests join between steps
                try:
                    job = self._queue.get(block=not self._active)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                else:
                    self._start(job)
            if not self._active:
                if closing:
                    break
                continue
            try:
                self._step()
            except BaseException as e:  # noqa: BLE001 - a worker that died would leave every request waiting
                for slot in list(self._active):
                    slot.job.error = slot.job.error or e
                    try:
                        self._finish(slot)
                    except BaseException:  # noqa: BLE001
                        with self._lock:
                            if slot in self._active:
                                self._active.remove(slot)
                        self._end(slot.job)
        # cancel whatever is still queued behind the sentinel
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.cancel()
                self._end(job)

    def _end(self, job: Job) -> None:
        """The job is over (finished, cancelled or failed): count it and tell its caller."""
        with self._lock:
            self._admitted -= 1
        self.counters.requests_done += 1
        if job.error is not None:
            self.counters.requests_failed += 1
        elif job.cancelled:
            self.counters.requests_cancelled += 1
        try:
            job.on_done(job)
        except Exception:  # noqa: BLE001 - a caller's callback cannot stop the worker
            pass

    def _start(self, job: Job) -> None:
        """A slot for `job`: its session (from the conversation cache when a parked one holds the start
        of its prompt), sampler and Run."""
        with self._lock:
            if self._closed:
                job.cancel()
        if job.cancelled:
            self._end(job)
            return
        session = None
        try:
            tok, n = self.tok, len(job.prompt)
            taken = self.cache.take(job.prompt, self.max_context, self.kv)
            if taken is not None:
                session, start = self.sessions.resume(taken[0]), taken[1]
            else:
                session, start = self.sessions.take(self.max_context, self.kv), 0
            job.resumed = start
            self.counters.prompt_tokens += n
            self.counters.prompt_tokens_fed += n - start
            sampler = Sampler(self.model.geometry.n_vocab, job.params, banned=tok.stop_ids if job.ignore_eos else ())
            stream, stop = tok.stream(), StopText(job.stops)
            stop_ids = () if job.ignore_eos else tok.stop_ids

            def on_token(token: int) -> bool:
                self.counters.tokens_generated += 1
                job.on_token(token)
                self.check()
                if token not in stop_ids:
                    delta = stop.push(stream.push(token))
                    if delta:
                        job.on_text(delta)
                return stop.stopped or job.cancelled

            if self.spec:
                run = self._spec_run(session, job, sampler, stop_ids, on_token, start)
            else:
                run = Run(session, job.prompt, sampler, job.max_tokens, stop_ids=stop_ids, on_token=on_token,
                          prefill=self.chunk, start=start)
        except BaseException as e:  # noqa: BLE001 - no request may kill the worker
            job.error = e
            if session is not None:
                self.sessions.give(session)
            self._end(job)
            return
        with self._lock:
            self._active.append(_Slot(job, run, session, stream, stop))

    def _spec_run(self, session, job, sampler, stop_ids, on_token, start):
        """A SpecRun drafting with the MTP head. A resumed session's earlier positions are not in
        the new head cache: its first drafts see less context (the output is the same)."""
        from .mtp import MTPHead
        from .speculative import MTPDrafter, SpecRun

        if self.drafter is not None:
            drafter = self.drafter(job, sampler)
        else:
            if self._head is None:
                self._head = MTPHead.of(self.model)
            drafter = MTPDrafter(self._head, self.max_context, self.kv, sampler.fork(sampler.seed + 1), self.spec_min_p)
        return SpecRun(self.model, session, job.prompt, sampler, job.max_tokens, drafter=drafter, n_draft=self.spec,
                       stats=self.spec_stats, stop_ids=stop_ids, on_token=on_token, prefill=self.chunk, start=start,
                       snapshots=self.sessions.snapshots(session))

    def _step(self) -> None:
        """One forward of every active request's next feed, then each takes its logits."""
        for slot in [s for s in self._active if s.job.cancelled]:  # cancelled while its prompt was fed
            slot.run.cancel()
            self._finish(slot)
        slots = list(self._active)
        if not slots:
            return
        if self.spec:
            slots = self._draft_together(slots)
            if not slots:
                return
        feeds, fed = [], []
        for s in slots:  # (a feed drafts: a drafter that fails fails its request, never the worker)
            try:
                feeds.append(s.run.feed())
                fed.append(s)
            except BaseException as e:  # noqa: BLE001
                s.job.error = e
                self._finish(s)
        slots = fed
        if not slots:
            return
        try:
            if self.spec and (not self.batch_mtp or len(slots) == 1):
                # each request's own forward (its verify rows and head inputs); alone, the same work, and
                # a plain step takes the token step, which allocates nothing
                rows = [s.run.forward(self.model, *f) for s, f in zip(slots, feeds)]
            elif self.spec:  # --batch-mtp: one forward; a verifying request's rows each keep their snapshot
                args = [s.run.batch_args(f[0]) for s, f in zip(slots, feeds)]
                rows = self.model.forward_batch([s.session for s in slots], [f[0] for f in feeds],
                                                [f[1] for f in feeds], hidden=[a[0] for a in args],
                                                saved=[a[1] for a in args])
            elif len(slots) == 1 and feeds[0][0].size == 1:  # the decode step: nothing allocated (S12)
                rows = [self.model.step(slots[0].session, int(feeds[0][0][0]))]
            else:
                rows = self.model.forward_batch([s.session for s in slots], [f[0] for f in feeds], [f[1] for f in feeds])
        except BaseException as e:  # noqa: BLE001 - the step failed for every request in it
            for s in slots:
                s.job.error = e
                self._finish(s)
            return
        if self.spec and any(getattr(s.run, "drafts", None) for s in slots):
            self.counters.verify_forwards += 1 if self.batch_mtp else sum(bool(s.run.drafts) for s in slots)
        for s, r in zip(slots, rows):
            try:
                done = s.run.take(r)
            except BaseException as e:  # noqa: BLE001
                s.job.error, done = e, True
            if done:
                self._finish(s)

    def _draft_together(self, slots: list) -> list:
        """The requests whose drafters share the MTP head on the host draft their next chains together
        (engine/speculative.py draft_together: one forward of the head a chain position for all of
        them, where each alone would read its weights again); the drafts wait in each run for its feed.
        -> the slots still running (a drafting failure fails the requests it was drafting for)."""
        from .speculative import draft_together

        jobs = [(s, s.run.draft_job()) for s in slots]
        jobs = [(s, j) for s, j in jobs if j is not None]
        if len(jobs) < 2:
            return slots
        t0 = time.perf_counter()
        try:
            got = draft_together([j for _, j in jobs])
        except BaseException as e:  # noqa: BLE001 - the requests it drafted for fail, not the worker
            for s, _ in jobs:
                s.job.error = e
                self._finish(s)
            return [s for s in slots if any(s is a for a in self._active)]
        self.spec_stats.draft_s += time.perf_counter() - t0
        for (s, _), drafted in zip(jobs, got):
            s.run.ready = drafted
        return slots

    def _finish(self, slot: _Slot) -> None:
        job, stop = slot.job, slot.stop
        with self._lock:
            self._active.remove(slot)
        if job.error is None:
            if not stop.stopped:
                tail = stop.push(slot.stream.flush())
                tail += stop.flush() if not stop.stopped else ""
                if tail:
                    job.on_text(tail)
            result = slot.run.result()
            job.text, job.result = stop.text, result
            if not job.cancelled:
                job.finish = "stop" if result.stop in ("eos", "stopped") else "length"
            fed = result.fed.tolist()
        slot.run.close()
        try:
            if job.error is None and self.cache.keeps(fed, slot.session):
                # the session holds exactly the fed tokens: park it under them for the next turn
                self.cache.park(fed, self.sessions.park(slot.session))
            else:
                self.sessions.give(slot.session)
        except BaseException as e:  # noqa: BLE001 - a failed park loses the parked copy, not the worker
            job.error = job.error or e
        self._end(job)


def run_and_wait(scheduler: Scheduler, job: Job, timeout: float | None = None) -> Job:
    """Submit `job` and block until it ends (for callers without an event loop: strata chat, tests)."""
    done = threading.Event()
    previous = job.on_done

    def finished(j: Job) -> None:
        previous(j)
        done.set()

    job.on_done = finished
    scheduler.submit(job)
    if not done.wait(timeout):
        job.cancel()
        done.wait()
    return job
