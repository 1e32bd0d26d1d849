"""docs/configuration.md's key reference is generated from the config classes and must be current."""

from __future__ import annotations

import re

from pydantic import BaseModel

from tandem.config.loader import _annotations_at, _models_in, valid_keys
from tandem.config.reference import COMMANDS, DOC, render_reference, updated


def test_the_committed_reference_is_current():
    text = DOC.read_text()
    assert updated(text) == text, "docs/configuration.md is stale: run `python -m tandem.config.reference`"


def test_a_changed_default_makes_the_reference_stale(monkeypatch):
    from tandem.config.base import CheckpointConfig

    monkeypatch.setattr(CheckpointConfig.model_fields["interval"], "default", 11)
    assert updated(DOC.read_text()) != DOC.read_text()


def test_every_leaf_key_has_a_row_and_a_meaning():
    reference = render_reference()
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \| (.*) \|$", reference, re.MULTILINE)
    assert all(meaning.strip() for _, _, meaning in rows)
    documented = {key for key, _, _ in rows}
    for _, config_cls, _ in COMMANDS:
        for key in valid_keys(config_cls):
            if _is_leaf(config_cls, key):  # `tandem rl`'s `trainer.x` is documented as `tandem trainer`'s `x`
                assert key in documented or key.split(".", 1)[-1] in documented, key


def _is_leaf(model: type[BaseModel], key: str) -> bool:
    """A key whose value is not a section (sections are documented through their keys)."""
    return not any(_models_in(a) for a in _annotations_at(model, key))
