"""The engine's paged latent cache (GLM-5, DeepSeek-V3): tokens and logprobs equal a teacher-forced pass of the model
(what the recompute path computes) through chunked prefills, batched decodes, prefix-cache hits, n > 1 and
preemptions, with DSA's top-k below and past the contexts; the memory plan counts latent entries, not keys and values."""

import random

import pytest
import torch
from inference_helpers import teacher_forced_logprobs
from test_engine import run

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine import paged_latent_attention
from tandem.inference.engine.kv_cache import LatentCache
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.setup import build_engine
from tandem.models.loading import load_causal_lm
from tandem.models.moe import replayed_routing
from tandem.models.presets import PRESETS, shape_config, write_model

SHAPES = {
    "glm5-sparse": dict(PRESETS["tiny-glm5"], index_topk=4),
    "glm5-topk-past-the-context": PRESETS["tiny-glm5"],
    "deepseek-v3": PRESETS["tiny-deepseek-v3"],
}
"""Contexts here reach 56 tokens: a top-k of 4 chooses for nearly every query, one of 64 never does."""

SETTINGS = {
    "roomy": dict(num_blocks=256, max_num_batched_tokens=512),
    # 20 blocks of 4 tokens for 12 sequences of up to 56 and a 24-token budget: chunked prefills and preemptions.
    "memory-starved": dict(num_blocks=20, max_num_batched_tokens=24),
    # Roomy, each op scoring at most 100 (query, context token) pairs: prefill chunks attend in slices of queries.
    "query-slices": dict(num_blocks=256, max_num_batched_tokens=512),
    # Roomy, each step launched before the last is read (CUDA's default): input tokens still pending on the device.
    "overlap": dict(num_blocks=256, max_num_batched_tokens=512),
}


def serve(folder, **settings):
    config = {"device": "cpu", "block_size": 4, "max_model_len": 64, **settings}
    return build_engine(ModelConfig(name=str(folder)), EngineConfig(**config), seed=0)


@pytest.mark.parametrize("shape, settings", [
    ("glm5-sparse", "roomy"), ("glm5-sparse", "memory-starved"), ("glm5-sparse", "query-slices"), ("glm5-sparse", "overlap"),
    ("glm5-topk-past-the-context", "roomy"), ("deepseek-v3", "roomy"), ("deepseek-v3", "memory-starved"),
])
def test_logprobs_and_greedy_tokens_match_a_teacher_forced_pass(shape, settings, monkeypatch, tmp_path):
    """Six prompts of 1 to 40 tokens sharing a 12-token prefix (three blocks), two samples each, greedy and sampled,
    in one batch."""
    latent_dir = write_model(shape_config(SHAPES[shape]), tmp_path / "m")
    if settings == "query-slices":
        monkeypatch.setattr(paged_latent_attention, "QUERY_KEY_PAIRS", 100)
    engine = serve(latent_dir, **SETTINGS[settings])
    assert isinstance(engine.runner.cache, LatentCache)
    engine.overlap = settings == "overlap"
    computed = []
    run_batch = engine.runner.run
    engine.runner.run = lambda batch, previous: (computed.append(batch.num_tokens), run_batch(batch, previous))[1]
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(12)]
    requests = {}
    for i in range(6):
        prompt = (prefix if i % 3 else [])[:rng.randint(1, 12)] + [rng.randrange(256) for _ in range(rng.randint(1, 28))]
        params = SamplingParams(max_tokens=16, temperature=[0.0, 1.0][i % 2], seed=i, ignore_eos=True,
                                return_routed_experts=True)
        requests[str(i)] = (prompt, params)
        engine.add_request(str(i), prompt, params, n=2)
    results = run(engine)
    model = load_causal_lm(str(latent_dir))
    assert len(results) == 12
    for (rid, _), r in results.items():
        prompt, params = requests[rid]
        ids, logprobs = r["ids"], r["logprobs"]
        assert len(ids) == 16
        expected = teacher_forced_logprobs(model, prompt, ids, params.temperature)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)
        replay = torch.full((len(prompt) + 16, 3, 2), -1)  # the experts the engine reports, of the 3 MoE blocks
        replay[len(prompt) - 1:-1] = torch.tensor(r["routed_experts"])
        with replayed_routing(model, replay):
            torch.testing.assert_close(teacher_forced_logprobs(model, prompt, ids, params.temperature), expected)
        if params.temperature == 0.0:  # each greedy token is the teacher-forced pass's most likely one
            sequence = torch.tensor([prompt + ids])
            with torch.no_grad():
                logits = model.lm_head(model(sequence, torch.arange(sequence.shape[1])[None]))[0, len(prompt) - 1:-1]
            assert ids == logits.argmax(-1).tolist()
    without_cache_hits = sum(len(prompt) + 15 for prompt, _ in requests.values()) * 2
    if settings != "memory-starved":  # the second samples and the shared prefix came from the cache
        assert sum(computed) < without_cache_hits
    else:
        assert engine.scheduler.num_preemptions > 0


def test_the_memory_plan_counts_latent_entries(tmp_path):
    """Per token and layer kv_lora_rank + qk_rope_head_dim numbers, plus index_head_dim in each layer with an
    indexer: a sixth of what keys and values of every head would take at tiny-glm5's shape."""
    shape = PRESETS["tiny-glm5"]
    folder = write_model(shape_config(shape), tmp_path / "m")
    engine = serve(folder, cpu_kv_cache_gib=1 / 1024, max_num_seqs=64, max_model_len=256)
    cache = engine.runner.cache
    layers, full = shape["num_hidden_layers"], 2  # indexer_types: full, shared, full, shared
    per_token = layers * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"]) + full * shape["index_head_dim"]
    expanded = layers * 2 * shape["num_attention_heads"] * (shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"])
    assert per_token * 6 == expanded
    per_block = 4 * per_token * 4  # block_size 4, fp32
    assert engine.block_manager.num_blocks == 2**20 // per_block
    assert (cache.entries.numel() + cache.index_keys.numel()) * 4 == (engine.block_manager.num_blocks + 1) * per_block
    assert cache.bytes_per_token == 4 * per_token  # what the decode roofline counts (benchmarks/roofline.py)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_drafts_are_verified_over_the_latent_cache(method, tmp_path):
    """N-gram drafts, or a DeepSeek-V3 draft model with a latent cache of its own: a token and its drafts attend as
    one short query each (absorbed form, each choosing its top-k)."""
    folder = write_model(shape_config(SHAPES["glm5-sparse"]), tmp_path / "m")
    speculative = {"method": method, "min_expected_tokens": 0}  # draft wherever lookup matches: verifying is checked
    if method == "draft_model":
        speculative["draft_model"] = str(write_model(shape_config(SHAPES["deepseek-v3"]), tmp_path / "draft"))
    engine = serve(folder, num_blocks=64, speculative=speculative)
    prompt = [5, 6, 7, 8] * 6
    engine.add_request("r", prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=0, ignore_eos=True))
    r = run(engine)[("r", 0)]
    assert engine.stats().num_draft_tokens > 0
    expected = teacher_forced_logprobs(load_causal_lm(str(folder)), prompt, r["ids"], 1.0)
    torch.testing.assert_close(torch.tensor(r["logprobs"]), expected, atol=1e-5, rtol=0)


def test_a_mixed_step_attends_chunks_expanded_and_short_queries_absorbed():
    """A prefill chunk (6 tokens, nothing cached) is a group of its own in the expanded form; a decode (context 9)
    and a token with two drafts (context 7) form one absorbed group, padded by repeating the last query."""
    from tandem.inference.engine.paged_attention import AttentionMetadata
    from tandem.inference.engine.paged_latent_attention import PagedLatentAttention

    cache = LatentCache(num_layers=1, num_blocks=8, block_size=4, entry_dim=3, indexed_layers=[], index_dim=2,
                        dtype=torch.float32, device=torch.device("cpu"))
    tables = torch.tensor([[0, 1, 7], [2, 3, 4], [5, 6, 7]])
    meta = AttentionMetadata(slot_mapping=torch.zeros(10, dtype=torch.long), query_start=torch.tensor([0, 6, 7, 10]),
                             seq_lens=torch.tensor([6, 9, 7]), block_tables=tables, tiles=torch.zeros(2, 1), block_q=16,
                             query_lens_host=[6, 1, 3], seq_lens_host=[6, 9, 7])
    chunk, short = PagedLatentAttention(cache, meta, index_topk=0).groups()
    assert chunk.expanded and not short.expanded
    assert chunk.rows.tolist() == [list(range(6))] and chunk.blocks.tolist() == [[0, 1]]
    assert chunk.visible[0].tolist() == torch.ones(6, 8, dtype=torch.bool).tril().tolist()
    assert short.rows.tolist() == [[6, 6, 6], [7, 8, 9]] and short.blocks.tolist() == [[2, 3, 4], [5, 6, 7]]
    assert short.visible.sum(-1).tolist() == [[9, 9, 9], [5, 6, 7]]  # each query sees up to its own position


@pytest.mark.parametrize("indexed_layers", [[0, 2], []], ids=["dsa", "mla-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_blocks_move_between_caches_bit_for_bit_and_only_into_their_own_layout(indexed_layers, dtype):
    """A prefill server's blocks land in a decode server's cache as they were held: latent entries and indexer keys
    of every layer, in other block ids; a cache of another layout takes nothing."""
    def cache_of(entry_dim=6):
        return LatentCache(num_layers=3, num_blocks=6, block_size=4, entry_dim=entry_dim, indexed_layers=indexed_layers,
                           index_dim=5, dtype=dtype, device=torch.device("cpu"))

    source, target = cache_of(), cache_of()
    gen = torch.Generator().manual_seed(0)
    for tensor in (source.entries, source.index_keys):
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    blocks = source.export_blocks([4, 1])
    assert blocks.shape == (2, 4, 3 * 6 + len(indexed_layers) * 5) and blocks.dtype == dtype
    target.import_blocks([0, 3], blocks)
    for held, landed in ((source.entries, target.entries), (source.index_keys, target.index_keys)):
        assert torch.equal(landed[:, [0, 3]].view(torch.uint8), held[:, [4, 1]].view(torch.uint8))
        assert not landed[:, [1, 2, 4, 5, 6]].any()
    other = cache_of(entry_dim=7)
    assert source.layout == target.layout != other.layout
    with pytest.raises(ValueError, match=r"latent blocks of shape \(2, 4, \d+\) and torch\.\w+; this cache takes"):
        other.import_blocks([0, 3], blocks)
    assert not other.entries.any() and not other.index_keys.any()
