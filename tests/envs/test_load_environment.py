import sys
import textwrap

import pytest

from tandem.envs import BUILTIN_ENVIRONMENTS, Environment, load_environment


@pytest.mark.parametrize(
    "env_id", ["reverse_text", "reverse-text", "alphabet-sort", "wordle", "math", "humaneval"]
)
def test_builtins_load_with_kwargs(env_id):
    env = load_environment(env_id, num_train_examples=4, num_eval_examples=3, seed=1)
    assert isinstance(env, Environment)
    assert len(env.get_dataset()) == 4 and len(env.get_eval_dataset()) == 3


def test_kwargs_reach_the_environment():
    env = load_environment("math", num_train_examples=1, num_eval_examples=1, max_concurrent=3)
    assert env.max_concurrent == 3


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A folder on sys.path where a test can write environment modules."""
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_custom_env", "env_without_loader", "env_with_missing_dependency"):
        sys.modules.pop(name, None)


def test_installed_module_is_imported_by_id(module_dir):
    (module_dir / "my_custom_env.py").write_text(
        textwrap.dedent(
            """
            from tandem.envs import SingleTurnEnv

            def load_environment(size=1, **kwargs):
                rows = [{"question": str(i), "answer": str(i)} for i in range(size)]
                return SingleTurnEnv(dataset=rows, **kwargs)
            """
        )
    )
    env = load_environment("my-custom-env", size=3)
    assert [e["answer"] for e in env.get_dataset()] == ["0", "1", "2"]


def test_unknown_id_names_the_id_and_the_builtins():
    with pytest.raises(ValueError) as error:
        load_environment("no-such-env")
    message = str(error.value)
    assert "'no-such-env'" in message and "'no_such_env'" in message
    assert all(name in message for name in BUILTIN_ENVIRONMENTS)


def test_module_without_loader_is_an_error(module_dir):
    (module_dir / "env_without_loader.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match="has no load_environment function"):
        load_environment("env_without_loader")


def test_missing_dependency_of_a_module_is_not_hidden(module_dir):
    (module_dir / "env_with_missing_dependency.py").write_text("import surely_not_installed_pkg\n")
    with pytest.raises(ModuleNotFoundError, match="surely_not_installed_pkg"):
        load_environment("env_with_missing_dependency")
