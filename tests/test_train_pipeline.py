"""End to end on a tiny random target: data -> eagle3 / dflash training -> engine -> lossless decoding, with the
runtime drafting exactly what the training forward computes."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tiny_drafters import build_tiny_engine
from tiny_models import make_tiny_checkpoint
from whiflash_trt.config import DFlashTreeConfig, GenerationConfig, SpecConfig, TreeConfig
from whiflash_trt.models.drafter_checkpoints import load_dflash, load_eagle3
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.train.checkpointing import read_log
from whiflash_trt.train.cli import main as train_main
from whiflash_trt.train.data import TrainingData

STEPS = 12


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = make_tiny_checkpoint(root / "target", "train")
    data = root / "data"
    assert train_main(["data", "--target", str(target), "--output", str(data), "--per-category", "6",
                       "--num-val", "1", "--num-router", "1", "--max-new-tokens", "24", "--lanes", "8",
                       "--shard-size", "8", "--dtype", "fp32", "--max-prompt-tokens", "400"]) == 0
    assert train_main(["data", "--target", str(target), "--output", str(data), "--split", "router",
                       "--max-new-tokens", "24", "--lanes", "8", "--sampled-fraction", "0", "--dtype", "fp32",
                       "--max-prompt-tokens", "400"]) == 0
    common = ["--data", str(data), "--steps", str(STEPS), "--seqs-per-step", "2", "--lr", "3e-3",
              "--warmup-steps", "2", "--no-progress"]
    assert train_main(["eagle3", *common, "--output", str(root / "e3"), "--draft-vocab", "200"]) == 0
    assert train_main(["dflash", *common, "--output", str(root / "df"), "--layers", "2", "--draft-block-len", "4",
                       "--anchors", "8"]) == 0
    return root


@pytest.fixture(scope="module")
def trained_engine_dir(workspace):
    """The tiny target with the EAGLE-3 and DFlash drafters the workspace trained."""
    return build_tiny_engine(workspace / "target", workspace / "engine", ar_drafter=workspace / "e3" / "export",
                             dllm_drafter=workspace / "df" / "export")


def test_data_holds_target_greedy_tokens_and_features(workspace):
    data = TrainingData(workspace / "data")
    manifest = data.manifest
    assert manifest["capture_layers"] == [1, 3, 4]
    assert len(data) > 0 and data.num_tokens() > 0
    seq = data[0]
    assert seq.features.shape == (len(seq.tokens), 3 * 64)
    assert seq.hidden.shape == (len(seq.tokens), 64)


def test_batched_generator_reproduces_the_runtime_greedy_output(workspace):
    engine = Engine.load(build_tiny_engine(workspace / "target", workspace / "engine-ar"), dtype="fp32")
    data = TrainingData(workspace / "data")
    greedy = [data[i] for i in range(len(data)) if data[i].greedy][:3]
    assert greedy
    for seq in greedy:
        response = seq.tokens[seq.prompt_len:].tolist()
        out = engine.generate(seq.tokens[:seq.prompt_len].tolist(), GenerationConfig(max_new_tokens=len(response)))
        k = min(len(out.token_ids), len(response))
        assert out.token_ids[:k] == response[:k] and k > 0


def test_losses_go_down(workspace):
    for run in ("e3", "df"):
        losses = [r["loss"] for r in read_log(workspace / run)]
        assert len(losses) == STEPS
        assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, (run, losses)


def test_checkpoints_decode_losslessly_through_the_runtime(workspace, trained_engine_dir):
    engine = Engine.load(trained_engine_dir, dtype="fp32")
    gen = GenerationConfig(max_new_tokens=40)
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for prompt in ("def add(a, b):", "The quick brown fox"):
        ids = engine.encode(prompt)
        ar = engine.generate(ids, gen, spec=SpecConfig(mode="ar")).token_ids
        for mode in ("eagle3", "dflash", "whiflash"):
            result = engine.generate(ids, gen, spec=SpecConfig(mode=mode))
            assert result.token_ids == ar, mode
            assert result.stats["tau"] >= 1.0


def test_runtime_dflash_block_matches_training_forward(workspace, trained_engine_dir):
    from whiflash_trt.train.dflash_trainer import DFlashLoss, DFlashOptions

    engine = Engine.load(trained_engine_dir, dtype="fp32")
    data = TrainingData(workspace / "data")
    seq = next(data[i] for i in range(len(data)) if len(data[i].tokens) - data[i].prompt_len >= 6)
    drafter = load_dflash(workspace / "df" / "export", engine.target.config).float()
    loss = DFlashLoss(drafter, engine.target, data.feature_columns(drafter.config.capture_layers),
                      DFlashOptions(num_layers=2, draft_block_len=4, loss_vocab_size=0))
    anchor = seq.prompt_len + 2
    with torch.no_grad():
        hidden = loss.forward_blocks(seq.features[:, loss.cols].float(), seq.tokens, torch.tensor([anchor]))
    trained = (hidden[0, 1:] @ engine.target.lm_head.weight.T).argmax(-1).tolist()
    # the runtime at the state "committed x_0..x_{anchor-1}, bonus x_anchor"
    with engine.scratch_sequence(seq.tokens[:anchor].tolist(), anchor + 4) as s:
        s.commit(seq.tokens[:anchor].tolist(), int(seq.tokens[anchor]), seq.features[:anchor].clone())
        proposer = engine.proposers["dflash"].with_tree(DFlashTreeConfig(top_k=1))   # the block's chain
        proposer.catch_up(s)
        drafts = proposer.propose(s).tree.tokens[1:]
    assert drafts == trained


def test_runtime_eagle3_chain_matches_training_forward(workspace, trained_engine_dir):
    from whiflash_trt.train.eagle3_trainer import Eagle3Loss, Eagle3Options

    engine = Engine.load(trained_engine_dir, dtype="fp32")
    data = TrainingData(workspace / "data")
    seq = next(data[i] for i in range(len(data)) if len(data[i].tokens) - data[i].prompt_len >= 6)
    n = seq.prompt_len + 2
    with engine.scratch_sequence(seq.tokens[:n].tolist(), n + 16) as s:
        s.commit(seq.tokens[:n].tolist(), int(seq.tokens[n]), seq.features[:n].clone())
        proposer = engine.proposers["eagle3"].with_tree(TreeConfig(top_k=1, depth=3, total_tokens=4))
        proposer.catch_up(s)
        drafts = proposer.propose(s).tree.tokens[1:]
    # training forward over tokens x_0..x_{n-1}, b, d_1, d_2 with the drafter's own tokens as later inputs
    drafter = load_eagle3(workspace / "e3" / "export", engine.target.config).float()
    loss = Eagle3Loss(drafter, engine.target, data.feature_columns(drafter.config.capture_layers),
                      Eagle3Options(ttt_steps=3))
    tokens = torch.tensor(seq.tokens[:n + 1].tolist() + drafts[:-1])
    feats = seq.features[:n].float()
    base = torch.arange(n)
    g = drafter.fc(feats[:, loss.cols])
    k0v0, diag, trained = None, [], []
    with torch.no_grad():
        for j in range(3):
            idx = (base + 1 + j).clamp(max=len(tokens) - 1)
            h, k0v0, kv = loss.step_forward(loss.embed[tokens[idx]], g, base + j, k0v0, diag)
            diag.append(kv)
            trained.append(int(drafter.to_target_ids(drafter.draft_logprobs(h)[n - 1].argmax())))
            g = h
    assert drafts == trained


def test_resume_continues_the_same_run(workspace, tmp_path):
    data = workspace / "data"
    common = ["--data", str(data), "--seqs-per-step", "2", "--lr", "3e-3", "--warmup-steps", "2", "--no-progress"]
    for kind, extra in (("eagle3", ["--draft-vocab", "200"]), ("dflash", ["--layers", "1", "--block-size", "4"])):
        straight, split = tmp_path / f"{kind}-straight", tmp_path / f"{kind}-split"
        assert train_main([kind, *common, *extra, "--output", str(straight), "--steps", "4"]) == 0
        assert train_main([kind, *common, *extra, "--output", str(split), "--steps", "2"]) == 0
        assert train_main([kind, *common, *extra, "--output", str(split), "--steps", "4"]) == 0
        a, b = read_log(straight), read_log(split)
        assert [r["loss"] for r in a] == [r["loss"] for r in b], kind
        wa = torch.load(straight / "state.pt", weights_only=True)["model"]
        wb = torch.load(split / "state.pt", weights_only=True)["model"]
        assert all(torch.equal(wa[k], wb[k]) for k in wa), kind


def test_router_command_writes_a_router_the_engine_uses(workspace):
    from whiflash_trt.spec.router_file import load_router

    out = workspace / "router.safetensors"
    assert train_main(["router", "--data", str(workspace / "data"), "--eagle3", str(workspace / "e3" / "export"),
                       "--dflash", str(workspace / "df" / "export"), "--output", str(out), "--width", "16",
                       "--cost-prompts", "1"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["num_states"] > 0 and report["selection"]["throughput"]["tokens_per_s"] > 0
    router = load_router(out, 64)
    assert router.version == 2 and router.threshold == report["selection"]["throughput"]["threshold"]
    assert router.entropy_none_threshold == report["selection"]["entropy"]["none_threshold"]
    assert out.stat().st_size < 8192   # a few hundred parameters
    engine = Engine.load(build_tiny_engine(workspace / "target", workspace / "engine-router",
                                           ar_drafter=workspace / "e3" / "export",
                                           dllm_drafter=workspace / "df" / "export", router=out), dtype="fp32")
    gen = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    ids = engine.encode("def add(a, b):")
    ar = engine.generate(ids, gen, spec=SpecConfig(mode="ar")).token_ids
    assert engine.generate(ids, gen, spec=SpecConfig(mode="whiflash", router="neural")).token_ids == ar


def test_router_states_under_a_budget_are_contiguous_windows_over_every_sequence(workspace, trained_engine_dir):
    from whiflash_trt.train.router_trainer import measure_states, simulate

    engine = Engine.load(trained_engine_dir, dtype="fp32")
    data = TrainingData(workspace / "data" / "router")
    spec = SpecConfig(mode="whiflash")
    every = measure_states(engine, data, spec, progress=False)
    seqs = sorted({r.seq for r in every})
    budget = max(len(seqs), len(every) // 3)
    some = measure_states(engine, data, spec, max_states=budget, progress=False)
    assert len(some) <= budget + len(seqs) and {r.seq for r in some} == set(seqs)
    for k in seqs:
        positions = [r.position for r in some if r.seq == k]
        assert positions == list(range(positions[0], positions[0] + len(positions)))
    full = {(r.seq, r.position): (r.al_eagle3, r.al_dflash) for r in every}
    assert all(full[(r.seq, r.position)] == (r.al_eagle3, r.al_dflash) for r in some)   # same states, same ALs
    walked = simulate(some, lambda r: "eagle3", {"eagle3": 1.0, "dflash": 1.0})
    assert walked["rounds"]["eagle3"] >= len(seqs)


def test_eval_command_reports_tau_per_category_and_lossless(workspace, capsys):
    out = workspace / "eval.json"
    assert train_main(["eval", "--data", str(workspace / "data"), "--eagle3", str(workspace / "e3" / "export"),
                       "--dflash", str(workspace / "df" / "export"), "--per-category", "1",
                       "--max-new-tokens", "16", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["lossless"] is True
    assert "mix" in report["eagle3"] and len(report["eagle3"]) >= 3   # json prompts exceed the tiny context
    assert report["eagle3"]["mix"]["tau"] >= 1.0
    assert report["tree"] == dataclasses.asdict(TreeConfig())   # the runtime default
    chain = workspace / "eval-chain.json"
    assert train_main(["eval", "--data", str(workspace / "data"), "--eagle3", str(workspace / "e3" / "export"),
                       "--per-category", "1", "--max-new-tokens", "16", "--tree", "1,3,4,0.1",
                       "--output", str(chain)]) == 0
    report = json.loads(chain.read_text())
    assert report["tree"] == {"top_k": 1, "depth": 3, "total_tokens": 4, "min_prob": 0.1} and report["lossless"] is True
    with pytest.raises(SystemExit, match="TOP_K,DEPTH,TOTAL_TOKENS"):
        train_main(["eval", "--data", str(workspace / "data"), "--eagle3", str(workspace / "e3" / "export"),
                    "--tree", "4,5"])
    df_chain = workspace / "eval-df-chain.json"
    assert train_main(["eval", "--data", str(workspace / "data"), "--dflash", str(workspace / "df" / "export"),
                       "--per-category", "1", "--max-new-tokens", "16", "--dflash-tree-total-tokens", "3",
                       "--dflash-tree-top-k", "1", "--output", str(df_chain)]) == 0
    report = json.loads(df_chain.read_text())
    assert report["dflash_tree"] == {"total_tokens": 3, "top_k": 1, "min_prob": 0.0} and report["lossless"] is True
    assert "tree" not in report and report["dflash"]["mix"]["rounds"] > 0
    with pytest.raises(SystemExit, match="total_tokens must be >= 2"):
        train_main(["eval", "--data", str(workspace / "data"), "--dflash", str(workspace / "df" / "export"),
                    "--dflash-tree-total-tokens", "1"])


def test_generator_drain_keeps_in_flight_sequences_consistent(workspace):
    from whiflash_trt.train.generate import BatchedGenerator
    from whiflash_trt.train.target import load_target

    model, tok = load_target(str(workspace / "target"), "fp32")
    gen = BatchedGenerator(model, (1, 3, 4), lanes=2, max_len=128, eos_ids=())
    g = torch.Generator().manual_seed(0)
    gen.add([1, 5, 6, 7], {"index": 0, "temperature": 0.0}, g)
    gen.add([1, 8, 9], {"index": 1, "temperature": 0.0}, g)
    for _ in range(3):
        assert gen.step(100, g) == []
    drained = gen.drain()
    assert [len(f.tokens) - f.prompt_len for f in drained] == [3, 3]
    assert all(f.features.shape[0] == len(f.tokens) == f.hidden.shape[0] for f in drained)
    assert gen.active == [] and sorted(gen.free) == [0, 1]


def test_growing_a_data_folder_keeps_held_out_prompts_and_shards(tmp_path):
    from whiflash_trt.train.data import read_manifest, read_prompts

    target = make_tiny_checkpoint(tmp_path / "target", "train")
    data = tmp_path / "data"
    args = ["data", "--target", str(target), "--output", str(data), "--num-val", "1", "--num-router", "1",
            "--max-new-tokens", "4", "--lanes", "8", "--shard-size", "8", "--dtype", "fp32",
            "--max-prompt-tokens", "400"]
    assert train_main([*args, "--per-category", "3"]) == 0
    before = {s: read_prompts(data / f"prompts.{s}.jsonl") for s in ("train", "val", "router")}
    shards_before = read_manifest(data)["shards"]
    assert train_main([*args, "--per-category", "6"]) == 0
    after = {s: read_prompts(data / f"prompts.{s}.jsonl") for s in ("train", "val", "router")}
    manifest = read_manifest(data)
    assert after["val"] == before["val"] and after["router"] == before["router"]
    assert after["train"][:len(before["train"])] == before["train"] and len(after["train"]) > len(before["train"])
    held_out = {json.dumps(r.to_json()) for s in ("val", "router") for r in after[s]}
    assert not any(json.dumps(r.to_json()) in held_out for r in after["train"])
    assert manifest["shards"][:len(shards_before)] == shards_before
    done = [i for shard in manifest["shards"] for i in shard["prompt_index"]]
    assert len(done) == len(set(done)) and max(done) >= len(before["train"])   # new prompts decoded, none twice
    assert manifest["options"]["per_category"] == 6 and manifest["growth"][0]["added_prompts"] > 0


def test_a_larger_stdlib_request_keeps_every_prompt_and_its_role():
    from whiflash_trt.train.sources import code_and_prose_prompts

    code, prose = code_and_prose_prompts(5, 5, 0)
    more_code, more_prose = code_and_prose_prompts(600, 600, 0)
    assert more_code[:5] == code and more_prose[:5] == prose
    assert len(more_code) == 600 and any("method of the Python class" in r.messages[-1]["content"] for r in more_code)


def test_lr_schedule_warms_up_then_decays_linearly():
    from whiflash_trt.train.loop import LoopOptions, _lr

    opts = LoopOptions(max_steps=100, lr=1.0, warmup_steps=10, decay_from=60, min_lr_ratio=0.1)
    assert _lr(opts, 0) == pytest.approx(0.1) and _lr(opts, 9) == pytest.approx(1.0)
    assert _lr(opts, 59) == pytest.approx(1.0) and _lr(opts, 80) == pytest.approx(0.55)
    assert _lr(opts, 99) == pytest.approx(1.0 - 0.9 * 39 / 40)
    with pytest.raises(ValueError, match="decay_from"):
        LoopOptions(max_steps=10, decay_from=10)


def test_sigterm_ends_a_training_run_with_a_checkpoint(workspace, tmp_path):
    """A run told to stop finishes its step, saves, and a rerun continues from there."""
    import os
    import signal

    from whiflash_trt.train.dflash_trainer import DFlashLoss
    calls = {"n": 0}
    original = DFlashLoss.__call__

    def stop_during_third_sequence(self, seq, generator):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, seq, generator)

    out = tmp_path / "df"
    args = ["dflash", "--data", str(workspace / "data"), "--output", str(out), "--seqs-per-step", "2",
            "--steps", "6", "--layers", "1", "--block-size", "4", "--no-progress"]
    DFlashLoss.__call__ = stop_during_third_sequence
    try:
        assert train_main(args) == 0
    finally:
        DFlashLoss.__call__ = original
    assert [r["step"] for r in read_log(out)] == [1, 2]          # the step in flight finished, then it stopped
    assert torch.load(out / "state.pt", weights_only=True)["run"]["step"] == 2
    assert train_main(args) == 0
    assert [r["step"] for r in read_log(out)] == [1, 2, 3, 4, 5, 6]


def test_kept_token_level_recomputes_the_generated_features_bit_for_bit(workspace, tmp_path):
    kept, restored = tmp_path / "kept", tmp_path / "restored"
    assert train_main(["keep", "--data", str(workspace / "data"), "--output", str(kept)]) == 0
    assert not list(kept.rglob("features-*")) and (kept / "router" / "manifest.json").is_file()
    with pytest.raises(ValueError, match="whiflash-train features"):
        TrainingData(kept)
    assert train_main(["features", "--data", str(restored), "--tokens-from", str(kept),
                       "--batch-tokens", "300"]) == 0
    for split in ("", "router"):
        generated, recomputed = TrainingData(workspace / "data" / split), TrainingData(restored / split)
        assert len(generated) == len(recomputed) > 0
        for k in range(len(generated)):
            a, b = generated[k], recomputed[k]
            assert torch.equal(a.tokens, b.tokens) and a.prompt_len == b.prompt_len
            assert torch.equal(a.features, b.features) and torch.equal(a.hidden, b.hidden)
    assert train_main(["features", "--data", str(restored)]) == 0   # nothing left to do


def test_dflash_training_can_start_from_a_trained_drafter(workspace, tmp_path):
    from whiflash_trt.train.dflash_trainer import DFlashOptions, make_drafter
    from whiflash_trt.train.target import load_target

    target, _ = load_target(str(workspace / "target"), "fp32")
    trained = load_dflash(workspace / "df" / "export", target.config)
    opts = DFlashOptions(num_layers=2, draft_block_len=4, init_from=str(workspace / "df" / "export"))
    drafter = make_drafter(target, trained.config.target_layer_ids, opts)
    for name, value in trained.state_dict().items():
        if name not in ("d2t", "t2d"):
            assert torch.equal(drafter.state_dict()[name], value.float()), name
    with pytest.raises(ValueError, match="num_layers 2 > 1"):
        make_drafter(target, trained.config.target_layer_ids, dataclasses.replace(opts, num_layers=1))
    common = ["--data", str(workspace / "data"), "--steps", "2", "--seqs-per-step", "2", "--no-progress"]
    assert train_main(["dflash", *common, "--output", str(tmp_path / "df2"), "--layers", "2",
                       "--draft-block-len", "4", "--anchors", "8", "--init-from", str(workspace / "df" / "export")]) == 0
    assert (tmp_path / "df2" / "export" / "model.safetensors").is_file()


@torch.inference_mode()
def test_a_grown_dflash_drafts_what_its_checkpoint_did(workspace):
    """--init-from a 2-layer checkpoint into a 3-layer run: the new layer starts as an identity, so the grown drafter's
    block hidden states equal the checkpoint's before training moves them."""
    from whiflash_trt.train.dflash_trainer import DFlashOptions, make_drafter
    from whiflash_trt.train.target import load_target

    target, _ = load_target(str(workspace / "target"), "fp32")
    trained = load_dflash(workspace / "df" / "export", target.config).float()
    opts = DFlashOptions(num_layers=3, draft_block_len=4, init_from=str(workspace / "df" / "export"))
    grown = make_drafter(target, trained.config.target_layer_ids, opts)
    assert grown.config.num_layers == 3 and not torch.equal(grown.layers[2].self_attn.q_proj.weight,
                                                            torch.zeros_like(grown.layers[2].self_attn.q_proj.weight))
    g = torch.Generator().manual_seed(0)
    n, b, h = 7, trained.config.draft_block_len, target.config.hidden_size
    feats = torch.randn(n, grown.fc.in_features, generator=g)
    block = torch.randn(b, h, generator=g)
    outs = []
    for drafter in (trained, grown):
        c = drafter.config
        k_pool = torch.zeros(c.num_layers, n, c.num_kv_heads, c.head_dim)
        v_pool = torch.zeros_like(k_pool)
        drafter.write_kv_only(feats, torch.arange(n), k_pool, v_pool, torch.arange(n))
        outs.append(drafter(block, torch.arange(n, n + b), k_pool, v_pool, torch.arange(n)))
    assert torch.equal(outs[0], outs[1])


def test_a_folder_written_before_the_token_level_split_still_reads(workspace, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from whiflash_trt.train.data import read_manifest
    from whiflash_trt.train.kept import copy_token_level

    src, old = workspace / "data", tmp_path / "old"
    old.mkdir()
    manifest = read_manifest(src)
    for i, entry in enumerate(manifest["shards"]):   # the one-file layout: tokens and features together
        name = f"shard-{i:05d}.safetensors"
        save_file(load_file(str(src / entry.pop("tokens"))) | load_file(str(src / entry.pop("features"))),
                  str(old / name))
        entry["file"] = name
    (old / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(src / "prompts.train.jsonl", old)
    new_data, old_data = TrainingData(src), TrainingData(old)
    assert len(new_data) == len(old_data) > 0
    assert all(torch.equal(new_data[k].features, old_data[k].features) for k in range(len(new_data)))
    with pytest.raises(ValueError, match="regenerate it"):
        copy_token_level(old, tmp_path / "kept")


def test_dflash_soft_labels_train_towards_the_target_distribution(workspace, tmp_path):
    common = ["--data", str(workspace / "data"), "--steps", str(STEPS), "--seqs-per-step", "2", "--lr", "3e-3",
              "--warmup-steps", "2", "--no-progress"]
    assert train_main(["dflash", *common, "--output", str(tmp_path / "soft"), "--layers", "2",
                       "--draft-block-len", "4", "--anchors", "8", "--soft-labels"]) == 0
    losses = [r["loss"] for r in read_log(tmp_path / "soft")]
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def test_features_of_other_layers_from_the_same_tokens(workspace, tmp_path):
    kept, other = tmp_path / "kept", tmp_path / "other"
    assert train_main(["keep", "--data", str(workspace / "data"), "--output", str(kept)]) == 0
    assert train_main(["features", "--data", str(other), "--tokens-from", str(kept), "--capture-layers", "0,2"]) == 0
    data, generated = TrainingData(other), TrainingData(workspace / "data")
    assert data.capture_layers == (0, 2) and TrainingData(other / "router").capture_layers == (0, 2)
    assert data[0].features.shape == (len(data[0].tokens), 2 * 64)
    assert torch.equal(data[0].hidden, generated[0].hidden)   # the final state does not depend on what is captured
    assert train_main(["features", "--data", str(other), "--capture-layers", "1,3,4"]) == 2   # features exist


def test_eagle3_training_can_start_from_a_trained_drafter(workspace, tmp_path):
    common = ["--data", str(workspace / "data"), "--steps", "2", "--seqs-per-step", "2", "--no-progress"]
    start = workspace / "e3" / "export"
    assert train_main(["eagle3", *common, "--output", str(tmp_path / "e3"), "--init-from", str(start),
                       "--lr", "0"]) == 0   # lr 0: the export is the starting drafter itself
    from whiflash_trt.train.target import load_target

    target, _ = load_target(str(workspace / "target"), "fp32")
    before, after = load_eagle3(start, target.config), load_eagle3(tmp_path / "e3" / "export", target.config)
    assert torch.equal(before.d2t, after.d2t)
    for name, value in before.state_dict().items():
        assert torch.equal(after.state_dict()[name], value), name


@pytest.mark.parametrize("drafter", ["eagle3", "dflash"])
def test_bf16_autocast_training_learns(workspace, tmp_path, drafter):
    common = ["--data", str(workspace / "data"), "--steps", str(STEPS), "--seqs-per-step", "2", "--lr", "3e-3",
              "--warmup-steps", "2", "--no-progress", "--precision", "bf16", "--output", str(tmp_path / drafter)]
    shape = ["--draft-vocab", "200"] if drafter == "eagle3" else ["--layers", "2", "--draft-block-len", "4",
                                                                  "--anchors", "8"]
    assert train_main([drafter, *common, *shape]) == 0
    losses = [r["loss"] for r in read_log(tmp_path / drafter)]
    assert len(losses) == STEPS and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
