"""whiflash-run and whiflash-bench take the same draft-tree options, and an option left out keeps its setting's
default."""
import argparse

from whiflash_trt.config import DFlashTreeConfig, SuffixTreeConfig, TreeConfig
from whiflash_trt.tree_options import add_tree_options, tree_settings


def parse(*argv: str) -> dict:
    p = argparse.ArgumentParser()
    add_tree_options(p)
    return tree_settings(p.parse_args(list(argv)))


def test_options_left_out_keep_the_defaults():
    assert parse() == {"tree": TreeConfig(), "dflash_tree": DFlashTreeConfig(), "suffix_tree": SuffixTreeConfig()}


def test_each_option_sets_its_own_setting():
    got = parse("--tree-depth", "2", "--tree-min-prob", "0.2", "--dflash-tree-top-k", "1", "--suffix-tree-factor",
                "2", "--suffix-tree-total-tokens", "5")
    assert got == {"tree": TreeConfig(depth=2, min_prob=0.2), "dflash_tree": DFlashTreeConfig(top_k=1),
                   "suffix_tree": SuffixTreeConfig(total_tokens=5, factor=2.0)}


def test_run_and_bench_take_the_same_tree_options():
    from whiflash_trt.bench.cli import parser as bench_parser
    from whiflash_trt.cli import run_parser

    def tree_flags(p) -> set[str]:
        return {s for a in p._actions for s in a.option_strings if "tree" in s}

    assert tree_flags(run_parser()) == tree_flags(bench_parser()) and len(tree_flags(run_parser())) == 10
