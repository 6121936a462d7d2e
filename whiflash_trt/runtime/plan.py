"""A request's plan: its speculation settings resolved against the engine, checked once, and the parts they pick.

Engine.plan builds one per request; every front end (whiflash-run, the OpenAI server, the Triton model, the Python
API) goes through it, so the rule below on which settings a mode takes lives here only. Errors are SpecError
(whiflash_trt.errors), naming the setting by its neutral name; each front end spells it its own way.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from whiflash_trt.config import DFLASH, EAGLE3, MODE_DRAFTERS, SUFFIX, WHIFLASH, SpecConfig
from whiflash_trt.errors import SpecError

if TYPE_CHECKING:   # annotations only: the front ends import the rule without the models
    from whiflash_trt.runtime.drafters import Proposer
    from whiflash_trt.spec.router import Router

ROUTING = ("router", "threshold", "catch_up")   # whiflash mode only
EAGLE3_TREE = ("tree_top_k", "tree_depth", "tree_total_tokens", "tree_min_prob")   # SpecConfig.tree
DFLASH_TREE = ("dflash_tree_total_tokens", "dflash_tree_top_k", "dflash_tree_min_prob")   # SpecConfig.dflash_tree
SUFFIX_TREE = ("suffix_tree_total_tokens", "suffix_tree_min_prob", "suffix_tree_factor")   # SpecConfig.suffix_tree
# the neutral names of a request's speculation settings
PARAMS = ("mode", *ROUTING, *EAGLE3_TREE, *DFLASH_TREE, *SUFFIX_TREE)


@dataclass(frozen=True)
class Plan:
    """One request's speculation: the spec resolved (no "auto" left), the drafters its mode runs shaped by its tree
    settings, and its router (whiflash mode only). The router keeps that request's routing state, so a plan serves
    one request."""
    spec: SpecConfig
    proposers: dict[str, Proposer]
    router: Router | None


def check_options_apply(mode: str, given: Collection[str]) -> None:
    """Settings the request names explicitly (`given`, neutral names) that its resolved `mode` would silently ignore
    are a SpecError: routing outside whiflash mode, a drafter's tree settings in a mode without that drafter."""
    unknown = set(given) - set(PARAMS)
    if unknown:
        raise ValueError(f"not speculation settings: {', '.join(sorted(unknown))}")
    rules = ((ROUTING, mode == WHIFLASH, f"only to {{mode}} {WHIFLASH}"),
             (EAGLE3_TREE, EAGLE3 in MODE_DRAFTERS[mode], "only to the EAGLE-3 drafter"),
             (DFLASH_TREE, DFLASH in MODE_DRAFTERS[mode], "only to the DFlash drafter"),
             (SUFFIX_TREE, SUFFIX in MODE_DRAFTERS[mode], "only to the suffix drafter"))
    for names, applies, where in rules:
        ignored = tuple(p for p in names if p in given)
        if ignored and not applies:
            verb = "applies" if len(ignored) == 1 else "apply"
            raise SpecError(ignored, f"{{params}} {verb} {where}; this request's mode is {mode}")
