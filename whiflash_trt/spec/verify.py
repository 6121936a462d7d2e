"""Verification of a draft tree against the target, greedy and lossless sampling: pure functions of tensors.

Sampling rule for deterministic drafts (point-mass proposals): at a node with target distribution p, try the children
in draft order; accept child x with probability p(x); on rejection set p(x) = 0 and renormalise; when no child is
accepted, draw the bonus token from what is left. The emitted token at every step is then distributed exactly as p.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from whiflash_trt.spec.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    path: list[int]      # accepted tree nodes, root (0) first; len(path) - 1 drafts accepted
    tokens: list[int]    # committed this round: root token + accepted drafts
    bonus: int           # the target's own token after the accepted path (pending next round)

    @property
    def num_accepted(self) -> int:
        return len(self.path) - 1


def verify_greedy(tree: DraftTree, logits: torch.Tensor, choice: list[int] | None = None) -> Verdict:
    """logits: [T, vocab] target logits at every tree node; `choice`: their argmax per node where the caller has it
    already (the engine's kernel)."""
    if choice is None:
        choice = logits.float().argmax(-1).tolist()   # the same index as bf16's argmax (exact), 2x faster
    kids = tree.children()
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in kids[node] if tree.tokens[c] == choice[node]), None)
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path], choice[node])
        path.append(nxt)


def verify_sampling(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """probs: [T, vocab] target distributions (after temperature/top-k/top-p) at every tree node."""
    kids = tree.children()
    path = [0]
    while True:
        node = path[-1]
        p = probs[node].clone()
        accepted = None
        for c in kids[node]:
            x = tree.tokens[c]
            u = torch.rand((), generator=generator, device=p.device)
            if u < p[x]:
                accepted = c
                break
            p[x] = 0.0
            total = p.sum()
            if total <= 0:
                break
            p = p / total
        if accepted is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, [tree.tokens[i] for i in path], bonus)
        path.append(accepted)
