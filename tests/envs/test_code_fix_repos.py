import random

import pytest

from tandem.envs.code_fix_repos import TEMPLATES, generate_repository, module_source, plant


def failing_cases(source: str, template) -> list[str]:
    """The test cases of `template` that `source` (a whole module) fails."""
    namespace: dict = {}
    exec(source, namespace)  # our own templates, never model output

    def passes(call: str, expected: str) -> bool:
        try:
            return eval(call, namespace) == eval(expected)
        except Exception:
            return False

    return [call for call, expected in template.cases if not passes(call, expected)]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_every_bug_is_planted_once_fails_a_test_and_is_undone_by_the_reverse_edit(template):
    topic = [t for t in TEMPLATES if t.topic == template.topic]
    module = module_source(topic)
    assert failing_cases(module, template) == []
    assert len({bug.kind for bug in template.bugs}) == len(template.bugs)
    for bug in template.bugs:
        buggy, old, new = plant(module, bug)  # raises unless the text occurs once in the whole module
        assert failing_cases(buggy, template), f"{template.name}: {bug.kind} fails no test"
        assert buggy.count(old) == 1 and buggy.replace(old, new) == module  # one replace_text undoes it


def test_repositories_are_a_function_of_the_seed():
    first = generate_repository(random.Random(5))
    assert generate_repository(random.Random(5)) == first
    assert generate_repository(random.Random(6)) != first
    assert first.failing_test.startswith("tests/test_") and first.num_tests == 4
    path, old, new = first.fix
    assert first.failing_test.startswith(f"tests/test_{path[4:-3]}.py") and first.files[path].count(old) == 1
    kinds = {generate_repository(random.Random(seed)).bug_kind for seed in range(200)}
    assert len(kinds) >= 6
