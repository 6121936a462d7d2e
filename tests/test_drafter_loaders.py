"""Drafter and router loaders: public key layouts load; mismatches give errors that name the problem."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tiny_drafters import make_dflash, make_eagle3
from whiflash_trt.config import ModelConfig, RopeConfig
from whiflash_trt.errors import CheckpointError
from whiflash_trt.models.drafter_checkpoints import load_dflash, load_eagle3, save_dflash, save_eagle3
from whiflash_trt.spec.router import RouterMLP
from whiflash_trt.spec.router_file import load_router, save_router

TARGET = ModelConfig(architecture="llama", vocab_size=120, hidden_size=64, intermediate_size=128, num_layers=8,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
                     rope=RopeConfig(theta=500000.0))


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_weights(folder, fn):
    from safetensors.torch import load_file
    state = load_file(str(folder / "model.safetensors"))
    fn(state)
    save_file(state, str(folder / "model.safetensors"))


def test_eagle3_public_layout_round_trips_and_uses_its_own_rope(tmp_path):
    drafter = make_eagle3(TARGET)
    save_eagle3(drafter, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["rope_theta"]                          # like the public LLaMA-3.1 EAGLE-3 config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_eagle3(tmp_path, TARGET)
    assert loaded.config.rope.theta == 10000.0     # never the target's 500000
    assert loaded.config.capture_layers == (1, 3, 4)
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_eagle3_vllm_renamed_layer_keys_load(tmp_path):
    save_eagle3(make_eagle3(TARGET), tmp_path, dtype=torch.float32)
    _edit_weights(tmp_path, lambda s: s.update({k.replace("midlayer.", "layers.0."): s.pop(k)
                                                for k in [k for k in s if k.startswith("midlayer.")]}))
    load_eagle3(tmp_path, TARGET)


def test_eagle3_aux_layer_ids_from_config(tmp_path):
    save_eagle3(make_eagle3(TARGET), tmp_path, dtype=torch.float32)
    _edit_config(tmp_path, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 7]})
    assert load_eagle3(tmp_path, TARGET).config.capture_layers == (0, 3, 6)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=96), "hidden"),
    (dict(target_hidden_size=32), "target_hidden_size"),
    (dict(vocab_size=121), "vocab"),
])
def test_eagle3_that_does_not_fit_the_target_is_refused(tmp_path, change, message):
    save_eagle3(make_eagle3(TARGET), tmp_path, dtype=torch.float32)
    _edit_config(tmp_path, **change)
    with pytest.raises(CheckpointError, match=message):
        load_eagle3(tmp_path, TARGET)


def test_eagle3_missing_key_and_wrong_shape(tmp_path):
    save_eagle3(make_eagle3(TARGET), tmp_path / "a", dtype=torch.float32)
    _edit_weights(tmp_path / "a", lambda s: s.pop("midlayer.self_attn.q_proj.weight"))
    with pytest.raises(CheckpointError, match="missing.*q_proj"):
        load_eagle3(tmp_path / "a", TARGET)
    save_eagle3(make_eagle3(TARGET), tmp_path / "b", dtype=torch.float32)
    _edit_weights(tmp_path / "b", lambda s: s.update(extra=torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected.*extra"):
        load_eagle3(tmp_path / "b", TARGET)
    save_eagle3(make_eagle3(TARGET), tmp_path / "c", dtype=torch.float32)
    _edit_weights(tmp_path / "c", lambda s: s.update({"fc.weight": s["fc.weight"][:, :10].contiguous()}))
    with pytest.raises(CheckpointError, match="fc.weight has shape"):
        load_eagle3(tmp_path / "c", TARGET)


def test_dflash_public_layout_round_trips_with_mask_embedding(tmp_path):
    drafter = make_dflash(TARGET)
    save_dflash(drafter, tmp_path, TARGET.num_layers, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["dflash_config"]["mask_token_id"] == 120
    loaded = load_dflash(tmp_path, TARGET)
    assert loaded.mask_embedding is not None and loaded.config.draft_block_len == 6
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_dflash_mask_token_outside_the_table_needs_the_carried_row(tmp_path):
    save_dflash(make_dflash(TARGET), tmp_path, TARGET.num_layers, dtype=torch.float32)
    _edit_weights(tmp_path, lambda s: s.pop("mask_embedding"))
    with pytest.raises(CheckpointError, match="mask_token_id 120 has no row"):
        load_dflash(tmp_path, TARGET)
    _edit_config(tmp_path, dflash_config={"mask_token_id": 7, "target_layer_ids": [1, 5]})
    assert load_dflash(tmp_path, TARGET).mask_embedding is None   # a spare row in the target's table is used


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=96), "hidden_size"),
    (dict(num_target_layers=12), "12-layer target"),
    (dict(dflash_config={"mask_token_id": 120, "target_layer_ids": [1, 9]}), "target_layer_ids"),
    (dict(dflash_config={"target_layer_ids": [1, 5]}), "mask_token_id"),
])
def test_dflash_that_does_not_fit_the_target_is_refused(tmp_path, change, message):
    save_dflash(make_dflash(TARGET), tmp_path, TARGET.num_layers, dtype=torch.float32)
    _edit_config(tmp_path, **change)
    with pytest.raises(CheckpointError, match=message):
        load_dflash(tmp_path, TARGET)


def test_missing_drafter_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_dflash(tmp_path / "nope", TARGET)


def test_router_round_trip_and_mismatch(tmp_path):
    mlp = RouterMLP(64, 8)
    save_router(mlp, tmp_path / "r.safetensors", threshold=0.75, entropy_threshold=1.25)
    loaded = load_router(tmp_path / "r.safetensors", 64)
    assert loaded.threshold == 0.75 and loaded.entropy_threshold == 1.25
    x = torch.randn(3, 64)
    assert torch.allclose(loaded.mlp(x), mlp(x))
    with pytest.raises(CheckpointError, match="hidden size 64, the target's is 32"):
        load_router(tmp_path / "r.safetensors", 32)
    with pytest.raises(CheckpointError, match="do not exist"):
        load_router(tmp_path / "missing.safetensors", 64)


def test_throughput_router_file_round_trip_and_clear_errors(tmp_path):
    import json
    import math

    from safetensors.torch import save_file

    from whiflash_trt.spec.router import FEATURES, AcceptancePredictor
    from whiflash_trt.spec.router_file import save_throughput_router

    p = AcceptancePredictor(8)
    costs = {"none": 0.07, "eagle3": 0.18, "dflash": 0.13}
    trees = {"eagle3": {"top_k": 3, "depth": 4, "total_tokens": 6}, "dflash": {"total_tokens": 6, "top_k": None}}
    save_throughput_router(p, tmp_path / "r2.safetensors", 1.1, {"eagle3": 1.5, "dflash": 0.7}, costs, 0.5, 0.05,
                           entropy_threshold=0.5, entropy_none_threshold=2.0, trees=trees)
    loaded = load_router(tmp_path / "r2.safetensors", 64)     # v2 does not read the hidden state: any size
    assert (loaded.version, loaded.threshold, loaded.relax, loaded.round_seconds) == (2, 1.1, 0.05, costs)
    assert (loaded.entropy_threshold, loaded.entropy_none_threshold, loaded.trees) == (0.5, 2.0, trees)
    save_throughput_router(p, tmp_path / "untreed.safetensors", 1.1, {}, costs, 0.5, 0.05)   # files before trees
    assert load_router(tmp_path / "untreed.safetensors", 64).trees == {}
    x = torch.randn(3, len(FEATURES))
    assert torch.allclose(loaded.predictor(x), p(x))
    v1 = tmp_path / "r1.safetensors"
    save_router(RouterMLP(64, 8), v1, threshold=0.5)
    assert load_router(v1, 64).version == 1 and load_router(v1, 64).entropy_none_threshold == math.inf
    state = {k: v.contiguous() for k, v in p.state_dict().items()}
    save_file(state, str(tmp_path / "future.safetensors"), metadata={"format": "whiflash-router-v9"})
    with pytest.raises(CheckpointError, match="format 'whiflash-router-v9'"):
        load_router(tmp_path / "future.safetensors", 64)
    meta = {"format": "whiflash-router-v2", "features": "entropy,hidden", "threshold": "1", "alpha": "0.5",
            "relax": "0", "priors": json.dumps({}), "round_seconds": json.dumps(costs)}
    save_file(state, str(tmp_path / "other.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match="trained on features"):
        load_router(tmp_path / "other.safetensors", 64)
    meta |= {"features": ",".join(FEATURES), "trees": "[1, 2]"}
    save_file(state, str(tmp_path / "bad-trees.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match="trees must be a JSON object"):
        load_router(tmp_path / "bad-trees.safetensors", 64)


def test_dflash_draft_vocabulary_round_trips_and_is_checked(tmp_path):
    """save_dflash(draft_vocab=ids) adds draft_vocab_size and EAGLE-3's d2t/t2d maps; they load back, and maps
    that disagree with each other or leave the vocabulary are refused. Without them the drafter uses every id."""
    drafter = make_dflash(TARGET)
    assert drafter.draft_vocab() is None
    ids = torch.tensor([3, 5, 8, 40, 119])
    save_dflash(drafter, tmp_path, TARGET.num_layers, dtype=torch.float32, draft_vocab=ids[[2, 0, 4, 1, 3]])
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == 5
    loaded = load_dflash(tmp_path, TARGET)
    assert torch.equal(loaded.draft_vocab(), ids) and int(loaded.t2d.sum()) == 5
    for k, v in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    _edit_weights(tmp_path, lambda s: s["d2t"].add_(s["t2d"].numel()))
    with pytest.raises(CheckpointError, match="outside the vocabulary"):
        load_dflash(tmp_path, TARGET)
    _edit_weights(tmp_path, lambda s: (s["d2t"].sub_(s["t2d"].numel()), s["t2d"].__setitem__(0, True)))
    with pytest.raises(CheckpointError, match="t2d does not mark"):
        load_dflash(tmp_path, TARGET)
    _edit_weights(tmp_path, lambda s: (s.pop("d2t"), s.pop("t2d")))
    with pytest.raises(CheckpointError, match="missing"):
        load_dflash(tmp_path, TARGET)
    with pytest.raises(ValueError, match="unique target ids"):
        save_dflash(drafter, tmp_path, TARGET.num_layers, draft_vocab=torch.tensor([1, 1, 2]))
