"""Code says what and why, never the history: tandem's prose names no machine, date, issue or commit.

A docstring keeps the cause and the rule; the figures that proved it live in a result file it names
(`benchmarks/results/<file>.json`), and the dated story in `benchmarks/RESULTS.md`. Prose is what a
reader reads as text: comments (`tokenize`) and string statements (`ast`: module, class and function
docstrings, and the docstrings under attributes). Code is not prose: a compute-capability check, a hex
constant or a GPU name in a string the program uses is never read here. Result-file paths are cut out
before the rules run, since their names carry the machine and the date.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import tandem

RESULT_FILE = re.compile(r"benchmarks/results/[\w.\-]+")
QUOTED = re.compile(r"`[^`]*`|\"[^\"]*\"")
"""Code spans and quoted strings in prose: data the program reads or writes (a device name in a file format)."""

_HEX_WORD = r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"
_COMMIT_WORDS = r"(?:commits?|committed|since|at|before|after|until|reverted|sha|rev|revision|HEAD|code of|in)"

RULES: dict[str, re.Pattern[str]] = {
    "machine name": re.compile(
        r"\b(?:[Hh](?:100|200|800)|[HG]H200|GB?200|B100|A100|A800|A10G?|L40S?|V100|MI[23]\d\dX?|"
        r"(?:RTX|GTX) ?\d{3,4}(?: ?Ti)?|TPU ?v\d)\b"),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "issue reference": re.compile(
        r"\b(?:issues?|PR|pull request|ticket|bug) ?#?\d+\b|(?<![\w&#/])#\d+\b|github\.com/\S+/(?:issues|pull)/\d+",
        re.IGNORECASE),
    "where it was measured": re.compile(
        r"\b[Mm]easured (?:on|at|with|in) (?:an? |one |the |two |this |that )?"
        r"(?:\d|[A-Z]\d|commit|GPU|machine|host|lease|node|box|laptop|day\b)"),
    "commit id": re.compile(rf"\b{_COMMIT_WORDS}\W{{1,3}}{_HEX_WORD}|{_HEX_WORD}\W{{1,3}}(?:commit|\+)"),
    "diary": re.compile(
        r"\b(?:today|yesterday|this (?:week|month|morning)|last (?:week|month)|that day|the same day|"
        r"used to be|as of (?:now|today)|at the time|we (?:measured|found|saw|tried|observed|noticed))\b",
        re.IGNORECASE),
}
"""Each rule's name and what it finds in prose."""


def prose_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and string statement of a module, one entry per line."""
    lines = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    source_lines = [line.encode() for line in LINE_BREAK.split(source)]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else []:
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)):
                continue
            text = statement_text(source_lines, statement)
            lines.extend((statement.lineno + k, line) for k, line in enumerate(text.splitlines()))
    return sorted(lines)


LINE_BREAK = re.compile(r"\r\n|\r|\n")
"""Where the parser's line numbers break a module (`ast.get_source_segment` splits the same way)."""


def statement_text(source_lines: list[bytes], statement: ast.stmt) -> str:
    """The statement's source, as `ast.get_source_segment` cuts it (columns count UTF-8 bytes), from the module's
    lines split once: that function splits the whole module again for each statement."""
    first, last = statement.lineno - 1, statement.end_lineno - 1
    if first == last:
        return source_lines[first][statement.col_offset:statement.end_col_offset].decode()
    middle = source_lines[first + 1:last]
    parts = [source_lines[first][statement.col_offset:], *middle, source_lines[last][:statement.end_col_offset]]
    return "\n".join(part.decode() for part in parts)


def findings(source: str, name: str) -> list[str]:
    """`name:line: rule: text` for each prose line of `source` that tells history instead of the reason."""
    found = []
    for number, line in prose_lines(source):
        text = RESULT_FILE.sub("<result file>", line).replace('"""', "").replace("'''", "")
        for rule, pattern in RULES.items():
            if pattern.search(QUOTED.sub("<data>", text) if rule == "machine name" else text):
                found.append(f"{name}:{number}: {rule}: {line.strip()}")
    return found


def test_tandem_prose_names_no_machine_date_issue_or_commit():
    root = Path(tandem.__file__).parent
    found = [f for path in sorted(root.rglob("*.py"))
             for f in findings(path.read_text(), str(path.relative_to(root.parent)))]
    assert not found, ("Say the reason and name the result file (`benchmarks/results/<file>.json`); the story goes "
                       "to `benchmarks/RESULTS.md`:\n" + "\n".join(found))


OFFENDING = '''"""Fused norms.

On an H200 the decode step took 4.6 ms (issue 23), measured on 2026-12-04 at commit 7b5267e.
"""

THRESHOLD = 3
"""Before #41 we found this too low."""


def step():
    """Tiles tuned on an H200."""
    # measured at 16k tokens on one A100; see https://github.com/o/r/issues/7
    return THRESHOLD  # since ac8f622 this is faster than it used to be
'''

CLEAN = '''"""Fused norms: one kernel per norm, since eager mode launches eight (`benchmarks/results/engine-h200-2026-12-04-fused-blocks.json`).

Time is measured on the reader's clock; the profile is measured on CUDA. SM 9.0 and newer take the fast path.
"""

TABLES = {"NVIDIA H200": "h200.json"}
"""Written as `{"device": "NVIDIA H100 80GB HBM3", "shapes": ...}`, one table per GPU."""
SEED = 0x9E3779B97F4A7C15
COLOR = "#112233"


def fast(capability=(9, 0), name="H100 80GB HBM3"):
    # rows 0..b-1, in order; the hash is 64 hex digits: 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
    return capability >= (9, 0) and name != "deadbeef1"
'''


def test_lint_finds_each_kind_of_history_in_docstrings_and_comments():
    found = findings(OFFENDING, "x.py")
    by_line: dict[int, set[str]] = {}
    for f in found:
        _, line, rule, _ = f.split(":", 3)
        by_line.setdefault(int(line), set()).add(rule.strip())
    assert by_line == {
        3: {"machine name", "issue reference", "where it was measured", "date", "commit id"},
        7: {"issue reference", "diary"},
        11: {"machine name"},
        12: {"where it was measured", "machine name", "issue reference"},
        13: {"commit id", "diary"},
    }, found


def test_lint_leaves_code_result_files_and_plain_prose_alone():
    assert findings(CLEAN, "x.py") == []
