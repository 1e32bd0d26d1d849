"""Which task comes next: a weighted mix of environments, each read in seeded shuffled epochs.

Every choice is a pure function of (seed, counters): draw i picks its environment with
`Random(f"{seed}:draw:{i}")`, and epoch e of an environment is the permutation
`Random(f"{seed}:{env}:{e}")`. So the whole sampler state is two counters, which is what an
orchestrator checkpoint stores to resume the data stream where it stopped.
"""

from __future__ import annotations

import random
from typing import Any

from tandem.orchestrator.environments import LoadedEnv, as_examples


class TaskSampler:
    def __init__(self, envs: list[LoadedEnv], seed: int):
        self.envs = envs
        self.seed = seed
        self.datasets = {e.name: as_examples(e.env.get_dataset(), e.name) for e in envs}
        self.num_draws = 0
        self.positions = {e.name: 0 for e in envs}
        self._orders: dict[tuple[str, int], list[int]] = {}

    def next(self) -> tuple[LoadedEnv, dict[str, Any]]:
        """The next (environment, example)."""
        env = random.Random(f"{self.seed}:draw:{self.num_draws}").choices(self.envs, [e.weight for e in self.envs])[0]
        data = self.datasets[env.name]
        epoch, index = divmod(self.positions[env.name], len(data))
        self.num_draws += 1
        self.positions[env.name] += 1
        return env, data[self._order(env.name, epoch, len(data))[index]]

    def state_dict(self) -> dict[str, Any]:
        return {"num_draws": self.num_draws, "positions": dict(self.positions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state["positions"]) - set(self.positions)
        if unknown:
            raise ValueError(f"checkpoint has data positions of environments {sorted(unknown)} that this run lacks")
        self.num_draws = int(state["num_draws"])
        self.positions.update({k: int(v) for k, v in state["positions"].items()})

    def _order(self, name: str, epoch: int, size: int) -> list[int]:
        key = (name, epoch)
        if key not in self._orders:
            order = list(range(size))
            random.Random(f"{self.seed}:{name}:{epoch}").shuffle(order)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != name}  # keep one epoch per env
            self._orders[key] = order
        return self._orders[key]
