import pytest

from tandem.envs.slips import slip_draws


def test_slip_draws_are_seeded_at_the_asked_rate():
    draws = slip_draws(0.25, "misclosed_fraction", "misclosed 7")
    first = [draws() for _ in range(2000)]
    again = slip_draws(0.25, "misclosed_fraction", "misclosed 7")
    assert [again() for _ in range(2000)] == first
    assert 0.22 < sum(first) / 2000 < 0.28
    never, always = slip_draws(0.0, "f", "s"), slip_draws(1.0, "f", "s")
    assert not any(never() for _ in range(100)) and all(always() for _ in range(100))


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_a_fraction_outside_zero_to_one_names_the_argument(fraction):
    with pytest.raises(ValueError, match="off_by_one_fraction"):
        slip_draws(fraction, "off_by_one_fraction", "off by one 0")
