"""Requests/s and tokens/s through Triton (whiflash-serve, gRPC streaming client) vs Engine.generate called directly.

Run with the Triton venv's Python (scripts/setup_triton_env.sh), which has tritonclient and this project:

    .venv-triton/bin/python scripts/bench_triton.py --engine ENGINE [--max-tokens 64] [--requests 16] \
        [--concurrency 1 8] [--instances 1 2] [--repeats 3] [--torch-threads 1]

Direct: one Engine in this process, requests one after another (what `whiflash-run --prompts-file` does; the engine
serves one sequence at a time, so more direct clients would only queue). Triton: a repository with N instances is
written to a temporary folder, a server started on 127.0.0.1 (free ports), one warm-up request per instance, then
`--requests` requests spread over C concurrent gRPC clients. Greedy decoding, the same prompts everywhere; tokens
are those actually generated (a request may stop at EOS before --max-tokens). Prints one JSON line per row.

Each row is run --repeats times and the fastest run reported (a loaded machine slows runs, never speeds them).
On a shared machine wall-clock rates still mostly measure the neighbours, so each row also gives the CPU time
spent per generated token: this process's for direct, the server's and its Python-backend stubs' for Triton (the
client's own gRPC threads are not counted).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

PROMPTS = [
    "The history of the printing press",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Explain why the sky is blue.",
    "A recipe for pancakes:",
    "The capital of France is",
    "Once upon a time, in a small village,",
]


def prompts_for(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def cpu_seconds(pid: int, with_children: bool = True) -> float:
    """user + system CPU time of a process (all its threads) and, optionally, of its direct children."""
    def own(stat: str) -> int:
        fields = stat[stat.rindex(")") + 2:].split()  # fields from the 3rd on; utime, stime are the 14th, 15th
        return int(fields[11]) + int(fields[12])

    ticks = own(Path(f"/proc/{pid}/stat").read_text())
    if with_children:
        for stat_path in Path("/proc").glob("[0-9]*/stat"):
            try:
                stat = stat_path.read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                ticks += own(stat)
    return ticks / os.sysconf("SC_CLK_TCK")


def bench_direct(engine_dir: Path, max_tokens: int, num_requests: int, torch_threads: int, repeats: int) -> dict:
    import torch

    from whiflash_trt.config import GenerationConfig
    from whiflash_trt.runtime.engine import Engine

    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    engine = Engine.load(engine_dir)
    gen = GenerationConfig(max_new_tokens=max_tokens)
    engine.generate(engine.encode(PROMPTS[0]), gen)  # warm-up
    runs = []
    for _ in range(repeats):
        start, cpu_start, tokens = time.perf_counter(), time.process_time(), 0
        for prompt in prompts_for(num_requests):
            tokens += len(engine.generate(engine.encode(prompt), gen).token_ids)
        runs.append((tokens, time.perf_counter() - start, time.process_time() - cpu_start))
    return _row("direct", 1, 1, num_requests, runs)


def _row(path: str, instances: int, clients: int, requests: int, runs: list[tuple[int, float, float]]) -> dict:
    """Rates of the fastest of the repeated runs (the least disturbed); CPU per token of the median run."""
    tokens, seconds, _ = min(runs, key=lambda r: r[1])
    cpu_ms = sorted(1000 * cpu / n for n, _, cpu in runs)[len(runs) // 2]
    return {"path": path, "instances": instances, "clients": clients, "requests": requests, "tokens": tokens,
            "seconds": round(seconds, 2), "requests_per_s": round(requests / seconds, 2),
            "tokens_per_s": round(tokens / seconds, 1), "cpu_ms_per_token": round(cpu_ms, 2),
            "seconds_all_runs": [round(r[1], 2) for r in runs]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TritonServer:
    """whiflash-serve on a fresh repository for the engine; stopped on exit."""

    def __init__(self, engine_dir: Path, instances: int, torch_threads: int, workdir: Path) -> None:
        bin_dir = Path(sys.prefix) / "bin"
        repo = workdir / f"repo-{instances}"
        subprocess.run([str(bin_dir / "whiflash-build"), "--engine", str(engine_dir), "--triton-repo", str(repo),
                        "--triton-instances", str(instances), "--triton-threads", str(torch_threads)],
                       check=True, capture_output=True)
        self.http_port, self.grpc_port = _free_port(), _free_port()
        self.log = open(workdir / f"server-{instances}.log", "wb")
        self.proc = subprocess.Popen(
            [str(bin_dir / "whiflash-serve"), "--triton-repo", str(repo), "--http-port", str(self.http_port),
             "--grpc-port", str(self.grpc_port), "--backends-dir", str(workdir / "backends"),
             "--", "--exit-timeout-secs=5"], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.proc.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"tritonserver not ready after {timeout_s} s; see {self.log.name}")

    def __enter__(self) -> "TritonServer":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def triton_request(url: str, prompt: str, max_tokens: int, stream: bool) -> int:
    """One request over a gRPC stream; returns num_new_tokens of the final response."""
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, array, dtype in (("text_input", np.array([[prompt.encode()]], dtype=np.object_), "BYTES"),
                               ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
                               ("stream", np.array([[stream]], dtype=bool), "BOOL")):
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("ensemble", inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=600)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                return int(result.as_numpy("num_new_tokens").reshape(-1)[0])
    finally:
        client.stop_stream()
        client.close()


def bench_triton(server: TritonServer, instances: int, clients: int, max_tokens: int, num_requests: int,
                 stream: bool, repeats: int) -> dict:
    url = f"127.0.0.1:{server.grpc_port}"
    runs = []
    for _ in range(repeats):
        work: queue.Queue = queue.Queue()
        for prompt in prompts_for(num_requests):
            work.put(prompt)
        tokens: list[int] = []
        errors: list[str] = []

        def client() -> None:
            while True:
                try:
                    prompt = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    tokens.append(triton_request(url, prompt, max_tokens, stream))
                except Exception as e:  # reported after the run
                    errors.append(str(e))

        threads = [threading.Thread(target=client) for _ in range(clients)]
        start, cpu_start = time.perf_counter(), cpu_seconds(server.proc.pid)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        runs.append((sum(tokens), time.perf_counter() - start, cpu_seconds(server.proc.pid) - cpu_start))
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return _row("triton-stream" if stream else "triton", instances, clients, num_requests, runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=16, help="requests per row")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--instances", type=int, nargs="+", default=[1, 2])
    p.add_argument("--stream", action="store_true", help="streamed responses (one per round)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row; the fastest is reported")
    p.add_argument("--torch-threads", type=int, default=0, help="torch threads, direct and per server instance "
                                                                "(0: torch's default)")
    args = p.parse_args(argv)
    print(json.dumps(bench_direct(args.engine, args.max_tokens, args.requests, args.torch_threads,
                                  args.repeats)), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-triton-") as tmp:
        for instances in args.instances:
            with TritonServer(args.engine, instances, args.torch_threads, Path(tmp)) as server:
                server.wait_ready()
                url = f"127.0.0.1:{server.grpc_port}"
                warmups = [threading.Thread(target=triton_request, args=(url, PROMPTS[0], 4, False))
                           for _ in range(instances)]
                for t in warmups:
                    t.start()
                for t in warmups:
                    t.join()
                for clients in args.concurrency:
                    row = bench_triton(server, instances, clients, args.max_tokens, args.requests, args.stream,
                                       args.repeats)
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
