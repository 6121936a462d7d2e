"""Batched rounds: many requests share each target forward, each routing on its own, joining and leaving between
rounds. Every request's output equals its output alone: greedy token for token (fp32 and bf16), sampled draw for draw
from its own seed. KV memory never runs out under a running sequence, and every block comes back."""
from __future__ import annotations

import random

import pytest

from whiflash_trt.config import GenerationConfig, SamplingConfig, SpecConfig, TreeConfig
from whiflash_trt.runtime.batch import Batch
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.kv_cache import KVCacheExhausted

SPECS = [SpecConfig(mode="ar"), SpecConfig(mode="eagle3"), SpecConfig(mode="dflash"),
         SpecConfig(mode="eagle3", tree=TreeConfig(top_k=1, depth=4, total_tokens=5)),
         SpecConfig(mode="whiflash", router="entropy", threshold=1.5),
         SpecConfig(mode="whiflash", router="neural", threshold=0.0, catch_up="eager"), SpecConfig(mode="suffix")]


def jobs(engine: Engine, n: int, seed: int, sampling: bool = False) -> list[tuple]:
    """(prompt, GenerationConfig, SpecConfig): prompts of 1-60 tokens, 4-40 new tokens, every mode."""
    rng = random.Random(seed)
    vocab = engine.target.config.vocab_size
    out = []
    for i in range(n):
        sampler = SamplingConfig(temperature=0.9, top_p=0.95, seed=i) if sampling else SamplingConfig()
        gen = GenerationConfig(max_new_tokens=rng.randrange(4, 40), sampling=sampler)
        out.append(([rng.randrange(1, vocab) for _ in range(rng.randrange(1, 60))], gen, SPECS[i % len(SPECS)]))
    return out


def run_batched(engine: Engine, work: list[tuple], max_running: int, join_every: int = 2) -> list:
    """Submit a new request every `join_every` steps (so requests join and leave mid-stream); -> each one's result."""
    batch, reqs, pending = Batch(engine, max_running), [], list(work)
    while pending or batch.busy:
        if pending:
            prompt, gen, spec = pending.pop(0)
            reqs.append(batch.submit(engine.request(prompt, gen, spec)))
        for _ in range(join_every):
            batch.step()
    return [r.result() for r in reqs]


def assert_same_as_alone(engine: Engine, work: list[tuple], batched: list) -> None:
    for i, ((prompt, gen, spec), got) in enumerate(zip(work, batched)):
        alone = engine.generate(prompt, gen, spec=spec)
        assert got.token_ids == alone.token_ids, f"request {i} ({spec.mode}) differs from its run alone"
        assert got.finish_reason == alone.finish_reason
        assert got.stats["rounds"] == alone.stats["rounds"] and got.stats["tau"] == alone.stats["tau"]
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


@pytest.mark.parametrize("build", ["torch-fp32", "torch-bf16", "compiled-bf16"])
def test_batched_greedy_equals_each_request_alone(request, spec_engine_dir, build):
    engine = (Engine.load(request.getfixturevalue("compiled_spec_engine_dir")) if build == "compiled-bf16" else
              Engine.load(spec_engine_dir, dtype=build.split("-")[1]))
    work = jobs(engine, 12, seed=1)
    assert_same_as_alone(engine, work, run_batched(engine, work, max_running=4))


@pytest.mark.parametrize("build", ["spec_engine", "compiled_spec_engine"])
def test_batched_sampling_draws_from_each_requests_own_generator(request, build):
    engine = request.getfixturevalue(build)
    work = jobs(engine, 8, seed=2, sampling=True)
    assert_same_as_alone(engine, work, run_batched(engine, work, max_running=8, join_every=1))


def test_requests_wait_for_kv_memory_and_one_that_never_fits_is_refused(spec_engine_dir):
    engine = Engine.load(spec_engine_dir)
    per_request = max(engine.slots_needed(engine.request(p, g, s)) for p, g, s in jobs(engine, 6, seed=3))
    # room for two of the longest requests at once
    budget = 2 * -(-per_request // engine.kv.block_size) * engine.kv.bytes_per_block_id
    engine = Engine.load(spec_engine_dir, kv_budget_bytes=budget)
    allocator = engine.kv.allocator
    work = jobs(engine, 6, seed=3)
    batch, reqs, most = Batch(engine, max_running=6), [], 0
    for prompt, gen, spec in work:
        reqs.append(batch.submit(engine.request(prompt, gen, spec)))
    too_long = engine.request([1] * 30, GenerationConfig(max_new_tokens=10 * per_request), SpecConfig(mode="ar"))
    with pytest.raises(KVCacheExhausted, match="on its own it needs"):
        batch.submit(too_long)
    assert allocator.num_free == allocator.num_blocks, "a refused request holds no block"
    while batch.busy:
        batch.step()
        most = max(most, len(batch.running))
    assert 2 <= most < 6, "requests beyond the KV budget must wait, and two fit"
    assert_same_as_alone(engine, work, [r.result() for r in reqs])


def test_cancelled_and_failing_requests_end_alone_and_free_their_blocks(spec_engine):
    work = jobs(spec_engine, 4, seed=4)
    batch = Batch(spec_engine, max_running=4)

    def fail(tokens):
        raise RuntimeError("consumer went away")

    reqs = [batch.submit(spec_engine.request(p, g, s, on_tokens=fail if i == 1 else None))
            for i, (p, g, s) in enumerate(work)]
    batch.step()
    batch.step()
    batch.cancel(reqs[2], RuntimeError("cancelled"))
    batch.run()
    with pytest.raises(RuntimeError, match="consumer went away"):
        reqs[1].result()
    with pytest.raises(RuntimeError, match="cancelled"):
        reqs[2].result()
    keep = [0, 3]
    assert_same_as_alone(spec_engine, [work[i] for i in keep], [reqs[i].result() for i in keep])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_trees_grown_together_equal_trees_grown_alone(spec_engine_dir, dtype):
    engine = Engine.load(spec_engine_dir, dtype=dtype)
    batch = Batch(engine, max_running=4)
    reqs = [batch.submit(engine.request(p, GenerationConfig(max_new_tokens=30), SpecConfig(mode="eagle3")))
            for p, _, _ in jobs(engine, 4, seed=5)]
    batch.step()   # prefill
    batch.step()   # one round: the sequences now differ in length
    proposer = reqs[0].proposers["eagle3"]
    seqs = [r.seq for r in batch.running]
    assert len(seqs) == 4
    for seq in seqs:
        proposer.catch_up(seq)
    together = proposer.propose_many(seqs)
    for seq, got in zip(seqs, together):
        alone = proposer.propose(seq)
        assert (got.tree.tokens, got.tree.parents, got.tree.depths) == (alone.tree.tokens, alone.tree.parents,
                                                                         alone.tree.depths)
    for req in list(batch.running):
        batch.cancel(req, RuntimeError("done"))
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


def test_a_temperature_too_small_to_divide_by_is_greedy_beside_a_greedy_request(spec_engine):
    """1e-40 overflows fp32 logits to inf (NaN probabilities): it is below GREEDY_BELOW_TEMPERATURE, so greedy."""
    prompt, _, _ = jobs(spec_engine, 1, seed=6)[0]
    greedy = GenerationConfig(max_new_tokens=20)
    tiny = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=1e-40, seed=1))
    batch = Batch(spec_engine, max_running=2)
    reqs = [batch.submit(spec_engine.request(prompt, gen, SpecConfig(mode="eagle3"))) for gen in (tiny, greedy)]
    batch.run()
    alone = spec_engine.generate(prompt, greedy, spec=SpecConfig(mode="eagle3")).token_ids
    assert [r.result().token_ids for r in reqs] == [alone, alone]


def poison(req, sampling_field: str = "temperature", value=float("nan")) -> None:
    """Corrupt one request's settings past their validation (as a bug would): its next round raises in the engine."""
    object.__setattr__(req.gen.sampling, sampling_field, value)


def test_a_request_whose_round_raises_ends_alone_and_the_others_are_as_alone(spec_engine):
    """Poisoned after admission: request 1 fails in its prefill's forward (a token id outside the vocabulary),
    request 3 in a later round's verify (NaN temperature: torch.multinomial raises); the rest keep their output."""
    work = jobs(spec_engine, 5, seed=7, sampling=True)
    batch = Batch(spec_engine, max_running=5)
    reqs = [batch.submit(spec_engine.request(p, g, s)) for p, g, s in work]
    reqs[1].seq.prompt_ids[-1] = spec_engine.target.config.vocab_size + 7
    batch.step()
    assert reqs[1].done and not reqs[3].done
    poison(reqs[3])
    batch.run()
    with pytest.raises(IndexError):
        reqs[1].result()
    with pytest.raises(RuntimeError, match="probability tensor"):
        reqs[3].result()
    keep = [0, 2, 4]
    assert_same_as_alone(spec_engine, [work[i] for i in keep], [reqs[i].result() for i in keep])


def test_a_request_whose_drafting_raises_ends_alone_and_the_others_are_as_alone(spec_engine):
    """Request 0 (whiflash mode) loses its route signal after prefill, so its router raises while the batch drafts;
    the batch then drafts each request alone and only request 0 ends. (It is the first to route: the others' routers
    see each signal once, so their rounds and tau match too.)"""
    work = [(jobs(spec_engine, 1, seed=8)[0][0], GenerationConfig(max_new_tokens=30), SPECS[4])]
    work += jobs(spec_engine, 6, seed=9)[1:]
    batch = Batch(spec_engine, max_running=6)
    reqs = [batch.submit(spec_engine.request(p, g, s)) for p, g, s in work]
    batch.step()
    assert batch.running[0] is reqs[0]
    reqs[0].signal = None
    batch.run()
    with pytest.raises(AttributeError):
        reqs[0].result()
    assert_same_as_alone(spec_engine, work[1:], [r.result() for r in reqs[1:]])
