"""Workers in processes of their own (`serve --processes N`).

Python runs one thread's code at a time, so worker threads (scheduler.py) overlap only while MLX
computes; on a CPU of several cores, where each worker's passes take one core, workers in processes of
their own keep every core busy. Such a process loads the pair by the names the server loaded it by and
runs a scheduler of its own (its engines, its kept prompt caches); to the server's scheduler it is one
more worker, taking requests from the one queue by the same rule as a thread (`Scheduler.takes`). A
request's tokens and settings go to it over a pipe and its events come back; a client that goes away
or falls behind is told to it within WATCH_S. /metrics sums the processes' counters with the server's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import time
from collections import deque

from ..chat import common_prefix
from ..errors import UserError
from ..loading import load_pair
from ..speculative import GenerationResponse
from .errors import ApiError
from .metrics import Metrics
from .pool import PromptCachePool
from .scheduler import MAX_BACKLOG, Finished, Request, Scheduler

log = logging.getLogger("dflash_mlx.server")

WATCH_S = 0.02  # how often requests under way in a process are checked for a client gone or behind
ASK_S = 5.0  # the longest /metrics waits for a process's counters
STOP_S = 30.0  # the longest a stopping process is waited for (then it is killed)
KEPT = 64  # the latest answers a process is taken to keep the caches of


def scheduler_for(
    target, draft, tokenizer, pool, metrics, max_active, max_waiting, workers=1, processes=1, names=None
) -> Scheduler:
    """The server's scheduler: `workers` threads in each of `processes` processes, the others loading
    the pair by `names` (load_pair's arguments) and keeping prompt caches as `pool` does; `metrics`
    counts them all."""
    if processes > 1 and names is None:
        raise ValueError("processes > 1 needs the names the pair was loaded by (names)")
    remote = functools.partial(Remote, names=names, pool_args=(pool.max_bytes, pool.draft_window))
    scheduler = Scheduler(
        target, draft, tokenizer, pool, metrics, max_active, max_waiting, workers, processes, remote
    )
    metrics.sources = [r.counters for r in scheduler.remotes]
    return scheduler


class Remote:
    """A worker in a process of its own, seen from the server's scheduler: one thread takes requests from
    the queue and watches their clients, one reads the process's events."""

    def __init__(self, scheduler: Scheduler, index: int, most: int, threads: int, names, pool_args):
        self.s, self.most, self.index = scheduler, most, index
        context = multiprocessing.get_context("spawn")  # (a forked process would inherit MLX's threads)
        self.conn, theirs = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(theirs, names, most, threads, pool_args),
            name=f"dflash-mlx-worker-{index}",
            daemon=True,
        )
        self.load = 0  # requests it holds (read by the other workers, under the scheduler's lock)
        self.requests: dict[int, Request] = {}  # ... by their ids there
        self.answers: dict[int, list[int]] = {}  # ... their tokens so far
        self.kept = _Kept()
        self.behind: set[int] = set()  # the ids of those whose readers are behind, as it was last told
        self.told_gone: set[int] = set()
        self.ids = itertools.count()
        self.ended = False  # the process has ended
        self.sending, self.asking = threading.Lock(), threading.Lock()
        self.replies: queue.Queue = queue.Queue()
        self.counted: list = []  # the metric families it last answered with
        self.thread = threading.Thread(target=self._run, name=f"dflash-mlx-taker-{index}", daemon=True)
        self.reader = threading.Thread(target=self._read, name=f"dflash-mlx-reader-{index}", daemon=True)

    def launch(self) -> None:
        self.process.start()

    def start(self) -> None:
        """Once launched: wait for the process to have loaded the pair, then take requests."""
        try:
            reply = self.conn.recv()
        except EOFError:
            reply = ("failed", f"it ended (exit code {self.process.exitcode})")
        if reply[0] != "ready":
            raise RuntimeError(f"worker process {self.index} could not start: {reply[1]}")
        self.thread.start()
        self.reader.start()

    def close(self, grace: float) -> None:
        """The server is shutting down (Scheduler.close_queue)."""
        self._send("close", grace)

    def counters(self) -> list:
        """The process's metric families (prometheus_client's); those it last gave if it does not answer
        in time, and of those only the counters once it has ended (a counter never goes back, and what
        it counted was done; what a gauge measured is gone with it)."""
        with self.asking:
            if self.ended or not self._send("metrics"):
                return [family for family in self.counted if family.type == "counter"]
            try:
                self.counted = self.replies.get(timeout=ASK_S)
            except queue.Empty:
                pass
            return self.counted

    def _send(self, *message) -> bool:
        with self.sending:
            try:
                self.conn.send(message)
                return True
            except (OSError, ValueError):  # (the process has ended: the reader ends its requests)
                return False

    def _run(self) -> None:
        while True:
            with self.s.lock:
                if not self.s.stopping and not (self.s.waiting and self.s.takes(self, self.load)):
                    # (with nothing under way or waiting, a submitted request wakes it)
                    self.s.lock.wait(WATCH_S if self.requests or self.s.waiting else None)
                if self.s.stopping:
                    break
                self.s.let_go_of_the_gone()
                joining = []
                while not self.ended and self.s.waiting and self.s.takes(self, self.load):
                    joining.append((next(self.ids), self.s.waiting.popleft()))
                    self.requests[joining[-1][0]] = joining[-1][1]
                    self.answers[joining[-1][0]] = []
                    self.load = len(self.requests)
                self.s.metrics.waiting.set(len(self.s.waiting))
            for i, r in joining:
                left = None if r.deadline is None else r.deadline - time.monotonic()  # (clocks differ)
                self._send("submit", i, r.prompt, r.settings, r.stop, left, r.continues, r.scored)
            for i, r in list(self.requests.items()):
                if r.cancelled.is_set() and i not in self.told_gone:
                    self.told_gone.add(i)
                    self._send("cancel", i)
                elif (r.backlog() >= MAX_BACKLOG) != (i in self.behind):
                    self.behind ^= {i}
                    self._send("backlog", i, r.backlog())
        self._send("stop")  # (its requests end there, as the server's own do)
        self.reader.join(STOP_S)
        self.process.join(STOP_S)
        if self.process.is_alive():
            log.error("worker process %d did not stop: killed", self.index)
            self.process.kill()

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "metrics":
                self.replies.put(message[1])
                continue
            _, i, event = message
            request = self.requests.get(i)
            if request is None:
                continue
            request.emit(event)
            if isinstance(event, GenerationResponse):
                self.answers[i] += event.tokens
            elif isinstance(event, Finished):
                self._forget(i, kept=event.error is None)
        with self.s.lock:
            self.ended = True
            gone, self.load = list(self.requests), self.most  # (it takes no more)
        if gone and not self.s.stopping:
            self.process.join(1)  # (for its exit code)
            log.error("worker process %d ended (exit code %s)", self.index, self.process.exitcode)
        for i in gone:
            request = self.requests[i]
            self._forget(i)
            request.emit(Finished(None if self.s.stopping else RuntimeError("the worker process ended")))

    def _forget(self, i: int, kept: bool = False) -> None:
        with self.s.lock:
            answer = self.answers.pop(i)
            if kept:
                self.kept.add(self.requests[i].prompt + answer)
            del self.requests[i]
            self.behind.discard(i)
            self.told_gone.discard(i)
            self.s.release()
            if not self.ended:
                self.load = len(self.requests)
            self.s.lock.notify_all()


class _Kept:
    """What a worker process's kept caches hold, as far as the server can tell: the tokens (prompt and
    answer) of the latest requests it answered, for `Scheduler.takes`."""

    def __init__(self):
        self.tokens: deque[list[int]] = deque(maxlen=KEPT)

    def add(self, tokens: list[int]) -> None:
        for kept in [k for k in self.tokens if common_prefix(k, tokens) == len(k)]:
            self.tokens.remove(kept)  # (as the process's pool does: `tokens` goes on from it)
        self.tokens.append(tokens)

    def held(self, prompt: list[int]) -> int:
        return max((common_prefix(kept, prompt) for kept in self.tokens), default=0)


def log_to_stderr() -> None:
    """The server's log, and its worker processes': a time on each line (a service's log is read later)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s: %(message)s")


def _serve(conn, names, most: int, threads: int, pool_args) -> None:
    """A worker process: the pair loaded, a scheduler of its own answering what the server sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (the server's Ctrl-C stops it through the pipe)
    log_to_stderr()
    try:
        target, draft, tokenizer = load_pair(*names)
    except Exception as e:  # noqa: BLE001  (said by the server, which does not start)
        conn.send(("failed", str(e)))
        return
    metrics = Metrics()
    pool = PromptCachePool(target, draft, *pool_args)
    scheduler = Scheduler(target, draft, tokenizer, pool, metrics, most, most, threads)
    requests: dict[int, Request] = {}
    backlogs: dict[int, int] = {}
    sending = threading.Lock()

    def emit(i: int, event) -> None:
        if isinstance(event, Finished):
            requests.pop(i, None)
            backlogs.pop(i, None)
            event = Finished(_portable(event.error))
        with sending:
            conn.send(("event", i, event))

    scheduler.start()
    conn.send(("ready",))
    while True:
        try:
            kind, *args = conn.recv()
        except EOFError:  # (the server has gone)
            break
        if kind == "submit":
            i, prompt, settings, stop, left, continues, scored = args
            deadline = None if left is None else time.monotonic() + left
            request = Request(
                prompt,
                settings,
                stop,
                lambda event, i=i: emit(i, event),
                lambda i=i: backlogs.get(i, 0),
                deadline=deadline,
                continues=continues,
                scored=scored,
            )
            try:
                scheduler.admit()  # (the server sends no more than its share: never Busy)
            except ApiError as e:  # (the server began shutting down as it was sent)
                emit(i, Finished(e))
                continue
            requests[i] = request
            scheduler.submit(request)
        elif kind == "cancel" and args[0] in requests:
            requests[args[0]].cancelled.set()
        elif kind == "backlog" and args[0] in requests:
            backlogs[args[0]] = args[1]
        elif kind == "close":
            scheduler.close_queue(args[0])
        elif kind == "metrics":
            with sending:
                conn.send(("metrics", list(metrics.registry.collect())))
        elif kind == "stop":
            break
    scheduler.stop()
    conn.close()


def _portable(error: BaseException | None) -> BaseException | None:
    """An error as it can cross to the server: its own where it pickles as itself (the client's errors,
    the server's 4xx and 503), else its text (the traceback is logged here)."""
    if error is None or isinstance(error, (ApiError, UserError)):
        return error
    return RuntimeError(str(error))
