"""Frozen, validated configuration records: one per concern.

Each record checks itself once in __post_init__ and raises ValueError naming the bad value. Derived numbers are
returned by whoever computes them (see runtime.kv_cache.num_blocks_for_budget), never written back here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, asdict
from typing import Any

import torch

ARCHITECTURES = ("llama", "qwen3")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(DTYPES)}")


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base theta plus optional Llama-3 frequency scaling."""
    theta: float = 10000.0
    scaling_type: str = "default"          # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope theta must be positive, got {self.theta}")
        if self.scaling_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_scaling type {self.scaling_type!r} "
                             f"(supported: default, linear, llama3)")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be positive, got {self.factor}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "RopeConfig":
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        theta = float(scaling.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = scaling.get("rope_type", scaling.get("type", "default")) or "default"
        if kind == "default" or not scaling:
            return cls(theta=theta)
        return cls(
            theta=theta,
            scaling_type=kind,
            factor=float(scaling.get("factor", 1.0)),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only target (Llama family or Qwen3)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Read a Hugging Face config.json dict (LlamaForCausalLM / Qwen3ForCausalLM)."""
        model_type = cfg.get("model_type", "")
        arch = {"llama": "llama", "qwen3": "qwen3"}.get(model_type)
        if arch is None:
            raise ValueError(f"unsupported model_type {model_type!r} in config.json; supported: llama, qwen3")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"config.json is missing {', '.join(missing)}")
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            rope=RopeConfig.from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope"] = RopeConfig(**d["rope"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget all pools together may use."""
    block_size: int = 16
    memory_budget_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.memory_budget_bytes <= 0:
            raise ValueError(f"KV memory budget must be positive, got {self.memory_budget_bytes}")


# Temperatures below this are greedy: dividing fp32 logits by a far smaller one overflows them to inf, and the
# probabilities become NaN (at 1e-5 the distribution is the argmax already, unless logits tie within 1e-5).
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. A temperature below GREEDY_BELOW_TEMPERATURE (0 included) means greedy (top_k and
    top_p are then ignored)."""
    temperature: float = 0.0
    top_k: int = 0          # 0: no top-k filter
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE


@dataclass(frozen=True)
class GenerationConfig:
    """Stopping rules and sampling for one request."""
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()   # end like EOS, reason "stop" (kept in the output, as EOS is)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")


AUTO = "auto"   # a mode or router resolved by the engine to what it holds (runtime.policy)
EAGLE3, DFLASH = "eagle3", "dflash"   # the learned drafters: the engine's registry, their KV pools, engine components
SUFFIX = "suffix"                     # the parameter-free drafter: what followed the text's suffix before
AR, WHIFLASH = "ar", "whiflash"       # target only; every drafter routed per round
MODE_DRAFTERS = {AR: (), EAGLE3: (EAGLE3,), DFLASH: (DFLASH,), SUFFIX: (SUFFIX,),
                 WHIFLASH: (EAGLE3, DFLASH, SUFFIX)}   # mode -> drafters run
MODES = tuple(MODE_DRAFTERS)
BACKENDS = ("torch", "compiled", "onnx", "tensorrt")
GRAPH_BACKENDS = ("onnx", "tensorrt")   # the target and drafters run exported graphs (runtime.backends)
ROUTERS = ("entropy", "neural")
CATCH_UP = ("lazy", "eager")


@dataclass(frozen=True)
class TreeConfig:
    """Shape of EAGLE-3's dynamic draft tree. total_tokens None: the default of the CPU's GEMM loop
    (runtime.tree_defaults: 8 on AMX tiles, 4 on AVX2, else 6)."""
    # Each verified row costs 2-3% of a decode step, worth it only for a node likely to be accepted: nodes below the
    # probability floor go unverified, so the tree verifies up to total_tokens where the drafter is sure and fewer where
    # it is not, and a third draft step pays. The router's labels come from these defaults: changing them means
    # refitting it (MODEL_CARD.md, Router). Measurements: docs/measurements.md, "EAGLE-3's tree".
    top_k: int = 3            # children per expanded node (1 = a chain)
    depth: int = 3            # draft steps per round
    total_tokens: int | None = None   # nodes verified per round at most, root (bonus) included; None: see above
    min_prob: float = 0.05    # nodes whose path probability under the drafter is below this are not verified

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.depth < 1 or (self.total_tokens is not None and self.total_tokens < 2):
            raise ValueError(f"tree needs top_k >= 1, depth >= 1, total_tokens >= 2; got {self.top_k}, "
                             f"{self.depth}, {self.total_tokens}")
        check_min_prob(self.min_prob)


@dataclass(frozen=True)
class DFlashTreeConfig:
    """DFlash's draft per round, from one block forward: the DDTree of the total_tokens - 1 most probable prefixes
    under the block's per-position distributions (spec.ddtree); top_k 1 is the block's chain of total_tokens - 1
    argmax drafts. total_tokens None: the default of the CPU's GEMM loop (runtime.tree_defaults: 5 on AMX tiles, 4 on
    AVX2, else 6), or fewer where the block (and top_k) cannot hold that many."""
    # No probability floor by default: on DFlash's trees it measured no gain. Measurements: docs/measurements.md,
    # "DFlash's tree".
    total_tokens: int | None = None   # nodes verified per round at most, root (bonus) included; None: see above
    top_k: int | None = None          # children per node at most (1 = a chain); None = no limit
    min_prob: float = 0.0             # prefixes less probable than this (product of the marginals) are not verified

    def __post_init__(self) -> None:
        if self.total_tokens is not None and self.total_tokens < 2:
            raise ValueError(f"DFlash tree total_tokens must be >= 2 (the root and a draft), got {self.total_tokens}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"DFlash tree top_k must be >= 1 (1 = a chain), got {self.top_k}")
        check_min_prob(self.min_prob)


@dataclass(frozen=True)
class SuffixTreeConfig:
    """The suffix drafter's tree (spec.suffix): the most probable continuations of the longest earlier match, at
    most total_tokens nodes (root included; None: runtime.tree_defaults), none below min_prob, and no deeper than
    `factor` times the match length (SuffixDecoding's rule: a longer match earns a longer draft)."""
    total_tokens: int | None = None
    min_prob: float = 0.1
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.total_tokens is not None and self.total_tokens < 2:
            raise ValueError(f"suffix tree total_tokens must be >= 2 (the root and a draft), got {self.total_tokens}")
        if not self.factor > 0:
            raise ValueError(f"suffix tree factor must be positive, got {self.factor}")
        check_min_prob(self.min_prob)


def check_min_prob(min_prob: float) -> None:
    """A draft tree's probability floor: a node is verified only if the drafter gives its path at least this
    probability (0: every node the budget allows)."""
    if not 0.0 <= min_prob < 1.0:
        raise ValueError(f"a draft tree's min_prob must be in [0, 1), got {min_prob}")


@dataclass(frozen=True)
class SpecConfig:
    """Which drafter(s) run and how. mode and router "auto" = the engine's default (runtime.policy); threshold None =
    the router's own default (from its weights file or the built-in entropy default)."""
    mode: str = AUTO
    router: str = AUTO
    threshold: float | None = None
    catch_up: str = "lazy"
    tree: TreeConfig = field(default_factory=TreeConfig)   # EAGLE-3 only
    dflash_tree: DFlashTreeConfig = field(default_factory=DFlashTreeConfig)   # DFlash only
    suffix_tree: SuffixTreeConfig = field(default_factory=SuffixTreeConfig)   # the suffix drafter only

    def __post_init__(self) -> None:
        if self.mode not in (AUTO, *MODES):
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join((AUTO, *MODES))}")
        if self.router not in (AUTO, *ROUTERS):
            raise ValueError(f"unknown router {self.router!r}; expected one of {', '.join((AUTO, *ROUTERS))}")
        if self.catch_up not in CATCH_UP:
            raise ValueError(f"unknown catch-up {self.catch_up!r}; expected one of {', '.join(CATCH_UP)}")
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ValueError(f"router threshold must be finite, got {self.threshold}")
