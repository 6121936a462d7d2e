"""The central property: speculative greedy output equals target-only greedy output, token for token."""
from __future__ import annotations

import random

import pytest

from whiflash_trt.config import DFlashTreeConfig, GenerationConfig, SpecConfig, SuffixTreeConfig, TreeConfig
from whiflash_trt.runtime.drafters import Proposal, Proposer
from whiflash_trt.spec.tree import DraftTree

SPECS = [
    SpecConfig(mode="eagle3"),
    SpecConfig(mode="eagle3", tree=TreeConfig(top_k=1, depth=4, total_tokens=5)),      # chain
    SpecConfig(mode="eagle3", tree=TreeConfig(top_k=3, depth=3, total_tokens=8)),
    SpecConfig(mode="eagle3", tree=TreeConfig(top_k=3, depth=3, total_tokens=10, min_prob=0.2)),   # pruned
    SpecConfig(mode="dflash"),                                                                # DDTree, default nodes
    SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(top_k=1)),                         # the block's chain
    SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(total_tokens=12)),
    SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(total_tokens=9, top_k=2)),
    SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(total_tokens=4, top_k=1)),         # a shorter chain
    SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(total_tokens=12, min_prob=0.2)),   # pruned
    SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(top_k=1, min_prob=0.2)),           # a chain cut short
    SpecConfig(mode="whiflash", router="entropy", threshold=1.5),
    SpecConfig(mode="whiflash", router="entropy", threshold=1.5, dflash_tree=DFlashTreeConfig(total_tokens=16)),
    SpecConfig(mode="whiflash", router="entropy", threshold=1.2, catch_up="eager"),
    SpecConfig(mode="whiflash", router="neural", threshold=0.0),
    SpecConfig(mode="whiflash", router="neural", threshold=0.2, catch_up="eager"),
    SpecConfig(mode="suffix"),
    SpecConfig(mode="suffix", suffix_tree=SuffixTreeConfig(total_tokens=12, min_prob=0.0, factor=4.0)),   # branchy
    SpecConfig(mode="suffix", suffix_tree=SuffixTreeConfig(total_tokens=2)),                               # one draft
]


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.fixture(params=["torch-fp32", "compiled-bf16"])
def engine(request):
    """The spec engine (fp32, torch modules) and its bf16 build on the compiled backend."""
    return request.getfixturevalue("spec_engine" if request.param == "torch-fp32" else "compiled_spec_engine")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.router}-{s.threshold}-{s.catch_up}-k{s.tree.top_k}"
                                              f"-dd{s.dflash_tree.total_tokens}.{s.dflash_tree.top_k}")
def test_every_mode_equals_target_only_greedy(engine, spec):
    spec_engine = engine
    vocab = spec_engine.target.config.vocab_size
    for i, prompt in enumerate(_prompts(5, seed=len(SPECS) + spec.tree.top_k, vocab=vocab)):
        gen = GenerationConfig(max_new_tokens=3 + 11 * i)
        ref = spec_engine.generate(prompt, gen)
        out = spec_engine.generate(prompt, gen, spec=spec)
        assert out.token_ids == ref.token_ids, f"prompt {i}: {spec}"
        assert out.finish_reason == ref.finish_reason
        assert out.stats["new_tokens"] == len(ref.token_ids)
    assert spec_engine.kv.allocator.num_free == spec_engine.kv.allocator.num_blocks


def test_whiflash_routes_to_both_drafters_and_switches(spec_engine):
    vocab = spec_engine.target.config.vocab_size
    seen, switches = set(), 0
    for prompt in _prompts(4, seed=7, vocab=vocab):
        out = spec_engine.generate(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True),
                                   spec=SpecConfig(mode="whiflash", router="entropy", threshold=1.5))
        seen |= set(out.stats["rounds_per_drafter"])
        switches += out.stats["switches"]
    assert {"eagle3", "dflash"} <= seen and switches > 0


class OracleProposer(Proposer):
    """A drafter test double that knows the target's greedy continuation and proposes it with corruptions, as a
    chain or as a tree whose correct child sits among decoys: it exercises long accepted blocks, tree compaction,
    and EOS / the token limit landing inside an accepted block. Only verification and commit are under test."""

    def __init__(self, name, reference: list[int], tree: bool, block: int, seed: int) -> None:
        self.name, self.reference, self.tree, self.block = name, reference, tree, block
        self.rng = random.Random(seed)

    def for_spec(self, spec):
        return self

    def scratch_slots(self):
        return 0

    def max_tree_tokens(self):
        return 3 * self.block + 1 if self.tree else self.block

    def catch_up(self, seq, end=None, start=None):
        return seq.num_committed

    def propose(self, seq):
        n_out = seq.num_committed - len(seq.prompt_ids) + 1   # output tokens so far, pending included
        truth = self.reference[n_out:n_out + self.block - 1]
        drafts = [t if self.rng.random() < 0.85 else (t + 1) % 50 for t in truth]
        if not self.tree:
            return Proposal(DraftTree.chain(seq.pending, drafts), seq.num_committed)
        tokens, parents, depths, parent = [seq.pending], [-1], [0], 0
        for d, tok in enumerate(drafts, 1):
            decoys = [(tok + 3 + j) % 50 for j in range(2)]
            order = [tok] + decoys
            self.rng.shuffle(order)
            nxt = None
            for t in order:
                tokens.append(t); parents.append(parent); depths.append(d)
                if t == tok:
                    nxt = len(tokens) - 1
            parent = nxt
        # flat order must list parents before children: it does (each level appended after its parent)
        return Proposal(DraftTree(tokens, parents, depths), seq.num_committed)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_high_acceptance_with_stops_and_limit_inside_accepted_blocks(spec_engine, tree):
    vocab = spec_engine.target.config.vocab_size
    saved = dict(spec_engine.proposers)
    taus = []
    try:
        for i, prompt in enumerate(_prompts(8, seed=11, vocab=vocab)):
            long_ref = spec_engine.generate(prompt, GenerationConfig(max_new_tokens=60, ignore_eos=True))
            spec_engine.proposers["dflash"] = OracleProposer("dflash", long_ref.token_ids, tree, block=7, seed=i)
            # a stop token the target emits mid-way, so that it lands inside an accepted block
            stop = long_ref.token_ids[17 + i]
            cases = [GenerationConfig(max_new_tokens=m, ignore_eos=True) for m in (1, 2, 9, 23, 37)]
            cases += [GenerationConfig(max_new_tokens=50, ignore_eos=True, stop_token_ids=(stop,)),
                      GenerationConfig(max_new_tokens=50)]
            for gen in cases:
                ref = spec_engine.generate(prompt, gen)
                out = spec_engine.generate(prompt, gen, spec=SpecConfig(mode="dflash"))
                assert out.token_ids == ref.token_ids, (i, gen)
                assert out.finish_reason == ref.finish_reason
                if out.stats["rounds"]:
                    taus.append(out.stats["tau"])
                if gen.stop_token_ids:
                    assert ref.token_ids[-1] == stop and ref.finish_reason == "stop"
    finally:
        spec_engine.proposers.clear()
        spec_engine.proposers.update(saved)
    assert sum(taus) / len(taus) > 2.0, "the oracle must be accepted for several tokens per round"


class CyclingRouter:
    """A router test double that routes none, EAGLE-3, DFlash, suffix, none, none, DFlash, ... in a fixed cycle."""
    threshold = 0.0
    CYCLE = ["none", "eagle3", "dflash", "suffix", "none", "none", "dflash", "suffix", "eagle3", "eagle3"]

    def __init__(self) -> None:
        self.calls = 0

    def choose(self, signal, offers=None) -> str:
        self.calls += 1
        return self.CYCLE[(self.calls - 1) % len(self.CYCLE)]


@pytest.mark.parametrize("catch_up", ["lazy", "eager"])
def test_router_choosing_no_draft_runs_target_only_rounds_losslessly(spec_engine, catch_up):
    from whiflash_trt.runtime.batch import Batch

    vocab = spec_engine.target.config.vocab_size
    for i, prompt in enumerate(_prompts(4, seed=21, vocab=vocab)):
        gen = GenerationConfig(max_new_tokens=20 + 7 * i)
        ref = spec_engine.generate(prompt, gen)
        batch = Batch(spec_engine)
        req = spec_engine.request(prompt, gen, SpecConfig(mode="whiflash", router="entropy", catch_up=catch_up))
        req.router = CyclingRouter()
        batch.submit(req)
        batch.run()
        out = req.result()
        assert out.token_ids == ref.token_ids, f"prompt {i}"
        if out.stats["rounds"] >= 4:
            assert {"none", "eagle3", "dflash", "suffix"} <= set(out.stats["rounds_per_drafter"]), out.stats
    assert spec_engine.kv.allocator.num_free == spec_engine.kv.allocator.num_blocks


def test_throughput_router_file_routes_all_three_choices_losslessly(tmp_path, tiny_checkpoint):
    """A v2 router file through the whole path (build, load with its cost calibration, --router neural): a
    predictor wired to the previous round's choice cycles none -> EAGLE-3 -> DFlash -> none."""
    import torch

    from tiny_drafters import build_tiny_engine, save_drafters
    from whiflash_trt.runtime.engine import Engine
    from whiflash_trt.runtime.round_costs import LiveRoundSeconds
    from whiflash_trt.spec.router import FEATURES, AcceptancePredictor
    from whiflash_trt.spec.router_file import save_throughput_router

    p = AcceptancePredictor(len(FEATURES))
    with torch.no_grad():
        p.fc1.weight.copy_(torch.eye(len(FEATURES)))
        p.fc1.bias.zero_()
        p.fc2.weight.zero_()
        p.fc2.bias.zero_()
        p.fc2.weight[0, FEATURES.index("prev_none")] = 10.0      # after a target-only round: EAGLE-3
        p.fc2.weight[1, FEATURES.index("prev_eagle3")] = 10.0    # after EAGLE-3: DFlash
    costs = {"none": 1.0, "eagle3": 2.0, "dflash": 2.0}
    save_throughput_router(p, tmp_path / "router.safetensors", 1.0, {"eagle3": 0.0, "dflash": 0.0}, costs, 0.5, 0.0)
    target = tiny_checkpoint("spec")
    engine = Engine.load(build_tiny_engine(target, tmp_path / "engine", router=tmp_path / "router.safetensors",
                                           **save_drafters(tmp_path, target, router=False)),
                         round_costs_cache=tmp_path / "round-costs")
    costs_seen = dict(engine.round_seconds)
    assert set(costs_seen) == {"none", "eagle3", "dflash", "verify_row"} and costs_seen.pop("verify_row") >= 0
    assert min(costs_seen.values()) > 0
    # the calibrated tiny-model costs are noise, and the rounds would move them: fix the ratios for the cycle
    engine.round_seconds = LiveRoundSeconds(costs, alpha=0.0)
    vocab = engine.target.config.vocab_size
    for i, prompt in enumerate(_prompts(3, seed=5, vocab=vocab)):
        gen = GenerationConfig(max_new_tokens=25 + 5 * i, ignore_eos=True)
        ref = engine.generate(prompt, gen, spec=SpecConfig(mode="ar"))
        out = engine.generate(prompt, gen, spec=SpecConfig(mode="whiflash", router="neural"))
        assert out.token_ids == ref.token_ids, f"prompt {i}"
        assert [d for d, _ in out.stats["trace"][:3]] == ["none", "eagle3", "dflash"], out.stats["trace"]


def test_dflash_drafting_from_a_draft_vocabulary_is_lossless(tmp_path, tiny_checkpoint, monkeypatch):
    """A DFlash checkpoint with a draft vocabulary (d2t/t2d) drafts from those ids alone, through the target
    lm_head's rows of them, and its chain and DDTree outputs still equal target-only output."""
    import torch

    from tiny_drafters import build_tiny_engine, make_dflash, read_config
    from whiflash_trt.config import DFLASH
    from whiflash_trt.models.drafter_checkpoints import save_dflash
    from whiflash_trt.runtime.drafters import DFlashProposer
    from whiflash_trt.runtime.engine import Engine

    target = tiny_checkpoint("spec")
    cfg = read_config(target)
    ids = torch.arange(0, cfg.vocab_size, 2)
    save_dflash(make_dflash(cfg), tmp_path / "dflash", cfg.num_layers, dtype=torch.float32, draft_vocab=ids)
    engine = Engine.load(build_tiny_engine(target, tmp_path / "engine", dllm_drafter=tmp_path / "dflash"))
    assert engine.proposers[DFLASH].vocab == ids.tolist()
    drafted: list[int] = []
    propose_many = DFlashProposer.propose_many

    def recording(self, seqs):
        proposals = propose_many(self, seqs)
        drafted.extend(t for p in proposals for t in p.tree.tokens[1:])
        return proposals

    monkeypatch.setattr(DFlashProposer, "propose_many", recording)
    for spec in (SpecConfig(mode="dflash"), SpecConfig(mode="dflash", dflash_tree=DFlashTreeConfig(top_k=1))):
        for i, prompt in enumerate(_prompts(4, seed=3, vocab=cfg.vocab_size)):
            gen = GenerationConfig(max_new_tokens=5 + 9 * i)
            assert engine.generate(prompt, gen, spec=spec).token_ids == engine.generate(prompt, gen).token_ids
    assert drafted and set(drafted) <= set(ids.tolist())


def test_the_suffix_drafter_copies_a_repeated_passage(spec_engine):
    """A prompt that repeats a passage: where the target's output follows a passage it has seen, the suffix drafter's
    drafts are accepted, with no model of its own, and output is the target's."""
    vocab = spec_engine.target.config.vocab_size
    rng = random.Random(11)
    accepted = 0
    for _ in range(3):
        passage = [rng.randrange(1, vocab) for _ in range(12)]
        prompt = passage * 3
        gen = GenerationConfig(max_new_tokens=24, ignore_eos=True)
        ref = spec_engine.generate(prompt, gen, spec=SpecConfig(mode="ar"))
        out = spec_engine.generate(prompt, gen, spec=SpecConfig(mode="suffix"))
        assert out.token_ids == ref.token_ids
        accepted += out.stats["new_tokens"] - out.stats["rounds"]
    assert accepted > 0, accepted
