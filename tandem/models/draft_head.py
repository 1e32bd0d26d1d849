"""Giving a decoder-family model a draft head (`tandem model add-draft-head`, `tandem model init --draft-head`).

A draft head is a multi-token prediction layer (`tandem.models.decoder.DraftHead`) stored as DeepSeek-V3 stores its
MTP layer: config.json `num_nextn_predict_layers` = 1, weights `model.layers.{num_hidden_layers}.*`
(`tandem.models.expert_layout`). The engine drafts with it (`engine.speculative.method = "mtp"`) and the trainer
trains it with the policy (`mtp.train`), so its drafts follow the policy as RL moves it.

The module imports torch only where it makes weights: the vLLM wrapper, which loads no torch, reads
`has_draft_head` here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HEAD_FAMILIES = ("qwen3", "qwen3_moe", "minimax_m2")
"""The families a draft head is added to: those built of `decoder.DecoderLayer`s. GLM-5's, DeepSeek-V3's and GLM-4.5's
checkpoints carry an MTP layer of their own (GLM-4.5's a routed block, loaded as a `decoder.DraftHead` around it)."""

HEAD_SEED = 0
"""Seed of the head's new matrices (those not copied from the trunk)."""


def has_draft_head(hf_config: dict) -> bool:
    """Whether the config is a decoder family's with a draft head (`num_nextn_predict_layers` set)."""
    return hf_config.get("model_type") in HEAD_FAMILIES and bool(hf_config.get("num_nextn_predict_layers"))


def with_draft_head(hf_config: dict, source: str) -> dict:
    """`hf_config` (read from `source`) with one draft head; refused for a family that takes none, a model that
    already has one, or quantized weights."""
    model_type = hf_config.get("model_type")
    if model_type not in HEAD_FAMILIES:
        raise ValueError(f"{source}: model_type {model_type!r} takes no draft head (the families that do: "
                         f"{', '.join(HEAD_FAMILIES)}; GLM-5, DeepSeek-V3 and GLM-4.5 checkpoints carry an MTP layer of their own)")
    if hf_config.get("num_nextn_predict_layers"):
        raise ValueError(f"{source} already has {hf_config['num_nextn_predict_layers']} multi-token prediction "
                         "layer(s) (`num_nextn_predict_layers`)")
    if hf_config.get("quantization_config"):  # the head starts from the last block's weights, not their FP8 blocks
        raise ValueError(f"{source} holds quantized weights (`quantization_config`): add the head to the unquantized "
                         "checkpoint")
    return dict(hf_config, num_nextn_predict_layers=1)


def initial_head(trunk: dict[str, torch.Tensor], shapes: dict[str, torch.Size], num_layers: int) -> dict[str, torch.Tensor]:
    """The head's first weights (`shapes`: its parameters' in-memory names and shapes) from the trunk's state:

    - its block is a copy of the trunk's last block (attention and norms, and the feed-forward where that is dense;
      after a routed block, a SwiGLU whose down projection is zero, which adds nothing until it trains);
    - `eh_proj` = [0 | I], so the block's input is hnorm(h_t): the head starts from the features the LM head
      already reads, not from noise, and learns token t+1's part (the embedding half, zero at first);
    - `shared_head.norm` is the trunk's final norm; `enorm` and `hnorm` are ones."""
    import torch

    from tandem.models.random_init import initial_value

    dtype = trunk["model.norm.weight"].dtype
    last = f"model.layers.{num_layers - 1}."
    head = {}
    for name, shape in shapes.items():
        part = name.split(".", 3)[3]  # after model.mtp_layers.{i}.
        copied = trunk.get(last + part)
        if part == "eh_proj.weight":
            hidden = shape[0]
            value = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1)
        elif part == "shared_head.norm.weight":
            value = trunk["model.norm.weight"]
        elif copied is not None and copied.shape == shape:
            value = copied
        elif part == "mlp.down_proj.weight":
            value = torch.zeros(shape)
        else:
            value = initial_value(name, shape, HEAD_SEED, "cpu")
        head[name] = value.to(dtype).clone()
    return head


def add_draft_head(src: str, dst: Path) -> Path:
    """Write `dst`: the model folder `src` (or hub name) plus a draft head (`initial_head`) and the config key."""
    from tandem.models.hub import read_hf_config, resolve_model_path
    from tandem.models.loading import build_native
    from tandem.models.weights import load_state_dict, save_state_dict, side_files

    folder = resolve_model_path(src)
    hf_config = with_draft_head(read_hf_config(folder), str(folder / "config.json"))
    shapes = {name: p.shape for name, p in build_native(hf_config).named_parameters() if ".mtp_layers." in name}
    state = load_state_dict(folder)
    state.update(initial_head(state, shapes, hf_config["num_hidden_layers"]))
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for file in side_files(folder):
        shutil.copyfile(file, dst / file.name)
    save_state_dict(state, dst, hf_config)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return dst
