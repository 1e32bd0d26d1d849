"""Learning-rate schedules: warmup, then constant, linear or cosine decay to `min_lr_ratio`."""

from __future__ import annotations

import pytest
import torch

from tandem.config.trainer import AdamWConfig, ConstantSchedule, CosineSchedule, LinearSchedule, SGDConfig
from tandem.trainer.optim import build_optimizer, build_scheduler, lr_factor


def lrs(schedule, max_steps: int) -> list[float]:
    return [lr_factor(schedule, s, max_steps) for s in range(max_steps)]


def test_warmup_then_constant():
    assert lrs(ConstantSchedule(warmup_steps=3), 6) == pytest.approx([0.25, 0.5, 0.75, 1, 1, 1])


def test_linear_decays_to_min_ratio():
    assert lrs(LinearSchedule(warmup_steps=1, min_lr_ratio=0.1), 5) == pytest.approx([0.5, 1.0, 0.775, 0.55, 0.325])
    assert lr_factor(LinearSchedule(min_lr_ratio=0.1), 10, 10) == pytest.approx(0.1)


def test_cosine_decays_to_min_ratio():
    values = lrs(CosineSchedule(min_lr_ratio=0.0), 5)
    assert values[0] == 1.0 and values == sorted(values, reverse=True)
    assert values[2] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 2 / 5)).item()))
    assert lr_factor(CosineSchedule(min_lr_ratio=0.2), 5, 5) == pytest.approx(0.2)


@pytest.mark.parametrize("config, cls", [(AdamWConfig(lr=0.1), torch.optim.AdamW), (SGDConfig(lr=0.1, momentum=0.9), torch.optim.SGD)])
def test_scheduler_drives_the_optimizer_lr(config, cls):
    model = torch.nn.Linear(2, 2)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, LinearSchedule(warmup_steps=1), max_steps=3)
    seen = []
    for _ in range(3):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert isinstance(optimizer, cls)
    assert seen == pytest.approx([0.05, 0.1, 0.05])
