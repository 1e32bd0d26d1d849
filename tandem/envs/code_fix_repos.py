"""Small Python repositories with one planted bug, for `code_fix`.

A repository is a package `app/` of modules grouped by topic, each function with a unittest
test in `tests/`, and exactly one function mutated by one `Bug`: off by one, a wrong operator,
comparison, constant or variable, a missing call, or two statements swapped. Every bug is a
textual edit that appears once in its module, fails at least one test, and is undone by
replacing the buggy line(s), which are unique in the module (tests hold this for every bug). Repositories are a pure function of
the random generator, so a seed always gives the same ones.
"""

import itertools
import random
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Bug:
    kind: str
    correct: str
    """Text of the correct function that the bug replaces (present exactly once)."""
    buggy: str


@dataclass(frozen=True)
class FunctionTemplate:
    name: str
    topic: str
    """The module it goes in: `app/<topic>.py`."""
    source: str
    cases: tuple[tuple[str, str], ...]
    """(call, expected value) as Python expressions, e.g. ("sum_to(4)", "10")."""
    bugs: tuple[Bug, ...]


def _template(name: str, topic: str, source: str, cases: list[tuple[str, str]], bugs: list[tuple[str, str, str]]):
    return FunctionTemplate(name, topic, textwrap.dedent(source).strip() + "\n", tuple(cases),
                            tuple(Bug(*bug) for bug in bugs))


TEMPLATES = (
    _template("sum_to", "numbers", '''
        def sum_to(n):
            """Sum of the integers 1..n."""
            total = 0
            for i in range(1, n + 1):
                total += i
            return total
        ''', [("sum_to(1)", "1"), ("sum_to(4)", "10"), ("sum_to(0)", "0")],
        [("off_by_one", "range(1, n + 1)", "range(1, n)"), ("wrong_operator", "total += i", "total -= i"),
         ("wrong_constant", "total = 0\n    for i", "total = 1\n    for i")]),
    _template("clamp", "numbers", '''
        def clamp(x, low, high):
            """x limited to the range [low, high]."""
            if x < low:
                return low
            if x > high:
                return high
            return x
        ''', [("clamp(5, 0, 10)", "5"), ("clamp(-3, 0, 10)", "0"), ("clamp(12, 0, 10)", "10")],
        [("wrong_comparison", "if x > high", "if x < high"), ("wrong_variable", "x > high:\n        return high", "x > high:\n        return low")]),
    _template("average", "numbers", '''
        def average(values):
            """Mean of a non-empty list of numbers."""
            return sum(values) / len(values)
        ''', [("average([2, 4])", "3.0"), ("average([5])", "5.0"), ("average([1, 2, 3, 6])", "3.0")],
        [("off_by_one", "/ len(values)", "/ (len(values) + 1)"), ("wrong_call", "sum(values) /", "max(values) /")]),
    _template("index_of_max", "numbers", '''
        def index_of_max(values):
            """Index of the first largest value of a non-empty list."""
            best = 0
            for i in range(1, len(values)):
                if values[i] > values[best]:
                    best = i
            return best
        ''', [("index_of_max([3, 9, 2])", "1"), ("index_of_max([5])", "0"), ("index_of_max([1, 7, 7])", "1"),
              ("index_of_max([1, 2, 8])", "2")],
        [("wrong_comparison", "values[i] > values[best]", "values[i] >= values[best]"),
         ("off_by_one", "range(1, len(values))", "range(1, len(values) - 1)"),
         ("wrong_variable", "best = i", "best = values[i]")]),
    _template("running_total", "numbers", '''
        def running_total(values):
            """The partial sums of values, in order."""
            totals = []
            total = 0
            for value in values:
                total += value
                totals.append(total)
            return totals
        ''', [("running_total([1, 2, 3])", "[1, 3, 6]"), ("running_total([])", "[]"), ("running_total([5, -5])", "[5, 0]")],
        [("swapped_statements", "total += value\n        totals.append(total)", "totals.append(total)\n        total += value"),
         ("wrong_constant", "totals = []\n    total = 0", "totals = []\n    total = 1")]),
    _template("fahrenheit", "numbers", '''
        def fahrenheit(celsius):
            """A Celsius temperature in degrees Fahrenheit."""
            return celsius * 9 / 5 + 32
        ''', [("fahrenheit(0)", "32.0"), ("fahrenheit(100)", "212.0"), ("fahrenheit(-40)", "-40.0")],
        [("wrong_constant", "celsius * 9 / 5", "celsius * 5 / 9"), ("wrong_operator", "+ 32", "- 32")]),
    _template("count_vowels", "text", '''
        def count_vowels(text):
            """How many letters of text are vowels (a, e, i, o, u, in either case)."""
            count = 0
            for letter in text.lower():
                if letter in "aeiou":
                    count += 1
            return count
        ''', [("count_vowels('banana')", "3"), ("count_vowels('SKY')", "0"), ("count_vowels('Audio')", "4")],
        [("missing_call", "text.lower()", "text"), ("wrong_constant", '"aeiou"', '"aeio"'),
         ("wrong_operator", "count += 1", "count += 2")]),
    _template("reverse_words", "text", '''
        def reverse_words(sentence):
            """The words of sentence in reverse order, joined by single spaces."""
            words = sentence.split()
            return " ".join(reversed(words))
        ''', [("reverse_words('a b c')", "'c b a'"), ("reverse_words('  hello   world ')", "'world hello'"),
              ("reverse_words('one')", "'one'")],
        [("missing_call", "reversed(words)", "words"), ("wrong_constant", '" ".join', '"".join')]),
    _template("fizzbuzz", "text", '''
        def fizzbuzz(n):
            """FizzBuzz for multiples of 15, Fizz of 3, Buzz of 5, else n as text."""
            if n % 15 == 0:
                return "FizzBuzz"
            if n % 3 == 0:
                return "Fizz"
            if n % 5 == 0:
                return "Buzz"
            return str(n)
        ''', [("fizzbuzz(9)", "'Fizz'"), ("fizzbuzz(10)", "'Buzz'"), ("fizzbuzz(30)", "'FizzBuzz'"), ("fizzbuzz(7)", "'7'")],
        [("wrong_constant", "n % 15", "n % 25"), ("off_by_one", "return str(n)", "return str(n + 1)"),
         ("wrong_variable", '5 == 0:\n        return "Buzz"', '5 == 0:\n        return "Fizz"')]),
    _template("initials", "text", '''
        def initials(name):
            """The upper-case first letters of the words of name."""
            return "".join(word[0].upper() for word in name.split())
        ''', [("initials('ada lovelace')", "'AL'"), ("initials('Alan Mathison Turing')", "'AMT'")],
        [("off_by_one", "word[0]", "word[1]"), ("missing_call", "word[0].upper()", "word[0]")]),
    _template("is_leap_year", "dates", '''
        def is_leap_year(year):
            """Whether year is a leap year of the Gregorian calendar."""
            if year % 400 == 0:
                return True
            if year % 100 == 0:
                return False
            return year % 4 == 0
        ''', [("is_leap_year(2000)", "True"), ("is_leap_year(1900)", "False"), ("is_leap_year(2024)", "True"),
              ("is_leap_year(2023)", "False"), ("is_leap_year(1800)", "False")],
        [("wrong_constant", "year % 400", "year % 40"), ("wrong_variable", "100 == 0:\n        return False", "100 == 0:\n        return True"),
         ("wrong_comparison", "year % 4 == 0", "year % 4 != 0")]),
    _template("days_in_month", "dates", '''
        def days_in_month(month):
            """Days in a month (1-12) of a year that is not a leap year."""
            if month == 2:
                return 28
            if month in (4, 6, 9, 11):
                return 30
            return 31
        ''', [("days_in_month(2)", "28"), ("days_in_month(4)", "30"), ("days_in_month(12)", "31"), ("days_in_month(9)", "30")],
        [("wrong_constant", "(4, 6, 9, 11)", "(4, 6, 8, 11)"), ("off_by_one", "return 28", "return 29")]),
)


@dataclass(frozen=True)
class Repository:
    files: dict[str, str]
    """Relative path -> content, tests included."""
    test_files: tuple[str, ...]
    num_tests: int
    buggy_function: str
    bug_kind: str
    failing_test: str
    """`tests/test_<topic>.py::test_<function>`."""
    fix: tuple[str, str, str]
    """(path, old, new): the `replace_text` that undoes the bug. `old` is the whole buggy line(s),
    which occur once in the module even where the bug's own text does not."""
    short_fix: tuple[str, str, str]
    """(path, old, new): the same edit with the shortest `old` of whole words that occurs once
    (`shortest_fix`), e.g. ("app/numbers.py", "-=", "+=")."""


def module_source(functions: list[FunctionTemplate]) -> str:
    return "\n\n".join(f.source for f in functions)


def test_source(topic: str, functions: list[FunctionTemplate]) -> str:
    lines = ["import unittest", "", f"from app.{topic} import {', '.join(f.name for f in functions)}", "", "",
             f"class Test{topic.capitalize()}(unittest.TestCase):"]
    for function in functions:
        lines.append(f"    def test_{function.name}(self):")
        lines += [f"        self.assertEqual({call}, {expected})" for call, expected in function.cases]
        lines.append("")
    return "\n".join(lines)


def plant(source: str, bug: Bug) -> tuple[str, str, str]:
    """(the buggy module, its buggy line(s), the correct line(s))."""
    if source.count(bug.correct) != 1:
        raise ValueError(f"bug text {bug.correct!r} must occur once in its module, found {source.count(bug.correct)}")
    start = source.index(bug.correct)
    line_start, line_end = source.rfind("\n", 0, start) + 1, source.index("\n", start + len(bug.correct))
    correct_lines = source[line_start:line_end]
    return source.replace(bug.correct, bug.buggy), correct_lines.replace(bug.correct, bug.buggy), correct_lines


def _word_bounds(text: str, index: int, step: int, count: int) -> list[int]:
    """`index`, then the positions reached by moving it `count` whitespace-separated words left
    (`step` -1) or right (1)."""
    bounds = [index]
    for _ in range(count):
        i = bounds[-1]
        if step < 0:
            while i > 0 and text[i - 1].isspace():
                i -= 1
            while i > 0 and not text[i - 1].isspace():
                i -= 1
        else:
            while i < len(text) and text[i].isspace():
                i += 1
            while i < len(text) and not text[i].isspace():
                i += 1
        bounds.append(i)
    return bounds


def shortest_fix(buggy: str, correct: str, max_words: int = 6) -> tuple[str, str]:
    """(old, new) with `buggy.replace(old, new) == correct`, `old` the shortest run of whole words
    around the change that occurs once in `buggy`: far less to copy than the whole buggy lines
    (e.g. "-=" -> "+=" for `total -= i`). Raises when no run of up to `max_words` more words on
    each side is unique."""
    prefix = 0
    while prefix < min(len(buggy), len(correct)) and buggy[prefix] == correct[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(len(buggy), len(correct)) - prefix and buggy[-1 - suffix] == correct[-1 - suffix]:
        suffix += 1
    start, end = prefix, len(buggy) - suffix
    while start > 0 and not buggy[start - 1].isspace():
        start -= 1
    while end < len(buggy) and not buggy[end].isspace():
        end += 1
    spans = itertools.product(_word_bounds(buggy, start, -1, max_words), _word_bounds(buggy, end, 1, max_words))
    unique = [(a, b) for a, b in spans if buggy.count(buggy[a:b]) == 1]
    if not unique:
        raise ValueError("no run of whole words around the change occurs once")
    a, b = min(unique, key=lambda span: span[1] - span[0])
    return buggy[a:b], correct[a:len(correct) - (len(buggy) - b)]


def generate_repository(rng: random.Random, num_functions: int = 4) -> Repository:
    """`num_functions` distinct functions over their topics' modules, one of them bugged."""
    functions = rng.sample(TEMPLATES, num_functions)
    target = rng.choice(functions)
    bug = rng.choice(target.bugs)
    files = {"app/__init__.py": ""}
    tests = []
    for topic in sorted({f.topic for f in functions}):
        members = [f for f in functions if f.topic == topic]
        files[f"app/{topic}.py"] = module_source(members)
        files[f"tests/test_{topic}.py"] = test_source(topic, members)
        tests.append(f"tests/test_{topic}.py")
    files["tests/__init__.py"] = ""
    path = f"app/{target.topic}.py"
    correct = files[path]
    files[path], buggy_lines, correct_lines = plant(correct, bug)
    return Repository(files, tuple(tests + ["tests/__init__.py"]), num_functions, target.name, bug.kind,
                      f"tests/test_{target.topic}.py::test_{target.name}", (path, buggy_lines, correct_lines),
                      (path, *shortest_fix(files[path], correct)))
