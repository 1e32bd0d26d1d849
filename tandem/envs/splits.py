"""Seeded, disjoint train/eval splits for procedurally generated tasks.

Invariant: no question appears twice, so no eval question is ever trained on. Eval rows are
drawn first, so the eval set of a seed does not depend on how many train rows are asked for.
"""

import random
from collections.abc import Callable
from typing import Any

Row = dict[str, Any]


def draw_disjoint_splits(
    sample_row: Callable[[random.Random], Row], num_train: int, num_eval: int, seed: int
) -> tuple[list[Row], list[Row]]:
    """(train, eval) rows from `sample_row(rng)`, distinct by their `question`."""
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
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    if len(rows) < wanted:
        raise ValueError(
            f"found only {len(rows)} distinct questions in {max_draws} draws but "
            f"num_train_examples + num_eval_examples = {wanted}; ask for fewer examples or "
            "widen the task's settings"
        )
    return rows[num_eval:], rows[:num_eval]
