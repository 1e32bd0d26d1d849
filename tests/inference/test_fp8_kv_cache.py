"""The engine with `engine.kv_cache_dtype = "fp8"` on the CPU (the torch path, which dequantizes what it gathers):
the cache write's round trip, logprobs against the unquantized model's, the memory plan, and the settings refused.
The kernels' side (CUDA, Triton's interpreter): `tests/kernels/test_paged_attention_kernels.py`, `test_pointwise.py`;
the engine on CUDA with graphs: `tests/inference/test_gpu_engine.py`.

How close the logprobs stay: `inference_helpers.fp8_rho` with 2 FP8 factors per block, the keys in q k^T and the
values in p v (q and p stay in the model's dtype), each rounded once to e4m3 relative to its head's scale."""

import pytest
import torch
from inference_helpers import check_close_to_unquantized, generate

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig, InferenceConfig
from tandem.config.loader import ConfigError
from tandem.config.resolve import parse_rl_args
from tandem.inference.engine.fp8_blocks import check_fp8_device
from tandem.inference.engine.kv_cache import KVCache
from tandem.inference.engine.setup import build_engine
from tandem.inference.vllm.args import serve_argv
from tandem.kernels.fp8 import FP8, INV_FP8_MAX, MIN_AMAX
from tandem.models.presets import init_model

KV_FACTORS_PER_BLOCK = 2
"""FP8 factors of a block with an FP8 cache and unquantized weights: keys and values."""


def engine_for(model_dir, load_format: str = "safetensors", **settings):
    config = {"device": "cpu", "num_blocks": 64, "block_size": 16, "max_model_len": 256, "max_num_batched_tokens": 256,
              "kv_cache_dtype": "fp8", **settings}
    return build_engine(ModelConfig(name=str(model_dir), load_format=load_format), EngineConfig(**config), seed=0)


def test_the_cache_write_keeps_each_value_to_e4m3s_precision_of_its_head():
    """Each token's head is scaled by its largest magnitude / 448 and rounded to the nearest e4m3 number: a value
    comes back within 2^-4 of itself (half the spacing of 3 mantissa bits, at a binade's bottom), or within 2^-10 of
    the scale where it falls among e4m3's subnormals (spacing 2^-9); plus fp32's roundings of the scaling. Heads
    1e4 apart keep that precision each; an all-zero head stays zero. The torch path reads back exactly what the
    write returned, at the slots written, in the layer written."""
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(2, 4, 4, 3, 32, torch.float32, torch.device("cpu"), fp8=True)
    sizes = torch.tensor([1e-2, 1.0, 1e2])[None, :, None]
    k, v = (torch.randn(6, 3, 32, generator=gen) * sizes for _ in range(2))
    v[2, 1] = 0.0
    slots = torch.tensor([0, 3, 5, 9, 12, 15])
    held_k, held_v = cache.write(1, slots, k, v)
    for x, held, scales in ((k, held_k, cache.key_scales), (v, held_v, cache.value_scales)):
        scale = x.abs().amax(-1).clamp(min=MIN_AMAX) * INV_FP8_MAX
        assert torch.equal(scales[1].view(-1, 3)[slots], scale)
        bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale[..., None] + 2.0 ** -20 * x.abs()
        assert ((held - x).abs() <= bound).all()
        assert ((held - x).abs() / x.abs().clamp(min=1e-30)).max() > 2.0 ** -6  # stored in FP8: not lossless
    assert torch.equal(held_v[2, 1], torch.zeros(32))
    blocks = torch.tensor([0, 1, 2, 3])
    read_k, read_v = cache.read_blocks(1, blocks)
    assert torch.equal(read_k.view(-1, 3, 32)[slots], held_k) and torch.equal(read_v.view(-1, 3, 32)[slots], held_v)
    assert not cache.keys[0].view(torch.uint8).any() and not cache.key_scales[0].any()  # layer 0 untouched
    assert cache.keys.dtype == FP8 and cache.dtype == torch.float32


def test_fp8_blocks_move_between_caches_as_they_are_held():
    """Prefill/decode hand-off: `export_blocks` of an FP8 cache carries each head's FP8 bytes and its scale, and
    `import_blocks` writes them into another cache bit for bit (never rounded again); a cache of another dtype
    refuses them and keeps what it held."""
    gen = torch.Generator().manual_seed(1)
    source = KVCache(2, 6, 4, 3, 16, torch.float32, torch.device("cpu"), fp8=True)
    for layer in range(2):
        source.write(layer, torch.arange(24), *(torch.randn(24, 3, 16, generator=gen) * 10 for _ in range(2)))
    blocks = source.export_blocks([1, 4])
    assert blocks.dtype == torch.uint8 and blocks.shape == (2, 2, 2, 4, 3, 16 + 4)
    target = KVCache(2, 6, 4, 3, 16, torch.float32, torch.device("cpu"), fp8=True)
    target.import_blocks([5, 0], blocks)
    for layer in range(2):
        for got, want in zip(target.read_blocks(layer, torch.tensor([5, 0])), source.read_blocks(layer, torch.tensor([1, 4]))):
            assert torch.equal(got, want)
    assert torch.equal(target.key_scales[:, [5, 0]], source.key_scales[:, [1, 4]])
    unquantized = KVCache(2, 6, 4, 3, 16, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="this cache takes"):
        unquantized.import_blocks([0, 1], blocks)
    assert not unquantized.keys.any()


def test_fp8_kv_logprobs_stay_close_to_the_unquantized_models(tiny_dir, tiny_model):
    check_close_to_unquantized(generate(engine_for(tiny_dir)), tiny_model, "cpu", KV_FACTORS_PER_BLOCK)


def test_paging_preemption_and_shared_prompts_keep_the_bound(tiny_dir, tiny_model):
    """A cache too small for the batch: sequences are preempted and computed again (their keys and values written
    and quantized again), and n = 2 samples share their prompt's blocks; every logprob stays within the bound."""
    engine = engine_for(tiny_dir, num_blocks=12, max_num_batched_tokens=40, max_model_len=160)
    check_close_to_unquantized(generate(engine, num_requests=8, n=2), tiny_model, "cpu", KV_FACTORS_PER_BLOCK)
    assert engine.scheduler.num_preemptions > 0


def test_fp8_weights_and_fp8_cache_together(tiny_dir, tiny_model):
    """Both switches: the weights' 8 FP8 factors per block and the cache's 2."""
    engine = engine_for(tiny_dir, quantization="fp8")
    check_close_to_unquantized(generate(engine), tiny_model, "cpu", 8 + KV_FACTORS_PER_BLOCK)


def test_the_memory_plan_counts_fp8_bytes_and_their_scales(tiny_dir):
    """Per block: K and V of every layer and KV head, one byte per element plus a 4-byte scale per token and head.
    At Qwen3-0.6B's shape (head_dim 128, bf16) that is 264 bytes per head and token against 512: 1.94x the tokens.
    The CPU's budget (`cpu_kv_cache_gib`) then holds that many more blocks, and the tensors allocated are what the
    plan counted."""
    bf16 = KVCache.bytes_per_block(28, 16, 8, 128, torch.bfloat16)
    fp8 = KVCache.bytes_per_block(28, 16, 8, 128, torch.bfloat16, fp8=True)
    assert bf16 == 2 * 28 * 16 * 8 * 128 * 2 and fp8 == 2 * 28 * 16 * 8 * (128 + 4)
    assert round(bf16 / fp8, 2) == 1.94
    budget = {"num_blocks": None, "cpu_kv_cache_gib": 2.0 ** -10}  # 1 MiB
    tiny_fp32 = 2 * 2 * 16 * 2 * 32 * 4  # layers, block size, KV heads, head dim of the tiny model; fp32
    tiny_fp8 = 2 * 2 * 16 * 2 * (32 + 4)
    for dtype, per_block in (("auto", tiny_fp32), ("fp8", tiny_fp8)):
        engine = engine_for(tiny_dir, kv_cache_dtype=dtype, **budget)
        num_blocks = engine.block_manager.num_blocks
        assert num_blocks == 2 ** 20 // per_block
        cache = engine.runner.cache
        allocated = sum(t.numel() * t.element_size() for t in (cache.keys, cache.values, cache.key_scales, cache.value_scales)
                        if t is not None)
        assert allocated == (num_blocks + 1) * per_block  # one block more: the padding tokens' slots
        assert cache.bytes_per_token * 16 == per_block


def test_exact_runs_refuse_the_fp8_cache(tiny_dir):
    with pytest.raises(ConfigError, match=r"`run.exact` = true with `inference.engine.kv_cache_dtype` = 'fp8': attention "
                                          r"over keys and values rounded to FP8 cannot be bitwise equal"):
        parse_rl_args(["--run.exact", "true", "--inference.engine.kv_cache_dtype", "fp8"], environ={})
    with pytest.raises(ValueError, match=r"`engine.kv_cache_dtype` = 'fp8' cannot run exact"):
        build_engine(ModelConfig(name=str(tiny_dir)), EngineConfig(device="cpu", kv_cache_dtype="fp8"), seed=0, exact=True)


def test_a_gpu_without_fp8_is_refused_for_the_fp8_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"`engine.kv_cache_dtype` = 'fp8' needs a GPU of compute capability 8.9 or "
                                         r"newer.*NVIDIA A100 has 8.0: set `engine.kv_cache_dtype` = 'auto'"):
        check_fp8_device(torch.device("cuda"), "engine.kv_cache_dtype", "auto")


def test_a_latent_cache_refuses_the_fp8_cache(tmp_path):
    """Latent attention keeps its own cache (`LatentCache`), not held in FP8: the switch is refused, not ignored."""
    folder = init_model("tiny-glm5", tmp_path / "glm5", seed=0, weights=False)
    with pytest.raises(ValueError, match=r"`engine.kv_cache_dtype` = 'fp8': 'glm_moe_dsa' keeps a latent cache"):
        engine_for(folder, load_format="dummy")


def test_the_vllm_backend_gets_vllms_own_fp8_cache_flag():
    def argv(**engine):
        config = InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "/models/qwen3"}, "engine": engine})
        args = serve_argv(config)
        return args[args.index("--kv-cache-dtype") + 1]

    assert argv(kv_cache_dtype="fp8") == "fp8" and argv() == "auto"
    with pytest.raises(ValueError, match="extra_args.kv_cache_dtype"):
        InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "/models/qwen3"},
                                        "vllm": {"extra_args": {"kv_cache_dtype": "fp8"}}})
