"""The embedded default target's engine (SmolLM2-135M with the drafters and router the package ships), built once
into a cache folder whose name carries the shipped drafters' hash, so retrained drafters never reuse an old engine.
Processes starting at once build it once (builder.build_once). Its linears run the GGUF's own Q4_1/Q8_0 blocks
(--weights native) where the engine's kernels build here, else its dequantised bf16 weights."""
from __future__ import annotations

from pathlib import Path

from whiflash_trt import kernels
from whiflash_trt.builder.build import BuildOptions
from whiflash_trt.builder.build_once import build_once
from whiflash_trt.builder.bundled import bundled_for
from whiflash_trt.builder.sources import DEFAULT_TARGET
from whiflash_trt.config import AUTO

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "whiflash-trt"
LAYOUT = 7   # what a default engine holds; raised when that changes (2: EAGLE-3's step compiled; 3: DFlash's; 4: the
#              packages' RoPE traced by halves; 5: EAGLE-3's midlayer in int8 where kernels.int8_layers_pay; 6: native
#              weights; 7: the native weights stored packed for the kernels)


def default_weights() -> str:
    """native where the engine's kernels build (they compute from the GGUF's blocks), else bf16."""
    return "native" if kernels.can_build() else "bf16"


def default_engine(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    # the kernels' version and the layout too: an engine built before them (or for another torch) is not reused
    weights = default_weights()
    engine_dir = cache_dir / "engines" / f"{DEFAULT_TARGET}-{weights}-{bundled_for(DEFAULT_TARGET).version()}" \
        f"-{kernels.build.version()}-l{LAYOUT}"
    what = "the GGUF's Q4_1/Q8_0 weights" if weights == "native" else "bf16 weights (this machine cannot build the " \
        "kernels that compute from the GGUF's blocks)"
    return build_once(BuildOptions(target=DEFAULT_TARGET, output=engine_dir, dtype="bf16", weights=weights,
                                   backend=AUTO),
                      announce=f"building the default engine ({DEFAULT_TARGET}, {what}) into {engine_dir} (once)")
