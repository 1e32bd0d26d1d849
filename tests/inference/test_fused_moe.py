"""The engine's MoE execution on CPU: the kernel's row layout computes what the model's MoE computes,
and the engine reports the experts that sampled each token (router replay's input)."""

import importlib.util
import os
import random
import subprocess
import sys

import httpx
import numpy as np
import pytest
import torch
from inference_helpers import make_config

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.fused_moe import moe_blocks
from tandem.inference.engine.moe_kernel import ExpertBlocks, align_to_blocks
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.inference.server import BackgroundServer
from tandem.models.loading import load_causal_lm
from tandem.models.moe import MoE, MoEArgs, replayed_routing
from tandem.models.presets import init_model


def grouped_matmul_reference(a, weight, blocks: ExpertBlocks, rows_per_copy, num_copies, routing=None):
    """What one program per row block of `moe_kernel._grouped_matmul_kernel` computes, block by block."""
    out = torch.full((num_copies, weight.shape[1]), float("nan"))
    for b, expert in enumerate(blocks.block_experts.tolist()):
        if b * blocks.block_m >= blocks.num_padded.item():
            break
        copies = blocks.sorted_copies[b * blocks.block_m:(b + 1) * blocks.block_m]
        copies = copies[copies < num_copies]
        rows = a[copies // rows_per_copy] @ weight[expert].T
        out[copies] = rows if routing is None else rows * routing[copies, None]
    return out


def moe_through_blocks(moe: MoE, x: torch.Tensor, block_m: int) -> torch.Tensor:
    """`fused_moe.fused_experts`'s steps, with the kernel replaced by its reference."""
    flat = x.reshape(-1, x.shape[-1])
    weights, expert_ids = moe.gate(flat)
    n, k = expert_ids.shape
    blocks = align_to_blocks(expert_ids, moe.args.num_experts, block_m)
    gate, up = grouped_matmul_reference(flat, moe.experts.gate_up_proj, blocks, k, n * k).chunk(2, dim=-1)
    down = grouped_matmul_reference(torch.nn.functional.silu(gate) * up, moe.experts.down_proj, blocks, 1, n * k,
                                    weights.reshape(-1))
    return down.view(n, k, -1).sum(1).view(x.shape)


@pytest.mark.parametrize("num_tokens", [1, 3, 40])
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_the_kernel_layout_computes_the_models_moe(num_tokens, block_m):
    torch.manual_seed(num_tokens)
    moe = MoE(MoEArgs(num_experts=8, top_k=2, hidden_size=32, intermediate_size=24, norm_topk_prob=True))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, num_tokens, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe_through_blocks(moe, x, block_m), moe(x), atol=1e-5, rtol=1e-5)


def test_the_layout_holds_each_copy_once_in_padded_groups_of_its_expert():
    expert_ids = torch.tensor([[3, 0], [3, 1], [0, 3], [7, 3], [1, 0]])
    blocks = align_to_blocks(expert_ids, num_experts=8, block_m=4)
    num_copies = expert_ids.numel()
    assert blocks.sorted_copies.numel() == 12 + 8 * 3  # fixed by N, k, E and block_m only
    assert blocks.num_padded.item() == 4 * 4  # experts 0, 1, 3, 7: one block each
    real = blocks.sorted_copies[blocks.sorted_copies < num_copies]
    assert sorted(real.tolist()) == list(range(num_copies))
    for b in range(4):
        copies = blocks.sorted_copies[4 * b:4 * b + 4]
        copies = copies[copies < num_copies]
        assert (expert_ids.reshape(-1)[copies] == blocks.block_experts[b]).all()
    assert blocks.block_experts[:4].tolist() == [0, 1, 3, 7]


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


INTERPRETED_KERNEL = """
import torch
from tandem.inference.engine.fused_moe import fused_experts
from tandem.models.moe import MoE, MoEArgs

torch.manual_seed(0)
moe = MoE(MoEArgs(num_experts=16, top_k=4, hidden_size=96, intermediate_size=80, norm_topk_prob=True))
for p in moe.parameters():
    torch.nn.init.normal_(p, std=0.1)
for num_tokens in (1, 40, 150, 300):  # row blocks of 16, 16, 32 and 64 (4 of 16 experts per token)
    x = torch.randn(num_tokens, 96)
    with torch.no_grad():
        weights, expert_ids = moe.gate(x)
        out = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, expert_ids)
        torch.testing.assert_close(out, moe(x[None])[0], atol=1e-5, rtol=1e-5)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4),
                    reason="Triton 3.6's interpreter fails on numpy >= 2.4 (int() of a one-element array)")
def test_the_kernel_under_tritons_interpreter_computes_the_models_moe():
    """The real kernel on CPU tensors (fp32, exact dot products), run by Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED_KERNEL], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
