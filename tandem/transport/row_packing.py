"""First-fit-decreasing: which samples share a row of the trainer's batches.

Both producers of packed rows use it: the orchestrator for each RL step's samples and the SFT trainer for
each epoch of its data. Longest first, each sample goes to the first row with room for it (ties in index
order); the row with room is found in a max segment tree, in O(log rows): a scan from the first row makes
packing quadratic in the rows (timings: `benchmarks/RESULTS.md`).
"""

from __future__ import annotations


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`, longest items placed first."""
    bins: list[list[int]] = []
    room = _MaxTree()
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"item {i} of length {n} exceeds the bin capacity {capacity}")
        b = room.first_at_least(n)
        if b is None:
            bins.append([i])
            room.append(capacity - n)
        else:
            bins[b].append(i)
            room.set(b, room.value(b) - n)
    return bins


class _MaxTree:
    """The free room of each bin, bins in creation order as leaves, each node the largest room below it."""

    def __init__(self):
        self.size = 1
        self.tree = [-1, -1]  # leaves from index `size`; -1: no bin there yet
        self.count = 0

    def value(self, i: int) -> int:
        return self.tree[self.size + i]

    def append(self, value: int) -> None:
        if self.count == self.size:  # grow: the old tree becomes the left half of one twice as wide
            leaves = self.tree[self.size:] + [-1] * self.size
            self.size *= 2
            self.tree = [-1] * self.size + leaves
            for node in range(self.size - 1, 0, -1):
                self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
        self.count += 1
        self.set(self.count - 1, value)

    def set(self, i: int, value: int) -> None:
        node = self.size + i
        self.tree[node] = value
        while node > 1:
            node //= 2
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])

    def first_at_least(self, value: int) -> int | None:
        """The first bin with at least `value` of room, or None."""
        if self.tree[1] < value:
            return None
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= value else 2 * node + 1
        return node - self.size
