"""Render configs for people: resolved TOML for `--dry-run`, key listings for `--help`."""

from __future__ import annotations

from typing import Any

import tomli_w
from pydantic import BaseModel

from tandem.config.base import ProcessConfig
from tandem.config.loader import _models_in

PROCESS_SECTIONS = ("inference", "orchestrator", "trainer")


def to_toml(config: BaseModel) -> str:
    """The config as TOML; `None` values are left out (TOML has no null)."""
    return tomli_w.dumps(_drop_none(config.model_dump(mode="json")))


def dump_process_configs(config: ProcessConfig) -> str:
    """Each process's resolved config under a `# <process>` heading (one if not an RL config)."""
    parts = [(name, getattr(config, name)) for name in PROCESS_SECTIONS if isinstance(getattr(config, name, None), ProcessConfig)]
    if not parts:
        return to_toml(config)
    return "\n".join(f"# ---- {name} ----\n{to_toml(sub)}" for name, sub in parts)


def describe(model: type[BaseModel], prefix: str = "") -> str:
    """One line per key: dotted name, default and description."""
    lines = []
    for name, field in model.model_fields.items():
        subs = _models_in(field.annotation)
        key = f"{prefix}{name}"
        if subs and len(subs) == 1:
            lines.append(describe(subs[0], key + "."))
            continue
        default = "" if field.is_required() else f" = {field.get_default(call_default_factory=True)!r}"
        lines.append(f"  --{key}{default}\n      {field.description or ''}")
    return "\n".join(lines)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
