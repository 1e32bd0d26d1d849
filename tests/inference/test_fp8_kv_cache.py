"""The engine with `engine.kv_cache_dtype = "fp8"` on the CPU (the torch path, which dequantizes what it gathers):
the cache write's round trip, logprobs against the unquantized model's, the memory plan, and the settings refused;
for decoder blocks (`KVCache`) and for latent attention (`LatentCache`: GLM-5, DeepSeek-V3). The kernels' side
(CUDA, Triton's interpreter): `tests/kernels/test_paged_attention_kernels.py`, `test_pointwise.py`,
`test_latent_attention_kernels.py`; the engine on CUDA with graphs: `tests/inference/test_gpu_engine.py`; the
prefill/decode hand-off of FP8 latent blocks: `tests/inference/test_disaggregated.py`.

How close the logprobs stay: `inference_helpers.fp8_rho` with 2 FP8 factors per block, the keys in q k^T and the
values in p v (q and p stay in the model's dtype), each rounded once to e4m3 relative to its head's scale; for a
latent block the latent part c, as the key (q_c . c) and as the value (p c)."""

import random

import pytest
import torch
from inference_helpers import check_close_to_unquantized, generate

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig, InferenceConfig
from tandem.config.loader import ConfigError
from tandem.config.resolve import parse_rl_args
from tandem.inference.engine.fp8_blocks import check_fp8_device
from tandem.inference.engine.kv_cache import KVCache, LatentCache, dequantize, quantize_heads
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.inference.vllm.args import serve_argv
from tandem.kernels.fp8 import FP8, INV_FP8_MAX, MIN_AMAX
from tandem.launch.preflight import MismatchLimit, mismatch_limit
from tandem.models import dsa
from tandem.models.loading import load_causal_lm
from tandem.models.presets import PRESETS, shape_config, write_model

KV_FACTORS_PER_BLOCK = 2
"""FP8 factors of a block with an FP8 cache and unquantized weights: keys and values."""


def engine_for(model_dir, load_format: str = "safetensors", **settings):
    config = {"device": "cpu", "num_blocks": 64, "block_size": 16, "max_model_len": 256, "max_num_batched_tokens": 256,
              "kv_cache_dtype": "fp8", **settings}
    return build_engine(ModelConfig(name=str(model_dir), load_format=load_format), EngineConfig(**config), seed=0)


def e4m3_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How far each value of rows x [..., D] may come back from FP8 with its row's `scale` [...]: within 2^-4 of itself
    (half the spacing of 3 mantissa bits, at a binade's bottom), or within 2^-10 of the scale where it falls among
    e4m3's subnormals (spacing 2^-9); plus fp32's roundings of the scaling."""
    return 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale[..., None] + 2.0 ** -20 * x.abs()


def test_the_cache_write_keeps_each_value_to_e4m3s_precision_of_its_head():
    """Each token's head is scaled by its largest magnitude / 448 and rounded to the nearest e4m3 number: a value
    comes back within `e4m3_bound`. Heads 1e4 apart keep that precision each; an all-zero head stays zero. The torch
    path reads back exactly what the write returned, at the slots written, in the layer written."""
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
        assert ((held - x).abs() <= e4m3_bound(x, scale)).all()
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
                                          r"over a cache rounded to FP8 \(keys and values, or latent entries\) cannot "
                                          r"be bitwise equal"):
        parse_rl_args(["--run.exact", "true", "--inference.engine.kv_cache_dtype", "fp8"], environ={})
    with pytest.raises(ValueError, match=r"`engine.kv_cache_dtype` = 'fp8' cannot run exact"):
        build_engine(ModelConfig(name=str(tiny_dir)), EngineConfig(device="cpu", kv_cache_dtype="fp8"), seed=0, exact=True)


def test_a_gpu_without_fp8_is_refused_for_the_fp8_cache(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"`engine.kv_cache_dtype` = 'fp8' needs a GPU of compute capability 8.9 or "
                                         r"newer.*NVIDIA A100 has 8.0: set `engine.kv_cache_dtype` = 'auto'"):
        check_fp8_device(torch.device("cuda"), "engine.kv_cache_dtype", "auto")


def test_the_vllm_backend_gets_vllms_own_fp8_cache_flag():
    def argv(**engine):
        config = InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "/models/qwen3"}, "engine": engine})
        args = serve_argv(config)
        return args[args.index("--kv-cache-dtype") + 1]

    assert argv(kv_cache_dtype="fp8") == "fp8" and argv() == "auto"
    with pytest.raises(ValueError, match="extra_args.kv_cache_dtype"):
        InferenceConfig.model_validate({"backend": "vllm", "model": {"name": "/models/qwen3"},
                                        "vllm": {"extra_args": {"kv_cache_dtype": "fp8"}}})


LATENT_SHAPES = {"tiny-glm5": PRESETS["tiny-glm5"], "tiny-deepseek-v3": PRESETS["tiny-deepseek-v3"]}
"""tiny-glm5's DSA keeps 64 tokens, fewer than the longest contexts here (84): its last queries choose."""
LATENT_TAILS = 4.0
"""How far (in RHO) a latent FP8 cache's logprobs reach in the tails, where a `KVCache`'s reach 2: one entry's c
serves every head, so its rounding moves all heads' scores together where a KV cache's per-head roundings partly
cancel, and tiny-glm5's DSA choice moves with its rounded indexer keys
(`test_rounded_indexer_keys_change_few_choices_and_the_next_token_distribution_little`)."""


def latent_cache(fp8: bool = True, **sizes) -> LatentCache:
    """Three layers of entries of 32 latent and 8 RoPE numbers, indexer keys of 16 in layers 0 and 2, fp32."""
    shape = dict(num_layers=3, num_blocks=6, block_size=4, entry_dim=40, indexed_layers=[0, 2], index_dim=16,
                 dtype=torch.float32, device=torch.device("cpu"), fp8=fp8, rope_dim=8 if fp8 else 0)
    return LatentCache(**dict(shape, **sizes))


def test_the_latent_cache_write_keeps_c_and_indexer_keys_to_e4m3s_precision_and_the_rope_part_as_it_is():
    """Each token's latent part c and indexer key, each with one scale (its largest magnitude / 448), come back within
    `e4m3_bound`, tokens 1e5 apart alike; an all-zero c stays zero; the RoPE part comes back as written. Whole blocks
    and single slots read the same numbers, in the layer written only."""
    gen = torch.Generator().manual_seed(0)
    cache = latent_cache()
    sizes = torch.tensor([1e-2, 1.0, 1e2, 1.0, 1e3, 3.0])[:, None]
    entries, keys = torch.randn(6, 40, generator=gen) * sizes, torch.randn(6, 16, generator=gen) * sizes
    entries[3, :32] = 0.0
    slots = torch.tensor([0, 3, 5, 9, 12, 15])
    cache.write(2, slots, entries)
    cache.write_index_keys(2, slots, keys)
    blocks = torch.tensor([0, 1, 2, 3])
    held_entries = cache.read_entries(2, blocks).flatten(0, 1)[slots]
    held_keys = cache.read_index_keys(2, blocks).flatten(0, 1)[slots]
    assert torch.equal(cache.read_entries(2, slots, per_slot=True), held_entries)
    for x, held, scales in ((entries[:, :32], held_entries[:, :32], cache.entry_scales[2]),
                            (keys, held_keys, cache.index_key_scales[1])):
        scale = x.abs().amax(-1).clamp(min=MIN_AMAX) * INV_FP8_MAX
        assert torch.equal(scales.flatten()[slots], scale)
        assert ((held - x).abs() <= e4m3_bound(x, scale)).all()
        assert ((held - x).abs() / x.abs().clamp(min=1e-30)).max() > 2.0 ** -6  # stored in FP8: not lossless
    assert torch.equal(held_entries[3, :32], torch.zeros(32))
    assert torch.equal(held_entries[:, 32:], entries[:, 32:])
    assert not cache.entries[:2].view(torch.uint8).any() and not cache.ropes[:2].any() and not cache.index_keys[0].view(
        torch.uint8).any()  # layers 0 and 1 untouched
    assert (cache.entries.dtype, cache.index_keys.dtype, cache.ropes.dtype) == (FP8, FP8, torch.float32)


def test_fp8_latent_blocks_move_between_caches_as_they_are_held_and_only_into_their_layout():
    """Prefill/decode hand-off: an FP8 latent cache exports its bytes (each token's FP8 latent parts, scales, RoPE
    parts, FP8 indexer keys and scales: `bytes_per_token` of them) and another FP8 cache takes them bit for bit into
    other block ids; a latent cache in the model's dtype has another layout and refuses them, and an FP8 cache
    refuses its blocks; neither writes anything."""
    gen = torch.Generator().manual_seed(1)
    source = latent_cache()
    for layer in range(3):
        source.write(layer, torch.arange(28), torch.randn(28, 40, generator=gen) * 10)
    for layer in (0, 2):
        source.write_index_keys(layer, torch.arange(28), torch.randn(28, 16, generator=gen))
    blocks = source.export_blocks([1, 4])
    per_token = 3 * (32 + 4 + 8 * 4) + 2 * (16 + 4)
    assert blocks.dtype == torch.uint8 and blocks.shape == (2, 4, per_token) and source.bytes_per_token == per_token
    target = latent_cache()
    target.import_blocks([5, 0], blocks)
    for name in ("entries", "entry_scales", "ropes", "index_keys", "index_key_scales"):
        held, landed = getattr(source, name), getattr(target, name)
        assert torch.equal(landed[:, [5, 0]].view(torch.uint8), held[:, [1, 4]].view(torch.uint8)), name
        assert not landed[:, [1, 2, 3, 4]].view(torch.uint8).any(), name
    unquantized = latent_cache(fp8=False)
    assert source.layout == target.layout != unquantized.layout
    with pytest.raises(ValueError, match=r"latent blocks of shape \(2, 4, 244\) and torch.uint8; this cache takes "
                                         r"\(2, 4, 152\) and torch.float32"):
        unquantized.import_blocks([0, 1], blocks)
    with pytest.raises(ValueError, match="this cache takes"):
        target.import_blocks([1, 2], unquantized.export_blocks([0, 1]))
    assert not unquantized.entries.any() and not target.entries[:, [1, 2]].view(torch.uint8).any()


def test_the_memory_plan_counts_the_latent_caches_fp8_bytes_and_scales(tmp_path):
    """Per token and layer: kv_lora_rank bytes, a 4-byte scale and the RoPE part in the model's dtype; per indexed
    layer index_head_dim bytes and a scale. At GLM-5's shape in bf16 (every layer indexed) that is 776 bytes per
    token and layer against 1,408: 1.81x the tokens. The CPU's budget then holds that many more blocks of tiny-glm5
    (fp32), and the tensors allocated are what the plan counted."""
    glm5 = PRESETS["glm-5"]
    layers, rank, rope = glm5["num_hidden_layers"], glm5["kv_lora_rank"], glm5["qk_rope_head_dim"]
    sizes = dict(num_layers=layers, block_size=16, entry_dim=rank + rope, indexed_layers=list(range(layers)),
                 index_dim=glm5["index_head_dim"], dtype=torch.bfloat16)
    bf16, fp8 = LatentCache.bytes_per_block(**sizes), LatentCache.bytes_per_block(**sizes, fp8=True, rope_dim=rope)
    assert bf16 == 16 * layers * 1408 and fp8 == 16 * layers * 776 and round(bf16 / fp8, 2) == 1.81
    folder = write_model(shape_config(PRESETS["tiny-glm5"]), tmp_path / "glm5")
    budget = {"num_blocks": None, "cpu_kv_cache_gib": 2.0 ** -10}  # 1 MiB
    tiny_fp32 = 16 * (4 * 48 + 2 * 32) * 4  # block size; 4 layers of entries, 2 indexed; fp32
    tiny_fp8 = 16 * (4 * (32 + 4 + 16 * 4) + 2 * (32 + 4))
    for dtype, per_block in (("auto", tiny_fp32), ("fp8", tiny_fp8)):
        engine = engine_for(folder, kv_cache_dtype=dtype, **budget)
        num_blocks = engine.block_manager.num_blocks
        assert num_blocks == 2 ** 20 // per_block
        cache = engine.runner.cache
        held = (cache.entries, cache.entry_scales, cache.ropes, cache.index_keys, cache.index_key_scales)
        assert sum(t.nbytes for t in held if t is not None) == (num_blocks + 1) * per_block
        assert cache.bytes_per_token * 16 == per_block


@pytest.mark.parametrize("preset", LATENT_SHAPES)
def test_fp8_latent_logprobs_stay_close_to_the_unquantized_cache(preset, tmp_path):
    """Prompts of 1 to 60 tokens, 24 tokens each, 40 tokens a step: prefill chunks (expanded form) beside decodes
    (absorbed form) over the FP8 latent cache, against the model's teacher-forced pass, which the engine with its
    cache in the model's dtype equals (`tests/inference/test_latent_cache.py`). Within `fp8_rho` of 2 factors a
    block on average, `LATENT_TAILS` RHO at most."""
    folder = write_model(shape_config(LATENT_SHAPES[preset]), tmp_path / preset)
    engine = engine_for(folder, max_num_batched_tokens=40)
    assert isinstance(engine.runner.cache, LatentCache) and engine.runner.cache.fp8
    check_close_to_unquantized(generate(engine), load_causal_lm(str(folder)), "cpu", KV_FACTORS_PER_BLOCK,
                               LATENT_TAILS)


def test_mtp_drafts_keep_their_entries_in_the_fp8_latent_cache(tmp_path):
    """`engine.speculative.method = "mtp"`: the multi-token prediction layer's entries and indexer keys, the cache's
    last layer, are written in FP8 as the policy's are (their scales set), its drafts are verified over the FP8
    cache, and the logprobs keep the bound above."""
    folder = write_model(shape_config(PRESETS["tiny-glm5"]), tmp_path / "glm5")
    engine = engine_for(folder, max_num_batched_tokens=40, speculative={"method": "mtp", "num_tokens": 2})
    cache = engine.runner.cache
    layers = PRESETS["tiny-glm5"]["num_hidden_layers"]
    assert cache.fp8 and cache.entries.shape[0] == layers + 1 and cache.indexed_layers[-1] == layers
    check_close_to_unquantized(generate(engine), load_causal_lm(str(folder)), "cpu", KV_FACTORS_PER_BLOCK,
                               LATENT_TAILS)
    assert engine.stats().num_draft_tokens > 0
    assert cache.entry_scales[layers].any() and cache.layer_index_key_scales(layers).any()


def test_rounded_indexer_keys_change_few_choices_and_the_next_token_distribution_little(tmp_path, monkeypatch):
    """tiny-glm5 with DSA keeping 8 tokens of contexts of 40 to 84 (a choice at nearly every query; each chosen token
    weighs 1/8 of the attention, so a changed choice moves the output most), teacher-forced with and without its
    indexer keys rounded as the FP8 cache rounds them (one scale per token): the queries' top-k changes at
    near-ties only (measured: under 2% of the chosen tokens), and the next-token distributions move by a mean KL
    under `preflight.max_mismatch_kl` (measured: under 1e-3, a tenth of `max_mismatch_kl_fp8`). Why the keys stay in
    FP8: at long contexts every token's key is read each decode step (32 KiB per 128 tokens per indexed layer at GLM-5's
    shape in bf16), most of a DSA decode's reads."""
    folder = write_model(shape_config(dict(PRESETS["tiny-glm5"], index_topk=8)), tmp_path / "glm5")
    model = load_causal_lm(str(folder))
    project = dsa.Indexer.project
    indexed: list[tuple[dsa.IndexerProjections, torch.Tensor]] = []

    def rounded_keys(indexer, *args):
        index = project(indexer, *args)
        B, T, D = index.keys.shape
        keys = dequantize(*quantize_heads(index.keys.reshape(B * T, 1, D)), index.keys.dtype).view(B, T, D)
        indexed.append((index, keys))
        return dsa.IndexerProjections(index.queries, keys, index.weights)

    rng = random.Random(0)
    changed = chosen = 0
    kls = []
    for _ in range(6):
        tokens = torch.tensor([[rng.randrange(256) for _ in range(rng.randint(40, 84))]])
        positions = torch.arange(tokens.shape[1])[None]
        distributions = []
        for patch in (project, rounded_keys):
            monkeypatch.setattr(dsa.Indexer, "project", patch)
            with torch.no_grad():
                distributions.append(model.lm_head(model(tokens, positions))[0].float().log_softmax(-1))
        kls.append((distributions[0].exp() * (distributions[0] - distributions[1])).sum(-1))
        visible = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool).tril()[None]
        choosing = visible[0].sum(-1) > 8
        for index, keys in indexed:
            masks = [torch.zeros_like(visible).scatter_(-1, *dsa.choose(index.queries, index.weights, key, visible, 8))
                     for key in (index.keys, keys)]
            exact, rounded = (mask[0, choosing] for mask in masks)
            changed += int((exact & ~rounded).sum())
            chosen += int(exact.sum())
        indexed.clear()
    kl = torch.cat(kls)
    assert 0 < changed <= 0.03 * chosen, (changed, chosen)
    assert 0 < kl.mean() <= 2e-3, kl.mean()


def test_a_glm5_run_with_the_fp8_cache_resolves_serves_and_answers_to_the_fp8_mismatch_limit(tmp_path):
    """`inference.engine.kv_cache_dtype = "fp8"` with a GLM-5 model: the run's config resolves, its preflight holds
    the server to `max_mismatch_kl_fp8` as for a `KVCache`, and the engine it describes serves from an FP8 latent
    cache; exact runs refuse it, naming the key."""
    folder = write_model(shape_config(PRESETS["tiny-glm5"]), tmp_path / "glm5")
    config = parse_rl_args(["--model.name", str(folder), "--output-dir", str(tmp_path / "run"),
                            "--inference.engine.kv_cache_dtype", "fp8", "--inference.engine.num_blocks", "64",
                            "--inference.engine.max_model_len", "256"], environ={})
    assert mismatch_limit(config) == MismatchLimit(1e-2, "preflight.max_mismatch_kl_fp8",
                                                   "the server rounds to FP8: `inference.engine.kv_cache_dtype` = 'fp8'")
    engine = build_engine(config.inference.model, config.inference.engine, seed=0)
    assert isinstance(engine.runner.cache, LatentCache) and engine.runner.cache.fp8
    engine.add_request("r", [5, 6, 7, 8] * 5, SamplingParams(max_tokens=8, ignore_eos=True))
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step()
    assert sum(len(out.token_ids) for out in outputs) == 8
    with pytest.raises(ValueError, match=r"`engine.kv_cache_dtype` = 'fp8' cannot run exact: attention over an FP8 "
                                         r"cache \(keys and values, or latent entries\)"):
        build_engine(config.inference.model, config.inference.engine, seed=0, exact=True)
