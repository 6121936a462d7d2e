"""The draft-tree options of every front end that takes them on a command line (whiflash-run, whiflash-bench), and
the tree settings they give. An option left out is None, and the setting then keeps its config default, so a run can
tell which settings it was given (runtime.plan's rule: a tree option applies only where the mode runs its drafter)."""
from __future__ import annotations

import argparse

from whiflash_trt.config import DFLASH, EAGLE3, SUFFIX, DFlashTreeConfig, SuffixTreeConfig, TreeConfig
from whiflash_trt.runtime.plan import DFLASH_TREE, EAGLE3_TREE, SUFFIX_TREE
from whiflash_trt.runtime.tree_defaults import DEFAULT_NODES_HELP

# SpecConfig field -> its config class and the neutral names (runtime.plan) of its settings: "<field>_<setting>"
TREE_OPTIONS = {"tree": (TreeConfig, EAGLE3_TREE), "dflash_tree": (DFlashTreeConfig, DFLASH_TREE),
                "suffix_tree": (SuffixTreeConfig, SUFFIX_TREE)}


def add_tree_options(p: argparse.ArgumentParser) -> None:
    """Each drafter's draft-tree settings."""
    p.add_argument("--tree-top-k", type=int, help=f"EAGLE-3 tree: children per expanded node, 1 = a chain "
                                                  f"(default: {TreeConfig.top_k})")
    p.add_argument("--tree-depth", type=int, help=f"EAGLE-3 tree: draft steps per round "
                                                  f"(default: {TreeConfig.depth})")
    p.add_argument("--tree-total-tokens", type=int, help=f"EAGLE-3 tree: nodes verified per round at most, root "
                                                         f"included (default: {DEFAULT_NODES_HELP[EAGLE3]})")
    p.add_argument("--tree-min-prob", type=float, help=f"EAGLE-3 tree: nodes whose path probability under the "
                                                       f"drafter is lower are not verified "
                                                       f"(default: {TreeConfig.min_prob})")
    p.add_argument("--dflash-tree-total-tokens", type=int,
                   help="DFlash tree (DDTree): nodes verified per round at most, root included, the most probable "
                        "prefixes under the block's per-position distributions "
                        f"(default: {DEFAULT_NODES_HELP[DFLASH]}, or what the block holds)")
    p.add_argument("--dflash-tree-top-k", type=int, help="DFlash tree: children per node at most, 1 = the block's "
                                                         "chain (default: no limit)")
    p.add_argument("--dflash-tree-min-prob", type=float, help="DFlash tree: prefixes less probable than this are "
                                                              f"not verified (default: {DFlashTreeConfig.min_prob})")
    p.add_argument("--suffix-tree-total-tokens", type=int, help="suffix tree: nodes verified per round at most, root "
                                                                "included (default: "
                                                                f"{DEFAULT_NODES_HELP[SUFFIX]})")
    p.add_argument("--suffix-tree-min-prob", type=float, help="suffix tree: continuations seen less often than this "
                                                              "share of the match's occurrences are not verified "
                                                              f"(default: {SuffixTreeConfig.min_prob})")
    p.add_argument("--suffix-tree-factor", type=float, help="suffix tree: depth at most this times the match's "
                                                            f"length (default: {SuffixTreeConfig.factor})")


def tree_settings(args: argparse.Namespace) -> dict:
    """SpecConfig's tree fields from add_tree_options's options, the ones left out at their defaults."""
    settings = {}
    for field, (config, params) in TREE_OPTIONS.items():
        given = {p.removeprefix(field + "_"): getattr(args, p) for p in params if getattr(args, p) is not None}
        settings[field] = config(**given)
    return settings
