"""The engine's fused decoder blocks (`fused_blocks`) compute what the model's blocks compute.

On CPU: the routing (other backends and the CPU keep the model's forward), and tiny engines whose blocks run the
pointwise kernels under Triton's interpreter in fp32 (their logprobs against a teacher-forced pass). The kernels
alone, against the model's functions: `tests/kernels/test_pointwise.py`."""

import os
import subprocess
import sys

import pytest
import torch
from triton_interpreter import needs_triton_interpreter

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.fused_blocks import apply_fused_blocks, fused_block_forward
from tandem.inference.engine.kv_cache import KVCache
from tandem.inference.engine.paged_attention import AttentionMetadata, PagedAttention
from tandem.inference.engine.setup import build_engine
from tandem.models.exact import exact_block_forward
from tandem.models.loading import load_causal_lm, load_weights_into
from tandem.models.weights import load_state_dict


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


@needs_triton_interpreter
def test_engines_with_fused_blocks_under_tritons_interpreter_match_a_teacher_forced_pass():
    """fp32, CPU tensors: tiny engines (Qwen3's block, MiniMax-M2's) whose blocks run the kernels, their prefill
    chunks and decodes against a teacher-forced pass."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", INTERPRETED_ENGINE], env=env, capture_output=True, text=True, timeout=300)
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
@pytest.mark.parametrize("exact", [False, True], ids=["default", "exact"])
def test_cuda_engines_fuse_their_blocks_unless_exact(tiny_dir, exact):
    """`[run] exact` keeps its own blocks (batch invariance); otherwise the fused blocks serve when asked."""
    engine = build_engine(ModelConfig(name=str(tiny_dir), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
                                       fused_blocks=True), seed=0, exact=exact)
    forwards = {block.forward.func for block in engine.runner.model.layers}
    assert forwards == ({exact_block_forward} if exact else {fused_block_forward})
