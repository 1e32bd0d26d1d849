"""Merging a rollout's turns into samples by the prefix property."""

import pytest

from tandem.orchestrator.samples import Turn, build_samples


def turn(prompt, completion, version=0, temperature=1.0):
    return Turn(list(prompt), list(completion), [-0.1 * (i + 1) for i in range(len(completion))], version, temperature)


def test_single_turn_is_prompt_as_context_then_completion_as_loss():
    (sample,) = build_samples([turn([1, 2, 3], [7, 8], version=4, temperature=0.7)])
    assert sample.token_ids == [1, 2, 3, 7, 8]
    assert sample.loss_mask == [0, 0, 0, 1, 1]
    assert sample.logprobs == pytest.approx([0, 0, 0, -0.1, -0.2])
    assert sample.temperatures == [0.7] * 5
    assert sample.versions == [4]


def test_turns_that_extend_the_previous_tokens_merge_into_one_sample():
    first = turn([1, 2], [5, 6], version=0)
    second = turn([1, 2, 5, 6, 9, 9], [7], version=1)  # previous tokens + environment reply
    (sample,) = build_samples([first, second])
    assert sample.token_ids == [1, 2, 5, 6, 9, 9, 7]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert sample.versions == [0, 1]
    assert sample.oldest_version == 0


def test_a_turn_that_breaks_the_prefix_starts_a_new_sample():
    first = turn([1, 2], [5, 6])
    second = turn([1, 2, 5, 4, 9], [7])  # the conversation was re-rendered differently
    third = turn([1, 2, 5, 4, 9, 7, 3], [8])
    samples = build_samples([first, second, third])
    assert [s.token_ids for s in samples] == [[1, 2, 5, 6], [1, 2, 5, 4, 9, 7, 3, 8]]
    assert samples[1].loss_mask == [0, 0, 0, 0, 0, 1, 0, 1]
    # every sampled token is a loss token exactly once
    assert sum(s.num_loss_tokens for s in samples) == 4


def test_logprob_count_must_match_the_tokens():
    bad = Turn([1], [2, 3], [-0.1], 0, 1.0)
    with pytest.raises(ValueError, match="1 logprobs for 2 completion tokens"):
        build_samples([bad])
