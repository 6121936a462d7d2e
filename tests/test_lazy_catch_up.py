"""Lazy catch-up (a drafter untouched until chosen, then its whole backlog in one KV-only pass) gives exactly the
drafts that updating both drafters every round (eager) gives, on sequences that switch often."""
from __future__ import annotations

import random
from dataclasses import replace

from whiflash_trt.config import DFLASH, DFlashTreeConfig, GenerationConfig, SpecConfig


class RecordingProposer:
    """Delegates to the real proposer and records every draft tree it proposes."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def for_spec(self, spec):
        return RecordingProposer(self.inner.for_spec(spec), self.log)

    def propose_many(self, seqs):
        proposals = self.inner.propose_many(seqs)
        for seq, proposal in zip(seqs, proposals):
            self.log.append((self.inner.name, seq.num_committed, proposal.tree.tokens, proposal.tree.parents))
        return proposals

    def propose(self, seq):
        return self.propose_many([seq])[0]


def _drafts(engine, prompt, spec, gen):
    log: list = []
    saved = dict(engine.proposers)
    engine.proposers.update({n: RecordingProposer(p, log) for n, p in saved.items()})
    try:
        out = engine.generate(prompt, gen, spec=spec)
    finally:
        engine.proposers.clear()
        engine.proposers.update(saved)
    return out, log


def test_lazy_and_eager_catch_up_propose_identical_drafts(spec_engine):
    rng = random.Random(3)
    vocab = spec_engine.target.config.vocab_size
    total_switches = total_backlog = 0
    for router, threshold in (("entropy", 1.5), ("neural", 0.1)):
        for _ in range(3):
            prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 30))]
            gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
            lazy, lazy_log = _drafts(spec_engine, prompt, SpecConfig("whiflash", router, threshold, "lazy"), gen)
            eager, eager_log = _drafts(spec_engine, prompt, SpecConfig("whiflash", router, threshold, "eager"), gen)
            assert lazy_log == eager_log
            assert lazy.token_ids == eager.token_ids
            total_switches += lazy.stats["switches"]
            # lazy does the same work in fewer, larger passes: never more backlog tokens than eager
            assert lazy.stats["catch_up_tokens"] <= eager.stats["catch_up_tokens"]
            total_backlog += lazy.stats["catch_up_tokens"]
    assert total_switches >= 10, "the sequences must switch often for this test to mean anything"
    assert total_backlog > 0


def test_dflash_cache_after_ddtree_rounds_is_what_a_fresh_prefill_gives(spec_engine):
    """After a tree round DFlash's context holds the accepted path's features, compacted: at every round's state, its
    block logits equal those of a fresh prefill of the same committed tokens (and lazy == eager across switches)."""
    tree = DFlashTreeConfig(total_tokens=12)
    rng = random.Random(5)
    vocab = spec_engine.target.config.vocab_size
    checked = moved = 0
    for spec in (SpecConfig("dflash", dflash_tree=tree),
                 SpecConfig("whiflash", "entropy", 1.5, "lazy", dflash_tree=tree)):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randrange(2, 20))]
        gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
        out, log = _drafts(spec_engine, prompt, spec, gen)
        eager, eager_log = _drafts(spec_engine, prompt, replace(spec, catch_up="eager"), gen)
        assert log == eager_log and out.token_ids == eager.token_ids
        proposer = spec_engine.proposers[DFLASH].for_spec(spec)
        for name, n, tokens, parents in log:
            if name != DFLASH:
                continue
            committed = prompt + out.token_ids[:n - len(prompt)]
            with spec_engine.scratch_sequence(committed, n + proposer.max_tree_tokens()) as seq:
                target = spec_engine.runner.step(seq, committed, logits_rows=[n - 1], capture=True)
                seq.commit(committed, tokens[0], target.captured, {DFLASH: 0})
                seq.frontiers[DFLASH] = proposer.catch_up(seq)
                fresh = proposer.propose(seq).tree
            assert (fresh.tokens, fresh.parents) == (tokens, parents), f"round at {n}"
            checked += 1
        moved += sum(1 for _, t in out.stats["trace"] if t > 1)
    assert checked >= 8 and moved >= 3, "several DDTree rounds, some of them accepting drafts, must be checked"


def test_a_drafters_prompt_prefill_is_its_own_phase_and_catch_up_counts_generated_tokens(spec_engine):
    """The first round's KV-only pass over the prompt is drafter_prefill; catch_up then covers the tokens each round
    committed (a static drafter's whole backlog but the last round's), so the switching overhead counts decoding."""
    rng = random.Random(7)
    vocab = spec_engine.target.config.vocab_size
    prompt = [rng.randrange(1, vocab) for _ in range(25)]
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    # EAGLE-3's root forward writes position N-1 when it drafts: its prompt prefill is one position short, and it
    # catches up a round's tokens but the last of them
    for mode, prefilled, per_round in (("dflash", len(prompt), lambda t: t),
                                       ("eagle3", len(prompt) - 1, lambda t: t - 1)):
        stats = spec_engine.generate(prompt, gen, spec=SpecConfig(mode=mode)).stats
        taus = [t for _, t in stats["trace"]]
        assert len(taus) >= 3
        assert stats["drafter_prefill_tokens"] == prefilled
        # every round's tokens, caught up the round after (the last round's never)
        assert stats["catch_up_tokens"] == sum(per_round(t) for t in taus[:-1])
        phases = stats["phase_seconds"]
        assert phases["drafter_prefill"] > 0 and phases["catch_up"] > 0
        # phase_seconds are rounded to 10 us: the overhead (from the unrounded seconds) lies within what that allows
        half = 0.5e-5
        low = (phases["catch_up"] - half) / (sum(phases.values()) + half * len(phases))
        high = (phases["catch_up"] + half) / (sum(phases.values()) - half * len(phases))
        assert low - half <= stats["switching_overhead"] <= high + half
    # a routed run: each drafter prefills the prompt once, the first time it drafts (EAGLE-3 one position short only
    # if that is the first round)
    stats = spec_engine.generate(prompt, gen, spec=SpecConfig("whiflash", "entropy", 1.5, "lazy")).stats
    drafters = [d for d, _ in stats["trace"]]
    used = set(drafters) - {"none", "suffix"}   # the suffix drafter indexes the prompt with no KV-only prefill
    assert used == {"eagle3", "dflash"}
    assert stats["drafter_prefill_tokens"] == 2 * len(prompt) - (drafters[0] == "eagle3")
