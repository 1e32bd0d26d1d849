"""The latent cache's decode kernels (`tandem.kernels.latent_attention`): DSA's index scores and top-k, and
absorbed-form attention over every visible entry or over the chosen ones, read in place through block tables;
against float64 formulas over the gathered cache, and the engine's latent attention with them against its torch
path (`PagedLatentAttention`, full and `shared` DSA layers, decodes and drafts beside a prefill chunk). Sequences of
several lengths, partly filled last blocks, contexts below and past `index_topk`, a CUDA-graph padding row. Under
Triton's interpreter on CPU tensors (fp32: 1e-5), and on CUDA in bf16."""

from __future__ import annotations

import importlib.util
import random
import re
import subprocess
from pathlib import Path

import pytest
import torch
from triton_interpreter import needs_triton_interpreter, run_interpreted

from tandem.inference.engine.kv_cache import LatentCache
from tandem.inference.engine.paged_attention import AttentionMetadata
from tandem.models.dsa import IndexerProjections
from tandem.models.mla import LatentAttention, LatentProjections

DECODES = [3, 17, 40, 600, 9, 0]
"""Contexts of a decode-only step: a partly filled first block, several blocks, one of three chunks of keys
(`chunk_keys`: 256 here), a CUDA-graph padding row (context 0)."""
MIXED = [(6, 6), (1, 9), (3, 7), (2, 30)]
"""(tokens this step, context after it): a fresh prefill chunk, a decode, a token with two drafts, one with one."""
ONE_CHUNK = [(13, 40)]
"""A chunk of one sequence's prompt: the kernels' per-query rows of its one sequence are a view of one element."""


def latent_step(device: str, dtype: torch.dtype, shapes: list[tuple[int, int]], block_size: int = 4, heads: int = 4,
                seed: int = 0, fp8: bool = False) -> tuple[LatentAttention, LatentCache, AttentionMetadata,
                                                            LatentProjections, IndexerProjections]:
    """A step of sequences of these `shapes` over a two-layer latent cache whose first layer has an indexer (the
    second shares its choice), every slot random: the layers' attention module, the cache, the step's metadata, and
    its projections and indexer projections (the step's own entries and keys are written by the backend). `fp8`: an
    FP8 cache, every slot written (quantized) from random entries and keys."""
    gen = torch.Generator().manual_seed(seed)
    kv_lora_rank, rope, nope, v_dim, index_heads, index_dim = 32, 16, 16, 16, 8, 32
    attention = LatentAttention(64, heads, None, kv_lora_rank, nope, rope, v_dim, False, (nope + rope) ** -0.5, True)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    attention.to(device, dtype)
    blocks_needed = [-(-ctx // block_size) for _, ctx in shapes]
    num_blocks = sum(blocks_needed) + 8
    cache = LatentCache(2, num_blocks, block_size, kv_lora_rank + rope, [0], index_dim, dtype, torch.device(device),
                        fp8=fp8, rope_dim=rope)
    if fp8:
        every_slot = torch.arange((num_blocks + 1) * block_size, device=device)
        for layer in range(2):
            cache.write(layer, every_slot, torch.randn(len(every_slot), kv_lora_rank + rope, generator=gen).to(device, dtype))
        cache.write_index_keys(0, every_slot, torch.randn(len(every_slot), index_dim, generator=gen).to(device, dtype))
    else:
        for tensor in (cache.entries, cache.index_keys):
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(shapes), max(blocks_needed) + 2, dtype=torch.long)
    slots: list[int] = []
    for i, (q_len, ctx) in enumerate(shapes):
        tables[i, :blocks_needed[i]] = torch.tensor(order[:blocks_needed[i]], dtype=torch.long)
        order = order[blocks_needed[i]:]
        if ctx == 0:
            slots.append(cache.pad_slot)
        else:
            slots.extend(int(tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx - q_len, ctx))
    n = sum(q for q, _ in shapes)
    query_lens = [q for q, _ in shapes]
    decode_only = all(q == 1 for q in query_lens)
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=device),
                             query_start=torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), device=device),
                             seq_lens=torch.tensor([c for _, c in shapes], device=device), block_tables=tables.to(device),
                             tiles=torch.zeros(2, 1, dtype=torch.long, device=device), block_q=1 if decode_only else 16,
                             query_lens_host=query_lens, seq_lens_host=[c for _, c in shapes],
                             max_context=max(c for _, c in shapes))

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    projections = LatentProjections(rand(1, n, heads, nope), rand(1, n, heads, rope), rand(1, n, kv_lora_rank + rope), None)
    index = IndexerProjections(rand(1, n, index_heads, index_dim), rand(1, n, index_dim),
                               torch.randn(1, n, index_heads, generator=gen).to(device))
    return attention, cache, meta, projections, index


def context_of(cache_layer: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first `ctx` tokens of one sequence's blocks, gathered: [ctx, features]."""
    S = cache_layer.shape[1]
    positions = torch.arange(ctx, device=table.device)
    return cache_layer[table[positions // S], positions % S]


def float64_index_scores(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """DSA's index scores of one query (queries [H, D], weights [H]) over keys [C, D], in float64: [C]."""
    q, w, k = queries.double(), weights.double(), keys.double()
    return (w[:, None] * torch.relu(q @ k.T * q.shape[-1] ** -0.5)).sum(0)


def assert_top_k_up_to_ties(scores: torch.Tensor, chosen: list[int], k: int, tolerance: float) -> None:
    """`chosen` holds min(k, context) distinct positions, each scored within the tolerance of the k-th best of
    `scores` [context]: the top k up to near ties the scores' precision cannot order."""
    kth_best = scores.topk(min(k, scores.shape[0])).values[-1]
    assert len(set(chosen)) == len(chosen) == min(k, scores.shape[0]), chosen
    assert (scores[sorted(chosen)] >= kth_best - tolerance * (1 + kth_best.abs())).all(), chosen


def check_kernels_against_float64(device: str, dtype: torch.dtype, tolerance: float, index_topk: int = 12,
                                  heads: int = 4, fp8: bool = False) -> None:
    """The three kernels on a decode-only step (`DECODES`) against float64 formulas over each gathered context (`fp8`:
    over an FP8 cache, the formulas over what it holds, each FP8 number times its scale)."""
    from tandem.kernels.latent_attention import choose, index_scores, latent_attention

    attention, cache, meta, projections, index = latent_step(device, dtype, [(1, c) for c in DECODES], heads=heads,
                                                             fp8=fp8)
    every_block = torch.arange(cache.entries.shape[1], device=device)
    entries, keys = cache.read_entries(0, every_block), cache.read_index_keys(0, every_block)  # as held, in `dtype`
    held_entries, held_keys, key_scales = cache.layer(0), cache.layer_index_keys(0), cache.layer_index_key_scales(0)
    positions = (meta.seq_lens - 1)
    rows = torch.arange(len(DECODES), device=device)
    bound = max(DECODES)
    scores = index_scores(index.queries[0], index.weights[0], held_keys, meta.block_tables, rows, positions, bound,
                          key_scales)
    chosen, counts = choose(index.queries[0], index.weights[0], held_keys, meta.block_tables, rows, positions, bound,
                            index_topk, max_pairs=2 * bound, key_scales=key_scales)  # two queries a slice
    q = attention.absorbed_queries(projections.q_nope[0], projections.q_rope[0])
    dense = latent_attention(q, held_entries, meta.block_tables, rows, (positions + 1).clamp(min=0), bound,
                             attention.absorbed_scale, attention.kv_lora_rank, None, *cache.layer_scales(0))
    sparse = latent_attention(q, held_entries, meta.block_tables, rows, counts, chosen.shape[1], attention.absorbed_scale,
                              attention.kv_lora_rank, chosen, *cache.layer_scales(0))
    assert counts.tolist() == [min(c, index_topk) for c in DECODES]
    for i, ctx in enumerate(DECODES):
        if ctx == 0:  # a padding row: nothing seen, zeros out
            assert torch.isinf(scores[i]).all() and not dense[i].any() and not sparse[i].any()
            continue
        expected = float64_index_scores(index.queries[0, i], index.weights[0, i],
                                        context_of(keys, meta.block_tables[i], ctx))
        torch.testing.assert_close(scores[i, :ctx].double(), expected, rtol=tolerance, atol=tolerance)
        assert torch.isinf(scores[i, ctx:]).all()
        # The top k, up to near ties the scores' tolerance cannot order (FP8 keys in bf16): its attention follows it.
        picked = chosen[i, :counts[i]].cpu()
        assert_top_k_up_to_ties(expected.cpu(), picked.tolist(), index_topk, tolerance)
        e_i = context_of(entries, meta.block_tables[i], ctx).double()
        for out, seen in ((dense, torch.arange(ctx)), (sparse, picked)):
            weights = torch.softmax(q[i].double() @ e_i[seen].T * attention.absorbed_scale, dim=-1)
            expected_out = weights @ e_i[seen, :attention.kv_lora_rank]
            torch.testing.assert_close(out[i].double(), expected_out, rtol=tolerance, atol=tolerance)


def chosen_tokens(backend, selection: list | None, kernels: bool) -> dict[int, frozenset[int]]:
    """Each query's (the step's token row's) chosen context positions in a step's DSA `selection`, a `Chosen` per
    [G, L] query of the torch path or per kernel query; none where a group sees every visible token."""
    picked: dict[int, frozenset[int]] = {}
    for group, choice in zip(backend.groups(), selection or []):
        if choice is None:
            continue
        flat = kernels and not group.expanded
        rows = group.kernel_queries[0] if flat else group.rows.flatten()
        positions = choice.positions.reshape(len(rows), -1)
        counts = choice.counts.flatten()
        picked.update(zip(rows.tolist(), [frozenset(positions[i, :counts[i]].tolist()) for i in range(len(rows))]))
    return picked


def check_near_tie(cache, meta, index, row: int, index_topk: int, choices: tuple, tolerance: float) -> None:
    """Both `choices` of the query at step token `row` are its top `index_topk` up to near ties: float64 index scores
    over the keys as the cache holds them, every chosen token's within the tolerance of the k-th best."""
    seq = int(torch.searchsorted(meta.query_start, torch.tensor(row, device=meta.query_start.device), right=True)) - 1
    position = int(meta.seq_lens[seq]) - (int(meta.query_start[seq + 1]) - row)
    every_block = torch.arange(cache.entries.shape[1], device=meta.block_tables.device)
    keys = context_of(cache.read_index_keys(0, every_block), meta.block_tables[seq], position + 1)
    scores = float64_index_scores(index.queries[0, row], index.weights[0, row], keys).cpu()
    for choice in choices:
        assert_top_k_up_to_ties(scores, list(choice), index_topk, tolerance)


def check_backend_against_torch_path(device: str, dtype: torch.dtype, tolerance: float, fp8: bool = False) -> None:
    """`PagedLatentAttention` with the kernels against its torch path, a full DSA layer then a shared one: decodes
    (top-k below and past the contexts, as a CUDA graph's bound too), a mixed step (decodes, drafts and a chunk) and
    one sequence's chunk alone; `fp8`: over an FP8 cache (the torch path dequantizes what it gathers, the kernels in registers)."""
    from tandem.inference.engine import paged_latent_attention
    from tandem.inference.engine.paged_latent_attention import PagedLatentAttention

    serve = paged_latent_attention.kernels_serve
    try:
        decodes = [(1, c) for c in DECODES]
        for shapes, index_topk, bound in ((decodes, 12, None), (decodes, 600, None), (decodes, 300, 640), (MIXED, 5, None),
                                          (ONE_CHUNK, 5, None)):
            outputs = []
            for kernels in (True, False):
                paged_latent_attention.kernels_serve = serve if kernels else (lambda cache, rank: False)
                attention, cache, meta, projections, index = latent_step(device, dtype, shapes, fp8=fp8)
                if bound is not None:  # a graph's step: the bound, not the longest context
                    meta.max_context, meta.query_lens_host, meta.seq_lens_host = bound, None, None
                backend = PagedLatentAttention(cache, meta, index_topk)
                full, selection = backend.attend_latent(0, attention, projections, index, None)
                shared, _ = backend.attend_latent(1, attention, projections, None, selection)
                outputs.append((full, shared, selection, chosen_tokens(backend, selection, kernels)))
            (full, shared, chosen, picked), (full_torch, shared_torch, chosen_torch, picked_torch) = outputs
            sparse = index_topk < max(c for _, c in shapes)
            assert [c is None for c in chosen] == [c is None for c in chosen_torch] == [not sparse] * len(chosen)
            assert picked.keys() == picked_torch.keys() and bool(picked) == sparse
            real = torch.cat([torch.arange(s - q, s) for s, (q, c) in zip(meta.query_start[1:].tolist(), shapes) if c])
            # A query whose two choices part must part at near ties of its index scores (the kernels score FP8 keys
            # in fp32 registers, the torch path their values in `dtype`); the others attend alike.
            alike = [row for row in real.tolist() if picked.get(row) == picked_torch.get(row)]
            for row in set(real.tolist()) - set(alike):
                check_near_tie(cache, meta, index, row, index_topk, (picked[row], picked_torch[row]), tolerance)
            assert len(alike) == len(real) or (dtype != torch.float32 and 2 * len(alike) >= len(real)), (alike, real)
            for out, expected in ((full, full_torch), (shared, shared_torch)):
                torch.testing.assert_close(out[0, alike].double(), expected[0, alike].double(), rtol=tolerance,
                                           atol=tolerance)
    finally:
        paged_latent_attention.kernels_serve = serve

def engine_samples(folder: Path, device: str, dtype: str = "float32", **engine) -> dict[str, tuple[list, list]]:
    """Four prompts of 1 to 30 tokens (with `speculative` in `engine`: of a 4-token pattern repeated, which n-gram
    lookup drafts from), sampled together for 16 tokens each through an engine of the model in `folder` (blocks of
    4 tokens, `engine`'s settings): each request's token ids and logprobs."""
    from tandem.config.base import ModelConfig
    from tandem.config.inference import EngineConfig
    from tandem.inference.engine.sampling_params import SamplingParams
    from tandem.inference.engine.setup import build_engine

    config = dict(device=device, block_size=4, max_model_len=64, max_num_seqs=8, **engine)
    served = build_engine(ModelConfig(name=str(folder), dtype=dtype), EngineConfig(**config), seed=0)
    rng = random.Random(0)
    for i in range(4):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        if "speculative" in engine:
            prompt = [5 + i, 6, 7, 8] * 6
        served.add_request(str(i), prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True))
    samples: dict[str, tuple[list, list]] = {}
    while served.has_unfinished:
        for out in served.step():
            ids, logprobs = samples.setdefault(out.request_id, ([], []))
            ids += out.token_ids
            logprobs += out.logprobs
    assert sorted(len(ids) for ids, _ in samples.values()) == [16] * 4
    assert (served.runner.graphs is not None) == (device == "cuda" and config.get("cuda_graphs", True))
    assert (served.stats().num_draft_tokens > 0) == ("speculative" in engine)
    return samples


def check_engine_kernels_against_torch_path(folder: Path, device: str, tolerance: float, **engine) -> None:
    """The engine's samples with the kernels equal its torch path's: the same tokens, logprobs within `tolerance`."""
    from tandem.inference.engine import paged_latent_attention

    with_kernels = engine_samples(folder, device, **engine)
    serve = paged_latent_attention.kernels_serve
    paged_latent_attention.kernels_serve = lambda cache, rank: False
    try:
        torch_path = engine_samples(folder, device, **dict(engine, cuda_graphs=False))
    finally:
        paged_latent_attention.kernels_serve = serve
    for rid, (ids, logprobs) in torch_path.items():
        assert with_kernels[rid][0] == ids, rid
        torch.testing.assert_close(torch.tensor(with_kernels[rid][1]), torch.tensor(logprobs), atol=tolerance, rtol=0)


INTERPRETED = """
import torch
from tandem.kernels import latent_attention
latent_attention.serves = lambda *dims_and_device: True  # CPU tensors, run by the interpreter
from test_latent_attention_kernels import check_backend_against_torch_path, check_kernels_against_float64
for fp8 in (False, True):  # the cache in the model's dtype, in FP8
    for index_topk, heads in ((12, 4), (300, 4), (12, 64)):  # one chunk of chosen keys, two; two programs' heads
        check_kernels_against_float64("cpu", torch.float32, 1e-5, index_topk, heads, fp8)
    check_backend_against_torch_path("cpu", torch.float32, 1e-5, fp8)
print("ok")
"""

ENGINE_INTERPRETED = """
from pathlib import Path
from tandem.kernels import latent_attention
latent_attention.serves = lambda *dims_and_device: True  # CPU tensors, run by the interpreter
from test_latent_attention_kernels import check_engine_kernels_against_torch_path
check_engine_kernels_against_torch_path(Path({folder!r}), "cpu", 1e-5)
# A token and its drafts: short queries of several tokens, verified in eager steps.
check_engine_kernels_against_torch_path(Path({folder!r}), "cpu", 1e-5,
                                        speculative=dict(method="ngram", min_expected_tokens=0))
check_engine_kernels_against_torch_path(Path({folder!r}), "cpu", 1e-5, kv_cache_dtype="fp8")
print("ok")
"""


@needs_triton_interpreter
def test_latent_kernels_under_tritons_interpreter():
    """CPU tensors, fp32: the kernels against float64, the backend with them against its torch path; over a cache in
    the model's dtype and over an FP8 one."""
    run_interpreted(INTERPRETED, timeout=900, folder=str(Path(__file__).parent))


@needs_triton_interpreter
@pytest.mark.parametrize("index_topk", [4, 64], ids=["sparse", "topk-past-the-contexts"])
def test_engine_with_the_kernels_under_tritons_interpreter_samples_as_its_torch_path(index_topk, tmp_path):
    """tiny-glm5 on the CPU in fp32, four prompts sampled for 16 tokens (contexts to 46), then four that n-gram lookup
    drafts for, then the first four over an FP8 cache: with DSA choosing 4 tokens of most contexts, and with a top-k
    past every context (dense MLA)."""
    from tandem.models.presets import PRESETS, shape_config, write_model

    folder = write_model(shape_config(dict(PRESETS["tiny-glm5"], index_topk=index_topk)), tmp_path / "m")
    run_interpreted(ENGINE_INTERPRETED.format(folder=str(folder)), timeout=900, folder=str(Path(__file__).parent))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_glm5_attention_programs_compile_for_hopper_without_spills(tmp_path):
    """GLM-5's shape in bf16 (512 latent + 64 RoPE features, `HEADS_PER_PROGRAM` heads a program, dense and sparse;
    the combination of their chunks; the indexer's scores), over a bf16 cache and an FP8 one, compiled for sm_90 by
    Triton and its bundled ptxas, no GPU needed: the kernels build, and their tiles stay in registers with the
    engine's launch settings (a spill would move every chunk's output through local memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tandem.kernels import attention, latent_attention

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("Triton's NVIDIA backend has no ptxas")
    heads = latent_attention.HEADS_PER_PROGRAM
    pointers = dict(q_ptr="*bf16", ropes_ptr="*bf16", scales_ptr="*fp32", out_ptr="*bf16", part_out_ptr="*fp32",
                    part_stats_ptr="*fp32", block_tables_ptr="*i64", query_seq_ptr="*i64", lengths_ptr="*i64",
                    chosen_ptr="*i64", seq_lens_ptr="*i64", query_start_ptr="*i64", qk_scale="fp32")
    held = {False: "*bf16", True: "*fp8e4nv"}
    launches = {False: latent_attention._ATTEND_LAUNCH, True: latent_attention._FP8_ATTEND_LAUNCH}
    programs = [(latent_attention._latent_chunk_kernel,
                 dict(GROUP=heads, ROWS=heads, SPLIT=256, BLOCK_N=launches[fp8]["BLOCK_N"], PAGE=16, LATENT=512,
                      ROPE=64, SPARSE=sparse, FP8=fp8, IEEE=False),
                 {k: v for k, v in launches[fp8].items() if k != "BLOCK_N"}, dict(entries_ptr=held[fp8]))
                for sparse in (False, True) for fp8 in (False, True)]
    programs.append((attention._combine_splits_kernel, dict(GROUP=heads, GROUP_P=heads, SPLIT=4096, HEAD_DIM=512),
                     latent_attention._COMBINE_LAUNCH, {}))
    programs += [(latent_attention._index_scores_kernel,  # GLM-5's indexer: 32 heads of 128
                  dict(HEADS=32, HEADS_P=32, HEAD_DIM=128, BLOCK_N=latent_attention.SCORE_KEYS, PAGE=16, FP8=fp8,
                       IEEE=False), latent_attention._SCORE_LAUNCH,
                  dict(w_ptr="*fp32", keys_ptr=held[fp8], key_scales_ptr="*fp32", query_pos_ptr="*i64",
                       out_ptr="*fp32", scale="fp32"))
                 for fp8 in (False, True)]
    for i, (kernel, constants, options, own_types) in enumerate(programs):
        types = dict(pointers, **own_types)
        signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options=options)
        ptx = tmp_path / f"program-{i}.ptx"
        ptx.write_text(compiled.asm["ptx"])
        report = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "out.cubin")],
                                capture_output=True, text=True, check=True).stderr
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
        assert spills and not any(spills), (kernel.__name__, constants, report)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["cache-in-dtype", "fp8-cache"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_latent_kernels_on_cuda(dtype, tolerance, fp8):
    for index_topk, heads in ((12, 4), (300, 4), (12, 64)):
        check_kernels_against_float64("cuda", dtype, tolerance, index_topk, heads, fp8)
    check_backend_against_torch_path("cuda", dtype, tolerance, fp8)


@needs_cuda
@pytest.mark.parametrize("index_topk", [4, 64], ids=["sparse", "topk-past-the-contexts"])
def test_engine_with_the_kernels_on_cuda(index_topk, tmp_path):
    """tiny-glm5 in fp32: the engine with the kernels and CUDA graphs samples as its eager torch path (over a cache in
    fp32 and an FP8 one), and as itself without graphs."""
    from tandem.models.presets import PRESETS, shape_config, write_model

    folder = write_model(shape_config(dict(PRESETS["tiny-glm5"], index_topk=index_topk)), tmp_path / "m")
    check_engine_kernels_against_torch_path(folder, "cuda", 1e-4)
    check_engine_kernels_against_torch_path(folder, "cuda", 1e-4, kv_cache_dtype="fp8")
    graphs, eager = engine_samples(folder, "cuda"), engine_samples(folder, "cuda", cuda_graphs=False)
    for rid, (ids, logprobs) in eager.items():
        assert graphs[rid][0] == ids, rid
        torch.testing.assert_close(torch.tensor(graphs[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)
