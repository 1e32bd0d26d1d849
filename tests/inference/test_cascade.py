"""Cascade attention on the engine's side: which sequences of a decode step are grouped over a shared prefix
(`cascade.py`), the torch path's cascade against plain attention, and the engine's outputs with the cascade on and
off. The Triton kernels against plain attention: `tests/kernels/test_cascade_attention_kernels.py`."""

import pytest
import torch
from attention_cases import dense_reference, shared_prefix_step, with_cascade

from tandem.config.base import ModelConfig
from tandem.config.inference import EngineConfig
from tandem.inference.engine.cascade import CascadePlanner, find_shared_prefixes, shared_blocks
from tandem.inference.engine.paged_attention import reference_cascade_attention
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.sequence import Sequence
from tandem.inference.engine.setup import build_engine


def test_shared_blocks_counts_the_leading_run_of_equal_ids_within_the_limit():
    assert shared_blocks([1, 2, 3, 4], [1, 2, 3, 9, 10], 10) == 3
    assert shared_blocks([1, 2, 3, 4], [1, 2, 3, 4], 2) == 2
    assert shared_blocks([1, 2], [5, 2], 10) == 0
    assert shared_blocks([], [1], 10) == 0
    assert shared_blocks([1, 5, 3], [2, 5, 3], 10) == 0  # equal ids after a difference are not a shared prefix


def test_groups_are_rows_sharing_leading_blocks_and_a_member_that_shares_less_is_left_out_when_it_costs():
    """Rows 0, 2, 5 share 3 blocks; row 3 shares only the first of them (a conversation's system prompt): with it the
    group would save 3 x 1 blocks instead of 2 x 3, so it stays out; row 1 shares nothing; row 4 shares 2 blocks
    with row 6, whose context (33 tokens, block size 16) leaves only 2 whole blocks before its query."""
    tables = [[1, 2, 3, 10], [20, 21], [1, 2, 3, 11], [1, 30, 31], [40, 41, 42, 43], [1, 2, 3, 12, 13], [40, 41, 42]]
    contexts = [60, 20, 50, 40, 60, 70, 33]
    found = find_shared_prefixes(tables, contexts, 16, members=8)
    assert sorted(map(sorted, found.groups)) == [[0, 2, 5], [4, 6]]
    assert dict(zip(map(min, found.groups), found.prefix_tokens)) == {0: 48, 4: 32}
    assert found.row_prefix == [48, 0, 48, 0, 32, 48, 32]
    assert found.saved_tokens == 2 * 48 + 32


def test_a_group_larger_than_a_program_holds_is_served_in_pieces_and_a_lone_row_shares_nothing():
    tables = [[7, 8, 100 + i] for i in range(5)]
    found = find_shared_prefixes(tables, [40] * 5, 16, members=2)
    assert sorted(map(len, found.groups)) == [2, 2] and found.row_prefix.count(0) == 1
    row_prefix, group_prefix, members = found.transfer_parts(8, 4, 2)
    assert row_prefix[5:] == [0, 0, 0] and group_prefix == [32, 32, 0, 0] and members[4:] == [-1] * 4


def test_the_planner_keeps_its_plan_while_the_tables_are_the_same_lists_and_declines_small_savings():
    seqs = [Sequence("r", i, list(range(50)), SamplingParams(max_tokens=8), tokenizer=None) for i in range(3)]
    for i, seq in enumerate(seqs):
        seq.block_table = [1, 2, 3, 10 + i]
        seq.num_computed_tokens = 50
    planner = CascadePlanner(16, members=8, min_saved_tokens=96)
    plan = planner.plan(seqs)
    assert plan is not None and plan.saved_tokens == 96
    seqs[0].block_table.append(99)  # a decode's new block: the same list
    assert planner.plan(seqs) is plan
    seqs[2].block_table = [1, 2, 30, 31]  # replaced (freed and allocated again): planned anew, the three share 2
    assert planner.plan(seqs) is None     # blocks and save 2 x 32 tokens, fewer than asked
    assert CascadePlanner(16, members=8, min_saved_tokens=64).plan(seqs).saved_tokens == 64


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32-cache", "fp8-cache"])
def test_the_torch_paths_cascade_equals_plain_attention(fp8):
    q, cache, meta, tables = shared_prefix_step("cpu", torch.float32, fp8=fp8)
    meta = with_cascade(meta, tables, 16, members=8)
    assert len(meta.cascade.plan.groups) == 4
    out = reference_cascade_attention(q, cache, 0, meta)  # the padding row too: it sees no key, its output is 0
    torch.testing.assert_close(out.double(), dense_reference(q, cache, meta), rtol=1e-5, atol=1e-5)


def run_groups(model_dir, cascade: str, device: str = "cpu", long_prompts: bool = False) -> tuple[dict, int]:
    """Requests of n = 1..8 samples (prompts of 1 to 5 whole blocks and a partial one; `long_prompts`: 600 tokens
    more for even n, a prefix of two chunks of the kernels) sampled at temperatures 0, 0.7 and 1 with seeds, fp32,
    on an engine with `engine.cascade_attention` = `cascade` (any saving pays): each sample's tokens and logprobs,
    and how many steps took the cascade (on CUDA: replayed its graphs)."""
    engine = build_engine(ModelConfig(name=str(model_dir), dtype="float32"), EngineConfig(
        device=device, num_blocks=512, block_size=16, max_model_len=1024, max_num_batched_tokens=1024, max_num_seqs=48,
        cascade_attention=cascade, cascade_min_saved_tokens=1, compile_norms=False), seed=0)
    planned = []
    if engine.runner.graphs is not None:
        replay = engine.runner.graphs.replay
        engine.runner.graphs.replay = lambda b, bound, cascade: planned.append(cascade) or replay(b, bound, cascade)
    elif engine.runner.cascade is not None:
        plan = engine.runner.cascade.plan
        engine.runner.cascade.plan = lambda seqs: planned.append(plan(seqs) is not None) or plan(seqs)
    for n in range(1, 9):
        prompt = [(7 * n + 3 * j) % 251 for j in range(16 * (n % 5) + 5 + n + (600 if long_prompts and n % 2 == 0 else 0))]
        engine.add_request(str(n), prompt, SamplingParams(max_tokens=20, temperature=[0.0, 0.7, 1.0][n % 3], seed=n,
                                                          ignore_eos=True), n=n)
    results: dict = {}
    while engine.has_unfinished:
        for out in engine.step():
            ids, logprobs = results.setdefault((out.request_id, out.index), ([], []))
            ids += out.token_ids
            logprobs += out.logprobs
    return results, sum(planned)


def check_same_samples(on: dict, off: dict, atol: float) -> None:
    assert on.keys() == off.keys() and len(on) == sum(range(1, 9))
    for key in on:
        assert on[key][0] == off[key][0], f"sample {key}: tokens differ with the cascade"
        torch.testing.assert_close(torch.tensor(on[key][1]), torch.tensor(off[key][1]), rtol=0, atol=atol)


def test_the_engines_tokens_and_logprobs_are_the_same_with_the_cascade_on_and_off(tiny_dir):
    """fp32 on the CPU (the torch path, `on`): the same seeded samples, logprobs within fp32 rounding of the sums'
    order; `auto` attends plainly on the CPU."""
    on, cascade_steps = run_groups(tiny_dir, "on")
    off, none = run_groups(tiny_dir, "auto")
    assert cascade_steps >= 10 and none == 0
    check_same_samples(on, off, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_engines_cuda_graphs_of_the_cascade_give_the_samples_of_plain_attention(tiny_dir):
    """fp32 on CUDA, decode steps replayed from CUDA graphs, prefixes of one and of two chunks: the cascade's
    graphs give the seeded samples of the plain ones."""
    on, cascade_steps = run_groups(tiny_dir, "auto", "cuda", long_prompts=True)
    off, none = run_groups(tiny_dir, "off", "cuda", long_prompts=True)
    assert cascade_steps >= 10 and none == 0
    check_same_samples(on, off, atol=1e-4)
