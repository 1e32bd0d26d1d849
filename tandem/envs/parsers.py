"""Parsers turn a model's completion into the answer a reward function compares.

`Parser` is the identity; `XMLParser` reads `<tag>...</tag>` fields; `ThinkParser` drops the
`<think>...</think>` block of reasoning models. Each can also score how well a completion
follows its format (`get_format_reward_func`), so a rubric can reward the format itself.
"""

import re
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from tandem.envs.types import Messages

FormatRewardFunc = Callable[..., float]


def assistant_contents(completion: Messages | str) -> list[str]:
    """The text of every assistant turn (a plain string counts as one turn)."""
    if isinstance(completion, str):
        return [completion]
    return [m.get("content") or "" for m in completion if m.get("role") == "assistant"]


def last_assistant_content(completion: Messages | str) -> str | None:
    """The text of the last assistant turn, None when there is none."""
    contents = assistant_contents(completion)
    return contents[-1] if contents else None


class Parser:
    """The identity parser: the answer is the last assistant message as written."""

    def parse(self, text: str) -> Any:
        return text

    def parse_answer(self, completion: Messages | str) -> str | None:
        """The parsed last assistant message; None when the model never answered."""
        content = last_assistant_content(completion)
        return None if content is None else self.parse(content)

    def get_format_reward_func(self) -> FormatRewardFunc:
        """A reward function for format adherence; any text is well-formed here."""

        def format_reward_func(completion: Messages | str) -> float:
            return 1.0

        return format_reward_func


class XMLParser(Parser):
    """Fields written as `<field>value</field>`.

    A field's value is the content of its last occurrence (models revise; the last one is the
    answer they settled on), stripped of surrounding whitespace; None when the field has no
    complete open/close pair.
    """

    def __init__(self, fields: Sequence[str], answer_field: str | None = None):
        if not fields:
            raise ValueError("XMLParser needs at least one field")
        for name in fields:
            if not re.fullmatch(r"[A-Za-z_][\w-]*", name):
                raise ValueError(f"XMLParser field {name!r} is not a valid tag name")
        self.fields = list(fields)
        self.answer_field = answer_field or self.fields[-1]
        if self.answer_field not in self.fields:
            raise ValueError(f"answer_field {self.answer_field!r} is not one of {self.fields}")
        self._patterns = {
            name: re.compile(rf"<{re.escape(name)}>(.*?)</{re.escape(name)}>", re.DOTALL)
            for name in self.fields
        }

    def parse(self, text: str) -> SimpleNamespace:
        """One attribute per field: its value, or None."""
        values = {}
        for name, pattern in self._patterns.items():
            matches = pattern.findall(text)
            values[name] = matches[-1].strip() if matches else None
        return SimpleNamespace(**values)

    def parse_answer(self, completion: Messages | str) -> str | None:
        """The answer field of the last assistant message."""
        content = last_assistant_content(completion)
        return None if content is None else getattr(self.parse(content), self.answer_field)

    def format(self, **values: str) -> str:
        """The fields given, in declared order, as `<field>\\nvalue\\n</field>` blocks."""
        unknown = set(values) - set(self.fields)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}; this parser has {self.fields}")
        return "\n".join(
            f"<{name}>\n{values[name]}\n</{name}>" for name in self.fields if name in values
        )

    def format_score(self, text: str) -> float:
        """0 without a non-empty answer field; else 0.5, plus 0.25 if no field tag appears
        twice, plus 0.25 if there is no text outside the field tags."""
        answer = getattr(self.parse(text), self.answer_field)
        if not answer:
            return 0.0
        tags_once = all(
            text.count(f"<{name}>") <= 1 and text.count(f"</{name}>") <= 1 for name in self.fields
        )
        outside = text
        for pattern in self._patterns.values():
            outside = pattern.sub("", outside)
        return 0.5 + 0.25 * tags_once + 0.25 * (outside.strip() == "")

    def get_format_reward_func(self) -> FormatRewardFunc:
        """Mean `format_score` over the assistant turns; 0 when there are none."""

        def format_reward_func(completion: Messages | str) -> float:
            contents = assistant_contents(completion)
            return sum(map(self.format_score, contents)) / len(contents) if contents else 0.0

        return format_reward_func


class ThinkParser(Parser):
    """Drops the reasoning block: the answer is what follows the last `</think>`, then
    `extract_fn` (e.g. pull out a `\\boxed{}`). A `<think>` that never closes means the model
    was still thinking, so the answer is empty; text without think tags is taken whole."""

    def __init__(self, extract_fn: Callable[[str], str | None] = lambda text: text):
        self.extract_fn = extract_fn

    def parse(self, text: str) -> str | None:
        if "</think>" in text:
            text = text.rsplit("</think>", 1)[1]
        elif "<think>" in text:
            text = ""
        return self.extract_fn(text.strip())

    def get_format_reward_func(self) -> FormatRewardFunc:
        """Fraction of assistant turns shaped `<think>...</think>answer`: one think block, at
        the start, with a non-empty answer after it."""

        def is_well_formed(text: str) -> bool:
            return (
                text.lstrip().startswith("<think>")
                and text.count("<think>") == 1
                and text.count("</think>") == 1
                and text.split("</think>", 1)[1].strip() != ""
            )

        def format_reward_func(completion: Messages | str) -> float:
            contents = assistant_contents(completion)
            return sum(map(is_well_formed, contents)) / len(contents) if contents else 0.0

        return format_reward_func
