"""reverse_text: write a short string of random words backwards, character by character.

The answer goes inside `<reversed_text>` tags. Reward = `difflib.SequenceMatcher` ratio
between the parsed answer and the reversed text (1.0 exact, partial credit for near
misses), 0 when the tags are missing. The format score is reported as a metric only.
Prompts are kept short on purpose: a tiny byte-level model learns this task on CPU.
"""

import difflib
import random
from typing import Any

from tandem.envs.parsers import XMLParser
from tandem.envs.rubric import Rubric
from tandem.envs.single_turn import SingleTurnEnv
from tandem.envs.slips import slip_draws
from tandem.envs.splits import Row, draw_disjoint_splits
from tandem.envs.types import Messages
from tandem.envs.word_lists import load_word_list

SYSTEM_PROMPT = "Reverse the text character by character. Answer in <reversed_text> tags."
PARSER = XMLParser(["reversed_text"])


def _sample_row(rng: random.Random, min_words: int, max_words: int) -> Row:
    words = load_word_list("words.txt")
    text = " ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words)))
    return {"question": text, "answer": text[::-1], "task": "reverse_text"}


def _make_splits(
    num_train_examples: int, num_eval_examples: int, seed: int, min_words: int, max_words: int
) -> tuple[list[Row], list[Row]]:
    if not 1 <= min_words <= max_words:
        raise ValueError(f"need 1 <= min_words <= max_words, got {min_words=}, {max_words=}")
    return draw_disjoint_splits(
        lambda rng: _sample_row(rng, min_words, max_words),
        num_train_examples,
        num_eval_examples,
        seed,
    )


def lcs_reward(completion: Messages, answer: str) -> float:
    """Similarity of the parsed answer to the reversed text; 0 without an answer."""
    parsed = PARSER.parse_answer(completion)
    if parsed is None:
        return 0.0
    return difflib.SequenceMatcher(None, parsed, answer).ratio()


def load_environment(
    num_train_examples: int = 2000,
    num_eval_examples: int = 200,
    seed: int = 0,
    min_words: int = 1,
    max_words: int = 3,
    **kwargs: Any,
) -> SingleTurnEnv:
    train, eval_rows = _make_splits(
        num_train_examples, num_eval_examples, seed, min_words, max_words
    )
    format_reward_func = PARSER.get_format_reward_func()
    rubric = Rubric(funcs=[lcs_reward, format_reward_func], weights=[1.0, 0.0], parser=PARSER)
    return SingleTurnEnv(
        dataset=train,
        eval_dataset=eval_rows,
        system_prompt=SYSTEM_PROMPT,
        parser=PARSER,
        rubric=rubric,
        **kwargs,
    )


def sft_examples(
    n: int,
    seed: int = 0,
    num_eval_examples: int = 200,
    min_words: int = 1,
    max_words: int = 3,
    misclosed_fraction: float = 0.0,
) -> list[dict[str, Messages]]:
    """`n` chat examples `{"messages": [system, user, assistant]}` with the correct answer,
    for SFT warm-up. They are the first `n` training rows of `load_environment` with the same
    seed, word counts and `num_eval_examples`, so they never contain its eval questions.

    `misclosed_fraction`: the share of examples (drawn at random, seeded) whose answer closes with
    `</reversed>` instead of `</reversed_text>`: an imperfect demonstrator, whose model reverses well
    but sometimes answers in a form the parser rejects (reward 0), a slip RL's reward can correct."""
    train, _ = _make_splits(n, num_eval_examples, seed, min_words, max_words)
    slips = slip_draws(misclosed_fraction, "misclosed_fraction", f"misclosed {seed}")
    examples = []
    for row in train:
        answer = PARSER.format(reversed_text=row["answer"])
        if slips():
            answer = answer.replace("</reversed_text>", "</reversed>")
        examples.append({"messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": answer},
        ]})
    return examples
