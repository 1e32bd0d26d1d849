"""Secret config values (API keys): marked once, by their type, and kept out of everything tandem writes or shows.

A field typed `Secret` is written as `REDACTED` wherever a config is written or shown (`configs/*.toml` of the
run folder, `--dry-run`, the W&B run's config, the k8s ConfigMap, config errors: `tandem.config.loader.shown`).
A process that the launcher starts gets the value through its environment instead
(`tandem.config.loader.secret_env`: `TANDEM_<SECTION>__<KEY>`, which overrides its config file), so no file of
the run holds it; a process started by hand takes it from a flag or that variable. A config file that holds
`REDACTED` is refused unless a flag or the variable gives the value: the server must never serve with the
placeholder as its key, nor a client send it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field
from pydantic.fields import FieldInfo

REDACTED = "<redacted>"
"""What a written or shown config holds in place of a secret that is set."""


def _not_redacted(value: str | None) -> str | None:
    if value == REDACTED:
        raise ValueError(f"{REDACTED} stands for a secret that tandem does not write into files: give its value with "
                         "a flag (`--section.key VALUE`) or an environment variable (TANDEM_SECTION__KEY), "
                         "either of which overrides the file")
    return value


Secret = Annotated[str | None, Field(json_schema_extra={"secret": True}), AfterValidator(_not_redacted)]
"""The type of a secret field (unset: None)."""


def is_secret(field: FieldInfo) -> bool:
    """Whether `field` is typed `Secret`."""
    return isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("secret") is True


def secrets_of(config: BaseModel, prefix: str = "") -> dict[str, str]:
    """Dotted key -> value of each secret of `config` that is set, in nested sections too."""
    found: dict[str, str] = {}
    for name, field in type(config).model_fields.items():
        value = getattr(config, name)
        if is_secret(field) and value is not None:
            found[prefix + name] = value
        elif isinstance(value, BaseModel):
            found.update(secrets_of(value, f"{prefix}{name}."))
    return found


def redacted_dump(config: BaseModel) -> dict[str, Any]:
    """`config.model_dump(mode="json")` with each secret that is set replaced by `REDACTED`."""
    data = config.model_dump(mode="json")
    for key in secrets_of(config):
        *sections, leaf = key.split(".")
        node = data
        for section in sections:
            node = node[section]
        node[leaf] = REDACTED
    return data
