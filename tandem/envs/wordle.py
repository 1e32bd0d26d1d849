"""wordle: find a hidden 5-letter word in at most 6 guesses.

The model writes each guess inside `<guess>` tags; the environment answers with Wordle
feedback, one mark per letter: G (right letter, right spot), Y (in the word, elsewhere),
X (not in the word, or no copies left). Duplicates follow the game: greens are matched
first, then yellows left to right while unmatched copies of the letter remain. A guess that
is missing, not 5 letters, or not an allowed word gets an error message and still uses up
one of the 6 turns; with `invalid_ends_game` it ends the game instead, so a malformed turn costs
what the rest of the game could have earned.

The words: by default the hidden words are those of `data/wordle_answers.txt` and a guess may
be any word of `data/wordle_guesses.txt`. `num_words` N plays a smaller game, the difficulty
knob: N of the answer words (the same N for every seed) are both the hidden words and the only
allowed guesses, a vocabulary a tiny model can learn in a short warm-up.

Reward, with k = the number of guesses (turns) used up to the correct one:

    reward = solved + efficiency + 0.2 * partial + format_weight * format
    solved     = 1 if some guess equals the answer, else 0
    efficiency = (7 - k) / 6 if solved, else 0          (1 for k = 1 ... 1/6 for k = 6)
    partial    = (greens + 0.5 * yellows) / 5 of the last valid guess, 0 if none
    format     = the mean over the model's turns of `XMLParser.format_score` (0 for a turn whose
                 guess has no well-closed <guess> tags)

so with the default `format_weight` 0 a first-guess solve scores 2.2, a sixth-guess solve 1.3667,
and an unsolved game at most 0.16 (four greens); the format score is then a metric only. A rejected
guess costs its turn, which an unsolved game's reward barely sees: `format_weight` (verifiers' wordle
has a format reward function in its rubric too) makes each malformed turn cost format_weight / turns.
"""

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from tandem.envs.multi_turn import MultiTurnEnv
from tandem.envs.parsers import XMLParser, assistant_contents
from tandem.envs.rubric import Rubric
from tandem.envs.slips import slip_draws
from tandem.envs.splits import split_items
from tandem.envs.types import Messages, State
from tandem.envs.word_lists import load_word_list

MAX_GUESSES = 6
SYSTEM_PROMPT = (
    f"You are playing Wordle. Find the hidden 5-letter English word in at most {MAX_GUESSES} "
    "guesses. Write each guess inside <guess> tags, e.g. <guess>crane</guess>. After each "
    "guess you get one mark per letter: G = right letter in the right spot, Y = in the word "
    "but in another spot, X = not in the word (or no more copies of it)."
)
QUESTION = f"Guess the hidden 5-letter word. You have {MAX_GUESSES} guesses."
PARSER = XMLParser(["guess"])


def score_guess(guess: str, answer: str) -> str:
    """Five marks, G/Y/X, for `guess` against `answer` (both lowercase, 5 letters)."""
    marks = ["X"] * 5
    unmatched = Counter(a for g, a in zip(guess, answer, strict=True) if g != a)
    for i, (g, a) in enumerate(zip(guess, answer, strict=True)):
        if g == a:
            marks[i] = "G"
        elif unmatched[g] > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


@dataclass(frozen=True)
class Vocabulary:
    """The words of one game: the hidden word is one of `answers`; a guess counts only if it is
    in `allowed`. The reward functions are its methods, so they judge guesses by the same words
    the game does."""

    answers: tuple[str, ...]
    """The words a hidden word is drawn from (before the train/eval split)."""
    allowed: frozenset[str]
    """The words accepted as a guess; contains every answer."""

    def read_guess(self, text: str) -> str | None:
        """The guess written in `text`, lowercase, if it is an allowed word; else None."""
        guess = PARSER.parse(text).guess
        if guess is None:
            return None
        guess = guess.lower()
        return guess if guess in self.allowed else None

    def feedback(self, text: str, answer: str, guesses_left: int) -> str:
        """The environment's reply to one model turn."""
        guess = self.read_guess(text)
        left = f"{guesses_left} guess{'es' if guesses_left != 1 else ''} left."
        if guess is None:
            return (
                "Invalid guess: write one 5-letter English word inside <guess> tags. "
                f"This counts as a guess. {left}"
            )
        return f"{guess.upper()}\n{' '.join(score_guess(guess, answer))}\n{left}"

    def _guesses(self, completion: Messages) -> list[str | None]:
        return [self.read_guess(text) for text in assistant_contents(completion)]

    def _solved_at(self, completion: Messages, answer: str) -> int | None:
        """The 1-based turn of the correct guess, None if unsolved."""
        guesses = self._guesses(completion)
        return guesses.index(answer) + 1 if answer in guesses else None

    def solved_reward(self, completion: Messages, answer: str) -> float:
        return float(self._solved_at(completion, answer) is not None)

    def efficiency_reward(self, completion: Messages, answer: str) -> float:
        turn = self._solved_at(completion, answer)
        return 0.0 if turn is None else (MAX_GUESSES + 1 - turn) / MAX_GUESSES

    def partial_reward(self, completion: Messages, answer: str) -> float:
        valid = [guess for guess in self._guesses(completion) if guess is not None]
        if not valid:
            return 0.0
        marks = score_guess(valid[-1], answer)
        return (marks.count("G") + 0.5 * marks.count("Y")) / 5


@cache
def vocabulary(num_words: int = -1) -> Vocabulary:
    """-1: every answer word, and every word of the guess list allowed. N: the first N answer
    words of one fixed shuffle (so a smaller game's words are part of every larger one's), which
    are also the only allowed guesses."""
    answers = load_word_list("wordle_answers.txt")
    if num_words == -1:
        return Vocabulary(answers, frozenset(load_word_list("wordle_guesses.txt")))
    if not 1 <= num_words <= len(answers):
        raise ValueError(f"num_words = {num_words}: -1 (all) or 1 to {len(answers)} (the answer words)")
    shuffled = list(answers)
    random.Random("wordle vocabulary").shuffle(shuffled)
    words = tuple(shuffled[:num_words])
    return Vocabulary(words, frozenset(words))


class WordleEnv(MultiTurnEnv):
    """Ends on the correct guess, after `MAX_GUESSES` turns, or (`invalid_ends_game`) on a rejected guess."""

    def __init__(self, words: Vocabulary, invalid_ends_game: bool = False, **kwargs: Any):
        super().__init__(max_turns=MAX_GUESSES, **kwargs)
        self.words = words
        self.invalid_ends_game = invalid_ends_game

    def is_completed(self, messages: Messages, state: State, **kwargs: Any) -> bool:
        last = messages[-1]
        if last["role"] != "assistant":
            return False
        guess = self.words.read_guess(last["content"])
        return guess == state["answer"] or (guess is None and self.invalid_ends_game)

    def env_response(
        self, messages: Messages, state: State, **kwargs: Any
    ) -> tuple[Messages, State]:
        text = self.words.feedback(messages[-1]["content"], state["answer"], self.max_turns - state["turn"])
        return [{"role": "user", "content": text}], state


def _row(answer: str) -> dict[str, str]:
    return {"question": QUESTION, "answer": answer, "task": "wordle"}


def _split_answers(
    words: Vocabulary, num_train: int, num_eval: int, seed: int, held_out_answers: bool
) -> tuple[list[str], list[str]]:
    """Disjoint train and eval answers, or (`held_out_answers` false) both drawn from every answer word: the
    eval then plays new games on the words trained on, as Wordle itself draws from one fixed list."""
    if held_out_answers:
        return split_items(words.answers, num_train, num_eval, seed, "wordle has {} answer words")
    train, _ = split_items(words.answers, num_train, 0, seed, "wordle has {} answer words")
    _, eval_words = split_items(words.answers, 0, num_eval, seed, "wordle has {} answer words")
    return train, eval_words


def load_environment(
    num_train_examples: int = -1,
    num_eval_examples: int = 100,
    seed: int = 0,
    num_words: int = -1,
    held_out_answers: bool = True,
    format_weight: float = 0.0,
    invalid_ends_game: bool = False,
    **kwargs: Any,
) -> WordleEnv:
    """Answers are split by `seed` into disjoint eval and train words; `num_train_examples`
    -1 takes every answer not in the eval set. `held_out_answers` false: eval and train answers are drawn
    from every answer word (-1 train answers: all of them), so the eval measures play on the game's list
    rather than finding words never trained on. `num_words`: see `vocabulary`; `format_weight` and
    `invalid_ends_game`: see the module's docstring."""
    if format_weight < 0:
        raise ValueError(f"wordle: `format_weight` = {format_weight} must be >= 0")
    words = vocabulary(num_words)
    train, eval_words = _split_answers(words, num_train_examples, num_eval_examples, seed, held_out_answers)
    format_reward_func = PARSER.get_format_reward_func()
    rubric = Rubric(
        funcs=[words.solved_reward, words.efficiency_reward, words.partial_reward, format_reward_func],
        weights=[1.0, 1.0, 0.2, format_weight],
        parser=PARSER,
    )
    return WordleEnv(
        words,
        invalid_ends_game,
        dataset=[_row(word) for word in train],
        eval_dataset=[_row(word) for word in eval_words],
        system_prompt=SYSTEM_PROMPT,
        parser=PARSER,
        rubric=rubric,
        **kwargs,
    )


def _demonstration(
    words: Vocabulary, answer: str, rng: random.Random, slips: Callable[[], bool], invalid_ends_game: bool
) -> Messages:
    """One game, each guess drawn at random from the answer words still consistent with all
    the feedback so far: a plain strategy that solves most games in 6 guesses, so the warm-up
    teaches the format and the use of feedback without playing well. The guesses `slips()` says
    so (a share `misclosed_fraction`, `sft_examples`) close with `</gues>`: the game
    rejects them and the turn is lost (with `invalid_ends_game`, the game: the demonstration ends there, as the
    game does). Only wrong guesses slip, and the guess after a slip is
    another candidate, so no demonstration repeats its last guess: retried words teach a tiny
    model to repeat its last guess, which it then does after valid feedback too."""
    messages: Messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": QUESTION},
    ]
    candidates = list(words.answers)
    slipped = None
    for turn in range(1, MAX_GUESSES + 1):
        guess = rng.choice([word for word in candidates if word != slipped])
        misclosed = slips() and guess != answer
        messages.append({"role": "assistant", "content": f"<guess>{guess}</{'gues' if misclosed else 'guess'}>"})
        if (guess == answer and not misclosed) or (misclosed and invalid_ends_game) or turn == MAX_GUESSES:
            break
        slipped = guess if misclosed else None
        if not misclosed:
            marks = score_guess(guess, answer)
            candidates = [word for word in candidates if score_guess(guess, word) == marks]
        reply = words.feedback(messages[-1]["content"], answer, MAX_GUESSES - turn)
        messages.append({"role": "user", "content": reply})
    return messages


def sft_examples(
    n: int,
    seed: int = 0,
    num_eval_examples: int = 100,
    num_words: int = -1,
    held_out_answers: bool = True,
    misclosed_fraction: float = 0.0,
    invalid_ends_game: bool = False,
) -> list[dict[str, Messages]]:
    """`n` demonstration games on the training answers of `load_environment` with the same seed,
    `num_eval_examples`, `num_words` and `held_out_answers` (never a held-out eval answer; guesses may be any
    answer word, as in the game), cycling over those answers when `n` is larger, each game played afresh.

    `misclosed_fraction`: the share of guesses (drawn at random, seeded apart from the games) that
    close with `</gues>` instead of `</guess>`: an imperfect demonstrator whose slips the game
    rejects, each costing a turn (a lower efficiency, or an unsolved game), which RL's reward can
    remove. `invalid_ends_game`: the games follow that rule of the environment (a slip ends the game)."""
    slips = slip_draws(misclosed_fraction, "misclosed_fraction", f"misclosed {seed}")
    words = vocabulary(num_words)
    train, _ = _split_answers(words, -1, num_eval_examples, seed, held_out_answers)
    rng = random.Random(seed)
    return [
        {"messages": _demonstration(words, train[i % len(train)], rng, slips, invalid_ends_game)}
        for i in range(n)
    ]
