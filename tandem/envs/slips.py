"""Seeded slips of an imperfect demonstrator, for SFT warm-up data.

A warm-up on flawless demonstrations can leave RL nothing its reward sees; one whose demonstrator
slips now and then (a wrong closing tag, an answer one off) leaves a share of scored-low answers that
RL's reward removes. The draws are seeded apart from the task's, so the same questions come with or
without slips.
"""

import random
from collections.abc import Callable


def slip_draws(fraction: float, name: str, seed: str) -> Callable[[], bool]:
    """A function that says, on each call, whether the next demonstration slips: True with probability
    `fraction`, the same sequence for the same `seed` (a string, e.g. "misclosed 0"). `name` is the
    slip's argument name, for the error."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{name} = {fraction}: a fraction, 0 to 1")
    rng = random.Random(seed)
    return lambda: rng.random() < fraction
