import asyncio
import re

import pytest

from tandem.envs import wordle
from tandem.envs.word_lists import load_word_list


def guess(word: str) -> str:
    return f"<guess>{word}</guess>"


def play(answer: str, replies, scripted_client, num_words: int = -1, **env_args):
    env = wordle.load_environment(num_train_examples=10, num_eval_examples=10, num_words=num_words, **env_args)
    prompt = env.get_dataset(1)[0]["prompt"]
    client = scripted_client(replies)
    completion, state = asyncio.run(env.rollout(client, "m", prompt, answer, "wordle"))
    score = asyncio.run(env.rubric.score_rollout(prompt, completion, answer, state))
    return completion, state, score


def test_feedback_marks_duplicates_like_the_game():
    assert wordle.score_guess("crane", "crane") == "GGGGG"
    assert wordle.score_guess("crane", "react") == "YYGXY"
    assert wordle.score_guess("papal", "apple") == "YYGXY"
    assert wordle.score_guess("eerie", "there") == "YXYXG"  # only one e left after the green
    assert wordle.score_guess("speed", "abide") == "XXYXY"
    assert wordle.score_guess("sassy", "glass") == "YYXGX"


def test_reading_guesses():
    read_guess = wordle.vocabulary().read_guess
    assert read_guess("I think <guess> CRANE </guess>") == "crane"
    assert read_guess("<guess>zzzzz</guess>") is None
    assert read_guess("<guess>cranes</guess>") is None
    assert read_guess("<guess>crane</gues>") is None  # the imperfect demonstrator's slip
    assert read_guess("crane") is None


def test_rewards_follow_the_documented_formula(scripted_client):
    _, state, first_try = play("crane", [guess("crane")], scripted_client)
    assert state["stop_reason"] == "completed" and state["turn"] == 1
    assert first_try.reward == pytest.approx(2.2)
    _, _, sixth = play("crane", [guess("slate")] * 5 + [guess("crane")], scripted_client)
    assert sixth.reward == pytest.approx(1 + 1 / 6 + 0.2)
    # never solved: 0.2 * partial of the last valid guess (trace vs crane: X G G Y G)
    _, state, unsolved = play("crane", [guess("slate")] * 5 + [guess("trace")], scripted_client)
    assert state["stop_reason"] == "max_turns" and state["turn"] == 6
    assert unsolved.reward == pytest.approx(0.2 * (3 + 0.5) / 5)
    _, _, malformed = play("crane", ["crane"] * 6, scripted_client)
    assert malformed.reward == 0.0 and malformed.metrics["format_reward_func"] == 0.0
    _, _, empty = play("crane", [""] * 6, scripted_client)
    assert empty.reward == 0.0


def test_scripted_game_with_an_invalid_guess(scripted_client):
    replies = [guess("slate"), guess("qqqqq"), "no tags", guess("crane")]
    completion, state, score = play("crane", replies, scripted_client)
    assert (state["turn"], state["stop_reason"]) == (4, "completed")
    feedback = [m["content"] for m in completion if m["role"] == "user"]
    assert feedback[0] == "SLATE\nX X G X G\n5 guesses left."
    assert feedback[1].startswith("Invalid guess") and feedback[1].endswith("4 guesses left.")
    assert feedback[2].endswith("3 guesses left.")
    assert score.metrics == {
        "solved_reward": 1.0,
        "efficiency_reward": pytest.approx(3 / 6),
        "partial_reward": 1.0,
        "format_reward_func": pytest.approx(0.75),
    }
    assert score.reward == pytest.approx(1 + 0.5 + 0.2)


def test_format_weight_makes_each_malformed_turn_cost(scripted_client):
    """A game solved at turn 3 after a misclosed guess: the same solve, minus format_weight * (1 - 2/3)."""
    replies = [guess("slate"), "<guess>trace</gues>", guess("crane")]
    _, _, plain = play("crane", replies, scripted_client)
    _, _, weighted = play("crane", replies, scripted_client, format_weight=0.3)
    assert weighted.metrics["format_reward_func"] == pytest.approx(2 / 3)
    assert weighted.reward == pytest.approx(plain.reward + 0.3 * 2 / 3)
    with pytest.raises(ValueError, match="format_weight"):
        wordle.load_environment(format_weight=-1)


def test_invalid_ends_game_stops_at_the_first_rejected_guess(scripted_client):
    """The same replies: the lenient game goes on to the solve; the strict one ends at the misclosed guess,
    keeping the partial reward of the last valid guess (slate vs crane: X X G X G)."""
    replies = [guess("slate"), "<guess>trace</gues>", guess("crane")]
    _, state, lenient = play("crane", replies, scripted_client)
    assert (state["turn"], lenient.metrics["solved_reward"]) == (3, 1.0)
    completion, state, strict = play("crane", replies, scripted_client, invalid_ends_game=True)
    assert (state["turn"], state["stop_reason"]) == (2, "completed")
    assert completion[-1] == {"role": "assistant", "content": "<guess>trace</gues>"}
    assert strict.reward == pytest.approx(0.2 * 2 / 5) and strict.metrics["solved_reward"] == 0.0
    _, state, _ = play("crane", [guess("qqqqq")], scripted_client, invalid_ends_game=True)  # not a word: ends too
    assert state["turn"] == 1


def test_last_turn_gets_no_feedback(scripted_client):
    completion, _, _ = play("crane", [guess("slate")] * 6, scripted_client)
    assert len(completion) == 11 and completion[-1]["role"] == "assistant"
    assert "1 guess left." in completion[-2]["content"]


def test_splits_are_disjoint_and_seeded():
    env = wordle.load_environment(seed=2)
    train = [e["answer"] for e in env.get_dataset()]
    evals = [e["answer"] for e in env.get_eval_dataset()]
    assert len(evals) == 100 and len(train) == len(load_word_list("wordle_answers.txt")) - 100
    assert not set(train) & set(evals)
    assert wordle.load_environment(seed=2).get_eval_dataset() == env.get_eval_dataset()
    assert wordle.load_environment(seed=3).get_eval_dataset() != env.get_eval_dataset()
    with pytest.raises(ValueError, match="answer words"):
        wordle.load_environment(num_train_examples=10_000)


def test_an_eval_on_the_trained_answers_draws_both_from_every_word():
    env = wordle.load_environment(num_eval_examples=10, num_words=30, held_out_answers=False, seed=4)
    train = [e["answer"] for e in env.get_dataset()]
    evals = [e["answer"] for e in env.get_eval_dataset()]
    assert sorted(train) == sorted(wordle.vocabulary(30).answers) and len(set(evals)) == 10 and set(evals) <= set(train)
    assert evals == [e["answer"] for e in wordle.load_environment(num_eval_examples=10, num_words=30, seed=4).get_eval_dataset()]
    demonstrated = {row["messages"][-1]["content"].removeprefix("<guess>").removesuffix("</guess>")
                    for row in wordle.sft_examples(300, seed=4, num_eval_examples=10, num_words=30, held_out_answers=False)}
    assert set(evals) <= demonstrated  # the demonstrations end on eval answers too
    with pytest.raises(ValueError, match="answer words"):
        wordle.load_environment(num_eval_examples=31, num_words=30, held_out_answers=False)


def test_word_lists():
    answers = load_word_list("wordle_answers.txt")
    guesses = load_word_list("wordle_guesses.txt")
    assert len(answers) >= 300 and len(guesses) > len(answers)
    for words in (answers, guesses):
        assert len(set(words)) == len(words)
        assert all(re.fullmatch("[a-z]{5}", word) for word in words)
    assert set(answers) <= set(guesses)


def test_too_many_eval_words_is_an_error():
    with pytest.raises(ValueError, match="answer words"):
        wordle.load_environment(num_eval_examples=10_000)


def test_sft_examples_replay_as_rollouts_of_training_answers(scripted_client):
    env = wordle.load_environment(num_eval_examples=100, seed=3)
    train = [e["answer"] for e in env.get_dataset()]
    evals = {e["answer"] for e in env.get_eval_dataset()}
    rows = wordle.sft_examples(len(train) + 20, seed=3, num_eval_examples=100)
    assert wordle.sft_examples(5, seed=3, num_eval_examples=100) == rows[:5]
    answers = train + train[:20]  # cycling over the training answers
    solved = 0
    for row, answer in list(zip(rows, answers, strict=True))[::10]:
        assert answer not in evals
        messages = row["messages"]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        completion, _, score = play(answer, replies, scripted_client)
        assert messages[:2] == env.get_dataset(1)[0]["prompt"]
        assert completion == messages[2:]  # the feedback is the environment's own
        solved += score.metrics["solved_reward"]
    assert solved >= 0.9 * len(rows[::10])  # guesses consistent with the feedback solve most games


def test_a_smaller_game_uses_only_its_words(scripted_client):
    words = wordle.vocabulary(40)
    answers = load_word_list("wordle_answers.txt")
    assert len(words.answers) == 40 and set(words.answers) <= set(answers)
    assert words.allowed == set(words.answers)
    assert set(wordle.vocabulary(20).answers) <= set(words.answers)  # nested, same for every seed
    env = wordle.load_environment(num_eval_examples=8, num_words=40, seed=1)
    train = [e["answer"] for e in env.get_dataset()]
    evals = [e["answer"] for e in env.get_eval_dataset()]
    assert len(train) == 32 and sorted(train + evals) == sorted(words.answers)
    outside = next(word for word in answers if word not in words.allowed)
    answer = words.answers[0]
    completion, _, score = play(answer, [guess(outside), guess(answer)], scripted_client, num_words=40)
    assert completion[1]["content"].startswith("Invalid guess")  # allowed in the full game, not here
    assert score.metrics["solved_reward"] == 1.0 and score.metrics["efficiency_reward"] == pytest.approx(5 / 6)
    for bad in (0, len(answers) + 1):
        with pytest.raises(ValueError, match="num_words"):
            wordle.load_environment(num_words=bad)


def test_misclosed_demonstrations_slip_and_score_lower(scripted_client):
    args = dict(seed=1, num_eval_examples=8, num_words=40)
    clean = wordle.sft_examples(200, **args)
    slipped = wordle.sft_examples(200, misclosed_fraction=0.3, **args)
    train = [e["answer"] for e in wordle.load_environment(**args).get_dataset()]
    wrong = misclosed = 0
    for row, answer in zip(slipped, train * 10):
        guesses = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        words = [text.removeprefix("<guess>").split("<")[0] for text in guesses]
        assert all(a != b for a, b in zip(words, words[1:]))  # no retry of the last word, even after a slip
        wrong += sum(word != answer for word in words)
        misclosed += sum(text.endswith("</gues>") for text in guesses)
        assert not any(text == f"<guess>{answer}</gues>" for text in guesses)  # only wrong guesses slip
    assert 0.25 < misclosed / wrong < 0.35
    rewards = {}
    for name, rows in (("clean", clean), ("slipped", slipped)):
        total = 0.0
        for row, answer in zip(rows[::4], (train * 10)[::4]):
            replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            completion, _, score = play(answer, replies, scripted_client, num_words=40)
            assert completion == row["messages"][2:]  # slips get the environment's own reply
            total += score.reward
        rewards[name] = total / len(rows[::4])
    assert rewards["clean"] > 1.5 and rewards["slipped"] < rewards["clean"] - 0.1
    with pytest.raises(ValueError, match="misclosed_fraction"):
        wordle.sft_examples(2, misclosed_fraction=1.5)


def test_demonstrations_of_the_strict_game_end_at_their_slip(scripted_client):
    args = dict(seed=1, num_eval_examples=8, num_words=40)
    rows = wordle.sft_examples(100, misclosed_fraction=0.3, invalid_ends_game=True, **args)
    train = [e["answer"] for e in wordle.load_environment(**args).get_dataset()]
    ended_by_slip = 0
    for row, answer in zip(rows, train * 10):
        guesses = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        slips = [i for i, text in enumerate(guesses) if text.endswith("</gues>")]
        assert slips in ([], [len(guesses) - 1])  # at most one slip, the last turn
        ended_by_slip += bool(slips)
        completion, _, _ = play(answer, guesses, scripted_client, num_words=40, invalid_ends_game=True)
        assert completion == row["messages"][2:]  # the game ends where the demonstration does
    assert 20 < ended_by_slip < 80
