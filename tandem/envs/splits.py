"""Seeded, disjoint train/eval splits, of generated tasks or of a fixed list of items.

Invariant: no question appears twice, so no eval question is ever trained on. Eval rows are
drawn first, so the eval set of a seed does not depend on how many train rows are asked for.
"""

import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

Row = dict[str, Any]
Item = TypeVar("Item")


def split_items(
    items: Sequence[Item], num_train: int, num_eval: int, seed: int, what: str
) -> tuple[list[Item], list[Item]]:
    """(train, eval) of distinct `items` after a `seed` shuffle; `num_train` -1 takes every item
    not in eval. `what` names the items in the error ("wordle has 594 answer words")."""
    wanted_train = len(items) - num_eval if num_train < 0 else num_train
    if num_eval < 0 or wanted_train < 0 or wanted_train + num_eval > len(items):
        raise ValueError(
            f"{what.format(len(items))}; num_train_examples={num_train} and "
            f"num_eval_examples={num_eval} do not fit"
        )
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)
    return shuffled[num_eval : num_eval + wanted_train], shuffled[:num_eval]


def draw_disjoint_splits(
    sample_row: Callable[[random.Random], Row], num_train: int, num_eval: int, seed: int, key: str = "question"
) -> tuple[list[Row], list[Row]]:
    """(train, eval) rows from `sample_row(rng)`, distinct by their `key` field (the question,
    unless the task is more than its text)."""
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"example counts must be >= 0, got {num_train=} and {num_eval=}")
    rng = random.Random(seed)
    wanted = num_eval + num_train
    max_draws = 20 * wanted + 1000
    rows: list[Row] = []
    seen: set[str] = set()
    for _ in range(max_draws):
        if len(rows) == wanted:
            break
        row = sample_row(rng)
        if row[key] not in seen:
            seen.add(row[key])
            rows.append(row)
    if len(rows) < wanted:
        raise ValueError(
            f"found only {len(rows)} distinct questions in {max_draws} draws but "
            f"num_train_examples + num_eval_examples = {wanted}; ask for fewer examples or "
            "widen the task's settings"
        )
    return rows[num_eval:], rows[:num_eval]
