"""The engine with `engine.quantization = "fp8"`: what it holds in FP8, what it computes, FP8 checkpoints, updates,
and the settings it refuses, for dense models and mixtures of experts (routed experts, shared experts). How close
FP8 logprobs stay to the unquantized model's: `check_close_to_unquantized`, with 8 quantized factors per block
(q/k/v, o, gate/up and down products, both factors of each in FP8; the experts' products are the same four)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from fp8_release import CHECKPOINT_SCHEME, DECODER_RELEASE, write_fp8_release
from inference_helpers import (QUANTIZED, assert_same_tensors, check_close_to_unquantized, check_follows_fp8_scheme, engine_for,
                               fp8_rho, fp8_state, generate, teacher_forced_logprobs)
from triton_interpreter import needs_triton_interpreter, run_interpreted

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.config.loader import ConfigError
from tandem.config.resolve import parse_rl_args
from tandem.inference.engine.fp8_blocks import apply_fp8_blocks, check_fp8_device
from tandem.inference.engine.setup import build_engine
from tandem.kernels.fp8 import FP8
from tandem.models.fp8 import Fp8Experts, Fp8Linear, dequantize_weight, fp8_weight_names, quantize_named, quantize_weight
from tandem.models.hub import read_hf_config
from tandem.models.loading import DUMMY_SEED, build_native, load_causal_lm
from tandem.models.presets import init_model
from tandem.models.random_init import initial_value
from tandem.models.weights import load_state_dict, save_state_dict

FACTORS_PER_BLOCK = 8
"""FP8 factors between a block's input and output: both factors of q/k/v, o, gate/up and down."""
QUANTIZED_MOE = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj\.weight|mlp\.(gate|up|down)_proj\.weight|"
                           r"mlp\.shared_experts\.(gate|up|down)_proj\.weight|mlp\.experts\.(gate_up|down)_proj)")
"""The in-memory names of the weights a mixture of experts holds in FP8: attention, a dense block's feed-forward,
shared experts, routed experts."""


def quantized(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The FP8 weights and scales of `state`'s dense projections, as an FP8 checkpoint names them."""
    out = {}
    for name in filter(QUANTIZED.fullmatch, state):
        out[name], out[name + "_scale_inv"] = quantize_weight(state[name])
    return out


@pytest.fixture(scope="module")
def tiny_fp8_dir(tiny_dir, tmp_path_factory):
    """The tiny model as a released FP8 checkpoint stores it: projections in FP8 beside their block scales."""
    folder = tmp_path_factory.mktemp("tiny_fp8") / "model"
    shutil.copytree(tiny_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = CHECKPOINT_SCHEME
    state = load_state_dict(tiny_dir)
    save_state_dict({**state, **quantized(state)}, folder, config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("settings", [{}, {"num_blocks": 12, "max_num_batched_tokens": 40, "max_model_len": 160}],
                         ids=["roomy", "memory-starved"])
def test_the_engine_computes_the_fp8_scheme_through_paging_chunking_and_preemption(tiny_dir, tiny_model, settings):
    """The engine's logprobs against one teacher-forced pass of the same FP8 blocks (`check_follows_fp8_scheme`)."""
    engine = engine_for(tiny_dir, **settings)
    model = load_causal_lm(str(tiny_dir), quantization="fp8")
    apply_fp8_blocks(model, kernels=False)
    check_follows_fp8_scheme(generate(engine, num_requests=8), model, tiny_model)
    if settings:
        assert engine.scheduler.num_preemptions > 0


def test_fp8_logprobs_stay_close_to_the_unquantized_models(tiny_dir, tiny_model):
    check_close_to_unquantized(generate(engine_for(tiny_dir)), tiny_model, "cpu", FACTORS_PER_BLOCK)


@pytest.mark.parametrize("fp8_experts", [True, False])
def test_the_projections_and_routed_experts_are_held_in_fp8(tiny_dir, tiny_moe_dir, tiny_glm_dir, fp8_experts):
    """Embeddings, norms, the LM head and routers keep the model's dtype; the rest of each block is FP8: 7 weights a
    dense block, 4 + 2 a block of routed experts, 4 + 3 + 2 with a shared expert (GLM-4.5's, whose first block is
    dense); without `fp8_experts` the 2 routed experts' weights keep the model's dtype."""
    experts = 2 if fp8_experts else 0
    for folder, num_fp8 in ((tiny_dir, 7 * 2), (tiny_moe_dir, (4 + experts) * 2), (tiny_glm_dir, 7 + (7 + experts) * 2)):
        state = engine_for(folder, fp8_experts=fp8_experts).weight_target.state_dict()
        fp8 = {name for name, t in state.items() if t.dtype == FP8}
        assert len(fp8) == num_fp8 and all(QUANTIZED_MOE.fullmatch(name) for name in fp8), folder
        assert all(name.removesuffix("_scale_inv") in fp8 for name in state if name.endswith("_scale_inv"))
        assert all(t.dtype == torch.float32 for name, t in state.items() if name not in fp8), folder


@pytest.mark.parametrize("fp8_experts", [True, False])
def test_a_bf16_model_names_the_weights_the_engine_holds_in_fp8(tiny_dir, tiny_moe_dir, tiny_glm_dir, fp8_experts):
    """What the trainer's broadcast quantizes (`fp8_weight_names` of its own bf16 model, told
    `weight_transport.fp8_experts`) is what the engine holds in FP8, no more and no less: the dense projections, the
    shared experts' and, with `fp8_experts`, the routed experts'."""
    for folder in (tiny_dir, tiny_moe_dir, tiny_glm_dir):
        state = engine_for(folder, fp8_experts=fp8_experts).weight_target.state_dict()
        held = {name for name, t in state.items() if t.dtype == FP8}
        assert fp8_weight_names(build_native(read_hf_config(folder), "meta", torch.bfloat16), fp8_experts) == held


@pytest.fixture(scope="module")
def tiny_minimax_dir(tmp_path_factory):
    """MiniMax-M2's block: its experts named w1/w3/w2 under `block_sparse_moe` on disk, a score bias on the block."""
    return init_model("tiny-minimax-m2", tmp_path_factory.mktemp("tiny_minimax"), seed=0)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-glm4-moe", "tiny-minimax-m2"])
def test_fp8_experts_compute_the_scheme_and_stay_close_to_the_unquantized_moe(preset, tiny_moe_dir, tiny_glm_dir,
                                                                             request):
    """The engine's logprobs against a teacher-forced pass of the same FP8 model (its experts by the reference,
    expert by expert), as for a dense model; and against the unquantized model within FP8's reach. The families
    whose mixture of experts runs the engine's fused MoE path."""
    folder = {"tiny-moe": tiny_moe_dir, "tiny-glm4-moe": tiny_glm_dir}.get(preset) or request.getfixturevalue("tiny_minimax_dir")
    results = generate(engine_for(folder, fp8_experts=True))
    fp8_model = load_causal_lm(str(folder), quantization="fp8", fp8_experts=True)
    apply_fp8_blocks(fp8_model, kernels=False)
    assert all(isinstance(layer.mlp.experts, Fp8Experts) for layer in fp8_model.layers if hasattr(layer.mlp, "experts"))
    differences = torch.cat([(torch.tensor(lp) - teacher_forced_logprobs(fp8_model, p, ids, t)).abs()
                             for p, ids, lp, t in results.values()])
    assert (differences <= 1e-5).float().mean() >= 0.95 and differences.max() <= 2.0 ** -6
    check_close_to_unquantized(results, load_causal_lm(str(folder)), "cpu", FACTORS_PER_BLOCK)


def test_an_fp8_checkpoint_loads_as_it_is_and_generates(tiny_dir, tiny_fp8_dir):
    """Its FP8 tensors and scales are what the engine holds, bit for bit: the same as quantizing the bf16 checkpoint
    on load, so both engines sample the same tokens with the same logprobs. Without `quantization` the checkpoint's
    weights are dequantized into the model's dtype."""
    from_checkpoint = engine_for(tiny_fp8_dir)
    on_load = engine_for(tiny_dir)
    on_disk = quantized(load_state_dict(tiny_dir))
    assert_same_tensors(fp8_state(from_checkpoint), on_disk)
    assert_same_tensors(fp8_state(on_load), on_disk)
    assert generate(from_checkpoint) == generate(on_load)

    dequantized = engine_for(tiny_fp8_dir, quantization="none")
    state = dequantized.weight_target.state_dict()
    assert not fp8_state(dequantized)
    for name in filter(QUANTIZED.fullmatch, on_disk):
        assert torch.equal(state[name], dequantize_weight(on_disk[name], on_disk[name + "_scale_inv"]))
    generate(dequantized)


@pytest.fixture(scope="module")
def tiny_glm_fp8_dir(tiny_glm_dir, tmp_path_factory):
    """GLM-4.5's tiny model as a released FP8 checkpoint of a mixture of experts stores it: each expert's gate, up
    and down projection in FP8 beside its own `weight_scale_inv`, as are the shared experts and attention."""
    return write_fp8_release(tiny_glm_dir, tmp_path_factory.mktemp("tiny_glm_fp8") / "model", DECODER_RELEASE)


def test_an_fp8_checkpoint_of_experts_loads_as_it_is_and_generates(tiny_glm_dir, tiny_glm_fp8_dir):
    """Each expert's FP8 tensors and scales, stacked, are what the engine holds, bit for bit; the same as quantizing
    the bf16 checkpoint on load, so both engines sample the same tokens with the same logprobs. Without
    `quantization`, or without `fp8_experts`, the experts are dequantized into the model's dtype."""
    on_disk = load_file(str(tiny_glm_fp8_dir / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.up_proj.weight_scale_inv" in on_disk
    from_checkpoint, on_load = engine_for(tiny_glm_fp8_dir, fp8_experts=True), engine_for(tiny_glm_dir, fp8_experts=True)
    assert_same_tensors(fp8_state(from_checkpoint), fp8_state(on_load))
    held = fp8_state(from_checkpoint)
    for j in (0, 7):  # expert j's gate rows, then its up rows, each with the blocks of its own tensor
        prefix = f"model.layers.1.mlp.experts.{j}"
        gate_up = held["model.layers.1.mlp.experts.gate_up_proj"][j].view(torch.uint8)
        gate, up = (on_disk[f"{prefix}.{p}.weight"].view(torch.uint8) for p in ("gate_proj", "up_proj"))
        assert torch.equal(gate_up, torch.cat([gate, up]))
        assert torch.equal(held["model.layers.1.mlp.experts.gate_up_proj_scale_inv"][j], torch.cat(
            [on_disk[f"{prefix}.gate_proj.weight_scale_inv"], on_disk[f"{prefix}.up_proj.weight_scale_inv"]]))
        assert torch.equal(held["model.layers.1.mlp.experts.down_proj_scale_inv"][j],
                           on_disk[f"{prefix}.down_proj.weight_scale_inv"])
    assert generate(from_checkpoint) == generate(on_load)

    expected = dequantize_weight(on_disk["model.layers.2.mlp.experts.3.down_proj.weight"],
                                 on_disk["model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"])
    for quantization in ("none", "fp8"):  # "fp8" without `fp8_experts`: the experts alone in the model's dtype
        dequantized = engine_for(tiny_glm_fp8_dir, quantization=quantization, fp8_experts=False)
        state = dequantized.weight_target.state_dict()
        assert torch.equal(state["model.layers.2.mlp.experts.down_proj"][3], expected)
        assert bool(fp8_state(dequantized)) == (quantization == "fp8")
        generate(dequantized)


def test_experts_updates_quantize_on_load_and_a_quantized_broadcast_equals_them(tiny_glm_dir, tmp_path_factory):
    """A bf16 update reaches every FP8 weight of a mixture of experts (the shared experts' stacks included): the
    engine then samples as one started from those weights. The trainer's quantized broadcast (`quantize_named` of
    the names its bf16 model gives) loads to the same bits."""
    other = init_model("tiny-glm4-moe", tmp_path_factory.mktemp("tiny_glm_other"), seed=1)
    update = load_state_dict(other)
    engine = engine_for(tiny_glm_dir, fp8_experts=True)
    engine.update_weights(update)
    assert generate(engine) == generate(engine_for(other, fp8_experts=True))
    broadcast = engine_for(tiny_glm_dir, fp8_experts=True)
    names = fp8_weight_names(build_native(read_hf_config(tiny_glm_dir), "meta", torch.bfloat16), experts=True)
    sent = dict(quantize_named(update.items(), names))
    assert sum(t.dtype == FP8 for t in sent.values()) == len(names)
    broadcast.update_weights(sent)
    assert_same_tensors(fp8_state(broadcast), fp8_state(engine))


@pytest.mark.parametrize("field, value", [("quant_method", "gptq"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                          ("weight_block_size", [64, 64])])
def test_other_quantization_schemes_are_refused_naming_the_file_and_the_field(tiny_fp8_dir, tmp_path, field, value):
    folder = tmp_path / "model"
    shutil.copytree(tiny_fp8_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**CHECKPOINT_SCHEME, field: value}
    (folder / "config.json").write_text(json.dumps(config))
    for quantization in ("fp8", "none"):
        with pytest.raises(ValueError, match=rf"{re.escape(str(folder / 'config.json'))}: `quantization_config.{field}`"):
            engine_for(folder, quantization=quantization)


def test_a_bf16_update_is_quantized_on_load(tiny_dir, tiny_other_dir):
    """The engine's weights after an update are the update's weights quantized, in the layers and in the stacked
    matrices the blocks multiply by, so it then samples exactly as an engine started from those weights."""
    engine = engine_for(tiny_dir)
    update = load_state_dict(tiny_other_dir)
    engine.update_weights(update)
    assert_same_tensors(fp8_state(engine), quantized(update))
    block = engine.weight_target.layers[1]
    projections = block.forward.args[1]  # the stacks `apply_fp8_blocks` gave the block's forward
    q, q_scale = quantize_weight(update["model.layers.1.self_attn.q_proj.weight"])
    v, v_scale = quantize_weight(update["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(projections.qkv.weight[:128].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(projections.qkv.weight[192:].view(torch.uint8), v.view(torch.uint8))
    assert torch.equal(projections.qkv.scale_inv, torch.cat([q_scale, quantize_weight(
        update["model.layers.1.self_attn.k_proj.weight"])[1], v_scale]))
    assert generate(engine) == generate(engine_for(tiny_other_dir))


def test_dummy_weights_are_the_random_weights_quantized(tiny_dir, tiny_moe_dir):
    engine = engine_for(tiny_dir, load_format="dummy")
    name = "model.layers.0.mlp.down_proj.weight"
    layer = engine.weight_target.get_submodule(name.removesuffix(".weight"))
    assert isinstance(layer, Fp8Linear)
    q, scale_inv = quantize_weight(initial_value(name, layer.weight.shape, DUMMY_SEED, "cpu"))
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale_inv, scale_inv)
    experts = engine_for(tiny_moe_dir, load_format="dummy", fp8_experts=True).weight_target.get_submodule(
        "model.layers.1.mlp.experts")
    assert isinstance(experts, Fp8Experts)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    q, scale_inv = quantize_weight(initial_value(name, experts.gate_up_proj.shape, DUMMY_SEED, "cpu"), parts=2)
    assert torch.equal(experts.gate_up_proj.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(experts.gate_up_proj_scale_inv, scale_inv)


def test_a_gpu_without_fp8_tensor_cores_is_refused_at_engine_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"`engine.quantization` = 'fp8' needs a GPU of compute capability 8.9 or newer.*"
                                         r"NVIDIA A100 has 8.0"):
        check_fp8_device(torch.device("cuda"))
    check_fp8_device(torch.device("cpu"))  # the CPU runs the reference


def test_exact_runs_refuse_fp8(tiny_dir):
    with pytest.raises(ConfigError, match=r"`run.exact` = true with `inference.engine.quantization` = 'fp8': rollouts "
                                          r"from FP8 products cannot be bitwise equal"):
        parse_rl_args(["--run.exact", "true", "--inference.engine.quantization", "fp8"], environ={})
    with pytest.raises(ValueError, match="cannot run exact"):
        build_engine(ModelConfig(name=str(tiny_dir)), EngineConfig(device="cpu", quantization="fp8"), seed=0, exact=True)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer")
def test_fp8_on_cuda_stays_close_to_bf16(tiny_dir):
    """The kernel path: Triton FP8 products, the pointwise kernels around them, decode steps from CUDA graphs."""
    engine = engine_for(tiny_dir, device="cuda", max_num_seqs=8)
    assert engine.runner.graphs is not None
    check_close_to_unquantized(generate(engine), load_causal_lm(str(tiny_dir), "cuda"), "cuda", FACTORS_PER_BLOCK)


INTERPRETED_TILE_TABLE = """
import json
import torch
from inference_helpers import teacher_forced_logprobs
from tandem.inference.engine.fp8_blocks import apply_fp8_blocks
from tandem.models.loading import load_causal_lm

split = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=3, SPLIT_K=2)
model = load_causal_lm({folder!r}, quantization="fp8")
shapes = [f"n={{n}},k={{k}}" for n, k in {shapes!r}]
entries = [{{"num_tokens": 4, "product": "triton", "tiles": split}}, {{"num_tokens": 64, "product": "triton",
            "tiles": dict(split, BLOCK_M=32, SPLIT_K=1)}}]
with open({table!r}, "w") as f:
    json.dump({{"device": "test", "shapes": {{key: entries for key in shapes}}}}, f)
apply_fp8_blocks(model, kernels=False, tile_table={table!r}, max_tokens=20)
weights = [w for block in model.layers for w in vars(block.forward.args[1]).values() if hasattr(w, "tiles")]
assert len(weights) == 4 * len(model.layers), len(weights)
assert all(w.tiles.choose(3) == ("triton", split) and w.tiles.variant_token_counts(20) == [4, 20] for w in weights)
prompt, completion = list(range(1, 12)), list(range(12, 16))
tuned = teacher_forced_logprobs(model, prompt, completion, 1.0)
for w in weights:
    w.tiles = None
rule = teacher_forced_logprobs(model, prompt, completion, 1.0)
assert (tuned - rule).abs().max() <= 1e-4, (tuned - rule).abs().max()  # the order of fp32 sums alone
print("ok")
"""


def tiny_projection_shapes(folder) -> list[tuple[int, int]]:
    """(N, K) of the tiny model's stacked q/k/v, o, gate/up and down weights."""
    config = json.loads((folder / "config.json").read_text())
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return [((heads + 2 * config["num_key_value_heads"]) * head_dim, hidden), (hidden, heads * head_dim),
            (2 * inter, hidden), (hidden, inter)]


@needs_triton_interpreter
def test_a_tile_table_gives_every_projection_its_tiles_under_tritons_interpreter(tiny_dir, tmp_path):
    """`engine.fp8_tile_table` as the engine installs it (`apply_fp8_blocks`), the Triton kernel run by Triton's
    interpreter: each stacked weight gets its shape's choices, every choice is warmed, and the products with the
    table's tiles (a split reduction) give what the rule's give, to the order of fp32 sums."""
    script = INTERPRETED_TILE_TABLE.format(folder=str(tiny_dir), shapes=tiny_projection_shapes(tiny_dir),
                                           table=str(tmp_path / "fp8_tiles.json"))
    run_interpreted(script, timeout=600, folder=str(Path(__file__).parent))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer")
def test_fp8_on_cuda_with_a_tile_table_stays_close_to_bf16(tiny_dir, tmp_path):
    """`engine.fp8_tile_table`: each product takes its table's choice by token count (split Triton tiles for decode
    batches; cuBLAS's block-scaled product from 9 rows on, where the weight is whole 128 x 128 blocks, else the rule),
    every choice warmed at start; the results stay as close to bf16 as the rule's. cuBLAS's entries of a weight it
    does not serve (`scaled_mm_serves`) take the rule."""
    shapes = tiny_projection_shapes(tiny_dir)
    split = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=3, SPLIT_K=2)
    entries = [{"num_tokens": 1, "product": "triton", "tiles": split},
               {"num_tokens": 8, "product": "triton", "tiles": dict(split, SPLIT_K=1)},
               {"num_tokens": 256, "product": "scaled_mm"}]
    table = tmp_path / "fp8_tiles.json"
    table.write_text(json.dumps({"device": "test", "shapes": {f"n={n},k={k}": entries for n, k in shapes}}))
    engine = engine_for(tiny_dir, device="cuda", max_num_seqs=8, fp8_tile_table=str(table))
    projections = engine.runner.model.layers[0].forward.args[1]
    assert projections.qkv.tiles.choose(100) == ("triton", None)  # q, k, v of 128, 64, 64 rows: not whole blocks
    assert projections.o.tiles.choose(100) == projections.down.tiles.choose(9) == ("scaled_mm", None)
    assert projections.gate_up.tiles.choose(1) == ("triton", split)
    assert projections.gate_up.tiles.choose(300) == ("triton", None)  # 6 blocks of rows by one of columns
    check_close_to_unquantized(generate(engine), load_causal_lm(str(tiny_dir), "cuda"), "cuda", FACTORS_PER_BLOCK)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-glm4-moe"])
def test_fp8_experts_on_cuda_stay_close_to_bf16(preset, tiny_moe_dir, tiny_glm_dir):
    """The fused MoE kernels in block FP8 (routed experts), the dense FP8 feed-forward (shared experts), decode steps
    from CUDA graphs; against the same model unquantized, and against the eager FP8 experts (the reference)."""
    folder = {"tiny-moe": tiny_moe_dir, "tiny-glm4-moe": tiny_glm_dir}[preset]
    engine = engine_for(folder, device="cuda", max_num_seqs=8, fp8_experts=True)
    assert engine.runner.graphs is not None and engine.runner.model.layers[1].mlp.forward.func.__name__ == "fused_moe_forward"
    results = generate(engine)
    check_close_to_unquantized(results, load_causal_lm(str(folder), "cuda"), "cuda", FACTORS_PER_BLOCK)
    fp8_model = load_causal_lm(str(folder), "cuda", quantization="fp8", fp8_experts=True)
    apply_fp8_blocks(fp8_model, kernels=False)
    differences = torch.cat([(torch.tensor(lp) - teacher_forced_logprobs(fp8_model, p, ids, t, "cuda")).abs()
                             for p, ids, lp, t in results.values()])
    assert differences.mean() <= fp8_rho(FACTORS_PER_BLOCK, len(fp8_model.layers)) / 4, differences.mean()
