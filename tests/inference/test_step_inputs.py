"""Step inputs: what reaches the device, block-table rows updated incrementally, graph buckets."""

from pathlib import Path

import torch
from triton_interpreter import needs_triton_interpreter, run_interpreted

from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.cascade import CascadePlanner
from tandem.inference.engine.cuda_graphs import graph_batch_sizes, padded_batch_size
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.scheduler import Scheduler
from tandem.inference.engine.sequence import Sequence
from tandem.inference.engine.step_inputs import StepInputBuilder
from tandem.models.byte_tokenizer import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()


def test_graph_sizes_cover_every_batch_with_little_padding():
    sizes = graph_batch_sizes(100)
    assert sizes == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert graph_batch_sizes(1) == [1] and graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    for b in range(1, 101):
        padded = padded_batch_size(sizes, b)
        assert b <= padded <= max(8, b + 15)


def setup(num_seqs: int, prompt_len: int):
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, 8, 256)
    seqs = [Sequence("r", i, list(range(3 + i, 3 + i + prompt_len)), SamplingParams(max_tokens=20), TOKENIZER)
            for i in range(num_seqs)]
    for s in seqs:
        scheduler.add(s)
    return scheduler, seqs, StepInputBuilder(torch.device("cpu"), 8, 16, 4, pad_slot=64 * 4)


def finish_step(batch) -> None:
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_prefill_then_decode_inputs_and_block_tables():
    scheduler, seqs, builder = setup(3, 6)
    batch = scheduler.schedule()
    step = builder.build(batch)
    assert step.input_ids.tolist() == [t for s in seqs for t in s.token_ids]
    assert step.positions.tolist() == list(range(6)) * 3
    assert step.query_start.tolist() == [0, 6, 12, 18] and step.seq_lens.tolist() == [6, 6, 6]
    assert step.sample_index.tolist() == [5, 11, 17] and step.tiles.tolist() == [[0, 1, 2], [0, 0, 0]]
    slots = [s.block_table[p // 4] * 4 + p % 4 for s in seqs for p in range(6)]
    assert step.slot_mapping.tolist() == slots
    for i, s in enumerate(seqs):
        assert builder.block_tables[i, :len(s.block_table)].tolist() == s.block_table
    finish_step(batch)
    # Decodes: positions 6, 6, 6 (each sequence's 7th token); padded to a graph size of 4.
    batch = scheduler.schedule()
    updates = builder._table_updates(batch)
    assert updates == ([], [])  # the tables were sent with the prefill and have not grown
    step = builder.build(batch, pad_to=4)
    assert step.input_ids.tolist() == [7, 7, 7, 0] and step.positions.tolist() == [6, 6, 6, 0]
    assert step.seq_lens.tolist() == [7, 7, 7, 0] and step.slot_mapping.tolist()[3] == 64 * 4
    assert step.block_q == 1 and step.seq_lens_host == [7, 7, 7]


def test_every_view_starts_16_bytes_aligned_whatever_the_counts():
    """Odd numbers of sequences and tokens: an unaligned view made Triton compile its kernels again mid-run."""
    scheduler, seqs, builder = setup(3, 5)
    step = builder.build(scheduler.schedule())
    views = [step.input_ids, step.positions, step.slot_mapping, step.seq_lens, step.query_start, step.tiles,
             step.sample_index]
    assert len(step.input_ids) == 15 and len(step.seq_lens) == 3 and len(step.query_start) == 4
    assert all(view.data_ptr() % 16 == 0 for view in views)
    assert step.input_ids.tolist() == [t for s in seqs for t in s.token_ids] and step.sample_index.tolist() == [4, 9, 14]


def test_block_table_rows_send_only_what_changed():
    scheduler, seqs, builder = setup(2, 4)
    batch = scheduler.schedule()
    builder.build(batch)
    finish_step(batch)
    batch = scheduler.schedule()  # the 5th token needs a second block of 4
    index, value = builder._table_updates(batch)
    assert index == [1, 16 + 1] and value == [seqs[0].block_table[1], seqs[1].block_table[1]]
    # Another sequence in row 0 rewrites the row from its start.
    batch.seqs.reverse()
    index, value = builder._table_updates(batch)
    assert index == [0, 1, 16, 17] and value == seqs[1].block_table + seqs[0].block_table


def test_pending_input_ids_are_copied_from_the_previous_steps_tokens_on_the_device():
    for with_prefill in (False, True):
        scheduler, seqs, builder = setup(3, 6)
        batch = scheduler.schedule()
        builder.build(batch)
        for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            seq.num_computed_tokens += n
            seq.mark_pending(2 - row)  # rows in reverse order: the copy must follow the row, not the position
        previous = torch.tensor([70, 71, 72])
        if with_prefill:
            scheduler.add(Sequence("p", 0, [40, 41, 42, 43, 44], SamplingParams(max_tokens=20), TOKENIZER))
            step = builder.build(scheduler.schedule(), previous_tokens=previous)
            assert step.input_ids.tolist() == [72, 71, 70, 40, 41, 42, 43, 44]
            assert step.positions.tolist() == [6, 6, 6, 0, 1, 2, 3, 4]
        else:
            step = builder.build(scheduler.schedule(), pad_to=4, previous_tokens=previous)
            assert step.input_ids.tolist() == [72, 71, 70, 0] and step.positions.tolist() == [6, 6, 6, 0]
        assert [s.num_tokens for s in seqs] == [7, 7, 7] and [len(s.token_ids) for s in seqs] == [6, 6, 6]


def verifying_batch():
    """Three decoding sequences of 6, 7 and 8 tokens (block size 4) with 3, 0 and 1 drafts, and a builder."""
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, 8, 256, num_lookahead_tokens=3)
    seqs = [Sequence("r", i, list(range(3 + i, 8 + 2 * i)), SamplingParams(max_tokens=20), TOKENIZER) for i in range(3)]
    for s in seqs:
        scheduler.add(s)
    finish_step(scheduler.schedule())  # the prompts, each sampling its next token
    batch = scheduler.schedule()
    for i, drafts in enumerate([[40, 41, 42], [], [43]]):
        batch.set_drafts(i, drafts)
    return batch, StepInputBuilder(torch.device("cpu"), 8, 16, 4, pad_slot=64 * 4)


def test_a_verifying_graphs_inputs_pack_the_real_rows_then_one_padding_sequence():
    """Graph of 4 sequences of k + 1 = 4 tokens, tiles of 4 tokens: the 7 real rows first, as an eager step packs
    them; the other 9 rows are a padding sequence of context 0 writing to the pad slot (three tiles); the unused
    tiles start past every token."""
    batch, builder = verifying_batch()
    assert batch.is_verify_only and batch.has_drafts
    eager = builder.build(batch)
    step = builder.build_verify(batch, pad_to=4, tokens_per_seq=4, block_q=4)
    assert eager.input_ids.tolist() == [7, 40, 41, 42, 7, 7, 43]
    assert step.input_ids.tolist() == eager.input_ids.tolist() + [0] * 9
    assert step.positions.tolist()[:7] == eager.positions.tolist()
    assert step.slot_mapping.tolist() == eager.slot_mapping.tolist() + [64 * 4] * 9
    assert step.seq_lens.tolist() == eager.seq_lens.tolist() + [0, 0]
    assert step.query_start.tolist() == eager.query_start.tolist() + [16, 16]
    assert step.tiles.tolist() == [[0, 1, 2, 3, 3, 3, 3, 3], [0, 0, 0, 0, 4, 8, 16, 16]]
    assert step.sample_index.tolist() == list(range(7))


INTERPRETED_VERIFY = """
import sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {here!r})
import torch
from attention_cases import kernel_caches
from test_step_inputs import verifying_batch
from tandem.inference.engine.kv_cache import KVCache
from tandem.kernels.attention import paged_attention

batch, builder = verifying_batch()
gen = torch.Generator().manual_seed(0)
cache = KVCache(1, 64, 4, 2, 16, torch.float32, torch.device("cpu"))
every_slot = torch.arange(65 * 4)
cache.write(0, every_slot, *(torch.randn(len(every_slot), 2, 16, generator=gen) for _ in range(2)))
eager = builder.build(batch)
q = torch.randn(16, 4, 16, generator=gen)
expected = paged_attention(q[:7].contiguous(), block_tables=builder.block_tables, seq_lens=eager.seq_lens,
                           query_start=eager.query_start, tiles=eager.tiles, block_q=16, **kernel_caches(cache))
step = builder.build_verify(batch, pad_to=4, tokens_per_seq=4, block_q=4)
out = paged_attention(q, block_tables=builder.block_tables, seq_lens=step.seq_lens, query_start=step.query_start,
                      tiles=step.tiles, block_q=4, **kernel_caches(cache))
torch.testing.assert_close(out[:7], expected, rtol=1e-5, atol=1e-5)
assert (out[7:] == 0).all()
print("ok")
"""


@needs_triton_interpreter
def test_a_verifying_graphs_rows_attend_as_the_eager_step_does():
    """Under Triton's interpreter: the real rows of a verifying graph's layout get the eager step's attention
    outputs, the padding rows zeros."""
    here = Path(__file__).parent
    run_interpreted(INTERPRETED_VERIFY.format(tests=str(here.parent), here=str(here)), timeout=300)


def test_a_cascade_plan_reaches_the_device_padded_to_a_graphs_rows_and_group_slots():
    """Three samples of one 9-token prompt (2 whole blocks of 4 shared by prefix caching) and a sequence of its
    own, decoding, padded to a graph of 8 rows: each row's prefix, the group's prefix and members, unused group slots
    empty; an eager step sends as many slots as groups."""
    bm = BlockManager(64, 4)
    scheduler = Scheduler(bm, 8, 256)
    prompts = [list(range(9))] * 3 + [list(range(50, 59))]
    seqs = [Sequence("r", i, prompt, SamplingParams(max_tokens=20), TOKENIZER) for i, prompt in enumerate(prompts)]
    for seq in seqs:
        scheduler.add(seq)
    builder = StepInputBuilder(torch.device("cpu"), 8, 16, 4, pad_slot=64 * 4)
    for _ in range(4):  # prefill (the samples after the first wait for its blocks), then decodes
        batch = scheduler.schedule()
        if batch.is_decode_only:
            break
        builder.build(batch)
        finish_step(batch)
        for seq in batch.seqs:
            bm.register_computed_blocks(seq)
    assert batch.is_decode_only and len(batch.seqs) == 4
    assert [s.block_table[:2] for s in seqs[:3]].count(seqs[0].block_table[:2]) == 3  # the prompt's shared blocks
    plan = CascadePlanner(4, members=8, min_saved_tokens=1).plan(batch.seqs)
    step = builder.build(batch, pad_to=8, cascade=plan, members=8)
    rows = [batch.seqs.index(s) for s in seqs[:3]]
    assert step.cascade.row_prefix.tolist() == [8 if i in rows else 0 for i in range(8)]
    assert step.cascade.group_prefix.tolist() == [8, 0, 0, 0]  # a graph of 8 rows: 4 group slots
    assert sorted(step.cascade.group_members[0].tolist()[:3]) == sorted(rows)
    assert step.cascade.group_members.tolist()[0][3:] == [-1] * 5 and (step.cascade.group_members[1:] == -1).all()
    eager = builder.build(batch, cascade=plan, members=8)
    assert eager.cascade.group_prefix.tolist() == [8] and eager.cascade.row_prefix.shape == (4,)
