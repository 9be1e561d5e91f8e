"""The generation workers, each a thread over an engine of its own (engine.py), and their one queue.

A request goes to the worker with the fewest under way, up to its share of `max_active`. MLX's CPU
backend computes a thread's work on one core, so on a CPU of several cores the workers' passes run at
once (docs/server.md says when that pays); kept caches (pool.py) are shared, computed before another
thread may take them up. Within a worker, requests that are answering step together: each engine step
is one target pass over all of them, so every stream moves each step and none waits for another to
finish. A request joins once its prompt is prefilled; short prompts that wait at once are prefilled
together in one pass where that has measured faster than one at a time (a GPU); a long prompt is
prefilled a chunk at a time between steps, each chunk sized by the prefill speed last measured to take
about PREFILL_TURN_S while others are under way (about PREFILL_ALONE_S alone, which is as long as a
request that arrives meanwhile waits), and never under FIRST_CHUNK tokens: a pass's fixed cost can
outlast the turn (a slow CPU at a long context), and chunks sized by the speed of smaller ones would
shrink to a token a pass. Turns go to whatever has received the fewest tokens: the batch
(its least served request) or a prefilling request, a chunk counting as the tokens the batch's requests
receive in its time, so a long prompt shares the worker with the streams under way rather than holding
them up. A request whose reader has fallen behind (a slow client) leaves the batch until it catches up;
one whose reader takes nothing for STALLED_S meanwhile (a hung client, which TCP may keep connected for
hours) ends there, so that it does not hold its slot for good. Requests are admitted before their
prompts are made (`admit`), so a full server refuses them (`Busy`) before any work: up to `max_active`
in flight and `max_waiting` more. A request whose client has gone, or that has run past its deadline,
is taken out before the next step; its cache, left consistent, goes back to the pool like any other (a
request that failed leaves its cache out).

Steps are pipelined: the next is launched before the last one's tokens are handed to the readers.
A request with a seed draws each token with a key made from its seed and the token's position, so it
gets the same answer whatever runs beside it (engine.Sequence's `keyed`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx

from ..cache import prefill_step, prefill_together
from ..engine import Engine, Sequence
from ..errors import UserError
from ..pairing import context_room
from ..settings import GenerationSettings
from ..speculative import Answer, GenerationResponse
from .errors import ApiError
from .metrics import Metrics
from .pool import PromptCachePool

log = logging.getLogger("dflash_mlx.server")

PREFILL_TURN_S = 0.25  # about how long a prefill chunk takes while other requests are under way
PREFILL_ALONE_S = 1.0  # ... and while none is
FIRST_CHUNK = 64  # prompt tokens in a chunk before any prefill speed is known, and the fewest after
MAX_BACKLOG = 64  # events a request's reader may leave unread before it leaves the batch
STALLED_S = 60.0  # seconds out of the batch with its reader taking nothing: a hung client, whose answer ends
# Short prompts (each the last chunk of its request, of at most SHORT tokens) that wait at once are
# prefilled together or one at a time by which gives them their first tokens sooner on average, from
# the prompt tokens a second each has given; the other is tried again every RETRY_SHORT. (A longer
# prompt gains little from sharing a pass, and would pad the others' rows to its length.)
SHORT, RETRY_SHORT = 256, 16
SCORED_CHUNK = 512  # the most prompt tokens in a chunk that is scored (`echo`)
DECLINED_S = 0.02  # how long an idle worker that leaves the next request to another waits to look again
STOPPED_WITHIN_S = 0.5  # how long after an error of MLX's a shutdown is taken as its cause


class Busy(Exception):
    """Every slot is taken and the queue is full."""


SHUTTING_DOWN = "the server is shutting down: send the request again once it is back"


@dataclass
class Started:
    """The first event of a request: how much of its prompt a kept cache already held."""

    prompt_tokens: int
    cached_tokens: int


@dataclass
class PromptScored:
    """A request's prompt, scored (one asking for its prompt's log-probabilities): `log_probabilities`
    of each prompt token but the first, before its first token."""

    scores: list


@dataclass
class Finished:
    """The last event of a request; `error` is set if it failed."""

    error: BaseException | None = None


@dataclass
class Request:
    prompt: list[int]
    settings: GenerationSettings
    stop: list[str]
    emit: Callable[[object], None]  # gets Started, each GenerationResponse, then Finished (worker thread)
    backlog: Callable[[], int] = lambda: 0  # events emitted and not yet read
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic() past which the answer ends where it is ("length")
    continues: bool = False  # the answer's text goes on from the prompt's (see Answer's `joins`)
    scored: bool = False  # the prompt's tokens' log-probabilities are wanted too (`PromptScored`)


@dataclass(eq=False)
class _Job:
    request: Request
    cache: object
    prompt: list[int]  # prompt tokens not yet processed (prefilled in turns of their own while long)
    answer: Answer
    served: float  # tokens received (a prefill chunk counts what it cost), plus the level it started at
    seq: Sequence | None = None  # once its prompt is in: its place in the engine
    paused_at: float | None = None  # when it left the batch for its reader to catch up (None: in it)
    turn: int = 0  # when it last had a turn (ties go to the one waiting longest)
    scores: list | None = None  # the prompt's scores so far, where they are wanted


def worker_share(max_active: int, workers: int) -> tuple[int, int]:
    """-> (the workers that answer, at most one per request; the most requests each has at once)."""
    n = max(1, min(workers, max_active))
    return n, -(-max_active // n)


class Scheduler:
    def __init__(
        self,
        target,
        draft,
        tokenizer,
        pool: PromptCachePool,
        metrics: Metrics,
        max_active: int,
        max_waiting: int,
        workers: int = 1,
        processes: int = 1,
        remote: Callable | None = None,
    ):
        """`workers` threads in each of `processes` processes, the others than this one made by
        `remote(scheduler, index, most requests, threads)` (processes.py's Remote)."""
        self.target, self.draft, self.tokenizer, self.pool = target, draft, tokenizer, pool
        self.metrics, self.max_active, self.max_waiting = metrics, max_active, max_waiting
        self.waiting: deque[Request] = deque()
        self.admitted = 0  # requests admitted and not yet ended: preparing, waiting, joining or active
        self.stopping = False
        self.closing: float | None = None  # shutting down: nothing more joins; answers end by then
        self.closed = threading.Event()  # ... set once `closing` is
        self.lock = threading.Condition()
        n, share = worker_share(max_active, workers * processes)
        self.local = [_Worker(self, i, share) for i in range(min(n, workers))]
        self.remotes = [
            remote(self, i, min(workers, n - i * workers) * share, min(workers, n - i * workers))
            for i in range(1, -(-n // workers))
        ]
        self.workers = self.local + self.remotes

    @property
    def active(self) -> list[_Job]:
        """The requests under way in this process."""
        return [job for worker in self.local for job in worker.active]

    def start(self) -> None:
        for remote in self.remotes:  # (they load the pair side by side)
            remote.launch()
        for remote in self.remotes:
            remote.start()
        for worker in self.local:
            worker.thread.start()

    def takes(self, worker, load: int) -> bool:
        """Whether a worker holding `load` requests takes the next one from the queue: while it has room
        and no other holds fewer for its size, or as few with more of its prompt in a kept cache (a
        conversation's next turn goes where its last one's cache is) (with the lock held, a request
        waiting)."""
        if load >= worker.most:
            return False
        prompt, mine = self.waiting[0].prompt, None
        for w in self.workers:
            if w is worker or load * w.most < w.load * worker.most:
                continue
            if load * w.most > w.load * worker.most:
                return False
            if w.kept is not worker.kept:  # (threads of one process share its caches)
                mine = worker.kept.held(prompt) if mine is None else mine
                if w.kept.held(prompt) > mine:
                    return False
        return True

    def stop(self) -> None:
        """Stop every request (their clients get what they had) and the workers."""
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        for worker in self.workers:
            if worker.thread.is_alive():
                worker.thread.join()

    def close_queue(self, grace: float) -> None:
        """The server is shutting down: requests waiting for their turn end now with a 503, not when its
        grace period has run out, and new ones get it too; the answers under way end within `grace`
        seconds, as at max_tokens (their connections would be cut)."""
        with self.lock:
            self.closing = time.monotonic() + grace
            self.closed.set()
            while self.waiting:
                self.waiting.popleft().emit(Finished(ApiError(503, SHUTTING_DOWN)))
                self.admitted -= 1
            self.metrics.waiting.set(0)
        for remote in self.remotes:
            remote.close(grace)

    def admit(self) -> None:
        """Take a place for a request about to be made (before its prompt is): Busy when there is none.
        `submit` or `withdraw` follows."""
        with self.lock:
            if self.closing is not None:
                raise ApiError(503, SHUTTING_DOWN)
            self.let_go_of_the_gone()
            if self.admitted >= self.max_active + self.max_waiting:
                raise Busy
            self.admitted += 1

    def let_go_of_the_gone(self) -> None:
        """Requests waiting whose clients left give their places back (with the lock held)."""
        for gone in [r for r in self.waiting if r.cancelled.is_set()]:
            self.waiting.remove(gone)
            self.admitted -= 1
            self.metrics.cancelled.inc()
            gone.emit(Finished())
        self.metrics.waiting.set(len(self.waiting))

    def withdraw(self) -> None:
        """Give back the place of an admitted request that will not be submitted."""
        self.release()

    def submit(self, request: Request) -> None:
        """Queue an admitted request."""
        with self.lock:
            if self.closing is not None:  # (admitted just before the queue closed)
                self.admitted -= 1
                request.emit(Finished(ApiError(503, SHUTTING_DOWN)))
                return
            self.waiting.append(request)
            self.metrics.waiting.set(len(self.waiting))
            self.lock.notify_all()

    def release(self) -> None:
        with self.lock:
            self.admitted -= 1


class _Worker:
    """One thread answering its share of the requests over an engine of its own (see the module's
    docstring): up to its share of `max_active` at once, taken from the common queue."""

    def __init__(self, scheduler: Scheduler, index: int, most: int):
        self.s, self.most = scheduler, most
        self.pool, self.metrics, self.tokenizer = scheduler.pool, scheduler.metrics, scheduler.tokenizer
        self.kept = self.pool  # (what it answers from: `Scheduler.takes`)
        self.draft = scheduler.draft
        self.engine = Engine(self.pool.target, self.draft)
        self.active: list[_Job] = []
        self.load = 0  # its active requests and those it is taking (read by the others, under the lock)
        self.turns = 0
        self.prefill_rate: float | None = None  # prompt tokens a second in the last prefill chunk
        # prompt tokens a second of short prompts' prefills, one at a time and together (averages)
        self.short_rates: dict[bool, float | None] = {False: None, True: None}
        self.short_choices = 0
        self.token_seconds: float | None = None  # worker seconds per token a request receives (average)
        self.launched = 0.0  # when the step under way was launched
        self.returning: list[_Job] = []  # ended while their step was under way: their caches come back
        self.thread = threading.Thread(target=self._run, name=f"dflash-mlx-generation-{index}", daemon=True)

    def _run(self) -> None:
        while True:
            with self.s.lock:
                self.load = len(self.active)  # (what it had taken and has ended meanwhile is not counted)
                while not self.s.stopping and not self.active and not self.s.waiting:
                    self.s.lock.wait()
                if not (self.s.stopping or self.active or self.s.takes(self, 0)):  # (another takes it)
                    self.s.lock.wait(DECLINED_S)
                if self.s.stopping:
                    break
                self.s.let_go_of_the_gone()  # (each turn: the queue's length is right while others answer)
                joining = []
                while self.s.waiting and self.s.takes(self, len(self.active) + len(joining)):
                    joining.append(self.s.waiting.popleft())
                self.load = len(self.active) + len(joining)
                self.metrics.waiting.set(len(self.s.waiting))
            try:
                self._cycle(joining)
            except Exception as e:  # noqa: BLE001  (a bug in a step: the requests in it get the error)
                e = self._stopped(e)
                gone = self.engine.rows + self.engine.joining
                for job in [j for j in self.active if j.seq is not None and j.seq in gone]:
                    job.seq.removed = True  # (with the engine it was in)
                    self._end(job, e, keep=False)
                self.returning = []
                self.engine = Engine(self.pool.target, self.draft)
            self.metrics.active.set(len(self.s.active))
        self.engine.close()
        for job in list(self.active):
            self._end(job, None)
        with self.s.lock:
            while self.s.waiting:
                self.s.waiting.popleft().emit(Finished())
        mx.synchronize()  # no model work left running when the process ends (MLX would abort)
        mx.clear_streams()  # (MLX's rule for a thread that ran its work: else an abort at exit, at times)

    def _cycle(self, joining: list[Request]) -> None:
        """One turn of the worker: collect the step under way, let requests go and come, then either a
        prefill chunk or the next step, and hand out what the collected step gave."""
        results = self.engine.collect() if self.engine.step_rows and self.engine.ready is None else []
        if results:
            self._served(results)
        for job in [j for j in self.returning if j.seq not in self.engine.rows]:
            self.returning.remove(job)
            self._keep(job.cache)
        for job in list(self.active):
            self._check(job)
        level = min((job.served for job in self.active), default=0.0)
        for request in joining:
            self._start(request, level)
        prefilling = [j for j in self.active if j.seq is None]
        answering = [j for j in self.active if j.seq is not None and j.paused_at is None]
        first = min(prefilling, key=lambda j: (j.served, j.turn), default=None)
        if first is not None and (not answering or first.served <= min(j.served for j in answering)):
            short = [
                j for j in prefilling if len(j.prompt) <= min(self._chunk(j), SHORT) and j.scores is None
            ]
            self.engine.other_work()
            if first in short and len(short) > 1 and self._together(len(short)):
                self._prefill_together([first] + [j for j in short if j is not first])
            else:
                self._prefill(first)
        elif answering:
            tic = time.perf_counter()
            self.engine.launch()
            self.launched = tic
        elif self.active:
            time.sleep(0.005)  # every reader is behind: let them catch up
        self._hand_out(results)

    def _served(self, results) -> None:
        """Count what a collected step gave, and how long it took per token a request received."""
        seconds = time.perf_counter() - self.launched
        self.metrics.busy.inc(seconds)
        self.metrics.record_step(len(results), all(r.proposed == 0 for r in results))
        per_token = seconds / (sum(len(r.tokens) for r in results) / len(results))
        self.token_seconds = (
            per_token if self.token_seconds is None else 0.9 * self.token_seconds + 0.1 * per_token
        )

    def _hand_out(self, results) -> None:
        jobs = {id(j.seq): j for j in self.active if j.seq is not None}
        for r in results:
            job = jobs.get(id(r.seq))
            if job is None:
                continue
            job.served += len(r.tokens)
            response = job.answer.respond(r.tokens, r.accepted, r.seq.finish, r.source, r.proposed, r.scores)
            self.metrics.record(response)
            job.request.emit(response)
            if response.finish_reason is not None:
                self._end(job, None)

    def _check(self, job: _Job) -> None:
        """Take out a request whose client has gone or whose time is up; pause or resume one whose
        reader is behind."""
        request = job.request
        if request.cancelled.is_set():
            self.metrics.cancelled.inc()
            self._end(job, None)
        elif any(d is not None and time.monotonic() > d for d in (request.deadline, self.s.closing)):
            self.metrics.timed_out.inc()
            self._cut(job)
        elif job.seq is not None:
            behind = request.backlog() >= MAX_BACKLOG
            if behind and job.paused_at is None:
                self.engine.remove(job.seq)
                job.paused_at = time.monotonic()
            elif not behind and job.paused_at is not None:
                self.engine.add(job.seq)
                job.paused_at = None
            if job.paused_at is not None and time.monotonic() - job.paused_at > STALLED_S:
                self.metrics.cancelled.inc()
                self._cut(job)

    def _cut(self, job: _Job) -> None:
        """End an answer where it is, as if it had reached max_tokens (finish reason "length")."""
        request = job.request
        produced = job.answer.produced
        request.emit(GenerationResponse("", [], None, len(request.prompt), 0.0, produced, 0.0, 0.0, "length"))
        self._end(job, None)

    def _start(self, request: Request, level: float) -> None:
        if request.cancelled.is_set():
            self.metrics.cancelled.inc()
            self.s.release()
            request.emit(Finished())
            return
        try:  # (a prompt to score is prefilled whole: kept caches hold no logits)
            taken = self.pool.take(request.prompt, reuse=not request.scored)
        except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
            log.exception("a request could not start")
            self.s.release()
            request.emit(Finished(e))
            return
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self.metrics.cached_tokens.inc(taken.reused)
        self.metrics.cache_lookups.labels("hit" if taken.reused else "miss").inc()
        request.emit(Started(len(request.prompt), taken.reused))
        joins = request.prompt[-1] if request.continues else None
        answer = Answer(self.tokenizer, request.stop, len(request.prompt), joins)
        prompt = request.prompt[len(taken.cache.tokens) :]
        scores = [] if request.scored else None
        self.active.append(_Job(request, taken.cache, prompt, answer, level, scores=scores))

    def _prefill(self, job: _Job) -> None:
        """A chunk of the job's prompt; its last part starts its answer (the first token handed out)."""
        self.turns += 1
        job.turn = self.turns
        tic = time.perf_counter()
        n = self._chunk(job)
        scoring = job.scores is not None and len(job.prompt) > 1  # (its last token predicts the answer)
        try:
            if len(job.prompt) > n or scoring:
                # (a scored chunk's logits are all kept: a vocabulary's worth of floats per token)
                n = min(n, SCORED_CHUNK, len(job.prompt) - 1) if scoring else n
                chunk, job.prompt = job.prompt[:n], job.prompt[n:]
                if scoring:
                    k = job.request.settings.logprobs or 0
                    job.scores += job.cache.prefill_scored(chunk, job.prompt[0], k)
                else:
                    job.cache.prefill(chunk, n)
                seconds = time.perf_counter() - tic
                self.metrics.busy.inc(seconds)
                if not scoring:  # (scoring costs more than a prefill: its pace is not theirs)
                    self.prefill_rate = n / seconds
                job.served += seconds / self.token_seconds if self.token_seconds else 1
                return
            if job.scores is not None:
                job.request.emit(PromptScored(job.scores))
            seq = self._sequence(job)
            first = seq.start(job.prompt)
        except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
            self._failed(job, e)
            return
        seconds = time.perf_counter() - tic
        if len(job.prompt) <= SHORT and job.scores is None:
            self._short_rate(False, len(job.prompt), seconds)
        self._begin(job, seq, first, seconds)

    def _together(self, k: int) -> bool:
        """Whether k short prompts waiting at once are prefilled together this time (see RETRY_SHORT).
        One at a time, the i-th waits for i prefills: k + 1 halves of one on average, where together
        all wait for the one pass. So together pays where its rate beats one at a time's 2k / (k + 1)
        times over (where a pass over several rows costs about one row's), not merely where it is
        faster in all."""
        rates = self.short_rates
        if None in rates.values():
            return rates[True] is None
        self.short_choices += 1
        sooner = rates[True] * (k + 1) > rates[False] * 2 * k
        return sooner != (self.short_choices % RETRY_SHORT == 0)

    def _short_rate(self, together: bool, tokens: int, seconds: float) -> None:
        rate, last = tokens / max(seconds, 1e-9), self.short_rates[together]
        self.short_rates[together] = rate if last is None else 0.8 * last + 0.2 * rate

    def _prefill_together(self, jobs: list[_Job]) -> None:
        """Short prompts in one pass (`prefill_together`), each starting its answer."""
        self.turns += 1
        tic = time.perf_counter()
        seqs = {}
        for job in jobs:
            try:
                seqs[job] = self._sequence(job)
            except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
                self._failed(job, e)
        jobs = list(seqs)
        if not jobs:
            return
        try:
            logits = prefill_together([job.cache for job in jobs], [job.prompt for job in jobs])
        except Exception as e:  # noqa: BLE001  (the server goes on; the requests get the error)
            for job in jobs:
                self._failed(job, e)
            return
        seconds = time.perf_counter() - tic
        self._short_rate(True, sum(len(job.prompt) for job in jobs), seconds)
        for job, row in zip(jobs, logits):
            job.turn = self.turns
            try:
                first = seqs[job].begin(row)
            except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
                self._failed(job, e)
                continue
            self._begin(job, seqs[job], first, seconds / len(jobs))

    def _sequence(self, job: _Job) -> Sequence:
        settings = job.request.settings
        room = min(settings.max_tokens, context_room(self.pool.target, len(job.request.prompt)))
        eos = frozenset(self.tokenizer.eos_token_ids)
        return Sequence(job.cache, settings, room, eos)

    def _failed(self, job: _Job, error: Exception) -> None:
        if not isinstance(error, UserError):
            error = self._stopped(error)
        self._end(job, error, keep=False)

    def _stopped(self, error: Exception) -> Exception:
        """A model pass's error, logged -> what its requests get. MLX's CPU backend compiles kernels with
        g++ on first use, in the terminal's process group: a Ctrl-C that stops the server ends that
        compiler too, and MLX raises at about the moment the server starts shutting down. That is
        the shutdown, in one line, not a failure."""
        if isinstance(error, RuntimeError) and self.s.closed.wait(STOPPED_WITHIN_S):
            log.warning("an answer ended by the shutdown while MLX compiled a kernel (%s)", error)
            return ApiError(503, SHUTTING_DOWN)
        log.error("generation failed", exc_info=error)
        return error

    def _begin(self, job: _Job, seq: Sequence, first: list[int], seconds: float) -> None:
        """A job whose prompt is in: its first token handed out, and it joins the engine."""
        self.metrics.busy.inc(seconds)
        job.seq, job.served = seq, job.served + len(first)
        response = job.answer.respond(first, None, seq.finish, scores=seq.scores)
        self.metrics.record(response)
        job.request.emit(response)
        if response.finish_reason is not None:
            self._end(job, None)
        else:
            self.engine.add(seq)

    def _chunk(self, job: _Job) -> int:
        """Prompt tokens to prefill in this turn (at most the request's prefill step)."""
        step = job.request.settings.prefill_step_size or prefill_step()
        seconds = PREFILL_ALONE_S if len(self.active) == 1 and not self.s.waiting else PREFILL_TURN_S
        return min(step, max(FIRST_CHUNK, int((self.prefill_rate or 0.0) * seconds)))

    def _end(self, job: _Job, error: BaseException | None, keep: bool = True) -> None:
        if job.seq is not None and not job.seq.removed and job.seq.finish is None:
            self.engine.remove(job.seq)  # its step is taken back (once collected, if batched)
        self.active.remove(job)
        # (a failed request's cache is not worth keeping, nor a scored prompt's: one never reused)
        if error is None and keep and job.scores is None:
            if job.seq is not None and job.seq in self.engine.rows:
                self.returning.append(job)  # (lent to the step under way)
            else:
                self._keep(job.cache)
        self.s.release()
        job.request.emit(Finished(error))

    def _keep(self, cache) -> None:
        evicted = self.pool.evictions
        self.pool.put(cache)
        self.metrics.evictions.inc(self.pool.evictions - evicted)
        self.metrics.cache_bytes.set(self.pool.nbytes)
        self.metrics.cache_entries.set(len(self.pool.caches))
