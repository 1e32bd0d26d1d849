"""LoRA adapters (`tandem.models.lora`): the adapted model, PEFT's files and merge, the engine's merge without drift."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tandem.inference.engine.lora_merge import AdapterMerger
from tandem.models.layers import projection_weight
from tandem.models.loading import load_causal_lm
from tandem.models.lora import (ADAPTER_CONFIG, LoraLinear, LoraSpec, adapted_weight, apply_lora, export_merged, initial_adapters,
                                LoraExperts, lora_experts, lora_modules, read_adapter_folder, write_adapter_folder)
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=TARGETS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return init_model("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


def hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids))


def random_adapters(model: nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Adapters as training would leave them: A and B both away from their start."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in lora_modules(model):
        state[f"{name}.lora_A.weight"] = (torch.randn(module.lora_A.weight.shape, generator=gen) * 0.1).to(dtype)
        state[f"{name}.lora_B.weight"] = (torch.randn(module.lora_B.weight.shape, generator=gen) * 0.1).to(dtype)
    return state


def assert_peft_agrees(with_adapters, tmp_path, ids: torch.Tensor, ours: torch.Tensor, atol: float) -> None:
    """PEFT's model with the folder `tmp_path / "adapters"` gives our logits, and `tandem model export --merge`
    writes PEFT's own merge (`merge_and_unload`) with the same logits."""
    from transformers import AutoModelForCausalLM

    torch.testing.assert_close(with_adapters(ids).logits, ours, atol=atol, rtol=1e-5)
    export_merged(tmp_path / "adapters", tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    peft_merged = with_adapters.merge_and_unload()
    for name, tensor in peft_merged.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    torch.testing.assert_close(exported(ids).logits, ours, atol=atol, rtol=1e-5)


def adapted(folder, spec: LoraSpec = SPEC, adapters_seed: int | None = None, draw=None) -> nn.Module:
    """The model in `folder` with `spec`'s adapters at their start, or drawn by `draw` (default `random_adapters`)
    from `adapters_seed`."""
    model = load_causal_lm(str(folder), "cpu", "float32")
    apply_lora(model, spec, source="test")
    state = initial_adapters(model, seed=0) if adapters_seed is None else (draw or random_adapters)(model, adapters_seed)
    model.load_state_dict(state, strict=False)
    return model


def test_adapters_start_as_the_base_and_the_base_keeps_its_names(tiny):
    base = load_causal_lm(str(tiny), "cpu", "float32")
    model = adapted(tiny)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hidden(model, ids), hidden(base, ids))  # B = 0: the base model, to the bit
    names = {n for n, _ in model.named_parameters()}
    assert set(dict(base.named_parameters())) <= names
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names and "model.layers.1.mlp.down_proj.lora_B.weight" in names
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in names if ".lora_" in n} and len(trainable) == 2 * 7 * base.args.num_hidden_layers
    assert not any(isinstance(m, LoraLinear) for n, m in model.named_modules() if n.endswith("lm_head"))


def test_the_adapted_weight_is_what_the_model_multiplies_by(tiny):
    model = adapted(tiny, adapters_seed=1)
    q = model.model.layers[0].self_attn.q_proj
    base, a, b = q.weight, q.lora_A.weight, q.lora_B.weight
    torch.testing.assert_close(projection_weight(q), base + b @ a * 2.0, rtol=0, atol=1e-6)
    # Every adapted projection, as a merged plain model: the same forward.
    merged = load_causal_lm(str(tiny), "cpu", "float32")
    merged.load_state_dict({f"{n}.weight": m.adapted_weight().detach() for n, m in lora_modules(model)}, strict=False)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(hidden(model, ids), hidden(merged, ids), rtol=0, atol=0)


def test_gradients_reach_only_the_adapters(tiny):
    model = adapted(tiny, adapters_seed=2)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(2))
    hidden(model, ids).square().mean().backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None and param.grad.abs().sum() > 0) == (".lora_" in name), name


def test_a_target_that_names_no_projection_lists_the_models(tiny):
    model = load_causal_lm(str(tiny), "cpu", "float32")
    with pytest.raises(ValueError, match=r"cfg.toml: `lora.target_modules` names \['qkv'\], which match no linear projection.*"
                                         r"\['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        apply_lora(model, LoraSpec(4, 8.0, ("q_proj", "qkv")), source="cfg.toml")


def test_the_adapter_folder_is_peft_s_and_peft_computes_what_tandem_computes(tiny, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    model = adapted(tiny, adapters_seed=3)
    state = {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}
    write_adapter_folder(tmp_path / "adapters", state, SPEC, str(tiny))
    config = json.loads((tmp_path / "adapters" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(tiny))
    spec, read = read_adapter_folder(tmp_path / "adapters")
    assert spec == SPEC and read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state)

    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(hf, tmp_path / "adapters")
    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(3))
    ours = model.lm_head(hidden(model, ids))
    assert_peft_agrees(with_adapters, tmp_path, ids, ours, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_merges_what_the_trainer_multiplies_by_and_never_drifts(tiny, dtype):
    """The engine merges each update into its kept base: after 100 updates, the adapters of the first give the
    first's weights to the bit, and those are the trainer's adapted weights (same function, same dtype)."""
    served = load_causal_lm(str(tiny), "cpu", "float32").to(dtype)
    merger = AdapterMerger(served, SPEC)
    trainer = adapted(tiny).to(dtype)
    first = random_adapters(trainer, seed=10, dtype=dtype)
    merger.apply(first)
    first_weights = {n: p.clone() for n, p in served.state_dict().items()}
    trainer.load_state_dict(first, strict=False)
    for name, module in lora_modules(trainer):
        assert torch.equal(first_weights[f"{name}.weight"], module.adapted_weight()), name
    for seed in range(11, 110):
        merger.apply(random_adapters(trainer, seed=seed, dtype=dtype))
    merger.apply(first)
    assert all(torch.equal(first_weights[n], p) for n, p in served.state_dict().items())
    # what a bad update names, and that it changes nothing
    bad = dict(first)
    bad.pop("model.layers.1.self_attn.q_proj.lora_B.weight")
    with pytest.raises(KeyError, match="without both LoRA matrices.*layers.1.self_attn.q_proj"):
        merger.apply(bad)
    wide = {**first, "model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, served.args.hidden_size, dtype=dtype)}
    with pytest.raises(ValueError, match="rank 4 needs A"):
        merger.apply(wide)
    assert all(torch.equal(first_weights[n], p) for n, p in served.state_dict().items())


def test_adapted_weight_rounds_in_the_base_dtype():
    base = torch.randn(8, 6).to(torch.bfloat16)
    a, b = torch.randn(2, 6), torch.randn(8, 2)
    out = adapted_weight(base, a, b, 0.5)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, base + (b.to(torch.bfloat16) @ a.to(torch.bfloat16)) * 0.5)


def test_export_merge_is_the_base_with_each_adapted_weight_replaced(tiny, tmp_path):
    model = adapted(tiny, adapters_seed=4)
    write_adapter_folder(tmp_path / "a", {n: p.detach() for n, p in model.named_parameters() if ".lora_" in n}, SPEC, str(tiny))
    merged = load_state_dict(export_merged(tmp_path / "a", tmp_path / "m"))
    base = load_state_dict(tiny)
    assert merged.keys() == base.keys()
    for name, tensor in merged.items():
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            assert torch.equal(tensor, model.get_submodule(module).adapted_weight().detach()), name
        else:
            assert torch.equal(tensor, base[name]), name


EXPERT_SPEC = LoraSpec(rank=2, alpha=6.0, target_modules=("q_proj", "o_proj"), target_experts=("gate_up_proj", "down_proj"))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return init_model("tiny-moe", tmp_path_factory.mktemp("tiny-moe"), seed=0)


@pytest.fixture(scope="module")
def moe_families(tiny_moe, tmp_path_factory) -> dict:
    """Qwen3-MoE; GLM-4.5 (a dense first block, a shared expert); MiniMax-M2 (a block-level score bias, `w1`/`w2`/`w3`
    on disk)."""
    return {"tiny-moe": tiny_moe, **{preset: init_model(preset, tmp_path_factory.mktemp(preset), seed=0)
                                      for preset in ("tiny-glm4-moe", "tiny-minimax-m2")}}


def expert_adapters(model: nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Projection and expert adapters as training would leave them: A and B both away from their start."""
    gen = torch.Generator().manual_seed(seed)
    state = random_adapters(model, seed, dtype)
    for name, module in lora_experts(model):
        for projection in module.targets:
            for suffix in ("_lora_A", "_lora_B"):
                shape = getattr(module, projection + suffix).shape
                state[f"{name}.{projection}{suffix}"] = (torch.randn(shape, generator=gen) * 0.1).to(dtype)
    return state


def adapted_moe(tiny_moe, spec: LoraSpec = EXPERT_SPEC, adapters_seed: int | None = None) -> nn.Module:
    return adapted(tiny_moe, spec, adapters_seed, draw=expert_adapters)


def test_expert_adapters_start_as_the_base_and_only_they_and_the_projections_train(tiny_moe):
    base = load_causal_lm(str(tiny_moe), "cpu", "float32")
    model = adapted_moe(tiny_moe)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hidden(model, ids), hidden(base, ids))  # B = 0: the base model, to the bit
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, LoraExperts) and experts.gate_up_proj_lora_A.shape == (8, 2, base.args.hidden_size)
    assert experts.down_proj_lora_B.shape == (8, base.args.hidden_size, 2)
    model = adapted_moe(tiny_moe, adapters_seed=1)
    hidden(model, ids).square().mean().backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None and param.grad.abs().sum() > 0) == ("lora_" in name), name
    assert sum("experts.gate_up_proj_lora_" in n for n, p in model.named_parameters()) == 2 * base.args.num_hidden_layers


def test_the_adapted_experts_are_what_the_model_multiplies_by(tiny_moe):
    model = adapted_moe(tiny_moe, adapters_seed=2)
    experts = model.model.layers[1].mlp.experts
    gate_up, down = experts.expert_weights()
    for e in range(8):
        delta = experts.gate_up_proj_lora_B[e] @ experts.gate_up_proj_lora_A[e] * 3.0
        torch.testing.assert_close(gate_up[e], experts.gate_up_proj[e] + delta, rtol=0, atol=1e-6)
    assert not torch.equal(down, experts.down_proj)
    one_target = adapted_moe(tiny_moe, LoraSpec(2, 6.0, (), ("down_proj",)), adapters_seed=2)
    gate_up, down = one_target.model.layers[1].mlp.experts.expert_weights()
    assert gate_up is one_target.model.layers[1].mlp.experts.gate_up_proj and not torch.equal(down, experts.down_proj)


def test_expert_targets_on_a_model_without_routed_experts_are_an_error(tiny):
    model = load_causal_lm(str(tiny), "cpu", "float32")
    with pytest.raises(ValueError, match=r"cfg.toml: `lora.target_experts` names \['down_proj'\], but the model has no "
                                         r"routed experts"):
        apply_lora(model, LoraSpec(4, 8.0, ("q_proj",), ("down_proj",)), source="cfg.toml")


@pytest.mark.parametrize("family, spec", [
    ("tiny-moe", EXPERT_SPEC), ("tiny-moe", LoraSpec(2, 6.0, (), ("gate_up_proj",))),
    ("tiny-moe", LoraSpec(2, 6.0, ("q_proj",), ("down_proj",))),
    ("tiny-glm4-moe", LoraSpec(2, 6.0, ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_up_proj", "down_proj"))),
    ("tiny-minimax-m2", EXPERT_SPEC),
], ids=["both", "gate_up_only", "down_only", "glm4_moe", "minimax_m2"])
def test_peft_loads_expert_adapters_and_computes_and_merges_what_tandem_does(moe_families, tmp_path, family, spec):
    import peft
    from transformers import AutoModelForCausalLM

    tiny_moe = moe_families[family]
    model = adapted_moe(tiny_moe, spec, adapters_seed=3)
    state = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    write_adapter_folder(tmp_path / "adapters", state, spec, str(tiny_moe))
    config = json.loads((tmp_path / "adapters" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == [f"mlp.experts.{p}" for p in spec.target_experts]
    read_spec, read = read_adapter_folder(tmp_path / "adapters")
    assert read_spec == spec and read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state)

    ids = torch.randint(0, 256, (2, 14), generator=torch.Generator().manual_seed(3))
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32)
    base_logits = hf(ids).logits
    with_adapters = peft.PeftModel.from_pretrained(hf, tmp_path / "adapters")
    assert len([n for n, _ in with_adapters.named_parameters() if "lora_" in n]) == len(state)
    ours = model.lm_head(hidden(model, ids))
    assert not torch.allclose(ours, base_logits, atol=1e-3)  # the adapters move the policy
    assert_peft_agrees(with_adapters, tmp_path, ids, ours, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_merges_expert_adapters_as_the_trainer_multiplies_and_never_drifts(tiny_moe, dtype):
    served = load_causal_lm(str(tiny_moe), "cpu", "float32").to(dtype)
    merger = AdapterMerger(served, EXPERT_SPEC)
    trainer = adapted_moe(tiny_moe).to(dtype)
    first = expert_adapters(trainer, seed=10, dtype=dtype)
    merger.apply(first)
    first_weights = {n: p.clone() for n, p in served.state_dict().items()}
    trainer.load_state_dict(first, strict=False)
    for name, module in lora_experts(trainer):
        gate_up, down = module.expert_weights()
        assert torch.equal(first_weights[f"{name}.gate_up_proj"], gate_up) and torch.equal(first_weights[f"{name}.down_proj"], down)
    for seed in range(11, 40):
        merger.apply(expert_adapters(trainer, seed=seed, dtype=dtype))
    merger.apply(first)
    assert all(torch.equal(first_weights[n], p) for n, p in served.state_dict().items())
    wide = {**first, "model.layers.0.mlp.experts.down_proj_lora_A": torch.zeros(8, 4, 64, dtype=dtype)}
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.down_proj: .* rank 2 needs A \(8, 2, 64\)"):
        merger.apply(wide)
    without_experts = {n: t for n, t in first.items() if "experts" not in n}
    with pytest.raises(KeyError, match=r"missing for \['model.layers.0.mlp.experts.down_proj'"):
        merger.apply(without_experts)
    assert all(torch.equal(first_weights[n], p) for n, p in served.state_dict().items())


def test_a_folder_s_target_parameters_other_than_the_experts_stacks_are_refused(tiny_moe, tmp_path):
    model = adapted_moe(tiny_moe, adapters_seed=6)
    write_adapter_folder(tmp_path, {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}, EXPERT_SPEC, "b")
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_parameters": ["mlp.experts.w1"]}))
    with pytest.raises(ValueError, match=r"adapter_config.json: `target_parameters` = \['mlp.experts.w1'\]: only the routed"):
        read_adapter_folder(tmp_path)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(ValueError, match=r"experts.base_layer.lora_A.weight' nests deeper than the 1 `target_parameters`"):
        read_adapter_folder(tmp_path)


def test_shared_experts_are_projections_and_adapt_beside_the_routed_ones(moe_families):
    """GLM-4.5's shared expert is a dense feed-forward of `nn.Linear`s: `target_modules` adapts it (and the dense first
    block), `target_experts` the routed stacks, and the engine merges both into what the trainer multiplies by."""
    spec = LoraSpec(2, 6.0, TARGETS, ("gate_up_proj", "down_proj"))
    model = load_causal_lm(str(moe_families["tiny-glm4-moe"]), "cpu", "float32")
    names = apply_lora(model, spec, source="test")
    assert {"model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_experts.down_proj", "model.layers.2.mlp.experts"} <= set(names)
    model.load_state_dict(expert_adapters(model, seed=7), strict=False)
    served = load_causal_lm(str(moe_families["tiny-glm4-moe"]), "cpu", "float32")
    AdapterMerger(served, spec).apply(expert_adapters(model, seed=7))
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(hidden(served, ids), hidden(model, ids), rtol=0, atol=1e-5)
    shared = served.model.layers[1].mlp.shared_experts.down_proj.weight
    assert torch.equal(shared, model.model.layers[1].mlp.shared_experts.down_proj.adapted_weight())
