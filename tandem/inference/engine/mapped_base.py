"""The engine's side of `lora.share_base`: its model's weights are the trainer's tensors, mapped, never its own.

The model is built on `meta` and each parameter becomes the trainer's tensor of the same HF name
(`tandem.transport.shared_base`), so the engine loads nothing and holds no copy: on CUDA its weights are the trainer's
device memory, on the CPU the pages of one shared file. Nothing may write into them (the trainer reads the same
tensors), so the adapters are not merged: each update goes into the low-rank side path (`lora_side_path`, sign +1 on
the policy's rows), whose tensors stay at fixed addresses for the CUDA graphs. The q/k/v and gate/up of each block
lie end to end in the buffer, so the fused blocks' stacks are views of it (`stacked_projections.stack_rows`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tandem.inference.engine.lora_merge import check_adapters
from tandem.inference.engine.lora_side_path import LowRankSidePath
from tandem.models.hub import read_hf_config
from tandem.models.loading import build_native, is_native, replace_parameters
from tandem.models.lora import LoraSpec
from tandem.transport.shared_base import MappedBase, read_shared_base


def load_mapped_model(folder: Path, shared_file: Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The native model of `folder` whose parameters are the tensors `shared_file` describes, mapped on `device`; an
    error names the file and what does not fit (a missing weight, another shape or dtype than `model.dtype`'s)."""
    hf_config = read_hf_config(folder)
    source = str(Path(folder) / "config.json")
    if not is_native(hf_config):
        raise ValueError(f"`engine.lora.share_base` needs a model native to tandem; {source} says model_type "
                         f"{hf_config.get('model_type')!r}, which loads through transformers")
    mapped = read_shared_base(shared_file, device)
    model = build_native(hf_config, "meta", dtype, source)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(mapped.tensors))
    if missing:
        raise KeyError(f"{shared_file} lacks {missing[:5]} of the model in {folder}: trainer and engine serve one model")
    for name, param in params.items():
        tensor = mapped.tensors[name]
        if tensor.shape != param.shape or tensor.dtype != param.dtype:
            raise ValueError(f"{shared_file}: {name} is {tuple(tensor.shape)} {tensor.dtype}, the engine's model holds "
                             f"{tuple(param.shape)} {param.dtype}: set the trainer's and the engine's `model.dtype` alike")
    replace_parameters(model, {name: mapped.tensors[name] for name in params})
    model.mapped_base = mapped  # the mapping lives as long as the model
    return model.eval()


def mapped_parameter_bytes(model: nn.Module, mapped: MappedBase) -> tuple[int, int]:
    """(bytes of `model`'s parameters inside the mapped buffer, bytes outside it): what the engine holds of its own."""
    start = mapped.buffer.data_ptr()
    end = start + mapped.buffer.numel()
    inside = outside = 0
    for param in model.parameters():
        nbytes = param.numel() * param.element_size()
        if start <= param.data_ptr() and param.data_ptr() + nbytes <= end:
            inside += nbytes
        else:
            outside += nbytes
    return inside, outside


class SidePathAdapters:
    """The policy's adapters as the side path over a mapped base adds them; `apply` is `AdapterMerger.apply`'s
    counterpart (checked whole first, nothing changed unless all fit)."""

    def __init__(self, side: LowRankSidePath, spec: LoraSpec, shapes: dict[str, torch.Size]):
        """`shapes`: the adapted weights' by HF name (`tandem.models.lora.adapted_parameters`)."""
        self.side = side
        self.spec = spec
        self.shapes = shapes

    def apply(self, adapters: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.side.load(check_adapters(adapters, self.shapes, self.spec))
