"""A decoder family's draft head (`tandem.models.decoder.DraftHead`, `tandem.models.draft_head`): stored as DeepSeek-V3
stores its MTP layer, built only where the config asks, trained alone by its loss, and added to a model folder from
its trunk's last block."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tandem.models.cli import main
from tandem.models.decoder import DraftHead
from tandem.models.draft_head import add_draft_head
from tandem.models.loading import load_causal_lm
from tandem.models.moe import MoE
from tandem.models.presets import PRESETS, init_model, shape_config, write_model
from tandem.models.weights import load_state_dict, save_state_dict

HEAD_PARTS = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "input_layernorm.weight",
              "post_attention_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
              "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
              "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"}
"""A Qwen3 head's tensors under DeepSeek-V3's MTP names (after `model.layers.{num_hidden_layers}.`)."""


@pytest.fixture(scope="module")
def with_head(tmp_path_factory):
    return init_model("tiny", tmp_path_factory.mktemp("m") / "with-head", seed=1, draft_head=True)


def test_a_head_is_saved_and_loaded_bit_for_bit_under_deepseeks_names(with_head, tmp_path):
    config = json.loads((with_head / "config.json").read_text())
    layers = config["num_hidden_layers"]
    assert config["num_nextn_predict_layers"] == 1
    on_disk = load_file(str(with_head / "model.safetensors"))
    assert {k.removeprefix(f"model.layers.{layers}.") for k in on_disk if k.startswith(f"model.layers.{layers}.")} == HEAD_PARTS
    model = load_causal_lm(str(with_head))
    assert isinstance(model.model.mtp_layers[0], DraftHead) and model.model.mtp_layers[0].layer_idx == layers
    state = model.state_dict()
    save_state_dict(state, tmp_path / "again", config)
    (tmp_path / "again" / "config.json").write_text(json.dumps(config))
    assert load_file(str(tmp_path / "again" / "model.safetensors")).keys() == on_disk.keys()
    again = load_state_dict(tmp_path / "again")
    assert all(torch.equal(again[name], tensor) for name, tensor in state.items() if name != "lm_head.weight")


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-minimax-m2", "tiny-glm4-moe"])
def test_a_folder_has_a_head_exactly_when_its_config_says_so(preset, tmp_path):
    """GLM-4.5's checkpoints carry an MTP layer of their own, a routed block: kept, as a `DraftHead` around it."""
    plain = load_causal_lm(str(init_model(preset, tmp_path / "plain")))
    assert len(plain.model.mtp_layers) == 0
    asked = load_causal_lm(str(write_model(shape_config(dict(PRESETS[preset], num_nextn_predict_layers=1)), tmp_path / "a")))
    assert len(asked.model.mtp_layers) == 1 and isinstance(asked.model.mtp_layers[0], DraftHead)
    assert isinstance(asked.model.mtp_layers[0].mlp, MoE) == (preset == "tiny-glm4-moe")


def test_a_minimax_heads_feed_forward_keeps_the_name_mlp_on_disk(tmp_path):
    folder = init_model("tiny-minimax-m2", tmp_path / "m", draft_head=True)
    head = [k for k in load_file(str(folder / "model.safetensors")) if k.startswith("model.layers.2.")]
    assert "model.layers.2.mlp.down_proj.weight" in head and not any("block_sparse_moe" in k for k in head)
    assert len(load_causal_lm(str(folder)).model.mtp_layers) == 1


def test_the_heads_loss_reaches_the_head_alone(with_head):
    model = load_causal_lm(str(with_head))
    model.requires_grad_(True)
    ids = torch.tensor([[5, 9, 33, 40, 41, 42, 43]])
    positions = torch.arange(7)[None]
    draft = model.predict_after_next(model(ids, positions), ids.roll(-1, 1), positions, detach_inputs=True)
    logits = torch.nn.functional.linear(draft[0, :-2], model.lm_head.weight.detach())  # as `tandem.trainer.mtp` does
    torch.nn.functional.cross_entropy(logits, ids[0, 2:]).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    head = {name for name in grads if ".mtp_layers." in name}
    assert head and all(grads[name] is not None and grads[name].abs().sum() > 0 for name in head)
    assert all(grads[name] is None for name in grads.keys() - head)


def test_add_draft_head_copies_the_trunk_and_starts_the_head_from_its_last_block(tmp_path):
    src = init_model("tiny", tmp_path / "src", seed=2)
    assert main(["add-draft-head", str(src), str(tmp_path / "dst")]) == 0
    trunk, dst = load_state_dict(src), load_state_dict(tmp_path / "dst")
    assert all(torch.equal(dst[name], tensor) for name, tensor in trunk.items())
    head = {name.removeprefix("model.mtp_layers.0."): t for name, t in dst.items() if name.startswith("model.mtp_layers.0.")}
    assert {name for name in head} == HEAD_PARTS
    last = "model.layers.1."
    for part in HEAD_PARTS - {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}:
        assert torch.equal(head[part], trunk[last + part]), part
    hidden = PRESETS["tiny"]["hidden_size"]
    assert torch.equal(head["eh_proj.weight"], torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1))
    assert torch.equal(head["shared_head.norm.weight"], trunk["model.norm.weight"])
    model = load_causal_lm(str(tmp_path / "dst"))
    ids, positions = torch.tensor([[7, 8, 9, 10]]), torch.arange(4)[None]
    assert torch.equal(model(ids, positions), load_causal_lm(str(src))(ids, positions))
    assert {p.name for p in src.iterdir()} <= {p.name for p in (tmp_path / "dst").iterdir()}


def test_a_routed_last_block_leaves_a_head_whose_feed_forward_adds_nothing_yet(tmp_path):
    dst = add_draft_head(str(init_model("tiny-moe", tmp_path / "src")), tmp_path / "dst")
    head = load_state_dict(dst)
    assert torch.equal(head["model.mtp_layers.0.mlp.down_proj.weight"],
                       torch.zeros_like(head["model.mtp_layers.0.mlp.down_proj.weight"]))
    assert head["model.mtp_layers.0.mlp.gate_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("preset, reason", [("tiny-glm4-moe", "GLM-4.5 checkpoints carry an MTP layer of their own"),
                                            ("tiny-glm5", "carry an MTP layer of their own"),
                                            ("tiny", "already has 1 multi-token prediction layer")])
def test_add_draft_head_refuses_what_cannot_take_one(preset, reason, tmp_path, capsys):
    src = init_model(preset, tmp_path / "src", draft_head=preset == "tiny")
    assert main(["add-draft-head", str(src), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert reason in err and str(src / "config.json") in err, err
    assert not (tmp_path / "dst").exists()


def test_add_draft_head_refuses_a_quantized_checkpoint(tmp_path):
    src = init_model("tiny", tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds quantized weights .* add the head to the unquantized checkpoint"):
        add_draft_head(str(src), tmp_path / "dst")
