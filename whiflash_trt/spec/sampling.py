"""Turning target logits into the distribution tokens are drawn from (temperature, top-k, top-p), and the one sampler
of the target's own next token (runtime prefill, training data generation)."""
from __future__ import annotations

import torch

from whiflash_trt.config import SamplingConfig


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] fp32 probabilities after temperature, top-k and top-p filtering.

    Speculative verification must accept against exactly this distribution, so it is the single definition.
    """
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= sampling.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """The target's own next token from [vocab] logits: the argmax (greedy) or one draw from target_probs, the same
    token (and the same generator draws) that verification emits as the bonus of an empty draft."""
    if sampling.greedy:
        return int(logits.argmax(-1))
    return int(torch.multinomial(target_probs(logits, sampling), 1, generator=generator))
