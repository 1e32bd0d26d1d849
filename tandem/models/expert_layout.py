"""Expert weights (and multi-token prediction layers) in memory vs on disk: the one place that converts between them.

In memory (tandem's models, as transformers 5's) each sparse block holds its experts stacked:
`{p}.mlp.experts.gate_up_proj` [E, 2*I, H] (expert j's gate rows, then its up rows) and
`{p}.mlp.experts.down_proj` [E, H, I]. On disk, Hugging Face checkpoints store one tensor per
expert and projection, with names each family chose (`ExpertLayout`), and transformers 5 writes
them back that way. `weights.load_state_dict` and `weights.save_state_dict` call `to_memory` and
`to_disk`, so every reader and writer of a model folder (`tandem model init`, the trainer's
loading and published `weights/step_N`, the engine's loading and weight updates) agrees.
Stacking copies: while a folder is loaded, its experts exist once more in host memory.

The multi-token prediction layers that checkpoints hold after the last block (`model.layers.{N + i}`, N =
`num_hidden_layers`) are kept for the families of `KEEPS_MTP_LAYERS`, whose models hold them apart from the blocks as
`model.mtp_layers.{i}` (GLM-5's, DeepSeek-V3's and GLM-4.5's own, the decoder families' draft head:
`tandem.models.decoder.DraftHead`); another family's are left out. A draft head's dense
feed-forward keeps the name `mlp` on disk in every family (MiniMax-M2 names only its routed blocks otherwise).
DeepSeek-V3's checkpoints (R1's, V3.1's) also store, in each such layer, a copy of the model's embedding and LM
head (`embed_tokens.weight`, `shared_head.head.weight`): the layer shares the model's own (DeepSeek-V3's paper; GLM-5's
checkpoints store no copy), so those copies are left out on reading (`MTP_COPIES`), as tandem's MTP layer has neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLayout:
    """How one family's checkpoints name the sparse block and its experts' projections."""

    block: str = "mlp"
    """Name of the feed-forward module on disk (`mlp` in memory)."""
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


EXPERT_LAYOUTS = {"qwen3_moe": ExpertLayout(), "glm4_moe": ExpertLayout(), "glm_moe_dsa": ExpertLayout(),
                  "deepseek_v3": ExpertLayout(), "minimax_m2": ExpertLayout(block="block_sparse_moe", gate="w1", up="w3", down="w2")}
"""model_type -> its on-disk layout, for the native mixture-of-experts families. Other families'
tensors pass unchanged: a transformers fallback model publishes and reloads its own in-memory names."""


SCALES = "_scale_inv"
"""Suffix of an FP8 weight's block scales (`tandem.models.fp8`): on disk `experts.N.gate_proj.weight_scale_inv`, in
memory `experts.gate_up_proj_scale_inv`, stacked as the weights are (each expert's gate blocks, then its up blocks)."""


KEEPS_MTP_LAYERS = frozenset({"qwen3", "qwen3_moe", "minimax_m2", "glm4_moe", "glm_moe_dsa", "deepseek_v3"})
"""Families whose models keep the checkpoints' multi-token prediction layers (as `model.mtp_layers.{i}`)."""

MTP_COPIES = re.compile(r"model\.mtp_layers\.\d+\.(embed_tokens|shared_head\.head)\.weight(_scale_inv)?")
"""An MTP layer's stored copies of the model's embedding and LM head (in-memory names), left out on reading."""


def to_memory(state: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """On-disk names -> in-memory names: per-expert tensors (and FP8 experts' block scales) stacked, the block renamed
    `mlp`, the multi-token-prediction layers (`num_nextn_predict_layers`, after the last block) renamed
    `model.mtp_layers.{i}` (`KEEPS_MTP_LAYERS`, their copies of the embedding and head left out)."""
    model_type = hf_config.get("model_type", "")
    layout = EXPERT_LAYOUTS.get(model_type)
    if model_type in KEEPS_MTP_LAYERS:
        state = {_mtp_in_memory(name, hf_config["num_hidden_layers"]): t for name, t in state.items()}
        state = {name: t for name, t in state.items() if not MTP_COPIES.fullmatch(name)}
    if layout is None:
        return state
    if layout.block != "mlp":
        state = {name.replace(f".{layout.block}.", ".mlp."): t for name, t in state.items()}
    pattern = re.compile(rf"(.*)\.mlp\.experts\.(\d+)\.({layout.gate}|{layout.up}|{layout.down})\.weight({SCALES})?")
    per_expert: dict[tuple[str, str], dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, tensor in state.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = tensor
        else:
            prefix, j, proj, scales = match.groups()
            per_expert.setdefault((prefix, scales or ""), {}).setdefault(proj, {})[int(j)] = tensor
    for (prefix, scales), projections in per_expert.items():
        count = 1 + max(j for tensors in projections.values() for j in tensors)
        disk_prefix = _mtp_on_disk(prefix + ".", hf_config["num_hidden_layers"])[:-1] if model_type in KEEPS_MTP_LAYERS else prefix
        gate, up, down = (_stack(projections.get(p, {}), count, f"{disk_prefix}.{layout.block}.experts.{{j}}.{p}.weight{scales}")
                          for p in (layout.gate, layout.up, layout.down))
        out[f"{prefix}.mlp.experts.gate_up_proj{scales}"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.mlp.experts.down_proj{scales}"] = down
    return out


def is_mtp_layer(name: str, hf_config: dict) -> bool:
    """Whether on-disk `name` is a multi-token prediction layer's (`model.layers.{N + i}.*`, i < `num_nextn_predict_layers`)."""
    num_layers, num_mtp = hf_config.get("num_hidden_layers", 0), hf_config.get("num_nextn_predict_layers") or 0
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and num_layers <= int(match.group(1)) < num_layers + num_mtp


def _mtp_in_memory(name: str, num_layers: int) -> str:
    """`model.layers.{num_layers + i}.x` -> `model.mtp_layers.{i}.x`; other names unchanged."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match is None or int(match.group(1)) < num_layers:
        return name
    return f"model.mtp_layers.{int(match.group(1)) - num_layers}.{name[match.end():]}"


def _mtp_on_disk(name: str, num_layers: int) -> str:
    """`model.mtp_layers.{i}.x` -> `model.layers.{num_layers + i}.x`; other names unchanged."""
    match = re.match(r"model\.mtp_layers\.(\d+)\.", name)
    return name if match is None else f"model.layers.{num_layers + int(match.group(1))}.{name[match.end():]}"


def _stack(tensors: dict[int, torch.Tensor], count: int, name: str) -> torch.Tensor:
    """The tensors of experts 0..count-1 stacked; a missing expert is an error naming its tensor."""
    missing = [j for j in range(count) if j not in tensors]
    if missing:
        raise KeyError(f"the checkpoint lacks {name.format(j=missing[0])}")
    return torch.stack([tensors[j] for j in range(count)])


def to_disk(state: dict[str, torch.Tensor], hf_config: dict) -> dict[str, torch.Tensor]:
    """In-memory names -> on-disk names: stacked experts (and FP8 experts' scales) split into one tensor per expert
    (copies, as safetensors stores no shared memory), the block renamed as the family names it, the kept
    multi-token prediction layers named as the checkpoints name them."""
    model_type = hf_config.get("model_type", "")
    layout = EXPERT_LAYOUTS.get(model_type)
    if model_type in KEEPS_MTP_LAYERS:
        state = {_mtp_on_disk(name, hf_config["num_hidden_layers"]): t for name, t in state.items()}
    if layout is None:
        return state
    out = {}
    for name, tensor in state.items():
        disk_name = name if is_mtp_layer(name, hf_config) else name.replace(".mlp.", f".{layout.block}.")
        stacked = re.fullmatch(rf"(.*)\.experts\.(gate_up_proj|down_proj)({SCALES})?", disk_name)
        if stacked is None:
            out[disk_name] = tensor
            continue
        prefix, proj, scales = stacked.group(1), stacked.group(2), stacked.group(3) or ""
        disk_projections = (layout.gate, layout.up) if proj == "gate_up_proj" else (layout.down,)
        for disk_proj, part in zip(disk_projections, tensor.chunk(len(disk_projections), dim=1)):
            for j in range(tensor.shape[0]):
                out[f"{prefix}.experts.{j}.{disk_proj}.weight{scales}"] = part[j].clone()
    return out
