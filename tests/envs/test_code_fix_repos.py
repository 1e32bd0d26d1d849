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
        buggy = plant(module, bug)  # raises unless the text occurs once in the whole module
        assert failing_cases(buggy, template), f"{template.name}: {bug.kind} fails no test"
        # one replace_text of the buggy line(s), which are unique, undoes it
        start = module.index(bug.correct)
        line_start, line_end = module.rfind("\n", 0, start) + 1, module.index("\n", start + len(bug.correct))
        correct_lines = module[line_start:line_end]
        buggy_lines = correct_lines.replace(bug.correct, bug.buggy)
        assert buggy.count(buggy_lines) == 1 and buggy.replace(buggy_lines, correct_lines) == module


def test_repositories_are_a_function_of_the_seed():
    first = generate_repository(random.Random(5))
    assert generate_repository(random.Random(5)) == first
    assert generate_repository(random.Random(6)) != first
    assert first.failing_test.startswith("tests/test_") and first.num_tests == 4
    kinds = {generate_repository(random.Random(seed)).bug_kind for seed in range(200)}
    assert len(kinds) >= 6
