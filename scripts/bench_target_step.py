"""Micro-benchmark: one target step (q new tokens on a cached context) of our forward vs transformers', on the same
weights, for bf16 and fp32 and q = 1, 2, 8, 16: each round times every q and both forwards in turn, and each ratio
is the median of its per-round ratios. bf16 times the engine's target as it runs (the default engine: the compiled
backend where it was built); fp32 the torch modules.

    python scripts/bench_target_step.py [--engine DIR] [--context 256] [--rounds 7] [--iters 10] [--threads N]
        [--generate N]

With --generate N it then decodes N held-out prompts per category (96 new tokens, greedy, chat template) with the
engine's `ar` mode and with transformers' generate() on the same bf16 weights, alternated per prompt, and prints the
time ratio per prompt and its median (and whether the two outputs are token-equal: in bf16 the kernels round
otherwise than transformers' eager ops, so they may part at a near-tie; losslessness is measured against `ar`).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def hf_model(ckpt, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = ckpt.config
    hf_cfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                         intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope.theta,
                         max_position_embeddings=cfg.max_position_embeddings,
                         tie_word_embeddings=cfg.tie_word_embeddings)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k): v.to(dtype)
             for k, v in ckpt.state_dict.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg)
    return model.eval()


def compare(runner, hf, seq, prompt: list[int], dtype: torch.dtype, args) -> None:
    """Our target step against transformers' on the same cached context, q = 1, 2, 8, 16 new tokens."""
    from transformers import DynamicCache

    with torch.inference_mode():
        runner.step(seq, prompt)
        seq.commit(prompt, None)
        cache = DynamicCache(config=hf.config)
        hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
    sizes = (1, 2, 8, 16)

    def run_ours(q):
        runner.step(seq, prompt[:q])

    def run_hf(q):
        with torch.inference_mode():
            hf(torch.tensor([prompt[:q]]), past_key_values=cache, use_cache=True)
            cache.crop(-q)

    # every round times each q and both forwards in turn, so ratios pair measurements seconds apart (the machine's
    # speed drifts by several percent over minutes)
    times = {(name, q): [] for name in ("ours", "hf") for q in sizes}
    for q in sizes:
        run_ours(q), run_hf(q)  # warm-up
    for _ in range(args.rounds):
        for q in sizes:
            for name, fn in (("ours", run_ours), ("hf", run_hf)):
                t = time.perf_counter()
                for _ in range(args.iters):
                    fn(q)
                times[name, q].append((time.perf_counter() - t) / args.iters * 1000)
    for q in sizes:
        ours, hf_ms = times["ours", q], times["hf", q]
        speedup = statistics.median(h / o for h, o in zip(hf_ms, ours))
        rel = statistics.median(o / b for o, b in zip(ours, times["ours", 1]))
        print(f"{str(dtype)[6:]:6} {q:2} {statistics.median(ours):8.2f} {statistics.median(hf_ms):8.2f} "
              f"{speedup:8.2f}x {rel:10.2f}x")


def compare_generate(engine, hf, prompts_per_category: int) -> None:
    """`ar` decoding against transformers' generate (hf: the bf16 model) on held-out prompts, alternated per prompt
    (greedy)."""
    from whiflash_trt.bench.prompts import held_out_prompts
    from whiflash_trt.config import AR, GenerationConfig, SpecConfig

    spec, gen = SpecConfig(mode=AR), GenerationConfig(max_new_tokens=96)
    prompts = [engine.encode(p.prompt, chat=True) for p in held_out_prompts(prompts_per_category)]
    engine.generate(prompts[0], GenerationConfig(max_new_tokens=8), spec=spec)   # warm-up, both
    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)
    ratios, equal = [], 0
    print("ar against transformers' generate (bf16, greedy, 96 new tokens)")
    for ids in prompts:
        t = time.perf_counter()
        ours = engine.generate(ids, gen, spec=spec).token_ids
        t_ours = time.perf_counter() - t
        with torch.inference_mode():
            t = time.perf_counter()
            out = hf.generate(torch.tensor([ids]), max_new_tokens=len(ours), min_new_tokens=len(ours),
                              do_sample=False)
            t_hf = time.perf_counter() - t
        equal += out[0, len(ids):].tolist() == ours
        ratios.append(t_hf / t_ours)
        print(f"  {len(ids):4d} prompt tokens: ours {t_ours:.3f} s, transformers {t_hf:.3f} s ({ratios[-1]:.2f}x)")
    print(f"median {statistics.median(ratios):.2f}x over {len(ratios)} prompts; {equal} token-equal")


def main() -> None:
    from whiflash_trt.bench.environment import default_engine_dir
    from whiflash_trt.builder.sources import load_checkpoint, resolve_target
    from whiflash_trt.config import CacheConfig
    from whiflash_trt.models.checkpoints import instantiate_target
    from whiflash_trt.runtime.engine import Engine
    from whiflash_trt.runtime.loading import EngineParts

    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--engine", help="bf16 engine of smollm2-135m to time (default: the embedded one)")
    ap.add_argument("--generate", type=int, default=0, metavar="N",
                    help="then `ar` against transformers' generate on N held-out prompts per category")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(resolve_target("smollm2-135m"))
    cfg = ckpt.config
    prompt = torch.randint(0, cfg.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, context {args.context}")
    print("dtype  q   ours ms  hf ms   hf/ours   ours(q)/ours(1)")
    for dtype in (torch.bfloat16, torch.float32):
        if dtype == torch.bfloat16:
            engine = Engine.load(args.engine or default_engine_dir())
            print(f"bf16: {type(engine.target).__name__} of {args.engine or default_engine_dir()}")
        else:
            engine = Engine(EngineParts(instantiate_target(ckpt, dtype), None), CacheConfig())
        hf = hf_model(ckpt, dtype)
        with engine.scratch_sequence(prompt, args.context + 32) as seq:
            compare(engine.runner, hf, seq, prompt, dtype, args)
        if dtype == torch.bfloat16 and args.generate:
            compare_generate(engine, hf, args.generate)


if __name__ == "__main__":
    main()
