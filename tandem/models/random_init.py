"""Random initial weights by parameter name, the same in every process, rank and order of creation.

Each tensor's values depend only on (seed, its HF name, its shape) and the kind of device that
draws them (CPU and CUDA generators differ): the engine building a model on a GPU and each trainer
rank making its shard there (`model.load_format = "dummy"`) get the same numbers without reading or
writing weights, as `tandem model init` does on the CPU. Matrices are normal(0, 0.02), norm weights
1, biases and score corrections 0.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping

import torch

STD = 0.02
"""Standard deviation of the random matrices."""


def initial_value(name: str, shape: torch.Size | tuple[int, ...], seed: int, device: str | torch.device) -> torch.Tensor:
    """The fp32 initial value of parameter `name`."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith((".bias", "e_score_correction_bias")):
        return torch.zeros(shape, device=device)
    # 32 bits: the CPU generator (mt19937) keeps only the low 32 bits of its seed.
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.randn(shape, generator=generator, device=device).mul_(STD)  # in place: one fp32 copy at a time


class RandomWeights(Mapping):
    """A state dict of `initial_value`s, each made when it is read (never all at once)."""

    def __init__(self, shapes: dict[str, torch.Size], seed: int, device: str | torch.device):
        self.shapes, self.seed, self.device = shapes, seed, device

    def __getitem__(self, name: str) -> torch.Tensor:
        return initial_value(name, self.shapes[name], self.seed, self.device)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)
