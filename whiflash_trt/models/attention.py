"""Row-invariant attention: a query row's output depends only on its query and its visible keys in logical order.

Greedy speculative decoding gives exactly the target-only text only if a row computed inside a T-token verify equals,
bit for bit, the same row computed in a 1-token step; otherwise near-ties of the top-2 logits flip. CPU SDPA picks
its key split from the key count and treats one query differently from many, so its rows change in the last bits
with the shape of the call. Here every reduction a row takes part in has a shape fixed by that row alone:
- a row's visible keys are laid out in logical order (a tree node: the context, then its ancestors, then itself,
  exactly the keys a chain gives that position) in chunks of CHUNK keys, the last one padded with masked keys;
- scores q.k and each chunk's sums of p.v and p are fp32 GEMMs of at least MIN_ROWS rows (a one-row GEMM takes a
  GEMV path that sums in another order; from MIN_ROWS rows up a row does not depend on the row count);
- the softmax max is over all visible keys (a max is exact in any order), so chunks need no online rescaling;
- chunk sums are added strictly in chunk order (cumsum), so the fully masked chunks of a longer call add exact zeros.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

CHUNK = 64       # keys per chunk: every chunk reduction has this length
ROW_BLOCK = 128  # query rows per pass over the keys (bounds the score memory of a long prefill)
# MKL's fp32 GEMM sums a row of q.k^T (keys stored [S, D]) alike for any row count from 3 up, and a row of p.v from
# 2 up; fewer rows take other paths (measured; tests/test_row_invariance.py holds it).
MIN_ROWS = 3


@dataclass
class RowBlock:
    """Query rows [start, end) and where their visible keys sit; the fp32 K/V buffers are filled by each layer."""
    start: int
    end: int
    bias: torch.Tensor         # [rows * group, S_pad] fp32: 0 where logical key j of the row exists, else -inf
    shared: int                # logical keys [0, shared) are read keys [0, shared) for every row (multiple of CHUNK)
    tail: torch.Tensor | None  # [rows, S_pad - shared] read-key index of the later logical keys; None: read order
    tail_scores: torch.Tensor | None  # tail per score row, [rows * group, S_pad - shared]
    buffers: dict = field(default_factory=dict)  # "k", "v": [kv_heads, width, head_dim] fp32, zero past the keys


@dataclass
class KeyOrder:
    """Built once per forward from the [T, S] mask; every layer's attention reads it."""
    blocks: list[RowBlock]
    group: int  # query heads per KV head


def key_order(attn_mask: torch.Tensor, group: int) -> KeyOrder:
    """attn_mask [T, S] bool over the read keys, which are in logical order for every row (True = may attend)."""
    t, s = attn_mask.shape
    dev = attn_mask.device
    lengths = attn_mask.sum(-1)  # [T]
    read_index = torch.arange(s, device=dev)
    order = shared_all = None
    if not torch.equal(attn_mask, read_index < lengths[:, None]):
        # A tree: each row's visible keys first, in read order (a stable sort keeps it).
        order = torch.sort((~attn_mask).to(torch.uint8), dim=-1, stable=True).indices  # [T, S]
        same = (order == read_index) & (read_index < lengths[:, None])
        shared_all = int(same.int().cumprod(-1).sum(-1).min()) // CHUNK * CHUNK
    blocks = []
    for start in range(0, t, ROW_BLOCK):
        end = min(start + ROW_BLOCK, t)
        rows = lengths[start:end]
        s_pad = -(-int(rows.max()) // CHUNK) * CHUNK
        bias = torch.zeros(end - start, s_pad, device=dev)
        bias.masked_fill_(torch.arange(s_pad, device=dev) >= rows[:, None], float("-inf"))
        bias = bias.repeat_interleave(group, 0)
        if order is None:  # every row sees a prefix of the read keys (prefill, decode, chain)
            blocks.append(RowBlock(start, end, bias, s_pad, None, None))
            continue
        shared = min(shared_all, s_pad)
        tail = order[start:end, shared:s_pad]
        if tail.shape[1] < s_pad - shared:  # logical slots past the last read key: masked, any key will do
            tail = torch.nn.functional.pad(tail, (0, s_pad - shared - tail.shape[1]))
        blocks.append(RowBlock(start, end, bias, shared, tail, tail.repeat_interleave(group, 0)))
    return KeyOrder(blocks, group)


def row_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: KeyOrder,
                            scale: float) -> torch.Tensor:
    """q [T, heads, D]; k, v [S, kv_heads, D] read keys (after RoPE); -> [T, heads * D] in q's dtype."""
    t, heads, d = q.shape
    kv_heads, group = k.shape[1], keys.group
    # [kv_heads, T * group, D] fp32, rows ordered (token, head within the group)
    qf = torch.empty(kv_heads, t, group, d, device=q.device)
    qf.copy_(q.view(t, kv_heads, group, d).transpose(0, 1)).mul_(scale)
    qf = qf.view(kv_heads, t * group, d)
    out = torch.empty(t, kv_heads, group, d, dtype=q.dtype, device=q.device)
    for blk in keys.blocks:
        o = _attend(qf[:, blk.start * group:blk.end * group], k, v, blk)  # [kv, rows * group, D]
        out[blk.start:blk.end].copy_(o.view(kv_heads, -1, group, d).transpose(0, 1))
    return out.view(t, heads * d)


def _fp32_buffer(x: torch.Tensor, blk: RowBlock, name: str) -> torch.Tensor:
    """x [S, kv, D] -> the block's [kv, width, D] fp32 buffer of the keys it reads, zero past them. The "v" buffer
    has one more column of ones: the p.v GEMM then also sums p (the softmax denominator) in the same order."""
    s = x.shape[0] if blk.tail is not None else min(x.shape[0], blk.bias.shape[1])
    buf = blk.buffers.get(name)
    if buf is None:
        width = max(blk.bias.shape[1], -(-s // CHUNK) * CHUNK)
        buf = x.new_zeros(x.shape[1], width, x.shape[2] + (name == "v"), dtype=torch.float32)
        if name == "v":
            buf[..., -1] = 1
        blk.buffers[name] = buf
    buf[:, :s, :x.shape[2]].copy_(x[:s].transpose(0, 1))
    return buf


def _attend(qf: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blk: RowBlock) -> torch.Tensor:
    """qf [kv, M, D] (M = rows * group, scaled) -> [kv, M, D] fp32."""
    kv, m, d = qf.shape
    s, s_pad = k.shape[0], blk.bias.shape[1]
    kf, vf = _fp32_buffer(k, blk, "k"), _fp32_buffer(v, blk, "v")  # [kv, width, D], [kv, width, D + 1]
    chunks, shared_chunks = s_pad // CHUNK, blk.shared // CHUNK
    if blk.tail is None:
        scores = _mm(qf, kf[:, :s_pad].transpose(1, 2), blk.bias)  # [kv, M, S_pad]
    else:
        # score every read key once, then pick each row's own logical order
        every = _mm(qf, kf[:, :s].transpose(1, 2))  # [kv, M, S]
        late = every.gather(-1, blk.tail_scores.expand(kv, -1, -1))
        scores = torch.cat([every[..., :blk.shared], late], -1).add_(blk.bias)
    p = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # [kv, M, S_pad]; masked keys give exact zeros
    p = p.view(kv, m, chunks, CHUNK).transpose(1, 2)  # [kv, chunks, M, CHUNK]
    # per chunk: [sum of p.v, sum of p]
    parts = _mm(p[:, :shared_chunks], vf[:, :blk.shared].view(kv, shared_chunks, CHUNK, d + 1))
    if blk.tail is not None:
        rows, tail_chunks = blk.tail.shape[0], chunks - shared_chunks
        v_rows = vf[:, blk.tail].view(kv, rows, tail_chunks, CHUNK, d + 1)  # each row's own later values
        p_rows = p[:, shared_chunks:].reshape(kv, tail_chunks, rows, m // rows, CHUNK).transpose(1, 2)
        late = _mm(p_rows, v_rows)  # [kv, rows, tail chunks, group, D + 1]
        parts = torch.cat([parts, late.transpose(1, 2).reshape(kv, tail_chunks, m, d + 1)], 1)
    total = parts.cumsum(1)[:, -1]  # chunk sums added in chunk order: [kv, M, D + 1]
    return total[..., :d] / total[..., d:]


def _mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """bias + a @ b with at least MIN_ROWS rows, so each row is summed as in any larger call."""
    rows = a.shape[-2]
    if rows < MIN_ROWS:
        a = torch.cat([a] + [a[..., :1, :]] * (MIN_ROWS - rows), -2)
        bias = None if bias is None else torch.cat([bias] + [bias[..., :1, :]] * (MIN_ROWS - rows), -2)
    out = a @ b if bias is None else torch.baddbmm(bias, a, b)
    return out if rows >= MIN_ROWS else out[..., :rows, :]
