"""`whiflash-serve --openai` under hostile input, as a real server process on 127.0.0.1 with an API key and small
limits, driven by the official `openai` client and httpx: every limit is answered with its OpenAI error object (401,
413, 415, 400; 429 in process, the engine's worker held so that the queue stays full), and under a load of
well-formed streams mixed with hostile requests every stream still gets exactly its single-request output, /health
answers promptly, and no KV block is left allocated."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest

from test_openai_server import MODEL, PROMPT, reference, serving

KEY = "test-key-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_BODY = 256 * 1024
MAX_PROMPT_CHARS = 20_000
MAX_STOP_CHARS = 64
CHAT_MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(spec_engine_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai-limits") / "server.log"
    with serving(spec_engine_dir, log, "--kv-budget-mb", "4", "--max-batch", "8", "--api-key", KEY,
                 "--max-body-bytes", str(MAX_BODY), "--max-prompt-chars", str(MAX_PROMPT_CHARS),
                 "--max-stop-chars", str(MAX_STOP_CHARS), "--chat-max-tokens", str(CHAT_MAX_TOKENS)) as url:
        yield url


def post(server: str, path: str, body=None, content: bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> httpx.Response:
    if content is None:
        content = json.dumps(body).encode()
        headers = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(server + path, content=content, headers=headers, timeout=timeout)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}


# ----- one request per limit ---------------------------------------------------------------------------------------
def test_the_api_key_guards_every_route_but_health(server):
    assert httpx.get(f"{server}/health").status_code == 200
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
        r = httpx.post(f"{server}/v1/completions", json=completion(), headers=headers, timeout=30)
        assert error_of(r, 401)["code"] == "invalid_api_key"
        assert httpx.get(f"{server}/metrics", headers=headers).status_code == 401
        assert httpx.get(f"{server}/v1/models", headers=headers).status_code == 401
    assert httpx.get(f"{server}/metrics", headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
    assert good.completions.create(**completion()).usage.completion_tokens >= 1


def test_a_body_over_the_cap_is_413_declared_or_chunked(server):
    huge = json.dumps(completion(prompt="x" * MAX_BODY)).encode()
    assert error_of(post(server, "/v1/completions", content=huge,
                         headers={"content-type": "application/json", **AUTH}), 413)["code"] == "request_too_large"

    def chunks():   # no Content-Length: the server counts while it reads
        for i in range(0, len(huge), 65536):
            yield huge[i:i + 65536]

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers={"content-type": "application/json", **AUTH},
                   timeout=30)
    assert error_of(r, 413)["code"] == "request_too_large"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_declared_json_is_415(server, content_type):
    headers = {**AUTH, **({"content-type": content_type} if content_type else {})}
    r = httpx.post(f"{server}/v1/completions", content=json.dumps(completion()).encode(), headers=headers, timeout=30)
    assert error_of(r, 415)["code"] == "unsupported_media_type"


HOSTILE_BODIES = {
    # name: (raw body, the error's code, its param)
    "invalid-utf8": (b'{"model": "tiny-spec", "prompt": "caf\xe9 \xff", "max_tokens": 4}', "invalid_json", None),
    "lone-surrogate": (b'{"model": "tiny-spec", "prompt": "a \\ud800 b", "max_tokens": 4}', "invalid_json", None),
    "nested-json": (b'{"model": "tiny-spec", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "invalid_json",
                    None),
    "long-stop-strings": (json.dumps(completion(stop=["y" * 50_000] * 4)).encode(), "stop_too_long", "stop"),
    "long-prompt": (json.dumps(completion(prompt="z" * (MAX_PROMPT_CHARS + 1))).encode(), "prompt_too_long",
                    "prompt"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BODIES))
def test_a_hostile_body_is_an_openai_400(server, name):
    content, code, param = HOSTILE_BODIES[name]
    error = error_of(post(server, "/v1/completions", content=content,
                          headers={"content-type": "application/json", **AUTH}), 400)
    assert (error["code"], error["param"]) == (code, param)


def test_chat_without_max_tokens_gets_the_servers_default_not_the_whole_context(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "ignore_eos": True}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == CHAT_MAX_TOKENS
    assert r.json()["choices"][0]["finish_reason"] == "length"


HOLD_LIMIT_S = 60   # how long the held worker waits for the test at most (a failing test must not hang)


class HeldScheduler:
    """The server's BatchScheduler whose worker stops in its first request's second round until `release` is set:
    that request stays running and the next one stays queued for as long as the test needs, whatever the machine's
    load. Everything but `submit` is the real scheduler's."""

    def __init__(self, scheduler) -> None:
        self.scheduler, self.num_submitted = scheduler, 0
        self.running, self.queued, self.release = threading.Event(), threading.Event(), threading.Event()

    def submit(self, request) -> None:
        self.num_submitted += 1
        if self.num_submitted == 1:
            request.sink = HeldSink(request.sink, self)
        self.scheduler.submit(request)
        if self.num_submitted == 2:
            self.queued.set()

    def __getattr__(self, name):
        return getattr(self.scheduler, name)


class HeldSink:
    """A RequestSink whose second `tokens` (called on the scheduler's worker, inside its step) waits for `release`:
    in the first round the request is still joining the batch, from the second on it is one of its running."""

    def __init__(self, sink, held: HeldScheduler) -> None:
        self.sink, self.held, self.num_rounds = sink, held, 0

    def tokens(self, new_ids) -> None:
        self.num_rounds += 1
        if self.num_rounds == 2:
            self.held.running.set()
            self.held.release.wait(HOLD_LIMIT_S)
        self.sink.tokens(new_ids)

    def __getattr__(self, name):
        return getattr(self.sink, name)


def test_a_full_queue_is_answered_429(spec_engine_dir):
    """In process (the app over a real engine and BatchScheduler, max_running 1, max_queue 1): one request runs, held
    in its second round; one waits; the next is refused 429 (the openai client's RateLimitError); once the held one
    goes on, both are served and so is the next."""
    from fastapi.testclient import TestClient

    from whiflash_trt.runtime.engine import Engine
    from whiflash_trt.serving.openai_api.app import OpenAIServer
    from whiflash_trt.serving.openai_api.limits import ServerLimits
    from whiflash_trt.serving.scheduler import BatchScheduler

    engine = Engine.load(spec_engine_dir)
    held = HeldScheduler(BatchScheduler(engine, threads=1, max_running=1))
    app = OpenAIServer(engine, held, MODEL, ServerLimits(max_queue=1)).app()
    body = completion(max_tokens=8, mode="ar", ignore_eos=True)
    with TestClient(app, raise_server_exceptions=False) as client, ThreadPoolExecutor(2) as pool:
        try:
            first = pool.submit(client.post, "/v1/completions", json=body)
            assert held.running.wait(HOLD_LIMIT_S), "the first request never ran"
            second = pool.submit(client.post, "/v1/completions", json=body)
            assert held.queued.wait(HOLD_LIMIT_S), f"the second request never queued: {second}"
            health = client.get("/health").json()
            assert (health["running"], health["queue_length"]) == (1, 1)
            assert error_of(client.post("/v1/completions", json=completion()), 429)["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0,
                              http_client=client).completions.create(**completion())
            assert not first.done() and not second.done()
        finally:
            held.release.set()
        assert first.result().status_code == second.result().status_code == 200
        assert client.post("/v1/completions", json=completion()).status_code == 200


# ----- the load test -----------------------------------------------------------------------------------------------
NUM_STREAMS = 8
NUM_HOSTILE = 200     # cheap to refuse: the load test stays ~20 s on 2 busy cores
HEALTH_LIMIT_S = 0.5
LOAD_DEADLINE_S = 120


def hostile_requests(rng: random.Random) -> list[tuple[str, dict]]:
    """(kind, httpx.post keyword arguments) of NUM_HOSTILE requests, every kind in turn, shuffled."""
    json_headers = {"content-type": "application/json", **AUTH}
    kinds = {
        "huge-body": dict(content=b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}', headers=json_headers),
        "long-stops": dict(content=json.dumps(completion(stop=["y" * 50_000] * 4)).encode(), headers=json_headers),
        "bad-utf8": dict(content=HOSTILE_BODIES["invalid-utf8"][0], headers=json_headers),
        "surrogate": dict(content=HOSTILE_BODIES["lone-surrogate"][0], headers=json_headers),
        "nested": dict(content=HOSTILE_BODIES["nested-json"][0], headers=json_headers),
        "text-plain": dict(content=json.dumps(completion()).encode(), headers={"content-type": "text/plain", **AUTH}),
        "no-key": dict(content=json.dumps(completion()).encode(), headers={"content-type": "application/json"}),
        "long-prompt": dict(content=HOSTILE_BODIES["long-prompt"][0], headers=json_headers),
    }
    names = sorted(kinds)
    work = [(names[i % len(names)], kinds[names[i % len(names)]]) for i in range(NUM_HOSTILE)]
    rng.shuffle(work)
    return work


POLL_HEALTH = """
import sys, time, urllib.request
url, stop = sys.argv[1], sys.argv[2]
while True:
    t = time.monotonic()
    with urllib.request.urlopen(url, timeout=5) as r:
        code = r.status
    print(code, time.monotonic() - t, flush=True)
    if stop in sys.stdin.readline():
        break
"""


@contextmanager
def health_poller(server: str):
    """GET /health about every 50 ms from a process of its own (the test's client threads would delay its
    timings by contending for this process's GIL) -> the list it fills at exit with (status, seconds) per poll."""
    log: list[tuple[int, float]] = []
    proc = subprocess.Popen([sys.executable, "-c", POLL_HEALTH, f"{server}/health", "stop"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    stopping = threading.Event()

    def pace() -> None:   # one line per poll: "go" while the load runs, then "stop"
        while not stopping.is_set():
            time.sleep(0.05)
            proc.stdin.write("go\n")
            proc.stdin.flush()

    pacer = threading.Thread(target=pace, daemon=True)
    pacer.start()
    try:
        yield log
    finally:
        stopping.set()
        pacer.join(timeout=10)
        out, _ = proc.communicate("stop\n", timeout=30)
        log += [(int(code), float(seconds)) for code, seconds in (line.split() for line in out.splitlines())]


def test_load_streams_keep_their_outputs_beside_hostile_requests(server, spec_engine):
    """8 concurrent well-formed streams (greedy, and two with temperature 1e-40, which is greedy) while 200 hostile
    requests arrive from 4 more clients: every stream's text equals its request alone, every hostile request gets a
    4xx, /health (polled from a process of its own) answers within 0.5 s throughout, and every KV block is free at
    the end. Sized for 2 busy cores: ~20 s here (the tiny fp32 engine). Bounded: loopback only, 208 requests, each
    client with a 60 s timeout, the whole test under LOAD_DEADLINE_S."""
    prompts = [f"Question: what is {i} times {i + 2}? Answer:" for i in range(NUM_STREAMS)]
    lengths = [20 + 2 * i for i in range(NUM_STREAMS)]
    temperatures = [1e-40 if i in (2, 5) else 0.0 for i in range(NUM_STREAMS)]
    expected = [reference(spec_engine, spec_engine.encode(p), n, ignore_eos=True).text
                for p, n in zip(prompts, lengths)]
    hostile = hostile_requests(random.Random(0))
    start = time.monotonic()

    def stream(i: int) -> str:
        client = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
        chunks = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i],
                                           temperature=temperatures[i], stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(c.choices[0].text for c in chunks)

    def attack(worker: int) -> list[tuple[str, int]]:
        return [(kind, httpx.post(f"{server}/v1/completions", timeout=60, **kwargs).status_code)
                for kind, kwargs in hostile[worker::4]]

    with health_poller(server) as health_log:
        with ThreadPoolExecutor(NUM_STREAMS + 4) as pool:
            streams = [pool.submit(stream, i) for i in range(NUM_STREAMS)]
            attacks = [pool.submit(attack, w) for w in range(4)]
            answers = [f.result(timeout=LOAD_DEADLINE_S) for f in streams]
            outcomes = [o for f in attacks for o in f.result(timeout=LOAD_DEADLINE_S)]
    health_codes, health_seconds = zip(*health_log)
    assert answers == expected
    assert len(outcomes) == NUM_HOSTILE
    assert all(400 <= status < 500 for _, status in outcomes), [o for o in outcomes if not 400 <= o[1] < 500]
    assert set(health_codes) == {200}
    assert max(health_seconds) < HEALTH_LIMIT_S, f"/health took {max(health_seconds):.2f} s"
    health = httpx.get(f"{server}/health").json()
    assert health["kv_blocks_used"] == 0 and health["kv_blocks_free"] == health["kv_blocks_total"]
    assert (health["running"], health["queue_length"]) == (0, 0)
    assert time.monotonic() - start < LOAD_DEADLINE_S


def test_a_chat_template_that_refuses_the_messages_is_an_openai_400(spec_engine_dir):
    """In process (the app over a real engine and scheduler): the engine's own template raises, as templates that
    check the roles' order do (raise_exception); the client gets a 400 naming it, and the server goes on."""
    from fastapi.testclient import TestClient

    from whiflash_trt.runtime.engine import Engine
    from whiflash_trt.serving.openai_api.app import OpenAIServer
    from whiflash_trt.serving.scheduler import BatchScheduler

    engine = Engine.load(spec_engine_dir)
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = ("{% if messages[0]['role'] == 'assistant' %}"
                                      "{{ raise_exception('the conversation must not start with the assistant') }}"
                                      "{% endif %}" + template)
    app = OpenAIServer(engine, BatchScheduler(engine, threads=1, max_running=1), MODEL).app()
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"model": MODEL, "messages": [{"role": "assistant", "content": "Hi"}], "max_tokens": 4}
        error = error_of(client.post("/v1/chat/completions", json=body), 400)
        assert (error["code"], error["param"]) == ("invalid_messages", "messages")
        assert "must not start with the assistant" in error["message"]
        body["messages"] = [{"role": "user", "content": "Hi"}]
        assert client.post("/v1/chat/completions", json=body).status_code == 200
