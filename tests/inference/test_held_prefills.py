"""The prefill server's held prompts: their bytes counted while computed and held, freed when taken or expired."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.inference.disaggregated.held import HeldPrefills, OverBudget


def test_held_bytes_admit_within_the_budget_and_come_back_when_taken_or_expired():
    held = HeldPrefills(hold_timeout_s=0.05, max_bytes=1000)
    with held.reserve(600):
        assert held.num_bytes == 600
        with pytest.raises(OverBudget, match="max_held_mib"):
            with held.reserve(600):
                pass
        first = held.put([torch.zeros(100, dtype=torch.uint8), torch.zeros(50, dtype=torch.float32)])  # 300 bytes
    assert held.num_bytes == 300
    with held.reserve(700):
        second = held.put([torch.zeros(700, dtype=torch.uint8)])
    assert (len(held), held.num_bytes) == (2, 1000)
    with pytest.raises(OverBudget):
        with held.reserve(1):
            pass
    assert [t.nbytes for t in held.take(first)] == [100, 200] and held.take(first) is None
    assert held.num_bytes == 700
    time.sleep(0.06)  # the second is never taken: it expires, and its bytes come back at the next reserve
    with held.reserve(1000):
        assert len(held) == 0 and held.take(second) is None
    assert held.num_bytes == 0
