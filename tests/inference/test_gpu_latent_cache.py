"""The latent cache on CUDA (GLM-5, DeepSeek-V3): the engine (overlapped steps, the MoE kernels, the latent attention
and DSA kernels, decode steps replayed from CUDA graphs) against a teacher-forced pass of the model under the
experts the engine reports."""


import pytest
import torch
from inference_helpers import check_against_replayed_routing

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
