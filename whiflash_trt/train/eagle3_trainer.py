"""EAGLE-3 training: draft vocabulary by token frequency, training-time test unrolled over `ttt_steps` steps.

Notation per sequence of T fed tokens x_0..x_{T-1}: base t in [0, T-1). Step 0 at base t takes (fc(F_t), x_{t+1})
at position t and predicts x_{t+2}; step j takes (the drafter's own step j-1 output at t, x_{t+1+j}) at position
t + j and predicts x_{t+2+j} -- exactly what the runtime tree does at depth j. Attention at step j: the step-0
keys of bases 0..t (the context, causal) plus the keys of steps 1..j at the same base (its ancestors). Loss:
sum_j 0.8^j * soft cross-entropy to the target's distribution at t+1+j restricted (renormalised) to the draft vocab.
The forward uses the runtime module's own parameters, so the saved checkpoint drafts exactly what was trained.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from whiflash_trt.config import RopeConfig
from whiflash_trt.models.drafter_checkpoints import load_eagle3, save_eagle3
from whiflash_trt.models.eagle3 import Eagle3Config, Eagle3Drafter
from whiflash_trt.models.layers import apply_rope
from whiflash_trt.models.target import TargetModel
from whiflash_trt.train.checkpointing import peek_extra
from whiflash_trt.train.data import SequenceData, TrainingData, choose_vocab, token_counts
from whiflash_trt.train.loop import LoopOptions, train_loop


@dataclass(frozen=True)
class Eagle3Options:
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None    # None: the target's
    num_heads: int | None = None
    num_kv_heads: int | None = None
    ttt_steps: int = 4
    step_decay: float = 0.8
    prompt_weight: float = 0.2              # loss weight of predictions that fall inside the prompt
    max_positions: int = 768
    init_from_target: bool = True
    init_from: str | None = None            # an EAGLE-3 checkpoint to start from (its weights and draft vocabulary)

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}")


def make_drafter(target: TargetModel, vocab_ids: torch.Tensor, opts: Eagle3Options) -> Eagle3Drafter:
    tc = target.config
    n = tc.num_layers
    heads = opts.num_heads or tc.num_heads
    cfg = Eagle3Config(hidden_size=tc.hidden_size, intermediate_size=opts.intermediate_size or tc.intermediate_size,
                       num_heads=heads, num_kv_heads=opts.num_kv_heads or tc.num_kv_heads,
                       head_dim=tc.hidden_size // heads, rms_norm_eps=tc.rms_norm_eps, vocab_size=tc.vocab_size,
                       draft_vocab_size=len(vocab_ids), target_hidden_size=tc.hidden_size,
                       max_position_embeddings=tc.max_position_embeddings, rope=RopeConfig(theta=10000.0),
                       aux_layer_ids=(2, n // 2, n - 3))
    drafter = Eagle3Drafter(cfg)
    drafter.d2t.copy_(vocab_ids - torch.arange(len(vocab_ids)))
    drafter.t2d.zero_()
    drafter.t2d[vocab_ids] = True
    if opts.init_from:
        _init_from_checkpoint(drafter, Path(opts.init_from), target)
    elif opts.init_from_target:
        _init_from_target(drafter, target, vocab_ids)
    return drafter


def checkpoint_vocab(path: Path, target: TargetModel) -> torch.Tensor:
    """The sorted target ids of a checkpoint's draft vocabulary."""
    d2t = load_eagle3(path, target.config).d2t
    return torch.arange(len(d2t)) + d2t


@torch.no_grad()
def _init_from_checkpoint(drafter: Eagle3Drafter, path: Path, target: TargetModel) -> None:
    """Warm start from a trained drafter of the same shape and draft vocabulary (training it further)."""
    source = load_eagle3(path, target.config)
    mine, theirs = drafter.config, source.config
    same = ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "draft_vocab_size", "aux_layer_ids")
    differ = [f"{k} {getattr(theirs, k)} != {getattr(mine, k)}" for k in same if getattr(mine, k) != getattr(theirs, k)]
    if differ or not torch.equal(source.d2t, drafter.d2t):
        raise ValueError(f"cannot start from {path}: its shape or draft vocabulary differs from this run's "
                         f"({'; '.join(differ) or 'd2t'})")
    drafter.load_state_dict(source.state_dict())


@torch.no_grad()
def _init_from_target(drafter: Eagle3Drafter, target: TargetModel, vocab_ids: torch.Tensor) -> None:
    """Warm start: fc passes the highest captured layer, the midlayer's hidden half and MLP copy the target's last
    layer, norm and lm_head are the target's (restricted to the draft vocab)."""
    h = target.config.hidden_size
    c = drafter.config
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, 2 * h:] = torch.eye(h)
    last = target.layers[-1]
    attn, src = drafter.midlayer.self_attn, last.self_attn
    same_shape = (c.num_heads, c.num_kv_heads, c.intermediate_size) == (
        target.config.num_heads, target.config.num_kv_heads, target.config.intermediate_size)
    if same_shape:
        for name in ("q_proj", "k_proj", "v_proj"):
            w = getattr(attn, name).weight
            w[:, h:] = getattr(src, name).weight.float()
            w[:, :h] *= 0.1
        attn.o_proj.weight.copy_(src.o_proj.weight.float())
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(drafter.midlayer.mlp, name).weight.copy_(getattr(last.mlp, name).weight.float())
        drafter.midlayer.hidden_norm.weight.copy_(last.input_layernorm.weight.float())
        drafter.midlayer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
    drafter.norm.weight.copy_(target.norm.weight.float())
    drafter.lm_head.weight.copy_(target.lm_head.weight[vocab_ids].float())


class Eagle3Loss:
    """Training-time-test loss of one sequence (see the module docstring)."""

    def __init__(self, drafter: Eagle3Drafter, target: TargetModel, cols: torch.Tensor, opts: Eagle3Options):
        self.drafter, self.opts, self.cols = drafter, opts, cols
        self.embed = target.embed_tokens.weight.detach().float()
        vocab_ids = torch.arange(drafter.config.draft_vocab_size) + drafter.d2t
        self.target_head = target.lm_head.weight.detach()[vocab_ids].float()   # [Vd, H]

    def _attend(self, q, k0, v0, diag_k, diag_v):
        """q [h, T, D]; k0/v0 [h, T, D] (causal context); diag_k/v lists of [h, T, D] (same-base ancestors)."""
        scale = q.shape[-1] ** -0.5
        t = q.shape[1]
        s0 = (q @ k0.transpose(1, 2)) * scale
        s0 = s0.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        sd = [((q * k).sum(-1, keepdim=True) * scale) for k in diag_k]
        p = torch.softmax(torch.cat([s0] + sd, dim=-1), dim=-1)
        out = p[..., :t] @ v0
        for i, v in enumerate(diag_v):
            out = out + p[..., t + i:t + i + 1] * v
        return out

    def step_forward(self, embeds, g, positions, k0v0, diag):
        """One TTT step over all bases; returns (out hidden [T, H], this step's (k, v))."""
        m = self.drafter
        layer, attn = m.midlayer, m.midlayer.self_attn
        t = g.shape[0]
        nh, nkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        cos, sin = m.rotary(positions, g.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(g)], dim=-1)
        q = apply_rope(attn.q_proj(x).view(t, nh, hd), cos, sin)
        k = apply_rope(attn.k_proj(x).view(t, nkv, hd), cos, sin)
        v = attn.v_proj(x).view(t, nkv, hd)
        rep = nh // nkv
        k = k.transpose(0, 1).repeat_interleave(rep, 0)   # [h, T, D]
        v = v.transpose(0, 1).repeat_interleave(rep, 0)
        if k0v0 is None:
            k0v0 = (k, v)
            o = self._attend(q.transpose(0, 1), k, v, [], [])
        else:
            o = self._attend(q.transpose(0, 1), *k0v0, [d[0] for d in diag] + [k], [d[1] for d in diag] + [v])
        h = g + attn.o_proj(o.transpose(0, 1).reshape(t, nh * hd))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h, k0v0, (k, v)

    def __call__(self, seq: SequenceData, generator: torch.Generator):
        opts = self.opts
        tokens, feats, hidden = seq.tokens, seq.features, seq.hidden
        if len(tokens) > opts.max_positions + 1:   # a window ending at a random point of the response
            hi = int(torch.randint(max(seq.prompt_len, opts.max_positions + 1), len(tokens) + 1, (1,),
                                   generator=generator))
            lo = hi - (opts.max_positions + 1)
            tokens, feats, hidden = tokens[lo:hi], feats[lo:hi], hidden[lo:hi]
            prompt_len = max(0, seq.prompt_len - lo)
            offset = lo
        else:
            prompt_len, offset = seq.prompt_len, 0
        t_all = len(tokens)
        nb = t_all - 1                                # bases 0..T-2
        if nb < 1:
            return torch.zeros(()), 0, {}
        with torch.no_grad():
            # [T-1, Vd]: row r is the distribution at position r + 1
            target_logp = torch.log_softmax(hidden[1:].float() @ self.target_head.T, dim=-1)
        g = self.drafter.fc(feats[:nb, self.cols].float())
        base = torch.arange(nb)
        k0v0, diag, loss, total_w, metrics = None, [], 0.0, 0.0, {}
        for j in range(opts.ttt_steps):
            valid = base + 1 + j <= t_all - 1          # the token x_{t+1+j} exists as input and has a target dist
            # predicting x_{t+2+j} needs dist at t+1+j (row t+j of target_logp), which exists iff t+1+j <= T-1
            if not bool(valid.any()):
                break
            idx = (base + 1 + j).clamp(max=t_all - 1)
            embeds = self.embed[tokens[idx]]
            h, k0v0, kv = self.step_forward(embeds, g, base + j + offset, k0v0, diag)
            diag.append(kv)
            logp = self.drafter.draft_logprobs(h)                  # [nb, Vd]
            rows = (base + j).clamp(max=nb - 1)
            q = target_logp[rows].exp()
            ce = -(q * logp).sum(-1)                               # [nb]
            w = torch.where(base + 2 + j >= prompt_len, 1.0, opts.prompt_weight) * valid
            w = w * (base + 1 + j <= t_all - 1)
            step_loss = (ce * w).sum()
            loss = loss + (opts.step_decay ** j) * step_loss
            total_w += float(w.sum()) * (opts.step_decay ** j)
            resp = valid & (base + 2 + j >= prompt_len)
            if bool(resp.any()):
                agree = (logp.argmax(-1) == target_logp[rows].argmax(-1)) & resp
                metrics[f"acc{j}"] = float(agree.sum()) / float(resp.sum())
            g = h
        if total_w == 0:
            return torch.zeros(()), 0, {}
        return loss / total_w, nb, metrics


def train_eagle3(data_folder: Path, run_dir: Path, target: TargetModel, opts: Eagle3Options,
                 loop: LoopOptions) -> Path:
    """Train (or resume) an EAGLE-3 drafter; returns the exported checkpoint folder (public format)."""
    run_dir = Path(run_dir)
    extra = peek_extra(run_dir)
    data = TrainingData(data_folder, extra["num_shards_vocab"] if extra else None, features=False)
    if extra is None:
        counts = token_counts(data, target.config.vocab_size)
        vocab_ids = (checkpoint_vocab(Path(opts.init_from), target) if opts.init_from
                     else choose_vocab(counts, opts.draft_vocab_size))
        covered = float(counts[vocab_ids].sum()) / max(1, float(counts.sum()))
        extra = {"vocab_ids": vocab_ids.tolist(), "vocab_coverage": covered,
                 "num_shards_vocab": len(data.manifest["shards"])}
    vocab_ids = torch.tensor(extra["vocab_ids"])
    torch.manual_seed(loop.seed)
    drafter = make_drafter(target, vocab_ids, opts).float()
    drafter.rotary.to(torch.float32)
    cols = data.feature_columns(drafter.config.capture_layers)
    loss = Eagle3Loss(drafter, target, cols, opts)
    export_dir = run_dir / "export"
    train_loop(run_dir, drafter, Path(data_folder), loss, loop, lambda: save_eagle3(drafter, export_dir), extra)
    return export_dir

