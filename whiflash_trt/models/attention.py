"""Row-invariant attention: a query row's output depends only on its query and its visible keys in logical order.

Greedy speculative decoding gives exactly the target-only text only if a row computed inside a T-token verify equals,
bit for bit, the same row computed in a 1-token step; otherwise near-ties of the top-2 logits flip. CPU SDPA picks
its key split from the key count and treats one query differently from many, so its rows change in the last bits
with the shape of the call. Here every reduction a row takes part in has a shape fixed by that row alone:
- a row's visible keys are laid out in logical order (a tree node: the context, then its ancestors, then itself,
  exactly the keys a chain gives that position) in chunks of CHUNK keys, the last one padded with masked keys;
- scores q.k and each chunk's sums of p.v and p are batches of fp32 GEMMs of exactly GEMM_ROWS rows (MKL sums a row
  in an order that depends on the row count: on the Intel Xeon a 1-row GEMM differs, on an AMD EPYC Zen 4 a 4-row
  or larger one; a batched GEMM sums each slice as the lone GEMM does, so a row's bits are fixed);
- the softmax max is over all visible keys (a max is exact in any order), so chunks need no online rescaling;
- chunk sums are added strictly in chunk order (cumsum), so the fully masked chunks of a longer call add exact zeros.

A call may hold several sequences (segments, models.contracts.Segment): each row sees only its own segment's keys.
Segments with similar row counts are attended as one batch: every GEMM above is then batched over the sequences and
KV heads, and a batched GEMM sums each slice as the lone GEMM does, so a sequence's rows do not depend on the other
sequences of the call either (tests/test_row_invariance.py holds both).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whiflash_trt import kernels
from whiflash_trt.models.contracts import Segment
from whiflash_trt.models.layers import apply_rope, attention

CHUNK = 64       # keys per chunk: every chunk reduction has this length
ROW_BLOCK = 128  # query rows per pass over the keys (bounds the score memory of a long prefill)
# Rows of every fp32 GEMM here: MKL sums a row of q.k^T (keys stored [S, D]) and of p.v alike at 3 rows on every CPU
# we measured (the Xeon: from 3 up; the EPYC: 1 to 3); tests/test_row_invariance.py holds it.
GEMM_ROWS = 3
V_EXTRA = 16     # columns after the values: the ones that sum p, then zeros (a p.v width of D + 16)


@dataclass(frozen=True)
class AttentionContext:
    """One step's attention inputs, built once per forward and passed to every layer: the new rows' rotary angles,
    the pool slots their K/V go to, what each row reads (`keys`, whose kind says how: RowKeys on the engine's kernel,
    KeyLayout on torch, GraphKeys in an exported graph, dflash.BlockReads for DFlash's torch blocks) and every
    layer's pools."""
    cos: torch.Tensor                  # [T, 1, D] (broadcast over heads)
    sin: torch.Tensor
    write_slots: torch.Tensor | None   # [T]; None: the step writes no pool (BlockReads)
    keys: KeyLayout | RowKeys | GraphKeys   # or dflash.BlockReads
    k_cache: torch.Tensor              # [L, slots, kv, D]
    v_cache: torch.Tensor

    @staticmethod
    def at(rotary, positions, dtype, write_slots, keys, k_cache, v_cache) -> AttentionContext:
        """The context of rows at `positions` [T]: `rotary`'s (a layers.RotaryTable) angles there in `dtype`."""
        return AttentionContext(*rotary(positions, dtype), write_slots, keys, k_cache, v_cache)

    def attend(self, q, k, v, layer: int, scale: float) -> torch.Tensor:
        """q [T, heads, D], k and v [T, kv, D] (not rotated) -> [T, heads * D], layer `layer`'s K/V written (or,
        in a graph, kept)."""
        return self.keys.attend(q, k, v, self, layer, scale)


@dataclass
class RowBlock:
    """Query rows [lo, hi) of B segments, padded to R rows each, and where their visible keys sit."""
    q_rows: torch.Tensor      # [B, R] row of the call for each query; padding repeats the segment's first row here
    out_index: torch.Tensor   # [n] the real queries among the B * R
    out_rows: torch.Tensor    # [n] their rows in the call
    slots: torch.Tensor       # [B, W] pool slots of each segment's read keys in read order; padding repeats its first
    bias: torch.Tensor        # [B, 1, R * group, S_pad] fp32: 0 where logical key j of the row exists, else -inf
    shared: int               # logical keys [0, shared) are read keys [0, shared) for every row (multiple of CHUNK)
    tail: torch.Tensor | None  # [B, R, S_pad - shared] read-key index of the later logical keys; None: read order
    tail_scores: torch.Tensor | None  # tail per score row, [B, 1, R * group, S_pad - shared]
    buffers: dict = field(default_factory=dict)  # "k", "v": [B, kv_heads, W, head_dim (v: + V_EXTRA)] fp32, per layer


@dataclass
class KeyLayout:
    """Built once per forward from the segments; every layer's attention reads it."""
    blocks: list[RowBlock]
    group: int  # query heads per KV head

    def attend(self, q, k, v, ctx: AttentionContext, layer: int, scale: float) -> torch.Tensor:
        """Rotates q [T, heads, D] and k [T, kv, D] (apply_rope at ctx.cos, ctx.sin), writes k, v at ctx.write_slots
        of layer `layer` of the pools [L, slots, kv, D], then attends q -> [T, heads * D]."""
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        ctx.k_cache[layer].index_copy_(0, ctx.write_slots, k)
        ctx.v_cache[layer].index_copy_(0, ctx.write_slots, v)
        return row_invariant_attention(q, ctx.k_cache[layer], ctx.v_cache[layer], self, scale)


@dataclass
class RowKeys:
    """Each row's visible keys as pool slots in logical order, for the engine's attention kernel
    (whiflash_trt/kernels/paged_attention.cpp, row-invariant by construction)."""
    slots: torch.Tensor    # [T, W] int64; row t reads slots[t, :lengths[t]]
    lengths: torch.Tensor  # [T] int64

    def attend(self, q, k, v, ctx: AttentionContext, layer: int, scale: float) -> torch.Tensor:
        """KeyLayout.attend on the kernel, which rotates q and k itself (kernels.paged_attention)."""
        return kernels.paged_attention(q, k, v, ctx.k_cache, ctx.v_cache, layer, ctx.write_slots, self.slots,
                                       self.lengths, scale, ctx.cos, ctx.sin)


@dataclass
class GraphKeys:
    """Each row's keys for an exported graph (ONNX), which cannot write its inputs: the pools read at read_slots [S]
    (logical order) as a torch step sees them after its own writes (a read slot that is also a write slot shows the
    new token's K/V), attended through SDPA under a [T, S] mask; every layer's new K/V are kept (k_new, v_new) for
    the caller to scatter into the pools."""
    mask: torch.Tensor    # [T, S] bool
    fresh: torch.Tensor   # [S, 1, 1] bool: read slot s is written by this step
    source: torch.Tensor  # [S] the new row that writes read slot s (where fresh)
    k: torch.Tensor       # [L, S, kv, D] the pools at read_slots before this step
    v: torch.Tensor
    k_new: list = field(default_factory=list)   # per layer, [T, kv, D] (k after RoPE)
    v_new: list = field(default_factory=list)

    @staticmethod
    def overlay(k_cache, v_cache, write_slots, read_slots, mask) -> GraphKeys:
        hit = read_slots[:, None] == write_slots[None, :]                                # [S, T]
        source = (hit * torch.arange(write_slots.shape[0])[None, :]).sum(-1)
        return GraphKeys(mask, hit.any(-1)[:, None, None], source, k_cache.index_select(1, read_slots),
                         v_cache.index_select(1, read_slots))

    def attend(self, q, k, v, ctx: AttentionContext, layer: int, scale: float) -> torch.Tensor:
        """KeyLayout.attend without the pool write (the overlay holds what the step reads of the pools)."""
        q, k = apply_rope(q, ctx.cos, ctx.sin), apply_rope(k, ctx.cos, ctx.sin)
        self.k_new.append(k)
        self.v_new.append(v)
        k_read = torch.where(self.fresh, k.index_select(0, self.source), self.k[layer])
        v_read = torch.where(self.fresh, v.index_select(0, self.source), self.v[layer])
        return attention(q, k_read, v_read, self.mask, scale)


def attention_keys(segments: list[Segment], group: int, use_kernel: bool) -> KeyLayout | RowKeys:
    """What every layer's attention of one forward reads: RowKeys for the kernel (`use_kernel`: the model's
    kernel_attention, set where the kernels are loaded), else the torch attention's KeyLayout."""
    return row_keys(segments) if use_kernel else key_layout(segments, group)


def row_keys(segments: list[Segment]) -> RowKeys:
    """A row's visible keys in read order: the context, then (a tree node) its ancestors, then itself, exactly the
    keys a chain gives that position. A segment's layout (order, lengths) is taken as it is; a mask alone is
    ordered here."""
    slots, lengths = [], []
    for seg in segments:
        rows = seg.rows
        if seg.order is not None:   # laid out by the caller
            slots.append(seg.read_slots[seg.order])
            lengths.append(seg.lengths if seg.lengths is not None
                           else torch.full((rows,), seg.order.shape[1], device=seg.order.device))
            continue
        if seg.lengths is not None:   # prefixes of the read keys
            slots.append(seg.read_slots.expand(rows, -1))
            lengths.append(seg.lengths)
            continue
        width = seg.mask.shape[1]
        count = seg.mask.sum(-1)
        if torch.equal(seg.mask, torch.arange(width, device=seg.mask.device) < count[:, None]):
            slots.append(seg.read_slots.expand(rows, width))  # prefill, decode, chain: a prefix of the read keys
        else:
            order = torch.sort((~seg.mask).to(torch.uint8), dim=-1, stable=True).indices
            slots.append(seg.read_slots[order])
        lengths.append(count)
    if len(slots) == 1:
        return RowKeys(slots[0], lengths[0])
    width = max(s.shape[1] for s in slots)
    padded = [torch.nn.functional.pad(s, (0, width - s.shape[1])) for s in slots]  # slot 0 past a row's length
    return RowKeys(torch.cat(padded), torch.cat(lengths))


def key_layout(segments: list[Segment], group: int) -> KeyLayout:
    """Segments of more than ROW_BLOCK rows (prefills) in blocks of their own; the others batched by row count (the
    next power of two), so a batch pads few rows, and trees also by key chunks, so their rows' own key orders start
    at about the same chunk."""
    first, blocks, buckets = 0, [], {}
    for seg in segments:
        mask = seg.visible()
        seg = Segment(seg.read_slots, mask)   # the blocks below read the mask
        rows, keys = mask.shape
        if rows > ROW_BLOCK:
            blocks += [_row_block([seg], [first], lo, group) for lo in range(0, rows, ROW_BLOCK)]
        else:
            prefix = torch.equal(mask, torch.arange(keys, device=mask.device) < mask.sum(-1)[:, None])
            key = (1 << (rows - 1).bit_length(), 0 if prefix else -(-keys // CHUNK))
            buckets.setdefault(key, []).append((seg, first))
        first += rows
    for members in buckets.values():
        blocks.append(_row_block([s for s, _ in members], [f for _, f in members], 0, group))
    return KeyLayout(blocks, group)


def _row_block(segments: list[Segment], firsts: list[int], lo: int, group: int) -> RowBlock:
    dev = segments[0].mask.device
    counts = torch.tensor([min(seg.mask.shape[0] - lo, ROW_BLOCK) for seg in segments], device=dev)
    b, r = len(segments), int(counts.max())
    w = max(seg.read_slots.numel() for seg in segments)
    mask = torch.zeros(b, r, w, dtype=torch.bool, device=dev)
    slots = torch.empty(b, w, dtype=torch.long, device=dev)
    q_rows = torch.empty(b, r, dtype=torch.long, device=dev)
    for i, (seg, first) in enumerate(zip(segments, firsts)):
        n, s = int(counts[i]), seg.read_slots.numel()
        mask[i, :n, :s] = seg.mask[lo:lo + n]
        mask[i, n:, :s] = seg.mask[lo]
        slots[i, :s], slots[i, s:] = seg.read_slots, seg.read_slots[0]
        q_rows[i, :n], q_rows[i, n:] = torch.arange(first + lo, first + lo + n, device=dev), first + lo
    out_index = (torch.arange(r, device=dev) < counts[:, None]).flatten().nonzero()[:, 0]
    lengths = mask.sum(-1)  # [B, R]
    s_pad = -(-int(lengths.max()) // CHUNK) * CHUNK
    width = max(s_pad, -(-w // CHUNK) * CHUNK)
    slots = torch.cat([slots, slots[:, :1].expand(b, width - w)], 1)
    logical = torch.arange(s_pad, device=dev)
    bias = torch.zeros(b, r, s_pad, device=dev).masked_fill_(logical >= lengths[..., None], float("-inf"))
    block = RowBlock(q_rows, out_index, q_rows.flatten()[out_index], slots,
                     bias.repeat_interleave(group, 1)[:, None], s_pad, None, None)
    if torch.equal(mask, torch.arange(w, device=dev) < lengths[..., None]):
        return block  # every row sees a prefix of its read keys (prefill, decode, chain)
    # A tree: each row's visible keys first, in read order (a stable sort keeps it).
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices[..., :s_pad]
    order = torch.nn.functional.pad(order, (0, s_pad - order.shape[-1]))  # past the read keys: masked, any key
    same = (order == logical) & (logical < lengths[..., None])
    block.shared = int(same.int().cumprod(-1).sum(-1).min()) // CHUNK * CHUNK
    block.tail = order[..., block.shared:]
    block.tail_scores = block.tail.repeat_interleave(group, 1)[:, None]
    return block


def row_invariant_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, keys: KeyLayout,
                            scale: float) -> torch.Tensor:
    """q [T, heads, D]; k_pool, v_pool [slots, kv_heads, D] one layer's pool (the new K/V written; after RoPE)
    -> [T, heads * D] in q's dtype."""
    t, heads, d = q.shape
    kv_heads, group = k_pool.shape[1], keys.group
    out = torch.empty(t, heads * d, dtype=q.dtype, device=q.device)
    for blk in keys.blocks:
        b, r = blk.q_rows.shape
        # [B, kv_heads, R * group, D] fp32, rows ordered (token, head within the group)
        qf = torch.empty(b, kv_heads, r, group, d, device=q.device)
        qf.copy_(q[blk.q_rows.flatten()].view(b, r, kv_heads, group, d).transpose(1, 2)).mul_(scale)
        o = _attend(qf.view(b, kv_heads, r * group, d), _fp32_buffer(k_pool, blk, "k"), _fp32_buffer(v_pool, blk, "v"),
                    blk)
        o = o.view(b, kv_heads, r, group, d).transpose(1, 2).reshape(b * r, heads * d)
        out[blk.out_rows] = o[blk.out_index].to(q.dtype)
    return out


def _fp32_buffer(pool: torch.Tensor, blk: RowBlock, name: str) -> torch.Tensor:
    """The block's read keys -> [B, kv, W, D] fp32. The "v" buffer has V_EXTRA more columns, a column of ones and
    zeros: the p.v GEMM then also sums p (the softmax denominator) in the same order, over a width that is a multiple
    of 16 (at other widths MKL on the EPYC sums a row by its place in the call)."""
    b, w = blk.slots.shape
    kv, d = pool.shape[1:]
    buf = blk.buffers.get(name)
    if buf is None:
        buf = pool.new_zeros(b, kv, w, d + (V_EXTRA if name == "v" else 0), dtype=torch.float32)
        if name == "v":
            buf[..., d] = 1
        blk.buffers[name] = buf
    buf[..., :d].copy_(pool.index_select(0, blk.slots.flatten()).view(b, w, kv, d).transpose(1, 2))
    return buf


def _attend(qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor, blk: RowBlock) -> torch.Tensor:
    """qf [B, kv, M, D] (M = rows * group, scaled); kf [B, kv, W, D]; vf [B, kv, W, D + V_EXTRA]
    -> [B, kv, M, D] fp32."""
    b, kv, m, d = qf.shape
    s_pad = blk.bias.shape[-1]
    chunks, shared_chunks = s_pad // CHUNK, blk.shared // CHUNK
    if blk.tail is None:
        scores = _mm(qf, kf[:, :, :s_pad].transpose(-1, -2)).add_(blk.bias)  # [B, kv, M, S_pad]
    else:  # score every read key once, then pick each row's own logical order
        every = _mm(qf, kf.transpose(-1, -2))  # [B, kv, M, W]
        late = every.gather(-1, blk.tail_scores.expand(-1, kv, -1, -1))
        scores = torch.cat([every[..., :blk.shared], late], -1).add_(blk.bias)
    p = scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # masked keys give exact zeros
    p = p.unflatten(-1, (chunks, CHUNK)).transpose(2, 3)  # [B, kv, chunks, M, CHUNK]
    # per chunk: [sum of p.v, sum of p]
    parts = _mm(p[:, :, :shared_chunks], vf[:, :, :blk.shared].unflatten(2, (shared_chunks, CHUNK)))
    if blk.tail is not None:  # each row's own later values
        rows, tail_chunks = blk.tail.shape[1], chunks - shared_chunks
        seg = torch.arange(b, device=qf.device)[:, None, None]
        v_rows = vf.transpose(1, 2)[seg, blk.tail].permute(0, 3, 1, 2, 4)  # [B, kv, R, S_pad - shared, D + V_EXTRA]
        v_rows = v_rows.unflatten(3, (tail_chunks, CHUNK))
        p_rows = p[:, :, shared_chunks:].unflatten(3, (rows, m // rows)).transpose(2, 3)  # [B, kv, R, tail, group, C]
        late = _mm(p_rows, v_rows)  # [B, kv, R, tail chunks, group, D + V_EXTRA]
        parts = torch.cat([parts, late.transpose(2, 3).flatten(3, 4)], 2)
    total = parts.cumsum(2)[:, :, -1]  # chunk sums added in chunk order: [B, kv, M, D + V_EXTRA]
    return total[..., :d] / total[..., d:d + 1]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as a batch of GEMM_ROWS-row GEMMs (the last one padded with copies of a's first row), so each row is
    summed alike whatever the row count. b is made contiguous: the EPYC's MKL sums a batch over a transposed b by
    the batch's size."""
    rows, b = a.shape[-2], b.contiguous()
    pad = -rows % GEMM_ROWS
    if pad:
        a = torch.cat([a, a[..., :1, :].expand(*a.shape[:-2], pad, a.shape[-1])], -2)
    out = a.unflatten(-2, (-1, GEMM_ROWS)) @ b.unsqueeze(-3)
    return out.flatten(-3, -2)[..., :rows, :]
