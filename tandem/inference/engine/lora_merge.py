"""The engine's side of LoRA: a policy update is adapters only, merged into a kept copy of the base.

The engine multiplies by merged weights (`W + B @ A * scale`, `tandem.models.lora.adapted_weight`, the function
the trainer's forward uses), so its kernels, CUDA graphs and stacked projections run unchanged and a decode step
reads no more bytes than the base model's. Merging from a kept copy of the base, never from the previous merged
weights, keeps every update exact: no rounding accumulates over hundreds of updates. The copy holds the targeted
projections only, on the host (pinned on CUDA), so the device holds one copy of the model; each update moves
them to the device one projection at a time. Adapted routed experts are the model's stacked tensors
[E, out, in] (the engine's fused kernels read the same ones), merged one stack at a time.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.inference.engine.lora_side_path import LowRankSidePath
from tandem.models.lora import LoraSpec, adapted_parameters, adapted_weight, adapter_pairs


def check_adapters(adapters: dict[str, torch.Tensor], shapes: dict[str, torch.Size], spec: LoraSpec
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapters by the weight they adapt, checked against the adapted weights' `shapes` (by name) and `spec`'s
    rank; an error names what does not fit (before anything is changed)."""
    pairs = adapter_pairs(adapters)
    missing, unexpected = sorted(set(shapes) - set(pairs)), sorted(set(pairs) - set(shapes))
    if missing or unexpected:
        raise KeyError(f"the adapters do not match the served model's LoRA targets {list(spec.target_modules)}: "
                       f"missing for {missing[:5]}, unexpected for {unexpected[:5]}")
    rank = spec.rank
    for name, (lora_a, lora_b) in pairs.items():
        *experts, out_features, in_features = shapes[name]  # stacked experts: [E, out, in]
        want_a, want_b = (*experts, rank, in_features), (*experts, out_features, rank)
        if tuple(lora_a.shape) != want_a or tuple(lora_b.shape) != want_b:
            raise ValueError(f"adapter shapes for {name}: A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)}; rank "
                             f"{rank} needs A {want_a}, B {want_b}")
        if not (lora_a.is_floating_point() and lora_b.is_floating_point()):
            raise ValueError(f"adapter dtypes for {name}: {lora_a.dtype}, {lora_b.dtype}; floating point is needed")
    return pairs


class AdapterMerger:
    def __init__(self, model: nn.Module, spec: LoraSpec, source: str = "the engine's config",
                 base_path: LowRankSidePath | None = None):
        """Keep host copies of `model`'s projections that `spec` targets (every `nn.Linear` whose last name part is
        a target, the LM head never, and the routed experts' stacks it names); a target that matches nothing is an
        error naming `source` and what the model has. `base_path`: the side path that serves the base model beside
        the policy, given each update's adapters."""
        self.spec = spec
        self.base_path = base_path
        self.params = adapted_parameters(model, spec, source, section="engine.lora")
        for name, param in self.params.items():
            if not param.is_floating_point() or param.element_size() < 2:
                raise ValueError(f"{name} is held as {param.dtype}: LoRA adapters merge into bf16, fp16 or fp32 weights")
        pin = next(iter(self.params.values())).device.type == "cuda"
        self.base = {name: param.detach().to("cpu", copy=True) for name, param in self.params.items()}
        if pin:
            self.base = {name: tensor.pin_memory() for name, tensor in self.base.items()}

    def apply(self, adapters: dict[str, torch.Tensor]) -> None:
        """Merge `adapters` (HF-named `<projection>.lora_A.weight`, `.lora_B.weight`) into the live weights, in place
        (stacked projections see it: their parameters are views); nothing changes unless all fit."""
        pairs = check_adapters(adapters, {name: base.shape for name, base in self.base.items()}, self.spec)
        with torch.no_grad():
            for name, (lora_a, lora_b) in pairs.items():
                param = self.params[name]
                base = self.base[name].to(param.device, non_blocking=True)
                param.copy_(adapted_weight(base, lora_a.to(param.device), lora_b.to(param.device), self.spec.scale))
        if self.base_path is not None:
            self.base_path.load(pairs)
