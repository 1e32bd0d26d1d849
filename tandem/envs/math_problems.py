"""math: procedurally generated arithmetic word problems with integer answers.

Several templates (add, take away, groups of, share equally, change, temperature drop,
two steps); `difficulty` d draws operands up to 10**d. The final answer goes in `\\boxed{}`.
Reward = 1 if the last `\\boxed{...}` after any `<think>` block holds a number equal to the
answer, else 0. Accepted numbers: an optional minus sign, digits either plain or grouped by
commas in threes (`1,000`), and an optional decimal part (`42.0`); anything else in the box
(units, words, expressions) scores 0.
"""

import random
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from tandem.envs.parsers import ThinkParser
from tandem.envs.rubric import Rubric
from tandem.envs.single_turn import SingleTurnEnv
from tandem.envs.slips import slip_draws
from tandem.envs.splits import Row, draw_disjoint_splits
from tandem.envs.types import Messages
from tandem.envs.word_lists import load_word_list

SYSTEM_PROMPT = "Solve the problem. Put the final answer, a single number, in \\boxed{}."
ITEMS = ["apples", "pencils", "marbles", "stickers", "cookies", "books", "stamps", "shells"]
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")

# (rng, person, item, max_operand) -> (question, integer answer)
Template = Callable[[random.Random, str, str, int], tuple[str, int]]


def _add(rng: random.Random, who: str, item: str, top: int) -> tuple[str, int]:
    a, b = rng.randint(2, top), rng.randint(2, top)
    return f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?", a + b


def _take_away(rng: random.Random, who: str, item: str, top: int) -> tuple[str, int]:
    a = rng.randint(2, top)
    b = rng.randint(1, a)
    return f"{who} had {a} {item} and gave {b} of them away. How many {item} are left?", a - b


def _groups_of(rng: random.Random, who: str, item: str, top: int) -> tuple[str, int]:
    a, b = rng.randint(2, top), rng.randint(2, top)
    return f"{who} has {a} bags with {b} {item} in each bag. How many {item} in total?", a * b


def _share(rng: random.Random, who: str, item: str, top: int) -> tuple[str, int]:
    each, friends = rng.randint(2, top), rng.randint(2, 12)
    question = (
        f"{who} shares {each * friends} {item} equally among {friends} friends. "
        f"How many {item} does each friend get?"
    )
    return question, each


def _change(rng: random.Random, who: str, item: str, top: int) -> tuple[str, int]:
    count, price, extra = rng.randint(2, 12), rng.randint(1, top), rng.randint(0, top)
    paid = count * price + extra
    question = (
        f"{who} buys {count} {item} at {price} dollars each and pays {paid} dollars. "
        f"How many dollars of change does {who} get?"
    )
    return question, extra


def _temperature(rng: random.Random, who: str, item: str, top: int) -> tuple[str, int]:
    start, drop = rng.randint(-top // 2, top), rng.randint(1, top)
    question = (
        f"{who} reads {start} degrees on the thermometer. Overnight it drops by {drop} "
        "degrees. What does the thermometer read now?"
    )
    return question, start - drop


def _two_steps(rng: random.Random, who: str, item: str, top: int) -> tuple[str, int]:
    start, packs, per_pack = rng.randint(2, top), rng.randint(2, 9), rng.randint(2, top)
    given = rng.randint(1, start + packs * per_pack)
    question = (
        f"{who} had {start} {item}, bought {packs} packs of {per_pack} {item}, then gave "
        f"away {given}. How many {item} does {who} have now?"
    )
    return question, start + packs * per_pack - given


TEMPLATES: dict[str, Template] = {
    "add": _add,
    "take_away": _take_away,
    "groups_of": _groups_of,
    "share": _share,
    "change": _change,
    "temperature": _temperature,
    "two_steps": _two_steps,
}


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed); None if absent or
    unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    content_start = start + len("\\boxed{")
    depth = 1
    for i in range(content_start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:i].strip()
    return None


def parse_number(text: str) -> Decimal | None:
    """`text` as a number if it is one of the accepted spellings, else None."""
    if not _NUMBER.fullmatch(text):
        return None
    return Decimal(text.replace(",", ""))


PARSER = ThinkParser(extract_fn=last_boxed)


def boxed_answer_reward(completion: Messages, answer: str) -> float:
    """1 if the last boxed number equals the integer answer, else 0."""
    boxed = PARSER.parse_answer(completion)
    number = None if boxed is None else parse_number(boxed)
    return float(number is not None and number == Decimal(answer))


def _sample_row(rng: random.Random, difficulty: int, templates: list[Template]) -> Row:
    person = rng.choice(load_word_list("names.txt")).split(" ", 1)[0]
    template = rng.choice(templates)
    question, answer = template(rng, person, rng.choice(ITEMS), 10**difficulty)
    return {"question": question, "answer": str(answer), "task": "math"}


def _make_splits(
    num_train_examples: int,
    num_eval_examples: int,
    seed: int,
    difficulty: int,
    templates: list[str] | None,
) -> tuple[list[Row], list[Row]]:
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1 (operands up to 10**d), got {difficulty}")
    chosen = list(TEMPLATES) if templates is None else templates
    unknown = [name for name in chosen if name not in TEMPLATES]
    if unknown or not chosen:
        raise ValueError(
            f"templates = {templates}: name one or more of {', '.join(TEMPLATES)}"
        )
    kinds = [TEMPLATES[name] for name in chosen]
    return draw_disjoint_splits(
        lambda rng: _sample_row(rng, difficulty, kinds), num_train_examples, num_eval_examples, seed
    )


def load_environment(
    num_train_examples: int = 2000,
    num_eval_examples: int = 200,
    seed: int = 0,
    difficulty: int = 2,
    templates: list[str] | None = None,
    **kwargs: Any,
) -> SingleTurnEnv:
    """`templates`: the kinds of problem to draw (names of `TEMPLATES`), all of them when None; fewer
    kinds make an easier task, e.g. `["add", "take_away"]` for a model too small for the rest."""
    train, eval_rows = _make_splits(
        num_train_examples, num_eval_examples, seed, difficulty, templates
    )
    rubric = Rubric(funcs=[boxed_answer_reward], parser=PARSER)
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
    difficulty: int = 2,
    templates: list[str] | None = None,
    off_by_one_fraction: float = 0.0,
) -> list[dict[str, Messages]]:
    """`n` chat examples `{"messages": [system, user, assistant]}` whose answer is the bare
    `\\boxed{N}`: they teach the answer format and give a first idea of the arithmetic, the
    rest is left to RL. They are the first `n` training rows of `load_environment` with the
    same seed, difficulty, templates and `num_eval_examples`, so they never contain its eval
    questions.

    `off_by_one_fraction`: the share of examples (drawn at random, seeded) whose boxed answer is
    one more or one less than the right one: an imperfect demonstrator, whose arithmetic slips
    (reward 0) leave the warm-up's answers spread around the right one, a spread RL's reward narrows."""
    train, _ = _make_splits(n, num_eval_examples, seed, difficulty, templates)
    slips = slip_draws(off_by_one_fraction, "off_by_one_fraction", f"off by one {seed}")
    directions = random.Random(f"off by one {seed}, direction")
    examples = []
    for row in train:
        answer = int(row["answer"])
        if slips():
            answer += directions.choice([-1, 1])
        examples.append({"messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
        ]})
    return examples
