"""alphabet_sort: sort names alphabetically by first or last name, over 1 to 3 turns.

Turn 1 gives a few names; each follow-up turn adds more and asks for the full sorted list
again. Answers go inside `<alphabetical_sorted>` tags, one "First Last" name per line.
Within one example all first names differ and all last names differ, so the order is never
ambiguous. Reward = mean over the example's turns of `difflib.SequenceMatcher` ratio between
the answered list and the correct sorted list (each as newline-joined names); a turn with no
tags, or never reached, scores 0.

`info` of an example: `sort_by` ("first" or "last") and `names_per_turn` (the names each
turn introduces); the expected lists are derived from it.
"""

import difflib
import random
from typing import Any

from tandem.envs.multi_turn import MultiTurnEnv
from tandem.envs.parsers import XMLParser, assistant_contents
from tandem.envs.rubric import Rubric
from tandem.envs.slips import slip_draws
from tandem.envs.splits import Row, draw_disjoint_splits
from tandem.envs.types import Info, Messages, State
from tandem.envs.word_lists import load_word_list

SYSTEM_PROMPT = (
    "Sort names alphabetically as asked. Answer with the full sorted list inside "
    "<alphabetical_sorted> tags, one name per line, each written as 'First Last'."
)
PARSER = XMLParser(["alphabetical_sorted"])


def sort_names(names: list[str], sort_by: str) -> list[str]:
    """Names in alphabetical order of first name or of last name (case-insensitive)."""

    def key(name: str) -> tuple[str, str]:
        first, last = name.lower().split(" ", 1)
        return (first, last) if sort_by == "first" else (last, first)

    return sorted(names, key=key)


def expected_lists(info: Info) -> list[list[str]]:
    """The correct sorted list after each turn."""
    seen: list[str] = []
    lists = []
    for names in info["names_per_turn"]:
        seen = seen + names
        lists.append(sort_names(seen, info["sort_by"]))
    return lists


def first_question(names: list[str], sort_by: str) -> str:
    return f"Sort these names by {sort_by} name:\n" + "\n".join(names)


def follow_up_question(names: list[str]) -> str:
    return "Add these names and give the full sorted list again:\n" + "\n".join(names)


def _sample_row(
    rng: random.Random,
    min_turns: int,
    max_turns: int,
    min_names: int,
    max_names: int,
    names_per_follow_up: int,
) -> Row:
    num_turns = rng.randint(min_turns, max_turns)
    counts = [rng.randint(min_names, max_names)] + [names_per_follow_up] * (num_turns - 1)
    pool = list(load_word_list("names.txt"))
    rng.shuffle(pool)
    chosen: list[str] = []
    firsts: set[str] = set()
    lasts: set[str] = set()
    for name in pool:
        first, last = name.split(" ", 1)
        if first not in firsts and last not in lasts:
            chosen.append(name)
            firsts.add(first)
            lasts.add(last)
        if len(chosen) == sum(counts):
            break
    if len(chosen) < sum(counts):
        raise ValueError(
            f"an example needs {sum(counts)} names with distinct first and last names; "
            f"data/names.txt has at most {len(chosen)}: lower max_names, max_turns or "
            "names_per_follow_up"
        )
    names_per_turn = []
    for count in counts:
        names_per_turn.append(chosen[:count])
        chosen = chosen[count:]
    sort_by = rng.choice(["first", "last"])
    info = {"sort_by": sort_by, "names_per_turn": names_per_turn}
    return {
        "question": first_question(names_per_turn[0], sort_by),
        "answer": "\n".join(expected_lists(info)[-1]),
        "task": "alphabet_sort",
        "info": info,
    }


def _make_splits(
    num_train_examples: int,
    num_eval_examples: int,
    seed: int,
    min_turns: int,
    max_turns: int,
    min_names: int,
    max_names: int,
    names_per_follow_up: int,
) -> tuple[list[Row], list[Row]]:
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns=}, {max_turns=}")
    if not 1 <= min_names <= max_names or names_per_follow_up < 1:
        raise ValueError(
            f"need 1 <= min_names <= max_names and names_per_follow_up >= 1, got "
            f"{min_names=}, {max_names=}, {names_per_follow_up=}"
        )
    return draw_disjoint_splits(
        lambda rng: _sample_row(
            rng, min_turns, max_turns, min_names, max_names, names_per_follow_up
        ),
        num_train_examples,
        num_eval_examples,
        seed,
    )


class AlphabetSortEnv(MultiTurnEnv):
    """Ends after the example's number of turns; each env turn adds that turn's names."""

    def is_completed(self, messages: Messages, state: State, **kwargs: Any) -> bool:
        return state["turn"] >= len(state["info"]["names_per_turn"])

    def env_response(
        self, messages: Messages, state: State, **kwargs: Any
    ) -> tuple[Messages, State]:
        names = state["info"]["names_per_turn"][state["turn"]]
        return [{"role": "user", "content": follow_up_question(names)}], state


def sorted_list_reward(completion: Messages, info: Info) -> float:
    """Mean per-turn similarity of the answered list to the correct one."""
    expected = expected_lists(info)
    answers = assistant_contents(completion)
    total = 0.0
    for text, names in zip(answers, expected, strict=False):
        parsed = PARSER.parse(text).alphabetical_sorted
        if parsed is None:
            continue
        lines = [line.strip() for line in parsed.splitlines() if line.strip()]
        total += difflib.SequenceMatcher(None, "\n".join(lines), "\n".join(names)).ratio()
    return total / len(expected)


def load_environment(
    num_train_examples: int = 2000,
    num_eval_examples: int = 200,
    seed: int = 0,
    min_turns: int = 1,
    max_turns: int = 3,
    min_names: int = 3,
    max_names: int = 6,
    names_per_follow_up: int = 2,
    **kwargs: Any,
) -> AlphabetSortEnv:
    train, eval_rows = _make_splits(
        num_train_examples,
        num_eval_examples,
        seed,
        min_turns,
        max_turns,
        min_names,
        max_names,
        names_per_follow_up,
    )
    format_reward_func = PARSER.get_format_reward_func()
    rubric = Rubric(
        funcs=[sorted_list_reward, format_reward_func], weights=[1.0, 0.0], parser=PARSER
    )
    return AlphabetSortEnv(
        dataset=train,
        eval_dataset=eval_rows,
        system_prompt=SYSTEM_PROMPT,
        parser=PARSER,
        rubric=rubric,
        max_turns=max_turns,
        **kwargs,
    )


def sft_examples(
    n: int,
    seed: int = 0,
    num_eval_examples: int = 200,
    min_turns: int = 1,
    max_turns: int = 3,
    min_names: int = 3,
    max_names: int = 6,
    names_per_follow_up: int = 2,
    misclosed_fraction: float = 0.0,
) -> list[dict[str, Messages]]:
    """`n` whole conversations `{"messages": [system, user, assistant, user, assistant, ...]}`,
    every assistant turn the correct sorted list, the follow-ups as the environment writes them.
    They are the first `n` training rows of `load_environment` with the same arguments, so they
    never contain its eval questions.

    `misclosed_fraction`: the share of assistant turns (drawn at random, seeded) that close with
    `</alphabetical>` instead of `</alphabetical_sorted>`: an imperfect demonstrator, whose lists are
    right but sometimes in a form the parser rejects (that turn scores 0), a slip RL's reward can
    correct."""
    train, _ = _make_splits(
        n, num_eval_examples, seed, min_turns, max_turns, min_names, max_names, names_per_follow_up
    )
    slips = slip_draws(misclosed_fraction, "misclosed_fraction", f"misclosed {seed}")
    examples = []
    for row in train:
        names_per_turn = row["info"]["names_per_turn"]
        messages: Messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": row["question"]},
        ]
        for turn, names in enumerate(expected_lists(row["info"])):
            if turn:
                messages.append({"role": "user", "content": follow_up_question(names_per_turn[turn])})
            answer = PARSER.format(alphabetical_sorted="\n".join(names))
            if slips():
                answer = answer.replace("</alphabetical_sorted>", "</alphabetical>")
            messages.append({"role": "assistant", "content": answer})
        examples.append({"messages": messages})
    return examples
