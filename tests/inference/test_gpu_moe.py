"""The engine's MoE kernels on CUDA: the fused grouped GEMM against the model's MoE, inside a CUDA
graph, and the engine (bf16, CUDA graphs) against a teacher-forced pass of the model."""


import pytest
import torch
from inference_helpers import check_against_replayed_routing

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.fused_moe import RoutingRecorder, apply_fused_moe, fused_experts
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm
from tandem.models.moe import MoE, MoEArgs
from tandem.models.presets import init_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """The compiled router is one code object: these tests build every router variant in two dtypes in one
    process, more than dynamo's recompile limit (8) allows, which one engine (one model) never nears."""
    torch._dynamo.reset()
    yield


ROUTERS = {
    "qwen3-moe": dict(norm_topk_prob=True),
    "glm-4.5": dict(score_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    score_bias="router", router_fp32=True, num_shared_experts=1),
    "minimax-m2": dict(score_func="sigmoid", norm_topk_prob=True, score_bias="block"),
}


def random_moe(dtype: torch.dtype, **args) -> MoE:
    """16 experts, top-4; features that are not multiples of the kernel's tiles (masked edges)."""
    torch.manual_seed(0)
    moe = MoE(MoEArgs(**{"num_experts": 16, "top_k": 4, "hidden_size": 96, "intermediate_size": 80, **args}))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return moe.to("cuda", dtype)


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("num_tokens", [1, 5, 100, 300])  # row blocks of 16, 16, 32, 64
def test_fused_experts_equal_the_models_moe(router, dtype, tolerance, num_tokens):
    moe = random_moe(dtype, **ROUTERS[router])
    x = torch.randn(1, num_tokens, 96, device="cuda", dtype=dtype)
    with torch.no_grad():
        expected = moe(x).float()
        apply_fused_moe(moe)
        out = moe(x).float()
    assert (out - expected).abs().max().item() <= tolerance * expected.abs().max().item()


TILES = [dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=5),
         dict(BLOCK_M=32, BLOCK_N=256, BLOCK_K=128, GROUP_M=16, num_warps=8, num_stages=2),
         dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=4)]


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("num_tokens", [1, 100, 600])
def test_fused_experts_equal_the_models_moe_with_any_tuned_tiles(tiles, num_tokens):
    """Tiles a tuned table may name (`benchmarks/moe_tune.py`'s grid): K both a multiple of BLOCK_K and not."""
    moe = random_moe(torch.bfloat16, **ROUTERS["qwen3-moe"])
    x = torch.randn(num_tokens, 96, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = moe(x[None])[0].float()
        weights, expert_ids = moe.gate(x)
        out = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, expert_ids,
                            (tiles, dict(tiles, BLOCK_K=16))).float()
    assert (out - expected).abs().max().item() <= 2e-2 * expected.abs().max().item()


def test_fused_moe_replays_in_a_cuda_graph_whatever_the_routing():
    moe = random_moe(torch.bfloat16, **ROUTERS["qwen3-moe"])
    reference = random_moe(torch.bfloat16, **ROUTERS["qwen3-moe"])
    recorder = RoutingRecorder(1, 8, 4, torch.device("cuda"))
    apply_fused_moe(moe, recorder)
    static = torch.randn(1, 8, 96, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        moe(static)  # warmup: compilation outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = moe(static)
        for seed in range(3):
            torch.manual_seed(seed)
            static.copy_(torch.randn_like(static))  # new tokens: new routing, same graph
            graph.replay()
            expected_ids = reference.gate(static[0])[1]
            torch.testing.assert_close(out, reference(static), atol=3e-2, rtol=3e-2)
            assert torch.equal(recorder.expert_ids[0].long(), expected_ids)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-glm4-moe"])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_moe_engine_with_cuda_graphs_matches_a_teacher_forced_pass(preset, dtype, atol, tmp_path):
    """Prefill chunks through the kernels, decodes through the graphs. The reference replays the experts
    the engine reports (bf16: a near tie routed differently would be a different model, not an error)."""
    folder = init_model(preset, tmp_path / preset, seed=0)
    name = "float32" if dtype == torch.float32 else "bfloat16"
    engine = build_engine(ModelConfig(name=str(folder), dtype=name),
                          EngineConfig(device="cuda", max_num_seqs=16, max_model_len=256, max_num_batched_tokens=96), seed=0)
    assert engine.runner.graphs is not None
    model = load_causal_lm(str(folder), torch.device("cuda"), name)
    check_against_replayed_routing(engine, model, atol)
