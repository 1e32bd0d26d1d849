import random

import pytest

from tandem.transport.row_packing import first_fit_decreasing


def test_first_fit_decreasing_fills_bins_tightly():
    bins = first_fit_decreasing([6, 5, 4, 3, 2], capacity=10)
    assert [sorted(b) for b in bins] == [[0, 2], [1, 3, 4]]
    with pytest.raises(ValueError, match="exceeds the bin capacity"):
        first_fit_decreasing([11], capacity=10)


def test_each_item_goes_to_the_first_bin_with_room_longest_first():
    """The bins a scan of every bin gives, ties in index order, for many more bins than the tree starts with."""
    rng = random.Random(1)
    for capacity, count in ((40, 300), (1024, 2000), (7, 1)):
        lengths = [rng.randint(1, capacity) for _ in range(count)]
        expected: list[list[int]] = []
        for i in sorted(range(count), key=lambda i: -lengths[i]):
            row = next((b for b in expected if sum(lengths[j] for j in b) + lengths[i] <= capacity), None)
            row.append(i) if row is not None else expected.append([i])
        assert first_fit_decreasing(lengths, capacity) == expected
    assert first_fit_decreasing([], 8) == []
