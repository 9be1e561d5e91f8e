"""One generation worker for every request.

The models run on one thread. Requests in flight are interleaved turn by turn: each turn goes to the
request that has received the fewest tokens (a cycle commits anywhere from one token to a whole block,
so counting cycles would favour the requests whose drafts are accepted); a request that joins starts
level with the least served one. A long prompt is prefilled a chunk per turn, each sized by the
prefill speed last measured to take about PREFILL_TURN_S while other requests are under way (about
PREFILL_ALONE_S alone, which is as long as a request that arrives meanwhile waits), and counting as
the tokens the others would have received in its time: a long prompt shares the worker with the
streams under way rather than holding them up. A request whose reader has fallen behind (a slow
client) waits its turns out. Requests are admitted before their prompts are made (`admit`), so a
full server refuses them (`Busy`) before any work: up to `max_active` in flight and `max_waiting`
more. A request whose client has gone, or that has run past its deadline, is
stopped before its next turn; its cache, left consistent, goes back to the pool like any other (a
request that failed leaves its cache out).

A request with a seed draws from a random stream of its own, so interleaving neither changes its draws
nor lets its seed reset anyone else's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from ..errors import UserError
from ..settings import GenerationSettings
from ..speculative import GenerationResponse, stream_generate
from .metrics import Metrics
from .pool import PromptCachePool

log = logging.getLogger("dflash_mlx.server")

PREFILL_TURN_S = 0.25  # about how long a prefill chunk takes while other requests are under way
PREFILL_ALONE_S = 1.0  # ... and while none is
FIRST_CHUNK = 64  # prompt tokens in a chunk before any prefill speed is known
MAX_BACKLOG = 64  # events a request's reader may leave unread before its turns are skipped


class Busy(Exception):
    """Every slot is taken and the queue is full."""


@dataclass
class Started:
    """The first event of a request: how much of its prompt a kept cache already held."""

    prompt_tokens: int
    cached_tokens: int


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


@dataclass
class _Job:
    request: Request
    cache: object
    prompt: list[int]  # prompt tokens not yet processed (prefilled in turns of their own while long)
    served: float  # tokens received (a prefill chunk counts what it cost), plus the level it started at
    generator: object = None
    produced: int = 0  # tokens emitted
    key: mx.array | None = None  # a seeded request's random key between its turns
    turn: int = 0  # when it last had a turn (ties go to the one waiting longest)


def _swap_key(key: mx.array) -> mx.array:
    """Make `key` MLX's global random key; -> the one it replaces."""
    state = mx.random.state[0]
    old = mx.array(state)
    state[...] = key
    return old


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
    ):
        self.target, self.draft, self.tokenizer, self.pool = target, draft, tokenizer, pool
        self.metrics, self.max_active, self.max_waiting = metrics, max_active, max_waiting
        self.waiting: deque[Request] = deque()
        self.active: list[_Job] = []
        self.admitted = 0  # requests admitted and not yet ended: preparing, waiting, joining or active
        self.turns = 0
        self.prefill_rate: float | None = None  # prompt tokens a second in the last prefill chunk
        self.token_seconds: float | None = None  # worker seconds per token served in answers (average)
        self.stopping = False
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="dflash-mlx-generation", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop every request (their clients get what they had) and the worker."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.thread.is_alive():
            self.thread.join()

    def admit(self) -> None:
        """Take a place for a request about to be made (before its prompt is): Busy when there is none.
        `submit` or `withdraw` follows."""
        with self.lock:
            for gone in [r for r in self.waiting if r.cancelled.is_set()]:  # their clients left
                self.waiting.remove(gone)
                self.admitted -= 1
                gone.emit(Finished())
            if self.admitted >= self.max_active + self.max_waiting:
                raise Busy
            self.admitted += 1

    def withdraw(self) -> None:
        """Give back the place of an admitted request that will not be submitted."""
        self._release()

    def submit(self, request: Request) -> None:
        """Queue an admitted request."""
        with self.lock:
            self.waiting.append(request)
            self.metrics.waiting.set(len(self.waiting))
            self.lock.notify()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.active and not self.waiting:
                    self.lock.wait()
                if self.stopping:
                    break
                joining = []
                while self.waiting and len(self.active) + len(joining) < self.max_active:
                    joining.append(self.waiting.popleft())
                self.metrics.waiting.set(len(self.waiting))
            level = min((job.served for job in self.active), default=0.0)
            for request in joining:
                self._start(request, level)
            ready = [
                j for j in self.active if j.request.cancelled.is_set() or j.request.backlog() < MAX_BACKLOG
            ]
            if ready:
                self._turn(min(ready, key=lambda job: (job.served, job.turn)))
            elif self.active:
                time.sleep(0.005)  # every reader is behind: let them catch up
            self.metrics.active.set(len(self.active))
        for job in list(self.active):
            self._end(job, None)
        with self.lock:
            while self.waiting:
                self.waiting.popleft().emit(Finished())
        mx.synchronize()  # no model work left running when the process ends (MLX would abort)

    def _start(self, request: Request, level: float) -> None:
        if request.cancelled.is_set():
            self._release()
            request.emit(Finished())
            return
        try:
            taken = self.pool.take(request.prompt)
        except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
            log.exception("a request could not start")
            self._release()
            request.emit(Finished(e))
            return
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self.metrics.cached_tokens.inc(taken.reused)
        self.metrics.cache_lookups.labels("hit" if taken.reused else "miss").inc()
        request.emit(Started(len(request.prompt), taken.reused))
        self.active.append(_Job(request, taken.cache, request.prompt[len(taken.cache.tokens) :], level))

    def _turn(self, job: _Job) -> None:
        self.turns += 1
        job.turn = self.turns
        if job.request.cancelled.is_set():
            self.metrics.cancelled.inc()
            self._end(job, None)
            return
        deadline = job.request.deadline
        if deadline is not None and time.monotonic() > deadline:
            self.metrics.timed_out.inc()
            job.request.emit(self._cut(job))
            self._end(job, None)
            return
        seeded = job.request.settings.seed is not None
        if seeded:  # its own key in, the shared one kept aside
            outside = _swap_key(job.key) if job.key is not None else mx.array(mx.random.state[0])
        tic = time.perf_counter()
        try:
            response = self._step(job)
        except StopIteration:
            response = None
        except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
            if not isinstance(e, UserError):
                log.exception("generation failed")
            self._end(job, e)
            return
        finally:
            if seeded:
                job.key = _swap_key(outside)
        if response is None:
            self._end(job, None)
            return
        seconds = time.perf_counter() - tic
        self.metrics.busy.inc(seconds)
        if isinstance(response, GenerationResponse):
            self.metrics.record(response)
            n = len(response.tokens)
            job.served += n
            job.produced += n
            if response.accepted is not None and n:  # a cycle (the first token's turn holds a prefill)
                per_token = seconds / n
                self.token_seconds = (
                    per_token if self.token_seconds is None else (0.9 * self.token_seconds + 0.1 * per_token)
                )
            job.request.emit(response)
            if response.finish_reason is not None:
                self._end(job, None)
        else:  # a prefill chunk: it counts the tokens an answer would have received in its time
            self.prefill_rate = response / seconds
            job.served += seconds / self.token_seconds if self.token_seconds else 1

    def _chunk(self, job: _Job) -> int:
        """Prompt tokens to prefill in this turn (at most the request's prefill step)."""
        step = job.request.settings.prefill_step_size
        if self.prefill_rate is None:
            return min(FIRST_CHUNK, step)
        seconds = PREFILL_ALONE_S if len(self.active) == 1 and not self.waiting else PREFILL_TURN_S
        return max(1, min(step, int(self.prefill_rate * seconds)))

    def _step(self, job: _Job):
        """One turn's work: a chunk of the prompt (-> its length), or the next cycle (-> its response).
        The last part of the prompt, up to a chunk, goes with the first cycle."""
        if job.generator is None:
            n = self._chunk(job)
            if len(job.prompt) > n:
                chunk, job.prompt = job.prompt[:n], job.prompt[n:]
                job.cache.prefill(chunk, n)
                return len(chunk)
            job.generator = stream_generate(
                self.target,
                self.draft,
                self.tokenizer,
                job.prompt,
                prompt_cache=job.cache,
                stop=job.request.stop,
                **asdict(job.request.settings),
            )
        return next(job.generator)

    def _cut(self, job: _Job) -> GenerationResponse:
        """The last response of a request stopped at its deadline: no more tokens, finish "length"."""
        prompt = len(job.request.prompt)
        return GenerationResponse("", [], None, prompt, 0.0, job.produced, 0.0, 0.0, "length")

    def _end(self, job: _Job, error: BaseException | None) -> None:
        if job.generator is not None:
            job.generator.close()  # a cycle under way is taken back: the cache stays consistent
        self.active.remove(job)
        if error is None:  # (a failed request's cache is not worth keeping)
            evicted = self.pool.evictions
            self.pool.put(job.cache)
            self.metrics.evictions.inc(self.pool.evictions - evicted)
            self.metrics.cache_bytes.set(self.pool.nbytes)
            self.metrics.cache_entries.set(len(self.pool.caches))
        self._release()
        job.request.emit(Finished(error))

    def _release(self) -> None:
        with self.lock:
            self.admitted -= 1
