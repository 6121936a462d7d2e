"""Throughput and per-request latency through `whiflash-serve --openai` at 1/2/4/8 concurrent requests, ar vs
whiflash, interleaved (at each concurrency both modes run back to back, in an order that alternates).

Starts the server as a subprocess (the embedded default engine unless --engine), sends the first --num-prompts
prompts of the benchmark's `mix` set as greedy chat requests with the official openai client, and prints a Markdown
table. Every concurrency level sends the same --num-prompts requests, --concurrency at a time. The server batches
(up to its --max-batch requests share every round), so on a memory-bound CPU throughput grows with concurrency.

    python scripts/bench_openai.py --threads 1 --num-prompts 8 --max-tokens 48
"""
from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from whiflash_trt.bench.prompts import load_prompts
from whiflash_trt.serving.readiness import wait_until_ready

SERVE = Path(sys.executable).parent / "whiflash-serve"
STARTUP_TIMEOUT_S = 900   # the first run builds the default engine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int, log: Path) -> subprocess.Popen:
    cmd = [str(SERVE), "--openai", "--port", str(port), "--threads", str(args.threads)]
    if args.engine:
        cmd += ["--engine", str(args.engine)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    failure = wait_until_ready(proc, f"http://127.0.0.1:{port}/health", STARTUP_TIMEOUT_S, log)
    if failure:
        proc.terminate()
        sys.exit(failure)
    return proc


def one_request(client: openai.OpenAI, model: str, prompt: str, mode: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                          max_tokens=max_tokens, temperature=0, extra_body={"mode": mode})
    stats = resp.to_dict()["whiflash"]
    return {"latency": time.perf_counter() - start, "tokens": resp.usage.completion_tokens, "tau": stats["tau"]}


def run_level(client, model: str, prompts: list[str], mode: str, concurrency: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(lambda p: one_request(client, model, p, mode, max_tokens), prompts))
    wall = time.perf_counter() - start
    latencies = sorted(r["latency"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    taus = [r["tau"] for r in runs if r["tau"] is not None]
    return {"concurrency": concurrency, "mode": mode, "requests": len(runs), "tokens": tokens, "wall": wall,
            "tokens_per_s": tokens / wall, "latency_mean": statistics.mean(latencies), "latency_max": latencies[-1],
            "tau": statistics.mean(taus) if taus else float("nan")}


def table(rows: list[dict]) -> str:
    lines = ["| concurrent | mode | requests | tokens | wall s | total tokens/s | mean latency s | max latency s | "
             "mean tau | tokens/s vs ar |", "|---|---|---|---|---|---|---|---|---|---|"]
    ar = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == "ar"}
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["mode"])):
        ratio = r["tokens_per_s"] / ar[r["concurrency"]] if r["concurrency"] in ar else float("nan")
        lines.append(f"| {r['concurrency']} | {r['mode']} | {r['requests']} | {r['tokens']} | {r['wall']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['latency_mean']:.2f} | {r['latency_max']:.2f} | "
                     f"{r['tau']:.2f} | {ratio:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", type=Path, help="engine directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--num-prompts", type=int, default=8, help="requests per concurrency level and mode")
    p.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every request")
    p.add_argument("--concurrency", default="1,2,4,8", help="comma-separated numbers of requests in flight")
    p.add_argument("--modes", default="ar,whiflash", help="comma-separated modes (the `mode` extra field)")
    args = p.parse_args()
    prompts = [bp.prompt for bp in load_prompts(["mix"], args.num_prompts)]
    modes, levels = args.modes.split(","), [int(c) for c in args.concurrency.split(",")]
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="bench-openai-")) / "server.log"
    proc = start_server(args, port, log)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=3600, http_client=httpx.Client(limits=httpx.Limits(max_connections=64)))
        model = client.models.list().data[0].id
        for mode in modes:   # untimed warm-up
            one_request(client, model, prompts[0], mode, 8)
        rows = []
        for i, concurrency in enumerate(levels):
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                rows.append(run_level(client, model, prompts, mode, concurrency, args.max_tokens))
                r = rows[-1]
                print(f"concurrency {concurrency} {mode}: {r['tokens_per_s']:.1f} tokens/s, mean latency "
                      f"{r['latency_mean']:.2f} s", file=sys.stderr, flush=True)
        print(f"model {model}, {len(prompts)} chat prompts (bench set `mix`), max_tokens {args.max_tokens}, "
              f"greedy, server --threads {args.threads}\n")
        print(table(rows))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
