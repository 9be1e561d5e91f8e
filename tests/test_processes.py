"""Workers in processes of their own (`serve --processes`): each loads the pair from its folders and
answers its share of the requests as the server's own worker would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
from mlx_lm.utils import save_config, save_model
from prometheus_client import CollectorRegistry, Counter, Gauge
from serving import chat_tokenizer, serving
from test_drafter import write_zlab_checkpoint
from test_server import config, metric, words
from tiny import CONFIGS, make_draft, make_target

from dflash_mlx import apply_chat_template, generate
from dflash_mlx.loading import load_pair
from dflash_mlx.server.app import create_app
from dflash_mlx.server.metrics import Metrics
from dflash_mlx.server.pool import PromptCachePool
from dflash_mlx.server.processes import scheduler_for
from dflash_mlx.server.scheduler import Finished, Request, Started
from dflash_mlx.settings import GenerationSettings


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """-> (names: the tiny pair's folders, (target, drafter, tokenizer) loaded from them)."""
    root = tmp_path_factory.mktemp("pair")
    save_model(root / "target", make_target("llama"))
    save_config(dict(CONFIGS["llama"], eos_token_id=95), root / "target" / "config.json")
    chat_tokenizer(root / "target")
    write_zlab_checkpoint(root / "draft", make_draft())
    names = (str(root / "target"), str(root / "draft"))
    return names, load_pair(*names)


def until(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_answers_from_a_worker_process_are_the_ones_generate_gives_alone(saved):
    """Requests go to this process's worker or the other process's by which holds fewer: each answer is
    `generate`'s alone, both processes answered some, a seeded sample is the same from either, and
    /metrics counts both processes' work."""
    names, (target, draft, tok) = saved
    metrics = Metrics()
    pool = PromptCachePool(target, draft, 1 << 30)
    scheduler = scheduler_for(target, draft, tok, pool, metrics, 4, 8, 1, 2, names)
    prompts = [
        tok.encode(words(seed, n), add_special_tokens=False) for seed, n in ((1, 30), (2, 90), (3, 50))
    ]
    prompts += prompts[:1]
    greedy = GenerationSettings(max_tokens=24)
    sampled = GenerationSettings(max_tokens=24, temperature=1.0, seed=7)
    got: dict[int, list] = {i: [] for i in range(6)}
    finished: list = []

    def submit(i, prompt, settings):
        def emit(event):
            if isinstance(event, Finished):
                finished.append(event.error)
            elif hasattr(event, "tokens"):
                got[i].extend(event.tokens)

        scheduler.admit()
        scheduler.submit(Request(prompt, settings, [], emit))

    scheduler.start()
    try:
        for i in (4, 5):  # (at once: one here, one there)
            submit(i, prompts[1], sampled)
        until(lambda: len(finished) == 2)
        for i, prompt in enumerate(prompts):
            submit(i, prompt, greedy)
        until(lambda: len(finished) == 6)
        text = metrics.text().decode()
    finally:
        scheduler.stop()
    assert finished == [None] * 6
    for i, prompt in enumerate(prompts):
        assert got[i] == generate(target, draft, tok, prompt, max_tokens=24).tokens
    assert got[4] == got[5] and len(got[4]) == 24
    lookups = sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("dflash_mlx_prefix_cache_lookups_total")
    )
    here = pool.hits + pool.misses
    assert lookups == 6 and 0 < here < 6  # (every request looked up once, some of them there)
    generated = [line for line in text.splitlines() if line.startswith("dflash_mlx_generated_tokens_total")]
    assert generated == [f"dflash_mlx_generated_tokens_total {sum(map(len, got.values())):.1f}"]
    assert not scheduler.remotes[0].process.is_alive() and scheduler.remotes[0].process.exitcode == 0


def test_a_conversations_next_turn_goes_to_the_process_that_kept_its_cache(saved):
    """Between processes holding as few requests, a request goes to the one whose kept caches hold the
    most of its prompt: four conversations answered in both processes, each one's next turn, sent alone,
    takes up its own kept cache."""
    names, (target, draft, tok) = saved
    pool = PromptCachePool(target, draft, 1 << 30)
    scheduler = scheduler_for(target, draft, tok, pool, Metrics(), 4, 8, 1, 2, names)
    firsts = [tok.encode(words(seed, 40), add_special_tokens=False) for seed in (51, 52, 53, 54)]
    answers: dict[int, list] = {i: [] for i in range(8)}
    cached: dict[int, int] = {}
    finished: list = []

    def submit(i, prompt):
        def emit(event):
            if isinstance(event, Finished):
                finished.append(event.error)
            elif isinstance(event, Started):
                cached[i] = event.cached_tokens
            elif hasattr(event, "tokens"):
                answers[i].extend(event.tokens)

        scheduler.admit()
        scheduler.submit(Request(prompt, GenerationSettings(max_tokens=12), [], emit))

    scheduler.start()
    try:
        for i, prompt in enumerate(firsts):
            submit(i, prompt)
        until(lambda: len(finished) == 4)
        here = pool.hits + pool.misses
        for i, prompt in enumerate(firsts):
            more = tok.encode(words(60 + i, 10), add_special_tokens=False)
            submit(4 + i, prompt + answers[i] + more)
            until(lambda i=i: len(finished) == 5 + i)
    finally:
        scheduler.stop()
    # both processes answered first turns (two each, unless one of them, finished first, took the last:
    # on a loaded machine the other process may still be busy then)
    assert finished == [None] * 8 and 1 <= here <= 3
    for i, prompt in enumerate(firsts):
        assert cached[4 + i] >= len(prompt), (i, cached)


def _streams(url: str, prompts: list[str], max_tokens: int):
    """Streamed completions of `prompts`, each opened once the last one has started -> their line
    iterators (and the responses, to close)."""
    out = []
    for prompt in prompts:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        response = httpx.Client(timeout=120).send(
            httpx.Request("POST", f"{url}/v1/completions", json=body), stream=True
        )
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # (it has started)
        out.append((response, lines))
    return out


def _next_event(lines) -> str:
    return next(line for line in lines if line)


def _there(app, prompts: list[str], tok) -> int:
    """Which of `prompts` the worker process is answering."""
    remote = app.state.scheduler.remotes[0]
    held = [r.prompt for r in remote.requests.values()]
    assert len(held) == 1
    return [tok.encode(p) for p in prompts].index(held[0])


@contextmanager
def _two_answering(saved, seeds: tuple[int, int]):
    """A server of a worker here and one in a process of its own, each answering a long streamed
    completion (`seeds`: of prompts whose answers run to 2000 tokens) -> (its URL, the worker process,
    (the stream answered there, the one answered here))."""
    names, (target, draft, tok) = saved
    app = create_app(target, draft, tok, config(max_active=2, processes=2, names=names))
    prompts = [words(seed, 30) for seed in seeds]
    with serving(app) as url:
        streams = _streams(url, prompts, 2000)
        there = _there(app, prompts, tok)
        yield url, app.state.scheduler.remotes[0], (streams[there], streams[1 - there])


def _answered(url: str, seed: int) -> None:
    body = {"model": "tiny", "prompt": words(seed, 20), "max_tokens": 8}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0


def test_a_client_leaving_stops_its_answer_in_the_worker_process(saved):
    with _two_answering(saved, (41, 42)) as (url, remote, (there, here)):
        before = metric(url, "dflash_mlx_cancelled_requests_total")
        there[0].close()
        until(lambda: not remote.requests)  # (its end came back from the process)
        assert metric(url, "dflash_mlx_cancelled_requests_total") == before + 1
        assert '"finish_reason": null' in _next_event(here[1])  # (the other goes on)
        here[0].close()
        _answered(url, 43)


def test_a_worker_process_that_ends_fails_its_answer_and_the_server_goes_on(saved, caplog):
    with _two_answering(saved, (45, 49)) as (url, remote, (there, here)):
        counted = metric(url, "dflash_mlx_prompt_tokens_total")  # (both prompts: one in each process)
        with caplog.at_level("ERROR", logger="dflash_mlx.server"):
            remote.process.kill()
            rest = list(there[1])
        # (what the ended process had counted still counts: the counters went back to this one's alone)
        assert metric(url, "dflash_mlx_prompt_tokens_total") == counted
        assert any("worker process 1 ended" in r.getMessage() for r in caplog.records)
        errors = [json.loads(line.removeprefix("data: ")) for line in rest if '"error"' in line]
        assert errors and errors[-1]["error"]["type"] == "server_error"
        assert '"finish_reason": null' in _next_event(here[1])  # (the other goes on)
        here[0].close()
        for seed in (46, 47):  # (answered here: the ended process takes nothing more)
            _answered(url, seed)
        assert metric(url, "dflash_mlx_generated_tokens_total") > 0  # (/metrics still answers)
        health = httpx.get(f"{url}/health")  # (it said "ok": a supervisor never restarted it)
        assert health.status_code == 503 and health.json()["ended_worker_processes"] == [1]


def test_an_answer_in_the_worker_process_ends_at_its_time_limit(saved):
    names, (target, draft, tok) = saved
    app = create_app(target, draft, tok, config(max_active=2, processes=2, names=names, request_timeout=0.5))
    with serving(app) as url:

        def last_event(seed):
            body = {"model": "tiny", "prompt": words(seed, 30), "max_tokens": 2000, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
                events = [line for line in r.iter_lines() if line.startswith("data: {")]
            return json.loads(events[-1].removeprefix("data: "))

        with ThreadPoolExecutor(2) as pool:
            ends = list(pool.map(last_event, (55, 56)))
        assert [e["choices"][0]["finish_reason"] for e in ends] == ["length", "length"]
        assert metric(url, "dflash_mlx_timed_out_requests_total") == 2
        there = app.state.scheduler.remotes[0].counters()
        timed_out = [
            s.value for f in there for s in f.samples if s.name == "dflash_mlx_timed_out_requests_total"
        ]
        assert timed_out == [1]  # (one of them answered there)


def test_a_worker_process_that_cannot_load_the_pair_stops_the_server_starting(saved, tmp_path):
    names, (target, draft, tok) = saved
    pool, gone = PromptCachePool(target, draft, 0), (str(tmp_path / "gone"), names[1])
    scheduler = scheduler_for(target, draft, tok, pool, Metrics(), 2, 2, 1, 2, gone)
    with pytest.raises(RuntimeError, match="worker process 1 could not start: .*gone"):
        scheduler.start()
    scheduler.stop()


def test_metrics_of_several_processes_are_summed():
    """Counters and gauges are the sums of every process's, by label; a counter's creation time the
    earliest."""
    metrics = Metrics()
    metrics.generated.inc(5)
    metrics.cache_lookups.labels("hit").inc()
    other = CollectorRegistry()
    Counter("dflash_mlx_generated_tokens", "", registry=other).inc(7)
    lookups = Counter("dflash_mlx_prefix_cache_lookups", "", ["result"], registry=other)
    lookups.labels("hit").inc(2)
    lookups.labels("miss").inc(3)
    Gauge("dflash_mlx_active_requests", "", registry=other).set(2)
    metrics.active.set(1)
    metrics.sources = [lambda: list(other.collect())]
    lines = dict(line.rsplit(" ", 1) for line in metrics.text().decode().splitlines() if line[0] != "#")
    assert float(lines["dflash_mlx_generated_tokens_total"]) == 12
    assert float(lines['dflash_mlx_prefix_cache_lookups_total{result="hit"}']) == 3
    assert float(lines['dflash_mlx_prefix_cache_lookups_total{result="miss"}']) == 3
    assert float(lines["dflash_mlx_active_requests"]) == 3
    created = [
        s.value
        for registry in (metrics.registry, other)
        for f in registry.collect()
        for s in f.samples
        if s.name == "dflash_mlx_generated_tokens_created"
    ]
    assert float(lines["dflash_mlx_generated_tokens_created"]) == min(created) < max(created)


def test_serve_with_two_processes_answers_and_stops_both_on_ctrl_c(saved):
    """`dflash-mlx serve --processes 2` as a user runs it: two requests at once answered as `generate`
    answers them, and at Ctrl-C the server and its worker process end."""
    names, (target, draft, tok) = saved
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "-m", names[0], "-d", names[1]]
    command += ["--port", str(port), "--name", "tiny", "--processes", "2", "--block-size", "4"]
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        until(lambda: _up(port) or server.poll() is not None)
        assert server.poll() is None, server.communicate()[1]
        children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True)
        pids = [int(p) for p in children.stdout.split()]
        conversations = [[{"role": "user", "content": words(seed, n)}] for seed, n in ((48, 30), (49, 60))]
        path = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "tiny", "max_tokens": 16}
        with ThreadPoolExecutor(2) as pool:
            replies = list(
                pool.map(lambda m: httpx.post(path, json=dict(body, messages=m), timeout=120), conversations)
            )
        for messages, r in zip(conversations, replies):
            prompt = apply_chat_template(tok, messages)
            want = generate(target, draft, tok, prompt, max_tokens=16, block_size=4).text
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0, err
    assert err.index("loading the pair in another process") < err.index("serving tiny")
    assert pids  # (the worker process, and multiprocessing's resource tracker)
    until(lambda: not any(_alive(pid) for pid in pids), 30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


BURST = """
import os, signal, sys, time
end = time.monotonic() + 0.5
while time.monotonic() < end:
    try:
        os.kill(int(sys.argv[1]), signal.SIGINT)
    except ProcessLookupError:
        break
"""


def test_serve_with_two_processes_ends_when_signals_come_in_a_burst(saved):
    """A terminal's Ctrl-C under `timeout` (which passes the signal on) reaches the server twice at once:
    a signal that came while the first one's handler was telling the worker process to close must not
    wait for that handler, which it interrupted (the server hung, deaf to all but SIGKILL)."""
    names, _ = saved
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "dflash_mlx.cli.main", "serve", "-m", names[0], "-d", names[1]]
    command += ["--port", str(port), "--name", "tiny", "--processes", "2"]
    for _ in range(2):
        server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        try:
            until(lambda server=server: _up(port) or server.poll() is not None)
            assert server.poll() is None, server.communicate()[1]
            # (a signal pending at almost every step of the first one's handler)
            subprocess.run([sys.executable, "-c", BURST, str(server.pid)], timeout=30)
            _, err = server.communicate(timeout=30)
        finally:
            server.kill()
        assert server.returncode == 0, err
