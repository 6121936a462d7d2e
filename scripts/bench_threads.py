"""Decode speed of whiflash-run at several --threads values, interleaved, as the machine is and with every core but
one kept busy by a spinning process (a machine shared with other jobs). Prints median tokens/s per setting and the
load average before each part (run it on a quiet machine to see the quiet figures).

    python scripts/bench_threads.py [--threads 1,2] [--repeats 3] [--mode auto] [--max-new-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from contextlib import contextmanager

PROMPT = "Write a Python function that reverses a string."


def tokens_per_s(threads: int, mode: str, max_new: int) -> float:
    out = subprocess.run(["whiflash-run", "--chat", "--prompt", PROMPT, "--json", "--mode", mode, "--threads",
                          str(threads), "--max-new-tokens", str(max_new)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])["stats"]["tokens_per_s"]


@contextmanager
def busy_cores(n: int):
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", default="auto")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    cpus = len(os.sched_getaffinity(0))
    print(f"CPU: {platform.processor() or platform.machine()}, {cpus} usable cores; mode {args.mode}")
    for label, spinners in (("as is", 0), (f"+{cpus - 1} spinning", cpus - 1)):
        print(f"{label}: load average before {os.getloadavg()[0]:.2f}")
        runs = {t: [] for t in counts}
        with busy_cores(spinners):
            for _ in range(args.repeats):
                for t in counts:
                    runs[t].append(tokens_per_s(t, args.mode, args.max_new_tokens))
        for t in counts:
            print(f"{label:>24}  --threads {t}: median {statistics.median(runs[t]):6.2f} tok/s  (runs {runs[t]})")


if __name__ == "__main__":
    main()
