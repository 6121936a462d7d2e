"""The engine's default policy: what "auto" means for the drafters and router weights an engine holds. Every front
end (whiflash-run, whiflash-bench, the Triton model, the Python API) gets it through Engine.plan."""
from __future__ import annotations

from dataclasses import replace

from whiflash_trt.config import AR, AUTO, DFLASH, EAGLE3, MODE_DRAFTERS, WHIFLASH, SpecConfig


def default_mode(drafters: set[str]) -> str:
    """Both drafters routed per round, else the one drafter, else target-only."""
    return next(mode for mode in (WHIFLASH, EAGLE3, DFLASH, AR) if set(MODE_DRAFTERS[mode]) <= drafters)


def resolve_spec(spec: SpecConfig, drafters: set[str], has_router_weights: bool) -> SpecConfig:
    """`spec` with "auto" mode and router replaced by concrete choices (the neural router where weights exist)."""
    mode = default_mode(drafters) if spec.mode == AUTO else spec.mode
    router = ("neural" if has_router_weights else "entropy") if spec.router == AUTO else spec.router
    return replace(spec, mode=mode, router=router)
