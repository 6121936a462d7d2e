"""`whiflash-serve --openai` as a real server process on 127.0.0.1, driven by the official `openai` client and httpx:
its greedy text is Engine.generate's, streams concatenate to the whole text and end with [DONE], concurrent clients
get their single-request outputs, bad requests get OpenAI error objects while the server keeps serving, and a client
that leaves mid-stream cancels its sequence without leaking a KV block."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from whiflash_trt.cli import serve_main
from whiflash_trt.config import GenerationConfig, SamplingConfig, SpecConfig
from whiflash_trt.serving.readiness import wait_until_ready

MODEL = "tiny-spec"   # the served id (--model-name)
PROMPT = "def add(a, b):"
SYSTEM = "You are terse."
USER = "Hello world! How are you today?"
STARTUP_TIMEOUT_S = 90
KV_BUDGET_MB = 1   # ~23 blocks of 16 tokens with both drafters' pools: requests up to ~340 tokens fit, 450 do not
SERVE = Path(sys.executable).parent / "whiflash-serve"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(engine_dir: Path, log: Path, *options: str):
    """A server process on a free loopback port -> its base URL; stopped at exit."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([str(SERVE), "--openai", "--engine", str(engine_dir), "--port", str(port),
                                 "--threads", "1", "--model-name", MODEL, *options],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        failure = wait_until_ready(proc, f"{url}/health", STARTUP_TIMEOUT_S, log)
        if failure:
            pytest.fail(failure)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(spec_engine_dir, tmp_path_factory):
    """The server's base URL; its log is printed if it fails to start."""
    log = tmp_path_factory.mktemp("openai-server") / "server.log"
    with serving(spec_engine_dir, log, "--kv-budget-mb", str(KV_BUDGET_MB)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def reference(engine, ids: list[int], max_tokens: int, spec: SpecConfig | None = None, **gen):
    return engine.generate(ids, GenerationConfig(max_new_tokens=max_tokens, **gen), spec=spec)


def metric(server: str, name: str) -> float:
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def test_models_lists_the_served_name_which_defaults_to_the_target_name(client, spec_engine, tiny_checkpoint):
    from whiflash_trt.serving.openai_api.server import served_model_name

    assert [m.id for m in client.models.list()] == [MODEL]
    assert served_model_name(spec_engine.manifest) == tiny_checkpoint("spec").name


def test_greedy_completion_is_engine_generate_with_usage_and_whiflash_stats(client, spec_engine):
    ids = spec_engine.encode(PROMPT)
    expected = reference(spec_engine, ids, 40)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    assert resp.choices[0].text == expected.text and len(expected.token_ids) > 0
    assert resp.choices[0].finish_reason == ("length" if expected.finish_reason == "length" else "stop")
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    assert resp.usage.total_tokens == len(ids) + len(expected.token_ids)
    stats = resp.to_dict()["whiflash"]
    default = spec_engine.resolve_spec()
    assert (stats["mode"], stats["router"]) == (default.mode, default.router) == ("whiflash", "neural")
    assert stats["rounds"] == expected.stats["rounds"] and stats["tau"] >= 1.0 and stats["tokens_per_s"] > 0


def test_mode_extra_field_runs_target_only_and_gives_the_same_greedy_text(client, spec_engine):
    expected = reference(spec_engine, spec_engine.encode(PROMPT), 40, ignore_eos=True)
    for mode in ("ar", "eagle3", "dflash"):
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                         extra_body={"mode": mode, "ignore_eos": True})
        assert resp.choices[0].text == expected.text, mode
        assert resp.to_dict()["whiflash"]["mode"] == mode
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 40


def test_completion_token_id_prompt_is_the_same_request_as_its_text(client, spec_engine):
    ids = spec_engine.encode(PROMPT)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_streamed_completion_concatenates_to_the_whole_text_and_ends_with_done(server, client, spec_engine):
    expected = reference(spec_engine, spec_engine.encode(PROMPT), 40)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1, "the text should come in pieces"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].to_dict()["whiflash"]["mode"] == "whiflash"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    # the wire format: server-sent events, the last one `data: [DONE]`
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_chat_completion_is_engine_generate_on_the_chat_template(client, spec_engine):
    ids = spec_engine.encode(USER, chat=True, system=SYSTEM)
    expected = reference(spec_engine, ids, 30)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.total_tokens == len(ids) + len(expected.token_ids)


def test_multi_turn_chat_puts_every_turn_in_the_template(client, spec_engine):
    turns = [("user", "Hello"), ("assistant", "Hi there"), ("user", "What is 7 times 6?")]
    # the tiny tokenizer's ChatML template, written out
    text = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"
    expected = reference(spec_engine, spec_engine.tokenizer.encode(text, add_special_tokens=False), 24)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": r, "content": c} for r, c in turns],
                                          max_tokens=24, temperature=0)
    assert resp.choices[0].message.content == expected.text


def test_stop_string_cuts_the_text_whole_and_streamed(client, spec_engine):
    full = reference(spec_engine, spec_engine.encode(PROMPT), 40, ignore_eos=True).text
    assert len(full) > 12, "the tiny model should write some text"
    stop = full[8:11]
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "never-seen"],
                extra_body={"ignore_eos": True})
    resp = client.completions.create(**args)
    assert resp.choices[0].text == full[:full.find(stop)] and resp.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert streamed == full[:full.find(stop)]


def test_seeded_sampling_is_engine_generate_with_that_seed(client, spec_engine):
    ids = spec_engine.encode(PROMPT)
    sampling = SamplingConfig(temperature=0.9, top_p=0.8, seed=1234)
    expected = reference(spec_engine, ids, 30, sampling=sampling, ignore_eos=True)
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0.9, top_p=0.8,
                                     seed=1234, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected.text
    greedy = reference(spec_engine, ids, 30, ignore_eos=True)
    assert expected.token_ids != greedy.token_ids, "sampling at 0.9 should leave the greedy path"


def test_eight_concurrent_clients_get_their_single_request_outputs(server, spec_engine):
    prompts = [f"Question: what is {i} plus {i + 3}? Answer:" for i in range(8)]
    expected = [reference(spec_engine, spec_engine.encode(p), 24 + i).text for i, p in enumerate(prompts)]

    def ask(i: int) -> str:
        own = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
        args = dict(model=MODEL, prompt=prompts[i], max_tokens=24 + i, temperature=0)
        if i % 2:
            return "".join(c.choices[0].text for c in own.completions.create(**args, stream=True))
        return own.completions.create(**args).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == expected
    assert len(set(expected)) > 1


LONG = [5] * 600   # token ids: more than the spec target's 512-token context
BAD_REQUESTS = [
    # (endpoint, body or raw text, HTTP status, the error's param)
    ("completions", {"max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"max_tokens": True}, 400, "max_tokens"),
    ("completions", {"temperature": -0.5}, 400, "temperature"),
    ("completions", {"temperature": "hot"}, 400, "temperature"),
    ("completions", {"top_p": 1.5}, 400, "top_p"),
    ("completions", {"top_p": 0}, 400, "top_p"),
    ("completions", {"mode": "turbo"}, 400, "mode"),
    ("completions", {"router": "magic"}, 400, "router"),
    ("completions", {"mode": "ar", "threshold": 0.5}, 400, "threshold"),
    ("completions", {"mode": "eagle3", "router": "entropy", "threshold": 0.5}, 400, "router"),
    ("completions", {"seed": "abc"}, 400, "seed"),
    ("completions", {"stop": 5}, 400, "stop"),
    ("completions", {"stop": [""]}, 400, "stop"),
    ("completions", {"stream": "yes"}, 400, "stream"),
    ("completions", {"n": 2}, 400, "n"),
    ("completions", {"prompt": None}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": 42}, 400, "prompt"),
    ("completions", {"prompt": LONG}, 400, "prompt"),
    ("completions", {"model": "gpt-4o"}, 404, "model"),
    ("completions", "{not json", 400, None),
    ("completions", "[1, 2]", 400, None),
    ("chat", {"messages": None}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "hi " * 600}]}, 400, "messages"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS,
                         ids=[f"{e}-{json.dumps(b)[:40]}" for e, b, _, _ in BAD_REQUESTS])
def test_malformed_request_gets_an_openai_error_and_the_server_keeps_serving(server, endpoint, body, status, param):
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]
    if isinstance(body, dict):
        base = ({"model": MODEL, "prompt": PROMPT} if endpoint == "completions"
                else {"model": MODEL, "messages": [{"role": "user", "content": USER}]})
        r = httpx.post(server + path, json={**base, "max_tokens": 4, **body}, timeout=30)
    else:
        r = httpx.post(server + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    ok = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)


def test_client_leaving_mid_stream_cancels_its_sequence_and_frees_every_block(server, client):
    health = httpx.get(f"{server}/health").json()
    assert health["kv_blocks_free"] == health["kv_blocks_total"] > 0
    cancelled = metric(server, 'whiflash_requests_total{endpoint="completions",outcome="cancelled"}')
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True, "mode": "ar",
            "ignore_eos": True}   # 300 target-only rounds (~1 s): far longer than the server needs to notice
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 30
    while metric(server, 'whiflash_requests_total{endpoint="completions",outcome="cancelled"}') == cancelled:
        assert time.monotonic() < deadline, "the engine did not stop the abandoned sequence"
        time.sleep(0.05)
    health = httpx.get(f"{server}/health").json()
    assert (health["running"], health["queue_length"]) == (0, 0)
    assert health["kv_blocks_free"] == health["kv_blocks_total"]
    assert metric(server, "whiflash_kv_blocks_free") == metric(server, "whiflash_kv_blocks_total")
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.completion_tokens >= 1


def test_client_leaving_a_non_streaming_request_cancels_it(server):
    label = 'whiflash_requests_total{endpoint="completions",outcome="cancelled"}'
    cancelled = metric(server, label)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "temperature": 0, "mode": "ar", "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):   # the client gives up long before 300 rounds are done
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.2))
    deadline = time.monotonic() + 30
    while metric(server, label) == cancelled:
        assert time.monotonic() < deadline, "the engine did not stop the abandoned request"
        time.sleep(0.05)
    health = httpx.get(f"{server}/health").json()
    assert health["running"] == 0 and health["kv_blocks_free"] == health["kv_blocks_total"]


def test_request_larger_than_the_kv_budget_gets_an_error_and_frees_its_blocks(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_cache_exhausted"
    assert "KV cache exhausted" in r.json()["error"]["message"] and "--kv-budget-mb" in r.json()["error"]["message"]
    with httpx.stream("POST", f"{server}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        events = [line[6:] for line in r.iter_lines() if line]
    assert json.loads(events[-2])["error"]["code"] == "kv_cache_exhausted" and events[-1] == "[DONE]"
    assert all("choices" in json.loads(e) for e in events[:-2]), "text came before the error"
    health = httpx.get(f"{server}/health").json()
    assert health["kv_blocks_free"] == health["kv_blocks_total"]


def test_unknown_route_is_an_openai_404(server):
    r = httpx.get(f"{server}/v1/engines")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_metrics_count_requests_tokens_and_acceptance(server, client):
    tokens = metric(server, "whiflash_generated_tokens_total")
    done = metric(server, 'whiflash_requests_total{endpoint="chat",outcome="ok"}')
    taus = metric(server, "whiflash_request_tau_count")
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": USER}], max_tokens=12,
                                          temperature=0)
    assert metric(server, "whiflash_generated_tokens_total") == tokens + resp.usage.completion_tokens
    assert metric(server, 'whiflash_requests_total{endpoint="chat",outcome="ok"}') == done + 1
    assert metric(server, "whiflash_request_tau_count") == taus + 1
    assert metric(server, "whiflash_queue_length") == 0
    assert metric(server, "whiflash_last_request_tokens_per_second") > 0


def test_bad_server_options_are_one_error_line_before_anything_loads(capsys, tmp_path):
    assert serve_main(["--openai", "--engine", str(tmp_path), "--port", "0", "--threads", "1"]) == 2
    assert capsys.readouterr().err.strip() == "error: port must be in 1..65535, got 0"
    assert serve_main(["--openai", "--engine", str(tmp_path / "none"), "--port", "9", "--threads", "1"]) == 2
    assert "not a whiflash engine directory" in capsys.readouterr().err
    for option, value in (("--max-queue", "0"), ("--max-body-bytes", "-1"), ("--chat-max-tokens", "0")):
        assert serve_main(["--openai", "--engine", str(tmp_path), "--port", "9", option, value]) == 2
        assert capsys.readouterr().err.strip() == f"error: {option[2:]} must be >= 1, got {value}"


def test_a_device_that_cannot_run_here_is_named_by_its_flag_before_anything_loads(capsys, tmp_path):
    # no engine at this path and no CUDA device 99 anywhere: the device check fails first, spelled as a CLI flag
    assert serve_main(["--openai", "--engine", str(tmp_path / "none"), "--port", "9", "--device", "cuda:99"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda:99: ") and len(err.strip().splitlines()) == 1, err


def test_the_runtime_and_the_triton_cli_do_not_import_the_web_stack():
    code = ("import sys, whiflash_trt.cli, whiflash_trt.runtime.engine; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_openai_option_has_help_text():
    from whiflash_trt.cli import openai_parser

    for action in openai_parser()._actions:
        assert action.help, f"whiflash-serve --openai: {action.option_strings or action.dest} has no help text"
