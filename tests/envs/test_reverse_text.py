import asyncio

import pytest

from tandem.envs import reverse_text
from tandem.envs.word_lists import load_word_list


def score(content: str | None, target: str = "abcd"):
    """Score one answer (None: the model never answered) against `target`."""
    env = reverse_text.load_environment(num_train_examples=1, num_eval_examples=1)
    completion = [] if content is None else [{"role": "assistant", "content": content}]
    return asyncio.run(env.rubric.score_rollout([], completion, target, {}))


def test_rewards():
    right = score("<reversed_text>\nabcd\n</reversed_text>")
    assert right.reward == 1.0 and right.metrics["format_reward_func"] == 1.0
    assert score("<reversed_text>abxy</reversed_text>").reward == 0.5  # 2 of 4 characters match
    malformed = score("abcd")
    assert malformed.reward == 0.0 and malformed.metrics["format_reward_func"] == 0.0
    assert score("<reversed_text>abcd").reward == 0.0
    assert score("<reversed_text></reversed_text>").reward == 0.0
    assert score("").reward == 0.0
    assert score(None).reward == 0.0


def test_examples_reverse_the_prompt():
    env = reverse_text.load_environment(num_train_examples=50, num_eval_examples=10, max_words=2)
    for example in env.get_dataset() + env.get_eval_dataset():
        text = example["prompt"][-1]["content"]
        assert example["answer"] == text[::-1]
        assert 1 <= len(text.split()) <= 2
        assert example["prompt"][0] == {"role": "system", "content": reverse_text.SYSTEM_PROMPT}
        assert example["task"] == "reverse_text"


def test_splits_are_disjoint_and_seeded():
    env = reverse_text.load_environment(num_train_examples=300, num_eval_examples=100, seed=3)
    train = {e["prompt"][-1]["content"] for e in env.get_dataset()}
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    assert len(train) == 300 and len(evals) == 100 and not train & evals
    again = reverse_text.load_environment(num_train_examples=300, num_eval_examples=100, seed=3)
    assert again.get_dataset() == env.get_dataset()
    assert again.get_eval_dataset() == env.get_eval_dataset()
    other = reverse_text.load_environment(num_train_examples=300, num_eval_examples=100, seed=4)
    assert other.get_eval_dataset() != env.get_eval_dataset()
    bigger = reverse_text.load_environment(num_train_examples=500, num_eval_examples=100, seed=3)
    assert bigger.get_eval_dataset() == env.get_eval_dataset()


def test_too_many_examples_for_the_word_pool_is_an_error():
    words = len(load_word_list("words.txt"))
    with pytest.raises(ValueError, match="distinct questions"):
        reverse_text.load_environment(num_train_examples=words, num_eval_examples=1, max_words=1)
    with pytest.raises(ValueError, match="min_words"):
        reverse_text.load_environment(min_words=3, max_words=2)


def test_sft_examples_are_correct_and_avoid_the_eval_set():
    examples = reverse_text.sft_examples(200, seed=5)
    assert len(examples) == 200
    env = reverse_text.load_environment(num_train_examples=200, seed=5)
    evals = {e["prompt"][-1]["content"] for e in env.get_eval_dataset()}
    parser = reverse_text.PARSER
    for example, train in zip(examples, env.get_dataset(), strict=True):
        system, user, assistant = example["messages"]
        assert system == {"role": "system", "content": reverse_text.SYSTEM_PROMPT}
        assert user["content"] not in evals
        assert user == train["prompt"][-1]
        assert parser.parse_answer([assistant]) == user["content"][::-1]
    assert reverse_text.sft_examples(10, seed=5) == examples[:10]


def test_misclosed_examples_reverse_correctly_but_score_zero():
    """The imperfect demonstrator of the example's warm-up: the same questions and reversals, a seeded share
    closed with `</reversed>`, which the rubric scores 0 (what RL then learns to avoid)."""
    clean = reverse_text.sft_examples(400, seed=3)
    sloppy = reverse_text.sft_examples(400, seed=3, misclosed_fraction=0.3)
    assert sloppy == reverse_text.sft_examples(400, seed=3, misclosed_fraction=0.3)
    slipped = 0
    for good, bad in zip(clean, sloppy, strict=True):
        assert good["messages"][:2] == bad["messages"][:2]
        answer, given = good["messages"][2]["content"], bad["messages"][2]["content"]
        if given != answer:
            slipped += 1
            assert given == answer.replace("</reversed_text>", "</reversed>")
            assert score(given, good["messages"][1]["content"][::-1]).reward == 0.0
    assert 0.2 < slipped / 400 < 0.4
    with pytest.raises(ValueError, match="misclosed_fraction"):
        reverse_text.sft_examples(4, misclosed_fraction=1.5)


def test_word_list_is_plain_lowercase_words():
    words = load_word_list("words.txt")
    assert len(words) >= 300 and len(set(words)) == len(words)
    assert all(word.isalpha() and word.islower() for word in words)
