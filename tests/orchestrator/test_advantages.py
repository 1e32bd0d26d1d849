import pytest

from tandem.config.orchestrator import AdvantageConfig
from tandem.orchestrator.advantages import group_advantages, is_zero_signal


def test_reward_minus_group_mean():
    advantages = group_advantages([1.0, 0.0, 0.5, 0.5], [10, 10, 10, 10], AdvantageConfig(), max_tokens=100)
    assert advantages == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert sum(advantages) == pytest.approx(0.0)


def test_std_normalization_gives_unit_spread():
    advantages = group_advantages([2.0, 0.0], [1, 1], AdvantageConfig(std_normalize=True), max_tokens=100)
    assert advantages == pytest.approx([1.0, -1.0])


def test_std_normalization_leaves_equal_rewards_at_zero():
    advantages = group_advantages([0.3, 0.3, 0.3], [1, 2, 3], AdvantageConfig(std_normalize=True), max_tokens=10)
    assert is_zero_signal(advantages)


def test_length_penalty_prefers_the_shorter_of_equal_rewards():
    advantages = group_advantages([1.0, 1.0], [10, 90], AdvantageConfig(length_penalty=0.5), max_tokens=100)
    assert advantages[0] > 0 > advantages[1]
    assert advantages == pytest.approx([0.2, -0.2])


def test_zero_signal_detection():
    assert is_zero_signal([0.0, 0.0, 1e-12])
    assert is_zero_signal([])
    assert not is_zero_signal([0.1, -0.1])
