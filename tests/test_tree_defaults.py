"""A draft tree's default node count follows the verify's GEMM loop: 8 / 5 nodes (EAGLE-3 / DFlash) where it runs on
AMX tiles of 16 rows, 4 for every drafter on AVX2's FMA loop, 3 for the learned drafters and 4 for the suffix drafter
over a native target's GGML GEMM (every build), 6 elsewhere, and a request's own count wins."""
import torch

from whiflash_trt import kernels
from whiflash_trt.config import DFLASH, EAGLE3, SUFFIX, SpecConfig, TreeConfig
from whiflash_trt.runtime import tree_defaults
from whiflash_trt.runtime.tree_defaults import default_nodes


def test_the_default_node_counts_follow_the_gemm_loop(monkeypatch):
    monkeypatch.setattr(kernels, "registered", lambda: True)
    for gemm, isa, expected in (("amx", "amx", {EAGLE3: 8, DFLASH: 5, SUFFIX: 6}),
                                ("dot", "avx512bf16", {EAGLE3: 6, DFLASH: 6, SUFFIX: 6}),
                                ("fma", "avx512", {EAGLE3: 6, DFLASH: 6, SUFFIX: 6}),
                                ("fma", "avx2", {EAGLE3: 4, DFLASH: 4, SUFFIX: 4})):
        monkeypatch.setattr(kernels, "gemm", lambda g=gemm: g)
        monkeypatch.setattr(kernels, "loaded_isa", lambda i=isa: i)
        assert {d: default_nodes(d, torch.device("cpu"), torch.bfloat16) for d in (EAGLE3, DFLASH, SUFFIX)} == expected
    # a native target (GGML blocks), whichever build and loop runs the rest: 3 nodes for the learned drafters, 4 for
    # the suffix drafter
    for gemm, isa in (("fma", "avx2"), ("dot", "avx512bf16"), ("amx", "amx")):
        monkeypatch.setattr(kernels, "gemm", lambda g=gemm: g)
        monkeypatch.setattr(kernels, "loaded_isa", lambda i=isa: i)
        assert {d: default_nodes(d, torch.device("cpu"), torch.bfloat16, native=True)
                for d in (EAGLE3, DFLASH, SUFFIX)} == {EAGLE3: 3, DFLASH: 3, SUFFIX: 4}
    monkeypatch.setattr(kernels, "gemm", lambda: "amx")
    assert default_nodes(EAGLE3, torch.device("meta"), torch.bfloat16) == tree_defaults.NODES[EAGLE3]   # not the CPU's
    # an fp32 target's verify does not run the bf16 GEMM loop: whether this process loaded the kernels (another
    # engine, a test) must not change its trees
    assert default_nodes(EAGLE3, torch.device("cpu"), torch.float32) == tree_defaults.NODES[EAGLE3]


def test_a_proposer_verifies_the_machines_default_unless_the_request_names_a_count(spec_engine_dir):
    from whiflash_trt.runtime.engine import Engine

    engine = Engine.load(spec_engine_dir)   # its own load: the default follows the loop chosen when it loads
    proposer = engine.proposers[EAGLE3]
    assert proposer.max_tree_tokens() == default_nodes(EAGLE3, engine.device, engine.target.dtype)
    assert proposer.for_spec(SpecConfig(tree=TreeConfig(total_tokens=3))).max_tree_tokens() == 3
