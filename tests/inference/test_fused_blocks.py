"""The engine's fused decoder blocks (`fused_blocks`, `pointwise`) compute what the model's blocks compute.

On CPU: the routing (other backends and the CPU keep the model's forward), and the kernels under Triton's
interpreter in fp32 against the model's own functions, alone and inside the engine (its logprobs against a
teacher-forced pass). The interpreter truncates when it casts to bf16 (the GPU rounds to nearest, as
torch does), so bf16 runs on CUDA only (`test_cuda_kernels_round_where_the_model_rounds`)."""

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.fused_blocks import apply_fused_blocks, fused_block_forward
from tandem.inference.engine.kv_cache import KVCache
from tandem.inference.engine.paged_attention import AttentionMetadata, PagedAttention
from tandem.inference.engine.setup import build_engine
from tandem.models.exact import exact_block_forward
from tandem.models.layers import YarnScaling, apply_rope, rms_norm, rope_cos_sin
from tandem.models.loading import load_causal_lm, load_weights_into
from tandem.models.weights import load_state_dict


def reference_qk(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, head_dim):
    """`before_attention`'s steps after the projections, on one step's tokens [N, heads * D]."""
    n = q.shape[0]
    if q_norm_weight is not None and q_norm_weight.shape[0] != head_dim:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k, v = (t.reshape(1, n, -1, head_dim) for t in (q, k, v))
    if q_norm_weight is not None and q_norm_weight.shape[0] == head_dim:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    return apply_rope(q, cos[None], sin[None])[0], apply_rope(k, cos[None], sin[None])[0], v[0]


KERNEL_CASES = [  # heads, kv heads, head dim, partial rotary factor, q/k norm, YaRN
    (4, 2, 16, 1.0, "head", None),  # Qwen3
    (5, 1, 16, 0.5, "none", None),  # GLM-4.5: partial rotary, no q/k norm, heads not a power of 2
    (3, 3, 8, 1.0, "all_heads", YarnScaling(4.0, 64, 1.2)),  # MiniMax-M2's norm over all heads, YaRN's cos/sin
]


def check_kernels(device: str, dtype: torch.dtype, num_tokens: int = 7, seed: int = 0) -> list[float]:
    """Both kernels against the model's functions on random inputs; returns the fraction of equal elements
    of each output (q, k, normed sum) after asserting they are close."""
    from tandem.kernels import pointwise

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    equal = []
    for heads, kv_heads, head_dim, rotary, norm, yarn in KERNEL_CASES:
        q = rand(num_tokens, heads * head_dim + 3)[:, :heads * head_dim]  # rows wider than their heads (a view)
        k, v = rand(num_tokens, kv_heads * head_dim), rand(num_tokens, kv_heads * head_dim)
        q_w, k_w = {"head": (rand(head_dim), rand(head_dim)), "none": (None, None),
                    "all_heads": (rand(heads * head_dim), rand(kv_heads * head_dim))}[norm]
        positions = torch.arange(3, 3 + num_tokens, device=device)[None]
        cos, sin = rope_cos_sin(positions, int(head_dim * rotary), 10_000.0, dtype, yarn)
        cache = KVCache(1, num_tokens, 4, kv_heads, head_dim, dtype, torch.device(device))
        slots = torch.randperm(4 * num_tokens, generator=gen)[:num_tokens].to(device)
        k_cache, v_cache = cache.layer(0)
        q_out = pointwise.qk_norm_rope_write(q, k, v, cos[0], sin[0], q_w, k_w, 1e-6, k_cache, v_cache, slots)
        ref_q, ref_k, ref_v = reference_qk(q, k, v, cos[0], sin[0], q_w, k_w, 1e-6, head_dim)
        written_k = k_cache.reshape(-1, kv_heads, head_dim)[slots]
        assert torch.equal(v_cache.reshape(-1, kv_heads, head_dim)[slots], ref_v)
        assert int((k_cache != 0).sum()) == int((written_k != 0).sum())  # nothing written outside the slots
        for out, ref in ((q_out, ref_q), (written_k, ref_k)):
            check_close(out, ref, dtype)
            equal.append((out == ref).float().mean().item())
    x, delta, weight = rand(num_tokens, 48), rand(num_tokens, 48), rand(48)
    total, normed = pointwise.rms_norm(x, weight, 1e-6, delta=delta)
    assert torch.equal(total, x + delta)
    check_close(normed, rms_norm(x + delta, weight, 1e-6), dtype)
    equal.append((normed == rms_norm(x + delta, weight, 1e-6)).float().mean().item())
    same, normed = pointwise.rms_norm(x, weight, 1e-6)
    assert same is x
    check_close(normed, rms_norm(x, weight, 1e-6), dtype)
    inter = 1100  # two programs per row, the second one part masked
    gate_up = rand(num_tokens, 2 * inter + 5)[:, :2 * inter]  # rows wider than gate and up (a view)
    ref = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    check_close(pointwise.silu_mul(gate_up), ref, dtype)
    equal.append((pointwise.silu_mul(gate_up) == ref).float().mean().item())
    return equal


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: within a few ulps; bf16: within a few roundings of the largest element (a norm's sum in another
    order can move an intermediate rounding by an ulp, which the weight and RoPE carry on)."""
    scale = ref.abs().max().item()
    tolerance = 4e-6 * scale if dtype == torch.float32 else 2 ** -5 * scale
    assert (out.float() - ref.float()).abs().max().item() <= tolerance


INTERPRETED_KERNELS = """
import sys
sys.path.insert(0, "tests/inference")
from test_fused_blocks import check_kernels
import torch
check_kernels("cpu", torch.float32)
check_kernels("cpu", torch.float32, num_tokens=1, seed=1)
print("ok")
"""

INTERPRETED_ENGINE = """
import random, sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests/inference")
import torch
from inference_helpers import teacher_forced_logprobs
from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.kernels import pointwise
from tandem.kernels import attention as attention_kernel
from tandem.inference.engine.fused_blocks import apply_fused_blocks, fused_block_forward
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm
from tandem.models.presets import init_model

attention_kernel.serves = lambda head_dim, device: True  # the interpreter runs the kernels on CPU tensors
pointwise.is_available = lambda x: True
calls = []
kernel = pointwise.qk_norm_rope_write
pointwise.qk_norm_rope_write = lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k)
for preset in ("tiny", "tiny-minimax-m2"):  # Qwen3; q/k norms over all heads, partial rotary, a MoE feed-forward
    folder = init_model(preset, Path(tempfile.mkdtemp()) / preset, seed=0)
    engine = build_engine(ModelConfig(name=str(folder), dtype="float32"),
                          EngineConfig(device="cpu", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32), seed=0)
    assert apply_fused_blocks(engine.runner.model) > 0
    model = load_causal_lm(str(folder))
    rng = random.Random(0)
    prompts = {str(i): [rng.randrange(256) for _ in range(length)] for i, length in enumerate((5, 40))}
    for request_id, prompt in prompts.items():  # the long prompt prefills in two chunks, beside the other's decodes
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True), n=1,
                           incremental=False)
    calls.clear()
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    assert len(outputs) == 2 and max(calls) >= 14 and min(calls) <= 2, calls  # prefill chunks and decode steps
    for out in outputs:
        expected = teacher_forced_logprobs(model, prompts[out.request_id], out.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
print("ok")
"""

@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.skipif(tuple(int(v) for v in np.__version__.split(".")[:2]) >= (2, 4),
                    reason="Triton 3.6's interpreter fails on numpy >= 2.4 (int() of a one-element array)")
@pytest.mark.parametrize("script", [INTERPRETED_KERNELS, INTERPRETED_ENGINE], ids=["kernels", "engine"])
def test_the_kernels_under_tritons_interpreter_compute_the_models_block(script):
    """fp32, CPU tensors: the kernels against the model's functions (Qwen3's per-head norms, GLM's partial
    rotary without norms, a norm over all heads with YaRN), then tiny engines (Qwen3's block, MiniMax-M2's)
    whose blocks run them, their prefill chunks and decodes against a teacher-forced pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_other_backends_and_the_cpu_keep_the_models_block(tiny_model):
    model = type(tiny_model)(tiny_model.args)
    model.load_state_dict(tiny_model.state_dict())
    ids = torch.randint(0, 256, (1, 9))
    before = model(ids, torch.arange(9)[None])
    assert apply_fused_blocks(model) == len(model.layers)
    assert all("forward" in vars(block) for block in model.layers)
    assert torch.equal(model(ids, torch.arange(9)[None]), before)  # the packed backend of a plain forward
    cache = KVCache(len(model.layers), 2, 16, model.args.num_key_value_heads, model.args.head_dim, torch.float32,
                    torch.device("cpu"))
    meta = AttentionMetadata(slot_mapping=torch.arange(9), query_start=torch.tensor([0, 9]), seq_lens=torch.tensor([9]),
                             block_tables=torch.tensor([[0, 1]]), tiles=torch.zeros(2, 1, dtype=torch.long), block_q=16,
                             query_lens_host=[9], seq_lens_host=[9])
    paged = model(ids, torch.arange(9)[None], attention=PagedAttention(cache, meta))  # CPU: the torch reference
    torch.testing.assert_close(paged, before, atol=1e-5, rtol=0)


def test_weight_updates_reach_the_stacked_projections(tiny_model, tiny_other_dir):
    """The engine copies new weights into the parameters (`load_weights_into`); those are views of the stacked
    matrices the fused blocks multiply by, so an update reaches them, and the model's own forward after it is the
    updated model's."""
    model = type(tiny_model)(tiny_model.args)
    model.load_state_dict(tiny_model.state_dict())
    apply_fused_blocks(model)
    other = load_state_dict(tiny_other_dir)
    load_weights_into(model, other)
    for i, block in enumerate(model.layers):
        stacked = block.forward.args[1]
        names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkv"]
        assert torch.equal(stacked.qkv, torch.cat([other[n] for n in names]))
        names = [f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up")]
        assert torch.equal(stacked.gate_up, torch.cat([other[n] for n in names]))
    ids = torch.randint(0, 256, (1, 9))
    torch.testing.assert_close(model(ids, torch.arange(9)[None]), load_causal_lm(str(tiny_other_dir))(ids, torch.arange(9)[None]),
                               atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_round_where_the_model_rounds():
    """bf16: within a few roundings (`check_close`), and most elements equal: the kernels round where the torch
    chain rounds, but a norm's sum in another order moves its result by an ulp now and then, which the weight and
    RoPE carry on (79-95% equal per output on the H200 at one token). Decode-sized and prefill-sized steps.
    (fp32: the interpreter's test, and the engine tests of `test_gpu_engine.py` and `test_gpu_moe.py`, which
    run these.)"""
    for num_tokens, seed in ((1, 0), (256, 1), (4096, 2)):
        equal = check_kernels("cuda", torch.bfloat16, num_tokens, seed)
        assert min(equal) > 0.7, equal


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_cuda_engines_fuse_their_blocks_unless_exact(tiny_dir, exact):
    """`[run] exact` keeps its own blocks (batch invariance); otherwise the fused blocks serve when asked."""
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
                                       fused_blocks=True), seed=0, exact=exact)
    forwards = {block.forward.func for block in engine.runner.model.layers}
    assert forwards == ({exact_block_forward} if exact else {fused_block_forward})
