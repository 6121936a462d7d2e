"""A real Triton Inference Server (nvidia-pytriton's bundled binary) serving a repository written by
`whiflash-build --triton-repo` for a tiny random engine, queried with tritonclient on 127.0.0.1.

The server runs from the venv made by scripts/setup_triton_env.sh (.venv-triton, or WHIFLASH_TRITON_VENV): the
Python-backend stub needs a venv of the system Python. Run this module with that venv's interpreter, which also has
tritonclient:  .venv-triton/bin/python -m pytest tests/test_triton.py
The module is skipped, saying why, only when that venv or tritonclient is missing; a server that is there but fails
to start or to load the models fails the tests.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("WHIFLASH_TRITON_VENV") or ROOT / ".venv-triton")
SETUP_HINT = "run scripts/setup_triton_env.sh, then .venv-triton/bin/python -m pytest tests/test_triton.py"

grpcclient = pytest.importorskip("tritonclient.grpc", reason=f"tritonclient is not installed here ({SETUP_HINT})")
if not (VENV / "bin" / "whiflash-serve").is_file():
    pytest.skip(f"no Triton venv at {VENV} ({SETUP_HINT})", allow_module_level=True)

MODEL = "ensemble"
MAX_TOKENS = 24
STARTUP_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 60
PROMPTS = [
    "The quick brown fox",
    "def add(a, b):",
    "Speculative decoding drafts tokens",
    "Hello world! How are you",
    "Question: what is 12 plus 30?",
    '{"name": "whiflash", "tokens": [',
    "The cache holds keys and values",
    "for i in range(10):",
]


def whiflash_run(engine: Path, tmp: Path, *options: str) -> list[dict]:
    """`whiflash-run --json OPTIONS` (the venv's, i.e. this checkout's) on every prompt, greedy."""
    prompts_file = tmp / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = subprocess.run([str(VENV / "bin" / "whiflash-run"), "--engine", str(engine), "--prompts-file",
                          str(prompts_file), "--max-new-tokens", str(MAX_TOKENS), "--json", *options],
                         capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


# ----- the server ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    http_port: int
    grpc_port: int
    expected: list[dict]   # whiflash-run --mode ar's JSON for each prompt (target-only)
    default: list[dict]    # whiflash-run's JSON for each prompt with no mode given (the engine's default)
    whiflash: list[dict]   # whiflash-run --mode whiflash's (router: the engine's default)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def http(self, path: str, body: dict | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", data=data)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()


def _log_tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-40:])


def _wait_ready(proc: subprocess.Popen, server: Server, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tritonserver exited with {proc.returncode} before it was ready:\n{_log_tail(log)}")
        try:
            if server.http("/v2/health/ready", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"tritonserver not ready after {STARTUP_TIMEOUT_S} s:\n{_log_tail(log)}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group: it and its Python stubs
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_engine):
    tmp = tmp_path_factory.mktemp("triton")
    checked = subprocess.run([str(VENV / "bin" / "python"), "-c", "import whiflash_trt; print(whiflash_trt.__file__)"],
                             capture_output=True, text=True, timeout=60)
    if Path(checked.stdout.strip()).resolve().parents[1] != ROOT:
        pytest.fail(f"{VENV} serves whiflash_trt from {checked.stdout.strip() or checked.stderr} rather than {ROOT}: "
                    f"rerun scripts/setup_triton_env.sh in this checkout")
    # a random 6-layer Llama with both drafters and a router: PROMPTS[0] * 100 is longer than its 256 positions
    engine = tiny_engine("llama", drafters=True, num_hidden_layers=6)
    repo = tmp / "repo"
    subprocess.run([str(VENV / "bin" / "whiflash-build"), "--engine", str(engine), "--triton-repo", str(repo),
                    "--triton-instances", "2"], check=True, timeout=120, capture_output=True)
    srv = Server(free_port(), free_port(), whiflash_run(engine, tmp, "--mode", "ar"), whiflash_run(engine, tmp),
                 whiflash_run(engine, tmp, "--mode", "whiflash"))
    log = tmp / "tritonserver.log"
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(
            [str(VENV / "bin" / "whiflash-serve"), "--triton-repo", str(repo), "--http-port", str(srv.http_port),
             "--grpc-port", str(srv.grpc_port), "--backends-dir", str(tmp / "backends"),
             "--", "--exit-timeout-secs=5"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_ready(proc, srv, log)
        yield srv
    finally:
        _stop(proc)


# ----- a gRPC client ---------------------------------------------------------------------------------------------
def _array(value, dtype) -> np.ndarray:
    return np.array([[value]], dtype=dtype)


def make_inputs(text=None, max_tokens=MAX_TOKENS, stream=False, extra: dict | None = None) -> list:
    """Request tensors ([1, 1]: batch size 1); `extra` {name: numpy array} adds or replaces inputs."""
    arrays = {}
    if text is not None:
        arrays["text_input"] = np.array([[text.encode()]], dtype=np.object_)
    if max_tokens is not None:
        arrays["max_tokens"] = np.array([[max_tokens]], dtype=np.int32)
    arrays["stream"] = np.array([[stream]], dtype=bool)
    arrays.update(extra or {})
    inputs = []
    for name, a in arrays.items():
        tensor = grpcclient.InferInput(name, list(a.shape), "BYTES" if a.dtype == np.object_ else
                                       {np.dtype(bool): "BOOL", np.dtype(np.int32): "INT32",
                                        np.dtype(np.float32): "FP32", np.dtype(np.uint64): "UINT64"}[a.dtype])
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    return inputs


@dataclass
class Reply:
    texts: list[str]         # text_output of each response
    last: dict               # the outputs of the final response
    error: str | None

    @property
    def text(self) -> str:
        return "".join(self.texts)


def grpc_generate(url: str, inputs: list) -> Reply:
    """One request over a gRPC stream; collects responses until the final one or an error."""
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    texts, last = [], {}
    try:
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=REQUEST_TIMEOUT_S)
            if error is not None:
                return Reply(texts, last, str(error))
            response = result.get_response()
            if response.outputs:
                last = {o.name: result.as_numpy(o.name).reshape(-1)[0] for o in response.outputs}
                texts.append(last["text_output"].decode())
            if response.parameters["triton_final_response"].bool_param:
                return Reply(texts, last, None)
    finally:
        client.stop_stream()
        client.close()


# ----- tests -----------------------------------------------------------------------------------------------------
def test_non_streaming_request_returns_whiflash_run_text_and_stats(server):
    want = server.expected[0]
    reply = grpc_generate(server.grpc_url, make_inputs(PROMPTS[0], extra={"mode": _array(b"ar", np.object_)}))
    assert reply.error is None
    assert reply.texts == [want["text"]]
    assert reply.last["finish_reason"].decode() == want["finish_reason"]
    assert reply.last["num_new_tokens"] == len(want["token_ids"])
    assert reply.last["num_rounds"] == want["stats"]["rounds"]
    assert reply.last["acceptance_length"] == pytest.approx(want["stats"].get("tau", 1.0))
    assert reply.last["tokens_per_s"] > 0


@pytest.mark.parametrize("mode", ["eagle3", "dflash", "whiflash"])
def test_speculative_modes_through_triton_return_the_target_only_text(server, mode):
    want = server.expected[3]   # whiflash-run's default: target-only greedy
    extra = {"mode": _array(mode.encode(), np.object_)}
    if mode == "whiflash":   # a threshold applies to whiflash only (runtime.plan's option rule)
        extra["threshold"] = _array(2.0, np.float32)
    reply = grpc_generate(server.grpc_url, make_inputs(PROMPTS[3], extra=extra))
    assert reply.error is None
    assert "".join(reply.texts) == want["text"]
    assert reply.last["num_new_tokens"] == len(want["token_ids"])
    assert 0 < reply.last["num_rounds"] <= len(want["token_ids"])
    assert reply.last["acceptance_length"] >= 1.0


def test_a_threshold_beside_a_mode_that_ignores_it_is_an_error_through_triton(server):
    reply = grpc_generate(server.grpc_url, make_inputs(PROMPTS[3], extra={
        "mode": _array(b"eagle3", np.object_), "threshold": _array(2.0, np.float32)}))
    assert reply.error is not None and "threshold applies only to mode whiflash" in reply.error
    assert reply.texts == []


@pytest.mark.parametrize("mode", [None, "auto", "whiflash"])
def test_a_request_without_mode_gets_the_engine_default_as_whiflash_run_does(server, mode):
    want = (server.whiflash if mode == "whiflash" else server.default)[4]
    assert (want["stats"]["mode"], want["stats"]["router"]) == ("whiflash", "neural")
    extra = {} if mode is None else {"mode": _array(mode.encode(), np.object_)}
    reply = grpc_generate(server.grpc_url, make_inputs(PROMPTS[4], extra=extra))
    assert reply.error is None
    assert reply.text == want["text"]
    assert reply.last["num_new_tokens"] == len(want["token_ids"])
    assert reply.last["num_rounds"] == want["stats"]["rounds"]   # the same rounds: the same drafters were chosen
    assert reply.last["acceptance_length"] == pytest.approx(want["stats"]["tau"])


def test_streaming_request_concatenates_to_whiflash_run_text(server):
    want = server.expected[1]
    reply = grpc_generate(server.grpc_url, make_inputs(PROMPTS[1], stream=True))
    assert reply.error is None
    assert len(reply.texts) > 1, "a streamed request should get more than one response"
    assert reply.text == want["text"]
    assert reply.last["finish_reason"].decode() == want["finish_reason"]
    assert reply.last["num_new_tokens"] == len(want["token_ids"])


def test_http_generate_endpoints_serve_the_ensemble(server):
    want = server.expected[2]
    status, body = server.http(f"/v2/models/{MODEL}/generate", {"text_input": PROMPTS[2], "max_tokens": MAX_TOKENS})
    assert status == 200, body
    assert json.loads(body)["text_output"] == want["text"]
    status, body = server.http(f"/v2/models/{MODEL}/generate_stream",
                               {"text_input": PROMPTS[2], "max_tokens": MAX_TOKENS, "stream": True})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == want["text"]


def test_eight_concurrent_clients_each_get_their_own_answer(server):
    replies: dict[int, Reply] = {}

    def client(i: int) -> None:
        replies[i] = grpc_generate(server.grpc_url, make_inputs(PROMPTS[i], stream=i % 2 == 1))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * REQUEST_TIMEOUT_S)
    assert sorted(replies) == list(range(len(PROMPTS)))
    for i, want in enumerate(server.expected):
        assert replies[i].error is None, replies[i].error
        assert replies[i].text == want["text"], f"client {i} ({PROMPTS[i]!r}) got another answer"


def test_a_poisoned_temperature_beside_a_greedy_request_leaves_both_greedy(server):
    """temperature 1e-40 (fp32 logits divided by it overflow) is greedy, and its batch-mate keeps its answer."""
    poisoned = make_inputs(PROMPTS[0], extra={"temperature": _array(1e-40, np.float32)})
    replies: dict[int, Reply] = {}

    def client(i: int, inputs: list) -> None:
        replies[i] = grpc_generate(server.grpc_url, inputs)

    threads = [threading.Thread(target=client, args=(0, poisoned)),
               threading.Thread(target=client, args=(1, make_inputs(PROMPTS[1])))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * REQUEST_TIMEOUT_S)
    assert sorted(replies) == [0, 1]
    for i in (0, 1):
        assert replies[i].error is None, replies[i].error
        assert replies[i].text == server.expected[i]["text"]


@pytest.mark.parametrize("inputs, message", [
    (dict(text=None), "text_input is required"),
    (dict(text=""), "prompt is empty"),
    (dict(extra={"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)}), "batch"),
    (dict(max_tokens=None), "max_tokens is required"),
    (dict(max_tokens=-3), "max_tokens must be a positive integer"),
    (dict(extra={"max_tokens": _array(1.5, np.float32)}), "data-type"),
    (dict(extra={"text_input": _array(7, np.int32)}), "data-type"),
    (dict(extra={"temperature": _array(-1.0, np.float32)}), "temperature must be >= 0"),
    (dict(extra={"mode": _array(b"warp", np.object_)}), "unknown mode"),
    (dict(text=PROMPTS[0] * 100), "context"),
], ids=["missing_text_input", "empty_text_input", "batch_of_two", "missing_max_tokens", "negative_max_tokens", "max_tokens_as_float",
        "text_input_as_int", "negative_temperature", "unknown_mode", "prompt_longer_than_context"])
def test_malformed_request_gets_an_error_and_the_server_keeps_serving(server, inputs, message):
    reply = grpc_generate(server.grpc_url, make_inputs(**{"text": PROMPTS[0], **inputs}))
    assert reply.error is not None, f"expected an error, got {reply.texts}"
    assert message.lower() in reply.error.lower()
    good = grpc_generate(server.grpc_url, make_inputs(PROMPTS[3]))
    assert good.error is None and good.text == server.expected[3]["text"]
