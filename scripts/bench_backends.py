"""Backends side by side on SmolLM2-135M: tokens/s of the onnx backend (onnxruntime CPU, fp32) vs the torch backend
(fp32 on the very same engine directory, and bf16), interleaved round by round in one process; plus build, export and
load times. Greedy, target-only (`ar`) by default: SmolLM2 has no trained drafters here. --with-drafters adds random
EAGLE-3 / DFlash drafters so the speculative modes' per-round cost shows (their acceptance is ~0, so tokens/s is
then a cost measure, not a speedup).

    python scripts/bench_backends.py [--engine-dir /tmp/whiflash-bench] [--max-new-tokens 64] [--rounds 3]
                                     [--threads N]

--threads sets torch's intra-op threads, which the onnx backend follows too. On a machine shared with other jobs,
1 thread measures the backends rather than OpenMP's behaviour under oversubscription.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain in two sentences why the sky is blue.",
           'Return a JSON object with the fields "name" and "age" for a person called Ada, 36.']


def random_drafters(folder: Path, cfg) -> tuple[Path, Path]:
    """Random EAGLE-3 and DFlash checkpoints shaped for the target (for timing only)."""
    from whiflash_trt.config import RopeConfig
    from whiflash_trt.models.dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids
    from whiflash_trt.models.drafter_checkpoints import save_dflash, save_eagle3
    from whiflash_trt.models.eagle3 import Eagle3Config, Eagle3Drafter

    torch.manual_seed(0)
    h, n = cfg.hidden_size, cfg.num_layers
    eagle3 = Eagle3Drafter(Eagle3Config(h, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.rms_norm_eps, cfg.vocab_size, cfg.vocab_size, h,
                                        cfg.max_position_embeddings, RopeConfig(), (2, n // 2, n - 3)))
    eagle3.t2d.fill_(True)
    save_eagle3(eagle3, folder / "eagle3", dtype=torch.float32)
    dflash = DFlashDrafter(DFlashConfig(h, cfg.intermediate_size, 2, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                        cfg.rms_norm_eps, cfg.vocab_size, cfg.max_position_embeddings, RopeConfig(),
                                        16, cfg.vocab_size, default_target_layer_ids(n, 2)), h, True)
    save_dflash(dflash, folder / "dflash", n, dtype=torch.float32)
    return folder / "eagle3", folder / "dflash"


def build(engine_dir: Path, with_drafters: bool) -> dict:
    from whiflash_trt.builder.build import BuildOptions, build_engine
    from whiflash_trt.builder.sources import load_checkpoint, resolve_target

    drafters = {}
    if with_drafters:
        cfg = load_checkpoint(resolve_target("smollm2-135m")).config
        e, d = random_drafters(Path(tempfile.mkdtemp(prefix="whiflash-bench-drafters-")), cfg)
        drafters = {"ar_drafter": e, "dllm_drafter": d}
    times = {}
    for backend in ("torch", "onnx"):
        start = time.perf_counter()
        build_engine(BuildOptions(target="smollm2-135m", output=engine_dir / backend, dtype="fp32",
                                  backend=backend, show_progress=False, **drafters))
        times[f"build_{backend}_s"] = round(time.perf_counter() - start, 1)
    return times


def main() -> None:
    from whiflash_trt.config import GenerationConfig, SpecConfig
    from whiflash_trt.runtime.engine import Engine

    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dir", type=Path, default=Path(tempfile.gettempdir()) / "whiflash-bench")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--with-drafters", action="store_true")
    ap.add_argument("--threads", type=int, help="intra-op threads of both backends (default: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if not (args.engine_dir / "onnx" / "manifest.json").is_file():
        report.update(build(args.engine_dir, args.with_drafters))
    manifest = json.loads((args.engine_dir / "onnx" / "manifest.json").read_text())
    report["export_s"] = manifest["onnx"]["export_seconds"]
    report["export_per_graph_s"] = {k: g["export_seconds"] for k, g in manifest["onnx"]["graphs"].items()}
    engines, load_s = {}, {}
    for name, kwargs in (("torch-fp32", {"backend": "torch"}), ("onnx-fp32", {}),
                         ("torch-bf16", {"backend": "torch", "dtype": "bf16"})):
        start = time.perf_counter()
        engines[name] = Engine.load(args.engine_dir / "onnx", **kwargs)
        load_s[name] = round(time.perf_counter() - start, 2)
    report["load_s"] = load_s
    modes = ["ar"] + (["eagle3", "dflash"] if "eagle3" in engines["onnx-fp32"].proposers else [])
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    first = next(iter(engines.values()))
    prompts = [first.encode(p, chat=True) for p in PROMPTS]
    for mode in modes:
        spec = SpecConfig(mode=mode)
        rates = {name: [] for name in engines}
        tokens = {}
        for name, engine in engines.items():       # warm-up (first-call allocations, onnxruntime arenas)
            engine.generate(prompts[0], GenerationConfig(max_new_tokens=4, ignore_eos=True), spec=spec)
        for _ in range(args.rounds):
            for name, engine in engines.items():   # interleaved: load drifts hit every backend alike
                n, seconds = 0, 0.0
                for i, prompt in enumerate(prompts):
                    out = engine.generate(prompt, gen, spec=spec)
                    n, seconds = n + len(out.token_ids), seconds + out.stats["seconds"]
                    tokens[(name, i)] = out.token_ids
                rates[name].append(n / seconds)
        same = all(tokens[("onnx-fp32", i)] == tokens[("torch-fp32", i)] for i in range(len(prompts)))
        report[mode] = {"tokens_per_s_median": {k: round(statistics.median(v), 2) for k, v in rates.items()},
                        "tokens_per_s_all": {k: [round(x, 2) for x in v] for k, v in rates.items()},
                        "onnx_tokens_equal_torch_fp32": same}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
