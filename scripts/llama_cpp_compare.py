"""Our engines against llama.cpp on the same GGUF, side by side in one run: the bench's prompts through the chat
template, the same prompt token ids to every configuration, greedy, N new tokens, the same threads; per prompt each
configuration runs in turn (the order rotating), and the script prints each one's tokens/s and its median per-prompt
ratio to llama.cpp's, and how many leading tokens each output shares with llama.cpp's and with the first engine's `ar`.
With --kl-text, instead: the mean per-token KL divergence between each pair of next-token distributions (llama.cpp
and each engine's target) over that text, teacher-forced in windows of --kl-window tokens.

    python scripts/llama_cpp_compare.py --llama-python /work/llama-venv/bin/python \\
        --engine native=/tmp/e-native --engine bf16=ENGINE --modes ar,whiflash --per-category 5 --threads 2
    python scripts/llama_cpp_compare.py --llama-python ... --engine native=... --engine bf16=... --kl-text FILE

Every engine runs in a worker process of its own, so one run can also time an engine under another environment:
`--env LABEL:VAR=VALUE` sets VAR in that engine's worker, e.g. `--env avx2:WHIFLASH_ISA=avx2` (the AVX2 build on an
AVX-512 CPU) or `--env old:PYTHONPATH=CHECKOUT` (an earlier commit's code, for an A/B across commits; mode `auto` is
each engine's default mode). llama.cpp runs in a worker process of the Python that has llama-cpp-python (`pip
install llama-cpp-python`; it compiles llama.cpp for this CPU), which needs nothing of this package.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def llama_worker(gguf: str, threads: int, context: int) -> None:
    """Reads {"ids": [...], "max_new_tokens": n} lines, answers {"ids": generated, "seconds": s} lines; a request
    with "logits_to": PATH instead saves the logits of every position of "ids" there (.npy) and answers {}."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=context, verbose=False,
                logits_all=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "logits_to" in request:
            llm.reset()
            llm.eval(request["ids"])
            np.save(request["logits_to"], np.asarray(llm.scores[:len(request["ids"])], dtype=np.float32))
            print("{}", flush=True)
            continue
        out, start = [], time.perf_counter()
        for token in llm.generate(request["ids"], top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            if token == llm.token_eos() or len(out) == request["max_new_tokens"]:
                break
            out.append(token)
        print(json.dumps({"ids": out, "seconds": time.perf_counter() - start}), flush=True)


def engine_worker(engine_dir: str, threads: int) -> None:
    """Reads {"encode": text} lines (answers {"ids": the chat template's ids}) and {"ids": [...], "mode": m,
    "max_new_tokens": n} lines (answers {"ids": generated, "seconds": s}); uses only the API every commit has."""
    import torch

    from whiflash_trt.config import GenerationConfig, SpecConfig
    from whiflash_trt.runtime.engine import Engine

    torch.set_num_threads(threads)
    engine = Engine.load(engine_dir)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "encode" in request:
            print(json.dumps({"ids": engine.encode(request["encode"], chat=True)}), flush=True)
            continue
        gen = GenerationConfig(max_new_tokens=request["max_new_tokens"])
        start = time.perf_counter()
        out = engine.generate(request["ids"], gen, spec=SpecConfig(mode=request["mode"])).token_ids
        print(json.dumps({"ids": out, "seconds": time.perf_counter() - start}), flush=True)


class Worker:
    """A worker process of this script (`args` select which), answering one JSON line per JSON line sent."""

    def __init__(self, python: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([python, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        json.loads(self.proc.stdout.readline())

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def generate(self, ids: list[int], max_new_tokens: int, mode: str | None = None) -> tuple[list[int], float]:
        reply = self.ask({"ids": ids, "max_new_tokens": max_new_tokens, **({"mode": mode} if mode else {})})
        return reply["ids"], reply["seconds"]

    def logits(self, ids: list[int], path: str):
        import numpy as np
        import torch

        self.ask({"ids": ids, "logits_to": path})
        return torch.from_numpy(np.load(path))


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def target_logits(engine, ids: list[int]):
    """The engine's target over `ids` from an empty cache: fp32 logits of every position."""
    import torch

    cfg, n = engine.target.config, len(ids)
    pool = torch.zeros(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, dtype=engine.target.dtype)
    rows = torch.arange(n)
    with torch.inference_mode():
        out = engine.target(torch.tensor(ids), rows, pool, pool.clone(), rows, rows,
                            torch.ones(n, n, dtype=torch.bool).tril())
    return out.logits.float()


def kl_table(engines: dict, llama: Worker, text: str, window: int) -> None:
    """Mean per-token KL(P || Q) for every ordered pair of llama.cpp and the engines, over `text` in windows."""
    import tempfile

    import torch

    first = next(iter(engines.values()))
    ids = first.tokenizer(text)["input_ids"]
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    logp: dict[str, list] = {name: [] for name in ["llama.cpp", *engines]}
    with tempfile.TemporaryDirectory() as tmp:
        for i, w in enumerate(windows):
            logp["llama.cpp"].append(torch.log_softmax(llama.logits(w, f"{tmp}/{i}.npy"), -1))
            for name, engine in engines.items():
                logp[name].append(torch.log_softmax(target_logits(engine, w), -1))
    logp = {name: torch.cat(parts) for name, parts in logp.items()}
    print(f"{len(windows)} windows of {window} tokens ({len(windows) * window} positions)")
    print("P | Q | mean KL(P || Q) nats | top-1 agreement")
    for p in logp:
        for q in logp:
            if p != q:
                kl = (logp[p].exp() * (logp[p] - logp[q])).sum(-1).mean().item()
                top1 = (logp[p].argmax(-1) == logp[q].argmax(-1)).float().mean().item()
                print(f"{p} | {q} | {kl:.5f} | {top1:.4f}")


def time_configs(args, workers: dict[str, Worker], llama: Worker) -> None:
    """Every configuration (llama.cpp, then each engine in each mode) on every prompt, in a rotating order."""
    from whiflash_trt.bench.prompts import load_prompts

    modes = args.modes.split(",")
    configs = [(label, mode) for label in workers for mode in modes]
    first = next(iter(workers))
    speed: dict[str, list[float]] = {}
    ratio: dict[str, list[float]] = {}
    agree: dict[str, list[tuple[int, int]]] = {}
    llama_tokens = 0   # llama.cpp's new tokens over all prompts (it stops at its end-of-sequence token)
    for i, prompt in enumerate(load_prompts(None, args.per_category)):
        ids = workers[first].ask({"encode": prompt.prompt})["ids"]
        runs = {}
        order = ["llama.cpp"] + [f"{label}/{mode}" for label, mode in configs]
        for name in order[i % len(order):] + order[:i % len(order)]:
            if name == "llama.cpp":
                runs[name] = llama.generate(ids, args.max_new_tokens)
            else:
                label, mode = name.split("/")
                runs[name] = workers[label].generate(ids, args.max_new_tokens, mode)
        llama_tokens += len(runs["llama.cpp"][0])
        base = runs[f"{first}/ar"][0] if modes[0] == "ar" else runs["llama.cpp"][0]
        llama_speed = len(runs["llama.cpp"][0]) / runs["llama.cpp"][1]
        for name, (out, seconds) in runs.items():
            speed.setdefault(name, []).append(len(out) / seconds)
            ratio.setdefault(name, []).append(len(out) / seconds / llama_speed)
            agree.setdefault(name, []).append((shared_prefix(out, runs["llama.cpp"][0]), shared_prefix(out, base)))
        print(f"{prompt.id}: " + ", ".join(f"{n} {speed[n][-1]:.1f}" for n in runs), file=sys.stderr, flush=True)
    print(f"{len(speed['llama.cpp'])} prompts, {args.max_new_tokens} new tokens, {args.threads} threads")
    print(f"config | tok/s (median) | x llama.cpp (median per prompt) | tokens shared with llama.cpp | with {first} "
          "ar's")
    for name in speed:
        shared = agree[name]
        print(f"{name} | {statistics.median(speed[name]):.1f} | {statistics.median(ratio[name]):.3f} | "
              f"{sum(a for a, _ in shared)}/{llama_tokens} | {sum(b for _, b in shared)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-worker", metavar="GGUF", help=argparse.SUPPRESS)
    p.add_argument("--engine-worker", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    p.add_argument("--gguf", help="the GGUF both run (default: the embedded SmolLM2)")
    p.add_argument("--engine", action="append", default=[], metavar="LABEL=DIR", help="an engine to time (repeat)")
    p.add_argument("--env", action="append", default=[], metavar="LABEL:VAR=VALUE",
                   help="an environment variable of that engine's worker process (repeat)")
    p.add_argument("--modes", default="ar,whiflash", help="our modes to time, comma-separated (auto: the default)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kl-text", help="a text file: the KL divergences over it instead of the timing")
    p.add_argument("--kl-window", type=int, default=256, help="tokens per teacher-forced window")
    args = p.parse_args()
    if args.llama_worker:
        llama_worker(args.llama_worker, args.threads, 4096)
        return 0
    if args.engine_worker:
        engine_worker(args.engine_worker, args.threads)
        return 0
    if not args.llama_python or not args.engine:
        p.error("--llama-python and at least one --engine are needed")
    engines = dict(e.split("=", 1) for e in args.engine)
    envs: dict[str, dict[str, str]] = {label: {} for label in engines}
    for item in args.env:
        label, _, assignment = item.partition(":")
        var, eq, value = assignment.partition("=")
        if label not in engines or not eq:
            p.error(f"--env {item}: want LABEL:VAR=VALUE with LABEL one of {sorted(engines)}")
        envs[label][var] = value

    from whiflash_trt.builder.sources import embedded_gguf

    llama = Worker(args.llama_python, ["--llama-worker", args.gguf or str(embedded_gguf()), "--threads",
                                       str(args.threads)])
    if args.kl_text:
        import torch

        from whiflash_trt.runtime.engine import Engine

        torch.set_num_threads(args.threads)
        kl_table({label: Engine.load(path) for label, path in engines.items()}, llama,
                 Path(args.kl_text).read_text(), args.kl_window)
        return 0
    workers = {label: Worker(sys.executable, ["--engine-worker", path, "--threads", str(args.threads)], envs[label])
               for label, path in engines.items()}
    time_configs(args, workers, llama)
    return 0


if __name__ == "__main__":
    sys.exit(main())
