"""One generation worker for every request.

The models run on one thread. Requests in flight are interleaved cycle by cycle: each turn goes to the
request that has received the fewest tokens (a cycle commits anywhere from one token to a whole block,
so counting cycles would favour the requests whose drafts are accepted); a request that joins starts
level with the least served one. Past `max_active` requests in flight, new ones wait in a queue of
`max_waiting`; past that they are refused (`Busy`). A request whose client has gone is stopped before
its next cycle; its cache, left consistent, goes back to the pool like any other.
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
    cancelled: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Job:
    request: Request
    cache: object
    generator: object
    served: float  # tokens received, plus the level it started at
    turn: int = 0  # when it last had a turn (ties go to the one waiting longest)


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
        self.admitted = 0  # requests submitted and not yet ended: waiting, joining or active
        self.turns = 0
        self.stopping = False
        self.lock = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="dflash-mlx-generation", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()
        self.thread.join()

    def submit(self, request: Request) -> None:
        with self.lock:
            if self.admitted >= self.max_active + self.max_waiting:
                raise Busy
            self.admitted += 1
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
            if self.active:
                self._turn(min(self.active, key=lambda job: (job.served, job.turn)))
            self.metrics.active.set(len(self.active))
        for job in self.active:
            job.generator.close()
        mx.synchronize()  # no model work left running when the process ends (MLX would abort)

    def _start(self, request: Request, level: float) -> None:
        if request.cancelled.is_set():
            self._release()
            request.emit(Finished())
            return
        try:
            taken = self.pool.take(request.prompt)
            cache = taken.cache
            generator = stream_generate(
                self.target,
                self.draft,
                self.tokenizer,
                request.prompt[len(cache.tokens) :],
                prompt_cache=cache,
                stop=request.stop,
                **asdict(request.settings),
            )
        except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
            log.exception("a request could not start")
            self._release()
            request.emit(Finished(e))
            return
        self.metrics.prompt_tokens.inc(len(request.prompt))
        self.metrics.cached_tokens.inc(taken.reused)
        self.metrics.cache_lookups.labels("hit" if taken.reused else "miss").inc()
        request.emit(Started(len(request.prompt), taken.reused))
        self.active.append(_Job(request, cache, generator, level))

    def _turn(self, job: _Job) -> None:
        self.turns += 1
        job.turn = self.turns
        if job.request.cancelled.is_set():
            self.metrics.cancelled.inc()
            self._end(job, None)
            return
        tic = time.perf_counter()
        try:
            response: GenerationResponse = next(job.generator)
        except StopIteration:
            self._end(job, None)
            return
        except Exception as e:  # noqa: BLE001  (the server goes on; the request gets the error)
            if not isinstance(e, UserError):
                log.exception("generation failed")
            self._end(job, e)
            return
        self.metrics.record(response, time.perf_counter() - tic)
        job.served += len(response.tokens)
        job.request.emit(response)
        if response.finish_reason is not None:
            self._end(job, None)

    def _end(self, job: _Job, error: BaseException | None) -> None:
        job.generator.close()  # a cycle under way is taken back: the cache stays consistent
        self.active.remove(job)
        evicted = self.pool.evictions
        self.pool.put(job.cache)
        self.metrics.evictions.inc(self.pool.evictions - evicted)
        self.metrics.cache_bytes.set(self.pool.nbytes)
        self._release()
        job.request.emit(Finished(error))

    def _release(self) -> None:
        with self.lock:
            self.admitted -= 1
