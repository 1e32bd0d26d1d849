"""OpenAI tool schemas from plain Python functions.

The function's name is the tool name, the first paragraph of its docstring the description,
its annotations the JSON-schema types, and a Google-style `Args:` section the parameter
descriptions. Parameters without a default are required; `hidden` ones (filled in by the
environment, not the model) are left out.
"""

import inspect
import re
import types
from collections.abc import Callable, Collection
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

_PRIMITIVES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    tuple: "array",
    set: "array",
    dict: "object",
    type(None): "null",
}
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns?|Raises|Yields?|Examples?|Notes?):\s*$")
_ARG_LINE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


def json_schema(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a type annotation; `{}` (any value) when unannotated."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return {}
    if annotation in _PRIMITIVES:
        return {"type": _PRIMITIVES[annotation]}
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (Union, types.UnionType):
        options = [json_schema(arg) for arg in args if arg is not type(None)]
        return options[0] if len(options) == 1 else {"anyOf": options}
    if origin in (list, tuple, set):
        return {"type": "array", "items": json_schema(args[0])} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    raise TypeError(
        f"no JSON schema for annotation {annotation!r}; use str, int, float, bool, list, dict, "
        "Literal, or Optional of these"
    )


def parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    description_lines: list[str] = []
    arg_docs: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for raw in doc.splitlines():
        line = raw.strip()
        header = _SECTION.match(line)
        if header:
            section, current = header.group(1), None
        elif section is None:
            description_lines.append(line)
        elif section in ("Args", "Arguments", "Parameters") and line:
            arg = _ARG_LINE.match(line)
            if arg:
                current = arg.group(1)
                arg_docs[current] = arg.group(2).strip()
            elif current is not None:
                arg_docs[current] = f"{arg_docs[current]} {line}".strip()
    first_paragraph = "\n".join(description_lines).strip().split("\n\n")[0]
    return " ".join(first_paragraph.split()), arg_docs


def tool_schema(func: Callable[..., Any], hidden: Collection[str] = ()) -> dict[str, Any]:
    """`{"type": "function", "function": {name, description, parameters}}` for `func`."""
    description, arg_docs = parse_docstring(inspect.getdoc(func) or "")
    hints = get_type_hints(func)
    properties: dict[str, dict[str, Any]] = {}
    required: list[str] = []
    for param in inspect.signature(func).parameters.values():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if param.name in hidden:
            continue
        try:
            schema = json_schema(hints.get(param.name, inspect.Parameter.empty))
        except TypeError as error:
            raise TypeError(f"tool {func.__name__!r}, parameter {param.name!r}: {error}") from None
        if param.name in arg_docs:
            schema["description"] = arg_docs[param.name]
        properties[param.name] = schema
        if param.default is inspect.Parameter.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": func.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }
