"""Compose a config from TOML files, environment variables and command-line overrides.

Precedence, lowest first: field defaults, `@ file.toml` files in order, environment variables
`TANDEM_<SECTION>__<KEY>`, then `--a.b value` flags in order. Every leaf value remembers where it
came from, so an error can name the key, the value and its source, never a traceback.
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from tandem.config.secret import REDACTED, is_secret, secrets_of

ENV_PREFIX = "TANDEM_"


class ConfigError(Exception):
    """A user-facing config problem; the message is complete and is printed as is."""


@dataclass
class RawConfig:
    """What the user wrote, merged but not validated: nested `data` and the source of each dotted key."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)


def parse_args(config_cls: type[BaseModel], argv: list[str], environ: dict[str, str] | None = None) -> BaseModel:
    """Build `config_cls` from `argv` (without the subcommand) and the environment."""
    raw = read_args(config_cls, argv, environ)
    return validate(config_cls, raw.data, raw.sources)


def read_args(config_cls: type[BaseModel], argv: list[str], environ: dict[str, str] | None = None) -> RawConfig:
    """Merge the files, environment variables and flags of `argv` for `config_cls`, in precedence order."""
    sources: dict[str, str] = {}
    data: dict[str, Any] = {}
    overrides: list[tuple[str, Any, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "@" or arg.startswith("@"):
            path, i = (argv[i + 1] if arg == "@" and i + 1 < len(argv) else arg[1:] or None), i + (2 if arg == "@" else 1)
            if not path:
                raise ConfigError("`@` must be followed by a TOML file path")
            _merge(data, load_toml(Path(path)), sources, source=path)
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: use `@ file.toml` or `--key value`")
        key = arg[2:]
        value: Any
        if "=" in key:
            key, raw = key.split("=", 1)
            value, i = _typed_value(config_cls, _normalize(key), raw), i + 1
        elif key.startswith("no-"):
            key, value, i = key[3:], False, i + 1
            _check_boolean_flag(config_cls, _normalize(key), arg)
        elif i + 1 < len(argv) and argv[i + 1].startswith("@") and _is_boolean_key(config_cls, _normalize(key)):
            value, i = True, i + 1  # `--resume @ more.toml`: the flag, then a file; never the file's content as its value
        elif i + 1 < len(argv) and argv[i + 1] == "@" and i + 2 < len(argv):
            path = argv[i + 2]
            overrides.append((_normalize(key), load_toml(Path(path)), path))
            i += 3
            continue
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value, i = _typed_value(config_cls, _normalize(key), argv[i + 1]), i + 2
        else:
            value, i = True, i + 1
            _check_boolean_flag(config_cls, _normalize(key), arg)
        overrides.append((_normalize(key), _split_if_list(config_cls, _normalize(key), value), "the command line"))

    for name, raw in sorted((environ if environ is not None else os.environ).items()):
        # Only variables whose first segment is a top-level field count: TANDEM_HOME and the
        # like stay free for other uses.
        parts = name[len(ENV_PREFIX):].lower().split("__") if name.startswith(ENV_PREFIX) else []
        if parts and parts[0] in config_cls.model_fields:
            key = ".".join(parts)
            _merge(data, _nest(key, _split_if_list(config_cls, key, _typed_value(config_cls, key, raw))), sources,
                   source=f"environment variable {name}")
    for key, value, source in overrides:
        _merge(data, _nest(key, value), sources, source=source)
    return RawConfig(data, sources)


def _check_boolean_flag(config_cls: type[BaseModel], key: str, flag: str) -> None:
    """A flag without a value (`--x`, `--no-x`) is only for a boolean key; an unknown key is left to validation."""
    annotations = _annotations_at(config_cls, key)
    if annotations and not any(_allows_bool(a) for a in annotations):
        raise ConfigError(f"flag `{flag}` (from the command line) has no value, but `{key}` is not a boolean key: "
                          f"write `{flag.replace('--no-', '--', 1)} VALUE`")


def _is_boolean_key(config_cls: type[BaseModel], key: str) -> bool:
    """Whether dotted `key` takes a boolean and nothing a file could give (a section)."""
    annotations = _annotations_at(config_cls, key)
    return bool(annotations) and all(_allows_bool(a) and not _models_in(a) for a in annotations)


def _annotations_at(model: type[BaseModel], key: str) -> list[Any]:
    """The type annotations of dotted `key` in `model`, one per union variant that has it."""
    return [f.annotation for f in _fields_at(model, key)]


def _fields_at(model: type[BaseModel], key: str) -> list[FieldInfo]:
    """The fields of dotted `key` in `model`, one per union variant that has it."""
    models, parts = [model], key.split(".")
    for depth, part in enumerate(parts):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if depth == len(parts) - 1:
            return fields
        models = [sub for f in fields for sub in _models_in(f.annotation)]
    return []


def shown(config_cls: type[BaseModel], key: str, value: Any) -> Any:
    """`value` of dotted `key` as a message may show it: `REDACTED` for a secret (`tandem.config.secret`)."""
    return REDACTED if any(is_secret(f) for f in _fields_at(config_cls, key)) else value


def env_name(key: str) -> str:
    """The environment variable that sets dotted `key` (`server.api_key`: `TANDEM_SERVER__API_KEY`)."""
    return ENV_PREFIX + key.replace(".", "__").upper()


def secret_env(config: BaseModel) -> dict[str, str]:
    """The environment variables that give a process of root config `config` its secrets, each value as it is
    (a secret is typed text, whose variable is read as given: `123` stays the string it is)."""
    return {env_name(key): value for key, value in secrets_of(config).items()}


def _split_if_list(config_cls: type[BaseModel], key: str, value: Any) -> Any:
    """A plain string given to a list key is a comma-separated list (`--client.base-urls http://a:8000,http://b:8000`);
    the elements stay strings for validation to convert. A TOML list (`'["a", "b"]'`) is already a list."""
    annotations = _annotations_at(config_cls, key)
    if isinstance(value, str) and annotations and all(typing.get_origin(a) is list for a in annotations):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def _allows_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and any(_allows_bool(a) for a in typing.get_args(annotation))


def load_toml(path: Path) -> dict[str, Any]:
    """Read one TOML file, turning a missing file or a syntax error into a `ConfigError`."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: invalid TOML: {err}") from None


def validate(config_cls: type[BaseModel], data: dict[str, Any], sources: dict[str, str]) -> BaseModel:
    """Validate `data` against `config_cls`, explaining the first errors in user terms."""
    try:
        return config_cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError("\n".join(_explain(config_cls, data, sources, e) for e in err.errors())) from None


def valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key of `model`, sections and leaves."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        keys.append(key)
        for sub in _models_in(field.annotation):
            keys.extend(valid_keys(sub, key + "."))
    return sorted(set(keys))


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _explain(config_cls: type[BaseModel], data: dict[str, Any], sources: dict[str, str], error: dict) -> str:
    key, value = _key_of(data, error["loc"])
    if error["type"] == "value_error" and (not key or isinstance(error.get("input"), (dict, BaseModel))):
        # A section's own check (a model validator): its message names the keys; say where each came from.
        msg = error["msg"].removeprefix("Value error, ")
        return f"{f'in `{key}`: ' if key else ''}{msg}{_sources_named(msg, key, sources)}"
    source = _source_of(sources, key)
    where = f" (from {source})" if source else ""
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(key, valid_keys(config_cls), n=1, cutoff=0.5)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        if close and close[0] == key:  # a key of another variant of a discriminated union
            hint = f"; `{key}` belongs to another `type` of `{key.rpartition('.')[0]}`"
        return f"unknown key `{key}`{where}{hint}"
    if error["type"] == "missing":
        return f"missing required key `{key}`{where}"
    return f"invalid value for `{key}`{where}: {shown(config_cls, key, value)!r}: {error['msg']}"


def _key_of(data: dict[str, Any], loc: tuple) -> tuple[str, Any]:
    """Map a pydantic error location onto the user's dotted key, skipping union tags."""
    parts: list[str] = []
    node: Any = data
    for i, item in enumerate(loc):
        if isinstance(node, dict) and item in node:
            parts.append(str(item))
            node = node[item]
        elif isinstance(node, dict) and i + 1 < len(loc) and isinstance(item, str):
            continue  # a name absent from the data with more below it: a discriminated union's tag
        elif isinstance(node, list) and isinstance(item, int) and item < len(node):
            parts[-1] += f"[{item}]"
            node = node[item]
        elif not isinstance(node, dict) or isinstance(item, int):
            continue
        else:
            parts.append(str(item))
            node = None
    return ".".join(parts), node


def _sources_named(msg: str, section: str, sources: dict[str, str]) -> str:
    """` (`a.b` from X; ...)` for each key quoted in `msg` that the user set, relative to `section`."""
    named = []
    for key in dict.fromkeys(re.findall(r"`([A-Za-z_][\w.]*)`", msg)):
        full = f"{section}.{key}" if section else key
        if full in sources:
            named.append(f"`{full}` from {sources[full]}")
    return f" ({'; '.join(named)})" if named else ""


def _source_of(sources: dict[str, str], key: str) -> str | None:
    while key:
        if key in sources:
            return sources[key]
        key = key.rpartition(".")[0].split("[")[0] if "." in key else ""
    return None


def _merge(into: dict[str, Any], new: dict[str, Any], sources: dict[str, str], source: str, prefix: str = "") -> None:
    for key, value in new.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value, sources, source, dotted + ".")
            continue
        into[key] = value
        sources[dotted] = source
        if isinstance(value, dict):
            for leaf in _leaves(value, dotted + "."):
                sources[leaf] = source


def _leaves(d: dict[str, Any], prefix: str) -> list[str]:
    out = []
    for key, value in d.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out.extend(_leaves(value, f"{prefix}{key}."))
    return out


def _nest(key: str, value: Any) -> dict[str, Any]:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _normalize(key: str) -> str:
    return key.replace("-", "_")


def _typed_value(config_cls: type[BaseModel], key: str, raw: str) -> Any:
    """A flag's or variable's text for `key`: as given where the key only takes text (an API key or a run name of
    digits stays a string), else read as a TOML literal."""
    annotations = _annotations_at(config_cls, key)
    text_only = annotations and all(_text_types(t) == {str} for t in annotations)
    return raw if text_only else _parse_value(raw)


def _text_types(annotation: Any) -> set[Any]:
    """The types a value of `annotation` may take, None left out (`str | None` -> {str}; `list[str]` -> {list[str]})."""
    unions = (typing.Union, types.UnionType)
    variants = typing.get_args(annotation) if typing.get_origin(annotation) in unions else (annotation,)
    return {v for v in variants if v is not type(None)}


def _parse_value(raw: str) -> Any:
    """Read a command-line value as a TOML literal (int, float, bool, list), else a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
