"""DFlash training: random anchors in the target's own response, blocks [x_a, MASK x (B-1)], same-position labels.

Per sequence: the context K/V of every layer come from hidden_norm(fc(F_t)) for all t (computed once); `anchors`
blocks are drafted in one forward with a block mask: a block at anchor a (positions a..a+B-1) sees the context
t < a and its own B tokens (bidirectional), nothing else. Slot k predicts x_{a+k} through the target's frozen
lm_head, weighted exp(-(k-1)/gamma). The anchor a is a bonus position of the runtime (a >= prompt length), so the
block's root token is the target's own token there. Labels are the target's greedy tokens given the true prefix
(the token itself inside a greedy response), so blocks anchored in the prompt (teacher forcing, lower weight) add
cheap training signal. Target embedding and lm_head stay frozen; the mask token has
no row in the target's table, so the drafter learns its own `mask_embedding`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from whiflash_trt.config import RopeConfig
from whiflash_trt.models.dflash import DFlashConfig, DFlashDrafter
from whiflash_trt.models.drafter_checkpoints import load_dflash, save_dflash
from whiflash_trt.models.layers import apply_rope
from whiflash_trt.models.target import TargetModel
from whiflash_trt.train.checkpointing import peek_extra
from whiflash_trt.train.data import SequenceData, TrainingData, choose_vocab, token_counts
from whiflash_trt.train.loop import LoopOptions, train_loop


@dataclass(frozen=True)
class DFlashOptions:
    num_layers: int = 3
    draft_block_len: int = 8
    gamma: float | None = None          # None: 7 * (B - 1) / 15 (gamma 7 for B = 16)
    anchors: int = 24                   # blocks per sequence per forward
    target_layer_ids: tuple[int, ...] | None = None   # None: the data's captured layers
    mask_token_id: int | None = None    # None: the target's vocab size (a row the target does not have)
    init_from_target: bool = True
    init_from: str | None = None        # a DFlash checkpoint to start from instead (same shape, or fewer layers)
    loss_vocab_size: int = 16384       # cross-entropy over the most frequent tokens only (CPU cost); 0 = all
    prompt_weight: float = 0.3         # loss weight of blocks anchored inside the prompt (teacher-forced labels)
    soft_labels: bool = False          # CE to the target's distribution (over the loss vocabulary) instead of its
                                       # greedy token

    def __post_init__(self) -> None:
        if self.draft_block_len < 2 or self.num_layers < 1 or self.anchors < 1:
            raise ValueError(f"need draft_block_len >= 2, num_layers >= 1, anchors >= 1; got {self.draft_block_len}, "
                             f"{self.num_layers}, {self.anchors}")

    @property
    def decay(self) -> float:
        return self.gamma if self.gamma is not None else 7.0 * (self.draft_block_len - 1) / 15.0


def make_drafter(target: TargetModel, layer_ids: tuple[int, ...], opts: DFlashOptions) -> DFlashDrafter:
    tc = target.config
    mask_id = opts.mask_token_id if opts.mask_token_id is not None else tc.vocab_size
    cfg = DFlashConfig(hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size, num_layers=opts.num_layers,
                       num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                       rms_norm_eps=tc.rms_norm_eps, vocab_size=tc.vocab_size,
                       max_position_embeddings=tc.max_position_embeddings, rope=RopeConfig(theta=tc.rope.theta),
                       draft_block_len=opts.draft_block_len, mask_token_id=mask_id, target_layer_ids=tuple(layer_ids))
    drafter = DFlashDrafter(cfg, tc.hidden_size, carries_mask_embedding=mask_id >= tc.vocab_size)
    if opts.init_from:
        _init_from_checkpoint(drafter, Path(opts.init_from), target)
    elif opts.init_from_target:
        _init_from_target(drafter, target)
    return drafter


@torch.no_grad()
def _init_from_checkpoint(drafter: DFlashDrafter, path: Path, target: TargetModel) -> None:
    """Warm start from a trained drafter (training it further on new data); its draft vocabulary is not kept: the
    run's own loss vocabulary is exported. A checkpoint with fewer layers grows: its layers come first, and each new
    layer after them starts from the target layer _init_from_target would give it with its output projections
    (o_proj, down_proj) zero, so it adds nothing to the residual stream and the grown drafter drafts exactly what the
    checkpoint did until training moves it."""
    source = load_dflash(path, target.config)
    mine, theirs = drafter.config, source.config
    same = ("draft_block_len", "target_layer_ids", "mask_token_id", "hidden_size", "intermediate_size")
    differ = [f"{k} {getattr(theirs, k)} != {getattr(mine, k)}" for k in same if getattr(mine, k) != getattr(theirs, k)]
    if theirs.num_layers > mine.num_layers:
        differ.append(f"num_layers {theirs.num_layers} > {mine.num_layers}")
    if differ:
        raise ValueError(f"cannot start from {path}: its shape differs from this run's ({'; '.join(differ)})")
    grown = range(theirs.num_layers, mine.num_layers)
    if grown:
        _init_from_target(drafter, target)   # what the checkpoint does not hold: the grown layers
    for i in grown:
        drafter.layers[i].self_attn.o_proj.weight.zero_()
        drafter.layers[i].mlp.down_proj.weight.zero_()
    state = {k: v for k, v in source.state_dict().items() if k not in ("d2t", "t2d")}
    drafter.load_state_dict(state, strict=False)
    new = {k for k in drafter.state_dict() if any(k.startswith(f"layers.{i}.") for i in grown)}
    missing = set(drafter.state_dict()) - set(state) - {"d2t", "t2d"} - new
    if missing:
        raise ValueError(f"{path} lacks {sorted(missing)}")


@torch.no_grad()
def _init_from_target(drafter: DFlashDrafter, target: TargetModel) -> None:
    """Warm start: layer i copies the target's layer L - n + i (attention, MLP, norms); fc passes the highest
    captured feature; the final norm is the target's; the mask embedding starts at the mean token embedding."""
    h, n = target.config.hidden_size, drafter.config.num_layers
    k = len(drafter.config.target_layer_ids)
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, (k - 1) * h:] = torch.eye(h)
    for i, layer in enumerate(drafter.layers):
        src = target.layers[target.config.num_layers - n + i]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(layer.self_attn, name).weight.copy_(getattr(src.self_attn, name).weight.float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight.float())
        layer.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
        layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
    drafter.norm.weight.copy_(target.norm.weight.float())
    if drafter.mask_embedding is not None:
        drafter.mask_embedding.copy_(target.embed_tokens.weight.float().mean(0))


class DFlashLoss:
    def __init__(self, drafter: DFlashDrafter, target: TargetModel, cols: torch.Tensor, opts: DFlashOptions,
                 loss_vocab: torch.Tensor | None = None):
        self.drafter, self.opts, self.cols = drafter, opts, cols
        self.embed = target.embed_tokens.weight.detach().float()
        vocab = target.config.vocab_size
        self.loss_vocab = loss_vocab if loss_vocab is not None else torch.arange(vocab)
        self.full_head = target.lm_head.weight.detach().float()
        self.head = self.full_head[self.loss_vocab]       # [Vl, H], frozen
        # target id -> row of the loss vocabulary (-100: outside it, ignored by the loss)
        self.to_row = torch.full((vocab,), -100, dtype=torch.long)
        self.to_row[self.loss_vocab] = torch.arange(len(self.loss_vocab))
        b = opts.draft_block_len
        self.slot_weight = torch.exp(-(torch.arange(1, b) - 1).float() / opts.decay)   # [B-1]

    def block_inputs(self, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """[A * B, H]: each block's root embedding followed by B-1 mask embeddings."""
        b, h = self.opts.draft_block_len, self.embed.shape[1]
        m = self.drafter
        mask_e = (m.mask_embedding if m.mask_embedding is not None
                  else self.embed[m.config.mask_token_id])
        x = mask_e.expand(len(anchors), b, h).clone()
        x[:, 0] = self.embed[tokens[anchors]]
        return x.reshape(-1, h)

    def forward_blocks(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """-> [A, B, H] final-norm hidden of every block slot."""
        m, b = self.drafter, self.opts.draft_block_len
        t, a = feats.shape[0], len(anchors)
        ctx = m.hidden_norm(m.fc(feats))                                  # [T, H]
        pos_ctx = torch.arange(t)
        pos_blk = (anchors[:, None] + torch.arange(b)).reshape(-1)        # [A*B]
        cos_c, sin_c = m.rotary(pos_ctx, ctx.dtype)
        cos_b, sin_b = m.rotary(pos_blk, ctx.dtype)
        blk_id = torch.arange(a).repeat_interleave(b)
        mask = torch.cat([pos_ctx[None, :] < anchors[blk_id][:, None],   # context before the anchor
                          blk_id[:, None] == blk_id[None, :]], dim=1)    # own block, bidirectional
        x = self.block_inputs(tokens, anchors)
        for layer in m.layers:
            attn = layer.self_attn
            nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
            hx = layer.input_layernorm(x)
            q = apply_rope(attn.q_norm(attn.q_proj(hx).view(-1, nh, hd)), cos_b, sin_b)
            kb = apply_rope(attn.k_norm(attn.k_proj(hx).view(-1, nkv, hd)), cos_b, sin_b)
            vb = attn.v_proj(hx).view(-1, nkv, hd)
            kc = apply_rope(attn.k_norm(attn.k_proj(ctx).view(t, nkv, hd)), cos_c, sin_c)
            vc = attn.v_proj(ctx).view(t, nkv, hd)
            k = torch.cat([kc, kb]).transpose(0, 1)
            v = torch.cat([vc, vb]).transpose(0, 1)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=hd ** -0.5,
                                               enable_gqa=nh != nkv)
            x = x + attn.o_proj(o.transpose(0, 1).reshape(-1, nh * hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x).view(a, b, -1)

    def sample_anchors(self, seq: SequenceData, generator: torch.Generator) -> torch.Tensor:
        """Distinct anchors in [1, T-1) (a needs context and the label at a+1); response anchors first."""
        t, p = len(seq.tokens), seq.prompt_len
        if t < 3:
            return torch.empty(0, dtype=torch.long)
        resp = torch.arange(max(p, 1), t - 1)
        prompt = torch.arange(1, min(p, t - 1))
        n_resp = min(len(resp), self.opts.anchors)
        n_prompt = min(len(prompt), self.opts.anchors - n_resp) if self.opts.prompt_weight > 0 else 0
        picked = [resp[torch.randperm(len(resp), generator=generator)[:n_resp]],
                  prompt[torch.randperm(len(prompt), generator=generator)[:n_prompt]]]
        return torch.cat(picked).sort().values

    def labels(self, seq: SequenceData, positions: torch.Tensor) -> torch.Tensor:
        """The target's greedy token at each position given the true prefix: argmax lm_head(hidden[pos - 1]).
        In a greedy response that is the token itself; in the prompt (teacher forcing) and in sampled responses
        it is what greedy verification would accept there."""
        labels = seq.tokens[positions]   # in a greedy response: the exact token the (bf16) target chose
        need = positions < seq.prompt_len if seq.greedy else torch.ones_like(positions, dtype=torch.bool)
        if bool(need.any()):   # a full-vocabulary head: ~30% of a step where every label took it
            with torch.no_grad():
                labels[need] = (seq.hidden[positions[need] - 1].float() @ self.full_head.T).argmax(-1)
        return labels

    def __call__(self, seq: SequenceData, generator: torch.Generator):
        anchors = self.sample_anchors(seq, generator)
        if len(anchors) == 0:
            return torch.zeros(()), 0, {}
        b, t = self.opts.draft_block_len, len(seq.tokens)
        hidden = self.forward_blocks(seq.features[:, self.cols].float(), seq.tokens, anchors)
        label_pos = anchors[:, None] + torch.arange(1, b)           # [A, B-1]
        valid = label_pos < t
        greedy = self.labels(seq, label_pos.clamp(max=t - 1))
        labels = self.to_row[greedy]
        logits = hidden[:, 1:] @ self.head.T                         # [A, B-1, Vl]
        if self.opts.soft_labels:   # the target's distribution of x_p is lm_head(hidden[p - 1]), renormalised
            with torch.no_grad():
                soft = (seq.hidden[label_pos.clamp(max=t - 1) - 1].float() @ self.head.T).softmax(-1)
            ce = -(soft * logits.log_softmax(-1)).sum(-1).reshape(-1)
        else:
            valid = valid & (labels >= 0)
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1),
                                 reduction="none")
        block_w = torch.where(anchors >= seq.prompt_len, 1.0, self.opts.prompt_weight)     # [A]
        w = (block_w[:, None] * self.slot_weight[None, :] * valid).reshape(-1)
        loss = (ce * w).sum() / w.sum()
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels) & valid & (labels >= 0)
            # expected accepted drafts per block if verified against these labels: the run of leading hits
            run = hit.long().cumprod(-1).sum(-1).float()
            resp = anchors >= seq.prompt_len
            metrics = {"acc1": float(hit[resp, 0].float().mean()) if bool(resp.any()) else 0.0,
                       "accept": float(run[resp].mean()) if bool(resp.any()) else 0.0}
        return loss, int(valid.sum()), metrics


def train_dflash(data_folder: Path, run_dir: Path, target: TargetModel, opts: DFlashOptions,
                 loop: LoopOptions) -> Path:
    """Train (or resume) a DFlash drafter; returns the exported checkpoint folder (public format)."""
    run_dir = Path(run_dir)
    extra = peek_extra(run_dir)
    data = TrainingData(data_folder, extra["num_shards_vocab"] if extra else None, features=False)
    if extra is None:
        extra = {"options": dict(opts.__dict__), "num_shards_vocab": len(data.manifest["shards"]), "loss_vocab": None}
        if opts.loss_vocab_size:
            counts = token_counts(data, target.config.vocab_size)
            extra["loss_vocab"] = choose_vocab(counts, opts.loss_vocab_size).tolist()
    loss_vocab = torch.tensor(extra["loss_vocab"]) if extra["loss_vocab"] is not None else None
    layer_ids = opts.target_layer_ids or data.capture_layers
    torch.manual_seed(loop.seed)
    drafter = make_drafter(target, tuple(layer_ids), opts).float()
    cols = data.feature_columns(drafter.config.capture_layers)
    loss = DFlashLoss(drafter, target, cols, opts, loss_vocab)
    export_dir = run_dir / "export"
    n = target.config.num_layers
    # the export drafts from the loss vocabulary (the only ids it was trained to rank): a smaller LM head per round
    train_loop(run_dir, drafter, Path(data_folder), loss, loop,
               lambda: save_dflash(drafter, export_dir, n, draft_vocab=loss_vocab), extra)
    return export_dir
