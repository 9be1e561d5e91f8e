"""`dflash-mlx serve` against careless and hostile clients: values at the edges of the math, text the
tokenizer cannot take, clients' templates, huge bodies, errors on a kept-alive connection, a full server,
repeated prompts, long prompts beside short ones, and a time limit. A real server on a free loopback
port, as in test_server.py; every load bounded."""

from __future__ import annotations

import gzip
import http.client
import json
import resource
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pydantic import ValidationError
from serving import serving
from test_server import (  # noqa: F401  (tiny: a fixture)
    Failing,
    clients,
    config,
    expected,
    held_after_the_first_token,
    metric,
    tiny,
    words,
)

import dflash_mlx.server.prompts as prompts
import dflash_mlx.server.scheduler as scheduler_module
from dflash_mlx import SpeculativeCache, generate
from dflash_mlx.server.app import create_app
from dflash_mlx.server.metrics import Metrics
from dflash_mlx.server.pool import PromptCachePool
from dflash_mlx.server.scheduler import MAX_BACKLOG, RETRY_SHORT, Finished, Request, Scheduler, Started
from dflash_mlx.server.schemas import ChatCompletionRequest, CompletionRequest, MessagesRequest
from dflash_mlx.settings import GenerationSettings
from dflash_mlx.speculative import GenerationResponse


@pytest.fixture(scope="module")
def server(tiny):  # noqa: F811
    app = create_app(*tiny, config(max_body_bytes=1 << 20))
    with serving(app) as url:
        yield url, app


def post(url: str, path: str, body: dict | bytes, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=60, **kw)


def text_of(path: str, r: httpx.Response) -> str:
    body = r.json()
    if path == "/v1/messages":
        return "".join(b["text"] for b in body["content"] if b["type"] == "text")
    choice = body["choices"][0]
    return choice["text"] if path == "/v1/completions" else choice["message"]["content"]


def request(path: str, content: str, **kw) -> dict:
    if path == "/v1/completions":
        return {"model": "tiny", "prompt": content, **kw}
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 24, **kw}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages"])
@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1e-300},
        {"temperature": 1e-45},
        {"temperature": 5e-324},
        {"temperature": 0.7, "top_p": 1e-300},
        {"temperature": 0.7, "top_p": 0},
    ],
)
def test_sampling_values_at_the_edges_of_the_math_decode_greedily(tiny, server, path, sampling):  # noqa: F811
    """Temperatures below 1e-5 are greedy; a top_p below any token's probability keeps the top token alone."""
    url, _ = server
    target, draft, tok = tiny
    greedy = post(url, path, request(path, words(100), max_tokens=24, temperature=0))
    r = post(url, path, request(path, words(100), max_tokens=24, **sampling))
    assert r.status_code == 200, r.text
    assert text_of(path, r) == text_of(path, greedy)
    r = post(url, path, request(path, words(100), max_tokens=24, stream=True, **sampling))
    assert r.status_code == 200 and "error" not in r.text


def test_any_integer_seed_is_taken_modulo_2_to_the_64(server):
    url, _ = server
    path = "/v1/chat/completions"
    texts = {}
    for seed in (-1, 2**64 - 1, 2**64, 0, 10**30, 10**30 % 2**64):
        r = post(url, path, request(path, words(101), temperature=1.0, seed=seed))
        assert r.status_code == 200, r.text
        texts[seed] = text_of(path, r)
    assert (
        texts[-1] == texts[2**64 - 1] and texts[2**64] == texts[0] and texts[10**30] == texts[10**30 % 2**64]
    )
    assert len(set(texts.values())) > 1  # (the seed matters)


BAD_TEXT = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5 \\ud800", "max_tokens": 4}'),
    ("/v1/completions", b'{"model": "tiny", "prompt": "w5", "stop": ["w6", "\\ud800"]}'),  # (never met)
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "w5"}], "stop": "\\udc00"}',
    ),
    (
        "/v1/messages",
        b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "w5"}], '
        b'"stop_sequences": ["\\ud800"]}',
    ),
    (
        "/v1/chat/completions",
        b'{"model": "tiny", "messages": [{"role": "user", "content": "w5 \\udfff w6"}]}',
    ),
    (
        "/v1/messages",
        b'{"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud83d"}]}',
    ),
]


@pytest.mark.parametrize("path, body", BAD_TEXT)
def test_text_with_an_unpaired_surrogate_is_a_400_that_says_so(server, path, body):
    url, _ = server
    r = post(url, path, body)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "unpaired UTF-16 surrogate" in message and "valid Unicode" in message
    assert "TextEncodeInput" not in message and "Union" not in message


@pytest.mark.parametrize("name", ["tokenize", "add_generation_prompt", "return_dict", "messages"])
def test_call_arguments_in_chat_template_kwargs_are_refused_by_name(server, name):
    url, _ = server
    r = post(
        url, "/v1/chat/completions", request("/v1/chat/completions", "w5", chat_template_kwargs={name: True})
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == f"chat_template_kwargs.{name}" and "not a template variable" in error["message"]
    assert "TokenizerWrapper" not in error["message"] and "()" not in error["message"]


BOMB = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}w5"


def test_a_client_template_is_refused_unless_the_server_allows_them(server):
    url, _ = server
    r = post(
        url,
        "/v1/chat/completions",
        request("/v1/chat/completions", "w5", chat_template_kwargs={"chat_template": BOMB}),
    )
    assert r.status_code == 400 and "--allow-client-templates" in r.json()["error"]["message"]


def health_while(url: str, busy: threading.Thread) -> list[float]:
    """Ask /health again and again while `busy` runs: -> how long each answer took."""
    times = []
    with httpx.Client(base_url=url, timeout=30) as c:
        while busy.is_alive():
            tic = time.monotonic()
            assert c.get("/health").status_code == 200
            times.append(time.monotonic() - tic)
            time.sleep(0.02)
    return times


def in_thread(fn) -> tuple[threading.Thread, dict]:
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=fn()), daemon=True)
    thread.start()
    return thread, out


def test_allowed_client_templates_render_in_a_sandbox_with_time_and_size_limits(tiny):  # noqa: F811
    target, draft, tok = tiny
    with serving(create_app(*tiny, config(client_templates=True, max_body_bytes=1 << 20))) as url:
        path = "/v1/chat/completions"
        own = "{% for m in messages %}w9 {{ m['content'] }} {% endfor %}w10 "
        r = post(url, path, request(path, words(102), chat_template_kwargs={"chat_template": own}))
        assert r.status_code == 200, r.text
        want = generate(
            target, draft, tok, tok.encode(f"w9 {words(102)} w10 ", add_special_tokens=False), max_tokens=24
        )
        assert text_of(path, r) == want.text
        # Templates that would loop for hours are stopped at the time limit, one waiting for the other
        # at most that long; meanwhile the server answers, requests with its own template too.
        bombs = [
            in_thread(
                lambda: post(url, path, request(path, "w5", chat_template_kwargs={"chat_template": BOMB}))
            )
            for _ in range(3)
        ]
        time.sleep(0.5)
        assert text_of(path, post(url, path, request(path, words(104)))) and all(
            b.is_alive() for b, _ in bombs
        )
        assert len(health_while(url, bombs[0][0])) > 1
        for b, _ in bombs:
            b.join(30)
        replies = [out["r"] for _, out in bombs]
        assert {r.status_code for r in replies} <= {400, 429}
        assert any("took over" in r.json()["error"]["message"] for r in replies)
        big = post(
            url, path, request(path, "w5", chat_template_kwargs={"chat_template": "{{ 'w5 ' * 2000000 }}"})
        )
        assert big.status_code == 400 and "characters" in big.json()["error"]["message"]
        assert "error" not in post(url, path, request(path, words(103))).json()  # and it goes on
        # A template's error that quotes a lone surrogate of the client's: a 400, U+FFFD in its place.
        raising = {"chat_template": "{{ raise_exception(messages[0]['content']) }}"}
        r = post(url, path, request(path, "w5 \ud800", chat_template_kwargs=raising))
        assert r.status_code == 400 and "w5 \ufffd" in r.json()["error"]["message"], r.text
        long = {"chat_template": "{{ raise_exception('E' * 1000000) }}"}  # (the megabyte came back whole)
        r = post(url, path, request(path, "w5", chat_template_kwargs=long))
        assert r.status_code == 400 and len(r.content) < 1000 and "EEE...EEE" in r.text, r.text[:300]


def test_prompts_are_made_off_the_event_loop(tiny, server, monkeypatch):  # noqa: F811
    """While one request's prompt is being tokenized (held here, as a huge body's would be), the server
    answers /health and other requests."""
    url, _ = server
    held, real = threading.Event(), prompts.encode_chat_text

    def slow(tokenizer, text):
        if "w77 w77" in text:
            held.wait(30)
        return real(tokenizer, text)

    monkeypatch.setattr(prompts, "encode_chat_text", slow)
    path = "/v1/chat/completions"
    big, out = in_thread(lambda: post(url, path, request(path, "w77 w77 " + words(104))))
    try:
        time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        other = post(url, path, request(path, words(105)))
        assert text_of(path, other) == expected(tiny, [{"role": "user", "content": words(105)}]).text
        assert big.is_alive()
    finally:
        held.set()
    big.join(30)
    assert out["r"].status_code == 200


def test_an_internal_error_leaves_the_kept_alive_connection_usable(tiny, server, monkeypatch):  # noqa: F811
    import dflash_mlx.server.app as app_module

    def failing(*args, **kwargs):
        raise RuntimeError("a bug")

    url, _ = server
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    body = json.dumps(request("/v1/chat/completions", words(106)))
    headers = {"content-type": "application/json"}
    with monkeypatch.context() as m:
        m.setattr(app_module, "Channels", failing)  # a bug in a route, before any response
        conn.request("POST", "/v1/chat/completions", body, headers)
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        assert r.status == 500 and error["type"] == "server_error" and "a bug" not in error["message"]
    conn.request("POST", "/v1/chat/completions", body, headers)  # the same connection
    r = conn.getresponse()
    assert r.status == 200
    assert json.loads(r.read())["choices"][0]["message"]["content"] == (
        expected(tiny, [{"role": "user", "content": words(106)}]).text
    )
    conn.close()


def test_a_full_server_refuses_a_request_before_making_its_prompt(tiny, monkeypatch):  # noqa: F811
    release, rendered = held_after_the_first_token(monkeypatch), []
    real_render = prompts._render
    monkeypatch.setattr(prompts, "_render", lambda *a: rendered.append(1) or real_render(*a))
    with serving(create_app(*tiny, config(max_active=1, max_waiting=0))) as url:
        path = "/v1/chat/completions"
        with httpx.stream(
            "POST", f"{url}{path}", json=request(path, words(107), stream=True), timeout=60
        ) as r:
            lines = r.iter_lines()
            while "w" not in next(lines):
                pass
            before = len(rendered)
            refused = post(url, path, request(path, "w5 " * 100_000))
            assert refused.status_code == 429 and len(rendered) == before
            release.set()


def test_a_prompt_too_long_in_characters_is_refused_before_tokenizing(tiny, server, monkeypatch):  # noqa: F811
    url, _ = server
    tokenized = []
    monkeypatch.setattr(prompts, "encode_chat_text", lambda tok, text: tokenized.append(text) or [5])
    monkeypatch.setattr(prompts, "encode_prompt", lambda tok, text: tokenized.append(text) or [5])
    longest = max(map(len, tiny[2].get_vocab()))
    huge = "w5 " * (tiny[0].args.max_position_embeddings * longest // 3 + 1)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        r = post(url, path, request(path, huge))
        assert r.status_code == 400 and "characters, more than the model's context" in r.text, r.text
    assert tokenized == []


HELLO = [{"role": "user", "content": "w5"}]


def test_a_template_waits_at_most_its_time_limit_for_others_then_gets_429(tiny, monkeypatch):  # noqa: F811
    """Clients' templates take turns at the sandbox, each waiting at most TEMPLATE_SECONDS from its
    request's start, holding no place on the server meanwhile: requests with the model's template
    go on being answered (they were refused as the server was full)."""
    monkeypatch.setattr(prompts, "TEMPLATE_SECONDS", 1.0)
    slow = "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}"
    with serving(create_app(*tiny, config(client_templates=True, max_active=1, max_waiting=1))) as url:
        path = "/v1/chat/completions"
        body = request(path, "w5", max_tokens=2, chat_template_kwargs={"chat_template": slow})
        timed = []

        def sent():
            tic = time.monotonic()
            r = post(url, path, body)
            timed.append(time.monotonic() - tic)
            return r

        with ThreadPoolExecutor(12) as pool:
            slow_ones = [pool.submit(sent) for _ in range(12)]
            time.sleep(0.5)
            ours = post(url, path, request(path, "w5", max_tokens=2))
            statuses = sorted(f.result().status_code for f in slow_ones)
        assert ours.status_code == 200, ours.text
        # those that had a turn rendered until killed (400), the rest waited their second, then were
        # told to retry
        assert set(statuses) == {400, 429} and statuses.count(429) >= 6, statuses
        assert max(timed) < 30, timed
        fine = request(path, "w5", max_tokens=2, chat_template_kwargs={"chat_template": "{{ 'w5' }}"})
        assert post(url, path, fine).status_code == 200


def test_the_sandbox_renders_a_template_and_says_why_one_failed(tiny):  # noqa: F811
    sandbox = prompts.TemplateSandbox(tiny[2], 1 << 20)
    try:
        assert sandbox.render("{{ 'w5' }}", HELLO, {}) == "w5"
        with pytest.raises(
            prompts.ApiError, match="OverflowError: Range too big"
        ):  # the cause, for its author
            sandbox.render("{% for i in range(10**9) %}{% endfor %}", HELLO, {})
    finally:
        sandbox.close()


def test_a_json_body_is_read_whatever_its_type_says_and_a_compressed_one_is_told_what_to_send(server):
    url, _ = server
    body = json.dumps(request("/v1/chat/completions", "w5")).encode()
    for kind in ("application/x-www-form-urlencoded", "text/plain", None):  # (curl -d: a form's type)
        headers = {"content-type": kind} if kind else {}
        r = httpx.post(f"{url}/v1/chat/completions", content=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/chat/completions", content=b"w5=w6", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        content=gzip.compress(body),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
        timeout=60,
    )
    assert r.status_code == 415 and "Content-Encoding" in r.json()["error"]["message"]


def test_a_body_json_cannot_read_is_a_400_that_says_why(server):
    url, _ = server
    path = "/v1/chat/completions"
    good = json.dumps(request(path, "w5"))[:-1].encode()  # (without its closing brace)
    for body, says in (
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xe9"}]}', "is not UTF-8 text"),
        (json.dumps(request(path, "w5")).encode("utf-16"), "is not UTF-8 text"),  # (json reads UTF-16)
        (good + b', "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nests objects and arrays over 100 deep"),
        (good + b', "x": ' + b"9" * 5000 + b"}", "a number too long to read"),
        (
            json.dumps(request(path, "w5", temperature=float("nan"))).encode(),
            "temperature: should be a finite",
        ),
        (json.dumps(request(path, "w5", seed=1e308)).encode(), "seed: should be a valid integer"),
    ):
        r = post(url, path, body)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    r = httpx.request("OPTIONS", f"{url}{path}", timeout=60)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
    for where in ("/v1/models", "/v1/models/tiny", "/metrics", "/health"):
        assert httpx.head(f"{url}{where}", timeout=60).status_code == 200, where
    for where in (path + "/", "/docs", "/openapi.json"):  # (no redirect, no generated pages)
        r = httpx.post(f"{url}{where}", json=request(path, "w5"), timeout=60)
        assert r.status_code in (404, 405) and r.json()["error"]["message"], where
        assert httpx.get(f"{url}{where}", timeout=60).status_code in (404, 405), where


# tool_choice allowing a tool the request does not give
ALLOWED_UNKNOWN = {
    "type": "allowed_tools",
    "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]},
}


@pytest.mark.parametrize(
    "path, field, value",
    [
        ("/v1/chat/completions", "echo", True),  # (completions echo)
        ("/v1/completions", "suffix", "w5"),
        ("/v1/completions", "best_of", 2),
        ("/v1/chat/completions", "response_format", {"type": "json_object"}),
        ("/v1/chat/completions", "tool_choice", "required"),
        ("/v1/chat/completions", "tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("/v1/messages", "tool_choice", {"type": "any"}),
        ("/v1/messages", "output_format", {"type": "json_schema", "schema": {"type": "object"}}),
        ("/v1/messages", "output_config", {"format": {"type": "json_schema", "schema": {"type": "object"}}}),
        ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {"type": "object"}}]),
        ("/v1/chat/completions", "function_call", {"name": "f"}),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
        ("/v1/chat/completions", "stream_options", {"include_usage": True}),  # (without stream)
        ("/v1/completions", "stream_options", {"include_usage": False}),
        ("/v1/chat/completions", "tool_choice", ALLOWED_UNKNOWN),  # (OpenAI's API refuses it too)
    ],
)
def test_what_the_server_cannot_give_is_refused_rather_than_left_out(server, path, field, value):
    url, _ = server
    r = post(url, path, dict(request(path, "w5"), **{field: value}))
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field}: "), r.text
    asked_not = {
        "echo": False,
        "best_of": 1,
        "suffix": "",
        "response_format": {"type": "text"},
        "tool_choice": {"type": "auto"} if path == "/v1/messages" else "none",
        "functions": [],
        "function_call": "auto",
        "modalities": ["text"],
        "audio": None,
        "stream_options": None,
        "output_format": None,
        "output_config": {"effort": "high"},  # (what else it holds is no format)
    }[field]
    assert post(url, path, dict(request(path, "w5"), **{field: asked_not})).status_code == 200


@pytest.mark.parametrize(
    "path, part",
    [
        ("/v1/chat/completions", {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
        (
            "/v1/messages",
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
        ),
        ("/v1/messages/count_tokens", {"type": "document", "source": {"type": "text", "data": "w5"}}),
    ],
)
def test_images_and_documents_are_refused_by_a_model_that_reads_text(server, path, part):
    url, _ = server
    body = request(path.removesuffix("/count_tokens"), "w5")
    body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "w5"}, part]}]
    r = post(url, path, body)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("messages[0].content[1]: ") and "text only" in message


def test_an_image_a_tool_gave_back_is_refused_too(server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    body = request("/v1/messages", "w5")
    body["messages"] = [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}]},
    ]
    r = post(url := server[0], "/v1/messages", body)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("messages[1].content[0].content[0]: "), r.text
    body["messages"][1]["content"][0]["content"] = [{"type": "text", "text": "w5"}]
    assert post(url, "/v1/messages", body).status_code == 200


def test_options_sent_as_null_take_their_defaults(server):
    url, _ = server
    chat = request("/v1/chat/completions", words(102))
    want = text_of("/v1/chat/completions", post(url, "/v1/chat/completions", chat))
    for field in ("n", "stream", "max_tokens", "temperature", "top_p", "stop", "stream_options", "seed"):
        r = post(url, "/v1/chat/completions", dict(chat, **{field: None}))
        assert r.status_code == 200, (field, r.text)
        assert text_of("/v1/chat/completions", r) == want or field == "max_tokens"
    # a completion's default length is the API's, 16 tokens, not the server's
    long = next(
        c
        for c in (request("/v1/completions", words(k), max_tokens=40) for k in range(103, 140))
        if post(url, "/v1/completions", c).json()["usage"]["completion_tokens"] > 16
    )
    r = post(url, "/v1/completions", dict(long, max_tokens=None))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16
    sixteen = post(url, "/v1/completions", dict(long, max_tokens=16))
    assert text_of("/v1/completions", r) == text_of("/v1/completions", sixteen)


def test_a_completion_prompt_may_come_as_a_list_of_one(tiny, server):  # noqa: F811
    url, _ = server
    _, _, tok = tiny
    text = words(104)
    ids = tok.encode(text)
    want = text_of("/v1/completions", post(url, "/v1/completions", request("/v1/completions", text)))
    for prompt in ([text], ids, [ids]):
        r = post(url, "/v1/completions", request("/v1/completions", prompt))
        assert r.status_code == 200 and text_of("/v1/completions", r) == want, (prompt, r.text)
    r = post(url, "/v1/completions", request("/v1/completions", [text, text]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "one prompt per request, got 2" in r.json()["error"]["message"]
    r = post(url, "/v1/completions", request("/v1/completions", ["5", 6]))
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt[")


def test_an_assistant_refusal_in_the_history_is_read_as_its_text(tiny, server):  # noqa: F811
    url, _ = server
    said = [{"role": "user", "content": words(105)}, None, {"role": "user", "content": words(106)}]
    as_text = [said[0], {"role": "assistant", "content": words(107)}, said[2]]
    as_refusal = [
        said[0],
        {"role": "assistant", "content": [{"type": "refusal", "refusal": words(107)}]},
        said[2],
    ]
    got = [
        post(url, "/v1/chat/completions", dict(request("/v1/chat/completions", ""), messages=m))
        for m in (as_text, as_refusal)
    ]
    assert got[1].status_code == 200, got[1].text
    assert text_of("/v1/chat/completions", got[1]) == text_of("/v1/chat/completions", got[0])


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"temperature": 1e308}, "temperature"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 " * 5000}]}, "messages"),
        ("/v1/completions", {"prompt": "w5 " * 5000}, "prompt"),
        ("/v1/completions", {"prompt": [5] * 5000}, "prompt"),  # (past the context in tokens)
    ],
)
def test_a_refused_value_names_its_field(server, path, body, param):
    url, _ = server
    r = post(url, path, dict(request(path, "w5"), **body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_stop_strings_are_limited_in_number(server):
    url, _ = server
    r = post(
        url, "/v1/chat/completions", request("/v1/chat/completions", "w5", stop=[f"w{i}" for i in range(65)])
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = post(url, "/v1/messages", request("/v1/messages", "w5", stop_sequences=["x"] * 65))
    assert r.status_code == 400


WRONG = 20_000  # items of a list that are all of the wrong kind
MESSAGE = {"role": "user", "content": "w5"}


@pytest.mark.parametrize(
    "schema, body",
    [
        (ChatCompletionRequest, {"messages": [1] * WRONG}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [1] * WRONG}]}),
        (ChatCompletionRequest, {"messages": [{"role": "assistant", "tool_calls": [1] * WRONG}]}),
        (ChatCompletionRequest, {"messages": [MESSAGE], "stop": [1] * WRONG}),
        (ChatCompletionRequest, {"messages": [MESSAGE], "tools": [1] * WRONG}),
        (ChatCompletionRequest, {"messages": [MESSAGE], "logit_bias": {f"x{i}": 1 for i in range(WRONG)}}),
        (CompletionRequest, {"prompt": [[1, "x"]] * WRONG}),
        (MessagesRequest, {"max_tokens": 1, "messages": [1] * WRONG}),
        (MessagesRequest, {"max_tokens": 1, "messages": [{"role": "user", "content": [1] * WRONG}]}),
        (MessagesRequest, {"max_tokens": 1, "messages": [MESSAGE], "system": [1] * WRONG}),
        (MessagesRequest, {"max_tokens": 1, "messages": [MESSAGE], "stop_sequences": [1] * WRONG}),
        (MessagesRequest, {"max_tokens": 1, "messages": [MESSAGE], "tools": [1] * WRONG}),
    ],
)
def test_a_list_of_wrong_items_is_refused_at_its_first(schema, body):
    # pydantic reports every wrong item by default: a body of millions of them held the server for 30 s
    with pytest.raises(ValidationError) as e:
        schema.model_validate({"model": "tiny", **body})
    assert e.value.error_count() <= 4  # (one for each member of a union the value could be)


def test_a_body_of_too_many_json_items_is_a_413_before_it_is_validated(tiny):  # noqa: F811
    with serving(create_app(*tiny, config(max_body_items=100))) as url:
        base = {"model": "tiny", "max_tokens": 1}  # (with messages: an object, 3 keys and an array)
        for many in (
            {"messages": [{"role": "nobody"}] * 50},  # objects (none of them a valid message)
            {"messages": [MESSAGE], "metadata": [[]] * 100},  # arrays
            {"messages": [MESSAGE], "chat_template_kwargs": {f"k{i}": 0 for i in range(100)}},  # keys
        ):
            r = post(url, "/v1/chat/completions", base | many)
            message = r.json()["error"]["message"]
            assert r.status_code == 413 and "over 100 JSON objects, arrays and keys" in message, r.text
        r = post(url, "/v1/messages", base | many)
        assert r.status_code == 413 and r.json()["type"] == "error", r.text
        text = {"role": "user", "content": '{[:"\\' * 10}  # braces, colons and escapes in text are text
        r = post(url, "/v1/chat/completions", base | {"messages": [text] * 20})  # (65 items in all)
        assert r.status_code == 200, r.text


def nested(depth: int) -> dict:
    """A tool whose parameters' schema makes the body `depth` objects and arrays deep."""
    schema = {"type": "string", "description": "{[{[ text, not structure"}
    for _ in range(depth - 7):  # (body, tools, tool, function, parameters, properties and a property)
        schema = {"type": "array", "items": schema}
    parameters = {"type": "object", "properties": {"a": schema}}
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}]}


def test_a_body_nested_too_deeply_is_a_400_before_it_is_read(tiny):  # noqa: F811
    """Deeply nested JSON that Python's parser still reads went on to overflow the stack of what reads
    messages and tools after it (a 400 blaming the chat template, a long traceback in the log)."""
    with serving(create_app(*tiny, config(max_body_depth=40))) as url:
        base = {"model": "tiny", "max_tokens": 1, "messages": [MESSAGE]}
        assert post(url, "/v1/chat/completions", base | nested(40)).status_code == 200
        for path in ("/v1/chat/completions", "/v1/messages"):
            r = post(url, path, base | nested(41))
            assert r.status_code == 400 and "nests objects and arrays over 40 deep" in r.text, r.text
        r = post(url, "/v1/chat/completions", base | {"metadata": {"text": "[" * 100}})  # (text: not nested)
        assert r.status_code == 200, r.text


def test_tool_call_arguments_nested_too_deeply_are_a_400(tiny):  # noqa: F811
    """A tool call's arguments are JSON in a string, which the body's check reads as text: parsed, they
    gave a 500 (Python's parser out of stack) or a 400 blaming the template with a traceback of
    thousands of lines in the log."""

    def called(arguments: str) -> dict:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [
            MESSAGE,
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"},
        ]
        return {"model": "tiny", "max_tokens": 1, "messages": messages}

    with serving(create_app(*tiny, config(max_body_depth=40))) as url:
        for depth in (41, 5000):
            r = post(url, "/v1/chat/completions", called("[" * depth + "]" * depth))
            assert r.status_code == 400 and "arguments nest over 40 deep" in r.text, r.text
        assert (
            post(url, "/v1/chat/completions", called('{"a": ' + "[" * 39 + "]" * 39 + "}")).status_code == 200
        )
        assert post(url, "/v1/chat/completions", called("not JSON: kept as text [[[")).status_code == 200


def test_connections_past_the_most_allowed_get_a_503_at_once_and_the_server_goes_on(tiny):  # noqa: F811
    """Past the open-files limit, asyncio's accept loop logged a traceback for each waiting connection,
    thousands a second, and the server could open no file: connections past the most are refused."""
    with serving(create_app(*tiny, config(max_connections=4))) as url:
        idle = [connect(url) for _ in range(4)]  # (they send nothing: each holds its connection)
        with connect(url) as s:
            tic = time.monotonic()
            reply = read_until(s, b"\r\n\r\n{")
            reply += s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 503") and time.monotonic() - tic < 5, reply
            assert "too many connections" in json.loads(reply.split(b"\r\n\r\n")[1])["error"]["message"]
        idle.pop().close()
        time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        for s in idle:
            s.close()


def test_a_request_that_is_not_http_gets_a_400_with_an_error_body(server):
    url, _ = server
    for sent in (
        b"GARBAGE\r\n\r\n",
        HEAD + b"Content-Length: -1\r\n\r\n",
        HEAD + b"Content-Length: 1e30\r\n\r\n",
    ):
        with connect(url) as s:
            s.sendall(sent)
            reply = read_until(s, b"\r\n\r\n{")
            reply += s.recv(65536)
        head, body = reply.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, reply
        assert json.loads(body)["error"]["message"].startswith("the request is not valid HTTP/1.1"), reply


def test_a_body_framed_both_by_length_and_by_chunks_is_refused_and_its_connection_closed(server):
    """Where a proxy in front frames the body by one and the server by the other, what follows it on
    the connection (here a second request) would be read as a request the proxy never saw."""
    url, _ = server
    with connect(url) as s:
        s.sendall(
            HEAD + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        reply = read_until(s, b"never")  # (all it sends, until it closes the connection)
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and b"connection: close" in head.lower(), reply
    assert json.loads(body)["error"]["message"] == (
        "a request gives Content-Length or Transfer-Encoding, not both"
    )


def test_serve_raises_its_open_files_limit_as_far_as_it_may():
    from cli.serve import _open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        limit = _open_files()
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (limit, hard) and limit >= soft
        if hard != resource.RLIM_INFINITY:
            assert limit == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def connect(url: str) -> socket.socket:
    """A raw connection to the server (a client that sends what it likes, when it likes)."""
    where = urllib.parse.urlsplit(url)
    return socket.create_connection((where.hostname, where.port), timeout=30)


def read_until(s: socket.socket, wanted: bytes) -> bytes:
    """What the server sends, up to `wanted` (or until it closes the connection)."""
    reply = b""
    while wanted not in reply and (part := s.recv(65536)):
        reply += part
    return reply


def test_a_body_that_stops_halfway_gets_a_408_and_one_too_long_a_413_before_it_is_sent(tiny):  # noqa: F811
    with serving(create_app(*tiny, config(body_seconds=0.5, max_body_bytes=1000))) as url:
        for request_head, status, wanted in (
            (HEAD + b'Content-Length: 100\r\n\r\n{"model": ', b"408", b"did not arrive within 0.5 s"),
            (HEAD + b"Content-Length: 100000000\r\n\r\n", b"413", b"over 1000 bytes"),
        ):
            with connect(url) as s:
                s.sendall(request_head)
                reply = read_until(s, wanted)
            assert reply.split(b" ")[1] == status and wanted in reply, reply


def test_a_connection_that_sends_no_request_head_in_time_is_closed_and_one_that_did_is_not(tiny):  # noqa: F811
    with serving(create_app(*tiny, config(head_seconds=0.3, body_seconds=10))) as url:
        for sent in (b"", HEAD):  # nothing at all; headers that stop halfway
            with connect(url) as s:
                s.sendall(sent)
                tic = time.monotonic()
                assert s.recv(65536) == b"" and time.monotonic() - tic < 10  # closed, well before uvicorn's
        body = json.dumps(request("/v1/chat/completions", "w5", max_tokens=3)).encode()
        with connect(url) as s:
            s.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body))
            time.sleep(1)  # the head is in: its body has its own time
            s.sendall(body)
            reply = read_until(s, b"chat.completion")
            assert reply.startswith(b"HTTP/1.1 200"), reply
            tic = time.monotonic()  # the next request's head must come in time again
            while s.recv(65536):
                pass
            assert time.monotonic() - tic < 10


def test_a_connection_an_answer_kept_open_waits_the_head_deadline_not_uvicorns_5_s(tiny):  # noqa: F811
    """uvicorn closed it 5 s after an answer, when httpx's pool (the openai client's) keeps one as long:
    a request sent as the server closed it failed ("Server disconnected")."""
    body = json.dumps(request("/v1/chat/completions", "w5", max_tokens=3)).encode()
    with serving(create_app(*tiny, config(head_seconds=9, body_seconds=10))) as url, connect(url) as s:
        for pause in (6, 0):
            s.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            reply = read_until(s, b"chat.completion")
            assert reply.startswith(b"HTTP/1.1 200"), reply
            time.sleep(pause)


def test_a_long_value_a_client_sent_comes_back_cut_short(server):
    url, _ = server
    r = post(url, "/v1/chat/completions", request("/v1/chat/completions", "w5", model="m" * 100_000))
    assert r.status_code == 404 and len(r.text) < 500 and "'mm" in r.text and "m...m" in r.text
    r = post(url, "/v1/chat/completions", request("/v1/chat/completions", "w5", logit_bias={"x" * 3000: 1}))
    param = r.json()["error"]["param"]
    assert (
        r.status_code == 400 and param.startswith("logit_bias.x") and "x...x" in param and len(param) == 103
    )
    part = {"role": "user", "content": [{"type": "y" * 3000}]}
    r = post(url, "/v1/chat/completions", dict(request("/v1/chat/completions", "w5"), messages=[part]))
    assert r.status_code == 400 and len(r.text) < 500 and "y...y" in r.text, r.text


def test_the_pool_keeps_one_cache_for_repeats_and_none_for_failed_requests(tiny, server, monkeypatch):  # noqa: F811
    url, app = server
    pool, path = app.state.pool, "/v1/chat/completions"
    post(url, path, request(path, words(108)))
    entries, nbytes = len(pool.caches), pool.nbytes
    for _ in range(5):
        post(url, path, request(path, words(108)))
    assert len(pool.caches) == entries and pool.nbytes == nbytes
    assert metric(url, "dflash_mlx_prefix_cache_entries") == entries
    assert metric(url, "dflash_mlx_prefix_cache_bytes") == nbytes
    import dflash_mlx.server.scheduler as scheduler

    monkeypatch.setattr(scheduler, "Sequence", Failing)
    assert post(url, path, request(path, words(109), max_tokens=13)).status_code == 500
    assert len(pool.caches) == entries


def test_the_pool_drops_what_it_holds_already_and_replaces_what_a_cache_goes_on_from():
    from tiny import make_draft, make_target

    target, draft = make_target("llama"), make_draft()
    first = SpeculativeCache(target, draft)
    generate(target, draft, None, list(range(5, 45)), max_tokens=6, prompt_cache=first)
    pool = PromptCachePool(target, draft, max_bytes=1 << 40)
    pool.put(first)
    shorter = SpeculativeCache(target, draft)
    generate(target, draft, None, first.tokens[:41], max_tokens=1, prompt_cache=shorter)
    assert shorter.tokens == first.tokens[:42]
    pool.put(shorter)  # a prefix of a kept cache: nothing new
    assert pool.caches == [first] and pool.duplicates == 1
    earlier = first.copy()
    longer = pool.take(first.tokens + [7]).cache  # the next turn, which goes on from `first`
    assert longer is first and not pool.caches
    generate(target, draft, None, [7], max_tokens=4, prompt_cache=longer)
    pool.put(earlier)
    pool.put(longer)  # it holds all `earlier` holds, and more
    assert pool.caches == [longer]


def test_a_kept_cache_holds_its_buffers_at_the_size_of_its_tokens_and_goes_on_exactly():
    from tiny import make_draft, make_target

    target, draft = make_target("llama"), make_draft()
    prompt = list(range(5, 45))
    cache = SpeculativeCache(target, draft)
    generate(target, draft, None, prompt, max_tokens=6, prompt_cache=cache)
    history = list(cache.tokens)

    def target_bytes():
        return sum(c.nbytes for c in cache.target_cache)

    before = target_bytes()
    cache.compact()
    assert target_bytes() == before * cache.processed // 256  # the positions in use of a 256-position block
    more = [7, 8, 9]
    out = generate(target, draft, None, more, max_tokens=300, prompt_cache=cache)
    assert out.tokens == generate(target, draft, None, history + more, max_tokens=300).tokens


def test_a_long_prompt_shares_the_worker_with_a_short_request_that_comes_beside_it(tiny):  # noqa: F811
    """The short request's whole answer arrives before the long prompt's first token."""
    target, draft, tok = tiny
    pool = PromptCachePool(target, draft, 0)
    scheduler = Scheduler(target, draft, tok, pool, Metrics(), max_active=4, max_waiting=4)
    events, lock = [], threading.Lock()

    def emitter(name):
        def emit(event):
            with lock:
                events.append((name, type(event).__name__, getattr(event, "finish_reason", None)))

        return emit

    long_prompt = [5 + i % 80 for i in range(3000)]
    short_prompt = tok.encode(words(110), add_special_tokens=False)
    settings = GenerationSettings(max_tokens=12)
    for name, prompt in (("long", long_prompt), ("short", short_prompt)):
        scheduler.admit()
        scheduler.submit(Request(prompt, settings, [], emitter(name)))
    scheduler.start()
    try:
        deadline = time.monotonic() + 120
        while sum(kind == "Finished" for _, kind, _ in events) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        scheduler.stop()
    answers = [name for name, kind, _ in events if kind == "GenerationResponse"]
    short_done = max(i for i, name in enumerate(answers) if name == "short")
    assert short_done < answers.index("long")
    assert [kind for name, kind, _ in events if name == "long"][0] == Started.__name__
    assert [kind for name, kind, _ in events if name == "short"][-1] == Finished.__name__


def test_past_its_time_limit_an_answer_ends_as_at_max_tokens(tiny, monkeypatch):  # noqa: F811
    import dflash_mlx.server.scheduler as scheduler

    class Slow(scheduler.Engine):
        def collect(self):
            time.sleep(0.1)
            return super().collect()

    monkeypatch.setattr(scheduler, "Engine", Slow)
    with serving(create_app(*tiny, config(request_timeout=1.0))) as url:
        oai, ant = clients(url)
        messages = [{"role": "user", "content": words(111)}]
        r = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=200)
        full = expected(tiny, messages, max_tokens=200)
        assert r.choices[0].finish_reason == "length" and 0 < r.usage.completion_tokens < len(full.tokens)
        assert full.text.startswith(r.choices[0].message.content)
        chunks = list(
            oai.chat.completions.create(model="tiny", messages=messages, max_tokens=200, stream=True)
        )
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        m = ant.messages.create(model="tiny", messages=messages, max_tokens=200)
        assert m.stop_reason == "max_tokens"
        assert metric(url, "dflash_mlx_timed_out_requests_total") == 3


def test_a_prompt_whose_scoring_its_time_limit_cut_short_gets_an_error_not_a_partial_score(tiny, monkeypatch):  # noqa: F811
    """Echo with logprobs (lm-eval's log-likelihood): a reply without every prompt token's score would
    be summed as if it had them."""
    real = SpeculativeCache.prefill_scored

    def slow(self, *args):
        time.sleep(0.3)
        return real(self, *args)

    monkeypatch.setattr(SpeculativeCache, "prefill_scored", slow)
    monkeypatch.setattr(scheduler_module, "SCORED_CHUNK", 16)  # (several chunks)
    body = {"model": "tiny", "prompt": words(113, n=80), "max_tokens": 0, "echo": True, "logprobs": 1}
    with serving(create_app(*tiny, config(request_timeout=0.5))) as url:
        r = post(url, "/v1/completions", body)
        assert r.status_code == 503 and "scoring was cut short" in r.json()["error"]["message"], r.text
        events = post(url, "/v1/completions", dict(body, stream=True)).text
        assert "scoring was cut short" in events and "[DONE]" not in events


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("messages", ["w5"], "messages[0]: should be an object"),
        (
            "messages",
            [{"role": "user", "content": "w5", "tool_calls": [{"function": 3}]}],
            "messages[0].tool_calls[0].function: should be an object",
        ),
        ("stop", 5, "stop: should be a valid string or should be a valid list"),
        (
            "messages",
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "messages[0].content[0].text: should be a valid string",
        ),
        (
            "messages",
            [{"role": "user", "content": [{"text": "w5"}]}],
            "messages[0].content[0].type: is required",
        ),
        ("stream_options", 3, "stream_options: should be an object"),
    ],
)
def test_a_body_of_the_wrong_shape_gets_the_field_named_in_the_clients_terms(server, field, value, message):
    url, _ = server
    r = post(url, "/v1/chat/completions", dict(request("/v1/chat/completions", "w5"), **{field: value}))
    assert r.status_code == 400 and r.json()["error"]["message"] == message


def _submit(scheduler, prompt: list[int], settings, tokens: list, finished: list) -> None:
    """Admit and queue a request: its tokens go to `tokens`, its end's error (or None) to `finished`."""

    def emit(event):
        if isinstance(event, Finished):
            finished.append(event.error)
        elif hasattr(event, "tokens"):
            tokens.extend(event.tokens)

    scheduler.admit()
    scheduler.submit(Request(prompt, settings, [], emit))


@pytest.mark.parametrize("together", [False, True], ids=["one at a time", "together"])
def test_short_prompts_waiting_at_once_prefill_together_where_that_pays_and_answer_as_alone(
    tiny,  # noqa: F811
    monkeypatch,
    together,
):
    """Requests that wait at once, each answered as `generate` answers it alone, whether their prompts
    were prefilled one at a time or in one pass (chosen by which has been faster: forced here)."""
    import dflash_mlx.server.scheduler as scheduler_module

    target, draft, tok = tiny
    passes = []

    def counted(caches, prompts):
        passes.append(len(caches))
        return prefill_together(caches, prompts)

    prefill_together = scheduler_module.prefill_together
    monkeypatch.setattr(scheduler_module, "prefill_together", counted)
    monkeypatch.setattr(scheduler_module._Worker, "_together", lambda self, k: together)
    scheduler = Scheduler(target, draft, tok, PromptCachePool(target, draft, 0), Metrics(), 4, 4)
    prompts = [tok.encode(words(120 + i, 3 + 4 * i), add_special_tokens=False) for i in range(4)]
    settings = GenerationSettings(max_tokens=16)
    got, finished = {i: [] for i in range(4)}, []
    for i, prompt in enumerate(prompts):
        _submit(scheduler, prompt, settings, got[i], finished)
    scheduler.start()
    try:
        deadline = time.monotonic() + 120
        while len(finished) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert finished == [None] * 4
    for i, prompt in enumerate(prompts):
        assert got[i] == generate(target, draft, None, prompt, max_tokens=16).tokens
    assert (passes == [4]) if together else not passes


def test_short_prompts_go_together_where_that_gives_their_first_tokens_sooner_on_average(tiny):  # noqa: F811
    target, draft, tok = tiny
    s = Scheduler(target, draft, tok, PromptCachePool(target, draft, 0), Metrics(), 4, 4).workers[0]
    assert s._together(4)  # (together not measured yet: tried)
    s.short_rates = {False: None, True: 100.0}
    assert not s._together(4)  # (one at a time not measured yet)
    s.short_rates = {False: 100.0, True: 150.0}  # sooner in all, but the first three wait longer
    assert [s._together(4) for _ in range(32)].count(True) == 32 // RETRY_SHORT
    s.short_rates = {False: 100.0, True: 400.0}  # four rows cost what one does (a GPU)
    assert [s._together(4) for _ in range(32)].count(False) == 32 // RETRY_SHORT


class _Reader:
    """A request's reader that takes an event every `every` seconds (None: never) once `first` are
    waiting, noting how many it had left unread whenever another came."""

    def __init__(self, every: float | None, first: int = 0):
        self.events, self.read, self.most_behind, self.every, self.first = [], 0, 0, every, first
        self.lock = threading.Lock()
        if every is not None:
            threading.Thread(target=self._read, daemon=True).start()

    def emit(self, event) -> None:
        with self.lock:
            self.most_behind = max(self.most_behind, self.backlog())
            self.events.append(event)

    def backlog(self) -> int:
        return len(self.events) - self.read

    def _read(self) -> None:
        while self.backlog() < self.first and not (self.events and isinstance(self.events[-1], Finished)):
            time.sleep(0.005)
        while not (self.read and isinstance(self.events[self.read - 1], Finished)):
            time.sleep(self.every)
            with self.lock:
                self.read = min(self.read + 1, len(self.events))

    def text(self) -> str:
        return "".join(e.text for e in self.events if isinstance(e, GenerationResponse))


def test_an_answer_waits_for_a_slow_reader_and_gives_up_its_slot_to_others_when_its_reader_hangs(
    tiny,  # noqa: F811
    monkeypatch,
):
    target, draft, tok = tiny
    monkeypatch.setattr(scheduler_module, "STALLED_S", 0.5)
    metrics = Metrics()
    scheduler = Scheduler(target, draft, tok, PromptCachePool(target, draft, 0), metrics, 1, 4)
    a, b = (tok.encode(words(seed), add_special_tokens=False) for seed in (7, 8))
    settings = GenerationSettings(max_tokens=150, block_size=1)  # (a token an event, whatever the timings)
    # One slot: the hung reader's request, then the one after it, then a slow reader's, which reads only
    # once the server would have to run ahead of it, and then slower than any answer comes.
    hung, after, slow = _Reader(None), _Reader(0.001), _Reader(0.02, first=MAX_BACKLOG)
    for reader, prompt in ((hung, a), (after, b), (slow, b)):
        scheduler.admit()
        scheduler.submit(Request(prompt, settings, [], reader.emit, reader.backlog))
    scheduler.start()
    try:
        deadline = time.monotonic() + 60
        while not (slow.events and isinstance(slow.events[-1], Finished)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        scheduler.stop()
    whole = generate(target, draft, tok, b, max_tokens=150).text  # (any policy: the same text)
    cut = [e for e in hung.events if isinstance(e, GenerationResponse)]
    assert cut[-1].finish_reason == "length" and cut[-1].generation_tokens < 150
    assert isinstance(hung.events[-1], Finished) and hung.events[-1].error is None
    assert metrics.cancelled._value.get() == 1
    assert after.text() == slow.text() == whole
    assert slow.most_behind in (MAX_BACKLOG, MAX_BACKLOG + 1)  # behind, and never run ahead of


def one_slot_slow_app(tiny, monkeypatch):  # noqa: F811
    """An app answering one request at a time (four may wait), at 0.05 s or more a step, so that
    others wait while it answers."""

    class Slow(scheduler_module.Engine):
        def collect(self):
            time.sleep(0.05)
            return super().collect()

    monkeypatch.setattr(scheduler_module, "Engine", Slow)
    return create_app(*tiny, config(max_active=1, max_waiting=4))


def test_at_shutdown_the_queued_requests_end_at_once_with_a_503_and_new_ones_get_one(tiny, monkeypatch):  # noqa: F811
    """What `serve` does at Ctrl-C (`close_queue`): uvicorn held queued requests for its grace period and
    then cut their connections; they now end at once in their API's error shape, and the answer under
    way ends within the grace it is given, as at max_tokens."""

    app = one_slot_slow_app(tiny, monkeypatch)
    messages = [{"role": "user", "content": words(111)}]
    with serving(app) as url, ThreadPoolExecutor(2) as pool:
        body = {"model": "tiny", "messages": messages, "max_tokens": 8}
        anthropic_body = dict(body, stream=True)
        long = dict(body, max_tokens=300, stream=True)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=long, timeout=60) as active:
            lines = active.iter_lines()
            next(lines)  # (it has started)
            queued = [
                pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=60),
                pool.submit(lambda: httpx.post(f"{url}/v1/messages", json=anthropic_body, timeout=60).text),
            ]
            deadline = time.monotonic() + 60
            while len(app.state.scheduler.waiting) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            app.state.scheduler.close_queue(grace=1.0)
            openai_reply, anthropic_events = queued[0].result(), queued[1].result()
            late = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            rest = [line for line in lines if line]
    assert any('"finish_reason": "length"' in line for line in rest) and rest[-1] == "data: [DONE]"
    produced = sum('"content": "' in line for line in rest)
    assert 0 < produced < 290  # (ended within its grace, at 0.05 s or more a step, not at its 300)
    for reply in (openai_reply, late):
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
        assert "shutting down" in reply.json()["error"]["message"]
    assert 'event: error\ndata: {"type": "error", "error": {"type": "api_error"' in anthropic_events
    assert "shutting down" in anthropic_events


def test_queued_requests_whose_clients_leave_are_counted_and_leave_the_queue_at_once(tiny, monkeypatch):  # noqa: F811
    """While another request answers, the queue's length drops as its clients leave, and they count as
    cancelled (the gauge stayed up until the next request came, and only active ones were counted)."""

    app = one_slot_slow_app(tiny, monkeypatch)
    body = {"model": "tiny", "messages": [{"role": "user", "content": words(111)}], "stream": True}
    with serving(app) as url:
        path = f"{url}/v1/chat/completions"
        with httpx.stream("POST", path, json=dict(body, max_tokens=300), timeout=60) as active:
            lines = active.iter_lines()
            next(lines)  # (it has started)
            before = metric(url, "dflash_mlx_cancelled_requests_total")
            for _ in range(2):
                with httpx.stream("POST", path, json=dict(body, max_tokens=8), timeout=60):
                    deadline = time.monotonic() + 60
                    while metric(url, "dflash_mlx_queue_length") != 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.02)
            deadline = time.monotonic() + 60
            while metric(url, "dflash_mlx_queue_length") != 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            assert metric(url, "dflash_mlx_cancelled_requests_total") == before + 2
            assert any('"finish_reason": null' in line for line in lines)  # (still answering)


def test_a_model_error_at_shutdown_is_the_shutdown_and_others_a_500(tiny, monkeypatch, caplog):  # noqa: F811
    """A Ctrl-C that stops `serve` also ends the g++ compiling MLX's kernels (same process group), and
    MLX raises at about the moment the server starts shutting down: the request gets the shutdown's
    503, the log one line. The same error with no shutdown is a bug: a 500, and its traceback logged."""
    app = create_app(*tiny, config())
    scheduler = app.state.scheduler
    monkeypatch.setattr(scheduler_module, "STOPPED_WITHIN_S", 0.5)
    real_run, stop = SpeculativeCache._run, {"now": False}

    def compile_killed(self, *args, **kwargs):
        if stop["now"]:  # (the signal handler runs a moment after MLX raised)
            threading.Timer(0.05, scheduler.close_queue, kwargs={"grace": 1.0}).start()
        raise RuntimeError("[Compile::eval_cpu] Failed to compile function")

    body = request("/v1/chat/completions", words(112))
    with serving(app) as url:
        monkeypatch.setattr(SpeculativeCache, "_run", compile_killed)
        with caplog.at_level("WARNING", logger="dflash_mlx.server"):
            bug = post(url, "/v1/chat/completions", body)
            assert bug.status_code == 500
            assert any(r.levelname == "ERROR" and r.exc_info for r in caplog.records)
            caplog.clear()
            stop["now"] = True
            stopped = post(url, "/v1/chat/completions", body)
        monkeypatch.setattr(SpeculativeCache, "_run", real_run)
    assert stopped.status_code == 503 and "shutting down" in stopped.json()["error"]["message"]
    assert [r.levelname for r in caplog.records] == ["WARNING"] and not caplog.records[0].exc_info


def test_two_workers_share_the_requests_and_each_answer_is_the_one_generate_gives_alone(tiny):  # noqa: F811
    """Requests go to the worker with fewer under way (each a thread of its own, with its own engine and
    MLX stream, keeping caches in the one pool): every answer is `generate`'s alone, both workers
    answered some, and a kept cache is taken up again."""
    target, draft, tok = tiny
    pool = PromptCachePool(target, draft, 1 << 30)
    scheduler = Scheduler(target, draft, tok, pool, Metrics(), 4, 8, workers=2)
    answered_by: dict[int, set] = {}
    take = pool.take

    def taken(prompt, reuse=True):
        answered_by.setdefault(len(prompt), set()).add(threading.current_thread().name)
        return take(prompt, reuse)

    pool.take = taken
    sizes = ((1, 30), (2, 90), (3, 50), (4, 120), (5, 40), (6, 70))  # (seed, words)
    prompts = [tok.encode(words(seed, n), add_special_tokens=False) for seed, n in sizes]
    prompts.append(prompts[3] + tok.encode(words(9, 12), add_special_tokens=False))  # goes on from one
    got, finished = {i: [] for i in range(len(prompts))}, []
    scheduler.start()
    try:
        settings = GenerationSettings(max_tokens=24)
        for batch in (prompts[:6], prompts[6:]):
            for prompt in batch:
                _submit(scheduler, prompt, settings, got[prompts.index(prompt)], finished)
            deadline = time.monotonic() + 120
            while len(finished) < prompts.index(batch[-1]) + 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        scheduler.stop()
    assert finished == [None] * len(prompts)
    for i, prompt in enumerate(prompts):
        assert got[i] == generate(target, draft, tok, prompt, max_tokens=24).tokens
    assert len(set().union(*answered_by.values())) == 2
    assert pool.hits >= 1  # (the last prompt took the cache of the one it goes on from)


def _slow_prefills(monkeypatch, seconds: float) -> list[int]:
    """Each prefill pass takes `seconds` longer -> the lengths of the chunks prefilled, as they come."""
    prefill, chunks = SpeculativeCache.prefill, []

    def slow(cache, tokens, step=None, progress=None):
        chunks.append(len(tokens))
        time.sleep(seconds)
        return prefill(cache, tokens, step, progress)

    monkeypatch.setattr(SpeculativeCache, "prefill", slow)
    return chunks


def _answered_alone(pair, prompt, settings, metrics=None) -> tuple[list[int], list]:
    """One request through a scheduler of its own -> (its tokens, its end's error as `_submit` gives)."""
    target, draft, tok = pair
    scheduler = Scheduler(target, draft, tok, PromptCachePool(target, draft, 0), metrics or Metrics(), 4, 4)
    got, finished = [], []
    _submit(scheduler, prompt, settings, got, finished)
    scheduler.start()
    try:
        deadline = time.monotonic() + 60
        while not finished:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        scheduler.stop()
    return got, finished


def test_a_prompt_s_chunks_stay_long_where_a_pass_costs_more_than_a_turn(tiny, monkeypatch):  # noqa: F811
    """Chunks sized by the speed of the last: where a pass's fixed cost outlasts a turn (a slow CPU
    at a long context), each chunk's speed fell with its size, shrinking the next, down to one token
    a pass."""
    chunks = _slow_prefills(monkeypatch, 0.1)
    monkeypatch.setattr(scheduler_module, "PREFILL_TURN_S", 0.05)
    monkeypatch.setattr(scheduler_module, "PREFILL_ALONE_S", 0.05)
    prompt = [5 + i % 80 for i in range(600)]
    got, finished = _answered_alone(tiny, prompt, GenerationSettings(max_tokens=4))
    assert finished == [None] and len(chunks) >= 4
    assert min(chunks[:-1]) == scheduler_module.FIRST_CHUNK
    assert got == generate(*tiny, prompt, max_tokens=4).tokens


def test_busy_seconds_count_every_chunk_of_a_prompt_s_prefill(tiny, monkeypatch):  # noqa: F811
    """Only a prompt's last chunk counted as busy: a long prompt's prefill left the counter still."""
    chunks, metrics = _slow_prefills(monkeypatch, 0.2), Metrics()
    settings = GenerationSettings(max_tokens=2, prefill_step_size=16, block_size=4)
    _, finished = _answered_alone(tiny, list(range(5, 205)), settings, metrics)
    assert finished == [None] and len(chunks) >= 10
    assert metrics.registry.get_sample_value("dflash_mlx_busy_seconds_total") >= 0.2 * len(chunks)
