"""Batched self-distillation decoding: many sequences advance one token per target step.

The runtime decodes one request at a time; for training data we want throughput. Each of `lanes` sequences owns a
contiguous row of a dense KV cache [layers, lanes, kv_heads, max_len, head_dim]; one step feeds one new token per
active lane (a prompt is prefilled alone in its lane), with padded attention masked per lane. The target's own
modules and weights are used (its layers' projections, norms and MLPs; only the attention over the dense lane cache
is this module's), so tokens and captured features are the target's (same dtype as the runtime).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whiflash_trt.config import SamplingConfig
from whiflash_trt.models.target import TargetModel
from whiflash_trt.spec import sampling


@dataclass
class Lane:
    index: int
    tokens: list[int] = field(default_factory=list)   # prompt + response fed so far (positions 0..len-1)
    feats: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    prompt_len: int = 0
    next_token: int | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class Finished:
    tokens: list[int]            # [T] fed tokens (prompt + response, the final sampled token dropped)
    prompt_len: int
    features: torch.Tensor       # [T, len(capture) * H] captured target layer outputs
    hidden: torch.Tensor         # [T, H] final-norm hidden (logits = lm_head(hidden) predict the next token)
    meta: dict


def _attention(attn, x, cos, sin, k_cache, v_cache, lanes, positions, lengths_after):
    """x [B, T, H]; positions [B, T]; k/v_cache [lanes, kv, max_len, D] of this layer; writes then attends."""
    b, t, _ = x.shape
    nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.project(x, cos, sin)   # [B, T, heads or kv_heads, D]
    k_cache[lanes[:, None], :, positions] = k.to(k_cache.dtype)     # cache [lanes, kv, max_len, D]; indexed result [B, T, kv, D]
    v_cache[lanes[:, None], :, positions] = v.to(v_cache.dtype)
    s = int(lengths_after.max())
    if lanes.numel() == k_cache.shape[0] and bool((lanes == torch.arange(lanes.numel())).all()):
        keys, vals = k_cache[:, :, :s], v_cache[:, :, :s]     # every lane, in order: a view, no gather
    else:
        keys, vals = k_cache[lanes, :, :s], v_cache[lanes, :, :s]   # [B, kv, S, D]
    mask = torch.arange(s, device=x.device)[None, None, :] <= positions[:, :, None]  # [B, T, S]
    # Plain batched matmuls: CPU SDPA with a mask is ~30x slower for these short-query shapes.
    rep = nh // nkv
    qg = q.view(b, t, nkv, rep, hd).permute(0, 2, 3, 1, 4).reshape(b, nkv, rep * t, hd).to(keys.dtype)
    scores = (qg @ keys.transpose(-1, -2)) * attn.scale                            # [B, kv, rep*T, S]
    scores = scores.view(b, nkv, rep, t, s).masked_fill(~mask[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, nkv, rep * t, s)
    out = (probs @ vals).view(b, nkv, rep, t, hd).permute(0, 3, 1, 2, 4)                  # [B, T, kv, rep, D]
    return attn.o_proj(out.reshape(b, t, nh * hd).to(x.dtype))


@torch.inference_mode()
def batched_forward(model: TargetModel, ids: torch.Tensor, positions: torch.Tensor, k_cache, v_cache,
                    lanes: torch.Tensor, capture: tuple[int, ...]):
    """ids/positions [B, T] -> (final-norm hidden [B, T, H], captured [B, T, len(capture) * H])."""
    x = model.embed_tokens(ids)
    cos, sin = model.rotary(positions.flatten(), x.dtype)
    cos, sin = cos.view(*ids.shape, 1, -1), sin.view(*ids.shape, 1, -1)
    lengths_after = positions[:, -1] + 1
    captured = {}
    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        x = x + _attention(layer.self_attn, h, cos, sin, k_cache[i], v_cache[i], lanes, positions, lengths_after)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in capture:
            captured[i] = x
    return model.norm(x), torch.cat([captured[i] for i in capture], dim=-1)


class BatchedGenerator:
    def __init__(self, model: TargetModel, capture: tuple[int, ...], lanes: int, max_len: int,
                 eos_ids: tuple[int, ...]) -> None:
        cfg = model.config
        # fp32 cache: CPU bf16 batched matmuls copy their operands; K/V values are the bf16 model's, widened
        shape = (cfg.num_layers, lanes, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k, self.v = torch.zeros(shape), torch.zeros(shape)
        self.model, self.capture, self.max_len, self.eos = model, tuple(capture), max_len, set(eos_ids)
        self.free = list(range(lanes))[::-1]
        self.active: list[Lane] = []

    def add(self, prompt_ids: list[int], meta: dict, generator: torch.Generator) -> None:
        lane = Lane(self.free.pop(), prompt_len=len(prompt_ids), meta=meta)
        ids = torch.tensor([prompt_ids])
        pos = torch.arange(len(prompt_ids))[None]
        hidden, feats = batched_forward(self.model, ids, pos, self.k, self.v, torch.tensor([lane.index]),
                                        self.capture)
        lane.tokens, lane.feats, lane.hidden = list(prompt_ids), [feats[0]], [hidden[0]]
        logits = self.model.lm_head(hidden[0, -1:])
        lane.next_token = sampling.next_token(logits[0], SamplingConfig(meta.get("temperature", 0.0)), generator)
        self.active.append(lane)

    def drain(self) -> list[Finished]:
        """End every active sequence where it is (a truncated response is still the target's own text)."""
        out = []
        for ln in self.active:
            feats, hidden = torch.cat(ln.feats), torch.cat(ln.hidden)
            n = min(len(ln.tokens), feats.shape[0], hidden.shape[0])   # an interrupted step may be half-recorded
            if n > ln.prompt_len:
                out.append(Finished(ln.tokens[:n], ln.prompt_len, feats[:n], hidden[:n], ln.meta | {"truncated": True}))
        self.free += [ln.index for ln in self.active]
        self.active = []
        return out

    def step(self, max_new_tokens: int, generator: torch.Generator) -> list[Finished]:
        """Feed every active lane's pending token; return the sequences that finished."""
        lanes = self.active = sorted(self.active, key=lambda ln: ln.index)   # all lanes busy -> a cache view
        ids = torch.tensor([[ln.next_token] for ln in lanes])
        pos = torch.tensor([[len(ln.tokens)] for ln in lanes])
        hidden, feats = batched_forward(self.model, ids, pos, self.k, self.v, torch.tensor([ln.index for ln in lanes]),
                                        self.capture)
        logits = self.model.lm_head(hidden[:, 0])
        done, keep = [], []
        for j, lane in enumerate(lanes):
            lane.tokens.append(lane.next_token)
            lane.feats.append(feats[j])
            lane.hidden.append(hidden[j])
            temperature = SamplingConfig(lane.meta.get("temperature", 0.0))
            lane.next_token = sampling.next_token(logits[j], temperature, generator)
            new = len(lane.tokens) - lane.prompt_len
            if lane.tokens[-1] in self.eos or new >= max_new_tokens or len(lane.tokens) >= self.max_len:
                done.append(Finished(lane.tokens, lane.prompt_len, torch.cat(lane.feats), torch.cat(lane.hidden),
                                     lane.meta))
                self.free.append(lane.index)
            else:
                keep.append(lane)
        self.active = keep
        return done
