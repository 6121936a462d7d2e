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
            raise ValueError(f"unsupported rope_scaling type {self.scaling_type!r} (supported: default, linear, llama3)")
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
    (runtime.tree_defaults: 8 on AMX tiles, else 6)."""
    # Measured on the compiled CPU engine, where a verify's GEMMs are compute-bound past a few rows (a 16-node verify
    # costs ~2.4x a decode step): 6 nodes beat 16 and 8 in every benchmark category (whiflash-bench
    # --tree-total-tokens 4/6/8/16, 2 prompts per category), and top-k 3 beat 4 (3 prompts per category). Depth,
    # speed-up over `ar` with scripts/compare_tree_shapes.py (--eagle3 3,3,6 3,2,6 --num-prompts 5 --threads 2: 20
    # held-out prompts, 96 tokens, interleaved in one process; AMD EPYC Zen 4): 2 draft steps 1.304 against 1.308
    # for 3 on one day (on the bench's own prompts 1.328 and 1.335 against 1.349 and 1.320), then 1.474 against
    # 1.367, 1.339 against 1.343 and 1.391 against 1.354 on a later one (`ar` 17.5, 14.9 and 10.9 ms per round: the
    # shared machine's speed changed from run to run).
    # A third step adds tau (2.147 against 2.028) that its own cost takes back, so the cheaper round is the default.
    # On an Intel Xeon with AMX, whose GEMM loop makes a 16-row verify's linears cost a 1-row step's, the default
    # still wins (--num-prompts 3, two runs): speed-up 1.459/1.463 for 3,2,6; 3,2,4 1.469, 3,2,8 1.430, 4,2,8 1.452,
    # 4,2,10 1.408, 3,3,8 1.430, 4,3,12 1.392, 4,4,16 1.304: each verified row still adds ~0.3 ms of attention and
    # bookkeeping, and a draft step ~0.6 ms. With the AMX attention as well (2026-12-03, same CPU, --num-prompts 5):
    # 3,2,5 1.561 against 1.533 for 3,2,6 (3,2,4 1.515), and 1.607 against 1.589 on prompts 15-19 (--skip 15): a 6th
    # node is a second tile of query vectors in every layer's attention (SmolLM2: 3 per row, 16 a tile).
    # A probability floor (min_prob, 2026-12-04, same CPU): each verified row costs ~0.2-0.28 ms (2-3% of a step),
    # worth it only for a node likely to be accepted, so nodes whose path probability under the drafter is below the
    # floor can be left unverified; the tree then verifies up to total_tokens where the drafter is sure and fewer
    # where it is not, and a third draft step pays. Speed-up over `ar` (scripts/compare_tree_shapes.py --eagle3
    # K,D,N@P ... --num-prompts 5 --threads 2, 20 held-out prompts, one process each line; all but the last line by
    # an ad hoc copy of it that pruned the same nodes before the script took @P): prompts 15-19 of each
    # set, 3,2,6 1.562, at 0.02/0.05/0.1 1.588/1.594/1.590; 3,2,6 1.590, at 0.05 1.611, 3,3,8 at 0.05 1.634, 3,3,10
    # at 0.05 1.636, 4,3,12 at 0.05 1.637; 3,2,6 1.564, 3,3,10 at 0.03 1.612 and at 0.08 1.607, 4,4,16 at 0.05 1.592;
    # prompts 10-14, 3,2,6 1.516, 3,3,10 at 0.05 1.558, 3,3,8 at 0.05 1.554, 4,3,10 at 0.05 1.555; the benchmark's
    # own prompts (--skip 0, a check, not a choice): 3,2,6 1.495, 3,3,10 at 0.05 1.529, 3,3,8 at 0.05 1.559. The
    # default: 3,3,8 at 0.05, as good as 10 nodes on held-out prompts and never verifying more than 8 rows. Where
    # the GEMM takes 6 rows per pass (no AMX) 6 nodes beat 8 (runtime.tree_defaults), so the node count is the
    # machine's. The router's labels are each drafter's accepted drafts with the default trees, so it was refit for them
    # (MODEL_CARD.md, Router); a first refit routed worse, with costs calibrated on one code prompt that put
    # EAGLE-3's adaptive round at 1.11x DFlash's where the bench measured 1.06x (runtime.round_costs now calibrates
    # on a code and a prose prompt: 1.08x).
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
    argmax drafts. total_tokens None: the default of the CPU's GEMM loop (runtime.tree_defaults: 5 on AMX tiles, else
    6), or fewer where the block (and top_k) cannot hold that many."""
    # The default node count is measured on the compiled CPU engine (whiflash-bench --modes ar,dflash --num-prompts 3
    # --max-new-tokens 64 --dflash-tree-total-tokens N, 2 threads): its GEMM takes up to 6 rows per pass over the
    # weights, so a 6-node verify costs about a 5-node one and a 7-node one ~5 ms more (round 24.1 vs 29.1 ms).
    # N = 4/5/6/7 ran at 0.94/0.97/0.92/0.84x `ar` over all categories, the block's 8-node chain at 0.77x (tau 1.63;
    # the 6-node tree 1.82). With the drafter shipped on 2026-12-01, on held-out prompts
    # (scripts/compare_tree_shapes.py --dflash 6 5 4 --num-prompts 5 --threads 2, AMD EPYC Zen 4, three runs): 5
    # nodes 1.416x, 1.323x and 1.363x `ar`, 6 nodes 1.345x, 1.282x and 1.368x (4 nodes: 1.384x in the first).
    # On an Intel Xeon with AMX (same script, --num-prompts 3, two runs): 5 nodes 1.409x and 1.419x, 6 1.411x, 8
    # 1.396x and 1.406x, 12 1.335x, 16 1.278x. With the AMX attention (2026-12-03, same CPU): 5 nodes 1.532x, 6
    # 1.520x, 8 1.523x (--num-prompts 3); 5 nodes 1.497x, 4 1.466x (--num-prompts 5). A probability floor (min_prob)
    # does not pay here (2026-12-04, same CPU, compare_tree_shapes.py --dflash N@P as above, 20 prompts): prompts
    # 15-19, 5 nodes 1.491x, at 0.02/0.05/0.1 1.488x/1.494x/1.485x; again 1.488x, 8 at 0.05 1.499x, 10 at 0.08
    # 1.516x; prompts 10-14, 5 nodes 1.476x, 8 at 0.08 1.448x, 10 at 0.08 1.435x, 10 at 0.05 1.476x. On an AMD
    # EPYC (dot loop) on 2026-12-04 6 nodes beat 5 (runtime.tree_defaults).
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
