"""The engine's default policy: what "auto" means for the drafters and router weights an engine holds. Every front
end (whiflash-run, whiflash-bench, the Triton model, the Python API) gets it through Engine.plan."""
from __future__ import annotations

from dataclasses import replace

from whiflash_trt.config import AR, AUTO, DFLASH, EAGLE3, MODE_DRAFTERS, SUFFIX, WHIFLASH, SpecConfig


def default_mode(drafters: set[str]) -> str:
    """Every drafter routed per round where the engine has both learned ones, else its one learned drafter, else
    target-only. The suffix drafter needs no checkpoint: every engine has it."""
    held = set(drafters) | {SUFFIX}
    return next(mode for mode in (WHIFLASH, EAGLE3, DFLASH, AR) if set(MODE_DRAFTERS[mode]) <= held)


def resolve_spec(spec: SpecConfig, drafters: set[str], has_router_weights: bool) -> SpecConfig:
    """`spec` with "auto" mode and router replaced by concrete choices (the neural router where weights exist)."""
    mode = default_mode(drafters) if spec.mode == AUTO else spec.mode
    router = ("neural" if has_router_weights else "entropy") if spec.router == AUTO else spec.router
    return replace(spec, mode=mode, router=router)
