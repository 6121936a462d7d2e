"""The target model (Llama family and Qwen3) over a paged KV pool.

One forward serves prefill, decode and multi-token (chain or tree) verification: the caller gives the new tokens'
positions, the pool slots their K/V go to, the slots of every key they may attend to (in logical order, new ones
included) and an explicit [T, S] attention mask. Module names follow the Hugging Face checkpoints, so loading is a
name map (drop the leading "model.").
"""
from __future__ import annotations

import torch
from torch import nn

from whiflash_trt import kernels
from whiflash_trt.config import ModelConfig
from whiflash_trt.models.attention import AttentionContext, attention_keys
from whiflash_trt.models.contracts import Segment, Target, TargetOutput
from whiflash_trt.models.layers import FrozenLinear, RMSNorm, RotaryTable, SwiGLU, gate_up_packs, k_major, row_linear


class Attention(nn.Module):
    """Self-attention over a paged pool; `in_features` differs from hidden_size only for EAGLE-3's midlayer (2H)."""

    def __init__(self, cfg: ModelConfig, in_features: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, bias = cfg.hidden_size, cfg.attention_bias
        d_in = in_features or h
        self.q_proj = nn.Linear(d_in, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=bias)
        self.qk_norm = cfg.architecture == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.head_dim ** -0.5
        self.qkv: FrozenLinear | None = None  # set by fuse(), with self.o

    def fuse(self, use_kernels: bool = True, int8: bool = False, many_rows: bool = True,
             blocks: dict[str, torch.Tensor] | None = None) -> None:
        """One [q;k;v] matrix; q/k/v_proj become views into it, so names and state_dict stay the checkpoint's.
        `int8`: on the kernels, the projections' weights quantised per output row (a drafter's, see FrozenLinear),
        run in the int8 loop for many rows (DFlash's blocks) or few (`many_rows` False: EAGLE-3's draft steps).
        `blocks`: GGML weights packed already ("qkv", "o_proj": a native target's, pack_native's) that run in place
        of those the dense ones would be packed into (FrozenLinear's kernel_weight)."""
        blocks = blocks or {}
        projs = (self.q_proj, self.k_proj, self.v_proj)
        fused = k_major(torch.cat([p.weight for p in projs]))
        bias = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None
        start = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(fused[start:start + n], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
            start += n
        self.o_proj.weight = nn.Parameter(k_major(self.o_proj.weight), requires_grad=False)
        self.qkv = FrozenLinear(fused, bias, use_kernels, int8, many_rows, blocks.get("qkv"))
        self.o = FrozenLinear(self.o_proj.weight, self.o_proj.bias, use_kernels, int8, many_rows, blocks.get("o_proj"))

    def projections(self, x) -> list[torch.Tensor]:
        """x [..., H] -> q, k, v [..., heads (kv_heads) * head_dim]"""
        if self.qkv is None:
            return [self.q_proj(x), self.k_proj(x), self.v_proj(x)]
        return self.split(self.qkv(x))

    def split(self, qkv: torch.Tensor) -> list[torch.Tensor]:
        """The fused projection's output [..., (heads + 2 kv_heads) * head_dim] -> q, k, v"""
        kv = self.num_kv_heads * self.head_dim
        return qkv.split([self.num_heads * self.head_dim, kv, kv], -1)

    def heads(self, lead, q, k, v):
        """The projections' q, k, v [*lead, ...] -> per head, q and k normed (Qwen3); not rotated"""
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, lead, q, k, v, ctx: AttentionContext, layer: int) -> torch.Tensor:
        """The projections' outputs q, k, v [*lead, ...] -> heads, then the attention, which rotates q and k ->
        [*lead, heads * D]. The kernel (RowKeys) rotates them itself, as apply_rope does, bit for bit: a compiled
        step then makes no pass over them between the QKV GEMM and the attention (such a pass is a serial kernel,
        ~9 us per layer at 16 rows on the Intel Xeon with AMX, the other thread waiting through it)."""
        return ctx.attend(*self.heads(lead, q, k, v), layer, self.scale)

    def forward(self, x, ctx: AttentionContext, layer: int):
        """Writes and reads layer `layer` of the context's pools."""
        out = self.attend(x.shape[:-1], *self.projections(x), ctx, layer)
        return self.o(out) if self.qkv is not None else row_linear(out, self.o_proj.weight, self.o_proj.bias)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norms_in_gemms = False   # forward's kernel form: set by TargetModel.fuse_projections

    def on_kernels(self) -> bool:
        """Both norms can run inside the GEMMs after them (residual_forward): bf16 or GGML weights on the kernels."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.qkv is not None and attn.qkv.kernel_weight is not None and mlp.gate_up_packed is not None
                and attn.qkv.kernel_weight.dtype in (torch.int32, torch.uint8)
                and self.input_layernorm.weight.dtype == torch.bfloat16)

    def forward(self, h, delta, ctx: AttentionContext, layer: int):
        """The residual stream x = h + delta [T, H] (delta None: x = h) -> the (h, delta) of the layer's output. On
        the kernels (norms_in_gemms, set by TargetModel.fuse_projections) the stream stays two terms, so each norm
        runs in the GEMM after it with the residual add before it (kernels.linear_norm): the torch form's roundings,
        but for the order in which a norm sums its squares (kernels/rows.h). Elsewhere delta stays None."""
        attn, mlp = self.self_attn, self.mlp
        if not self.norms_in_gemms:
            h = h + attn(self.input_layernorm(h), ctx, layer)
            return h + mlp(self.post_attention_layernorm(h)), None
        norm = self.input_layernorm
        qkv, h = kernels.linear_norm(h, delta, norm.weight, norm.eps, attn.qkv.kernel_weight, attn.qkv.kernel_bias,
                                     attn.qkv.weight.shape[0])
        out = attn.attend(h.shape[:-1], *attn.split(qkv), ctx, layer)
        norm = self.post_attention_layernorm
        act, h = kernels.linear_norm(h, attn.o(out), norm.weight, norm.eps, mlp.gate_up_packed, None,
                                     mlp.gate_proj.weight.shape[0], silu=True)
        return h, mlp.down(act)


class TargetModel(nn.Module, Target):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryTable(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.head: FrozenLinear | None = None  # the lm_head, set by fuse_projections
        self.kernel_attention = False          # set by fuse_projections
        self.native = False                    # its linears run GGML blocks: set by fuse_projections

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden) if self.head is not None else self.lm_head(hidden)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def fuse_projections(self, use_kernels: bool = True, native: dict[str, torch.Tensor] | None = None) -> None:
        """Inference-only: one matmul for q/k/v and one for gate/up per layer (fewer, larger weight streams), every
        weight in the layout whose GEMM rows do not depend on the row count (layers.k_major). `use_kernels`: the
        attention and the bf16 linears run on whiflash_trt.kernels where they are loaded (False: torch and oneDNN).
        `native`: a GGUF file's own blocks packed for the kernels (pack_native's, by native_linears' names), which
        the linears they name run over in place of their bf16 weights. Those dense weights are then neither packed
        nor read, and may be meta tensors (runtime/loading.py reads none of them); the embedding, the norms and the
        dense LM head's weight stay."""
        native = native or {}
        if native and not (use_kernels and kernels.registered() and self.dtype == torch.bfloat16):
            raise ValueError("native weights run on the engine's kernels in bf16")
        for i, layer in enumerate(self.layers):
            layer.self_attn.fuse(use_kernels, blocks=_under(native, f"layers.{i}.self_attn."))
            layer.mlp.fuse(use_kernels, blocks=_under(native, f"layers.{i}.mlp."))
        head = nn.Parameter(k_major(self.lm_head.weight), requires_grad=False)
        if self.lm_head.weight is self.embed_tokens.weight:
            self.embed_tokens.weight = head
        self.lm_head.weight = head
        self.head = FrozenLinear(head, use_kernel=use_kernels, kernel_weight=native.get("lm_head"))
        self.kernel_attention = use_kernels and kernels.registered()
        self.native = bool(native)
        self._place_norms()

    def _place_norms(self) -> None:
        """The norms run inside the GEMMs after them where every layer's weights are on the kernels."""
        norms_in_gemms = self.kernel_attention and all(layer.on_kernels() for layer in self.layers)
        for layer in self.layers:
            layer.norms_in_gemms = norms_in_gemms

    def streamed_weight_bytes(self) -> int:
        """Bytes of weights one step reads once fused (fuse_projections): each projection and the LM head as its GEMM
        reads it (the packed or GGML weight on the kernels, else the module's) and the norms; the embedding's one row
        aside."""
        def read(frozen: FrozenLinear) -> int:
            return (frozen.kernel_weight if frozen.kernel_weight is not None else frozen.weight).nbytes

        total = self.norm.weight.nbytes + read(self.head)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            gate_up = mlp.gate_up_packed.nbytes if mlp.gate_up_packed is not None else read(mlp.gate_up)
            total += read(attn.qkv) + read(attn.o) + gate_up + read(mlp.down)
            total += layer.input_layernorm.weight.nbytes + layer.post_attention_layernorm.weight.nbytes
        return total

    def forward(
        self,
        input_ids: torch.Tensor,        # [T]
        positions: torch.Tensor,        # [T]
        k_cache: torch.Tensor,          # [num_layers, num_slots, kv_heads, head_dim]
        v_cache: torch.Tensor,
        write_slots: torch.Tensor,      # [T] where the new tokens' K/V go
        read_slots: torch.Tensor,       # [S] every key the new tokens may see, in logical order
        attn_mask: torch.Tensor,        # [T, S] bool
        capture_layers: tuple[int, ...] = (),
        logits_indices: torch.Tensor | None = None,  # rows of T to compute logits for; None = all
    ) -> TargetOutput:
        """One sequence's new tokens."""
        return self.forward_segments(input_ids, positions, k_cache, v_cache, write_slots,
                                     [Segment(read_slots, attn_mask)], capture_layers, logits_indices)

    def forward_segments(self, input_ids, positions, k_cache, v_cache, write_slots, segments: list[Segment],
                         capture_layers: tuple[int, ...] = (), logits_indices=None) -> TargetOutput:
        """Each row's result depends only on its token, position and visible keys, never on the other rows of the
        call: a verify row equals, bit for bit, the same position fed alone, and a sequence's rows in a batch equal
        its rows in a call of its own (see models/attention.py)."""
        keys = attention_keys(segments, self.config.num_heads // self.config.num_kv_heads, self.kernel_attention)
        ctx = AttentionContext.at(self.rotary, positions, self.dtype, write_slots, keys, k_cache, v_cache)
        return self.run(input_ids, ctx, capture_layers, logits_indices)

    def run(self, input_ids, ctx: AttentionContext, capture_layers: tuple[int, ...] = (),
            logits_indices=None) -> TargetOutput:
        """The one forward every step runs: forward_segments, the compiled step (builder/compile_target.py) and the
        exported graph (builder/onnx_export.py) build `ctx` and call it."""
        x, delta = self.embed_tokens(input_ids), None
        captured = []
        for i, layer in enumerate(self.layers):
            x, delta = layer(x, delta, ctx, i)
            if i in capture_layers:
                captured.append((capture_layers.index(i), x if delta is None else x + delta))
        if delta is not None:
            x = x + delta
        rows = x if logits_indices is None else x.index_select(0, logits_indices)
        hidden = self.norm(rows)
        logits = self.head(hidden) if self.head is not None else row_linear(hidden, self.lm_head.weight)
        feats = torch.cat([t for _, t in sorted(captured, key=lambda p: p[0])], dim=-1) if captured else None
        return TargetOutput(logits=logits, hidden=hidden, captured=feats)


def _under(named: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries of `named` whose names start with `prefix`, by the rest of their names."""
    return {name[len(prefix):]: t for name, t in named.items() if name.startswith(prefix)}


def native_linears(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The linears that run GGML blocks, by the name of their packed weight (pack_native), each with the GGUF
    tensors it is packed from, in order (a tied LM head: the embedding table's)."""
    table = {}
    for i in range(cfg.num_layers):
        at = f"layers.{i}."
        table |= {f"{at}self_attn.qkv": tuple(f"{at}self_attn.{p}_proj.weight" for p in "qkv"),
                  f"{at}self_attn.o_proj": (f"{at}self_attn.o_proj.weight",),
                  f"{at}mlp.gate_up": (f"{at}mlp.gate_proj.weight", f"{at}mlp.up_proj.weight"),
                  f"{at}mlp.down_proj": (f"{at}mlp.down_proj.weight",)}
    table["lm_head"] = ("embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight",)
    return table


def pack_native(cfg: ModelConfig, blocks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GGUF's blocks (kernels.ggml_blocks, by weight name) -> the packed weights TargetModel.fuse_projections takes
    (kernels.pack_ggml, by native_linears' names): q/k/v where all three have blocks of one type, o, gate/up likewise
    (their rows interleaved, kernels.ggml_gate_up), down and the LM head. Pure byte moves, the same on every CPU: an
    engine stores them packed (builder/build.py)."""
    packed = {}
    for name, sources in native_linears(cfg).items():
        found = [blocks.get(s) for s in sources]
        if any(b is None for b in found) or len({kernels.ggml_kind(b) for b in found}) > 1:
            continue
        if name.endswith("gate_up"):
            if gate_up_packs(cfg.intermediate_size):
                packed[name] = kernels.pack_ggml(kernels.ggml_gate_up(*found))
        else:
            packed[name] = kernels.pack_ggml(torch.cat(found))
    return packed


def dense_replaced(cfg: ModelConfig, packed: dict[str, torch.Tensor]) -> set[str]:
    """The dense weights a target over `packed` (pack_native's) never reads: its layers' linears that run blocks.
    The LM head's stays (a drafter slices its draft vocabulary's rows from it, and a tied one is the embedding)."""
    return {s for name, sources in native_linears(cfg).items() if name in packed and name != "lm_head"
            for s in sources}
