"""The latent cache on CUDA (GLM-5, DeepSeek-V3): the engine (overlapped steps, the MoE kernels, the latent attention
and DSA kernels, decode steps replayed from CUDA graphs) against a teacher-forced pass of the model under the
experts the engine reports; and over an FP8 latent cache, within FP8's reach of it."""


import pytest
import torch
from inference_helpers import check_against_replayed_routing, check_close_to_unquantized, generate
from test_fp8_kv_cache import KV_FACTORS_PER_BLOCK, LATENT_TAILS

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.kv_cache import LatentCache
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm
from tandem.models.presets import PRESETS, shape_config, write_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("shape, dtype, atol", [
    (dict(PRESETS["tiny-glm5"], index_topk=16), "float32", 1e-4),
    (PRESETS["tiny-deepseek-v3"], "float32", 1e-4),
    (PRESETS["tiny-deepseek-v3"], "bfloat16", 0.1),
    (PRESETS["tiny-glm5"], "bfloat16", 0.1),  # top-k 64 past every context: a near tie cannot choose otherwise
], ids=["glm5-sparse-fp32", "deepseek-v3-fp32", "deepseek-v3-bf16", "glm5-dense-bf16"])
def test_latent_engine_matches_a_teacher_forced_pass(shape, dtype, atol, tmp_path):
    folder = write_model(shape_config(shape), tmp_path / "m")
    engine = build_engine(ModelConfig(name=str(folder), dtype=dtype),
                          EngineConfig(device="cuda", max_num_seqs=16, max_model_len=256, max_num_batched_tokens=96), seed=0)
    assert isinstance(engine.runner.cache, LatentCache) and engine.runner.graphs is not None and engine.overlap
    model = load_causal_lm(str(folder), torch.device("cuda"), dtype)
    check_against_replayed_routing(engine, model, atol)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize("shape", [PRESETS["tiny-glm5"], PRESETS["tiny-deepseek-v3"]], ids=["glm5", "deepseek-v3"])
def test_the_fp8_latent_cache_on_cuda_stays_close_to_the_model(shape, tmp_path):
    """`engine.kv_cache_dtype = "fp8"` on the kernel path in fp32 (the cache write quantizes, the kernels dequantize
    in registers, decodes replayed from CUDA graphs): as close to the model's teacher-forced pass as the CPU's torch
    path is (`tests/inference/test_fp8_kv_cache.py`), on the same shapes. A top-k far below the contexts (16 of up
    to 84 tokens) is no test of the kernels here: its rounded indexer keys change choices at most queries, and a
    changed choice reaches past the tails' bound on the CPU's torch path as on the kernels; that the kernels choose
    and attend as the torch path over an FP8 cache is `test_engine_with_the_kernels_on_cuda[sparse]`'s."""
    folder = write_model(shape_config(shape), tmp_path / "m")
    engine = build_engine(ModelConfig(name=str(folder), dtype="float32"),
                          EngineConfig(device="cuda", max_num_seqs=16, max_model_len=256, max_num_batched_tokens=40,
                                       kv_cache_dtype="fp8"), seed=0)
    assert isinstance(engine.runner.cache, LatentCache) and engine.runner.cache.fp8 and engine.runner.graphs is not None
    model = load_causal_lm(str(folder), torch.device("cuda"), "float32")
    check_close_to_unquantized(generate(engine), model, "cuda", KV_FACTORS_PER_BLOCK, LATENT_TAILS)
