"""Latent attention's context-parallel backend at a `cp` group of one rank, on the CPU and on CUDA: the gathered-latent
path (attention over the gathered entries under the DSA choice) gives the one-rank forward and gradients on a packed row whose
documents outgrow `index_topk`; and on CUDA the indexer's choice over a long row holds a slice of its scores at a
time, never all of them. (`test_context_parallel.py` runs the backend over 2 and 4 ranks.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tandem.models.attention import DocumentCausalAttention, document_ids
from tandem.models.dsa import IndexerProjections, choose, index_scores, top_k
from tandem.models.loading import empty_native
from tandem.models.presets import preset_config
from tandem.trainer.micro_batch import ContextShard
from tandem.trainer.parallel.dims import close_parallel, init_parallel
from tandem.trainer.parallel.latent_context_parallel import LatentContextAttention

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device, tolerance", [("cpu", 1e-5), pytest.param("cuda", 1e-4, marks=CUDA)])
def test_the_gathered_latent_backend_of_one_rank_gives_the_models_forward_and_gradients(device, tolerance):
    """Relative to the largest value of each tensor: fp32 with other orders of summation (on CUDA other kernels)."""
    hf_config = dict(preset_config("tiny-glm5"), index_topk=8)
    model = empty_native(hf_config, device, torch.float32)
    model.init_weights(0)
    lengths = [29, 6, 17, 12]  # past index_topk but one: the sparse choice runs
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf_config["vocab_size"], (1, sum(lengths)), generator=gen).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    upstream = torch.randn(1, sum(lengths), hf_config["hidden_size"], generator=gen).to(device)
    dims = init_parallel(device)
    try:
        shard = ContextShard(group=dist.group.WORLD, size=1, rank=0, row_document_ids=document_ids(positions)[0],
                             row_document_lengths=lengths, targets=ids, num_real=sum(lengths))
        backends = {"one rank": DocumentCausalAttention([lengths], dims.device, ["math"]),
                    "gathered": LatentContextAttention(shard, query_chunk=5, index_topk=8)}
        results = {}
        for name, backend in backends.items():
            model.zero_grad()
            hidden = model(ids, positions, attention=backend)
            (hidden * upstream).sum().backward()
            results[name] = hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        close_parallel()
    (ref, ref_grads), (got, got_grads) = results["one rank"], results["gathered"]
    assert (got - ref).abs().max() <= tolerance * ref.abs().max()
    assert got_grads.keys() == ref_grads.keys() and any("kv_a_proj_with_mqa" in n for n in ref_grads)
    for name, grad in ref_grads.items():
        assert (got_grads[name] - grad).abs().max() <= tolerance * grad.abs().max(), name


@CUDA
def test_the_indexers_choice_over_a_long_row_holds_a_slice_of_its_scores_at_a_time():
    """GLM-5's indexer (32 heads of 128 features) over one 32,768-token document: all its scores at once would take
    128 GiB of fp32, more than the device; sliced they take 512 MiB, beside the 1 GiB causal mask."""
    T, heads, dim, k = 32768, 32, 128, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    index = IndexerProjections(torch.randn(1, T, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16),
                               torch.randn(1, T, dim, generator=gen, device="cuda", dtype=torch.bfloat16),
                               torch.randn(1, T, heads, generator=gen, device="cuda"))
    visible = torch.ones(T, T, dtype=torch.bool, device="cuda").tril()[None]
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    positions, kept = choose(index.queries, index.weights, index.keys, visible, k)
    peak = torch.cuda.max_memory_allocated() - before
    assert positions.shape == kept.shape == (1, T, k)
    assert peak < 4 * 2**30, f"{peak / 2**30:.1f} GiB"
    assert int(kept[0, 100].sum()) == 101 and bool(kept[0, -1].all())  # an early query keeps all it sees
    rows = slice(T - 3, T)  # the last queries, chosen alone
    alone, _ = top_k(index_scores(index.queries[:, rows], index.keys, index.weights[:, rows]), visible[:, rows], k)
    assert torch.equal(positions[:, rows].sort(-1).values, alone.sort(-1).values)
