"""One prompt, one answer: the multi-turn loop stopped after the first model turn."""

from typing import Any

from tandem.envs.multi_turn import MultiTurnEnv
from tandem.envs.types import Messages, State


class SingleTurnEnv(MultiTurnEnv):
    def __init__(self, **kwargs: Any):
        super().__init__(max_turns=1, **kwargs)

    def is_completed(self, messages: Messages, state: State, **kwargs: Any) -> bool:
        return state["turn"] >= 1

    def env_response(
        self, messages: Messages, state: State, **kwargs: Any
    ) -> tuple[Messages, State]:
        return [], state
