"""Small environments for orchestrator tests, built on tandem's environment API, and the
fake-server reply functions that play the model for them."""

from __future__ import annotations

import random

from tandem.envs import MultiTurnEnv, Rubric, SingleTurnEnv
from tandem.orchestrator.environments import LoadedEnv

WORDS = ["apple", "river", "stone", "cloud", "ember", "frost", "maple", "tiger"]


def word_rows(n: int, offset: int = 0) -> list[dict]:
    return [{"question": f"say {WORDS[(i + offset) % len(WORDS)]} {i}", "answer": WORDS[(i + offset) % len(WORDS)]}
            for i in range(n)]


def exact_match(completion, answer) -> float:
    return float(completion[-1]["content"].strip() == answer)


def say_env(name: str = "say", extra_funcs: tuple = (), weight: float = 1.0) -> LoadedEnv:
    """Single turn: answer the word after `say`; reward 1 when exact."""
    rubric = Rubric(funcs=[exact_match, *extra_funcs], weights=[1.0] + [0.0] * len(extra_funcs))
    env = SingleTurnEnv(dataset=word_rows(16), eval_dataset=word_rows(6, offset=3), rubric=rubric)
    return LoadedEnv(name, env, weight)


def right_or_wrong(prompt: str, rng: random.Random) -> str:
    """Half the time the asked word, else a wrong one: groups get varied rewards."""
    asked = prompt.rsplit("say ", 1)[-1].split()[0]
    return asked if rng.random() < 0.5 else "wrong"


class CountdownEnv(MultiTurnEnv):
    """Three model turns; each environment reply says how many are left. Reward: the share of
    turns that repeated the environment's last word."""

    def __init__(self, **kwargs):
        super().__init__(max_turns=3, dataset=word_rows(8), rubric=Rubric(funcs=[self.repeated]), **kwargs)

    def is_completed(self, messages, state, **kwargs) -> bool:
        return False

    def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": f"left {3 - state['turn']}"}], state

    @staticmethod
    def repeated(completion) -> float:
        turns = [m["content"] for m in completion if m["role"] == "assistant"]
        return sum(len(t) > 2 for t in turns) / 3


def echo_or_short(prompt: str, rng: random.Random) -> str:
    last = prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
    return last if rng.random() < 0.5 else "ok"
