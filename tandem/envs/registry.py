"""`load_environment(env_id)`: a built-in by name, else an installed environment module.

An id names a module after turning `-` into `_` (as verifiers environment packages do):
`reverse-text` and `reverse_text` are the same. Built-ins win over installed modules.
"""

import importlib
from typing import Any

BUILTIN_ENVIRONMENTS = {
    "reverse_text": "tandem.envs.reverse_text",
    "alphabet_sort": "tandem.envs.alphabet_sort",
    "wordle": "tandem.envs.wordle",
    "math": "tandem.envs.math_problems",
    "wiki_search": "tandem.envs.wiki_search",
    "code_fix": "tandem.envs.code_fix",
    "swe": "tandem.envs.swe",
    "humaneval": "tandem.envs.humaneval",
    "fixed_length": "tandem.envs.fixed_length",
}


def load_environment(env_id: str, **kwargs: Any) -> Any:
    """The environment built by the `load_environment(**kwargs)` of the module `env_id` names.

    Returns whatever that function returns: a tandem `Environment` for built-ins, possibly
    another OpenAI-client-shaped environment for installed modules.
    """
    module_name = env_id.replace("-", "_")
    builtin = BUILTIN_ENVIRONMENTS.get(module_name)
    try:
        module = importlib.import_module(builtin or module_name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if module_name != missing and not module_name.startswith(f"{missing}."):
            raise  # the module exists, but one of its own imports is missing
        raise ValueError(
            f"unknown environment {env_id!r}: not a built-in ({', '.join(BUILTIN_ENVIRONMENTS)}) "
            f"and no installed module named {module_name!r}"
        ) from None
    if not callable(getattr(module, "load_environment", None)):
        raise ValueError(
            f"module {module.__name__!r} (environment {env_id!r}) has no load_environment function"
        )
    return module.load_environment(**kwargs)
