"""The engine's MoE on CPU: it reports the experts that sampled each token (router replay's input), and replaying
them routes through them. The MoE kernels against the model's MoE: `tests/kernels/test_moe_kernels.py`."""

import random

import httpx
import pytest
import torch
from inference_helpers import make_config

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.fused_moe import moe_blocks
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm
from tandem.models.moe import MoE, MoEArgs, replayed_routing
from tandem.models.presets import init_model


def routing_of_a_forward(model, token_ids: list[int]) -> torch.Tensor:
    """[T, num_moe_layers, k] expert ids of each position, from one forward over the whole sequence."""
    found = []
    hooks = [b.gate.register_forward_hook(lambda _m, _i, out: found.append(out[1])) for b in moe_blocks(model)]
    with torch.no_grad():
        model(torch.tensor([token_ids]), torch.arange(len(token_ids))[None])
    for hook in hooks:
        hook.remove()
    return torch.stack(found, 1)


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-glm4-moe"])
def test_the_engine_reports_the_experts_that_sampled_each_token(preset, tmp_path):
    """Chunked prefills, batched decodes, preemptions: token j's experts are those of position prompt + j - 1
    in a teacher-forced forward (fp32 CPU: no near-tie flips them). GLM: dense first layers, grouped sigmoid router."""
    folder = init_model(preset, tmp_path / preset, seed=0)
    engine = build_engine(ModelConfig(name=str(folder)), EngineConfig(
        device="cpu", num_blocks=16, block_size=16, max_model_len=160, max_num_batched_tokens=40), seed=0)
    engine.overlap = True  # what CUDA does: the routing of step N is read after step N+1 is launched
    model = load_causal_lm(str(folder))
    rng = random.Random(2)
    prompts = {}
    for i in range(6):
        prompts[str(i)] = [rng.randrange(256) for _ in range(rng.randint(1, 60))]
        engine.add_request(str(i), prompts[str(i)], SamplingParams(max_tokens=12, seed=i, ignore_eos=True,
                                                                   return_routed_experts=i % 3 != 0))
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.scheduler.num_preemptions > 0
    num_layers, top_k = len(moe_blocks(model)), moe_blocks(model)[0].args.top_k
    for rid, outs in outputs.items():
        tokens = [t for out in outs for t in out.token_ids]
        routed = [r for out in outs for r in out.routed_experts]
        if int(rid) % 3 == 0:
            assert routed == []
            continue
        expected = routing_of_a_forward(model, prompts[rid] + tokens)[len(prompts[rid]) - 1:-1]
        assert torch.tensor(routed).shape == (12, num_layers, top_k)
        assert torch.equal(torch.tensor(routed), expected)


def test_replaying_the_reported_experts_routes_through_them_exactly():
    """Replayed ids replace the router's choice where given (>= 0), and the weights are the router's own
    scores of those experts: differentiable, and equal to the unreplayed weights where the ids agree."""
    torch.manual_seed(0)
    moe = MoE(MoEArgs(num_experts=8, top_k=2, hidden_size=16, intermediate_size=8, norm_topk_prob=True))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, 16)
    own_weights, own_ids = moe.gate(x)
    forced = torch.tensor([[7, 6], [-1, -1], [0, 1], [-1, -1], [5, 4]])
    with replayed_routing(torch.nn.Sequential(moe), forced[:, None]):
        weights, ids = moe.gate(x)
    assert torch.equal(ids[[0, 2, 4]], forced[[0, 2, 4]]) and torch.equal(ids[[1, 3]], own_ids[[1, 3]])
    torch.testing.assert_close(weights[[1, 3]], own_weights[[1, 3]])
    weights.sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.gate.replayed_ids is None  # only within the block


def test_routed_experts_of_a_dense_model_are_a_clear_error(tiny_dir):
    engine = build_engine(ModelConfig(name=str(tiny_dir)), EngineConfig(device="cpu", num_blocks=8, max_model_len=64), seed=0)
    with pytest.raises(ValueError, match="return_routed_experts"):
        engine.add_request("a", [1, 2], SamplingParams(max_tokens=2, return_routed_experts=True))


def test_generate_returns_the_routed_experts_when_asked(tiny_moe_dir, server):
    moe_server = BackgroundServer(make_config(tiny_moe_dir))
    try:
        body = {"prompt_token_ids": [5, 6, 7], "n": 2, "max_tokens": 4, "seed": 0}
        plain = httpx.post(f"{moe_server.url}/v1/generate", json=body).json()
        asked = httpx.post(f"{moe_server.url}/v1/generate", json={**body, "return_routed_experts": True}).json()
    finally:
        moe_server.stop()
    assert all("routed_experts" not in c for c in plain["choices"])
    for choice in asked["choices"]:
        routed = torch.tensor(choice["routed_experts"])
        assert routed.shape == (4, 2, 2) and 0 <= routed.min() and routed.max() < 8  # tiny-moe: 2 layers, top-2 of 8
        assert all(len(set(r)) == 2 for token in choice["routed_experts"] for r in token)  # k distinct experts
    dense = httpx.post(f"{server.url}/v1/generate", json={**body, "return_routed_experts": True})
    assert dense.status_code == 400 and "return_routed_experts" in dense.text
