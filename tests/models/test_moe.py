"""Mixture-of-experts models: tandem's forward equals transformers' own classes on the same folder,
experts round-trip between their stacked in-memory and per-expert on-disk layouts."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.models.loading import load_causal_lm
from tandem.models.moe import GroupedExperts, permute, unpermute
from tandem.models.presets import PRESETS, init_model, shape_config, write_model
from tandem.models.weights import load_state_dict, save_state_dict

DOCUMENTS = [11, 7, 14]
"""Lengths of the documents packed in the test row."""


def packed_row(vocab_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab_size, (1, sum(DOCUMENTS)), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in DOCUMENTS])[None]
    return ids, positions


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def assert_matches_transformers(folder) -> None:
    """fp32 logprobs of a packed row (several documents) within 1e-5 of transformers' class."""
    ours = load_causal_lm(str(folder), "cpu", "float32")
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert type(theirs).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    ids, positions = packed_row(ours.args.vocab_size)
    with torch.no_grad():
        expected = next_token_logprobs(theirs(input_ids=ids, position_ids=positions, use_cache=False).logits, ids)
        got = next_token_logprobs(ours.lm_head(ours(ids, positions)), ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


TINY_MOE = PRESETS["tiny-moe"]
TINY_GLM = PRESETS["tiny-glm4-moe"]
TINY_MINIMAX = PRESETS["tiny-minimax-m2"]


def write_with_random_biases(shape: dict, out):
    """A model folder whose biases (attention, score correction) are random too: init leaves them 0,
    which would let a model that ignores them pass."""
    hf_config = shape_config(shape)
    folder = write_model(hf_config, out, seed=0)
    generator = torch.Generator().manual_seed(1)
    state = {name: t + 0.1 * torch.randn(t.shape, generator=generator) if name.endswith(("bias", "norm.weight")) else t
             for name, t in load_state_dict(folder).items()}
    save_state_dict(state, folder, hf_config)
    return folder


@pytest.mark.parametrize("shape", [
    TINY_GLM,
    dict(TINY_GLM, use_qk_norm=True, attention_bias=False, n_group=1, topk_group=1, norm_topk_prob=False, first_k_dense_replace=0),
    TINY_MINIMAX,
], ids=["glm4_moe", "glm4_moe-qk-norm", "minimax_m2"])
def test_glm_and_minimax_equal_transformers(shape, tmp_path):
    assert_matches_transformers(write_with_random_biases(shape, tmp_path / "m"))


def test_minimax_checkpoints_name_the_block_and_experts_as_released(tmp_path):
    from safetensors import safe_open

    folder = write_model(shape_config(TINY_MINIMAX), tmp_path / "m")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.layers.0.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.e_score_correction_bias",
            "model.layers.0.block_sparse_moe.experts.7.w1.weight", "model.layers.0.block_sparse_moe.experts.7.w3.weight",
            "model.layers.0.block_sparse_moe.experts.7.w2.weight"} <= names
    assert "model.layers.0.mlp.e_score_correction_bias" in load_state_dict(folder)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return init_model("tiny-moe", tmp_path_factory.mktemp("tiny-moe"), seed=0)


def test_tiny_moe_equals_transformers_qwen3_moe(tiny_moe):
    assert_matches_transformers(tiny_moe)


def test_experts_are_stacked_in_memory_and_per_expert_on_disk(tiny_moe, tmp_path):
    from safetensors import safe_open

    with safe_open(str(tiny_moe / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    assert {"model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.1.mlp.experts.7.down_proj.weight"} <= on_disk
    assert not any("gate_up_proj" in name for name in on_disk)
    state = load_state_dict(tiny_moe)
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * 64, 128)
    assert state["model.layers.1.mlp.experts.down_proj"].shape == (8, 128, 64)
    with safe_open(str(tiny_moe / "model.safetensors"), "pt") as f:
        gate, up = f.get_tensor("model.layers.1.mlp.experts.3.gate_proj.weight"), f.get_tensor("model.layers.1.mlp.experts.3.up_proj.weight")
    assert torch.equal(state["model.layers.1.mlp.experts.gate_up_proj"][3], torch.cat([gate, up]))  # gate rows first


@pytest.mark.parametrize("model_type, block, names", [("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
                                                      ("minimax_m2", "block_sparse_moe", ("w1", "w3", "w2"))])
def test_fp8_experts_and_their_scales_go_per_expert_on_disk_and_back(model_type, block, names):
    """An FP8 checkpoint stores each expert's projections beside their own `weight_scale_inv`, under the family's
    names; in memory they stack as the weights do (gate blocks, then up blocks), and the round trip is exact."""
    from tandem.kernels.fp8 import FP8
    from tandem.models.expert_layout import to_disk, to_memory

    gen = torch.Generator().manual_seed(0)
    state = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 2 * 64, 256, generator=gen).to(FP8),
             "model.layers.0.mlp.experts.gate_up_proj_scale_inv": torch.rand(4, 2, 2, generator=gen),
             "model.layers.0.mlp.experts.down_proj": torch.randn(4, 256, 64, generator=gen).to(FP8),
             "model.layers.0.mlp.experts.down_proj_scale_inv": torch.rand(4, 2, 1, generator=gen)}
    config = {"model_type": model_type, "num_hidden_layers": 1}
    on_disk = to_disk(state, config)
    gate, up, down = (f"model.layers.0.{block}.experts.3.{name}.weight" for name in names)
    assert on_disk[f"{up}_scale_inv"].shape == (1, 2) and on_disk[f"{down}_scale_inv"].shape == (2, 1)
    assert torch.equal(on_disk[f"{up}_scale_inv"], state["model.layers.0.mlp.experts.gate_up_proj_scale_inv"][3, 1:])
    assert torch.equal(on_disk[gate].view(torch.uint8),
                       state["model.layers.0.mlp.experts.gate_up_proj"][3, :64].view(torch.uint8))
    back = to_memory(on_disk, config)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k].view(torch.uint8) if back[k].dtype == FP8 else back[k],
                           state[k].view(torch.uint8) if state[k].dtype == FP8 else state[k]) for k in state)


def test_saved_weights_load_back_into_transformers(tiny_moe, tmp_path):
    """A folder written through `save_state_dict` (what published `weights/step_N` are) is one transformers reads."""
    model = load_causal_lm(str(tiny_moe))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    config = json.loads((tiny_moe / "config.json").read_text())
    out = tmp_path / "step_1"
    save_state_dict(model.state_dict(), out, config)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tiny_moe / name).read_bytes())
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, positions = packed_row(260, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids, position_ids=positions, use_cache=False).logits,
                                   model.lm_head(model(ids, positions)), atol=1e-5, rtol=0)


def test_permute_groups_tokens_by_expert_and_unpermute_sums_their_copies():
    expert_ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order, counts = permute(expert_ids, num_experts=4)
    assert counts.tolist() == [2, 2, 2, 0]
    assert (expert_ids.reshape(-1)[order]).tolist() == [0, 0, 1, 1, 2, 2]
    x = torch.randn(3, 5)
    rows = x[order // 2]  # identity experts
    weights = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 2.0]])
    torch.testing.assert_close(unpermute(rows, order, weights), x * weights.sum(1, keepdim=True))


def test_grouped_experts_compute_each_experts_swiglu():
    experts = GroupedExperts(num_experts=3, hidden_size=8, intermediate_size=4)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    counts = torch.tensor([2, 0, 3])
    x = torch.randn(5, 8)
    expected = []
    for row, e in zip(x, [0, 0, 2, 2, 2]):
        gate, up = experts.gate_up_proj[e][:4] @ row, experts.gate_up_proj[e][4:] @ row
        expected.append(experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(experts(x, counts), torch.stack(expected))


@pytest.mark.parametrize("model_type, field, value", [
    ("qwen3_moe", "use_sliding_window", True),
    ("qwen3_moe", "hidden_act", "gelu"),
    ("qwen3", "rope_parameters", {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}),
    ("glm4_moe", "n_group", 3),
    ("minimax_m2", "scoring_func", "softmax"),
    ("minimax_m2", "attn_type_list", [0, 1]),
    ("minimax_m2", "quantization_config", {"quant_method": "awq"}),
])
def test_unsupported_config_values_name_the_field_and_file(model_type, field, value, tmp_path):
    shape = {"qwen3_moe": TINY_MOE, "qwen3": dict(TINY_MOE, model_type="qwen3"), "glm4_moe": TINY_GLM,
             "minimax_m2": TINY_MINIMAX}[model_type]
    folder = write_model(shape_config(shape), tmp_path / "m", weights=False)
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    reported = {"rope_parameters": "rope_type", "quantization_config": "quantization_config.quant_method"}.get(field, field)
    with pytest.raises(ValueError, match=f"{folder / 'config.json'}: `{reported}` = "):
        load_causal_lm(str(folder))


def test_weights_of_another_architecture_name_the_folder_and_tensors(tiny_moe, tmp_path):
    """A dense Qwen3 checkpoint under a Qwen3-MoE config: the experts and routers are missing."""
    dense = init_model("tiny", tmp_path / "dense")
    (dense / "config.json").write_bytes((tiny_moe / "config.json").read_bytes())
    with pytest.raises(KeyError, match=rf"the weights in {dense} do not match the model: missing \['model.layers.0.mlp.gate.weight'"):
        load_causal_lm(str(dense))


def test_a_missing_expert_names_its_tensor(tiny_moe, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_moe / name).read_bytes())
    tensors = load_file(str(tiny_moe / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]  # the last: counts come from all three projections
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match="lacks model.layers.1.mlp.experts.7.up_proj.weight"):
        load_state_dict(folder)


def test_glm_routers_stay_fp32_in_a_bf16_model(tmp_path):
    """As transformers and vLLM keep them: the router weight and score bias choose experts in fp32."""
    folder = write_model(shape_config(TINY_GLM), tmp_path / "m")
    model = load_causal_lm(str(folder), "cpu", "bfloat16")
    router = model.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None]).dtype == torch.bfloat16


def test_glm_multi_token_prediction_layers_are_kept_and_nothing_past_them(tmp_path):
    """GLM-4.5 checkpoints hold `num_nextn_predict_layers` routed blocks after the last one (`model.layers.{N}`):
    kept as the model's MTP layers (`model.mtp_layers`), experts and router included; a tensor past them is an
    error."""
    from safetensors.torch import load_file, save_file

    folder = write_model(shape_config(dict(TINY_GLM, num_nextn_predict_layers=1)), tmp_path / "m")
    tensors = load_file(str(folder / "model.safetensors"))
    state = load_causal_lm(str(folder)).state_dict()
    for in_memory, on_disk in (("eh_proj.weight", "eh_proj.weight"), ("mlp.gate.e_score_correction_bias",) * 2,
                               ("self_attn.q_proj.weight",) * 2):
        assert torch.equal(state[f"model.mtp_layers.0.{in_memory}"], tensors[f"model.layers.3.{on_disk}"]), in_memory
    assert torch.equal(state["model.mtp_layers.0.mlp.experts.down_proj"][7], tensors["model.layers.3.mlp.experts.7.down_proj.weight"])
    save_file(dict(tensors, **{"model.layers.4.eh_proj.weight": torch.zeros(2, 2)}), str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match=r"unexpected \['model.mtp_layers.1.eh_proj.weight'\]"):
        load_causal_lm(str(folder))
