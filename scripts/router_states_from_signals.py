"""Turn scripts/router_signals.py's per-prompt cache into a `whiflash-train router --states` file.

router_signals.py replays both drafters (runtime.replay) at every state of the target's greedy output to built-in
bench prompts after the first --skip of each category (the bench measures the first ones), so its cache holds the
router's labels (each drafter's accepted drafts) and signals (entropy, margin, hidden) at held-out states of the
benchmark's categories, chat included, which the router data split (math, json, code, prose) lacks. Sequence ids
start at --first-seq so the file can join another states file (--states A.pt,B.pt).

    python scripts/router_states_from_signals.py --cache /tmp/wt14/sigcache --out bench-states.pt
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from whiflash_trt.train.router_trainer import StateRecord, save_states


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="router_signals.py --cache folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--first-seq", type=int, default=100000, help="sequence id of the first prompt")
    args = p.parse_args(argv)
    records = []
    for k, path in enumerate(sorted(args.cache.glob("*.pt"))):
        m = torch.load(path, weights_only=True)
        for i in range(len(m["a_eagle3"])):
            records.append(StateRecord(args.first_seq + k, i, m["a_eagle3"][i] + 1, m["a_dflash"][i] + 1,
                                       m["entropy"][i], m["hidden"][i].float(), m["margin"][i]))
    save_states(records, args.out)
    print(f"{len(records)} states of {k + 1} prompts -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
