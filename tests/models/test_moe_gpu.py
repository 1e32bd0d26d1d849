"""On CUDA: the grouped-GEMM experts compute what the per-expert loop computes, and each family in
bf16 stays within the dense model's bf16 tolerance of transformers' own class on the same device."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from tandem.models.loading import load_causal_lm
from tandem.models.moe import GroupedExperts, has_grouped_mm
from tandem.models.presets import PRESETS, init_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BF16_MEAN, BF16_MAX = 0.01, 0.05
"""Logprob differences dense Qwen3 shows in bf16 on an H200 against a full pass (docs/inference.md:
mean 0.007, max 0.045), rounded up."""


def test_grouped_mm_experts_equal_the_per_expert_loop_in_value_and_gradient():
    x = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    if not has_grouped_mm(x):
        pytest.skip("torch._grouped_mm needs bf16 on compute capability 9.0 or newer")
    experts = GroupedExperts(num_experts=8, hidden_size=256, intermediate_size=128).cuda().to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.05)
        experts.down_proj.normal_(0, 0.05)
    counts = torch.tensor([40, 0, 100, 1, 59, 0, 60, 40], device="cuda")  # empty experts too
    upstream = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)

    def run(forward):
        out = forward(x, counts)
        grads = torch.autograd.grad((out * upstream).sum(), [x, experts.gate_up_proj, experts.down_proj])
        return out, grads

    grouped, grouped_grads = run(experts._grouped)
    looped, looped_grads = run(experts._looped)
    torch.testing.assert_close(grouped, looped, rtol=2e-2, atol=2e-2)
    for mine, ref in zip(grouped_grads, looped_grads):
        torch.testing.assert_close(mine, ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe", "tiny-glm4-moe", "tiny-minimax-m2"])
def test_bf16_logprobs_are_within_the_dense_tolerance_of_transformers(preset, tmp_path):
    model_type = PRESETS[preset]["model_type"]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    folder = init_model(preset, tmp_path / preset)
    ours = load_causal_lm(str(folder), "cuda", "bfloat16")
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    ids = torch.randint(0, 256, (1, 200), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    positions = torch.arange(200, device="cuda")[None]
    with torch.no_grad():
        expected = theirs(input_ids=ids, use_cache=False).logits.float()[:, :-1].log_softmax(-1)
        got = ours.lm_head(ours(ids, positions)).float()[:, :-1].log_softmax(-1)
    targets = ids[:, 1:, None]
    diff = (got.gather(-1, targets) - expected.gather(-1, targets)).abs()
    assert diff.mean() < BF16_MEAN and diff.max() < BF16_MAX, (diff.mean().item(), diff.max().item())
