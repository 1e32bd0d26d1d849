"""GLM-5 and DeepSeek-V3 (latent attention) in FP8: their released block-FP8 checkpoints in the engine (held as they
are, or dequantized), `engine.quantization = "fp8"` over the latent cache (prefill chunks in the expanded form,
decodes in the absorbed one), bf16 updates quantized on load and the trainer's quantized broadcast, and the
checkpoints the engine refuses. The trainer's side of the same checkpoints: `tests/trainer/test_fp8_checkpoints.py`.

A latent block has 6 products in FP8 between its input and output (q_a, q_b, kv_a, o, gate/up, down; the indexer's
only choose tokens), both factors of each: 12 quantized factors per block."""

import json
import re
import shutil

import pytest
import torch
from fp8_release import CHECKPOINT_SCHEME, LATENT_RELEASE, write_fp8_release
from inference_helpers import (assert_same_tensors, check_close_to_unquantized, check_follows_fp8_scheme, engine_for, fp8_rho,
                               fp8_state, generate, teacher_forced_logprobs)
from safetensors.torch import load_file, save_file

from tandem.inference.engine.fp8_blocks import apply_fp8_blocks
from tandem.inference.engine.kv_cache import LatentCache
from tandem.kernels.fp8 import FP8
from tandem.models.fp8 import Fp8Experts, dequantize_weight, fp8_weight_names, quantize_named
from tandem.models.hub import read_hf_config
from tandem.models.loading import build_native, load_causal_lm
from tandem.models.presets import init_model
from tandem.models.weights import load_state_dict

FACTORS_PER_BLOCK = 12
"""FP8 factors between a latent block's input and output: both factors of q_a, q_b, kv_a, o, gate/up and down."""
HELD_IN_FP8 = re.compile(r"model\.(layers|mtp_layers)\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|indexer\.(wq_b|wk))"
                         r"\.weight|mlp\.((shared_experts\.)?(gate|up|down)_proj\.weight|experts\.(gate_up|down)_proj))")
"""The in-memory names of the weights the engine holds in FP8 for these families (with `fp8_experts`), the multi-token
prediction layer's (`model.mtp_layers`) among them: not kv_b_proj, the indexer's weights_proj, or `eh_proj`."""
PRESETS = ["tiny-glm5", "tiny-deepseek-v3"]


@pytest.fixture(scope="module")
def bf16_dirs(tmp_path_factory) -> dict[str, object]:
    return {preset: init_model(preset, tmp_path_factory.mktemp(preset), seed=0) for preset in PRESETS}


@pytest.fixture(scope="module")
def fp8_dirs(bf16_dirs, tmp_path_factory) -> dict[str, object]:
    """Each preset as GLM-5-FP8 / DeepSeek-V3 are released (`fp8_release.LATENT_RELEASE`)."""
    return {preset: write_fp8_release(folder, tmp_path_factory.mktemp(f"{preset}-fp8") / "model", LATENT_RELEASE)
            for preset, folder in bf16_dirs.items()}


def fp8_reference(folder) -> torch.nn.Module:
    """The model as the engine holds it in FP8, run by the engine's FP8 blocks outside the engine (torch's reference)."""
    model = load_causal_lm(str(folder), quantization="fp8", fp8_experts=True)
    apply_fp8_blocks(model, kernels=False)
    return model


@pytest.mark.parametrize("preset", PRESETS)
def test_a_released_fp8_checkpoint_loads_as_it_is_and_the_rest_dequantized(preset, fp8_dirs):
    """The FP8 weights the engine holds are the checkpoint's, bit for bit (each expert's stacked), the multi-token
    prediction layer's included (an engine that drafts with it); kv_b_proj, FP8 on disk, is held dequantized;
    without `quantization` everything is."""
    folder = fp8_dirs[preset]
    on_disk = load_file(str(folder / "model.safetensors"))
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert f"model.layers.{layers}.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in on_disk  # the MTP layer's
    engine = engine_for(folder, fp8_experts=True, speculative={"method": "mtp"})
    held = fp8_state(engine)
    fp8 = {name for name, t in held.items() if t.dtype == FP8}
    assert fp8 and all(HELD_IN_FP8.fullmatch(name) for name in fp8)
    state = engine.weight_target.state_dict()
    assert {n for n, t in state.items() if HELD_IN_FP8.fullmatch(n)} == fp8  # every one of those, and no more
    same_names = {name: name for name in ("model.layers.1.self_attn.q_a_proj.weight", "model.layers.0.mlp.down_proj.weight",
                                          "model.layers.2.mlp.shared_experts.up_proj.weight",
                                          "model.layers.1.self_attn.o_proj.weight")}
    mtp = {f"model.mtp_layers.0.{name}": f"model.layers.{layers}.{name}"
           for name in ("self_attn.q_b_proj.weight", "mlp.shared_experts.down_proj.weight")}
    for in_memory, disk in (same_names | mtp).items():
        assert torch.equal(held[in_memory].view(torch.uint8), on_disk[disk].view(torch.uint8)), in_memory
        assert torch.equal(held[in_memory + "_scale_inv"], on_disk[disk + "_scale_inv"]), in_memory
    assert state["model.mtp_layers.0.eh_proj.weight"].dtype == torch.float32
    gate = on_disk["model.layers.1.mlp.experts.5.gate_proj.weight"]
    assert torch.equal(held["model.layers.1.mlp.experts.gate_up_proj"][5, :gate.shape[0]].view(torch.uint8),
                       gate.view(torch.uint8))
    if preset == "tiny-glm5":
        assert "model.layers.0.self_attn.indexer.wk.weight" in fp8
        assert state["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32

    dequantized = {"model.layers.1.self_attn.kv_b_proj.weight": "model.layers.1.self_attn.kv_b_proj.weight",
                   "model.mtp_layers.0.self_attn.kv_b_proj.weight": f"model.layers.{layers}.self_attn.kv_b_proj.weight"}
    unquantized = engine_for(folder, quantization="none", speculative={"method": "mtp"}).weight_target.state_dict()
    assert not any(t.dtype == FP8 for t in unquantized.values())
    for in_memory, disk in dict(dequantized, **{"model.layers.1.self_attn.o_proj.weight":
                                                "model.layers.1.self_attn.o_proj.weight"}).items():
        expected = dequantize_weight(on_disk[disk], on_disk[disk + "_scale_inv"])
        assert torch.equal(unquantized[in_memory], expected), in_memory
        if in_memory in dequantized:
            assert torch.equal(state[in_memory], expected), in_memory


@pytest.mark.parametrize("preset", PRESETS)
def test_the_fp8_latent_engine_computes_the_scheme_and_stays_close_to_bf16(preset, fp8_dirs):
    """Prompts of 1 to 60 tokens, 24 tokens each, through the latent cache (prefill chunks expanded, decodes absorbed;
    tiny-glm5's DSA keeps 64 tokens, fewer than the longest contexts).

    - Against a teacher-forced pass of the same FP8 model (the scheme), as for the other families
      (`check_follows_fp8_scheme`).
    - Against the bf16 model on the same dequantized weights, the trainer's teacher-forced forward: within FP8's reach
      (`fp8_rho` of 12 factors a block), the bound the other families meet; the bf16 engine on those weights gives
      the trainer's logprobs (within fp32 rounding), so the FP8 engine is as close to it as to the trainer."""
    folder = fp8_dirs[preset]
    engine = engine_for(folder, fp8_experts=True)
    assert isinstance(engine.runner.cache, LatentCache)
    results = generate(engine)
    bf16_model = load_causal_lm(str(folder))
    check_follows_fp8_scheme(results, fp8_reference(folder), bf16_model)
    check_close_to_unquantized(results, bf16_model, "cpu", FACTORS_PER_BLOCK)
    for p, ids, lp, t in generate(engine_for(folder, quantization="none")).values():
        torch.testing.assert_close(torch.tensor(lp), teacher_forced_logprobs(bf16_model, p, ids, t), atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_bf16_model_names_the_weights_the_engine_holds_in_fp8(preset, bf16_dirs):
    """What the trainer's broadcast quantizes (`fp8_weight_names` of its bf16 model) is what an engine drafting with
    the multi-token prediction layer holds in FP8; one that does not holds the rest (it passes the layer's over)."""
    folder = bf16_dirs[preset]
    for experts in (True, False):
        names = fp8_weight_names(build_native(read_hf_config(folder), "meta", torch.bfloat16), experts)
        drafting, plain = ({name for name, t in fp8_state(engine_for(folder, fp8_experts=experts, speculative=spec)).items()
                            if t.dtype == FP8} for spec in ({"method": "mtp"}, {}))
        assert names == drafting
        assert plain == {name for name in names if not name.startswith("model.mtp_layers.")} != names


def test_updates_are_quantized_on_load_and_a_quantized_broadcast_equals_them(bf16_dirs, tmp_path):
    """A bf16 update (a folder's, read as `load_state_dict`) reaches every FP8 weight of the latent blocks, including
    the projections the attention calls as modules: the engine then samples as one started from those weights. The
    trainer's broadcast (`quantize_named` of the names its bf16 model gives) loads to the same bits, which are the
    weights quantized on the server."""
    other = init_model("tiny-glm5", tmp_path / "other", seed=1)
    update = load_state_dict(other)
    engine = engine_for(bf16_dirs["tiny-glm5"], fp8_experts=True)
    engine.update_weights(update)
    started = engine_for(other, fp8_experts=True)
    assert_same_tensors(fp8_state(engine), fp8_state(started))
    assert generate(engine) == generate(started)
    attention = engine.weight_target.layers[1].self_attn  # the blocks the FP8 products read are the layers' tensors
    assert attention.q_b_proj.forward.keywords["weight"].weight.data_ptr() == attention.q_b_proj.weight.data_ptr()
    stacked = attention.input_projections.args[0].weight  # q_a's rows, then kv_a's
    assert stacked.data_ptr() == attention.q_a_proj.weight.data_ptr()
    assert attention.kv_a_proj_with_mqa.weight.data_ptr() == stacked[attention.q_a_proj.out_features:].data_ptr()

    broadcast = engine_for(bf16_dirs["tiny-glm5"], fp8_experts=True)
    names = fp8_weight_names(build_native(read_hf_config(other), "meta", torch.bfloat16), experts=True)
    sent = dict(quantize_named(update.items(), names))
    assert sum(t.dtype == FP8 for t in sent.values()) == len(names)
    broadcast.update_weights(sent)
    assert_same_tensors(fp8_state(broadcast), fp8_state(engine))
    assert isinstance(broadcast.weight_target.layers[1].mlp.experts, Fp8Experts)


@pytest.mark.parametrize("field, value", [("quant_method", "gptq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                          ("weight_block_size", [64, 64])])
def test_other_schemes_are_refused_before_any_weight_is_read(field, value, fp8_dirs, tmp_path):
    """From config.json alone, naming it and the field, for the engine (FP8 or not) and the trainer's model: the
    folder holds no weights, so a refusal that read them would say so instead."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(fp8_dirs["tiny-glm5"] / "config.json", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, quantization_config={**CHECKPOINT_SCHEME, field: value})))
    source = re.escape(str(folder / "config.json"))
    for quantization in ("fp8", "none"):
        with pytest.raises(ValueError, match=rf"{source}: `quantization_config.{field}` = "):
            load_causal_lm(str(folder), quantization=quantization)
    with pytest.raises(ValueError, match=rf"{source}: `quantization_config.{field}` = "):
        build_native(read_hf_config(folder), "meta", source=str(folder / "config.json"))


def test_an_fp8_weight_without_its_scales_is_refused_naming_it(fp8_dirs, tmp_path):
    """Nothing is copied into the model unless every tensor fits: the error names the tensor and the folder."""
    folder = tmp_path / "model"
    shutil.copytree(fp8_dirs["tiny-deepseek-v3"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_b_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"))
    for quantization in ("fp8", "none"):
        with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}: model.layers.1.self_attn.q_b_proj.weight is FP8 "
                                             r"but model.layers.1.self_attn.q_b_proj.weight_scale_inv is missing"):
            load_causal_lm(str(folder), quantization=quantization)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize("preset", PRESETS)
def test_fp8_latent_engine_on_cuda_stays_close_to_bf16(preset, fp8_dirs):
    """The kernel path: Triton FP8 products (the dense ones and the fused MoE's), the latent attention and DSA kernels
    over the cache, decode steps replayed from CUDA graphs; against the bf16 model on the same dequantized weights
    (the trainer's forward), and against the eager FP8 reference."""
    folder = fp8_dirs[preset]
    engine = engine_for(folder, device="cuda", max_num_seqs=8, fp8_experts=True)
    assert isinstance(engine.runner.cache, LatentCache) and engine.runner.graphs is not None
    results = generate(engine)
    bf16_model = load_causal_lm(str(folder), "cuda")
    check_close_to_unquantized(results, bf16_model, "cuda", FACTORS_PER_BLOCK)
    fp8_model = load_causal_lm(str(folder), "cuda", quantization="fp8", fp8_experts=True)
    apply_fp8_blocks(fp8_model, kernels=False)
    differences = torch.cat([(torch.tensor(lp) - teacher_forced_logprobs(fp8_model, p, ids, t, "cuda")).abs()
                             for p, ids, lp, t in results.values()])
    assert differences.mean() <= fp8_rho(FACTORS_PER_BLOCK, len(fp8_model.layers)) / 4, differences.mean()
