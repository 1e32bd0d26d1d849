import asyncio

import pytest

from tandem.envs import alphabet_sort
from tandem.envs.word_lists import load_word_list

INFO = {
    "sort_by": "last",
    "names_per_turn": [["Zoe Adams", "Adam Young", "Mia King"], ["Leo Brown"], ["Ivy Cruz"]],
}
TURN_1 = ["Zoe Adams", "Mia King", "Adam Young"]
TURN_2 = ["Zoe Adams", "Leo Brown", "Mia King", "Adam Young"]
TURN_3 = ["Zoe Adams", "Leo Brown", "Ivy Cruz", "Mia King", "Adam Young"]


def tagged(names: list[str]) -> str:
    return alphabet_sort.PARSER.format(alphabetical_sorted="\n".join(names))


def reward(*answers: str) -> float:
    completion = []
    for text in answers:
        completion += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    return alphabet_sort.sorted_list_reward(completion, INFO)


def test_expected_lists_follow_the_sort_key():
    assert alphabet_sort.expected_lists(INFO) == [TURN_1, TURN_2, TURN_3]
    assert alphabet_sort.sort_names(TURN_1, "first") == ["Adam Young", "Mia King", "Zoe Adams"]


def test_rewards():
    assert reward(tagged(TURN_1), tagged(TURN_2), tagged(TURN_3)) == 1.0
    assert reward(tagged(TURN_1), tagged(TURN_2)) == pytest.approx(2 / 3)  # last turn missing
    assert reward(tagged(TURN_1), "no tags", tagged(TURN_3)) == pytest.approx(2 / 3)
    wrong_order = tagged(list(reversed(TURN_3)))
    partial = reward(tagged(TURN_1), tagged(TURN_2), wrong_order)
    assert 2 / 3 < partial < 1.0
    assert reward("<alphabetical_sorted></alphabetical_sorted>", "", "") == 0.0
    assert reward() == 0.0
    spaced = "<alphabetical_sorted>\n  Zoe Adams\n\nMia King \nAdam Young\n</alphabetical_sorted>"
    assert (
        alphabet_sort.sorted_list_reward(
            [{"role": "assistant", "content": spaced}],
            {"sort_by": "last", "names_per_turn": [TURN_1]},
        )
        == 1.0
    )


def run_game(env, example, replies, scripted_client):
    client = scripted_client(replies)
    completion, state = asyncio.run(
        env.rollout(
            client, "m", example["prompt"], example["answer"], example["task"], example["info"]
        )
    )
    score = asyncio.run(
        env.rubric.score_rollout(
            example["prompt"], completion, example["answer"], state, info=example["info"]
        )
    )
    return client, completion, state, score


def test_three_turn_rollout(scripted_client):
    env = alphabet_sort.load_environment(num_train_examples=50, num_eval_examples=10, min_turns=3)
    example = env.get_dataset(1)[0]
    expected = alphabet_sort.expected_lists(example["info"])
    assert len(expected) == 3
    assert example["answer"] == "\n".join(expected[-1])
    replies = [tagged(names) for names in expected]
    client, completion, state, score = run_game(env, example, replies, scripted_client)
    assert (state["turn"], state["stop_reason"]) == (3, "completed")
    assert [m["role"] for m in completion] == [
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    for names in example["info"]["names_per_turn"][1:]:
        assert all(name in "".join(m["content"] for m in completion) for name in names)
    assert score.reward == 1.0 and score.errors == []
    assert len(client.calls) == 3


def test_rollout_cut_by_length(scripted_client):
    env = alphabet_sort.load_environment(num_train_examples=20, num_eval_examples=5, min_turns=2)
    example = env.get_dataset(1)[0]
    first = tagged(alphabet_sort.expected_lists(example["info"])[0])
    replies = [first, {"content": "<alphabetical_sorted>\nAb", "finish_reason": "length"}]
    _, _, state, score = run_game(env, example, replies, scripted_client)
    assert (state["turn"], state["stop_reason"]) == (2, "length")
    turns = len(example["info"]["names_per_turn"])
    assert score.reward == pytest.approx(1 / turns)


def test_examples_have_distinct_names_and_turn_counts_in_range():
    env = alphabet_sort.load_environment(num_train_examples=200, num_eval_examples=20)
    counts = set()
    for example in env.get_dataset():
        names = [n for turn in example["info"]["names_per_turn"] for n in turn]
        assert len({n.split()[0] for n in names}) == len(names)
        assert len({n.split()[1] for n in names}) == len(names)
        assert example["info"]["sort_by"] in example["prompt"][-1]["content"]
        counts.add(len(example["info"]["names_per_turn"]))
    assert counts == {1, 2, 3}


def test_splits_are_disjoint_and_seeded():
    env = alphabet_sort.load_environment(num_train_examples=500, num_eval_examples=100, seed=1)
    train = {e["prompt"][-1]["content"] for e in env.get_dataset()}
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    assert len(train) == 500 and len(evals) == 100 and not train & evals
    again = alphabet_sort.load_environment(num_train_examples=500, num_eval_examples=100, seed=1)
    assert again.get_dataset() == env.get_dataset()
    assert again.get_eval_dataset() == env.get_eval_dataset()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="distinct first and last names"):
        alphabet_sort.load_environment(
            num_train_examples=1, num_eval_examples=1, min_names=150, max_names=150
        )
    with pytest.raises(ValueError, match="min_turns"):
        alphabet_sort.load_environment(min_turns=0)


def test_names_list_is_first_and_last_names():
    names = load_word_list("names.txt")
    assert len(names) >= 200 and len(set(names)) == len(names)
    assert all(len(name.split()) == 2 and name.istitle() for name in names)


def test_sft_examples_replay_as_perfect_rollouts_of_training_rows(scripted_client):
    args = dict(num_eval_examples=30, seed=2, min_names=2, max_names=4, names_per_follow_up=1)
    env = alphabet_sort.load_environment(num_train_examples=40, **args)
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    rows = alphabet_sort.sft_examples(40, **args)
    assert alphabet_sort.sft_examples(5, **args) == rows[:5]
    for row, example in zip(rows, env.get_dataset(), strict=True):
        messages = row["messages"]
        assert messages[:2] == example["prompt"] and messages[1]["content"] not in evals
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert len(replies) == len(example["info"]["names_per_turn"])
        _, completion, _, score = run_game(env, example, replies, scripted_client)
        assert completion == messages[2:]  # the follow-ups are the environment's own
        assert score.reward == 1.0


def test_misclosed_turns_hold_the_right_list_but_score_zero():
    """The imperfect demonstrator of the example's warm-up: the same conversations, a seeded share of
    the assistant turns closed with `</alphabetical>`, which the rubric scores 0 for that turn."""
    args = dict(seed=3, min_names=2, max_names=3, max_turns=2, names_per_follow_up=1)
    rows = alphabet_sort.load_environment(num_train_examples=300, **args).get_dataset()
    clean = alphabet_sort.sft_examples(300, **args)
    sloppy = alphabet_sort.sft_examples(300, misclosed_fraction=0.3, **args)
    assert sloppy == alphabet_sort.sft_examples(300, misclosed_fraction=0.3, **args)
    turns = slipped = 0
    for good, bad, row in zip(clean, sloppy, rows, strict=True):
        assert [m["role"] for m in good["messages"]] == [m["role"] for m in bad["messages"]]
        slips_before = slipped
        for right, given in zip(good["messages"], bad["messages"], strict=True):
            if right["role"] != "assistant":
                assert given == right
                continue
            turns += 1
            if given != right:
                slipped += 1
                closed = right["content"].replace("</alphabetical_sorted>", "</alphabetical>")
                assert given["content"] == closed
        replies = sum(m["role"] == "assistant" for m in bad["messages"])
        score = alphabet_sort.sorted_list_reward(bad["messages"][2:], row["info"])
        assert score == pytest.approx(1 - (slipped - slips_before) / replies)
    assert 0.2 < slipped / turns < 0.4
    with pytest.raises(ValueError, match="misclosed_fraction"):
        alphabet_sort.sft_examples(4, misclosed_fraction=-0.1)
