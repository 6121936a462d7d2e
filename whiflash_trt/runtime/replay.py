"""Drafters replayed over a known greedy output: what each would draft, and how much of it would be accepted.

Greedy verification is deterministic, so a drafter's accepted drafts at state N (x_0..x_{N-1} committed, x_N the
pending bonus) are the longest path of its draft tree whose tokens match the target's own continuation x_{N+1}...:
no verify pass is needed. Offline tools (router training, the benchmark's oracle, router-signal studies) drive the
runtime proposers through these helpers on a scratch Sequence, position by position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from whiflash_trt.models.contracts import TargetOutput
from whiflash_trt.runtime.drafters import Proposal, Proposer
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.spec.tree import DraftTree


def num_accepted(tree: DraftTree, continuation: list[int]) -> int:
    """Accepted drafts (tau - 1) under greedy verification against the known continuation x_{N+1}, x_{N+2}, ..."""
    children = tree.children()
    node, depth = 0, 0
    while depth < len(continuation):
        nxt = next((c for c in children[node] if tree.tokens[c] == continuation[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


@torch.inference_mode()
def capture_output(engine, token_ids: list[int]) -> TargetOutput:
    """One target pass over prompt + output: logits and final-norm hidden at every row, and the captured features
    of the layers the engine's drafters read (the union every verify captures)."""
    with engine.scratch_sequence(token_ids) as seq:
        return engine.runner.step(seq, token_ids, capture=True)


@dataclass(frozen=True)
class ReplayState:
    position: int                      # N: x_0..x_{N-1} committed, x_N pending
    seq: Sequence                      # the scratch sequence at that state (valid until the next state)
    proposals: dict[str, Proposal]     # drafter name -> its draft at N


@torch.inference_mode()
def replay_drafts(engine, proposers: dict[str, Proposer], tokens: list[int], features: torch.Tensor, first: int,
                  last: int) -> Iterator[ReplayState]:
    """Every proposer's draft at each state N in [first, last), in order, on one scratch Sequence.

    `features` [>= last, F] are the target's captured features of `tokens` (capture_output(...).captured or the
    training data's); each state commits up to N, catches every proposer up and lets it propose."""
    if not 0 < first <= last < len(tokens):
        raise ValueError(f"states [{first}, {last}) need 0 < first <= last < len(tokens) = {len(tokens)}")
    dtype = engine.target.dtype
    per_round = max((p.max_tree_tokens() + p.scratch_slots() for p in proposers.values()), default=0) + 1
    with engine.scratch_sequence(tokens[:first], len(tokens) + per_round) as seq:
        seq.commit(tokens[:first], tokens[first], features[:first].to(dtype), {name: 0 for name in proposers})
        for n in range(first, last):
            if n > seq.num_committed:
                seq.commit(tokens[seq.num_committed:n], tokens[n], features[seq.num_committed:n].to(dtype),
                           dict(seq.frontiers))
            frontiers = {name: p.catch_up(seq) for name, p in proposers.items()}
            proposals = {name: p.propose(seq) for name, p in proposers.items()}
            seq.frontiers.update(frontiers)
            yield ReplayState(n, seq, proposals)


def accepted_at(engine, proposers: dict[str, Proposer], tokens: list[int], features: torch.Tensor, first: int,
                last: int) -> dict[str, list[int]]:
    """drafter name -> [accepted drafts at N for N in [first, last)] against the continuation in `tokens`."""
    out: dict[str, list[int]] = {name: [] for name in proposers}
    for state in replay_drafts(engine, proposers, tokens, features, first, last):
        for name, proposal in state.proposals.items():
            out[name].append(num_accepted(proposal.tree, tokens[state.position + 1:]))
    return out
