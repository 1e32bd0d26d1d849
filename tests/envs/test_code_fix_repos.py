import random

import pytest

from tandem.envs.code_fix_repos import TEMPLATES, generate_repository, module_source, plant, shortest_fix


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


def test_shortest_fix_is_a_unique_run_of_whole_words_that_undoes_the_bug():
    module = module_source([t for t in TEMPLATES if t.topic == "numbers"])
    sum_to = next(t for t in TEMPLATES if t.name == "sum_to")
    buggy, _, _ = plant(module, next(b for b in sum_to.bugs if b.kind == "wrong_operator"))
    assert shortest_fix(buggy, module) == ("-=", "+=")  # "-" alone is not a whole word
    buggy, _, _ = plant(module, next(b for b in sum_to.bugs if b.kind == "wrong_constant"))
    old, new = shortest_fix(buggy, module)
    assert buggy.count(old) == 1 and buggy.replace(old, new) == module and len(old) < len("    total = 1")


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda t: t.name)
def test_every_bug_has_a_shortest_fix_no_longer_than_its_lines(template):
    for module in (module_source([template]), module_source([t for t in TEMPLATES if t.topic == template.topic])):
        for bug in template.bugs:
            buggy, lines_old, _ = plant(module, bug)
            old, new = shortest_fix(buggy, module)
            assert buggy.count(old) == 1 and buggy.replace(old, new) == module
            assert len(old) <= len(lines_old)
            assert not old[:1].isspace() and not old[-1:].isspace()


def test_shortest_fix_refuses_when_no_run_of_words_is_unique():
    with pytest.raises(ValueError, match="occurs once"):
        shortest_fix("x = 1\nx = 1\n", "x = 1\nx = 2\n", max_words=1)


def test_a_repository_short_fix_and_line_fix_make_the_same_module():
    for seed in range(30):
        repo = generate_repository(random.Random(seed))
        (path, old, new), (short_path, short_old, short_new) = repo.fix, repo.short_fix
        assert short_path == path and repo.files[path].count(short_old) == 1 and len(short_old) <= len(old)
        assert repo.files[path].replace(short_old, short_new) == repo.files[path].replace(old, new)
