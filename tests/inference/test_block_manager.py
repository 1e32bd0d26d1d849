"""Paged blocks: reference counts, prefix sharing, and forgetting old-weight KV."""

from tandem.inference.engine.block_manager import BlockManager
from tandem.inference.engine.sampling_params import SamplingParams
from tandem.inference.engine.sequence import Sequence
from tandem.models.byte_tokenizer import build_byte_tokenizer

TOKENIZER = build_byte_tokenizer()


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams(max_tokens=4), TOKENIZER)


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence allocated and fully prefilled, its blocks registered."""
    s = seq(tokens)
    bm.allocate(s)
    s.num_computed_tokens = s.num_tokens
    bm.register_computed_blocks(s)
    return s


def test_allocate_and_free_return_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(list(range(10)))
    bm.allocate(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    bm.free_blocks(a)
    assert bm.num_free_blocks == 8 and a.block_table == []


def test_shared_prefix_blocks_are_reused_with_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, list(range(10)))
    b = seq(list(range(10)))
    bm.allocate(b)
    # Blocks 0-1 are full and precede the last prompt token: shared. Block 2 is private.
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    bm.free_blocks(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]


def test_block_of_the_last_prompt_token_is_never_shared():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, list(range(8)))
    b = seq(list(range(8)))
    bm.allocate(b)
    assert b.num_computed_tokens == 4  # the second block holds the last token: recomputed


def test_different_prefix_shares_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    computed(bm, list(range(10)))
    b = seq([99] + list(range(1, 10)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_freed_blocks_stay_hittable_until_reused():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = computed(bm, list(range(9)))
    first = a.block_table[0]
    bm.free_blocks(a)
    b = seq(list(range(9)))
    bm.allocate(b)
    assert b.block_table[0] == first and b.num_computed_tokens == 8


def test_reusing_a_free_block_evicts_its_registration():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = computed(bm, list(range(9)))
    bm.free_blocks(a)
    other = computed(bm, [50 + i for i in range(9)])  # takes all three blocks, a's included
    bm.free_blocks(other)
    c = seq(list(range(9)))
    bm.allocate(c)
    assert c.num_computed_tokens == 0


def test_weight_update_epoch_forgets_cached_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, list(range(10)))
    bm.reset_prefix_cache()
    b = seq(list(range(10)))
    bm.allocate(b)
    assert b.num_computed_tokens == 0
    # a's KV is from the old weights: blocks it computes later are not registered either.
    a.token_ids += [1, 2, 3]
    bm.append_blocks(a)
    a.num_computed_tokens = 12
    bm.register_computed_blocks(a)
    assert bm.cached == {}
