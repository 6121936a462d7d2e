"""Losslessness check: every mode's greedy tokens against `ar`'s, prompt by prompt.

At the first differing position the target itself is asked (same dtype, one forward over prompt + common prefix)
for its logits there. On CPU the target's rows are bit-identical whatever the shape of the call
(models/attention.py), so in bf16 and fp32 any divergence is a bug (tolerance 0). Where a tolerance is given (fp16 on
CUDA, whose kernels are not made row-invariant), a divergence is accepted when both the ar token and the mode's token
lie within it of the target's top logit (a near-tie), and anything else is flagged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch

# Default near-tie tolerance per dtype, in logits; 0 = exact (every divergence is a bug). fp16 logits near 16-32 are
# spaced 0.125 apart, so a flip between two tokens two spacings apart is still rounding.
NEAR_TIE = {"bf16": 0.0, "fp16": 0.25, "fp32": 0.0}

LogitsFn = Callable[[list[int]], torch.Tensor]   # token ids -> [vocab] the target's logits after the last one


@dataclass(frozen=True)
class Divergence:
    prompt_id: str
    category: str
    mode: str
    position: int                 # index into the generated tokens
    ar_token: int | None          # None: that side ended here
    mode_token: int | None
    top2_gap: float | None        # target's top-1 minus top-2 logit at the position
    ar_deficit: float | None      # top-1 logit minus the ar token's logit
    mode_deficit: float | None    # top-1 logit minus the mode token's logit
    near_tie: bool

    def to_dict(self) -> dict:
        return asdict(self)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def diagnose(prompt_ids: list[int], ar: list[int], other: list[int], position: int, logits_fn: LogitsFn,
             tolerance: float) -> dict:
    """Gap numbers at `position` (logits after prompt + the common prefix)."""
    ar_tok = ar[position] if position < len(ar) else None
    mode_tok = other[position] if position < len(other) else None
    logits = logits_fn(prompt_ids + ar[:position]).float()
    top = torch.topk(logits, 2).values.tolist()

    def deficit(tok):
        return None if tok is None else round(top[0] - float(logits[tok]), 6)

    ar_def, mode_def = deficit(ar_tok), deficit(mode_tok)
    near = tolerance > 0 and ar_def is not None and mode_def is not None and max(ar_def, mode_def) <= tolerance
    return {"ar_token": ar_tok, "mode_token": mode_tok, "top2_gap": round(top[0] - top[1], 6),
            "ar_deficit": ar_def, "mode_deficit": mode_def, "near_tie": near}


def check_lossless(records: list[dict], prompt_ids: dict[str, list[int]], logits_fn: LogitsFn,
                   tolerance: float, baseline: str = "ar") -> dict:
    """records: {"prompt_id", "category", "mode", "token_ids"}, one per prompt and mode (keyed by prompt_id).

    A record holding "error" (its generation raised) counts as a failure and as a bug.
    -> {"tolerance", "by_mode": {mode: {category: {num, exact, errors, exact_match_rate}}}, "divergences": [...],
        "errors": [...], "bugs": divergences that are not near-ties, plus failed runs}
    """
    ar = {r["prompt_id"]: r for r in records if r["mode"] == baseline and "error" not in r}
    by_mode: dict[str, dict[str, dict]] = {}
    divergences, errors = [], []
    for r in records:
        if r["mode"] == baseline or r["prompt_id"] not in ar:
            continue
        cell = by_mode.setdefault(r["mode"], {}).setdefault(r["category"], {"num": 0, "exact": 0, "errors": 0})
        cell["num"] += 1
        if "error" in r:
            cell["errors"] += 1
            errors.append({"prompt_id": r["prompt_id"], "category": r["category"], "mode": r["mode"],
                           "error": r["error"]})
            continue
        ref = ar[r["prompt_id"]]["token_ids"]
        pos = first_difference(ref, r["token_ids"])
        if pos is None:
            cell["exact"] += 1
            continue
        info = diagnose(prompt_ids[r["prompt_id"]], ref, r["token_ids"], pos, logits_fn, tolerance)
        divergences.append(Divergence(r["prompt_id"], r["category"], r["mode"], pos, **info))
    for cells in by_mode.values():
        for cell in cells.values():
            cell["exact_match_rate"] = round(cell["exact"] / cell["num"], 4)
    return {"baseline": baseline, "tolerance": tolerance, "by_mode": by_mode,
            "divergences": [d.to_dict() for d in divergences], "errors": errors,
            "bugs": sum(not d.near_tie for d in divergences) + len(errors)}
