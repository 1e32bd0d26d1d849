"""An engine that does not draft with the policy's multi-token prediction layer (`engine.speculative.method` other
than 'mtp') neither holds nor reads it: it serves the tokens and logprobs of the model with the layer, and takes the
policy updates that carry the layer (a folder reload, the trainer's broadcast in bf16 or quantized, LoRA adapters)
by passing exactly the layer's tensors over."""

import pytest
import torch
from inference_helpers import assert_same_tensors, fp8_state
from inference_helpers import engine_for as fp8_engine_for
from test_engine import engine_for, run
from test_speculative import seeded_requests

from tandem.inference.admin_api import read_update_folder
from tandem.inference.engine import setup
from tandem.models.fp8 import fp8_weight_names, quantize_named
from tandem.models.hub import read_hf_config
from tandem.models.loading import build_native, load_causal_lm
from tandem.models.lora import LoraSpec, apply_lora, initial_adapters
from tandem.models.multi_token import mtp_layers
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict

MODELS = {"glm5": dict(preset="tiny-glm5"), "qwen3-head": dict(preset="tiny", draft_head=True)}
"""GLM-5's own MTP layer (latent attention, a mixture of experts) and a decoder family's draft head."""
SETTINGS = dict(block_size=4, num_blocks=256, max_model_len=128)


def model_dir(name: str, folder, seed: int = 0):
    return init_model(MODELS[name]["preset"], folder, seed=seed, draft_head=MODELS[name].get("draft_head", False))


def generate(engine) -> dict:
    for rid, prompt, params in seeded_requests(8):
        engine.add_request(rid, prompt, params, n=2)
    return run(engine)


def is_mtp_name(name: str) -> bool:
    return name.startswith("model.mtp_layers.")


@pytest.mark.parametrize("name", MODELS)
def test_an_engine_that_does_not_draft_holds_no_mtp_layer_and_serves_the_same(name, tmp_path, monkeypatch):
    """The same tokens and logprobs, bit for bit, as the engine whose model holds the layer (built as before); the
    cache keeps the blocks' layers alone either way; with `method` = 'mtp' the layer is held."""
    folder = model_dir(name, tmp_path / "m")
    plain = engine_for(folder, **SETTINGS)
    assert not mtp_layers(plain.weight_target)
    assert not any(is_mtp_name(n) for n in plain.weight_target.state_dict())
    drafting = engine_for(folder, speculative={"method": "mtp"}, **SETTINGS)
    assert len(mtp_layers(drafting.weight_target)) == 1

    load = setup.load_causal_lm
    monkeypatch.setattr(setup, "load_causal_lm", lambda *args, **kwargs: load(*args, **{**kwargs, "keep_mtp": True}))
    holding = engine_for(folder, **SETTINGS)
    assert len(mtp_layers(holding.weight_target)) == 1
    cache, held_cache = plain.runner.cache, holding.runner.cache
    assert type(cache) is type(held_cache) and cache.layout == held_cache.layout
    assert generate(plain) == generate(holding)


@pytest.mark.parametrize("name", MODELS)
def test_a_folder_read_without_its_mtp_layer_is_the_rest_of_it(name, tmp_path):
    """`keep_mtp` = false: every tensor but the layer's, as read with it."""
    folder = model_dir(name, tmp_path / "m")
    whole, trunk = load_state_dict(folder), load_state_dict(folder, keep_mtp=False)
    assert any(is_mtp_name(n) for n in whole)
    assert_same_tensors(trunk, {n: t for n, t in whole.items() if not is_mtp_name(n)})


@pytest.mark.parametrize("name", MODELS)
def test_updates_that_carry_the_mtp_layer_apply_to_an_engine_without_it(name, tmp_path):
    """The update route reads none of the layer's tensors from a folder for an engine without it. A folder's state
    that carries the layer (as the route reads it for an engine that drafts with it) and the trainer's broadcast (its
    model's in-memory names): the engine passes the layer's tensors over and holds, bit for bit, what an engine
    started from the same folder holds, and samples alike. A name the model lacks is still refused: another MTP
    layer's, a typo's."""
    start, other = model_dir(name, tmp_path / "start"), model_dir(name, tmp_path / "other", seed=1)
    started = engine_for(other, **SETTINGS)
    assert not any(is_mtp_name(n) for n in read_update_folder(other, started.weight_target)[0])
    drafting = engine_for(other, speculative={"method": "mtp"}, **SETTINGS)
    folder_state, _ = read_update_folder(other, drafting.weight_target)
    broadcast_state = load_causal_lm(str(other)).state_dict()
    for state in (folder_state, broadcast_state):
        assert any(is_mtp_name(n) for n in state)
        engine = engine_for(start, **SETTINGS)
        engine.update_weights(state)
        assert not mtp_layers(engine.weight_target)
        assert_same_tensors(engine.weight_target.state_dict(), started.weight_target.state_dict())
    assert generate(engine) == generate(started)
    extra = folder_state["model.layers.0.input_layernorm.weight"]
    for wrong in ("model.mtp_layers.1.enorm.weight", "model.layers.0.input_layernorm.weigth"):
        with pytest.raises(KeyError, match="do not match the model"):
            engine.update_weights({**folder_state, wrong: extra})


def test_mtp_weights_are_refused_by_a_model_whose_checkpoint_has_no_mtp_layer(tiny_dir, tmp_path):
    """Only the layers the engine left out are passed over: a checkpoint without one takes none."""
    head = model_dir("qwen3-head", tmp_path / "head")
    engine = engine_for(tiny_dir, **SETTINGS)
    with pytest.raises(KeyError, match="model.mtp_layers.0"):
        engine.update_weights(read_update_folder(head, engine.weight_target)[0])


def test_a_quantized_broadcast_that_carries_the_mtp_layer_applies_to_an_fp8_engine_without_it(tmp_path):
    """`weight_transport.quantization` = 'fp8': the trainer quantizes what its model holds in FP8, the MTP layer's
    included (`fp8_weight_names`); an FP8 engine without the layer holds what one started from the folder holds."""
    start, other = (init_model("tiny-glm5", tmp_path / f"glm5-{seed}", seed=seed) for seed in (0, 1))
    names = fp8_weight_names(build_native(read_hf_config(other), "meta", torch.bfloat16), experts=True)
    sent = dict(quantize_named(load_state_dict(other).items(), names))
    assert any(is_mtp_name(n) and n.endswith("_scale_inv") for n in sent)
    engine = fp8_engine_for(start, fp8_experts=True)
    engine.update_weights(sent)
    assert not mtp_layers(engine.weight_target)
    assert_same_tensors(fp8_state(engine), fp8_state(fp8_engine_for(other, fp8_experts=True)))


def test_lora_adapters_of_the_mtp_layer_are_passed_over(tmp_path):
    """The trainer's LoRA adapts the draft head's projections too: the engine without the head merges the trunk's
    adapters as it merges them alone."""
    folder = model_dir("qwen3-head", tmp_path / "m")
    lora = {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]}
    trainer_model = load_causal_lm(str(folder))
    apply_lora(trainer_model, LoraSpec(4, 8, ("q_proj", "down_proj")), "test")
    generator = torch.Generator().manual_seed(0)
    adapters = {n: torch.randn(t.shape, generator=generator) / 10 for n, t in initial_adapters(trainer_model, 0).items()}
    assert any(is_mtp_name(n) for n in adapters)
    engines = [engine_for(folder, lora=lora, **SETTINGS) for _ in range(2)]
    engines[0].update_weights(adapters)
    engines[1].update_weights({n: t for n, t in adapters.items() if not is_mtp_name(n)})
    assert_same_tensors(*(engine.weight_target.state_dict() for engine in engines))
    assert not torch.equal(engines[0].weight_target.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           load_state_dict(folder)["model.layers.0.self_attn.q_proj.weight"])
