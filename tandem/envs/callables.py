"""Calling user-written functions the way verifiers does: sync or async, and with only the
keyword arguments they ask for, so a reward function can be `def f(completion, answer)`."""

import inspect
from collections.abc import Callable, Mapping
from typing import Any


async def maybe_await(value: Any) -> Any:
    """Await `value` if it is awaitable (the result of an async function), else return it."""
    if inspect.isawaitable(value):
        return await value
    return value


def function_name(func: Callable[..., Any]) -> str:
    """A readable name for reports: `__name__`, or the class name of a callable object."""
    return getattr(func, "__name__", type(func).__name__)


def select_kwargs(func: Callable[..., Any], available: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of `available` that `func` names as parameters; all of them if it takes
    `**kwargs`."""
    parameters = inspect.signature(func).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(available)
    accepted = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {name: value for name, value in available.items() if name in accepted}
