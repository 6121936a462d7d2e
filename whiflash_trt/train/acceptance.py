"""Offline acceptance on held-out prompts: the target's greedy responses, then every response position as a round start.

Because the drafters are trained on the target's own greedy output, greedy verification at position n accepts exactly
the drafts that match the response's next tokens. So per-position acceptance, or the accepted length of any draft
tree, follows from drafter forwards alone: one target prefill captures every position's features, and each position
is drafted from a cache caught up to it (the runtime's catch_up and propose, on a scratch sequence).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from whiflash_trt.config import AR, DFLASH, EAGLE3, GenerationConfig, SpecConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.tokenizer_policy import chat_ids
from whiflash_trt.train.data import split_prompts
from whiflash_trt.train.sources import PromptRecord, build_prompts

# How `whiflash-train data` split the shipped drafters' prompts (its defaults; see the model card).
DATA_PER_CATEGORY, DATA_SEED, NUM_VAL, NUM_ROUTER = 600, 0, 12, 24


@dataclass(frozen=True)
class Response:
    category: str
    prompt_ids: list[int]
    response_ids: list[int]     # the target's greedy tokens after the prompt


def held_out_prompts(split: str, per_category: int) -> list[PromptRecord]:
    """The first `per_category` prompts of each category of a split ("val", "router" or "train") of the shipped
    drafters' data folder, rebuilt from the prompt sources with the data command's defaults."""
    records = split_prompts(build_prompts(DATA_PER_CATEGORY, DATA_SEED), NUM_VAL, NUM_ROUTER)[split]
    seen: Counter = Counter()
    out = []
    for r in records:
        if seen[r.category] < per_category:
            out.append(r)
            seen[r.category] += 1
    return out


def greedy_responses(engine: Engine, records: list[PromptRecord], max_new_tokens: int,
                     cache: Path | None = None) -> list[Response]:
    """The target's greedy responses (chat template, target-only decoding), read from / written to `cache`."""
    if cache is not None and cache.is_file():
        return [Response(**json.loads(line)) for line in cache.read_text().splitlines() if line]
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    out = []
    for r in records:
        ids = chat_ids(engine.tokenizer, r.messages)
        result = engine.generate(ids, gen, spec=SpecConfig(mode=AR))
        out.append(Response(r.category, ids, result.token_ids))
    if cache is not None:
        cache.write_text("".join(json.dumps(vars(x)) + "\n" for x in out))
    return out


def round_starts(engine: Engine, response: Response, horizon: int, slack: int) -> Iterator[tuple[Sequence, list[int]]]:
    """For every response position n with `horizon` known tokens after it: a scratch sequence with x_0..x_{n-1}
    committed, x_n pending and every drafter caught up, and the continuation x_{n+1}..x_{n+horizon}. `slack`: slots
    past n that a proposal may use."""
    tokens = response.prompt_ids + response.response_ids
    first, last = len(response.prompt_ids), len(tokens) - 1 - horizon
    if last <= first:
        return
    with engine.scratch_sequence(tokens, len(tokens) + slack) as seq:
        captured = engine.runner.step(seq, tokens, logits_rows=[len(tokens) - 1], capture=True).captured
        names = [n for n in (EAGLE3, DFLASH) if n in engine.proposers]
        seq.commit(tokens[:first], tokens[first], captured[:first], {n: 0 for n in names})
        for n in range(first, last):
            if n > seq.num_committed:
                seq.commit(tokens[seq.num_committed:n], tokens[n], captured[seq.num_committed:n], dict(seq.frontiers))
            seq.frontiers.update({name: engine.proposers[name].catch_up(seq) for name in names})
            yield seq, tokens[n + 1:n + 1 + horizon]


def conditional_acceptance(accepted: list[int], depth: int) -> list[float | None]:
    """P(draft k accepted | drafts 1..k-1 accepted) for k = 1..depth, from accepted-draft counts per round."""
    reached = [sum(a >= k for a in accepted) for k in range(depth + 1)]
    return [round(reached[k] / reached[k - 1], 4) if reached[k - 1] else None for k in range(1, depth + 1)]
