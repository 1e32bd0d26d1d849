"""Datasets as plain lists of `Example` dicts.

Rows may come already formatted (with a `prompt`) or as `question`/`answer` pairs that get a
system prompt and few-shot messages prepended. A Hugging Face `datasets.Dataset` works too:
it is read through `.to_list()` (or plain iteration), so `datasets` is never imported here.
"""

import random
from collections.abc import Iterable, Mapping
from typing import Any

from tandem.envs.types import Example, Messages


def build_prompt(
    question: str, system_prompt: str | None = None, few_shot: Messages | None = None
) -> Messages:
    """`[system?] + few_shot + [user: question]`."""
    prompt: Messages = []
    if system_prompt is not None:
        prompt.append({"role": "system", "content": system_prompt})
    prompt.extend(dict(message) for message in few_shot or [])
    prompt.append({"role": "user", "content": question})
    return prompt


def format_example(
    row: Mapping[str, Any], system_prompt: str | None = None, few_shot: Messages | None = None
) -> Example:
    """One row as an `Example`; a row that already has a `prompt` keeps it as it is."""
    if "prompt" in row:
        prompt = [dict(message) for message in row["prompt"]]
    elif "question" in row:
        prompt = build_prompt(row["question"], system_prompt, few_shot)
    else:
        raise ValueError(
            f"dataset row needs a 'prompt' or a 'question' key, got keys {sorted(row)}"
        )
    return Example(
        prompt=prompt,
        answer=str(row.get("answer", "")),
        task=str(row.get("task") or "default"),
        info=dict(row.get("info") or {}),
    )


def format_dataset(
    rows: Iterable[Mapping[str, Any]] | Any,
    system_prompt: str | None = None,
    few_shot: Messages | None = None,
) -> list[Example]:
    """All rows as `Example`s. `rows` is any iterable of mappings or an HF `Dataset`."""
    records = rows.to_list() if hasattr(rows, "to_list") else rows
    return [format_example(row, system_prompt, few_shot) for row in records]


def take_examples(examples: list[Example], n: int = -1, seed: int | None = None) -> list[Example]:
    """The first `n` examples (all if `n < 0`), after a seeded shuffle when `seed` is given."""
    chosen = list(examples)
    if seed is not None:
        random.Random(seed).shuffle(chosen)
    return chosen if n < 0 else chosen[:n]
