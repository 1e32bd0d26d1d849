"""fixed_length: prompts and completions of exact lengths, for measuring the RL loop (`benchmarks/rl_loop.py`).

Every prompt is `prompt_chars` random lowercase letters (with the byte tokenizer, one token each, plus the chat
template's). Every completion is exactly `sampling.max_tokens` tokens long: the environment samples with
`ignore_eos`, so only the token budget ends a turn (as long as no `sampling.stop` string is set). The reward is the
share of completion tokens whose id is even: it differs between the rollouts of a group (so no group is filtered as
zero-signal and the loss is not degenerate) and a policy can raise it, but it says nothing about language.
"""

from __future__ import annotations

import random
import string
from typing import Any

from tandem.envs.rubric import Rubric
from tandem.envs.single_turn import SingleTurnEnv
from tandem.envs.types import State


def even_token_reward(state: State) -> float:
    """Share of the last model turn's tokens with an even id; 0 when it sampled none."""
    responses = state.get("responses") or []
    if not responses:
        return 0.0
    token_ids = responses[-1].choices[0].token_ids
    return sum(1 for t in token_ids if t % 2 == 0) / len(token_ids) if token_ids else 0.0


def load_environment(num_examples: int = 1000, prompt_chars: int = 64, seed: int = 0, **kwargs: Any) -> SingleTurnEnv:
    """`num_examples` prompts of `prompt_chars` random letters (drawn from `seed`); eval uses the same set."""
    if num_examples < 1 or prompt_chars < 1:
        raise ValueError(f"need num_examples >= 1 and prompt_chars >= 1, got {num_examples=}, {prompt_chars=}")
    rng = random.Random(seed)
    rows = [{"question": "".join(rng.choices(string.ascii_lowercase, k=prompt_chars)), "answer": "", "task": "fixed_length"}
            for _ in range(num_examples)]
    return SingleTurnEnv(dataset=rows, rubric=Rubric(funcs=[even_token_reward]),
                         sampling_args={"ignore_eos": True, **kwargs.pop("sampling_args", {})}, **kwargs)
